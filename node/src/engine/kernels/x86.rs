//! x86-64 kernels: AVX2 (`vpmaddubsw` + `vpmaddwd`) and AVX-512 VNNI
//! (`vpdpbusd` on 256-bit registers), generated from one template.
//!
//! A tile is `R` weight rows x `C` activation rows: each weight block is
//! unpacked once per tile (4-bit quants to 32 unsigned bytes, or `|q|` for
//! `Q8_0` with the sign moved onto the activations), then dotted with each
//! activation row's block; per pair, the 8 lane sums are scaled by
//! `d_w * d_x` into an f32 accumulator, and `m_w * s_x` is added on the side.
//!
//! Every function here is compiled for the features of its instruction set and
//! only entered through [`rect_avx2`] / [`rect_vnni`], whose callers have
//! checked those features at run time.

use core::arch::x86_64::*;

use super::{Acts, QuantFormat, Rect, BLOCK};

const F_Q4_0: u8 = 0;
const F_Q4_1: u8 = 1;
const F_Q8_0: u8 = 2;
const F_Q5_0: u8 = 3;

/// A rectangle on AVX2.
pub(crate) fn rect_avx2(rect: &Rect<'_>, acts: &Acts<'_>, out: &mut [f32]) {
    // SAFETY: reached only for `Isa::Avx2`, which `Isa::check` admits only after
    // avx2, fma and f16c were detected on this CPU.
    unsafe { avx2::rect(rect, acts, out) }
}

/// A rectangle on AVX-512 VNNI.
pub(crate) fn rect_vnni(rect: &Rect<'_>, acts: &Acts<'_>, out: &mut [f32]) {
    // SAFETY: reached only for `Isa::Avx512Vnni`, which `Isa::check` admits only
    // after avx2, fma, f16c, avx512f, avx512vl and avx512vnni were detected.
    unsafe { vnni::rect(rect, acts, out) }
}

macro_rules! x86_kernels {
    ($name:ident, $features:literal, $tile_c:literal, $dot:item) => {
        mod $name {
            use super::*;

            $dot

            #[inline]
            #[target_feature(enable = $features)]
            fn f16_to_f32(lo: u8, hi: u8) -> f32 {
                let bits = i32::from(u16::from_le_bytes([lo, hi]));
                _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits)))
            }

            #[inline]
            #[target_feature(enable = $features)]
            fn load32_u8(b: &[u8]) -> __m256i {
                let b = &b[..32];
                // SAFETY: `b` is 32 readable bytes; the load is unaligned.
                unsafe { _mm256_loadu_si256(b.as_ptr().cast()) }
            }

            #[inline]
            #[target_feature(enable = $features)]
            fn load32_i8(b: &[i8]) -> __m256i {
                let b = &b[..32];
                // SAFETY: `b` is 32 readable bytes; the load is unaligned.
                unsafe { _mm256_loadu_si256(b.as_ptr().cast()) }
            }

            /// 16 bytes of packed 4-bit quants to 32 bytes 0..=15: low nibbles
            /// (values 0..16) in the low lane, high nibbles (16..32) in the high lane.
            #[inline]
            #[target_feature(enable = $features)]
            fn nibbles(b: &[u8]) -> __m256i {
                let b = &b[..16];
                // SAFETY: `b` is 16 readable bytes; the load is unaligned.
                let lo = unsafe { _mm_loadu_si128(b.as_ptr().cast()) };
                let hi = _mm_srli_epi16::<4>(lo);
                _mm256_and_si256(_mm256_set_m128i(hi, lo), _mm256_set1_epi8(0x0f))
            }

            /// The 32 bits at `b[..4]` as 32 bytes: 0x10 where the bit is set
            /// (ggml's `bytes_from_bits_32`, scaled to `Q5_0`'s fifth bit).
            #[inline]
            #[target_feature(enable = $features)]
            fn high_bits(b: &[u8]) -> __m256i {
                let bits = i32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                let shuf = _mm256_set_epi64x(
                    0x0303030303030303,
                    0x0202020202020202,
                    0x0101010101010101,
                    0x0000000000000000,
                );
                let bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(bits), shuf);
                let bytes = _mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
                let set = _mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1));
                _mm256_and_si256(set, _mm256_set1_epi8(0x10))
            }

            #[inline]
            #[target_feature(enable = $features)]
            fn hsum(v: __m256) -> f32 {
                let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
                let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
                let s = _mm_add_ss(s, _mm_movehdup_ps(s));
                _mm_cvtss_f32(s)
            }

            /// Weight rows `[r0, r0 + R)` x activation rows `[c0, c0 + C)` of the rectangle.
            #[inline]
            #[target_feature(enable = $features)]
            fn tile<const F: u8, const R: usize, const C: usize>(
                rect: &Rect<'_>,
                acts: &Acts<'_>,
                r0: usize,
                c0: usize,
                out: &mut [f32],
            ) {
                let k = acts.k;
                let kb = k / BLOCK;
                let bb = match F {
                    F_Q4_0 => QuantFormat::Q4_0.block_bytes(),
                    F_Q4_1 => QuantFormat::Q4_1.block_bytes(),
                    F_Q5_0 => QuantFormat::Q5_0.block_bytes(),
                    _ => QuantFormat::Q8_0.block_bytes(),
                };
                let mut acc = [[_mm256_setzero_ps(); C]; R];
                let mut macc = [[0f32; C]; R];
                for b in 0..kb {
                    let mut wv = [_mm256_setzero_si256(); R];
                    let mut dw = [0f32; R];
                    let mut mw = [0f32; R];
                    for r in 0..R {
                        let off = (r0 + r) * rect.row_bytes + b * bb;
                        let blk = &rect.w[off..off + bb];
                        dw[r] = f16_to_f32(blk[0], blk[1]);
                        match F {
                            F_Q4_0 => {
                                mw[r] = -8.0 * dw[r];
                                wv[r] = nibbles(&blk[2..18]);
                            }
                            F_Q4_1 => {
                                mw[r] = f16_to_f32(blk[2], blk[3]);
                                wv[r] = nibbles(&blk[4..20]);
                            }
                            F_Q5_0 => {
                                mw[r] = -16.0 * dw[r];
                                wv[r] = _mm256_or_si256(nibbles(&blk[6..22]), high_bits(&blk[2..6]));
                            }
                            _ => wv[r] = load32_u8(&blk[2..34]),
                        }
                    }
                    for c in 0..C {
                        let row = rect.a0 + c0 + c;
                        let xo = row * k + b * BLOCK;
                        let x = load32_i8(&acts.qs[xo..xo + BLOCK]);
                        let dx = acts.d[row * kb + b];
                        let sx = if F == F_Q8_0 { 0.0 } else { acts.s[row * kb + b] };
                        for r in 0..R {
                            let sum = if F == F_Q8_0 {
                                // |w| (unsigned) times x with w's sign.
                                dot(_mm256_abs_epi8(wv[r]), _mm256_sign_epi8(x, wv[r]))
                            } else {
                                dot(wv[r], x)
                            };
                            acc[r][c] = _mm256_fmadd_ps(
                                _mm256_cvtepi32_ps(sum),
                                _mm256_set1_ps(dw[r] * dx),
                                acc[r][c],
                            );
                            if F != F_Q8_0 {
                                macc[r][c] += mw[r] * sx;
                            }
                        }
                    }
                }
                for r in 0..R {
                    for c in 0..C {
                        out[(c0 + c) * rect.sa + (r0 + r) * rect.sr] = hsum(acc[r][c]) + macc[r][c];
                    }
                }
            }

            #[target_feature(enable = $features)]
            fn rect_f<const F: u8>(rect: &Rect<'_>, acts: &Acts<'_>, out: &mut [f32]) {
                let mut c0 = 0;
                while c0 + $tile_c <= rect.na {
                    let mut r0 = 0;
                    while r0 + 4 <= rect.nr {
                        tile::<F, 4, $tile_c>(rect, acts, r0, c0, out);
                        r0 += 4;
                    }
                    while r0 < rect.nr {
                        tile::<F, 1, $tile_c>(rect, acts, r0, c0, out);
                        r0 += 1;
                    }
                    c0 += $tile_c;
                }
                while c0 < rect.na {
                    let mut r0 = 0;
                    while r0 + 4 <= rect.nr {
                        tile::<F, 4, 1>(rect, acts, r0, c0, out);
                        r0 += 4;
                    }
                    while r0 < rect.nr {
                        tile::<F, 1, 1>(rect, acts, r0, c0, out);
                        r0 += 1;
                    }
                    c0 += 1;
                }
            }

            #[target_feature(enable = $features)]
            pub(super) fn rect(rect: &Rect<'_>, acts: &Acts<'_>, out: &mut [f32]) {
                match rect.format {
                    QuantFormat::Q4_0 => rect_f::<F_Q4_0>(rect, acts, out),
                    QuantFormat::Q4_1 => rect_f::<F_Q4_1>(rect, acts, out),
                    QuantFormat::Q8_0 => rect_f::<F_Q8_0>(rect, acts, out),
                    QuantFormat::Q5_0 => rect_f::<F_Q5_0>(rect, acts, out),
                    // K-quants never reach the row-major x86 kernels (see `run_rect`).
                    _ => super::super::scalar::rect(rect, acts, out),
                }
            }
        }
    };
}

x86_kernels!(
    avx2,
    "avx2,fma,f16c",
    2,
    /// Sums of 4 adjacent u8 x i8 products per 32-bit lane.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn dot(u: __m256i, s: __m256i) -> __m256i {
        _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1))
    }
);

x86_kernels!(
    vnni,
    "avx2,fma,f16c,avx512f,avx512vl,avx512vnni",
    4,
    /// Sums of 4 adjacent u8 x i8 products per 32-bit lane.
    // The AVX-512 intrinsics are stable since Rust 1.89, newer than the
    // workspace's declared rust-version; the pinned toolchain has them.
    #[allow(clippy::incompatible_msrv)]
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
    fn dot(u: __m256i, s: __m256i) -> __m256i {
        _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s)
    }
);
