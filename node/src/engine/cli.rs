//! `mlx-node generate` and `mlx-node bench`: one-shot tools over [`Engine`].
//!
//! `generate` streams the model's output to stdout as it is produced;
//! `bench` measures prefill and decode speed and prints one JSON object,
//! with the effective memory bandwidth and compute they imply (and with
//! `--batch`, the aggregate decode speed of 1, 2, 4, 8, 16 concurrent
//! streams through the node's continuous batching); `--save`
//! writes those figures where the node reads them at start-up, so its Hello
//! carries measured figures the scheduler prefers to the chip table.
//!
//! # Threads
//! candle sizes its CPU thread pools once, from `RAYON_NUM_THREADS` /
//! `CANDLE_NUM_THREADS`, the first time it computes anything. `--threads`
//! therefore sets those variables and builds rayon's global pool before any
//! model is loaded; it must be handled at the very start of the process.
//!
//! # Failure
//! Errors are returned as `anyhow` errors with context; `main` prints them.

use std::io::Write;
use std::ops::ControlFlow;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use super::batch::{BatchConfig, Batcher, JobSink};
use super::device::{self, DeviceChoice};
use super::kv::{KvShape, PAGE};
use super::{
    ChatTurn, Engine, EngineError, GenerateRequest, Generation, PromptInput, Resume, Sampling,
    TokenChunk,
};

/// Arguments of `mlx-node generate`.
#[derive(Debug, Clone, clap::Args)]
pub struct GenerateArgs {
    /// Model file (GGUF) or safetensors model directory.
    #[arg(long)]
    pub model: PathBuf,
    /// Treat the prompt as one user message and apply the model's chat template.
    #[arg(long)]
    pub chat: bool,
    /// Optional system message (with --chat).
    #[arg(long)]
    pub system: Option<String>,
    /// Sampling temperature; 0 means greedy.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Keep only the k most likely tokens; 0 means off.
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    /// Nucleus sampling threshold; 1 means off.
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// Drop tokens less likely than min_p times the most likely one; 0 means off.
    #[arg(long, default_value_t = 0.0)]
    pub min_p: f32,
    /// Repetition penalty; 1 means off.
    #[arg(long, default_value_t = 1.0)]
    pub repetition_penalty: f32,
    /// OpenAI's presence penalty over generated tokens (-2 to 2); 0 means off.
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub presence_penalty: f32,
    /// OpenAI's frequency penalty over generated tokens (-2 to 2); 0 means off.
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub frequency_penalty: f32,
    /// Seed of the sampler.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Most tokens to generate.
    #[arg(long, default_value_t = 128)]
    pub max_tokens: usize,
    /// Stop strings (repeatable).
    #[arg(long)]
    pub stop: Vec<String>,
    /// CPU threads (default: candle's choice, the physical core count).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Where to compute: auto (Metal when built with it and present, else
    /// the CPU), cpu, metal or cuda.
    #[arg(long, default_value = "auto")]
    pub device: DeviceChoice,
    /// The prompt.
    pub prompt: String,
}

/// Arguments of `mlx-node bench`.
#[derive(Debug, Clone, clap::Args)]
pub struct BenchArgs {
    /// Model file (GGUF) or safetensors model directory.
    #[arg(long)]
    pub model: PathBuf,
    /// CPU threads (default: candle's choice, the physical core count).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Where to compute: auto, cpu, metal or cuda (as `generate`).
    #[arg(long, default_value = "auto")]
    pub device: DeviceChoice,
    /// Length of the prompt processed in the prefill measurement.
    #[arg(long, default_value_t = 128)]
    pub prompt_tokens: usize,
    /// Tokens generated in the decode measurement.
    #[arg(long, default_value_t = 128)]
    pub gen_tokens: usize,
    /// Measured runs (the median is reported).
    #[arg(long, default_value_t = 3)]
    pub runs: usize,
    /// Also write the measured figures here (the node reads
    /// `<data_dir>/bench.json` at start-up).
    #[arg(long)]
    pub save: Option<PathBuf>,
    /// Also measure continuous batching: aggregate decode speed of N
    /// concurrent streams through the node's batch, for each N of
    /// `--streams` (saved with `--save` as the node's throughput curve).
    #[arg(long)]
    pub batch: bool,
    /// Stream counts measured by `--batch`.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8,16")]
    pub streams: Vec<usize>,
}

/// Sets candle's CPU thread count. Must run before candle computes anything.
#[allow(
    clippy::disallowed_methods,
    reason = "candle and rayon read their thread count only from the environment"
)]
pub fn set_threads(threads: Option<usize>) -> anyhow::Result<()> {
    let Some(n) = threads else { return Ok(()) };
    anyhow::ensure!(n > 0, "--threads must be at least 1");
    // candle reads these once, lazily; setting them before the first tensor
    // operation is what makes the count take effect.
    std::env::set_var("RAYON_NUM_THREADS", n.to_string());
    std::env::set_var("CANDLE_NUM_THREADS", n.to_string());
    // Fails only if the global pool was already built (by an earlier call);
    // then the first setting stays in force.
    let _ = rayon::ThreadPoolBuilder::new()
        .num_threads(n)
        .build_global();
    Ok(())
}

/// Runs `mlx-node generate`: streams the output to stdout.
pub fn generate(args: GenerateArgs) -> anyhow::Result<()> {
    set_threads(args.threads)?;
    let backend = device::resolve(args.device)?;
    let mut engine = Engine::load_on(&args.model, &backend)
        .with_context(|| format!("loading model {}", args.model.display()))?;
    let input = if args.chat {
        let mut turns = Vec::new();
        if let Some(system) = &args.system {
            turns.push(ChatTurn {
                role: "system".to_string(),
                content: system.clone(),
            });
        }
        turns.push(ChatTurn {
            role: "user".to_string(),
            content: args.prompt.clone(),
        });
        PromptInput::Chat(turns)
    } else {
        PromptInput::Text(args.prompt.clone())
    };
    let request = GenerateRequest {
        input,
        sampling: Sampling {
            temperature: args.temperature,
            top_k: args.top_k,
            top_p: args.top_p,
            min_p: args.min_p,
            repetition_penalty: args.repetition_penalty,
            seed: args.seed,
            max_tokens: args.max_tokens,
            stop: args.stop.clone(),
            logprobs: None,
            presence_penalty: args.presence_penalty,
            frequency_penalty: args.frequency_penalty,
            logit_bias: Vec::new(),
            grammar: None,
        },
        resume: Resume::default(),
    };
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    let mut write_error = None;
    let generation = engine
        .generate(&request, &mut |chunk| {
            if let Err(e) = out
                .write_all(chunk.text.as_bytes())
                .and_then(|()| out.flush())
            {
                write_error = Some(e);
                return ControlFlow::Break(());
            }
            ControlFlow::Continue(())
        })
        .context("generating")?;
    if let Some(e) = write_error {
        return Err(e).context("writing to stdout");
    }
    writeln!(out)?;
    let decoded = generation.output_token_ids.len();
    eprintln!(
        "[{} prompt tokens, {} generated, finish {}, prefill {:.1} ms, decode {:.1} tok/s]",
        generation.prompt_tokens,
        decoded,
        generation.finish.as_str(),
        generation.prefill.as_secs_f64() * 1e3,
        if generation.decode.is_zero() {
            0.0
        } else {
            decoded.saturating_sub(1) as f64 / generation.decode.as_secs_f64()
        }
    );
    Ok(())
}

/// Runs `mlx-node bench`: prints `{"prefill_tok_s": .., "decode_tok_s": .., ...}`.
///
/// Prefill is one forward pass over a `prompt_tokens`-long prompt; decode is
/// `gen_tokens` single-token passes with greedy sampling (EOS ignored, so the
/// count is exact). After a warm-up, each is run `runs` times and the median
/// speed reported.
pub fn bench(args: BenchArgs) -> anyhow::Result<()> {
    set_threads(args.threads)?;
    anyhow::ensure!(args.prompt_tokens > 0, "--prompt-tokens must be at least 1");
    anyhow::ensure!(args.runs > 0, "--runs must be at least 1");
    let load_start = Instant::now();
    let backend = device::resolve(args.device)?;
    let mut engine = Engine::load_on(&args.model, &backend)
        .with_context(|| format!("loading model {}", args.model.display()))?;
    let load_s = load_start.elapsed().as_secs_f64();
    let ctx = engine.info.context_length;
    anyhow::ensure!(
        args.prompt_tokens + args.gen_tokens <= ctx,
        "--prompt-tokens + --gen-tokens must fit the context length {ctx}"
    );
    let prompt = bench_prompt(&engine, args.prompt_tokens)?;
    // Warm-up: first-touch of weights, candle's lazily packed kernels.
    run_once(&mut engine, &prompt[..prompt.len().min(16)], 4)?;
    let mut prefill = Vec::new();
    let mut decode = Vec::new();
    for _ in 0..args.runs {
        let (p, d) = run_once(&mut engine, &prompt, args.gen_tokens)?;
        prefill.push(args.prompt_tokens as f64 / p);
        if args.gen_tokens > 0 {
            decode.push(args.gen_tokens as f64 / d);
        }
    }
    let median = |v: &mut Vec<f64>| -> f64 {
        if v.is_empty() {
            return 0.0;
        }
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let prefill_tok_s = median(&mut prefill);
    let decode_tok_s = median(&mut decode);
    let curve = if args.batch {
        batch_curve(
            &mut engine,
            args.prompt_tokens,
            args.gen_tokens,
            &args.streams,
        )?
    } else {
        Vec::new()
    };
    // Bytes read per generated token: the weights a token reads (all of a
    // dense model's; a mixture of experts' active share of the file) plus
    // the KV cache (f32) at mid-generation, as the scheduler's cost model
    // counts them.
    let active_share = engine.info.active_parameters as f64 / engine.info.parameters.max(1) as f64;
    let kv_per_token = 2 * engine.info.layers * engine.info.kv_heads * engine.info.head_dim * 4;
    let bytes_per_token = model_bytes(&args.model)? as f64 * active_share
        + (kv_per_token * (args.prompt_tokens + args.gen_tokens / 2)) as f64;
    let figures = crate::hardware::BenchFigures {
        memory_bandwidth_bytes_per_s: (bytes_per_token * decode_tok_s) as u64,
        compute_flops: (2.0 * engine.info.active_parameters as f64 * prefill_tok_s) as u64,
    };
    if let Some(path) = &args.save {
        let mut saved = serde_json::to_value(figures)?;
        if !curve.is_empty() {
            saved["batch"] = serde_json::to_value(&curve)?;
        }
        std::fs::write(path, serde_json::to_vec_pretty(&saved)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    let out = serde_json::json!({
        "model": args.model.display().to_string(),
        "architecture": engine.info.architecture,
        "backend": engine.backend(),
        "parameters": engine.info.parameters,
        "active_parameters": engine.info.active_parameters,
        "threads": candle_core::utils::get_num_threads(),
        "prompt_tokens": args.prompt_tokens,
        "gen_tokens": args.gen_tokens,
        "runs": args.runs,
        "load_s": load_s,
        "prefill_tok_s": prefill_tok_s,
        "decode_tok_s": decode_tok_s,
        "memory_bandwidth_bytes_per_s": figures.memory_bandwidth_bytes_per_s,
        "compute_flops": figures.compute_flops,
        "batch": curve,
    });
    println!("{out}");
    Ok(())
}

/// Bytes of a model: the GGUF file, or a directory's safetensors files.
fn model_bytes(path: &std::path::Path) -> anyhow::Result<u64> {
    let meta = std::fs::metadata(path).with_context(|| format!("reading {}", path.display()))?;
    if meta.is_file() {
        return Ok(meta.len());
    }
    let mut total = 0;
    for entry in std::fs::read_dir(path).with_context(|| format!("listing {}", path.display()))? {
        let entry = entry?;
        if entry.path().extension().is_some_and(|e| e == "safetensors") {
            total += entry.metadata()?.len();
        }
    }
    Ok(total)
}

/// A prompt of exactly `n` tokens (English text, repeated as needed).
fn bench_prompt(engine: &Engine, n: usize) -> anyhow::Result<Vec<u32>> {
    const TEXT: &str =
        "The quick brown fox jumps over the lazy dog. Sphinx of black quartz, judge my vow. \
        In the beginning the universe was created; this has made a lot of people very angry and \
        been widely regarded as a bad move. ";
    let piece = engine
        .tokenize(TEXT)
        .context("tokenizing the bench prompt")?;
    anyhow::ensure!(!piece.is_empty(), "the bench prompt tokenizes to nothing");
    Ok(piece.iter().copied().cycle().take(n).collect())
}

/// Counts the tokens streamed to it.
struct Count(Arc<AtomicUsize>);

impl JobSink for Count {
    fn token(&mut self, _: &TokenChunk) -> ControlFlow<()> {
        self.0.fetch_add(1, Ordering::Relaxed);
        ControlFlow::Continue(())
    }
    fn done(self: Box<Self>, _: Result<Generation, EngineError>) {}
}

/// Aggregate decode tokens/s of `n` concurrent greedy streams through the
/// batch, for each `n` in `streams`: the streams are prefilled together
/// (prompts of about `prompt_tokens`, each different), then `gen_tokens`
/// steps are timed and every token streamed in them counted (a stream that
/// ends early just stops counting).
fn batch_curve(
    engine: &mut Engine,
    prompt_tokens: usize,
    gen_tokens: usize,
    streams: &[usize],
) -> anyhow::Result<Vec<crate::hardware::BatchPoint>> {
    let text = engine.text.clone();
    let base = bench_prompt(engine, prompt_tokens)?;
    let mut curve = Vec::new();
    for &n in streams.iter().filter(|&&n| n > 0) {
        let positions = n * (prompt_tokens + gen_tokens + 2 * PAGE);
        let cfg = BatchConfig {
            slots: n,
            kv_pages: KvShape::pages_for(positions),
            step_tokens: n * prompt_tokens.max(1),
            prefix_cache: false,
        };
        let mut batch = Batcher::new(&engine.model, text.clone(), cfg)?;
        let count = Arc::new(AtomicUsize::new(0));
        for i in 0..n {
            // Different prompts: each starts at another token of the text.
            let ids: Vec<u32> = base
                .iter()
                .cycle()
                .skip(i * 7)
                .take(prompt_tokens)
                .copied()
                .collect();
            let request = GenerateRequest {
                input: PromptInput::Text(engine.detokenize(&ids)),
                sampling: Sampling {
                    max_tokens: gen_tokens + 1,
                    ..Sampling::default()
                },
                resume: Resume::default(),
            };
            batch.submit(&request, Box::new(Count(count.clone())), Instant::now());
        }
        // Prefill (and each stream's first token), untimed.
        while count.load(Ordering::Relaxed) < n && batch.step(&mut engine.model) {}
        count.store(0, Ordering::Relaxed);
        let start = Instant::now();
        for _ in 0..gen_tokens {
            if !batch.step(&mut engine.model) {
                break;
            }
        }
        let secs = start.elapsed().as_secs_f64();
        let tokens = count.load(Ordering::Relaxed);
        curve.push(crate::hardware::BatchPoint {
            streams: n as u32,
            tokens_per_s: tokens as f64 / secs.max(1e-9),
        });
    }
    Ok(curve)
}

/// One prefill + decode; returns (prefill seconds, decode seconds).
fn run_once(engine: &mut Engine, prompt: &[u32], gen: usize) -> anyhow::Result<(f64, f64)> {
    engine.model.reset(prompt.len() + gen);
    let start = Instant::now();
    let mut logits = engine.model.forward(prompt)?;
    let prefill = start.elapsed().as_secs_f64();
    let start = Instant::now();
    for _ in 0..gen {
        let token = super::sampler::argmax(&logits);
        logits = engine.model.forward(&[token])?;
    }
    Ok((prefill, start.elapsed().as_secs_f64()))
}
