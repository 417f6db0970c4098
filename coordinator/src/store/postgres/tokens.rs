//! The token relay's rows on PostgreSQL (see
//! [`crate::store::Store::append_tokens`]), and its wake-ups: a `NOTIFY`
//! on [`TOKENS_CHANNEL`] per job in the writing transaction (delivered at
//! commit, so a woken follower finds the rows), received through sqlx's
//! `PgListener` ([`TokenListener`]).
//!
//! # Failure
//! A notification is a hint: one lost while the listener's connection was
//! down is reported as [`Wakeup::Lost`], and followers poll anyway.

use std::collections::BTreeSet;

use sqlx::{postgres::PgListener, PgConnection, PgPool};

use super::super::{Result, StoreError, Wakeup};

super::super::backend::token_queries!(PgConnection, sqlx::Postgres);

/// The channel the relay's notifications travel on; the payload is a job id.
pub const TOKENS_CHANNEL: &str = "mlxnet_tokens";

/// How long the listener waits after an error before it tries again.
const RETRY: std::time::Duration = std::time::Duration::from_secs(1);

/// Notifies [`TOKENS_CHANNEL`] once per distinct job of `chunks` and `wake`.
pub(super) async fn notify(
    conn: &mut PgConnection,
    chunks: &[RelayChunk],
    wake: &[JobId],
) -> Result<()> {
    let jobs: BTreeSet<String> = chunks
        .iter()
        .map(|c| c.job)
        .chain(wake.iter().copied())
        .map(|j| j.to_string())
        .collect();
    if jobs.is_empty() {
        return Ok(());
    }
    let jobs: Vec<String> = jobs.into_iter().collect();
    sqlx::query("SELECT pg_notify($1, j) FROM unnest($2::text[]) AS j")
        .bind(TOKENS_CHANNEL)
        .bind(&jobs)
        .execute(&mut *conn)
        .await?;
    Ok(())
}

/// A connection listening on [`TOKENS_CHANNEL`].
pub struct TokenListener {
    listener: PgListener,
}

impl std::fmt::Debug for TokenListener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TokenListener")
    }
}

impl TokenListener {
    pub(super) async fn connect(pool: &PgPool) -> Result<Self> {
        let mut listener = PgListener::connect_with(pool).await?;
        listener.listen(TOKENS_CHANNEL).await?;
        Ok(Self { listener })
    }

    /// The next wake-up. A lost connection (reconnected by the next call)
    /// or an error is [`Wakeup::Lost`]: notifications may have been missed.
    pub async fn next(&mut self) -> Wakeup {
        loop {
            match self.listener.try_recv().await {
                Ok(Some(n)) => match n.payload().parse() {
                    Ok(job) => return Wakeup::Job(job),
                    Err(_) => continue,
                },
                Ok(None) => return Wakeup::Lost,
                Err(e) => {
                    tracing::warn!(error = %e, "listening for token notifications failed; retrying");
                    tokio::time::sleep(RETRY).await;
                    return Wakeup::Lost;
                }
            }
        }
    }
}
