//! Gemma 3, the second architecture: what it adds to the Llama-family block.
//!
//! As in llama.cpp's `llm_build_gemma3_iswa` (and Google's `gemma_pytorch`):
//! - token embeddings are multiplied by `sqrt(hidden)` (in f32, as llama.cpp
//!   does; Hugging Face rounds the factor to bf16);
//! - per layer: `h = x + post_attn_norm(attn(attn_norm(x)))`, then
//!   `x = h + post_ffw_norm(down(gelu(gate(ffn_norm(h))) * up(ffn_norm(h))))`:
//!   RMS norms after attention and after the feed-forward, before each
//!   residual add (the GGUF converter already added Gemma's `1 +` to every
//!   norm weight);
//! - q and k get a per-head RMS norm before the rotary embedding (NeoX
//!   layout: the two halves of each head);
//! - interleaved attention: five sliding-window layers (a query sees the
//!   last `sliding_window` positions, itself included; rotary base 10,000)
//!   then one global layer (`rope.freq_base`, 1,000,000 for Gemma 3), so
//!   layer `i` is global when `i % 6 == 5`;
//! - attention logits scaled by `1 / sqrt(head_dim)` (27B: `1 / sqrt(hidden
//!   / heads)`, as `query_pre_attn_scalar` says);
//! - GeGLU with GELU's tanh approximation, computed as ggml's CPU backend
//!   does: the input rounded to f16, GELU looked up per f16 value and
//!   rounded to f16 ([`gelu_f16`]); inputs beyond ±10 are 0 or themselves;
//! - the output head is tied to the embedding.
//!
//! The block itself is [`super::model::Block`] (so pods shard Gemma like
//! Llama); this module reads the configuration and holds the pieces only
//! Gemma uses.
//!
//! # Failure
//! [`EngineError::Config`] for an invalid window or pattern in the file.

use std::sync::OnceLock;

use super::config::{Activation, ModelConfig, SlidingWindow};
use super::gguf::MetaValue;
use super::EngineError;

/// Gemma 3's local/global layer pattern when the file does not give one.
const DEFAULT_PATTERN: usize = 6;
/// Rotary base of the sliding-window layers (llama.cpp's
/// `rope_freq_base_train_swa` for Gemma 3).
const LOCAL_ROPE_THETA: f32 = 10_000.0;

/// Completes a Llama-style `cfg` read from a `gemma3` GGUF; `meta(k)` reads
/// `gemma3.<k>`.
pub(crate) fn from_gguf<'a>(
    mut cfg: ModelConfig,
    meta: &dyn Fn(&str) -> Option<&'a MetaValue>,
) -> Result<ModelConfig, EngineError> {
    let int = |k: &str| meta(k).and_then(MetaValue::as_u64).map(|v| v as usize);
    cfg.rope_interleaved = false;
    cfg.qk_norm = true;
    cfg.post_norms = true;
    cfg.activation = Activation::GeluTanh;
    cfg.embed_scale = (cfg.hidden_size as f32).sqrt();
    // 27B (62 layers) scales by hidden / heads, the others by the head dimension.
    cfg.attn_scale = if cfg.layers == 62 {
        1.0 / ((cfg.hidden_size / cfg.heads) as f32).sqrt()
    } else {
        1.0 / (cfg.head_dim as f32).sqrt()
    };
    if cfg.rms_eps == 1e-5 && meta("attention.layer_norm_rms_epsilon").is_none() {
        cfg.rms_eps = 1e-6;
    }
    cfg.sliding_window = match int("attention.sliding_window") {
        Some(0) | None => None,
        Some(window) => Some(SlidingWindow {
            window,
            pattern: int("attention.sliding_window_pattern").unwrap_or(DEFAULT_PATTERN),
            rope_theta: LOCAL_ROPE_THETA,
        }),
    };
    if let Some(w) = &cfg.sliding_window {
        if w.pattern == 1 {
            return Err(EngineError::Config(
                "gemma3.attention.sliding_window_pattern 1 leaves no windowed layer".into(),
            ));
        }
    }
    Ok(cfg)
}

/// GELU, tanh approximation, as ggml's `ggml_gelu_f32`.
fn gelu_tanh(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    const COEF_A: f32 = 0.044_715;
    0.5 * x * (1.0 + (SQRT_2_OVER_PI * x * (1.0 + COEF_A * x * x)).tanh())
}

/// GELU as ggml's CPU backend computes it (`GGML_GELU_FP16`): 0 below -10,
/// `x` above 10, else the f16-rounded GELU of the f16-rounded input, from a
/// table of every f16.
pub fn gelu_f16(x: f32) -> f32 {
    static TABLE: OnceLock<Vec<f32>> = OnceLock::new();
    if x <= -10.0 {
        return 0.0;
    }
    if x >= 10.0 {
        return x;
    }
    let table = TABLE.get_or_init(|| {
        (0..=u16::MAX)
            .map(|bits| {
                let v = half::f16::from_bits(bits).to_f32();
                half::f16::from_f32(gelu_tanh(v)).to_f32()
            })
            .collect()
    });
    table[usize::from(half::f16::from_f32(x).to_bits())]
}

/// In place: `gate[i] <- gelu(gate[i]) * up[i]` (ggml's `geglu`).
pub fn geglu(gate: &mut [f32], up: &[f32]) {
    for (g, u) in gate.iter_mut().zip(up) {
        *g = gelu_f16(*g) * u;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gelu_follows_ggml_cut_offs_and_rounding() {
        assert_eq!(gelu_f16(-10.5), 0.0);
        assert_eq!(gelu_f16(12.25), 12.25);
        assert_eq!(gelu_f16(0.0), 0.0);
        // Close to the exact tanh form, and f16 values.
        for i in -400..400 {
            let x = i as f32 / 40.0;
            let y = gelu_f16(x);
            assert_eq!(half::f16::from_f32(y).to_f32(), y, "{x}: not an f16 value");
            assert!(
                (y - gelu_tanh(x)).abs() <= 4e-3 * (1.0 + x.abs()),
                "{x}: {y}"
            );
        }
        let (mut g, u) = (vec![1.0f32, -20.0, 3.0], vec![2.0f32, 5.0, 0.5]);
        geglu(&mut g, &u);
        assert_eq!(g, vec![gelu_f16(1.0) * 2.0, 0.0, gelu_f16(3.0) * 0.5]);
    }

    #[test]
    fn five_local_layers_then_one_global() {
        let w = SlidingWindow {
            window: 512,
            pattern: 6,
            rope_theta: 1e4,
        };
        let local: Vec<bool> = (0..12).map(|i| w.applies(i)).collect();
        assert_eq!(
            local,
            [true, true, true, true, true, false, true, true, true, true, true, false]
        );
        let all = SlidingWindow { pattern: 0, ..w };
        assert!((0..7).all(|i| all.applies(i)));
    }
}
