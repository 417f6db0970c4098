//! The SQLite store: one file in the data directory, WAL journal, schema from
//! `migrations/sqlite` (embedded at build time).
//!
//! Durability: `synchronous = FULL`, so every commit is fsynced to the WAL
//! before it returns: an answered submit (its hold is money) survives power
//! loss, not only a crash of the process. The ledger's group commit makes
//! that one fsync per batch of submits, not one per submit.
//!
//! Binary columns hold prost encodings of `JobInput`, `SamplingParams` and
//! `ResultClaim`; the claim's signature sits in its own column.

use std::{str::FromStr, time::Duration};

use mlxnet_proto::{
    ids::JobId,
    v1::{JobInput, ResultClaim, SamplingParams, SignedClaim},
};
use prost::Message;
use sqlx::{
    sqlite::{
        SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteRow, SqliteSynchronous,
    },
    Row, SqliteConnection, SqlitePool,
};

use super::{segments, StoreError};
use crate::{
    domain::{
        AttemptEnd, CancelOutcome, Completion, JobRecord, JobState, JobStats, NewJob, NodeRecord,
        StreamedEnd,
    },
    util::now_ms,
};

static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("../migrations/sqlite");

/// How every write transaction of the store begins: with the write lock
/// taken up front. A deferred transaction that reads before it writes (as
/// completing a job reads its streamed segments first) cannot upgrade its
/// read lock while another connection writes, and SQLite answers
/// SQLITE_BUSY at once instead of waiting `busy_timeout`; that lost job
/// completions under concurrent submits.
pub(crate) const IMMEDIATE: &str = "BEGIN IMMEDIATE";

const JOB_COLUMNS: &str = "id, model, input, sampling, state, attempt, node_id, output_text, \
     completion_tokens, claim, signature, error, created_at_ms, updated_at_ms, priority";

/// Jobs and nodes in SQLite.
#[derive(Clone, Debug)]
pub struct SqliteStore {
    pool: SqlitePool,
}

impl SqliteStore {
    /// Opens (creating if missing) the database at `url` and applies migrations.
    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        let options = SqliteConnectOptions::from_str(url)?
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Full)
            .foreign_keys(true)
            .busy_timeout(Duration::from_secs(5));
        let pool = SqlitePoolOptions::new()
            .max_connections(4)
            .connect_with(options)
            .await?;
        MIGRATOR.run(&pool).await?;
        Ok(Self { pool })
    }

    /// Closes every connection; the file can be reopened afterwards.
    pub async fn close(&self) {
        self.pool.close().await;
    }

    /// Checks the database answers.
    pub async fn ping(&self) -> Result<(), StoreError> {
        sqlx::query("SELECT 1").execute(&self.pool).await?;
        Ok(())
    }

    // ---- jobs ----

    /// Inserts a queued job (attempt 1).
    pub async fn insert_job(&self, job: &NewJob) -> Result<JobRecord, StoreError> {
        let mut conn = self.pool.acquire().await?;
        insert_job_on(&mut conn, job, now_ms()).await
    }

    /// The connection pool, for the ledger's tables in the same database.
    pub(crate) fn pool(&self) -> &SqlitePool {
        &self.pool
    }

    pub async fn get_job(&self, id: JobId) -> Result<Option<JobRecord>, StoreError> {
        let row = sqlx::query(&format!("SELECT {JOB_COLUMNS} FROM jobs WHERE id = ?"))
            .bind(id.to_string())
            .fetch_optional(&self.pool)
            .await?;
        row.map(|r| job_from_row(&r)).transpose()
    }

    /// Newest first.
    pub async fn list_jobs(&self, limit: u32) -> Result<Vec<JobRecord>, StoreError> {
        let rows = sqlx::query(&format!(
            "SELECT {JOB_COLUMNS} FROM jobs ORDER BY created_at_ms DESC, id DESC LIMIT ?"
        ))
        .bind(i64::from(limit))
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(job_from_row).collect()
    }

    /// Queued jobs, oldest first.
    pub async fn queued_jobs(&self, limit: u32) -> Result<Vec<JobRecord>, StoreError> {
        let rows = sqlx::query(&format!(
            "SELECT {JOB_COLUMNS} FROM jobs WHERE state = 'queued' ORDER BY created_at_ms, id LIMIT ?"
        ))
        .bind(i64::from(limit))
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(job_from_row).collect()
    }

    /// The paying account of each of `jobs` that has a hold (jobs from before
    /// the ledger have none), for fair share across accounts.
    pub async fn job_accounts(
        &self,
        jobs: &[JobId],
    ) -> Result<std::collections::HashMap<JobId, String>, StoreError> {
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
        for (job, account) in query.fetch_all(&self.pool).await? {
            if let Ok(id) = job.parse::<JobId>() {
                out.insert(id, account);
            }
        }
        Ok(out)
    }

    pub async fn count_queued(&self) -> Result<u64, StoreError> {
        let n: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM jobs WHERE state = 'queued'")
            .fetch_one(&self.pool)
            .await?;
        Ok(n as u64)
    }

    /// [`SqliteStore::assign`] for a batch of placements (job, attempt, node)
    /// in one transaction; one flag per entry, false where the job was not
    /// queued at that attempt any more.
    pub async fn assign_many(
        &self,
        batch: &[(JobId, u32, String)],
    ) -> Result<Vec<bool>, StoreError> {
        let now = now_ms();
        let mut tx = self.pool.begin_with(IMMEDIATE).await?;
        let mut done = Vec::with_capacity(batch.len());
        for (id, attempt, node_id) in batch {
            let ok = sqlx::query(
                "UPDATE jobs SET state = 'assigned', node_id = ?, error = NULL, updated_at_ms = ? \
                 WHERE id = ? AND state = 'queued' AND attempt = ?",
            )
            .bind(node_id)
            .bind(now)
            .bind(id.to_string())
            .bind(i64::from(*attempt))
            .execute(&mut *tx)
            .await?
            .rows_affected()
                == 1;
            if ok {
                sqlx::query(
                    "INSERT OR REPLACE INTO job_attempts (job_id, attempt, node_id, outcome, started_at_ms) \
                     VALUES (?, ?, ?, 'assigned', ?)",
                )
                .bind(id.to_string())
                .bind(i64::from(*attempt))
                .bind(node_id)
                .bind(now)
                .execute(&mut *tx)
                .await?;
            }
            done.push(ok);
        }
        tx.commit().await?;
        Ok(done)
    }

    /// `queued -> assigned` to `node_id` for `attempt`. False if the job is not
    /// queued at that attempt any more.
    pub async fn assign(&self, id: JobId, attempt: u32, node_id: &str) -> Result<bool, StoreError> {
        let now = now_ms();
        let mut tx = self.pool.begin_with(IMMEDIATE).await?;
        let done = sqlx::query(
            "UPDATE jobs SET state = 'assigned', node_id = ?, error = NULL, updated_at_ms = ? \
             WHERE id = ? AND state = 'queued' AND attempt = ?",
        )
        .bind(node_id)
        .bind(now)
        .bind(id.to_string())
        .bind(i64::from(attempt))
        .execute(&mut *tx)
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
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        Ok(done)
    }

    /// `assigned -> running` when the node says it started.
    pub async fn mark_running(
        &self,
        id: JobId,
        attempt: u32,
        node_id: &str,
    ) -> Result<bool, StoreError> {
        let now = now_ms();
        let mut tx = self.pool.begin_with(IMMEDIATE).await?;
        let done = sqlx::query(
            "UPDATE jobs SET state = 'running', updated_at_ms = ? \
             WHERE id = ? AND state = 'assigned' AND attempt = ? AND node_id = ?",
        )
        .bind(now)
        .bind(id.to_string())
        .bind(i64::from(attempt))
        .bind(node_id)
        .execute(&mut *tx)
        .await?
        .rows_affected()
            == 1;
        if done {
            sqlx::query(
                "UPDATE job_attempts SET outcome = 'running' WHERE job_id = ? AND attempt = ?",
            )
            .bind(id.to_string())
            .bind(i64::from(attempt))
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        Ok(done)
    }

    /// `assigned | running -> completed` with the verified claim. Only the
    /// node holding this attempt can complete it, once; anything else
    /// returns false and changes nothing. A resumed job's output is what
    /// its earlier attempts streamed followed by the claim's.
    pub async fn complete(&self, c: &Completion) -> Result<bool, StoreError> {
        let now = now_ms();
        let claim = c.result.claim.clone().unwrap_or_default();
        let mut tx = self.pool.begin_with(IMMEDIATE).await?;
        let before = crate::domain::Streamed::of(&segments::segments_on(&mut tx, c.job_id).await?);
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
        .execute(&mut *tx)
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
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        Ok(done)
    }

    /// Ends `attempt` (held by `node_id`) as failed: requeued as `attempt + 1`
    /// when `retryable` and attempts remain, else failed for good. `None` if
    /// the job is not at that attempt on that node any more.
    pub async fn fail_attempt(
        &self,
        id: JobId,
        attempt: u32,
        node_id: &str,
        reason: &str,
        retryable: bool,
        max_attempts: u32,
    ) -> Result<Option<AttemptEnd>, StoreError> {
        let end = StreamedEnd {
            job: id,
            attempt,
            node_id,
            reason,
            retryable,
            max_attempts,
        };
        let mut tx = self.pool.begin_with(IMMEDIATE).await?;
        let ended = fail_attempt_on(&mut tx, &end, now_ms()).await?;
        tx.commit().await?;
        Ok(ended)
    }

    /// Cancels a job that has not finished.
    pub async fn cancel(&self, id: JobId) -> Result<CancelOutcome, StoreError> {
        let now = now_ms();
        let mut tx = self.pool.begin_with(IMMEDIATE).await?;
        let row = sqlx::query(
            "UPDATE jobs SET state = 'cancelled', updated_at_ms = ? \
             WHERE id = ? AND state IN ('queued', 'assigned', 'running') RETURNING attempt",
        )
        .bind(now)
        .bind(id.to_string())
        .fetch_optional(&mut *tx)
        .await?;
        let outcome = match row {
            Some(row) => {
                let attempt: i64 = row.try_get("attempt")?;
                sqlx::query(
                    "UPDATE job_attempts SET outcome = 'cancelled', ended_at_ms = ? \
                     WHERE job_id = ? AND attempt = ? AND outcome IN ('assigned', 'running')",
                )
                .bind(now)
                .bind(id.to_string())
                .bind(attempt)
                .execute(&mut *tx)
                .await?;
                CancelOutcome::Cancelled
            }
            None => {
                let state: Option<String> =
                    sqlx::query_scalar("SELECT state FROM jobs WHERE id = ?")
                        .bind(id.to_string())
                        .fetch_optional(&mut *tx)
                        .await?;
                match state {
                    None => CancelOutcome::NotFound,
                    Some(s) => CancelOutcome::AlreadyFinished(parse_state(&id.to_string(), &s)?),
                }
            }
        };
        tx.commit().await?;
        Ok(outcome)
    }

    /// At start-up no node session exists, so every assigned or running job
    /// lost its node: requeue each (bounded by `max_attempts`). Returns how many.
    pub async fn requeue_orphans(&self, max_attempts: u32) -> Result<u64, StoreError> {
        let now = now_ms();
        let mut tx = self.pool.begin_with(IMMEDIATE).await?;
        sqlx::query(
            "UPDATE job_attempts SET outcome = 'failed', error = 'coordinator restarted', ended_at_ms = ? \
             WHERE outcome IN ('assigned', 'running')",
        )
        .bind(now)
        .execute(&mut *tx)
        .await?;
        let n = sqlx::query(
            "UPDATE jobs SET \
               state = CASE WHEN attempt < ?1 THEN 'queued' ELSE 'failed' END, \
               attempt = CASE WHEN attempt < ?1 THEN attempt + 1 ELSE attempt END, \
               node_id = CASE WHEN attempt < ?1 THEN NULL ELSE node_id END, \
               error = 'coordinator restarted while the job ran', updated_at_ms = ?2 \
             WHERE state IN ('assigned', 'running')",
        )
        .bind(i64::from(max_attempts))
        .bind(now)
        .execute(&mut *tx)
        .await?
        .rows_affected();
        tx.commit().await?;
        Ok(n)
    }

    pub async fn job_stats(&self) -> Result<JobStats, StoreError> {
        let rows = sqlx::query(
            "SELECT state, COUNT(*) AS n, COALESCE(SUM(completion_tokens), 0) AS tokens FROM jobs GROUP BY state",
        )
        .fetch_all(&self.pool)
        .await?;
        let mut stats = JobStats::default();
        for row in rows {
            let state: String = row.try_get("state")?;
            let n: i64 = row.try_get("n")?;
            let n = n as u64;
            match state.as_str() {
                "queued" => stats.queued += n,
                "assigned" | "running" => stats.running += n,
                "completed" => {
                    stats.completed += n;
                    let tokens: i64 = row.try_get("tokens")?;
                    stats.tokens_generated = tokens as u64;
                }
                "failed" => stats.failed += n,
                "cancelled" => stats.cancelled += n,
                _ => {}
            }
        }
        Ok(stats)
    }

    // ---- nodes ----

    /// Records a node that completed the handshake, online.
    pub async fn upsert_node(&self, node: &NodeRecord) -> Result<(), StoreError> {
        let now = now_ms();
        sqlx::query(
            "INSERT INTO nodes (id, name, hardware, models, version, status, first_seen_ms, last_seen_ms) \
             VALUES (?1, ?2, ?3, ?4, ?5, 'online', ?6, ?6) \
             ON CONFLICT (id) DO UPDATE SET name = ?2, hardware = ?3, models = ?4, version = ?5, \
               status = 'online', last_seen_ms = ?6",
        )
        .bind(&node.id)
        .bind(&node.name)
        .bind(&node.hardware)
        .bind(&node.models)
        .bind(&node.version)
        .bind(now)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    pub async fn touch_node(&self, id: &str) -> Result<(), StoreError> {
        sqlx::query("UPDATE nodes SET last_seen_ms = ? WHERE id = ?")
            .bind(now_ms())
            .bind(id)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    pub async fn set_node_offline(&self, id: &str) -> Result<(), StoreError> {
        sqlx::query("UPDATE nodes SET status = 'offline' WHERE id = ?")
            .bind(id)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// At start-up no session exists yet.
    pub async fn mark_all_nodes_offline(&self) -> Result<(), StoreError> {
        sqlx::query("UPDATE nodes SET status = 'offline'")
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    pub async fn get_node(&self, id: &str) -> Result<Option<(NodeRecord, String)>, StoreError> {
        let row = sqlx::query(
            "SELECT id, name, hardware, models, version, status FROM nodes WHERE id = ?",
        )
        .bind(id)
        .fetch_optional(&self.pool)
        .await?;
        row.map(|r| {
            Ok((
                NodeRecord {
                    id: r.try_get("id")?,
                    name: r.try_get("name")?,
                    hardware: r.try_get("hardware")?,
                    models: r.try_get("models")?,
                    version: r.try_get("version")?,
                },
                r.try_get("status")?,
            ))
        })
        .transpose()
    }

    pub async fn count_nodes(&self) -> Result<u64, StoreError> {
        let n: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM nodes")
            .fetch_one(&self.pool)
            .await?;
        Ok(n as u64)
    }
}

/// Inserts a queued job (attempt 1) on `conn`, which may be inside the
/// caller's transaction (the ledger places the job's hold in the same one).
pub(crate) async fn insert_job_on(
    conn: &mut SqliteConnection,
    job: &NewJob,
    now: i64,
) -> Result<JobRecord, StoreError> {
    insert_jobs_on(conn, &[(job, now)]).await?;
    Ok(JobRecord::queued(job, now))
}

/// Inserts queued jobs (attempt 1), each created at its own time, with
/// multi-row INSERTs on `conn` (see [`insert_rows`]).
pub(crate) async fn insert_jobs_on(
    conn: &mut SqliteConnection,
    jobs: &[(&NewJob, i64)],
) -> Result<(), StoreError> {
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
pub(crate) async fn insert_rows<T>(
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

fn parse_state(id: &str, s: &str) -> Result<JobState, StoreError> {
    s.parse().map_err(|_| StoreError::Corrupt {
        id: id.to_owned(),
        what: format!("unknown state {s:?}"),
    })
}

/// The guarded end of an attempt (see [`SqliteStore::fail_attempt`]) on
/// `conn`, inside the caller's transaction.
pub(crate) async fn fail_attempt_on(
    conn: &mut SqliteConnection,
    end: &StreamedEnd<'_>,
    now: i64,
) -> Result<Option<AttemptEnd>, StoreError> {
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

fn job_from_row(row: &SqliteRow) -> Result<JobRecord, StoreError> {
    let id_text: String = row.try_get("id")?;
    let corrupt = |what: String| StoreError::Corrupt {
        id: id_text.clone(),
        what,
    };
    let id: JobId = id_text.parse().map_err(|e| corrupt(format!("{e}")))?;
    let input: Vec<u8> = row.try_get("input")?;
    let sampling: Vec<u8> = row.try_get("sampling")?;
    let state: String = row.try_get("state")?;
    let attempt: i64 = row.try_get("attempt")?;
    let completion_tokens: i64 = row.try_get("completion_tokens")?;
    let claim: Option<Vec<u8>> = row.try_get("claim")?;
    let signature: Option<Vec<u8>> = row.try_get("signature")?;
    let result = match (claim, signature) {
        (Some(c), Some(signature)) => Some(SignedClaim {
            claim: Some(
                ResultClaim::decode(c.as_slice()).map_err(|e| corrupt(format!("claim: {e}")))?,
            ),
            signature,
        }),
        _ => None,
    };
    Ok(JobRecord {
        id,
        model: row.try_get("model")?,
        input: JobInput::decode(input.as_slice()).map_err(|e| corrupt(format!("input: {e}")))?,
        sampling: SamplingParams::decode(sampling.as_slice())
            .map_err(|e| corrupt(format!("sampling: {e}")))?,
        state: parse_state(&id_text, &state)?,
        priority: row.try_get::<i64, _>("priority")?.clamp(0, 3) as u8,
        attempt: attempt as u32,
        node_id: row.try_get("node_id")?,
        output_text: row.try_get("output_text")?,
        completion_tokens: completion_tokens as u32,
        result,
        error: row.try_get("error")?,
        created_at_ms: row.try_get("created_at_ms")?,
        updated_at_ms: row.try_get("updated_at_ms")?,
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use mlxnet_proto::v1::job_input;

    pub(crate) async fn fresh() -> (tempfile::TempDir, SqliteStore) {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}", dir.path().join("t.db").display());
        let store = SqliteStore::connect(&url).await.unwrap();
        (dir, store)
    }

    pub(crate) async fn queued(store: &SqliteStore) -> JobRecord {
        store
            .insert_job(&NewJob {
                id: JobId::new(),
                model: "m".into(),
                input: JobInput {
                    kind: Some(job_input::Kind::Prompt("hello".into())),
                },
                sampling: SamplingParams {
                    seed: Some(7),
                    max_tokens: 16,
                    ..Default::default()
                },
                priority: 0,
            })
            .await
            .unwrap()
    }

    pub(crate) fn completion(job: &JobRecord, attempt: u32, node: &str, text: &str) -> Completion {
        Completion {
            job_id: job.id,
            attempt,
            node_id: node.into(),
            result: SignedClaim {
                claim: Some(ResultClaim {
                    job_id: job.id.to_string(),
                    attempt,
                    output_text: text.into(),
                    completion_tokens: 3,
                    ..Default::default()
                }),
                signature: vec![1; 64],
            },
        }
    }

    #[tokio::test]
    async fn a_job_runs_through_its_states_and_reads_back_as_stored() {
        let (_dir, store) = fresh().await;
        let job = queued(&store).await;
        assert_eq!(store.get_job(job.id).await.unwrap().unwrap(), job);
        assert_eq!(store.count_queued().await.unwrap(), 1);

        assert!(store.assign(job.id, 1, "n1").await.unwrap());
        assert!(
            !store.assign(job.id, 1, "n2").await.unwrap(),
            "already assigned"
        );
        assert!(
            !store.mark_running(job.id, 1, "n2").await.unwrap(),
            "other node"
        );
        assert!(store.mark_running(job.id, 1, "n1").await.unwrap());
        assert!(store
            .complete(&completion(&job, 1, "n1", "Paris"))
            .await
            .unwrap());

        let done = store.get_job(job.id).await.unwrap().unwrap();
        assert_eq!(done.state, JobState::Completed);
        assert_eq!(done.output_text, "Paris");
        assert_eq!(done.node_id.as_deref(), Some("n1"));
        let result = done.result.unwrap();
        assert_eq!(result.signature, vec![1; 64]);
        assert_eq!(result.claim.unwrap().output_text, "Paris");
        let stats = store.job_stats().await.unwrap();
        assert_eq!(
            (stats.completed, stats.tokens_generated, stats.queued),
            (1, 3, 0)
        );
    }

    #[tokio::test]
    async fn completion_is_accepted_once_and_only_from_the_holder() {
        let (_dir, store) = fresh().await;
        let job = queued(&store).await;
        assert!(
            !store
                .complete(&completion(&job, 1, "n1", "x"))
                .await
                .unwrap(),
            "not assigned yet"
        );
        assert!(store.assign(job.id, 1, "n1").await.unwrap());
        assert!(
            !store
                .complete(&completion(&job, 1, "n2", "x"))
                .await
                .unwrap(),
            "foreign node"
        );
        assert!(
            !store
                .complete(&completion(&job, 2, "n1", "x"))
                .await
                .unwrap(),
            "wrong attempt"
        );
        assert!(store
            .complete(&completion(&job, 1, "n1", "first"))
            .await
            .unwrap());
        assert!(
            !store
                .complete(&completion(&job, 1, "n1", "second"))
                .await
                .unwrap(),
            "duplicate"
        );
        assert!(
            store
                .fail_attempt(job.id, 1, "n1", "late", true, 3)
                .await
                .unwrap()
                .is_none(),
            "a late failure changes nothing"
        );
        let done = store.get_job(job.id).await.unwrap().unwrap();
        assert_eq!(
            (done.state, done.output_text.as_str()),
            (JobState::Completed, "first")
        );
    }

    #[tokio::test]
    async fn failed_attempts_requeue_until_the_bound_then_fail() {
        let (_dir, store) = fresh().await;
        let job = queued(&store).await;
        for attempt in 1..=2 {
            assert!(store.assign(job.id, attempt, "n1").await.unwrap());
            let end = store
                .fail_attempt(job.id, attempt, "n1", "lost", true, 3)
                .await
                .unwrap();
            assert_eq!(
                end,
                Some(AttemptEnd::Requeued {
                    attempt: attempt + 1
                })
            );
            let j = store.get_job(job.id).await.unwrap().unwrap();
            assert_eq!(
                (j.state, j.attempt, j.node_id),
                (JobState::Queued, attempt + 1, None)
            );
        }
        assert!(
            !store.assign(job.id, 2, "n1").await.unwrap(),
            "stale attempt number"
        );
        assert!(store.assign(job.id, 3, "n1").await.unwrap());
        let end = store
            .fail_attempt(job.id, 3, "n1", "lost again", true, 3)
            .await
            .unwrap();
        assert_eq!(end, Some(AttemptEnd::Failed));
        let j = store.get_job(job.id).await.unwrap().unwrap();
        assert_eq!(
            (j.state, j.error.as_deref()),
            (JobState::Failed, Some("lost again"))
        );

        // A non-retryable failure fails at once.
        let job = queued(&store).await;
        assert!(store.assign(job.id, 1, "n1").await.unwrap());
        let end = store
            .fail_attempt(job.id, 1, "n1", "prompt too long", false, 3)
            .await
            .unwrap();
        assert_eq!(end, Some(AttemptEnd::Failed));
    }

    #[tokio::test]
    async fn cancel_stops_unfinished_jobs_and_blocks_later_results() {
        let (_dir, store) = fresh().await;
        let job = queued(&store).await;
        assert!(store.assign(job.id, 1, "n1").await.unwrap());
        assert_eq!(
            store.cancel(job.id).await.unwrap(),
            CancelOutcome::Cancelled
        );
        assert!(!store
            .complete(&completion(&job, 1, "n1", "x"))
            .await
            .unwrap());
        assert_eq!(
            store.cancel(job.id).await.unwrap(),
            CancelOutcome::AlreadyFinished(JobState::Cancelled)
        );
        assert_eq!(
            store.cancel(JobId::new()).await.unwrap(),
            CancelOutcome::NotFound
        );
    }

    #[tokio::test]
    async fn restart_requeues_orphans_and_keeps_finished_jobs() {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}", dir.path().join("t.db").display());
        let store = SqliteStore::connect(&url).await.unwrap();
        let done = queued(&store).await;
        assert!(store.assign(done.id, 1, "n1").await.unwrap());
        assert!(store
            .complete(&completion(&done, 1, "n1", "kept"))
            .await
            .unwrap());
        let orphan = queued(&store).await;
        assert!(store.assign(orphan.id, 1, "n1").await.unwrap());
        store
            .upsert_node(&NodeRecord {
                id: "n1".into(),
                name: "mac".into(),
                hardware: "{}".into(),
                models: "[]".into(),
                version: "0.1.0".into(),
            })
            .await
            .unwrap();
        store.close().await;

        let store = SqliteStore::connect(&url).await.unwrap();
        store.mark_all_nodes_offline().await.unwrap();
        assert_eq!(store.requeue_orphans(3).await.unwrap(), 1);
        let o = store.get_job(orphan.id).await.unwrap().unwrap();
        assert_eq!((o.state, o.attempt), (JobState::Queued, 2));
        let d = store.get_job(done.id).await.unwrap().unwrap();
        assert_eq!(
            (d.state, d.output_text.as_str()),
            (JobState::Completed, "kept")
        );
        let (node, status) = store.get_node("n1").await.unwrap().unwrap();
        assert_eq!((node.name.as_str(), status.as_str()), ("mac", "offline"));
        assert_eq!(store.count_nodes().await.unwrap(), 1);
        let listed = store.list_jobs(10).await.unwrap();
        assert_eq!(listed.len(), 2);
        assert_eq!(listed[0].id, orphan.id, "newest first");
    }
}
