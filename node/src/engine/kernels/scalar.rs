//! Portable reference kernels: activation quantization (used by every path) and
//! the block dot products every SIMD path is tested against.
//!
//! Written for clarity, not speed; the sums follow ggml's definitions exactly
//! (integer dot per block, then `d_w * d_x * dot (+ m_w * s_x)` in f32).

use super::{Acts, QuantFormat, Rect, BLOCK, SUPER};

/// f16 at `bytes[at..at + 2]` (little-endian) as f32.
pub(crate) fn f16_at(bytes: &[u8], at: usize) -> f32 {
    half::f16::from_bits(u16::from_le_bytes([bytes[at], bytes[at + 1]])).to_f32()
}

fn round_f16(x: f32) -> f32 {
    half::f16::from_f32(x).to_f32()
}

/// `x` rounded half to even, for `|x| <= 127` (what quantization feeds it;
/// larger values are clamped to ±128 first). Adding and subtracting 1.5 * 2^23
/// makes the FPU round in its default mode, nearest-even, inline; `f32::
/// round_ties_even` is a call into libm on x86-64 without SSE4.1 at build time.
#[inline]
fn round_even(x: f32) -> f32 {
    const MAGIC: f32 = 12_582_912.0;
    let x = x.clamp(-128.0, 128.0);
    (x + MAGIC) - MAGIC
}

/// Quantizes one block of 32 values into `q` (ggml's `quantize_row_q8_1` as
/// its x86 build computes it: `127 / max|x|` as the inverse scale, and
/// rounding half to even like `_mm256_round_ps`):
/// returns `(d, s81, sx)` = (scale rounded to f16, f16-rounded `d * sum(q)`,
/// `d_rounded * sum(q)`).
pub(crate) fn quantize_block(x: &[f32], q: &mut [i8]) -> (f32, f32, f32) {
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
    let mut sum = 0i32;
    for (qi, xi) in q.iter_mut().zip(x) {
        // `as` saturates (and maps NaN to 0), so odd inputs cannot overflow.
        let v = round_even(xi * id) as i8;
        *qi = v;
        sum += i32::from(v);
    }
    let d16 = round_f16(d);
    (d16, round_f16(d * sum as f32), d16 * sum as f32)
}

/// Quantizes one block of 256 values into `q` as ggml's `quantize_row_q8_K_ref`
/// does (the value of largest magnitude maps to -127, `iscale = -127 / max`,
/// quants rounded half to even, at most 127) and writes the sum of each 16
/// quants to `bs`; returns the f32 scale `1 / iscale`.
pub(crate) fn quantize_block_k(x: &[f32], q: &mut [i8], bs: &mut [i32]) -> f32 {
    let mut max = 0f32;
    let mut amax = 0f32;
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    if amax == 0.0 {
        q.fill(0);
        bs.fill(0);
        return 0.0;
    }
    let iscale = -127.0 / max;
    for (qi, &xi) in q.iter_mut().zip(x) {
        *qi = round_even(iscale * xi).min(127.0) as i8;
    }
    for (b, sixteen) in bs.iter_mut().zip(q.chunks_exact(16)) {
        *b = sixteen.iter().map(|&v| i32::from(v)).sum();
    }
    1.0 / iscale
}

/// The 6-bit scale and minimum of sub-block `j` (0..8) of a `Q4_K`/`Q5_K`
/// block's 12 scale bytes (ggml's `get_scale_min_k4`).
pub(crate) fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// The 256 unsigned quants of a K-quant block, in value order (`Q4_K`:
/// 0..=15, `Q5_K`: 0..=31, `Q6_K`: 0..=63, offset 32 not applied).
pub(crate) fn k_quants(format: QuantFormat, blk: &[u8]) -> [u8; SUPER] {
    let mut q = [0u8; SUPER];
    match format {
        QuantFormat::Q4K | QuantFormat::Q5K => {
            let (qs, qh) = if format == QuantFormat::Q4K {
                (&blk[16..144], None)
            } else {
                (&blk[48..176], Some(&blk[16..48]))
            };
            for c in 0..4 {
                for l in 0..32 {
                    let byte = qs[32 * c + l];
                    let (mut lo, mut hi) = (byte & 0x0f, byte >> 4);
                    if let Some(qh) = qh {
                        lo |= ((qh[l] >> (2 * c)) & 1) << 4;
                        hi |= ((qh[l] >> (2 * c + 1)) & 1) << 4;
                    }
                    q[64 * c + l] = lo;
                    q[64 * c + 32 + l] = hi;
                }
            }
        }
        QuantFormat::Q6K => {
            let (ql, qh) = (&blk[0..128], &blk[128..192]);
            for n in 0..2 {
                for l in 0..32 {
                    let (a, b, h) = (ql[64 * n + l], ql[64 * n + 32 + l], qh[32 * n + l]);
                    q[128 * n + l] = (a & 0x0f) | ((h & 3) << 4);
                    q[128 * n + 32 + l] = (b & 0x0f) | (((h >> 2) & 3) << 4);
                    q[128 * n + 64 + l] = (a >> 4) | (((h >> 4) & 3) << 4);
                    q[128 * n + 96 + l] = (b >> 4) | (((h >> 6) & 3) << 4);
                }
            }
        }
        _ => {}
    }
    q
}

/// One K-quant block against 256 `Q8_K` activation quants `x` with their
/// sums of 16 `bs`: `(sumi, summ, d, dmin)`, the value being
/// `d_x * (d * sumi - dmin * summ)`. Integer parts are exact, as in ggml.
pub(crate) fn block_dot_k(
    format: QuantFormat,
    blk: &[u8],
    x: &[i8],
    bs: &[i32],
) -> (i32, i32, f32, f32) {
    let q = k_quants(format, blk);
    let dot = |from: usize, len: usize| -> i32 {
        q[from..from + len]
            .iter()
            .zip(&x[from..from + len])
            .map(|(&a, &b)| i32::from(a) * i32::from(b))
            .sum()
    };
    match format {
        QuantFormat::Q6K => {
            let sc = &blk[192..208];
            let mut sumi = 0i32;
            for g in 0..16 {
                // (q - 32) . x = q . x - 32 * sum(x)
                sumi += i32::from(sc[g] as i8) * (dot(16 * g, 16) - 32 * bs[g]);
            }
            (sumi, 0, f16_at(blk, 208), 0.0)
        }
        _ => {
            let scales = &blk[4..16];
            let (mut sumi, mut summ) = (0i32, 0i32);
            for j in 0..8 {
                let (sc, m) = scale_min_k4(j, scales);
                sumi += i32::from(sc) * dot(32 * j, 32);
                summ += i32::from(m) * (bs[2 * j] + bs[2 * j + 1]);
            }
            (sumi, summ, f16_at(blk, 0), f16_at(blk, 2))
        }
    }
}

/// The 32 unsigned 5-bit quants of a `Q5_0` block (offset 16 not applied).
pub(crate) fn q5_0_quants(blk: &[u8]) -> [u8; BLOCK] {
    let qh = u32::from_le_bytes([blk[2], blk[3], blk[4], blk[5]]);
    let qs = &blk[6..22];
    let mut q = [0u8; BLOCK];
    for j in 0..BLOCK / 2 {
        q[j] = (qs[j] & 0x0f) | ((((qh >> j) & 1) as u8) << 4);
        q[j + BLOCK / 2] = (qs[j] >> 4) | ((((qh >> (j + 16)) & 1) as u8) << 4);
    }
    q
}

/// Integer dot of one weight block's quants with 32 activation quants, plus the
/// weight block's scale and minimum-term factor: value = `d * dot + m * s`.
pub(crate) fn block_dot(format: QuantFormat, blk: &[u8], x: &[i8]) -> (i32, f32, f32) {
    match format {
        QuantFormat::Q5_0 => {
            let d = f16_at(blk, 0);
            let dot = q5_0_quants(blk)
                .iter()
                .zip(x)
                .map(|(&w, &a)| i32::from(w) * i32::from(a))
                .sum();
            (dot, d, -16.0 * d)
        }
        QuantFormat::Q4_0 | QuantFormat::Q4_1 => {
            let (d, m, qs) = if format == QuantFormat::Q4_0 {
                let d = f16_at(blk, 0);
                (d, -8.0 * d, &blk[2..18])
            } else {
                (f16_at(blk, 0), f16_at(blk, 2), &blk[4..20])
            };
            let mut dot = 0i32;
            for j in 0..BLOCK / 2 {
                dot += i32::from(qs[j] & 0x0f) * i32::from(x[j]);
                dot += i32::from(qs[j] >> 4) * i32::from(x[j + BLOCK / 2]);
            }
            (dot, d, m)
        }
        QuantFormat::Q8_0 => {
            let d = f16_at(blk, 0);
            let dot = blk[2..34]
                .iter()
                .zip(x)
                .map(|(&w, &a)| i32::from(w as i8) * i32::from(a))
                .sum();
            (dot, d, 0.0)
        }
        // K-quants go through `block_dot_k`.
        _ => (0, 0.0, 0.0),
    }
}

/// The reference rectangle for K-quant weights.
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
                let x = &acts.qs[row * acts.k + b * SUPER..row * acts.k + (b + 1) * SUPER];
                let bs = &acts.bs[(row * kb + b) * 16..(row * kb + b + 1) * 16];
                let (sumi, summ, d, dmin) = block_dot_k(rect.format, blk, x, bs);
                let dx = acts.d[row * kb + b];
                acc += d * dx * sumi as f32;
                accm += dmin * dx * summ as f32;
            }
            out[a * rect.sa + r * rect.sr] = acc - accm;
        }
    }
}

/// The reference rectangle (see [`Rect`]).
pub(crate) fn rect(rect: &Rect<'_>, acts: &Acts<'_>, out: &mut [f32]) {
    if rect.format.is_k() {
        return rect_k(rect, acts, out);
    }
    let bb = rect.format.block_bytes();
    let kb = acts.k / BLOCK;
    for a in 0..rect.na {
        let row = rect.a0 + a;
        for r in 0..rect.nr {
            let w = &rect.w[r * rect.row_bytes..(r + 1) * rect.row_bytes];
            let mut sum = 0f32;
            for b in 0..kb {
                let blk = &w[b * bb..(b + 1) * bb];
                let x = &acts.qs[row * acts.k + b * BLOCK..row * acts.k + (b + 1) * BLOCK];
                let (dot, d, m) = block_dot(rect.format, blk, x);
                let dx = acts.d[row * kb + b];
                sum += d * dx * dot as f32;
                if rect.format != QuantFormat::Q8_0 {
                    sum += m * acts.s[row * kb + b];
                }
            }
            out[a * rect.sa + r * rect.sr] = sum;
        }
    }
}

#[cfg(test)]
mod round_tests {
    use super::round_even;

    #[test]
    fn round_even_matches_the_standard_library() {
        let mut x = -130.0f32;
        while x <= 130.0 {
            assert_eq!(
                round_even(x),
                x.clamp(-128.0, 128.0).round_ties_even(),
                "{x}"
            );
            x += 0.125;
        }
        assert_eq!(round_even(2.5), 2.0);
        assert_eq!(round_even(-3.5), -4.0);
        assert_eq!(round_even(f32::NAN) as i8, 0);
    }
}
