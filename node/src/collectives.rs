//! Collective operations among the members of a pod: all-reduce (sum),
//! all-gather, broadcast, send/recv and barrier.
//!
//! One trait, [`Collective`], implemented once by [`Group`] over a
//! [`Transport`] (how bytes move). The algorithms live in [`Group`]: a direct
//! mesh exchange for small messages (one round trip: every rank sends its
//! buffer to every other and sums in rank order) and a ring reduce-scatter +
//! all-gather for large ones (each rank moves `2 (n-1)/n` of the buffer).
//! Transports:
//! - [`tcp`]: TCP sockets, `TCP_NODELAY`, non-blocking with a short spin
//!   then `poll`, full duplex; the data plane without RDMA.
//! - [`verbs`]: the RDMA transport, written against a small verbs interface
//!   ([`verbs::Verbs`]: registered frame slots, posted sends and receives,
//!   completion polling, a side channel for peer liveness). Its backends are
//!   [`fabric`], an in-memory emulated fabric with those semantics (so the
//!   RDMA algorithm runs in tests here), and [`ibverbs`], the device (the
//!   system verbs library, loaded at run time).
//!
//! # Invariants
//! - Every rank issues the same operations in the same order with the same
//!   sizes; every message carries the operation's sequence number, kind and
//!   length, so a mismatch is [`CollectiveError::Mismatch`], not a hang or
//!   garbage.
//! - All ranks end an all-reduce with bit-identical buffers (one summation
//!   order per element, decided by the algorithm, not by arrival order).
//! - No allocation per call once scratch has grown to the largest message.
//!
//! # Failure
//! A lost peer (closed connection, dead side channel) or one that makes no
//! progress for the configured timeout fails the operation with
//! [`CollectiveError::PeerLost`] / [`CollectiveError::Timeout`] and poisons the
//! group: its connections are shut down so the other members fail fast too,
//! and every later call returns [`CollectiveError::Poisoned`]. Nothing here
//! retries.

use std::time::Duration;

use half::{bf16, f16};

pub mod fabric;
mod group;
#[allow(
    unsafe_code,
    reason = "the RDMA binding: FFI to libibverbs, loaded at run time"
)]
pub mod ibverbs;
pub mod stripe;
pub mod tcp;
pub mod verbs;

#[cfg(test)]
mod auth_tests;
#[cfg(test)]
pub(crate) mod tests;

pub use group::{Group, GroupOptions};

/// Largest pod the collectives handle (stack arrays are sized by it).
pub const MAX_RANKS: usize = 16;

/// Element type of an all-reduce.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DType {
    F32,
    F16,
    BF16,
}

impl DType {
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
        }
    }
}

/// What a collective failed with.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CollectiveError {
    #[error("lost pod member {peer}: {reason}")]
    PeerLost { peer: usize, reason: String },
    #[error("pod member {peer} made no progress for {timeout:?}")]
    Timeout { peer: usize, timeout: Duration },
    #[error(
        "pod member {peer} is out of step: expected {expected}, got {got} \
         (members must issue the same operations in the same order)"
    )]
    Mismatch {
        peer: usize,
        expected: String,
        got: String,
    },
    #[error("the group failed earlier and can no longer be used")]
    Poisoned,
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    #[error("pod of {0} members is larger than the {MAX_RANKS} supported")]
    TooManyRanks(usize),
    #[error("connecting the pod failed: {0}")]
    Connect(String),
    #[error("rdma is unavailable: {0}")]
    RdmaUnavailable(String),
    #[error("rdma is unavailable: {0}")]
    Rdma(#[from] ibverbs::RdmaError),
    #[error("rdma work request failed: {0}")]
    Verbs(String),
    /// One queue pair to `peer` failed (a failed work completion, a lost
    /// frame); a striped link carries on over its other lanes.
    #[error("the rdma link to pod member {peer} failed: {reason}")]
    Link { peer: usize, reason: String },
}

/// The operations every pod member runs in lockstep.
///
/// Byte buffers: an all-reduce's buffer holds little-endian elements of its
/// [`DType`]; all-gather's output is `size() * input.len()` bytes in rank
/// order. Use [`all_reduce`] for typed slices.
pub trait Collective: Send {
    fn rank(&self) -> usize;
    fn size(&self) -> usize;
    /// In place: every rank's `data` becomes the element-wise sum over ranks.
    fn all_reduce_sum(&mut self, data: &mut [u8], dtype: DType) -> Result<(), CollectiveError>;
    fn all_gather(&mut self, input: &[u8], output: &mut [u8]) -> Result<(), CollectiveError>;
    /// `root`'s `data` is copied into every rank's `data` (same length everywhere).
    fn broadcast(&mut self, data: &mut [u8], root: usize) -> Result<(), CollectiveError>;
    fn send(&mut self, data: &[u8], to: usize) -> Result<(), CollectiveError>;
    fn recv(&mut self, data: &mut [u8], from: usize) -> Result<(), CollectiveError>;
    fn barrier(&mut self) -> Result<(), CollectiveError>;
}

/// Element types an all-reduce sums.
pub trait Element: bytemuck::Pod + Send + Sync {
    const DTYPE: DType;
    fn to_f32(self) -> f32;
    fn from_f32(v: f32) -> Self;
}

impl Element for f32 {
    const DTYPE: DType = DType::F32;
    fn to_f32(self) -> f32 {
        self
    }
    fn from_f32(v: f32) -> Self {
        v
    }
}

impl Element for f16 {
    const DTYPE: DType = DType::F16;
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    fn from_f32(v: f32) -> Self {
        f16::from_f32(v)
    }
}

impl Element for bf16 {
    const DTYPE: DType = DType::BF16;
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    fn from_f32(v: f32) -> Self {
        bf16::from_f32(v)
    }
}

/// Bytes of one rank's report in [`first_failure`]: a flag and the reason,
/// cut to fit.
const REPORT: usize = 256;

/// Every rank learns whether every rank's own step failed (`mine`: this
/// rank's error, if any): the first failed rank and its reason, the same on
/// every rank, so a pod decides together. One all-gather.
pub fn first_failure(
    c: &mut (impl Collective + ?Sized),
    mine: Option<&dyn std::fmt::Display>,
) -> Result<Option<(usize, String)>, CollectiveError> {
    let n = c.size();
    let mut report = [0u8; REPORT];
    if let Some(e) = mine {
        report[0] = 1;
        let msg = e.to_string();
        let mut len = msg.len().min(REPORT - 1);
        while !msg.is_char_boundary(len) {
            len -= 1;
        }
        report[1..1 + len].copy_from_slice(&msg.as_bytes()[..len]);
    }
    let mut all = vec![0u8; REPORT * n];
    c.all_gather(&report, &mut all)?;
    Ok((0..n).find(|&r| all[r * REPORT] != 0).map(|r| {
        let text = &all[r * REPORT + 1..(r + 1) * REPORT];
        let end = text.iter().position(|&b| b == 0).unwrap_or(text.len());
        (r, String::from_utf8_lossy(&text[..end]).into_owned())
    }))
}

/// Typed all-reduce sum.
pub fn all_reduce<T: Element>(
    c: &mut (impl Collective + ?Sized),
    data: &mut [T],
) -> Result<(), CollectiveError> {
    c.all_reduce_sum(bytemuck::cast_slice_mut(data), T::DTYPE)
}
