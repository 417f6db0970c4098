//! The registry of live node sessions: one per node id, the newest winning.
//!
//! # Invariants
//! - At most one session per node id. A node that reconnects replaces its old
//!   session; the old connection is closed by the caller, and the old
//!   session's clean-up removes the entry only if it is still its own
//!   (compared by session serial), so it never evicts its replacement.
//! - A job slot and its memory are reserved synchronously when a job is
//!   placed ([`Session::reserve`]) and released when the returned guard drops,
//!   so placement never over-fills a node between heartbeats.

use std::{
    collections::HashMap,
    sync::{
        atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering},
        Arc, Mutex,
    },
};

use mlxnet_proto::ids::NodeId;

use super::handshake::{PodMembership, Registration};
use crate::{
    scheduler::{affinity, BatchCurve, Evidence, Fleet, Measured, Mode, NodeSpec, PodSpec, Policy},
    util::clip,
};

/// The longest node-sent reason (a drain's, a pod's degradation, a job's
/// failure) kept or logged, in characters: a node may send megabytes.
pub const MAX_REASON_CHARS: usize = 256;

/// One authenticated node connection.
#[derive(Debug)]
pub struct Session {
    /// Increases with every session the coordinator accepts.
    pub serial: u64,
    pub node_id: NodeId,
    pub name: String,
    /// The operator account it earns for (linked at the handshake).
    pub operator: String,
    pub connection: quinn::Connection,
    /// Digests of the catalogue-matching model files it reported.
    pub models: Vec<[u8; 32]>,
    pub max_concurrent_jobs: u32,
    /// Its batch's speed by concurrent streams.
    pub batch: BatchCurve,
    pub memory_bytes: u64,
    pub chip: String,
    pub mode: Mode,
    pub measured: Measured,
    free_memory_bytes: AtomicU64,
    running: AtomicU32,
    reserved_bytes: AtomicU64,
    draining: AtomicBool,
    /// Wakes whoever waits for this node's `Drain` ([`Session::drained_within`]).
    drained: tokio::sync::Notify,
    /// Set when the node is a pod member; such a node takes no job of its
    /// own (its pod's jobs go to the leader).
    pub pod: Option<PodMembership>,
    /// Leader only: why the pod cannot take jobs now (empty: whole).
    pod_degraded: Mutex<String>,
    /// Heartbeats received, and the last one's prefix-cache counters
    /// (prompt tokens, hit tokens): the node's word, used only to take
    /// prefix affinity away ([`affinity`]), never for money.
    prefix: Mutex<(u64, u64, u64)>,
}

impl Session {
    /// A session for a node that proved its key and earns for `operator`.
    /// A node announcing 0 concurrent jobs is taken to mean 1.
    pub fn new(
        serial: u64,
        connection: quinn::Connection,
        node: &Registration,
        operator: String,
    ) -> Self {
        Self {
            serial,
            node_id: node.node_id,
            name: node.name.clone(),
            operator,
            connection,
            models: node.models.clone(),
            max_concurrent_jobs: node.max_concurrent_jobs.max(1),
            batch: node.batch.clone(),
            memory_bytes: node.memory_bytes,
            chip: node.chip.clone(),
            mode: node.mode,
            measured: node.measured,
            free_memory_bytes: AtomicU64::new(node.free_memory_bytes),
            running: AtomicU32::new(0),
            reserved_bytes: AtomicU64::new(0),
            draining: AtomicBool::new(false),
            drained: tokio::sync::Notify::new(),
            pod: node.pod.clone(),
            pod_degraded: Mutex::new(String::new()),
            prefix: Mutex::new((0, 0, 0)),
        }
    }

    /// Records a heartbeat's prefix-cache counters; returns by how many
    /// hit tokens they grew since the last one (0 if they went back).
    pub fn report_prefix(&self, prompt_tokens: u64, hit_tokens: u64) -> u64 {
        let mut p = self.prefix.lock().unwrap_or_else(|p| p.into_inner());
        let grew = hit_tokens.saturating_sub(p.2);
        *p = (p.0.saturating_add(1), prompt_tokens, hit_tokens);
        grew
    }

    /// What the node's heartbeats said, for [`affinity::Affinity::report`].
    pub fn prefix_report(&self) -> affinity::Report {
        let p = *self.prefix.lock().unwrap_or_else(|p| p.into_inner());
        affinity::Report {
            session: self.serial,
            beats: p.0,
            prompt_tokens: p.1,
            hit_tokens: p.2,
        }
    }

    /// Records the pod health a leader reported in a heartbeat.
    /// The reason is clipped to [`MAX_REASON_CHARS`] before it is kept or
    /// logged.
    pub fn report_pod_degraded(&self, reason: &str) {
        let reason = clip(reason, MAX_REASON_CHARS);
        let mut d = self.pod_degraded.lock().unwrap_or_else(|p| p.into_inner());
        if *d != reason {
            if reason.is_empty() {
                tracing::info!(node = %self.node_id.short(), "pod whole again");
            } else {
                tracing::warn!(node = %self.node_id.short(), %reason, "pod degraded");
            }
            reason.clone_into(&mut d);
        }
    }

    /// Why this leader's pod cannot take jobs now, if it cannot.
    pub fn pod_degraded(&self) -> Option<String> {
        let d = self.pod_degraded.lock().unwrap_or_else(|p| p.into_inner());
        (!d.is_empty()).then(|| d.clone())
    }

    /// The node asked for no new jobs.
    pub fn drain(&self) {
        self.draining.store(true, Ordering::Relaxed);
        self.drained.notify_waiters();
    }

    /// Whether the node has asked for no new jobs, or does so within
    /// `limit`: a drained node's `Drain` (control stream) and its hand-off
    /// claims (job streams) travel on different streams, so either may
    /// arrive first.
    pub async fn drained_within(&self, limit: std::time::Duration) -> bool {
        let notified = self.drained.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        if self.is_draining() {
            return true;
        }
        let _ = tokio::time::timeout(limit, notified).await;
        self.is_draining()
    }

    /// Whether the node holds the model file `sha256` and takes new jobs:
    /// what "serving a model" means to clients (models list, the outlook).
    pub fn serves(&self, sha256: &[u8; 32]) -> bool {
        self.models.contains(sha256) && !self.is_draining()
    }

    /// Whether the node asked for no new jobs.
    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Relaxed)
    }

    /// Records what the node reported in a heartbeat.
    pub fn report_free_memory(&self, bytes: u64) {
        self.free_memory_bytes.store(bytes, Ordering::Relaxed);
    }

    pub fn running_jobs(&self) -> u32 {
        self.running.load(Ordering::Relaxed)
    }

    /// Takes a job slot and `bytes` of memory until the guard drops.
    pub fn reserve(self: &Arc<Self>, bytes: u64) -> Reservation {
        self.running.fetch_add(1, Ordering::Relaxed);
        self.reserved_bytes.fetch_add(bytes, Ordering::Relaxed);
        Reservation {
            session: Arc::clone(self),
            bytes,
        }
    }

    /// The node as the scheduler sees it now: free memory is what it last
    /// reported less what placed jobs reserve; its running jobs take their
    /// slots, and a draining node offers none.
    pub fn spec(&self) -> NodeSpec {
        let mut spec = NodeSpec::new(
            self.node_id,
            &self.chip,
            self.memory_bytes,
            self.mode,
            &self.measured,
        );
        spec.free_memory_bytes = self
            .free_memory_bytes
            .load(Ordering::Relaxed)
            .saturating_sub(self.reserved_bytes.load(Ordering::Relaxed));
        spec.max_concurrent_jobs = if self.draining.load(Ordering::Relaxed) || self.pod.is_some() {
            0
        } else {
            self.max_concurrent_jobs.saturating_sub(self.running_jobs())
        };
        spec.running_jobs = self.running_jobs();
        spec.batch = self.batch.clone();
        spec.cached = self.models.clone();
        spec
    }
}

/// A job slot held on a session.
#[derive(Debug)]
pub struct Reservation {
    session: Arc<Session>,
    bytes: u64,
}

impl Reservation {
    pub fn session(&self) -> &Arc<Session> {
        &self.session
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.session.running.fetch_sub(1, Ordering::Relaxed);
        self.session
            .reserved_bytes
            .fetch_sub(self.bytes, Ordering::Relaxed);
    }
}

/// All live sessions.
#[derive(Clone, Debug, Default)]
pub struct Sessions {
    inner: Arc<Mutex<HashMap<NodeId, Arc<Session>>>>,
    serials: Arc<AtomicU64>,
    /// Woken whenever a session is removed ([`Sessions::emptied`]).
    removed: Arc<tokio::sync::Notify>,
}

impl Sessions {
    fn with<R>(&self, f: impl FnOnce(&mut HashMap<NodeId, Arc<Session>>) -> R) -> R {
        let mut guard = match self.inner.lock() {
            Ok(g) => g,
            Err(poisoned) => poisoned.into_inner(),
        };
        f(&mut guard)
    }

    pub fn next_serial(&self) -> u64 {
        self.serials.fetch_add(1, Ordering::Relaxed) + 1
    }

    /// Registers `session`, returning the one it replaces.
    pub fn insert(&self, session: Arc<Session>) -> Option<Arc<Session>> {
        self.with(|map| map.insert(session.node_id, session))
    }

    /// Removes `node`'s session if it is still the one with `serial`.
    pub fn remove_if_current(&self, node: NodeId, serial: u64) -> bool {
        let removed = self.with(|map| {
            if map.get(&node).is_some_and(|s| s.serial == serial) {
                map.remove(&node);
                true
            } else {
                false
            }
        });
        if removed {
            self.removed.notify_waiters();
        }
        removed
    }

    /// Returns once no session is left (a draining replica waits for its
    /// nodes to move).
    pub async fn emptied(&self) {
        loop {
            let notified = self.removed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.is_empty() {
                return;
            }
            notified.await;
        }
    }

    pub fn get(&self, node: &NodeId) -> Option<Arc<Session>> {
        self.with(|map| map.get(node).cloned())
    }

    /// Every session, oldest first.
    pub fn all(&self) -> Vec<Arc<Session>> {
        let mut all: Vec<_> = self.with(|map| map.values().cloned().collect());
        all.sort_by_key(|s| s.serial);
        all
    }

    pub fn len(&self) -> usize {
        self.with(|map| map.len())
    }

    /// The scheduler's fleet of `sessions` (see [`Session::spec`]), each
    /// ranked on what it has shown (`evidence`; a node absent from it has
    /// shown nothing: see [`NodeSpec::with_evidence`]). Nodes do not
    /// download models yet, so only cached models are placed.
    pub fn fleet(sessions: &[Arc<Session>], evidence: &HashMap<NodeId, Evidence>) -> Fleet {
        let mut fleet = Fleet::new(Policy {
            downloads: false,
            ..Policy::default()
        });
        for s in sessions {
            // Ids are unique in the registry, so this cannot fail.
            let shown = evidence.get(&s.node_id).copied().unwrap_or_default();
            let _ = fleet.add_node(s.spec().with_evidence(&shown));
        }
        for leader in sessions {
            if let Some(spec) = Self::whole_pod(sessions, leader) {
                if let Err(e) = fleet.add_pod(spec) {
                    tracing::debug!(error = %e, "pod left out of placement");
                }
            }
        }
        // A member busy with its pod's job keeps the pod busy.
        for s in sessions {
            if s.pod.is_some() && s.running_jobs() > 0 {
                fleet.set_draining(&s.node_id, true);
            }
        }
        fleet
    }

    /// The pod `leader` speaks for, when it is whole: the leader reports no
    /// degradation and its membership is confirmed ([`pod_confirmed`]).
    fn whole_pod(sessions: &[Arc<Session>], leader: &Session) -> Option<PodSpec> {
        let pod = leader.pod.as_ref()?;
        if leader.pod_degraded().is_some() {
            return None;
        }
        let confirmed = pod_confirmed(&leader.node_id, pod, |id| {
            sessions
                .iter()
                .find(|s| s.node_id == *id)
                .and_then(|s| s.pod.as_ref())
        });
        if !confirmed {
            return None;
        }
        let usable = |v: f64| v.is_finite() && v > 0.0;
        let typical = PodSpec::typical(&pod.name, pod.members.clone(), false);
        Some(PodSpec {
            link_latency_s: if usable(pod.link_latency_s) {
                pod.link_latency_s
            } else {
                typical.link_latency_s
            },
            link_bandwidth: if usable(pod.link_bandwidth) {
                pod.link_bandwidth
            } else {
                typical.link_bandwidth
            },
            ..typical
        })
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Whether `leader`'s report of its pod is confirmed both ways: it is rank
/// 0 and first in its own member list, and every member it names is online
/// (`member` finds its report) and reports the same pod name, its own rank
/// there, and the same member list (so names the leader too). A node
/// claiming to lead an honest pod's members is not confirmed: their own
/// Hellos name another leader.
pub(crate) fn pod_confirmed<'a>(
    leader: &NodeId,
    pod: &PodMembership,
    member: impl Fn(&NodeId) -> Option<&'a PodMembership>,
) -> bool {
    if pod.rank != 0 || pod.members.first() != Some(leader) {
        return false;
    }
    pod.members.iter().enumerate().all(|(rank, id)| {
        member(id).is_some_and(|m| {
            m.name == pod.name && m.rank as usize == rank && m.members == pod.members
        })
    })
}

#[cfg(test)]
mod pod_tests;
