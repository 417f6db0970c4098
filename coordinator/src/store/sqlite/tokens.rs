//! The token relay's rows on SQLite (see
//! [`crate::store::Store::append_tokens`]). SQLite serves one replica, so
//! there is nobody to wake: `notify` does nothing, and followers poll.

use sqlx::SqliteConnection;

use super::super::{Result, StoreError};

super::super::backend::token_queries!(SqliteConnection, sqlx::Sqlite);

/// Nothing to wake: every follower is in this process (see the module docs).
pub(super) async fn notify(
    _conn: &mut SqliteConnection,
    _chunks: &[RelayChunk],
    _wake: &[JobId],
) -> Result<()> {
    Ok(())
}
