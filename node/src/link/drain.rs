//! Node-wide drain state: how a node leaves without losing work.
//!
//! Draining has two steps. First the node stops taking jobs (new job
//! streams are refused as retryable, and the coordinator is told with
//! `Drain`, so it places nothing more here); running jobs go on. When the
//! grace period ends, the node hands off: every running job stops at its
//! next token boundary and returns a partial claim (`finish_reason`
//! "handoff") covering exactly the tokens it streamed, and the coordinator
//! resumes the job on another node after them.
//!
//! A pause of lending (the owner returned, see `crate::policy`) drains the
//! same way, with the shorter `lending.grace_ms`; once the session has
//! ended and lending resumes, the link [`reopen`](DrainState::reopen)s the
//! state and dials again.
//!
//! # Invariants
//! - Within a session both steps only go forward (false -> true); only the
//!   link reopens the state, between sessions, when no job of the last one
//!   is left.
//! - Hand-off implies draining.

use std::sync::atomic::{AtomicBool, Ordering};

/// Shared by the session and every job task of a node.
#[derive(Debug, Default)]
pub struct DrainState {
    draining: AtomicBool,
    handoff: AtomicBool,
}

impl DrainState {
    /// Takes no new jobs from now on.
    pub fn start(&self) {
        self.draining.store(true, Ordering::SeqCst);
    }

    /// Running jobs stop at the next token and hand their work back.
    pub fn hand_off(&self) {
        self.draining.store(true, Ordering::SeqCst);
        self.handoff.store(true, Ordering::SeqCst);
    }

    /// Takes jobs again (between sessions, after a pause).
    pub fn reopen(&self) {
        self.handoff.store(false, Ordering::SeqCst);
        self.draining.store(false, Ordering::SeqCst);
    }

    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::SeqCst)
    }

    pub fn is_handing_off(&self) -> bool {
        self.handoff.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hand_off_implies_draining() {
        let d = DrainState::default();
        assert!(!d.is_draining() && !d.is_handing_off());
        d.start();
        assert!(d.is_draining() && !d.is_handing_off());
        let d = DrainState::default();
        d.hand_off();
        assert!(d.is_draining() && d.is_handing_off());
        d.reopen();
        assert!(!d.is_draining() && !d.is_handing_off());
    }
}
