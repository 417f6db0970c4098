//! The engine on candle's device abstraction: the same Llama-family model as
//! `model` (Llama 2/3, SmolLM2, Mistral, Qwen2 bias, Qwen3 q/k norm), with
//! every weight matmul a candle `QMatMul` on the device, norms, rotary
//! embedding, attention and softmax as device tensor ops (candle-nn's fused
//! kernels where it has them), and the KV cache preallocated on the device.
//!
//! One code path serves every candle device: `Device::Metal` on a Mac
//! (feature `metal`), `Device::Cuda` (feature `cuda`), and `Device::Cpu`,
//! on which the test suite runs it against the fast CPU path (`model` with
//! our own kernels), so the device path is tested on every machine.
//!
//! [`DeviceChoice`] is what the owner asks for (`--device auto|cpu|metal|cuda`);
//! [`resolve`] turns it into a [`Backend`]: `cpu` is the fast CPU path, `auto`
//! takes Metal (then CUDA) when compiled in and present, else the fast CPU path.
//!
//! # Numerics
//! Chosen to follow the fast path (and llama.cpp) where it matters for
//! greedy decoding: keys and values are stored as f16 (llama.cpp's default
//! cache), queries and attention probabilities are rounded to f16 before
//! their products, everything else is f32; the rotary angles come from the
//! same recurrence ([`super::ops::Rope::cos_sin`]). Matmul accumulation
//! order differs by device, so the two paths agree up to near ties.
//!
//! # Invariants
//! - The cache holds `capacity` positions per layer, allocated on the device
//!   at the first pass after [`DeviceModel::reset`] asked for more than it
//!   has; tokens are written in place (`slice_set`), never concatenated.
//! - Only token ids and logits cross between host and device (and the
//!   embedding rows of the tokens in a pass).
//!
//! # Failure
//! A device that is compiled out is [`DeviceError::NotCompiledWith`] (never a
//! panic, never a silent fallback when it was asked for by name); one that is
//! compiled in but absent is [`DeviceError::Unavailable`]. Candle errors
//! during a pass are [`EngineError::Candle`].

use std::fmt;
use std::str::FromStr;

use candle_core::quantized::QMatMul;
use candle_core::{DType, Device, Module, Tensor, D};

use super::batch::{Logits, SeqChunk};
use super::config::ModelConfig;
use super::model::{rope_for, Model};
use super::ops::Rope;
use super::weights::{Embedding, WeightSource};
use super::EngineError;

/// The compute device the owner asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DeviceChoice {
    /// Metal when compiled in and present, then CUDA, else the CPU.
    #[default]
    Auto,
    /// The fast CPU path (our kernels).
    Cpu,
    /// Apple's GPU through candle's Metal backend (feature `metal`).
    Metal,
    /// An NVIDIA GPU through candle's CUDA backend (feature `cuda`).
    Cuda,
}

impl FromStr for DeviceChoice {
    type Err = DeviceError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(Self::Auto),
            "cpu" => Ok(Self::Cpu),
            "metal" => Ok(Self::Metal),
            "cuda" => Ok(Self::Cuda),
            _ => Err(DeviceError::Unknown(s.to_owned())),
        }
    }
}

impl fmt::Display for DeviceChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Auto => "auto",
            Self::Cpu => "cpu",
            Self::Metal => "metal",
            Self::Cuda => "cuda",
        })
    }
}

/// Why the asked-for device cannot be used.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DeviceError {
    #[error("device {0:?} must be auto, cpu, metal or cuda")]
    Unknown(String),
    #[error(
        "device {device} asked for, but this mlx-node was built without the `{feature}` feature"
    )]
    NotCompiledWith {
        device: &'static str,
        feature: &'static str,
    },
    #[error("device {device} is not available on this machine: {reason}")]
    Unavailable {
        device: &'static str,
        reason: String,
    },
}

/// Where an engine computes.
#[derive(Debug, Clone, Default)]
pub enum Backend {
    /// The fast CPU path: our SIMD kernels on f32 slices (`model`).
    #[default]
    Native,
    /// The device path on a candle device (`Device::Cpu` included).
    Device(Device),
}

impl Backend {
    /// "cpu", "metal", "cuda", or "candle-cpu" (the device path on the CPU).
    pub fn name(&self) -> &'static str {
        match self {
            Backend::Native => "cpu",
            Backend::Device(Device::Cpu) => "candle-cpu",
            Backend::Device(Device::Metal(_)) => "metal",
            Backend::Device(Device::Cuda(_)) => "cuda",
        }
    }
}

/// Metal device 0, when compiled in and present.
fn metal() -> Result<Device, DeviceError> {
    if !cfg!(feature = "metal") {
        return Err(DeviceError::NotCompiledWith {
            device: "metal",
            feature: "metal",
        });
    }
    Device::new_metal(0).map_err(|e| DeviceError::Unavailable {
        device: "metal",
        reason: e.to_string(),
    })
}

/// CUDA device 0, when compiled in and present.
fn cuda() -> Result<Device, DeviceError> {
    if !cfg!(feature = "cuda") {
        return Err(DeviceError::NotCompiledWith {
            device: "cuda",
            feature: "cuda",
        });
    }
    Device::new_cuda(0).map_err(|e| DeviceError::Unavailable {
        device: "cuda",
        reason: e.to_string(),
    })
}

/// The backend for `choice`. `auto` never fails: it falls back to the CPU
/// (and says why in the log); a device asked for by name fails when it is
/// compiled out or absent.
pub fn resolve(choice: DeviceChoice) -> Result<Backend, DeviceError> {
    match choice {
        DeviceChoice::Cpu => Ok(Backend::Native),
        DeviceChoice::Metal => metal().map(Backend::Device),
        DeviceChoice::Cuda => cuda().map(Backend::Device),
        DeviceChoice::Auto => {
            for (name, found) in [("metal", metal()), ("cuda", cuda())] {
                match found {
                    Ok(d) => return Ok(Backend::Device(d)),
                    Err(DeviceError::NotCompiledWith { .. }) => {}
                    Err(e) => tracing::info!(device = name, reason = %e, "device not used"),
                }
            }
            Ok(Backend::Native)
        }
    }
}

/// One projection on the device: `y = x · Wᵀ (+ b)`.
#[derive(Debug, Clone)]
pub struct DeviceLinear {
    w: QMatMul,
    bias: Option<Tensor>,
}

impl DeviceLinear {
    pub fn new(w: QMatMul, bias: Option<Tensor>) -> Self {
        Self { w, bias }
    }

    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let y = self.w.forward(x)?;
        match &self.bias {
            Some(b) => y.broadcast_add(b),
            None => Ok(y),
        }
    }
}

/// One transformer block's weights on the device.
#[derive(Debug, Clone)]
struct DeviceBlock {
    attn_norm: Tensor,
    q: DeviceLinear,
    k: DeviceLinear,
    v: DeviceLinear,
    o: DeviceLinear,
    q_norm: Option<Tensor>,
    k_norm: Option<Tensor>,
    ffn_norm: Tensor,
    gate: DeviceLinear,
    up: DeviceLinear,
    down: DeviceLinear,
}

/// One layer's keys and values, `[1, kv_heads, capacity, head_dim]` f16.
#[derive(Debug)]
struct DeviceCache {
    k: Tensor,
    v: Tensor,
}

/// The whole model on a candle device, with its KV cache there. Not
/// `Clone`: a clone would share the cache's device memory.
#[derive(Debug)]
pub struct DeviceModel {
    pub cfg: ModelConfig,
    device: Device,
    /// Looked up on the host (only the rows of a pass are dequantized), then
    /// uploaded.
    embed: Embedding,
    blocks: Vec<DeviceBlock>,
    norm: Tensor,
    lm_head: DeviceLinear,
    tied: bool,
    rope: Rope,
    /// cos and sin of every cached position, `[capacity, rope_dims / 2]` f32.
    cos: Tensor,
    sin: Tensor,
    cache: Vec<DeviceCache>,
    /// Positions the allocated cache holds.
    capacity: usize,
    /// Positions the next pass must have room for (set by `reset`).
    wanted: usize,
    pos: usize,
}

/// Dtype of the cached keys and values (llama.cpp's default cache type).
const CACHE_DTYPE: DType = DType::F16;

fn vector(
    w: &WeightSource<'_>,
    base: &str,
    len: usize,
    dev: &Device,
) -> Result<Tensor, EngineError> {
    Ok(Tensor::from_vec(w.vector(base, "weight", len)?, len, dev)?)
}

/// `x` rounded to f16 and back (as the fast path and llama.cpp round
/// attention operands).
fn round_f16(x: &Tensor) -> candle_core::Result<Tensor> {
    x.to_dtype(DType::F16)?.to_dtype(DType::F32)
}

impl DeviceModel {
    /// Loads every weight onto `device`, checking each shape against `cfg`
    /// (the same names and checks as [`Model::load`]).
    pub fn load(
        cfg: ModelConfig,
        w: &WeightSource<'_>,
        device: &Device,
    ) -> Result<Self, EngineError> {
        if cfg.moe.is_some() {
            return Err(EngineError::Config(format!(
                "{} (mixture of experts) runs on the CPU path only (--device cpu)",
                cfg.architecture_name
            )));
        }
        if cfg.architecture == super::config::Architecture::Gemma3 {
            // Windowed layers, post-norms, GeGLU and scaled embeddings are
            // in the fast CPU path only ([`EngineModel::load`] sends it there).
            return Err(EngineError::Config(
                "gemma3 runs on the CPU path only (--device cpu)".into(),
            ));
        }
        let dev = device;
        let h = cfg.hidden_size;
        let hd = cfg.head_dim;
        let q_out = cfg.heads * hd;
        let kv_out = cfg.kv_heads * hd;
        let ff = cfg.intermediate_size;
        let embed = w.embedding("token_embd", cfg.vocab_size, h)?;
        let lin = |base: &str, out, inp, bias| -> Result<DeviceLinear, EngineError> {
            let (q, b) = w.device_linear(base, out, inp, bias, dev)?;
            Ok(DeviceLinear::new(q, b))
        };
        let mut blocks = Vec::with_capacity(cfg.layers);
        for i in 0..cfg.layers {
            let p = |s: &str| format!("blk.{i}.{s}");
            let (q_norm, k_norm) = if cfg.qk_norm {
                (
                    Some(vector(w, &p("attn_q_norm"), hd, dev)?),
                    Some(vector(w, &p("attn_k_norm"), hd, dev)?),
                )
            } else {
                (None, None)
            };
            blocks.push(DeviceBlock {
                attn_norm: vector(w, &p("attn_norm"), h, dev)?,
                q: lin(&p("attn_q"), q_out, h, cfg.qkv_bias)?,
                k: lin(&p("attn_k"), kv_out, h, cfg.qkv_bias)?,
                v: lin(&p("attn_v"), kv_out, h, cfg.qkv_bias)?,
                o: lin(&p("attn_output"), h, q_out, false)?,
                q_norm,
                k_norm,
                ffn_norm: vector(w, &p("ffn_norm"), h, dev)?,
                gate: lin(&p("ffn_gate"), ff, h, false)?,
                up: lin(&p("ffn_up"), ff, h, false)?,
                down: lin(&p("ffn_down"), h, ff, false)?,
            });
        }
        let norm = vector(w, "output_norm", h, dev)?;
        let tied = !w.has("output");
        let lm_head = lin(
            if tied { "token_embd" } else { "output" },
            cfg.vocab_size,
            h,
            false,
        )?;
        let rope = rope_for(&cfg, w)?;
        let empty = Tensor::zeros((0, cfg.rope_dims / 2), DType::F32, dev)?;
        Ok(DeviceModel {
            cfg,
            device: dev.clone(),
            embed,
            blocks,
            norm,
            lm_head,
            tied,
            rope,
            cos: empty.clone(),
            sin: empty,
            cache: Vec::new(),
            capacity: 0,
            wanted: 0,
            pos: 0,
        })
    }

    /// The device this model computes on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Total number of weights (as [`Model::parameters`] counts them).
    pub fn parameters(&self) -> u64 {
        let c = &self.cfg;
        let (h, hd, ff) = (
            c.hidden_size as u64,
            c.head_dim as u64,
            c.intermediate_size as u64,
        );
        let (q, kv) = (c.heads as u64 * hd, c.kv_heads as u64 * hd);
        let per_block =
            2 * h + 2 * q * h + 2 * kv * h + 3 * ff * h + if c.qk_norm { 2 * hd } else { 0 };
        let mut n = self.embed.rows() as u64 * h + h + c.layers as u64 * per_block;
        if !self.tied {
            n += c.vocab_size as u64 * h;
        }
        n
    }

    /// Empties the cache; the next pass makes room for `capacity` positions
    /// (reusing the allocation when it is large enough).
    pub fn reset(&mut self, capacity: usize) {
        self.pos = 0;
        self.wanted = capacity;
    }

    /// Allocates the cache and the rotary tables for `self.wanted` positions
    /// when the current ones are too small.
    fn ensure_capacity(&mut self) -> Result<(), EngineError> {
        if self.wanted <= self.capacity && self.cache.len() == self.cfg.layers {
            return Ok(());
        }
        let cap = self.wanted.max(self.capacity);
        let (kvh, hd) = (self.cfg.kv_heads, self.cfg.head_dim);
        self.cache = (0..self.cfg.layers)
            .map(|_| {
                Ok(DeviceCache {
                    k: Tensor::zeros((1, kvh, cap, hd), CACHE_DTYPE, &self.device)?,
                    v: Tensor::zeros((1, kvh, cap, hd), CACHE_DTYPE, &self.device)?,
                })
            })
            .collect::<candle_core::Result<_>>()?;
        let half = self.cfg.rope_dims / 2;
        let (mut cos, mut sin) = (
            Vec::with_capacity(cap * half),
            Vec::with_capacity(cap * half),
        );
        let mut cs = Vec::with_capacity(half);
        for p in 0..cap {
            self.rope.cos_sin(p, &mut cs);
            for &(c, s) in &cs {
                cos.push(c);
                sin.push(s);
            }
        }
        self.cos = Tensor::from_vec(cos, (cap, half), &self.device)?;
        self.sin = Tensor::from_vec(sin, (cap, half), &self.device)?;
        self.capacity = cap;
        Ok(())
    }

    /// Runs `tokens` at the next positions, fills the cache and returns the
    /// logits of the last one.
    pub fn forward(&mut self, tokens: &[u32]) -> Result<Vec<f32>, EngineError> {
        self.forward_rows(tokens, tokens.len() - 1)
    }

    /// One sequence's chunk of a batch pass (the batch runs a device model
    /// one sequence at a time, see [`super::batch::BatchModel::max_sequences`]):
    /// a chunk at position 0 starts a sequence (the cache is emptied and
    /// sized for `chunk.capacity`); any other must continue where the cache
    /// stands, else it is refused rather than computed over another
    /// sequence's keys. Returns the logits rows the chunk asks for.
    pub fn forward_chunk(&mut self, chunk: &SeqChunk<'_>) -> Result<Vec<f32>, EngineError> {
        if chunk.tokens.is_empty() {
            return Err(EngineError::Batch("a chunk with no tokens".into()));
        }
        if chunk.pos == 0 {
            self.reset(chunk.capacity.max(chunk.tokens.len()));
        } else if chunk.pos != self.pos {
            return Err(EngineError::Batch(format!(
                "the device cache holds {} positions, the chunk starts at {}",
                self.pos, chunk.pos
            )));
        }
        if chunk.pos + chunk.tokens.len() > self.wanted.max(self.capacity) {
            return Err(EngineError::Batch(format!(
                "a chunk reaching position {} in a cache of {}",
                chunk.pos + chunk.tokens.len(),
                self.wanted.max(self.capacity)
            )));
        }
        if let Some(t) = chunk
            .tokens
            .iter()
            .find(|&&t| t as usize >= self.cfg.vocab_size)
        {
            return Err(EngineError::Batch(format!(
                "token {t} is outside the vocabulary of {}",
                self.cfg.vocab_size
            )));
        }
        let from = match chunk.logits {
            Logits::None => chunk.tokens.len(),
            Logits::Last => chunk.tokens.len() - 1,
            Logits::From(k) => k.min(chunk.tokens.len()),
        };
        self.forward_rows(chunk.tokens, from)
    }

    /// Like [`DeviceModel::forward`], but returns the logits of every token
    /// from index `from` on (as [`Model::forward_rows`]).
    pub fn forward_rows(&mut self, tokens: &[u32], from: usize) -> Result<Vec<f32>, EngineError> {
        self.ensure_capacity()?;
        let s = tokens.len();
        let h = self.cfg.hidden_size;
        let x = self.embed.lookup(tokens)?;
        let mut x = Tensor::from_vec(x, (s, h), &self.device)?;
        let pass = Pass::new(self, s)?;
        for (block, cache) in self.blocks.iter().zip(&self.cache) {
            x = pass.block(block, cache, &x)?;
        }
        self.pos += s;
        let rows = s.saturating_sub(from);
        if rows == 0 {
            return Ok(Vec::new());
        }
        let last = x.narrow(0, s - rows, rows)?;
        let last = candle_nn::ops::rms_norm(&last, &self.norm, self.cfg.rms_eps)?;
        let logits = self.lm_head.forward(&last)?;
        Ok(logits.flatten_all()?.to_vec1::<f32>()?)
    }
}

/// What every block of one pass shares: its shape, the rotary tables of its
/// positions and the causal mask.
struct Pass<'a> {
    cfg: &'a ModelConfig,
    s: usize,
    pos: usize,
    cos: Tensor,
    sin: Tensor,
    /// `[group * s, pos + s]` with 0 where attention is allowed, -inf where
    /// not; `None` for a single token (it sees the whole cache).
    mask: Option<Tensor>,
}

impl<'a> Pass<'a> {
    fn new(m: &'a DeviceModel, s: usize) -> Result<Self, EngineError> {
        let (pos, cfg) = (m.pos, &m.cfg);
        let cos = m.cos.narrow(0, pos, s)?.contiguous()?;
        let sin = m.sin.narrow(0, pos, s)?.contiguous()?;
        let mask = if s > 1 {
            let (group, len) = (cfg.heads / cfg.kv_heads, pos + s);
            let mut v = Vec::with_capacity(group * s * len);
            for _ in 0..group {
                for t in 0..s {
                    v.extend((0..len).map(|j| if j <= pos + t { 0.0 } else { f32::NEG_INFINITY }));
                }
            }
            Some(Tensor::from_vec(v, (group * s, len), &m.device)?)
        } else {
            None
        };
        Ok(Pass {
            cfg,
            s,
            pos,
            cos,
            sin,
            mask,
        })
    }

    /// Rotary embedding of `x` = `[1, heads, s, head_dim]` (the first
    /// `rope_dims` of each head rotate; the rest pass through).
    fn rope(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let (rd, hd) = (self.cfg.rope_dims, self.cfg.head_dim);
        let apply = |t: &Tensor| {
            if self.cfg.rope_interleaved {
                candle_nn::rotary_emb::rope_i(t, &self.cos, &self.sin)
            } else {
                candle_nn::rotary_emb::rope(t, &self.cos, &self.sin)
            }
        };
        if rd == hd {
            return apply(x);
        }
        let rot = apply(&x.narrow(D::Minus1, 0, rd)?.contiguous()?)?;
        Tensor::cat(&[&rot, &x.narrow(D::Minus1, rd, hd - rd)?], D::Minus1)?.contiguous()
    }

    /// `x + attn(x)`, then `+ ffn(..)`, on `x` = `[s, hidden]`.
    fn block(
        &self,
        b: &DeviceBlock,
        cache: &DeviceCache,
        x: &Tensor,
    ) -> Result<Tensor, EngineError> {
        let (s, pos) = (self.s, self.pos);
        let (heads, kvh, hd) = (self.cfg.heads, self.cfg.kv_heads, self.cfg.head_dim);
        let eps = self.cfg.rms_eps;
        let hn = candle_nn::ops::rms_norm(x, &b.attn_norm, eps)?;
        let mut q = b.q.forward(&hn)?.reshape((s, heads, hd))?;
        let mut k = b.k.forward(&hn)?.reshape((s, kvh, hd))?;
        let v = b.v.forward(&hn)?.reshape((s, kvh, hd))?;
        if let Some(w) = &b.q_norm {
            q = candle_nn::ops::rms_norm(&q.contiguous()?, w, eps)?;
        }
        if let Some(w) = &b.k_norm {
            k = candle_nn::ops::rms_norm(&k.contiguous()?, w, eps)?;
        }
        // [1, heads, s, hd], as the rotary kernels and the cache want.
        let heads_first = |t: Tensor| t.unsqueeze(0)?.transpose(1, 2)?.contiguous();
        let q = self.rope(&heads_first(q)?)?;
        let k = self.rope(&heads_first(k)?)?;
        let v = heads_first(v)?;
        cache.k.slice_set(&k.to_dtype(CACHE_DTYPE)?, 2, pos)?;
        cache.v.slice_set(&v.to_dtype(CACHE_DTYPE)?, 2, pos)?;

        let len = pos + s;
        let group = heads / kvh;
        // The heads sharing one kv head are adjacent, so the queries regroup
        // as [kv_heads, group * s, hd] and meet their keys in one matmul.
        let q = round_f16(&q)?.reshape((kvh, group * s, hd))?;
        let keys = cache
            .k
            .narrow(2, 0, len)?
            .to_dtype(DType::F32)?
            .reshape((kvh, len, hd))?;
        let values = cache
            .v
            .narrow(2, 0, len)?
            .to_dtype(DType::F32)?
            .reshape((kvh, len, hd))?;
        let scores = (q.matmul(&keys.t()?)? * (1.0 / (hd as f64).sqrt()))?;
        let scores = match &self.mask {
            Some(mask) => scores.broadcast_add(mask)?,
            None => scores,
        };
        let probs = round_f16(&candle_nn::ops::softmax_last_dim(&scores)?)?;
        let att = probs
            .matmul(&values)? // [kvh, group * s, hd]
            .reshape((1, heads, s, hd))?
            .transpose(1, 2)?
            .reshape((s, heads * hd))?;
        let x = (x + b.o.forward(&att)?)?;

        let hn = candle_nn::ops::rms_norm(&x, &b.ffn_norm, eps)?;
        let g = b.gate.forward(&hn)?;
        let u = b.up.forward(&hn)?;
        let d = b.down.forward(&(g.silu()? * u)?)?;
        Ok((x + d)?)
    }
}

/// The model an engine runs: the fast CPU path or the device path.
#[derive(Debug)]
#[allow(clippy::large_enum_variant)]
pub enum EngineModel {
    Native(Model),
    Device(DeviceModel),
}

impl EngineModel {
    /// Loads the weights for `backend`.
    pub fn load(
        cfg: ModelConfig,
        w: &WeightSource<'_>,
        backend: &Backend,
    ) -> Result<Self, EngineError> {
        Ok(match backend {
            Backend::Native => EngineModel::Native(Model::load(cfg, w)?),
            Backend::Device(_) if cfg.architecture == super::config::Architecture::Gemma3 => {
                tracing::warn!(
                    backend = backend.name(),
                    "gemma3 runs on the CPU path only: this model computes on the CPU"
                );
                EngineModel::Native(Model::load(cfg, w)?)
            }
            Backend::Device(_) if cfg.moe.is_some() => {
                tracing::warn!(
                    backend = backend.name(),
                    architecture = %cfg.architecture_name,
                    "mixture-of-experts models run on the CPU path only: this model computes on the CPU"
                );
                EngineModel::Native(Model::load(cfg, w)?)
            }
            Backend::Device(d) => EngineModel::Device(DeviceModel::load(cfg, w, d)?),
        })
    }

    pub fn cfg(&self) -> &ModelConfig {
        match self {
            EngineModel::Native(m) => &m.cfg,
            EngineModel::Device(m) => &m.cfg,
        }
    }

    pub fn parameters(&self) -> u64 {
        match self {
            EngineModel::Native(m) => m.parameters(),
            EngineModel::Device(m) => m.parameters(),
        }
    }

    /// Weights one token reads (see [`Model::active_parameters`]).
    pub fn active_parameters(&self) -> u64 {
        match self {
            EngineModel::Native(m) => m.active_parameters(),
            EngineModel::Device(m) => m.parameters(),
        }
    }

    /// "cpu", "candle-cpu", "metal" or "cuda".
    pub fn backend_name(&self) -> &'static str {
        match self {
            EngineModel::Native(_) => Backend::Native.name(),
            EngineModel::Device(m) => Backend::Device(m.device.clone()).name(),
        }
    }

    pub fn reset(&mut self, capacity: usize) {
        match self {
            EngineModel::Native(m) => m.reset(capacity),
            EngineModel::Device(m) => m.reset(capacity),
        }
    }

    pub fn forward(&mut self, tokens: &[u32]) -> Result<Vec<f32>, EngineError> {
        match self {
            EngineModel::Native(m) => m.forward(tokens),
            EngineModel::Device(m) => m.forward(tokens),
        }
    }

    pub fn forward_rows(&mut self, tokens: &[u32], from: usize) -> Result<Vec<f32>, EngineError> {
        match self {
            EngineModel::Native(m) => m.forward_rows(tokens, from),
            EngineModel::Device(m) => m.forward_rows(tokens, from),
        }
    }
}

impl super::Forward for EngineModel {
    type Error = EngineError;
    fn context_length(&self) -> usize {
        self.cfg().context_length
    }
    fn reset(&mut self, capacity: usize) -> Result<(), EngineError> {
        EngineModel::reset(self, capacity);
        Ok(())
    }
    fn forward(&mut self, tokens: &[u32]) -> Result<Vec<f32>, EngineError> {
        EngineModel::forward(self, tokens)
    }
}

#[cfg(test)]
mod tests;
