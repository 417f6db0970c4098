//! The small per-token operations of the transformer, on f32 slices: RMS norm,
//! rotary embedding, SwiGLU and causal attention over the KV cache.
//!
//! These run between the weight matmuls ([`super::linear::Linear`]) and are
//! written as plain loops over contiguous rows, because on CPU a chain of
//! candle ops (each allocating and dispatching) costs more than the math for
//! the tiny tensors of single-token decoding.
//!
//! # Invariants
//! - Every function checks slice lengths against the dimensions it is given
//!   through the types of its callers; callers pass consistent shapes (the
//!   model config is validated), so the indexing below cannot go out of bounds.
//! - Arithmetic mirrors llama.cpp's CPU path (f32 accumulation with f64 sums
//!   in norms and softmax, K/V and attention operands rounded to f16 as in its
//!   default f16 cache, the same RoPE angle recurrence) so greedy decoding
//!   gives the same tokens.

use candle_core::Tensor;

/// Copies a tensor's values out as f32 (contiguous, row-major).
pub fn to_vec(t: &Tensor) -> candle_core::Result<Vec<f32>> {
    t.flatten_all()?.to_vec1::<f32>()
}

/// In place: each row of `x` (length `w.len()`) ← row / rms(row) · w.
pub fn rms_norm(x: &mut [f32], w: &[f32], eps: f32) {
    let n = w.len();
    for row in x.chunks_exact_mut(n) {
        // ggml sums the squares in f64.
        let mut sum = 0.0f64;
        for v in row.iter() {
            sum += f64::from(v * v);
        }
        let mean = (sum / n as f64) as f32;
        let scale = 1.0 / (mean + eps).sqrt();
        for (v, wi) in row.iter_mut().zip(w) {
            *v = *v * scale * wi;
        }
    }
}

/// Rotary embedding tables: the inverse frequencies of each rotated pair.
#[derive(Debug, Clone)]
pub struct Rope {
    /// cos/sin for one position: `rope_dims / 2` pairs.
    theta_scale: f32,
    freq_scale: f32,
    factors: Option<Vec<f32>>,
    pub dims: usize,
    pub interleaved: bool,
}

impl Rope {
    pub fn new(
        dims: usize,
        base: f32,
        freq_scale: f32,
        factors: Option<Vec<f32>>,
        interleaved: bool,
    ) -> Self {
        Rope {
            theta_scale: base.powf(-2.0 / dims as f32),
            freq_scale,
            factors,
            dims,
            interleaved,
        }
    }

    /// cos and sin of every pair at position `pos`, as llama.cpp computes them.
    pub fn cos_sin(&self, pos: usize, out: &mut Vec<(f32, f32)>) {
        out.clear();
        let mut theta = pos as f32;
        for i in 0..self.dims / 2 {
            let ff = self.factors.as_ref().map_or(1.0, |f| f[i]);
            let t = self.freq_scale * (theta / ff);
            out.push((t.cos(), t.sin()));
            theta *= self.theta_scale;
        }
    }

    /// In place on one head vector (length >= dims).
    pub fn apply(&self, head: &mut [f32], cs: &[(f32, f32)]) {
        let half = self.dims / 2;
        if self.interleaved {
            for (i, &(c, s)) in cs.iter().enumerate() {
                let x0 = head[2 * i];
                let x1 = head[2 * i + 1];
                head[2 * i] = x0 * c - x1 * s;
                head[2 * i + 1] = x0 * s + x1 * c;
            }
        } else {
            for (i, &(c, s)) in cs.iter().enumerate() {
                let x0 = head[i];
                let x1 = head[i + half];
                head[i] = x0 * c - x1 * s;
                head[i + half] = x0 * s + x1 * c;
            }
        }
    }
}

/// In place: `gate[i] ← silu(gate[i]) · up[i]`.
pub fn swiglu(gate: &mut [f32], up: &[f32]) {
    for (g, u) in gate.iter_mut().zip(up) {
        let x = *g;
        *g = x / (1.0 + (-x).exp()) * u;
    }
}

/// In place: `x[i] += y[i]`.
pub fn add_assign(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

/// Largest head dimension [`attention`] handles (the config check rejects
/// larger ones).
pub const MAX_HEAD_DIM: usize = 512;

/// `x` rounded to the nearest f16, back as f32.
fn round_f16(x: f32) -> f32 {
    half::f16::from_f32(x).to_f32()
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    // Eight independent accumulators let the compiler vectorise the loop.
    let mut acc = [0.0f32; 8];
    let chunks = a.len() / 8;
    for c in 0..chunks {
        let (x, y) = (&a[c * 8..c * 8 + 8], &b[c * 8..c * 8 + 8]);
        for j in 0..8 {
            acc[j] += x[j] * y[j];
        }
    }
    let mut sum: f32 = acc.iter().sum();
    for j in chunks * 8..a.len() {
        sum += a[j] * b[j];
    }
    sum
}

/// One layer's keys and values: `[kv_heads][capacity][head_dim]` each.
#[derive(Debug, Clone)]
pub struct LayerCache {
    pub k: Vec<f32>,
    pub v: Vec<f32>,
}

/// Shapes of one attention computation.
#[derive(Debug, Clone, Copy)]
pub struct AttnShape {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Positions the cache can hold.
    pub capacity: usize,
}

impl LayerCache {
    pub fn new(shape: AttnShape) -> Self {
        let n = shape.kv_heads * shape.capacity * shape.head_dim;
        LayerCache {
            k: vec![0.0; n],
            v: vec![0.0; n],
        }
    }

    /// Writes the keys/values of `s` new tokens (`[s][kv_heads][head_dim]`)
    /// at positions `pos..pos + s`, rounded to f16 as llama.cpp's default
    /// (f16) cache stores them.
    pub fn store(&mut self, shape: AttnShape, pos: usize, k: &[f32], v: &[f32]) {
        let hd = shape.head_dim;
        let s = k.len() / (shape.kv_heads * hd);
        for t in 0..s {
            for h in 0..shape.kv_heads {
                let src = (t * shape.kv_heads + h) * hd;
                let dst = (h * shape.capacity + pos + t) * hd;
                for (d, x) in self.k[dst..dst + hd].iter_mut().zip(&k[src..src + hd]) {
                    *d = round_f16(*x);
                }
                for (d, x) in self.v[dst..dst + hd].iter_mut().zip(&v[src..src + hd]) {
                    *d = round_f16(*x);
                }
            }
        }
    }
}

/// Causal attention of `s` queries at positions `pos..pos + s`
/// (`q`: `[s][heads][head_dim]`) over the cache, whose first `pos + s`
/// positions are filled, logits scaled by `scale` (`1 / sqrt(head_dim)` for
/// most models); with a `window`, each query sees only the last `window`
/// positions (itself included), as llama.cpp's standard sliding-window mask
/// (`p1 - p0 < window`). Returns `[s][heads][head_dim]`.
pub fn attention(
    q: &[f32],
    cache: &LayerCache,
    shape: AttnShape,
    pos: usize,
    window: Option<usize>,
    scale: f32,
) -> Vec<f32> {
    let hd = shape.head_dim;
    let group = shape.heads / shape.kv_heads;
    let s = q.len() / (shape.heads * hd);
    let mut out = vec![0.0f32; q.len()];
    let work = |idx: usize, o: &mut [f32]| {
        let t = idx / shape.heads;
        let h = idx % shape.heads;
        let kvh = h / group;
        let len = pos + t + 1;
        let first = window.map_or(0, |w| len.saturating_sub(w));
        // llama.cpp multiplies f16 K by q converted to f16, and f16 V by the
        // probabilities converted to f16; rounding the same way keeps greedy
        // decoding on the same tokens.
        let mut qv = [0f32; MAX_HEAD_DIM];
        let qv = &mut qv[..hd];
        for (d, &x) in qv.iter_mut().zip(&q[idx * hd..(idx + 1) * hd]) {
            *d = round_f16(x);
        }
        let base = kvh * shape.capacity * hd;
        let mut scores = Vec::with_capacity(len - first);
        let mut max = f32::NEG_INFINITY;
        for j in first..len {
            let kv = &cache.k[base + j * hd..base + (j + 1) * hd];
            let sc = dot(qv, kv) * scale;
            max = max.max(sc);
            scores.push(sc);
        }
        // ggml accumulates the softmax denominator in f64.
        let mut sum = 0.0f64;
        for sc in scores.iter_mut() {
            *sc = (*sc - max).exp();
            sum += f64::from(*sc);
        }
        let inv = (1.0 / sum) as f32;
        for (j, p) in (first..len).zip(&scores) {
            let w = round_f16(p * inv);
            let vv = &cache.v[base + j * hd..base + (j + 1) * hd];
            for (oi, vi) in o.iter_mut().zip(vv) {
                *oi += w * vi;
            }
        }
    };
    // Parallel over (token, head) pairs on the kernels' pool (one pool for all
    // the model's work, so two never compete for cores); a single short row
    // is not worth a fork.
    if s * shape.heads > 1 && pos + s > 64 {
        super::kernels::par_chunks_mut(&mut out, hd, work);
    } else {
        out.chunks_mut(hd).enumerate().for_each(|(i, o)| work(i, o));
    }
    out
}
