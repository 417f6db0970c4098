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
}

/// A node's audit record: how many of its audited jobs passed and failed,
/// and whether it is banned from placement.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AuditRecord {
    pub clean: u32,
    pub failed: u32,
    pub banned: bool,
}

/// One node's availability in a reward epoch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Availability {
    pub node_id: String,
    pub memory_bytes: u64,
    pub online_ms: u64,
}
