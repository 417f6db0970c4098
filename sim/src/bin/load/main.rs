//! The load run over real QUIC: a real coordinator in a child process, N
//! virtual nodes on the real node link, clients submitting over gRPC at a
//! seeded Poisson rate; prints the table against its goals.
//!
//! What is real: the coordinator (`Application::build` with its SQLite
//! store, ledger, scheduler, dispatcher and QUIC link, in a child process
//! of this binary so its CPU time and memory are read from
//! `/proc/<pid>/stat` and `/proc/<pid>/status`), the node link's wire
//! protocol (QUIC with the pinned certificate, `Open`, the challenge
//! signed with a real ed25519 key over the connection's exporter, `Hello`,
//! heartbeats at the interval `Welcome` asks for, one bidirectional stream
//! per job, `Started`, token frames, a claim signed with `claim::sign`),
//! and the client API (gRPC `Submit` and `Watch`, with a real API key).
//! What is fake: the engine. Each virtual node runs a timed fake that
//! sleeps its chip's prefill time, then emits made-up tokens at its chip's
//! decode rate; it says so (its Hello's name and version are
//! `fake-engine`), and its claims carry its own prefill time, which the
//! client subtracts from submit-to-first-token. Audits are off in the
//! child (no fake can re-score a claim).
//!
//! Many nodes share a few quinn client endpoints (`--endpoints`): one UDP
//! socket each, so file descriptors do not grow with nodes (no limit is
//! raised); handshakes are limited to `--dial-concurrency` at once so the
//! coordinator's handshake timeout is not what is measured.
//!
//! `--kills N` runs the process-kill run instead ([`kills`]): the same
//! coordinator child killed with SIGKILL N times under load and restarted
//! on its database, then every job and the books checked there.
//!
//! Modules: [`coordinator`] (the child and its handle), [`node`] (a virtual
//! node and its fake engine), [`kills`] (the process-kill run).
//!
//! # Failure
//! A registration that fails (a handshake timed out under load, a refusal)
//! is tried again with backoff, as a real node does, up to
//! `--register-attempts`; the report counts the retries. The run exits
//! non-zero when the child does not start, a node is not welcomed after
//! its last try, or (with `--require-all`) a job does not complete with a
//! claim that verifies; figures are printed either way.

#![allow(clippy::print_stdout, reason = "a command-line tool's report")]

mod coordinator;
mod kills;
mod node;

use std::{
    path::PathBuf,
    sync::{atomic::Ordering, Arc},
    time::{Duration, Instant},
};

use anyhow::{anyhow, bail, Context, Result};
use clap::Parser;
use futures::StreamExt;
use mlxnet_coordinator::test_utils::client_config;
use mlxnet_proto::{
    bearer::{authed, Authed, Bearer},
    claim,
    v1::{
        job_event, job_input, jobs_client::JobsClient, JobInput, SamplingParams, SubmitJobRequest,
        WatchJobRequest,
    },
};
use rand::{rngs::StdRng, Rng, SeedableRng};
use tokio::sync::{Mutex, Semaphore};

use crate::{
    coordinator::Coordinator,
    node::{Dial, NodeStats},
};

/// The model every virtual node holds.
const MODEL: &str = "smollm2-135m-instruct";
/// What the fake engine's Hello says it is.
const FAKE_VERSION: &str = "mlxnet-load/fake-engine";
/// The child's starting balance for the load's client (micro-MLX).
const GRANT: i64 = 1_000_000_000_000;
#[derive(Parser, Debug, Clone)]
#[command(about = "mlx-network's load run: a real coordinator, N virtual nodes over QUIC")]
struct Args {
    /// Virtual nodes.
    #[arg(long, default_value_t = 50)]
    nodes: usize,
    /// Jobs the clients submit.
    #[arg(long, default_value_t = 200)]
    jobs: usize,
    /// Mean submits per second (Poisson).
    #[arg(long, default_value_t = 50.0)]
    rate: f64,
    /// Tokens each job asks for.
    #[arg(long, default_value_t = 16)]
    max_tokens: u32,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Quinn client endpoints the nodes share.
    #[arg(long, default_value_t = 8)]
    endpoints: usize,
    /// Handshakes at once.
    #[arg(long, default_value_t = 64)]
    dial_concurrency: usize,
    /// gRPC channels the clients share.
    #[arg(long, default_value_t = 4)]
    channels: usize,
    /// Heartbeat intervals to wait once every node is welcomed, before the
    /// idle memory is read.
    #[arg(long, default_value_t = 2)]
    settle_beats: u32,
    /// The heartbeat interval the coordinator asks for (its default: 5 s);
    /// its timeout is three intervals, as by default.
    #[arg(long, default_value_t = 5_000)]
    heartbeat_ms: u64,
    /// Exit non-zero unless every job completed with a verified claim.
    #[arg(long)]
    require_all: bool,
    /// Tries per node to dial, prove its key and be welcomed, as a real
    /// node retries: exponential backoff with equal jitter between tries.
    #[arg(long, default_value_t = 8)]
    register_attempts: u32,
    /// The process-kill run: SIGKILL the coordinator this many times at
    /// seeded random moments while clients submit at `--rate` (`--jobs` is
    /// then unused), restart it on the same database and ports each time,
    /// and check the books and every job against the database at the end.
    #[arg(long, default_value_t = 0)]
    kills: u32,
    /// The process-kill run: mean time between kills (exponential gaps).
    #[arg(long, default_value_t = 3_000)]
    kill_every_ms: u64,
    /// The process-kill run with PostgreSQL restarts instead: each of the
    /// `--kills` faults runs this shell command (one that restarts the
    /// PostgreSQL server `--postgres` names, e.g. `pg_ctl -D DIR -m
    /// immediate restart`) and the coordinator is not killed: it must ride
    /// the restart out.
    #[arg(long)]
    restart_postgres: Option<String>,
    /// The process-kill run: how long, after the last restart, every job
    /// has to reach an end before it counts as lost.
    #[arg(long, default_value_t = 300)]
    settle_s: u64,
    /// The process-kill run on PostgreSQL: the URL of a server's database
    /// (`postgres://USER@HOST:PORT/postgres`); the run creates a fresh
    /// database there for the coordinator and drops it at the end.
    /// Without it the coordinator uses SQLite in its data directory.
    #[arg(long)]
    postgres: Option<String>,
    /// Internal: the child's database URL.
    #[arg(long, hide = true)]
    database_url: Option<String>,
    /// Internal: the child's gRPC port (0: any).
    #[arg(long, default_value_t = 0, hide = true)]
    grpc_port: u16,
    /// Internal: the child's QUIC port (0: any).
    #[arg(long, default_value_t = 0, hide = true)]
    quic_port: u16,
    /// Internal: run the coordinator in this process (the child).
    #[arg(long, hide = true)]
    coordinator_child: Option<PathBuf>,
}

fn main() -> Result<()> {
    let args = Args::parse();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    if let Some(dir) = &args.coordinator_child {
        return runtime.block_on(coordinator::child(dir.clone(), &args));
    }
    if args.kills > 0 {
        return runtime.block_on(kills::run(args));
    }
    runtime.block_on(parent(args))
}

async fn parent(args: Args) -> Result<()> {
    let dir = std::env::temp_dir().join(format!("mlxnet-load-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let coordinator = Coordinator::start(&dir, &args, None)?;
    let result = drive(&args, &coordinator).await;
    drop(coordinator);
    let _ = std::fs::remove_dir_all(&dir);
    result
}

async fn drive(args: &Args, coordinator: &Coordinator) -> Result<()> {
    let mut rng = StdRng::seed_from_u64(args.seed);
    let client = client_config(&coordinator.fingerprint);
    let mut endpoints = Vec::new();
    for _ in 0..args.endpoints.max(1) {
        let mut e = quinn::Endpoint::client("127.0.0.1:0".parse()?)?;
        e.set_default_client_config(client.clone());
        endpoints.push(e);
    }
    let nodes = node::fleet(args.nodes, &mut rng);

    let (rss_before, _) = coordinator.usage()?;
    let stats = Arc::new(NodeStats::default());
    let dials = Arc::new(Semaphore::new(args.dial_concurrency.max(1)));
    let (welcomed_tx, mut welcomed_rx) = tokio::sync::mpsc::channel::<Result<Duration>>(1024);
    let connect_start = Instant::now();
    for (i, node) in nodes.into_iter().enumerate() {
        let endpoint = endpoints[i % endpoints.len()].clone();
        let tx = welcomed_tx.clone();
        let stats = Arc::clone(&stats);
        let dials = Arc::clone(&dials);
        let addr = coordinator.quic;
        let attempts = args.register_attempts.max(1);
        let jitter = StdRng::seed_from_u64(args.seed ^ (i as u64).wrapping_mul(0x9e37_79b9));
        let dial = Dial {
            endpoint,
            addr,
            dials,
            stats,
            attempts,
            reconnect: false,
        };
        tokio::spawn(node::run(node, i, dial, jitter, tx));
    }
    drop(welcomed_tx);
    let mut interval = Duration::from_secs(5);
    for _ in 0..args.nodes {
        match welcomed_rx.recv().await {
            Some(Ok(i)) => interval = i,
            Some(Err(e)) => return Err(e),
            None => bail!("nodes ended before all were welcomed"),
        }
    }
    let connect_s = connect_start.elapsed().as_secs_f64();
    // Idle: every node welcomed and heartbeating, no job yet.
    let (_, cpu_idle0) = coordinator.usage()?;
    let settle = interval * args.settle_beats.max(1);
    tokio::time::sleep(settle).await;
    let (rss_idle, cpu_idle1) = coordinator.usage()?;
    let idle_cpu_per_s = (cpu_idle1 - cpu_idle0) / settle.as_secs_f64();

    // Clients: Poisson arrivals, each job watched to its end.
    let mut channels = Vec::new();
    for _ in 0..args.channels.max(1) {
        let ch = tonic::transport::Channel::from_shared(coordinator.grpc.clone())?
            .connect()
            .await?;
        let bearer = Bearer::for_key(Some(&coordinator.key)).map_err(|e| anyhow!("{e:?}"))?;
        channels.push(authed(ch, bearer));
    }
    let results = Arc::new(Mutex::new(Vec::<JobResult>::new()));
    let (_, cpu0) = coordinator.usage()?;
    let load_start = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    let mut next = Instant::now();
    for j in 0..args.jobs {
        let gap: f64 = -(1.0 - rng.gen::<f64>()).ln() / args.rate.max(1e-6);
        next += Duration::from_secs_f64(gap);
        tokio::time::sleep_until(next.into()).await;
        let channel = channels[j % channels.len()].clone();
        let results = Arc::clone(&results);
        let max_tokens = args.max_tokens;
        let prompt = format!("load run job {j}: say something about the number {j}");
        tasks.spawn(async move {
            let r = one_job(channel, prompt, max_tokens).await;
            results.lock().await.push(r);
        });
    }
    while tasks.join_next().await.is_some() {}
    let load_s = load_start.elapsed().as_secs_f64();
    let (rss_end, cpu1) = coordinator.usage()?;
    let results = std::mem::take(&mut *results.lock().await);

    // --- figures ---
    let completed: Vec<&JobResult> = results.iter().filter(|r| r.verified).collect();
    let mut ttft: Vec<f64> = completed.iter().filter_map(|r| r.ttft_ms).collect();
    ttft.sort_by(f64::total_cmp);
    let pct = |p: f64| -> f64 {
        if ttft.is_empty() {
            return f64::NAN;
        }
        let i = ((p * ttft.len() as f64).ceil() as usize).clamp(1, ttft.len()) - 1;
        ttft[i]
    };
    let placed: Vec<f64> = results.iter().filter_map(|r| r.assigned_s).collect();
    let first_submit = results
        .iter()
        .map(|r| r.submitted_s)
        .fold(f64::INFINITY, f64::min);
    let last_placed = placed.iter().copied().fold(0.0, f64::max);
    let placements_per_s = placed.len() as f64 / (last_placed - first_submit).max(1e-3);
    let cpu_per_job_ms = (cpu1 - cpu0) * 1000.0 / completed.len().max(1) as f64;
    let per_node = (rss_idle.saturating_sub(rss_before)) as f64 / args.nodes.max(1) as f64;
    let missed = stats.missed.load(Ordering::Relaxed);
    let lost = stats.lost.load(Ordering::Relaxed);
    let failed: Vec<&JobResult> = results.iter().filter(|r| !r.verified).collect();

    println!("load run: {} nodes over {} quinn endpoints, {} jobs at {} jobs/s (seed {}), {} tokens each; build profile {}",
        args.nodes, args.endpoints, args.jobs, args.rate, args.seed, args.max_tokens, PROFILE);
    println!(
        "  nodes welcomed in {connect_s:.1} s; heartbeat interval {} ms; load phase {load_s:.1} s",
        interval.as_millis()
    );
    println!(
        "  jobs completed with a verified claim: {}/{}",
        completed.len(),
        results.len()
    );
    for f in failed.iter().take(5) {
        println!("    not completed: {}", f.error.as_deref().unwrap_or("?"));
    }
    println!("  {:<52} {:>14} {:>16}", "figure", "measured", "goal");
    println!(
        "  {:<52} {:>11.1} ms {:>16}",
        "submit-to-first-token p50 (minus fake prefill)",
        pct(0.5),
        ""
    );
    println!(
        "  {:<52} {:>11.1} ms {:>16}",
        "submit-to-first-token p99 (minus fake prefill)",
        pct(0.99),
        "<= 100 ms @1000"
    );
    println!(
        "  {:<52} {:>14.1} {:>16}",
        "placements/s (placed jobs / first submit..last placement)", placements_per_s, ""
    );
    println!(
        "  {:<52} {:>11.2} ms {:>16}",
        "coordinator CPU per job (load phase, incl. heartbeats)", cpu_per_job_ms, ""
    );
    println!(
        "  {:<52} {:>11.3} s {:>16}",
        "coordinator CPU per second, idle nodes heartbeating", idle_cpu_per_s, ""
    );
    println!(
        "  {:<52} {:>11.1} KB {:>16}",
        "coordinator memory per connected idle node",
        per_node / 1024.0,
        "<= 20 KB"
    );
    println!(
        "  {:<52} {:>14} {:>16}",
        "heartbeats missed (sent with the last unacked)", missed, "0"
    );
    println!(
        "  {:<52} {:>14} {:>16}",
        "node sessions lost during the run", lost, "0"
    );
    println!("  rss: before nodes {:.1} MB, idle with nodes {:.1} MB, after load {:.1} MB; heartbeats sent {}; job streams {}; registrations retried {}",
        rss_before as f64 / 1e6, rss_idle as f64 / 1e6, rss_end as f64 / 1e6,
        stats.beats.load(Ordering::Relaxed), stats.jobs.load(Ordering::Relaxed),
        stats.retries.load(Ordering::Relaxed));
    if args.require_all && completed.len() != args.jobs {
        bail!(
            "{} of {} jobs did not complete with a verified claim",
            args.jobs - completed.len(),
            args.jobs
        );
    }
    Ok(())
}

#[cfg(debug_assertions)]
const PROFILE: &str = "dev (debug assertions on)";
#[cfg(not(debug_assertions))]
const PROFILE: &str = "optimised (no debug assertions)";

// --- a client ------------------------------------------------------------

struct JobResult {
    submitted_s: f64,
    assigned_s: Option<f64>,
    /// Submit to first token, less the fake engine's prefill.
    ttft_ms: Option<f64>,
    verified: bool,
    error: Option<String>,
}

static EPOCH: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();

fn since_epoch(t: Instant) -> f64 {
    t.duration_since(*EPOCH.get_or_init(Instant::now))
        .as_secs_f64()
}

async fn one_job(channel: Authed, prompt: String, max_tokens: u32) -> JobResult {
    let submitted = Instant::now();
    let mut r = JobResult {
        submitted_s: since_epoch(submitted),
        assigned_s: None,
        ttft_ms: None,
        verified: false,
        error: None,
    };
    if let Err(e) = watch_job(channel, prompt, max_tokens, submitted, &mut r).await {
        r.error = Some(format!("{e:#}"));
    }
    r
}

async fn watch_job(
    channel: Authed,
    prompt: String,
    max_tokens: u32,
    submitted: Instant,
    r: &mut JobResult,
) -> Result<()> {
    let mut jobs = JobsClient::new(channel);
    let job = jobs
        .submit(SubmitJobRequest {
            model: MODEL.into(),
            input: Some(JobInput {
                kind: Some(job_input::Kind::Prompt(prompt)),
            }),
            sampling: Some(SamplingParams {
                max_tokens,
                ..Default::default()
            }),
            max_price_micro_mlx: 0,
            priority: 0,
        })
        .await?
        .into_inner();
    let mut events = jobs
        .watch(WatchJobRequest {
            job_id: job.id.clone(),
        })
        .await?
        .into_inner();
    let mut first_token: Option<Instant> = None;
    while let Some(ev) = events.next().await {
        match ev?.event {
            Some(job_event::Event::Assigned(_)) if r.assigned_s.is_none() => {
                r.assigned_s = Some(since_epoch(Instant::now()));
            }
            Some(job_event::Event::Tokens(_)) => {
                first_token.get_or_insert_with(Instant::now);
            }
            Some(job_event::Event::Completed(c)) => {
                let done = Instant::now();
                let job = c.job.context("a completion without its job")?;
                let signed = job.result.context("a completion without its claim")?;
                let signer = claim::verify(&signed).map_err(|e| anyhow!("claim: {e}"))?;
                let cl = signed.claim.as_ref().context("empty claim")?;
                if cl.job_id != job.id || signer.to_string() != job.node_id {
                    bail!("the claim is not this job's or its node's");
                }
                let prefill = Duration::from_micros(cl.prefill_micros);
                let seen = first_token.unwrap_or(done);
                r.ttft_ms = Some(
                    seen.duration_since(submitted)
                        .saturating_sub(prefill)
                        .as_secs_f64()
                        * 1000.0,
                );
                if r.assigned_s.is_none() {
                    r.assigned_s = Some(since_epoch(seen));
                }
                r.verified = true;
                return Ok(());
            }
            Some(job_event::Event::Failed(f)) => bail!("failed: {}", f.reason),
            Some(job_event::Event::Cancelled(_)) => bail!("cancelled"),
            _ => {}
        }
    }
    bail!("the watch ended before the job did")
}
