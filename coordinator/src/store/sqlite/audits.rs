//! Audits (one per audited job: pending, then passed, failed or missed) and
//! each node's audit record (clean and failed counts, ban).

use sqlx::SqliteConnection;

use super::super::{rows, Result};
use crate::domain::{AuditRecord, RecordDelta};

pub(super) async fn banned(conn: &mut SqliteConnection) -> Result<Vec<String>> {
    Ok(
        sqlx::query_scalar("SELECT node_id FROM node_records WHERE banned_at_ms IS NOT NULL")
            .fetch_all(&mut *conn)
            .await?,
    )
}

pub(super) async fn record(conn: &mut SqliteConnection, node: &str) -> Result<AuditRecord> {
    let row = sqlx::query(&format!(
        "SELECT {} FROM node_records WHERE node_id = ?",
        rows::RECORD_COLUMNS
    ))
    .bind(node)
    .fetch_optional(&mut *conn)
    .await?;
    rows::audit_record(row.as_ref())
}

pub(super) async fn records(conn: &mut SqliteConnection) -> Result<Vec<(String, AuditRecord)>> {
    let found = sqlx::query(&format!(
        "SELECT node_id, {} FROM node_records ORDER BY node_id",
        rows::RECORD_COLUMNS
    ))
    .fetch_all(&mut *conn)
    .await?;
    found.iter().map(rows::node_audit_record).collect()
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

pub(super) async fn count(
    conn: &mut SqliteConnection,
    node: &str,
    delta: &RecordDelta,
) -> Result<()> {
    sqlx::query(
        "INSERT INTO node_records (node_id, clean_audits, failed_audits, jobs_done, \
         failed_attempts, wrong_verdicts) VALUES (?1, ?2, ?3, ?4, ?5, ?6) \
         ON CONFLICT (node_id) DO UPDATE SET clean_audits = clean_audits + ?2, \
         failed_audits = failed_audits + ?3, jobs_done = jobs_done + ?4, \
         failed_attempts = failed_attempts + ?5, wrong_verdicts = wrong_verdicts + ?6",
    )
    .bind(node)
    .bind(i64::from(delta.clean))
    .bind(i64::from(delta.failed))
    .bind(i64::from(delta.jobs))
    .bind(i64::from(delta.failed_attempts))
    .bind(i64::from(delta.wrong_verdicts))
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
