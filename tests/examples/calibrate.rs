//! Calibration of the scheduler's cost model against real jobs: a real
//! coordinator and a real node (serving SmolLM2 with the figures that
//! `mlx-node bench --save` measured) run jobs of several prompt and output
//! lengths; for each, the cost model's predicted job time (prefill + tokens
//! x time per token, from the node's measured bandwidth and compute) is set
//! against the time the node's signed claim reports (prefill + decode), and
//! the error printed; so is the predicted decode rate (tokens/s) against the
//! claim's (tokens after the first / decode time), the figure issue 5 asks
//! to be within ±20%.
//!
//! Run (same thread count for both):
//! ```text
//! mlx-node bench --model models/SmolLM2-135M-Instruct.Q4_1.gguf --threads 1 --save /tmp/bench.json
//! cargo run -p mlxnet-tests --example calibrate -- --bench /tmp/bench.json --threads 1
//! ```
//! The prediction is made for the tokens each job actually produced (a job
//! may end at EOS before `max_tokens`), so the comparison is of the model,
//! not of how long the model chose to talk.

use anyhow::{bail, Context};
use clap::Parser;
use mlxnet_coordinator::{
    catalogue::Catalogue,
    config::smollm2_135m_instruct,
    scheduler::{Decision, Fleet, JobShape, Measured, Mode, NodeSpec, Policy},
};
use mlxnet_proto::{ids::NodeId, v1::JobState};
use mlxnet_tests::{coordinator_config, prompt_job, spawn_coordinator, spawn_node, state};

#[derive(Parser)]
#[command(about = "Predicted vs measured job time on a real node")]
struct Args {
    /// Figures saved by `mlx-node bench --save` on this machine.
    #[arg(long)]
    bench: std::path::PathBuf,
    /// Compute threads of the node (use the bench's).
    #[arg(long, default_value_t = 1)]
    threads: usize,
    /// Runs of each job shape (the median measured time is compared).
    #[arg(long, default_value_t = 3)]
    runs: usize,
}

/// Prompts of growing length (raw text; the model continues them).
const PARAGRAPH: &str = "The lighthouse stood at the end of the long stone pier, its white tower \
    streaked with salt and rust. Every night for forty years the keeper had climbed the spiral \
    stairs, trimmed the wick, polished the great lens and watched the beam sweep across the dark \
    water. Ships passed far out on the horizon, their lights like slow stars, and sometimes a \
    fishing boat came close enough that he could hear the men calling to one another over the \
    sound of the engine. ";

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    // As `mlx-node run` does before any thread exists: the engine's compute
    // pool takes its size from here, and must match the bench's.
    mlx_node::engine::cli::set_threads(Some(args.threads))?;
    tokio::runtime::Runtime::new()?.block_on(calibrate(args))
}

async fn calibrate(args: Args) -> anyhow::Result<()> {
    let saved: serde_json::Value = serde_json::from_slice(
        &std::fs::read(&args.bench).with_context(|| format!("reading {}", args.bench.display()))?,
    )?;
    let figure = |k: &str| {
        saved[k]
            .as_f64()
            .with_context(|| format!("{k} missing from {}", args.bench.display()))
    };
    let measured = Measured {
        memory_bandwidth: Some(figure("memory_bandwidth_bytes_per_s")?),
        compute: Some(figure("compute_flops")?),
        internet: None,
    };

    let dir = tempfile::tempdir()?;
    let coord = spawn_coordinator(coordinator_config(&dir.path().join("coord"))).await?;
    let node_dir = dir.path().join("node");
    std::fs::create_dir_all(&node_dir)?;
    std::fs::copy(&args.bench, node_dir.join(mlx_node::hardware::BENCH_FILE))?;
    let mut config = coord.node_config(&node_dir, "calibration");
    config.threads = Some(args.threads);
    let mut node = spawn_node(config).await?;
    node.registered().await?;
    let mut client = coord.client().await?;

    let catalogue = Catalogue::new(&[smollm2_135m_instruct()])?;
    let model = catalogue
        .get("smollm2-135m-instruct")
        .context("test model in the catalogue")?;
    let key = ed25519_dalek::SigningKey::from_bytes(&[7; 32]);
    let mut spec = NodeSpec::new(
        NodeId::from_key(&key.verifying_key()),
        "this machine",
        64 << 30,
        Mode::Dedicated,
        &measured,
    );
    spec.cached = vec![model.sha256];
    let mut fleet = Fleet::new(Policy::default());
    fleet.add_node(spec)?;

    // Warm-up: first touch of the weights on the node.
    client.run_job(prompt_job("Hello", 4)).await?;

    println!(
        "{:>7} {:>7} {:>10} {:>10} {:>8} {:>11} {:>11} {:>8}",
        "prompt", "tokens", "predicted", "measured", "error", "pred tok/s", "meas tok/s", "error"
    );
    let mut worst: f64 = 0.0;
    let mut worst_rate: f64 = 0.0;
    let mut within = 0;
    let mut rate_within = 0;
    let mut total = 0;
    for (paragraphs, max_tokens) in [(0, 32), (0, 128), (1, 64), (1, 256), (3, 128), (6, 64)] {
        let prompt = format!("{}Once upon a time,", PARAGRAPH.repeat(paragraphs));
        let mut times = Vec::new();
        let (mut prompt_tokens, mut tokens, mut decode_s) = (0, 0, Vec::new());
        for _ in 0..args.runs {
            let run = client.run_job(prompt_job(&prompt, max_tokens)).await?;
            if state(&run.job) != JobState::Completed {
                bail!("job failed: {}", run.job.error);
            }
            let c = run.job.result.and_then(|s| s.claim).context("no claim")?;
            prompt_tokens = c.prompt_tokens;
            tokens = c.completion_tokens;
            times.push((c.prefill_micros + c.decode_micros) as f64 / 1e6);
            decode_s.push(c.decode_micros as f64 / 1e6);
        }
        times.sort_by(f64::total_cmp);
        decode_s.sort_by(f64::total_cmp);
        let measured_s = times[times.len() / 2];
        let job = JobShape {
            model: &model.shape,
            prompt_tokens,
            max_tokens: tokens,
        };
        let Decision::Place(p) = fleet.decide(&job) else {
            bail!("the node should take the job");
        };
        let predicted_s = p.estimate.prefill_s + f64::from(tokens) * p.estimate.per_token_s;
        let error = (predicted_s - measured_s) / measured_s;
        // The first token comes out of the prefill; the rest are decode steps.
        let measured_rate = f64::from(tokens.saturating_sub(1)) / decode_s[decode_s.len() / 2];
        let predicted_rate = p.estimate.tokens_per_s();
        let rate_error = (predicted_rate - measured_rate) / measured_rate;
        println!(
            "{prompt_tokens:>7} {tokens:>7} {predicted_s:>9.3}s {measured_s:>9.3}s {:>+7.1}% {predicted_rate:>11.1} {measured_rate:>11.1} {:>+7.1}%",
            error * 100.0,
            rate_error * 100.0,
        );
        worst = worst.max(error.abs());
        worst_rate = worst_rate.max(rate_error.abs());
        if rate_error.abs() <= 0.20 {
            rate_within += 1;
        }
        total += 1;
        if error.abs() <= 0.20 {
            within += 1;
        }
    }
    println!(
        "job time: {within} of {total} job shapes within ±20%; worst error {:.1}%",
        worst * 100.0
    );
    println!(
        "decode tokens/s: {rate_within} of {total} job shapes within ±20%; worst error {:.1}%",
        worst_rate * 100.0
    );
    node.stop().await?;
    coord.stop().await?;
    Ok(())
}
