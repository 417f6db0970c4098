//! API keys: only each key's SHA-256 is stored, with its public id,
//! scopes, label, expiry, revocation and own limits.

use sqlx::SqliteConnection;

use super::super::{rows, NewKey, Result};
use crate::domain::{KeyInfo, KeyLimits, StoredKey};

pub(super) async fn insert(conn: &mut SqliteConnection, k: &NewKey) -> Result<()> {
    sqlx::query(
        "INSERT INTO api_keys (id, account_id, hash, scopes, label, created_at_ms, expires_at_ms) \
         VALUES (?, ?, ?, ?, ?, ?, ?)",
    )
    .bind(&k.id)
    .bind(&k.account_id)
    .bind(k.hash.to_vec())
    .bind(k.scopes.names().join(","))
    .bind(&k.label)
    .bind(k.created_at_ms)
    .bind(k.expires_at_ms)
    .execute(&mut *conn)
    .await?;
    Ok(())
}

pub(super) async fn by_hash(
    conn: &mut SqliteConnection,
    hash: &[u8; 32],
    now_ms: i64,
) -> Result<Option<StoredKey>> {
    let row = sqlx::query(
        "SELECT id, account_id, scopes, expires_at_ms, max_requests_per_sec, max_in_flight \
         FROM api_keys WHERE hash = ? AND revoked_at_ms IS NULL \
         AND (expires_at_ms IS NULL OR expires_at_ms > ?)",
    )
    .bind(hash.to_vec())
    .bind(now_ms)
    .fetch_optional(&mut *conn)
    .await?;
    row.as_ref().map(rows::stored_key).transpose()
}

pub(super) async fn set_limits(
    conn: &mut SqliteConnection,
    key_id: &str,
    limits: KeyLimits,
) -> Result<bool> {
    let n =
        sqlx::query("UPDATE api_keys SET max_requests_per_sec = ?, max_in_flight = ? WHERE id = ?")
            .bind(limits.requests_per_sec.map(i64::from))
            .bind(limits.max_in_flight.map(i64::from))
            .bind(key_id)
            .execute(&mut *conn)
            .await?
            .rows_affected();
    Ok(n == 1)
}

pub(super) async fn revoke(
    conn: &mut SqliteConnection,
    key_id: &str,
    account: Option<&str>,
    now_ms: i64,
) -> Result<bool> {
    let n = sqlx::query(
        "UPDATE api_keys SET revoked_at_ms = ?1 WHERE id = ?2 AND revoked_at_ms IS NULL \
         AND (?3 IS NULL OR account_id = ?3)",
    )
    .bind(now_ms)
    .bind(key_id)
    .bind(account)
    .execute(&mut *conn)
    .await?
    .rows_affected();
    Ok(n == 1)
}

pub(super) async fn list(conn: &mut SqliteConnection, account: &str) -> Result<Vec<KeyInfo>> {
    let rows = sqlx::query(
        "SELECT id, account_id, scopes, label, created_at_ms, expires_at_ms, revoked_at_ms \
         FROM api_keys WHERE account_id = ? ORDER BY created_at_ms DESC, id",
    )
    .bind(account)
    .fetch_all(&mut *conn)
    .await?;
    rows.iter().map(rows::key_info).collect()
}
