//! aarch64 kernels on Advanced SIMD (baseline on every aarch64 CPU, so no run-time check).
//!
//! Uses widening multiplies (`smull`/`smull2` + `sadalp`) rather than `sdot`,
//! whose intrinsics are not stable Rust yet. A tile is `R` weight rows x 1..=2
//! activation rows; each pair's four 32-bit lane sums are scaled by
//! `d_w * d_x` into an f32x4 accumulator.
//!
//! `Q5_0` and the K-quants unpack each block's quants to bytes with the
//! portable decoder ([`scalar::q5_0_quants`], [`scalar::k_quants`]), then
//! take the same widening dot products per 32 (or, `Q6_K`, 16) values.

use core::arch::aarch64::*;

use super::scalar::{self, f16_at};
use super::{Acts, QuantFormat, Rect, BLOCK, SUPER};

const F_Q4_0: u8 = 0;
const F_Q4_1: u8 = 1;
const F_Q8_0: u8 = 2;
const F_Q5_0: u8 = 3;

#[inline]
#[target_feature(enable = "neon")]
fn load16_u8(b: &[u8]) -> uint8x16_t {
    let b = &b[..16];
    // SAFETY: `b` is 16 readable bytes; vld1q has no alignment requirement.
    unsafe { vld1q_u8(b.as_ptr()) }
}

#[inline]
#[target_feature(enable = "neon")]
fn load16_i8(b: &[i8]) -> int8x16_t {
    let b = &b[..16];
    // SAFETY: `b` is 16 readable bytes; vld1q has no alignment requirement.
    unsafe { vld1q_s8(b.as_ptr()) }
}

/// Four lane sums of `w[0..16] * x[0..16] + w[16..32] * x[16..32]`.
#[inline]
#[target_feature(enable = "neon")]
fn dot(w0: int8x16_t, w1: int8x16_t, x0: int8x16_t, x1: int8x16_t) -> int32x4_t {
    let p0 = vmull_s8(vget_low_s8(w0), vget_low_s8(x0));
    let p1 = vmull_high_s8(w0, x0);
    let p2 = vmull_s8(vget_low_s8(w1), vget_low_s8(x1));
    let p3 = vmull_high_s8(w1, x1);
    let s = vpaddlq_s16(p0);
    let s = vpadalq_s16(s, p1);
    let s = vpadalq_s16(s, p2);
    vpadalq_s16(s, p3)
}

#[inline]
#[target_feature(enable = "neon")]
fn tile<const F: u8, const R: usize, const C: usize>(
    rect: &Rect<'_>,
    acts: &Acts<'_>,
    r0: usize,
    c0: usize,
    out: &mut [f32],
) {
    let k = acts.k;
    let kb = k / BLOCK;
    let bb = rect.format.block_bytes();
    let mut acc = [[vdupq_n_f32(0.0); C]; R];
    let mut macc = [[0f32; C]; R];
    for b in 0..kb {
        let mut w0 = [vdupq_n_s8(0); R];
        let mut w1 = [vdupq_n_s8(0); R];
        let mut dw = [0f32; R];
        let mut mw = [0f32; R];
        for r in 0..R {
            let off = (r0 + r) * rect.row_bytes + b * bb;
            let blk = &rect.w[off..off + bb];
            dw[r] = f16_at(blk, 0);
            if F == F_Q8_0 {
                w0[r] = vreinterpretq_s8_u8(load16_u8(&blk[2..18]));
                w1[r] = vreinterpretq_s8_u8(load16_u8(&blk[18..34]));
            } else if F == F_Q5_0 {
                mw[r] = -16.0 * dw[r];
                let q = scalar::q5_0_quants(blk);
                w0[r] = vreinterpretq_s8_u8(load16_u8(&q[0..16]));
                w1[r] = vreinterpretq_s8_u8(load16_u8(&q[16..32]));
            } else {
                let (m, qs) = if F == F_Q4_0 {
                    (-8.0 * dw[r], &blk[2..18])
                } else {
                    (f16_at(blk, 2), &blk[4..20])
                };
                mw[r] = m;
                let q = load16_u8(qs);
                w0[r] = vreinterpretq_s8_u8(vandq_u8(q, vdupq_n_u8(0x0f)));
                w1[r] = vreinterpretq_s8_u8(vshrq_n_u8::<4>(q));
            }
        }
        for c in 0..C {
            let row = rect.a0 + c0 + c;
            let xo = row * k + b * BLOCK;
            let x0 = load16_i8(&acts.qs[xo..xo + 16]);
            let x1 = load16_i8(&acts.qs[xo + 16..xo + 32]);
            let dx = acts.d[row * kb + b];
            let sx = if F == F_Q8_0 {
                0.0
            } else {
                acts.s[row * kb + b]
            };
            for r in 0..R {
                let sum = dot(w0[r], w1[r], x0, x1);
                acc[r][c] = vfmaq_n_f32(acc[r][c], vcvtq_f32_s32(sum), dw[r] * dx);
                if F != F_Q8_0 {
                    macc[r][c] += mw[r] * sx;
                }
            }
        }
    }
    for r in 0..R {
        for c in 0..C {
            out[(c0 + c) * rect.sa + (r0 + r) * rect.sr] = vaddvq_f32(acc[r][c]) + macc[r][c];
        }
    }
}

#[target_feature(enable = "neon")]
fn rect_f<const F: u8>(rect: &Rect<'_>, acts: &Acts<'_>, out: &mut [f32]) {
    let mut c0 = 0;
    while c0 + 2 <= rect.na {
        let mut r0 = 0;
        while r0 + 4 <= rect.nr {
            tile::<F, 4, 2>(rect, acts, r0, c0, out);
            r0 += 4;
        }
        while r0 < rect.nr {
            tile::<F, 1, 2>(rect, acts, r0, c0, out);
            r0 += 1;
        }
        c0 += 2;
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

/// Four lane sums of `w[0..16] * x[0..16]`.
#[inline]
#[target_feature(enable = "neon")]
fn dot16(w: int8x16_t, x: int8x16_t) -> int32x4_t {
    let p0 = vmull_s8(vget_low_s8(w), vget_low_s8(x));
    let p1 = vmull_high_s8(w, x);
    vpadalq_s16(vpaddlq_s16(p0), p1)
}

/// K-quant rectangle: each block's quants unpacked to bytes (at most 63,
/// so they are valid i8), integer dots per sub-block on NEON, the sub-block
/// scales applied to the exact integer sums.
#[target_feature(enable = "neon")]
fn rect_k(rect: &Rect<'_>, acts: &Acts<'_>, out: &mut [f32]) {
    let bb = rect.format.block_bytes();
    let kb = acts.k / SUPER;
    for a in 0..rect.na {
        let row = rect.a0 + a;
        for r in 0..rect.nr {
            let w = &rect.w[r * rect.row_bytes..(r + 1) * rect.row_bytes];
            let (mut acc, mut accm) = (0f32, 0f32);
            for b in 0..kb {
                let blk = &w[b * bb..(b + 1) * bb];
                let q = scalar::k_quants(rect.format, blk);
                let xo = row * acts.k + b * SUPER;
                let x = &acts.qs[xo..xo + SUPER];
                let bs = &acts.bs[(row * kb + b) * 16..(row * kb + b + 1) * 16];
                let dot_at = |from: usize| -> i32 {
                    let wv = vreinterpretq_s8_u8(load16_u8(&q[from..from + 16]));
                    vaddvq_s32(dot16(wv, load16_i8(&x[from..from + 16])))
                };
                let dx = acts.d[row * kb + b];
                if rect.format == QuantFormat::Q6K {
                    let mut sumi = 0i32;
                    for g in 0..16 {
                        let sc = i32::from(blk[192 + g] as i8);
                        sumi += sc * (dot_at(16 * g) - 32 * bs[g]);
                    }
                    acc += f16_at(blk, 208) * dx * sumi as f32;
                } else {
                    let (mut sumi, mut summ) = (0i32, 0i32);
                    for j in 0..8 {
                        let (sc, m) = scalar::scale_min_k4(j, &blk[4..16]);
                        sumi += i32::from(sc) * (dot_at(32 * j) + dot_at(32 * j + 16));
                        summ += i32::from(m) * (bs[2 * j] + bs[2 * j + 1]);
                    }
                    acc += f16_at(blk, 0) * dx * sumi as f32;
                    accm += f16_at(blk, 2) * dx * summ as f32;
                }
            }
            out[a * rect.sa + r * rect.sr] = acc - accm;
        }
    }
}

/// A rectangle on NEON.
pub(crate) fn rect(rect: &Rect<'_>, acts: &Acts<'_>, out: &mut [f32]) {
    // SAFETY: Advanced SIMD ("neon") is part of every aarch64 target Rust
    // supports (it is in the baseline feature set), so this CPU has it.
    unsafe {
        match rect.format {
            QuantFormat::Q4_0 => rect_f::<F_Q4_0>(rect, acts, out),
            QuantFormat::Q4_1 => rect_f::<F_Q4_1>(rect, acts, out),
            QuantFormat::Q8_0 => rect_f::<F_Q8_0>(rect, acts, out),
            QuantFormat::Q5_0 => rect_f::<F_Q5_0>(rect, acts, out),
            QuantFormat::Q4K | QuantFormat::Q5K | QuantFormat::Q6K => rect_k(rect, acts, out),
        }
    }
}
