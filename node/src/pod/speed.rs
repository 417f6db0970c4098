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
    let mut best = f64::INFINITY;
    for pass in 0..=PASSES {
        let start = Instant::now();
        par_chunks_mut(&mut y, ROWS_PER_TASK, |task, out| {
            for (i, o) in out.iter_mut().enumerate() {
                let r = task * ROWS_PER_TASK + i;
                let row = &matrix[r * COLS..(r + 1) * COLS];
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
        std::hint::black_box(&y);
        if pass > 0 {
            best = best.min(start.elapsed().as_secs_f64());
        }
    }
    let bytes = (ROWS * COLS * std::mem::size_of::<f32>()) as f64;
    if best > 0.0 {
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

    #[test]
    fn the_probe_measures_a_positive_speed() {
        let s = probe();
        assert!(s.is_finite() && s > 0.0, "{s}");
    }
}
