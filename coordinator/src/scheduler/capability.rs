//! What a node or a pod can do, as the scheduler sees it: memory, memory
//! bandwidth, compute, internet link, pod links, cached models, mode and
//! reliability.
//!
//! # Invariants
//! - A figure the node measured (`mlx-node bench`, link tests) always wins
//!   over the chip table ([`mlxnet_proto::chips`]); the table wins over the
//!   assumed defaults used for machines the table does not know. Every
//!   resolved [`Figure`] says which of the three it came from, so a decision's
//!   reason can too.
//! - Figures are finite and positive (bad measurements are ignored, never
//!   propagated as NaN or zero into the cost model).
//! - Placement ranks a node on evidence, not its Hello alone
//!   ([`NodeSpec::with_evidence`]): its memory bandwidth never ranks above
//!   what its own verified claims showed ([`Evidence::bandwidth`]), and a
//!   node that has shown nothing yet ranks at most at its chip table's
//!   figure (the assumed default for a chip the table does not know), so
//!   a self-measured figure alone never wins; its reliability is the
//!   decayed share of its attempts that ended well.

use mlxnet_proto::{chips, ids::NodeId};

use super::cost::BatchCurve;

/// Bandwidth assumed for a machine the chip table does not know (bytes/s):
/// a dual-channel DDR5 desktop.
pub const ASSUMED_MEMORY_BANDWIDTH: f64 = 50e9;
/// Compute assumed for a machine the chip table does not know (FLOP/s).
pub const ASSUMED_COMPUTE: f64 = 1e12;
/// Internet link assumed when the node has not measured one: 100 Mbit/s.
pub const ASSUMED_INTERNET: f64 = 12.5e6;
/// The most memory believed of a machine the chip table does not know
/// (bytes): a large workstation's 128 GiB.
pub const ASSUMED_MAX_MEMORY: u64 = 128 << 30;

/// The most memory a node on `chip` can have: the chip table's largest
/// configuration, or [`ASSUMED_MAX_MEMORY`] for a chip it does not know.
/// A reported figure above it is not believed.
pub fn memory_cap(chip: &str) -> u64 {
    chips::lookup(chip).map_or(ASSUMED_MAX_MEMORY, chips::ChipSpec::max_memory_bytes)
}

/// Whether the owner lends the node full-time or only while idle.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Mode {
    Dedicated,
    /// The owner may come back and drain it at any time.
    IdleTime,
}

impl Mode {
    /// From the Hello's `mode` string; anything but "dedicated" is idle-time
    /// (the cautious reading).
    pub fn from_hello(mode: &str) -> Self {
        if mode.eq_ignore_ascii_case("dedicated") {
            Mode::Dedicated
        } else {
            Mode::IdleTime
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Dedicated => "dedicated",
            Mode::IdleTime => "idle-time",
        }
    }
}

/// Where a figure came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    Measured,
    Table,
    Assumed,
    /// Shown by the node's own verified claims' timings.
    Observed,
}

impl Source {
    pub fn as_str(self) -> &'static str {
        match self {
            Source::Measured => "measured",
            Source::Table => "table",
            Source::Assumed => "assumed",
            Source::Observed => "observed",
        }
    }
}

/// One resolved figure.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Figure {
    pub value: f64,
    pub source: Source,
}

impl Figure {
    /// Measured if usable, else the table's value, else the assumption.
    pub fn pick(measured: Option<f64>, table: Option<f64>, assumed: f64) -> Self {
        let usable = |v: &f64| v.is_finite() && *v > 0.0;
        if let Some(value) = measured.filter(usable) {
            Figure {
                value,
                source: Source::Measured,
            }
        } else if let Some(value) = table.filter(usable) {
            Figure {
                value,
                source: Source::Table,
            }
        } else {
            Figure {
                value: assumed,
                source: Source::Assumed,
            }
        }
    }
}

/// What the node measured itself (absent = not measured).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Measured {
    /// Effective memory bandwidth while decoding: bytes read per token x
    /// tokens/s, from `mlx-node bench`.
    pub memory_bandwidth: Option<f64>,
    /// Effective compute while prefilling, FLOP/s.
    pub compute: Option<f64>,
    /// Download rate to the internet, bytes/s.
    pub internet: Option<f64>,
}

/// A node's resolved performance figures.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Capability {
    /// Bytes/s of unified memory.
    pub memory_bandwidth: Figure,
    /// FLOP/s.
    pub compute: Figure,
    /// Bytes/s from the internet (model downloads).
    pub internet: Figure,
}

impl Capability {
    /// Measured figures over the chip table over assumptions.
    pub fn resolve(chip: &str, measured: &Measured) -> Self {
        let spec = chips::lookup(chip);
        Capability {
            memory_bandwidth: Figure::pick(
                measured.memory_bandwidth,
                spec.map(|s| s.memory_bandwidth_bytes_per_s() as f64),
                ASSUMED_MEMORY_BANDWIDTH,
            ),
            compute: Figure::pick(
                measured.compute,
                spec.map(|s| s.compute_flops()),
                ASSUMED_COMPUTE,
            ),
            internet: Figure::pick(measured.internet, None, ASSUMED_INTERNET),
        }
    }
}

/// Everything the scheduler knows about one node.
#[derive(Clone, Debug, PartialEq)]
pub struct NodeSpec {
    pub id: NodeId,
    /// Chip name as reported ("Apple M3 Ultra"), for reasons.
    pub chip: String,
    /// Total memory (what the node could ever offer).
    pub memory_bytes: u64,
    /// Free memory now (reported, less what running jobs reserve).
    pub free_memory_bytes: u64,
    pub max_concurrent_jobs: u32,
    /// Jobs it runs now (placed before this fleet was built); with the
    /// fleet's own placements they set its batch's load.
    pub running_jobs: u32,
    /// Its aggregate decode speed by concurrent streams (empty: unknown).
    pub batch: BatchCurve,
    pub mode: Mode,
    /// Share of its past attempts that completed, in [0, 1], recent ones
    /// weighing most ([`Evidence::reliability`]); 1 for a new node.
    pub reliability: f64,
    /// SHA-256 digests of the model files it holds.
    pub cached: Vec<[u8; 32]>,
    pub capability: Capability,
}

impl NodeSpec {
    /// A node described by its chip, with table figures unless `measured`
    /// says otherwise; free = total, new (reliability 1), one job at a time.
    pub fn new(id: NodeId, chip: &str, memory_bytes: u64, mode: Mode, measured: &Measured) -> Self {
        NodeSpec {
            id,
            chip: chip.to_owned(),
            memory_bytes,
            free_memory_bytes: memory_bytes,
            max_concurrent_jobs: 1,
            running_jobs: 0,
            batch: BatchCurve::default(),
            mode,
            reliability: 1.0,
            cached: Vec::new(),
            capability: Capability::resolve(chip, measured),
        }
    }
}

/// Weight of the latest attempt in [`Evidence`]'s moving averages: each
/// older one counts half as much as the one after it.
pub const EVIDENCE_WEIGHT: f64 = 0.5;

/// What a node has shown, as exponentially weighted moving averages over
/// its attempts (so old evidence decays): the share that ended well, and
/// the memory bandwidth its verified claims' timings imply.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Evidence {
    /// In [0, 1]; 1 for a node with no attempt yet.
    pub reliability: f64,
    /// Bytes/s: bytes read per token x its claims' tokens / decode time;
    /// `None` until a claim showed it.
    pub bandwidth: Option<f64>,
}

impl Default for Evidence {
    fn default() -> Self {
        Evidence {
            reliability: 1.0,
            bandwidth: None,
        }
    }
}

impl Evidence {
    /// An attempt ended: completed (or handed off under a signed claim) or
    /// failed.
    pub fn attempt(&mut self, ok: bool) {
        let outcome = if ok { 1.0 } else { 0.0 };
        self.reliability += EVIDENCE_WEIGHT * (outcome - self.reliability);
    }

    /// A verified claim decoded `tokens` in `decode_s` seconds of a model
    /// reading `bytes_per_token` per token. Unusable figures (no tokens, no
    /// time, not finite) show nothing.
    pub fn decoded(&mut self, tokens: u32, decode_s: f64, bytes_per_token: f64) {
        let shown = f64::from(tokens) / decode_s * bytes_per_token;
        if tokens == 0 || !shown.is_finite() || shown <= 0.0 {
            return;
        }
        self.bandwidth = Some(match self.bandwidth {
            Some(b) => b + EVIDENCE_WEIGHT * (shown - b),
            None => shown,
        });
    }
}

impl NodeSpec {
    /// The node ranked on `evidence`: its reliability, and its memory
    /// bandwidth capped by what it showed (or, having shown nothing, by
    /// its chip's table figure).
    pub fn with_evidence(mut self, evidence: &Evidence) -> Self {
        self.reliability = evidence.reliability;
        let cap = match evidence.bandwidth {
            Some(value) => Figure {
                value,
                source: Source::Observed,
            },
            None => Capability::resolve(&self.chip, &Measured::default()).memory_bandwidth,
        };
        if cap.value.is_finite()
            && cap.value > 0.0
            && cap.value < self.capability.memory_bandwidth.value
        {
            self.capability.memory_bandwidth = cap;
        }
        self
    }
}

/// A pod: Macs joined by cables, gang-scheduled as one target.
#[derive(Clone, Debug, PartialEq)]
pub struct PodSpec {
    pub name: String,
    /// Rank 0 first (the leader, which downloads the model).
    pub members: Vec<NodeId>,
    /// One-way latency of one collective step between members, seconds
    /// (under 50 us with RDMA over Thunderbolt 5, about 300 us over TCP).
    pub link_latency_s: f64,
    /// Bytes/s of the slowest link between two members.
    pub link_bandwidth: f64,
}

impl PodSpec {
    /// Typical pod links: RDMA over Thunderbolt 5 when every member has it,
    /// else a TCP ring over Thunderbolt / Ethernet.
    pub fn typical(name: &str, members: Vec<NodeId>, all_thunderbolt5: bool) -> Self {
        let (link_latency_s, link_bandwidth) = if all_thunderbolt5 {
            (50e-6, 10e9)
        } else {
            (300e-6, 2.5e9)
        };
        PodSpec {
            name: name.to_owned(),
            members,
            link_latency_s,
            link_bandwidth,
        }
    }
}
