//! Audits: a share of completed jobs is re-scored on another node, and each
//! node keeps a record that decides how often it is audited and whether it
//! is placed at all.
//!
//! After a job completes (its claim verified), [`audit_rate`] of the serving
//! node's record decides whether it is audited: BOINC-style, high for a new
//! node (`rate_new`), halving every `halve_every` clean audits down to
//! `rate_floor`, and every job once a node has failed one. An audited job is
//! sent as an audit assignment to another online node holding the same
//! model file, which answers with a signed verdict (node side:
//! `mlx-node`'s `Engine::audit`).
//!
//! Every completed job's pay is held until its audit window
//! (`window_ms` after completion) closes; the ledger's settlement reads the
//! `audits` table: a failed audit voids the hold (the client gets it all
//! back, the operator nothing), otherwise the job is paid once the window
//! closed. A failed audit also counts against the node; at `ban_after`
//! failures it is banned from placement for good.
//!
//! # Invariants
//! - An audit is recorded once per job and ends once (`pending` to
//!   `passed`, `failed` or `missed`, a guarded update), and the node's record
//!   changes in the same transaction, so a verdict counts once.
//! - A verdict counts only when signed by the node it was sent to, about
//!   this job and this claim's signature; the auditor is never the node
//!   that served the job.
//!
//! # Failure
//! [`AuditError`] for the database; an auditor that fails, vanishes or lies
//! about its identity leaves the audit pending, and it is `missed` when the
//! window closes (the job is then paid: nothing showed it wrong).

mod driver;

use std::{collections::HashSet, sync::Mutex};

pub use crate::domain::AuditRecord as NodeRecord;
use crate::util::lock;
use mlxnet_proto::{ids::NodeId, v1::SignedVerdict};
use prost::Message;
use serde::Deserialize;
use sqlx::{Row, SqlitePool};

/// Audit settings (`[audit]` in the coordinator config).
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct AuditConfig {
    /// Share of a new node's jobs that are audited.
    pub rate_new: f64,
    /// The share an established clean node decays to.
    pub rate_floor: f64,
    /// Clean audits that halve the rate.
    pub halve_every: u32,
    /// Pay is held this long after a job completes; an audit must end by then.
    pub window_ms: i64,
    /// Failed audits after which a node is never placed again.
    pub ban_after: u32,
}

impl Default for AuditConfig {
    fn default() -> Self {
        // Cost at the floor: an audit cost 59% of the job it audits
        // (`cargo bench -p mlx-node --bench audit`, 16-token jobs), so 3%
        // of jobs cost under 2% of served compute; a new node pays 50% x 60% = 30% until
        // 5 x log2(0.5 / 0.03) ~ 20 clean audits bring it to the floor.
        Self {
            rate_new: 0.5,
            rate_floor: 0.03,
            halve_every: 5,
            window_ms: 10 * 60 * 1000,
            ban_after: 2,
        }
    }
}

impl AuditConfig {
    /// No audits and no pay delay (tests and the devnet, unless they ask).
    pub fn off() -> Self {
        Self {
            rate_new: 0.0,
            rate_floor: 0.0,
            window_ms: 0,
            ..Self::default()
        }
    }
}

/// The share of `record`'s node's jobs to audit.
pub fn audit_rate(config: &AuditConfig, record: &NodeRecord) -> f64 {
    if record.failed > 0 {
        return 1.0;
    }
    let halvings = f64::from(record.clean) / f64::from(config.halve_every.max(1));
    (config.rate_new * 0.5f64.powf(halvings))
        .max(config.rate_floor)
        .clamp(0.0, 1.0)
}

/// Why an audit operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AuditError {
    #[error("database error")]
    Database(#[from] sqlx::Error),
}

/// How an audit ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Ended {
    /// The verdict counted; the audited node's record is now this.
    Counted(NodeRecord),
    /// The audit had already ended (a duplicate or late verdict).
    AlreadyEnded,
}

/// Audit records in the coordinator's database, and the banned nodes.
pub struct Audits {
    pool: SqlitePool,
    pub config: AuditConfig,
    banned: Mutex<HashSet<NodeId>>,
}

impl Audits {
    /// Loads the banned nodes from the database.
    pub async fn load(pool: SqlitePool, config: AuditConfig) -> Result<Self, AuditError> {
        let ids: Vec<String> =
            sqlx::query_scalar("SELECT node_id FROM node_records WHERE banned_at_ms IS NOT NULL")
                .fetch_all(&pool)
                .await?;
        let banned = ids.iter().filter_map(|id| id.parse().ok()).collect();
        Ok(Self {
            pool,
            config,
            banned: Mutex::new(banned),
        })
    }

    /// The audits in `store`'s database (tools and tests that open it).
    pub async fn of_store(
        store: &crate::store::Store,
        config: AuditConfig,
    ) -> Result<Self, AuditError> {
        Self::load(store.pool().clone(), config).await
    }

    /// Whether `node` may no longer be placed.
    pub fn is_banned(&self, node: &NodeId) -> bool {
        lock(&self.banned).contains(node)
    }

    /// `node`'s record (zero for a node never audited).
    pub async fn record(&self, node: &str) -> Result<NodeRecord, AuditError> {
        let row = sqlx::query(
            "SELECT clean_audits, failed_audits, banned_at_ms FROM node_records WHERE node_id = ?",
        )
        .bind(node)
        .fetch_optional(&self.pool)
        .await?;
        Ok(match row {
            None => NodeRecord::default(),
            Some(r) => NodeRecord {
                clean: r.try_get::<i64, _>("clean_audits")?.max(0) as u32,
                failed: r.try_get::<i64, _>("failed_audits")?.max(0) as u32,
                banned: r.try_get::<Option<i64>, _>("banned_at_ms")?.is_some(),
            },
        })
    }

    /// Records that `job`, served by `node`, will be audited. False if it
    /// already was.
    pub async fn begin(&self, job: &str, node: &str, now_ms: i64) -> Result<bool, AuditError> {
        let done = sqlx::query(
            "INSERT OR IGNORE INTO audits (job_id, node_id, state, created_at_ms) \
             VALUES (?, ?, 'pending', ?)",
        )
        .bind(job)
        .bind(node)
        .bind(now_ms)
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected() == 1)
    }

    /// Ends `job`'s pending audit with `verdict` by `auditor`, and counts it
    /// in the audited node's record (banning it at `ban_after` failures).
    pub async fn finish(
        &self,
        job: &str,
        auditor: &str,
        verdict: &SignedVerdict,
        passed: bool,
        now_ms: i64,
    ) -> Result<Ended, AuditError> {
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
        let node: Option<String> = sqlx::query_scalar(
            "UPDATE audits SET state = ?, auditor = ?, verdict = ?, ended_at_ms = ? \
             WHERE job_id = ? AND state = 'pending' RETURNING node_id",
        )
        .bind(if passed { "passed" } else { "failed" })
        .bind(auditor)
        .bind(verdict.encode_to_vec())
        .bind(now_ms)
        .bind(job)
        .fetch_optional(&mut *tx)
        .await?;
        let Some(node) = node else {
            return Ok(Ended::AlreadyEnded);
        };
        let (clean, failed) = if passed { (1, 0) } else { (0, 1) };
        sqlx::query(
            "INSERT INTO node_records (node_id, clean_audits, failed_audits) VALUES (?1, ?2, ?3) \
             ON CONFLICT (node_id) DO UPDATE SET clean_audits = clean_audits + ?2, \
             failed_audits = failed_audits + ?3",
        )
        .bind(&node)
        .bind(clean)
        .bind(failed)
        .execute(&mut *tx)
        .await?;
        sqlx::query(
            "UPDATE node_records SET banned_at_ms = ? \
             WHERE node_id = ? AND banned_at_ms IS NULL AND failed_audits >= ?",
        )
        .bind(now_ms)
        .bind(&node)
        .bind(i64::from(self.config.ban_after.max(1)))
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        let record = self.record(&node).await?;
        if record.banned {
            if let Ok(id) = node.parse() {
                lock(&self.banned).insert(id);
            }
        }
        Ok(Ended::Counted(record))
    }

    /// Ends `job`'s pending audit without a verdict (no auditor in time).
    pub async fn miss(&self, job: &str, now_ms: i64) -> Result<(), AuditError> {
        sqlx::query(
            "UPDATE audits SET state = 'missed', ended_at_ms = ? WHERE job_id = ? AND state = 'pending'",
        )
        .bind(now_ms)
        .bind(job)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// How `job`'s audit stands (`None`: not audited).
    pub async fn state(&self, job: &str) -> Result<Option<String>, AuditError> {
        Ok(
            sqlx::query_scalar("SELECT state FROM audits WHERE job_id = ?")
                .bind(job)
                .fetch_optional(&self.pool)
                .await?,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rate_starts_high_decays_with_clean_audits_to_the_floor_and_jumps_on_a_failure() {
        let c = AuditConfig::default();
        let rate = |clean, failed| {
            audit_rate(
                &c,
                &NodeRecord {
                    clean,
                    failed,
                    banned: false,
                },
            )
        };
        assert_eq!(rate(0, 0), 0.5);
        assert!((rate(5, 0) - 0.25).abs() < 1e-12);
        assert!(rate(10, 0) < rate(5, 0));
        assert_eq!(rate(1000, 0), c.rate_floor);
        assert_eq!(
            rate(1000, 1),
            1.0,
            "a node that failed once is always audited"
        );
        assert_eq!(audit_rate(&AuditConfig::off(), &NodeRecord::default()), 0.0);
    }

    #[tokio::test]
    async fn a_verdict_counts_once_and_failures_past_the_threshold_ban() {
        let dir = tempfile::tempdir().unwrap();
        let store = crate::store::Store::connect(&format!(
            "sqlite://{}",
            dir.path().join("a.db").display()
        ))
        .await
        .unwrap();
        let audits = Audits::load(store.pool().clone(), AuditConfig::default())
            .await
            .unwrap();
        let node =
            NodeId::from_key(&ed25519_dalek::SigningKey::from_bytes(&[3; 32]).verifying_key());
        let hex = node.to_string();
        let verdict = SignedVerdict::default();
        for (i, job) in ["j1", "j2"].iter().enumerate() {
            // Jobs rows are referenced; insert bare ones.
            sqlx::query(
                "INSERT INTO jobs (id, model, input, sampling, state, attempt, created_at_ms, updated_at_ms) \
                 VALUES (?, 'm', x'', x'', 'completed', 1, 0, 0)",
            )
            .bind(job)
            .execute(store.pool())
            .await
            .unwrap();
            assert!(audits.begin(job, &hex, 0).await.unwrap());
            assert!(!audits.begin(job, &hex, 0).await.unwrap());
            let ended = audits.finish(job, "a", &verdict, false, 1).await.unwrap();
            assert_eq!(
                ended,
                Ended::Counted(NodeRecord {
                    clean: 0,
                    failed: i as u32 + 1,
                    banned: i == 1,
                })
            );
            assert_eq!(
                audits.finish(job, "a", &verdict, true, 2).await.unwrap(),
                Ended::AlreadyEnded
            );
        }
        assert!(audits.is_banned(&node));
        let reloaded = Audits::load(store.pool().clone(), AuditConfig::default())
            .await
            .unwrap();
        assert!(reloaded.is_banned(&node), "the ban survives a restart");
        store.close().await;
    }
}
