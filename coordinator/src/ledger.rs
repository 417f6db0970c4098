//! The ledger: accounts in integer micro-MLX, double-entry two-phase
//! transfers (the TigerBeetle model), API keys, and the job settlement built
//! on them. Users see "MLX tokens"; in code "token" means a model token and
//! the currency is `mlx` / `micro_mlx` (1 MLX = 1,000,000 micro-MLX).
//!
//! Accounts: clients and node operators (users; either may submit jobs and
//! earn), and the network's own: the treasury (issues grants; the only
//! account allowed below zero), job escrow, the network fee, and the reward
//! pool. Money moves only through [`transfer`]; jobs pay through [`settle`];
//! callers authenticate through [`keys`].
//!
//! # Invariants
//! - Amounts are `i64` micro-MLX, never floats, never negative.
//! - The sum over all accounts of `credits - debits` (posted and pending
//!   separately) is zero at every commit: each transfer debits one account and
//!   credits another by the same amount.
//! - Transfer rows are immutable (schema triggers); a transfer's id is its
//!   idempotency key; a hold is resolved at most once (schema index).
//! - An account with `no_overdraft` never has debits (posted + pending)
//!   above its posted credits (checked here, and by a schema CHECK).
//! - Every operation runs in one store transaction (`Store::write`), so a
//!   crash at any point leaves either all of it or none of it.
//! - The rules are here, written once; the store (any backend) holds only
//!   their SQL.
//!
//! # Failure
//! [`LedgerError`]: a refused operation (insufficient balance, unknown
//! account, a reused id) changes nothing; database errors are kept as the
//! source and never shown to clients.

pub mod keys;
pub mod rewards;
pub mod settle;
mod submit;
pub mod transfer;

#[cfg(test)]
mod tests;

use serde::Deserialize;

pub use crate::domain::{
    Account, AccountKind, Applied, JobTerms, NewTransfer, NodeEarnings, Price, Totals, Transfer,
    TransferKind,
};
pub use settle::Share;

use crate::{
    store::{Anomaly, AnyStore, Store, StoreError, StoreTx},
    util::{error_chain, now_ms},
};

/// Issues every MLX token that enters the ledger; may go below zero.
pub const TREASURY: &str = "system:treasury";
/// Holds job payments between submit and settlement.
pub const ESCROW: &str = "system:escrow";
/// Collects the network's fee on every paid job.
pub const FEE: &str = "system:fee";
/// Funds availability rewards.
pub const REWARD_POOL: &str = "system:reward_pool";

/// Ledger settings (`[ledger]` in the coordinator config).
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct LedgerConfig {
    /// Network fee on each job's price, in basis points (500 = 5%).
    pub fee_bps: u32,
    /// How long a job's hold lives; a job still unfinished then is cancelled
    /// and its hold expires.
    pub hold_ttl_ms: i64,
    /// How often the expiry sweep runs.
    pub sweep_interval_ms: u64,
    /// Test knob for the crash-consistency test: the process stops dead
    /// (prints `settlement paused at step N` and waits forever, holding its
    /// transaction open) at the N-th settlement step since start. Never set
    /// in production.
    pub test_pause_at_step: Option<u32>,
    /// Length of an availability reward epoch.
    pub reward_epoch_ms: i64,
    /// Pay for a completed job waits this long after completion (the audit
    /// window, set from `[audit] window_ms` by the coordinator); a failed
    /// audit voids it instead.
    #[serde(skip)]
    pub audit_window_ms: i64,
    /// Micro-MLX a dedicated node earns per GiB offered per hour online.
    pub reward_per_gib_hour: u64,
    /// Most the reward pool pays out per epoch, in micro-MLX.
    pub reward_pool_per_epoch: i64,
}

impl Default for LedgerConfig {
    fn default() -> Self {
        Self {
            fee_bps: 500,
            hold_ttl_ms: 24 * 60 * 60 * 1000,
            sweep_interval_ms: 5_000,
            test_pause_at_step: None,
            audit_window_ms: 0,
            reward_epoch_ms: 60 * 60 * 1000,
            reward_per_gib_hour: 1_000,
            reward_pool_per_epoch: 100_000_000,
        }
    }
}

/// Why a ledger operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LedgerError {
    #[error("store")]
    Store(#[from] StoreError),
    #[error("account {0} does not exist")]
    NoSuchAccount(String),
    #[error("insufficient balance in {account}: {needed} micro-MLX needed, {available} available")]
    InsufficientFunds {
        account: String,
        needed: i64,
        available: i64,
    },
    #[error("transfer {id} already exists with different fields")]
    ExistsWithDifferentFields { id: String },
    #[error("pending transfer {0} does not exist")]
    NoSuchPending(String),
    #[error("pending transfer {0} was already resolved")]
    AlreadyResolved(String),
    #[error("pending transfer {id} expired at {deadline_ms}")]
    PendingExpired { id: String, deadline_ms: i64 },
    #[error("cannot post {amount}: the pending transfer holds {pending}")]
    ExceedsPending { amount: i64, pending: i64 },
    #[error("{0}")]
    Invalid(&'static str),
    #[error("stored ledger data does not decode: {0}")]
    Corrupt(String),
    #[error("the group commit this submit was in failed: {0}")]
    BatchAborted(String),
    #[error("the key making this key was revoked or expired")]
    ParentKeyGone,
}

impl From<crate::domain::InvalidScopes> for LedgerError {
    fn from(e: crate::domain::InvalidScopes) -> Self {
        LedgerError::Invalid(e.0)
    }
}

/// The ledger over the coordinator's store.
#[derive(Clone, Debug)]
pub struct Ledger {
    store: AnyStore,
    config: LedgerConfig,
    /// Submits waiting for the next group commit (see [`Ledger::submit_job`]).
    submits: std::sync::Arc<std::sync::Mutex<Vec<submit::QueuedSubmit>>>,
    /// Held by the submit that writes the queue, until its batch committed.
    batch_writer: std::sync::Arc<tokio::sync::Mutex<()>>,
    /// Recently authenticated keys (see [`keys`]).
    keys: std::sync::Arc<keys::KeyCache>,
}

impl Ledger {
    /// The ledger in `store`'s database (migrated when the store opened).
    pub fn new(store: AnyStore, config: LedgerConfig) -> Self {
        Self {
            store,
            config,
            submits: std::sync::Arc::default(),
            batch_writer: std::sync::Arc::default(),
            keys: std::sync::Arc::default(),
        }
    }

    pub(crate) fn key_cache(&self) -> &keys::KeyCache {
        &self.keys
    }

    pub fn config(&self) -> &LedgerConfig {
        &self.config
    }

    /// The store the ledger keeps its books in.
    pub fn store(&self) -> &AnyStore {
        &self.store
    }

    /// Creates a client or operator account with a zero balance.
    pub async fn create_account(
        &self,
        name: &str,
        kind: AccountKind,
    ) -> Result<Account, LedgerError> {
        if !matches!(kind, AccountKind::Client | AccountKind::Operator) {
            return Err(LedgerError::Invalid(
                "only client and operator accounts can be created",
            ));
        }
        let name = name.trim();
        if name.is_empty() || name.len() > 64 {
            return Err(LedgerError::Invalid("an account name is 1 to 64 bytes"));
        }
        let account = Account::new(
            format!("acct_{}", hex::encode(rand::random::<[u8; 8]>())),
            name.to_owned(),
            kind,
            now_ms(),
        );
        self.store.insert_account(&account).await?;
        Ok(account)
    }

    pub async fn account(&self, id: &str) -> Result<Option<Account>, LedgerError> {
        Ok(self.store.account(id).await?)
    }

    /// Applies one transfer in its own transaction.
    pub async fn transfer(&self, t: &NewTransfer, now_ms: i64) -> Result<Applied, LedgerError> {
        let mut tx = self.store.write().await?;
        let applied = transfer::apply(&mut tx, t, now_ms).await?;
        tx.commit().await?;
        Ok(applied)
    }

    /// Issues `amount` from the treasury to `account` (admin only at the API).
    /// `id` is the idempotency key.
    pub async fn grant(
        &self,
        id: &str,
        account: &str,
        amount: i64,
        memo: &str,
    ) -> Result<Applied, LedgerError> {
        // Escrow and the fee account move only through settlement.
        match self.account(account).await? {
            Some(a)
                if matches!(
                    a.kind,
                    AccountKind::Client | AccountKind::Operator | AccountKind::RewardPool
                ) => {}
            _ => return Err(LedgerError::NoSuchAccount(account.to_owned())),
        }
        self.transfer(
            &NewTransfer {
                id: format!("grant:{id}"),
                kind: Some(TransferKind::Posted),
                debit: TREASURY.into(),
                credit: account.into(),
                amount,
                memo: memo.into(),
                ..Default::default()
            },
            now_ms(),
        )
        .await
    }

    /// One transfer by id.
    pub async fn get_transfer(&self, id: &str) -> Result<Option<Transfer>, LedgerError> {
        Ok(self.store.transfer(id).await?)
    }

    /// Jobs submitted by `account`, newest first.
    pub async fn jobs_of(&self, account: &str, limit: u32) -> Result<Vec<String>, LedgerError> {
        Ok(self.store.jobs_of(account, limit).await?)
    }

    /// The account's transfers, newest first.
    pub async fn history(&self, account: &str, limit: u32) -> Result<Vec<Transfer>, LedgerError> {
        Ok(self.store.history(account, limit).await?)
    }

    /// Payouts to `account` since `since_ms`, per node.
    pub async fn earnings(
        &self,
        account: &str,
        since_ms: i64,
    ) -> Result<Vec<NodeEarnings>, LedgerError> {
        Ok(self.store.earnings(account, since_ms).await?)
    }

    /// Nodes linked to `account`.
    pub async fn nodes_of(&self, account: &str) -> Result<Vec<String>, LedgerError> {
        Ok(self.store.nodes_of(account).await?)
    }

    /// Links `node_id` to the operator account it earns for. An empty
    /// `account` keeps the node's current link, or gives a new node an
    /// account of its own (`node <id prefix>`), so no payout is ever lost.
    pub async fn link_node(&self, node_id: &str, account: &str) -> Result<String, LedgerError> {
        let mut tx = self.store.write().await?;
        let linked = if account.is_empty() {
            settle::operator_of(&mut tx, node_id).await?
        } else {
            let Some(a) = tx.account(account).await? else {
                return Err(LedgerError::NoSuchAccount(account.to_owned()));
            };
            if !matches!(a.kind, AccountKind::Client | AccountKind::Operator) {
                return Err(LedgerError::NoSuchAccount(account.to_owned()));
            }
            tx.link_operator(node_id, account, now_ms()).await?;
            account.to_owned()
        };
        tx.commit().await?;
        Ok(linked)
    }

    /// Sums over all accounts, and the open holds.
    pub async fn totals(&self) -> Result<Totals, LedgerError> {
        Ok(self.store.totals().await?)
    }

    /// Every broken ledger invariant, described (empty when the books are
    /// sound): stored balances that differ from the transfer rows; sums over
    /// accounts that are not zero; a hold resolved twice; an open hold past
    /// its deadline (at `now_ms`); an ended job whose hold is still open; a
    /// paid job whose payouts and fee do not add up to what was posted; a
    /// failed or cancelled job that paid anyone.
    pub async fn violations(&self, now_ms: i64) -> Result<Vec<String>, LedgerError> {
        let mut out: Vec<String> = self
            .audit()
            .await?
            .into_iter()
            .map(|a| format!("account {a}: stored balances differ from its transfers"))
            .collect();
        let t = self.totals().await?;
        if t.posted != 0 || t.pending != 0 {
            out.push(format!("sums over accounts are {t:?}, not zero"));
        }
        let anomalies = self
            .store
            .ledger_anomalies(now_ms, self.config.audit_window_ms)
            .await?;
        out.extend(anomalies.into_iter().map(|(what, id)| {
            let what = match what {
                Anomaly::ResolvedTwice => "resolved more than once",
                Anomaly::OpenPastDeadline => "open past its deadline",
                Anomaly::EndedWithHoldOpen => "ended with its hold still open",
                Anomaly::PaidMismatch => "paid, but payouts and fee differ from the post",
                Anomaly::FailedAuditPaid => "failed its audit, yet paid someone",
                Anomaly::EndedPaid => "failed or cancelled, yet paid someone",
            };
            format!("{id}: {what}")
        }));
        Ok(out)
    }

    /// Recomputes every account's balances from the transfer rows and
    /// returns the accounts whose stored balances differ (empty when sound).
    pub async fn audit(&self) -> Result<Vec<String>, LedgerError> {
        Ok(self.store.balance_mismatches().await?)
    }
}

/// Settles `job` now, logging (not returning) a failure: the sweep and the
/// next start-up settle whatever is left open.
pub async fn settle_logged(ledger: &Ledger, job: mlxnet_proto::ids::JobId) {
    match ledger.settle_job(job, now_ms()).await {
        Ok(outcome) => tracing::debug!(job_id = %job, ?outcome, "settled"),
        Err(e) => tracing::warn!(
            job_id = %job,
            error = %error_chain(&e),
            "settlement failed; the sweep retries it"
        ),
    }
}

/// Holds handled per sweep pass.
const SWEEP_BATCH: u32 = 512;

/// What one sweep pass did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Swept {
    /// Ended jobs whose settlement had not happened (a crash, an error).
    pub settled: usize,
    /// Unfinished jobs cancelled because their hold's deadline passed.
    pub cancelled: usize,
}

/// Settles every ended job with an open hold, and cancels then settles every
/// job whose hold is past its deadline. `cancel` cancels one job (the store's
/// guarded transition, plus whatever the caller must tell watchers and
/// nodes). Run at start-up (before anything is served) and periodically
/// (`dispatch::sweep`).
pub async fn sweep<F, Fut>(ledger: &Ledger, now_ms: i64, cancel: F) -> Result<Swept, LedgerError>
where
    F: Fn(mlxnet_proto::ids::JobId) -> Fut,
    Fut: std::future::Future<Output = Result<(), StoreError>>,
{
    sweep_under(ledger, now_ms, None, cancel).await
}

/// [`sweep`] by the replica holding `lease`: every settlement's
/// transaction is fenced by it, so once the lease is lost the sweep stops
/// with `StoreError::Fenced` and settles nothing more. (`cancel` is the
/// job's guarded transition, which a repeat leaves unchanged.)
pub async fn sweep_under<F, Fut>(
    ledger: &Ledger,
    now_ms: i64,
    lease: Option<&crate::domain::Lease>,
    cancel: F,
) -> Result<Swept, LedgerError>
where
    F: Fn(mlxnet_proto::ids::JobId) -> Fut,
    Fut: std::future::Future<Output = Result<(), StoreError>>,
{
    let mut out = Swept::default();
    for id in ledger.unsettled_jobs(now_ms, SWEEP_BATCH).await? {
        let Ok(job) = id.parse() else {
            return Err(LedgerError::Corrupt(format!("hold of job {id:?}")));
        };
        ledger.settle_job_under(job, now_ms, lease).await?;
        out.settled += 1;
    }
    for id in ledger.due_holds(now_ms, SWEEP_BATCH).await? {
        let Ok(job) = id.parse() else {
            return Err(LedgerError::Corrupt(format!("hold of job {id:?}")));
        };
        if ledger.settle_job_under(job, now_ms, lease).await? == settle::Settlement::Overdue {
            cancel(job).await?;
            out.cancelled += 1;
            ledger.settle_job_under(job, now_ms, lease).await?;
        }
    }
    Ok(out)
}
