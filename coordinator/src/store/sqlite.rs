//! The SQLite store: one file in the data directory, WAL journal, schema from
//! `migrations/sqlite` (embedded at build time).
//!
//! Durability: `synchronous = FULL`, so every commit is fsynced to the WAL
//! before it returns: an answered submit (its hold is money) survives power
//! loss, not only a crash of the process. The ledger's group commit makes
//! that one fsync per batch of submits, not one per submit.
//!
//! Write transactions ([`SqliteStore::write`], and every job transition)
//! begin with `BEGIN IMMEDIATE`, taking SQLite's write lock up front: a
//! deferred transaction that reads before it writes cannot upgrade its read
//! lock while another connection writes, and SQLite answers SQLITE_BUSY at
//! once instead of waiting `busy_timeout` (that lost job completions under
//! concurrent submits). [`StoreTx`] writers also queue on an in-process lock
//! first, so they never meet in SQLite's busy handler (which sleeps for
//! milliseconds).
//!
//! Binary columns hold prost encodings of `JobInput`, `SamplingParams` and
//! `ResultClaim`; the claim's signature sits in its own column.
//!
//! # Layout
//! - [`jobs`]: jobs, attempts and hand-off segments.
//! - [`nodes`]: registered nodes.
//! - [`ledger`]: accounts, transfers, holds, terms, operators, rewards.
//! - [`keys`]: API keys (hashes only).
//! - [`leases`]: the singleton duties' leases and fences.
//! - [`audits`]: audits and node records.

mod audits;
mod jobs;
mod keys;
mod leases;
mod ledger;
mod nodes;
mod tokens;

use std::{
    collections::{HashMap, HashSet},
    str::FromStr,
    sync::Arc,
    time::Duration,
};

use mlxnet_proto::ids::JobId;
use sqlx::{
    sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous},
    SqliteConnection, SqlitePool,
};

use super::{Anomaly, NewKey, OpenHold, PayerBalance, Result, Side, Store, StoreTx, TokenWakeups};
use crate::{
    domain::{
        Account, AttemptEnd, AuditRecord, Availability, CancelOutcome, Completion, JobRecord,
        JobStats, JobTerms, KeyInfo, KeyLimits, Lease, NewJob, NodeEarnings, NodeRecord,
        RecordDelta, RelayChunk, Segment, StoredKey, StreamedEnd, Totals, Transfer,
    },
    util::now_ms,
};

static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("../migrations/sqlite");

/// How every write transaction of the store begins (see the module docs).
const IMMEDIATE: &str = "BEGIN IMMEDIATE";

/// The SQLite database: a pool of four connections.
#[derive(Clone, Debug)]
pub struct SqliteStore {
    pool: SqlitePool,
    /// One [`SqliteTx`] at a time (see the module docs).
    writer: Arc<tokio::sync::Mutex<()>>,
}

/// A write transaction holding the in-process writer lock; commit with
/// [`StoreTx::commit`], drop to roll back.
#[derive(Debug)]
pub struct SqliteTx {
    tx: sqlx::Transaction<'static, sqlx::Sqlite>,
    _writer: tokio::sync::OwnedMutexGuard<()>,
}

impl SqliteStore {
    /// Opens (creating if missing) the database at `url` and applies migrations.
    pub async fn connect(url: &str) -> Result<Self> {
        let options = SqliteConnectOptions::from_str(url)?
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Full)
            .foreign_keys(true)
            .busy_timeout(Duration::from_secs(5));
        let pool = SqlitePoolOptions::new()
            .max_connections(4)
            .connect_with(options)
            .await?;
        MIGRATOR.run(&pool).await?;
        Ok(Self {
            pool,
            writer: Arc::default(),
        })
    }

    /// The connection pool, for the backend's own tests (schema checks).
    #[cfg(test)]
    pub(crate) fn pool(&self) -> &SqlitePool {
        &self.pool
    }

    async fn conn(&self) -> Result<sqlx::pool::PoolConnection<sqlx::Sqlite>> {
        Ok(self.pool.acquire().await?)
    }

    /// A job transition's own transaction (no writer lock: one statement
    /// guards it, see the module docs).
    async fn begin(&self) -> Result<sqlx::Transaction<'static, sqlx::Sqlite>> {
        Ok(self.pool.begin_with(IMMEDIATE).await?)
    }
}

fn conn(tx: &mut SqliteTx) -> &mut SqliteConnection {
    &mut tx.tx
}

impl Store for SqliteStore {
    type Tx = SqliteTx;

    async fn close(&self) {
        self.pool.close().await;
    }

    async fn ping(&self) -> Result<()> {
        sqlx::query("SELECT 1").execute(&self.pool).await?;
        Ok(())
    }

    async fn durability(&self) -> Result<String> {
        let mut conn = self.conn().await?;
        let journal: String = sqlx::query_scalar("PRAGMA journal_mode")
            .fetch_one(&mut *conn)
            .await?;
        let sync: i64 = sqlx::query_scalar("PRAGMA synchronous")
            .fetch_one(&mut *conn)
            .await?;
        let sync = match sync {
            0 => "OFF",
            1 => "NORMAL",
            2 => "FULL",
            3 => "EXTRA",
            _ => "unknown",
        };
        Ok(format!("journal_mode={journal}, synchronous={sync}"))
    }

    async fn write(&self) -> Result<SqliteTx> {
        let writer = Arc::clone(&self.writer).lock_owned().await;
        let tx = self.begin().await?;
        Ok(SqliteTx {
            tx,
            _writer: writer,
        })
    }

    /// One replica: nobody else writes tokens, so nothing wakes.
    async fn token_wakeups(&self) -> Result<TokenWakeups> {
        Ok(TokenWakeups::never())
    }

    super::backend::store_methods!();
}

impl StoreTx for SqliteTx {
    super::backend::tx_methods!();
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::TransferKind;

    /// The schema's triggers keep transfer rows immutable, whatever the
    /// caller (moved from the ledger's
    /// `transfers_are_idempotent_two_phase_and_never_overdraw`).
    #[tokio::test]
    async fn transfer_rows_are_immutable_whatever_the_caller() {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}", dir.path().join("t.db").display());
        let ledger = SqliteStore::connect(&url).await.unwrap();
        let mut tx = ledger.write().await.unwrap();
        tx.insert_transfers(&[Transfer {
            id: "p1".into(),
            kind: TransferKind::Posted,
            debit: "system:treasury".into(),
            credit: "system:fee".into(),
            amount: 5,
            pending_id: None,
            deadline_ms: None,
            job_id: None,
            node_id: None,
            tokens: 0,
            memo: "test".into(),
            created_at_ms: 1,
        }])
        .await
        .unwrap();
        tx.commit().await.unwrap();

        // Rows are immutable, whatever the caller.
        assert!(
            sqlx::query("UPDATE transfers SET amount = 1 WHERE id = 'p1'")
                .execute(ledger.pool())
                .await
                .is_err()
        );
        assert!(sqlx::query("DELETE FROM transfers WHERE id = 'p1'")
            .execute(ledger.pool())
            .await
            .is_err());
    }
}
