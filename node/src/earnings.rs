//! `mlx-node earnings`: what the owner's operator account earned, read from
//! the coordinator's accounts service with the owner's API key.
//!
//! # Failure
//! [`EarningsError`]: the coordinator unreachable, or its status (a wrong,
//! revoked or expired key reads UNAUTHENTICATED) passed through with its
//! message.

use std::fmt::Write as _;

use mlxnet_proto::{
    bearer::{authed, Bearer},
    money::mlx,
    v1::{accounts_client::AccountsClient, EarningsPeriod, EarningsRequest, EarningsResponse},
};
use tonic::transport::Channel;

/// Why the earnings could not be read.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EarningsError {
    #[error("invalid coordinator address {0:?}")]
    Address(String),
    #[error("cannot reach the coordinator at {address}")]
    Connect {
        address: String,
        source: tonic::transport::Error,
    },
    #[error("the API key must be printable ASCII")]
    Key,
    #[error("{} ({:?})", .0.message(), .0.code())]
    Status(#[from] tonic::Status),
}

/// Asks the coordinator at `grpc` for the earnings of `api_key`'s account.
pub async fn fetch(grpc: &str, api_key: &str) -> Result<EarningsResponse, EarningsError> {
    let bearer = Bearer::for_key(Some(api_key)).map_err(|_| EarningsError::Key)?;
    let channel = Channel::from_shared(grpc.to_owned())
        .map_err(|_| EarningsError::Address(grpc.to_owned()))?
        .connect()
        .await
        .map_err(|source| EarningsError::Connect {
            address: grpc.to_owned(),
            source,
        })?;
    Ok(AccountsClient::new(authed(channel, bearer))
        .earnings(EarningsRequest {})
        .await?
        .into_inner())
}

fn row(out: &mut String, label: &str, p: Option<EarningsPeriod>) {
    let p = p.unwrap_or_default();
    let _ = writeln!(
        out,
        "  {label:<10} {:>16} MLX  {:>6} jobs  {:>9} tokens",
        mlx(p.micro_mlx),
        p.jobs,
        p.tokens
    );
}

/// The report as printed; `this_node` (hex id) is marked in the per-node list.
pub fn render(r: &EarningsResponse, this_node: &str) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "operator account {}", r.account_id);
    row(&mut out, "today", r.today);
    row(&mut out, "this week", r.week);
    row(&mut out, "all time", r.all_time);
    for n in &r.nodes {
        let mark = if n.node_id == this_node {
            " (this node)"
        } else {
            ""
        };
        let _ = writeln!(out, "node {}{mark}", n.node_id);
        row(&mut out, "today", n.today);
        row(&mut out, "this week", n.week);
        row(&mut out, "all time", n.all_time);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use mlxnet_proto::v1::NodeEarnings;

    #[test]
    fn the_report_shows_periods_and_marks_this_node() {
        let p = |m, j, t| {
            Some(EarningsPeriod {
                micro_mlx: m,
                jobs: j,
                tokens: t,
            })
        };
        let r = EarningsResponse {
            account_id: "acct_1".into(),
            today: p(1_500_000, 2, 300),
            week: p(2_000_001, 3, 400),
            all_time: p(2_000_001, 3, 400),
            nodes: vec![NodeEarnings {
                node_id: "ab".into(),
                today: p(1_500_000, 2, 300),
                week: None,
                all_time: p(2_000_001, 3, 400),
                ..Default::default()
            }],
            next_reward_epoch_ms: 0,
        };
        let text = render(&r, "ab");
        let words = text.split_whitespace().collect::<Vec<_>>().join(" ");
        assert!(
            words.starts_with("operator account acct_1 today 1.500000 MLX 2 jobs 300 tokens"),
            "{text}"
        );
        assert!(
            words.contains(
                "node ab (this node) today 1.500000 MLX 2 jobs 300 tokens \
                 this week 0.000000 MLX 0 jobs 0 tokens all time 2.000001 MLX"
            ),
            "{text}"
        );
    }
}
