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
//! `mlx-node`'s `Engine::audit`); the dispatcher runs that exchange
//! (`dispatch::audit`).
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

use std::{collections::HashSet, sync::Mutex};

pub use crate::domain::AuditRecord as NodeRecord;
use crate::util::lock;
use mlxnet_proto::{ids::NodeId, v1::SignedVerdict};
use prost::Message;
use serde::Deserialize;

use crate::store::{AnyStore, Store, StoreError, StoreTx};

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
    #[error("store")]
    Store(#[from] StoreError),
}

/// How an audit ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Ended {
    /// The verdict counted; the audited node's record is now this.
    Counted(NodeRecord),
    /// The audit had already ended (a duplicate or late verdict).
    AlreadyEnded,
}

/// Audit records in the coordinator's store, and the banned nodes.
pub struct Audits {
    store: AnyStore,
    pub config: AuditConfig,
    banned: Mutex<HashSet<NodeId>>,
}

impl Audits {
    /// Loads the banned nodes from the store.
    pub async fn load(store: AnyStore, config: AuditConfig) -> Result<Self, AuditError> {
        let ids = store.banned_nodes().await?;
        let banned = ids.iter().filter_map(|id| id.parse().ok()).collect();
        Ok(Self {
            store,
            config,
            banned: Mutex::new(banned),
        })
    }

    /// The audits in `store`'s database (tools and tests that open it).
    pub async fn of_store(store: &AnyStore, config: AuditConfig) -> Result<Self, AuditError> {
        Self::load(store.clone(), config).await
    }

    /// Whether `node` may no longer be placed.
    pub fn is_banned(&self, node: &NodeId) -> bool {
        lock(&self.banned).contains(node)
    }

    /// `node`'s record (zero for a node never audited).
    pub async fn record(&self, node: &str) -> Result<NodeRecord, AuditError> {
        Ok(self.store.audit_record(node).await?)
    }

    /// Records that `job`, served by `node`, will be audited. False if it
    /// already was.
    pub async fn begin(&self, job: &str, node: &str, now_ms: i64) -> Result<bool, AuditError> {
        Ok(self.store.begin_audit(job, node, now_ms).await?)
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
        let mut tx = self.store.write().await?;
        let ended = tx
            .end_audit(job, passed, auditor, &verdict.encode_to_vec(), now_ms)
            .await?;
        let Some(node) = ended else {
            return Ok(Ended::AlreadyEnded);
        };
        tx.count_audit(&node, passed).await?;
        let mut record = tx.audit_record(&node).await?;
        if !record.banned && record.failed >= self.config.ban_after.max(1) {
            tx.ban_node(&node, now_ms).await?;
            record.banned = true;
        }
        tx.commit().await?;
        if record.banned {
            if let Ok(id) = node.parse() {
                lock(&self.banned).insert(id);
            }
        }
        Ok(Ended::Counted(record))
    }

    /// Ends `job`'s pending audit without a verdict (no auditor in time).
    pub async fn miss(&self, job: &str, now_ms: i64) -> Result<(), AuditError> {
        Ok(self.store.miss_audit(job, now_ms).await?)
    }

    /// How `job`'s audit stands (`None`: not audited).
    pub async fn state(&self, job: &str) -> Result<Option<String>, AuditError> {
        Ok(self.store.audit_state(job).await?)
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
        let store = AnyStore::connect(&format!("sqlite://{}", dir.path().join("a.db").display()))
            .await
            .unwrap();
        let audits = Audits::load(store.clone(), AuditConfig::default())
            .await
            .unwrap();
        let node =
            NodeId::from_key(&ed25519_dalek::SigningKey::from_bytes(&[3; 32]).verifying_key());
        let hex = node.to_string();
        let verdict = SignedVerdict::default();
        // Audits reference jobs; store bare ones.
        let mut jobs = Vec::new();
        for _ in 0..2 {
            let job = crate::domain::NewJob {
                id: mlxnet_proto::ids::JobId::new(),
                model: "m".into(),
                input: Default::default(),
                sampling: Default::default(),
                priority: 0,
            };
            jobs.push(store.insert_job(&job).await.unwrap().id.to_string());
        }
        for (i, job) in jobs.iter().enumerate() {
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
        let reloaded = Audits::load(store.clone(), AuditConfig::default())
            .await
            .unwrap();
        assert!(reloaded.is_banned(&node), "the ban survives a restart");
        store.close().await;
    }
}
