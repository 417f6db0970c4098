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

use sqlx::Row;

pub use crate::domain::Availability;

use super::{
    settle::operator_of, transfer, Ledger, LedgerError, NewTransfer, TransferKind, REWARD_POOL,
};

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

    /// Records that dedicated node `node_id`, offering `memory_bytes`, was
    /// online and responsive for the `online_ms` that ended at `now_ms`.
    pub async fn record_online(
        &self,
        node_id: &str,
        memory_bytes: u64,
        online_ms: u64,
        now_ms: i64,
    ) -> Result<(), LedgerError> {
        sqlx::query(
            "INSERT INTO availability (epoch, node_id, memory_bytes, online_ms) VALUES (?1, ?2, ?3, ?4) \
             ON CONFLICT (epoch, node_id) DO UPDATE SET online_ms = online_ms + ?4, \
             memory_bytes = MAX(memory_bytes, ?3)",
        )
        .bind(self.epoch_of(now_ms))
        .bind(node_id)
        .bind(i64::try_from(memory_bytes).unwrap_or(i64::MAX))
        .bind(i64::try_from(online_ms).unwrap_or(i64::MAX))
        .execute(self.pool())
        .await?;
        Ok(())
    }

    /// Pays every ended, unpaid epoch (before the one `now_ms` is in).
    /// Returns how many epochs were paid.
    pub async fn pay_rewards(&self, now_ms: i64) -> Result<usize, LedgerError> {
        let current = self.epoch_of(now_ms);
        let epochs: Vec<i64> = sqlx::query_scalar(
            "SELECT DISTINCT a.epoch FROM availability a LEFT JOIN reward_epochs r ON r.epoch = a.epoch \
             WHERE a.epoch < ? AND r.epoch IS NULL ORDER BY a.epoch",
        )
        .bind(current)
        .fetch_all(self.pool())
        .await?;
        for &epoch in &epochs {
            let mut tx = self.write_tx().await?;
            let paid: Option<i64> =
                sqlx::query_scalar("SELECT epoch FROM reward_epochs WHERE epoch = ?")
                    .bind(epoch)
                    .fetch_optional(&mut *tx)
                    .await?;
            if paid.is_some() {
                continue;
            }
            let rows = sqlx::query(
                "SELECT node_id, memory_bytes, online_ms FROM availability WHERE epoch = ? ORDER BY node_id",
            )
            .bind(epoch)
            .fetch_all(&mut *tx)
            .await?;
            let rows = rows
                .iter()
                .map(|r| {
                    let memory: i64 = r.try_get("memory_bytes")?;
                    let online: i64 = r.try_get("online_ms")?;
                    Ok(Availability {
                        node_id: r.try_get("node_id")?,
                        memory_bytes: memory.max(0) as u64,
                        online_ms: online.max(0) as u64,
                    })
                })
                .collect::<Result<Vec<_>, LedgerError>>()?;
            let pool = transfer::account(&mut tx, REWARD_POOL)
                .await?
                .map_or(0, |a| a.available());
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
            sqlx::query("INSERT INTO reward_epochs (epoch, paid_ms, total) VALUES (?, ?, ?)")
                .bind(epoch)
                .bind(now_ms)
                .bind(total)
                .execute(&mut *tx)
                .await?;
            tx.commit().await?;
        }
        Ok(epochs.len())
    }
}
