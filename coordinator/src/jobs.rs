//! The job state machine and the in-memory event hub that feeds `Watch`.
//!
//! States: `queued -> assigned -> running -> completed | failed | cancelled`;
//! a failed attempt may go back to `queued` with the next attempt number
//! (see the store). The store is the truth; the hub only carries what a
//! watcher needs live: state events, and the tokens of the current attempt so
//! far, so a watcher that arrives late replays them.
//!
//! # Invariants
//! - Token chunks are recorded and broadcast under one lock, so a subscriber
//!   sees every chunk exactly once: in its replay or live, never both.
//! - A job's buffer is kept when it is requeued: the next attempt resumes
//!   after those tokens (hand-off), so a late watcher replays the whole
//!   stream so far. It is dropped when the job ends; memory is bounded by
//!   unfinished jobs.
//!
//! # Failure
//! Nothing here fails; a watcher that falls behind the broadcast buffer
//! resynchronises from the store (see the Watch handler).

use std::{
    collections::HashMap,
    fmt,
    str::FromStr,
    sync::{Arc, Mutex},
};

use mlxnet_proto::{
    ids::JobId,
    v1::{self, job_event, JobEvent},
};
use tokio::sync::broadcast;

use crate::store::JobRecord;

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

/// The client-API view of a stored job.
pub fn to_proto(job: &JobRecord) -> v1::Job {
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
    }
}

/// The event that ends a watch, for a job in a terminal state.
pub fn terminal_event(job: &JobRecord) -> Option<JobEvent> {
    let event = match job.state {
        JobState::Completed => job_event::Event::Completed(job_event::Completed {
            job: Some(to_proto(job)),
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

const CHANNEL_CAPACITY: usize = 1024;

struct Live {
    tokens: Vec<job_event::Tokens>,
    tx: broadcast::Sender<JobEvent>,
}

/// Live events of unfinished jobs.
#[derive(Clone, Default)]
pub struct EventHub {
    inner: Arc<Mutex<HashMap<JobId, Live>>>,
}

/// What a new watcher gets: the tokens so far and the live feed after them.
pub struct Subscription {
    pub tokens: Vec<job_event::Tokens>,
    pub rx: broadcast::Receiver<JobEvent>,
}

impl EventHub {
    fn with<R>(&self, f: impl FnOnce(&mut HashMap<JobId, Live>) -> R) -> R {
        let mut guard = match self.inner.lock() {
            Ok(g) => g,
            Err(poisoned) => poisoned.into_inner(),
        };
        f(&mut guard)
    }

    fn live(map: &mut HashMap<JobId, Live>, job: JobId) -> &mut Live {
        map.entry(job).or_insert_with(|| Live {
            tokens: Vec::new(),
            tx: broadcast::channel(CHANNEL_CAPACITY).0,
        })
    }

    /// Subscribes to `job`'s events; the returned tokens precede everything
    /// the receiver will see.
    pub fn subscribe(&self, job: JobId) -> Subscription {
        self.with(|map| {
            let live = Self::live(map, job);
            Subscription {
                tokens: live.tokens.clone(),
                rx: live.tx.subscribe(),
            }
        })
    }

    /// A chunk of tokens of the current attempt.
    pub fn tokens(&self, job: JobId, chunk: job_event::Tokens) {
        self.with(|map| {
            let live = Self::live(map, job);
            live.tokens.push(chunk.clone());
            let _ = live.tx.send(JobEvent {
                job_id: job.to_string(),
                event: Some(job_event::Event::Tokens(chunk)),
            });
        })
    }

    /// Puts `chunk` (what earlier attempts streamed, read back from the
    /// store) in front of a job whose buffer is empty, e.g. after a
    /// coordinator restart, so late watchers still replay the whole stream.
    /// Live subscribers already saw those tokens (or will replay them on
    /// reconnect), so nothing is sent.
    pub fn seed(&self, job: JobId, chunk: job_event::Tokens) {
        self.with(|map| {
            let live = Self::live(map, job);
            if live.tokens.is_empty() && !chunk.token_ids.is_empty() {
                live.tokens.push(chunk);
            }
        })
    }

    /// A state event. A terminal event drops the job's entry after sending.
    /// A job with no entry (nobody watches it, no tokens kept) gets none: a
    /// watcher that comes later reads the state from the store. So queued
    /// jobs nobody watches cost no channel (each holds [`CHANNEL_CAPACITY`]
    /// slots), and memory does not grow with the queue.
    pub fn publish(&self, job: JobId, event: job_event::Event) {
        self.with(|map| {
            let terminal = matches!(
                event,
                job_event::Event::Completed(_)
                    | job_event::Event::Failed(_)
                    | job_event::Event::Cancelled(_)
            );
            let Some(live) = map.get_mut(&job) else {
                return;
            };
            let _ = live.tx.send(JobEvent {
                job_id: job.to_string(),
                event: Some(event),
            });
            if terminal {
                map.remove(&job);
            }
        })
    }

    /// Forgets a job nobody will publish for again (e.g. its watcher left and it ended).
    pub fn forget_if_idle(&self, job: JobId) {
        self.with(|map| {
            if map
                .get(&job)
                .is_some_and(|l| l.tx.receiver_count() == 0 && l.tokens.is_empty())
            {
                map.remove(&job);
            }
        })
    }

    /// Jobs with live state (for tests and metrics).
    pub fn len(&self) -> usize {
        self.with(|map| map.len())
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunk(index: u32, text: &str) -> job_event::Tokens {
        job_event::Tokens {
            index,
            token_ids: vec![index],
            text: text.into(),
        }
    }

    #[tokio::test]
    async fn a_late_watcher_replays_tokens_then_follows_live_without_duplicates() {
        let hub = EventHub::default();
        let job = JobId::new();
        hub.tokens(job, chunk(0, "Hel"));
        hub.tokens(job, chunk(1, "lo"));
        let mut sub = hub.subscribe(job);
        assert_eq!(
            sub.tokens
                .iter()
                .map(|t| t.text.as_str())
                .collect::<String>(),
            "Hello"
        );
        hub.tokens(job, chunk(2, "!"));
        hub.publish(job, job_event::Event::Cancelled(job_event::Cancelled {}));
        let live = sub.rx.recv().await.unwrap();
        assert!(matches!(live.event, Some(job_event::Event::Tokens(ref t)) if t.text == "!"));
        let end = sub.rx.recv().await.unwrap();
        assert!(is_terminal_event(&end));
        assert!(hub.is_empty(), "a finished job leaves no state behind");
    }

    #[tokio::test]
    async fn requeue_keeps_the_streamed_tokens_the_next_attempt_resumes_after() {
        let hub = EventHub::default();
        let job = JobId::new();
        hub.tokens(job, chunk(0, "kept"));
        hub.publish(
            job,
            job_event::Event::Queued(job_event::Queued {
                attempt: 2,
                reason: "node lost".into(),
            }),
        );
        hub.tokens(job, chunk(1, " on"));
        let replay = hub.subscribe(job).tokens;
        assert_eq!(
            replay.iter().map(|t| t.text.as_str()).collect::<String>(),
            "kept on"
        );
    }

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
