//! K-quant records on 512-bit registers (AVX-512 VNNI): two 8-row groups
//! side by side, so each `vpdpbusd` advances 16 weight rows.
//!
//! Why: on the Xeons this runs on, `vpdpbusd` retires about one per cycle on
//! 512-bit registers as on 256-bit ones (a microbenchmark of independent
//! chains on this machine: ~0.35 ns per instruction at either width), so a
//! 512-bit register does twice the multiply-adds per cycle. llama.cpp's
//! AVX-512 K-quant kernels use 512-bit registers for the same reason; with
//! the 256-bit kernel, our `Q4_K_M` prefill ran at about half its speed.
//!
//! Layout: the 8-row records of [`super`], unchanged: a 512-bit vector is
//! group `g`'s 32-byte vector in its low half and group `g + 1`'s in its
//! high half (one `vinserti64x4`), scales and minimums likewise.
//!
//! # Invariants
//! - Every lane computes its weight row with the same integer dots and the
//!   same f32 operations, in the same order, as the 256-bit kernel (the
//!   minimum sums through `vpdpwssd` instead of `vpmaddwd` + add: the same
//!   exact integers), so a row's result does not depend on its partner.
//! - A group without a partner (the last of an odd run) runs paired with
//!   itself and keeps the low half: its bits are those it gets when paired,
//!   so the outputs do not depend on how the groups are split between parts.
//!
//! # The decode kernel ([`groups_k_row`])
//! With one activation row (a decode step), the tile kernel sums each chunk
//! of 64 values into two accumulators, so each step waits for the previous
//! `vpdpbusd` (4 to 5 cycles) and the weights are read at well under the
//! memory bus's rate. The single-row kernel walks the four chunks of a
//! super-block inside its loop over the quant vectors (`Q6_K`: both halves
//! of 16-value groups), keeping 8 independent accumulators in flight, reads
//! whole records through fixed-size arrays, and pairs group `i` of its run
//! with group `half + i` (two long sequential streams for the prefetchers,
//! where neighbouring pairs restart them every two groups). Each row gets
//! the same bits as from the tile kernel: the integer sums are exact in any
//! order, and the f32 operations per super-block are the same ones in the
//! same order.
//!
//! Every function here is compiled for AVX-512 F/VL/BW/VNNI and entered only
//! through [`groups_k`] and [`groups_k_row`], whose callers have checked
//! those features at run time ([`super::super::Isa::Avx512Vnni`]).

use core::arch::x86_64::*;

use super::{
    bsum_pair, quants_at, record_bytes, Acts, Packed, QuantFormat, GROUP, K5_QH, K6_SCALES, K_D,
    K_DMIN, K_MINS, K_SCALES, SUPER,
};

/// Activation rows per tile.
const TILE: usize = 4;

/// Groups `[g0, g0 + out.len() / (8 * rows))` of the K-quant matrix `p`
/// against all `rows` activation rows: `out` is `[group][row][8]`.
pub(crate) fn groups_k(p: &Packed, acts: &Acts<'_>, rows: usize, g0: usize, out: &mut [f32]) {
    // SAFETY: reached only for `Isa::Avx512Vnni`, which `Isa::check` admits
    // only after avx2, fma, f16c, avx512f, avx512vl, avx512bw and avx512vnni
    // were detected on this CPU.
    unsafe { groups(p, acts, rows, g0, out) }
}

#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")]
fn groups(p: &Packed, acts: &Acts<'_>, rows: usize, g0: usize, out: &mut [f32]) {
    match p.format {
        QuantFormat::Q4K => groups_f::<4>(p, acts, rows, g0, out),
        QuantFormat::Q5K => groups_f::<5>(p, acts, rows, g0, out),
        QuantFormat::Q6K => groups_f::<6>(p, acts, rows, g0, out),
        // Only K-quant matrices are routed here (`groups_vnni`).
        _ => {}
    }
}

#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")]
fn groups_f<const F: u8>(p: &Packed, acts: &Acts<'_>, rows: usize, g0: usize, out: &mut [f32]) {
    let per = GROUP * rows;
    let count = out.len() / per;
    let mut gi = 0;
    while gi < count {
        let paired = gi + 1 < count;
        let (ga, gb) = (g0 + gi, if paired { g0 + gi + 1 } else { g0 + gi });
        let pair = &mut out[gi * per..(gi + if paired { 2 } else { 1 }) * per];
        let mut a = 0;
        while a + TILE <= rows {
            let v = tile::<F, TILE>(p, acts, ga, gb, a);
            store(&v, pair, per, a, paired);
            a += TILE;
        }
        while a < rows {
            let v = tile::<F, 1>(p, acts, ga, gb, a);
            store(&v, pair, per, a, paired);
            a += 1;
        }
        gi += 2;
    }
}

/// Writes a tile's results: the low halves to the first group's rows `a..`,
/// the high halves (when paired) to the second group's.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")]
fn store<const C: usize>(v: &[__m512; C], pair: &mut [f32], per: usize, a: usize, paired: bool) {
    for (c, v) in v.iter().enumerate() {
        let lo = &mut pair[(a + c) * GROUP..(a + c + 1) * GROUP];
        // SAFETY: `lo` is 8 writable f32; the store is unaligned.
        unsafe { _mm256_storeu_ps(lo.as_mut_ptr(), _mm512_castps512_ps256(*v)) };
        if paired {
            let hi = &mut pair[per + (a + c) * GROUP..per + (a + c + 1) * GROUP];
            let h = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(*v)));
            // SAFETY: `hi` is 8 writable f32; the store is unaligned.
            unsafe { _mm256_storeu_ps(hi.as_mut_ptr(), h) };
        }
    }
}

/// 32 bytes at `at` of each record, `x`'s in the low half.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")]
fn load_pair(x: &[u8], y: &[u8], at: usize) -> __m512i {
    let (x, y) = (&x[at..at + 32], &y[at..at + 32]);
    // SAFETY: `x` and `y` are 32 readable bytes each; the loads are unaligned.
    let (lo, hi) = unsafe {
        (
            _mm256_loadu_si256(x.as_ptr().cast()),
            _mm256_loadu_si256(y.as_ptr().cast()),
        )
    };
    _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi)
}

/// The 6-bit values of one 96-byte Q6_K unit at `base` of each record
/// (32 low-nibble bytes of values l and l+64, 32 of l+32 and l+96, 32 bytes
/// of high bits), as the four vectors of values l, l+32, l+64 and l+96:
/// the tile kernel and the single-row kernel share it.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")]
fn q6_values(x: &[u8], y: &[u8], base: usize, low: __m512i, three: __m512i) -> [__m512i; 4] {
    let av = load_pair(x, y, base);
    let bv = load_pair(x, y, base + 32);
    let hv = load_pair(x, y, base + 64);
    [
        _mm512_or_si512(
            _mm512_and_si512(av, low),
            _mm512_slli_epi16::<4>(_mm512_and_si512(hv, three)),
        ),
        _mm512_or_si512(
            _mm512_and_si512(bv, low),
            _mm512_slli_epi16::<2>(_mm512_and_si512(hv, _mm512_set1_epi8(0x0c))),
        ),
        _mm512_or_si512(
            _mm512_and_si512(_mm512_srli_epi16::<4>(av), low),
            _mm512_and_si512(hv, _mm512_set1_epi8(0x30)),
        ),
        _mm512_or_si512(
            _mm512_and_si512(_mm512_srli_epi16::<4>(bv), low),
            _mm512_and_si512(_mm512_srli_epi16::<2>(hv), _mm512_set1_epi8(0x30)),
        ),
    ]
}

/// 16 bytes at `at` of each record as one 256-bit vector, `x`'s in the low half.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")]
fn load16_pair(x: &[u8], y: &[u8], at: usize) -> __m256i {
    let (x, y) = (&x[at..at + 16], &y[at..at + 16]);
    // SAFETY: `x` and `y` are 16 readable bytes each; the loads are unaligned.
    let (lo, hi) = unsafe {
        (
            _mm_loadu_si128(x.as_ptr().cast()),
            _mm_loadu_si128(y.as_ptr().cast()),
        )
    };
    _mm256_set_m128i(hi, lo)
}

/// 8 bytes at `at` of each record as one 128-bit vector, `x`'s in the low half.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")]
fn load8_pair(x: &[u8], y: &[u8], at: usize) -> __m128i {
    let (x, y) = (&x[at..at + 8], &y[at..at + 8]);
    // SAFETY: `x` and `y` are 8 readable bytes each; the loads are unaligned.
    let (lo, hi) = unsafe {
        (
            _mm_loadl_epi64(x.as_ptr().cast()),
            _mm_loadl_epi64(y.as_ptr().cast()),
        )
    };
    _mm_unpacklo_epi64(lo, hi)
}

/// The 16 rows' f16 values at `at` as f32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")]
fn halves_pair(x: &[u8], y: &[u8], at: usize) -> __m512 {
    _mm512_cvtph_ps(load16_pair(x, y, at))
}

/// Four activation quants broadcast to every lane.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")]
fn four(x: &[i8], at: usize) -> __m512i {
    let x = &x[at..at + 4];
    _mm512_set1_epi32(i32::from_le_bytes([
        x[0] as u8, x[1] as u8, x[2] as u8, x[3] as u8,
    ]))
}

/// Bit `bit` of every byte of `h`, moved to bit 4 (0x10 or 0).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")]
fn bit4(h: __m512i, bit: i32) -> __m512i {
    let t = _mm512_srl_epi16(h, _mm_cvtsi32_si128(bit));
    _mm512_and_si512(_mm512_slli_epi16::<4>(t), _mm512_set1_epi8(0x10))
}

/// Weight rows of groups `ga` (low lanes) and `gb` (high lanes) against
/// activation rows `[a0, a0 + C)`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")]
fn tile<const F: u8, const C: usize>(
    p: &Packed,
    acts: &Acts<'_>,
    ga: usize,
    gb: usize,
    a0: usize,
) -> [__m512; C] {
    let k = p.k;
    let kb = k / SUPER;
    let rec = p.record_bytes();
    let qa = quants_at(p.format);
    let ra = &p.bytes[ga * kb * rec..(ga + 1) * kb * rec];
    let rb = &p.bytes[gb * kb * rec..(gb + 1) * kb * rec];
    let mut acc = [_mm512_setzero_ps(); C];
    let mut accm = [_mm512_setzero_ps(); C];
    let low = _mm512_set1_epi8(0x0f);
    let three = _mm512_set1_epi8(3);
    for (b, (x, y)) in ra.chunks_exact(rec).zip(rb.chunks_exact(rec)).enumerate() {
        let mut sumi = [_mm512_setzero_si512(); C];
        let xs: [&[i8]; C] =
            std::array::from_fn(|c| &acts.qs[(a0 + c) * k + b * SUPER..(a0 + c + 1) * k]);
        let bs: [&[i32]; C] = std::array::from_fn(|c| {
            &acts.bs[((a0 + c) * kb + b) * 16..((a0 + c) * kb + b + 1) * 16]
        });
        if F == 6 {
            for n in 0..2 {
                for lh in 0..2 {
                    // Sums of the 4 groups of 16 values this quarter
                    // touches: values l, l+32, l+64, l+96.
                    let mut gs = [[_mm512_setzero_si512(); 4]; C];
                    for j in 4 * lh..4 * lh + 4 {
                        let base = qa + (n * 8 + j) * 96;
                        let v = q6_values(x, y, base, low, three);
                        for c in 0..C {
                            for (set, vs) in v.iter().enumerate() {
                                let at = 128 * n + 32 * set + 4 * j;
                                gs[c][set] = _mm512_dpbusd_epi32(gs[c][set], *vs, four(xs[c], at));
                            }
                        }
                    }
                    for (set, grp) in (0..4).map(|set| (set, 8 * n + 2 * set + lh)) {
                        let sc = _mm512_cvtepi8_epi32(load8_pair(x, y, K6_SCALES + 8 * grp));
                        for c in 0..C {
                            let centred =
                                _mm512_sub_epi32(gs[c][set], _mm512_set1_epi32(32 * bs[c][grp]));
                            sumi[c] = _mm512_add_epi32(sumi[c], _mm512_mullo_epi32(centred, sc));
                        }
                    }
                }
            }
        } else {
            for ch in 0..4 {
                let mut even = [_mm512_setzero_si512(); C];
                let mut odd = [_mm512_setzero_si512(); C];
                for j in 0..8 {
                    let vq = load_pair(x, y, qa + 32 * (8 * ch + j));
                    let mut lo = _mm512_and_si512(vq, low);
                    let mut hi = _mm512_and_si512(_mm512_srli_epi16::<4>(vq), low);
                    if F == 5 {
                        let h = load_pair(x, y, K5_QH + 32 * j);
                        lo = _mm512_or_si512(lo, bit4(h, 2 * ch as i32));
                        hi = _mm512_or_si512(hi, bit4(h, 2 * ch as i32 + 1));
                    }
                    for c in 0..C {
                        let at = 64 * ch + 4 * j;
                        even[c] = _mm512_dpbusd_epi32(even[c], lo, four(xs[c], at));
                        odd[c] = _mm512_dpbusd_epi32(odd[c], hi, four(xs[c], at + 32));
                    }
                }
                let se = _mm512_cvtepu8_epi32(load8_pair(x, y, K_SCALES + 8 * (2 * ch)));
                let so = _mm512_cvtepu8_epi32(load8_pair(x, y, K_SCALES + 8 * (2 * ch + 1)));
                for c in 0..C {
                    sumi[c] = _mm512_add_epi32(
                        sumi[c],
                        _mm512_add_epi32(
                            _mm512_mullo_epi32(even[c], se),
                            _mm512_mullo_epi32(odd[c], so),
                        ),
                    );
                }
            }
            let dmin = halves_pair(x, y, K_DMIN);
            let mins: [__m512i; 4] =
                std::array::from_fn(|i| _mm512_cvtepu8_epi16(load16_pair(x, y, K_MINS + 16 * i)));
            for c in 0..C {
                let mut summ = _mm512_setzero_si512();
                for (i, m) in mins.iter().enumerate() {
                    let s = _mm512_set1_epi32(bsum_pair(bs[c], i));
                    summ = _mm512_dpwssd_epi32(summ, *m, s);
                }
                let dx = _mm512_set1_ps(acts.d[(a0 + c) * kb + b]);
                accm[c] =
                    _mm512_fmadd_ps(_mm512_cvtepi32_ps(summ), _mm512_mul_ps(dmin, dx), accm[c]);
            }
        }
        let d = halves_pair(x, y, K_D);
        for c in 0..C {
            let dx = _mm512_set1_ps(acts.d[(a0 + c) * kb + b]);
            acc[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sumi[c]), _mm512_mul_ps(d, dx), acc[c]);
        }
    }
    std::array::from_fn(|c| _mm512_sub_ps(acc[c], accm[c]))
}

/// Groups `[g0, g0 + out.len() / 8)` of the K-quant matrix `p` against one
/// activation row (the only one in `acts`): `out` is `[group][8]`.
pub(crate) fn groups_k_row(p: &Packed, acts: &Acts<'_>, g0: usize, out: &mut [f32]) {
    // SAFETY: reached only for `Isa::Avx512Vnni`, which `Isa::check` admits
    // only after avx2, fma, f16c, avx512f, avx512vl, avx512bw and avx512vnni
    // were detected on this CPU.
    unsafe { rows(p, acts, g0, out) }
}

#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")]
fn rows(p: &Packed, acts: &Acts<'_>, g0: usize, out: &mut [f32]) {
    const R4: usize = record_bytes(QuantFormat::Q4K);
    const R5: usize = record_bytes(QuantFormat::Q5K);
    const R6: usize = record_bytes(QuantFormat::Q6K);
    match p.format {
        QuantFormat::Q4K => rows_f::<4, R4>(p, acts, g0, out),
        QuantFormat::Q5K => rows_f::<5, R5>(p, acts, g0, out),
        QuantFormat::Q6K => rows_f::<6, R6>(p, acts, g0, out),
        // Only K-quant matrices are routed here (`run_row_k`).
        _ => {}
    }
}

#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")]
fn rows_f<const F: u8, const REC: usize>(p: &Packed, acts: &Acts<'_>, g0: usize, out: &mut [f32]) {
    // Group `i` of the first half runs beside group `half + i`: two long
    // runs of consecutive records, which the prefetchers follow (pairing
    // neighbours restarts both streams every two groups, and on weights
    // streamed from memory it ran at half the speed of one 8-row stream).
    let count = out.len() / GROUP;
    let half = count / 2;
    let (first, second) = out.split_at_mut(half * GROUP);
    for (i, (lo, hi)) in first
        .chunks_exact_mut(GROUP)
        .zip(second.chunks_exact_mut(GROUP))
        .enumerate()
    {
        let v = row::<F, REC>(p, acts, g0 + i, g0 + half + i);
        // SAFETY: `lo` and `hi` are 8 writable f32 each; the stores are unaligned.
        unsafe {
            _mm256_storeu_ps(lo.as_mut_ptr(), _mm512_castps512_ps256(v));
            _mm256_storeu_ps(
                hi.as_mut_ptr(),
                _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v))),
            );
        }
    }
    if count % 2 == 1 {
        // The last group alone (paired with itself, its low half kept).
        let g = g0 + count - 1;
        let v = row::<F, REC>(p, acts, g, g);
        let last = &mut out[(count - 1) * GROUP..count * GROUP];
        // SAFETY: `last` is 8 writable f32; the store is unaligned.
        unsafe { _mm256_storeu_ps(last.as_mut_ptr(), _mm512_castps512_ps256(v)) };
    }
}

/// Weight rows of groups `ga` (low lanes) and `gb` (high lanes) against the
/// one activation row: [`tile`]`::<F, 1>`'s bits, computed with 8
/// independent accumulators.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")]
fn row<const F: u8, const REC: usize>(p: &Packed, acts: &Acts<'_>, ga: usize, gb: usize) -> __m512 {
    let kb = p.k / SUPER;
    let qa = quants_at(p.format);
    let (ra, _) = p.bytes[ga * kb * REC..(ga + 1) * kb * REC].as_chunks::<REC>();
    let (rb, _) = p.bytes[gb * kb * REC..(gb + 1) * kb * REC].as_chunks::<REC>();
    let (xq, _) = acts.qs[..kb * SUPER].as_chunks::<SUPER>();
    let (xb, _) = acts.bs[..kb * 16].as_chunks::<16>();
    let mut acc = _mm512_setzero_ps();
    let mut accm = _mm512_setzero_ps();
    let low = _mm512_set1_epi8(0x0f);
    let three = _mm512_set1_epi8(3);
    let blocks = ra.iter().zip(rb).zip(xq).zip(xb).zip(&acts.d[..kb]);
    for ((((x, y), q), bs), &dxs) in blocks {
        let (x, y): (&[u8], &[u8]) = (x, y);
        let mut sumi = _mm512_setzero_si512();
        if F == 6 {
            for n in 0..2 {
                // [lh][set]: sums of the 4 groups of 16 values that the
                // vectors j = 4 * lh + jj touch (values l, l+32, l+64, l+96).
                let mut gs = [[_mm512_setzero_si512(); 4]; 2];
                for jj in 0..4 {
                    for (lh, gs) in gs.iter_mut().enumerate() {
                        let j = 4 * lh + jj;
                        let base = qa + (n * 8 + j) * 96;
                        let v = q6_values(x, y, base, low, three);
                        for (set, (g, vs)) in gs.iter_mut().zip(&v).enumerate() {
                            let at = 128 * n + 32 * set + 4 * j;
                            *g = _mm512_dpbusd_epi32(*g, *vs, four(q, at));
                        }
                    }
                }
                for (lh, gs) in gs.iter().enumerate() {
                    for (set, g) in gs.iter().enumerate() {
                        let grp = 8 * n + 2 * set + lh;
                        let sc = _mm512_cvtepi8_epi32(load8_pair(x, y, K6_SCALES + 8 * grp));
                        let centred = _mm512_sub_epi32(*g, _mm512_set1_epi32(32 * bs[grp]));
                        sumi = _mm512_add_epi32(sumi, _mm512_mullo_epi32(centred, sc));
                    }
                }
            }
        } else {
            let mut even = [_mm512_setzero_si512(); 4];
            let mut odd = [_mm512_setzero_si512(); 4];
            for j in 0..8 {
                let h = if F == 5 {
                    load_pair(x, y, K5_QH + 32 * j)
                } else {
                    _mm512_setzero_si512()
                };
                for (ch, (e, o)) in even.iter_mut().zip(odd.iter_mut()).enumerate() {
                    let vq = load_pair(x, y, qa + 32 * (8 * ch + j));
                    let mut lo = _mm512_and_si512(vq, low);
                    let mut hi = _mm512_and_si512(_mm512_srli_epi16::<4>(vq), low);
                    if F == 5 {
                        lo = _mm512_or_si512(lo, bit4(h, 2 * ch as i32));
                        hi = _mm512_or_si512(hi, bit4(h, 2 * ch as i32 + 1));
                    }
                    let at = 64 * ch + 4 * j;
                    *e = _mm512_dpbusd_epi32(*e, lo, four(q, at));
                    *o = _mm512_dpbusd_epi32(*o, hi, four(q, at + 32));
                }
            }
            for (ch, (e, o)) in even.iter().zip(&odd).enumerate() {
                let se = _mm512_cvtepu8_epi32(load8_pair(x, y, K_SCALES + 8 * (2 * ch)));
                let so = _mm512_cvtepu8_epi32(load8_pair(x, y, K_SCALES + 8 * (2 * ch + 1)));
                sumi = _mm512_add_epi32(
                    sumi,
                    _mm512_add_epi32(_mm512_mullo_epi32(*e, se), _mm512_mullo_epi32(*o, so)),
                );
            }
            let dmin = halves_pair(x, y, K_DMIN);
            let mut summ = _mm512_setzero_si512();
            for i in 0..4 {
                let m = _mm512_cvtepu8_epi16(load16_pair(x, y, K_MINS + 16 * i));
                let s = _mm512_set1_epi32(bsum_pair(bs, i));
                summ = _mm512_dpwssd_epi32(summ, m, s);
            }
            let dx = _mm512_set1_ps(dxs);
            accm = _mm512_fmadd_ps(_mm512_cvtepi32_ps(summ), _mm512_mul_ps(dmin, dx), accm);
        }
        let d = halves_pair(x, y, K_D);
        let dx = _mm512_set1_ps(dxs);
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sumi), _mm512_mul_ps(d, dx), acc);
    }
    _mm512_sub_ps(acc, accm)
}
