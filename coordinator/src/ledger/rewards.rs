//! Availability rewards for dedicated nodes: a node lent full-time earns,
//! per hour online and responsive, a reward proportional to the memory it
//! offers, paid from the reward pool once per epoch. Idle-time nodes earn
//! per job only.
//!
//! A dedicated node's online time is counted from its heartbeats (an
//! interval counts only when the heartbeat came within the timeout, so a
//! silent node earns nothing for its silence). When an epoch is over, each
//! node is owed `GiB offered x hours online x reward_per_gib_hour`; if the
//! total is above the epoch cap or what the pool holds, every reward is
//! scaled down by the same factor.
//!
//! # Invariants
//! - An epoch is paid once: its `reward_epochs` row and its transfers
//!   (`reward:<epoch>:<node>`, pool -> operator) commit together.
//! - The pool never goes below zero (it is a no-overdraft account) and no
//!   epoch pays more than its cap.
//!
//! # Failure
//! [`LedgerError`]; an epoch that fails to pay stays unpaid and is retried.

pub use crate::domain::Availability;
use crate::domain::Lease;

use super::{
    settle::operator_of, transfer, Ledger, LedgerError, NewTransfer, TransferKind, REWARD_POOL,
};
use crate::store::{Store, StoreTx};

const GIB: u128 = 1 << 30;
const HOUR_MS: u128 = 3_600_000;

/// Each node's reward for an epoch: memory x time x rate, scaled down
/// together so the sum stays within `budget`. Nodes owed nothing are left out.
pub fn split(rows: &[Availability], reward_per_gib_hour: u64, budget: i64) -> Vec<(String, i64)> {
    let owed: Vec<u128> = rows
        .iter()
        .map(|a| {
            u128::from(a.memory_bytes) * u128::from(a.online_ms) * u128::from(reward_per_gib_hour)
                / (GIB * HOUR_MS)
        })
        .collect();
    let total: u128 = owed.iter().sum();
    let budget = u128::try_from(budget.max(0)).unwrap_or(0);
    rows.iter()
        .zip(owed)
        .map(|(a, o)| {
            let amount = if total > budget {
                o * budget / total
            } else {
                o
            };
            (a.node_id.clone(), i64::try_from(amount).unwrap_or(i64::MAX))
        })
        .filter(|(_, amount)| *amount > 0)
        .collect()
}

impl Ledger {
    fn epoch_of(&self, ms: i64) -> i64 {
        ms.div_euclid(self.config().reward_epoch_ms.max(1))
    }

    /// When the reward epoch `now_ms` is in ends (ms since the Unix epoch):
    /// it is paid at the first reward sweep after that.
    pub fn reward_epoch_end_ms(&self, now_ms: i64) -> i64 {
        (self.epoch_of(now_ms) + 1).saturating_mul(self.config().reward_epoch_ms.max(1))
    }

    /// Records that dedicated node `node_id`, offering `memory_bytes`, was
    /// online and responsive for the `online_ms` that ended at `now_ms`.
    pub async fn record_online(
        &self,
        node_id: &str,
        memory_bytes: u64,
        online_ms: u64,
        now_ms: i64,
    ) -> Result<(), LedgerError> {
        Ok(self
            .store()
            .record_online(self.epoch_of(now_ms), node_id, memory_bytes, online_ms)
            .await?)
    }

    /// Pays every ended, unpaid epoch (before the one `now_ms` is in).
    /// Returns how many epochs were paid.
    pub async fn pay_rewards(&self, now_ms: i64) -> Result<usize, LedgerError> {
        self.pay_rewards_under(now_ms, None).await
    }

    /// [`Ledger::pay_rewards`] by a duty holding `lease`: each epoch's
    /// transaction is fenced, so a replica that lost the lease pays nothing
    /// (`StoreError::Fenced`).
    pub async fn pay_rewards_under(
        &self,
        now_ms: i64,
        lease: Option<&Lease>,
    ) -> Result<usize, LedgerError> {
        let epochs = self.store().unpaid_epochs(self.epoch_of(now_ms)).await?;
        for &epoch in &epochs {
            let mut tx = self.store().write().await?;
            if let Some(lease) = lease {
                tx.fence(lease, now_ms).await?;
            }
            if tx.epoch_paid(epoch).await? {
                continue;
            }
            let rows = tx.availability(epoch).await?;
            let pool = tx.account(REWARD_POOL).await?.map_or(0, |a| a.available());
            let budget = pool.min(self.config().reward_pool_per_epoch);
            let mut total = 0i64;
            for (node, amount) in split(&rows, self.config().reward_per_gib_hour, budget) {
                let operator = operator_of(&mut tx, &node).await?;
                transfer::apply(
                    &mut tx,
                    &NewTransfer {
                        id: format!("reward:{epoch}:{node}"),
                        kind: Some(TransferKind::Posted),
                        debit: REWARD_POOL.into(),
                        credit: operator,
                        amount,
                        node_id: Some(node),
                        memo: "reward".into(),
                        ..Default::default()
                    },
                    now_ms,
                )
                .await?;
                total += amount;
            }
            tx.mark_epoch_paid(epoch, now_ms, total).await?;
            tx.commit().await?;
        }
        Ok(epochs.len())
    }
}
