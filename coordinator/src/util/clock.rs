//! Where the coordinator reads the time: the wall clock, or a clock the
//! calling thread installed in its place (the deterministic simulator,
//! `mlxnet-sim`, runs the real store and ledger on one thread under a clock
//! that moves only when the simulation says so).
//!
//! # Invariants
//! - With no clock installed, [`crate::util::now_ms`] is the wall clock.
//! - An installed clock is per thread and ends with its [`ClockGuard`], so a
//!   simulated clock never leaks into another thread's coordinator.

use std::{
    cell::RefCell,
    sync::{
        atomic::{AtomicI64, Ordering},
        Arc,
    },
};

/// A source of the time in milliseconds since the Unix epoch.
pub trait Clock: Send + Sync {
    fn now_ms(&self) -> i64;
}

/// The wall clock (0 if it is before the epoch).
#[derive(Clone, Copy, Debug, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now_ms(&self) -> i64 {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis() as i64)
            .unwrap_or(0)
    }
}

/// A clock that moves only when told (the simulator's).
#[derive(Clone, Debug, Default)]
pub struct ManualClock(Arc<AtomicI64>);

impl ManualClock {
    pub fn new(start_ms: i64) -> Self {
        Self(Arc::new(AtomicI64::new(start_ms)))
    }

    /// Moves the clock to `ms`; a clock never goes back, so an earlier `ms`
    /// leaves it where it is.
    pub fn set(&self, ms: i64) {
        self.0.fetch_max(ms, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now_ms(&self) -> i64 {
        self.0.load(Ordering::SeqCst)
    }
}

thread_local! {
    static INSTALLED: RefCell<Option<Arc<dyn Clock>>> = const { RefCell::new(None) };
}

/// Makes `clock` this thread's time until the guard drops (the previous
/// one, if any, comes back then).
pub fn install(clock: Arc<dyn Clock>) -> ClockGuard {
    let previous = INSTALLED.with(|c| c.borrow_mut().replace(clock));
    ClockGuard { previous }
}

/// Ends an [`install`]ed clock when dropped.
#[must_use = "the clock is uninstalled when the guard drops"]
pub struct ClockGuard {
    previous: Option<Arc<dyn Clock>>,
}

impl Drop for ClockGuard {
    fn drop(&mut self) {
        let previous = self.previous.take();
        INSTALLED.with(|c| *c.borrow_mut() = previous);
    }
}

/// This thread's time: its installed clock, else the wall clock.
pub(crate) fn now_ms() -> i64 {
    INSTALLED
        .with(|c| c.borrow().as_ref().map(|c| c.now_ms()))
        .unwrap_or_else(|| SystemClock.now_ms())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_installed_clock_is_this_threads_time_until_its_guard_drops() {
        let clock = ManualClock::new(1_000);
        let wall = SystemClock.now_ms();
        {
            let _guard = install(Arc::new(clock.clone()));
            assert_eq!(crate::util::now_ms(), 1_000);
            clock.set(2_500);
            clock.set(2_000);
            assert_eq!(crate::util::now_ms(), 2_500, "a clock never goes back");
            let other = std::thread::spawn(crate::util::now_ms).join().unwrap();
            assert!(other >= wall, "another thread keeps the wall clock");
        }
        assert!(crate::util::now_ms() >= wall);
    }
}
