//! The HTTP layer's overhead: time to first token of the same chat job
//! through `POST /v1/chat/completions` (streamed, over one kept-alive
//! HTTP/1.1 connection) and through gRPC Submit + Watch, on one real
//! coordinator and one real node, in the same run, the two interleaved
//! round by round. Prints p50/p99 of each and their ratio.
//!
//! TTFT is from just before the request is written to the first event that
//! carries generated text (HTTP: the first chunk with non-empty `content`;
//! gRPC: the first Tokens event).
//!
//! ```text
//! cargo run --release -p mlxnet-tests --example openai_ttft -- --rounds 40
//! ```

use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Parser;
use mlxnet_proto::v1::{job_event, WatchJobRequest};
use mlxnet_tests::{chat_job, coordinator_config, spawn_coordinator, spawn_node, TEST_MODEL_ID};
use tokio::{
    io::{AsyncBufReadExt, AsyncWriteExt, BufReader},
    net::TcpStream,
};

#[derive(Parser)]
#[command(about = "TTFT over /v1/chat/completions against gRPC Submit+Watch")]
struct Args {
    /// Rounds (each: one HTTP job and one gRPC job).
    #[arg(long, default_value_t = 40)]
    rounds: usize,
    /// Tokens per job (short: TTFT is the point).
    #[arg(long, default_value_t = 4)]
    max_tokens: u32,
}

const QUESTION: &str = "What is the capital of France?";

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

/// One streamed chat request on `conn`; the time to its first text chunk.
/// Reads the stream to `[DONE]`, so the connection serves the next one.
async fn http_ttft(
    conn: &mut BufReader<TcpStream>,
    host: &str,
    key: &str,
    max_tokens: u32,
) -> anyhow::Result<Duration> {
    let body = serde_json::json!({
        "model": TEST_MODEL_ID,
        "messages": [
            {"role": "system", "content": mlxnet_tests::SYSTEM_PROMPT},
            {"role": "user", "content": QUESTION},
        ],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": true,
    })
    .to_string();
    let req = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: {host}\r\nauthorization: Bearer {key}\r\n\
         content-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    let started = Instant::now();
    conn.get_mut().write_all(req.as_bytes()).await?;
    let mut first = None;
    let mut line = String::new();
    loop {
        line.clear();
        if conn.read_line(&mut line).await? == 0 {
            bail!("the connection closed mid-stream");
        }
        let Some(data) = line.trim_end().strip_prefix("data: ") else {
            continue;
        };
        if data == "[DONE]" {
            break;
        }
        if first.is_none() {
            let v: serde_json::Value = serde_json::from_str(data)?;
            if v["choices"][0]["delta"]["content"]
                .as_str()
                .is_some_and(|t| !t.is_empty())
            {
                first = Some(started.elapsed());
            }
        }
    }
    // What is left of this response (the chunked body's last, empty chunk)
    // is read with the next one's headers: only `data:` lines count.
    first.context("no text chunk")
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    mlxnet_tests::test_model();
    let dir = tempfile::tempdir()?;
    let coord = spawn_coordinator(coordinator_config(&dir.path().join("coord"))).await?;
    let mut node = spawn_node(coord.node_config(&dir.path().join("n"), "n")).await?;
    node.registered().await?;
    let key = coord.accounts.client_key.clone();
    let host = coord.http_addr.to_string();
    let mut conn = BufReader::new(TcpStream::connect(coord.http_addr).await?);
    let mut grpc = coord.client().await?;

    let (mut http, mut rpc) = (Vec::new(), Vec::new());
    // One warm-up round of each, not counted.
    for round in 0..=args.rounds {
        let h = http_ttft(&mut conn, &host, &key, args.max_tokens).await?;
        let started = Instant::now();
        let job = grpc
            .jobs
            .submit(chat_job(QUESTION, args.max_tokens))
            .await?
            .into_inner();
        let mut events = grpc
            .jobs
            .watch(WatchJobRequest { job_id: job.id })
            .await?
            .into_inner();
        let mut g = None;
        while let Some(e) = events.message().await? {
            match e.event {
                Some(job_event::Event::Tokens(t)) if g.is_none() && !t.text.is_empty() => {
                    g = Some(started.elapsed());
                }
                Some(job_event::Event::Completed(_)) => break,
                Some(job_event::Event::Failed(f)) => bail!("gRPC job failed: {}", f.reason),
                _ => {}
            }
        }
        if round > 0 {
            http.push(h);
            rpc.push(g.context("no gRPC token")?);
        }
    }
    http.sort();
    rpc.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let (h50, h99) = (percentile(&http, 0.5), percentile(&http, 0.99));
    let (g50, g99) = (percentile(&rpc, 0.5), percentile(&rpc, 0.99));
    println!("rounds: {} (max_tokens {})", args.rounds, args.max_tokens);
    println!(
        "TTFT /v1/chat/completions: p50 {:.2} ms  p99 {:.2} ms",
        ms(h50),
        ms(h99)
    );
    println!(
        "TTFT gRPC Submit+Watch:    p50 {:.2} ms  p99 {:.2} ms",
        ms(g50),
        ms(g99)
    );
    println!(
        "HTTP / gRPC: p50 {:.3}x  p99 {:.3}x  (p50 difference {:+.2} ms)",
        ms(h50) / ms(g50),
        ms(h99) / ms(g99),
        ms(h50) - ms(g50)
    );
    node.stop().await?;
    coord.stop().await?;
    Ok(())
}
