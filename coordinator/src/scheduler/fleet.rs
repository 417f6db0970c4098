//! The fleet as the scheduler sees it, indexed for fast decisions, and the
//! decision itself: which node or pod takes one job, and why.
//!
//! # Decision rule
//! 1. Feasibility: a node with a free job slot and at least the job's memory
//!    free; a pod whose every member is free (no job of its own, not
//!    draining) and holds its share. Models not cached need a download, which
//!    the policy may forbid.
//! 2. Tiers, best first: cached model on a dedicated node; cached on an
//!    idle-time node for a long job (> `Policy::long_job_s`); then the same
//!    two without the model cached. Cached is strongly preferred: any cached
//!    candidate beats every download. All of these come before any
//!    unreliable candidate (reliability under [`RELIABLE`]: most of its
//!    recent attempts failed), which takes a job only when no reliable one
//!    can.
//! 3. Within the best tier, the lowest expected completion (estimate /
//!    reliability; on a node already running jobs, the estimate of a
//!    stream sharing its batch, by the node's speed curve: so a second job
//!    goes to a busy node when that is faster than an idle slow one) sets a band (+10% or +1 s, whichever is larger); inside the
//!    band the tightest memory fit wins (least memory left over), so the big
//!    Macs stay free for the big models when a small Mac is nearly as fast.
//!    Ties go to a single Mac over a pod (fewer machines tied up), then to
//!    the faster candidate, then to the earliest added.
//! 4. Prefix affinity ([`Fleet::decide_with`], [`super::affinity`]): a node
//!    that last ran a prefix of the job's input is looked at even when it
//!    is not its class's best fit, and its estimate counts only the prefill
//!    of the rest of the input (its prefix cache serves the prefix; the
//!    decode part is unchanged). Then, among the candidates inside the
//!    band, the one with the longest prefix wins. In a worse tier affinity
//!    counts for nothing, and it never makes a node that is slower or
//!    busier at decoding the job win: only the prefill it saves counts.
//!
//! # Index
//! Nodes are grouped into classes of identical figures: chip table values
//! exactly; measured memory bandwidth and compute rounded to a 5% grid,
//! measured internet links to a 25% grid; reliability to quarters; mode.
//! Each cached model keeps, per speed class (the class without the internet
//! link, which a cached model does not use), its available holders in a
//! `BTreeSet` ordered by free memory; every full class keeps all its
//! available nodes the same way (for downloads, looked at only when no
//! holder fits). A decision thus costs O(classes x log nodes) plus one pass
//! over the free pods, not a scan of the fleet. The nodes of a class differ
//! only in their load: the class offers its best-fit node and, when that
//! one is busy, its best-fitting idle node among the next
//! [`IDLE_SCAN`] (the fastest the class has for this job).
//!
//! # Invariants
//! - Memory is never overcommitted: [`Fleet::commit`] re-checks the
//!   placement against the current state and refuses it otherwise.
//! - A pod is placed only when every member is free; a member running a job
//!   of its own, or draining, makes its pod unavailable; a member running its
//!   pod's job takes no job of its own.
//! - A node belongs to at most one pod.
//! - Decisions do no I/O and take `&self`; the same state and job always give
//!   the same decision.

use std::collections::{BTreeSet, HashMap};
use std::fmt::Write as _;

use mlxnet_proto::ids::NodeId;

use super::{
    capability::{Capability, Figure, Mode, NodeSpec, PodSpec, Source},
    cost::{estimate, Estimate, JobShape, PodLinks, Speeds},
};

/// Tunables of the decision rule.
#[derive(Clone, Debug, PartialEq)]
pub struct Policy {
    /// Candidates within this fraction of the best time count as near-best.
    pub near_best_ratio: f64,
    /// ... or within this many seconds, whichever is larger.
    pub near_best_floor_s: f64,
    /// Jobs estimated longer than this prefer dedicated nodes.
    pub long_job_s: f64,
    /// Whether a node may download a model it does not hold.
    pub downloads: bool,
}

impl Default for Policy {
    fn default() -> Self {
        Policy {
            near_best_ratio: 0.10,
            near_best_floor_s: 1.0,
            long_job_s: 60.0,
            downloads: true,
        }
    }
}

/// Why the fleet refused a change.
#[derive(Debug, thiserror::Error, PartialEq)]
#[non_exhaustive]
pub enum FleetError {
    #[error("node {0} is already in the fleet")]
    DuplicateNode(String),
    #[error("pod {pod}: node {node} is not in the fleet")]
    UnknownMember { pod: String, node: String },
    #[error("pod {pod}: node {node} is already in a pod")]
    AlreadyInPod { pod: String, node: String },
    #[error("pod {0} needs at least two distinct members")]
    TooFewMembers(String),
    #[error("placement no longer fits: {0}")]
    Stale(String),
}

/// Where a job goes.
#[derive(Clone, Debug, PartialEq)]
pub enum Target {
    Node(NodeId),
    Pod { name: String, members: Vec<NodeId> },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Slot {
    Node(u32),
    Pod(u32),
}

/// A chosen target with its estimate and the reason it won.
#[derive(Clone, Debug, PartialEq)]
pub struct Placement {
    pub target: Target,
    slot: Slot,
    /// Memory reserved on the node, or on each pod member.
    pub memory_per_member: u64,
    pub estimate: Estimate,
    /// Bytes of the job's input prefix the chosen node last ran, as the
    /// caller's affinity said (0 for a pod, or none).
    pub prefix_match: u64,
    pub reason: String,
}

/// The outcome of one decision.
#[derive(Clone, Debug, PartialEq)]
pub enum Decision {
    Place(Placement),
    /// Feasible on this fleet, but nothing suitable is free now.
    Wait(String),
    /// No node or pod of this fleet could ever hold it.
    Never(String),
}

/// Available nodes by (free memory, slot), smallest first.
type ByFree = BTreeSet<(u64, u32)>;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct ClassKey {
    bandwidth: u64,
    compute: u64,
    /// 0 in a speed class.
    internet: u64,
    mode: Mode,
    reliability: u8,
}

#[derive(Clone, Debug)]
struct Class {
    speeds: Speeds,
    mode: Mode,
    reliability: f64,
    /// Available nodes of this class by (free memory, slot); full classes only.
    available: ByFree,
}

#[derive(Clone, Debug)]
struct NodeState {
    spec: NodeSpec,
    class: u32,
    speed_class: u32,
    free: u64,
    running: u32,
    draining: bool,
    pod: Option<u32>,
    pod_job: bool,
}

impl NodeState {
    fn solo_available(&self) -> bool {
        !self.draining && !self.pod_job && self.running < self.spec.max_concurrent_jobs
    }

    fn fully_free(&self) -> bool {
        !self.draining && !self.pod_job && self.running == 0
    }
}

#[derive(Clone, Debug)]
struct PodState {
    spec: PodSpec,
    members: Vec<u32>,
    /// Members not fully free; the pod is available at 0.
    busy: u32,
    speeds: Speeds,
    mode: Mode,
    reliability: f64,
    /// n x the smallest member's total memory: the most it could ever hold.
    capacity: u64,
    min_member_total: u64,
}

/// The fleet and its index.
#[derive(Clone, Debug, Default)]
pub struct Fleet {
    policy: Policy,
    nodes: Vec<NodeState>,
    by_id: HashMap<NodeId, u32>,
    classes: Vec<Class>,
    class_of: HashMap<ClassKey, u32>,
    speed_classes: Vec<Class>,
    speed_class_of: HashMap<ClassKey, u32>,
    /// Per model digest, per speed class: available nodes holding it.
    cached: HashMap<[u8; 32], HashMap<u32, ByFree>>,
    pods: Vec<PodState>,
    largest_node: u64,
    /// The largest node that takes jobs of its own (not a pod member, not
    /// draining: `max_concurrent_jobs` above 0).
    largest_taker: u64,
}

/// A candidate during one decision.
#[derive(Clone, Copy, Debug)]
struct Candidate {
    tier: u8,
    /// Expected completion: estimate / reliability.
    time: f64,
    leftover: u64,
    order: (u8, u32),
    slot: Slot,
    estimate: Estimate,
    cached: bool,
    need: u64,
    free: u64,
    /// Jobs the node already runs (0 for a pod, which runs one).
    load: u32,
    /// Bytes of the job's input prefix the node last ran (0: none known).
    affinity: u64,
}

impl Candidate {
    /// A node that ran `self.affinity` bytes of the job's input prefills
    /// only the rest: its prefix cache serves the part it ran. The prompt
    /// is counted in input bytes on both sides (`JobShape::prompt_tokens`
    /// is the input's bytes, the affinity's depth too), and prefill time is
    /// linear in it, so the credit is that share of the prefill estimate.
    /// The tier is left as it was (it depends on the model being cached
    /// and on the node's mode, not on this).
    fn credit_prefix(&mut self, job: &JobShape<'_>) {
        let prompt = u64::from(job.prompt_tokens);
        if prompt == 0 || self.estimate.total_s <= 0.0 {
            return;
        }
        let saved = self.estimate.prefill_s * self.affinity.min(prompt) as f64 / prompt as f64;
        let before = self.estimate.total_s;
        self.estimate.prefill_s -= saved;
        self.estimate.total_s = (before - saved).max(0.0);
        self.time *= self.estimate.total_s / before;
    }
}

/// Below this reliability (after rounding to quarters) a node or pod ranks
/// after every more reliable candidate, however fast it claims to be.
pub const RELIABLE: f64 = 0.5;

/// Nodes of a class looked at past a busy best fit for an idle one.
pub const IDLE_SCAN: usize = 32;

/// ln(1.05) and ln(1.25): the grids of measured speeds and internet links.
const SPEED_GRID: f64 = 0.048_790_164_169_432;
const LINK_GRID: f64 = 0.223_143_551_314_209_8;

fn grid(f: &Figure, step: f64) -> f64 {
    if matches!(f.source, Source::Measured | Source::Observed) {
        ((f.value.ln() / step).round() * step).exp()
    } else {
        f.value
    }
}

fn class_id(
    classes: &mut Vec<Class>,
    of: &mut HashMap<ClassKey, u32>,
    key: ClassKey,
    make: impl FnOnce() -> Class,
) -> u32 {
    *of.entry(key).or_insert_with(|| {
        classes.push(make());
        classes.len() as u32 - 1
    })
}

fn gb(bytes: u64) -> String {
    format!("{:.1} GB", bytes as f64 / 1e9)
}

fn secs(s: f64) -> String {
    if s < 0.01 {
        format!("{:.2} ms", s * 1e3)
    } else if s < 1.0 {
        format!("{:.0} ms", s * 1e3)
    } else {
        format!("{s:.1} s")
    }
}

impl Fleet {
    pub fn new(policy: Policy) -> Self {
        Fleet {
            policy,
            ..Fleet::default()
        }
    }

    pub fn policy(&self) -> &Policy {
        &self.policy
    }

    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// Adds a node (free memory capped at its total). Measured figures are
    /// rounded to the index's 2% grid.
    pub fn add_node(&mut self, mut spec: NodeSpec) -> Result<(), FleetError> {
        if self.by_id.contains_key(&spec.id) {
            return Err(FleetError::DuplicateNode(spec.id.short()));
        }
        let cap = &mut spec.capability;
        cap.memory_bandwidth.value = grid(&cap.memory_bandwidth, SPEED_GRID);
        cap.compute.value = grid(&cap.compute, SPEED_GRID);
        cap.internet.value = grid(&cap.internet, LINK_GRID);
        let reliability = if spec.reliability.is_finite() {
            (spec.reliability.clamp(0.25, 1.0) * 4.0).round() / 4.0
        } else {
            1.0
        };
        spec.reliability = reliability;
        let speeds = Speeds {
            memory_bandwidth: cap.memory_bandwidth.value,
            compute: cap.compute.value,
            internet: cap.internet.value,
        };
        let mut key = ClassKey {
            bandwidth: speeds.memory_bandwidth.to_bits(),
            compute: speeds.compute.to_bits(),
            internet: speeds.internet.to_bits(),
            mode: spec.mode,
            reliability: (reliability * 4.0) as u8,
        };
        let make = |speeds| {
            move || Class {
                speeds,
                mode: spec.mode,
                reliability,
                available: BTreeSet::new(),
            }
        };
        let class = class_id(&mut self.classes, &mut self.class_of, key, make(speeds));
        key.internet = 0;
        let speed_class = class_id(
            &mut self.speed_classes,
            &mut self.speed_class_of,
            key,
            make(speeds),
        );
        let slot = self.nodes.len() as u32;
        self.largest_node = self.largest_node.max(spec.memory_bytes);
        if spec.max_concurrent_jobs > 0 {
            self.largest_taker = self.largest_taker.max(spec.memory_bytes);
        }
        self.by_id.insert(spec.id, slot);
        let free = spec.free_memory_bytes.min(spec.memory_bytes);
        self.nodes.push(NodeState {
            spec,
            class,
            speed_class,
            free,
            running: 0,
            draining: false,
            pod: None,
            pod_job: false,
        });
        self.index(slot);
        Ok(())
    }

    /// Adds a pod of nodes already in the fleet.
    pub fn add_pod(&mut self, spec: PodSpec) -> Result<(), FleetError> {
        let mut members = Vec::with_capacity(spec.members.len());
        for id in &spec.members {
            let Some(&slot) = self.by_id.get(id) else {
                return Err(FleetError::UnknownMember {
                    pod: spec.name.clone(),
                    node: id.short(),
                });
            };
            if self.nodes[slot as usize].pod.is_some() || members.contains(&slot) {
                return Err(FleetError::AlreadyInPod {
                    pod: spec.name.clone(),
                    node: id.short(),
                });
            }
            members.push(slot);
        }
        if members.len() < 2 {
            return Err(FleetError::TooFewMembers(spec.name.clone()));
        }
        let pod = self.pods.len() as u32;
        let nodes: Vec<&NodeState> = members.iter().map(|&m| &self.nodes[m as usize]).collect();
        let caps: Vec<&Capability> = nodes.iter().map(|n| &n.spec.capability).collect();
        let speeds = Speeds {
            memory_bandwidth: caps
                .iter()
                .map(|c| c.memory_bandwidth.value)
                .fold(f64::INFINITY, f64::min),
            compute: caps.iter().map(|c| c.compute.value).sum(),
            internet: caps[0].internet.value,
        };
        let mode = if nodes.iter().all(|n| n.spec.mode == Mode::Dedicated) {
            Mode::Dedicated
        } else {
            Mode::IdleTime
        };
        let reliability = nodes.iter().map(|n| n.spec.reliability).fold(1.0, f64::min);
        let min_member_total = nodes.iter().map(|n| n.spec.memory_bytes).min().unwrap_or(0);
        let busy = nodes.iter().filter(|n| !n.fully_free()).count() as u32;
        for &m in &members {
            self.nodes[m as usize].pod = Some(pod);
        }
        self.pods.push(PodState {
            capacity: min_member_total.saturating_mul(members.len() as u64),
            min_member_total,
            members,
            busy,
            speeds,
            mode,
            reliability,
            spec,
        });
        Ok(())
    }

    fn index(&mut self, slot: u32) {
        let n = &self.nodes[slot as usize];
        if !n.solo_available() {
            return;
        }
        let entry = (n.free, slot);
        self.classes[n.class as usize].available.insert(entry);
        for digest in &n.spec.cached {
            self.cached
                .entry(*digest)
                .or_default()
                .entry(n.speed_class)
                .or_default()
                .insert(entry);
        }
    }

    fn unindex(&mut self, slot: u32) {
        let n = &self.nodes[slot as usize];
        let entry = (n.free, slot);
        if !self.classes[n.class as usize].available.remove(&entry) {
            return;
        }
        for digest in &n.spec.cached {
            if let Some(by_class) = self.cached.get_mut(digest) {
                if let Some(set) = by_class.get_mut(&n.speed_class) {
                    set.remove(&entry);
                    if set.is_empty() {
                        by_class.remove(&n.speed_class);
                    }
                }
            }
        }
    }

    /// Changes one node, keeping the index and its pod's busy count right.
    fn update(&mut self, slot: u32, f: impl FnOnce(&mut NodeState)) {
        let was_free = self.nodes[slot as usize].fully_free();
        self.unindex(slot);
        f(&mut self.nodes[slot as usize]);
        self.index(slot);
        let n = &self.nodes[slot as usize];
        if let Some(p) = n.pod {
            match (was_free, n.fully_free()) {
                (true, false) => self.pods[p as usize].busy += 1,
                (false, true) => self.pods[p as usize].busy -= 1,
                _ => {}
            }
        }
    }

    /// The node asked for no new work (owner back, shutting down), or may
    /// take work again.
    pub fn set_draining(&mut self, id: &NodeId, draining: bool) -> bool {
        let Some(&slot) = self.by_id.get(id) else {
            return false;
        };
        self.update(slot, |n| n.draining = draining);
        true
    }

    /// Largest memory any single node or pod could ever offer a job.
    pub fn largest_capacity(&self) -> u64 {
        self.pods
            .iter()
            .map(|p| p.capacity)
            .fold(self.largest_node, u64::max)
    }

    /// Whether some node or pod of this fleet could ever hold `job`.
    pub fn could_ever_hold(&self, job: &JobShape<'_>) -> bool {
        let need = job.memory_needed();
        need <= self.largest_node
            || self
                .pods
                .iter()
                .any(|p| job.memory_per_member(p.members.len()) <= p.min_member_total)
    }

    /// Whether a node that takes jobs of its own, or a pod, could ever run
    /// `job` (a node of a pod, or draining, runs none of its own; busy
    /// nodes count).
    pub fn could_ever_run(&self, job: &JobShape<'_>) -> bool {
        job.memory_needed() <= self.largest_taker
            || self
                .pods
                .iter()
                .any(|p| job.memory_per_member(p.members.len()) <= p.min_member_total)
    }

    fn tier(&self, reliability: f64, cached: bool, mode: Mode, total_s: f64) -> u8 {
        (u8::from(reliability < RELIABLE) << 2)
            | (u8::from(!cached) << 1)
            | u8::from(mode == Mode::IdleTime && total_s > self.policy.long_job_s)
    }

    /// Jobs a node runs now: before the fleet was built and placed since.
    fn load(&self, slot: u32) -> u32 {
        let n = &self.nodes[slot as usize];
        n.spec.running_jobs.saturating_add(n.running)
    }

    /// The class's best-fit node for `job`, and its best-fitting idle node
    /// (among the next [`IDLE_SCAN`]) when the best fit is busy.
    fn class_candidates(
        &self,
        job: &JobShape<'_>,
        c: &Class,
        set: &ByFree,
        need: u64,
        cached: bool,
        out: &mut Vec<Candidate>,
    ) {
        let mut fits = set.range((need, 0)..);
        let Some(&first) = fits.next() else {
            return;
        };
        out.push(self.node_candidate(job, c, first, need, cached));
        if self.load(first.1) > 0 {
            if let Some(&idle) = fits.take(IDLE_SCAN).find(|&&(_, s)| self.load(s) == 0) {
                out.push(self.node_candidate(job, c, idle, need, cached));
            }
        }
    }

    fn node_candidate(
        &self,
        job: &JobShape<'_>,
        c: &Class,
        (free, slot): (u64, u32),
        need: u64,
        cached: bool,
    ) -> Candidate {
        let load = self.load(slot);
        let alone = estimate(job, &c.speeds, cached, None);
        let estimate = if load == 0 {
            alone
        } else {
            let curve = &self.nodes[slot as usize].spec.batch;
            alone.shared(job, curve.slowdown(load.saturating_add(1)))
        };
        Candidate {
            tier: self.tier(c.reliability, cached, c.mode, estimate.total_s),
            time: estimate.total_s / c.reliability.max(0.05),
            leftover: free - need,
            order: (0, slot),
            slot: Slot::Node(slot),
            estimate,
            cached,
            need,
            free,
            load,
            affinity: 0,
        }
    }

    fn pod_candidate(&self, job: &JobShape<'_>, pod: u32) -> Option<Candidate> {
        let p = &self.pods[pod as usize];
        if p.busy > 0 {
            return None;
        }
        let n = p.members.len();
        let share = job.memory_per_member(n);
        let mut free = 0u64;
        let mut cached = true;
        for &m in &p.members {
            let node = &self.nodes[m as usize];
            if node.free < share {
                return None;
            }
            free = free.saturating_add(node.free);
            cached &= node.spec.cached.contains(&job.model.sha256);
        }
        if !cached && !self.policy.downloads {
            return None;
        }
        let links = PodLinks {
            members: n,
            latency_s: p.spec.link_latency_s,
            bandwidth: p.spec.link_bandwidth,
        };
        let estimate = estimate(job, &p.speeds, cached, Some(&links));
        // Best-fit compares the job's memory, not the members' rounded shares.
        let need = job.memory_needed();
        Some(Candidate {
            tier: self.tier(p.reliability, cached, p.mode, estimate.total_s),
            time: estimate.total_s / p.reliability.max(0.05),
            leftover: free.saturating_sub(need),
            order: (1, pod),
            slot: Slot::Pod(pod),
            estimate,
            cached,
            need,
            free,
            load: 0,
            affinity: 0,
        })
    }

    /// Chooses where `job` runs now, with the reason.
    pub fn decide(&self, job: &JobShape<'_>) -> Decision {
        self.decide_with(job, &[])
    }

    /// [`Fleet::decide`], knowing which nodes last ran a prefix of the
    /// job's input and how many bytes of it (`affinity`, from
    /// [`super::affinity::Affinity::matches`]). A node holding a prefix is
    /// estimated with the prefill of the rest of the input only; then,
    /// among the candidates of the best tier within the near-best band, the
    /// one holding the longest prefix wins.
    pub fn decide_with(&self, job: &JobShape<'_>, affinity: &[(NodeId, u64)]) -> Decision {
        let need = job.memory_needed();
        if !self.could_ever_hold(job) {
            return Decision::Never(format!(
                "needs {}, largest node or pod has {}",
                gb(need),
                gb(self.largest_capacity())
            ));
        }
        let mut cands: Vec<Candidate> = Vec::new();
        if let Some(by_class) = self.cached.get(&job.model.sha256) {
            for (&class, set) in by_class {
                let c = &self.speed_classes[class as usize];
                self.class_candidates(job, c, set, need, true, &mut cands);
            }
        }
        let any_cached_solo = !cands.is_empty();
        for pod in 0..self.pods.len() as u32 {
            cands.extend(self.pod_candidate(job, pod));
        }
        // A download never beats a cached candidate, so the uncached nodes
        // are only looked at when no cached one is feasible.
        if self.policy.downloads && !any_cached_solo && cands.iter().all(|c| !c.cached) {
            for c in &self.classes {
                self.class_candidates(job, c, &c.available, need, false, &mut cands);
            }
        }
        // A node holding a prefix may not be the best fit of its class:
        // it is looked at on its own.
        for &(id, bytes) in affinity {
            if bytes == 0 {
                continue;
            }
            let Some(&slot) = self.by_id.get(&id) else {
                continue;
            };
            if let Some(c) = cands.iter_mut().find(|c| c.slot == Slot::Node(slot)) {
                c.affinity = c.affinity.max(bytes);
                continue;
            }
            let n = &self.nodes[slot as usize];
            if !n.solo_available() || n.free < need || !n.spec.cached.contains(&job.model.sha256) {
                continue;
            }
            let class = &self.speed_classes[n.speed_class as usize];
            let mut c = self.node_candidate(job, class, (n.free, slot), need, true);
            c.affinity = bytes;
            cands.push(c);
        }
        for c in cands.iter_mut().filter(|c| c.affinity > 0) {
            c.credit_prefix(job);
        }
        let Some(best_tier) = cands.iter().map(|c| c.tier).min() else {
            return Decision::Wait(self.wait_reason(job, need));
        };
        cands.retain(|c| c.tier == best_tier);
        let fastest = cands.iter().map(|c| c.time).fold(f64::INFINITY, f64::min);
        let band =
            fastest + (fastest * self.policy.near_best_ratio).max(self.policy.near_best_floor_s);
        let near = cands.iter().filter(|c| c.time <= band).count();
        let by_affinity = cands
            .iter()
            .filter(|c| c.time <= band && c.affinity > 0)
            .max_by(|a, b| {
                a.affinity
                    .cmp(&b.affinity)
                    .then(b.time.total_cmp(&a.time))
                    .then(b.order.cmp(&a.order))
            });
        let by_fit = || {
            cands.iter().filter(|c| c.time <= band).min_by(|a, b| {
                a.leftover
                    .cmp(&b.leftover)
                    .then(a.order.0.cmp(&b.order.0))
                    .then(a.time.total_cmp(&b.time))
                    .then(a.order.cmp(&b.order))
            })
        };
        let Some(pick) = by_affinity.or_else(by_fit) else {
            return Decision::Wait(self.wait_reason(job, need));
        };
        Decision::Place(self.placement(job, pick, fastest, near, cands.len()))
    }

    fn wait_reason(&self, job: &JobShape<'_>, need: u64) -> String {
        let holders = self
            .cached
            .get(&job.model.sha256)
            .map_or(0, |m| m.values().map(BTreeSet::len).sum::<usize>());
        if !self.policy.downloads && holders == 0 {
            let any = self
                .nodes
                .iter()
                .any(|n| n.spec.cached.contains(&job.model.sha256));
            if !any {
                return format!("no online node holds model {}", job.model.id);
            }
        }
        format!(
            "needs {}; no node or pod that could hold it is free now",
            gb(need)
        )
    }

    fn placement(
        &self,
        job: &JobShape<'_>,
        c: &Candidate,
        fastest: f64,
        near: usize,
        of: usize,
    ) -> Placement {
        let e = &c.estimate;
        let mut reason = String::new();
        let (target, bandwidth, mode) = match c.slot {
            Slot::Node(slot) => {
                let n = &self.nodes[slot as usize];
                let cap = &n.spec.capability;
                let _ = write!(reason, "node {} ({}", n.spec.id.short(), n.spec.chip);
                (Target::Node(n.spec.id), cap.memory_bandwidth, n.spec.mode)
            }
            Slot::Pod(pod) => {
                let p = &self.pods[pod as usize];
                let first = &self.nodes[p.members[0] as usize];
                let _ = write!(
                    reason,
                    "pod {} ({} x {}",
                    p.spec.name,
                    p.members.len(),
                    first.spec.chip
                );
                let bw = self
                    .pods_members(pod)
                    .map(|n| n.spec.capability.memory_bandwidth)
                    .min_by(|a, b| a.value.total_cmp(&b.value))
                    .unwrap_or(first.spec.capability.memory_bandwidth);
                (
                    Target::Pod {
                        name: p.spec.name.clone(),
                        members: self.pods_members(pod).map(|n| n.spec.id).collect(),
                    },
                    bw,
                    p.mode,
                )
            }
        };
        let _ = write!(
            reason,
            ", {}, {}): est {} = ",
            mode.as_str(),
            if c.cached {
                "model cached"
            } else {
                "downloads the model"
            },
            secs(e.total_s)
        );
        if e.download_s > 0.0 {
            let _ = write!(reason, "download {} + ", secs(e.download_s));
        }
        let _ = write!(
            reason,
            "prefill {} + {} x {}/token ({} GB/s {}",
            secs(e.prefill_s),
            job.max_tokens,
            secs(e.per_token_s),
            {
                let gbs = bandwidth.value / 1e9;
                if gbs < 10.0 {
                    format!("{gbs:.2}")
                } else {
                    format!("{gbs:.0}")
                }
            },
            bandwidth.source.as_str()
        );
        if e.comm_per_token_s > 0.0 {
            let _ = write!(reason, ", pod links {}/token", secs(e.comm_per_token_s));
        }
        if c.load > 0 {
            if let Slot::Node(slot) = c.slot {
                let curve = &self.nodes[slot as usize].spec.batch;
                let _ = write!(
                    reason,
                    ", beside {} running: x{:.2}/token {}",
                    c.load,
                    curve.slowdown(c.load.saturating_add(1)),
                    if curve.is_empty() {
                        "(no batch curve: no batching gain)"
                    } else {
                        "by its batch curve"
                    }
                );
            }
        }
        let _ = write!(
            reason,
            "); needs {} of {} free, leaves {}",
            gb(c.need),
            gb(c.free),
            gb(c.leftover)
        );
        if c.affinity > 0 && near > 1 {
            let _ = write!(
                reason,
                "; holds {} bytes of the input's prefix, of {near} within {} of the fastest ({})",
                c.affinity,
                secs((fastest * self.policy.near_best_ratio).max(self.policy.near_best_floor_s)),
                secs(fastest)
            );
        } else if near > 1 {
            let _ = write!(
                reason,
                "; tightest fit of {near} within {} of the fastest ({})",
                secs((fastest * self.policy.near_best_ratio).max(self.policy.near_best_floor_s)),
                secs(fastest)
            );
        } else {
            let _ = write!(reason, "; fastest of {of}");
        }
        Placement {
            target,
            slot: c.slot,
            memory_per_member: match c.slot {
                Slot::Node(_) => c.need,
                Slot::Pod(pod) => job.memory_per_member(self.pods[pod as usize].members.len()),
            },
            estimate: c.estimate,
            prefix_match: c.affinity,
            reason,
        }
    }

    fn pods_members(&self, pod: u32) -> impl Iterator<Item = &NodeState> {
        self.pods[pod as usize]
            .members
            .iter()
            .map(|&m| &self.nodes[m as usize])
    }

    /// Reserves what `p` takes. Refuses (changing nothing) if it no longer
    /// fits, so memory is never overcommitted.
    pub fn commit(&mut self, p: &Placement) -> Result<(), FleetError> {
        let need = p.memory_per_member;
        match p.slot {
            Slot::Node(slot) => {
                let n = &self.nodes[slot as usize];
                if !n.solo_available() || n.free < need {
                    return Err(FleetError::Stale(format!(
                        "node {} has {} free and {} of {} jobs running",
                        n.spec.id.short(),
                        gb(n.free),
                        n.running,
                        n.spec.max_concurrent_jobs
                    )));
                }
                self.update(slot, |n| {
                    n.free -= need;
                    n.running += 1;
                });
            }
            Slot::Pod(pod) => {
                let members = self.pods[pod as usize].members.clone();
                if self.pods[pod as usize].busy > 0
                    || members.iter().any(|&m| self.nodes[m as usize].free < need)
                {
                    return Err(FleetError::Stale(format!(
                        "pod {} is not free",
                        self.pods[pod as usize].spec.name
                    )));
                }
                for m in members {
                    self.update(m, |n| {
                        n.free -= need;
                        n.pod_job = true;
                    });
                }
            }
        }
        Ok(())
    }

    /// Gives back what a committed `p` took (its job ended).
    pub fn release(&mut self, p: &Placement) {
        let need = p.memory_per_member;
        match p.slot {
            Slot::Node(slot) => self.update(slot, |n| {
                n.free = n.free.saturating_add(need).min(n.spec.memory_bytes);
                n.running = n.running.saturating_sub(1);
            }),
            Slot::Pod(pod) => {
                for m in self.pods[pod as usize].members.clone() {
                    self.update(m, |n| {
                        n.free = n.free.saturating_add(need).min(n.spec.memory_bytes);
                        n.pod_job = false;
                    });
                }
            }
        }
    }

    /// Free memory and running jobs of a node (for tests and metrics).
    pub fn node_state(&self, id: &NodeId) -> Option<(u64, u32, bool)> {
        self.by_id.get(id).map(|&s| {
            let n = &self.nodes[s as usize];
            (n.free, n.running, n.pod_job)
        })
    }
}
