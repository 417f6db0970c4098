//! Mixture-of-Experts feed-forward: a router picks `k` of `n` expert MLPs per
//! token and the token's output is their weighted sum (Qwen3-MoE, GGUF
//! architecture `qwen3moe`; its attention is Qwen3's, the block is
//! [`super::model::Block`] with this as its feed-forward).
//!
//! As llama.cpp's `build_moe_ffn` (softmax gating, as `llm_build_qwen3moe`
//! calls it) and Hugging Face's `Qwen3MoeSparseMoeBlock`:
//! - router logits `x · Wrᵀ` (`ffn_gate_inp`, `[experts, hidden]`), softmax
//!   over all experts (sum accumulated in f64, scaled by its inverse, as
//!   ggml's `soft_max`);
//! - the `k` most probable experts, best first; equal probabilities are
//!   ranked by the lower expert index (a fixed rule, so a tie never depends
//!   on the pass);
//! - with `expert_weights_norm` (the default for `qwen3moe`, which llama.cpp
//!   hard-codes and Qwen3-MoE's `norm_topk_prob` sets), the chosen
//!   probabilities divided by their sum (clamped below at f16's smallest
//!   normal, as llama.cpp does);
//! - each chosen expert's SwiGLU MLP (`ffn_{gate,up,down}_exps`, stacked
//!   `[experts, ff, hidden]` / `[experts, hidden, ff]`), its output times its
//!   weight, and the token's slots summed in rank order (best first).
//!
//! # Invariants
//! - In one pass each chosen expert runs once, over all the tokens routed to
//!   it (one matrix product per projection); an expert no token chose is
//!   never read.
//! - A token's output depends on that token alone, bit for bit, whatever
//!   else shares the pass (routing is per token, the kernels are row-local,
//!   the sum runs in rank order), so continuous batching and chunked
//!   prefill keep their guarantees.
//!
//! # Failure
//! [`EngineError::Config`] for missing or inconsistent expert metadata
//! (no experts, more used than there are, a gating function we do not
//! compute); weights are checked by shape when loaded.

use super::config::Activation;
use super::gguf::MetaValue;
use super::linear::Linear;
use super::weights::WeightSource;
use super::EngineError;

/// llama.cpp's lower clamp of the top-k weight sum (f16's smallest normal).
const MIN_WEIGHT_SUM: f32 = 6.103_515_6e-5;

/// How a router's logits become probabilities (GGUF `expert_gating_func`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gating {
    /// Softmax over every expert (Qwen3-MoE, Mixtral, DeepSeek V2).
    Softmax,
    /// An independent sigmoid per expert (DeepSeek V3, Kimi K2).
    #[cfg_attr(
        not(test),
        allow(
            dead_code,
            reason = "deepseek2 routing: unit-tested, its model is to come"
        )
    )]
    Sigmoid,
}

/// How a group of experts is scored for grouped top-k.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(
    not(test),
    allow(
        dead_code,
        reason = "deepseek2 routing: unit-tested, its model is to come"
    )
)]
pub enum GroupScore {
    /// The sum of the group's two best selection scores (DeepSeek V3's
    /// `noaux_tc`, llama.cpp's `deepseek2`).
    TopTwoSum,
    /// The group's best selection score (DeepSeek V2's `group_limited_greedy`).
    Max,
}

/// A DeepSeek-style router (`deepseek2` in GGUF): gating function, an
/// optional selection bias, grouped top-k, normalisation and the routed
/// scaling factor. Not yet wired to a model: the `deepseek2` architecture
/// (MLA attention, shared experts, leading dense layers) is still to come.
#[derive(Debug, Clone, PartialEq)]
pub struct RouterSpec {
    pub gating: Gating,
    /// Experts chosen per token.
    pub used: usize,
    /// Divide the chosen weights by their sum (`expert_weights_norm`).
    pub norm: bool,
    /// Multiply the final weights by this (`expert_weights_scale`).
    pub scale: f32,
    /// Experts fall into this many equal groups (`expert_group_count`; 1: no grouping).
    pub groups: usize,
    /// Only the best this many groups may be chosen from (`expert_group_used_count`).
    pub groups_used: usize,
    pub group_score: GroupScore,
}

impl RouterSpec {
    /// Checks the spec against `experts` experts.
    #[cfg_attr(
        not(test),
        allow(
            dead_code,
            reason = "deepseek2 routing: unit-tested, its model is to come"
        )
    )]
    pub fn check(&self, experts: usize) -> Result<(), EngineError> {
        let bad = |msg: String| Err(EngineError::Config(format!("router: {msg}")));
        if self.groups == 0 || !experts.is_multiple_of(self.groups) {
            return bad(format!(
                "{experts} experts do not fall into {} equal groups",
                self.groups
            ));
        }
        if self.groups_used == 0 || self.groups_used > self.groups {
            return bad(format!(
                "{} groups used of {}",
                self.groups_used, self.groups
            ));
        }
        let reachable = self.groups_used * (experts / self.groups);
        if self.used == 0 || self.used > reachable {
            return bad(format!(
                "{} experts used, but the {} best groups hold {reachable}",
                self.used, self.groups_used
            ));
        }
        if self.group_score == GroupScore::TopTwoSum && self.groups > 1 && experts / self.groups < 2
        {
            return bad("groups of one expert have no two best".into());
        }
        if !(self.scale.is_finite() && self.scale > 0.0) {
            return bad(format!(
                "routed scaling factor {} is not positive",
                self.scale
            ));
        }
        Ok(())
    }
}

/// Indices of `scores` by descending score, equal scores by lower index
/// (NaN ranks as equal rather than panicking).
fn ranked(scores: &[f32]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..scores.len()).collect();
    order.sort_by(|&a, &b| {
        scores[b]
            .partial_cmp(&scores[a])
            .unwrap_or(std::cmp::Ordering::Equal)
    });
    order
}

/// Appends one token's `spec.used` choices `(expert, weight)`, best first,
/// as llama.cpp's `build_moe_ffn` computes them: probabilities by the
/// gating function; selection scores are the probabilities plus `bias`
/// (DeepSeek V3's `e_score_correction_bias`, `exp_probs_b`); with groups,
/// only experts of the `groups_used` best groups (by `group_score` of their
/// selection scores) compete; the weights are the chosen experts'
/// probabilities (not biased), normalised if asked, then times `scale`.
/// `spec` was checked against `logits.len()` experts ([`RouterSpec::check`]).
pub(crate) fn route_grouped(
    spec: &RouterSpec,
    logits: &[f32],
    bias: Option<&[f32]>,
    out: &mut Vec<(usize, f32)>,
) {
    let probs: Vec<f32> = match spec.gating {
        Gating::Softmax => softmax(logits),
        Gating::Sigmoid => logits.iter().map(|&l| 1.0 / (1.0 + (-l).exp())).collect(),
    };
    let mut select: Vec<f32> = match bias {
        Some(b) => probs.iter().zip(b).map(|(p, b)| p + b).collect(),
        None => probs.clone(),
    };
    if spec.groups > 1 && spec.groups_used < spec.groups {
        let per = select.len() / spec.groups;
        let group_scores: Vec<f32> = select
            .chunks_exact(per)
            .map(|g| {
                let order = ranked(g);
                match spec.group_score {
                    GroupScore::Max => g[order[0]],
                    GroupScore::TopTwoSum => g[order[0]] + g[order[1]],
                }
            })
            .collect();
        let keep = ranked(&group_scores);
        for &dropped in &keep[spec.groups_used..] {
            select[dropped * per..(dropped + 1) * per].fill(f32::NEG_INFINITY);
        }
    }
    let start = out.len();
    out.extend(
        ranked(&select)
            .into_iter()
            .take(spec.used)
            .map(|e| (e, probs[e])),
    );
    let chosen = &mut out[start..];
    if spec.norm {
        let sum = chosen.iter().map(|&(_, w)| f64::from(w)).sum::<f64>() as f32;
        let sum = sum.max(MIN_WEIGHT_SUM);
        for (_, w) in chosen.iter_mut() {
            *w /= sum;
        }
    }
    if spec.scale != 1.0 {
        for (_, w) in chosen.iter_mut() {
            *w *= spec.scale;
        }
    }
}

/// ggml's softmax: exponentials of `logits - max`, summed in f64, scaled by
/// the inverse of the sum.
fn softmax(logits: &[f32]) -> Vec<f32> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut probs: Vec<f32> = logits.iter().map(|&l| (l - max).exp()).collect();
    let sum: f64 = probs.iter().map(|&p| f64::from(p)).sum();
    let inv = (1.0 / sum) as f32;
    for p in &mut probs {
        *p *= inv;
    }
    probs
}

/// The routed-experts part of a model's config.
#[derive(Debug, Clone, PartialEq)]
pub struct MoeConfig {
    /// Experts per layer.
    pub experts: usize,
    /// Experts chosen per token (`k`).
    pub used: usize,
    /// Hidden size of one expert's MLP.
    pub expert_ffn: usize,
    /// Divide the chosen weights by their sum.
    pub norm_top_k: bool,
    pub gating: Gating,
}

impl MoeConfig {
    /// From `<arch>.*` GGUF metadata (`meta(k)` reads `<arch>.<k>`);
    /// `dense_ffn` is `<arch>.feed_forward_length`, from which llama.cpp
    /// derives the expert size when the file does not give it.
    pub(crate) fn from_gguf<'a>(
        meta: &dyn Fn(&str) -> Option<&'a MetaValue>,
        arch: &str,
        dense_ffn: usize,
    ) -> Result<Self, EngineError> {
        let bad = |msg: String| EngineError::Config(format!("{arch}.{msg}"));
        let int = |k: &str| -> Result<Option<usize>, EngineError> {
            match meta(k) {
                None => Ok(None),
                Some(v) => v
                    .as_u64()
                    .and_then(|v| usize::try_from(v).ok())
                    .map(Some)
                    .ok_or_else(|| bad(format!("{k} is not a non-negative integer: {v:?}"))),
            }
        };
        let experts = int("expert_count")?.ok_or_else(|| bad("expert_count missing".into()))?;
        let used =
            int("expert_used_count")?.ok_or_else(|| bad("expert_used_count missing".into()))?;
        if experts == 0 || used == 0 || used > experts {
            return Err(bad(format!(
                "expert_used_count {used} must be between 1 and expert_count {experts}"
            )));
        }
        let expert_ffn = match int("expert_feed_forward_length")? {
            Some(n) => n,
            None => dense_ffn / used,
        };
        if expert_ffn == 0 {
            return Err(bad("expert_feed_forward_length is 0".into()));
        }
        let norm_top_k = match meta("expert_weights_norm") {
            None => true,
            Some(v) => v
                .as_bool()
                .ok_or_else(|| bad(format!("expert_weights_norm is not a bool: {v:?}")))?,
        };
        // llama.cpp's `llama_expert_gating_func_type`: 0 unset, 1 softmax, 2 sigmoid.
        let gating = match int("expert_gating_func")? {
            None | Some(0) | Some(1) => Gating::Softmax,
            Some(2) => {
                return Err(bad(
                    "expert_gating_func 2 (sigmoid) is not supported for this architecture".into(),
                ))
            }
            Some(other) => return Err(bad(format!("expert_gating_func {other} is unknown"))),
        };
        Ok(MoeConfig {
            experts,
            used,
            expert_ffn,
            norm_top_k,
            gating,
        })
    }
}

/// Appends one token's `k` choices `(expert, weight)`, best first, given its
/// router `logits` (one per expert). Probabilities as ggml's softmax; equal
/// ones ranked by the lower index; with `norm`, weights divided by their sum.
pub(crate) fn route(logits: &[f32], k: usize, norm: bool, out: &mut Vec<(usize, f32)>) {
    let spec = RouterSpec {
        gating: Gating::Softmax,
        used: k,
        norm,
        scale: 1.0,
        groups: 1,
        groups_used: 1,
        group_score: GroupScore::Max,
    };
    route_grouped(&spec, logits, None, out);
}

/// The slots (`token * k + rank`) routed to each expert, for the experts
/// that have any, in expert order; each slot appears once.
pub(crate) fn by_expert(choices: &[(usize, f32)], experts: usize) -> Vec<(usize, Vec<usize>)> {
    let mut groups: Vec<Vec<usize>> = vec![Vec::new(); experts];
    for (slot, &(e, _)) in choices.iter().enumerate() {
        groups[e].push(slot);
    }
    groups
        .into_iter()
        .enumerate()
        .filter(|(_, slots)| !slots.is_empty())
        .collect()
}

/// One expert's SwiGLU MLP.
#[derive(Debug, Clone)]
pub(crate) struct Expert {
    gate: Linear,
    up: Linear,
    down: Linear,
}

/// One layer's router and experts.
#[derive(Debug, Clone)]
pub(crate) struct MoeFfn {
    router: Linear,
    experts: Vec<Expert>,
    used: usize,
    norm_top_k: bool,
    /// The layer's index (for the test record of expert runs).
    #[cfg_attr(not(test), allow(dead_code, reason = "read by the test record only"))]
    layer: usize,
}

#[cfg(test)]
thread_local! {
    /// Every expert run on this thread: (layer, expert, rows).
    pub(crate) static EXPERT_RUNS: std::cell::RefCell<Vec<(usize, usize, usize)>> =
        const { std::cell::RefCell::new(Vec::new()) };
    /// For every token routed on this thread, the router's margin: its
    /// k-th best logit minus its (k+1)-th (none when every expert is used).
    /// A small one is a near tie, where a rounding difference upstream may
    /// choose another expert.
    pub(crate) static ROUTER_MARGINS: std::cell::RefCell<Vec<f32>> =
        const { std::cell::RefCell::new(Vec::new()) };
}

impl MoeFfn {
    /// Layer `i`'s router `blk.i.ffn_gate_inp` and stacked experts
    /// `blk.i.ffn_{gate,up,down}_exps`.
    pub(crate) fn load(
        cfg: &MoeConfig,
        w: &WeightSource<'_>,
        i: usize,
        hidden: usize,
    ) -> Result<Self, EngineError> {
        let p = |s: &str| format!("blk.{i}.{s}");
        let (n, ff) = (cfg.experts, cfg.expert_ffn);
        let router = w.linear(&p("ffn_gate_inp"), n, hidden, false)?;
        let gates = w.experts(&p("ffn_gate_exps"), n, ff, hidden)?;
        let ups = w.experts(&p("ffn_up_exps"), n, ff, hidden)?;
        let downs = w.experts(&p("ffn_down_exps"), n, hidden, ff)?;
        let experts = gates
            .into_iter()
            .zip(ups)
            .zip(downs)
            .map(|((gate, up), down)| Expert { gate, up, down })
            .collect();
        Ok(MoeFfn {
            router,
            experts,
            used: cfg.used,
            norm_top_k: cfg.norm_top_k,
            layer: i,
        })
    }

    /// Weights held, and weights one token reads.
    pub(crate) fn parameters(&self) -> (u64, u64) {
        let lin = |l: &Linear| (l.out_features() * l.in_features()) as u64;
        let router = lin(&self.router);
        let expert = |e: &Expert| lin(&e.gate) + lin(&e.up) + lin(&e.down);
        let per = self.experts.first().map_or(0, expert);
        (
            router + self.experts.iter().map(expert).sum::<u64>(),
            router + self.used as u64 * per,
        )
    }

    /// The feed-forward output of `x` = `[s][hidden]` (normed input), `[s][hidden]`.
    pub(crate) fn forward(
        &self,
        x: &[f32],
        s: usize,
        act: Activation,
    ) -> candle_core::Result<Vec<f32>> {
        let h = self.router.in_features();
        let n = self.experts.len();
        let k = self.used;
        let logits = self.router.forward_slice(x, s)?;
        let mut choices = Vec::with_capacity(s * k);
        for row in logits.chunks_exact(n) {
            route(row, k, self.norm_top_k, &mut choices);
            #[cfg(test)]
            if k < n {
                let order = ranked(row);
                ROUTER_MARGINS.with(|m| m.borrow_mut().push(row[order[k - 1]] - row[order[k]]));
            }
        }
        // Each slot's weighted expert output.
        let mut slots = vec![0f32; s * k * h];
        for (e, routed) in by_expert(&choices, n) {
            let rows = routed.len();
            #[cfg(test)]
            EXPERT_RUNS.with(|r| r.borrow_mut().push((self.layer, e, rows)));
            let mut xe = Vec::with_capacity(rows * h);
            for &slot in &routed {
                let t = slot / k;
                xe.extend_from_slice(&x[t * h..(t + 1) * h]);
            }
            let ex = &self.experts[e];
            let [mut g, u] = Linear::forward_shared([&ex.gate, &ex.up], &xe, rows)?;
            super::model::activate(act, &mut g, &u);
            let y = ex.down.forward_slice(&g, rows)?;
            for (yr, &slot) in y.chunks_exact(h).zip(&routed) {
                let w = choices[slot].1;
                for (o, v) in slots[slot * h..(slot + 1) * h].iter_mut().zip(yr) {
                    *o = v * w;
                }
            }
        }
        let mut out = vec![0f32; s * h];
        for (t, o) in out.chunks_exact_mut(h).enumerate() {
            o.copy_from_slice(&slots[t * k * h..(t * k + 1) * h]);
            for r in 1..k {
                let slot = t * k + r;
                super::ops::add_assign(o, &slots[slot * h..(slot + 1) * h]);
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod reference_tests;
#[cfg(test)]
mod tests;
