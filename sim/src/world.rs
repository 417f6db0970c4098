//! One seed's world: nodes, clients and faults around the coordinator's
//! real store, ledger, scheduler, audits and claim checks, run event by
//! event in simulated time.
//!
//! The simulated dispatcher follows `coordinator/src/dispatch.rs` step by
//! step: a placement pass claims queued jobs and plans them with the real
//! scheduler over the sessions' free memory; each attempt is followed like
//! `Dispatcher::follow` (started, tokens in order, a result checked by
//! `check_result`/`check_streamed` against `dispatch::expected`, a lease
//! renewed by every update); its end is recorded like `run_attempt`
//! (`complete` then settle, or `end_attempt_streamed` then settle when the
//! job failed, keeping no unsigned token of a failed or vanished attempt:
//! only a drained node's signed hand-off segment), retried after a store
//! error by the real loop's rule (`dispatch::record_backoff`). A
//! coordinator crash may hit
//! between any two of those writes; the restart runs the real
//! `app::recover`.
//!
//! # Invariants (checked at every step; see [`Sim::check`])
//! - No session holds more memory or jobs than its node has.
//! - The ledger's books: sums over accounts zero, stored balances equal
//!   their transfers, no hold resolved twice, no failed/cancelled job paid,
//!   no failed audit paid, posts equal payouts plus fee; no client account
//!   overdrawn.
//! - Every token a job keeps from an ended attempt is under that
//!   attempt's signed claim, and the kept segments follow each other with
//!   no gap (checked after each recorded end and at the end).
//! - The store never accepts a result for an attempt the coordinator
//!   already ended (a zombie's), and a job's store attempt is the one the
//!   coordinator drives.
//! - At the end: every accepted job is terminal (liveness, after faults
//!   stop), every terminal job's hold resolved, and every payout covered by
//!   a verified claim of that attempt and node, for no more tokens than the
//!   job allows.

use std::{
    collections::BTreeMap,
    sync::{Arc, Mutex},
};

use ed25519_dalek::SigningKey;
use mlxnet_coordinator::{
    app,
    audit::{audit_rate, AuditConfig, Audits, Verdict},
    catalogue::{smollm2_135m_instruct, Catalogue, CatalogueModel},
    dispatch::{expected, input_bytes, record_backoff},
    domain::{
        Account, AccountKind, AttemptEnd, CancelOutcome, Completion, JobRecord, JobState, JobTerms,
        NewJob, NodeRecord, Segment, Streamed, StreamedEnd,
    },
    ledger::{self, settle::max_price, settle::prompt_tokens_bound, Ledger, LedgerConfig},
    link::job::{check_result, check_streamed, Expected},
    scheduler::{self, Fleet, Measured, Mode, NodeSpec, Policy, Queue, Target},
    store::{Anomaly, AnyStore, Store, StoreError},
    util::clock::{self, ManualClock},
};
use mlxnet_proto::{
    claim,
    ids::{JobId, NodeId},
    v1::{job_input, AuditVerdict, JobInput, ResultClaim, SamplingParams, SignedClaim},
};
use rand::{rngs::StdRng, Rng, SeedableRng};
use sha2::{Digest, Sha256};

use crate::{Mutation, Options, Report, SimError};

/// The simulated coordinator's replica id: its nodes' and attempts' owner,
/// the same across its injected restarts (so each recovery takes them back).
const SIM_REPLICA: &str = "sim";

/// Where simulated time starts (2027-01-15, ms since the epoch).
const START_MS: i64 = 1_800_000_000_000;
/// The dispatcher's constants (`dispatch.rs`).
const PLACEMENT_TICK_MS: i64 = 2_000;
const PLACEMENT_BATCH: u32 = 256;
const RESUME_LEVEL: u8 = 1;
/// How long after faults stop every accepted job must be terminal.
const LIVENESS_BOUND_MS: i64 = 15 * 60 * 1000;
/// How long a dead connection takes to be noticed (the link's idle timeout).
const IDLE_TIMEOUT_MS: i64 = 10_000;

/// A fault the world injects.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Fault {
    NodeCrash,
    NodeStall,
    LinkLost,
    SameKeyReturn,
    OwnerReturn,
    CoordinatorCrash,
    /// A crash between two writes of one recording sequence.
    CrashBetweenWrites,
    StoreWriteFailed,
    /// The write landed, its answer did not (the caller sees an error).
    StoreReplyLost,
    StoreOutage,
    MessageDelayed,
    /// A result delivered and recorded twice.
    MessageDuplicated,
    /// A result of an ended attempt recorded after its job moved on.
    MessageReordered,
    HostileClaim,
    ClientCancel,
}

impl Fault {
    pub fn as_str(self) -> &'static str {
        match self {
            Fault::NodeCrash => "node-crash",
            Fault::NodeStall => "node-stall",
            Fault::LinkLost => "link-lost",
            Fault::SameKeyReturn => "same-key-return",
            Fault::OwnerReturn => "owner-return",
            Fault::CoordinatorCrash => "coordinator-crash",
            Fault::CrashBetweenWrites => "crash-between-writes",
            Fault::StoreWriteFailed => "store-write-failed",
            Fault::StoreReplyLost => "store-reply-lost",
            Fault::StoreOutage => "store-outage",
            Fault::MessageDelayed => "message-delayed",
            Fault::MessageDuplicated => "message-duplicated",
            Fault::MessageReordered => "message-reordered",
            Fault::HostileClaim => "hostile-claim",
            Fault::ClientCancel => "client-cancel",
        }
    }
}

/// How a hostile node lies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Hostile {
    /// Claims more prompt tokens than the prompt can have.
    InflatePrompt,
    /// On a resumed job, generates (and bills) the whole `max_tokens` again.
    IgnoreResume,
    /// Claims another attempt's number.
    WrongAttempt,
    /// Signs with another node's key.
    ForeignSigner,
    /// Counts more completion tokens than it lists.
    CountMismatch,
    /// Skips a token index.
    TokenGap,
    /// Hands off claiming more tokens than it streamed.
    BadHandoff,
}

const HOSTILE: [Hostile; 7] = [
    Hostile::InflatePrompt,
    Hostile::IgnoreResume,
    Hostile::WrongAttempt,
    Hostile::ForeignSigner,
    Hostile::CountMismatch,
    Hostile::TokenGap,
    Hostile::BadHandoff,
];

/// A realistic Mac: chip, memory (GiB), share of the fleet.
const MIX: [(&str, u64, u32); 10] = [
    ("Apple M1", 8, 10),
    ("Apple M1", 16, 10),
    ("Apple M2", 16, 12),
    ("Apple M2 Pro", 32, 10),
    ("Apple M3 Pro", 36, 10),
    ("Apple M3 Max", 64, 8),
    ("Apple M4", 24, 14),
    ("Apple M4 Pro", 48, 10),
    ("Apple M4 Max", 128, 4),
    ("Apple M2 Ultra", 192, 2),
];

/// An update on a job stream, node to coordinator.
#[derive(Clone, Debug)]
enum Msg {
    Started,
    Tokens { index: u32, ids: Vec<u32> },
    Result(Box<SignedClaim>),
    Failure { retryable: bool },
}

/// What the node is told with an assignment.
#[derive(Clone, Debug)]
struct Assigned {
    input: JobInput,
    model_sha256: [u8; 32],
    max_tokens: u32,
    resume: Vec<u32>,
}

/// How an attempt ended, as its stream showed.
#[derive(Clone, Debug)]
enum Outcome {
    Completed(Box<SignedClaim>),
    Failed { reason: String, retryable: bool },
    HandedOff(Box<SignedClaim>),
}

#[derive(Debug)]
enum Ev {
    Submit {
        client: usize,
    },
    Place,
    Tick,
    Sweep,
    Fault,
    /// The node works on one attempt (the first carries its assignment).
    Work {
        node: usize,
        conn: u64,
        job: JobId,
        attempt: u32,
        assigned: Option<Box<Assigned>>,
    },
    Deliver {
        coord: u64,
        conn: u64,
        job: JobId,
        attempt: u32,
        msg: Msg,
    },
    Lease {
        coord: u64,
        job: JobId,
        attempt: u32,
    },
    Record {
        coord: u64,
        job: Box<JobRecord>,
        node: usize,
        outcome: Outcome,
        segment: Box<Segment>,
        tries: u32,
    },
    Join {
        node: usize,
    },
    ConnLost {
        coord: u64,
        node: usize,
        conn: u64,
    },
    Restart,
    AuditEnd {
        job: JobId,
        node: usize,
        passed: bool,
    },
}

struct Node {
    key: SigningKey,
    id: NodeId,
    hex: String,
    chip: &'static str,
    memory: u64,
    mode: Mode,
    max_jobs: u32,
    /// Tokens per second it decodes.
    speed: f64,
    hostile: Option<Hostile>,
    /// Its process runs.
    up: bool,
    /// Its current connection (0: none).
    conn: u64,
    stalled_until: i64,
    /// Attempts it is running: what it was assigned and has produced.
    work: BTreeMap<(JobId, u32), NodeJob>,
    /// The connection on which it sent `Drain` (0: none): only there may
    /// a hand-off claim count (`check_streamed`).
    drained_conn: u64,
}

struct NodeJob {
    assigned: Assigned,
    produced: Vec<u32>,
    target: u32,
    started: bool,
}

/// The coordinator's session of a node.
struct Session {
    conn: u64,
    reserved: u64,
    running: u32,
}

/// An attempt the coordinator drives.
struct Live {
    attempt: u32,
    node: usize,
    conn: u64,
    memory: u64,
    record: JobRecord,
    segment: Segment,
    expected: Expected,
    last_progress: i64,
    started_at: i64,
}

/// What the simulator knows of an accepted job.
struct Track {
    input: JobInput,
    max_tokens: u32,
    model: String,
    /// Verified claims the coordinator accepted: (attempt, node hex) ->
    /// output tokens claimed.
    verified: BTreeMap<(u32, String), u32>,
}

struct Client {
    account: String,
    /// Mean ms between its submits.
    mean_gap_ms: f64,
}

struct Coord {
    /// Bumped by each crash: what the dead coordinator had in flight is dropped.
    epoch: u64,
    up: bool,
    sessions: BTreeMap<usize, Session>,
    live: BTreeMap<JobId, Live>,
}

/// The settings a seed draws.
struct Knobs {
    max_attempts: u32,
    lease_ms: i64,
    job_timeout_ms: i64,
    audit: AuditConfig,
    ledger: LedgerConfig,
    /// Mean ms between injected faults.
    fault_gap_ms: f64,
    /// Chance a store write fails (before or after landing).
    write_fail: f64,
    delay_ms: (i64, i64),
}

pub(crate) struct Sim {
    seed: u64,
    rng: StdRng,
    clock: ManualClock,
    now: i64,
    url: String,
    /// How the seed's jobs ended (read at the end).
    ended: (u64, u64, u64),
    store: AnyStore,
    ledger: Ledger,
    audits: Arc<Audits>,
    catalogue: Catalogue,
    knobs: Knobs,
    mutation: Option<Mutation>,
    nodes: Vec<Node>,
    by_id: BTreeMap<NodeId, usize>,
    clients: Vec<Client>,
    coord: Coord,
    events: BTreeMap<(i64, u64), Ev>,
    seq: u64,
    next_conn: u64,
    jobs: BTreeMap<JobId, Track>,
    faults: BTreeMap<Fault, u64>,
    faulty: bool,
    outage_until: i64,
    trace: Sha256,
    /// Prints every trace line (`MLXNET_SIM_TRACE=1`).
    verbose: bool,
    steps: u64,
    violations: Vec<String>,
}

/// Runs `seed` under `options`: its own thread's clock, runtime and database.
pub fn run_seed(seed: u64, options: &Options) -> Result<Report, SimError> {
    let clock = ManualClock::new(START_MS);
    let _guard = clock::install(Arc::new(clock.clone()));
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    // Unique per run, so seeds run at once in one process (tests) never
    // share a database.
    static RUNS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let run = RUNS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let path = options
        .dir
        .join(format!("mlxnet-sim-{}-{run}-{seed}.db", std::process::id()));
    let result = runtime.block_on(async {
        let mut sim = Sim::new(seed, options, clock, &path).await?;
        sim.run(options.steps).await;
        let report = sim.report();
        sim.store.close().await;
        Ok(report)
    });
    for suffix in ["", "-wal", "-shm"] {
        let mut p = path.clone().into_os_string();
        p.push(suffix);
        let _ = std::fs::remove_file(p);
    }
    result
}

/// A JobId from the seed's generator.
fn job_id(rng: &mut StdRng) -> JobId {
    let mut b: [u8; 16] = rng.gen();
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    match uuid::Uuid::from_bytes(b).to_string().parse() {
        Ok(id) => id,
        Err(_) => JobId::new(),
    }
}

/// The token a model produces at `index` of `job` (the same on every node,
/// so a resumed stream continues the same text).
fn token_at(job: JobId, index: u32) -> u32 {
    let mut h = Sha256::new();
    h.update(job.to_string().as_bytes());
    h.update(index.to_le_bytes());
    let d = h.finalize();
    u32::from_le_bytes([d[0], d[1], d[2], 0]) % 49_152
}

fn text_of(ids: &[u32]) -> String {
    ids.iter().map(|t| format!("{} ", t % 1000)).collect()
}

fn models() -> Vec<CatalogueModel> {
    let small = smollm2_135m_instruct();
    let mut mid = smollm2_135m_instruct();
    mid.id = "sim-8b".into();
    mid.parameters = 8_000_000_000;
    mid.size_bytes = 8_500_000_000;
    mid.sha256 = "11".repeat(32);
    let mut big = smollm2_135m_instruct();
    big.id = "sim-70b".into();
    big.parameters = 70_000_000_000;
    big.size_bytes = 40_000_000_000;
    big.sha256 = "22".repeat(32);
    vec![small, mid, big]
}

impl Sim {
    async fn new(
        seed: u64,
        options: &Options,
        clock: ManualClock,
        path: &std::path::Path,
    ) -> Result<Self, SimError> {
        let mut rng = StdRng::seed_from_u64(seed);
        let url = format!("sqlite://{}", path.display());
        let store = AnyStore::connect(&url).await?;
        let audit_window_ms = if rng.gen_bool(0.5) { 0 } else { 30_000 };
        let knobs = Knobs {
            max_attempts: rng.gen_range(2..=5),
            lease_ms: rng.gen_range(3_000..=15_000),
            job_timeout_ms: rng.gen_range(60_000..=180_000),
            audit: AuditConfig {
                window_ms: audit_window_ms,
                ban_after: rng.gen_range(1..=3),
                ..AuditConfig::default()
            },
            ledger: LedgerConfig {
                hold_ttl_ms: rng.gen_range(5..=30) * 60_000,
                audit_window_ms,
                ..LedgerConfig::default()
            },
            fault_gap_ms: rng.gen_range(300.0..3_000.0),
            write_fail: if rng.gen_bool(0.5) { 0.02 } else { 0.0 },
            delay_ms: (1, rng.gen_range(5..=200)),
        };
        let ledger = Ledger::new(store.clone(), knobs.ledger.clone());
        let audits = Arc::new(
            Audits::load(store.clone(), knobs.audit.clone())
                .await
                .map_err(|e| SimError::Setup(e.to_string()))?,
        );
        let catalogue = Catalogue::new(&models()).map_err(|e| SimError::Setup(e.to_string()))?;
        let n = rng.gen_range((options.nodes / 4).max(1)..=options.nodes.max(1));
        let hostile_share = if rng.gen_bool(0.5) { 0.0 } else { 0.2 };
        let total: u32 = MIX.iter().map(|m| m.2).sum();
        let mut nodes = Vec::with_capacity(n as usize);
        let mut by_id = BTreeMap::new();
        for i in 0..n as usize {
            let key = SigningKey::from_bytes(&rng.gen());
            let id = NodeId::from_key(&key.verifying_key());
            let mut pick = rng.gen_range(0..total);
            let (chip, gib, _) = *MIX
                .iter()
                .find(|m| {
                    if pick < m.2 {
                        true
                    } else {
                        pick -= m.2;
                        false
                    }
                })
                .unwrap_or(&MIX[0]);
            let bandwidth = mlxnet_proto::chips::lookup(chip)
                .map_or(100.0, |c| f64::from(c.memory_bandwidth_gb_s));
            by_id.insert(id, i);
            nodes.push(Node {
                hex: id.to_string(),
                key,
                id,
                chip,
                memory: gib << 30,
                mode: if rng.gen_bool(0.6) {
                    Mode::IdleTime
                } else {
                    Mode::Dedicated
                },
                max_jobs: if gib >= 64 { rng.gen_range(1..=4) } else { 1 },
                speed: bandwidth / 4.0,
                hostile: rng
                    .gen_bool(hostile_share)
                    .then(|| HOSTILE[rng.gen_range(0..HOSTILE.len())]),
                up: false,
                conn: 0,
                stalled_until: 0,
                work: BTreeMap::new(),
                drained_conn: 0,
            });
        }
        let mut sim = Sim {
            seed,
            rng,
            clock,
            now: START_MS,
            url,
            ended: (0, 0, 0),
            store,
            ledger,
            audits,
            catalogue,
            knobs,
            mutation: options.mutation,
            nodes,
            by_id,
            clients: Vec::new(),
            coord: Coord {
                epoch: 1,
                up: true,
                sessions: BTreeMap::new(),
                live: BTreeMap::new(),
            },
            events: BTreeMap::new(),
            seq: 0,
            next_conn: 1,
            jobs: BTreeMap::new(),
            faults: BTreeMap::new(),
            faulty: true,
            outage_until: 0,
            trace: Sha256::new(),
            verbose: std::env::var_os("MLXNET_SIM_TRACE").is_some(),
            steps: 0,
            violations: Vec::new(),
        };
        sim.setup_clients().await?;
        for node in 0..sim.nodes.len() {
            let at = sim.rng.gen_range(0..5_000);
            sim.at(at, Ev::Join { node });
        }
        sim.at(PLACEMENT_TICK_MS, Ev::Tick);
        sim.at(sim.knobs.ledger.sweep_interval_ms as i64, Ev::Sweep);
        let gap = sim.fault_gap();
        sim.at(gap, Ev::Fault);
        Ok(sim)
    }

    async fn setup_clients(&mut self) -> Result<(), SimError> {
        let n = self.rng.gen_range(3..=20);
        for i in 0..n {
            let id = format!("acct_sim{i:04}");
            let account = Account::new(
                id.clone(),
                format!("client {i}"),
                AccountKind::Client,
                START_MS,
            );
            self.store.insert_account(&account).await?;
            // Some clients run dry: their submits are refused.
            let amount = if self.rng.gen_bool(0.3) {
                self.rng.gen_range(10..2_000)
            } else {
                self.rng.gen_range(100_000..10_000_000)
            };
            self.ledger
                .grant(&format!("sim{i}"), &id, amount, "sim")
                .await
                .map_err(|e| SimError::Setup(e.to_string()))?;
            let mean_gap_ms = self.rng.gen_range(200.0..5_000.0);
            self.clients.push(Client {
                account: id,
                mean_gap_ms,
            });
            let at = self.exp(mean_gap_ms);
            self.at(at, Ev::Submit { client: i });
        }
        Ok(())
    }

    fn fault_gap(&mut self) -> i64 {
        let mean = self.knobs.fault_gap_ms;
        self.exp(mean)
    }

    /// An exponential gap (Poisson arrivals) with mean `mean` ms.
    fn exp(&mut self, mean: f64) -> i64 {
        let u: f64 = self.rng.gen_range(f64::MIN_POSITIVE..1.0);
        (-u.ln() * mean).ceil() as i64
    }

    fn delay(&mut self) -> i64 {
        let (lo, hi) = self.knobs.delay_ms;
        self.rng.gen_range(lo..=hi)
    }

    /// Schedules `ev` `after` ms from now.
    fn at(&mut self, after: i64, ev: Ev) {
        self.seq += 1;
        self.events.insert((self.now + after.max(0), self.seq), ev);
    }

    fn fault(&mut self, f: Fault) {
        *self.faults.entry(f).or_default() += 1;
        self.trace(&format!("fault {}", f.as_str()));
    }

    fn trace(&mut self, line: &str) {
        if self.verbose {
            eprintln!("{:>9} {line}", self.now - START_MS);
        }
        self.trace.update(self.now.to_le_bytes());
        self.trace.update(line.as_bytes());
        self.trace.update(b"\n");
    }

    fn violation(&mut self, what: String) {
        let line = format!(
            "step {} at t+{} ms: {what}",
            self.steps,
            self.now - START_MS
        );
        self.trace(&line);
        self.violations.push(line);
    }

    /// Whether this store write fails, and how: `Some(false)` before it
    /// lands, `Some(true)` after (the answer is lost).
    fn write_fails(&mut self) -> Option<bool> {
        if self.now < self.outage_until {
            self.fault(Fault::StoreWriteFailed);
            return Some(false);
        }
        if !self.faulty || self.knobs.write_fail <= 0.0 || !self.rng.gen_bool(self.knobs.write_fail)
        {
            return None;
        }
        let after = self.rng.gen_bool(0.5);
        self.fault(if after {
            Fault::StoreReplyLost
        } else {
            Fault::StoreWriteFailed
        });
        Some(after)
    }

    /// Whether the coordinator crashes right here, between two writes.
    fn crash_here(&mut self) -> bool {
        if self.faulty && self.rng.gen_bool(0.002) {
            self.fault(Fault::CrashBetweenWrites);
            true
        } else {
            false
        }
    }

    async fn run(&mut self, steps: u32) {
        while self.steps < u64::from(steps) {
            if !self.step().await {
                break;
            }
        }
        // Faults stop: every node comes back, the coordinator too; clients
        // stop submitting; every accepted job must end within the bound.
        self.faulty = false;
        self.outage_until = 0;
        if !self.coord.up {
            self.at(0, Ev::Restart);
        }
        for node in 0..self.nodes.len() {
            self.nodes[node].stalled_until = 0;
            if !self.nodes[node].up {
                let at = self.rng.gen_range(0..5_000);
                self.at(at, Ev::Join { node });
            }
        }
        let deadline = self.now + LIVENESS_BOUND_MS;
        while self.now < deadline && !self.all_terminal().await {
            if !self.step().await {
                break;
            }
        }
        self.finish().await;
    }

    async fn all_terminal(&self) -> bool {
        if !self.coord.live.is_empty() {
            return false;
        }
        matches!(self.store.job_stats().await, Ok(s) if s.queued + s.running == 0)
    }

    /// Runs the next event; false when none is left.
    async fn step(&mut self) -> bool {
        let Some(((t, _), ev)) = self.events.pop_first() else {
            return false;
        };
        self.now = t;
        self.clock.set(t);
        self.steps += 1;
        self.handle(ev).await;
        self.check().await;
        true
    }

    async fn handle(&mut self, ev: Ev) {
        match ev {
            Ev::Submit { client } => self.submit(client).await,
            Ev::Place => self.place().await,
            Ev::Tick => {
                self.place().await;
                self.at(PLACEMENT_TICK_MS, Ev::Tick);
            }
            Ev::Sweep => {
                self.sweep().await;
                self.at(self.knobs.ledger.sweep_interval_ms as i64, Ev::Sweep);
            }
            Ev::Fault => {
                if self.faulty {
                    self.inject().await;
                    let gap = self.fault_gap();
                    self.at(gap, Ev::Fault);
                }
            }
            Ev::Work {
                node,
                conn,
                job,
                attempt,
                assigned,
            } => self.work(node, conn, job, attempt, assigned),
            Ev::Deliver {
                coord,
                conn,
                job,
                attempt,
                msg,
            } => {
                if coord == self.coord.epoch && self.coord.up {
                    self.deliver(conn, job, attempt, msg).await;
                }
            }
            Ev::Lease {
                coord,
                job,
                attempt,
            } => {
                if coord == self.coord.epoch && self.coord.up {
                    self.lease(job, attempt).await;
                }
            }
            Ev::Record {
                coord,
                job,
                node,
                outcome,
                segment,
                tries,
            } => {
                if coord == self.coord.epoch && self.coord.up {
                    self.record(*job, node, outcome, *segment, tries).await;
                }
            }
            Ev::Join { node } => self.join(node).await,
            Ev::ConnLost { coord, node, conn } => {
                if coord == self.coord.epoch && self.coord.up {
                    self.conn_lost(node, conn, "lost the node's job stream: connection lost");
                }
            }
            Ev::Restart => self.restart().await,
            Ev::AuditEnd { job, node, passed } => self.audit_end(job, node, passed).await,
        }
    }

    // --- clients -------------------------------------------------------

    async fn submit(&mut self, client: usize) {
        if !self.faulty {
            return;
        }
        let gap = self.exp(self.clients[client].mean_gap_ms);
        self.at(gap, Ev::Submit { client });
        if !self.coord.up {
            return;
        }
        // A burst of concurrent submits shares one group commit.
        let burst = if self.rng.gen_bool(0.1) {
            self.rng.gen_range(2..=6)
        } else {
            1
        };
        let mut batch = Vec::with_capacity(burst);
        for _ in 0..burst {
            let models = self.catalogue.models();
            let model = models[self.rng.gen_range(0..models.len())].clone();
            let prompt: String = (0..self.rng.gen_range(1..400))
                .map(|_| char::from(self.rng.gen_range(b'a'..=b'z')))
                .collect();
            let input = JobInput {
                kind: Some(job_input::Kind::Prompt(prompt)),
            };
            let max_tokens = self.rng.gen_range(1..=64);
            let job = NewJob {
                id: job_id(&mut self.rng),
                model: model.info.id.clone(),
                input: input.clone(),
                sampling: SamplingParams {
                    max_tokens,
                    seed: Some(self.rng.gen()),
                    ..SamplingParams::default()
                },
                priority: self.rng.gen_range(0..=3),
            };
            let price = model.price();
            let terms = JobTerms {
                account: self.clients[client].account.clone(),
                max_price: max_price(&price, &input, max_tokens),
                price,
            };
            batch.push((job, terms));
        }
        if self.now < self.outage_until {
            self.fault(Fault::StoreWriteFailed);
            return;
        }
        let ledger = self.ledger.clone();
        let now = self.now;
        let answers = futures::future::join_all(
            batch
                .iter()
                .map(|(job, terms)| ledger.submit_job(job, terms, now)),
        )
        .await;
        for ((job, _), answer) in batch.into_iter().zip(answers) {
            match answer {
                Ok(record) => {
                    self.trace(&format!("submitted {}", record.id));
                    self.jobs.insert(
                        record.id,
                        Track {
                            input: job.input,
                            max_tokens: job.sampling.max_tokens,
                            model: job.model,
                            verified: BTreeMap::new(),
                        },
                    );
                }
                Err(e) => self.trace(&format!("submit refused: {e}")),
            }
        }
        self.at(0, Ev::Place);
        // Now and then a client cancels one of its jobs (once there is one:
        // a seed whose first submits were all refused drew from an empty
        // range here and panicked, seed 149 at the default size).
        if !self.jobs.is_empty() && self.rng.gen_bool(0.03) {
            if let Some(&id) = self.jobs.keys().nth(self.rng.gen_range(0..self.jobs.len())) {
                self.fault(Fault::ClientCancel);
                self.cancel(id).await;
            }
        }
    }

    /// `Dispatcher::cancel`: the store first, then the running attempt.
    async fn cancel(&mut self, id: JobId) {
        if self.write_fails() == Some(false) {
            return;
        }
        match self.store.cancel(id).await {
            Ok(CancelOutcome::Cancelled) => {
                self.trace(&format!("cancelled {id}"));
                self.stop_live(id);
                self.settle(id).await;
                self.at(0, Ev::Place);
            }
            Ok(other) => self.trace(&format!("cancel {id}: {other:?}")),
            Err(e) => self.trace(&format!("cancel {id} failed: {e}")),
        }
    }

    /// Ends the coordinator's attempt of `id` without touching the store
    /// (the cancel path's `Outcome::Cancelled`), telling its node to stop.
    fn stop_live(&mut self, id: JobId) {
        if let Some(live) = self.coord.live.remove(&id) {
            self.release(&live);
            self.nodes[live.node].work.remove(&(id, live.attempt));
        }
    }

    fn release(&mut self, live: &Live) {
        if let Some(s) = self.coord.sessions.get_mut(&live.node) {
            if s.conn == live.conn {
                s.reserved = s.reserved.saturating_sub(live.memory);
                s.running = s.running.saturating_sub(1);
            }
        }
    }

    /// `ledger::settle_logged`, a write that may fail.
    async fn settle(&mut self, id: JobId) {
        match self.write_fails() {
            Some(false) => return,
            Some(true) => {
                let _ = self.ledger.settle_job(id, self.now).await;
                return;
            }
            None => {}
        }
        match self.ledger.settle_job(id, self.now).await {
            Ok(s) => self.trace(&format!("settled {id}: {s:?}")),
            Err(e) => self.trace(&format!("settle {id} failed: {e}")),
        }
    }

    async fn sweep(&mut self) {
        if !self.coord.up {
            return;
        }
        if self.write_fails() == Some(false) {
            return;
        }
        let cancelled: Arc<Mutex<Vec<JobId>>> = Arc::default();
        let store = self.store.clone();
        let seen = Arc::clone(&cancelled);
        let swept = ledger::sweep(&self.ledger, self.now, |job| {
            let store = store.clone();
            let seen = Arc::clone(&seen);
            async move {
                let outcome = store.cancel(job).await?;
                if outcome == CancelOutcome::Cancelled {
                    if let Ok(mut s) = seen.lock() {
                        s.push(job);
                    }
                }
                Ok::<(), StoreError>(())
            }
        })
        .await;
        self.trace(&format!("sweep {swept:?}"));
        let ids = cancelled.lock().map(|s| s.clone()).unwrap_or_default();
        for id in ids {
            self.stop_live(id);
        }
    }

    // --- placement -----------------------------------------------------

    /// `Dispatcher::place_queued` and `plan`.
    async fn place(&mut self) {
        if !self.coord.up || self.coord.sessions.is_empty() {
            return;
        }
        if self.write_fails() == Some(false) {
            return;
        }
        let mut fleet = Fleet::new(Policy {
            downloads: false,
            ..Policy::default()
        });
        let shas: Vec<[u8; 32]> = self.catalogue.models().iter().map(|m| m.sha256).collect();
        for (&i, s) in &self.coord.sessions {
            let n = &self.nodes[i];
            if self.audits.is_banned(&n.id) {
                continue;
            }
            let mut spec = NodeSpec::new(n.id, n.chip, n.memory, n.mode, &Measured::default());
            spec.free_memory_bytes = n.memory.saturating_sub(s.reserved);
            spec.max_concurrent_jobs = n.max_jobs.saturating_sub(s.running);
            spec.cached = shas.clone();
            let _ = fleet.add_node(spec);
        }
        let catalogue = &self.catalogue;
        let mut plan: Vec<(JobRecord, NodeId, u64)> = Vec::new();
        let claimed = self
            .store
            .claim_queued(PLACEMENT_BATCH, |claimed| {
                let mut queue = Queue::new(claimed.len());
                for (job, account) in claimed {
                    let account = account.unwrap_or_default();
                    let level = if job.attempt > 1 { RESUME_LEVEL } else { 0 };
                    let _ = queue.push_ranked(&account, level, job.priority, job);
                }
                let placed = scheduler::schedule(&mut queue, &mut fleet, |job: &JobRecord| {
                    let model = catalogue.get(&job.model)?;
                    Some(model.job(input_bytes(&job.input), job.sampling.max_tokens))
                });
                for (job, placement) in placed {
                    if let Target::Node(node) = placement.target {
                        plan.push((job, node, placement.memory_per_member));
                    }
                }
                plan.iter()
                    .map(|(job, node, _)| (job.id, job.attempt, node.to_string()))
                    .collect()
            })
            .await;
        let assigned = match claimed {
            Ok(a) => a,
            Err(e) => {
                self.trace(&format!("placement failed: {e}"));
                return;
            }
        };
        for ((job, node_id, memory), assigned) in plan.into_iter().zip(assigned) {
            if !assigned {
                continue;
            }
            let Some(&node) = self.by_id.get(&node_id) else {
                continue;
            };
            self.trace(&format!("assigned {} #{} to {node}", job.id, job.attempt));
            self.start_attempt(job, node, memory).await;
        }
    }

    /// `run_attempt` up to the stream: reserve, read the segments, send the
    /// assignment.
    async fn start_attempt(&mut self, job: JobRecord, node: usize, memory: u64) {
        let Some(session) = self.coord.sessions.get_mut(&node) else {
            return;
        };
        session.reserved += memory;
        session.running += 1;
        let conn = session.conn;
        let resumed = match self.store.segments(job.id).await {
            Ok(s) => Streamed::of(&s),
            Err(e) => {
                self.trace(&format!("segments of {} failed: {e}", job.id));
                Streamed::default()
            }
        };
        let Some(model) = self.catalogue.get(&job.model).cloned() else {
            return;
        };
        let exp = expected(&job, &model, self.nodes[node].id, &resumed.token_ids);
        let segment = Segment {
            attempt: job.attempt,
            node_id: self.nodes[node].hex.clone(),
            first_index: resumed.token_ids.len() as u32,
            ..Segment::default()
        };
        let assigned = Assigned {
            input: job.input.clone(),
            model_sha256: model.sha256,
            max_tokens: job.sampling.max_tokens,
            resume: resumed.token_ids,
        };
        let attempt = job.attempt;
        let id = job.id;
        let live = Live {
            attempt,
            node,
            conn,
            memory,
            record: job,
            segment,
            expected: exp,
            last_progress: self.now,
            started_at: self.now,
        };
        if let Some(old) = self.coord.live.insert(id, live) {
            self.violation(format!(
                "job {id} assigned as attempt {attempt} while attempt {} still ran on node {}",
                old.attempt, old.node
            ));
        }
        let d = self.delay();
        self.at(
            d,
            Ev::Work {
                node,
                conn,
                job: id,
                attempt,
                assigned: Some(Box::new(assigned)),
            },
        );
        self.at(
            self.knobs.lease_ms,
            Ev::Lease {
                coord: self.coord.epoch,
                job: id,
                attempt,
            },
        );
    }

    // --- nodes ---------------------------------------------------------

    fn send(&mut self, node: usize, job: JobId, attempt: u32, msg: Msg) {
        let conn = self.nodes[node].conn;
        let mut d = self.delay();
        if self.faulty && self.rng.gen_bool(0.01) {
            self.fault(Fault::MessageDelayed);
            d += self.rng.gen_range(1_000..20_000);
        }
        let coord = self.coord.epoch;
        self.at(
            d,
            Ev::Deliver {
                coord,
                conn,
                job,
                attempt,
                msg,
            },
        );
    }

    /// The node's next move on one attempt.
    fn work(
        &mut self,
        node: usize,
        conn: u64,
        job: JobId,
        attempt: u32,
        assigned: Option<Box<Assigned>>,
    ) {
        let n = &self.nodes[node];
        if !n.up || n.conn != conn {
            return;
        }
        if n.stalled_until > self.now {
            let wait = n.stalled_until - self.now;
            self.at(
                wait,
                Ev::Work {
                    node,
                    conn,
                    job,
                    attempt,
                    assigned,
                },
            );
            return;
        }
        let hostile = n.hostile;
        if let Some(a) = assigned {
            let left = a.max_tokens.saturating_sub(a.resume.len() as u32);
            let target = if hostile == Some(Hostile::IgnoreResume) {
                a.max_tokens
            } else {
                self.rng.gen_range(left.min(1)..=left)
            };
            self.nodes[node].work.insert(
                (job, attempt),
                NodeJob {
                    assigned: *a,
                    produced: Vec::new(),
                    target,
                    started: false,
                },
            );
        }
        let speed = self.nodes[node].speed;
        let Some(w) = self.nodes[node].work.get_mut(&(job, attempt)) else {
            return;
        };
        if !w.started {
            w.started = true;
            self.send(node, job, attempt, Msg::Started);
            let prefill = self.rng.gen_range(20..400);
            self.again(node, conn, job, attempt, prefill);
            return;
        }
        let base = w.assigned.resume.len() as u32;
        if (w.produced.len() as u32) < w.target {
            let k = self
                .rng
                .gen_range(1..=8)
                .min(w.target - w.produced.len() as u32);
            let mut index = base + w.produced.len() as u32;
            let ids: Vec<u32> = (0..k).map(|i| token_at(job, index + i)).collect();
            w.produced.extend_from_slice(&ids);
            if hostile == Some(Hostile::TokenGap) && self.rng.gen_bool(0.3) {
                index += 1;
                self.fault(Fault::HostileClaim);
            }
            self.send(node, job, attempt, Msg::Tokens { index, ids });
            let gap = (f64::from(k) * 1000.0 / speed).ceil() as i64;
            self.again(node, conn, job, attempt, gap.max(1));
            return;
        }
        let claim = self.claim_of(node, job, attempt, false);
        self.nodes[node].work.remove(&(job, attempt));
        self.send(node, job, attempt, Msg::Result(Box::new(claim)));
    }

    fn again(&mut self, node: usize, conn: u64, job: JobId, attempt: u32, after: i64) {
        self.at(
            after,
            Ev::Work {
                node,
                conn,
                job,
                attempt,
                assigned: None,
            },
        );
    }

    /// The node's signed claim of what it produced on one attempt (a
    /// hand-off claim when `handoff`), lying as a hostile node does.
    fn claim_of(&mut self, node: usize, job: JobId, attempt: u32, handoff: bool) -> SignedClaim {
        let n = &self.nodes[node];
        let hostile = n.hostile;
        let Some(w) = n.work.get(&(job, attempt)) else {
            return SignedClaim::default();
        };
        let mut output = w.produced.clone();
        let prompt =
            prompt_tokens_bound(&w.assigned.input) as u32 / 2 + w.assigned.resume.len() as u32;
        let mut c = ResultClaim {
            job_id: job.to_string(),
            attempt,
            model_sha256: w.assigned.model_sha256.to_vec(),
            prompt_sha256: claim::resumed_input_digest(&w.assigned.input, &w.assigned.resume)
                .to_vec(),
            output_token_ids: Vec::new(),
            output_text: String::new(),
            prompt_tokens: prompt,
            completion_tokens: 0,
            prefill_micros: 1_000,
            decode_micros: 1_000,
            node_id: n.id.as_bytes().to_vec(),
            finish_reason: if handoff {
                claim::FINISH_HANDOFF.into()
            } else {
                "length".into()
            },
            // The simulator's jobs have no grammar and measure no energy.
            grammar_sha256: Vec::new(),
            energy_microjoules: 0,
            microjoules_per_token: 0,
        };
        let mut key = n.key.clone();
        match hostile {
            Some(Hostile::InflatePrompt) => c.prompt_tokens = prompt.saturating_mul(50),
            Some(Hostile::WrongAttempt) => c.attempt = attempt + 1,
            Some(Hostile::CountMismatch) => c.completion_tokens = 1,
            Some(Hostile::BadHandoff) if handoff => output.push(token_at(job, 9_999)),
            Some(Hostile::ForeignSigner) => {
                let other = (node + 1) % self.nodes.len();
                key = self.nodes[other].key.clone();
                c.node_id = self.nodes[other].id.as_bytes().to_vec();
            }
            _ => {}
        }
        if hostile.is_some() {
            self.fault(Fault::HostileClaim);
        }
        c.output_text = text_of(&output);
        c.completion_tokens = if hostile == Some(Hostile::CountMismatch) {
            output.len() as u32 + 1
        } else {
            output.len() as u32
        };
        c.output_token_ids = output;
        claim::sign(c, &key)
    }

    async fn join(&mut self, node: usize) {
        if self.nodes[node].up && self.nodes[node].conn != 0 {
            return;
        }
        self.nodes[node].up = true;
        if !self.coord.up {
            return;
        }
        let conn = self.next_conn;
        self.next_conn += 1;
        self.nodes[node].conn = conn;
        self.nodes[node].work.clear();
        // The link's handshake: the node's row, its operator.
        let n = &self.nodes[node];
        let record = NodeRecord {
            id: n.hex.clone(),
            name: format!("sim node {node}"),
            hardware: format!("{{\"chip\":\"{}\",\"memory_bytes\":{}}}", n.chip, n.memory),
            models: "[]".into(),
            version: "sim".into(),
            // The sim's store books with no bound (its nodes' slots are
            // the dispatcher's to keep).
            slots: 0,
        };
        let hex = n.hex.clone();
        if self.write_fails() == Some(false) {
            self.nodes[node].conn = 0;
            return;
        }
        if let Err(e) = self.store.upsert_node(&record, SIM_REPLICA).await {
            self.trace(&format!("upsert node failed: {e}"));
        }
        let _ = self.ledger.link_node(&hex, "").await;
        // The registry keeps one session per key: a returning key replaces
        // its old session, whose attempts end with its connection.
        if let Some(old) = self.coord.sessions.get(&node).map(|s| s.conn) {
            self.fault(Fault::SameKeyReturn);
            self.conn_lost(node, old, "the node reconnected; the old session ended");
        }
        self.coord.sessions.insert(
            node,
            Session {
                conn,
                reserved: 0,
                running: 0,
            },
        );
        self.trace(&format!("joined {node} conn {conn}"));
        self.at(0, Ev::Place);
    }

    /// The coordinator learns `conn` of `node` closed: its session goes,
    /// its attempts fail (retryably, their unsigned tokens dropped).
    fn conn_lost(&mut self, node: usize, conn: u64, reason: &str) {
        if self
            .coord
            .sessions
            .get(&node)
            .is_some_and(|s| s.conn == conn)
        {
            self.coord.sessions.remove(&node);
        }
        let ended: Vec<JobId> = self
            .coord
            .live
            .iter()
            .filter(|(_, l)| l.node == node && l.conn == conn)
            .map(|(id, _)| *id)
            .collect();
        for id in ended {
            self.end_live(
                id,
                Outcome::Failed {
                    reason: reason.into(),
                    retryable: true,
                },
            );
        }
    }

    // --- the coordinator's side of a job stream ---------------------------

    /// `Dispatcher::follow`, one update.
    async fn deliver(&mut self, conn: u64, job: JobId, attempt: u32, msg: Msg) {
        let current = self
            .coord
            .live
            .get(&job)
            .is_some_and(|l| l.attempt == attempt && l.conn == conn);
        if !current {
            // The stream was already ended (reset): nothing reads it. A
            // result still reaches the store now and then, as from a second
            // replica that lost the job or a stale retry: the store's guard
            // must refuse it.
            if let Msg::Result(signed) = msg {
                if self.faulty && self.rng.gen_bool(0.3) {
                    self.zombie(job, attempt, &signed).await;
                }
            }
            return;
        }
        let now = self.now;
        let lease = self.knobs.lease_ms;
        let Some(live) = self.coord.live.get_mut(&job) else {
            return;
        };
        live.last_progress = now;
        let node_hex = live.segment.node_id.clone();
        match msg {
            Msg::Started => {
                if self.write_fails() == Some(false) {
                    return;
                }
                let _ = self.store.mark_running(job, attempt, &node_hex).await;
            }
            Msg::Tokens { index, ids } => {
                let next = live.segment.first_index as usize + live.segment.token_ids.len();
                if index as usize != next {
                    let reason = format!("the node sent token {index} where token {next} was due");
                    self.end_live(
                        job,
                        Outcome::Failed {
                            reason,
                            retryable: true,
                        },
                    );
                    return;
                }
                live.segment.token_ids.extend_from_slice(&ids);
                live.segment.text.push_str(&text_of(&ids));
                self.at(
                    lease,
                    Ev::Lease {
                        coord: self.coord.epoch,
                        job,
                        attempt,
                    },
                );
            }
            Msg::Result(signed) => {
                let checked = if self.mutation == Some(Mutation::SkipResultCheck) {
                    Ok(())
                } else {
                    let drained = self.nodes[live.node].drained_conn == live.conn;
                    check_result(&signed, &live.expected)
                        .and_then(|()| check_streamed(&signed, &live.segment, drained))
                };
                let outcome = match checked {
                    Ok(()) => {
                        let handoff = mlxnet_coordinator::link::job::is_handoff(&signed);
                        if handoff {
                            Outcome::HandedOff(signed)
                        } else {
                            Outcome::Completed(signed)
                        }
                    }
                    Err(e) => Outcome::Failed {
                        reason: format!("result refused: {e}"),
                        retryable: true,
                    },
                };
                self.end_live(job, outcome);
            }
            Msg::Failure { retryable } => self.end_live(
                job,
                Outcome::Failed {
                    reason: "node failed the job".into(),
                    retryable,
                },
            ),
        }
    }

    /// A result of an ended attempt, offered to the store.
    async fn zombie(&mut self, job: JobId, attempt: u32, signed: &SignedClaim) {
        let Some(c) = signed.claim.as_ref() else {
            return;
        };
        // One coordinator never offers a reset stream's result to the
        // store; a second one could only once the store ended the attempt
        // (its end recorded, or requeued by a restart).
        let ended = match self.store.get_job(job).await {
            Ok(Some(r)) => {
                r.attempt != attempt || !matches!(r.state, JobState::Assigned | JobState::Running)
            }
            _ => false,
        };
        if !ended {
            return;
        }
        self.fault(Fault::MessageReordered);
        let Ok(node) = NodeId::from_bytes(&c.node_id) else {
            return;
        };
        let completion = Completion {
            job_id: job,
            attempt,
            node_id: node.to_string(),
            result: signed.clone(),
        };
        if let Ok(true) = self.store.complete(&completion).await {
            self.violation(format!(
                "the store accepted the result of attempt {attempt} of {job}, an attempt the coordinator had ended"
            ));
        }
    }

    async fn lease(&mut self, job: JobId, attempt: u32) {
        let Some(live) = self.coord.live.get(&job) else {
            return;
        };
        if live.attempt != attempt {
            return;
        }
        let idle = self.now - live.last_progress;
        let ran = self.now - live.started_at;
        if ran >= self.knobs.job_timeout_ms {
            self.end_live(
                job,
                Outcome::Failed {
                    reason: "the node did not finish in time".into(),
                    retryable: true,
                },
            );
        } else if idle >= self.knobs.lease_ms {
            if self.mutation == Some(Mutation::SkipLease) {
                return;
            }
            self.end_live(
                job,
                Outcome::Failed {
                    reason: format!("lease expired: no progress for {idle} ms"),
                    retryable: true,
                },
            );
        } else {
            let left = self.knobs.lease_ms - idle;
            self.at(
                left,
                Ev::Lease {
                    coord: self.coord.epoch,
                    job,
                    attempt,
                },
            );
        }
    }

    /// The attempt's stream ended: release its slot and record the end
    /// (`run_attempt` after `drive`).
    fn end_live(&mut self, job: JobId, outcome: Outcome) {
        let Some(mut live) = self.coord.live.remove(&job) else {
            return;
        };
        self.release(&live);
        self.nodes[live.node].work.remove(&(job, live.attempt));
        match &outcome {
            Outcome::HandedOff(signed) => live.segment.claim = Some((**signed).clone()),
            // `run_attempt`: a failed or vanished attempt keeps no unsigned
            // tokens (nothing tells a power loss from a node that streamed
            // junk and left); the next attempt starts after the last
            // signed segment.
            Outcome::Failed { .. } => {
                live.segment.token_ids.clear();
                live.segment.text.clear();
            }
            Outcome::Completed(_) => {}
        }
        self.trace(&format!(
            "attempt {} of {job} ended: {outcome:?}",
            live.attempt
        ));
        let coord = self.coord.epoch;
        self.at(
            0,
            Ev::Record {
                coord,
                job: Box::new(live.record),
                node: live.node,
                outcome,
                segment: Box::new(live.segment),
                tries: 0,
            },
        );
        self.at(0, Ev::Place);
    }

    /// One try of recording an attempt's end; a store error retries after
    /// the backoff, up to `RECORD_RETRIES`, then the job is left to the
    /// restart's orphan requeue (as `run_attempt` does).
    async fn record(
        &mut self,
        job: JobRecord,
        node: usize,
        outcome: Outcome,
        segment: Segment,
        tries: u32,
    ) {
        let result = match &outcome {
            Outcome::Completed(signed) => self.record_completion(&job, node, signed).await,
            Outcome::Failed { reason, retryable } => {
                self.record_failure(&job, node, reason, *retryable, &segment)
                    .await
            }
            Outcome::HandedOff(_) => {
                let reason = format!(
                    "the node drained; handed off after token {}",
                    segment.first_index as usize + segment.token_ids.len()
                );
                self.record_failure(&job, node, &reason, true, &segment)
                    .await
            }
        };
        match (result, record_backoff(tries + 1)) {
            (Ok(()), _) => {}
            (Err(()), Some(wait)) => {
                let coord = self.coord.epoch;
                self.at(
                    wait.as_millis() as i64,
                    Ev::Record {
                        coord,
                        job: Box::new(job),
                        node,
                        outcome,
                        segment: Box::new(segment),
                        tries: tries + 1,
                    },
                );
            }
            (Err(()), None) => self.trace(&format!("recording the end of {} gave up", job.id)),
        }
    }

    /// `Dispatcher::record_completion`.
    async fn record_completion(
        &mut self,
        job: &JobRecord,
        node: usize,
        signed: &SignedClaim,
    ) -> Result<(), ()> {
        let hex = self.nodes[node].hex.clone();
        let completion = Completion {
            job_id: job.id,
            attempt: job.attempt,
            node_id: hex.clone(),
            result: signed.clone(),
        };
        let fails = self.write_fails();
        if fails == Some(false) {
            return Err(());
        }
        let done = self.store.complete(&completion).await;
        if fails == Some(true) {
            if done.as_ref().is_ok_and(|d| *d) {
                self.verified(job.id, job.attempt, &hex, signed);
            }
            return Err(());
        }
        match done {
            Ok(true) => {}
            Ok(false) => return Ok(()),
            Err(_) => return Err(()),
        }
        self.verified(job.id, job.attempt, &hex, signed);
        self.trace(&format!("completed {} #{}", job.id, job.attempt));
        // A duplicated delivery records the same result again: the guard
        // must make it a no-op.
        if self.faulty && self.rng.gen_bool(0.02) {
            self.fault(Fault::MessageDuplicated);
            if let Ok(true) = self.store.complete(&completion).await {
                self.violation(format!("{} completed twice", job.id));
            }
        }
        if self.crash_here() {
            self.crash().await;
            return Ok(());
        }
        self.maybe_audit(job, node).await;
        if self.crash_here() {
            self.crash().await;
            return Ok(());
        }
        self.settle(job.id).await;
        if self.faulty && self.rng.gen_bool(0.02) {
            self.fault(Fault::MessageDuplicated);
            self.settle(job.id).await;
        }
        Ok(())
    }

    fn verified(&mut self, job: JobId, attempt: u32, hex: &str, signed: &SignedClaim) {
        let tokens = signed.claim.as_ref().map_or(0, |c| c.completion_tokens);
        if let Some(t) = self.jobs.get_mut(&job) {
            t.verified.insert((attempt, hex.to_owned()), tokens);
        }
    }

    /// `Dispatcher::record_failure`.
    async fn record_failure(
        &mut self,
        job: &JobRecord,
        node: usize,
        reason: &str,
        retryable: bool,
        segment: &Segment,
    ) -> Result<(), ()> {
        let hex = self.nodes[node].hex.clone();
        let end = StreamedEnd {
            job: job.id,
            attempt: job.attempt,
            node_id: &hex,
            reason,
            retryable,
            max_attempts: self.knobs.max_attempts,
        };
        let fails = self.write_fails();
        if fails == Some(false) {
            return Err(());
        }
        let ended = self.store.end_attempt_streamed(&end, segment).await;
        if let (Ok(Some(_)), Some(claim)) = (&ended, &segment.claim) {
            self.verified(job.id, job.attempt, &hex, claim);
        }
        if matches!(ended, Ok(Some(_))) {
            self.check_signed_output(job.id).await;
        }
        if fails == Some(true) {
            return Err(());
        }
        match ended {
            Ok(Some(AttemptEnd::Requeued { attempt })) => {
                self.trace(&format!("requeued {} as #{attempt}: {reason}", job.id));
            }
            Ok(Some(AttemptEnd::Failed)) => {
                self.trace(&format!("failed {}: {reason}", job.id));
                if self.crash_here() {
                    self.crash().await;
                    return Ok(());
                }
                self.settle(job.id).await;
            }
            Ok(None) => {}
            Err(e) => {
                self.trace(&format!("end of {} failed: {e}", job.id));
                return Err(());
            }
        }
        Ok(())
    }

    /// `Dispatcher::maybe_audit`, with the verdict arriving later.
    async fn maybe_audit(&mut self, job: &JobRecord, node: usize) {
        let hex = self.nodes[node].hex.clone();
        let Ok(record) = self.audits.record(&hex).await else {
            return;
        };
        let rate = audit_rate(&self.audits.config, &record);
        if rate <= 0.0 || !self.rng.gen_bool(rate.min(1.0)) {
            return;
        }
        if !matches!(
            self.audits.begin(&job.id.to_string(), &hex, self.now).await,
            Ok(true)
        ) {
            return;
        }
        // A hostile node's work fails its audit most of the time.
        let passed = self.nodes[node].hostile.is_none() || self.rng.gen_bool(0.2);
        let window = self.knobs.audit.window_ms.max(1);
        let after = self.rng.gen_range(1..=window + window / 4);
        self.at(
            after,
            Ev::AuditEnd {
                job: job.id,
                node,
                passed,
            },
        );
    }

    async fn audit_end(&mut self, job: JobId, node: usize, passed: bool) {
        if !self.coord.up {
            return;
        }
        // Honest auditors agree: a pass settles the audit with one verdict,
        // a failure counts once a second auditor confirms it
        // (`Audits::conclude`).
        let n = self.nodes.len();
        let auditors: Vec<usize> = if passed {
            vec![(node + 1) % n]
        } else {
            vec![(node + 1) % n, (node + 2) % n]
        };
        let verdicts: Vec<Verdict> = auditors
            .into_iter()
            .map(|auditor| {
                let verdict = AuditVerdict {
                    job_id: job.to_string(),
                    passed,
                    auditor_id: self.nodes[auditor].id.as_bytes().to_vec(),
                    ..AuditVerdict::default()
                };
                Verdict {
                    auditor: self.nodes[auditor].hex.clone(),
                    signed: claim::sign_verdict(verdict, &self.nodes[auditor].key),
                    passed,
                }
            })
            .collect();
        let ended = self
            .audits
            .conclude(&job.to_string(), &verdicts, self.now)
            .await;
        self.trace(&format!(
            "audit of {job}: passed {passed}: {:?}",
            ended.is_ok()
        ));
        // A failed audit voids the pay now (the sweep would, too).
        if !passed {
            self.settle(job).await;
        }
    }

    // --- faults --------------------------------------------------------

    async fn inject(&mut self) {
        let roll = self.rng.gen_range(0..100);
        let node = self.rng.gen_range(0..self.nodes.len());
        match roll {
            0..=19 => {
                // A node's process dies; it comes back with the same key.
                if !self.nodes[node].up {
                    return;
                }
                self.fault(Fault::NodeCrash);
                self.node_down(node, IDLE_TIMEOUT_MS);
                let back = self.rng.gen_range(1_000..60_000);
                self.at(back, Ev::Join { node });
            }
            20..=34 => {
                self.fault(Fault::NodeStall);
                let stall = self.rng.gen_range(500..(3 * self.knobs.lease_ms));
                self.nodes[node].stalled_until = self.now + stall;
            }
            35..=49 => {
                // The link drops; the node redials with the same key, maybe
                // before the coordinator noticed the old connection died.
                if !self.nodes[node].up || self.nodes[node].conn == 0 {
                    return;
                }
                self.fault(Fault::LinkLost);
                let noticed = self.rng.gen_range(0..IDLE_TIMEOUT_MS);
                self.node_down(node, noticed);
                self.nodes[node].up = true;
                let back = self.rng.gen_range(100..IDLE_TIMEOUT_MS);
                self.at(back, Ev::Join { node });
            }
            50..=64 => {
                // The owner of an idle-time Mac comes back: the node drains,
                // handing each job off with a claim of what it streamed.
                if self.nodes[node].mode != Mode::IdleTime || self.nodes[node].conn == 0 {
                    return;
                }
                self.fault(Fault::OwnerReturn);
                // Its `Drain` reaches the coordinator before the hand-off
                // claims (the real coordinator waits for it).
                self.nodes[node].drained_conn = self.nodes[node].conn;
                let running: Vec<(JobId, u32)> = self.nodes[node].work.keys().copied().collect();
                for (job, attempt) in running {
                    let started = self.nodes[node]
                        .work
                        .get(&(job, attempt))
                        .is_some_and(|w| w.started);
                    if !started {
                        continue;
                    }
                    let signed = self.claim_of(node, job, attempt, true);
                    self.nodes[node].work.remove(&(job, attempt));
                    self.send(node, job, attempt, Msg::Result(Box::new(signed)));
                }
                // It leaves once drained, and is back when the owner is done.
                let gone = self.rng.gen_range(200..2_000);
                let conn = self.nodes[node].conn;
                let coord = self.coord.epoch;
                self.at(gone, Ev::ConnLost { coord, node, conn });
                self.nodes[node].conn = 0;
                self.nodes[node].up = false;
                let back = self.rng.gen_range(10_000..120_000);
                self.at(back, Ev::Join { node });
            }
            65..=72 => {
                if !self.coord.up {
                    return;
                }
                self.fault(Fault::CoordinatorCrash);
                self.crash().await;
            }
            73..=78 => {
                self.fault(Fault::StoreOutage);
                self.outage_until = self.now + self.rng.gen_range(100..3_000);
            }
            79..=84 => {
                // A node fails a job it runs (out of memory, a bad model file).
                let Some(&(job, attempt)) = self.nodes[node].work.keys().next() else {
                    return;
                };
                self.nodes[node].work.remove(&(job, attempt));
                let retryable = self.rng.gen_bool(0.8);
                self.send(node, job, attempt, Msg::Failure { retryable });
            }
            _ => {}
        }
    }

    /// The node's connection dies; the coordinator notices after `noticed`.
    fn node_down(&mut self, node: usize, noticed: i64) {
        let conn = self.nodes[node].conn;
        self.nodes[node].up = false;
        self.nodes[node].conn = 0;
        self.nodes[node].work.clear();
        if conn != 0 {
            let coord = self.coord.epoch;
            self.at(noticed, Ev::ConnLost { coord, node, conn });
        }
    }

    /// The coordinator dies: what it held in memory is gone, connections
    /// drop, the database stays (every commit that returned has landed).
    async fn crash(&mut self) {
        self.trace("coordinator crashed");
        self.coord.up = false;
        self.coord.epoch += 1;
        self.coord.sessions.clear();
        self.coord.live.clear();
        for n in &mut self.nodes {
            n.conn = 0;
            n.work.clear();
        }
        self.store.close().await;
        let back = self.rng.gen_range(500..10_000);
        self.at(back, Ev::Restart);
    }

    /// `Application::build` after a crash: the store reopened, the real
    /// start-up recovery, audits loaded, nodes redial.
    async fn restart(&mut self) {
        if self.coord.up {
            return;
        }
        let store = match AnyStore::connect(&self.url).await {
            Ok(s) => s,
            Err(e) => {
                self.violation(format!("the database did not reopen: {e}"));
                return;
            }
        };
        self.store = store.clone();
        self.ledger = Ledger::new(store.clone(), self.knobs.ledger.clone());
        match app::recover(&store, &self.ledger, self.knobs.max_attempts, SIM_REPLICA).await {
            Ok((requeued, swept)) => {
                self.trace(&format!("recovered: requeued {requeued}, {swept:?}"))
            }
            Err(e) => {
                self.violation(format!("start-up recovery failed: {e}"));
                return;
            }
        }
        match Audits::load(store, self.knobs.audit.clone()).await {
            Ok(a) => self.audits = Arc::new(a),
            Err(e) => self.violation(format!("loading audits failed: {e}")),
        }
        self.coord.up = true;
        for node in 0..self.nodes.len() {
            if self.nodes[node].up {
                let at = self.rng.gen_range(10..3_000);
                self.at(at, Ev::Join { node });
            }
        }
    }

    // --- invariants ----------------------------------------------------

    /// The invariants every step must keep.
    async fn check(&mut self) {
        let mut broken = Vec::new();
        for (&i, s) in &self.coord.sessions {
            let n = &self.nodes[i];
            if s.reserved > n.memory || s.running > n.max_jobs {
                broken.push(format!(
                    "node {i} overcommitted: {} of {} bytes, {} of {} jobs",
                    s.reserved, n.memory, s.running, n.max_jobs
                ));
            }
        }
        for b in broken {
            self.violation(b);
        }
        if !self.coord.up {
            return;
        }
        self.check_books(false).await;
    }

    /// The ledger's books; with `settled`, also that nothing is left open
    /// that should have been resolved (true only after a final sweep).
    async fn check_books(&mut self, settled: bool) {
        let mut broken = Vec::new();
        match self.store.totals().await {
            Ok(t) if t.posted != 0 || t.pending != 0 => {
                broken.push(format!("sums over accounts are {t:?}, not zero"));
            }
            Ok(_) => {}
            Err(e) => broken.push(format!("reading totals failed: {e}")),
        }
        match self
            .store
            .ledger_anomalies(self.now, self.knobs.ledger.audit_window_ms)
            .await
        {
            Ok(found) => {
                for (what, id) in found {
                    let transient =
                        matches!(what, Anomaly::OpenPastDeadline | Anomaly::EndedWithHoldOpen);
                    if settled || !transient {
                        broken.push(format!("{id}: {what:?}"));
                    }
                }
            }
            Err(e) => broken.push(format!("reading anomalies failed: {e}")),
        }
        if settled || self.steps.is_multiple_of(64) {
            match self.store.balance_mismatches().await {
                Ok(m) => broken.extend(
                    m.into_iter()
                        .map(|a| format!("account {a}: balances differ from its transfers")),
                ),
                Err(e) => broken.push(format!("reading balances failed: {e}")),
            }
            for c in 0..self.clients.len() {
                let id = self.clients[c].account.clone();
                if let Ok(Some(a)) = self.store.account(&id).await {
                    if a.debits_posted + a.debits_pending > a.credits_posted {
                        broken.push(format!("account {id} overdrawn: {a:?}"));
                    }
                }
            }
        }
        for b in broken {
            self.violation(b);
        }
    }

    /// After the drain: liveness, every hold resolved, every payout covered.
    async fn finish(&mut self) {
        if !self.coord.up {
            self.violation("the coordinator was down at the end".into());
            return;
        }
        let stuck: Vec<JobId> = {
            let mut out = Vec::new();
            for &id in self.jobs.keys() {
                match self.store.get_job(id).await {
                    Ok(Some(r)) if !r.state.is_terminal() => out.push(id),
                    Ok(None) => out.push(id),
                    _ => {}
                }
            }
            out
        };
        for id in stuck.iter().take(5) {
            let state = self
                .store
                .get_job(*id)
                .await
                .ok()
                .flatten()
                .map(|r| (r.state, r.attempt));
            self.violation(format!(
                "liveness: job {id} not terminal {} ms after faults stopped: {state:?}",
                LIVENESS_BOUND_MS
            ));
        }
        // Past every audit window and hold deadline, one more sweep: then
        // nothing may be left open.
        let later = self.now + self.knobs.ledger.hold_ttl_ms + self.knobs.audit.window_ms + 1;
        self.now = later;
        self.clock.set(later);
        self.sweep().await;
        self.check_books(true).await;
        self.check_payouts().await;
        let ids: Vec<JobId> = self.jobs.keys().copied().collect();
        for id in ids {
            self.check_signed_output(id).await;
        }
        if let Ok(s) = self.store.job_stats().await {
            self.ended = (s.completed, s.failed, s.cancelled);
        }
    }

    /// The dispatcher's rule for a job's kept output: every token a job
    /// keeps from an ended attempt is under that attempt's signed claim (a
    /// drained node's hand-off); a failed or vanished attempt leaves
    /// nothing, and the next one starts after the last signed segment.
    async fn check_signed_output(&mut self, job: JobId) {
        let segments = match self.store.segments(job).await {
            Ok(s) => s,
            Err(e) => {
                self.trace(&format!("segments of {job} failed: {e}"));
                return;
            }
        };
        let mut broken = Vec::new();
        let mut next = 0u32;
        for s in &segments {
            if s.first_index != next {
                broken.push(format!(
                    "{job}: attempt {}'s segment starts at token {}, the kept output ends at {next}",
                    s.attempt, s.first_index
                ));
            }
            next = s.first_index + s.token_ids.len() as u32;
            if s.token_ids.is_empty() {
                continue;
            }
            let signed = s.claim.as_ref().and_then(|c| c.claim.as_ref());
            let covered =
                signed.is_some_and(|c| c.attempt == s.attempt && c.output_token_ids == s.token_ids);
            if !covered {
                broken.push(format!(
                    "{job}: attempt {} of node {} kept {} tokens no signed claim covers",
                    s.attempt,
                    &s.node_id[..s.node_id.len().min(8)],
                    s.token_ids.len()
                ));
            }
        }
        for b in broken {
            self.violation(b);
        }
    }

    /// Every payout is for a verified claim of that attempt and node, and a
    /// job's post is within what its verified tokens and prompt allow.
    async fn check_payouts(&mut self) {
        let mut broken = Vec::new();
        for (id, track) in &self.jobs {
            let Ok(transfers) = self.store.job_transfers(&id.to_string()).await else {
                continue;
            };
            let Some(model) = self.catalogue.get(&track.model) else {
                continue;
            };
            let prefix = format!("job:{id}:pay:");
            let mut output: u64 = 0;
            for t in &transfers {
                let Some(rest) = t.id.strip_prefix(&prefix) else {
                    continue;
                };
                let mut parts = rest.splitn(2, ':');
                let attempt: u32 = parts.next().and_then(|a| a.parse().ok()).unwrap_or(0);
                let node = parts.next().unwrap_or_default().to_owned();
                match track.verified.get(&(attempt, node.clone())) {
                    Some(&tokens) => output += u64::from(tokens),
                    None => broken.push(format!(
                        "{id}: paid {} to attempt {attempt} of node {} without a verified claim",
                        t.amount,
                        &node[..node.len().min(8)]
                    )),
                }
            }
            if output > u64::from(track.max_tokens) {
                broken.push(format!(
                    "{id}: paid for {output} output tokens, the job allows {}",
                    track.max_tokens
                ));
            }
            let bound = model.price().of(
                prompt_tokens_bound(&track.input),
                output.min(u64::from(track.max_tokens)),
            );
            if let Some(post) = transfers.iter().find(|t| t.id == format!("job:{id}:post")) {
                if post.amount > bound {
                    broken.push(format!(
                        "{id}: posted {} micro-MLX, more than its prompt and {output} verified tokens cost ({bound})",
                        post.amount
                    ));
                }
            }
        }
        for b in broken {
            self.violation(b);
        }
    }

    fn report(&mut self) -> Report {
        let trace = hex::encode(std::mem::take(&mut self.trace).finalize());
        Report {
            seed: self.seed,
            steps: self.steps,
            nodes: self.nodes.len() as u32,
            jobs: self.jobs.len() as u64,
            completed: self.ended.0,
            failed: self.ended.1,
            cancelled: self.ended.2,
            faults: self.faults.clone(),
            violations: std::mem::take(&mut self.violations),
            trace,
        }
    }
}
