//! Each pod member's speed, which sizes its tensor-parallel share.
//!
//! Why: a pod of mixed Macs splits every layer across its members, and every
//! step waits for the slowest; giving each member KV-head groups and
//! feed-forward columns in proportion to its speed evens the step out.
//!
//! What is measured ([`probe`]): the time to multiply an f32 matrix much
//! larger than the caches (64 MiB) by a vector, on the engine's compute threads, the
//! same shape of work as a decode step (which streams weights from memory).
//! The result is in GB/s of weights read. The probe is deterministic in its
//! work (fixed sizes and values), takes tens of milliseconds, and runs once
//! per pod formation. A configured speed (`pod.speed`, in the same unit)
//! replaces it, for tests or to pin a plan.
//!
//! # Invariants
//! - [`plan_weights`] is a pure function of the gathered speeds: every rank
//!   gathers the same records, so every rank computes the same weights and
//!   the same plan. Weights are rounded to eighths of the fastest member, so
//!   measurement noise between equal machines (a few percent) yields equal
//!   shares, and a pod that forms again keeps its plan (and its loaded share).
//!
//! # Failure
//! None: a probe that cannot time anything (a zero-length run on a coarse
//! clock) reports the largest finite speed rather than zero, and
//! [`plan_weights`] maps any non-finite or non-positive speed to the
//! smallest weight.

use std::time::Instant;

use crate::engine::kernels::par_chunks_mut;

/// Rows and columns of the probe's matrix (64 MiB of f32: beyond the
/// last-level caches of Apple silicon and of most x86 parts, so it streams
/// from memory as decoding does; small enough to allocate anywhere).
const ROWS: usize = 4096;
const COLS: usize = 4096;
/// Timed passes after one warm-up; the fastest counts.
const PASSES: usize = 4;
/// Output rows per task on the compute pool.
const ROWS_PER_TASK: usize = 64;
/// Weights are multiples of this fraction of the fastest member's speed.
const GRAIN: f64 = 8.0;

/// This machine's speed: GB/s of f32 weights read by a matrix-vector product
/// on the engine's compute threads.
pub fn probe() -> f64 {
    let matrix: Vec<f32> = (0..ROWS * COLS)
        .map(|i| ((i % 251) as f32 - 125.0) * 1e-3)
        .collect();
    let x: Vec<f32> = (0..COLS).map(|i| ((i % 17) as f32 - 8.0) * 1e-2).collect();
    let mut y = vec![0f32; ROWS];
    let mut times = Vec::with_capacity(PASSES + 1);
    for _ in 0..=PASSES {
        let start = Instant::now();
        mat_vec(&matrix, &x, &mut y);
        std::hint::black_box(&y);
        times.push(start.elapsed().as_secs_f64());
    }
    speed((ROWS * COLS * std::mem::size_of::<f32>()) as f64, &times)
}

/// `y = matrix * x` (`matrix` is `y.len()` rows of `x.len()` columns), split
/// over the engine's compute threads: the probe's timed work.
fn mat_vec(matrix: &[f32], x: &[f32], y: &mut [f32]) {
    let cols = x.len();
    par_chunks_mut(y, ROWS_PER_TASK, |task, out| {
        for (i, o) in out.iter_mut().enumerate() {
            let r = task * ROWS_PER_TASK + i;
            let row = &matrix[r * cols..(r + 1) * cols];
            // Eight lanes so the compiler vectorizes the dot product.
            let mut acc = [0f32; 8];
            for (w, v) in row.chunks_exact(8).zip(x.chunks_exact(8)) {
                for l in 0..8 {
                    acc[l] += w[l] * v[l];
                }
            }
            *o = acc.iter().sum();
        }
    });
}

/// GB/s of `bytes` read per pass, from the passes' times in seconds: the
/// first is a warm-up and does not count; the fastest of the rest does.
/// A pass too short for the clock gives the largest finite speed.
fn speed(bytes: f64, times: &[f64]) -> f64 {
    let best = times.iter().skip(1).copied().fold(f64::INFINITY, f64::min);
    if best > 0.0 && best.is_finite() {
        bytes / best / 1e9
    } else {
        f64::MAX
    }
}

/// The tensor-parallel weights of members with the gathered `speeds`: each
/// speed as a fraction of the fastest, rounded to the nearest eighth (at
/// least one eighth). Equal for speeds within about 6% of each other.
pub fn plan_weights(speeds: &[f64]) -> Vec<f64> {
    let usable = |s: f64| if s.is_finite() && s > 0.0 { s } else { 0.0 };
    let fastest = speeds.iter().copied().map(usable).fold(0.0, f64::max);
    speeds
        .iter()
        .map(|&s| {
            if fastest == 0.0 {
                return 1.0;
            }
            ((usable(s) / fastest * GRAIN).round() / GRAIN).max(1.0 / GRAIN)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weights_round_to_eighths_of_the_fastest() {
        // Noise between equal machines gives equal shares.
        assert_eq!(plan_weights(&[20.1, 19.3]), vec![1.0, 1.0]);
        // Twice as fast: twice the weight.
        assert_eq!(plan_weights(&[10.0, 20.0]), vec![0.5, 1.0]);
        assert_eq!(plan_weights(&[30.0, 10.0, 20.0]), vec![1.0, 0.375, 0.625]);
        // A member far slower still gets the smallest share; nonsense counts
        // as the slowest, and all-nonsense as equal.
        assert_eq!(plan_weights(&[100.0, 1.0]), vec![1.0, 0.125]);
        assert_eq!(
            plan_weights(&[5.0, f64::NAN, -1.0]),
            vec![1.0, 0.125, 0.125]
        );
        assert_eq!(plan_weights(&[0.0, f64::NAN]), vec![1.0, 1.0]);
    }

    /// The timed work is the whole product: every row, every column, each
    /// output where it belongs (checked against a plain serial product).
    #[test]
    fn the_probe_multiplies_the_whole_matrix() {
        let (rows, cols) = (ROWS_PER_TASK * 5 + 3, 104);
        let matrix: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 7919 % 263) as f32 - 131.0) * 1e-2)
            .collect();
        let x: Vec<f32> = (0..cols).map(|i| ((i % 13) as f32 - 6.0) * 0.1).collect();
        let mut y = vec![f32::NAN; rows];
        mat_vec(&matrix, &x, &mut y);
        for (r, got) in y.iter().enumerate() {
            let want: f64 = matrix[r * cols..(r + 1) * cols]
                .iter()
                .zip(&x)
                .map(|(w, v)| f64::from(*w) * f64::from(*v))
                .sum();
            let scale: f64 = matrix[r * cols..(r + 1) * cols]
                .iter()
                .zip(&x)
                .map(|(w, v)| f64::from((w * v).abs()))
                .sum();
            assert!(
                (f64::from(*got) - want).abs() <= 1e-5 * scale + 1e-6,
                "row {r}: {got} vs {want}"
            );
        }
    }

    /// The figure is the bytes over the fastest timed pass, in GB/s; the
    /// warm-up pass never counts, however fast.
    #[test]
    fn the_speed_is_bytes_over_the_fastest_timed_pass() {
        let bytes = 64.0 * 1024.0 * 1024.0;
        // Warm-up first (here the fastest of all, as a cached rerun can be).
        let times = [0.001, 0.008, 0.004, 0.016, 0.005];
        assert_eq!(speed(bytes, &times), bytes / 0.004 / 1e9);
        assert_eq!(speed(bytes, &[0.5, 0.25]), bytes / 0.25 / 1e9);
        // Too short to time: the largest finite speed, never zero or infinity.
        assert_eq!(speed(bytes, &[0.1, 0.0]), f64::MAX);
        assert_eq!(speed(bytes, &[0.1]), f64::MAX);
        // The real probe gives a finite, positive figure.
        let s = probe();
        assert!(s.is_finite() && s > 0.0, "{s}");
    }
}
