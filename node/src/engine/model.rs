//! The Llama-family decoder: Llama 2/3, SmolLM2, Mistral, Qwen2 (q/k/v bias),
//! Qwen3 (per-head q/k RMS norm), Qwen3-MoE (Qwen3's attention, routed
//! experts as the feed-forward: `super::moe`), and Gemma 3 (`super::gemma3`:
//! post norms, GeGLU, scaled embeddings, sliding-window layers with their own
//! rotary base).
//!
//! Architecture (as in Hugging Face's `modeling_llama.py` and llama.cpp's
//! `llm_build_llama`): token embedding, then per layer
//! `x += o(attn(rope(q(norm(x))), rope(k(norm(x))), v(norm(x))))` and
//! `x += down(silu(gate(norm(x))) * up(norm(x)))`, then a final norm and the
//! output projection (tied to the embedding when the file has none).
//!
//! One [`Block`] type and one [`Block::forward`] serve the whole model and a
//! pod rank's share of it (`super::sharded`): a rank's block holds its range of
//! heads and feed-forward columns, and passes an all-reduce where a single
//! node passes nothing.
//!
//! Two ways to run it: one sequence in the model's own contiguous cache
//! ([`Model::forward`], for `Engine::generate`, audits and benches), or many
//! sequences in one pass over a shared paged cache ([`Model::forward_batch`],
//! the node's continuous batching, `super::batch`). Both go through
//! [`Block::forward_rows`], so they compute the same numbers.
//!
//! # Invariants
//! - The own KV cache holds `capacity` positions per layer, allocated once per
//!   generation ([`Model::reset`]); tokens are written in place, never
//!   concatenated. `pos` counts the positions filled.
//! - [`Model::forward`] is only called with `pos + tokens <= capacity` and
//!   token ids `< vocab_size` (the engine checks both).

use super::batch::{Pass, SeqChunk};
use super::config::{Activation, ModelConfig, RopeScaling};
use super::kv::{self, Attend, KvLayer, KvPool, KvShape, Rows};
use super::linear::Linear;
use super::moe::MoeFfn;
use super::ops::{self, AttnShape, LayerCache, Rope};
use super::profile::{self, Part};
use super::weights::{Embedding, WeightSource};
use super::EngineError;

/// One transformer block: norms, attention projections (optional q/k norms),
/// SwiGLU feed-forward. A pod rank holds a block of the same type with its
/// share of the heads and feed-forward columns.
#[derive(Debug, Clone)]
pub struct Block {
    pub(crate) attn_norm: Vec<f32>,
    pub(crate) q: Linear,
    pub(crate) k: Linear,
    pub(crate) v: Linear,
    pub(crate) o: Linear,
    pub(crate) q_norm: Option<Vec<f32>>,
    pub(crate) k_norm: Option<Vec<f32>>,
    pub(crate) ffn_norm: Vec<f32>,
    pub(crate) ffn: FeedForward,
    /// What Gemma adds; empty for the Llama family.
    pub(crate) extras: LayerExtras,
}

/// A block's feed-forward.
#[derive(Debug, Clone)]
pub(crate) enum FeedForward {
    /// One gated MLP for every token (a pod rank's share of its columns).
    Dense {
        gate: Linear,
        up: Linear,
        down: Linear,
    },
    /// Routed experts (`super::moe`).
    Moe(MoeFfn),
}

impl FeedForward {
    /// The dense MLP of `cfg`'s layer `i`, or its experts when `cfg` has them.
    fn load(cfg: &ModelConfig, w: &WeightSource<'_>, i: usize) -> Result<Self, EngineError> {
        let (h, ff) = (cfg.hidden_size, cfg.intermediate_size);
        let p = |s: &str| format!("blk.{i}.{s}");
        Ok(match &cfg.moe {
            Some(moe) => FeedForward::Moe(MoeFfn::load(moe, w, i, h)?),
            None => FeedForward::Dense {
                gate: w.linear(&p("ffn_gate"), ff, h, false)?,
                up: w.linear(&p("ffn_up"), ff, h, false)?,
                down: w.linear(&p("ffn_down"), h, ff, false)?,
            },
        })
    }

    /// Weights held, and weights one token reads.
    fn parameters(&self) -> (u64, u64) {
        let lin = |l: &Linear| (l.out_features() * l.in_features()) as u64;
        match self {
            FeedForward::Dense { gate, up, down } => {
                let n = lin(gate) + lin(up) + lin(down);
                (n, n)
            }
            FeedForward::Moe(m) => m.parameters(),
        }
    }
}

/// In place: `gate <- act(gate) * up`.
pub(crate) fn activate(act: Activation, gate: &mut [f32], up: &[f32]) {
    match act {
        Activation::Silu => ops::swiglu(gate, up),
        Activation::GeluTanh => super::gemma3::geglu(gate, up),
    }
}

/// A layer's parts beyond the Llama block (Gemma 3).
#[derive(Debug, Clone, Default)]
pub struct LayerExtras {
    /// RMS norm of the attention output, before the residual add.
    pub(crate) post_attn_norm: Option<Vec<f32>>,
    /// RMS norm of the feed-forward output, before the residual add.
    pub(crate) post_ffn_norm: Option<Vec<f32>>,
    /// Sliding window: the layer sees only the last `window` positions and
    /// uses the local rotary embedding.
    pub(crate) window: Option<usize>,
}

impl LayerExtras {
    /// Layer `i`'s extras as the config asks for them.
    pub(crate) fn load(
        cfg: &ModelConfig,
        w: &WeightSource<'_>,
        i: usize,
    ) -> Result<Self, EngineError> {
        let h = cfg.hidden_size;
        let norm = |name: &str| -> Result<Option<Vec<f32>>, EngineError> {
            if cfg.post_norms {
                Ok(Some(w.vector(&format!("blk.{i}.{name}"), "weight", h)?))
            } else {
                Ok(None)
            }
        };
        Ok(LayerExtras {
            post_attn_norm: norm("post_attention_norm")?,
            post_ffn_norm: norm("post_ffw_norm")?,
            window: cfg
                .sliding_window
                .as_ref()
                .filter(|sw| sw.applies(i))
                .map(|sw| sw.window),
        })
    }
}

/// The rotary embedding the config and the file ask for (frequency factors
/// from the config or the file's `rope_freqs`, linear scaling).
pub(crate) fn rope_for(cfg: &ModelConfig, w: &WeightSource<'_>) -> Result<Rope, EngineError> {
    let factors = match &cfg.rope_scaling {
        RopeScaling::FreqFactors(f) => Some(f.clone()),
        _ => w.optional_vector("rope_freqs.weight", cfg.rope_dims / 2)?,
    };
    let freq_scale = match cfg.rope_scaling {
        RopeScaling::Linear { factor } => 1.0 / factor,
        _ => 1.0,
    };
    Ok(Rope::new(
        cfg.rope_dims,
        cfg.rope_theta,
        freq_scale,
        factors,
        cfg.rope_interleaved,
    ))
}

/// The rotary embedding of sliding-window layers (Gemma 3), if any.
pub(crate) fn local_rope_for(cfg: &ModelConfig) -> Option<Rope> {
    cfg.sliding_window.as_ref().map(|sw| {
        Rope::new(
            cfg.rope_dims,
            sw.rope_theta,
            1.0,
            None,
            cfg.rope_interleaved,
        )
    })
}

/// Everything a block needs besides its weights, for one forward pass.
pub(crate) struct Step<'a> {
    /// Tokens in this pass.
    pub s: usize,
    /// Position of the first of them.
    pub pos: usize,
    pub shape: AttnShape,
    pub eps: f32,
    pub rope: &'a Rope,
    /// The rotary embedding of windowed layers.
    pub rope_local: Option<&'a Rope>,
    pub act: Activation,
    pub attn_scale: f32,
    /// Scratch for the cos/sin of one position.
    pub cs: &'a mut Vec<(f32, f32)>,
}

impl Block {
    /// `x += attn(x)`, then `x += ffn(x)`, on `x` = `[s][hidden]`, storing the
    /// new keys and values in `cache`. `reduce` sums the attention and the
    /// feed-forward outputs across a pod's ranks before they are added (a
    /// single node passes a no-op).
    pub(crate) fn forward<E: From<candle_core::Error>>(
        &self,
        x: &mut [f32],
        cache: &mut LayerCache,
        step: &mut Step<'_>,
        reduce: &mut dyn FnMut(&mut [f32]) -> Result<(), E>,
    ) -> Result<(), E> {
        let rows = Rows::contiguous(step.pos, step.s);
        let mut kv = KvLayer::contiguous(cache, step.shape);
        self.forward_rows(x, &mut kv, &rows, step, reduce)
    }

    /// [`Block::forward`] over the rows of one or several sequences
    /// (`rows`, checked against `kv`): each row takes its own position and
    /// is stored into and attends over its own sequence's pages. `step.s`
    /// and `step.pos` are not read.
    pub(crate) fn forward_rows<E: From<candle_core::Error>>(
        &self,
        x: &mut [f32],
        kv: &mut KvLayer<'_>,
        rows: &Rows<'_>,
        step: &mut Step<'_>,
        reduce: &mut dyn FnMut(&mut [f32]) -> Result<(), E>,
    ) -> Result<(), E> {
        let (s, shape, eps) = (rows.len(), step.shape, step.eps);
        let hd = shape.head_dim;
        let norm = |x: &[f32], w: &[f32]| {
            profile::time(Part::Norm, || {
                let mut hn = x.to_vec();
                ops::rms_norm(&mut hn, w, eps);
                hn
            })
        };
        let hn = norm(x, &self.attn_norm);
        let [mut q, mut k, v] = Linear::forward_shared([&self.q, &self.k, &self.v], &hn, s)?;
        let rope = match (self.extras.window, step.rope_local) {
            (Some(_), Some(local)) => local,
            _ => step.rope,
        };
        profile::time(Part::Norm, || {
            if let Some(w) = &self.q_norm {
                ops::rms_norm(&mut q, w, eps);
            }
            if let Some(w) = &self.k_norm {
                ops::rms_norm(&mut k, w, eps);
            }
            for t in 0..s {
                rope.cos_sin(rows.position(t), step.cs);
                for head in q[t * shape.heads * hd..(t + 1) * shape.heads * hd].chunks_exact_mut(hd)
                {
                    rope.apply(head, step.cs);
                }
                for head in
                    k[t * shape.kv_heads * hd..(t + 1) * shape.kv_heads * hd].chunks_exact_mut(hd)
                {
                    rope.apply(head, step.cs);
                }
            }
        });
        let att = profile::time(Part::Attention, || {
            kv::store(kv, rows, &k, &v);
            let attend = Attend {
                heads: shape.heads,
                scale: step.attn_scale,
                window: self.extras.window,
            };
            kv::attention(&q, kv, rows, attend)
        });
        let mut o = self.o.forward_slice(&att, s)?;
        profile::time(Part::Collective, || reduce(&mut o))?;
        profile::time(Part::Norm, || {
            if let Some(w) = &self.extras.post_attn_norm {
                ops::rms_norm(&mut o, w, eps);
            }
            ops::add_assign(x, &o)
        });

        let hn = norm(x, &self.ffn_norm);
        let mut d = match &self.ffn {
            FeedForward::Dense { gate, up, down } => {
                let [mut g, u] = Linear::forward_shared([gate, up], &hn, s)?;
                profile::time(Part::Norm, || activate(step.act, &mut g, &u));
                down.forward_slice(&g, s)?
            }
            FeedForward::Moe(moe) => moe.forward(&hn, s, step.act)?,
        };
        profile::time(Part::Collective, || reduce(&mut d))?;
        profile::time(Part::Norm, || {
            if let Some(w) = &self.extras.post_ffn_norm {
                ops::rms_norm(&mut d, w, eps);
            }
            ops::add_assign(x, &d)
        });
        Ok(())
    }
}

/// In place: the token embeddings times `scale` (Gemma's `sqrt(hidden)`).
pub(crate) fn scale_embeddings(x: &mut [f32], scale: f32) {
    if scale != 1.0 {
        for v in x.iter_mut() {
            *v *= scale;
        }
    }
}

/// The whole model with its KV cache.
#[derive(Debug, Clone)]
pub struct Model {
    pub cfg: ModelConfig,
    embed: Embedding,
    blocks: Vec<Block>,
    norm: Vec<f32>,
    lm_head: Linear,
    /// The output projection is the embedding table.
    tied: bool,
    rope: Rope,
    rope_local: Option<Rope>,
    cache: Vec<LayerCache>,
    capacity: usize,
    pos: usize,
    /// Scratch for the cos/sin of one position.
    cs: Vec<(f32, f32)>,
}

impl Model {
    /// Loads every weight, checking each shape against `cfg`.
    pub fn load(cfg: ModelConfig, w: &WeightSource<'_>) -> Result<Model, EngineError> {
        let h = cfg.hidden_size;
        let hd = cfg.head_dim;
        let q_out = cfg.heads * hd;
        let kv_out = cfg.kv_heads * hd;
        let embed = w.embedding("token_embd", cfg.vocab_size, h)?;
        let mut blocks = Vec::with_capacity(cfg.layers);
        for i in 0..cfg.layers {
            let p = |s: &str| format!("blk.{i}.{s}");
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
                q: w.linear(&p("attn_q"), q_out, h, cfg.qkv_bias)?,
                k: w.linear(&p("attn_k"), kv_out, h, cfg.qkv_bias)?,
                v: w.linear(&p("attn_v"), kv_out, h, cfg.qkv_bias)?,
                o: w.linear(&p("attn_output"), h, q_out, false)?,
                q_norm,
                k_norm,
                ffn_norm: w.vector(&p("ffn_norm"), "weight", h)?,
                ffn: FeedForward::load(&cfg, w, i)?,
                extras: LayerExtras::load(&cfg, w, i)?,
            });
        }
        let norm = w.vector("output_norm", "weight", h)?;
        // Tied embeddings: no output matrix, the embedding table is reused.
        let tied = !w.has("output");
        let lm_head = if !tied {
            w.linear("output", cfg.vocab_size, h, false)?
        } else {
            w.linear("token_embd", cfg.vocab_size, h, false)?
        };
        let rope = rope_for(&cfg, w)?;
        let rope_local = local_rope_for(&cfg);
        Ok(Model {
            cfg,
            embed,
            blocks,
            norm,
            lm_head,
            tied,
            rope,
            rope_local,
            cache: Vec::new(),
            capacity: 0,
            pos: 0,
            cs: Vec::new(),
        })
    }

    /// Total number of weights.
    pub fn parameters(&self) -> u64 {
        self.parameter_counts().0
    }

    /// Weights one token reads: [`Model::parameters`] less the experts a
    /// token does not use (the same for a dense model).
    pub fn active_parameters(&self) -> u64 {
        self.parameter_counts().1
    }

    /// (total, active) numbers of weights.
    fn parameter_counts(&self) -> (u64, u64) {
        let lin = |l: &Linear| (l.out_features() * l.in_features()) as u64;
        let h = self.cfg.hidden_size as u64;
        let mut n = (self.embed.rows() as u64) * h + h;
        let mut unused = 0;
        for b in &self.blocks {
            n += 2 * h;
            n += [&b.extras.post_attn_norm, &b.extras.post_ffn_norm]
                .iter()
                .filter_map(|v| v.as_ref())
                .map(|v| v.len() as u64)
                .sum::<u64>();
            n += lin(&b.q) + lin(&b.k) + lin(&b.v) + lin(&b.o);
            let (all, active) = b.ffn.parameters();
            n += all;
            unused += all - active;
            n += [&b.q_norm, &b.k_norm]
                .iter()
                .filter_map(|v| v.as_ref())
                .map(|v| v.len() as u64)
                .sum::<u64>();
        }
        if !self.tied() {
            n += lin(&self.lm_head);
        }
        (n, n - unused)
    }

    fn tied(&self) -> bool {
        self.tied
    }

    fn shape(&self) -> AttnShape {
        AttnShape {
            heads: self.cfg.heads,
            kv_heads: self.cfg.kv_heads,
            head_dim: self.cfg.head_dim,
            capacity: self.capacity,
        }
    }

    /// Empties the cache and makes room for `capacity` positions (reusing the
    /// previous allocation when it is large enough).
    pub fn reset(&mut self, capacity: usize) {
        self.pos = 0;
        if capacity > self.capacity || self.cache.len() != self.cfg.layers {
            self.capacity = capacity;
            let shape = self.shape();
            self.cache = (0..self.cfg.layers)
                .map(|_| LayerCache::new(shape))
                .collect();
        }
    }

    /// Runs `tokens` at the next positions, fills the cache and returns the
    /// logits of the last one.
    pub fn forward(&mut self, tokens: &[u32]) -> Result<Vec<f32>, EngineError> {
        self.forward_rows(tokens, tokens.len() - 1)
    }

    /// Like [`Model::forward`], but returns the logits of every token from
    /// index `from` on (`tokens.len() - from` rows of `vocab_size`, one
    /// batched output projection; none when `from == tokens.len()`). The
    /// audit's teacher-forced pass reads every position this way.
    pub fn forward_rows(&mut self, tokens: &[u32], from: usize) -> Result<Vec<f32>, EngineError> {
        let s = tokens.len();
        let h = self.cfg.hidden_size;
        let eps = self.cfg.rms_eps;
        let pos = self.pos;
        let shape = self.shape();
        let mut x = self.embed.lookup(tokens)?;
        scale_embeddings(&mut x, self.cfg.embed_scale);
        let mut step = Step {
            s,
            pos,
            shape,
            eps,
            rope: &self.rope,
            rope_local: self.rope_local.as_ref(),
            act: self.cfg.activation,
            attn_scale: self.cfg.attn_scale,
            cs: &mut self.cs,
        };
        for (block, cache) in self.blocks.iter().zip(self.cache.iter_mut()) {
            block.forward::<EngineError>(&mut x, cache, &mut step, &mut |_| Ok(()))?;
        }
        self.pos += s;
        let rows = s.saturating_sub(from);
        if rows == 0 {
            return Ok(Vec::new());
        }
        let mut last = x[(s - rows) * h..].to_vec();
        ops::rms_norm(&mut last, &self.norm, eps);
        Ok(self.lm_head.forward_slice(&last, rows)?)
    }

    /// What one position takes in a paged KV cache for this model.
    pub fn kv_shape(&self) -> KvShape {
        KvShape {
            layers: self.cfg.layers,
            kv_heads: self.cfg.kv_heads,
            head_dim: self.cfg.head_dim,
        }
    }

    /// One pass over chunks of several sequences, each at its own positions
    /// and through its own pages of `pool` (see [`super::batch`]): every
    /// weight is read once for all their tokens. Returns the logits of the
    /// rows the chunks ask for, in order (`[rows][vocab_size]`). The
    /// model's own (single-sequence) cache is not touched.
    pub fn forward_batch(
        &mut self,
        pool: &mut KvPool,
        chunks: &[SeqChunk<'_>],
    ) -> Result<Vec<f32>, EngineError> {
        let pass = Pass::new(chunks, pool, self.kv_shape(), self.cfg.vocab_size)?;
        let eps = self.cfg.rms_eps;
        let mut x = self.embed.lookup(&pass.tokens)?;
        scale_embeddings(&mut x, self.cfg.embed_scale);
        let mut step = Step {
            s: pass.rows.len(),
            pos: 0,
            shape: self.shape(),
            eps,
            rope: &self.rope,
            rope_local: self.rope_local.as_ref(),
            act: self.cfg.activation,
            attn_scale: self.cfg.attn_scale,
            cs: &mut self.cs,
        };
        for (layer, block) in self.blocks.iter().enumerate() {
            let mut kv = pool.layer(layer);
            block.forward_rows::<EngineError>(
                &mut x,
                &mut kv,
                &pass.rows,
                &mut step,
                &mut |_| Ok(()),
            )?;
        }
        let (mut last, n) = pass.gather(&x, self.cfg.hidden_size);
        if n == 0 {
            return Ok(Vec::new());
        }
        ops::rms_norm(&mut last, &self.norm, eps);
        Ok(self.lm_head.forward_slice(&last, n)?)
    }
}
