//! Pods: a few Macs joined by cables that take one job as one unit.
//!
//! What lives here: the pod's membership file ([`hostfile`], MLX's hostfile
//! JSON and JACCL's bare device matrix, read unchanged), the sharding plan
//! that splits one model across the members ([`shard`]; the split model
//! itself is `engine::sharded`), forming the TCP data plane from the config
//! and measuring each link ([`links`]), each member's speed for its share
//! ([`speed`]), the running pod that serves jobs
//! ([`runtime`]), `mlx-node doctor` ([`doctor`]), and `mlx-node pod setup`
//! ([`setup`]: discovery over mDNS, cabling, the hostfile).
//!
//! # Invariants
//! - A [`hostfile::PodConfig`] that parsed has one host per rank, and every
//!   RDMA device row has one entry per rank with `null` on the diagonal.
//!   Topology checks (mesh / ring / symmetry / known devices) are separate
//!   pure functions, so a config can be read first and judged against the
//!   links actually present later (`mlx-node doctor`).
//!
//! # Failure
//! [`hostfile::PodConfigError`] names the rank pair or device at fault.

pub mod dataplane;
pub mod doctor;
pub mod hostfile;
pub mod links;
pub mod runtime;
pub mod setup;
pub mod shard;
pub mod speed;
