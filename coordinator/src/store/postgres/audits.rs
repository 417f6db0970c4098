//! Audits and each node's audit record on PostgreSQL.

use sqlx::PgConnection;

use super::super::{rows, Result};
use crate::domain::{AuditRecord, RecordDelta};

pub(super) async fn banned(conn: &mut PgConnection) -> Result<Vec<String>> {
    Ok(
        sqlx::query_scalar("SELECT node_id FROM node_records WHERE banned_at_ms IS NOT NULL")
            .fetch_all(&mut *conn)
            .await?,
    )
}

pub(super) async fn record(conn: &mut PgConnection, node: &str) -> Result<AuditRecord> {
    let row = sqlx::query(&format!(
        "SELECT {} FROM node_records WHERE node_id = $1",
        rows::RECORD_COLUMNS
    ))
    .bind(node)
    .fetch_optional(&mut *conn)
    .await?;
    rows::audit_record(row.as_ref())
}

pub(super) async fn records(conn: &mut PgConnection) -> Result<Vec<(String, AuditRecord)>> {
    let found = sqlx::query(&format!(
        "SELECT node_id, {} FROM node_records ORDER BY node_id",
        rows::RECORD_COLUMNS
    ))
    .fetch_all(&mut *conn)
    .await?;
    found.iter().map(rows::node_audit_record).collect()
}

pub(super) async fn begin(
    conn: &mut PgConnection,
    job: &str,
    node: &str,
    now_ms: i64,
) -> Result<bool> {
    let done = sqlx::query(
        "INSERT INTO audits (job_id, node_id, state, created_at_ms) \
         VALUES ($1, $2, 'pending', $3) ON CONFLICT (job_id) DO NOTHING",
    )
    .bind(job)
    .bind(node)
    .bind(now_ms)
    .execute(&mut *conn)
    .await?;
    Ok(done.rows_affected() == 1)
}

pub(super) async fn end(
    conn: &mut PgConnection,
    job: &str,
    passed: bool,
    auditor: &str,
    verdict: &[u8],
    now_ms: i64,
) -> Result<Option<String>> {
    Ok(sqlx::query_scalar(
        "UPDATE audits SET state = $1, auditor = $2, verdict = $3, ended_at_ms = $4 \
         WHERE job_id = $5 AND state = 'pending' RETURNING node_id",
    )
    .bind(if passed { "passed" } else { "failed" })
    .bind(auditor)
    .bind(verdict)
    .bind(now_ms)
    .bind(job)
    .fetch_optional(&mut *conn)
    .await?)
}

pub(super) async fn count(conn: &mut PgConnection, node: &str, delta: &RecordDelta) -> Result<()> {
    sqlx::query(
        "INSERT INTO node_records (node_id, clean_audits, failed_audits, jobs_done, \
         failed_attempts, wrong_verdicts) VALUES ($1, $2, $3, $4, $5, $6) \
         ON CONFLICT (node_id) DO UPDATE SET \
         clean_audits = node_records.clean_audits + $2, \
         failed_audits = node_records.failed_audits + $3, \
         jobs_done = node_records.jobs_done + $4, \
         failed_attempts = node_records.failed_attempts + $5, \
         wrong_verdicts = node_records.wrong_verdicts + $6",
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

pub(super) async fn ban(conn: &mut PgConnection, node: &str, now_ms: i64) -> Result<()> {
    sqlx::query(
        "UPDATE node_records SET banned_at_ms = $1 WHERE node_id = $2 AND banned_at_ms IS NULL",
    )
    .bind(now_ms)
    .bind(node)
    .execute(&mut *conn)
    .await?;
    Ok(())
}

pub(super) async fn miss(conn: &mut PgConnection, job: &str, now_ms: i64) -> Result<()> {
    sqlx::query(
        "UPDATE audits SET state = 'missed', ended_at_ms = $1 WHERE job_id = $2 AND state = 'pending'",
    )
    .bind(now_ms)
    .bind(job)
    .execute(&mut *conn)
    .await?;
    Ok(())
}

pub(super) async fn state(conn: &mut PgConnection, job: &str) -> Result<Option<String>> {
    Ok(
        sqlx::query_scalar("SELECT state FROM audits WHERE job_id = $1")
            .bind(job)
            .fetch_optional(&mut *conn)
            .await?,
    )
}
