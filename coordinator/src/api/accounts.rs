//! Accounts: until the ledger issue lands there is one demo account with no
//! balance, and the response says so in its account name.

use mlxnet_proto::v1::{accounts_server::Accounts, BalanceRequest, BalanceResponse};
use tonic::{Request, Response, Status};

/// Name of the only account until the ledger exists.
pub const DEMO_ACCOUNT: &str = "demo (no ledger yet)";

pub struct AccountsApi;

#[tonic::async_trait]
impl Accounts for AccountsApi {
    async fn balance(
        &self,
        _req: Request<BalanceRequest>,
    ) -> Result<Response<BalanceResponse>, Status> {
        Ok(Response::new(BalanceResponse {
            account: DEMO_ACCOUNT.into(),
            balance_micro_mlx: 0,
            held_micro_mlx: 0,
        }))
    }
}
