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

use mlxnet_proto::{chips, ids::NodeId};

use super::cost::BatchCurve;

/// Bandwidth assumed for a machine the chip table does not know (bytes/s):
/// a dual-channel DDR5 desktop.
pub const ASSUMED_MEMORY_BANDWIDTH: f64 = 50e9;
/// Compute assumed for a machine the chip table does not know (FLOP/s).
pub const ASSUMED_COMPUTE: f64 = 1e12;
/// Internet link assumed when the node has not measured one: 100 Mbit/s.
pub const ASSUMED_INTERNET: f64 = 12.5e6;

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
}

impl Source {
    pub fn as_str(self) -> &'static str {
        match self {
            Source::Measured => "measured",
            Source::Table => "table",
            Source::Assumed => "assumed",
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
    /// Share of its past attempts that completed, in [0, 1]; 1 for a new node.
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
