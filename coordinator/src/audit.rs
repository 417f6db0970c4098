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
//! Audits cannot be captured by one node: each auditor is drawn at random
//! ([`draw`], with a seed the coordinator draws per audit) among the
//! connected established nodes able to run the job, weighted by
//! reputation, never the audited node nor another
//! node of its operator, never a node that never placed itself (it
//! reports no memory for the job). A failing verdict counts only once a
//! second, distinct auditor confirms it; when the two disagree a third
//! decides, and the auditor in the minority is counted against
//! ([`decide`]). So one lying auditor can neither void an honest node's
//! pay nor ban it: it bans itself.
//!
//! # Reputation and probation
//! Each node's record ([`NodeRecord`]) is built from verified work only:
//! jobs completed under a claim the coordinator verified, audits passed
//! and failed (as the audited node), verdicts on the losing side of a
//! decision (as an auditor), failed attempts. A node is *established*
//! ([`AuditConfig::established`]) once it completed `probation_jobs`
//! jobs and passed `probation_audits` audits (audits are decided only by
//! established auditors, so that is verified by a node that had itself
//! earned it), with no failed audit and no wrong verdict, and is not
//! banned; the operator's `trusted` node ids are established from the
//! start (the bootstrap of a young network: someone has to audit the
//! first strangers). With audits off (`rate_new` and `rate_floor` 0),
//! jobs alone end probation. Every other node is *on probation*:
//! - it is audited at the new-node rate ([`audit_rate`] starts there and
//!   decays only with clean audits);
//! - it is never drawn as an auditor: auditors are drawn among
//!   established nodes only, weighted by reputation ([`draw`],
//!   [`AuditConfig::reputation`]);
//! - it earns no availability reward (`link::control_loop`; an
//!   established dedicated node earns only for the models it has shown it
//!   serves, [`Audits::shown`]);
//! - it is placed only while it runs fewer than `probation_running` jobs,
//!   unless no established node can take the job now
//!   (`Dispatcher::place_queued`): a network of new nodes still runs.
//!
//! A failed audit or a wrong verdict puts an established node back on
//! probation (and, at `ban_after` of them together, bans it). With no
//! established auditor online, an audit waits until its window closes
//! and is then `missed` (the job is paid: nothing confirmed it wrong).
//!
//! Every completed job's pay is held until its audit window
//! (`window_ms` after completion) closes; the ledger's settlement reads the
//! `audits` table: a failed audit voids the hold (the client gets it all
//! back, the operator nothing), otherwise the job is paid once the window
//! closed. A failed audit also counts against the node; at `ban_after`
//! failures it is banned from placement for good (an auditor in the
//! minority likewise).
//!
//! # Invariants
//! - An audit is recorded once per job and ends once (`pending` to
//!   `passed`, `failed` or `missed`, a guarded update), and the records of
//!   the audited node and of the minority auditors change in the same
//!   transaction, so a decision counts once.
//! - A verdict counts only when signed by the node it was sent to, about
//!   this job and this claim's signature; the auditors of one audit are
//!   distinct, and never the node that served the job or its operator's.
//! - An audit fails only on two failing verdicts.
//!
//! # Failure
//! [`AuditError`] for the database; an auditor that fails, vanishes or lies
//! about its identity leaves the audit pending (another is drawn), and it
//! is `missed` when the window closes undecided (the job is then paid:
//! nothing confirmed it wrong; nobody is counted against).

use std::{
    collections::{HashMap, HashSet},
    sync::{Arc, Mutex},
};

pub use crate::domain::AuditRecord as NodeRecord;
use crate::domain::RecordDelta;
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
    /// Failed audits (as the audited node) and wrong verdicts (as an
    /// auditor), together, after which a node is never placed again.
    pub ban_after: u32,
    /// Jobs completed under a verified claim that end probation.
    pub probation_jobs: u32,
    /// Clean audits (decided by established auditors) that end probation
    /// (with audits off, none are needed).
    pub probation_audits: u32,
    /// Jobs a node on probation may run at once while an established node
    /// could take the job instead.
    pub probation_running: u32,
    /// Clean audits past which an auditor's draw weight stops growing.
    pub reputation_cap: u32,
    /// Node ids (lowercase hex) established from the start: the
    /// operator's own nodes that audit a young network's first strangers.
    pub trusted: Vec<String>,
}

impl Default for AuditConfig {
    fn default() -> Self {
        // Cost at the floor: an audit cost 59% of the job it audits
        // (`cargo bench -p mlxnet-tests --bench audit`, 16-token jobs), so 3%
        // of jobs cost under 2% of served compute; a new node pays 50% x 60% = 30% until
        // 5 x log2(0.5 / 0.03) ~ 20 clean audits bring it to the floor.
        Self {
            rate_new: 0.5,
            rate_floor: 0.03,
            halve_every: 5,
            window_ms: 10 * 60 * 1000,
            ban_after: 2,
            probation_jobs: 3,
            probation_audits: 1,
            probation_running: 1,
            reputation_cap: 20,
            trusted: Vec::new(),
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

impl AuditConfig {
    /// Whether audits run at all.
    pub fn audits_on(&self) -> bool {
        self.rate_new > 0.0 || self.rate_floor > 0.0
    }

    /// Whether `node` (hex) with `record` is established, i.e. off
    /// probation (see the module header).
    pub fn established(&self, node: &str, record: &NodeRecord) -> bool {
        if record.banned {
            return false;
        }
        if self.trusted.iter().any(|t| t.eq_ignore_ascii_case(node)) {
            return true;
        }
        let audits_needed = if self.audits_on() {
            self.probation_audits
        } else {
            0
        };
        record.failed == 0
            && record.wrong_verdicts == 0
            && record.jobs >= self.probation_jobs
            && record.clean >= audits_needed
    }

    /// `node`'s weight in the auditors' draw: 0 (never drawn) on
    /// probation, else 1 + its clean audits up to `reputation_cap`.
    pub fn reputation(&self, node: &str, record: &NodeRecord) -> u32 {
        if !self.established(node, record) {
            return 0;
        }
        1 + record.clean.min(self.reputation_cap)
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
    /// The verdicts so far do not settle it ([`decide`]): ask another
    /// auditor.
    Undecided,
    /// The verdicts settled it (`passed` or not) and it counted: the
    /// audited node's record is now `record`, and each auditor in the
    /// minority (hex id) was counted against, its record now the one given.
    Counted {
        passed: bool,
        record: NodeRecord,
        against: Vec<(String, NodeRecord)>,
    },
    /// The audit had already ended (a duplicate or late verdict).
    AlreadyEnded,
}

/// One auditor's verdict on an audit, as it counts (signed by the node it
/// was sent to, about this job and this claim).
#[derive(Clone, Debug)]
pub struct Verdict {
    /// The auditor, lowercase hex.
    pub auditor: String,
    pub signed: SignedVerdict,
    pub passed: bool,
}

/// Where an audit stands after its verdicts so far.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decision {
    /// Ask another, distinct auditor.
    Undecided,
    /// Settled: whether the claim passed, and the indices of the verdicts
    /// that disagreed with that (their auditors are counted against).
    Decided { passed: bool, against: Vec<usize> },
}

/// Decides an audit from its verdicts in the order they came, each from a
/// distinct auditor (`true`: passed).
///
/// A first verdict that passes settles it (a cheater cannot choose its
/// auditor, and the audit rate catches it on a later job). A failing
/// verdict alone never does: it needs a second auditor's failing verdict;
/// when the second disagrees, a third decides. In general, after a first
/// failure, the first side to two verdicts wins. Every verdict on the
/// other side is the minority, counted against its auditor.
pub fn decide(verdicts: &[bool]) -> Decision {
    let Some(&first) = verdicts.first() else {
        return Decision::Undecided;
    };
    let passes = verdicts.iter().filter(|&&p| p).count();
    let fails = verdicts.len() - passes;
    let passed = if first {
        true
    } else if fails >= 2 {
        false
    } else if passes >= 2 {
        true
    } else {
        return Decision::Undecided;
    };
    let against = (0..verdicts.len())
        .filter(|&i| verdicts[i] != passed)
        .collect();
    Decision::Decided { passed, against }
}

/// A connected node the dispatcher might ask to audit a claim.
#[derive(Clone, Debug)]
pub struct Candidate {
    pub node: NodeId,
    /// The operator account it earns for.
    pub operator: String,
    /// It can take this audit now: it holds the model, reports the memory
    /// the job needs (a node that never placed itself does not), has a
    /// free slot, and is not banned, draining or a pod member.
    pub able: bool,
    /// Its draw weight ([`AuditConfig::reputation`]; 0: on probation,
    /// never drawn).
    pub reputation: u32,
}

/// Draws the next auditor of a claim by `audited` (whose operator is
/// `audited_operator`, empty if unknown) with `rng`: among the able
/// `candidates` with a reputation (never one on probation) that are
/// neither the audited node nor another node of its operator, nor one that
/// already gave a verdict (`asked`), each with a chance proportional to its
/// reputation.
///
/// The candidates are taken in node-id order, so the draw depends only on
/// the set and the rng, never on the order the nodes connected in or on
/// anything a node chose.
pub fn draw(
    candidates: &[Candidate],
    audited: &NodeId,
    audited_operator: &str,
    asked: &[NodeId],
    rng: &mut impl rand::Rng,
) -> Option<NodeId> {
    let mut pool: Vec<(String, NodeId, u64)> = candidates
        .iter()
        .filter(|c| {
            let same_operator = !audited_operator.is_empty() && c.operator == audited_operator;
            c.able
                && c.reputation > 0
                && c.node != *audited
                && !same_operator
                && !asked.contains(&c.node)
        })
        .map(|c| (c.node.to_string(), c.node, u64::from(c.reputation)))
        .collect();
    pool.sort_unstable_by(|a, b| a.0.cmp(&b.0));
    pool.dedup_by(|a, b| a.0 == b.0);
    let total: u64 = pool.iter().map(|c| c.2).sum();
    if total == 0 {
        return None;
    }
    let mut at = rng.gen_range(0..total);
    for (_, node, weight) in pool {
        if at < weight {
            return Some(node);
        }
        at -= weight;
    }
    None
}

/// Audit records in the coordinator's store, the banned nodes, and every
/// node's record as this coordinator last wrote or loaded it (placement
/// and the auditors' draw read it without I/O).
pub struct Audits {
    store: AnyStore,
    pub config: AuditConfig,
    banned: Mutex<HashSet<NodeId>>,
    records: Mutex<HashMap<String, NodeRecord>>,
    /// The model files (SHA-256) each node has shown it serves: a claim of
    /// its own verified (a completion or a drained hand-off). In
    /// memory, per process (a restart forgets it: a node shows it again
    /// with its next job), bounded by [`SHOWN_MAX`] nodes.
    shown: Mutex<HashMap<NodeId, HashSet<[u8; 32]>>>,
    /// The audits of each node this process has asked an auditor about
    /// and not yet ended ([`Audits::in_progress`]): placement holds a node
    /// back while they stand against it ([`Audits::held`]).
    standing: Mutex<HashMap<NodeId, Standing>>,
}

/// A node's audits in progress in this process.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Standing {
    /// Audits an auditor was asked about, not yet ended.
    pub in_progress: u32,
    /// Of those, the ones with a failing verdict awaiting confirmation.
    pub accused: u32,
}

/// Whether a node with `record` and audits `standing` is held out of
/// placement: an audit of it has a failing verdict awaiting confirmation,
/// or it has as many audits in progress as would ban it, with its failed
/// audits and wrong verdicts so far, if they all failed. Without this, a
/// node that fabricates fast kept getting jobs while its audits ran and
/// failed up to 6 before its ban (at 2) took effect. An honest node is
/// held only while `ban_after` audits of it run at once, and never where
/// no auditor is online (an audit counts once an auditor is asked).
pub fn held(config: &AuditConfig, record: &NodeRecord, standing: Standing) -> bool {
    let strikes = record.failed.saturating_add(record.wrong_verdicts);
    standing.accused > 0
        || (standing.in_progress > 0
            && strikes.saturating_add(standing.in_progress) >= config.ban_after.max(1))
}

/// One audit in progress of a node, counted in [`Audits::held`] until
/// dropped (when the audit ends, is missed, or the coordinator stops).
pub struct InProgress {
    audits: Arc<Audits>,
    node: NodeId,
    accused: bool,
}

impl InProgress {
    /// The audit has a failing verdict that awaits confirmation: the node
    /// is held until the audit ends.
    pub fn accuse(&mut self) {
        if !self.accused {
            self.accused = true;
            lock(&self.audits.standing)
                .entry(self.node)
                .or_default()
                .accused += 1;
        }
    }
}

impl Drop for InProgress {
    fn drop(&mut self) {
        let mut standing = lock(&self.audits.standing);
        if let Some(s) = standing.get_mut(&self.node) {
            s.in_progress = s.in_progress.saturating_sub(1);
            if self.accused {
                s.accused = s.accused.saturating_sub(1);
            }
            if s.in_progress == 0 {
                standing.remove(&self.node);
            }
        }
    }
}

/// The most nodes [`Audits`] remembers shown models for (past it, all are
/// forgotten and shown again).
const SHOWN_MAX: usize = 100_000;

impl Audits {
    /// Loads the banned nodes from the store.
    pub async fn load(store: AnyStore, config: AuditConfig) -> Result<Self, AuditError> {
        let ids = store.banned_nodes().await?;
        let banned = ids.iter().filter_map(|id| id.parse().ok()).collect();
        let records = store.node_records().await?.into_iter().collect();
        Ok(Self {
            store,
            config,
            banned: Mutex::new(banned),
            records: Mutex::new(records),
            shown: Mutex::new(HashMap::new()),
            standing: Mutex::new(HashMap::new()),
        })
    }

    /// `node` has shown it serves the model file `model`: a claim of its
    /// own verified. (An auditor's verdict shows nothing: one that passes
    /// every claim agrees with every honest decision without running it.)
    pub fn showed(&self, node: NodeId, model: [u8; 32]) {
        let mut shown = lock(&self.shown);
        if shown.len() >= SHOWN_MAX && !shown.contains_key(&node) {
            shown.clear();
        }
        shown.entry(node).or_default().insert(model);
    }

    /// The model files `node` has shown it serves (see [`Audits::showed`]).
    pub fn shown(&self, node: &NodeId) -> Vec<[u8; 32]> {
        lock(&self.shown)
            .get(node)
            .map(|m| m.iter().copied().collect())
            .unwrap_or_default()
    }

    /// The audits in `store`'s database (tools and tests that open it).
    pub async fn of_store(store: &AnyStore, config: AuditConfig) -> Result<Self, AuditError> {
        Self::load(store.clone(), config).await
    }

    /// Whether `node` may no longer be placed.
    pub fn is_banned(&self, node: &NodeId) -> bool {
        lock(&self.banned).contains(node)
    }

    /// Counts an audit of `node` as in progress (an auditor was asked)
    /// until the returned guard is dropped.
    pub fn in_progress(self: &Arc<Self>, node: NodeId) -> InProgress {
        lock(&self.standing).entry(node).or_default().in_progress += 1;
        InProgress {
            audits: Arc::clone(self),
            node,
            accused: false,
        }
    }

    /// Whether placement holds `node` back for the audits of it in
    /// progress here ([`held`]).
    pub fn held(&self, node: &NodeId) -> bool {
        let Some(standing) = lock(&self.standing).get(node).copied() else {
            return false;
        };
        let record = lock(&self.records)
            .get(&node.to_string())
            .copied()
            .unwrap_or_default();
        held(&self.config, &record, standing)
    }

    /// Whether `node` is on probation (see the module header), by its
    /// record as last known here.
    pub fn on_probation(&self, node: &NodeId) -> bool {
        let hex = node.to_string();
        let record = lock(&self.records).get(&hex).copied().unwrap_or_default();
        !self.config.established(&hex, &record)
    }

    /// `node`'s weight in the auditors' draw ([`AuditConfig::reputation`]).
    pub fn reputation(&self, node: &NodeId) -> u32 {
        let hex = node.to_string();
        let record = lock(&self.records).get(&hex).copied().unwrap_or_default();
        self.config.reputation(&hex, &record)
    }

    /// Adds `delta` (jobs done, failed attempts) to `node`'s record.
    pub async fn count_work(&self, node: &str, delta: &RecordDelta) -> Result<(), AuditError> {
        self.store.count_record(node, delta).await?;
        let record = self.store.audit_record(node).await?;
        lock(&self.records).insert(node.to_owned(), record);
        Ok(())
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

    /// Ends `job`'s pending audit if its `verdicts` so far settle it
    /// ([`decide`]): records the deciding verdict, counts the outcome in
    /// the audited node's record and a failure in each minority auditor's,
    /// banning any of them at `ban_after` failures, all in one
    /// transaction.
    pub async fn conclude(
        &self,
        job: &str,
        verdicts: &[Verdict],
        now_ms: i64,
    ) -> Result<Ended, AuditError> {
        let passes: Vec<bool> = verdicts.iter().map(|v| v.passed).collect();
        let Decision::Decided { passed, against } = decide(&passes) else {
            return Ok(Ended::Undecided);
        };
        let Some(deciding) = verdicts.iter().rev().find(|v| v.passed == passed) else {
            return Ok(Ended::Undecided);
        };
        let mut tx = self.store.write().await?;
        let ended = tx
            .end_audit(
                job,
                passed,
                &deciding.auditor,
                &deciding.signed.encode_to_vec(),
                now_ms,
            )
            .await?;
        let Some(node) = ended else {
            return Ok(Ended::AlreadyEnded);
        };
        let outcome = if passed {
            RecordDelta {
                clean: 1,
                ..RecordDelta::default()
            }
        } else {
            RecordDelta {
                failed: 1,
                ..RecordDelta::default()
            }
        };
        let record = self.count(&mut tx, &node, &outcome, now_ms).await?;
        let wrong = RecordDelta {
            wrong_verdicts: 1,
            ..RecordDelta::default()
        };
        let mut counted_against = Vec::with_capacity(against.len());
        for i in against {
            let auditor = &verdicts[i].auditor;
            let r = self.count(&mut tx, auditor, &wrong, now_ms).await?;
            counted_against.push((auditor.clone(), r));
        }
        tx.commit().await?;
        {
            let mut records = lock(&self.records);
            records.insert(node.clone(), record);
            for (a, r) in &counted_against {
                records.insert(a.clone(), *r);
            }
        }
        let newly_banned = std::iter::once((&node, &record))
            .chain(counted_against.iter().map(|(a, r)| (a, r)))
            .filter(|(_, r)| r.banned)
            .filter_map(|(id, _)| id.parse::<NodeId>().ok());
        lock(&self.banned).extend(newly_banned);
        Ok(Ended::Counted {
            passed,
            record,
            against: counted_against,
        })
    }

    /// Adds `delta` (an audit's outcome, a wrong verdict) to `node`'s
    /// record, banning it at `ban_after` failed audits and wrong verdicts
    /// together; returns the record.
    async fn count(
        &self,
        tx: &mut crate::store::AnyTx,
        node: &str,
        delta: &RecordDelta,
        now_ms: i64,
    ) -> Result<NodeRecord, AuditError> {
        tx.count_record(node, delta).await?;
        let mut record = tx.audit_record(node).await?;
        let strikes = record.failed.saturating_add(record.wrong_verdicts);
        if !record.banned && strikes >= self.config.ban_after.max(1) {
            tx.ban_node(node, now_ms).await?;
            record.banned = true;
        }
        Ok(record)
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
                    ..NodeRecord::default()
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

    #[test]
    fn a_node_is_held_while_a_failure_awaits_confirmation_or_its_audits_could_ban_it() {
        let c = AuditConfig::default();
        assert_eq!(c.ban_after, 2);
        let standing = |in_progress, accused| Standing {
            in_progress,
            accused,
        };
        let failed = |failed| NodeRecord {
            failed,
            ..NodeRecord::default()
        };
        let clean = NodeRecord::default();
        assert!(!held(&c, &clean, standing(0, 0)));
        assert!(!held(&c, &clean, standing(1, 0)), "one clean audit running");
        assert!(
            held(&c, &clean, standing(1, 1)),
            "a failure awaits confirmation"
        );
        assert!(held(&c, &clean, standing(2, 0)), "two running could ban it");
        assert!(
            held(&c, &failed(1), standing(1, 0)),
            "one more failure bans it"
        );
        assert!(!held(&c, &failed(1), standing(0, 0)), "nothing running");
        let wrong = NodeRecord {
            wrong_verdicts: 1,
            ..NodeRecord::default()
        };
        assert!(held(&c, &wrong, standing(1, 0)));
    }

    #[test]
    fn a_pass_settles_a_failure_needs_a_second_and_a_split_goes_to_a_third() {
        use Decision::{Decided, Undecided};
        let decided = |passed, against: &[usize]| Decided {
            passed,
            against: against.to_vec(),
        };
        let (p, f) = (true, false);
        assert_eq!(decide(&[]), Undecided);
        assert_eq!(decide(&[p]), decided(true, &[]));
        assert_eq!(decide(&[f]), Undecided, "a failure alone never counts");
        assert_eq!(decide(&[f, f]), decided(false, &[]));
        assert_eq!(decide(&[f, p]), Undecided, "a split asks a third");
        assert_eq!(decide(&[f, p, p]), decided(true, &[0]));
        assert_eq!(decide(&[f, p, f]), decided(false, &[1]));
        // Not produced by the dispatcher (a pass settles at once), but total:
        assert_eq!(decide(&[p, f]), decided(true, &[1]));
    }

    fn node(seed: u8) -> NodeId {
        NodeId::from_key(&ed25519_dalek::SigningKey::from_bytes(&[seed; 32]).verifying_key())
    }

    fn candidate(seed: u8, operator: &str, able: bool) -> Candidate {
        Candidate {
            node: node(seed),
            operator: operator.into(),
            able,
            reputation: 1,
        }
    }

    #[test]
    fn an_auditor_is_drawn_at_random_among_able_strangers_who_have_not_answered() {
        use rand::{rngs::StdRng, SeedableRng};
        let audited = node(1);
        let mut all = vec![
            candidate(1, "op_a", true),  // the audited node
            candidate(2, "op_a", true),  // its operator's other node
            candidate(3, "op_b", false), // cannot take it (e.g. no memory)
            candidate(4, "op_c", true),  // already answered
            candidate(5, "op_d", true),
            candidate(6, "op_e", true),
            candidate(7, "op_e", true),
        ];
        let asked = [node(4)];
        let mut seen = HashSet::new();
        for seed in 0..200 {
            let pick = draw(
                &all,
                &audited,
                "op_a",
                &asked,
                &mut StdRng::seed_from_u64(seed),
            )
            .unwrap();
            seen.insert(pick);
            // The same seed and set give the same auditor, whatever the
            // order the nodes connected in.
            all.reverse();
            let again = draw(
                &all,
                &audited,
                "op_a",
                &asked,
                &mut StdRng::seed_from_u64(seed),
            );
            assert_eq!(again, Some(pick));
        }
        assert_eq!(
            seen,
            HashSet::from([node(5), node(6), node(7)]),
            "every eligible auditor is drawn, and only they"
        );
        let nobody = [candidate(1, "op_a", true), candidate(2, "op_a", true)];
        let mut rng = StdRng::seed_from_u64(0);
        assert_eq!(draw(&nobody, &audited, "op_a", &[], &mut rng), None);
        // An unknown operator excludes only the audited node itself.
        assert_eq!(draw(&nobody, &audited, "", &[], &mut rng), Some(node(2)));
    }

    #[test]
    fn probation_ends_with_verified_work_and_trusted_nodes_start_established() {
        let c = AuditConfig {
            trusted: vec!["AB".into()],
            ..AuditConfig::default()
        };
        let rec = |jobs, clean, failed, wrong_verdicts| NodeRecord {
            jobs,
            clean,
            failed,
            wrong_verdicts,
            ..NodeRecord::default()
        };
        assert!(!c.established("n", &NodeRecord::default()), "new keys");
        assert!(!c.established("n", &rec(2, 1, 0, 0)), "too few jobs");
        assert!(!c.established("n", &rec(3, 0, 0, 0)), "no audit passed");
        assert!(c.established("n", &rec(3, 1, 0, 0)));
        assert!(!c.established("n", &rec(9, 9, 1, 0)), "a failed audit");
        assert!(!c.established("n", &rec(9, 9, 0, 1)), "a wrong verdict");
        assert!(c.established("ab", &NodeRecord::default()), "trusted");
        let banned = NodeRecord {
            banned: true,
            ..NodeRecord::default()
        };
        assert!(!c.established("ab", &banned), "a ban outranks trust");
        // With audits off, jobs alone end probation.
        let off = AuditConfig::off();
        assert!(off.established("n", &rec(3, 0, 0, 0)));
        assert!(!off.established("n", &rec(2, 0, 0, 0)));
        // Reputation: 0 on probation, then 1 + clean audits up to the cap.
        assert_eq!(c.reputation("n", &rec(3, 0, 0, 0)), 0);
        assert_eq!(c.reputation("n", &rec(3, 1, 0, 0)), 2);
        assert_eq!(c.reputation("n", &rec(3, 500, 0, 0)), 1 + c.reputation_cap);
        assert_eq!(c.reputation("ab", &NodeRecord::default()), 1);
    }

    #[test]
    fn the_draw_skips_nodes_on_probation_and_follows_reputation() {
        use rand::{rngs::StdRng, SeedableRng};
        let audited = node(1);
        let with = |seed, reputation| Candidate {
            reputation,
            ..candidate(seed, &format!("op_{seed}"), true)
        };
        let all = [with(2, 0), with(3, 1), with(4, 9)];
        let mut counts = HashMap::new();
        for seed in 0..2_000 {
            let mut rng = StdRng::seed_from_u64(seed);
            let pick = draw(&all, &audited, "", &[], &mut rng).unwrap();
            *counts.entry(pick).or_insert(0u32) += 1;
        }
        assert_eq!(counts.get(&node(2)), None, "on probation: never drawn");
        let (low, high) = (counts[&node(3)], counts[&node(4)]);
        // Expected 200 and 1800 (weights 1 and 9); far from an even split.
        assert!((100..=300).contains(&low), "{low} of 2000 at weight 1");
        assert_eq!(low + high, 2_000);
        let mut rng = StdRng::seed_from_u64(0);
        assert_eq!(draw(&[with(2, 0)], &audited, "", &[], &mut rng), None);
    }

    fn verdict(auditor: &str, passed: bool) -> Verdict {
        Verdict {
            auditor: auditor.into(),
            signed: SignedVerdict::default(),
            passed,
        }
    }

    #[tokio::test]
    async fn a_confirmed_verdict_counts_once_and_failures_past_the_threshold_ban() {
        let dir = tempfile::tempdir().unwrap();
        let store = AnyStore::connect(&format!("sqlite://{}", dir.path().join("a.db").display()))
            .await
            .unwrap();
        let audits = Audits::load(store.clone(), AuditConfig::default())
            .await
            .unwrap();
        let liar = node(9);
        let node = node(3);
        let hex = node.to_string();
        // Audits reference jobs; store bare ones.
        let mut jobs = Vec::new();
        for _ in 0..3 {
            let job = crate::domain::NewJob {
                id: mlxnet_proto::ids::JobId::new(),
                model: "m".into(),
                input: Default::default(),
                sampling: Default::default(),
                priority: 0,
            };
            jobs.push(store.insert_job(&job).await.unwrap().id.to_string());
        }
        // Job 0: the liar fails it, two others pass it: it passes, and the
        // liar is counted against.
        assert!(audits.begin(&jobs[0], &hex, 0).await.unwrap());
        let split = [
            verdict(&liar.to_string(), false),
            verdict("b", true),
            verdict("c", true),
        ];
        for n in 1..3 {
            assert_eq!(
                audits.conclude(&jobs[0], &split[..n], 1).await.unwrap(),
                Ended::Undecided
            );
            assert_eq!(
                audits.state(&jobs[0]).await.unwrap().as_deref(),
                Some("pending")
            );
        }
        assert_eq!(
            audits.conclude(&jobs[0], &split, 1).await.unwrap(),
            Ended::Counted {
                passed: true,
                record: NodeRecord {
                    clean: 1,
                    ..NodeRecord::default()
                },
                against: vec![(
                    liar.to_string(),
                    NodeRecord {
                        wrong_verdicts: 1,
                        ..NodeRecord::default()
                    }
                )],
            }
        );
        // Jobs 1 and 2: two auditors fail each; the node is banned at the
        // second (`ban_after` 2).
        for (i, job) in jobs[1..].iter().enumerate() {
            assert!(audits.begin(job, &hex, 0).await.unwrap());
            assert!(!audits.begin(job, &hex, 0).await.unwrap());
            let confirmed = [verdict("a", false), verdict("b", false)];
            let ended = audits.conclude(job, &confirmed, 1).await.unwrap();
            assert_eq!(
                ended,
                Ended::Counted {
                    passed: false,
                    record: NodeRecord {
                        clean: 1,
                        failed: i as u32 + 1,
                        banned: i == 1,
                        ..NodeRecord::default()
                    },
                    against: vec![],
                }
            );
            assert_eq!(
                audits
                    .conclude(job, &[verdict("c", true)], 2)
                    .await
                    .unwrap(),
                Ended::AlreadyEnded
            );
        }
        assert!(audits.is_banned(&node));
        assert!(!audits.is_banned(&liar));
        let reloaded = Audits::load(store.clone(), AuditConfig::default())
            .await
            .unwrap();
        assert!(reloaded.is_banned(&node), "the ban survives a restart");
        store.close().await;
    }
}
