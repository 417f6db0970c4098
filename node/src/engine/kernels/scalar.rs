//! Portable reference kernels: activation quantization (used by every path) and
//! the block dot products every SIMD path is tested against.
//!
//! Written for clarity, not speed; the sums follow ggml's definitions exactly
//! (integer dot per block, then `d_w * d_x * dot (+ m_w * s_x)` in f32).

use super::{Acts, QuantFormat, Rect, BLOCK};

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

/// Integer dot of one weight block's quants with 32 activation quants, plus the
/// weight block's scale and minimum-term factor: value = `d * dot + m * s`.
pub(crate) fn block_dot(format: QuantFormat, blk: &[u8], x: &[i8]) -> (i32, f32, f32) {
    match format {
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
    }
}

/// The reference rectangle (see [`Rect`]).
pub(crate) fn rect(rect: &Rect<'_>, acts: &Acts<'_>, out: &mut [f32]) {
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
