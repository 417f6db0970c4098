//! Nodes: the row a node's registration leaves, its audit record, and the
//! online time a dedicated node is rewarded for.

/// A node as it registered.
#[derive(Clone, Debug, PartialEq)]
pub struct NodeRecord {
    pub id: String,
    pub name: String,
    /// JSON of the hardware profile.
    pub hardware: String,
    /// JSON of the cached models.
    pub models: String,
    pub version: String,
    /// Jobs it runs at once (its Hello's `max_concurrent_jobs`, at least
    /// 1): the store books no more onto it. 0: no bound (a record that
    /// does not say).
    pub slots: u32,
}

/// A node's record, built from verified work only: how many of its
/// audited jobs passed and failed, whether it is banned from placement,
/// and (the reputation `audit` reads) the jobs it completed under a
/// verified claim, its failed attempts, and its verdicts as an auditor
/// that the audit's decision went against.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AuditRecord {
    pub clean: u32,
    pub failed: u32,
    pub banned: bool,
    /// Jobs completed under a claim the coordinator verified.
    pub jobs: u32,
    /// Attempts that ended failed (or vanished) on this node.
    pub failed_attempts: u32,
    /// Verdicts it gave as an auditor on the losing side of a decision.
    pub wrong_verdicts: u32,
}

/// What to add to a node's [`AuditRecord`] (one write).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RecordDelta {
    pub clean: u32,
    pub failed: u32,
    pub jobs: u32,
    pub failed_attempts: u32,
    pub wrong_verdicts: u32,
}

/// One node's availability in a reward epoch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Availability {
    pub node_id: String,
    pub memory_bytes: u64,
    pub online_ms: u64,
}
