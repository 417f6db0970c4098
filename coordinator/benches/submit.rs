//! Submit benchmark: durable SubmitJob/s, each with its hold, on SQLite.
//!
//! Starts a real coordinator (in process, gRPC on 127.0.0.1:0, a fresh
//! SQLite database in WAL mode), funds one client account, then runs a
//! concurrent gRPC load generator on the same machine: `--concurrency`
//! tasks over `--connections` HTTP/2 connections, each submitting jobs back
//! to back for `--seconds`. Every submit is authenticated by its API key,
//! places its hold and inserts the job in one committed transaction before
//! it is answered. Prints jobs/s and latency percentiles, then checks the
//! ledger holds one open hold per answered submit. Goal: >= 2,000/s with
//! p99 <= 25 ms.
//!
//! "Durable": a submit is answered only after its transaction committed to
//! the WAL; with `synchronous = NORMAL` (the store's setting) a committed
//! transaction survives a crash of the process, and the last ones may be
//! lost only on power loss / OS crash.
//!
//! Run: `cargo bench -p mlxnet-coordinator --bench submit` (optionally
//! `-- --concurrency 64 --connections 4 --seconds 10`).

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use anyhow::Context;
use mlxnet_coordinator::{
    ledger::{keys::Scopes, settle::JobTerms, AccountKind, Price},
    store::NewJob,
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
}

fn args() -> anyhow::Result<Args> {
    let mut a = Args {
        concurrency: 64,
        connections: 4,
        seconds: 10,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().context("flag needs a value");
        match flag.as_str() {
            "--concurrency" => a.concurrency = value()?.parse()?,
            "--connections" => a.connections = value()?.parse()?,
            "--seconds" => a.seconds = value()?.parse()?,
            "--bench" => {}
            other => anyhow::bail!("unknown flag {other}"),
        }
    }
    Ok(a)
}

fn main() -> anyhow::Result<()> {
    let args = args()?;
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?
        .block_on(run(args))
}

fn request(i: usize) -> SubmitJobRequest {
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

async fn run(args: Args) -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let mut config = CoordinatorConfig::for_data_dir(dir.path().to_path_buf());
    // No node serves these jobs; the queue bound must not be what stops them.
    config.limits.max_queued_jobs = u64::MAX;
    // One key drives the whole load: its own abuse limits are off here (the
    // global in-flight cap stays on; it is above `--concurrency`).
    config.limits.key_requests_per_sec = 0;
    config.limits.key_max_in_flight = 0;
    config.limits.max_in_flight_requests =
        config.limits.max_in_flight_requests.max(args.concurrency);
    let app = Application::build(config).await?;
    let ledger = app.ledger().clone();
    let account = ledger.create_account("bench", AccountKind::Client).await?;
    ledger
        .grant("bench", &account.id, i64::MAX / 4, "bench")
        .await?;
    let key = ledger
        .create_key(&account.id, Scopes::from_list(["submit"])?, "bench", None)
        .await?;
    let bearer: AsciiMetadataValue = format!("Bearer {}", key.secret()).parse()?;
    let grpc = app.grpc_addr();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(app.run_until(async move {
        let _ = stopped.await;
    }));

    let mut channels = Vec::new();
    for _ in 0..args.connections.max(1) {
        channels.push(
            Channel::from_shared(format!("http://{grpc}"))?
                .connect()
                .await?,
        );
    }
    let deadline = Instant::now() + Duration::from_secs(args.seconds);
    let started = Instant::now();
    let bearer = Arc::new(bearer);
    let mut tasks = Vec::new();
    for t in 0..args.concurrency {
        let mut client = JobsClient::new(channels[t % channels.len()].clone());
        let bearer = Arc::clone(&bearer);
        tasks.push(tokio::spawn(async move {
            let mut latencies = Vec::new();
            let mut errors = 0u64;
            let mut i = t;
            while Instant::now() < deadline {
                let mut req = Request::new(request(i));
                req.metadata_mut()
                    .insert("authorization", (*bearer).clone());
                let t0 = Instant::now();
                match client.submit(req).await {
                    Ok(_) => latencies.push(t0.elapsed()),
                    Err(_) => errors += 1,
                }
                i += 1_000_000;
            }
            (latencies, errors)
        }));
    }
    let mut latencies = Vec::new();
    let mut errors = 0;
    for t in tasks {
        let (l, e) = t.await?;
        latencies.extend(l);
        errors += e;
    }
    let elapsed = started.elapsed();
    latencies.sort();
    let pct = |p: f64| {
        latencies
            .get(((latencies.len() as f64 * p) as usize).min(latencies.len().saturating_sub(1)))
            .copied()
            .unwrap_or_default()
    };
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let rate = latencies.len() as f64 / elapsed.as_secs_f64();
    println!(
        "submit: {} jobs in {:.1} s over {} tasks / {} connections: {:.0} jobs/s ({} errors)",
        latencies.len(),
        elapsed.as_secs_f64(),
        args.concurrency,
        args.connections,
        rate,
        errors
    );
    println!(
        "latency: p50 {:.2} ms, p90 {:.2} ms, p99 {:.2} ms, max {:.2} ms",
        ms(pct(0.50)),
        ms(pct(0.90)),
        ms(pct(0.99)),
        ms(pct(1.0))
    );
    println!(
        "goal: >= 2000 jobs/s ({:.2}x), p99 <= 25 ms ({:.2}x)",
        rate / 2000.0,
        25.0 / ms(pct(0.99)).max(1e-9)
    );
    let totals = ledger.totals().await?;
    println!(
        "ledger: {} open holds for {} answered submits; sums over accounts {} / {}",
        totals.open_holds,
        latencies.len(),
        totals.posted,
        totals.pending
    );
    // The same submits straight into the ledger (hold + job row, one
    // transaction each), without gRPC, auth or the queue count: what SQLite
    // and the ledger cost on their own.
    let deadline = Instant::now() + Duration::from_secs(args.seconds);
    let started = Instant::now();
    let mut tasks = Vec::new();
    for t in 0..args.concurrency {
        let ledger = ledger.clone();
        let account = account.id.clone();
        tasks.push(tokio::spawn(async move {
            let mut latencies = Vec::new();
            let terms = JobTerms {
                account,
                price: Price {
                    input_per_mtok: 134_515,
                    output_per_mtok: 269_030,
                },
                max_price: 100,
            };
            let mut i = t;
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
                if ledger.submit_job(&job, &terms, now_ms()).await.is_ok() {
                    latencies.push(t0.elapsed());
                }
                i += 1_000_000;
            }
            latencies
        }));
    }
    let mut direct = Vec::new();
    for t in tasks {
        direct.extend(t.await?);
    }
    let elapsed = started.elapsed();
    direct.sort();
    let dpct = |p: f64| {
        direct
            .get(((direct.len() as f64 * p) as usize).min(direct.len().saturating_sub(1)))
            .copied()
            .unwrap_or_default()
    };
    println!(
        "ledger only (no gRPC): {} jobs in {:.1} s: {:.0} jobs/s; p50 {:.2} ms, p99 {:.2} ms",
        direct.len(),
        elapsed.as_secs_f64(),
        direct.len() as f64 / elapsed.as_secs_f64(),
        ms(dpct(0.50)),
        ms(dpct(0.99))
    );
    let _ = stop.send(());
    server.await??;
    Ok(())
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}
