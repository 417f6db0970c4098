//! The coordinator's domain values: what a job, an attempt, a node, an
//! account, a transfer, a price and an API key are, independent of where
//! they are stored or how they travel. Every layer speaks in these types.
//!
//! # Layout
//! - [`job`]: job states and records, attempts, hand-off segments, and the
//!   client-API view of a job.
//! - [`node`]: a node's registration row, its audit record, its availability.
//! - [`money`]: accounts, transfers, prices and a job's payment terms
//!   (integer micro-MLX; 1 MLX = 1,000,000 micro-MLX).
//! - [`key`]: API key scopes, limits and the authenticated caller.
//! - [`lease`]: a singleton duty's lease and its fencing epoch.
//!
//! # Invariants
//! - Nothing here imports another module of the crate; nothing here does I/O.

pub mod job;
pub mod key;
pub mod lease;
pub mod money;
pub mod node;

pub use job::{
    AttemptEnd, CancelOutcome, Completion, JobRecord, JobState, JobStats, NewJob, RelayChunk,
    Segment, Streamed, StreamedEnd, UnknownState,
};
pub use key::{Caller, InvalidScopes, KeyInfo, KeyLimits, Scope, Scopes, StoredKey};
pub use lease::{liveness_lease, Lease, LIVENESS_PREFIX};
pub use money::{
    hold_id, Account, AccountKind, Applied, JobTerms, NewTransfer, NodeEarnings, Price, Totals,
    Transfer, TransferKind,
};
pub use node::{AuditRecord, Availability, NodeRecord, RecordDelta};
