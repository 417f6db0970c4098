//! Hand-off state: what ended attempts streamed to the client, so the next
//! attempt resumes after it (see `migrations/sqlite/*_handoff.sql`).
//!
//! # Invariants
//! - A segment is written in the same transaction as its attempt's end, and
//!   only when that end was accepted (the job was at that attempt on that
//!   node), so a late or foreign report adds nothing.
//! - A job's segments are contiguous: each starts where the ones before it
//!   end (`first_index` = tokens streamed so far), which the unique
//!   `(job_id, first_index)` index and [`SqliteStore::end_attempt_streamed`]'s
//!   check enforce.
//!
//! # Failure
//! [`StoreError`]; a segment that does not decode is `Corrupt`.

use mlxnet_proto::{
    ids::JobId,
    v1::{ResultClaim, SignedClaim},
};
use prost::Message;
use sqlx::{Row, SqliteConnection};

use super::{sqlite::SqliteStore, StoreError};
use crate::{
    domain::{AttemptEnd, Segment, StreamedEnd},
    util::now_ms,
};

impl SqliteStore {
    /// [`SqliteStore::fail_attempt`], and in the same transaction records
    /// `segment` (when it holds tokens) for the next attempt to resume after.
    /// A segment that does not start where the job's stream ends is refused
    /// as `Corrupt` and nothing changes.
    pub async fn end_attempt_streamed(
        &self,
        end: &StreamedEnd<'_>,
        segment: &Segment,
    ) -> Result<Option<AttemptEnd>, StoreError> {
        let now = now_ms();
        let mut tx = self.pool().begin_with(super::sqlite::IMMEDIATE).await?;
        let ended = super::sqlite::fail_attempt_on(&mut tx, end, now).await?;
        if ended.is_some() && !segment.token_ids.is_empty() {
            let so_far = streamed_count_on(&mut tx, end.job).await?;
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
            .bind(encode_ids(&segment.token_ids))
            .bind(&segment.text)
            .bind(claim)
            .bind(signature)
            .bind(now)
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        Ok(ended)
    }

    /// A job's segments in stream order.
    pub async fn segments(&self, job: JobId) -> Result<Vec<Segment>, StoreError> {
        let mut conn = self.pool().acquire().await?;
        segments_on(&mut conn, job).await
    }
}

/// Tokens a job's segments hold.
pub(crate) async fn streamed_count_on(
    conn: &mut SqliteConnection,
    job: JobId,
) -> Result<u64, StoreError> {
    let n: i64 = sqlx::query_scalar(
        "SELECT COALESCE(SUM(token_count), 0) FROM job_segments WHERE job_id = ?",
    )
    .bind(job.to_string())
    .fetch_one(&mut *conn)
    .await?;
    Ok(n.max(0) as u64)
}

/// A job's segments in stream order, on `conn` (inside a caller's transaction).
pub(crate) async fn segments_on(
    conn: &mut SqliteConnection,
    job: JobId,
) -> Result<Vec<Segment>, StoreError> {
    let id = job.to_string();
    let rows = sqlx::query(
        "SELECT attempt, node_id, first_index, token_ids, text, claim, signature \
         FROM job_segments WHERE job_id = ? ORDER BY first_index",
    )
    .bind(&id)
    .fetch_all(&mut *conn)
    .await?;
    let corrupt = |what: String| StoreError::Corrupt {
        id: id.clone(),
        what,
    };
    rows.iter()
        .map(|r| {
            let attempt: i64 = r.try_get("attempt")?;
            let first: i64 = r.try_get("first_index")?;
            let ids: Vec<u8> = r.try_get("token_ids")?;
            let claim: Option<Vec<u8>> = r.try_get("claim")?;
            let signature: Option<Vec<u8>> = r.try_get("signature")?;
            let claim = match claim {
                Some(bytes) => Some(SignedClaim {
                    claim: Some(
                        ResultClaim::decode(bytes.as_slice())
                            .map_err(|e| corrupt(format!("segment claim: {e}")))?,
                    ),
                    signature: signature.unwrap_or_default(),
                }),
                None => None,
            };
            Ok(Segment {
                attempt: attempt as u32,
                node_id: r.try_get("node_id")?,
                first_index: first as u32,
                token_ids: decode_ids(&ids).ok_or_else(|| corrupt("segment token ids".into()))?,
                text: r.try_get("text")?,
                claim,
            })
        })
        .collect()
}

fn encode_ids(ids: &[u32]) -> Vec<u8> {
    ids.iter().flat_map(|t| t.to_le_bytes()).collect()
}

fn decode_ids(bytes: &[u8]) -> Option<Vec<u32>> {
    if !bytes.len().is_multiple_of(4) {
        return None;
    }
    Some(
        bytes
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::Streamed;
    use crate::store::sqlite::tests::{completion, fresh, queued};

    fn end<'a>(job: JobId, attempt: u32, node: &'a str) -> StreamedEnd<'a> {
        StreamedEnd {
            job,
            attempt,
            node_id: node,
            reason: "node lost",
            retryable: true,
            max_attempts: 3,
        }
    }

    fn segment(attempt: u32, node: &str, first: u32, ids: &[u32], text: &str) -> Segment {
        Segment {
            attempt,
            node_id: node.into(),
            first_index: first,
            token_ids: ids.to_vec(),
            text: text.into(),
            claim: None,
        }
    }

    #[tokio::test]
    async fn ended_attempts_leave_their_tokens_and_the_result_joins_them() {
        let (_dir, store) = fresh().await;
        let job = queued(&store).await;
        assert!(store.assign(job.id, 1, "n1").await.unwrap());
        let s1 = segment(1, "n1", 0, &[5, 6], "Once upon");
        assert_eq!(
            store
                .end_attempt_streamed(&end(job.id, 1, "n1"), &s1)
                .await
                .unwrap(),
            Some(AttemptEnd::Requeued { attempt: 2 })
        );
        // A late report of the same attempt adds nothing.
        let late = segment(1, "n1", 2, &[7], " a");
        assert_eq!(
            store
                .end_attempt_streamed(&end(job.id, 1, "n1"), &late)
                .await
                .unwrap(),
            None
        );
        assert!(store.assign(job.id, 2, "n2").await.unwrap());
        // A segment that does not start where the stream ends is refused,
        // and the attempt stays as it was.
        let gap = segment(2, "n2", 3, &[7], " a");
        assert!(matches!(
            store
                .end_attempt_streamed(&end(job.id, 2, "n2"), &gap)
                .await,
            Err(StoreError::Corrupt { .. })
        ));
        let s2 = segment(2, "n2", 2, &[7], " a");
        store
            .end_attempt_streamed(&end(job.id, 2, "n2"), &s2)
            .await
            .unwrap();
        assert_eq!(store.segments(job.id).await.unwrap(), [s1, s2]);
        assert_eq!(
            Streamed::of(&store.segments(job.id).await.unwrap()),
            Streamed {
                token_ids: vec![5, 6, 7],
                text: "Once upon a".into()
            }
        );
        assert!(store.assign(job.id, 3, "n3").await.unwrap());
        assert!(store
            .complete(&completion(&job, 3, "n3", " time"))
            .await
            .unwrap());
        let done = store.get_job(job.id).await.unwrap().unwrap();
        assert_eq!(done.output_text, "Once upon a time");
        assert_eq!(done.completion_tokens, 3 + 3, "resumed plus the claim's");
    }
}
