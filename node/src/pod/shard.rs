//! The sharding plan: which part of the model each pod member holds.
//!
//! Tensor parallel splits every layer: each rank gets a contiguous range of
//! KV-head groups (with their query heads) and of feed-forward columns.
//! Pipeline parallel gives each rank a contiguous range of layers. Shares are
//! proportional to a weight per member (measured speed for tensor parallel,
//! memory for pipeline), so mixed Macs work and counts need not divide evenly
//! (SmolLM2's 3 KV heads over 2 equal ranks: 2 + 1).
//!
//! # Invariants
//! - [`split`] returns consecutive, non-overlapping ranges that cover
//!   `0..total` exactly, one per weight, each non-empty, sizes within one of
//!   the exact proportional share (largest remainder; ties to lower ranks),
//!   except that a share that would be empty takes one unit from the largest.
//!
//! # Failure
//! [`ShardError`] when there are more members than units to share, or a
//! weight is not a positive finite number.

use std::ops::Range;

#[derive(Debug, thiserror::Error, PartialEq)]
#[non_exhaustive]
pub enum ShardError {
    #[error("cannot split {total} {what} over {ranks} members (each needs at least one)")]
    TooFewUnits {
        what: &'static str,
        total: usize,
        ranks: usize,
    },
    #[error("member {rank} has weight {weight}, which is not a positive number")]
    BadWeight { rank: usize, weight: f64 },
    #[error("a pod needs at least one member")]
    Empty,
}

/// Splits `0..total` in proportion to `weights` (see the invariants).
pub fn split(
    what: &'static str,
    total: usize,
    weights: &[f64],
) -> Result<Vec<Range<usize>>, ShardError> {
    let ranks = weights.len();
    if ranks == 0 {
        return Err(ShardError::Empty);
    }
    if let Some((rank, &weight)) = weights
        .iter()
        .enumerate()
        .find(|(_, w)| !(w.is_finite() && **w > 0.0))
    {
        return Err(ShardError::BadWeight { rank, weight });
    }
    if total < ranks {
        return Err(ShardError::TooFewUnits { what, total, ranks });
    }
    // Largest remainder on the exact shares, then every empty share takes
    // one unit from the largest.
    let sum: f64 = weights.iter().sum();
    let exact: Vec<f64> = weights.iter().map(|w| w / sum * total as f64).collect();
    let mut counts: Vec<usize> = exact.iter().map(|e| e.floor() as usize).collect();
    let mut left = total.saturating_sub(counts.iter().sum::<usize>());
    let mut order: Vec<usize> = (0..ranks).collect();
    order.sort_by(|&a, &b| {
        let (ra, rb) = (exact[a] - exact[a].floor(), exact[b] - exact[b].floor());
        rb.total_cmp(&ra).then(a.cmp(&b))
    });
    for &r in order.iter().cycle() {
        if left == 0 {
            break;
        }
        counts[r] += 1;
        left -= 1;
    }
    while let Some(empty) = counts.iter().position(|&c| c == 0) {
        let (largest, _) = counts
            .iter()
            .enumerate()
            .max_by(|a, b| a.1.cmp(b.1).then(b.0.cmp(&a.0)))
            .ok_or(ShardError::Empty)?;
        counts[largest] -= 1;
        counts[empty] += 1;
    }
    let mut start = 0;
    Ok(counts
        .into_iter()
        .map(|c| {
            let r = start..start + c;
            start += c;
            r
        })
        .collect())
}

/// One rank's part of every layer under tensor parallelism.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorShard {
    pub rank: usize,
    pub ranks: usize,
    /// KV heads this rank holds (its query heads are the matching groups).
    pub kv_heads: Range<usize>,
    /// Feed-forward columns (rows of gate/up, columns of down).
    pub ffn: Range<usize>,
}

/// The tensor-parallel plan for a model with `kv_heads` KV heads and
/// `intermediate` feed-forward columns over members of the given speeds.
pub fn tensor_plan(
    kv_heads: usize,
    intermediate: usize,
    speeds: &[f64],
) -> Result<Vec<TensorShard>, ShardError> {
    let heads = split("kv heads", kv_heads, speeds)?;
    let ffn = split("feed-forward columns", intermediate, speeds)?;
    Ok(heads
        .into_iter()
        .zip(ffn)
        .enumerate()
        .map(|(rank, (kv_heads, ffn))| TensorShard {
            rank,
            ranks: speeds.len(),
            kv_heads,
            ffn,
        })
        .collect())
}

/// The pipeline plan: consecutive layers per member, in proportion to memory.
pub fn pipeline_plan(layers: usize, memory: &[f64]) -> Result<Vec<Range<usize>>, ShardError> {
    split("layers", layers, memory)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn smollm2_three_kv_heads_over_two_equal_ranks_is_two_plus_one() {
        assert_eq!(split("kv heads", 3, &[1.0, 1.0]).unwrap(), vec![0..2, 2..3]);
        assert_eq!(
            split("kv heads", 3, &[1.0, 1.0, 1.0]).unwrap(),
            vec![0..1, 1..2, 2..3]
        );
    }

    #[test]
    fn shares_follow_speed() {
        // A Mac twice as fast gets twice the columns.
        assert_eq!(
            split("ffn", 1536, &[2.0, 1.0]).unwrap(),
            vec![0..1024, 1024..1536]
        );
        let r = split("ffn", 1000, &[3.0, 1.0, 1.0]).unwrap();
        assert_eq!(
            r.iter().map(|r| r.len()).collect::<Vec<_>>(),
            vec![600, 200, 200]
        );
        // Every rank keeps at least one unit however slow it is.
        assert_eq!(
            split("kv heads", 3, &[100.0, 1.0]).unwrap(),
            vec![0..2, 2..3]
        );
    }

    #[test]
    fn ranges_cover_everything_exactly() {
        for total in 1..40 {
            for w in [
                &[1.0][..],
                &[1.0, 2.0],
                &[0.3, 0.3, 0.4],
                &[5.0, 1.0, 1.0, 1.0],
            ] {
                if total < w.len() {
                    continue;
                }
                let r = split("x", total, w).unwrap();
                assert_eq!(r.first().unwrap().start, 0);
                assert_eq!(r.last().unwrap().end, total);
                assert!(r.windows(2).all(|p| p[0].end == p[1].start));
                assert!(r.iter().all(|r| !r.is_empty()));
            }
        }
    }

    #[test]
    fn impossible_splits_are_typed_errors() {
        assert_eq!(
            tensor_plan(3, 1536, &[1.0; 4]),
            Err(ShardError::TooFewUnits {
                what: "kv heads",
                total: 3,
                ranks: 4
            })
        );
        assert_eq!(split("x", 4, &[]), Err(ShardError::Empty));
        assert!(matches!(
            split("x", 4, &[1.0, -1.0]),
            Err(ShardError::BadWeight { rank: 1, .. })
        ));
        assert!(matches!(
            split("x", 4, &[f64::NAN]),
            Err(ShardError::BadWeight { rank: 0, .. })
        ));
    }
}
