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
//! Layout: for each group of 8 rows, for each block of 32 columns (256 for
//! the K-quants), one record. Every "vector" below is 32 bytes whose lane `r`
//! (bytes `4r..4r + 4`) comes from row `r`.
//! - 32-value formats: the 8 rows' f16 scales `d` (16 bytes); `Q4_1`: the 8
//!   rows' f16 minimums `m` (16 bytes); `Q5_0`: one vector of high bits, byte
//!   `4r + i` holding in bit `2j` the high bit of value `4j + i` and in bit
//!   `2j + 1` that of value `16 + 4j + i` of row `r`; then the quants:
//!   `Q4_0`/`Q4_1`/`Q5_0`: 4 vectors, vector `j` = bytes `4j..4j + 4` of each
//!   row's 16 packed bytes (low nibbles: values `4j..`, high nibbles: values
//!   `16 + 4j..`); `Q8_0`: 8 vectors, vector `j` = values `4j..4j + 4` of each row.
//! - `Q4_K`/`Q5_K`: the 8 rows' f16 `d` and `dmin` (32 bytes); the 6-bit
//!   sub-block scales unpacked to bytes, `[sub-block j][row]` (64 bytes), and
//!   the minimums, `[pair of sub-blocks][row][2]` (64 bytes, see [`k_min_at`]); `Q5_K`: 8 vectors of high-bit bytes, vector `j` = bytes
//!   `4j..4j + 4` of each row's 32 `qh` bytes; then 4 chunks of 64 values, each
//!   8 vectors, vector `j` = bytes `4j..4j + 4` of each row's 32 quant bytes of
//!   the chunk (low nibbles: sub-block `2c`, high nibbles: sub-block `2c + 1`).
//! - `Q6_K`: the 8 rows' f16 `d` (16 bytes); the i8 scales `[group of 16][row]`
//!   (128 bytes); then for each half of 128 values and each `j` of 8, three
//!   vectors: bytes `4j..` of the half's first 32 low-bit bytes, of its next 32,
//!   and of its 32 high-bit bytes.
//!
//! So a record has exactly the bytes of the 8 GGUF blocks it came from (the
//! K-quants' scales take 32 more bytes unpacked, 3% of `Q4_K`): the repacked
//! matrix takes the memory of the original, which is dropped.
//!
//! # Invariants
//! - `n` is a multiple of 8 and `k` of 32 (checked by [`Packed::new`]).
//! - The integer dot of each block is exact, and each row accumulates
//!   `d_w * d_x * dot` over blocks then adds the minimum terms, in block order,
//!   as ggml's row-major kernels do; results equal [`super::scalar`]'s up to f32
//!   rounding (tests compare them).

use super::{scalar, Acts, KernelError, QuantFormat, QuantMatrix, BLOCK, SUPER};

mod zmm;

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
        QuantFormat::Q5_0 => 48,
        QuantFormat::Q4K => 160,
        QuantFormat::Q5K => 416,
        QuantFormat::Q6K => 144,
        _ => 16,
    }
}

/// Bytes of one record (8 rows x one block).
pub(crate) const fn record_bytes(format: QuantFormat) -> usize {
    match format {
        QuantFormat::Q4K => 1184,
        QuantFormat::Q5K => 1440,
        _ => format.block_bytes() * GROUP,
    }
}

/// Offsets inside a K-quant record.
const K_D: usize = 0;
const K_DMIN: usize = 16;
const K_SCALES: usize = 32;
const K_MINS: usize = 96;
const K5_QH: usize = 160;
const K6_SCALES: usize = 16;

/// Where row `r`'s minimum of sub-block `j` sits in a `Q4_K`/`Q5_K` record:
/// `[pair of sub-blocks][row][2]`, so that 16 bytes widen to one vector of
/// 8 rows x 2 i16 minimums for `vpmaddwd` / `vpdpwssd` against pairs of
/// activation sums.
const fn k_min_at(j: usize, r: usize) -> usize {
    K_MINS + 16 * (j / 2) + 2 * r + j % 2
}

/// Sub-blocks `2i` and `2i + 1`'s activation sums (32 quants each, so they
/// fit in i16) packed as two i16 lanes, the partner of a [`k_min_at`] pair
/// in `vpmaddwd` / `vpdpwssd`; `bs` is one 256-block's 16 sums of 16.
pub(crate) fn bsum_pair(bs: &[i32], i: usize) -> i32 {
    let lo = bs[4 * i] + bs[4 * i + 1];
    let hi = bs[4 * i + 2] + bs[4 * i + 3];
    (u32::from(lo as u16) | (u32::from(hi as u16) << 16)) as i32
}

/// Writes row `r`'s GGUF block `blk` into `out`, the record of its group.
fn pack_k(format: QuantFormat, blk: &[u8], r: usize, out: &mut [u8]) {
    let qa = quants_at(format);
    match format {
        QuantFormat::Q4K | QuantFormat::Q5K => {
            out[K_D + 2 * r..K_D + 2 * r + 2].copy_from_slice(&blk[0..2]);
            out[K_DMIN + 2 * r..K_DMIN + 2 * r + 2].copy_from_slice(&blk[2..4]);
            for j in 0..8 {
                let (sc, m) = scalar::scale_min_k4(j, &blk[4..16]);
                out[K_SCALES + 8 * j + r] = sc;
                out[k_min_at(j, r)] = m;
            }
            let qs = if format == QuantFormat::Q5K {
                for (j, four) in blk[16..48].chunks_exact(4).enumerate() {
                    let at = K5_QH + 32 * j + 4 * r;
                    out[at..at + 4].copy_from_slice(four);
                }
                &blk[48..176]
            } else {
                &blk[16..144]
            };
            for (v, four) in qs.chunks_exact(4).enumerate() {
                // v = 8 * chunk + j
                let at = qa + 32 * v + 4 * r;
                out[at..at + 4].copy_from_slice(four);
            }
        }
        QuantFormat::Q6K => {
            out[K_D + 2 * r..K_D + 2 * r + 2].copy_from_slice(&blk[208..210]);
            for g in 0..16 {
                out[K6_SCALES + 8 * g + r] = blk[192 + g];
            }
            for n in 0..2 {
                for j in 0..8 {
                    let base = qa + (n * 8 + j) * 96 + 4 * r;
                    let a = 64 * n + 4 * j;
                    let h = 128 + 32 * n + 4 * j;
                    out[base..base + 4].copy_from_slice(&blk[a..a + 4]);
                    out[base + 32..base + 36].copy_from_slice(&blk[a + 32..a + 36]);
                    out[base + 64..base + 68].copy_from_slice(&blk[h..h + 4]);
                }
            }
        }
        _ => {}
    }
}

/// Row `r`'s 256 unsigned quants, as [`scalar::k_quants`] gives them, read
/// back from a K-quant record.
fn unpack_k_quants(format: QuantFormat, rec: &[u8], r: usize) -> [u8; SUPER] {
    let qa = quants_at(format);
    let mut q = [0u8; SUPER];
    match format {
        QuantFormat::Q4K | QuantFormat::Q5K => {
            for c in 0..4 {
                for j in 0..8 {
                    for i in 0..4 {
                        let byte = rec[qa + 32 * (8 * c + j) + 4 * r + i];
                        let l = 4 * j + i;
                        let (mut lo, mut hi) = (byte & 0x0f, byte >> 4);
                        if format == QuantFormat::Q5K {
                            let h = rec[K5_QH + 32 * j + 4 * r + i];
                            lo |= ((h >> (2 * c)) & 1) << 4;
                            hi |= ((h >> (2 * c + 1)) & 1) << 4;
                        }
                        q[64 * c + l] = lo;
                        q[64 * c + 32 + l] = hi;
                    }
                }
            }
        }
        QuantFormat::Q6K => {
            for n in 0..2 {
                for j in 0..8 {
                    for i in 0..4 {
                        let base = qa + (n * 8 + j) * 96 + 4 * r + i;
                        let (a, b, h) = (rec[base], rec[base + 32], rec[base + 64]);
                        let l = 4 * j + i;
                        q[128 * n + l] = (a & 0x0f) | ((h & 3) << 4);
                        q[128 * n + 32 + l] = (b & 0x0f) | (((h >> 2) & 3) << 4);
                        q[128 * n + 64 + l] = (a >> 4) | (((h >> 4) & 3) << 4);
                        q[128 * n + 96 + l] = (b >> 4) | (((h >> 6) & 3) << 4);
                    }
                }
            }
        }
        _ => {}
    }
    q
}

impl Packed {
    /// Repacks `w`; `None` when its row count is not a multiple of [`GROUP`].
    pub fn new(w: &QuantMatrix<'_>) -> Result<Option<Packed>, KernelError> {
        if !w.n.is_multiple_of(GROUP) {
            return Ok(None);
        }
        let format = w.format;
        let bb = format.block_bytes();
        let kb = w.k / format.block_len();
        let row_bytes = w.row_bytes();
        let rec = record_bytes(format);
        let mut bytes = vec![0u8; w.n / GROUP * kb * rec];
        let qa = quants_at(format);
        for g in 0..w.n / GROUP {
            for b in 0..kb {
                let out = &mut bytes[(g * kb + b) * rec..(g * kb + b + 1) * rec];
                for r in 0..GROUP {
                    let off = (g * GROUP + r) * row_bytes + b * bb;
                    let blk = &w.bytes[off..off + bb];
                    if format.is_k() {
                        pack_k(format, blk, r, out);
                        continue;
                    }
                    out[2 * r..2 * r + 2].copy_from_slice(&blk[0..2]);
                    let q = match format {
                        QuantFormat::Q4_1 => {
                            out[16 + 2 * r..16 + 2 * r + 2].copy_from_slice(&blk[2..4]);
                            &blk[4..20]
                        }
                        QuantFormat::Q5_0 => {
                            let qh = u32::from_le_bytes([blk[2], blk[3], blk[4], blk[5]]);
                            for i in 0..4 {
                                let mut h = 0u8;
                                for j in 0..4 {
                                    h |= (((qh >> (4 * j + i)) & 1) as u8) << (2 * j);
                                    h |= (((qh >> (16 + 4 * j + i)) & 1) as u8) << (2 * j + 1);
                                }
                                out[16 + 4 * r + i] = h;
                            }
                            &blk[6..22]
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
        record_bytes(self.format)
    }
}

/// Groups `[g0, g0 + out.len() / (8 * rows))` of `p` against all `rows`
/// activation rows, portable code: `out` is `[group][row][8]`.
pub(crate) fn groups_scalar(p: &Packed, acts: &Acts<'_>, rows: usize, g0: usize, out: &mut [f32]) {
    if p.format.is_k() {
        return groups_scalar_k(p, acts, rows, g0, out);
    }
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
                                    let (mut lo, mut hi) = (byte & 0x0f, byte >> 4);
                                    if p.format == QuantFormat::Q5_0 {
                                        let h = record[16 + 4 * r + i];
                                        lo |= ((h >> (2 * j)) & 1) << 4;
                                        hi |= ((h >> (2 * j + 1)) & 1) << 4;
                                    }
                                    dot += i32::from(lo) * i32::from(x[4 * j + i]);
                                    dot += i32::from(hi) * i32::from(x[16 + 4 * j + i]);
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
                        QuantFormat::Q5_0 => macc += -16.0 * d * acts.s[a * kb + b],
                        _ => {}
                    }
                }
                *o = acc + macc;
            }
        }
    }
}

/// [`groups_scalar`] for K-quant records.
fn groups_scalar_k(p: &Packed, acts: &Acts<'_>, rows: usize, g0: usize, out: &mut [f32]) {
    let kb = p.k / SUPER;
    let rec = p.record_bytes();
    for (gi, gout) in out.chunks_exact_mut(GROUP * rows).enumerate() {
        let g = g0 + gi;
        for (a, o) in gout.chunks_exact_mut(GROUP).enumerate() {
            for (r, o) in o.iter_mut().enumerate() {
                let (mut acc, mut accm) = (0f32, 0f32);
                for b in 0..kb {
                    let record = &p.bytes[(g * kb + b) * rec..(g * kb + b + 1) * rec];
                    let q = unpack_k_quants(p.format, record, r);
                    let x = &acts.qs[a * p.k + b * SUPER..a * p.k + (b + 1) * SUPER];
                    let bs = &acts.bs[(a * kb + b) * 16..(a * kb + b + 1) * 16];
                    let dot = |from: usize, len: usize| -> i32 {
                        q[from..from + len]
                            .iter()
                            .zip(&x[from..from + len])
                            .map(|(&w, &v)| i32::from(w) * i32::from(v))
                            .sum()
                    };
                    let d = scalar::f16_at(record, K_D + 2 * r);
                    let dx = acts.d[a * kb + b];
                    if p.format == QuantFormat::Q6K {
                        let mut sumi = 0i32;
                        for grp in 0..16 {
                            let sc = i32::from(record[K6_SCALES + 8 * grp + r] as i8);
                            sumi += sc * (dot(16 * grp, 16) - 32 * bs[grp]);
                        }
                        acc += d * dx * sumi as f32;
                    } else {
                        let (mut sumi, mut summ) = (0i32, 0i32);
                        for j in 0..8 {
                            sumi += i32::from(record[K_SCALES + 8 * j + r]) * dot(32 * j, 32);
                            summ += i32::from(record[k_min_at(j, r)]) * (bs[2 * j] + bs[2 * j + 1]);
                        }
                        let dmin = scalar::f16_at(record, K_DMIN + 2 * r);
                        acc += d * dx * sumi as f32;
                        accm += dmin * dx * summ as f32;
                    }
                }
                *o = acc - accm;
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) use x86::{groups_avx2, groups_vnni};
pub(crate) use zmm::groups_k_row;

#[cfg(target_arch = "x86_64")]
mod x86 {
    use core::arch::x86_64::*;

    use super::{
        quants_at, Acts, Packed, QuantFormat, BLOCK, GROUP, K5_QH, K6_SCALES, K_D, K_DMIN, K_MINS,
        K_SCALES, SUPER,
    };

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
        if p.format.is_k() {
            return super::zmm::groups_k(p, acts, rows, g0, out);
        }
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

                /// Bit `bit` of every byte of `h`, moved to bit 4 (0x10 or 0).
                #[inline]
                #[target_feature(enable = $features)]
                fn bit4(h: __m256i, bit: i32) -> __m256i {
                    // A 16-bit shift right by < 8 then left by 4: bit 4 of each
                    // byte comes from bit `bit` of the same byte.
                    let t = _mm256_srl_epi16(h, _mm_cvtsi32_si128(bit));
                    _mm256_and_si256(_mm256_slli_epi16::<4>(t), _mm256_set1_epi8(0x10))
                }

                /// Eight bytes at `b[..8]` widened (unsigned) to eight i32 lanes.
                #[inline]
                #[target_feature(enable = $features)]
                fn bytes_u32(b: &[u8]) -> __m256i {
                    let b = &b[..8];
                    // SAFETY: `b` is 8 readable bytes; the load is unaligned.
                    _mm256_cvtepu8_epi32(unsafe { _mm_loadl_epi64(b.as_ptr().cast()) })
                }

                /// Sixteen bytes at `b[..16]` widened (unsigned) to sixteen i16 lanes.
                #[inline]
                #[target_feature(enable = $features)]
                fn words(b: &[u8]) -> __m256i {
                    let b = &b[..16];
                    // SAFETY: `b` is 16 readable bytes; the load is unaligned.
                    _mm256_cvtepu8_epi16(unsafe { _mm_loadu_si128(b.as_ptr().cast()) })
                }

                /// Eight bytes at `b[..8]` widened (signed) to eight i32 lanes.
                #[inline]
                #[target_feature(enable = $features)]
                fn bytes_i32(b: &[u8]) -> __m256i {
                    let b = &b[..8];
                    // SAFETY: `b` is 8 readable bytes; the load is unaligned.
                    _mm256_cvtepi8_epi32(unsafe { _mm_loadl_epi64(b.as_ptr().cast()) })
                }

                /// One group of K-quant records against activation rows `[a0, a0 + C)`.
                #[inline]
                #[target_feature(enable = $features)]
                fn tile_k<const F: u8, const C: usize>(
                    p: &Packed,
                    acts: &Acts<'_>,
                    g: usize,
                    a0: usize,
                    out: &mut [f32],
                ) {
                    let k = p.k;
                    let kb = k / SUPER;
                    let rec = p.record_bytes();
                    let qa = quants_at(p.format);
                    let records = &p.bytes[g * kb * rec..(g + 1) * kb * rec];
                    let mut acc = [_mm256_setzero_ps(); C];
                    let mut accm = [_mm256_setzero_ps(); C];
                    let low = _mm256_set1_epi8(0x0f);
                    let three = _mm256_set1_epi8(3);
                    for (b, record) in records.chunks_exact(rec).enumerate() {
                        let mut sumi = [_mm256_setzero_si256(); C];
                        let xs: [&[i8]; C] =
                            std::array::from_fn(|c| &acts.qs[(a0 + c) * k + b * SUPER..]);
                        let bs: [&[i32]; C] =
                            std::array::from_fn(|c| &acts.bs[((a0 + c) * kb + b) * 16..]);
                        if F == 6 {
                            for n in 0..2 {
                                for lh in 0..2 {
                                    // Sums of the 4 groups of 16 values this
                                    // quarter touches: values l, l+32, l+64, l+96.
                                    let mut gs = [[_mm256_setzero_si256(); 4]; C];
                                    for j in 4 * lh..4 * lh + 4 {
                                        let base = qa + (n * 8 + j) * 96;
                                        let av = load256(&record[base..]);
                                        let bv = load256(&record[base + 32..]);
                                        let hv = load256(&record[base + 64..]);
                                        let v = [
                                            _mm256_or_si256(
                                                _mm256_and_si256(av, low),
                                                _mm256_slli_epi16::<4>(_mm256_and_si256(hv, three)),
                                            ),
                                            _mm256_or_si256(
                                                _mm256_and_si256(bv, low),
                                                _mm256_slli_epi16::<2>(_mm256_and_si256(
                                                    hv,
                                                    _mm256_set1_epi8(0x0c),
                                                )),
                                            ),
                                            _mm256_or_si256(
                                                _mm256_and_si256(_mm256_srli_epi16::<4>(av), low),
                                                _mm256_and_si256(hv, _mm256_set1_epi8(0x30)),
                                            ),
                                            _mm256_or_si256(
                                                _mm256_and_si256(_mm256_srli_epi16::<4>(bv), low),
                                                _mm256_and_si256(
                                                    _mm256_srli_epi16::<2>(hv),
                                                    _mm256_set1_epi8(0x30),
                                                ),
                                            ),
                                        ];
                                        for c in 0..C {
                                            for (set, vs) in v.iter().enumerate() {
                                                let at = 128 * n + 32 * set + 4 * j;
                                                gs[c][set] = dot(gs[c][set], *vs, four(xs[c], at));
                                            }
                                        }
                                    }
                                    for set in 0..4 {
                                        let grp = 8 * n + 2 * set + lh;
                                        let sc = bytes_i32(&record[K6_SCALES + 8 * grp..]);
                                        for c in 0..C {
                                            let centred = _mm256_sub_epi32(
                                                gs[c][set],
                                                _mm256_set1_epi32(32 * bs[c][grp]),
                                            );
                                            sumi[c] = _mm256_add_epi32(
                                                sumi[c],
                                                _mm256_mullo_epi32(centred, sc),
                                            );
                                        }
                                    }
                                }
                            }
                        } else {
                            for ch in 0..4 {
                                let mut even = [_mm256_setzero_si256(); C];
                                let mut odd = [_mm256_setzero_si256(); C];
                                for j in 0..8 {
                                    let vq = load256(&record[qa + 32 * (8 * ch + j)..]);
                                    let mut lo = _mm256_and_si256(vq, low);
                                    let mut hi = _mm256_and_si256(_mm256_srli_epi16::<4>(vq), low);
                                    if F == 5 {
                                        let h = load256(&record[K5_QH + 32 * j..]);
                                        lo = _mm256_or_si256(lo, bit4(h, 2 * ch as i32));
                                        hi = _mm256_or_si256(hi, bit4(h, 2 * ch as i32 + 1));
                                    }
                                    for c in 0..C {
                                        let at = 64 * ch + 4 * j;
                                        even[c] = dot(even[c], lo, four(xs[c], at));
                                        odd[c] = dot(odd[c], hi, four(xs[c], at + 32));
                                    }
                                }
                                let se = bytes_u32(&record[K_SCALES + 8 * (2 * ch)..]);
                                let so = bytes_u32(&record[K_SCALES + 8 * (2 * ch + 1)..]);
                                for c in 0..C {
                                    sumi[c] = _mm256_add_epi32(
                                        sumi[c],
                                        _mm256_add_epi32(
                                            _mm256_mullo_epi32(even[c], se),
                                            _mm256_mullo_epi32(odd[c], so),
                                        ),
                                    );
                                }
                            }
                            let dmin = halves(&record[K_DMIN..]);
                            let mins: [__m256i; 4] =
                                std::array::from_fn(|i| words(&record[K_MINS + 16 * i..]));
                            for c in 0..C {
                                let mut summ = _mm256_setzero_si256();
                                for (i, m) in mins.iter().enumerate() {
                                    let s = _mm256_set1_epi32(super::super::bsum_pair(bs[c], i));
                                    summ = _mm256_add_epi32(summ, _mm256_madd_epi16(*m, s));
                                }
                                let dx = _mm256_set1_ps(acts.d[(a0 + c) * kb + b]);
                                accm[c] = _mm256_fmadd_ps(
                                    _mm256_cvtepi32_ps(summ),
                                    _mm256_mul_ps(dmin, dx),
                                    accm[c],
                                );
                            }
                        }
                        let d = halves(&record[K_D..]);
                        for c in 0..C {
                            let dx = _mm256_set1_ps(acts.d[(a0 + c) * kb + b]);
                            acc[c] = _mm256_fmadd_ps(
                                _mm256_cvtepi32_ps(sumi[c]),
                                _mm256_mul_ps(d, dx),
                                acc[c],
                            );
                        }
                    }
                    for c in 0..C {
                        let o = &mut out[c * GROUP..(c + 1) * GROUP];
                        // SAFETY: `o` is 8 writable f32; the store is unaligned.
                        unsafe { _mm256_storeu_ps(o.as_mut_ptr(), _mm256_sub_ps(acc[c], accm[c])) };
                    }
                }

                #[target_feature(enable = $features)]
                fn groups_k<const F: u8>(
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
                            tile_k::<F, 4>(p, acts, g, a, &mut gout[a * GROUP..]);
                            a += 4;
                        }
                        while a < rows {
                            tile_k::<F, 1>(p, acts, g, a, &mut gout[a * GROUP..]);
                            a += 1;
                        }
                    }
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
                            let h = if F == 3 {
                                load256(&record[16..])
                            } else {
                                _mm256_setzero_si256()
                            };
                            for j in 0..4 {
                                let v = load256(&record[qa + 32 * j..]);
                                let mut lo = _mm256_and_si256(v, low);
                                let mut hi = _mm256_and_si256(_mm256_srli_epi16::<4>(v), low);
                                if F == 3 {
                                    lo = _mm256_or_si256(lo, bit4(h, 2 * j as i32));
                                    hi = _mm256_or_si256(hi, bit4(h, 2 * j as i32 + 1));
                                }
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
                            3 => _mm256_mul_ps(d, _mm256_set1_ps(-16.0)),
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
                        QuantFormat::Q5_0 => groups_f::<3>(p, acts, rows, g0, out),
                        QuantFormat::Q4K => groups_k::<4>(p, acts, rows, g0, out),
                        QuantFormat::Q5K => groups_k::<5>(p, acts, rows, g0, out),
                        QuantFormat::Q6K => groups_k::<6>(p, acts, rows, g0, out),
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
