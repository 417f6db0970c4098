//! Jobs, their attempts, and the tokens ended attempts streamed
//! (`job_segments`, see `migrations/sqlite/*_handoff.sql`).
//!
//! Every function runs on the connection it is given: the pool's, or a
//! transaction the caller began and commits.

use mlxnet_proto::ids::JobId;
use prost::Message;
use sqlx::{Row, SqliteConnection};

use super::super::{
    rows::{self, JOB_COLUMNS},
    Result, StoreError,
};
use crate::domain::{
    AttemptEnd, CancelOutcome, Completion, JobRecord, JobStats, NewJob, Segment, Streamed,
    StreamedEnd,
};

/// Inserts queued jobs (attempt 1), each created at its own time, with
/// multi-row INSERTs (see [`insert_rows`]).
pub(super) async fn insert(conn: &mut SqliteConnection, jobs: &[(&NewJob, i64)]) -> Result<()> {
    insert_rows(
        conn,
        "INSERT INTO jobs (id, model, input, sampling, state, attempt, created_at_ms, \
         updated_at_ms, priority) VALUES ",
        "(?, ?, ?, ?, 'queued', 1, ?, ?, ?)",
        jobs,
        |q, (job, now)| {
            q.bind(job.id.to_string())
                .bind(job.model.as_str())
                .bind(job.input.encode_to_vec())
                .bind(job.sampling.encode_to_vec())
                .bind(*now)
                .bind(*now)
                .bind(i64::from(job.priority))
        },
    )
    .await?;
    Ok(())
}

/// Most rows in one multi-row INSERT of [`insert_rows`].
const MAX_ROWS_PER_INSERT: usize = 128;

/// Inserts one row per item with as few statements as it takes: `head`
/// (`INSERT INTO t (cols) VALUES `) followed by `row` (`(?, ?, ...)`) once
/// per item, `bind` binding one item's values in the order of `row`. The
/// items go in chunks whose sizes are powers of two (at most
/// [`MAX_ROWS_PER_INSERT`]), so each table has at most eight distinct
/// statements and they all stay in the connection's prepared-statement
/// cache.
pub(super) async fn insert_rows<T>(
    conn: &mut SqliteConnection,
    head: &str,
    row: &str,
    items: &[T],
    bind: impl for<'q> Fn(
        sqlx::query::Query<'q, sqlx::Sqlite, sqlx::sqlite::SqliteArguments<'q>>,
        &'q T,
    )
        -> sqlx::query::Query<'q, sqlx::Sqlite, sqlx::sqlite::SqliteArguments<'q>>,
) -> Result<(), sqlx::Error> {
    let mut rest = items;
    while !rest.is_empty() {
        let n = MAX_ROWS_PER_INSERT.min(1 << rest.len().ilog2());
        let (chunk, tail) = rest.split_at(n);
        rest = tail;
        let mut sql = String::with_capacity(head.len() + n * (row.len() + 1));
        sql.push_str(head);
        for i in 0..n {
            if i > 0 {
                sql.push(',');
            }
            sql.push_str(row);
        }
        let mut query = sqlx::query(&sql);
        for item in chunk {
            query = bind(query, item);
        }
        query.execute(&mut *conn).await?;
    }
    Ok(())
}

pub(super) async fn get(conn: &mut SqliteConnection, id: JobId) -> Result<Option<JobRecord>> {
    let row = sqlx::query(&format!("SELECT {JOB_COLUMNS} FROM jobs WHERE id = ?"))
        .bind(id.to_string())
        .fetch_optional(&mut *conn)
        .await?;
    row.as_ref().map(rows::job).transpose()
}

pub(super) async fn list(conn: &mut SqliteConnection, limit: u32) -> Result<Vec<JobRecord>> {
    let rows = sqlx::query(&format!(
        "SELECT {JOB_COLUMNS} FROM jobs ORDER BY created_at_ms DESC, id DESC LIMIT ?"
    ))
    .bind(i64::from(limit))
    .fetch_all(&mut *conn)
    .await?;
    rows.iter().map(rows::job).collect()
}

pub(super) async fn queued(conn: &mut SqliteConnection, limit: u32) -> Result<Vec<JobRecord>> {
    let rows = sqlx::query(&format!(
        "SELECT {JOB_COLUMNS} FROM jobs WHERE state = 'queued' ORDER BY created_at_ms, id LIMIT ?"
    ))
    .bind(i64::from(limit))
    .fetch_all(&mut *conn)
    .await?;
    rows.iter().map(rows::job).collect()
}

/// Queued jobs, oldest first, with their paying accounts, claimed for the
/// caller's transaction (see `Store::claim_queued`). One writer at a time (`BEGIN IMMEDIATE`) keeps claims apart.
pub(super) async fn claim(
    conn: &mut SqliteConnection,
    limit: u32,
) -> Result<Vec<(JobRecord, Option<String>)>> {
    let rows = sqlx::query(&format!(
        "SELECT {JOB_COLUMNS}, \
           (SELECT account_id FROM job_holds h WHERE h.job_id = jobs.id) AS account_id \
         FROM jobs WHERE state = 'queued' ORDER BY created_at_ms, id LIMIT ?"
    ))
    .bind(i64::from(limit))
    .fetch_all(&mut *conn)
    .await?;
    rows.iter()
        .map(|r| Ok((rows::job(r)?, rows::Columns::opt_text(r, "account_id")?)))
        .collect()
}

pub(super) async fn accounts(
    conn: &mut SqliteConnection,
    jobs: &[JobId],
) -> Result<std::collections::HashMap<JobId, String>> {
    let mut out = std::collections::HashMap::with_capacity(jobs.len());
    if jobs.is_empty() {
        return Ok(out);
    }
    let marks = vec!["?"; jobs.len()].join(",");
    let sql = format!("SELECT job_id, account_id FROM job_holds WHERE job_id IN ({marks})");
    let mut query = sqlx::query_as::<_, (String, String)>(&sql);
    for id in jobs {
        query = query.bind(id.to_string());
    }
    for (job, account) in query.fetch_all(&mut *conn).await? {
        if let Ok(id) = job.parse::<JobId>() {
            out.insert(id, account);
        }
    }
    Ok(out)
}

pub(super) async fn count_queued(conn: &mut SqliteConnection) -> Result<u64> {
    let n: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM jobs WHERE state = 'queued'")
        .fetch_one(&mut *conn)
        .await?;
    Ok(n as u64)
}

pub(super) async fn stats(conn: &mut SqliteConnection) -> Result<JobStats> {
    let rows: Vec<(String, i64, i64)> = sqlx::query_as(
        "SELECT state, COUNT(*), COALESCE(SUM(completion_tokens), 0) FROM jobs GROUP BY state",
    )
    .fetch_all(&mut *conn)
    .await?;
    Ok(JobStats::of(
        rows.iter()
            .map(|(s, n, t)| (s.as_str(), *n as u64, *t as u64)),
    ))
}

/// Nothing to lock: one writer at a time (see the PostgreSQL backend's
/// `lock_nodes`).
pub(super) async fn lock_nodes(_conn: &mut SqliteConnection, _nodes: &[&str]) -> Result<()> {
    Ok(())
}

/// `queued -> assigned` (see `Store::assign`), on the caller's transaction,
/// booking one of the node's slots: the update lands only while the node's
/// assigned and running jobs are fewer than its slots (a node with no row,
/// or 0 slots, has no bound).
pub(super) async fn assign(
    conn: &mut SqliteConnection,
    id: JobId,
    attempt: u32,
    node_id: &str,
    now: i64,
) -> Result<bool> {
    let done = sqlx::query(
        "UPDATE jobs SET state = 'assigned', node_id = ?1, error = NULL, updated_at_ms = ?2, \
           replica = (SELECT replica FROM nodes WHERE id = ?1) \
         WHERE id = ?3 AND state = 'queued' AND attempt = ?4 AND (\
           SELECT slots = 0 OR slots > (SELECT COUNT(*) FROM jobs b \
             WHERE b.node_id = ?1 AND b.state IN ('assigned', 'running')) \
           FROM nodes WHERE id = ?1) IS NOT 0",
    )
    .bind(node_id)
    .bind(now)
    .bind(id.to_string())
    .bind(i64::from(attempt))
    .execute(&mut *conn)
    .await?
    .rows_affected()
        == 1;
    if done {
        sqlx::query(
            "INSERT OR REPLACE INTO job_attempts (job_id, attempt, node_id, outcome, started_at_ms) \
             VALUES (?, ?, ?, 'assigned', ?)",
        )
        .bind(id.to_string())
        .bind(i64::from(attempt))
        .bind(node_id)
        .bind(now)
        .execute(&mut *conn)
        .await?;
    }
    Ok(done)
}

/// `assigned -> running`, on the caller's transaction.
pub(super) async fn mark_running(
    conn: &mut SqliteConnection,
    id: JobId,
    attempt: u32,
    node_id: &str,
    now: i64,
) -> Result<bool> {
    let done = sqlx::query(
        "UPDATE jobs SET state = 'running', updated_at_ms = ? \
         WHERE id = ? AND state = 'assigned' AND attempt = ? AND node_id = ?",
    )
    .bind(now)
    .bind(id.to_string())
    .bind(i64::from(attempt))
    .bind(node_id)
    .execute(&mut *conn)
    .await?
    .rows_affected()
        == 1;
    if done {
        sqlx::query("UPDATE job_attempts SET outcome = 'running' WHERE job_id = ? AND attempt = ?")
            .bind(id.to_string())
            .bind(i64::from(attempt))
            .execute(&mut *conn)
            .await?;
    }
    Ok(done)
}

/// `assigned | running -> completed`, on the caller's transaction.
pub(super) async fn complete(
    conn: &mut SqliteConnection,
    c: &Completion,
    now: i64,
) -> Result<bool> {
    let claim = c.result.claim.clone().unwrap_or_default();
    let before = Streamed::of(&segments(conn, c.job_id).await?);
    let output_text = before.text + &claim.output_text;
    let completion_tokens = before.token_ids.len() as i64 + i64::from(claim.completion_tokens);
    let done = sqlx::query(
        "UPDATE jobs SET state = 'completed', output_text = ?, completion_tokens = ?, \
         claim = ?, signature = ?, error = NULL, updated_at_ms = ? \
         WHERE id = ? AND state IN ('assigned', 'running') AND attempt = ? AND node_id = ?",
    )
    .bind(&output_text)
    .bind(completion_tokens)
    .bind(claim.encode_to_vec())
    .bind(&c.result.signature)
    .bind(now)
    .bind(c.job_id.to_string())
    .bind(i64::from(c.attempt))
    .bind(&c.node_id)
    .execute(&mut *conn)
    .await?
    .rows_affected()
        == 1;
    if done {
        sqlx::query(
            "UPDATE job_attempts SET outcome = 'completed', ended_at_ms = ? WHERE job_id = ? AND attempt = ?",
        )
        .bind(now)
        .bind(c.job_id.to_string())
        .bind(i64::from(c.attempt))
        .execute(&mut *conn)
        .await?;
    }
    Ok(done)
}

/// The guarded end of an attempt, and its segment (see
/// `Store::end_attempt_streamed`), on the caller's transaction.
pub(super) async fn end_attempt(
    conn: &mut SqliteConnection,
    end: &StreamedEnd<'_>,
    segment: &Segment,
    now: i64,
) -> Result<Option<AttemptEnd>> {
    let ended = fail_attempt(conn, end, now).await?;
    if ended.is_some() && !segment.token_ids.is_empty() {
        let so_far = streamed_count(conn, end.job).await?;
        if u64::from(segment.first_index) != so_far {
            return Err(StoreError::Corrupt {
                id: end.job.to_string(),
                what: format!(
                    "segment of attempt {} starts at token {}, the stream is at {so_far}",
                    end.attempt, segment.first_index
                ),
            });
        }
        let (claim, signature) = match &segment.claim {
            Some(s) => (
                s.claim.as_ref().map(Message::encode_to_vec),
                Some(s.signature.clone()),
            ),
            None => (None, None),
        };
        sqlx::query(
            "INSERT INTO job_segments (job_id, attempt, node_id, first_index, token_count, \
             token_ids, text, claim, signature, created_at_ms) \
             VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        )
        .bind(end.job.to_string())
        .bind(i64::from(end.attempt))
        .bind(end.node_id)
        .bind(i64::from(segment.first_index))
        .bind(segment.token_ids.len() as i64)
        .bind(rows::encode_ids(&segment.token_ids))
        .bind(&segment.text)
        .bind(claim)
        .bind(signature)
        .bind(now)
        .execute(&mut *conn)
        .await?;
    }
    Ok(ended)
}

async fn fail_attempt(
    conn: &mut SqliteConnection,
    end: &StreamedEnd<'_>,
    now: i64,
) -> Result<Option<AttemptEnd>> {
    let row = sqlx::query(
        "UPDATE jobs SET \
           state = CASE WHEN ?1 AND attempt < ?2 THEN 'queued' ELSE 'failed' END, \
           attempt = CASE WHEN ?1 AND attempt < ?2 THEN attempt + 1 ELSE attempt END, \
           node_id = CASE WHEN ?1 AND attempt < ?2 THEN NULL ELSE node_id END, \
           error = ?3, updated_at_ms = ?4 \
         WHERE id = ?5 AND state IN ('assigned', 'running') AND attempt = ?6 AND node_id = ?7 \
         RETURNING state, attempt",
    )
    .bind(end.retryable)
    .bind(i64::from(end.max_attempts))
    .bind(end.reason)
    .bind(now)
    .bind(end.job.to_string())
    .bind(i64::from(end.attempt))
    .bind(end.node_id)
    .fetch_optional(&mut *conn)
    .await?;
    let Some(row) = row else {
        return Ok(None);
    };
    sqlx::query(
        "UPDATE job_attempts SET outcome = 'failed', error = ?, ended_at_ms = ? WHERE job_id = ? AND attempt = ?",
    )
    .bind(end.reason)
    .bind(now)
    .bind(end.job.to_string())
    .bind(i64::from(end.attempt))
    .execute(&mut *conn)
    .await?;
    let state: String = row.try_get("state")?;
    let new_attempt: i64 = row.try_get("attempt")?;
    Ok(Some(if state == "queued" {
        AttemptEnd::Requeued {
            attempt: new_attempt as u32,
        }
    } else {
        AttemptEnd::Failed
    }))
}

/// Cancels a job that has not finished, on the caller's transaction.
pub(super) async fn cancel(
    conn: &mut SqliteConnection,
    id: JobId,
    now: i64,
) -> Result<CancelOutcome> {
    let row = sqlx::query(
        "UPDATE jobs SET state = 'cancelled', updated_at_ms = ? \
         WHERE id = ? AND state IN ('queued', 'assigned', 'running') RETURNING attempt",
    )
    .bind(now)
    .bind(id.to_string())
    .fetch_optional(&mut *conn)
    .await?;
    Ok(match row {
        Some(row) => {
            let attempt: i64 = row.try_get("attempt")?;
            sqlx::query(
                "UPDATE job_attempts SET outcome = 'cancelled', ended_at_ms = ? \
                 WHERE job_id = ? AND attempt = ? AND outcome IN ('assigned', 'running')",
            )
            .bind(now)
            .bind(id.to_string())
            .bind(attempt)
            .execute(&mut *conn)
            .await?;
            CancelOutcome::Cancelled
        }
        None => {
            let state: Option<String> = sqlx::query_scalar("SELECT state FROM jobs WHERE id = ?")
                .bind(id.to_string())
                .fetch_optional(&mut *conn)
                .await?;
            match state {
                None => CancelOutcome::NotFound,
                Some(s) => CancelOutcome::AlreadyFinished(rows::parse_state(&id.to_string(), &s)?),
            }
        }
    })
}

/// Tokens a job's segments hold.
async fn streamed_count(conn: &mut SqliteConnection, job: JobId) -> Result<u64> {
    let n: i64 = sqlx::query_scalar(
        "SELECT COALESCE(SUM(token_count), 0) FROM job_segments WHERE job_id = ?",
    )
    .bind(job.to_string())
    .fetch_one(&mut *conn)
    .await?;
    Ok(n.max(0) as u64)
}

/// A job's segments in stream order.
pub(super) async fn segments(conn: &mut SqliteConnection, job: JobId) -> Result<Vec<Segment>> {
    let id = job.to_string();
    let rows = sqlx::query(
        "SELECT attempt, node_id, first_index, token_ids, text, claim, signature \
         FROM job_segments WHERE job_id = ? ORDER BY first_index",
    )
    .bind(&id)
    .fetch_all(&mut *conn)
    .await?;
    rows.iter().map(|r| rows::segment(&id, r)).collect()
}
