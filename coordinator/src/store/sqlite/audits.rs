//! Audits (one per audited job: pending, then passed, failed or missed) and
//! each node's audit record (clean and failed counts, ban).

use sqlx::SqliteConnection;

use super::super::{rows, Result};
use crate::domain::AuditRecord;

pub(super) async fn banned(conn: &mut SqliteConnection) -> Result<Vec<String>> {
    Ok(
        sqlx::query_scalar("SELECT node_id FROM node_records WHERE banned_at_ms IS NOT NULL")
            .fetch_all(&mut *conn)
            .await?,
    )
}

pub(super) async fn record(conn: &mut SqliteConnection, node: &str) -> Result<AuditRecord> {
    let row = sqlx::query(
        "SELECT clean_audits, failed_audits, banned_at_ms FROM node_records WHERE node_id = ?",
    )
    .bind(node)
    .fetch_optional(&mut *conn)
    .await?;
    rows::audit_record(row.as_ref())
}

pub(super) async fn begin(
    conn: &mut SqliteConnection,
    job: &str,
    node: &str,
    now_ms: i64,
) -> Result<bool> {
    let done = sqlx::query(
        "INSERT OR IGNORE INTO audits (job_id, node_id, state, created_at_ms) \
         VALUES (?, ?, 'pending', ?)",
    )
    .bind(job)
    .bind(node)
    .bind(now_ms)
    .execute(&mut *conn)
    .await?;
    Ok(done.rows_affected() == 1)
}

pub(super) async fn end(
    conn: &mut SqliteConnection,
    job: &str,
    passed: bool,
    auditor: &str,
    verdict: &[u8],
    now_ms: i64,
) -> Result<Option<String>> {
    Ok(sqlx::query_scalar(
        "UPDATE audits SET state = ?, auditor = ?, verdict = ?, ended_at_ms = ? \
         WHERE job_id = ? AND state = 'pending' RETURNING node_id",
    )
    .bind(if passed { "passed" } else { "failed" })
    .bind(auditor)
    .bind(verdict)
    .bind(now_ms)
    .bind(job)
    .fetch_optional(&mut *conn)
    .await?)
}

pub(super) async fn count(conn: &mut SqliteConnection, node: &str, passed: bool) -> Result<()> {
    let (clean, failed) = if passed { (1, 0) } else { (0, 1) };
    sqlx::query(
        "INSERT INTO node_records (node_id, clean_audits, failed_audits) VALUES (?1, ?2, ?3) \
         ON CONFLICT (node_id) DO UPDATE SET clean_audits = clean_audits + ?2, \
         failed_audits = failed_audits + ?3",
    )
    .bind(node)
    .bind(clean)
    .bind(failed)
    .execute(&mut *conn)
    .await?;
    Ok(())
}

pub(super) async fn ban(conn: &mut SqliteConnection, node: &str, now_ms: i64) -> Result<()> {
    sqlx::query(
        "UPDATE node_records SET banned_at_ms = ? WHERE node_id = ? AND banned_at_ms IS NULL",
    )
    .bind(now_ms)
    .bind(node)
    .execute(&mut *conn)
    .await?;
    Ok(())
}

pub(super) async fn miss(conn: &mut SqliteConnection, job: &str, now_ms: i64) -> Result<()> {
    sqlx::query(
        "UPDATE audits SET state = 'missed', ended_at_ms = ? WHERE job_id = ? AND state = 'pending'",
    )
    .bind(now_ms)
    .bind(job)
    .execute(&mut *conn)
    .await?;
    Ok(())
}

pub(super) async fn state(conn: &mut SqliteConnection, job: &str) -> Result<Option<String>> {
    Ok(
        sqlx::query_scalar("SELECT state FROM audits WHERE job_id = ?")
            .bind(job)
            .fetch_optional(&mut *conn)
            .await?,
    )
}
