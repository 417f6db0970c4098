//! Hyper-parameters of a Llama-family model, from GGUF metadata or a
//! Hugging Face `config.json`.
//!
//! # Invariants
//! - A [`ModelConfig`] is internally consistent: heads divide the hidden size
//!   (or an explicit head dimension is given), kv heads divide heads, the
//!   rotary dimension is even and at most the head dimension, every size is
//!   non-zero. Model code relies on this and does not re-check.
//!
//! # Failure
//! [`EngineError::UnsupportedArchitecture`] for an architecture we have no
//! code for; [`EngineError::Config`] naming the missing or inconsistent key.

use std::collections::HashMap;

use serde::Deserialize;

use super::gguf::MetaValue;
use super::moe::MoeConfig;
use super::EngineError;

/// Which Llama-family variant; decides biases, norms and RoPE layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Architecture {
    /// Llama 2/3, SmolLM2, Mistral (GGUF calls all of these "llama").
    Llama,
    /// Qwen2: biases on the q, k and v projections.
    Qwen2,
    /// Qwen3: RMS norm on each head of q and k, no biases.
    Qwen3,
    /// Qwen3-MoE: Qwen3's attention, routed experts as the feed-forward
    /// (`super::moe`).
    Qwen3Moe,
    /// Gemma 3 (`super::gemma3`): q/k norms, norms after attention and the
    /// feed-forward, GeGLU, scaled embeddings, sliding-window layers.
    Gemma3,
}

impl Architecture {
    pub fn parse(name: &str) -> Result<Self, EngineError> {
        match name {
            "llama" | "mistral" => Ok(Architecture::Llama),
            "qwen2" => Ok(Architecture::Qwen2),
            "qwen3" => Ok(Architecture::Qwen3),
            "qwen3moe" => Ok(Architecture::Qwen3Moe),
            "gemma3" | "gemma3_text" => Ok(Architecture::Gemma3),
            other => Err(EngineError::UnsupportedArchitecture(other.to_string())),
        }
    }
}

/// The feed-forward's gate activation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// SwiGLU: `silu(gate) * up`.
    Silu,
    /// GeGLU with the tanh approximation of GELU (Gemma).
    GeluTanh,
}

/// Sliding-window attention on some layers.
#[derive(Debug, Clone, PartialEq)]
pub struct SlidingWindow {
    /// A query sees the keys of the last `window` positions (itself included).
    pub window: usize,
    /// Layer `i` is windowed unless `i % pattern == pattern - 1` (Gemma 3:
    /// 6, five local layers then one global); 0 windows every layer.
    pub pattern: usize,
    /// Rotary base of the windowed layers.
    pub rope_theta: f32,
}

impl SlidingWindow {
    /// Whether layer `layer` attends through the window.
    pub fn applies(&self, layer: usize) -> bool {
        self.pattern == 0 || layer % self.pattern < self.pattern - 1
    }
}

/// How rotary positions are scaled.
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    None,
    /// Positions divided by `factor`.
    Linear {
        factor: f32,
    },
    /// Per-frequency divisors (Llama 3's scheme; GGUF stores them as the
    /// `rope_freqs.weight` tensor, config.json as parameters).
    FreqFactors(Vec<f32>),
}

/// Everything the model code needs to know about the shapes.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    /// The name as written in the file ("llama", "mistral", "qwen2", ...).
    pub architecture_name: String,
    pub architecture: Architecture,
    pub hidden_size: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub intermediate_size: usize,
    pub vocab_size: usize,
    pub context_length: usize,
    pub rms_eps: f32,
    pub rope_theta: f32,
    /// Number of leading dimensions of each head that are rotated.
    pub rope_dims: usize,
    /// Rotate adjacent pairs (GGUF "llama", whose q/k weights were permuted by
    /// the converter) rather than the two halves of each head (Hugging Face
    /// layout, GGUF qwen2/qwen3).
    pub rope_interleaved: bool,
    pub rope_scaling: RopeScaling,
    pub qkv_bias: bool,
    pub qk_norm: bool,
    pub activation: Activation,
    /// RMS norms on the attention and feed-forward outputs before the
    /// residual adds (Gemma).
    pub post_norms: bool,
    /// Token embeddings are multiplied by this (Gemma: `sqrt(hidden)`).
    pub embed_scale: f32,
    /// Scale of the attention logits (`1 / sqrt(head_dim)` unless the
    /// model says otherwise).
    pub attn_scale: f32,
    pub sliding_window: Option<SlidingWindow>,
    /// Routed experts in place of every layer's dense feed-forward.
    pub moe: Option<MoeConfig>,
}

impl ModelConfig {
    fn validate(self) -> Result<Self, EngineError> {
        let bad = |msg: String| Err(EngineError::Config(msg));
        for (name, v) in [
            ("hidden size", self.hidden_size),
            ("layer count", self.layers),
            ("head count", self.heads),
            ("kv head count", self.kv_heads),
            ("head dimension", self.head_dim),
            ("feed-forward size", self.intermediate_size),
            ("vocabulary size", self.vocab_size),
            ("context length", self.context_length),
        ] {
            if v == 0 {
                return bad(format!("{name} is 0"));
            }
        }
        if self.head_dim > super::ops::MAX_HEAD_DIM {
            return bad(format!(
                "head dimension {} is above the supported {}",
                self.head_dim,
                super::ops::MAX_HEAD_DIM
            ));
        }
        if !self.heads.is_multiple_of(self.kv_heads) {
            return bad(format!(
                "{} heads are not a multiple of {} kv heads",
                self.heads, self.kv_heads
            ));
        }
        if self.rope_dims == 0
            || !self.rope_dims.is_multiple_of(2)
            || self.rope_dims > self.head_dim
        {
            return bad(format!(
                "rotary dimension {} must be even and at most the head dimension {}",
                self.rope_dims, self.head_dim
            ));
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 0.0) {
            return bad(format!("rope theta {} is not positive", self.rope_theta));
        }
        if !(self.rms_eps.is_finite() && self.rms_eps >= 0.0) {
            return bad(format!("rms norm epsilon {} is invalid", self.rms_eps));
        }
        let positive = |v: f32| v.is_finite() && v > 0.0;
        if !positive(self.embed_scale) || !positive(self.attn_scale) {
            return bad(format!(
                "embedding scale {} and attention scale {} must be positive",
                self.embed_scale, self.attn_scale
            ));
        }
        if let Some(w) = &self.sliding_window {
            if w.window == 0 || !(w.rope_theta.is_finite() && w.rope_theta > 0.0) {
                return bad(format!(
                    "sliding window {} with rope theta {} is invalid",
                    w.window, w.rope_theta
                ));
            }
        }
        match &self.rope_scaling {
            RopeScaling::Linear { factor } if !(factor.is_finite() && *factor > 0.0) => {
                return bad(format!("rope scaling factor {factor} is not positive"))
            }
            RopeScaling::FreqFactors(f) if f.len() != self.rope_dims / 2 => {
                return bad(format!(
                    "{} rope frequency factors for rotary dimension {}",
                    f.len(),
                    self.rope_dims
                ))
            }
            _ => {}
        }
        Ok(self)
    }

    /// From GGUF metadata. `vocab_len` is the tokenizer's vocabulary size, used
    /// when `<arch>.vocab_size` is absent (most files).
    pub fn from_gguf(
        meta: &HashMap<String, MetaValue>,
        vocab_len: Option<usize>,
    ) -> Result<Self, EngineError> {
        let arch_name = meta
            .get("general.architecture")
            .and_then(MetaValue::as_str)
            .ok_or_else(|| EngineError::Config("missing general.architecture".into()))?
            .to_string();
        let architecture = Architecture::parse(&arch_name)?;
        let key = |k: &str| format!("{arch_name}.{k}");
        let int = |k: &str| -> Result<usize, EngineError> {
            let full = key(k);
            meta.get(&full)
                .and_then(MetaValue::as_u64)
                .and_then(|v| usize::try_from(v).ok())
                .ok_or_else(|| EngineError::Config(format!("missing or invalid {full}")))
        };
        let opt_int = |k: &str| -> Option<usize> {
            meta.get(&key(k))
                .and_then(MetaValue::as_u64)
                .and_then(|v| usize::try_from(v).ok())
        };
        let opt_f32 = |k: &str| -> Option<f32> {
            meta.get(&key(k))
                .and_then(MetaValue::as_f64)
                .map(|v| v as f32)
        };
        let hidden_size = int("embedding_length")?;
        let heads = int("attention.head_count")?;
        let kv_heads = opt_int("attention.head_count_kv").unwrap_or(heads);
        let head_dim = match opt_int("attention.key_length") {
            Some(d) => d,
            None if heads > 0 && hidden_size % heads == 0 => hidden_size / heads,
            None => {
                return Err(EngineError::Config(format!(
                    "hidden size {hidden_size} is not a multiple of {heads} heads"
                )))
            }
        };
        let vocab_size = match opt_int("vocab_size").or(vocab_len) {
            Some(v) => v,
            None => {
                return Err(EngineError::Config(format!(
                    "missing {}",
                    key("vocab_size")
                )))
            }
        };
        let rope_scaling = match meta
            .get(&key("rope.scaling.type"))
            .and_then(MetaValue::as_str)
        {
            None | Some("none") => RopeScaling::None,
            Some("linear") => RopeScaling::Linear {
                factor: opt_f32("rope.scaling.factor").unwrap_or(1.0),
            },
            Some(other) => {
                return Err(EngineError::Config(format!(
                    "unsupported rope scaling type {other:?}"
                )))
            }
        };
        let gemma = architecture == Architecture::Gemma3;
        let intermediate_size = int("feed_forward_length")?;
        let moe = match architecture {
            Architecture::Qwen3Moe => Some(MoeConfig::from_gguf(
                &|k| meta.get(&key(k)),
                &arch_name,
                intermediate_size,
            )?),
            _ => None,
        };
        let cfg = ModelConfig {
            architecture,
            hidden_size,
            layers: int("block_count")?,
            heads,
            kv_heads,
            head_dim,
            intermediate_size,
            vocab_size,
            context_length: int("context_length")?,
            rms_eps: opt_f32("attention.layer_norm_rms_epsilon").unwrap_or(1e-5),
            rope_theta: opt_f32("rope.freq_base").unwrap_or(10_000.0),
            rope_dims: opt_int("rope.dimension_count").unwrap_or(head_dim),
            rope_interleaved: architecture == Architecture::Llama,
            rope_scaling,
            qkv_bias: architecture == Architecture::Qwen2,
            qk_norm: matches!(
                architecture,
                Architecture::Qwen3 | Architecture::Qwen3Moe | Architecture::Gemma3
            ),
            activation: Activation::Silu,
            post_norms: false,
            embed_scale: 1.0,
            attn_scale: 1.0 / (head_dim as f32).sqrt(),
            sliding_window: None,
            moe,
            architecture_name: arch_name.clone(),
        };
        if gemma {
            super::gemma3::from_gguf(cfg, &|k| meta.get(&key(k)))?.validate()
        } else {
            cfg.validate()
        }
    }

    /// From a Hugging Face `config.json`.
    pub fn from_json(text: &str) -> Result<Self, EngineError> {
        let c: HfConfig = serde_json::from_str(text)
            .map_err(|e| EngineError::Config(format!("config.json: {e}")))?;
        let arch_name = c
            .model_type
            .clone()
            .ok_or_else(|| EngineError::Config("config.json: missing model_type".into()))?;
        let architecture = Architecture::parse(&arch_name)?;
        if architecture == Architecture::Qwen3Moe {
            return Err(EngineError::UnsupportedArchitecture(format!(
                "{arch_name} from safetensors (use its GGUF)"
            )));
        }
        if architecture == Architecture::Gemma3 {
            // Gemma's norms are stored as `w - 1` in checkpoints (GGUF adds
            // the 1); only its GGUF form is read here.
            return Err(EngineError::UnsupportedArchitecture(format!(
                "{arch_name} from safetensors (use its GGUF)"
            )));
        }
        let heads = c.num_attention_heads;
        let head_dim = match c.head_dim {
            Some(d) => d,
            None if heads > 0 && c.hidden_size.is_multiple_of(heads) => c.hidden_size / heads,
            None => {
                return Err(EngineError::Config(format!(
                    "config.json: hidden_size {} is not a multiple of {heads} heads",
                    c.hidden_size
                )))
            }
        };
        let rope_theta = c.rope_theta.unwrap_or(10_000.0) as f32;
        let rope_scaling = match &c.rope_scaling {
            None => RopeScaling::None,
            Some(s) => {
                let kind = s.rope_type.as_deref().or(s.r#type.as_deref()).unwrap_or("");
                match kind {
                    "default" => RopeScaling::None,
                    "linear" => RopeScaling::Linear {
                        factor: s.factor.unwrap_or(1.0) as f32,
                    },
                    "llama3" => {
                        RopeScaling::FreqFactors(llama3_freq_factors(head_dim, rope_theta, s)?)
                    }
                    other => {
                        return Err(EngineError::Config(format!(
                            "config.json: unsupported rope_scaling type {other:?}"
                        )))
                    }
                }
            }
        };
        ModelConfig {
            architecture,
            hidden_size: c.hidden_size,
            layers: c.num_hidden_layers,
            heads,
            kv_heads: c.num_key_value_heads.unwrap_or(heads),
            head_dim,
            intermediate_size: c.intermediate_size,
            vocab_size: c.vocab_size,
            context_length: c.max_position_embeddings.unwrap_or(4096),
            rms_eps: c.rms_norm_eps.unwrap_or(1e-6) as f32,
            rope_theta,
            rope_dims: head_dim,
            rope_interleaved: false,
            rope_scaling,
            qkv_bias: c
                .attention_bias
                .unwrap_or(architecture == Architecture::Qwen2),
            qk_norm: architecture == Architecture::Qwen3,
            activation: Activation::Silu,
            post_norms: false,
            embed_scale: 1.0,
            attn_scale: 1.0 / (head_dim as f32).sqrt(),
            sliding_window: None,
            moe: None,
            architecture_name: arch_name,
        }
        .validate()
    }
}

/// Llama 3's per-frequency divisors, as llama.cpp's converter computes them.
fn llama3_freq_factors(
    head_dim: usize,
    theta: f32,
    s: &HfRopeScaling,
) -> Result<Vec<f32>, EngineError> {
    let missing = |k: &str| EngineError::Config(format!("config.json: rope_scaling.{k} missing"));
    let factor = s.factor.ok_or_else(|| missing("factor"))?;
    let low = s.low_freq_factor.unwrap_or(1.0);
    let high = s.high_freq_factor.unwrap_or(4.0);
    let old_ctx = s
        .original_max_position_embeddings
        .ok_or_else(|| missing("original_max_position_embeddings"))? as f64;
    if high <= low {
        return Err(EngineError::Config(
            "config.json: rope_scaling.high_freq_factor must exceed low_freq_factor".into(),
        ));
    }
    let low_wavelen = old_ctx / low;
    let high_wavelen = old_ctx / high;
    Ok((0..head_dim / 2)
        .map(|i| {
            let freq = 1.0 / (theta as f64).powf(2.0 * i as f64 / head_dim as f64);
            let wavelen = 2.0 * std::f64::consts::PI / freq;
            let f = if wavelen < high_wavelen {
                1.0
            } else if wavelen > low_wavelen {
                factor
            } else {
                let smooth = (old_ctx / wavelen - low) / (high - low);
                1.0 / ((1.0 - smooth) / factor + smooth)
            };
            f as f32
        })
        .collect())
}

#[derive(Debug, Deserialize)]
struct HfRopeScaling {
    rope_type: Option<String>,
    r#type: Option<String>,
    factor: Option<f64>,
    low_freq_factor: Option<f64>,
    high_freq_factor: Option<f64>,
    original_max_position_embeddings: Option<usize>,
}

#[derive(Debug, Deserialize)]
struct HfConfig {
    model_type: Option<String>,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    vocab_size: usize,
    max_position_embeddings: Option<usize>,
    rms_norm_eps: Option<f64>,
    rope_theta: Option<f64>,
    rope_scaling: Option<HfRopeScaling>,
    attention_bias: Option<bool>,
}
