//! The cost model: how much memory a job needs and how long it would take on
//! a node or a pod.
//!
//! - memory = weights + KV cache for prompt + max_tokens (2 x layers x
//!   kv_heads x head_dim x bytes per element, per token) + 10% overhead
//!   (activations, allocator slack); a pod splits it evenly across its
//!   members (heads and feed-forward columns), each member must hold its
//!   share.
//! - time = download (weights / internet, only if not cached) + prefill
//!   (2 x parameters x prompt tokens / compute) + max_tokens x (bytes read
//!   per token / memory bandwidth + pod communication per token).
//!
//! Bytes read per token are the weights (the active experts' share for a
//! mixture of experts) plus the KV cache at the middle of
//! the generation. A pod member reads its share of both, and the slowest
//! member sets the pace; pod communication is two all-reduces of the hidden
//! state per layer (attention and feed-forward), each costing one link
//! latency plus the ring's 2 (n - 1) / n x hidden x 2 bytes over the link.
//!
//! A node that batches (continuous batching) runs several jobs at once for
//! a little more than the time of one: a job placed beside `k - 1` running
//! ones decodes at the node's per-stream speed at `k` streams, read from its
//! [`BatchCurve`] (`mlx-node bench --batch`: aggregate tokens/s by streams);
//! its per-token time is the lone stream's times the curve's
//! [`BatchCurve::slowdown`]. A node without a curve gets no credit: its `k`
//! jobs share one stream's speed (slowdown `k`).
//!
//! # Invariants
//! - Pure arithmetic on its inputs; every result is finite and >= 0 for
//!   positive figures (guaranteed by [`super::capability::Figure`] and by
//!   [`BatchCurve::new`], which drops unusable points).

/// Fraction of memory added for activations and allocator slack.
pub const OVERHEAD_DIVISOR: u64 = 10;
/// Bytes per element of the hidden state exchanged by pod all-reduces (f16).
const ACTIVATION_BYTES: f64 = 2.0;

/// What the cost model needs to know about a model (from the catalogue).
#[derive(Clone, Debug, PartialEq)]
pub struct ModelShape {
    pub id: String,
    pub sha256: [u8; 32],
    pub parameters: u64,
    /// Parameters used per token (mixture of experts); equal to
    /// `parameters` for a dense model.
    pub active_parameters: u64,
    /// Size of the weights file: what is downloaded and held.
    pub weights_bytes: u64,
    pub layers: u32,
    pub kv_heads: u32,
    pub head_dim: u32,
    pub hidden_size: u32,
    /// Bytes per element of the KV cache (4 for f32, 2 for f16).
    pub kv_element_bytes: u32,
    pub context_length: u32,
}

impl ModelShape {
    /// KV-cache bytes per token of context: 2 (k and v) x layers x kv_heads x
    /// head_dim x bytes per element.
    pub fn kv_bytes_per_token(&self) -> u64 {
        2 * u64::from(self.layers)
            * u64::from(self.kv_heads)
            * u64::from(self.head_dim)
            * u64::from(self.kv_element_bytes)
    }
}

/// One job, as the cost model sees it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct JobShape<'a> {
    pub model: &'a ModelShape,
    /// Prompt tokens (an upper bound is fine: bytes of prompt text).
    pub prompt_tokens: u32,
    pub max_tokens: u32,
}

impl JobShape<'_> {
    /// Tokens of context the job may use, capped at the model's context.
    pub fn context_tokens(&self) -> u64 {
        (u64::from(self.prompt_tokens) + u64::from(self.max_tokens))
            .min(u64::from(self.model.context_length.max(1)))
    }

    /// Memory to hold the job on one machine.
    pub fn memory_needed(&self) -> u64 {
        let raw =
            self.model.weights_bytes + self.context_tokens() * self.model.kv_bytes_per_token();
        raw + raw / OVERHEAD_DIVISOR
    }

    /// Memory each of `members` machines holds when a pod runs the job.
    pub fn memory_per_member(&self, members: usize) -> u64 {
        self.memory_needed().div_ceil(members.max(1) as u64)
    }

    /// Bytes read from memory per generated token (whole model): the active
    /// share of the weights plus the KV cache at mid-generation.
    pub fn bytes_per_token(&self) -> f64 {
        let mid_context = u64::from(self.prompt_tokens) + u64::from(self.max_tokens) / 2;
        let mid_context = mid_context.min(u64::from(self.model.context_length.max(1)));
        self.model.weights_bytes as f64 * self.active_share()
            + (mid_context * self.model.kv_bytes_per_token()) as f64
    }

    /// FLOPs of the prefill.
    pub fn prefill_flops(&self) -> f64 {
        2.0 * self.model.parameters as f64 * self.active_share() * f64::from(self.prompt_tokens)
    }

    fn active_share(&self) -> f64 {
        if self.model.parameters == 0 || self.model.active_parameters == 0 {
            1.0
        } else {
            (self.model.active_parameters as f64 / self.model.parameters as f64).min(1.0)
        }
    }
}

/// Estimated completion of a job on one target, in seconds.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Estimate {
    pub download_s: f64,
    pub prefill_s: f64,
    /// Seconds per generated token (memory reads plus pod communication).
    pub per_token_s: f64,
    /// Of which pod communication.
    pub comm_per_token_s: f64,
    pub total_s: f64,
}

impl Estimate {
    /// Decode rate the estimate implies.
    pub fn tokens_per_s(&self) -> f64 {
        if self.per_token_s > 0.0 {
            1.0 / self.per_token_s
        } else {
            f64::INFINITY
        }
    }
}

impl Estimate {
    /// The estimate of a job that shares the target with others: every
    /// token takes `slowdown` times as long (see [`BatchCurve::slowdown`]).
    pub fn shared(self, job: &JobShape<'_>, slowdown: f64) -> Estimate {
        let per_token_s = self.per_token_s * slowdown.max(1.0);
        Estimate {
            per_token_s,
            total_s: self.download_s + self.prefill_s + f64::from(job.max_tokens) * per_token_s,
            ..self
        }
    }
}

/// A node's aggregate decode speed by concurrent streams, as it measured
/// it: points sorted by streams, the first at one stream, every speed
/// finite and positive.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct BatchCurve {
    points: Vec<(u32, f64)>,
}

impl BatchCurve {
    /// From reported `(streams, tokens/s)` points. Unusable ones (no
    /// streams, a speed that is not finite and positive) are dropped, a
    /// repeated stream count keeps its first point; without a point at one
    /// stream (the base of every ratio) the curve is empty.
    pub fn new(points: impl IntoIterator<Item = (u32, f64)>) -> BatchCurve {
        let mut kept: Vec<(u32, f64)> = Vec::new();
        for (streams, speed) in points {
            if streams == 0 || !speed.is_finite() || speed <= 0.0 {
                continue;
            }
            if kept.iter().all(|&(s, _)| s != streams) {
                kept.push((streams, speed));
            }
        }
        kept.sort_by_key(|&(s, _)| s);
        if kept.first().is_some_and(|&(s, _)| s == 1) {
            BatchCurve { points: kept }
        } else {
            BatchCurve::default()
        }
    }

    pub fn is_empty(&self) -> bool {
        self.points.is_empty()
    }

    /// Aggregate speed at `streams` (>= 1): linear between measured
    /// points, flat past the last one.
    fn aggregate(&self, streams: u32) -> Option<f64> {
        let &(last_s, last_v) = self.points.last()?;
        if streams >= last_s {
            return Some(last_v);
        }
        let i = self.points.partition_point(|&(s, _)| s <= streams);
        let ((s0, v0), (s1, v1)) = (self.points[i - 1], self.points[i]);
        let t = f64::from(streams - s0) / f64::from(s1 - s0);
        Some(v0 + (v1 - v0) * t)
    }

    /// How many times longer each token of one stream takes when `streams`
    /// run at once than when it runs alone: `streams x speed(1) /
    /// speed(streams)`, at least 1 (a measurement where more streams were
    /// each faster is noise). Without a curve: `streams` (no batching gain).
    pub fn slowdown(&self, streams: u32) -> f64 {
        let streams = streams.max(1);
        match (self.aggregate(1), self.aggregate(streams)) {
            (Some(one), Some(many)) => (f64::from(streams) * one / many).max(1.0),
            _ => f64::from(streams),
        }
    }
}

/// Performance figures of a target (a node, or a pod's aggregate).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Speeds {
    /// Bytes/s of the slowest member's memory.
    pub memory_bandwidth: f64,
    /// FLOP/s of the whole target.
    pub compute: f64,
    /// Bytes/s of the link that downloads the model.
    pub internet: f64,
}

/// Pod links, for the communication term.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PodLinks {
    pub members: usize,
    pub latency_s: f64,
    pub bandwidth: f64,
}

/// The estimate for `job` on a target with `speeds`; `pod` is None for one Mac.
pub fn estimate(
    job: &JobShape<'_>,
    speeds: &Speeds,
    cached: bool,
    pod: Option<&PodLinks>,
) -> Estimate {
    let download_s = if cached {
        0.0
    } else {
        job.model.weights_bytes as f64 / speeds.internet
    };
    let prefill_s = job.prefill_flops() / speeds.compute;
    let (share, comm_per_token_s) = match pod {
        Some(p) if p.members > 1 => {
            let n = p.members as f64;
            let bytes = 2.0 * (n - 1.0) / n * f64::from(job.model.hidden_size) * ACTIVATION_BYTES;
            let per_all_reduce = p.latency_s + bytes / p.bandwidth;
            (1.0 / n, 2.0 * f64::from(job.model.layers) * per_all_reduce)
        }
        _ => (1.0, 0.0),
    };
    let per_token_s = job.bytes_per_token() * share / speeds.memory_bandwidth + comm_per_token_s;
    Estimate {
        download_s,
        prefill_s,
        per_token_s,
        comm_per_token_s,
        total_s: download_s + prefill_s + f64::from(job.max_tokens) * per_token_s,
    }
}
