//! A lease on a singleton duty (the ledger's sweep, reward payments): the
//! one replica that may run it now, and the fencing epoch its writes carry.
//!
//! # Invariants
//! - `epoch` grows by one whenever a holder takes a lease it did not hold
//!   (first grant: 1); renewing by the same holder keeps it. So a replica
//!   that lost a lease, even one that does not know it yet, holds a smaller
//!   epoch than the current holder, and a fenced write under it is refused.

/// A lease as granted: who holds it, under which epoch, until when.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Lease {
    /// The duty's name (e.g. `ledger-sweep`).
    pub name: String,
    /// The replica holding it (empty once released).
    pub holder: String,
    /// The fencing epoch.
    pub epoch: i64,
    /// Wall-clock ms after which another replica may take it over.
    pub expires_at_ms: i64,
}

/// The prefix of a replica's liveness lease: `replica/<replica_id>`, held
/// by the replica itself while it runs (see `dispatch::sweep`).
pub const LIVENESS_PREFIX: &str = "replica/";

/// The name of `replica`'s liveness lease.
pub fn liveness_lease(replica: &str) -> String {
    format!("{LIVENESS_PREFIX}{replica}")
}
