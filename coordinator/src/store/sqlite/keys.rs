//! API keys: only each key's SHA-256 is stored, with its public id,
//! scopes, label, expiry, revocation and own limits.

use sqlx::{Row, SqliteConnection};

use super::super::{NewKey, Result, StoreError};
use crate::domain::{Caller, KeyInfo, KeyLimits, Scopes, StoredKey};

fn scopes(key: &str, text: &str) -> Result<Scopes> {
    Scopes::from_text(text).map_err(|e| StoreError::Corrupt {
        id: format!("key {key}"),
        what: e.to_string(),
    })
}

fn limit(v: Option<i64>) -> Option<u32> {
    v.map(|n| u32::try_from(n.max(0)).unwrap_or(u32::MAX))
}

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
    let Some(r) = row else { return Ok(None) };
    let id: String = r.try_get("id")?;
    let text: String = r.try_get("scopes")?;
    Ok(Some(StoredKey {
        caller: Caller {
            account_id: r.try_get("account_id")?,
            scopes: scopes(&id, &text)?,
            limits: KeyLimits {
                requests_per_sec: limit(r.try_get("max_requests_per_sec")?),
                max_in_flight: limit(r.try_get("max_in_flight")?),
            },
            key_id: id,
        },
        expires_at_ms: r.try_get("expires_at_ms")?,
    }))
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
    rows.iter()
        .map(|r| {
            let id: String = r.try_get("id")?;
            let text: String = r.try_get("scopes")?;
            Ok(KeyInfo {
                scopes: scopes(&id, &text)?,
                id,
                account_id: r.try_get("account_id")?,
                label: r.try_get("label")?,
                created_at_ms: r.try_get("created_at_ms")?,
                expires_at_ms: r.try_get("expires_at_ms")?,
                revoked_at_ms: r.try_get("revoked_at_ms")?,
            })
        })
        .collect()
}
