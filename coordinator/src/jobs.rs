//! The in-memory event hub that feeds `Watch` (the job states themselves
//! are [`crate::domain::JobState`]). The store is the truth; the hub only carries what a
//! watcher needs live: state events, and the tokens of the current attempt so
//! far, so a watcher that arrives late replays them.
//!
//! # Invariants
//! - Token chunks are recorded and broadcast under one lock, so a subscriber
//!   sees every chunk exactly once: in its replay or live, never both.
//! - A job's buffer is kept when it is requeued: the next attempt resumes
//!   after those tokens (hand-off), so a late watcher replays the whole
//!   stream so far; the tokens of an attempt the job does not resume after
//!   are taken out ([`EventHub::rewind`]). It is dropped when the job ends; memory is bounded by
//!   unfinished jobs.
//!
//! # Failure
//! Nothing here fails; a watcher that falls behind the broadcast buffer
//! resynchronises from the store (see the Watch handler).

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
};

use mlxnet_proto::{
    ids::JobId,
    v1::{job_event, JobEvent},
};
use tokio::sync::broadcast;

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

    /// Forgets the chunks from token `keep` on (an attempt whose unsigned
    /// tokens the job does not keep), so late watchers replay only what
    /// the next attempt resumes after. Live subscribers see the next
    /// attempt's chunks start again at `keep`.
    pub fn rewind(&self, job: JobId, keep: u32) {
        self.with(|map| {
            if let Some(live) = map.get_mut(&job) {
                live.tokens.retain(|t| t.index < keep);
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
    use crate::domain::job::is_terminal_event;

    fn chunk(index: u32, text: &str) -> job_event::Tokens {
        job_event::Tokens {
            index,
            token_ids: vec![index],
            text: text.into(),
            logprobs: Vec::new(),
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
}
