//! The process-kill run: the real coordinator is killed with SIGKILL at
//! seeded random moments while virtual nodes serve and clients submit, and
//! started again each time on the same database (SQLite, or PostgreSQL
//! with `--postgres`) and ports; at the
//! end every job and the books are checked against the database.
//!
//! What it counts, from the database once the last coordinator has stopped:
//! - **lost**: a job the database holds that has not ended (completed,
//!   failed or cancelled) `--settle-s` after the last restart, or a job
//!   whose Submit returned an id the database does not hold;
//! - **broken books**: every invariant `Ledger::violations` checks (stored
//!   balances against transfer rows, sums over accounts zero, a hold
//!   resolved twice, an open hold past its deadline, an ended job whose hold
//!   is open, payouts and fee against the post, a failed job that paid),
//!   judged two sweep passes after the last job ended (a settlement the
//!   database failed is redone by the coordinator's sweep);
//!   so a double payment or a hold resolved twice is a violation;
//! - **ends sent**: a watch silent for 20 s is checked with Get; a job
//!   that had ended by then was never sent to its watcher (an end event
//!   lost), which counts as a failure;
//! - **claims**: every completed job's claim is checked by its client (its
//!   signature, its job and its node), as `mlxnet submit` does.
//!
//! A job may fail cleanly (its tries ran out across kills): that is
//! counted, not lost. A Submit that fails while the coordinator is down is
//! tried again; one that fails after the coordinator took it leaves a job
//! its client never learned of, which the database check covers.
//!
//! Nodes notice a dead coordinator by QUIC's idle timeout (3 s here, with
//! keep-alives every 500 ms: a killed process sends no close) and register
//! again with backoff; the restarted coordinator requeues its earlier
//! incarnation's jobs at start (same replica id, kept in its data
//! directory).
//!
//! With `--restart-postgres CMD` each fault restarts the PostgreSQL server
//! instead (CMD, through `sh -c`) and the coordinator is never killed: it
//! must ride the restarts out with the same checks at the end.
//!
//! Failure: exits non-zero on a lost or missing job, a broken invariant or
//! a claim that does not verify; the figures are printed first.

use std::{
    collections::{BTreeMap, HashSet},
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use anyhow::{anyhow, bail, Context, Result};
use futures::StreamExt;
use mlxnet_coordinator::{
    config::CoordinatorConfig,
    ledger::{Ledger, LedgerConfig},
    store::{AnyStore, Store},
    test_utils::client_config,
};
use mlxnet_proto::{
    bearer::{authed, Authed, Bearer},
    claim,
    v1::{
        job_event, job_input, jobs_client::JobsClient, GetJobRequest, Job, JobInput, JobState,
        SamplingParams, SubmitJobRequest, WatchJobRequest,
    },
};
use rand::{rngs::StdRng, Rng, SeedableRng};
use tokio::{sync::Semaphore, task::JoinSet};

use crate::{
    coordinator::Coordinator,
    node::{self, Dial, NodeStats},
    Args, MODEL, PROFILE,
};

/// How a job the client submitted ended, as its client saw it.
#[derive(Debug)]
enum Ended {
    /// Completed, and its claim verified.
    Completed,
    /// Completed, but its claim did not verify (the reason).
    Unverified(String),
    /// Failed (the reason the coordinator gave).
    Failed(String),
    Cancelled,
}

/// One client job through the kills.
#[derive(Debug, Default)]
struct Outcome {
    /// The id Submit returned (none if the run stopped before a Submit
    /// went through).
    id: Option<String>,
    ended: Option<Ended>,
    /// Submits that failed and were tried again.
    submit_errors: u32,
    /// Watches that broke before the job ended.
    watch_breaks: u32,
    /// Watches silent for [`WATCH_SILENCE`] while Get said the job had
    /// ended: the coordinator never sent the end to its watcher.
    end_unsent: bool,
}

/// A watch that says nothing for this long is checked with Get (a job of
/// `--max-tokens` on the slowest chip takes well under a second).
const WATCH_SILENCE: Duration = Duration::from_secs(20);

/// How a watch stopped.
enum Watched {
    Ended(Ended),
    /// The stream broke or ended without the job's end.
    Broke,
    /// Nothing for [`WATCH_SILENCE`].
    Silent,
}

pub(crate) async fn run(mut args: Args) -> Result<()> {
    let dir = std::env::temp_dir().join(format!("mlxnet-kills-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let fresh = match &args.postgres {
        Some(server) => Some(FreshDatabase::create(server).await?),
        None => None,
    };
    args.database_url = fresh.as_ref().map(|f| f.url.clone());
    let result = kills(&args, &dir).await;
    if let Some(fresh) = fresh {
        fresh.drop_it().await;
    }
    let _ = std::fs::remove_dir_all(&dir);
    result
}

/// A database of the run's own on a PostgreSQL server.
struct FreshDatabase {
    server: String,
    name: String,
    url: String,
}

impl FreshDatabase {
    async fn create(server: &str) -> Result<Self> {
        use sqlx::{Connection, Executor};
        let name = format!("mlxnet_kills_{}", std::process::id());
        let mut admin = sqlx::PgConnection::connect(server)
            .await
            .context("connecting to the PostgreSQL server")?;
        admin
            .execute(format!("DROP DATABASE IF EXISTS {name}").as_str())
            .await?;
        admin
            .execute(format!("CREATE DATABASE {name}").as_str())
            .await?;
        admin.close().await?;
        let (base, _) = server
            .rsplit_once('/')
            .context("a server URL ends in /DATABASE")?;
        Ok(Self {
            server: server.to_owned(),
            url: format!("{base}/{name}"),
            name,
        })
    }

    async fn drop_it(self) {
        use sqlx::{Connection, Executor};
        if let Ok(mut admin) = sqlx::PgConnection::connect(&self.server).await {
            let _ = admin
                .execute(format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", self.name).as_str())
                .await;
            let _ = admin.close().await;
        }
    }
}

async fn kills(args: &Args, dir: &std::path::Path) -> Result<()> {
    let mut rng = StdRng::seed_from_u64(args.seed);
    let mut coordinator = Coordinator::start(dir, args, None)?;
    let ports = coordinator.ports()?;
    let (grpc, quic) = (coordinator.grpc.clone(), coordinator.quic);
    let key = coordinator.key.clone();

    // Nodes: a short idle timeout, so a killed coordinator is noticed.
    let mut client = client_config(&coordinator.fingerprint);
    let mut transport = quinn::TransportConfig::default();
    transport.max_idle_timeout(Some(Duration::from_secs(3).try_into()?));
    transport.keep_alive_interval(Some(Duration::from_millis(500)));
    client.transport_config(Arc::new(transport));
    let mut endpoints = Vec::new();
    for _ in 0..args.endpoints.max(1) {
        let mut e = quinn::Endpoint::client("127.0.0.1:0".parse()?)?;
        e.set_default_client_config(client.clone());
        endpoints.push(e);
    }
    let stats = Arc::new(NodeStats::default());
    let dials = Arc::new(Semaphore::new(args.dial_concurrency.max(1)));
    let (welcomed_tx, mut welcomed) = tokio::sync::mpsc::channel(1024);
    for (i, n) in node::fleet(args.nodes, &mut rng).into_iter().enumerate() {
        let dial = Dial {
            endpoint: endpoints[i % endpoints.len()].clone(),
            addr: quic,
            dials: Arc::clone(&dials),
            stats: Arc::clone(&stats),
            attempts: u32::MAX,
            reconnect: true,
        };
        let jitter = StdRng::seed_from_u64(args.seed ^ (i as u64).wrapping_mul(0x9e37_79b9));
        tokio::spawn(node::run(n, i, dial, jitter, welcomed_tx.clone()));
    }
    drop(welcomed_tx);
    for _ in 0..args.nodes {
        match welcomed.recv().await {
            Some(Ok(_)) => {}
            Some(Err(e)) => return Err(e),
            None => bail!("nodes ended before all were welcomed"),
        }
    }
    // Welcomes after restarts: counted, never left to fill the channel.
    let rewelcomed = Arc::new(AtomicU64::new(0));
    {
        let rewelcomed = Arc::clone(&rewelcomed);
        tokio::spawn(async move {
            while welcomed.recv().await.is_some() {
                rewelcomed.fetch_add(1, Ordering::Relaxed);
            }
        });
    }

    // Clients: Poisson submits until the last kill, each job followed
    // through every kill to its end.
    let bearer = Bearer::for_key(Some(&key)).map_err(|e| anyhow!("{e:?}"))?;
    let mut channels = Vec::new();
    for _ in 0..args.channels.max(1) {
        let ch = tonic::transport::Channel::from_shared(grpc.clone())?.connect_lazy();
        channels.push(authed(ch, bearer.clone()));
    }
    let stop = Arc::new(AtomicBool::new(false));
    let submitter = {
        let stop = Arc::clone(&stop);
        let rate = args.rate.max(1e-6);
        let max_tokens = args.max_tokens;
        let mut rng = StdRng::seed_from_u64(args.seed.wrapping_add(1));
        tokio::spawn(async move {
            let mut tasks = JoinSet::new();
            let mut j = 0usize;
            while !stop.load(Ordering::Relaxed) {
                let gap: f64 = -(1.0 - rng.gen::<f64>()).ln() / rate;
                tokio::time::sleep(Duration::from_secs_f64(gap)).await;
                let channel = channels[j % channels.len()].clone();
                let prompt = format!("kill run job {j}: say something about the number {j}");
                tasks.spawn(follow_job(channel, prompt, max_tokens, Arc::clone(&stop)));
                j += 1;
            }
            tasks
        })
    };

    // The killer.
    let started = Instant::now();
    let mean = args.kill_every_ms.max(1) as f64;
    let mut restarts = Vec::new();
    for k in 1..=args.kills {
        let gap = -(1.0 - rng.gen::<f64>()).ln() * mean;
        tokio::time::sleep(Duration::from_millis(gap.max(50.0) as u64)).await;
        let t = Instant::now();
        match &args.restart_postgres {
            Some(command) => restart_postgres(command).await?,
            None => {
                coordinator.kill()?;
                coordinator = restart(dir, args, ports).await?;
            }
        }
        restarts.push(t.elapsed().as_secs_f64() * 1000.0);
        if k % 10 == 0 || k == args.kills {
            eprintln!(
                "  {k}/{} {}, {:.0} s, node registrations after restarts {}",
                args.kills,
                if args.restart_postgres.is_some() {
                    "PostgreSQL restarts"
                } else {
                    "kills"
                },
                started.elapsed().as_secs_f64(),
                rewelcomed.load(Ordering::Relaxed)
            );
        }
    }
    let kill_s = started.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    let mut tasks = submitter.await?;

    // Settle: every job the clients follow gets `--settle-s` to end.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(args.settle_s);
    let mut outcomes = Vec::new();
    while let Ok(Some(joined)) = tokio::time::timeout_at(deadline, tasks.join_next()).await {
        outcomes.push(joined?);
    }
    let unsettled = tasks.len();
    tasks.shutdown().await;
    // A settlement that failed with the database is redone by the
    // coordinator's sweep: two of its passes before the books are judged.
    let sweep = Duration::from_millis(LedgerConfig::default().sweep_interval_ms);
    tokio::time::sleep(sweep * 2 + Duration::from_secs(1)).await;
    let settle_s = started.elapsed().as_secs_f64() - kill_s;
    // A clean stop, then the database is the judge.
    drop(coordinator);
    let mut config = CoordinatorConfig::for_data_dir(dir.to_path_buf());
    config.database_url = args.database_url.clone();
    let store = AnyStore::connect(&config.database_url())
        .await
        .context("opening the run's database")?;
    let ledger = Ledger::new(store.clone(), LedgerConfig::default());
    let jobs = store.list_jobs(u32::MAX).await?;
    let violations = ledger.violations(now_ms()).await?;
    let open_holds = ledger.totals().await?.open_holds;
    store.close().await;

    let mut by_state = BTreeMap::<&str, usize>::new();
    for j in &jobs {
        *by_state.entry(j.state.as_str()).or_default() += 1;
    }
    let not_ended: Vec<String> = jobs
        .iter()
        .filter(|j| !j.state.is_terminal())
        .map(|j| format!("{} ({})", j.id, j.state.as_str()))
        .collect();
    let held: HashSet<String> = jobs.iter().map(|j| j.id.to_string()).collect();
    let acked: Vec<&String> = outcomes.iter().filter_map(|o| o.id.as_ref()).collect();
    let missing: Vec<&&String> = acked.iter().filter(|id| !held.contains(**id)).collect();
    let count = |f: fn(&Ended) -> bool| {
        outcomes
            .iter()
            .filter(|o| o.ended.as_ref().is_some_and(f))
            .count()
    };
    let completed = count(|e| matches!(e, Ended::Completed));
    let failed = count(|e| matches!(e, Ended::Failed(_)));
    let mut reasons = BTreeMap::<&str, usize>::new();
    for o in &outcomes {
        if let Some(Ended::Failed(why)) = &o.ended {
            *reasons.entry(why.as_str()).or_default() += 1;
        }
    }
    let cancelled = count(|e| matches!(e, Ended::Cancelled));
    let unverified: Vec<&String> = outcomes
        .iter()
        .filter_map(|o| match &o.ended {
            Some(Ended::Unverified(why)) => Some(why),
            _ => None,
        })
        .collect();
    let submit_errors: u32 = outcomes.iter().map(|o| o.submit_errors).sum();
    let watch_breaks: u32 = outcomes.iter().map(|o| o.watch_breaks).sum();
    let end_unsent = outcomes.iter().filter(|o| o.end_unsent).count();
    restarts.sort_by(f64::total_cmp);
    let restart_p50 = restarts
        .get(restarts.len() / 2)
        .copied()
        .unwrap_or(f64::NAN);
    let restart_max = restarts.last().copied().unwrap_or(f64::NAN);

    println!(
        "process-kill run: {} {} (mean gap {} ms, seed {}), {} nodes, submits at {}/s, {} tokens each, on {}; build profile {}",
        args.kills,
        if args.restart_postgres.is_some() { "PostgreSQL restarts" } else { "kills" },
        args.kill_every_ms, args.seed, args.nodes, args.rate, args.max_tokens,
        if args.database_url.is_some() { "PostgreSQL" } else { "SQLite" }, PROFILE
    );
    println!(
        "  {} {kill_s:.0} s, settle {settle_s:.0} s; restart ({}) p50 {restart_p50:.0} ms, max {restart_max:.0} ms",
        if args.restart_postgres.is_some() { "PostgreSQL-restart phase (the coordinator kept running)" } else { "kill phase" },
        if args.restart_postgres.is_some() { "the command's run" } else { "kill to READY" }
    );
    println!(
        "  node registrations after restarts {}, registrations retried {}",
        rewelcomed.load(Ordering::Relaxed),
        stats.retries.load(Ordering::Relaxed)
    );
    println!(
        "  client jobs {}, {} of them settled: acknowledged {}, completed and verified {completed}, failed cleanly {failed}, cancelled {cancelled}; submits retried {submit_errors}, watches broken by a kill {watch_breaks}",
        outcomes.len() + unsettled,
        outcomes.len(),
        acked.len()
    );
    println!("  database jobs {}: {by_state:?}", jobs.len());
    for (why, n) in &reasons {
        println!("    failed cleanly, {n} x: {why}");
    }
    println!("  {:<56} {:>10} {:>6}", "figure", "measured", "goal");
    println!(
        "  {:<56} {:>10} {:>6}",
        "jobs not ended after the settle time (lost)",
        not_ended.len(),
        0
    );
    println!(
        "  {:<56} {:>10} {:>6}",
        "acknowledged jobs the database does not hold (lost)",
        missing.len(),
        0
    );
    println!(
        "  {:<56} {:>10} {:>6}",
        "client jobs still unsettled at the deadline", unsettled, 0
    );
    println!(
        "  {:<56} {:>10} {:>6}",
        "ledger violations (double payments, holds)",
        violations.len(),
        0
    );
    println!(
        "  {:<56} {:>10} {:>6}",
        "ended jobs whose watcher was never sent the end", end_unsent, 0
    );
    println!(
        "  {:<56} {:>10} {:>6}",
        "completed jobs whose claim did not verify",
        unverified.len(),
        0
    );
    println!("  open holds at the end (jobs inside their pay window): {open_holds}");
    for line in not_ended.iter().take(5) {
        println!("    not ended: {line}");
    }
    for v in violations.iter().take(5) {
        println!("    violation: {v}");
    }
    for u in unverified.iter().take(5) {
        println!("    unverified: {u}");
    }
    if !not_ended.is_empty()
        || !missing.is_empty()
        || unsettled > 0
        || end_unsent > 0
        || !violations.is_empty()
        || !unverified.is_empty()
    {
        bail!("the process-kill run broke an invariant (see above)");
    }
    if completed == 0 {
        bail!("no job completed: the run did not load the coordinator");
    }
    Ok(())
}

/// Starts the coordinator again on `ports`, trying again for a few seconds
/// if a port is still held (the killed process's sockets close with it,
/// but the kernel may take a moment).
async fn restart(dir: &std::path::Path, args: &Args, ports: (u16, u16)) -> Result<Coordinator> {
    let mut last = None;
    for _ in 0..20 {
        match Coordinator::start(dir, args, Some(ports)) {
            Ok(c) => return Ok(c),
            Err(e) => {
                last = Some(e);
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
        }
    }
    Err(last
        .unwrap_or_else(|| anyhow!("no start"))
        .context("restarting the coordinator"))
}

/// Runs `command` (restarting the PostgreSQL server) through `sh -c`.
async fn restart_postgres(command: &str) -> Result<()> {
    let command = command.to_owned();
    let status = tokio::task::spawn_blocking(move || {
        std::process::Command::new("sh")
            .arg("-c")
            .arg(&command)
            .stdout(std::process::Stdio::null())
            .status()
    })
    .await??;
    if !status.success() {
        bail!("restarting PostgreSQL failed: {status}");
    }
    Ok(())
}

/// Submits one job (again while the coordinator is down) and follows it
/// through kills, by Watch and then Get, until it ends.
async fn follow_job(
    channel: Authed,
    prompt: String,
    max_tokens: u32,
    stop: Arc<AtomicBool>,
) -> Outcome {
    let mut jobs = JobsClient::new(channel);
    let mut out = Outcome::default();
    let request = SubmitJobRequest {
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
    };
    let id = loop {
        // A Submit that hangs (its coordinator killed mid-call) is an error.
        let submitted = tokio::time::timeout(WATCH_SILENCE, jobs.submit(request.clone())).await;
        match submitted.map_err(|_| ()).and_then(|r| r.map_err(|_| ())) {
            Ok(job) => break job.into_inner().id,
            Err(_) if stop.load(Ordering::Relaxed) && out.submit_errors > 40 => return out,
            Err(_) => {
                out.submit_errors += 1;
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
        }
    };
    out.id = Some(id.clone());
    loop {
        let silent = match watch_to_end(&mut jobs, &id).await {
            Watched::Ended(ended) => {
                out.ended = Some(ended);
                return out;
            }
            Watched::Broke => {
                out.watch_breaks += 1;
                tokio::time::sleep(Duration::from_millis(300)).await;
                false
            }
            Watched::Silent => true,
        };
        if let Ok(job) = jobs.get(GetJobRequest { job_id: id.clone() }).await {
            if let Some(ended) = ended(&job.into_inner()) {
                out.end_unsent |= silent;
                out.ended = Some(ended);
                return out;
            }
        }
    }
}

/// Watches `id` until it ends (`Some`) or the stream breaks (`None`).
async fn watch_to_end(jobs: &mut JobsClient<Authed>, id: &str) -> Watched {
    let watch = jobs.watch(WatchJobRequest {
        job_id: id.to_owned(),
    });
    let mut events = match tokio::time::timeout(WATCH_SILENCE, watch).await {
        Ok(Ok(events)) => events.into_inner(),
        Ok(Err(_)) => return Watched::Broke,
        Err(_) => return Watched::Silent,
    };
    loop {
        let ev = match tokio::time::timeout(WATCH_SILENCE, events.next()).await {
            Ok(Some(Ok(ev))) => ev,
            Ok(_) => return Watched::Broke,
            Err(_) => return Watched::Silent,
        };
        match ev.event {
            Some(job_event::Event::Completed(c)) => {
                return Watched::Ended(match c.job {
                    Some(job) => verified(&job),
                    None => Ended::Unverified("a completion without its job".into()),
                })
            }
            Some(job_event::Event::Failed(f)) => return Watched::Ended(Ended::Failed(f.reason)),
            Some(job_event::Event::Cancelled(_)) => return Watched::Ended(Ended::Cancelled),
            _ => {}
        }
    }
}

/// How `job` ended, or `None` while it runs.
fn ended(job: &Job) -> Option<Ended> {
    match job.state() {
        JobState::Completed => Some(verified(job)),
        JobState::Failed => Some(Ended::Failed(job.error.clone())),
        JobState::Cancelled => Some(Ended::Cancelled),
        _ => None,
    }
}

/// A completed job's claim: signed by the node the job names, for this job.
fn verified(job: &Job) -> Ended {
    let check = || -> Result<()> {
        let signed = job.result.as_ref().context("no claim")?;
        let signer = claim::verify(signed).map_err(|e| anyhow!("claim: {e}"))?;
        let cl = signed.claim.as_ref().context("empty claim")?;
        if cl.job_id != job.id || signer.to_string() != job.node_id {
            bail!("the claim is not this job's or its node's");
        }
        Ok(())
    };
    match check() {
        Ok(()) => Ended::Completed,
        Err(e) => Ended::Unverified(format!("{}: {e:#}", job.id)),
    }
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}
