//! Wire types of mlx-network and the few helpers every side shares.
//!
//! # Layout
//! - [`v1`]: generated prost/tonic types of package `mlxnet.v1` (client API
//!   services, node-link frames, the result claim).
//! - [`catalogue`]: the model catalogue as data (TOML): ids, licenses,
//!   memory figures, files pinned by SHA-256 with their mirrors.
//! - [`chips`]: the Apple silicon chip table (memory bandwidth, GPU cores,
//!   compute, Thunderbolt 5), used by the node's profile and the scheduler.
//! - [`ids`]: [`ids::NodeId`] (an ed25519 public key) and [`ids::JobId`].
//! - [`claim`]: canonical bytes of a result claim and of a job's input, and
//!   claim signature verification.
//! - [`grammar`]: structured output's grammar (`response_format`), its
//!   digest, and (feature `grammar`) its compilation by `llguidance`.
//! - [`auth`]: the node-link handshake transcript bound to the TLS session.
//! - [`frame`]: length-prefixed prost frames with a hard size cap.
//! - [`bearer`]: the `authorization: Bearer <key>` interceptor every client
//!   of the API uses.
//! - [`money`]: micro-MLX amounts as people read them (`mlx`).
//! - [`env`]: configuration from `PREFIX__SECTION__KEY` environment
//!   variables, the same for every binary.
//!
//! Nothing here does I/O beyond reading and writing frames on a stream the
//! caller owns.
#![forbid(unsafe_code)]

pub mod auth;
pub mod bearer;
pub mod catalogue;
pub mod chips;
pub mod claim;
pub mod env;
pub mod frame;
pub mod grammar;
pub mod ids;
pub mod money;

/// Generated types of package `mlxnet.v1`.
#[allow(clippy::all, missing_docs)]
pub mod v1 {
    tonic::include_proto!("mlxnet.v1");

    /// Encoded `FileDescriptorSet` of every mlxnet .proto, for gRPC reflection.
    pub const FILE_DESCRIPTOR_SET: &[u8] =
        include_bytes!(concat!(env!("OUT_DIR"), "/mlxnet_descriptor.bin"));
}
