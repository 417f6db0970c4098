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
