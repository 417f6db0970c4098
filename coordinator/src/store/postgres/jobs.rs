//! Jobs, their attempts, and the tokens ended attempts streamed, on
//! PostgreSQL: the SQL of `store/sqlite/jobs.rs` in PostgreSQL's dialect.
//! A transition and its `job_attempts` row are one statement (a data-
//! modifying CTE), so a guarded transition costs one round trip.
//!
//! Every function runs on the connection it is given: the pool's, or a
//! transaction the caller began and commits.

use mlxnet_proto::ids::JobId;
use prost::Message;
use sqlx::{PgConnection, Row};

use super::super::{
    rows::{self, JOB_COLUMNS},
    Result, StoreError,
};
use crate::domain::{
    AttemptEnd, CancelOutcome, Completion, JobRecord, JobStats, NewJob, Segment, Streamed,
    StreamedEnd,
};

/// Inserts queued jobs (attempt 1), each created at its own time: one
/// statement whatever the batch's size (arrays unnested).
pub(super) async fn insert(conn: &mut PgConnection, jobs: &[(&NewJob, i64)]) -> Result<()> {
    if jobs.is_empty() {
        return Ok(());
    }
    let ids: Vec<String> = jobs.iter().map(|(j, _)| j.id.to_string()).collect();
    let models: Vec<&str> = jobs.iter().map(|(j, _)| j.model.as_str()).collect();
    let inputs: Vec<Vec<u8>> = jobs.iter().map(|(j, _)| j.input.encode_to_vec()).collect();
    let sampling: Vec<Vec<u8>> = jobs
        .iter()
        .map(|(j, _)| j.sampling.encode_to_vec())
        .collect();
    let times: Vec<i64> = jobs.iter().map(|(_, now)| *now).collect();
    let priorities: Vec<i64> = jobs.iter().map(|(j, _)| i64::from(j.priority)).collect();
    sqlx::query(
        "INSERT INTO jobs (id, model, input, sampling, state, attempt, created_at_ms, \
         updated_at_ms, priority) \
         SELECT id, model, input, sampling, 'queued', 1, t, t, p \
         FROM UNNEST($1::text[], $2::text[], $3::bytea[], $4::bytea[], $5::int8[], $6::int8[]) \
           AS x (id, model, input, sampling, t, p)",
    )
    .bind(ids)
    .bind(models)
    .bind(inputs)
    .bind(sampling)
    .bind(times)
    .bind(priorities)
    .execute(&mut *conn)
    .await?;
    Ok(())
}

pub(super) async fn get(conn: &mut PgConnection, id: JobId) -> Result<Option<JobRecord>> {
    let row = sqlx::query(&format!("SELECT {JOB_COLUMNS} FROM jobs WHERE id = $1"))
        .bind(id.to_string())
        .fetch_optional(&mut *conn)
        .await?;
    row.as_ref().map(rows::job).transpose()
}

pub(super) async fn list(conn: &mut PgConnection, limit: u32) -> Result<Vec<JobRecord>> {
    let rows = sqlx::query(&format!(
        "SELECT {JOB_COLUMNS} FROM jobs ORDER BY created_at_ms DESC, id DESC LIMIT $1"
    ))
    .bind(i64::from(limit))
    .fetch_all(&mut *conn)
    .await?;
    rows.iter().map(rows::job).collect()
}

pub(super) async fn queued(conn: &mut PgConnection, limit: u32) -> Result<Vec<JobRecord>> {
    let rows = sqlx::query(&format!(
        "SELECT {JOB_COLUMNS} FROM jobs WHERE state = 'queued' ORDER BY created_at_ms, id LIMIT $1"
    ))
    .bind(i64::from(limit))
    .fetch_all(&mut *conn)
    .await?;
    rows.iter().map(rows::job).collect()
}

/// Queued jobs, oldest first, with their paying accounts, claimed for the
/// caller's transaction (see `Store::claim_queued`). `FOR UPDATE SKIP LOCKED`: rows another replica's claim holds are passed over, not waited for.
pub(super) async fn claim(
    conn: &mut PgConnection,
    limit: u32,
) -> Result<Vec<(JobRecord, Option<String>)>> {
    let rows = sqlx::query(&format!(
        "SELECT {JOB_COLUMNS}, \
           (SELECT account_id FROM job_holds h WHERE h.job_id = jobs.id) AS account_id \
         FROM jobs WHERE state = 'queued' ORDER BY created_at_ms, id LIMIT $1 FOR UPDATE SKIP LOCKED"
    ))
    .bind(i64::from(limit))
    .fetch_all(&mut *conn)
    .await?;
    rows.iter()
        .map(|r| Ok((rows::job(r)?, rows::Columns::opt_text(r, "account_id")?)))
        .collect()
}

pub(super) async fn accounts(
    conn: &mut PgConnection,
    jobs: &[JobId],
) -> Result<std::collections::HashMap<JobId, String>> {
    let ids: Vec<String> = jobs.iter().map(JobId::to_string).collect();
    let found: Vec<(String, String)> =
        sqlx::query_as("SELECT job_id, account_id FROM job_holds WHERE job_id = ANY($1)")
            .bind(ids)
            .fetch_all(&mut *conn)
            .await?;
    Ok(found
        .into_iter()
        .filter_map(|(job, account)| Some((job.parse::<JobId>().ok()?, account)))
        .collect())
}

pub(super) async fn count_queued(conn: &mut PgConnection) -> Result<u64> {
    let n: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM jobs WHERE state = 'queued'")
        .fetch_one(&mut *conn)
        .await?;
    Ok(n as u64)
}

pub(super) async fn stats(conn: &mut PgConnection) -> Result<JobStats> {
    let rows: Vec<(String, i64, i64)> = sqlx::query_as(
        "SELECT state, COUNT(*), COALESCE(SUM(completion_tokens), 0)::int8 FROM jobs GROUP BY state",
    )
    .fetch_all(&mut *conn)
    .await?;
    Ok(JobStats::of(
        rows.iter()
            .map(|(s, n, t)| (s.as_str(), *n as u64, *t as u64)),
    ))
}

/// Locks the rows of `nodes` (in id order, so two claims never wait on
/// each other in a circle) until the caller's transaction ends: a booking
/// made after it counts every booking another replica committed before
/// (each statement reads what was committed when it began), so two
/// replicas never both take a node's last slot.
pub(super) async fn lock_nodes(conn: &mut PgConnection, nodes: &[&str]) -> Result<()> {
    if nodes.is_empty() {
        return Ok(());
    }
    sqlx::query("SELECT id FROM nodes WHERE id = ANY($1) ORDER BY id FOR UPDATE")
        .bind(
            nodes
                .iter()
                .map(|n| (*n).to_owned())
                .collect::<Vec<String>>(),
        )
        .fetch_all(&mut *conn)
        .await?;
    Ok(())
}

/// `queued -> assigned` (see `Store::assign`), booking one of the node's
/// slots: the update lands only while the node's assigned and running
/// jobs are fewer than its slots (a node with no row, or 0 slots, has no
/// bound). Under [`lock_nodes`], so concurrent bookings of one node are
/// counted.
pub(super) async fn assign(
    conn: &mut PgConnection,
    id: JobId,
    attempt: u32,
    node_id: &str,
    now: i64,
) -> Result<bool> {
    let n = sqlx::query(
        "WITH a AS (UPDATE jobs SET state = 'assigned', node_id = $1, error = NULL, updated_at_ms = $2, \
           replica = (SELECT replica FROM nodes WHERE id = $1) \
           WHERE id = $3 AND state = 'queued' AND attempt = $4 AND (\
             SELECT slots = 0 OR slots > (SELECT COUNT(*) FROM jobs b \
               WHERE b.node_id = $1 AND b.state IN ('assigned', 'running')) \
             FROM nodes WHERE id = $1) IS NOT FALSE \
           RETURNING id, attempt) \
         INSERT INTO job_attempts (job_id, attempt, node_id, outcome, started_at_ms) \
         SELECT id, attempt, $1, 'assigned', $2 FROM a \
         ON CONFLICT (job_id, attempt) DO UPDATE SET node_id = EXCLUDED.node_id, \
           outcome = 'assigned', error = NULL, started_at_ms = EXCLUDED.started_at_ms, \
           ended_at_ms = NULL",
    )
    .bind(node_id)
    .bind(now)
    .bind(id.to_string())
    .bind(i64::from(attempt))
    .execute(&mut *conn)
    .await?
    .rows_affected();
    Ok(n == 1)
}

/// `assigned -> running`.
pub(super) async fn mark_running(
    conn: &mut PgConnection,
    id: JobId,
    attempt: u32,
    node_id: &str,
    now: i64,
) -> Result<bool> {
    let done: Option<i64> = sqlx::query_scalar(
        "WITH r AS (UPDATE jobs SET state = 'running', updated_at_ms = $1 \
           WHERE id = $2 AND state = 'assigned' AND attempt = $3 AND node_id = $4 RETURNING id), \
         a AS (UPDATE job_attempts SET outcome = 'running' \
           WHERE job_id = (SELECT id FROM r) AND attempt = $3) \
         SELECT COUNT(*) FROM r",
    )
    .bind(now)
    .bind(id.to_string())
    .bind(i64::from(attempt))
    .bind(node_id)
    .fetch_optional(&mut *conn)
    .await?;
    Ok(done == Some(1))
}

/// `assigned | running -> completed`, on the caller's transaction.
pub(super) async fn complete(conn: &mut PgConnection, c: &Completion, now: i64) -> Result<bool> {
    let claim = c.result.claim.clone().unwrap_or_default();
    let before = Streamed::of(&segments(conn, c.job_id).await?);
    let output_text = before.text + &claim.output_text;
    let completion_tokens = before.token_ids.len() as i64 + i64::from(claim.completion_tokens);
    let done: i64 = sqlx::query_scalar(
        "WITH c AS (UPDATE jobs SET state = 'completed', output_text = $1, completion_tokens = $2, \
           claim = $3, signature = $4, error = NULL, updated_at_ms = $5 \
           WHERE id = $6 AND state IN ('assigned', 'running') AND attempt = $7 AND node_id = $8 \
           RETURNING id), \
         a AS (UPDATE job_attempts SET outcome = 'completed', ended_at_ms = $5 \
           WHERE job_id = (SELECT id FROM c) AND attempt = $7) \
         SELECT COUNT(*) FROM c",
    )
    .bind(&output_text)
    .bind(completion_tokens)
    .bind(claim.encode_to_vec())
    .bind(&c.result.signature)
    .bind(now)
    .bind(c.job_id.to_string())
    .bind(i64::from(c.attempt))
    .bind(&c.node_id)
    .fetch_one(&mut *conn)
    .await?;
    Ok(done == 1)
}

/// The guarded end of an attempt, and its segment (see
/// `Store::end_attempt_streamed`), on the caller's transaction.
pub(super) async fn end_attempt(
    conn: &mut PgConnection,
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
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)",
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
    conn: &mut PgConnection,
    end: &StreamedEnd<'_>,
    now: i64,
) -> Result<Option<AttemptEnd>> {
    let row = sqlx::query(
        "WITH f AS (UPDATE jobs SET \
           state = CASE WHEN $1 AND attempt < $2 THEN 'queued' ELSE 'failed' END, \
           attempt = CASE WHEN $1 AND attempt < $2 THEN attempt + 1 ELSE attempt END, \
           node_id = CASE WHEN $1 AND attempt < $2 THEN NULL ELSE node_id END, \
           error = $3, updated_at_ms = $4 \
           WHERE id = $5 AND state IN ('assigned', 'running') AND attempt = $6 AND node_id = $7 \
           RETURNING id, state, attempt), \
         a AS (UPDATE job_attempts SET outcome = 'failed', error = $3, ended_at_ms = $4 \
           WHERE job_id = (SELECT id FROM f) AND attempt = $6) \
         SELECT state, attempt FROM f",
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

/// Cancels a job that has not finished.
pub(super) async fn cancel(conn: &mut PgConnection, id: JobId, now: i64) -> Result<CancelOutcome> {
    let cancelled: Option<i64> = sqlx::query_scalar(
        "WITH c AS (UPDATE jobs SET state = 'cancelled', updated_at_ms = $1 \
           WHERE id = $2 AND state IN ('queued', 'assigned', 'running') RETURNING id, attempt), \
         a AS (UPDATE job_attempts SET outcome = 'cancelled', ended_at_ms = $1 \
           WHERE job_id = (SELECT id FROM c) AND attempt = (SELECT attempt FROM c) \
           AND outcome IN ('assigned', 'running')) \
         SELECT attempt FROM c",
    )
    .bind(now)
    .bind(id.to_string())
    .fetch_optional(&mut *conn)
    .await?;
    if cancelled.is_some() {
        return Ok(CancelOutcome::Cancelled);
    }
    let state: Option<String> = sqlx::query_scalar("SELECT state FROM jobs WHERE id = $1")
        .bind(id.to_string())
        .fetch_optional(&mut *conn)
        .await?;
    Ok(match state {
        None => CancelOutcome::NotFound,
        Some(s) => CancelOutcome::AlreadyFinished(rows::parse_state(&id.to_string(), &s)?),
    })
}

/// Tokens a job's segments hold.
async fn streamed_count(conn: &mut PgConnection, job: JobId) -> Result<u64> {
    let n: i64 = sqlx::query_scalar(
        "SELECT COALESCE(SUM(token_count), 0)::int8 FROM job_segments WHERE job_id = $1",
    )
    .bind(job.to_string())
    .fetch_one(&mut *conn)
    .await?;
    Ok(n.max(0) as u64)
}

/// A job's segments in stream order.
pub(super) async fn segments(conn: &mut PgConnection, job: JobId) -> Result<Vec<Segment>> {
    let id = job.to_string();
    let rows = sqlx::query(
        "SELECT attempt, node_id, first_index, token_ids, text, claim, signature \
         FROM job_segments WHERE job_id = $1 ORDER BY first_index",
    )
    .bind(&id)
    .fetch_all(&mut *conn)
    .await?;
    rows.iter().map(|r| rows::segment(&id, r)).collect()
}
