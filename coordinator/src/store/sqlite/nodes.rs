//! Registered nodes: one row per node id, online or offline.

use sqlx::SqliteConnection;

use super::super::{rows, Result};
use crate::domain::NodeRecord;

pub(super) async fn upsert(
    conn: &mut SqliteConnection,
    node: &NodeRecord,
    replica: &str,
    now: i64,
) -> Result<()> {
    sqlx::query(
        "INSERT INTO nodes (id, name, hardware, models, version, status, first_seen_ms, last_seen_ms, replica, slots) \
         VALUES (?1, ?2, ?3, ?4, ?5, 'online', ?6, ?6, ?7, ?8) \
         ON CONFLICT (id) DO UPDATE SET name = ?2, hardware = ?3, models = ?4, version = ?5, \
           status = 'online', last_seen_ms = ?6, replica = ?7, slots = ?8",
    )
    .bind(&node.id)
    .bind(&node.name)
    .bind(&node.hardware)
    .bind(&node.models)
    .bind(&node.version)
    .bind(now)
    .bind(replica)
    .bind(i64::from(node.slots))
    .execute(&mut *conn)
    .await?;
    Ok(())
}

pub(super) async fn touch(conn: &mut SqliteConnection, id: &str, now: i64) -> Result<()> {
    sqlx::query("UPDATE nodes SET last_seen_ms = ? WHERE id = ?")
        .bind(now)
        .bind(id)
        .execute(&mut *conn)
        .await?;
    Ok(())
}

pub(super) async fn set_offline(conn: &mut SqliteConnection, id: &str) -> Result<()> {
    sqlx::query("UPDATE nodes SET status = 'offline' WHERE id = ?")
        .bind(id)
        .execute(&mut *conn)
        .await?;
    Ok(())
}

pub(super) async fn all_offline(conn: &mut SqliteConnection) -> Result<()> {
    sqlx::query("UPDATE nodes SET status = 'offline'")
        .execute(&mut *conn)
        .await?;
    Ok(())
}

pub(super) async fn get(
    conn: &mut SqliteConnection,
    id: &str,
) -> Result<Option<(NodeRecord, String)>> {
    let row = sqlx::query(
        "SELECT id, name, hardware, models, version, status, slots FROM nodes WHERE id = ?",
    )
    .bind(id)
    .fetch_optional(&mut *conn)
    .await?;
    row.as_ref().map(rows::node).transpose()
}

pub(super) async fn count(conn: &mut SqliteConnection) -> Result<u64> {
    let n: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM nodes")
        .fetch_one(&mut *conn)
        .await?;
    Ok(n as u64)
}
