//! Jobs: the state machine's states, a job as stored, the transitions'
//! inputs and outcomes, the tokens an ended attempt streamed (a hand-off
//! segment), and the client-API view of a job.
//!
//! States: `queued -> assigned -> running -> completed | failed | cancelled`;
//! a failed attempt may go back to `queued` with the next attempt number.

use std::{fmt, str::FromStr};

use mlxnet_proto::{
    ids::JobId,
    v1::{self, job_event, JobEvent, JobInput, SamplingParams, SignedClaim},
};

/// The most alternatives a token's log-probabilities may list (OpenAI's
/// `top_logprobs` bound), for `SamplingParams.logprobs`.
pub const MAX_LOGPROBS: u32 = 20;
/// The largest presence or frequency penalty, either sign (OpenAI's bound).
pub const MAX_PENALTY: f32 = 2.0;
/// The most entries a `logit_bias` may have (OpenAI's bound).
pub const MAX_LOGIT_BIAS: usize = 300;
/// The largest bias of one token, either sign (OpenAI's bound).
pub const MAX_BIAS: f32 = 100.0;

/// Where a job is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum JobState {
    Queued,
    Assigned,
    Running,
    Completed,
    Failed,
    Cancelled,
}

impl JobState {
    pub fn as_str(self) -> &'static str {
        match self {
            JobState::Queued => "queued",
            JobState::Assigned => "assigned",
            JobState::Running => "running",
            JobState::Completed => "completed",
            JobState::Failed => "failed",
            JobState::Cancelled => "cancelled",
        }
    }

    /// Completed, failed or cancelled: nothing will change it again.
    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            JobState::Completed | JobState::Failed | JobState::Cancelled
        )
    }

    pub fn to_proto(self) -> v1::JobState {
        match self {
            JobState::Queued => v1::JobState::Queued,
            JobState::Assigned => v1::JobState::Assigned,
            JobState::Running => v1::JobState::Running,
            JobState::Completed => v1::JobState::Completed,
            JobState::Failed => v1::JobState::Failed,
            JobState::Cancelled => v1::JobState::Cancelled,
        }
    }
}

impl fmt::Display for JobState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Not one of the state names.
#[derive(Debug, thiserror::Error)]
#[error("unknown job state {0:?}")]
pub struct UnknownState(String);

impl FromStr for JobState {
    type Err = UnknownState;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(match s {
            "queued" => JobState::Queued,
            "assigned" => JobState::Assigned,
            "running" => JobState::Running,
            "completed" => JobState::Completed,
            "failed" => JobState::Failed,
            "cancelled" => JobState::Cancelled,
            other => return Err(UnknownState(other.to_owned())),
        })
    }
}

/// A job as stored.
#[derive(Clone, Debug, PartialEq)]
pub struct JobRecord {
    pub id: JobId,
    pub model: String,
    pub input: JobInput,
    pub sampling: SamplingParams,
    /// 0..=3: orders the account's own queued jobs (see `scheduler::queue`).
    pub priority: u8,
    pub state: JobState,
    /// The current attempt (1-based); a requeue increments it.
    pub attempt: u32,
    /// Node of the current or last attempt (hex public key).
    pub node_id: Option<String>,
    pub output_text: String,
    pub completion_tokens: u32,
    /// The verified signed claim, once completed.
    pub result: Option<SignedClaim>,
    pub error: Option<String>,
    pub created_at_ms: i64,
    pub updated_at_ms: i64,
}

impl JobRecord {
    /// The record of `job` just queued at `now` (attempt 1, nothing run yet).
    pub fn queued(job: &NewJob, now: i64) -> Self {
        JobRecord {
            id: job.id,
            model: job.model.clone(),
            input: job.input.clone(),
            sampling: job.sampling.clone(),
            priority: job.priority,
            state: JobState::Queued,
            attempt: 1,
            node_id: None,
            output_text: String::new(),
            completion_tokens: 0,
            result: None,
            error: None,
            created_at_ms: now,
            updated_at_ms: now,
        }
    }
}

/// A job to insert (state `queued`, attempt 1).
#[derive(Clone, Debug)]
pub struct NewJob {
    pub id: JobId,
    pub model: String,
    pub input: JobInput,
    /// Seed already chosen.
    pub sampling: SamplingParams,
    /// 0..=3, checked at the API.
    pub priority: u8,
}

/// A verified result to record.
#[derive(Clone, Debug)]
pub struct Completion {
    pub job_id: JobId,
    pub attempt: u32,
    pub node_id: String,
    pub result: SignedClaim,
}

/// What happened to a job whose attempt failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttemptEnd {
    /// Back in the queue as this attempt.
    Requeued { attempt: u32 },
    /// Failed for good.
    Failed,
}

/// What a cancel did.
#[derive(Clone, Debug, PartialEq)]
pub enum CancelOutcome {
    NotFound,
    /// Already completed, failed or cancelled; nothing changed.
    AlreadyFinished(JobState),
    Cancelled,
}

/// Counts over all jobs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct JobStats {
    pub queued: u64,
    pub running: u64,
    pub completed: u64,
    pub failed: u64,
    pub cancelled: u64,
    /// Completion tokens of all completed jobs.
    pub tokens_generated: u64,
}

impl JobStats {
    /// The counts from `(state, jobs, completion tokens)` per stored state
    /// (a store's `GROUP BY state`); unknown states are not counted.
    pub fn of<'a>(per_state: impl IntoIterator<Item = (&'a str, u64, u64)>) -> Self {
        let mut stats = Self::default();
        for (state, n, tokens) in per_state {
            match state {
                "queued" => stats.queued += n,
                "assigned" | "running" => stats.running += n,
                "completed" => {
                    stats.completed += n;
                    stats.tokens_generated = tokens;
                }
                "failed" => stats.failed += n,
                "cancelled" => stats.cancelled += n,
                _ => {}
            }
        }
        stats
    }
}

/// The tokens one attempt streamed before it ended without finishing.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Segment {
    pub attempt: u32,
    pub node_id: String,
    /// Index of its first token in the job's stream.
    pub first_index: u32,
    pub token_ids: Vec<u32>,
    pub text: String,
    /// A drained node's signed partial claim (verified); none when the node
    /// vanished.
    pub claim: Option<SignedClaim>,
}

/// A chunk of tokens one attempt of a job streamed, as the token relay
/// carries it between replicas (`Store::append_tokens`). Chunks of a job
/// are ordered by `(attempt, chunk.index)`.
#[derive(Clone, Debug, PartialEq)]
pub struct RelayChunk {
    pub job: JobId,
    pub attempt: u32,
    pub chunk: mlxnet_proto::v1::job_event::Tokens,
}

/// Everything a job's ended attempts streamed, in order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Streamed {
    pub token_ids: Vec<u32>,
    pub text: String,
}

impl Streamed {
    /// Joins `segments` (in stream order).
    pub fn of(segments: &[Segment]) -> Self {
        let mut out = Streamed::default();
        for s in segments {
            out.token_ids.extend_from_slice(&s.token_ids);
            out.text.push_str(&s.text);
        }
        out
    }
}

/// How an attempt ended without a result: held by `node_id`, failed for
/// `reason`; requeued as the next attempt when `retryable` and fewer than
/// `max_attempts` were made, else failed for good.
#[derive(Clone, Debug)]
pub struct StreamedEnd<'a> {
    pub job: JobId,
    pub attempt: u32,
    pub node_id: &'a str,
    pub reason: &'a str,
    pub retryable: bool,
    pub max_attempts: u32,
}

/// The client-API view of a stored job and its hand-off `segments` (in
/// stream order; none for a job never handed off, or where the view leaves
/// them out).
pub fn to_proto(job: &JobRecord, segments: &[Segment]) -> v1::Job {
    v1::Job {
        id: job.id.to_string(),
        model: job.model.clone(),
        state: job.state.to_proto() as i32,
        attempt: job.attempt,
        node_id: job.node_id.clone().unwrap_or_default(),
        output_text: job.output_text.clone(),
        result: job.result.clone(),
        error: job.error.clone().unwrap_or_default(),
        created_at_ms: job.created_at_ms,
        updated_at_ms: job.updated_at_ms,
        sampling: Some(job.sampling.clone()),
        input: Some(job.input.clone()),
        priority: u32::from(job.priority),
        segments: segments.iter().map(segment_to_proto).collect(),
    }
}

/// The client-API view of a hand-off segment.
fn segment_to_proto(s: &Segment) -> v1::JobSegment {
    v1::JobSegment {
        node_id: s.node_id.clone(),
        attempt: s.attempt,
        first_index: s.first_index,
        token_ids: s.token_ids.clone(),
        claim: s.claim.clone(),
    }
}

/// The event that ends a watch, for a job in a terminal state; a completed
/// job's carries its hand-off `segments`.
pub fn terminal_event(job: &JobRecord, segments: &[Segment]) -> Option<JobEvent> {
    let event = match job.state {
        JobState::Completed => job_event::Event::Completed(job_event::Completed {
            job: Some(to_proto(job, segments)),
        }),
        JobState::Failed => job_event::Event::Failed(job_event::Failed {
            reason: job.error.clone().unwrap_or_default(),
        }),
        JobState::Cancelled => job_event::Event::Cancelled(job_event::Cancelled {}),
        _ => return None,
    };
    Some(JobEvent {
        job_id: job.id.to_string(),
        event: Some(event),
    })
}

/// Whether `event` ends a watch.
pub fn is_terminal_event(event: &JobEvent) -> bool {
    matches!(
        event.event,
        Some(
            job_event::Event::Completed(_)
                | job_event::Event::Failed(_)
                | job_event::Event::Cancelled(_)
        )
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn states_round_trip_through_their_names() {
        for s in [
            JobState::Queued,
            JobState::Assigned,
            JobState::Running,
            JobState::Completed,
            JobState::Failed,
            JobState::Cancelled,
        ] {
            assert_eq!(s.as_str().parse::<JobState>().unwrap(), s);
        }
        assert!("done".parse::<JobState>().is_err());
    }
}
