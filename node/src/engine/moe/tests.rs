//! Routing, the expert pass, and `qwen3moe` files through the engine:
//! a MoE whose experts all equal one dense MLP computes that dense model,
//! each chosen expert runs once per pass, batching changes nothing, and
//! malformed expert metadata is a typed error.

use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use candle_core::quantized::gguf_file::Value;
use candle_core::quantized::GgmlDType;

use super::*;
use crate::engine::gguf::GgufFile;
use crate::engine::testutil::{self, GgufTweaks, MoeSpec, TinySpec};
use crate::engine::{
    batch, Engine, GenerateRequest, Generation, PromptInput, Resume, Sampling, TokenChunk,
};

fn moe_spec(used: usize, identical: bool) -> TinySpec {
    TinySpec {
        moe: Some(MoeSpec {
            experts: 8,
            used,
            identical,
        }),
        ..TinySpec::new("qwen3moe")
    }
}

fn write(
    dir: &Path,
    name: &str,
    spec: &TinySpec,
    dtype: GgmlDType,
    tweaks: &GgufTweaks,
) -> PathBuf {
    let path = dir.join(format!("{name}-{dtype:?}.gguf"));
    testutil::write_gguf(&path, spec, dtype, tweaks);
    path
}

/// Last-position logits of `tokens` from a fresh cache.
fn logits(engine: &mut Engine, tokens: &[u32]) -> Vec<f32> {
    engine.model.reset(tokens.len());
    engine.model.forward(tokens).unwrap()
}

const PROMPT: [u32; 12] = [40, 71, 12, 99, 3, 250, 17, 17, 180, 64, 5, 200];

// ---------------------------------------------------------------- routing

#[test]
fn route_picks_the_k_most_probable_best_first_with_normalised_weights() {
    let logits = [0.5f32, 2.0, -1.0, 1.5, 2.0 - 1e-3];
    let mut out = Vec::new();
    route(&logits, 3, true, &mut out);
    let experts: Vec<usize> = out.iter().map(|c| c.0).collect();
    assert_eq!(experts, [1, 4, 3]);
    let sum: f32 = out.iter().map(|c| c.1).sum();
    assert!((sum - 1.0).abs() < 1e-6, "normalised weights sum to {sum}");
    assert!(out[0].1 > out[1].1 && out[1].1 > out[2].1);
    // The ratio of two weights is the ratio of their softmax probabilities.
    let want = (logits[1] - logits[3]).exp();
    assert!((out[0].1 / out[2].1 - want).abs() < 1e-5);

    // Without normalisation: the softmax probabilities themselves.
    let mut raw = Vec::new();
    route(&logits, 3, false, &mut raw);
    let z: f32 = logits.iter().map(|l| l.exp()).sum();
    for (e, w) in &raw {
        assert!((w - logits[*e].exp() / z).abs() < 1e-6, "{e}: {w}");
    }
    // One expert: its weight is exactly 1.
    let mut one = Vec::new();
    route(&logits, 1, true, &mut one);
    assert_eq!(one, [(1, 1.0)]);
    // Appends after what is there (one token after another).
    route(&logits, 2, true, &mut one);
    assert_eq!(one.len(), 3);
    assert_eq!(one[1].0, 1);
}

#[test]
fn route_breaks_ties_by_the_lower_expert_index() {
    let mut out = Vec::new();
    route(&[1.0, 3.0, 3.0, 0.0, 3.0], 2, true, &mut out);
    assert_eq!(out, [(1, 0.5), (2, 0.5)]);
    out.clear();
    route(&[0.0; 6], 4, false, &mut out);
    let experts: Vec<usize> = out.iter().map(|c| c.0).collect();
    assert_eq!(experts, [0, 1, 2, 3]);
    // A NaN logit (a broken file) routes somewhere rather than panicking.
    out.clear();
    route(&[f32::NAN, 1.0, 0.0], 2, true, &mut out);
    assert_eq!(out.len(), 2);
}

#[test]
fn by_expert_lists_each_used_expert_once_with_all_its_slots() {
    // Three tokens, k = 2: slots 0..6.
    let choices = [(3, 0.6), (0, 0.4), (0, 0.7), (3, 0.3), (5, 0.9), (3, 0.1)];
    let groups = by_expert(&choices, 8);
    assert_eq!(
        groups,
        vec![(0, vec![1, 2]), (3, vec![0, 3, 5]), (5, vec![4])]
    );
}

// ------------------------------------------------- deepseek2 routing

fn deepseek(used: usize, groups: usize, groups_used: usize, score: GroupScore) -> RouterSpec {
    RouterSpec {
        gating: Gating::Sigmoid,
        used,
        norm: false,
        scale: 1.0,
        groups,
        groups_used,
        group_score: score,
    }
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

fn experts_of(out: &[(usize, f32)]) -> Vec<usize> {
    out.iter().map(|c| c.0).collect()
}

#[test]
fn sigmoid_gating_normalises_then_applies_the_routed_scaling_factor() {
    let logits = [0.0f32, 2.0, -1.0, 1.0];
    let mut spec = deepseek(2, 1, 1, GroupScore::TopTwoSum);
    let mut out = Vec::new();
    route_grouped(&spec, &logits, None, &mut out);
    assert_eq!(out, [(1, sigmoid(2.0)), (3, sigmoid(1.0))]);
    spec.norm = true;
    spec.scale = 2.5;
    out.clear();
    route_grouped(&spec, &logits, None, &mut out);
    assert_eq!(experts_of(&out), [1, 3]);
    let sum: f32 = out.iter().map(|c| c.1).sum();
    assert!((sum - 2.5).abs() < 1e-6, "scaled weights sum to {sum}");
    assert!((out[0].1 / out[1].1 - sigmoid(2.0) / sigmoid(1.0)).abs() < 1e-6);
}

#[test]
fn the_selection_bias_changes_which_experts_not_their_weights() {
    let logits = [2.0f32, 1.0, 0.0, -1.0];
    let spec = deepseek(2, 1, 1, GroupScore::TopTwoSum);
    let mut out = Vec::new();
    route_grouped(&spec, &logits, Some(&[0.0, 0.0, 0.0, 5.0]), &mut out);
    assert_eq!(out, [(3, sigmoid(-1.0)), (0, sigmoid(2.0))]);
    // Without it, the two best by probability.
    out.clear();
    route_grouped(&spec, &logits, None, &mut out);
    assert_eq!(experts_of(&out), [0, 1]);
}

#[test]
fn grouped_top_k_chooses_only_from_the_best_groups() {
    // Four groups of two. Group 0 holds the single best expert (0.95) next
    // to a poor one (0.05); group 1 two good ones (0.7, 0.7).
    let logit = |p: f32| (p / (1.0 - p)).ln();
    let mut logits = vec![logit(0.1); 8];
    logits[0] = logit(0.95);
    logits[1] = logit(0.05);
    logits[2] = logit(0.7);
    logits[3] = logit(0.7);
    let mut out = Vec::new();
    // DeepSeek V3: groups by the sum of their two best: group 1 (1.4) wins.
    route_grouped(
        &deepseek(2, 4, 1, GroupScore::TopTwoSum),
        &logits,
        None,
        &mut out,
    );
    assert_eq!(experts_of(&out), [2, 3]);
    // DeepSeek V2: by their best: group 0 (0.95) wins.
    out.clear();
    route_grouped(&deepseek(2, 4, 1, GroupScore::Max), &logits, None, &mut out);
    assert_eq!(experts_of(&out), [0, 1]);
    // No grouping (or every group kept): the two best overall.
    for spec in [
        deepseek(2, 1, 1, GroupScore::TopTwoSum),
        deepseek(2, 4, 4, GroupScore::TopTwoSum),
    ] {
        out.clear();
        route_grouped(&spec, &logits, None, &mut out);
        assert_eq!(experts_of(&out), [0, 2], "{spec:?}");
    }
    // Two groups kept, four experts: both of each kept group.
    out.clear();
    route_grouped(
        &deepseek(4, 4, 2, GroupScore::TopTwoSum),
        &logits,
        None,
        &mut out,
    );
    assert_eq!(experts_of(&out), [0, 2, 3, 1]);
    // Equal groups: the lower-numbered ones are kept.
    out.clear();
    route_grouped(
        &deepseek(4, 4, 2, GroupScore::TopTwoSum),
        &[0.0; 8],
        None,
        &mut out,
    );
    assert_eq!(experts_of(&out), [0, 1, 2, 3]);
}

#[test]
fn router_specs_that_cannot_route_are_config_errors() {
    let ok = deepseek(4, 4, 2, GroupScore::TopTwoSum);
    ok.check(8).unwrap();
    let cases = [
        (
            RouterSpec {
                groups: 3,
                ..ok.clone()
            },
            "8 experts do not fall into 3 equal groups",
        ),
        (
            RouterSpec {
                groups_used: 0,
                ..ok.clone()
            },
            "0 groups used of 4",
        ),
        (
            RouterSpec {
                groups_used: 5,
                ..ok.clone()
            },
            "5 groups used of 4",
        ),
        (
            RouterSpec {
                used: 5,
                ..ok.clone()
            },
            "5 experts used, but the 2 best groups hold 4",
        ),
        (
            RouterSpec {
                used: 0,
                ..ok.clone()
            },
            "0 experts used",
        ),
        (
            RouterSpec {
                groups: 8,
                groups_used: 4,
                ..ok.clone()
            },
            "groups of one expert",
        ),
        (
            RouterSpec {
                scale: 0.0,
                ..ok.clone()
            },
            "routed scaling factor 0 is not positive",
        ),
    ];
    for (spec, want) in cases {
        match spec.check(8) {
            Err(EngineError::Config(msg)) => assert!(msg.contains(want), "{spec:?}: {msg}"),
            other => panic!("{spec:?}: expected a config error, got {other:?}"),
        }
    }
}

// ---------------------------------------------------------------- config

fn load_err(path: &Path) -> EngineError {
    match Engine::load(path) {
        Ok(_) => panic!("{} loaded but should not have", path.display()),
        Err(e) => e,
    }
}

#[test]
fn malformed_expert_metadata_is_a_config_error_naming_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let spec = moe_spec(2, false);
    let key = |k: &str| format!("qwen3moe.{k}");
    let cases: Vec<(&str, GgufTweaks, &str)> = vec![
        (
            "no-count",
            GgufTweaks {
                drop_meta: vec![key("expert_count")],
                ..GgufTweaks::default()
            },
            "expert_count missing",
        ),
        (
            "no-used",
            GgufTweaks {
                drop_meta: vec![key("expert_used_count")],
                ..GgufTweaks::default()
            },
            "expert_used_count missing",
        ),
        (
            "too-many-used",
            GgufTweaks {
                meta: vec![(key("expert_used_count"), Value::U32(9))],
                ..GgufTweaks::default()
            },
            "expert_used_count 9 must be between 1 and expert_count 8",
        ),
        (
            "none-used",
            GgufTweaks {
                meta: vec![(key("expert_used_count"), Value::U32(0))],
                ..GgufTweaks::default()
            },
            "expert_used_count 0",
        ),
        (
            "string-count",
            GgufTweaks {
                meta: vec![(key("expert_count"), Value::String("8".into()))],
                ..GgufTweaks::default()
            },
            "expert_count is not a non-negative integer",
        ),
        (
            "negative-count",
            GgufTweaks {
                meta: vec![(key("expert_count"), Value::I32(-8))],
                ..GgufTweaks::default()
            },
            "expert_count is not a non-negative integer",
        ),
        (
            "sigmoid",
            GgufTweaks {
                meta: vec![(key("expert_gating_func"), Value::U32(2))],
                ..GgufTweaks::default()
            },
            "expert_gating_func 2 (sigmoid) is not supported",
        ),
        (
            "unknown-gating",
            GgufTweaks {
                meta: vec![(key("expert_gating_func"), Value::U32(7))],
                ..GgufTweaks::default()
            },
            "expert_gating_func 7 is unknown",
        ),
        (
            "norm-not-bool",
            GgufTweaks {
                meta: vec![(key("expert_weights_norm"), Value::U32(1))],
                ..GgufTweaks::default()
            },
            "expert_weights_norm is not a bool",
        ),
    ];
    for (name, tweaks, want) in cases {
        let path = write(dir.path(), name, &spec, GgmlDType::F32, &tweaks);
        match load_err(&path) {
            EngineError::Config(msg) => assert!(msg.contains(want), "{name}: {msg}"),
            other => panic!("{name}: expected a config error, got {other}"),
        }
    }
}

#[test]
fn missing_or_misshapen_expert_tensors_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let spec = moe_spec(2, false);
    for gone in ["blk.1.ffn_up_exps.weight", "blk.0.ffn_gate_inp.weight"] {
        let tweaks = GgufTweaks {
            drop_tensor: Some(gone.into()),
            ..GgufTweaks::default()
        };
        let path = write(dir.path(), "drop", &spec, GgmlDType::Q8_0, &tweaks);
        match load_err(&path) {
            EngineError::MissingTensor { name } => assert_eq!(name, gone),
            other => panic!("expected {gone} missing, got {other}"),
        }
    }
    // The file says 4 experts, its tensors hold 8.
    let tweaks = GgufTweaks {
        meta: vec![("qwen3moe.expert_count".into(), Value::U32(4))],
        ..GgufTweaks::default()
    };
    let path = write(dir.path(), "count", &spec, GgmlDType::Q8_0, &tweaks);
    match load_err(&path) {
        EngineError::TensorShape { name, actual, .. } => {
            assert_eq!(name, "blk.0.ffn_gate_inp.weight");
            assert_eq!(actual, [8, spec.hidden]);
        }
        other => panic!("expected a shape error, got {other}"),
    }
}

#[test]
fn config_and_parameter_counts_follow_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let spec = moe_spec(2, false);
    let path = write(
        dir.path(),
        "m",
        &spec,
        GgmlDType::Q8_0,
        &GgufTweaks::default(),
    );
    let engine = Engine::load(&path).unwrap();
    let cfg = engine.model.cfg();
    assert!(cfg.qk_norm && !cfg.rope_interleaved && !cfg.qkv_bias);
    assert_eq!(
        cfg.moe,
        Some(MoeConfig {
            experts: 8,
            used: 2,
            expert_ffn: spec.ffn,
            norm_top_k: true,
            gating: Gating::Softmax,
        })
    );
    let (h, ff) = (spec.hidden as u64, spec.ffn as u64);
    let attn = (2 * (spec.heads + spec.kv_heads) * spec.head_dim) as u64 * h
        + 2 * spec.head_dim as u64
        + 2 * h;
    let vocab = testutil::tiny_vocab().len() as u64;
    let outside = 2 * vocab * h + h;
    let layers = spec.layers as u64;
    let info = engine.info();
    assert_eq!(
        info.parameters,
        outside + layers * (attn + 8 * h + 8 * 3 * ff * h)
    );
    assert_eq!(
        info.active_parameters,
        outside + layers * (attn + 8 * h + 2 * 3 * ff * h)
    );
    // The catalogue's facts, from the header alone, agree.
    let facts = crate::engine::describe_gguf(&path).unwrap();
    assert_eq!(
        (facts.parameters, facts.active_parameters),
        (info.parameters, info.active_parameters)
    );
    // A dense model reads all its weights.
    let dense = write(
        dir.path(),
        "d",
        &TinySpec::new("qwen3"),
        GgmlDType::Q8_0,
        &GgufTweaks::default(),
    );
    let d = Engine::load(&dense).unwrap();
    assert_eq!(d.info().active_parameters, d.info().parameters);
    let facts = crate::engine::describe_gguf(&dense).unwrap();
    assert_eq!(facts.active_parameters, facts.parameters);
}

// ---------------------------------------------------------------- the pass

/// The dense `qwen3` twin of a `moe_spec`: the same attention, norms and
/// embeddings, and the MLP every identical expert copies.
fn dense_twin() -> TinySpec {
    TinySpec {
        ffn: TinySpec::new("qwen3moe").ffn,
        ..TinySpec::new("qwen3")
    }
}

#[test]
fn identical_experts_compute_the_dense_model() {
    let dir = tempfile::tempdir().unwrap();
    for dtype in [GgmlDType::F32, GgmlDType::F16, GgmlDType::Q8_0] {
        let none = GgufTweaks::default();
        let mut dense =
            Engine::load(&write(dir.path(), "dense", &dense_twin(), dtype, &none)).unwrap();
        let want = logits(&mut dense, &PROMPT);
        // One expert per token: its weight is exactly 1. With our quantized
        // kernels (each row's result independent of the rows beside it)
        // the logits are the dense model's bit for bit; float weights go
        // through candle's gemm, whose rows round differently with the
        // row count (an expert's tokens are a subset of the pass).
        let one = write(dir.path(), "one", &moe_spec(1, true), dtype, &none);
        let mut one = Engine::load(&one).unwrap();
        let got = logits(&mut one, &PROMPT);
        if dtype == GgmlDType::Q8_0 {
            assert_eq!(got, want, "{dtype:?}, k = 1");
        } else {
            let off = worst(&got, &want);
            assert!(off < 1e-4, "{dtype:?}, k = 1: off by {off}");
        }
        // Two: w0 * y + w1 * y with w0 + w1 = 1, within f32 rounding.
        let two = write(dir.path(), "two", &moe_spec(2, true), dtype, &none);
        let mut two = Engine::load(&two).unwrap();
        let off = worst(&logits(&mut two, &PROMPT), &want);
        assert!(off < 1e-4, "{dtype:?}, k = 2: off by {off}");
    }
    // Experts drawn on their own compute something else.
    let other = write(
        dir.path(),
        "other",
        &moe_spec(2, false),
        GgmlDType::F32,
        &GgufTweaks::default(),
    );
    let mut other = Engine::load(&other).unwrap();
    let mut dense = Engine::load(&write(
        dir.path(),
        "dense",
        &dense_twin(),
        GgmlDType::F32,
        &GgufTweaks::default(),
    ))
    .unwrap();
    assert_ne!(logits(&mut other, &PROMPT), logits(&mut dense, &PROMPT));
}

#[test]
fn k_quant_experts_compute_the_dense_model_bit_for_bit() {
    // Experts 256 wide, so every projection holds whole Q4_K / Q6_K blocks.
    let dir = tempfile::tempdir().unwrap();
    let none = GgufTweaks::default();
    for dtype in [GgmlDType::Q4K, GgmlDType::Q6K] {
        let dense_spec = TinySpec {
            ffn: 256,
            ..TinySpec::new("qwen3")
        };
        let moe = TinySpec {
            ffn: 256,
            ..moe_spec(1, true)
        };
        let mut dense =
            Engine::load(&write(dir.path(), "dense", &dense_spec, dtype, &none)).unwrap();
        let mut one = Engine::load(&write(dir.path(), "one", &moe, dtype, &none)).unwrap();
        assert_eq!(
            logits(&mut one, &PROMPT),
            logits(&mut dense, &PROMPT),
            "{dtype:?}"
        );
    }
}

#[test]
fn each_expert_of_the_file_is_that_expert_of_the_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let spec = moe_spec(2, false);
    let path = write(
        dir.path(),
        "m",
        &spec,
        GgmlDType::F32,
        &GgufTweaks::default(),
    );
    let (ffn, h, _) = first_layer(&path);
    let drawn = testutil::hf_weights(&spec);
    let ff = spec.ffn;
    for (e, ex) in ffn.experts.iter().enumerate() {
        for (name, lin, inp) in [("up_proj", &ex.up, h), ("down_proj", &ex.down, ff)] {
            let want = drawn[&format!("model.layers.0.mlp.experts.{e}.{name}.weight")]
                .to_vec2::<f32>()
                .unwrap();
            // A unit input picks out one column of the weight, exactly.
            for j in [0, inp / 2, inp - 1] {
                let mut x = vec![0f32; inp];
                x[j] = 1.0;
                let col = lin.forward_slice(&x, 1).unwrap();
                let expect: Vec<f32> = want.iter().map(|row| row[j]).collect();
                assert_eq!(col, expect, "expert {e} {name} column {j}");
            }
        }
    }
}

/// Largest absolute difference.
fn worst(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len());
    got.iter()
        .zip(want)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max)
}

/// The first layer's `MoeFfn` of a file.
fn first_layer(path: &Path) -> (MoeFfn, usize, usize) {
    let file = GgufFile::open(path).unwrap();
    let vocab = file.tensors["token_embd.weight"].shape[0];
    let cfg = crate::engine::config::ModelConfig::from_gguf(&file.metadata, Some(vocab)).unwrap();
    let moe = cfg.moe.clone().unwrap();
    let ffn = MoeFfn::load(&moe, &WeightSource::Gguf(&file), 0, cfg.hidden_size).unwrap();
    (ffn, cfg.hidden_size, moe.used)
}

/// Test input rows: varied enough to route to different experts.
fn rows(s: usize, h: usize) -> Vec<f32> {
    (0..s * h)
        .map(|i| ((i * 7919 % 1000) as f32 / 500.0 - 1.0) * 1.5)
        .collect()
}

#[test]
fn a_pass_runs_each_chosen_expert_once_over_all_its_tokens() {
    let dir = tempfile::tempdir().unwrap();
    let path = write(
        dir.path(),
        "m",
        &moe_spec(2, false),
        GgmlDType::Q8_0,
        &GgufTweaks::default(),
    );
    let (ffn, h, k) = first_layer(&path);
    let s = 24;
    EXPERT_RUNS.with(|r| r.borrow_mut().clear());
    ffn.forward(&rows(s, h), s, Activation::Silu).unwrap();
    let runs = EXPERT_RUNS.with(|r| std::mem::take(&mut *r.borrow_mut()));
    let mut experts: Vec<usize> = runs.iter().map(|r| r.1).collect();
    experts.dedup();
    assert_eq!(experts.len(), runs.len(), "an expert ran twice: {runs:?}");
    assert_eq!(runs.iter().map(|r| r.2).sum::<usize>(), s * k, "{runs:?}");
    assert!(runs.len() > 2, "the router used only {runs:?}");

    // Through the whole model: per layer, each expert at most once.
    let mut engine = Engine::load(&path).unwrap();
    EXPERT_RUNS.with(|r| r.borrow_mut().clear());
    logits(&mut engine, &PROMPT);
    let runs = EXPERT_RUNS.with(|r| std::mem::take(&mut *r.borrow_mut()));
    for layer in 0..2 {
        let mine: Vec<_> = runs.iter().filter(|r| r.0 == layer).collect();
        let mut experts: Vec<usize> = mine.iter().map(|r| r.1).collect();
        experts.sort_unstable();
        experts.dedup();
        assert_eq!(experts.len(), mine.len(), "layer {layer}: {mine:?}");
        assert_eq!(mine.iter().map(|r| r.2).sum::<usize>(), PROMPT.len() * k);
    }
}

/// Each token's output computed the plain way: every expert of the
/// token's top-k (by a full sort) run on that token alone.
fn per_token(ffn: &MoeFfn, x: &[f32], s: usize, h: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(s * h);
    for t in 0..s {
        let xt = &x[t * h..(t + 1) * h];
        let logits = ffn.router.forward_slice(xt, 1).unwrap();
        let z: f32 = logits.iter().map(|l| l.exp()).sum();
        let mut p: Vec<(usize, f32)> = logits.iter().map(|l| l.exp() / z).enumerate().collect();
        p.sort_by(|a, b| b.1.total_cmp(&a.1));
        let top = &p[..ffn.used];
        let norm: f32 = top.iter().map(|c| c.1).sum();
        let mut acc = vec![0f32; h];
        for &(e, w) in top {
            let ex = &ffn.experts[e];
            let mut g = ex.gate.forward_slice(xt, 1).unwrap();
            let u = ex.up.forward_slice(xt, 1).unwrap();
            crate::engine::ops::swiglu(&mut g, &u);
            let y = ex.down.forward_slice(&g, 1).unwrap();
            for (a, v) in acc.iter_mut().zip(&y) {
                *a += v * w / norm;
            }
        }
        out.extend(acc);
    }
    out
}

#[test]
fn the_grouped_pass_equals_each_token_alone() {
    let dir = tempfile::tempdir().unwrap();
    for dtype in [GgmlDType::F32, GgmlDType::Q8_0] {
        let path = write(
            dir.path(),
            "m",
            &moe_spec(2, false),
            dtype,
            &GgufTweaks::default(),
        );
        let (ffn, h, _) = first_layer(&path);
        let s = 16;
        let x = rows(s, h);
        let all = ffn.forward(&x, s, Activation::Silu).unwrap();
        let scale = all.iter().map(|v| v.abs()).fold(0f32, f32::max);
        // A row's output does not depend on the pass: bit for bit through
        // our kernels (Q8_0), up to candle gemm's rounding for f32.
        for t in 0..s {
            let row = &all[t * h..(t + 1) * h];
            let alone = ffn
                .forward(&x[t * h..(t + 1) * h], 1, Activation::Silu)
                .unwrap();
            if dtype == GgmlDType::Q8_0 {
                assert_eq!(alone, row, "{dtype:?}: row {t}");
            } else {
                assert!(worst(&alone, row) <= 1e-5 * scale, "{dtype:?}: row {t}");
            }
        }
        // And the plain per-token computation agrees up to rounding.
        let off = worst(&all, &per_token(&ffn, &x, s, h));
        assert!(off <= 1e-5 * scale, "{dtype:?}: off by {off} of {scale}");
    }
}

// ---------------------------------------------------------------- the engine

fn greedy_text(prompt: &str) -> GenerateRequest {
    GenerateRequest {
        input: PromptInput::Text(prompt.into()),
        sampling: Sampling {
            max_tokens: 12,
            ..Sampling::default()
        },
        resume: Resume::default(),
    }
}

type Ends = Arc<Mutex<Vec<Option<Generation>>>>;

struct Keep {
    index: usize,
    ends: Ends,
}

impl batch::JobSink for Keep {
    fn token(&mut self, _: &TokenChunk) -> ControlFlow<()> {
        ControlFlow::Continue(())
    }
    fn done(self: Box<Self>, result: Result<Generation, EngineError>) {
        self.ends.lock().unwrap()[self.index] = Some(result.unwrap());
    }
}

#[test]
fn the_engine_generates_alike_alone_and_in_a_continuous_batch() {
    let dir = tempfile::tempdir().unwrap();
    let path = write(
        dir.path(),
        "m",
        &moe_spec(2, false),
        GgmlDType::Q8_0,
        &GgufTweaks::default(),
    );
    let mut engine = Engine::load(&path).unwrap();
    assert_eq!(engine.info().architecture, "qwen3moe");
    let prompts = [
        "hello world",
        "the world of hell",
        "or he",
        "wor wor hello he",
    ];
    let requests: Vec<GenerateRequest> = prompts.iter().map(|p| greedy_text(p)).collect();
    let alone: Vec<Generation> = requests
        .iter()
        .map(|r| {
            engine
                .generate(r, &mut |_| ControlFlow::Continue(()))
                .unwrap()
        })
        .collect();
    assert!(alone.iter().any(|g| !g.output_token_ids.is_empty()));
    let cfg = batch::BatchConfig {
        slots: requests.len(),
        kv_pages: 64,
        step_tokens: 8,
        prefix_cache: true,
    };
    let mut b = batch::Batcher::new(&engine.model, engine.text.clone(), cfg).unwrap();
    let ends: Ends = Arc::new(Mutex::new(vec![None; requests.len()]));
    let mut step = 0;
    loop {
        for (i, r) in requests.iter().enumerate() {
            if 2 * i == step {
                let sink = Keep {
                    index: i,
                    ends: ends.clone(),
                };
                b.submit(r, Box::new(sink), std::time::Instant::now());
            }
        }
        let worked = b.step(&mut engine.model);
        step += 1;
        assert!(step < 10_000, "the batch does not finish");
        if step > 2 * requests.len() && !worked && b.is_idle() {
            break;
        }
    }
    let ends = std::mem::take(&mut *ends.lock().unwrap());
    for (i, (end, solo)) in ends.into_iter().zip(&alone).enumerate() {
        let end = end.unwrap_or_else(|| panic!("job {i} got no answer"));
        assert_eq!(end.output_token_ids, solo.output_token_ids, "prompt {i}");
        assert_eq!(end.text, solo.text, "prompt {i}");
    }
}

#[test]
fn a_device_backend_runs_it_on_the_cpu_path_and_pods_refuse_it() {
    let dir = tempfile::tempdir().unwrap();
    let path = write(
        dir.path(),
        "m",
        &moe_spec(2, false),
        GgmlDType::Q8_0,
        &GgufTweaks::default(),
    );
    let backend = crate::engine::device::Backend::Device(candle_core::Device::Cpu);
    let mut on_device = Engine::load_on(&path, &backend).unwrap();
    assert_eq!(on_device.backend(), "cpu");
    let mut native = Engine::load(&path).unwrap();
    assert_eq!(
        logits(&mut on_device, &PROMPT),
        logits(&mut native, &PROMPT)
    );

    let plan = crate::engine::sharded::PodPlan::Pipeline {
        layers: vec![0..1, 1..2],
    };
    let err = match crate::engine::sharded::PodModel::load_gguf(
        &path,
        plan,
        0,
        crate::engine::sharded::Compute::Native,
    ) {
        Ok(_) => panic!("a pod loaded a mixture-of-experts file"),
        Err(e) => e,
    };
    assert!(err.to_string().contains("mixture-of-experts"), "{err}");
}
