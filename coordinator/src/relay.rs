//! The token relay: a running job's tokens reach watchers on every replica,
//! not only on the one whose node runs the job.
//!
//! The replica driving an attempt hands each token chunk to its [`Relay`];
//! a writer task batches what is pending (up to [`BATCH`] items) into one
//! transaction ([`Store::append_tokens`]), which also wakes the other
//! replicas (PostgreSQL `LISTEN/NOTIFY`). A watcher anywhere reads the
//! job's chunks through a [`Follower`], in `(attempt, first index)` order,
//! after a cursor; it reads again on every wake-up, and at least every
//! [`POLL`] without one, so a lost notification delays a token but never
//! loses it.
//!
//! SQLite serves one replica, whose watchers follow the in-process hub
//! ([`crate::jobs`]): its relay is [`Relay::disabled`], nothing is written,
//! and Watch takes today's path.
//!
//! # Invariants
//! - One writer per replica, in submission order: a chunk is written no
//!   later than any chunk queued after it, and [`Relay::flush`] returns
//!   only after everything queued before it is committed. The dispatcher
//!   flushes before it records an attempt's end, so a job's row never says
//!   it ended before all its chunks can be read.
//! - A job has one attempt at a time, so its chunks are written by one
//!   writer at a time, in order: a follower's cursor never skips a row
//!   committed later.
//! - An attempt's unkept tokens are deleted when it fails
//!   ([`Relay::rewind`]), and any an earlier attempt left (a dead
//!   replica's) when the next attempt starts; every chunk of a job goes
//!   [`RETENTION`] after the job ended (the sweep's [`Relay::purge`]).
//!
//! # Failure
//! A failed batch is retried with backoff until it is written or the
//! replica stops (tokens are not dropped while it runs). A listener that
//! cannot connect retries; meanwhile followers poll.

use std::{
    collections::HashMap,
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc, Mutex,
    },
    time::Duration,
};

use mlxnet_proto::{ids::JobId, v1::job_event};
use tokio::sync::{mpsc, oneshot, Notify};
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use crate::{
    domain::RelayChunk,
    metrics::Metrics,
    store::{AnyStore, Store, StoreError, Wakeup},
    util::{error_chain, lock, now_ms},
};

/// Items (chunks, wake-ups, flushes) the writer takes per transaction.
pub const BATCH: usize = 256;
/// Items that may wait for the writer before a sender waits.
const QUEUE: usize = 8192;
/// How often a follower reads without a wake-up.
pub const POLL: Duration = Duration::from_millis(500);
/// How long a job's chunks stay after it ended: for watchers still reading
/// when it ended (a watcher that falls further behind is told to watch again).
pub const RETENTION: Duration = Duration::from_secs(300);
/// Chunks a follower reads per query.
const PAGE: u32 = 512;
/// Backoff after a failed batch, and the most it grows to.
const RETRY: Duration = Duration::from_millis(100);
const RETRY_MAX: Duration = Duration::from_secs(5);

enum Item {
    Chunk(RelayChunk),
    Wake(JobId),
    Flush(oneshot::Sender<()>),
}

/// Followers waiting for wake-ups, per job.
type Waiting = Mutex<HashMap<JobId, Vec<(u64, Arc<Notify>)>>>;

struct Inner {
    store: AnyStore,
    metrics: Arc<Metrics>,
    replica: String,
    queue: mpsc::Sender<Item>,
    followers: Waiting,
    next_follower: AtomicU64,
    poll: Duration,
    /// Whether the listener is connected (and so receives wake-ups).
    listening: tokio::sync::watch::Sender<bool>,
}

/// This replica's end of the token relay (cheap to clone).
#[derive(Clone, Default)]
pub struct Relay {
    inner: Option<Arc<Inner>>,
}

/// What a [`Relay`] is started with.
pub struct RelayParts {
    pub store: AnyStore,
    pub metrics: Arc<Metrics>,
    pub replica: String,
    /// Stops the writer and the listener.
    pub shutdown: CancellationToken,
    /// Whether to listen for wake-ups (false: followers only poll, as if
    /// every notification were lost).
    pub listen: bool,
    /// How often followers read without a wake-up ([`POLL`]).
    pub poll: Duration,
}

impl Relay {
    /// A relay that relays nothing: one replica (SQLite), whose watchers
    /// follow the in-process hub.
    pub fn disabled() -> Self {
        Self { inner: None }
    }

    /// The relay for `store`: [`Relay::disabled`] on SQLite, else started.
    pub fn for_store(
        store: &AnyStore,
        metrics: Arc<Metrics>,
        replica: &str,
        shutdown: CancellationToken,
    ) -> Self {
        match store {
            AnyStore::Postgres(_) => Self::start(RelayParts {
                store: store.clone(),
                metrics,
                replica: replica.to_owned(),
                shutdown,
                listen: true,
                poll: POLL,
            }),
            _ => Self::disabled(),
        }
    }

    /// Starts the writer (and the listener, if asked) until `shutdown`.
    pub fn start(parts: RelayParts) -> Self {
        let (queue, rx) = mpsc::channel(QUEUE);
        let inner = Arc::new(Inner {
            store: parts.store,
            metrics: parts.metrics,
            replica: parts.replica,
            queue,
            followers: Mutex::default(),
            next_follower: AtomicU64::new(0),
            poll: parts.poll,
            listening: tokio::sync::watch::Sender::new(false),
        });
        tokio::spawn(write_loop(Arc::clone(&inner), rx, parts.shutdown.clone()));
        if parts.listen {
            tokio::spawn(listen_loop(Arc::clone(&inner), parts.shutdown));
        }
        Self { inner: Some(inner) }
    }

    /// Waits until the listener receives wake-ups (for tests: a
    /// notification sent before that is lost, which only delays).
    pub async fn listening(&self) {
        if let Some(inner) = &self.inner {
            let mut rx = inner.listening.subscribe();
            let _ = rx.wait_for(|l| *l).await;
        }
    }

    /// Whether watchers read tokens through the relay.
    pub fn enabled(&self) -> bool {
        self.inner.is_some()
    }

    /// Queues a chunk `attempt` of `job` streamed (waits only while the
    /// writer is [`QUEUE`] items behind).
    pub async fn tokens(&self, job: JobId, attempt: u32, chunk: &job_event::Tokens) {
        if let Some(inner) = &self.inner {
            let item = Item::Chunk(RelayChunk {
                job,
                attempt,
                chunk: chunk.clone(),
            });
            let _ = inner.queue.send(item).await;
        }
    }

    /// Wakes the followers of `job` on every replica (its state changed).
    /// A hint: dropped when the writer is far behind (followers poll).
    pub fn wake(&self, job: JobId) {
        if let Some(inner) = &self.inner {
            wake_local(inner, Wakeup::Job(job));
            let _ = inner.queue.try_send(Item::Wake(job));
        }
    }

    /// Waits until everything queued so far is written (or the writer
    /// stopped).
    pub async fn flush(&self) {
        if let Some(inner) = &self.inner {
            let (done, written) = oneshot::channel();
            if inner.queue.send(Item::Flush(done)).await.is_ok() {
                let _ = written.await;
            }
        }
    }

    /// Deletes `job`'s chunks from token `keep` on written by attempts
    /// before `attempt` (see [`Store::rewind_tokens`]); flushes first, so
    /// none of them is still on its way. Logged on failure: a late watcher
    /// may then replay tokens the next attempt streams again, which its
    /// rewind replaces.
    pub async fn rewind(&self, job: JobId, attempt: u32, keep: u32) {
        if let Some(inner) = &self.inner {
            self.flush().await;
            if let Err(e) = inner.store.rewind_tokens(job, attempt, keep).await {
                warn!(error = %error_chain(&e), %job, "rewinding the relayed tokens failed");
            }
        }
    }

    /// Deletes the chunks of jobs that ended more than [`RETENTION`] before
    /// `now_ms`.
    pub async fn purge(&self, now_ms: i64) -> Result<u64, StoreError> {
        match &self.inner {
            Some(inner) => {
                let retention = i64::try_from(RETENTION.as_millis()).unwrap_or(i64::MAX);
                inner
                    .store
                    .purge_tokens(now_ms.saturating_sub(retention))
                    .await
            }
            None => Ok(0),
        }
    }

    /// Follows `job`'s chunks from the first; `None` when disabled.
    pub fn follow(&self, job: JobId) -> Option<Follower> {
        let inner = Arc::clone(self.inner.as_ref()?);
        let id = inner.next_follower.fetch_add(1, Ordering::Relaxed);
        let notify = Arc::new(Notify::new());
        lock(&inner.followers)
            .entry(job)
            .or_default()
            .push((id, Arc::clone(&notify)));
        Some(Follower {
            inner,
            job,
            id,
            notify,
            after: None,
        })
    }
}

/// One watcher's read position in a job's relayed chunks.
pub struct Follower {
    inner: Arc<Inner>,
    job: JobId,
    id: u64,
    notify: Arc<Notify>,
    after: Option<(u32, u32)>,
}

impl Follower {
    /// Waits for a wake-up of this job, or [`POLL`] at most.
    pub async fn changed(&self) {
        tokio::select! {
            _ = self.notify.notified() => {}
            _ = tokio::time::sleep(self.inner.poll) => {}
        }
    }

    /// The chunks written since the last read, in order.
    pub async fn read(&mut self) -> Result<Vec<RelayChunk>, StoreError> {
        let mut out = Vec::new();
        loop {
            let page = self
                .inner
                .store
                .tokens_after(self.job, self.after, PAGE)
                .await?;
            let full = page.len() == PAGE as usize;
            if let Some(last) = page.last() {
                self.after = Some((last.attempt, last.chunk.index));
            }
            out.extend(page);
            if !full {
                return Ok(out);
            }
        }
    }
}

impl Drop for Follower {
    fn drop(&mut self) {
        let mut followers = lock(&self.inner.followers);
        if let Some(list) = followers.get_mut(&self.job) {
            list.retain(|(id, _)| *id != self.id);
            if list.is_empty() {
                followers.remove(&self.job);
            }
        }
    }
}

/// Wakes this replica's followers of the job (or all, when wake-ups were lost).
fn wake_local(inner: &Inner, wakeup: Wakeup) {
    let followers = lock(&inner.followers);
    match wakeup {
        Wakeup::Job(job) => {
            for (_, n) in followers.get(&job).into_iter().flatten() {
                n.notify_one();
            }
        }
        Wakeup::Lost => {
            for (_, n) in followers.values().flatten() {
                n.notify_one();
            }
        }
    }
}

async fn write_loop(inner: Arc<Inner>, mut rx: mpsc::Receiver<Item>, shutdown: CancellationToken) {
    loop {
        let first = tokio::select! {
            biased;
            item = rx.recv() => match item {
                Some(item) => item,
                None => return,
            },
            _ = shutdown.cancelled() => return,
        };
        let mut items = vec![first];
        while items.len() < BATCH {
            match rx.try_recv() {
                Ok(item) => items.push(item),
                Err(_) => break,
            }
        }
        let mut chunks = Vec::new();
        let mut wake = Vec::new();
        let mut flushes = Vec::new();
        for item in items {
            match item {
                Item::Chunk(c) => chunks.push(c),
                Item::Wake(job) => wake.push(job),
                Item::Flush(done) => flushes.push(done),
            }
        }
        if !chunks.is_empty() || !wake.is_empty() {
            let mut tries = 0u32;
            loop {
                match inner.store.append_tokens(&chunks, &wake, now_ms()).await {
                    Ok(()) => {
                        if !chunks.is_empty() {
                            inner.metrics.relay_batch_written(&inner.replica);
                        }
                        // This replica's own followers need no notification.
                        let mut jobs: Vec<JobId> = chunks.iter().map(|c| c.job).collect();
                        jobs.dedup();
                        for job in jobs {
                            wake_local(&inner, Wakeup::Job(job));
                        }
                        break;
                    }
                    Err(e) if !shutdown.is_cancelled() => {
                        tries = tries.saturating_add(1);
                        warn!(error = %error_chain(&e), tries, "writing relayed tokens failed; retrying");
                        tokio::time::sleep((RETRY * tries).min(RETRY_MAX)).await;
                    }
                    Err(e) => {
                        warn!(error = %error_chain(&e), "writing relayed tokens failed at shutdown");
                        return;
                    }
                }
            }
        }
        for done in flushes {
            let _ = done.send(());
        }
    }
}

async fn listen_loop(inner: Arc<Inner>, shutdown: CancellationToken) {
    loop {
        let wakeups = tokio::select! {
            _ = shutdown.cancelled() => return,
            w = inner.store.token_wakeups() => w,
        };
        let mut wakeups = match wakeups {
            Ok(w) => {
                inner.listening.send_replace(true);
                w
            }
            Err(e) => {
                warn!(error = %error_chain(&e), "listening for relayed tokens failed; followers poll");
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = tokio::time::sleep(RETRY_MAX) => continue,
                }
            }
        };
        loop {
            let wakeup = tokio::select! {
                _ = shutdown.cancelled() => {
                    inner.listening.send_replace(false);
                    return;
                }
                w = wakeups.next() => w,
            };
            if let Wakeup::Job(_) = wakeup {
                inner.metrics.relay_notified(&inner.replica);
            } else {
                debug!("token wake-ups may have been lost; waking every follower");
            }
            wake_local(&inner, wakeup);
        }
    }
}

#[cfg(test)]
mod tests;
