//! Reconnect delays: exponential from `min` to `max`, with jitter so a
//! coordinator restart is not met by every node at the same instant.
//!
//! # Invariants
//! - Every delay lies in `[min/2, max]`; the ceiling doubles per failure
//!   until it reaches `max`, and [`Backoff::reset`] (after a successful
//!   registration) brings it back to `min`.
//! - Randomness comes from a generator the caller seeds (tests seed it).

use std::time::Duration;

use rand::{Rng, RngCore};

/// Exponential backoff with "equal jitter": half the ceiling, plus a random
/// part of the other half.
#[derive(Debug)]
pub struct Backoff<R> {
    min: Duration,
    max: Duration,
    ceiling: Duration,
    rng: R,
}

impl<R: RngCore> Backoff<R> {
    pub fn new(min: Duration, max: Duration, rng: R) -> Self {
        let min = min.max(Duration::from_millis(1));
        let max = max.max(min);
        Self {
            min,
            max,
            ceiling: min,
            rng,
        }
    }

    /// The next delay to wait before dialing again.
    pub fn next_delay(&mut self) -> Duration {
        let ceiling = self.ceiling;
        self.ceiling = (self.ceiling * 2).min(self.max);
        let half = ceiling / 2;
        let jitter_ms = self.rng.gen_range(0..=(ceiling - half).as_millis() as u64);
        half + Duration::from_millis(jitter_ms)
    }

    /// Back to the shortest delay (the link worked).
    pub fn reset(&mut self) {
        self.ceiling = self.min;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{rngs::StdRng, SeedableRng};

    #[test]
    fn delays_grow_to_the_cap_stay_in_bounds_and_reset() {
        let min = Duration::from_millis(100);
        let max = Duration::from_millis(1_000);
        let mut b = Backoff::new(min, max, StdRng::seed_from_u64(7));
        let delays: Vec<Duration> = (0..10).map(|_| b.next_delay()).collect();
        for d in &delays {
            assert!(*d >= min / 2 && *d <= max, "{d:?}");
        }
        // Ceilings 100, 200, 400, 800, then 1000: late delays are at least 500 ms.
        assert!(delays[0] <= min);
        assert!(delays[5..].iter().all(|d| *d >= max / 2), "{delays:?}");
        // Jitter: not all the same.
        assert!(delays[5..].windows(2).any(|w| w[0] != w[1]), "{delays:?}");
        b.reset();
        assert!(b.next_delay() <= min);
    }
}
