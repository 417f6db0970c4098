//! Weights repacked at load time, eight rows interleaved, for x86-64.
//!
//! Why: in the row-major GGUF layout each weight row's block is dotted with the
//! activations on its own, then its 8 lane sums are reduced and scaled one row
//! at a time. Interleaving 8 rows puts 4 quant bytes of each row in each 32-bit
//! lane, so one `vpdpbusd` (or `vpmaddubsw` + `vpmaddwd` on AVX2) against 4
//! broadcast activation bytes advances all 8 rows at once, the lane sums are
//! already per row, and the 8 scales convert in one `vcvtph2ps`. This is the
//! layout llama.cpp's repacking CPU buffers use, and what makes its decoding
//! fast.
//!
//! Layout: for each group of 8 rows, for each block of 32 columns, one record:
//! - the 8 rows' f16 scales `d` (16 bytes);
//! - `Q4_1` only: the 8 rows' f16 minimums `m` (16 bytes);
//! - the quants as 32-byte vectors, lane `r` (bytes `4r..4r + 4`) from row `r`:
//!   `Q4_0`/`Q4_1`: 4 vectors, vector `j` = bytes `4j..4j + 4` of each row's 16
//!   packed bytes (low nibbles: values `4j..`, high nibbles: values `16 + 4j..`);
//!   `Q8_0`: 8 vectors, vector `j` = values `4j..4j + 4` of each row.
//!
//! So a record has exactly the bytes of the 8 GGUF blocks it came from: the
//! repacked matrix takes the memory of the original, which is dropped.
//!
//! # Invariants
//! - `n` is a multiple of 8 and `k` of 32 (checked by [`Packed::new`]).
//! - The integer dot of each block is exact, and each row accumulates
//!   `d_w * d_x * dot` over blocks then adds the minimum terms, in block order,
//!   as ggml's row-major kernels do; results equal [`super::scalar`]'s up to f32
//!   rounding (tests compare them).

use super::{scalar, Acts, KernelError, QuantFormat, QuantMatrix, BLOCK};

/// Rows per interleaved group.
pub const GROUP: usize = 8;

/// A weight matrix in the interleaved layout.
#[derive(Debug, Clone)]
pub struct Packed {
    pub(crate) format: QuantFormat,
    pub(crate) n: usize,
    pub(crate) k: usize,
    pub(crate) bytes: Vec<u8>,
}

/// Byte offset of the quants inside a record.
const fn quants_at(format: QuantFormat) -> usize {
    match format {
        QuantFormat::Q4_1 => 32,
        _ => 16,
    }
}

impl Packed {
    /// Repacks `w`; `None` when its row count is not a multiple of [`GROUP`].
    pub fn new(w: &QuantMatrix<'_>) -> Result<Option<Packed>, KernelError> {
        if !w.n.is_multiple_of(GROUP) {
            return Ok(None);
        }
        let format = w.format;
        let bb = format.block_bytes();
        let kb = w.k / BLOCK;
        let row_bytes = w.row_bytes();
        let rec = bb * GROUP;
        let mut bytes = vec![0u8; w.bytes.len()];
        let qa = quants_at(format);
        for g in 0..w.n / GROUP {
            for b in 0..kb {
                let out = &mut bytes[(g * kb + b) * rec..(g * kb + b + 1) * rec];
                for r in 0..GROUP {
                    let off = (g * GROUP + r) * row_bytes + b * bb;
                    let blk = &w.bytes[off..off + bb];
                    out[2 * r..2 * r + 2].copy_from_slice(&blk[0..2]);
                    let q = match format {
                        QuantFormat::Q4_1 => {
                            out[16 + 2 * r..16 + 2 * r + 2].copy_from_slice(&blk[2..4]);
                            &blk[4..20]
                        }
                        _ => &blk[2..],
                    };
                    for (j, four) in q.chunks_exact(4).enumerate() {
                        let at = qa + j * 32 + 4 * r;
                        out[at..at + 4].copy_from_slice(four);
                    }
                }
            }
        }
        Ok(Some(Packed {
            format,
            n: w.n,
            k: w.k,
            bytes,
        }))
    }

    pub(crate) fn record_bytes(&self) -> usize {
        self.format.block_bytes() * GROUP
    }
}

/// Groups `[g0, g0 + out.len() / (8 * rows))` of `p` against all `rows`
/// activation rows, portable code: `out` is `[group][row][8]`.
pub(crate) fn groups_scalar(p: &Packed, acts: &Acts<'_>, rows: usize, g0: usize, out: &mut [f32]) {
    let kb = p.k / BLOCK;
    let rec = p.record_bytes();
    let qa = quants_at(p.format);
    for (gi, gout) in out.chunks_exact_mut(GROUP * rows).enumerate() {
        let g = g0 + gi;
        for (a, o) in gout.chunks_exact_mut(GROUP).enumerate() {
            for (r, o) in o.iter_mut().enumerate() {
                let mut acc = 0f32;
                let mut macc = 0f32;
                for b in 0..kb {
                    let record = &p.bytes[(g * kb + b) * rec..(g * kb + b + 1) * rec];
                    let d = scalar::f16_at(record, 2 * r);
                    let x = &acts.qs[a * p.k + b * BLOCK..a * p.k + (b + 1) * BLOCK];
                    let mut dot = 0i32;
                    match p.format {
                        QuantFormat::Q8_0 => {
                            for j in 0..8 {
                                for i in 0..4 {
                                    let w = record[qa + j * 32 + 4 * r + i] as i8;
                                    dot += i32::from(w) * i32::from(x[4 * j + i]);
                                }
                            }
                        }
                        _ => {
                            for j in 0..4 {
                                for i in 0..4 {
                                    let byte = record[qa + j * 32 + 4 * r + i];
                                    dot += i32::from(byte & 0x0f) * i32::from(x[4 * j + i]);
                                    dot += i32::from(byte >> 4) * i32::from(x[16 + 4 * j + i]);
                                }
                            }
                        }
                    }
                    let dx = acts.d[a * kb + b];
                    acc += d * dx * dot as f32;
                    match p.format {
                        QuantFormat::Q4_1 => {
                            macc += scalar::f16_at(record, 16 + 2 * r) * acts.s[a * kb + b]
                        }
                        QuantFormat::Q4_0 => macc += -8.0 * d * acts.s[a * kb + b],
                        QuantFormat::Q8_0 => {}
                    }
                }
                *o = acc + macc;
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) use x86::{groups_avx2, groups_vnni};

#[cfg(target_arch = "x86_64")]
mod x86 {
    use core::arch::x86_64::*;

    use super::{quants_at, Acts, Packed, QuantFormat, BLOCK, GROUP};

    /// Groups on AVX2 (see [`super::groups_scalar`] for the shapes).
    pub(crate) fn groups_avx2(
        p: &Packed,
        acts: &Acts<'_>,
        rows: usize,
        g0: usize,
        out: &mut [f32],
    ) {
        // SAFETY: reached only for `Isa::Avx2`, admitted by `Isa::check` only
        // after avx2, fma and f16c were detected on this CPU.
        unsafe { avx2::groups(p, acts, rows, g0, out) }
    }

    /// Groups on AVX-512 VNNI.
    pub(crate) fn groups_vnni(
        p: &Packed,
        acts: &Acts<'_>,
        rows: usize,
        g0: usize,
        out: &mut [f32],
    ) {
        // SAFETY: reached only for `Isa::Avx512Vnni`, admitted by `Isa::check`
        // only after avx2, fma, f16c, avx512f, avx512vl and avx512vnni were detected.
        unsafe { vnni::groups(p, acts, rows, g0, out) }
    }

    macro_rules! packed_kernels {
        ($name:ident, $features:literal, $dot:item) => {
            mod $name {
                use super::*;

                $dot

                #[inline]
                #[target_feature(enable = $features)]
                fn load256(b: &[u8]) -> __m256i {
                    let b = &b[..32];
                    // SAFETY: `b` is 32 readable bytes; the load is unaligned.
                    unsafe { _mm256_loadu_si256(b.as_ptr().cast()) }
                }

                /// Eight f16 at `b[..16]` as f32.
                #[inline]
                #[target_feature(enable = $features)]
                fn halves(b: &[u8]) -> __m256 {
                    let b = &b[..16];
                    // SAFETY: `b` is 16 readable bytes; the load is unaligned.
                    _mm256_cvtph_ps(unsafe { _mm_loadu_si128(b.as_ptr().cast()) })
                }

                /// Four activation quants broadcast to every lane.
                #[inline]
                #[target_feature(enable = $features)]
                fn four(x: &[i8], at: usize) -> __m256i {
                    let x = &x[at..at + 4];
                    _mm256_set1_epi32(i32::from_le_bytes([
                        x[0] as u8, x[1] as u8, x[2] as u8, x[3] as u8,
                    ]))
                }

                /// One group (8 weight rows) against activation rows `[a0, a0 + C)`.
                #[inline]
                #[target_feature(enable = $features)]
                fn tile<const F: u8, const C: usize>(
                    p: &Packed,
                    acts: &Acts<'_>,
                    g: usize,
                    a0: usize,
                    out: &mut [f32],
                ) {
                    let k = p.k;
                    let kb = k / BLOCK;
                    let rec = p.record_bytes();
                    let qa = quants_at(p.format);
                    let records = &p.bytes[g * kb * rec..(g + 1) * kb * rec];
                    let mut acc = [_mm256_setzero_ps(); C];
                    let mut macc = [_mm256_setzero_ps(); C];
                    let low = _mm256_set1_epi8(0x0f);
                    for (b, record) in records.chunks_exact(rec).enumerate() {
                        let d = halves(record);
                        let mut sums = [_mm256_setzero_si256(); C];
                        if F == 2 {
                            for j in 0..8 {
                                let w = load256(&record[qa + 32 * j..]);
                                let aw = _mm256_abs_epi8(w);
                                for c in 0..C {
                                    let x = &acts.qs[(a0 + c) * k + b * BLOCK..];
                                    sums[c] = dot(sums[c], aw, _mm256_sign_epi8(four(x, 4 * j), w));
                                }
                            }
                        } else {
                            for j in 0..4 {
                                let v = load256(&record[qa + 32 * j..]);
                                let lo = _mm256_and_si256(v, low);
                                let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(v), low);
                                for c in 0..C {
                                    let x = &acts.qs[(a0 + c) * k + b * BLOCK..];
                                    sums[c] = dot(sums[c], lo, four(x, 4 * j));
                                    sums[c] = dot(sums[c], hi, four(x, 16 + 4 * j));
                                }
                            }
                        }
                        let m = match F {
                            1 => halves(&record[16..]),
                            0 => _mm256_mul_ps(d, _mm256_set1_ps(-8.0)),
                            _ => _mm256_setzero_ps(),
                        };
                        for c in 0..C {
                            let blk = (a0 + c) * kb + b;
                            let scale = _mm256_mul_ps(d, _mm256_set1_ps(acts.d[blk]));
                            acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[c]), scale, acc[c]);
                            if F != 2 {
                                macc[c] = _mm256_fmadd_ps(m, _mm256_set1_ps(acts.s[blk]), macc[c]);
                            }
                        }
                    }
                    for c in 0..C {
                        let o = &mut out[c * GROUP..(c + 1) * GROUP];
                        // SAFETY: `o` is 8 writable f32; the store is unaligned.
                        unsafe { _mm256_storeu_ps(o.as_mut_ptr(), _mm256_add_ps(acc[c], macc[c])) };
                    }
                }

                #[target_feature(enable = $features)]
                fn groups_f<const F: u8>(
                    p: &Packed,
                    acts: &Acts<'_>,
                    rows: usize,
                    g0: usize,
                    out: &mut [f32],
                ) {
                    for (gi, gout) in out.chunks_exact_mut(GROUP * rows).enumerate() {
                        let g = g0 + gi;
                        let mut a = 0;
                        while a + 4 <= rows {
                            tile::<F, 4>(p, acts, g, a, &mut gout[a * GROUP..]);
                            a += 4;
                        }
                        while a < rows {
                            tile::<F, 1>(p, acts, g, a, &mut gout[a * GROUP..]);
                            a += 1;
                        }
                    }
                }

                #[target_feature(enable = $features)]
                pub(super) fn groups(
                    p: &Packed,
                    acts: &Acts<'_>,
                    rows: usize,
                    g0: usize,
                    out: &mut [f32],
                ) {
                    match p.format {
                        QuantFormat::Q4_0 => groups_f::<0>(p, acts, rows, g0, out),
                        QuantFormat::Q4_1 => groups_f::<1>(p, acts, rows, g0, out),
                        QuantFormat::Q8_0 => groups_f::<2>(p, acts, rows, g0, out),
                    }
                }
            }
        };
    }

    packed_kernels!(
        avx2,
        "avx2,fma,f16c",
        /// `acc` plus the sums of 4 adjacent u8 x i8 products per 32-bit lane.
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        fn dot(acc: __m256i, u: __m256i, s: __m256i) -> __m256i {
            let pairs = _mm256_maddubs_epi16(u, s);
            _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)))
        }
    );

    packed_kernels!(
        vnni,
        "avx2,fma,f16c,avx512f,avx512vl,avx512vnni",
        /// `acc` plus the sums of 4 adjacent u8 x i8 products per 32-bit lane.
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
        fn dot(acc: __m256i, u: __m256i, s: __m256i) -> __m256i {
            _mm256_dpbusd_epi32(acc, u, s)
        }
    );
}
