//! Small helpers every layer may use: a poison-tolerant lock, an error's
//! whole chain as one line, the clock in milliseconds (the wall clock, or a
//! simulator's: [`clock`]), and the set of background tasks the application
//! waits for on shutdown.
//!
//! # Invariants
//! - Nothing here imports another module of the crate.

pub mod clock;
pub mod net;

use std::sync::{Mutex, MutexGuard};

use tokio::task::JoinSet;

/// Locks `m`. A lock poisoned by a holder that panicked is taken as it is,
/// so one panicked task does not wedge every other user of that state.
pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// `err` and all its sources, joined by ": ".
pub fn error_chain(err: &dyn std::error::Error) -> String {
    let mut out = err.to_string();
    let mut source = err.source();
    while let Some(s) = source {
        out.push_str(": ");
        out.push_str(&s.to_string());
        source = s.source();
    }
    out
}

/// The first `max` characters of `s` (all of it if shorter): for strings a
/// peer sent, before they are stored or logged.
pub fn clip(s: &str, max: usize) -> &str {
    match s.char_indices().nth(max) {
        Some((i, _)) => &s[..i],
        None => s,
    }
}

/// Milliseconds since the Unix epoch (0 if the clock is before it), by
/// this thread's clock (see [`clock`]).
pub fn now_ms() -> i64 {
    clock::now_ms()
}

/// Background tasks the application waits for on shutdown (attempts,
/// audits, node connections, the ledger sweep).
#[derive(Debug, Default)]
pub struct Tasks {
    set: Mutex<JoinSet<()>>,
}

impl Tasks {
    /// Spawns `fut`; finished tasks are reaped on the way.
    pub fn spawn(&self, fut: impl std::future::Future<Output = ()> + Send + 'static) {
        let mut set = lock(&self.set);
        while set.try_join_next().is_some() {}
        set.spawn(fut);
    }

    /// Waits for every task spawned so far (after shutdown was signalled).
    pub async fn join_all(&self) {
        let mut set = std::mem::take(&mut *lock(&self.set));
        while set.join_next().await.is_some() {}
    }
}
