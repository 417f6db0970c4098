//! The dispatcher: owns the coordinator's shared state and moves jobs through
//! their lives. It queues submitted jobs, places queued jobs on node sessions
//! (woken on submit, node join, heartbeat and job end, with a slow tick as a
//! safety net), drives each attempt over its QUIC stream, records verified
//! results, requeues lost or refused attempts (bounded), and cancels.
//! An attempt holds a lease renewed by each update from its node; a lease
//! that runs out (`job_lease_ms` without progress) fails the attempt like a
//! lost stream, so the job is requeued and its watchers see why.
//!
//! Hand-off: an attempt whose node drained leaves the tokens it streamed as
//! a segment (`store::segments`) under its signed partial claim; the next
//! attempt is assigned the job's input plus every segment's tokens
//! (`Assignment.resume`) and streams on from there, so the watcher sees one
//! stream with no gap and no repeat. A drained
//! node's partial claim (`finish_reason` "handoff") must cover exactly the
//! tokens it streamed; it is kept with its segment and pays that node (see
//! `ledger::settle`). A hand-off claim from a node that never sent `Drain`
//! is refused. Unsigned tokens are never kept: an attempt that fails, is
//! refused or stalls, or whose node vanished (a lost connection: killed,
//! power lost; it signed nothing) leaves nothing, and the stream rewinds to
//! the last kept segment, so every kept token is covered by a signed claim
//! and a client verifies the result against its own input. An attempt that
//! streams more than its `max_tokens` allow is refused as it streams.
//! Requeued jobs go ahead of new ones (queue level 1), so an interrupted
//! stream resumes first.
//!
//! # Invariants
//! - Every state change goes through the store's guarded transitions first;
//!   events are published to watchers only after the store accepted them.
//! - A node's job slot is reserved before the store assignment and released
//!   before placement is woken again, so a node is never over-filled and a
//!   requeued job can go straight back to a node that just freed up.
//! - On shutdown, attempts stop without touching the store; the next start
//!   requeues them (`Store::requeue_orphans`).
//!
//! # Failure
//! Store errors in the background loops are logged and retried on the next
//! wake; they never take the process down.

use std::{
    collections::{BTreeSet, HashMap, HashSet},
    sync::{Arc, Mutex},
    time::Duration,
};

use mlxnet_proto::{
    claim,
    frame::FrameError,
    grammar,
    ids::{JobId, NodeId},
    v1::{job_event, job_input, job_update, Assignment, JobInput, Resume, SignedClaim},
};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, instrument, warn};

#[cfg(test)]
mod adversary_tests;
mod audit;
#[cfg(test)]
mod audit_adversary_tests;
#[cfg(test)]
mod placement_adversary_tests;
#[cfg(test)]
mod reward_adversary_tests;
pub mod sweep;

use crate::{
    audit::Audits,
    catalogue::{Catalogue, Model},
    domain::{
        job::terminal_event, AttemptEnd, CancelOutcome, Completion, JobRecord, JobState, JobTerms,
        NewJob, RecordDelta, Segment, Streamed, StreamedEnd,
    },
    jobs::EventHub,
    ledger::{self, Ledger, LedgerError},
    link::{
        job::{
            check_result, check_streamed, Expected, JobStream, CODE_CANCELLED, CODE_REFUSED,
            CODE_TIMEOUT,
        },
        session::{Reservation, Session, Sessions, MAX_REASON_CHARS},
    },
    metrics::Metrics,
    relay::Relay,
    scheduler::{self, affinity, Affinity, Evidence, Queue, Target},
    store::{AnyStore, Store, StoreError},
    util::{clip, error_chain, lock, now_ms, Tasks},
    world::World,
};

/// How long a hand-off claim waits for its node's `Drain` (which travels
/// on the control stream, so it may arrive just after the claim).
const DRAIN_WAIT: Duration = Duration::from_secs(2);
/// Bytes of text an attempt may stream per token it may stream, and once
/// more for the resumed tokens' held-back text: a token's text is a few
/// bytes, so a node streaming more is refused before it is buffered.
const MAX_TEXT_BYTES_PER_TOKEN: usize = 256;
const TEXT_SLACK_BYTES: usize = 4096;

/// How often placement runs even when nothing woke it.
const PLACEMENT_TICK: Duration = Duration::from_secs(2);
/// Queued jobs considered per placement pass.
const PLACEMENT_BATCH: u32 = 256;

/// A claimed job and the account paying for it.
type Claimed = (JobRecord, Option<String>);

/// A job a placement pass picked, its node's memory reserved.
struct Planned {
    job: JobRecord,
    /// The account paying for it (the claim's, for a job planned again).
    account: Option<String>,
    node: NodeId,
    model: Model,
    reservation: Reservation,
    /// The reservations on a pod's other members.
    held: Vec<Reservation>,
    /// The job's input prefixes, and how many bytes of them the node last
    /// ran (see [`affinity`]).
    prefixes: Vec<affinity::Prefix>,
    prefix_match: u64,
    reason: String,
}

/// The dispatcher's settings (top-level keys of the coordinator's config
/// file, gathered by `config`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DispatchConfig {
    /// Attempts per job before it fails for good (`limits.max_attempts`).
    pub max_attempts: u32,
    /// Longest a single attempt may run before it is failed and requeued
    /// (`job_timeout_ms`); also how long an audit may take without a window.
    pub job_timeout_ms: u64,
    /// An attempt's lease: the node must show progress at least this often
    /// (`job_lease_ms`).
    pub job_lease_ms: u64,
    /// This replica's name: the holder of the singleton duties' leases
    /// (`replica_id`, resolved to a random one at start when unset).
    pub replica_id: String,
}

/// What the dispatcher is built from: its settings and the handles it
/// shares with the node link and the API (built once, by `app`).
pub struct Parts {
    pub config: DispatchConfig,
    pub store: AnyStore,
    /// Accounts, holds and settlement, in the store's database.
    pub ledger: Ledger,
    pub catalogue: Arc<Catalogue>,
    /// Audit records and bans (see [`crate::audit`]).
    pub audits: Arc<Audits>,
    pub hub: EventHub,
    /// Running jobs' tokens, to watchers on other replicas.
    pub relay: Relay,
    pub sessions: Sessions,
    pub metrics: Arc<Metrics>,
    /// The World page's view of the nodes (see [`crate::world`]).
    pub world: World,
    /// Wakes the placement loop (a node joined, beat or left; a job ended).
    pub wake: Arc<Notify>,
    /// Tasks the application waits for on shutdown.
    pub tasks: Arc<Tasks>,
    /// Cancelled when the application stops.
    pub shutdown: CancellationToken,
    /// Cancelled when the replica starts draining (before `shutdown`):
    /// placement claims no more queued jobs; running attempts go on.
    pub drain: CancellationToken,
}

/// The dispatcher of a running coordinator: places jobs and drives their
/// attempts. Its state is its own; callers use its methods.
pub struct Dispatcher {
    config: DispatchConfig,
    store: AnyStore,
    ledger: Ledger,
    catalogue: Arc<Catalogue>,
    hub: EventHub,
    relay: Relay,
    sessions: Sessions,
    metrics: Arc<Metrics>,
    world: World,
    audits: Arc<Audits>,
    wake: Arc<Notify>,
    running: Mutex<HashMap<JobId, CancellationToken>>,
    /// The nodes whose attempts of a job failed (hex): its later
    /// placements avoid every one of them while another node can take it
    /// (not only the last: a job must not go A, B, A while C is free). Kept
    /// in memory (a hint, not a record), dropped when the job completes,
    /// is cancelled or fails for good, and bounded by [`FAILED_ON_MAX`].
    failed_on: Mutex<HashMap<JobId, BTreeSet<String>>>,
    /// What each node has shown (decayed reliability, observed decode
    /// speed), which placement ranks it by instead of its Hello's figures
    /// alone. In memory, per process, like `failed_on`; bounded by
    /// [`EVIDENCE_MAX`] (past it, only connected nodes are kept).
    evidence: Mutex<HashMap<NodeId, Evidence>>,
    /// Which nodes last ran which input prefixes, so placement prefers a
    /// node whose prefix cache holds a job's (a hint, in memory, bounded
    /// by [`AFFINITY_KEYS`]; see [`affinity`]).
    affinity: Mutex<Affinity>,
    shutdown: CancellationToken,
    drain: CancellationToken,
    tasks: Arc<Tasks>,
    /// Attempt tasks not yet ended (their end recorded, or given up at
    /// shutdown), and what wakes [`Dispatcher::attempts_ended`].
    attempts: Arc<(std::sync::atomic::AtomicUsize, Notify)>,
}

/// Counts one attempt task from its spawn to its end.
struct AttemptGuard(Arc<(std::sync::atomic::AtomicUsize, Notify)>);

impl AttemptGuard {
    fn new(count: &Arc<(std::sync::atomic::AtomicUsize, Notify)>) -> Self {
        count.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Self(Arc::clone(count))
    }
}

impl Drop for AttemptGuard {
    fn drop(&mut self) {
        self.0 .0.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
        self.0 .1.notify_waiters();
    }
}

/// The most jobs [`Dispatcher`] remembers a failed node for (a job
/// cancelled while queued leaves its entry; past this, all are dropped).
const FAILED_ON_MAX: usize = 100_000;

/// The most nodes [`Dispatcher`] keeps [`Evidence`] for (past this, the
/// evidence of nodes not connected is dropped).
const EVIDENCE_MAX: usize = 100_000;

/// Input prefixes [`Dispatcher`] remembers nodes for (about 20 MB).
const AFFINITY_KEYS: usize = 1 << 16;

/// The backoff step between tries of recording an attempt's end after a
/// store error, and the most it grows to.
const RECORD_BACKOFF: Duration = Duration::from_millis(100);
const RECORD_BACKOFF_MAX: Duration = Duration::from_secs(5);

/// How long to wait before the next try of recording an attempt's end,
/// after its `tries`-th store error (None: give up). It never gives up
/// while the coordinator runs: the end is guarded by the attempt number
/// (a repeat changes nothing), and a job whose end is not recorded stays
/// assigned to nobody until the next start (found by the simulator: a
/// store outage of 0.6 s left jobs running for ever, seed 38). The
/// simulator (`mlxnet-sim`) retries by the same rule.
pub fn record_backoff(tries: u32) -> Option<Duration> {
    Some((RECORD_BACKOFF * tries).min(RECORD_BACKOFF_MAX))
}

/// How an attempt ended, as seen from its stream.
#[derive(Clone)]
enum Outcome {
    Completed(SignedClaim),
    Failed {
        reason: String,
        retryable: bool,
    },
    /// The node drained and handed the job back with this verified partial
    /// claim of the tokens it streamed.
    HandedOff(SignedClaim),
    Cancelled,
    Shutdown,
}

/// Queue level of requeued jobs: ahead of new ones, so a client's
/// interrupted stream resumes first (bounded by `max_attempts`).
const RESUME_LEVEL: u8 = 1;

impl Dispatcher {
    pub fn new(parts: Parts) -> Arc<Self> {
        let Parts {
            config,
            store,
            ledger,
            catalogue,
            audits,
            hub,
            relay,
            sessions,
            metrics,
            world,
            wake,
            tasks,
            shutdown,
            drain,
        } = parts;
        Arc::new(Self {
            config,
            store,
            ledger,
            catalogue,
            hub,
            relay,
            sessions,
            metrics,
            world,
            audits,
            wake,
            running: Mutex::new(HashMap::new()),
            failed_on: Mutex::new(HashMap::new()),
            evidence: Mutex::new(HashMap::new()),
            affinity: Mutex::new(Affinity::new(AFFINITY_KEYS)),
            shutdown,
            drain,
            tasks,
            attempts: Arc::default(),
        })
    }

    /// Returns once no attempt task is left: every attempt's end is
    /// recorded (how a draining replica finishes its in-flight writes
    /// before it releases its leases).
    pub async fn attempts_ended(&self) {
        loop {
            let notified = self.attempts.1.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.attempts.0.load(std::sync::atomic::Ordering::SeqCst) == 0 {
                return;
            }
            notified.await;
        }
    }

    /// Cancelled when the application stops.
    pub fn shutdown_token(&self) -> &CancellationToken {
        &self.shutdown
    }

    /// Sends `event` to `job`'s watchers: this replica's through the hub,
    /// and a wake-up to the other replicas' (they read the state from the
    /// store).
    fn publish(&self, job: JobId, event: job_event::Event) {
        self.hub.publish(job, event);
        self.relay.wake(job);
    }

    /// Asks the placement loop to run soon.
    pub fn wake(&self) {
        self.wake.notify_one();
    }

    /// Spawns a task that the application waits for on shutdown.
    pub fn spawn(&self, fut: impl std::future::Future<Output = ()> + Send + 'static) {
        self.tasks.spawn(fut);
    }

    /// Queues a validated job, with its hold placed in the same transaction.
    pub async fn submit(&self, job: NewJob, terms: &JobTerms) -> Result<JobRecord, LedgerError> {
        let started = std::time::Instant::now();
        let record = self.ledger.submit_job(&job, terms, now_ms()).await?;
        Metrics::observe(&self.metrics.submit_seconds, started.elapsed());
        self.metrics.jobs_submitted.inc();
        // The hub only: no watcher elsewhere can know the job before
        // Submit answers (a watch reads the row when it starts), so a
        // relay wake-up here would cost a NOTIFY per submit for nothing.
        self.hub.publish(
            record.id,
            job_event::Event::Queued(job_event::Queued {
                attempt: record.attempt,
                reason: String::new(),
            }),
        );
        self.wake();
        Ok(record)
    }

    /// Settles `id` (pay, refund, fee; logged, never failing the caller),
    /// timed.
    pub async fn settle(&self, id: JobId) {
        let started = std::time::Instant::now();
        ledger::settle_logged(&self.ledger, id).await;
        Metrics::observe(&self.metrics.settlement_seconds, started.elapsed());
    }

    /// Cancels a job: the store first, then the running attempt's stream.
    pub async fn cancel(&self, id: JobId) -> Result<CancelOutcome, StoreError> {
        let outcome = self.store.cancel(id).await?;
        if outcome == CancelOutcome::Cancelled {
            if let Some(token) = lock(&self.running).remove(&id) {
                token.cancel();
            }
            self.hub
                .publish(id, job_event::Event::Cancelled(job_event::Cancelled {}));
            self.settle(id).await;
            self.wake();
        }
        Ok(outcome)
    }

    /// Runs placement passes until shutdown.
    pub async fn placement_loop(self: Arc<Self>) {
        loop {
            tokio::select! {
                _ = self.shutdown.cancelled() => return,
                _ = self.wake.notified() => {}
                _ = tokio::time::sleep(PLACEMENT_TICK) => {}
            }
            if let Err(e) = self.place_queued().await {
                warn!(error = %error_chain(&e), "placement pass failed");
            }
        }
    }

    /// One pass: the oldest queued jobs this replica claims (see
    /// [`Store::claim_queued`]: another replica's pass never sees the same
    /// jobs at once), in the scheduler's priority and fair-share order, each
    /// onto the node the cost model picks among this replica's sessions. The
    /// node's memory is reserved before the claim commits its assignment.
    async fn place_queued(self: &Arc<Self>) -> Result<(), StoreError> {
        // A draining replica claims nothing: its nodes are leaving, and
        // the jobs stay queued for the other replicas.
        if self.sessions.is_empty() || self.drain.is_cancelled() {
            return Ok(());
        }
        let mut plan = Vec::new();
        let assigned = self
            .store
            .claim_queued(PLACEMENT_BATCH, |claimed| {
                // The sessions are read here, after the store has read the
                // queued jobs: a node that joined before a job was
                // submitted is a candidate for it (a snapshot taken before
                // the store's read could miss it and hand the job to the
                // nodes of an earlier moment).
                // A node banned after failed audits is never placed, nor
                // one held back while audits of its work that could ban it
                // run (`Audits::held`).
                let sessions: Vec<_> = self
                    .sessions
                    .all()
                    .into_iter()
                    .filter(|s| !self.audits.is_banned(&s.node_id) && !self.audits.held(&s.node_id))
                    .collect();
                let online: HashSet<NodeId> = sessions.iter().map(|s| s.node_id).collect();
                lock(&self.affinity).retain_nodes(|id| online.contains(id));
                // Probation's share of placement (see `audit`): a node on
                // probation takes at most `probation_running` jobs at once beside
                // the established nodes (pass 1); the jobs left go to established
                // nodes (pass 2), then to anyone (pass 3: a network of new nodes
                // still runs every job). A retried job is not handed back to a
                // node whose attempt failed it while another node could ever
                // take it, even one busy now (every pass; see
                // [`Self::plan_last`]).
                let cap = self.audits.config.probation_running;
                let mut room: HashMap<NodeId, u32> = HashMap::new();
                let mut first = Vec::new();
                let mut established = Vec::new();
                for s in &sessions {
                    if self.audits.on_probation(&s.node_id) {
                        let left = cap.saturating_sub(s.running_jobs());
                        if left > 0 {
                            room.insert(s.node_id, left);
                            first.push(Arc::clone(s));
                        }
                    } else {
                        established.push(Arc::clone(s));
                        first.push(Arc::clone(s));
                    }
                }
                let (placed, mut left) = self.plan_away(&first, claimed);
                for p in placed {
                    match room.get_mut(&p.node) {
                        Some(0) => left.push((p.job.clone(), p.account.clone())),
                        Some(n) => {
                            *n -= 1;
                            plan.push(p);
                        }
                        None => plan.push(p),
                    }
                }
                let (placed, left) = self.plan_away(&established, left);
                plan.extend(placed);
                if !left.is_empty() {
                    plan.extend(self.plan_last(&sessions, left));
                }
                plan.iter()
                    .map(|p| (p.job.id, p.job.attempt, p.node.to_string()))
                    .collect()
            })
            .await;
        let assigned = match assigned {
            Ok(assigned) => assigned,
            Err(e) if plan.is_empty() => return Err(e),
            // The commit may have landed with only its answer lost (the
            // database went away): jobs it assigned would then stay
            // assigned with no attempt running them, so what it did is
            // read back.
            Err(e) => {
                warn!(error = %error_chain(&e), "the placement's commit failed; reading back what it assigned");
                self.assigned_after_all(&plan).await
            }
        };
        for (p, assigned) in plan.into_iter().zip(assigned) {
            if !assigned || self.shutdown.is_cancelled() {
                continue;
            }
            let Planned {
                job,
                node,
                model,
                reservation,
                held,
                prefixes,
                prefix_match,
                reason,
                ..
            } = p;
            // A single node's prefix cache now holds the job's input (a
            // pod's is not tracked).
            let check = if held.is_empty() {
                let mut held_by = lock(&self.affinity);
                held_by.record(node, &prefixes);
                (prefix_match > 0).then(|| {
                    self.metrics.prefix_affinity_placements.inc();
                    held_by.expect_hit(node, &prefixes)
                })
            } else {
                None
            };
            Metrics::observe_since_ms(&self.metrics.placement_seconds, job.updated_at_ms, now_ms());
            let token = self.shutdown.child_token();
            lock(&self.running).insert(job.id, token.clone());
            self.publish(
                job.id,
                job_event::Event::Assigned(job_event::Assigned {
                    node_id: node.to_string(),
                    attempt: job.attempt,
                }),
            );
            debug!(job_id = %job.id, node = %node.short(), attempt = job.attempt, reason = %reason, "assigned");
            let this = Arc::clone(self);
            let counted = AttemptGuard::new(&self.attempts);
            self.spawn(async move {
                let wake = Arc::clone(&this);
                this.run_attempt(job, model, reservation, token).await;
                if let Some(check) = check {
                    lock(&wake.affinity).ended(&node, check);
                }
                drop(held);
                drop(counted);
                wake.wake();
            });
        }
        Ok(())
    }

    /// [`Self::plan`], with each retried job kept off every node whose
    /// attempt failed it; returns the plan and the jobs not placed.
    fn plan_away(
        &self,
        sessions: &[Arc<Session>],
        claimed: Vec<Claimed>,
    ) -> (Vec<Planned>, Vec<Claimed>) {
        let mut groups: Vec<(BTreeSet<String>, Vec<Claimed>)> = Vec::new();
        for (job, account) in claimed {
            let avoid = lock(&self.failed_on)
                .get(&job.id)
                .cloned()
                .filter(|_| job.attempt > 1)
                .unwrap_or_default();
            match groups.iter_mut().find(|(a, _)| *a == avoid) {
                Some((_, jobs)) => jobs.push((job, account)),
                None => groups.push((avoid, vec![(job, account)])),
            }
        }
        let mut plan = Vec::new();
        let mut left = Vec::new();
        for (avoid, jobs) in groups {
            let away: Vec<_> = sessions
                .iter()
                .filter(|s| !avoid.contains(&s.node_id.to_string()))
                .cloned()
                .collect();
            let ids: Vec<_> = jobs.iter().map(|(j, a)| (j.clone(), a.clone())).collect();
            let placed = if away.is_empty() {
                Vec::new()
            } else {
                self.plan(&away, jobs)
            };
            left.extend(
                ids.into_iter()
                    .filter(|(j, _)| !placed.iter().any(|p| p.job.id == j.id)),
            );
            plan.extend(placed);
        }
        (plan, left)
    }

    /// The last pass ("anyone"): [`Self::plan_away`] over every session,
    /// then the jobs still left that no node but those that failed them
    /// could ever run go back to those nodes (a small network still
    /// retries, up to `max_attempts`). A job another node could run stays
    /// queued for it, even while that node is busy: handing it back to a
    /// node that already failed it is how a job failed for good on
    /// attempts by A, B, A in the mixed-fleet run while honest nodes were
    /// full.
    fn plan_last(&self, sessions: &[Arc<Session>], claimed: Vec<Claimed>) -> Vec<Planned> {
        let (mut plan, left) = self.plan_away(sessions, claimed);
        let mut back = Vec::new();
        for (job, account) in left {
            if self.another_could_run(sessions, &job) {
                debug!(job_id = %job.id, attempt = job.attempt, "retry waits for a node that has not failed it");
            } else {
                back.push((job, account));
            }
        }
        if !back.is_empty() {
            plan.extend(self.plan(sessions, back));
        }
        plan
    }

    /// Whether a node among `sessions` whose attempt never failed `job`
    /// could ever run it: it holds the model file and takes jobs (not
    /// draining; a pod through its leader) with the memory the job needs,
    /// busy or not. True for a job no node has failed.
    fn another_could_run(&self, sessions: &[Arc<Session>], job: &JobRecord) -> bool {
        let avoid = match lock(&self.failed_on).get(&job.id) {
            Some(failed) if job.attempt > 1 => failed.clone(),
            _ => return true,
        };
        let Some(model) = self.catalogue.get(&job.model) else {
            return false;
        };
        let others: Vec<_> = sessions
            .iter()
            .filter(|s| !avoid.contains(&s.node_id.to_string()) && s.serves(&model.sha256))
            .cloned()
            .collect();
        if others.is_empty() {
            return false;
        }
        let shape = model.job(input_bytes(&job.input), job.sampling.max_tokens);
        // A busy node offers no free slot to the fleet, but it is one the
        // job can wait for.
        let need = shape.memory_needed();
        let single = others
            .iter()
            .any(|s| s.pod.is_none() && s.max_concurrent_jobs > 0 && s.spec().memory_bytes >= need);
        single || Sessions::fleet(&others, &lock(&self.evidence)).could_ever_run(&shape)
    }

    /// Places `claimed` (each job with its paying account) onto `sessions`,
    /// reserving each pick's memory on its node (and on a pod's other
    /// members).
    fn plan(
        &self,
        sessions: &[Arc<Session>],
        claimed: Vec<(JobRecord, Option<String>)>,
    ) -> Vec<Planned> {
        let mut fleet = Sessions::fleet(sessions, &lock(&self.evidence));
        let mut queue = Queue::new(claimed.len());
        let mut accounts: HashMap<JobId, Option<String>> = HashMap::new();
        for (job, account) in claimed {
            accounts.insert(job.id, account.clone());
            // Fair share across the accounts that pay (the ledger's holds);
            // a job's priority orders only its own account's jobs.
            let account = account.unwrap_or_default();
            let level = if job.attempt > 1 { RESUME_LEVEL } else { 0 };
            let _ = queue.push_ranked(&account, level, job.priority, job);
        }
        let mut prefixes: HashMap<JobId, Vec<affinity::Prefix>> = HashMap::new();
        let placed = {
            let mut held_by = lock(&self.affinity);
            for s in sessions {
                let dropped = held_by.report(s.node_id, s.prefix_report());
                let n = u64::from(dropped.reset) + dropped.missed as u64;
                if n > 0 {
                    debug!(node = %s.node_id.short(), reset = dropped.reset, missed = dropped.missed, "prefix affinity dropped");
                    self.metrics.prefix_affinity_dropped.inc_by(n);
                }
            }
            scheduler::schedule_with(&mut queue, &mut fleet, |job| {
                let model = self.catalogue.get(&job.model)?;
                let keys = prefixes
                    .entry(job.id)
                    .or_insert_with(|| affinity::prefixes(&model.sha256, &job.input));
                Some((
                    model.job(input_bytes(&job.input), job.sampling.max_tokens),
                    held_by.matches(keys),
                ))
            })
        };
        let mut plan = Vec::with_capacity(placed.len());
        for (job, placement) in placed {
            if self.shutdown.is_cancelled() {
                break;
            }
            let Some(model) = self.catalogue.get(&job.model).cloned() else {
                continue;
            };
            // A pod's job goes to its leader (rank 0), which speaks for the
            // pod; every other member's slot and share are held meanwhile.
            let (node, others) = match &placement.target {
                Target::Node(node) => (*node, &[][..]),
                Target::Pod { members, .. } => match members.split_first() {
                    Some((leader, others)) => (*leader, others),
                    None => continue,
                },
            };
            let Some(session) = sessions.iter().find(|s| s.node_id == node) else {
                continue;
            };
            if session.connection.close_reason().is_some() {
                // Gone; its clean-up has not run yet.
                continue;
            }
            let held: Vec<Reservation> = others
                .iter()
                .filter_map(|m| sessions.iter().find(|s| s.node_id == *m))
                .map(|s| s.reserve(placement.memory_per_member))
                .collect();
            if held.len() != others.len() {
                continue;
            }
            plan.push(Planned {
                reservation: session.reserve(placement.memory_per_member),
                account: accounts.remove(&job.id).flatten(),
                prefixes: prefixes.remove(&job.id).unwrap_or_default(),
                prefix_match: placement.prefix_match,
                job,
                node,
                model,
                held,
                reason: placement.reason,
            });
        }
        plan
    }

    /// Why no online node could ever hold `job` (None if one could, or if no
    /// node is online: one may join).
    pub fn never_fits(&self, job: &NewJob) -> Option<String> {
        let model = self.catalogue.get(&job.model)?;
        let sessions = self.sessions.all();
        if sessions.is_empty() {
            return None;
        }
        let fleet = Sessions::fleet(&sessions, &lock(&self.evidence));
        let shape = model.job(input_bytes(&job.input), job.sampling.max_tokens);
        if fleet.could_ever_hold(&shape) {
            return None;
        }
        Some(format!(
            "needs {:.1} GB, largest node or pod has {:.1} GB",
            shape.memory_needed() as f64 / 1e9,
            fleet.largest_capacity() as f64 / 1e9
        ))
    }

    #[instrument(skip_all, fields(job_id = %job.id, attempt = job.attempt, node = %reservation.session().node_id.short()))]
    async fn run_attempt(
        self: Arc<Self>,
        job: JobRecord,
        model: Model,
        reservation: Reservation,
        cancel: CancellationToken,
    ) {
        let session = Arc::clone(reservation.session());
        let node_hex = session.node_id.to_string();
        let _ = self
            .world
            .set_status(&node_hex, crate::world::Status::Serving);
        let (outcome, mut segment) = self.drive(&job, &model, &session, &cancel).await;
        // Every relayed chunk of the attempt is written before its end is
        // recorded, so a watcher that reads the end has every token.
        self.relay.flush().await;
        self.learn(session.node_id, &job, &model, &outcome);
        if matches!(outcome, Outcome::Completed(_) | Outcome::Cancelled) {
            lock(&self.failed_on).remove(&job.id);
        }
        // A job has one attempt at a time, so the entry (if a cancel did not
        // already take it) is this attempt's.
        lock(&self.running).remove(&job.id);
        // Recording is guarded by the attempt number (a repeat changes
        // nothing), so a store error (e.g. the database busy past its
        // timeout) is retried a few times before the job is left to the
        // restart's orphan requeue.
        if matches!(outcome, Outcome::Failed { .. }) {
            {
                let mut failed_on = lock(&self.failed_on);
                if failed_on.len() >= FAILED_ON_MAX {
                    failed_on.clear();
                }
                failed_on
                    .entry(job.id)
                    .or_default()
                    .insert(node_hex.clone());
            }
            self.count_work(
                &node_hex,
                RecordDelta {
                    failed_attempts: 1,
                    ..RecordDelta::default()
                },
            )
            .await;
        }
        let mut tries = 0;
        loop {
            let result = match outcome.clone() {
                Outcome::Completed(signed) => self.record_completion(&job, &node_hex, signed).await,
                Outcome::Failed { reason, retryable } => {
                    // A pod leader's failure takes its pod out of placement
                    // until its next heartbeat says it is whole again.
                    if retryable && session.pod.as_ref().is_some_and(|p| p.rank == 0) {
                        session.report_pod_degraded(&reason);
                    }
                    // No unsigned tokens are kept in the job, whether the
                    // node is still there (it failed, stalled or was
                    // refused) or gone (a lost connection: it signed
                    // nothing, and nothing tells a power loss from a node
                    // that streamed junk and left): the next attempt starts
                    // after the last kept segment, and the live stream
                    // rewinds to it.
                    if !segment.token_ids.is_empty() {
                        segment.token_ids.clear();
                        segment.text.clear();
                        self.hub.rewind(job.id, segment.first_index);
                        self.relay
                            .rewind(job.id, job.attempt.saturating_add(1), segment.first_index)
                            .await;
                    }
                    self.record_failure(&job, &node_hex, &reason, retryable, &segment)
                        .await
                }
                Outcome::HandedOff(signed) => {
                    let reason = format!(
                        "the node drained; handed off after token {}",
                        segment.first_index as usize + segment.token_ids.len()
                    );
                    segment.claim = Some(signed);
                    self.record_failure(&job, &node_hex, &reason, true, &segment)
                        .await
                }
                Outcome::Cancelled | Outcome::Shutdown => Ok(()),
            };
            match result {
                Ok(()) => break,
                Err(e) if record_backoff(tries + 1).is_some() && !self.shutdown.is_cancelled() => {
                    tries += 1;
                    warn!(error = %error_chain(&e), tries, "recording the attempt's end failed; retrying");
                    if let Some(wait) = record_backoff(tries) {
                        tokio::time::sleep(wait).await;
                    }
                }
                Err(e) => {
                    warn!(error = %error_chain(&e), "recording the attempt's end failed");
                    break;
                }
            }
        }
        drop(reservation);
        if session.running_jobs() == 0
            && self
                .sessions
                .get(&session.node_id)
                .is_some_and(|s| s.serial == session.serial)
        {
            let _ = self.world.set_status(&node_hex, crate::world::Status::Idle);
        }
        self.wake();
    }

    /// Which of `plan`'s picks the store shows assigned as planned (the
    /// job at its planned attempt on its planned node), read with retries
    /// until read; none once the coordinator stops.
    async fn assigned_after_all(&self, plan: &[Planned]) -> Vec<bool> {
        let mut out = Vec::with_capacity(plan.len());
        for p in plan {
            let mut tries = 0;
            let job = loop {
                match self.store.get_job(p.job.id).await {
                    Ok(job) => break job,
                    Err(_) if self.shutdown.is_cancelled() => break None,
                    Err(e) => {
                        tries += 1;
                        warn!(error = %error_chain(&e), tries, "reading back a placement failed; retrying");
                        if let Some(wait) = record_backoff(tries) {
                            tokio::time::sleep(wait).await;
                        }
                    }
                }
            };
            let node = p.node.to_string();
            out.push(job.is_some_and(|j| {
                j.state == JobState::Assigned
                    && j.attempt == p.job.attempt
                    && j.node_id.as_deref() == Some(node.as_str())
            }));
        }
        out
    }

    /// Adds an attempt's end to its node's [`Evidence`]: a verified claim
    /// (a completion or a drained hand-off) counts as a success, shows its
    /// decode speed and that the node serves the model (its availability
    /// rewards' capacity: [`Audits::showed`]); a failure counts against; a
    /// cancel or a shutdown says nothing about the node.
    fn learn(&self, node: NodeId, job: &JobRecord, model: &Model, outcome: &Outcome) {
        let (ok, signed) = match outcome {
            Outcome::Completed(signed) | Outcome::HandedOff(signed) => (true, Some(signed)),
            Outcome::Failed { .. } => (false, None),
            Outcome::Cancelled | Outcome::Shutdown => return,
        };
        if ok {
            // Capacity shown: availability rewards pay for this model.
            self.audits.showed(node, model.sha256);
        }
        let mut evidence = lock(&self.evidence);
        if evidence.len() >= EVIDENCE_MAX && !evidence.contains_key(&node) {
            evidence.retain(|id, _| self.sessions.get(id).is_some());
        }
        let shown = evidence.entry(node).or_default();
        shown.attempt(ok);
        if let Some(c) = signed.and_then(|s| s.claim.as_ref()) {
            let bytes_per_token = model
                .job(input_bytes(&job.input), job.sampling.max_tokens)
                .bytes_per_token();
            shown.decoded(
                c.completion_tokens,
                c.decode_micros as f64 / 1e6,
                bytes_per_token,
            );
        }
    }

    async fn record_completion(
        self: &Arc<Self>,
        job: &JobRecord,
        node_hex: &str,
        signed: SignedClaim,
    ) -> Result<(), StoreError> {
        let completion = Completion {
            job_id: job.id,
            attempt: job.attempt,
            node_id: node_hex.to_owned(),
            result: signed,
        };
        if !self.store.complete(&completion).await? {
            debug!("result arrived after the attempt ended; ignored");
            // An earlier try of this record may have committed and lost
            // only its answer (the database went away after the commit):
            // then this job's watchers still wait for its end.
            self.publish_end(job.id).await;
            return Ok(());
        }
        self.metrics.jobs_completed.inc();
        self.count_work(
            node_hex,
            RecordDelta {
                jobs: 1,
                ..RecordDelta::default()
            },
        )
        .await;
        info!("completed with a verified result");
        self.maybe_audit(job, node_hex, &completion.result).await;
        // Pays now unless the audit window holds the pay (then the sweep does).
        self.settle(job.id).await;
        let (tokens, energy) = completion.result.claim.as_ref().map_or((0, 0), |c| {
            (u64::from(c.completion_tokens), c.energy_microjoules)
        });
        if let Err(e) = self.world.record_job(node_hex, tokens) {
            debug!(error = %e, "world map: job of a node it does not show");
        }
        self.world.record_energy(tokens, energy);
        // The completion is committed: nothing after it may fail this
        // record, or the caller's retry would find the attempt ended and
        // the watchers would never be sent the end.
        self.publish_end(job.id).await;
        Ok(())
    }

    /// Sends `id`'s end (completed with its claim and segments, so a
    /// watcher verifies a resumed job whole; failed; cancelled) to its
    /// watchers (see [`Dispatcher::publish`]), reading it from the store with retries
    /// until it is read or the coordinator stops. Nothing when the job has
    /// not ended. Sending an end twice is harmless: the hub forgets a job
    /// at its first end.
    async fn publish_end(&self, id: JobId) {
        let mut tries = 0;
        loop {
            let read = async {
                let Some(done) = self.store.get_job(id).await? else {
                    return Ok(None);
                };
                let segments = self.store.segments(id).await?;
                Ok::<_, StoreError>(terminal_event(&done, &segments).and_then(|e| e.event))
            };
            match read.await {
                Ok(Some(event)) => return self.publish(id, event),
                Ok(None) => return,
                Err(e) if !self.shutdown.is_cancelled() => {
                    tries += 1;
                    warn!(error = %error_chain(&e), tries, "reading the job's end failed; retrying");
                    if let Some(wait) = record_backoff(tries) {
                        tokio::time::sleep(wait).await;
                    }
                }
                Err(e) => {
                    warn!(error = %error_chain(&e), "reading the job's end failed");
                    return;
                }
            }
        }
    }

    /// Adds `delta` to `node_hex`'s record (its reputation); a store error
    /// is logged (the record is evidence, not money: nothing else waits on
    /// it).
    async fn count_work(&self, node_hex: &str, delta: RecordDelta) {
        if let Err(e) = self.audits.count_work(node_hex, &delta).await {
            warn!(error = %error_chain(&e), "recording the node's work failed");
        }
    }

    async fn record_failure(
        &self,
        job: &JobRecord,
        node_hex: &str,
        reason: &str,
        retryable: bool,
        segment: &Segment,
    ) -> Result<(), StoreError> {
        let end = StreamedEnd {
            job: job.id,
            attempt: job.attempt,
            node_id: node_hex,
            reason,
            retryable,
            max_attempts: self.config.max_attempts,
        };
        let end = self.store.end_attempt_streamed(&end, segment).await?;
        match end {
            Some(AttemptEnd::Requeued { attempt }) => {
                self.metrics.jobs_requeued.inc();
                info!(reason, next_attempt = attempt, "attempt failed; requeued");
                self.publish(
                    job.id,
                    job_event::Event::Queued(job_event::Queued {
                        attempt,
                        reason: reason.to_owned(),
                    }),
                );
            }
            Some(AttemptEnd::Failed) => {
                lock(&self.failed_on).remove(&job.id);
                self.metrics.jobs_failed.inc();
                info!(reason, "job failed");
                self.settle(job.id).await;
                self.publish(
                    job.id,
                    job_event::Event::Failed(job_event::Failed {
                        reason: reason.to_owned(),
                    }),
                );
            }
            None => {
                debug!("attempt had already ended");
                // As in `record_completion`: an earlier try may have
                // committed this end and lost only its answer.
                self.publish_end(job.id).await;
            }
        }
        Ok(())
    }

    /// Sends the assignment (resuming after what earlier attempts streamed)
    /// and follows the node's updates to the end. Returns how it ended and
    /// the tokens this attempt streamed.
    async fn drive(
        &self,
        job: &JobRecord,
        model: &Model,
        session: &Session,
        cancel: &CancellationToken,
    ) -> (Outcome, Segment) {
        let mut segment = Segment {
            attempt: job.attempt,
            node_id: session.node_id.to_string(),
            ..Segment::default()
        };
        let resumed = match self.store.segments(job.id).await {
            Ok(s) => Streamed::of(&s),
            Err(e) => {
                let reason = format!("reading the job's streamed tokens: {}", error_chain(&e));
                let failed = Outcome::Failed {
                    reason,
                    retryable: true,
                };
                return (failed, segment);
            }
        };
        segment.first_index = resumed.token_ids.len() as u32;
        // What earlier attempts streamed past the kept tokens (a dead
        // replica's attempt) is not part of the stream.
        self.relay
            .rewind(job.id, job.attempt, segment.first_index)
            .await;
        self.hub.seed(
            job.id,
            job_event::Tokens {
                index: 0,
                token_ids: resumed.token_ids.clone(),
                text: resumed.text.clone(),
                // Not stored: a late watcher replays the ids and text only.
                logprobs: Vec::new(),
            },
        );
        let outcome = self
            .drive_resumed(job, model, session, cancel, resumed, &mut segment)
            .await;
        (outcome, segment)
    }

    async fn drive_resumed(
        &self,
        job: &JobRecord,
        model: &Model,
        session: &Session,
        cancel: &CancellationToken,
        resumed: Streamed,
        segment: &mut Segment,
    ) -> Outcome {
        let input = job.input.clone();
        let expected = expected(job, model, session.node_id, &resumed.token_ids);
        let assignment = Assignment {
            job_id: job.id.to_string(),
            attempt: job.attempt,
            model: job.model.clone(),
            model_sha256: model.sha256.to_vec(),
            input: Some(input),
            sampling: Some(job.sampling.clone()),
            resume: (!resumed.token_ids.is_empty()).then_some(Resume {
                token_ids: resumed.token_ids,
                text: resumed.text,
            }),
            audit: None,
        };
        let opened = tokio::select! {
            _ = cancel.cancelled() => return self.stopped(),
            r = JobStream::open(&session.connection, &assignment) => r,
        };
        let mut stream = match opened {
            Ok(s) => s,
            Err(e) => {
                return Outcome::Failed {
                    reason: format!("could not reach the node: {e}"),
                    retryable: true,
                }
            }
        };
        let deadline = Duration::from_millis(self.config.job_timeout_ms);
        let ended = tokio::select! {
            _ = cancel.cancelled() => None,
            r = tokio::time::timeout(deadline, self.follow(job, session, &expected, &mut stream, segment)) => Some(r),
        };
        match ended {
            None => {
                stream.reset(CODE_CANCELLED);
                self.stopped()
            }
            Some(Err(_elapsed)) => {
                stream.reset(CODE_TIMEOUT);
                Outcome::Failed {
                    reason: format!("the node did not finish within {deadline:?}"),
                    retryable: true,
                }
            }
            Some(Ok(Ok(signed))) => {
                stream.finish();
                let handoff = crate::link::job::is_handoff(&signed);
                if handoff {
                    Outcome::HandedOff(signed)
                } else {
                    Outcome::Completed(signed)
                }
            }
            Some(Ok(Err(failure))) => {
                stream.reset(CODE_REFUSED);
                failure
            }
        }
    }

    fn stopped(&self) -> Outcome {
        if self.shutdown.is_cancelled() {
            Outcome::Shutdown
        } else {
            Outcome::Cancelled
        }
    }

    /// Reads updates until a verified result (`Ok`) or the attempt's
    /// failure, adding the tokens it streams to `segment`.
    async fn follow(
        &self,
        job: &JobRecord,
        session: &Session,
        expected: &Expected,
        stream: &mut JobStream,
        segment: &mut Segment,
    ) -> Result<SignedClaim, Outcome> {
        let node_hex = session.node_id.to_string();
        // The lease: renewed by every update from the node.
        let lease = Duration::from_millis(self.config.job_lease_ms);
        // What this attempt may stream: the tokens left of `max_tokens`
        // (and the end-of-sequence id), each with a few bytes of text.
        let most_tokens = (job.sampling.max_tokens as usize)
            .saturating_sub(segment.first_index as usize)
            .saturating_add(1);
        let most_bytes = most_tokens
            .saturating_mul(MAX_TEXT_BYTES_PER_TOKEN)
            .saturating_add(TEXT_SLACK_BYTES);
        loop {
            let next = match tokio::time::timeout(lease, stream.next()).await {
                Ok(next) => next,
                Err(_) => {
                    return Err(Outcome::Failed {
                        reason: format!("lease expired: no progress from the node for {lease:?}"),
                        retryable: true,
                    })
                }
            };
            let update = match next {
                Ok(u) => u,
                Err(FrameError::Closed) => {
                    return Err(Outcome::Failed {
                        reason: "the node ended the job stream without a result".into(),
                        retryable: true,
                    })
                }
                Err(e) => {
                    return Err(Outcome::Failed {
                        reason: format!("lost the node's job stream: {e}"),
                        retryable: true,
                    })
                }
            };
            match update.msg {
                Some(job_update::Msg::Started(_)) => {
                    if let Err(e) = self
                        .store
                        .mark_running(job.id, job.attempt, &node_hex)
                        .await
                    {
                        warn!(error = %error_chain(&e), "recording the start failed");
                    }
                }
                Some(job_update::Msg::Tokens(t)) => {
                    let next = segment.first_index as usize + segment.token_ids.len();
                    if t.index as usize != next {
                        return Err(Outcome::Failed {
                            reason: format!(
                                "the node sent token {} where token {next} was due",
                                t.index
                            ),
                            retryable: true,
                        });
                    }
                    if segment.token_ids.len().saturating_add(t.token_ids.len()) > most_tokens
                        || segment.text.len().saturating_add(t.text.len()) > most_bytes
                    {
                        self.metrics.results_refused.inc();
                        return Err(Outcome::Failed {
                            reason: format!(
                                "the node streamed more than the {most_tokens} tokens (or \
                                 {most_bytes} bytes of text) this attempt may"
                            ),
                            retryable: true,
                        });
                    }
                    if let Err(e) = crate::link::job::check_logprobs(&t, job.sampling.logprobs) {
                        self.metrics.results_refused.inc();
                        return Err(Outcome::Failed {
                            reason: format!("the node's token chunk was refused: {e}"),
                            retryable: true,
                        });
                    }
                    if next == 0 && job.attempt == 1 && !t.token_ids.is_empty() {
                        Metrics::observe_since_ms(
                            &self.metrics.first_token_seconds,
                            job.created_at_ms,
                            now_ms(),
                        );
                    }
                    segment.token_ids.extend_from_slice(&t.token_ids);
                    segment.text.push_str(&t.text);
                    self.metrics
                        .tokens_streamed
                        .inc_by(t.token_ids.len() as u64);
                    let chunk = job_event::Tokens {
                        index: t.index,
                        token_ids: t.token_ids,
                        text: t.text,
                        logprobs: t.logprobs,
                    };
                    self.relay.tokens(job.id, job.attempt, &chunk).await;
                    self.hub.tokens(job.id, chunk);
                }
                Some(job_update::Msg::Result(signed)) => {
                    let handoff = crate::link::job::is_handoff(&signed);
                    let drained = handoff && session.drained_within(DRAIN_WAIT).await;
                    return match check_result(&signed, expected)
                        .and_then(|()| check_streamed(&signed, segment, drained))
                    {
                        Ok(()) => Ok(signed),
                        Err(e) => {
                            self.metrics.results_refused.inc();
                            warn!(error = %e, "result refused");
                            Err(Outcome::Failed {
                                reason: format!("result refused: {e}"),
                                retryable: true,
                            })
                        }
                    };
                }
                Some(job_update::Msg::Failure(f)) => {
                    return Err(Outcome::Failed {
                        reason: format!(
                            "node failed the job: {}",
                            clip(&f.reason, MAX_REASON_CHARS)
                        ),
                        retryable: f.retryable,
                    })
                }
                Some(job_update::Msg::Verdict(_)) | None => {
                    return Err(Outcome::Failed {
                        reason: "the node sent an empty or unexpected job update".into(),
                        retryable: true,
                    })
                }
            }
        }
    }
}

/// What `node`'s result for `job`'s current attempt must claim, the
/// attempt resuming after `resumed` (the tokens earlier attempts streamed):
/// no more completion tokens than `max_tokens` leaves after them, no more
/// prompt tokens than the input and `resumed` can make, no id past the
/// model's vocabulary, and the digest of the job's grammar (none without
/// one). The simulator (`mlxnet-sim`) checks its nodes' claims against the
/// same.
pub fn expected(job: &JobRecord, model: &Model, node: NodeId, resumed: &[u32]) -> Expected {
    let resumed_len = u32::try_from(resumed.len()).unwrap_or(u32::MAX);
    Expected {
        job_id: job.id.to_string(),
        attempt: job.attempt,
        node_id: node,
        model_sha256: model.sha256,
        input_sha256: claim::resumed_input_digest(&job.input, resumed),
        grammar_sha256: grammar::claim_digest(job.sampling.grammar.as_ref()),
        max_tokens: job.sampling.max_tokens.saturating_sub(resumed_len),
        max_prompt_tokens: ledger::settle::prompt_tokens_bound(&job.input)
            .saturating_add(resumed.len() as u64),
        vocab_size: model.info.vocab_size,
    }
}

/// Bytes of a job's input text (prompt, or all message contents).
pub fn input_bytes(input: &JobInput) -> usize {
    match &input.kind {
        Some(job_input::Kind::Prompt(p)) => p.len(),
        Some(job_input::Kind::Chat(c)) => c
            .messages
            .iter()
            .map(|m| m.content.len() + m.role.len())
            .sum(),
        None => 0,
    }
}

#[cfg(test)]
mod expected_tests {
    use super::*;
    use crate::catalogue::smollm2_135m_instruct;
    use mlxnet_proto::v1::SamplingParams;

    /// Found by the simulator (`mlxnet-sim`, a hostile node that ignores
    /// the resume): a resumed attempt could bill the job's whole
    /// `max_tokens` again on top of the tokens earlier attempts streamed.
    #[test]
    fn a_resumed_attempt_may_claim_only_what_is_left_of_max_tokens() {
        let catalogue = Catalogue::new(&[smollm2_135m_instruct()]).unwrap();
        let model = catalogue.get("smollm2-135m-instruct").unwrap();
        let input = JobInput {
            kind: Some(job_input::Kind::Prompt("hello".into())),
        };
        let job = JobRecord::queued(
            &NewJob {
                id: JobId::new(),
                model: model.info.id.clone(),
                input: input.clone(),
                sampling: SamplingParams {
                    max_tokens: 16,
                    ..SamplingParams::default()
                },
                priority: 0,
            },
            0,
        );
        let node =
            NodeId::from_key(&ed25519_dalek::SigningKey::from_bytes(&[3; 32]).verifying_key());
        let fresh = expected(&job, model, node, &[]);
        assert_eq!(fresh.max_tokens, 16);
        let bound = ledger::settle::prompt_tokens_bound(&input);
        assert_eq!(fresh.max_prompt_tokens, bound);
        let resumed = expected(&job, model, node, &[1, 2, 3, 4, 5]);
        assert_eq!(resumed.max_tokens, 11);
        assert_eq!(resumed.max_prompt_tokens, bound + 5);
    }

    /// Found by the simulator (seed 38): after three failed tries the end
    /// was dropped, and the job stayed assigned to nobody until a restart.
    #[test]
    fn recording_an_attempts_end_never_gives_up_and_backs_off_at_most_5_s() {
        for tries in [1, 3, 4, 50, 10_000] {
            let wait = record_backoff(tries).unwrap();
            assert!(
                wait > Duration::ZERO && wait <= RECORD_BACKOFF_MAX,
                "{tries}: {wait:?}"
            );
        }
    }
}
