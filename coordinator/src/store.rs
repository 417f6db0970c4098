//! Persistent state: nodes that have registered and jobs with their attempts.
//!
//! One implementation exists today ([`sqlite::SqliteStore`], exported as
//! [`Store`]); the Postgres backend will turn this into a trait with a shared
//! conformance suite. Handlers never see SQL: they call the operations here.
//!
//! # Invariants
//! - Every state transition is one statement (or one transaction whose first
//!   statement is the guarded write) with a `WHERE` on the expected current
//!   state, attempt and node, so a duplicate, late or foreign result changes
//!   nothing and reports `false` / `None`.
//! - A completed job always has its claim and signature stored with it.
//! - Attempts are bounded: a failed attempt requeues with `attempt + 1` only
//!   while `attempt < max_attempts`, else the job fails for good.
//!
//! # Failure
//! [`StoreError`]: database errors (kept as the source, never shown to clients)
//! and rows that do not decode (a corrupt or foreign database).

pub mod segments;
pub mod sqlite;

use mlxnet_proto::{
    ids::JobId,
    v1::{JobInput, SamplingParams, SignedClaim},
};

use crate::jobs::JobState;

pub use sqlite::SqliteStore as Store;

/// Why a store operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    #[error("database error")]
    Database(#[from] sqlx::Error),
    #[error("database migration failed")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    #[error("stored row of job {id} does not decode: {what}")]
    Corrupt { id: String, what: String },
}

/// A job as stored.
#[derive(Clone, Debug, PartialEq)]
pub struct JobRecord {
    pub id: JobId,
    pub model: String,
    pub input: JobInput,
    pub sampling: SamplingParams,
    /// 0..=3: orders the account's own queued jobs (see `scheduler::queue`).
    pub priority: u8,
    pub state: JobState,
    /// The current attempt (1-based); a requeue increments it.
    pub attempt: u32,
    /// Node of the current or last attempt (hex public key).
    pub node_id: Option<String>,
    pub output_text: String,
    pub completion_tokens: u32,
    /// The verified signed claim, once completed.
    pub result: Option<SignedClaim>,
    pub error: Option<String>,
    pub created_at_ms: i64,
    pub updated_at_ms: i64,
}

/// A job to insert (state `queued`, attempt 1).
#[derive(Clone, Debug)]
pub struct NewJob {
    pub id: JobId,
    pub model: String,
    pub input: JobInput,
    /// Seed already chosen.
    pub sampling: SamplingParams,
    /// 0..=3, checked at the API.
    pub priority: u8,
}

/// A verified result to record.
#[derive(Clone, Debug)]
pub struct Completion {
    pub job_id: JobId,
    pub attempt: u32,
    pub node_id: String,
    pub result: SignedClaim,
}

/// What happened to a job whose attempt failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttemptEnd {
    /// Back in the queue as this attempt.
    Requeued { attempt: u32 },
    /// Failed for good.
    Failed,
}

/// What a cancel did.
#[derive(Clone, Debug, PartialEq)]
pub enum CancelOutcome {
    NotFound,
    /// Already completed, failed or cancelled; nothing changed.
    AlreadyFinished(JobState),
    Cancelled,
}

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

/// Counts over all jobs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct JobStats {
    pub queued: u64,
    pub running: u64,
    pub completed: u64,
    pub failed: u64,
    pub cancelled: u64,
    /// Completion tokens of all completed jobs.
    pub tokens_generated: u64,
}

pub(crate) fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}
