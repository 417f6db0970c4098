//! Continuous batching bench: one node, many clients, against llama.cpp's
//! server (`llama-server --parallel 8`, continuous batching) in the same run.
//!
//! `cargo bench -p mlxnet-tests --bench batching`
//!
//! Ours goes the way a user's jobs go: a real coordinator (embedded SQLite),
//! a real node serving SmolLM2-135M-Instruct over QUIC, gRPC clients. For
//! each stream count S (1, 2, 4, 8, 16) S clients run at once, each
//! submitting its jobs one after the other (chat, greedy, `max_tokens` 128);
//! the round's aggregate decode speed is every generated token over the
//! round's wall time, and time-to-first-token is from the submit call to
//! the first streamed token. llama-server gets the same prompts, threads
//! and stream counts from `scripts/bench_llama_server.py` (streamed chat
//! completions). Then the prefix cache: two jobs sharing a system prompt of
//! about 1,000 tokens, one after the other, each one's first-token time,
//! and the second's output against the engine run alone (no cache).
//!
//! Every round is printed; nothing is a best-of.
//!
//! Settings (environment, all optional): `MLXNET_BENCH_THREADS` (2),
//! `MLXNET_BENCH_STREAMS` (`1,2,4,8,16`), `MLXNET_BENCH_PER_STREAM` (jobs
//! per client, 2), `MLXNET_BENCH_MAX_TOKENS` (128), `MLXNET_BENCH_ROUNDS`
//! (1), `MLXNET_BENCH_SLOTS` (the node's batch slots, default its own),
//! `MLXNET_BENCH_LLAMA_SERVER` (default `target/llama-server/build/bin/
//! llama-server`, built by `scripts/build-llama-server.sh`; absent: ours
//! only), `MLXNET_BENCH_PYTHON` (`python3`).

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use mlx_node::engine::{ChatTurn, Engine, GenerateRequest, PromptInput, Resume, Sampling};
use mlxnet_proto::v1::{
    job_event, job_input, ChatMessage, ChatMessages, JobInput, SamplingParams, SubmitJobRequest,
    WatchJobRequest,
};
use mlxnet_tests::{
    coordinator_config, repo_root, spawn_coordinator, spawn_node, test_model, Client, TEST_MODEL_ID,
};
use serde_json::{json, Value};

fn setting(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

fn number(name: &str, default: usize) -> anyhow::Result<usize> {
    match setting(name) {
        Some(v) => v.parse().with_context(|| format!("{name}={v}")),
        None => Ok(default),
    }
}

const SYSTEM: &str = "You are a helpful assistant.";

const QUESTIONS: [&str; 32] = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis to a child.",
    "List three uses of a paperclip.",
    "Why is the sky blue?",
    "Tell me a story about a lighthouse keeper.",
    "What is 12 times 7?",
    "Name a famous painting and its painter.",
    "How do bees make honey?",
    "Describe a rainy day in London.",
    "What causes the seasons?",
    "Give me a recipe for pancakes.",
    "Why do cats purr?",
    "Explain what a computer program is.",
    "What is the tallest mountain on Earth?",
    "Write a short poem about autumn leaves.",
    "How does a bicycle stay upright?",
    "What is the difference between weather and climate?",
    "Tell me about the history of the printing press.",
    "How do airplanes fly?",
    "What are the planets of the solar system?",
    "Explain gravity in simple words.",
    "What is a rainbow made of?",
    "Describe the life cycle of a butterfly.",
    "Why is exercise good for you?",
    "How do volcanoes form?",
    "What is the water cycle?",
    "Write a limerick about a cat.",
    "How does the heart pump blood?",
    "What is the speed of light?",
    "Tell me a fun fact about octopuses.",
    "What is the main ingredient of guacamole?",
];

/// The chat messages of job `i`.
fn messages(system: &str, i: usize) -> Vec<(String, String)> {
    vec![
        ("system".into(), system.into()),
        ("user".into(), QUESTIONS[i % QUESTIONS.len()].into()),
    ]
}

fn submit_request(msgs: &[(String, String)], max_tokens: u32) -> SubmitJobRequest {
    SubmitJobRequest {
        model: TEST_MODEL_ID.to_string(),
        input: Some(JobInput {
            kind: Some(job_input::Kind::Chat(ChatMessages {
                messages: msgs
                    .iter()
                    .map(|(role, content)| ChatMessage {
                        role: role.clone(),
                        content: content.clone(),
                    })
                    .collect(),
            })),
        }),
        sampling: Some(SamplingParams {
            max_tokens,
            ..Default::default()
        }),
        max_price_micro_mlx: 0,
        priority: 0,
    }
}

/// One job as a client sees it.
#[derive(Debug, Clone)]
struct Seen {
    ttft: Duration,
    tokens: usize,
    ids: Vec<u32>,
    end: Duration,
}

/// Submits and follows one job; times from the submit call.
async fn one_job(
    client: &mut Client,
    req: SubmitJobRequest,
    round_start: Instant,
) -> anyhow::Result<Seen> {
    let t0 = Instant::now();
    let job = client.jobs.submit(req).await?.into_inner();
    let mut stream = client
        .jobs
        .watch(WatchJobRequest {
            job_id: job.id.clone(),
        })
        .await?
        .into_inner();
    let mut ttft = None;
    let mut ids = Vec::new();
    while let Some(event) = stream.message().await? {
        match event.event {
            Some(job_event::Event::Tokens(t)) => {
                ttft.get_or_insert_with(|| t0.elapsed());
                ids.extend(t.token_ids);
            }
            Some(job_event::Event::Completed(_)) => break,
            Some(job_event::Event::Failed(f)) => bail!("job {} failed: {f:?}", job.id),
            Some(job_event::Event::Cancelled(_)) => bail!("job {} cancelled", job.id),
            _ => {}
        }
    }
    Ok(Seen {
        ttft: ttft.unwrap_or_else(|| t0.elapsed()),
        tokens: ids.len(),
        ids,
        end: round_start.elapsed(),
    })
}

/// Round figures: aggregate tokens/s, TTFT p50 and p99 (ms).
#[derive(Debug, Clone, Copy)]
struct Figures {
    tok_s: f64,
    p50_ms: f64,
    p99_ms: f64,
    jobs: usize,
}

/// Nearest-rank percentile.
fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

fn figures(ttfts_s: &[f64], tokens: usize, wall_s: f64) -> Figures {
    let mut t: Vec<f64> = ttfts_s.iter().map(|s| s * 1e3).collect();
    t.sort_by(f64::total_cmp);
    Figures {
        tok_s: tokens as f64 / wall_s,
        p50_ms: percentile(&t, 50.0),
        p99_ms: percentile(&t, 99.0),
        jobs: t.len(),
    }
}

async fn our_round(
    client: &Client,
    streams: usize,
    per_stream: usize,
    max_tokens: u32,
) -> anyhow::Result<Figures> {
    let start = Instant::now();
    let mut tasks = Vec::new();
    for c in 0..streams {
        let mut client = client.clone();
        tasks.push(tokio::spawn(async move {
            let mut seen = Vec::new();
            for k in 0..per_stream {
                let req = submit_request(&messages(SYSTEM, c + k * streams), max_tokens);
                seen.push(one_job(&mut client, req, start).await?);
            }
            anyhow::Ok(seen)
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await??);
    }
    let wall = all
        .iter()
        .map(|s| s.end)
        .max()
        .unwrap_or_default()
        .as_secs_f64();
    let ttfts: Vec<f64> = all.iter().map(|s| s.ttft.as_secs_f64()).collect();
    Ok(figures(
        &ttfts,
        all.iter().map(|s| s.tokens).sum(),
        wall.max(1e-9),
    ))
}

/// About `n` tokens of system prompt: numbered rules of an imaginary library.
fn long_system(n_tokens: usize, engine: &Engine) -> anyhow::Result<String> {
    let mut text = String::from("You are the assistant of the Lighthouse Library. House rules:\n");
    let mut i = 1;
    while engine.tokenize(&text)?.len() < n_tokens {
        text.push_str(&format!(
            "{i}. Shelf {i} holds books on topic number {}; answer briefly and name the shelf.\n",
            i * 7 % 97
        ));
        i += 1;
    }
    Ok(text)
}

fn llama_side(
    server: &std::path::Path,
    threads: usize,
    streams: &[usize],
    per_stream: usize,
    max_tokens: usize,
) -> anyhow::Result<Value> {
    let dir = tempfile::tempdir()?;
    let jobs_file = dir.path().join("jobs.json");
    let total = streams.iter().max().copied().unwrap_or(1) * per_stream;
    let jobs: Vec<Value> = (0..total)
        .map(|i| {
            Value::Array(
                messages(SYSTEM, i)
                    .into_iter()
                    .map(|(role, content)| json!({"role": role, "content": content}))
                    .collect(),
            )
        })
        .collect();
    std::fs::write(&jobs_file, serde_json::to_vec(&jobs)?)?;
    let python = setting("MLXNET_BENCH_PYTHON").unwrap_or_else(|| "python3".into());
    let out = Command::new(python)
        .arg(repo_root().join("scripts/bench_llama_server.py"))
        .args(["--server".as_ref(), server.as_os_str()])
        .args(["--model".as_ref(), test_model().as_os_str()])
        .args(["--threads", &threads.to_string()])
        .args(["--parallel", "8"])
        .args([
            "--streams",
            &streams
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(","),
        ])
        .args(["--per-stream", &per_stream.to_string()])
        .args(["--max-tokens", &max_tokens.to_string()])
        .args(["--jobs".as_ref(), jobs_file.as_os_str()])
        .output()
        .context("running scripts/bench_llama_server.py")?;
    if !out.status.success() {
        bail!(
            "llama-server side failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let line = String::from_utf8_lossy(&out.stdout);
    serde_json::from_str(line.trim()).context("llama-server side output")
}

fn llama_figures(round: &Value) -> Figures {
    let jobs = round["jobs"].as_array().cloned().unwrap_or_default();
    let ttfts: Vec<f64> = jobs.iter().filter_map(|j| j["ttft_s"].as_f64()).collect();
    let tokens: u64 = jobs.iter().filter_map(|j| j["tokens"].as_u64()).sum();
    let wall = jobs
        .iter()
        .filter_map(|j| j["end_s"].as_f64())
        .fold(0.0, f64::max);
    figures(&ttfts, tokens as usize, wall.max(1e-9))
}

fn main() -> anyhow::Result<()> {
    let threads = number("MLXNET_BENCH_THREADS", 2)?;
    let streams: Vec<usize> = setting("MLXNET_BENCH_STREAMS")
        .unwrap_or_else(|| "1,2,4,8,16".into())
        .split(',')
        .map(|s| s.trim().parse().context("MLXNET_BENCH_STREAMS"))
        .collect::<anyhow::Result<_>>()?;
    let per_stream = number("MLXNET_BENCH_PER_STREAM", 2)?;
    let max_tokens = number("MLXNET_BENCH_MAX_TOKENS", 128)?;
    let rounds = number("MLXNET_BENCH_ROUNDS", 1)?;
    let slots = setting("MLXNET_BENCH_SLOTS")
        .map(|s| s.parse::<u32>())
        .transpose()
        .context("MLXNET_BENCH_SLOTS")?;
    let server = setting("MLXNET_BENCH_LLAMA_SERVER")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_root().join("target/llama-server/build/bin/llama-server"));
    // Before any thread exists: the engine's compute pool takes its size here.
    mlx_node::engine::cli::set_threads(Some(threads))?;
    let runtime = tokio::runtime::Runtime::new()?;

    println!(
        "batching bench: SmolLM2-135M-Instruct Q4_1, {threads} threads, max_tokens {max_tokens}, \
         {per_stream} jobs per stream"
    );
    for round in 1..=rounds {
        let ours: Vec<(usize, Figures)> = runtime.block_on(async {
            let dir = tempfile::tempdir()?;
            let coord = spawn_coordinator(coordinator_config(&dir.path().join("coord"))).await?;
            let node_dir = dir.path().join("node");
            std::fs::create_dir_all(&node_dir)?;
            let mut config = coord.node_config(&node_dir, "bench-node");
            config.threads = Some(threads);
            config.batch_slots = slots;
            let mut node = spawn_node(config).await?;
            node.registered().await?;
            let client = coord.client().await?;
            // Warm-up: first touch of the weights, the template, the link.
            our_round(&client, 1, 1, 8).await?;
            let mut out = Vec::new();
            for &s in &streams {
                out.push((
                    s,
                    our_round(&client, s, per_stream, max_tokens as u32).await?,
                ));
            }
            node.stop().await?;
            coord.stop().await?;
            anyhow::Ok(out)
        })?;
        let llama = if server.is_file() {
            Some(llama_side(
                &server, threads, &streams, per_stream, max_tokens,
            )?)
        } else {
            println!(
                "(no llama-server at {}: build it with scripts/build-llama-server.sh)",
                server.display()
            );
            None
        };
        println!("round {round}");
        println!(
            "{:>7} | {:>10} {:>9} {:>9} | {:>10} {:>9} {:>9} | {:>6}",
            "streams",
            "ours tok/s",
            "TTFT p50",
            "TTFT p99",
            "llama tok/s",
            "TTFT p50",
            "TTFT p99",
            "ratio"
        );
        let mut llama_at = Vec::new();
        for (i, (s, f)) in ours.iter().enumerate() {
            let l = llama
                .as_ref()
                .and_then(|v| v["rounds"].get(i))
                .map(llama_figures);
            if let Some(round) = llama.as_ref().and_then(|v| v["rounds"].get(i)) {
                if let Some(errors) = round["errors"].as_array().filter(|e| !e.is_empty()) {
                    println!("  llama-server errors at {s} streams: {errors:?}");
                }
            }
            llama_at.push(l);
            match l {
                Some(l) => println!(
                    "{s:>7} | {:>10.1} {:>7.0}ms {:>7.0}ms | {:>10.1} {:>7.0}ms {:>7.0}ms | {:>5.2}x",
                    f.tok_s,
                    f.p50_ms,
                    f.p99_ms,
                    l.tok_s,
                    l.p50_ms,
                    l.p99_ms,
                    f.tok_s / l.tok_s
                ),
                None => println!(
                    "{s:>7} | {:>10.1} {:>7.0}ms {:>7.0}ms |",
                    f.tok_s, f.p50_ms, f.p99_ms
                ),
            }
            debug_assert!(f.jobs == s * per_stream);
        }
        let at = |n: usize| streams.iter().position(|&s| s == n);
        if let (Some(one), Some(eight)) = (at(1), at(8)) {
            let (o1, o8) = (ours[one].1, ours[eight].1);
            println!(
                "ours 8 streams / ours 1 stream: {:.2}x (goal >= 4); TTFT p99 at 8: {:.0} ms (goal <= 300)",
                o8.tok_s / o1.tok_s,
                o8.p99_ms
            );
            if let Some(l8) = llama_at[eight] {
                println!(
                    "ours / llama-server at 8 streams: {:.2}x (goal >= 3); llama-server 8 / 1: {:.2}x",
                    o8.tok_s / l8.tok_s,
                    llama_at[one].map_or(f64::NAN, |l1| l8.tok_s / l1.tok_s)
                );
            }
        }
        prefix_round(&runtime, threads)?;
    }
    Ok(())
}

/// Two jobs sharing a ~1,000-token system prompt, one after the other on a
/// fresh node; the second's output against the engine alone.
fn prefix_round(runtime: &tokio::runtime::Runtime, threads: usize) -> anyhow::Result<()> {
    let mut engine = Engine::load(&test_model())?;
    let system = long_system(1000, &engine)?;
    let (first, second) = (messages(&system, 0), messages(&system, 1));
    let prompt_tokens = engine
        .prompt_tokens(&chat_input(&second))
        .map(|p| p.len())?;
    let (a, b) = runtime.block_on(async {
        let dir = tempfile::tempdir()?;
        let coord = spawn_coordinator(coordinator_config(&dir.path().join("coord"))).await?;
        let node_dir = dir.path().join("node");
        std::fs::create_dir_all(&node_dir)?;
        let mut config = coord.node_config(&node_dir, "bench-prefix");
        config.threads = Some(threads);
        let mut node = spawn_node(config).await?;
        node.registered().await?;
        let mut client = coord.client().await?;
        our_round(&client, 1, 1, 8).await?; // warm-up, another prompt
        let start = Instant::now();
        let a = one_job(&mut client, submit_request(&first, 32), start).await?;
        let b = one_job(&mut client, submit_request(&second, 32), start).await?;
        node.stop().await?;
        coord.stop().await?;
        anyhow::Ok((a, b))
    })?;
    let alone = engine.generate(
        &GenerateRequest {
            input: chat_input(&second),
            sampling: Sampling {
                max_tokens: 32,
                ..Sampling::default()
            },
            resume: Resume::default(),
        },
        &mut |_| std::ops::ControlFlow::Continue(()),
    )?;
    println!(
        "prefix cache ({prompt_tokens}-token prompts sharing the system prompt): first job's \
         TTFT {:.0} ms, second's {:.0} ms: {:.1}x sooner (goal >= 10); second's output equals \
         the engine alone: {}",
        a.ttft.as_secs_f64() * 1e3,
        b.ttft.as_secs_f64() * 1e3,
        a.ttft.as_secs_f64() / b.ttft.as_secs_f64(),
        if b.ids == alone.output_token_ids {
            "yes"
        } else {
            "NO"
        }
    );
    Ok(())
}

fn chat_input(msgs: &[(String, String)]) -> PromptInput {
    PromptInput::Chat(
        msgs.iter()
            .map(|(role, content)| ChatTurn {
                role: role.clone(),
                content: content.clone(),
            })
            .collect(),
    )
}
