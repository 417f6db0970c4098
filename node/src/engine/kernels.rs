//! Fast CPU matrix products for quantized weights: GGUF `Q4_0`, `Q4_1`, `Q5_0`,
//! `Q8_0` and the K-quants `Q4_K`, `Q5_K`, `Q6_K` weight matrices times f32
//! activations, for the engine's weight matmuls.
//!
//! Why this exists: candle 0.11's CPU kernel for `Q4_1` is scalar, and its fast x86
//! kernels need `k` divisible by 256 (SmolLM2's `k` is 576), which leaves the node at
//! a third of llama.cpp's speed; its K-quant kernels do not repack, so the formats
//! real models ship in (`Q4_K_M`: Q4_K, Q6_K and, where a row is not a multiple
//! of 256, Q5_0) were the slow ones. These kernels follow ggml's scheme:
//! - the activations are quantized once per call into 8-bit blocks (see
//!   [`Scratch::quantize`]): for the 32-value formats ggml's `Q8_0`/`Q8_1` (scale
//!   `d = max|x| / 127`, kept rounded to f16 as ggml does, quants `round(x / d)`);
//!   for the K-quants ggml's `Q8_K` (256 values, f32 scale, and the sum of every
//!   16 quants);
//! - each output is a sum over blocks of `d_w * d_x * (integer dot of 32 quants)`,
//!   plus `m_w * s_x` for formats with a block minimum (`Q4_1`; `Q4_0`'s and
//!   `Q5_0`'s implicit offsets of -8 and -16 are folded in the same way); for a
//!   K-quant super-block of 256, `d_x * (d_w * sum_j sc_j * dot_j - dmin_w *
//!   sum_j m_j * bsum_j)` with the 6-bit (or, `Q6_K`, 8-bit) sub-block scales
//!   applied to exact integer dots, as ggml computes it;
//! - the integer dots run on the best instruction set of the CPU, chosen at run
//!   time ([`Isa::detect`]): AVX-512 VNNI (`vpdpbusd` on 256-bit registers,
//!   on 512-bit ones for repacked K-quants: two 8-row groups at once), AVX2
//!   (`vpmaddubsw`), NEON (widening multiplies), or portable scalar code;
//! - on x86-64, weights whose row count is a multiple of 8 are repacked at load
//!   time with 8 rows interleaved ([`packed`]), so one integer dot instruction
//!   advances 8 rows; that layout replaces the original (the same size; the
//!   K-quants' 6-bit sub-block scales are stored unpacked, 3% more);
//!   K-quant matrices whose row count is not a multiple of 8 (no real model
//!   has one) run the portable kernel on x86-64;
//! - work is split over candle's persistent barrier pool, the same threads that
//!   candle's own CPU ops use, so the two never compete for cores.
//!
//! Weights are read in place: the GGUF block bytes of a candle `QTensor` or of a
//! memory map, row after row. Nothing is allocated per call except the output
//! tensor of [`QuantLinear::forward`]; quantized activations live in a reusable
//! [`Scratch`] (one per thread for `forward`).
//!
//! # Unsafe
//! The house style allows `unsafe` only in the RDMA binding. This module is the
//! second, deliberate exception, because SIMD needs it: loads through pointers
//! (`_mm256_loadu_si256`, `vld1q_s8`, ...) and calls into functions compiled for
//! CPU features the binary is not built for. Every `unsafe` block carries a
//! `// SAFETY:` comment; loads only read from slices whose length was checked
//! just before, and a SIMD path is only entered after its CPU features were
//! detected at run time ([`Isa::available`]).
//!
//! # Invariants
//! - A weight matrix of `n` rows and `k` columns is `n * k / 32` blocks, row `r`
//!   at bytes `[r * row_bytes, (r + 1) * row_bytes)`; `k` is a multiple of 32.
//!   Checked when a [`QuantMatrix`] or [`QuantLinear`] is built.
//! - Every SIMD path computes the same sums as the scalar reference up to f32
//!   rounding (the tests compare them on random blocks for each path this CPU
//!   can run, including `k` not divisible by 256).
//! - Each activation row's outputs depend on that row alone, bit for bit: the
//!   same whatever other rows share the call and however the work is split
//!   (each output accumulates its blocks in order, in the same operations).
//!   Continuous batching (`super::batch`) relies on it for batched outputs to
//!   equal solo ones; a new kernel must keep it (a test checks every path).
//!
//! # Failure
//! Wrong formats, shapes or byte lengths are a [`KernelError`] when a matrix is
//! built or a product is called; nothing here panics on bad input.

use std::cell::RefCell;
use std::sync::{Arc, Mutex, OnceLock};

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Storage, Tensor};

use super::profile::Part;

#[cfg(target_arch = "aarch64")]
#[allow(unsafe_code, reason = "SIMD intrinsics (see # Unsafe above)")]
mod neon;
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code, reason = "SIMD intrinsics (see # Unsafe above)")]
mod packed;
mod scalar;
#[cfg(test)]
mod tests;
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code, reason = "SIMD intrinsics (see # Unsafe above)")]
mod x86;

/// Values per block of the 32-value formats (and per K-quant sub-block).
pub const BLOCK: usize = 32;

/// Values per K-quant super-block (ggml's `QK_K`).
pub const SUPER: usize = 256;

/// Most parts a product is split into (bounded so the per-call bookkeeping lives on the stack).
const MAX_PARTS: usize = 64;

/// Activation rows handled together by one part when a product is split over
/// activation rows (prefill); a multiple of every SIMD tile height.
const ACT_GROUP: usize = 4;

/// Below this many activation rows, a product is split over weight rows instead.
const SPLIT_ACTS_MIN: usize = 8;

/// What can go wrong when building or running a quantized product.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum KernelError {
    /// The tensor's quantization has no kernel here.
    #[error("no fast kernel for weights of type {0}")]
    UnsupportedFormat(String),
    /// Weights must be a 2-D matrix.
    #[error("weights must be a matrix (rows, columns), got shape {0:?}")]
    NotAMatrix(Vec<usize>),
    /// The reduction length must be a whole number of blocks.
    #[error("row length {k} is not a multiple of the block size {block}")]
    RowNotBlocks { k: usize, block: usize },
    /// The activations were quantized for another kind of weights.
    #[error("activations were quantized for {had:?} weights, not {want:?}")]
    ActsScheme { had: QuantFormat, want: QuantFormat },
    /// The byte buffer does not hold exactly `n * k / 32` blocks.
    #[error("weight bytes: expected {expected} bytes for {n}x{k}, got {got}")]
    ByteLength {
        n: usize,
        k: usize,
        expected: usize,
        got: usize,
    },
    /// The activations do not match the weight matrix or the output buffer.
    #[error(
        "activations of shape {rows}x{k} do not fit weights {n}x{wk} and an output of {out} values"
    )]
    Shape {
        rows: usize,
        k: usize,
        n: usize,
        wk: usize,
        out: usize,
    },
    /// The requested instruction set cannot run on this CPU.
    #[error("instruction set {0:?} is not available on this CPU")]
    IsaUnavailable(Isa),
    /// Input tensors must live on the CPU.
    #[error("fast kernels take CPU tensors, got one on {0:?}")]
    NotCpu(candle_core::DeviceLocation),
    /// A candle operation failed while preparing inputs or outputs.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

/// A GGUF block format with a kernel here.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QuantFormat {
    /// f16 scale `d`, 32 x 4-bit `q`: value `d * (q - 8)`. 18 bytes per block.
    Q4_0,
    /// f16 scale `d`, f16 minimum `m`, 32 x 4-bit `q`: value `d * q + m`. 20 bytes.
    Q4_1,
    /// f16 scale `d`, 32 x i8 `q`: value `d * q`. 34 bytes.
    Q8_0,
    /// f16 scale `d`, 32 high bits `qh` (u32), 32 x 4-bit low bits: value
    /// `d * (q - 16)` with `q` 5-bit. 22 bytes.
    Q5_0,
    /// 256 values: f16 `d`, f16 `dmin`, 12 bytes of 6-bit scales and mins of
    /// 8 sub-blocks of 32, 128 bytes of 4-bit `q`: value `d * sc_j * q - dmin * m_j`.
    /// 144 bytes.
    Q4K,
    /// `Q4_K` plus 32 bytes of high bits: 5-bit `q`. 176 bytes.
    Q5K,
    /// 256 values: 128 bytes of low 4 bits, 64 of high 2 bits, 16 i8 scales
    /// (one per 16 values), f16 `d`: value `d * sc_j * (q - 32)`. 210 bytes.
    Q6K,
}

impl QuantFormat {
    /// Bytes per block.
    pub const fn block_bytes(self) -> usize {
        match self {
            QuantFormat::Q4_0 => 18,
            QuantFormat::Q4_1 => 20,
            QuantFormat::Q8_0 => 34,
            QuantFormat::Q5_0 => 22,
            QuantFormat::Q4K => 144,
            QuantFormat::Q5K => 176,
            QuantFormat::Q6K => 210,
        }
    }

    /// Values per block: 32, or 256 for the K-quants.
    pub const fn block_len(self) -> usize {
        if self.is_k() {
            SUPER
        } else {
            BLOCK
        }
    }

    /// A K-quant (256-value super-blocks, `Q8_K` activations).
    pub const fn is_k(self) -> bool {
        matches!(self, QuantFormat::Q4K | QuantFormat::Q5K | QuantFormat::Q6K)
    }

    /// The format of a candle quantized dtype, if it has a kernel here.
    pub fn from_ggml(dtype: GgmlDType) -> Option<QuantFormat> {
        match dtype {
            GgmlDType::Q4_0 => Some(QuantFormat::Q4_0),
            GgmlDType::Q4_1 => Some(QuantFormat::Q4_1),
            GgmlDType::Q8_0 => Some(QuantFormat::Q8_0),
            GgmlDType::Q5_0 => Some(QuantFormat::Q5_0),
            GgmlDType::Q4K => Some(QuantFormat::Q4K),
            GgmlDType::Q5K => Some(QuantFormat::Q5K),
            GgmlDType::Q6K => Some(QuantFormat::Q6K),
            _ => None,
        }
    }
}

/// An instruction set a product can run on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Isa {
    /// Portable Rust, any CPU.
    Scalar,
    /// x86-64 AVX2 + FMA + F16C.
    Avx2,
    /// x86-64 AVX-512 VNNI with F, VL and BW (on 256-bit registers, and on
    /// 512-bit ones for the K-quants) + AVX2 + FMA + F16C.
    Avx512Vnni,
    /// aarch64 Advanced SIMD (always present on aarch64).
    Neon,
}

impl Isa {
    /// Every instruction set this CPU can run, slowest first (always starts with `Scalar`).
    pub fn available() -> &'static [Isa] {
        static AVAILABLE: OnceLock<Vec<Isa>> = OnceLock::new();
        AVAILABLE.get_or_init(|| {
            let mut isas = vec![Isa::Scalar];
            #[cfg(target_arch = "x86_64")]
            {
                let avx2 = std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
                    && std::arch::is_x86_feature_detected!("f16c");
                if avx2 {
                    isas.push(Isa::Avx2);
                    if std::arch::is_x86_feature_detected!("avx512f")
                        && std::arch::is_x86_feature_detected!("avx512vl")
                        && std::arch::is_x86_feature_detected!("avx512bw")
                        && std::arch::is_x86_feature_detected!("avx512vnni")
                    {
                        isas.push(Isa::Avx512Vnni);
                    }
                }
            }
            #[cfg(target_arch = "aarch64")]
            isas.push(Isa::Neon);
            isas
        })
    }

    /// The fastest instruction set this CPU can run.
    pub fn detect() -> Isa {
        Isa::available().last().copied().unwrap_or(Isa::Scalar)
    }

    fn check(self) -> Result<(), KernelError> {
        if Isa::available().contains(&self) {
            Ok(())
        } else {
            Err(KernelError::IsaUnavailable(self))
        }
    }
}

/// A borrowed, validated quantized weight matrix: `n` rows of `k` values each.
#[derive(Debug, Clone, Copy)]
pub struct QuantMatrix<'a> {
    format: QuantFormat,
    n: usize,
    k: usize,
    bytes: &'a [u8],
}

impl<'a> QuantMatrix<'a> {
    /// Checks that `bytes` holds exactly `n` rows of `k` values in `format`.
    pub fn new(
        format: QuantFormat,
        n: usize,
        k: usize,
        bytes: &'a [u8],
    ) -> Result<Self, KernelError> {
        let block = format.block_len();
        if !k.is_multiple_of(block) {
            return Err(KernelError::RowNotBlocks { k, block });
        }
        let expected = n * (k / block) * format.block_bytes();
        if bytes.len() != expected {
            return Err(KernelError::ByteLength {
                n,
                k,
                expected,
                got: bytes.len(),
            });
        }
        Ok(QuantMatrix {
            format,
            n,
            k,
            bytes,
        })
    }

    pub fn format(&self) -> QuantFormat {
        self.format
    }

    /// Output features (rows).
    pub fn rows(&self) -> usize {
        self.n
    }

    /// Input features (columns).
    pub fn cols(&self) -> usize {
        self.k
    }

    fn row_bytes(&self) -> usize {
        self.k / self.format.block_len() * self.format.block_bytes()
    }
}

/// Activations quantized to 8-bit blocks, plus reusable buffers for products.
///
/// Holds, for `rows` rows of `k` values, in one of two schemes:
/// - for the 32-value formats: the quants, each block's scale `d` (rounded to
///   f16 like ggml), `s81` = ggml `Q8_1`'s f16-rounded `d * sum(q)` (the
///   `Q4_1` minimum term), and `sx` = `d * sum(q)` unrounded (the `Q4_0` and
///   `Q5_0` offset term);
/// - for the K-quants (ggml's `Q8_K`): the quants, each 256-block's f32
///   scale in `d`, and in `bs` the sum of every 16 quants.
///
/// Buffers only grow.
#[derive(Debug, Default)]
pub struct Scratch {
    rows: usize,
    k: usize,
    /// Quantized with `Q8_K` (for K-quant weights) rather than `Q8_0`.
    k_scheme: bool,
    qs: Vec<i8>,
    d: Vec<f32>,
    s81: Vec<f32>,
    sx: Vec<f32>,
    /// `Q8_K` only: sums of each 16 quants.
    bs: Vec<i32>,
    /// Transposed output (`[n][rows]`) for products split over weight rows with more than one activation row.
    out_t: Vec<f32>,
}

/// The quantized activations of one call, as the per-ISA kernels read them.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Acts<'a> {
    pub(crate) k: usize,
    pub(crate) qs: &'a [i8],
    pub(crate) d: &'a [f32],
    /// Per block: the minimum-term factor for the weight format (`s81` or `sx`), empty for `Q8_0`.
    pub(crate) s: &'a [f32],
    /// K-quants: per row, 16 sums of 16 quants per 256-block.
    pub(crate) bs: &'a [i32],
}

/// One rectangle of a product: weight rows `[0, nr)` of `w` (which starts at the
/// first of them) against activation rows `[a0, a0 + na)`; output `(a, r)` goes
/// to `out[(a - a0) * sa + r * sr]`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Rect<'a> {
    pub(crate) format: QuantFormat,
    pub(crate) w: &'a [u8],
    pub(crate) row_bytes: usize,
    pub(crate) nr: usize,
    pub(crate) a0: usize,
    pub(crate) na: usize,
    pub(crate) sa: usize,
    pub(crate) sr: usize,
}

impl Scratch {
    pub fn new() -> Scratch {
        Scratch::default()
    }

    /// Quantizes `rows` rows of `k` values (`x` is `[rows][k]`, row-major)
    /// for weights of the 32-value formats.
    pub fn quantize(&mut self, x: &[f32], rows: usize, k: usize) -> Result<(), KernelError> {
        if !k.is_multiple_of(BLOCK) {
            return Err(KernelError::RowNotBlocks { k, block: BLOCK });
        }
        if x.len() != rows * k {
            return Err(KernelError::Shape {
                rows,
                k,
                n: 0,
                wk: k,
                out: x.len(),
            });
        }
        let blocks = rows * k / BLOCK;
        self.rows = rows;
        self.k = k;
        self.qs.resize(rows * k, 0);
        self.d.resize(blocks, 0.0);
        self.s81.resize(blocks, 0.0);
        self.sx.resize(blocks, 0.0);
        let chunks = x
            .chunks_exact(BLOCK)
            .zip(self.qs.chunks_exact_mut(BLOCK))
            .zip(self.d.iter_mut())
            .zip(self.s81.iter_mut().zip(self.sx.iter_mut()));
        for (((src, q), d), (s81, sx)) in chunks {
            let (bd, bs81, bsx) = scalar::quantize_block(src, q);
            *d = bd;
            *s81 = bs81;
            *sx = bsx;
        }
        self.k_scheme = false;
        Ok(())
    }

    /// Quantizes `rows` rows of `k` values for K-quant weights (ggml's
    /// `Q8_K`: 256-value blocks, f32 scales, sums of 16).
    pub fn quantize_k(&mut self, x: &[f32], rows: usize, k: usize) -> Result<(), KernelError> {
        if !k.is_multiple_of(SUPER) {
            return Err(KernelError::RowNotBlocks { k, block: SUPER });
        }
        if x.len() != rows * k {
            return Err(KernelError::Shape {
                rows,
                k,
                n: 0,
                wk: k,
                out: x.len(),
            });
        }
        let blocks = rows * k / SUPER;
        self.rows = rows;
        self.k = k;
        self.qs.resize(rows * k, 0);
        self.d.resize(blocks, 0.0);
        self.bs.resize(blocks * SUPER / 16, 0);
        let chunks = x
            .chunks_exact(SUPER)
            .zip(self.qs.chunks_exact_mut(SUPER))
            .zip(self.d.iter_mut().zip(self.bs.chunks_exact_mut(SUPER / 16)));
        for ((src, q), (d, bs)) in chunks {
            *d = scalar::quantize_block_k(src, q, bs);
        }
        self.k_scheme = true;
        Ok(())
    }

    /// Quantizes for weights of `format` (either scheme).
    pub fn quantize_for(
        &mut self,
        format: QuantFormat,
        x: &[f32],
        rows: usize,
        k: usize,
    ) -> Result<(), KernelError> {
        if format.is_k() {
            self.quantize_k(x, rows, k)
        } else {
            self.quantize(x, rows, k)
        }
    }

    /// Rows quantized by the last [`Scratch::quantize`].
    pub fn rows(&self) -> usize {
        self.rows
    }
}

/// Computes one rectangle on `isa` (which the caller has checked is available).
/// On x86-64, row-major K-quant matrices (row count not a multiple of 8,
/// never repacked) run the portable kernel.
fn run_rect(isa: Isa, rect: &Rect<'_>, acts: &Acts<'_>, out: &mut [f32]) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 if !rect.format.is_k() => x86::rect_avx2(rect, acts, out),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512Vnni if !rect.format.is_k() => x86::rect_vnni(rect, acts, out),
        #[cfg(target_arch = "aarch64")]
        Isa::Neon => neon::rect(rect, acts, out),
        _ => {
            #[cfg(test)]
            fell_back(isa, !(cfg!(target_arch = "x86_64") && rect.format.is_k()));
            scalar::rect(rect, acts, out)
        }
    }
}

/// Test hook: calls that asked for a SIMD path which has a kernel of its own
/// for the work, and ran the portable kernel instead. The kernel tests
/// require none: a dispatch that quietly fell back would have them compare
/// the scalar path with itself.
#[cfg(test)]
static SIMD_FELL_BACK: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

#[cfg(test)]
fn fell_back(isa: Isa, has_own_kernel: bool) {
    if isa != Isa::Scalar && has_own_kernel {
        SIMD_FELL_BACK.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
}

/// Threads in candle's barrier pool (its workers plus the calling thread).
pub fn pool_threads() -> usize {
    candle_core::utils::barrier_pool().n_workers() + 1
}

/// Runs `f(index, chunk)` for every `chunk_len`-sized chunk of `out` (the last
/// may be shorter), spread over candle's barrier pool: the same threads as
/// candle's ops and these kernels, so callers (attention, say) do not start a
/// second pool that would compete with them for cores. Allocation-free.
pub fn par_chunks_mut(out: &mut [f32], chunk_len: usize, f: impl Fn(usize, &mut [f32]) + Sync) {
    let chunk_len = chunk_len.max(1);
    let chunks = out.len().div_ceil(chunk_len);
    if chunks <= 1 || pool_threads() == 1 {
        for (i, chunk) in out.chunks_mut(chunk_len).enumerate() {
            f(i, chunk);
        }
        return;
    }
    // At most MAX_PARTS slots, each a run of whole chunks.
    let per_slot = chunks.div_ceil(MAX_PARTS);
    let slot_len = per_slot * chunk_len;
    let parts = out.len().div_ceil(slot_len);
    let mut slots: [Mutex<Option<&mut [f32]>>; MAX_PARTS] =
        std::array::from_fn(|_| Mutex::new(None));
    for (slot, part) in slots.iter_mut().zip(out.chunks_mut(slot_len)) {
        *slot
            .get_mut()
            .unwrap_or_else(|poisoned| poisoned.into_inner()) = Some(part);
    }
    candle_core::utils::barrier_pool().execute_chunked(parts, |range| {
        for p in range {
            let taken = slots[p]
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .take();
            if let Some(part) = taken {
                for (i, chunk) in part.chunks_mut(chunk_len).enumerate() {
                    f(p * per_slot + i, chunk);
                }
            }
        }
    });
}

/// Checks a product's shapes and borrows the quantized activations (with the
/// minimum-term factor `format` needs) and the transposition buffer from
/// `scratch`; `None` when there is nothing to compute.
fn prepare<'s>(
    format: QuantFormat,
    n: usize,
    k: usize,
    scratch: &'s mut Scratch,
    out: &[f32],
    isa: Isa,
) -> Result<Option<(Acts<'s>, &'s mut Vec<f32>)>, KernelError> {
    isa.check()?;
    if scratch.k_scheme != format.is_k() {
        return Err(KernelError::ActsScheme {
            had: if scratch.k_scheme {
                QuantFormat::Q4K
            } else {
                QuantFormat::Q8_0
            },
            want: format,
        });
    }
    let m = scratch.rows;
    if scratch.k != k || out.len() != m * n {
        return Err(KernelError::Shape {
            rows: m,
            k: scratch.k,
            n,
            wk: k,
            out: out.len(),
        });
    }
    if m == 0 || n == 0 {
        return Ok(None);
    }
    let Scratch {
        qs,
        d,
        s81,
        sx,
        bs,
        out_t,
        ..
    } = scratch;
    let s: &[f32] = match format {
        QuantFormat::Q4_0 | QuantFormat::Q5_0 => sx,
        QuantFormat::Q4_1 => s81,
        QuantFormat::Q8_0 | QuantFormat::Q4K | QuantFormat::Q5K | QuantFormat::Q6K => &[],
    };
    let bs: &[i32] = if format.is_k() { bs } else { &[] };
    Ok(Some((Acts { k, qs, d, s, bs }, out_t)))
}

/// `out = acts × wᵀ`: `out` is `[rows][n]` for the `rows` activation rows last
/// quantized into `scratch`, computed on `isa`.
pub fn matmul(
    w: &QuantMatrix<'_>,
    scratch: &mut Scratch,
    out: &mut [f32],
    isa: Isa,
) -> Result<(), KernelError> {
    let Some((acts, out_t)) = prepare(w.format, w.n, w.k, scratch, out, isa)? else {
        return Ok(());
    };
    // `prepare` checked `out` is `[m][n]` with `n > 0`.
    let (m, n) = (out.len() / w.n, w.n);
    let row_bytes = w.row_bytes();
    let threads = pool_threads();
    if m >= SPLIT_ACTS_MIN {
        // Prefill: each part owns whole output rows (a few activation rows x all weights).
        let groups = m.div_ceil(ACT_GROUP);
        let parts = groups.min(MAX_PARTS);
        let rows_per_part = groups.div_ceil(parts) * ACT_GROUP;
        par_chunks_mut(out, rows_per_part * n, |p, chunk| {
            let rect = Rect {
                format: w.format,
                w: w.bytes,
                row_bytes,
                nr: n,
                a0: p * rows_per_part,
                na: chunk.len() / n,
                sa: n,
                sr: 1,
            };
            run_rect(isa, &rect, &acts, chunk);
        });
        return Ok(());
    }
    // Decode: each part owns a range of weight rows; with several activation
    // rows the output is built transposed ([n][m]) and transposed back.
    let parts = (threads * 8).min(n.div_ceil(4)).clamp(1, MAX_PARTS);
    let rows_per_part = n.div_ceil(parts).div_ceil(4) * 4;
    let compute = |p: usize, chunk: &mut [f32]| {
        let r0 = p * rows_per_part;
        let nr = chunk.len() / m;
        let rect = Rect {
            format: w.format,
            w: &w.bytes[r0 * row_bytes..(r0 + nr) * row_bytes],
            row_bytes,
            nr,
            a0: 0,
            na: m,
            sa: 1,
            sr: m,
        };
        run_rect(isa, &rect, &acts, chunk);
    };
    if m == 1 {
        par_chunks_mut(out, rows_per_part, compute);
    } else {
        out_t.resize(m * n, 0.0);
        par_chunks_mut(out_t, rows_per_part * m, compute);
        for (r, col) in out_t.chunks_exact(m).enumerate() {
            for (a, v) in col.iter().enumerate() {
                out[a * n + r] = *v;
            }
        }
    }
    Ok(())
}

/// [`matmul`] for a repacked matrix (see [`packed`]): each part of the work
/// owns a run of 8-row groups, all activation rows.
#[cfg(target_arch = "x86_64")]
fn matmul_packed(
    w: &packed::Packed,
    scratch: &mut Scratch,
    out: &mut [f32],
    isa: Isa,
    decode: DecodePath,
) -> Result<(), KernelError> {
    use packed::GROUP;
    let Some((acts, out_t)) = prepare(w.format, w.n, w.k, scratch, out, isa)? else {
        return Ok(());
    };
    // `prepare` checked `out` is `[m][n]` with `n > 0`.
    let (m, n) = (out.len() / w.n, w.n);
    let groups = n / GROUP;
    let parts = (pool_threads() * 8).min(groups).clamp(1, MAX_PARTS);
    // An even number of groups per part: the 512-bit K-quant kernel runs
    // groups in pairs (a part's odd last group runs alone, same bits).
    let per_part = groups.div_ceil(parts).next_multiple_of(2);
    let run = |part: usize, chunk: &mut [f32]| run_groups(isa, w, &acts, m, part * per_part, chunk);
    if m == 1 && w.format.is_k() && decode == DecodePath::SingleRow {
        par_chunks_mut(out, per_part * GROUP, |part, chunk| {
            run_row_k(isa, w, &acts, part * per_part, chunk)
        });
    } else if m == 1 {
        par_chunks_mut(out, per_part * GROUP, run);
    } else {
        // Built as [group][activation row][8], then scattered to [row][n].
        out_t.resize(m * n, 0.0);
        par_chunks_mut(out_t, per_part * GROUP * m, run);
        for (g, block) in out_t.chunks_exact(GROUP * m).enumerate() {
            for (a, eight) in block.chunks_exact(GROUP).enumerate() {
                out[a * n + g * GROUP..a * n + (g + 1) * GROUP].copy_from_slice(eight);
            }
        }
    }
    Ok(())
}

/// Groups `[g0, g0 + out.len() / (8 * m))` of a repacked matrix against all
/// `m` activation rows on `isa`: `out` is `[group][activation row][8]`.
#[cfg(target_arch = "x86_64")]
fn run_groups(isa: Isa, w: &packed::Packed, acts: &Acts<'_>, m: usize, g0: usize, out: &mut [f32]) {
    match isa {
        Isa::Avx2 => packed::groups_avx2(w, acts, m, g0, out),
        Isa::Avx512Vnni => packed::groups_vnni(w, acts, m, g0, out),
        _ => {
            #[cfg(test)]
            fell_back(isa, true);
            packed::groups_scalar(w, acts, m, g0, out)
        }
    }
}

/// Which kernel computes a product of a repacked K-quant matrix with one
/// activation row (a decode step) on x86-64. Both give the same bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DecodePath {
    /// The single-row kernel (the default; see [`packed`]'s `row` kernels).
    #[default]
    SingleRow,
    /// The tile kernel prefill uses, as decode did before the single-row
    /// kernel existed: for benchmarks and tests that compare the two.
    Paired,
}

/// Groups `[g0, g0 + out.len() / 8)` of a repacked K-quant matrix against
/// one activation row on `isa`, with the single-row kernels.
#[cfg(target_arch = "x86_64")]
fn run_row_k(isa: Isa, w: &packed::Packed, acts: &Acts<'_>, g0: usize, out: &mut [f32]) {
    match isa {
        Isa::Avx2 => packed::groups_avx2(w, acts, 1, g0, out),
        Isa::Avx512Vnni => packed::groups_k_row(w, acts, g0, out),
        _ => packed::groups_scalar(w, acts, 1, g0, out),
    }
}

/// Where a [`QuantLinear`]'s bytes live.
#[derive(Clone)]
enum WeightBytes {
    /// A candle quantized tensor on the CPU (its blocks are read in place).
    QTensor(Arc<QTensor>),
    /// Any shared buffer (e.g. a memory-mapped GGUF file): bytes `[start, start + len)`.
    Shared {
        data: Arc<dyn AsRef<[u8]> + Send + Sync>,
        start: usize,
        len: usize,
    },
    /// Repacked at load time, 8 rows interleaved (x86-64; replaces the original bytes).
    #[cfg(target_arch = "x86_64")]
    Packed(Arc<packed::Packed>),
}

/// A linear layer without bias, `y = x Wᵀ`, over quantized weights `W` (`n x k`),
/// computed by the kernels of this module on the fastest instruction set of the CPU.
#[derive(Clone)]
pub struct QuantLinear {
    format: QuantFormat,
    n: usize,
    k: usize,
    weights: WeightBytes,
    isa: Isa,
    // Only the repacked layout (x86-64) has two decode kernels.
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    decode: DecodePath,
}

impl std::fmt::Debug for QuantLinear {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QuantLinear")
            .field("format", &self.format)
            .field("n", &self.n)
            .field("k", &self.k)
            .field("isa", &self.isa)
            .field("decode", &self.decode)
            .finish()
    }
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::new());
}

impl QuantLinear {
    /// Whether weights of this candle dtype can go through these kernels.
    pub fn supports(dtype: GgmlDType) -> bool {
        QuantFormat::from_ggml(dtype).is_some()
    }

    /// Wraps a 2-D quantized tensor `(n, k)` on the CPU.
    pub fn from_qtensor(tensor: Arc<QTensor>) -> Result<QuantLinear, KernelError> {
        let format = QuantFormat::from_ggml(tensor.dtype())
            .ok_or_else(|| KernelError::UnsupportedFormat(format!("{:?}", tensor.dtype())))?;
        let dims = tensor.shape().dims();
        let &[n, k] = dims else {
            return Err(KernelError::NotAMatrix(dims.to_vec()));
        };
        let device = tensor.device();
        if !device.is_cpu() {
            return Err(KernelError::NotCpu(device.location()));
        }
        let isa = Isa::detect();
        let bytes = tensor.data()?;
        #[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))]
        let matrix = QuantMatrix::new(format, n, k, &bytes)?;
        #[cfg(target_arch = "x86_64")]
        if let Some(p) = packed::Packed::new(&matrix)? {
            return Ok(QuantLinear {
                format,
                n,
                k,
                weights: WeightBytes::Packed(Arc::new(p)),
                isa,
                decode: DecodePath::default(),
            });
        }
        drop(bytes);
        Ok(QuantLinear {
            format,
            n,
            k,
            weights: WeightBytes::QTensor(tensor),
            isa,
            decode: DecodePath::default(),
        })
    }

    /// Wraps `n` rows of `k` values in `format` at bytes `[start, ..)` of `data`
    /// (e.g. a memory-mapped GGUF file).
    pub fn from_bytes(
        format: QuantFormat,
        n: usize,
        k: usize,
        data: Arc<dyn AsRef<[u8]> + Send + Sync>,
        start: usize,
    ) -> Result<QuantLinear, KernelError> {
        let block = format.block_len();
        if !k.is_multiple_of(block) {
            return Err(KernelError::RowNotBlocks { k, block });
        }
        let len = n * (k / block) * format.block_bytes();
        let available = (*data).as_ref().len().saturating_sub(start);
        if available < len {
            return Err(KernelError::ByteLength {
                n,
                k,
                expected: len,
                got: available,
            });
        }
        Ok(QuantLinear {
            format,
            n,
            k,
            weights: WeightBytes::Shared { data, start, len },
            isa: Isa::detect(),
            decode: DecodePath::default(),
        })
    }

    /// The same weights on another instruction set (for benchmarks and tests).
    pub fn with_isa(mut self, isa: Isa) -> Result<QuantLinear, KernelError> {
        isa.check()?;
        self.isa = isa;
        Ok(self)
    }

    /// The same weights with another decode kernel (for benchmarks and tests).
    pub fn with_decode_path(mut self, decode: DecodePath) -> QuantLinear {
        self.decode = decode;
        self
    }

    pub fn format(&self) -> QuantFormat {
        self.format
    }

    pub fn isa(&self) -> Isa {
        self.isa
    }

    /// Output features.
    pub fn out_features(&self) -> usize {
        self.n
    }

    /// Input features.
    pub fn in_features(&self) -> usize {
        self.k
    }

    /// Runs `f` with the weights as a [`QuantMatrix`].
    fn with_matrix<R>(
        &self,
        f: impl FnOnce(&QuantMatrix<'_>) -> Result<R, KernelError>,
    ) -> Result<R, KernelError> {
        match &self.weights {
            WeightBytes::QTensor(t) => {
                let bytes = t.data()?;
                f(&QuantMatrix::new(self.format, self.n, self.k, &bytes)?)
            }
            WeightBytes::Shared { data, start, len } => {
                let bytes = &(**data).as_ref()[*start..*start + *len];
                f(&QuantMatrix::new(self.format, self.n, self.k, bytes)?)
            }
            #[cfg(target_arch = "x86_64")]
            WeightBytes::Packed(_) => Err(KernelError::UnsupportedFormat(
                "repacked weights have no row-major view".into(),
            )),
        }
    }

    /// `out = x Wᵀ` on slices: `x` is `[rows][k]`, `out` is `[rows][n]`.
    pub fn forward_slice(
        &self,
        x: &[f32],
        rows: usize,
        out: &mut [f32],
        scratch: &mut Scratch,
    ) -> Result<(), KernelError> {
        super::profile::time(Part::Quantize, || {
            scratch.quantize_for(self.format, x, rows, self.k)
        })?;
        self.forward_quantized(scratch, out)
    }

    /// `out = x Wᵀ` for the activations `x` last quantized into `scratch`
    /// (`scratch.rows()` rows of `k`, in the scheme of this matrix's format).
    pub fn forward_quantized(
        &self,
        scratch: &mut Scratch,
        out: &mut [f32],
    ) -> Result<(), KernelError> {
        match &self.weights {
            #[cfg(target_arch = "x86_64")]
            WeightBytes::Packed(p) => matmul_packed(p, scratch, out, self.isa, self.decode),
            _ => self.with_matrix(|w| matmul(w, scratch, out, self.isa)),
        }
    }

    /// `outs[i] = x Wᵢᵀ` for several matrices of the same `k` (q, k and v of
    /// one input, say), with this thread's scratch: the activations are
    /// quantized once for all of them.
    pub fn forward_shared(
        ls: &[&QuantLinear],
        x: &[f32],
        rows: usize,
        outs: &mut [&mut [f32]],
    ) -> Result<(), KernelError> {
        let Some(k) = ls.first().map(|l| l.k) else {
            return Ok(());
        };
        if let Some(l) = ls.iter().find(|l| l.k != k) {
            return Err(KernelError::Shape {
                rows,
                k,
                n: l.n,
                wk: l.k,
                out: 0,
            });
        }
        SCRATCH.with(|scratch| {
            let scratch = &mut scratch.borrow_mut();
            // Once per scheme: `Q8_0` for the 32-value formats, then `Q8_K`
            // for the K-quants (a model may mix them within one group).
            for k_scheme in [false, true] {
                let mut quantized = false;
                for (l, out) in ls
                    .iter()
                    .zip(outs.iter_mut())
                    .filter(|(l, _)| l.format.is_k() == k_scheme)
                {
                    if !quantized {
                        super::profile::time(Part::Quantize, || {
                            scratch.quantize_for(l.format, x, rows, k)
                        })?;
                        quantized = true;
                    }
                    l.forward_quantized(scratch, out)?;
                }
            }
            Ok(())
        })
    }

    /// [`QuantLinear::forward_slice`] with this thread's reusable scratch.
    pub fn forward_local(
        &self,
        x: &[f32],
        rows: usize,
        out: &mut [f32],
    ) -> Result<(), KernelError> {
        SCRATCH.with(|scratch| self.forward_slice(x, rows, out, &mut scratch.borrow_mut()))
    }

    /// `x Wᵀ` for `x` of shape `[.., k]` (any float dtype, converted to f32), giving `[.., n]` in f32.
    pub fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.forward_tensor(x).map_err(candle_core::Error::wrap)
    }

    fn forward_tensor(&self, x: &Tensor) -> Result<Tensor, KernelError> {
        if !x.device().is_cpu() {
            return Err(KernelError::NotCpu(x.device().location()));
        }
        let x = if x.dtype() == DType::F32 {
            x.contiguous()?
        } else {
            x.to_dtype(DType::F32)?.contiguous()?
        };
        let dims = x.dims();
        let k = dims.last().copied().unwrap_or(0);
        if k != self.k || dims.len() < 2 {
            return Err(KernelError::Shape {
                rows: x.elem_count() / k.max(1),
                k,
                n: self.n,
                wk: self.k,
                out: 0,
            });
        }
        let rows = x.elem_count() / k;
        let mut out = vec![0f32; rows * self.n];
        {
            let (storage, layout) = x.storage_and_layout();
            let Storage::Cpu(cpu) = &*storage else {
                return Err(KernelError::NotCpu(x.device().location()));
            };
            let data = cpu.as_slice::<f32>()?;
            let start = layout.start_offset();
            let xs = data
                .get(start..start + rows * k)
                .ok_or(KernelError::Shape {
                    rows,
                    k,
                    n: self.n,
                    wk: self.k,
                    out: data.len(),
                })?;
            self.forward_local(xs, rows, &mut out)?;
        }
        let mut out_dims = dims.to_vec();
        if let Some(last) = out_dims.last_mut() {
            *last = self.n;
        }
        Ok(Tensor::from_vec(out, out_dims, &Device::Cpu)?)
    }
}
