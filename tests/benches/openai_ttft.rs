//! The HTTP layer's overhead: time to first token of the same chat job over
//! `POST /v1/chat/completions` (streamed, server-sent events) against gRPC
//! `Submit` + `Watch`, in the same run, against the same coordinator and
//! node.
//!
//! `cargo bench -p mlxnet-tests --bench openai_ttft`
//!
//! A real coordinator (embedded SQLite) and a real node serving
//! SmolLM2-135M-Instruct over QUIC, as a user's jobs go. Every request is
//! the same job: the same system prompt and question, greedy, the same
//! `max_tokens`. The requests alternate between the two APIs (gRPC first on
//! even rounds, HTTP first on odd ones), one at a time, so both see the same
//! machine, node and caches. Each client keeps its connection (tonic's
//! channel, reqwest's pool), warmed by one request each before timing.
//!
//! Time to first token is from the call (gRPC: `Submit`, then `Watch`; HTTP:
//! the POST) to the first token reaching the client: gRPC's first `Tokens`
//! event; HTTP's first chunk after the role chunk (the role chunk is sent
//! before any token exists, so it is not a token). Every request's figure is
//! printed, then p50 and p99 (nearest rank) of each API and the ratio
//! HTTP / gRPC. The streamed HTTP text must equal the gRPC job's text
//! (greedy, same job), or the run fails. Nothing is a best-of.
//!
//! Settings (environment, all optional): `MLXNET_BENCH_REQUESTS` (requests
//! per API, 40), `MLXNET_BENCH_MAX_TOKENS` (8), `MLXNET_BENCH_THREADS` (the
//! node's compute threads, 2).

use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context};
use mlxnet_proto::v1::{job_event, WatchJobRequest};
use mlxnet_tests::{
    chat_job, coordinator_config, spawn_coordinator, spawn_node, Client, SYSTEM_PROMPT,
    TEST_MODEL_ID,
};
use serde_json::{json, Value};

const QUESTION: &str = "What is the capital of France?";

fn number(name: &str, default: usize) -> anyhow::Result<usize> {
    match std::env::var(name).ok().filter(|v| !v.is_empty()) {
        Some(v) => v.parse().with_context(|| format!("{name}={v}")),
        None => Ok(default),
    }
}

/// One request as the client saw it: time to first token, and the text.
struct Seen {
    ttft: Duration,
    text: String,
}

/// gRPC: `Submit`, then `Watch` to the job's end.
async fn grpc(client: &mut Client, max_tokens: u32) -> anyhow::Result<Seen> {
    let t0 = Instant::now();
    let job = client
        .jobs
        .submit(chat_job(QUESTION, max_tokens))
        .await?
        .into_inner();
    let mut stream = client
        .jobs
        .watch(WatchJobRequest {
            job_id: job.id.clone(),
        })
        .await?
        .into_inner();
    let mut ttft = None;
    let mut text = String::new();
    while let Some(event) = stream.message().await? {
        match event.event {
            Some(job_event::Event::Tokens(t)) => {
                ttft.get_or_insert_with(|| t0.elapsed());
                text.push_str(&t.text);
            }
            Some(job_event::Event::Completed(c)) => {
                // The job's text is the signed text (a retried attempt
                // rewinds what was streamed).
                text = c.job.map(|j| j.output_text).unwrap_or(text);
                break;
            }
            Some(job_event::Event::Failed(f)) => bail!("job {} failed: {f:?}", job.id),
            Some(job_event::Event::Cancelled(_)) => bail!("job {} cancelled", job.id),
            _ => {}
        }
    }
    Ok(Seen {
        ttft: ttft.context("the gRPC job streamed no token")?,
        text,
    })
}

/// HTTP: the streamed chat completion, read chunk by chunk to `[DONE]`.
async fn http(
    client: &reqwest::Client,
    url: &str,
    key: &str,
    max_tokens: u32,
) -> anyhow::Result<Seen> {
    let body = json!({
        "model": TEST_MODEL_ID,
        "messages": [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": QUESTION},
        ],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": true,
    });
    let t0 = Instant::now();
    let mut resp = client
        .post(url)
        .bearer_auth(key)
        .header("content-type", "application/json")
        .body(body.to_string())
        .send()
        .await?;
    ensure!(
        resp.status().is_success(),
        "HTTP {}: {}",
        resp.status(),
        resp.text().await.unwrap_or_default()
    );
    let mut ttft = None;
    let mut text = String::new();
    let mut buf = String::new();
    let mut done = false;
    while let Some(bytes) = resp.chunk().await? {
        buf.push_str(std::str::from_utf8(&bytes).context("an SSE stream in UTF-8")?);
        // Whole events only: each ends with a blank line.
        while let Some(end) = buf.find("\n\n") {
            let event: String = buf.drain(..end + 2).collect();
            for line in event.lines() {
                let Some(data) = line.strip_prefix("data:") else {
                    continue;
                };
                let data = data.trim();
                if data == "[DONE]" {
                    done = true;
                    continue;
                }
                let v: Value = serde_json::from_str(data).context("an SSE chunk")?;
                ensure!(v.get("error").is_none(), "the stream failed: {v}");
                let delta = &v["choices"][0]["delta"];
                if delta.get("role").is_some() {
                    continue; // sent before any token
                }
                if let Some(t) = delta["content"].as_str() {
                    ttft.get_or_insert_with(|| t0.elapsed());
                    text.push_str(t);
                }
            }
        }
    }
    ensure!(done, "the stream ended without [DONE]");
    Ok(Seen {
        ttft: ttft.context("the HTTP stream carried no token")?,
        text,
    })
}

/// Nearest-rank percentile of sorted values.
fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// p50 and p99 in milliseconds.
fn p50_p99(ttfts: &[Duration]) -> (f64, f64) {
    let mut ms: Vec<f64> = ttfts.iter().map(|d| d.as_secs_f64() * 1e3).collect();
    ms.sort_by(f64::total_cmp);
    (percentile(&ms, 50.0), percentile(&ms, 99.0))
}

fn main() -> anyhow::Result<()> {
    let requests = number("MLXNET_BENCH_REQUESTS", 40)?;
    let max_tokens = u32::try_from(number("MLXNET_BENCH_MAX_TOKENS", 8)?)?;
    let threads = number("MLXNET_BENCH_THREADS", 2)?;
    ensure!(requests > 0, "MLXNET_BENCH_REQUESTS must be at least 1");
    // Before any thread exists: the engine's compute pool takes its size here.
    mlx_node::engine::cli::set_threads(Some(threads))?;
    // reqwest is built on rustls without a default provider (the node's
    // choice): the bench speaks plain HTTP, but the client wants one.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let runtime = tokio::runtime::Runtime::new()?;
    println!(
        "openai_ttft bench: SmolLM2-135M-Instruct Q4_1, {threads} threads, one job \
         (greedy, max_tokens {max_tokens}) {requests} times over each API, alternating"
    );
    let (grpc_seen, http_seen) = runtime.block_on(async {
        let dir = tempfile::tempdir()?;
        let coord = spawn_coordinator(coordinator_config(&dir.path().join("coord"))).await?;
        let node_dir = dir.path().join("node");
        std::fs::create_dir_all(&node_dir)?;
        let mut config = coord.node_config(&node_dir, "bench-node");
        config.threads = Some(threads);
        let mut node = spawn_node(config).await?;
        node.registered().await?;
        let mut client = coord.client().await?;
        let web = reqwest::Client::builder().build()?;
        let url = format!("http://{}/v1/chat/completions", coord.http_addr);
        let key = coord.accounts.client_key.clone();
        // Warm-up, one each: the weights, the template, both connections.
        let g = grpc(&mut client, max_tokens).await?;
        let h = http(&web, &url, &key, max_tokens).await?;
        ensure!(
            g.text == h.text,
            "the same greedy job answered {:?} over gRPC but {:?} over HTTP",
            g.text,
            h.text
        );
        println!("answer (both APIs): {:?}", g.text);
        println!("{:>4} | {:>12} | {:>12}", "#", "gRPC TTFT", "HTTP TTFT");
        let (mut gs, mut hs) = (Vec::new(), Vec::new());
        for i in 0..requests {
            let (g, h) = if i % 2 == 0 {
                let g = grpc(&mut client, max_tokens).await?;
                (g, http(&web, &url, &key, max_tokens).await?)
            } else {
                let h = http(&web, &url, &key, max_tokens).await?;
                (grpc(&mut client, max_tokens).await?, h)
            };
            ensure!(
                g.text == h.text,
                "request {i}: gRPC answered {:?}, HTTP {:?}",
                g.text,
                h.text
            );
            println!(
                "{i:>4} | {:>10.1}ms | {:>10.1}ms",
                g.ttft.as_secs_f64() * 1e3,
                h.ttft.as_secs_f64() * 1e3
            );
            gs.push(g.ttft);
            hs.push(h.ttft);
        }
        node.stop().await?;
        coord.stop().await?;
        anyhow::Ok((gs, hs))
    })?;
    let (g50, g99) = p50_p99(&grpc_seen);
    let (h50, h99) = p50_p99(&http_seen);
    println!("{:>8} | {:>10} | {:>10}", "", "p50", "p99");
    println!("{:>8} | {g50:>8.1}ms | {g99:>8.1}ms", "gRPC");
    println!("{:>8} | {h50:>8.1}ms | {h99:>8.1}ms", "HTTP");
    println!(
        "{:>8} | {:>9.2}x | {:>9.2}x   (HTTP / gRPC; difference p50 {:+.1} ms)",
        "ratio",
        h50 / g50,
        h99 / g99,
        h50 - g50
    );
    Ok(())
}
