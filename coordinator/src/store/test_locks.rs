//! Test helpers on a PostgreSQL test database that make the store's own
//! queries wait for sure, not by load: a table held under an exclusive
//! lock by a connection of the test's, and how many sessions wait on a
//! lock. Here because only the store names `sqlx` (see `layering_tests`).
//!
//! # Failure
//! Database errors as [`StoreError`]; the lock ends with the connection.

use sqlx::{Connection, PgConnection, Row};

use super::StoreError;

/// An exclusive lock on a table, held until [`HeldLock::release`] or drop.
pub(crate) struct HeldLock(PgConnection);

/// Locks `table` of the database at `url` (ACCESS EXCLUSIVE: every read
/// of it waits).
pub(crate) async fn lock_table(url: &str, table: &str) -> Result<HeldLock, StoreError> {
    let mut conn = PgConnection::connect(url).await?;
    sqlx::query("BEGIN").execute(&mut conn).await?;
    sqlx::query(&format!("LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE"))
        .execute(&mut conn)
        .await?;
    Ok(HeldLock(conn))
}

impl HeldLock {
    /// Ends the lock.
    pub(crate) async fn release(mut self) -> Result<(), StoreError> {
        sqlx::query("ROLLBACK").execute(&mut self.0).await?;
        Ok(())
    }
}

/// Sessions of the database at `url` waiting on a lock now.
pub(crate) async fn lock_waiters(url: &str) -> Result<i64, StoreError> {
    let mut conn = PgConnection::connect(url).await?;
    let row = sqlx::query(
        "SELECT count(*) AS n FROM pg_stat_activity \
         WHERE datname = current_database() AND wait_event_type = 'Lock'",
    )
    .fetch_one(&mut conn)
    .await?;
    Ok(row.try_get("n")?)
}
