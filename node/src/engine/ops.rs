//! The small per-token operations of the transformer, on f32 slices: RMS norm,
//! rotary embedding, SwiGLU, and the contiguous KV cache of one sequence
//! (stored into and attended over by [`super::kv`], which also runs the
//! paged cache of batched decoding).
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

/// Largest head dimension [`super::kv::attention`] handles (the config check rejects
/// larger ones).
pub const MAX_HEAD_DIM: usize = 512;

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
}
