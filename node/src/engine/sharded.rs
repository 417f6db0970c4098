//! The model split across the members of a pod: tensor parallel (every layer
//! split by KV-head groups and feed-forward columns) or pipeline parallel
//! (consecutive layers per member).
//!
//! Same architecture and arithmetic as [`super::model::Model`]; what differs
//! is which weights a rank holds and where the collectives go:
//! - tensor parallel: rank `r` holds the query/key/value rows of its KV-head
//!   groups, the matching columns of the output projection, its rows of the
//!   gate and up projections and the matching columns of the down
//!   projection. Attention and feed-forward each end in a partial sum that
//!   one all-reduce completes. Every rank embeds the tokens and holds its
//!   share of the output head's rows; the other ranks send their logits to
//!   rank 0, which alone samples.
//! - pipeline parallel: rank `r` holds whole layers `layers[r]`; rank 0
//!   embeds, each stage receives the hidden states from the previous one and
//!   sends its own to the next; the last stage applies the output head and
//!   sends the logits to rank 0. A long prompt goes through in
//!   micro-batches: stage `r` runs chunk `i` while stage `r + 1` runs chunk
//!   `i - 1` (a send returns once the bytes are handed over, not when the
//!   next stage has used them), so prefill keeps every stage busy; decode
//!   (one token) stays one pass.
//!
//! Each rank reads only its own slices of the memory-mapped GGUF file:
//! row slices are contiguous byte ranges; column slices take the same block
//! range of every row (shares are cut on quantization-block boundaries, so
//! quantized weights stay quantized and the activations are quantized in the
//! same blocks as in the unsplit model).
//!
//! Rank 0 drives generation ([`generate_greedy`]): it broadcasts the tokens
//! of each step, and samples from the logits it alone receives.
//!
//! # Invariants
//! - Every rank calls [`PodModel::forward`] with the same tokens in the same
//!   order (the generation loop broadcasts them), and the same micro-batch
//!   setting (a mismatch is a collective length mismatch, not a hang).
//! - A stage runs its chunks in order at increasing positions, so chunked
//!   prefill computes what one pass over the prompt computes.
//!
//! # Failure
//! [`PodModelError`]: a model error, a collective error (a lost member fails
//! the step), or a plan the model cannot take.

use std::ops::Range;
use std::path::Path;

use candle_core::quantized::ggml_file::qtensor_from_ggml;
use candle_core::quantized::GgmlDType;
use candle_core::{Device, Tensor};

use super::config::ModelConfig;
use super::gguf::GgufFile;
use super::linear::Linear;
use super::model::{
    local_rope_for, rope_for, scale_embeddings, Block, FeedForward, LayerExtras, Step,
};
use super::ops::{self, AttnShape, LayerCache, Rope};
use super::profile::{self, Part};
use super::weights::{Embedding, WeightSource};
use super::EngineError;
use crate::collectives::{all_reduce, Collective, CollectiveError};
use crate::pod::shard::{self, ShardError};

/// Why a pod model failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PodModelError {
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error(transparent)]
    Collective(#[from] CollectiveError),
    #[error(transparent)]
    Shard(#[from] ShardError),
    #[error("the pod's plan does not fit the model: {0}")]
    Plan(String),
    #[error(
        "rank {rank} refuses {share}: weights {weights} B + KV cache {kv} B for {positions} \
         positions = {need} B exceed its memory budget of {budget} B",
        need = weights + kv
    )]
    OverBudget {
        rank: usize,
        /// What the plan gave it ("layers 10..20", "kv heads 0..2, ...").
        share: String,
        weights: u64,
        kv: u64,
        positions: usize,
        budget: u64,
    },
}

/// What one rank may hold: a memory budget for its weights and the KV cache
/// of the longest sequence the pod accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryBudget {
    pub bytes: u64,
    /// Positions the KV cache must hold (prompt + generated).
    pub positions: usize,
}

impl From<candle_core::Error> for PodModelError {
    fn from(e: candle_core::Error) -> Self {
        PodModelError::Engine(e.into())
    }
}

/// How weight matmuls compute.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compute {
    /// As stored: quantized weights stay quantized (activations are
    /// quantized per block, as in the unsplit engine).
    Native,
    /// Weights dequantized to f32 at load, f32 matmuls: a split then differs
    /// from the whole only by the order of f32 additions.
    F32,
}

/// How the model is split.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PodPlan {
    /// Every layer split; `kv_heads[r]`, `ffn[r]` and `vocab[r]` (rows of
    /// the output head) are rank r's shares.
    Tensor {
        kv_heads: Vec<Range<usize>>,
        ffn: Vec<Range<usize>>,
        vocab: Vec<Range<usize>>,
    },
    /// `layers[r]`: rank r's consecutive layers.
    Pipeline { layers: Vec<Range<usize>> },
}

impl PodPlan {
    /// Tensor parallel shares in proportion to `speeds`; feed-forward shares
    /// are cut on `ffn_unit` boundaries (the quantization block).
    pub fn tensor(cfg: &ModelConfig, ffn_unit: usize, speeds: &[f64]) -> Result<Self, ShardError> {
        let unit = if cfg.intermediate_size.is_multiple_of(ffn_unit) {
            ffn_unit
        } else {
            1
        };
        let kv_heads = shard::split("kv heads", cfg.kv_heads, speeds)?;
        let ffn = shard::split("feed-forward blocks", cfg.intermediate_size / unit, speeds)?
            .into_iter()
            .map(|r| r.start * unit..r.end * unit)
            .collect();
        let vocab = shard::split("vocabulary rows", cfg.vocab_size, speeds)?;
        Ok(PodPlan::Tensor {
            kv_heads,
            ffn,
            vocab,
        })
    }

    /// Pipeline stages in proportion to `memory`.
    pub fn pipeline(cfg: &ModelConfig, memory: &[f64]) -> Result<Self, ShardError> {
        Ok(PodPlan::Pipeline {
            layers: shard::pipeline_plan(cfg.layers, memory)?,
        })
    }

    /// Rank `rank`'s share, for messages.
    pub fn describe(&self, rank: usize) -> String {
        match self {
            PodPlan::Tensor {
                kv_heads,
                ffn,
                vocab,
            } => format!(
                "kv heads {:?}, feed-forward columns {:?} and vocabulary rows {:?} of every layer",
                kv_heads.get(rank),
                ffn.get(rank),
                vocab.get(rank)
            ),
            PodPlan::Pipeline { layers } => match layers.get(rank) {
                Some(r) => format!("layers {}..{}", r.start, r.end),
                None => format!("no layers (rank {rank} of {})", layers.len()),
            },
        }
    }

    pub fn ranks(&self) -> usize {
        match self {
            PodPlan::Tensor { kv_heads, .. } => kv_heads.len(),
            PodPlan::Pipeline { layers } => layers.len(),
        }
    }
}

/// One rank's part of the model, with its KV cache.
#[derive(Debug)]
pub struct PodModel {
    pub cfg: ModelConfig,
    rank: usize,
    plan: PodPlan,
    /// Token embedding (tensor: every rank; pipeline: rank 0).
    embed: Option<Embedding>,
    blocks: Vec<Block>,
    /// Final norm and output head (tensor: every rank, its vocabulary rows;
    /// pipeline: the last stage, all rows).
    head: Option<(Vec<f32>, Linear)>,
    /// Tensor parallel: each rank's vocabulary rows.
    vocab: Vec<Range<usize>>,
    rope: Rope,
    rope_local: Option<Rope>,
    /// Local attention shape (local heads, local KV heads).
    heads: usize,
    kv_heads: usize,
    cache: Vec<LayerCache>,
    capacity: usize,
    pos: usize,
    cs: Vec<(f32, f32)>,
    /// Pipeline micro-batch size; `None`: chosen per pass.
    micro: Option<usize>,
}

/// Smallest pipeline micro-batch chosen per pass (see
/// [`PodModel::micro_batch`]).
pub const MIN_MICRO_BATCH: usize = 64;
/// Largest pipeline micro-batch chosen per pass: the engine's prefill
/// chunk, which bounds one pass's activations.
pub const MAX_MICRO_BATCH: usize = crate::engine::PREFILL_CHUNK;

/// Column cuts of a quantized matrix fall on this many columns: whole
/// blocks, and an even number of them (candle's SIMD dot products take
/// blocks in pairs).
fn cut_unit(dtype: GgmlDType) -> usize {
    match dtype.block_size() {
        1 => 1,
        b => 2 * b,
    }
}

/// Slices of GGUF tensors, read from the memory map.
struct Slicer<'a> {
    g: &'a GgufFile,
    compute: Compute,
}

impl Slicer<'_> {
    fn linear(
        &self,
        q: candle_core::quantized::QTensor,
        bias: Option<Tensor>,
    ) -> Result<Linear, EngineError> {
        match self.compute {
            Compute::Native => Linear::from_qtensor(q, bias),
            Compute::F32 => Linear::from_tensor(q.dequantize(&Device::Cpu)?, bias),
        }
    }

    fn entry(&self, name: &str) -> Result<&super::gguf::TensorEntry, EngineError> {
        self.g
            .tensors
            .get(name)
            .ok_or_else(|| EngineError::MissingTensor {
                name: name.to_string(),
            })
    }

    fn check(&self, name: &str, shape: [usize; 2]) -> Result<GgmlDType, EngineError> {
        let e = self.entry(name)?;
        if e.shape != shape {
            return Err(EngineError::TensorShape {
                name: name.to_string(),
                actual: e.shape.clone(),
                expected: shape.to_vec(),
            });
        }
        Ok(e.dtype)
    }

    /// Rows `rows` of `[out, inp]` matrix `base` (+ bias rows).
    fn rows(
        &self,
        base: &str,
        out: usize,
        inp: usize,
        rows: Range<usize>,
        bias: bool,
    ) -> Result<Linear, EngineError> {
        let name = format!("{base}.weight");
        let dtype = self.check(&name, [out, inp])?;
        let e = self.entry(&name)?;
        let row_bytes = e.len / out;
        let bytes = &self.g.tensor_bytes(e)[rows.start * row_bytes..rows.end * row_bytes];
        let q = qtensor_from_ggml(dtype, bytes, vec![rows.len(), inp], &Device::Cpu)?;
        let bias = if bias {
            let b = WeightSource::Gguf(self.g).vector(base, "bias", out)?;
            Some(Tensor::from_vec(
                b[rows.clone()].to_vec(),
                rows.len(),
                &Device::Cpu,
            )?)
        } else {
            None
        };
        self.linear(q, bias)
    }

    /// Columns `cols` of `[out, inp]` matrix `base`: the same block range of
    /// every row; dequantized when the range cuts through blocks.
    fn cols(
        &self,
        base: &str,
        out: usize,
        inp: usize,
        cols: Range<usize>,
    ) -> Result<Linear, EngineError> {
        let name = format!("{base}.weight");
        let dtype = self.check(&name, [out, inp])?;
        let block = dtype.block_size();
        let unit = cut_unit(dtype);
        if cols.start.is_multiple_of(unit) && cols.end.is_multiple_of(unit) {
            let e = self.entry(&name)?;
            let row_bytes = e.len / out;
            let per_block = dtype.type_size();
            let (b0, b1) = (cols.start / block * per_block, cols.end / block * per_block);
            let data = self.g.tensor_bytes(e);
            let mut bytes = Vec::with_capacity(out * (b1 - b0));
            for r in 0..out {
                bytes.extend_from_slice(&data[r * row_bytes + b0..r * row_bytes + b1]);
            }
            let q = qtensor_from_ggml(dtype, &bytes, vec![out, cols.len()], &Device::Cpu)?;
            self.linear(q, None)
        } else {
            let full = self.g.qtensor(&name)?.dequantize(&Device::Cpu)?;
            Linear::from_tensor(full.narrow(1, cols.start, cols.len())?, None)
        }
    }
}

/// The GGUF file at `path` and its model config.
fn open(path: &Path) -> Result<(GgufFile, ModelConfig), PodModelError> {
    let file = GgufFile::open(path)?;
    let vocab = file
        .tensors
        .get("token_embd.weight")
        .and_then(|e| e.shape.first().copied());
    let cfg = ModelConfig::from_gguf(&file.metadata, vocab)?;
    Ok((file, cfg))
}

/// The config and feed-forward cut unit of a GGUF file from the first bytes
/// of the file (`Ok(None)`: the header goes on past `prefix`).
pub fn header_config(prefix: &[u8]) -> Result<Option<(ModelConfig, usize)>, PodModelError> {
    let Some(h) = super::gguf::parse_header(prefix)? else {
        return Ok(None);
    };
    let vocab = h
        .tensors
        .get("token_embd.weight")
        .and_then(|e| e.shape.first().copied());
    let cfg = ModelConfig::from_gguf(&h.metadata, vocab)?;
    let unit = h
        .tensors
        .get("blk.0.ffn_down.weight")
        .map_or(1, |e| cut_unit(e.dtype));
    Ok(Some((cfg, unit)))
}

/// The byte ranges of a GGUF file that rank `rank` reads to load its share
/// under `plan` (sorted, merged), given the file's first bytes up to the end
/// of its header: the header itself, and per tensor what the rank loads:
/// its rows of a row-split matrix (q, k, v, gate, up, the output head
/// under tensor parallelism), a whole tensor otherwise (a column share
/// touches every row). Pipeline stages read only their layers, plus the
/// embedding (first stage) or the head (last stage).
pub fn shard_byte_ranges(
    prefix: &[u8],
    plan: &PodPlan,
    rank: usize,
) -> Result<Vec<Range<u64>>, PodModelError> {
    let h = super::gguf::parse_header(prefix)?
        .ok_or_else(|| PodModelError::Plan("the header goes on past the bytes given".into()))?;
    let n = plan.ranks();
    if rank >= n {
        return Err(PodModelError::Plan(format!("rank {rank} in a pod of {n}")));
    }
    let whole = |name: &str| {
        h.tensors
            .get(name)
            .map(|e| e.start as u64..(e.start + e.len) as u64)
    };
    let rows = |name: &str, r: &Range<usize>| {
        h.tensors.get(name).map(|e| {
            let per_row = (e.len / e.shape[0].max(1)) as u64;
            let start = e.start as u64;
            start + r.start as u64 * per_row..start + r.end as u64 * per_row
        })
    };
    let head = if h.tensors.contains_key("output.weight") {
        "output.weight"
    } else {
        "token_embd.weight"
    };
    let mut out: Vec<Range<u64>> = Vec::new();
    out.push(0..h.data_start);
    out.extend(whole("rope_freqs.weight"));
    let layer_tensors = |i: usize| {
        let prefix = format!("blk.{i}.");
        h.tensors
            .keys()
            .filter(move |k| k.starts_with(&prefix))
            .cloned()
            .collect::<Vec<_>>()
    };
    match plan {
        PodPlan::Pipeline { layers } => {
            for i in layers[rank].clone() {
                for name in layer_tensors(i) {
                    out.extend(whole(&name));
                }
            }
            if rank == 0 {
                out.extend(whole("token_embd.weight"));
            }
            if rank + 1 == n {
                out.extend(whole("output_norm.weight"));
                out.extend(whole(head));
            }
        }
        PodPlan::Tensor {
            kv_heads,
            ffn,
            vocab,
        } => {
            let group = h.tensors.get("blk.0.attn_q.weight").map_or(1, |q| {
                let kv = h
                    .tensors
                    .get("blk.0.attn_k.weight")
                    .map_or(1, |k| k.shape[0]);
                q.shape[0] / kv.max(1)
            });
            let kvr = &kv_heads[rank];
            // Rows of k/v per kv head: the k matrix's rows over all kv heads.
            let per_kv = |name: &str, total_heads: usize| {
                h.tensors
                    .get(name)
                    .map_or(0, |e| e.shape[0] / total_heads.max(1))
            };
            let total_kv = kv_heads.last().map_or(0, |r| r.end);
            for i in 0.. {
                let names = layer_tensors(i);
                if names.is_empty() {
                    break;
                }
                for name in names {
                    let local = name.split_once(&format!("blk.{i}.")).map_or("", |x| x.1);
                    let range = match local {
                        "attn_k.weight" | "attn_v.weight" | "attn_k.bias" | "attn_v.bias" => {
                            let hd = per_kv(&name, total_kv);
                            rows(&name, &(kvr.start * hd..kvr.end * hd))
                        }
                        "attn_q.weight" | "attn_q.bias" => {
                            let hd = per_kv(&name, total_kv * group);
                            rows(&name, &(kvr.start * group * hd..kvr.end * group * hd))
                        }
                        "ffn_gate.weight" | "ffn_up.weight" => rows(&name, &ffn[rank]),
                        _ => whole(&name),
                    };
                    out.extend(range);
                }
            }
            out.extend(whole("token_embd.weight"));
            out.extend(whole("output_norm.weight"));
            if head == "output.weight" {
                out.extend(rows(head, &vocab[rank]));
            }
        }
    }
    out.sort_by_key(|r| r.start);
    let mut merged: Vec<Range<u64>> = Vec::with_capacity(out.len());
    for r in out {
        match merged.last_mut() {
            Some(last) if r.start <= last.end => last.end = last.end.max(r.end),
            _ => merged.push(r),
        }
    }
    Ok(merged)
}

impl PodModel {
    /// Loads rank `rank`'s part of the GGUF model at `path` under `plan`.
    pub fn load_gguf(
        path: &Path,
        plan: PodPlan,
        rank: usize,
        compute: Compute,
    ) -> Result<PodModel, PodModelError> {
        let (file, cfg) = open(path)?;
        Self::load(&file, cfg, plan, rank, compute)
    }

    /// The model's config and the feed-forward cut unit (see `cut_unit`) of
    /// its `ffn_down` matrix.
    pub fn ffn_unit(path: &Path) -> Result<(ModelConfig, usize), PodModelError> {
        let (file, cfg) = open(path)?;
        let unit = file
            .tensors
            .get("blk.0.ffn_down.weight")
            .map_or(1, |e| cut_unit(e.dtype));
        Ok((cfg, unit))
    }

    /// Like [`load_gguf`](Self::load_gguf), but first refuses (with
    /// [`PodModelError::OverBudget`], before reading any weight) a share
    /// whose weights plus KV cache exceed `budget`.
    pub fn load_gguf_within(
        path: &Path,
        plan: PodPlan,
        rank: usize,
        compute: Compute,
        budget: MemoryBudget,
    ) -> Result<PodModel, PodModelError> {
        let (file, cfg) = open(path)?;
        let (weights, kv) = share_bytes(&file, &cfg, &plan, rank, compute, budget.positions)?;
        if weights + kv > budget.bytes {
            return Err(PodModelError::OverBudget {
                rank,
                share: plan.describe(rank),
                weights,
                kv,
                positions: budget.positions,
                budget: budget.bytes,
            });
        }
        Self::load(&file, cfg, plan, rank, compute)
    }

    fn load(
        g: &GgufFile,
        cfg: ModelConfig,
        plan: PodPlan,
        rank: usize,
        compute: Compute,
    ) -> Result<PodModel, PodModelError> {
        let n = plan.ranks();
        if rank >= n {
            return Err(PodModelError::Plan(format!("rank {rank} in a pod of {n}")));
        }
        if cfg.moe.is_some() {
            return Err(PodModelError::Plan(format!(
                "{} is a mixture-of-experts model: pods do not split experts yet (issue 19)",
                cfg.architecture_name
            )));
        }
        let w = WeightSource::Gguf(g);
        let s = Slicer { g, compute };
        let (h, hd, ff) = (cfg.hidden_size, cfg.head_dim, cfg.intermediate_size);
        let group = cfg.heads / cfg.kv_heads;
        let (layers, kvr, ffr) = match &plan {
            PodPlan::Tensor {
                kv_heads,
                ffn,
                vocab,
            } => {
                let covers = |r: &[Range<usize>], total: usize| {
                    r.first().map(|x| x.start) == Some(0)
                        && r.last().map(|x| x.end) == Some(total)
                        && r.windows(2).all(|p| p[0].end == p[1].start)
                };
                if ffn.len() != n
                    || vocab.len() != n
                    || !covers(kv_heads, cfg.kv_heads)
                    || !covers(ffn, ff)
                    || !covers(vocab, cfg.vocab_size)
                {
                    return Err(PodModelError::Plan(format!(
                        "tensor shares {kv_heads:?} / {ffn:?} do not cover {} kv heads and {ff} columns",
                        cfg.kv_heads
                    )));
                }
                (0..cfg.layers, kv_heads[rank].clone(), ffn[rank].clone())
            }
            PodPlan::Pipeline { layers } => {
                if layers.last().map(|l| l.end) != Some(cfg.layers) {
                    return Err(PodModelError::Plan(format!(
                        "stages {layers:?} do not cover {} layers",
                        cfg.layers
                    )));
                }
                (layers[rank].clone(), 0..cfg.kv_heads, 0..ff)
            }
        };
        let qr = kvr.start * group * hd..kvr.end * group * hd;
        let kr = kvr.start * hd..kvr.end * hd;
        let mut blocks = Vec::with_capacity(layers.len());
        for i in layers.clone() {
            let p = |x: &str| format!("blk.{i}.{x}");
            let (q_norm, k_norm) = if cfg.qk_norm {
                (
                    Some(w.vector(&p("attn_q_norm"), "weight", hd)?),
                    Some(w.vector(&p("attn_k_norm"), "weight", hd)?),
                )
            } else {
                (None, None)
            };
            blocks.push(Block {
                attn_norm: w.vector(&p("attn_norm"), "weight", h)?,
                q: s.rows(&p("attn_q"), cfg.heads * hd, h, qr.clone(), cfg.qkv_bias)?,
                k: s.rows(&p("attn_k"), cfg.kv_heads * hd, h, kr.clone(), cfg.qkv_bias)?,
                v: s.rows(&p("attn_v"), cfg.kv_heads * hd, h, kr.clone(), cfg.qkv_bias)?,
                o: s.cols(&p("attn_output"), h, cfg.heads * hd, qr.clone())?,
                q_norm,
                k_norm,
                ffn_norm: w.vector(&p("ffn_norm"), "weight", h)?,
                ffn: FeedForward::Dense {
                    gate: s.rows(&p("ffn_gate"), ff, h, ffr.clone(), false)?,
                    up: s.rows(&p("ffn_up"), ff, h, ffr.clone(), false)?,
                    down: s.cols(&p("ffn_down"), h, ff, ffr.clone())?,
                },
                extras: LayerExtras::load(&cfg, &w, i)?,
            });
        }
        let tensor = matches!(plan, PodPlan::Tensor { .. });
        let has_embed = tensor || rank == 0;
        let has_head = tensor || rank == n - 1;
        let vocab = match &plan {
            PodPlan::Tensor { vocab, .. } => vocab.clone(),
            PodPlan::Pipeline { .. } => Vec::new(),
        };
        let my_vocab = if tensor {
            vocab[rank].clone()
        } else {
            0..cfg.vocab_size
        };
        let embed = if has_embed {
            Some(w.embedding("token_embd", cfg.vocab_size, h)?)
        } else {
            None
        };
        let head = if has_head {
            let norm = w.vector("output_norm", "weight", h)?;
            let name = if w.has("output") {
                "output"
            } else {
                "token_embd"
            };
            let lm = s.rows(name, cfg.vocab_size, h, my_vocab, false)?;
            Some((norm, lm))
        } else {
            None
        };
        let rope = rope_for(&cfg, &w)?;
        let rope_local = local_rope_for(&cfg);
        Ok(PodModel {
            heads: kvr.len() * group,
            kv_heads: kvr.len(),
            cfg,
            rank,
            plan,
            embed,
            blocks,
            head,
            rope,
            rope_local,
            cache: Vec::new(),
            capacity: 0,
            pos: 0,
            cs: Vec::new(),
            micro: None,
            vocab,
        })
    }

    /// Whether this is a pipeline stage (not a tensor-parallel share).
    pub fn is_pipeline(&self) -> bool {
        matches!(self.plan, PodPlan::Pipeline { .. })
    }

    fn shape(&self) -> AttnShape {
        AttnShape {
            heads: self.heads,
            kv_heads: self.kv_heads,
            head_dim: self.cfg.head_dim,
            capacity: self.capacity,
        }
    }

    /// Empties the cache and makes room for `capacity` positions.
    pub fn reset(&mut self, capacity: usize) {
        self.pos = 0;
        if capacity > self.capacity || self.cache.len() != self.blocks.len() {
            self.capacity = capacity;
            let shape = self.shape();
            self.cache = (0..self.blocks.len())
                .map(|_| LayerCache::new(shape))
                .collect();
        }
    }

    /// Runs `tokens` (the same on every rank) at the next positions; rank 0
    /// gets the logits of the last one, the others `None`.
    ///
    /// Pipeline parallel, the tokens flow through the stages in
    /// micro-batches ([`PodModel::micro_batch`]): stage `r` runs chunk `i`
    /// while stage `r + 1` runs chunk `i - 1`, so a long prompt keeps every
    /// stage busy. Each stage still sees its chunks in order, at increasing
    /// positions, so its KV cache and results are what one pass computes.
    pub fn forward(
        &mut self,
        tokens: &[u32],
        comm: &mut dyn Collective,
    ) -> Result<Option<Vec<f32>>, PodModelError> {
        let s = tokens.len();
        if s == 0 || self.pos + s > self.capacity {
            return Err(PodModelError::Plan(format!(
                "{s} tokens at position {} exceed the cache of {}",
                self.pos, self.capacity
            )));
        }
        if let Some(bad) = tokens.iter().find(|&&t| t as usize >= self.cfg.vocab_size) {
            return Err(PodModelError::Plan(format!(
                "token {bad} is outside the vocabulary of {}",
                self.cfg.vocab_size
            )));
        }
        if matches!(self.plan, PodPlan::Tensor { .. }) {
            return self.forward_tensor(tokens, comm);
        }
        let micro = self.micro_batch(s, comm.size());
        let chunks = s.div_ceil(micro);
        let mut last = Vec::new();
        for (i, chunk) in tokens.chunks(micro).enumerate() {
            let x = self.stage(chunk, comm)?;
            if i + 1 == chunks {
                last = x;
            }
        }
        self.pipeline_logits(&last, comm)
    }

    /// Tokens per pipeline micro-batch for a pass of `s` tokens over `n`
    /// stages: the configured size ([`PodModel::set_micro_batch`]), else
    /// about `s / 8n` (the bubble, `n - 1` chunks of `s / chunk + n - 1`,
    /// stays near 1/8) but at least [`MIN_MICRO_BATCH`] (smaller chunks
    /// waste more on per-pass costs than the bubble costs) and at most
    /// [`MAX_MICRO_BATCH`], in multiples of 8 (the kernels' batched path).
    pub fn micro_batch(&self, s: usize, n: usize) -> usize {
        let size = self.micro.unwrap_or_else(|| {
            s.div_ceil(8 * n.max(1))
                .clamp(MIN_MICRO_BATCH, MAX_MICRO_BATCH)
        });
        size.div_ceil(8).max(1) * 8
    }

    /// Fixes the pipeline micro-batch size (`None`: chosen per pass).
    pub fn set_micro_batch(&mut self, tokens: Option<usize>) {
        self.micro = tokens.filter(|&t| t > 0);
    }

    /// One pipeline stage's share of one chunk: embed (stage 0) or receive
    /// the previous stage's hidden states, run this stage's layers, send
    /// them on (all stages but the last). Returns the hidden states.
    fn stage(
        &mut self,
        chunk: &[u32],
        comm: &mut dyn Collective,
    ) -> Result<Vec<f32>, PodModelError> {
        let (s, h) = (chunk.len(), self.cfg.hidden_size);
        let mut x = match &self.embed {
            Some(e) => {
                let mut x = e.lookup(chunk)?;
                scale_embeddings(&mut x, self.cfg.embed_scale);
                x
            }
            None => {
                let mut x = vec![0.0f32; s * h];
                profile::time(Part::Collective, || {
                    comm.recv(bytemuck::cast_slice_mut(&mut x), self.rank - 1)
                })?;
                x
            }
        };
        self.run_blocks(&mut x, s, &mut |_| Ok(()))?;
        if self.rank + 1 < comm.size() {
            profile::time(Part::Collective, || {
                comm.send(bytemuck::cast_slice(&x), self.rank + 1)
            })?;
        }
        Ok(x)
    }

    /// This rank's layers over `x` (`s` tokens at the next positions).
    fn run_blocks(
        &mut self,
        x: &mut [f32],
        s: usize,
        reduce: &mut dyn FnMut(&mut [f32]) -> Result<(), PodModelError>,
    ) -> Result<(), PodModelError> {
        let mut step = Step {
            s,
            pos: self.pos,
            shape: self.shape(),
            eps: self.cfg.rms_eps,
            rope: &self.rope,
            rope_local: self.rope_local.as_ref(),
            act: self.cfg.activation,
            attn_scale: self.cfg.attn_scale,
            cs: &mut self.cs,
        };
        for (block, cache) in self.blocks.iter().zip(self.cache.iter_mut()) {
            block.forward(x, cache, &mut step, reduce)?;
        }
        self.pos += s;
        Ok(())
    }

    /// The output head on the last token of `x` (this rank's rows of it).
    fn logits(&self, x: &[f32]) -> Result<Vec<f32>, PodModelError> {
        let h = self.cfg.hidden_size;
        let head = self
            .head
            .as_ref()
            .ok_or_else(|| PodModelError::Plan("no output head".into()))?;
        let mut last = x[x.len() - h..].to_vec();
        profile::time(Part::Norm, || {
            ops::rms_norm(&mut last, &head.0, self.cfg.rms_eps)
        });
        Ok(head.1.forward_slice(&last, 1)?)
    }

    /// Tensor parallel: every layer's two partial sums completed by an
    /// all-reduce; the vocabulary rows' logits gathered on rank 0.
    fn forward_tensor(
        &mut self,
        tokens: &[u32],
        comm: &mut dyn Collective,
    ) -> Result<Option<Vec<f32>>, PodModelError> {
        let s = tokens.len();
        let mut x = self
            .embed
            .as_ref()
            .ok_or_else(|| PodModelError::Plan("no embedding".into()))?
            .lookup(tokens)?;
        scale_embeddings(&mut x, self.cfg.embed_scale);
        self.run_blocks(&mut x, s, &mut |part| Ok(all_reduce(comm, part)?))?;
        // Each rank has its vocabulary rows; only rank 0 needs them all,
        // so the others send theirs straight into its logits vector.
        let mine = self.logits(&x)?;
        profile::time(Part::Collective, || {
            if self.rank != 0 {
                comm.send(bytemuck::cast_slice(&mine), 0)?;
                return Ok(None);
            }
            let mut out = vec![0f32; self.cfg.vocab_size];
            for (r, range) in self.vocab.iter().enumerate() {
                let dst = &mut out[range.clone()];
                if r == 0 {
                    dst.copy_from_slice(&mine);
                } else {
                    comm.recv(bytemuck::cast_slice_mut(dst), r)?;
                }
            }
            Ok(Some(out))
        })
    }

    /// Pipeline: the last stage's logits of the last chunk (`last`, its
    /// hidden states there) reach rank 0.
    fn pipeline_logits(
        &self,
        last: &[f32],
        comm: &mut dyn Collective,
    ) -> Result<Option<Vec<f32>>, PodModelError> {
        let end = comm.size() - 1;
        match (self.head.is_some(), self.rank) {
            (true, 0) => Ok(Some(self.logits(last)?)),
            (true, _) => {
                let l = self.logits(last)?;
                profile::time(Part::Collective, || comm.send(bytemuck::cast_slice(&l), 0))?;
                Ok(None)
            }
            (false, 0) => {
                let mut out = vec![0f32; self.cfg.vocab_size];
                profile::time(Part::Collective, || {
                    comm.recv(bytemuck::cast_slice_mut(&mut out), end)
                })?;
                Ok(Some(out))
            }
            (false, _) => Ok(None),
        }
    }
}

/// Bytes rank `rank` holds under `plan`: its weights (as stored, or as f32
/// under [`Compute::F32`]) and a KV cache (f32 keys and values) of
/// `positions` positions. Tensor shares count each matrix in proportion to
/// the rows or columns the rank takes.
pub fn share_bytes(
    g: &GgufFile,
    cfg: &ModelConfig,
    plan: &PodPlan,
    rank: usize,
    compute: Compute,
    positions: usize,
) -> Result<(u64, u64), PodModelError> {
    if rank >= plan.ranks() {
        return Err(PodModelError::Plan(format!(
            "rank {rank} in a pod of {}",
            plan.ranks()
        )));
    }
    let bytes = |name: &str| -> f64 {
        g.tensors.get(name).map_or(0.0, |e| match compute {
            Compute::Native => e.len as f64,
            Compute::F32 => 4.0 * e.shape.iter().product::<usize>() as f64,
        })
    };
    // A layer's attention matrices count by the attention share, its
    // feed-forward matrices by the feed-forward share, the rest (norms,
    // biases) whole.
    let layer = |i: usize, attn: f64, ffn: f64| -> f64 {
        let prefix = format!("blk.{i}.");
        g.tensors
            .keys()
            .filter_map(|name| Some((name, name.strip_prefix(&prefix)?)))
            .map(|(name, local)| {
                let share = if local.starts_with("attn_") && !local.contains("norm") {
                    attn
                } else if local.starts_with("ffn_") && !local.contains("norm") {
                    ffn
                } else {
                    1.0
                };
                share * bytes(name)
            })
            .sum()
    };
    let head_name = if g.tensors.contains_key("output.weight") {
        "output.weight"
    } else {
        "token_embd.weight"
    };
    // The embedding stays as stored, except float tables, which load as f32.
    let embed = g
        .tensors
        .get("token_embd.weight")
        .map_or(0.0, |e| match e.dtype {
            GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16 => {
                4.0 * e.shape.iter().product::<usize>() as f64
            }
            _ => e.len as f64,
        });
    let hd = cfg.head_dim as f64;
    let kv_layer = |kv_heads: usize| 2.0 * 4.0 * kv_heads as f64 * positions as f64 * hd;
    let (weights, kv) = match plan {
        PodPlan::Tensor {
            kv_heads,
            ffn,
            vocab,
        } => {
            let attn = kv_heads[rank].len() as f64 / cfg.kv_heads as f64;
            let ff = ffn[rank].len() as f64 / cfg.intermediate_size as f64;
            let head = vocab[rank].len() as f64 / cfg.vocab_size as f64;
            let layers: f64 = (0..cfg.layers).map(|i| layer(i, attn, ff)).sum();
            // Every rank embeds and holds its rows of the head.
            (
                layers + embed + head * bytes(head_name) + bytes("output_norm.weight"),
                cfg.layers as f64 * kv_layer(kv_heads[rank].len()),
            )
        }
        PodPlan::Pipeline { layers } => {
            let r = layers[rank].clone();
            let mut w: f64 = r.clone().map(|i| layer(i, 1.0, 1.0)).sum();
            if rank == 0 {
                w += embed;
            }
            if rank + 1 == layers.len() {
                w += bytes(head_name) + bytes("output_norm.weight");
            }
            (w, r.len() as f64 * kv_layer(cfg.kv_heads))
        }
    };
    Ok((weights.ceil() as u64, kv.ceil() as u64))
}

/// Greedy generation driven by rank 0: every step rank 0 broadcasts the
/// tokens to run (the prompt, then each sampled token), all ranks run the
/// step, rank 0 takes the arg-max of its logits. Returns (on rank 0) the
/// logits of every step and the generated tokens; other ranks return empty
/// vectors. `prompt` matters on rank 0 only; `steps` is the same everywhere.
pub fn generate_greedy(
    model: &mut PodModel,
    comm: &mut dyn Collective,
    prompt: &[u32],
    steps: usize,
) -> Result<(Vec<Vec<f32>>, Vec<u32>), PodModelError> {
    let mut len = [prompt.len() as u32];
    comm.broadcast(bytemuck::cast_slice_mut(&mut len), 0)?;
    let mut tokens = vec![0u32; len[0] as usize];
    if comm.rank() == 0 {
        tokens.copy_from_slice(prompt);
    }
    comm.broadcast(bytemuck::cast_slice_mut(&mut tokens), 0)?;
    model.reset(tokens.len() + steps);
    let (mut all_logits, mut out) = (Vec::new(), Vec::new());
    let mut step_tokens = tokens;
    for _ in 0..steps {
        let logits = model.forward(&step_tokens, comm)?;
        let mut next = [0u32];
        if let Some(l) = logits {
            next[0] = l
                .iter()
                .enumerate()
                .fold((0usize, f32::NEG_INFINITY), |best, (i, &v)| {
                    if v > best.1 {
                        (i, v)
                    } else {
                        best
                    }
                })
                .0 as u32;
            all_logits.push(l);
            out.push(next[0]);
        }
        comm.broadcast(bytemuck::cast_slice_mut(&mut next), 0)?;
        step_tokens = vec![next[0]];
    }
    Ok((all_logits, out))
}

#[cfg(test)]
mod tests;
