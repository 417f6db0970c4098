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
//! # Failure
//! A registration that fails (a handshake timed out under load, a refusal)
//! is tried again with backoff, as a real node does, up to
//! `--register-attempts`; the report counts the retries. The run exits
//! non-zero when the child does not start, a node is not welcomed after
//! its last try, or (with `--require-all`) a job does not complete with a
//! claim that verifies; figures are printed either way.

#![allow(clippy::print_stdout, reason = "a command-line tool's report")]

use std::{
    io::{BufRead, BufReader, Read},
    path::PathBuf,
    process::{Child, Command, Stdio},
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use anyhow::{anyhow, bail, Context, Result};
use clap::Parser;
use ed25519_dalek::{Signer, SigningKey};
use futures::StreamExt;
use mlxnet_coordinator::{
    app::Application,
    config::{smollm2_135m_instruct, CoordinatorConfig},
    ledger::{keys::Scopes, AccountKind},
    test_utils::client_config,
};
use mlxnet_proto::{
    auth,
    bearer::{authed, Authed, Bearer},
    claim,
    frame::{read_frame, write_frame},
    v1::{
        coordinator_control, job_event, job_input, job_update, jobs_client::JobsClient,
        node_control, Assignment, CachedModel, CoordinatorControl, HardwareProfile, Heartbeat,
        Hello, JobInput, JobUpdate, NodeControl, Open, ResultClaim, SamplingParams,
        SubmitJobRequest, WatchJobRequest,
    },
};
use rand::{rngs::StdRng, Rng, SeedableRng};
use tokio::sync::{Mutex, Semaphore};

/// The model every virtual node holds.
const MODEL: &str = "smollm2-135m-instruct";
/// What the fake engine's Hello says it is.
const FAKE_VERSION: &str = "mlxnet-load/fake-engine";
/// The child's starting balance for the load's client (micro-MLX).
const GRANT: i64 = 1_000_000_000_000;

/// A chip: name, memory (GiB), prefill and decode rates (tokens/s) of a
/// 135M-parameter model, share of the fleet.
const CHIPS: [(&str, u64, f64, f64, u32); 6] = [
    ("Apple M1", 16, 2_000.0, 120.0, 20),
    ("Apple M2", 16, 2_500.0, 140.0, 20),
    ("Apple M3 Pro", 36, 4_000.0, 180.0, 20),
    ("Apple M4", 24, 4_500.0, 200.0, 20),
    ("Apple M4 Max", 128, 9_000.0, 300.0, 15),
    ("Apple M2 Ultra", 192, 10_000.0, 320.0, 5),
];

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
        return runtime.block_on(child(dir.clone(), &args));
    }
    runtime.block_on(parent(args))
}

// --- the child: the real coordinator -----------------------------------

/// Builds the coordinator on `dir`, makes the load's client (account,
/// grant, key), prints one `READY` line and runs until stdin closes.
async fn child(dir: PathBuf, args: &Args) -> Result<()> {
    let mut config = CoordinatorConfig::for_data_dir(dir);
    config.heartbeat_interval_ms = args.heartbeat_ms;
    config.heartbeat_timeout_ms = args.heartbeat_ms * 3;
    config.limits.max_node_connections = args.nodes + 64;
    config.limits.key_requests_per_sec = 0;
    config.limits.key_max_in_flight = 0;
    config.limits.max_in_flight_requests = 100_000;
    config.limits.max_queued_jobs = 1_000_000;
    let app = Application::build(config).await?;
    let ledger = app.ledger().clone();
    let account = ledger
        .create_account("load client", AccountKind::Client)
        .await?;
    ledger.grant("load", &account.id, GRANT, "load run").await?;
    let key = ledger
        .create_key(
            &account.id,
            Scopes::from_list(["submit", "read"]).map_err(|e| anyhow!("{e:?}"))?,
            "load",
            None,
        )
        .await?;
    println!(
        "READY {} {} {} {}",
        app.grpc_addr(),
        app.quic_addr(),
        app.cert_fingerprint(),
        key.secret()
    );
    app.run_until(async {
        // The parent holds stdin: its end (or death) stops the child.
        let _ = tokio::task::spawn_blocking(|| {
            let mut sink = Vec::new();
            std::io::stdin().read_to_end(&mut sink)
        })
        .await;
    })
    .await?;
    Ok(())
}

// --- the parent: nodes, clients, figures --------------------------------

struct Coordinator {
    child: Child,
    grpc: String,
    quic: std::net::SocketAddr,
    fingerprint: String,
    key: String,
}

impl Coordinator {
    fn start(dir: &std::path::Path, args: &Args) -> Result<Self> {
        let exe = std::env::current_exe()?;
        let mut child = Command::new(exe)
            .arg("--coordinator-child")
            .arg(dir)
            .arg("--nodes")
            .arg(args.nodes.to_string())
            .arg("--heartbeat-ms")
            .arg(args.heartbeat_ms.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .context("starting the coordinator child")?;
        let out = child.stdout.take().context("the child's stdout")?;
        let mut line = String::new();
        BufReader::new(out).read_line(&mut line)?;
        let parts: Vec<&str> = line.split_whitespace().collect();
        let ["READY", grpc, quic, fingerprint, key] = parts[..] else {
            let _ = child.kill();
            bail!("the coordinator child did not start: {line:?}");
        };
        Ok(Self {
            grpc: format!("http://{grpc}"),
            quic: quic.parse()?,
            fingerprint: fingerprint.to_owned(),
            key: key.to_owned(),
            child,
        })
    }

    /// Resident memory (bytes) and CPU time (user + system, seconds).
    fn usage(&self) -> Result<(u64, f64)> {
        let pid = self.child.id();
        let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
        let rss_kb: u64 = status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .context("VmRSS")?;
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
        // Fields after the command name (which may hold spaces): utime and
        // stime are the 14th and 15th fields overall, in clock ticks
        // (USER_HZ, 100 on Linux).
        let rest = stat.rsplit_once(')').map(|(_, r)| r).context("stat")?;
        let f: Vec<&str> = rest.split_whitespace().collect();
        let ticks: u64 = f.get(11).and_then(|v| v.parse().ok()).unwrap_or(0)
            + f.get(12).and_then(|v| v.parse().ok()).unwrap_or(0);
        Ok((rss_kb * 1024, ticks as f64 / 100.0))
    }
}

impl Drop for Coordinator {
    fn drop(&mut self) {
        drop(self.child.stdin.take());
        let _ = self.child.wait();
    }
}

/// Counters every node shares.
#[derive(Default)]
struct NodeStats {
    welcomed: AtomicU64,
    beats: AtomicU64,
    /// A heartbeat sent while the one before was still unacknowledged.
    missed: AtomicU64,
    /// Sessions that ended during the run.
    lost: AtomicU64,
    /// Registrations that failed and were tried again.
    retries: AtomicU64,
    jobs: AtomicU64,
}

struct VirtualNode {
    key: SigningKey,
    chip: usize,
}

async fn parent(args: Args) -> Result<()> {
    let dir = std::env::temp_dir().join(format!("mlxnet-load-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let coordinator = Coordinator::start(&dir, &args)?;
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
    let weights: u32 = CHIPS.iter().map(|c| c.4).sum();
    let nodes: Vec<VirtualNode> = (0..args.nodes)
        .map(|_| {
            let mut pick = rng.gen_range(0..weights);
            let chip = CHIPS
                .iter()
                .position(|c| {
                    if pick < c.4 {
                        true
                    } else {
                        pick -= c.4;
                        false
                    }
                })
                .unwrap_or(0);
            VirtualNode {
                key: SigningKey::generate(&mut rng),
                chip,
            }
        })
        .collect();

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
        let mut jitter = StdRng::seed_from_u64(args.seed ^ (i as u64).wrapping_mul(0x9e37_79b9));
        tokio::spawn(async move {
            let mut attempt = 1;
            loop {
                let permit = dials.acquire().await;
                let tried = register(&endpoint, addr, &node, i).await;
                drop(permit);
                match tried {
                    Ok((conn, send, recv, interval)) => {
                        stats.welcomed.fetch_add(1, Ordering::Relaxed);
                        let _ = tx.send(Ok(interval)).await;
                        serve(node, conn, send, recv, interval, stats).await;
                        return;
                    }
                    Err(e) if attempt >= attempts => {
                        let e = e.context(format!("node {i}, after {attempt} tries"));
                        let _ = tx.send(Err(e)).await;
                        return;
                    }
                    Err(_) => {
                        stats.retries.fetch_add(1, Ordering::Relaxed);
                        tokio::time::sleep(register_backoff(attempt, &mut jitter)).await;
                        attempt += 1;
                    }
                }
            }
        });
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

// --- a virtual node ------------------------------------------------------

/// The wait before try `attempt + 1`: a ceiling of 250 ms doubling per
/// failed try up to 16 s, half of it fixed and half drawn ("equal
/// jitter"), so nodes refused together do not come back together.
fn register_backoff(attempt: u32, rng: &mut StdRng) -> Duration {
    let ceiling_ms = 250u64.saturating_mul(1 << attempt.saturating_sub(1).min(6));
    let half = ceiling_ms / 2;
    Duration::from_millis(half + rng.gen_range(0..=half))
}

/// Dials, proves the key and registers; returns the session and the
/// heartbeat interval `Welcome` asked for.
async fn register(
    endpoint: &quinn::Endpoint,
    addr: std::net::SocketAddr,
    node: &VirtualNode,
    i: usize,
) -> Result<(
    quinn::Connection,
    quinn::SendStream,
    quinn::RecvStream,
    Duration,
)> {
    let conn = endpoint.connect(addr, "localhost")?.await?;
    let (mut send, mut recv) = conn.open_bi().await?;
    let open = NodeControl {
        msg: Some(node_control::Msg::Open(Open {
            version: FAKE_VERSION.into(),
        })),
    };
    write_frame(&mut send, &open).await?;
    let challenge: CoordinatorControl = read_frame(&mut recv).await?;
    let Some(coordinator_control::Msg::Challenge(c)) = challenge.msg else {
        bail!("expected a challenge, got {:?}", challenge.msg);
    };
    let mut exporter = [0u8; auth::EXPORTER_LEN];
    conn.export_keying_material(&mut exporter, auth::EXPORTER_LABEL, b"")
        .map_err(|_| anyhow!("exporting keying material"))?;
    let signature = node.key.sign(&auth::transcript(&c.nonce, &exporter));
    let (chip, gib, ..) = CHIPS[node.chip];
    let memory = gib << 30;
    let hello = Hello {
        node_id: node.key.verifying_key().to_bytes().to_vec(),
        signature: signature.to_bytes().to_vec(),
        hardware: Some(HardwareProfile {
            chip: chip.into(),
            memory_bytes: memory,
            free_memory_bytes: memory / 2,
            ..Default::default()
        }),
        models: vec![CachedModel {
            model: MODEL.into(),
            sha256: hex::decode(smollm2_135m_instruct().sha256)?,
            size_bytes: 1,
        }],
        version: FAKE_VERSION.into(),
        max_concurrent_jobs: 1,
        name: format!("fake-engine-{i}"),
        ..Default::default()
    };
    write_frame(
        &mut send,
        &NodeControl {
            msg: Some(node_control::Msg::Hello(hello)),
        },
    )
    .await?;
    let reply: CoordinatorControl = read_frame(&mut recv).await?;
    match reply.msg {
        Some(coordinator_control::Msg::Welcome(w)) => {
            let ms = if w.heartbeat_interval_ms == 0 {
                5_000
            } else {
                u64::from(w.heartbeat_interval_ms)
            };
            Ok((conn, send, recv, Duration::from_millis(ms)))
        }
        other => bail!("not welcomed: {other:?}"),
    }
}

/// Heartbeats, acks and job streams until the session ends.
async fn serve(
    node: VirtualNode,
    conn: quinn::Connection,
    mut send: quinn::SendStream,
    mut recv: quinn::RecvStream,
    interval: Duration,
    stats: Arc<NodeStats>,
) {
    let node = Arc::new(node);
    let (ack_tx, mut ack_rx) = tokio::sync::mpsc::unbounded_channel::<()>();
    // The control stream's reader: counts acks.
    tokio::spawn(async move {
        while let Ok(m) = read_frame::<_, CoordinatorControl>(&mut recv).await {
            if matches!(m.msg, Some(coordinator_control::Msg::HeartbeatAck(_))) {
                let _ = ack_tx.send(());
            }
        }
    });
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut unacked = 0u64;
    let (_, gib, ..) = CHIPS[node.chip];
    loop {
        tokio::select! {
            _ = ticker.tick() => {
                if unacked > 0 {
                    stats.missed.fetch_add(1, Ordering::Relaxed);
                }
                let beat = NodeControl {
                    msg: Some(node_control::Msg::Heartbeat(Heartbeat {
                        free_memory_bytes: (gib << 30) / 2,
                        running_jobs: 0,
                        ..Default::default()
                    })),
                };
                if write_frame(&mut send, &beat).await.is_err() {
                    break;
                }
                unacked += 1;
                stats.beats.fetch_add(1, Ordering::Relaxed);
            }
            ack = ack_rx.recv() => match ack {
                Some(()) => unacked = unacked.saturating_sub(1),
                None => break,
            },
            stream = conn.accept_bi() => match stream {
                Ok((s, r)) => {
                    stats.jobs.fetch_add(1, Ordering::Relaxed);
                    tokio::spawn(fake_engine(Arc::clone(&node), s, r));
                }
                Err(_) => break,
            },
        }
    }
    stats.lost.fetch_add(1, Ordering::Relaxed);
}

/// One job on the timed fake engine: `Started`, the chip's prefill time,
/// tokens at its decode rate, a signed claim of exactly what was streamed.
async fn fake_engine(
    node: Arc<VirtualNode>,
    mut send: quinn::SendStream,
    mut recv: quinn::RecvStream,
) {
    let Ok(a) = read_frame::<_, Assignment>(&mut recv).await else {
        return;
    };
    let _ = run_fake(&node, &a, &mut send).await;
}

async fn run_fake(node: &VirtualNode, a: &Assignment, send: &mut quinn::SendStream) -> Result<()> {
    let (_, _, prefill_rate, decode_rate, _) = CHIPS[node.chip];
    let input = a.input.clone().unwrap_or_default();
    let resumed = a.resume.clone().unwrap_or_default();
    let prompt_len = match &input.kind {
        Some(job_input::Kind::Prompt(p)) => p.len(),
        _ => 16,
    };
    let prompt_tokens = (prompt_len / 4).max(1) as u32;
    let update = |m| JobUpdate { msg: Some(m) };
    write_frame(
        send,
        &update(job_update::Msg::Started(job_update::Started {})),
    )
    .await?;
    let prefill = Duration::from_secs_f64(f64::from(prompt_tokens) / prefill_rate);
    tokio::time::sleep(prefill).await;
    let max = a.sampling.as_ref().map_or(16, |s| s.max_tokens);
    let n = max.saturating_sub(resumed.token_ids.len() as u32);
    let first = resumed.token_ids.len() as u32;
    let step = Duration::from_secs_f64(1.0 / decode_rate);
    let decode_start = Instant::now();
    let mut ids = Vec::new();
    let mut text = String::new();
    for k in 0..n {
        let id = 1_000 + (k * 7919 + a.attempt) % 40_000;
        let t = format!(" w{id}");
        write_frame(
            send,
            &update(job_update::Msg::Tokens(job_update::Tokens {
                index: first + k,
                token_ids: vec![id],
                text: t.clone(),
                logprobs: Vec::new(),
            })),
        )
        .await?;
        ids.push(id);
        text.push_str(&t);
        tokio::time::sleep(step).await;
    }
    let signed = claim::sign(
        ResultClaim {
            job_id: a.job_id.clone(),
            attempt: a.attempt,
            model_sha256: a.model_sha256.clone(),
            prompt_sha256: claim::resumed_input_digest(&input, &resumed.token_ids).to_vec(),
            completion_tokens: ids.len() as u32,
            output_token_ids: ids,
            output_text: text,
            prompt_tokens,
            prefill_micros: prefill.as_micros() as u64,
            decode_micros: decode_start.elapsed().as_micros() as u64,
            node_id: node.key.verifying_key().to_bytes().to_vec(),
            finish_reason: "length".into(),
            grammar_sha256: mlxnet_proto::grammar::claim_digest(
                a.sampling.as_ref().and_then(|s| s.grammar.as_ref()),
            )
            .map(|d| d.to_vec())
            .unwrap_or_default(),
        },
        &node.key,
    );
    write_frame(send, &update(job_update::Msg::Result(signed))).await?;
    let _ = send.finish();
    let _ = send.stopped().await;
    Ok(())
}

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_register_backoff_doubles_to_its_cap_with_jitter_inside_each_ceiling() {
        let mut rng = StdRng::seed_from_u64(7);
        for attempt in 1..=12u32 {
            let ceiling = 250u64 << (attempt - 1).min(6);
            for _ in 0..50 {
                let wait = register_backoff(attempt, &mut rng).as_millis() as u64;
                assert!(
                    (ceiling / 2..=ceiling).contains(&wait),
                    "try {attempt}: waited {wait} ms, ceiling {ceiling} ms"
                );
            }
        }
        // Capped at 16 s: the 7th try and every later one share the ceiling.
        assert_eq!(250u64 << 6, 16_000);
        // Two nodes refused together draw different waits.
        let mut a = StdRng::seed_from_u64(1);
        let mut b = StdRng::seed_from_u64(2);
        let draws_a: Vec<_> = (0..8).map(|_| register_backoff(4, &mut a)).collect();
        let draws_b: Vec<_> = (0..8).map(|_| register_backoff(4, &mut b)).collect();
        assert_ne!(draws_a, draws_b);
    }
}
