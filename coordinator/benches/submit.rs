//! Submit benchmark: durable SubmitJob/s, each with its hold, on SQLite and
//! on PostgreSQL with 1 and with 3 coordinator replicas, in the same run.
//!
//! For each backend it starts real coordinators (in process, gRPC on
//! 127.0.0.1:0): SQLite in a temporary directory; PostgreSQL in a fresh
//! database on the server `--postgres URL` (default: the
//! `MLXNET_TEST_DATABASE_URL` the tests use; `scripts/pg-test-server.sh`
//! starts one), one coordinator per replica, all on that database. It funds
//! `--keys` client accounts with one API key each, and drives them from a
//! gRPC load generator on the same machine: real HTTP/2 over TCP,
//! `--connections` separate connections spread over the replicas, every
//! request authenticated by its key. Every submit authenticates, places its
//! hold and inserts the job in a committed transaction (group commit, see
//! `ledger/submit.rs`) before it is answered.
//!
//! Three load levels per backend, each for `--seconds`:
//! 1. closed loop: `--concurrency` tasks submitting back to back (the
//!    ceiling; latency there is mostly queueing, `concurrency / rate`);
//! 2. open loop: submits sent on a fixed schedule of `--rate` per second,
//!    latency measured from each one's scheduled send time (so a stalled
//!    server or generator is not hidden); the goals are checked here: at
//!    least 2,000/s with p99 <= 25 ms on SQLite, and at least 5,000/s with
//!    p99 <= 25 ms on PostgreSQL with 3 replicas;
//! 3. the peer: the same submits straight into the ledger with
//!    `--concurrency` tasks, without gRPC or auth (what SQLite and the
//!    ledger cost on their own), for the gRPC / ledger ratio.
//!
//! It prints figures and each backend's ratio to SQLite; it checks
//! correctness (one open hold per answered submit, no ledger invariant
//! broken) but never asserts timings.
//!
//! Durability: SQLite runs in WAL mode with `synchronous = FULL`, PostgreSQL
//! with `fsync = on, synchronous_commit = on`: a submit is answered only
//! after its batch's commit was flushed, so it survives power loss, not only
//! a crash of the process. The settings are read back and printed.
//!
//! Limits: each key's own abuse limits are off (`key_requests_per_sec = 0`,
//! `key_max_in_flight = 0`) so the generator measures the server, not the
//! default 200 requests/s per key; the global in-flight cap stays on (raised
//! to at least the load); the queue bound is lifted (no node serves these
//! jobs). Printed with the figures.
//!
//! Run: `cargo bench -p mlxnet-coordinator --bench submit` (optimized, the
//! figure that stands for a deployment), or with `--profile dev` to reuse
//! the dev build (the coordinator crate itself is then unoptimized, which
//! costs about 40% of the gRPC throughput on a 2-core machine). Optionally
//! `-- --seconds 10 --concurrency 64 --connections 4 --rate 2000 --keys 16
//! --postgres postgres://USER@HOST:PORT/postgres --replicas 1,3`. Without a
//! PostgreSQL URL only SQLite runs (and it says so).

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use anyhow::Context;
use mlxnet_coordinator::{
    domain::{AccountKind, JobTerms, NewJob, Price, Scopes},
    Application, CoordinatorConfig,
};
use mlxnet_proto::{
    ids::JobId,
    v1::{job_input, jobs_client::JobsClient, JobInput, SamplingParams, SubmitJobRequest},
};
use tonic::{metadata::AsciiMetadataValue, transport::Channel, Request};

struct Args {
    concurrency: usize,
    connections: usize,
    seconds: u64,
    rate: u64,
    keys: usize,
    /// A PostgreSQL server to create the benchmark's databases on.
    postgres: Option<String>,
    /// Replica counts to run on PostgreSQL.
    replicas: Vec<usize>,
}

/// One backend under load: SQLite, or PostgreSQL with `replicas`
/// coordinators on one database.
#[derive(Clone)]
struct Backend {
    name: String,
    /// `None`: SQLite in the data directory.
    postgres: Option<String>,
    replicas: usize,
}

/// What one backend measured.
struct Figures {
    name: String,
    closed: Sample,
    open: Option<Sample>,
    direct: Sample,
}

fn args() -> anyhow::Result<Args> {
    let mut a = Args {
        concurrency: 64,
        connections: 4,
        seconds: 5,
        rate: 2000,
        keys: 16,
        postgres: std::env::var("MLXNET_TEST_DATABASE_URL")
            .ok()
            .filter(|u| !u.is_empty()),
        replicas: vec![1, 3],
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().context("flag needs a value");
        match flag.as_str() {
            "--concurrency" => a.concurrency = value()?.parse()?,
            "--connections" => a.connections = value()?.parse()?,
            "--seconds" => a.seconds = value()?.parse()?,
            "--rate" => a.rate = value()?.parse()?,
            "--keys" => a.keys = value()?.parse()?,
            "--postgres" => a.postgres = Some(value()?),
            "--replicas" => {
                a.replicas = value()?
                    .split(',')
                    .map(str::parse)
                    .collect::<Result<_, _>>()?
            }
            "--bench" => {}
            other => anyhow::bail!("unknown flag {other}"),
        }
    }
    a.concurrency = a.concurrency.max(1);
    a.connections = a.connections.max(1);
    a.keys = a.keys.max(1);
    a.replicas.retain(|&n| n >= 1);
    Ok(a)
}

fn main() -> anyhow::Result<()> {
    let args = args()?;
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?
        .block_on(run(args))
}

fn request(i: u64) -> SubmitJobRequest {
    SubmitJobRequest {
        model: "smollm2-135m-instruct".into(),
        input: Some(JobInput {
            kind: Some(job_input::Kind::Prompt(format!(
                "Question {i}: what is the capital of France?"
            ))),
        }),
        sampling: Some(SamplingParams {
            max_tokens: 64,
            ..Default::default()
        }),
        max_price_micro_mlx: 0,
        priority: 0,
    }
}

/// The answered submits of one load level.
struct Sample {
    latencies: Vec<Duration>,
    errors: u64,
    elapsed: Duration,
}

impl Sample {
    fn new(mut latencies: Vec<Duration>, errors: u64, elapsed: Duration) -> Self {
        latencies.sort();
        Self {
            latencies,
            errors,
            elapsed,
        }
    }

    fn rate(&self) -> f64 {
        self.latencies.len() as f64 / self.elapsed.as_secs_f64()
    }

    /// The `p`-quantile latency in ms.
    fn ms(&self, p: f64) -> f64 {
        let l = &self.latencies;
        let i = ((l.len() as f64 * p) as usize).min(l.len().saturating_sub(1));
        l.get(i).copied().unwrap_or_default().as_secs_f64() * 1e3
    }

    fn print(&self, what: &str) {
        println!(
            "{what}: {} answered in {:.2} s: {:.0} submits/s, {} errors; latency p50 {:.2} ms, \
             p90 {:.2} ms, p99 {:.2} ms, max {:.2} ms",
            self.latencies.len(),
            self.elapsed.as_secs_f64(),
            self.rate(),
            self.errors,
            self.ms(0.50),
            self.ms(0.90),
            self.ms(0.99),
            self.ms(1.0)
        );
    }
}

/// A fresh database on the PostgreSQL server at `server`: its URL.
async fn fresh_database(server: &str) -> anyhow::Result<String> {
    use sqlx::{Connection, Executor};
    let name = format!("bench_{}", uuid::Uuid::new_v4().simple());
    let mut admin = sqlx::PgConnection::connect(server).await?;
    admin
        .execute(format!("CREATE DATABASE {name}").as_str())
        .await?;
    admin.close().await?;
    let (base, _) = server
        .rsplit_once('/')
        .context("a PostgreSQL URL ends in /DATABASE")?;
    Ok(format!("{base}/{name}"))
}

/// A client on connection `i % connections` with key `i % keys`.
struct Clients {
    channels: Vec<Channel>,
    bearers: Vec<AsciiMetadataValue>,
}

impl Clients {
    fn submit(&self, i: u64) -> (JobsClient<Channel>, Request<SubmitJobRequest>) {
        let client = JobsClient::new(self.channels[i as usize % self.channels.len()].clone());
        let mut req = Request::new(request(i));
        req.metadata_mut().insert(
            "authorization",
            self.bearers[i as usize % self.bearers.len()].clone(),
        );
        (client, req)
    }
}

/// `concurrency` tasks submitting back to back for `seconds`.
async fn closed_loop(
    clients: &Arc<Clients>,
    concurrency: usize,
    seconds: u64,
) -> anyhow::Result<Sample> {
    let deadline = Instant::now() + Duration::from_secs(seconds);
    let started = Instant::now();
    let mut tasks = Vec::new();
    for t in 0..concurrency as u64 {
        let clients = Arc::clone(clients);
        tasks.push(tokio::spawn(async move {
            let mut latencies = Vec::new();
            let mut errors = 0u64;
            let mut i = t;
            while Instant::now() < deadline {
                let (mut client, req) = clients.submit(i);
                let t0 = Instant::now();
                match client.submit(req).await {
                    Ok(_) => latencies.push(t0.elapsed()),
                    Err(_) => errors += 1,
                }
                i += concurrency as u64;
            }
            (latencies, errors)
        }));
    }
    let (mut latencies, mut errors) = (Vec::new(), 0);
    for t in tasks {
        let (l, e) = t.await?;
        latencies.extend(l);
        errors += e;
    }
    Ok(Sample::new(latencies, errors, started.elapsed()))
}

/// `rate` submits per second on a fixed schedule for `seconds`; each
/// latency runs from the submit's scheduled send time.
async fn open_loop(clients: &Arc<Clients>, rate: u64, seconds: u64) -> anyhow::Result<Sample> {
    let total = rate * seconds;
    let started = Instant::now();
    let mut set = tokio::task::JoinSet::new();
    let mut sent = 0u64;
    while sent < total {
        let due = ((started.elapsed().as_secs_f64() * rate as f64) as u64).min(total);
        while sent < due {
            let scheduled = started + Duration::from_secs_f64(sent as f64 / rate as f64);
            let (mut client, req) = clients.submit(1 << 40 | sent);
            set.spawn(async move {
                let ok = client.submit(req).await.is_ok();
                (ok, scheduled.elapsed())
            });
            sent += 1;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let (mut latencies, mut errors) = (Vec::new(), 0);
    while let Some(r) = set.join_next().await {
        match r? {
            (true, l) => latencies.push(l),
            (false, _) => errors += 1,
        }
    }
    Ok(Sample::new(latencies, errors, started.elapsed()))
}

/// The peer: `concurrency` tasks calling the ledger directly.
async fn ledger_only(
    ledger: &mlxnet_coordinator::ledger::Ledger,
    accounts: &[String],
    concurrency: usize,
    seconds: u64,
) -> anyhow::Result<Sample> {
    let deadline = Instant::now() + Duration::from_secs(seconds);
    let started = Instant::now();
    let mut tasks = Vec::new();
    for t in 0..concurrency {
        let ledger = ledger.clone();
        let account = accounts[t % accounts.len()].clone();
        tasks.push(tokio::spawn(async move {
            let mut latencies = Vec::new();
            let mut errors = 0u64;
            let terms = JobTerms {
                account,
                price: Price {
                    input_per_mtok: 134_515,
                    output_per_mtok: 269_030,
                },
                max_price: 100,
            };
            let mut i = 2 << 40 | t as u64;
            while Instant::now() < deadline {
                let r = request(i);
                let job = NewJob {
                    id: JobId::new(),
                    model: r.model,
                    input: r.input.unwrap_or_default(),
                    sampling: SamplingParams {
                        seed: Some(1),
                        max_tokens: 64,
                        ..Default::default()
                    },
                    priority: 0,
                };
                let t0 = Instant::now();
                match ledger.submit_job(&job, &terms, now_ms()).await {
                    Ok(_) => latencies.push(t0.elapsed()),
                    Err(_) => errors += 1,
                }
                i += concurrency as u64;
            }
            (latencies, errors)
        }));
    }
    let (mut latencies, mut errors) = (Vec::new(), 0);
    for t in tasks {
        let (l, e) = t.await?;
        latencies.extend(l);
        errors += e;
    }
    Ok(Sample::new(latencies, errors, started.elapsed()))
}

async fn run(args: Args) -> anyhow::Result<()> {
    let mut backends = vec![Backend {
        name: "SQLite".into(),
        postgres: None,
        replicas: 1,
    }];
    match &args.postgres {
        Some(server) => {
            for &n in &args.replicas {
                backends.push(Backend {
                    name: format!("PostgreSQL, {n} replica(s)"),
                    postgres: Some(server.clone()),
                    replicas: n,
                });
            }
        }
        None => println!(
            "PostgreSQL: not measured (no --postgres URL and MLXNET_TEST_DATABASE_URL unset)"
        ),
    }
    let mut all = Vec::new();
    for backend in &backends {
        println!("== {}", backend.name);
        all.push(run_backend(&args, backend).await?);
    }
    println!("== summary (ratio: submits/s against SQLite's in this run)");
    let sqlite = &all[0];
    for f in &all {
        let ratio = |a: &Sample, b: &Sample| a.rate() / b.rate().max(1e-9);
        let open = match (&f.open, &sqlite.open) {
            (Some(o), Some(so)) => format!(
                "open loop {:.0}/s p50 {:.2} ms p99 {:.2} ms ({:.2}x)",
                o.rate(),
                o.ms(0.5),
                o.ms(0.99),
                ratio(o, so)
            ),
            _ => "open loop not run".into(),
        };
        println!(
            "{}: closed loop {:.0}/s p50 {:.2} ms p99 {:.2} ms ({:.2}x); {open}; \
             ledger only {:.0}/s ({:.2}x)",
            f.name,
            f.closed.rate(),
            f.closed.ms(0.5),
            f.closed.ms(0.99),
            ratio(&f.closed, &sqlite.closed),
            f.direct.rate(),
            ratio(&f.direct, &sqlite.direct)
        );
    }
    Ok(())
}

async fn run_backend(args: &Args, backend: &Backend) -> anyhow::Result<Figures> {
    let dir = tempfile::tempdir()?;
    let url = match &backend.postgres {
        Some(server) => Some(fresh_database(server).await?),
        None => None,
    };
    let mut apps = Vec::new();
    for r in 0..backend.replicas {
        let mut config = CoordinatorConfig::for_data_dir(dir.path().join(format!("r{r}")));
        config.database_url = url.clone();
        // No node serves these jobs; the queue bound must not be what stops them.
        config.limits.max_queued_jobs = u64::MAX;
        config.limits.key_requests_per_sec = 0;
        config.limits.key_max_in_flight = 0;
        config.limits.max_in_flight_requests = config
            .limits
            .max_in_flight_requests
            .max(args.concurrency)
            .max(4096);
        apps.push(Application::build(config).await?);
    }
    let in_flight_cap = CoordinatorConfig::default()
        .limits
        .max_in_flight_requests
        .max(args.concurrency)
        .max(4096);
    let ledger = apps[0].ledger().clone();
    let mut accounts = Vec::new();
    let mut bearers = Vec::new();
    for k in 0..args.keys {
        let account = ledger
            .create_account(&format!("bench {k}"), AccountKind::Client)
            .await?;
        ledger
            .grant(&format!("bench {k}"), &account.id, i64::MAX / 64, "bench")
            .await?;
        let key = ledger
            .create_key(&account.id, Scopes::from_list(["submit"])?, "bench", None)
            .await?;
        bearers.push(format!("Bearer {}", key.secret()).parse()?);
        accounts.push(account.id);
    }
    let grpcs: Vec<_> = apps.iter().map(Application::grpc_addr).collect();
    let mut stops = Vec::new();
    let mut servers = Vec::new();
    for app in apps {
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        stops.push(stop);
        servers.push(tokio::spawn(app.run_until(async move {
            let _ = stopped.await;
        })));
    }
    let mut channels = Vec::new();
    for c in 0..args.connections.max(grpcs.len()) {
        channels.push(
            Channel::from_shared(format!("http://{}", grpcs[c % grpcs.len()]))?
                .tcp_nodelay(true)
                .connect()
                .await?,
        );
    }
    let clients = Arc::new(Clients { channels, bearers });

    println!(
        "setup: {} {} (a submit is answered after its group commit); {} replica(s); \
         {} keys/accounts, {} gRPC connections over TCP; {} core(s); load average {}",
        backend.name,
        ledger.durability().await?,
        backend.replicas,
        args.keys,
        clients.channels.len(),
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        loadavg()
    );
    println!(
        "limits: per-key rate limit off (key_requests_per_sec = 0, key_max_in_flight = 0); \
         global in-flight cap {in_flight_cap} per replica; queue bound lifted"
    );

    let closed = closed_loop(&clients, args.concurrency, args.seconds).await?;
    closed.print(&format!(
        "closed loop, {} tasks back to back",
        args.concurrency
    ));
    let open = if args.rate > 0 {
        let open = open_loop(&clients, args.rate, args.seconds).await?;
        open.print(&format!(
            "open loop, {} submits/s offered (latency from the scheduled send)",
            args.rate
        ));
        let offered = args.rate * args.seconds;
        let goal = if backend.postgres.is_some() && backend.replicas >= 3 {
            5000.0
        } else {
            2000.0
        };
        println!(
            "goal (open loop): >= {goal} submits/s: {} offered/s x {}/{offered} answered = {:.2}x; \
             p99 <= 25 ms: {:.2}x (1 or above meets it)",
            args.rate,
            open.latencies.len(),
            args.rate as f64 * open.latencies.len() as f64 / offered.max(1) as f64 / goal,
            25.0 / open.ms(0.99).max(1e-9)
        );
        Some(open)
    } else {
        None
    };
    let answered = closed.latencies.len() + open.as_ref().map_or(0, |o| o.latencies.len());
    let totals = ledger.totals().await?;
    println!(
        "ledger: {} open holds for {answered} answered submits; sums over accounts {} / {}",
        totals.open_holds, totals.posted, totals.pending
    );
    anyhow::ensure!(
        totals.open_holds == answered as i64,
        "an answered submit has no hold, or a refused one has"
    );
    let broken = ledger.violations(now_ms()).await?;
    anyhow::ensure!(broken.is_empty(), "ledger invariants broken: {broken:?}");

    let direct = ledger_only(&ledger, &accounts, args.concurrency, args.seconds).await?;
    direct.print(&format!(
        "peer: ledger only (no gRPC, no auth, replica 0), {} tasks back to back",
        args.concurrency
    ));
    println!(
        "gRPC closed loop / ledger only: {:.2}x submits/s; load average {}",
        closed.rate() / direct.rate().max(1e-9),
        loadavg()
    );
    for stop in stops {
        let _ = stop.send(());
    }
    for server in servers {
        server.await??;
    }
    Ok(Figures {
        name: backend.name.clone(),
        closed,
        open,
        direct,
    })
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "unknown".into())
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}
