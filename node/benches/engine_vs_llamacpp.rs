//! Engine benchmark against llama.cpp: prefill and decode tokens/s on the same
//! GGUF, prompt and thread counts, measured in the same run.
//!
//! `cargo bench -p mlx-node --bench engine_vs_llamacpp`
//!
//! Models (rows), each at every thread count (1 and 2 by default):
//! - `smollm2`: SmolLM2-135M-Instruct Q4_1 (the test model);
//! - `gemma3`: Gemma 3 270M Q4_K_M (real; Q4_K, Q6_K, Q5_0 and Q8_0 tensors);
//! - `llama1b-q4km` and `llama1b-q8`: a random-weight 1B-class Llama
//!   (`support/random_llama.rs`, written into `models/` on first use) in
//!   Q4_K_M and Q8_0; 32 new tokens per run instead of 128, to keep the run
//!   short.
//!
//! For each model and thread count this binary runs, as child processes so
//! each gets its own thread pools:
//! - our engine (`Engine::load` + `Engine::generate`, greedy, the fixed
//!   128-token prompt of `prompt-128.txt`), one warm-up then `runs`
//!   measured generations;
//! - llama.cpp through llama-cpp-python (`scripts/bench-vs-llama-cpp.py`):
//!   same file, prompt, threads, prefill in one batch, greedy tokens;
//!
//! then prints every round's figures and a table with the medians and the
//! ratios ours / llama.cpp, and notes where the two sides' prompt tokens
//! differ (they should not) or their greedy ids part: at a near tie of
//! llama.cpp's logits (top-2 margin below 0.35, the greedy tests' rule)
//! that is expected, elsewhere it is a bug.
//! Without llama-cpp-python it says how to install it and prints our numbers.
//!
//! `-- --prepare` only writes the random models and exits.
//!
//! Settings (environment, all optional): `MLXNET_BENCH_MODELS`
//! (comma-separated names from the list above, default all of them whose
//! files are there or can be written), `MLXNET_BENCH_MODEL` (one GGUF path
//! instead), `MLXNET_BENCH_THREADS` (comma-separated, default `1,2`),
//! `MLXNET_BENCH_RUNS` (default 3), `MLXNET_BENCH_PYTHON` (default `python3`).
//!
//! Decode tokens/s counts the forward passes after the first sampled token:
//! `(generated - 1) / decode time`, on both sides. Our engine stops at EOS;
//! the table says so when that happened before 128 tokens.

use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{bail, Context};
use mlx_node::engine::{Engine, GenerateRequest, PromptInput, Resume, Sampling};
use serde_json::{json, Value};

#[path = "support/random_llama.rs"]
mod random_llama;
use mlx_node::test_utils::{setting, workspace};

const GEN_TOKENS: usize = 128;
/// New tokens per run on the 1B models (a run of 128 would take minutes).
const GEN_TOKENS_1B: usize = 32;
const PROMPT: &str = include_str!("prompt-128.txt");
const SMOLLM2: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
const GEMMA3: &str = "gemma-3-270m-q4_k_m.gguf";

fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

fn numbers(v: &Value, key: &str) -> Vec<f64> {
    v[key]
        .as_array()
        .map(|a| a.iter().filter_map(Value::as_f64).collect())
        .unwrap_or_default()
}

/// Child mode: our engine at the thread count the parent set in the environment.
fn run_ours(model: &Path, runs: usize, gen_tokens: usize) -> anyhow::Result<Value> {
    let t = Instant::now();
    let mut engine = Engine::load(model).with_context(|| format!("loading {}", model.display()))?;
    let load_s = t.elapsed().as_secs_f64();
    let request = GenerateRequest {
        input: PromptInput::Text(PROMPT.trim_end_matches('\n').to_string()),
        sampling: Sampling {
            max_tokens: gen_tokens,
            ..Sampling::default()
        },
        resume: Resume::default(),
    };
    let prompt_ids = engine.prompt_tokens(&request.input)?;
    let (mut prefill, mut decode) = (Vec::new(), Vec::new());
    let mut first_ids = Vec::new();
    let mut generated = 0;
    let mut finish = String::new();
    for run in 0..=runs {
        let g = engine.generate(&request, &mut |_| ControlFlow::Continue(()))?;
        if run == 0 {
            first_ids = g.output_token_ids.iter().take(16).copied().collect();
            continue;
        }
        generated = g.output_token_ids.len();
        finish = g.finish.as_str().to_string();
        prefill.push(g.prompt_tokens as f64 / g.prefill.as_secs_f64());
        decode.push(generated.saturating_sub(1) as f64 / g.decode.as_secs_f64());
    }
    Ok(json!({
        "engine": "mlx-node",
        "load_s": load_s,
        "prompt_tokens": prompt_ids.len(),
        "prompt_ids": prompt_ids,
        "gen_tokens": generated,
        "finish": finish,
        "prefill_tok_s": prefill,
        "decode_tok_s": decode,
        "first_ids": first_ids,
    }))
}

/// Runs a child and parses the last line of its stdout as JSON.
fn child_json(mut cmd: Command, what: &str) -> anyhow::Result<(Value, Option<i32>)> {
    let out = cmd.output().with_context(|| format!("starting {what}"))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout
        .lines()
        .rev()
        .find(|l| l.trim_start().starts_with('{'));
    match line {
        Some(l) => Ok((
            serde_json::from_str(l).with_context(|| format!("{what} printed {l}"))?,
            out.status.code(),
        )),
        None => bail!(
            "{what} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
                .lines()
                .rev()
                .take(5)
                .collect::<Vec<_>>()
                .join(" | ")
        ),
    }
}

fn ours(model: &Path, threads: usize, runs: usize, gen_tokens: usize) -> anyhow::Result<Value> {
    let mut cmd = Command::new(std::env::current_exe()?);
    cmd.args([
        "--child-ours",
        &model.display().to_string(),
        &runs.to_string(),
        &gen_tokens.to_string(),
    ])
    .env("CANDLE_NUM_THREADS", threads.to_string())
    .env("RAYON_NUM_THREADS", threads.to_string());
    Ok(child_json(cmd, "our engine")?.0)
}

fn llama(
    model: &Path,
    threads: usize,
    runs: usize,
    gen_tokens: usize,
    prompt_file: &Path,
) -> anyhow::Result<Value> {
    let python = setting("MLXNET_BENCH_PYTHON").unwrap_or_else(|| "python3".into());
    let script = workspace().join("scripts/bench-vs-llama-cpp.py");
    let make = |extra: bool| {
        let mut cmd = Command::new(&python);
        cmd.arg(&script)
            .args(["--model", &model.display().to_string()])
            .args(["--threads", &threads.to_string()])
            .args(["--prompt-file", &prompt_file.display().to_string()])
            .args(["--gen-tokens", &gen_tokens.to_string()])
            .args(["--runs", &runs.to_string()]);
        if !extra {
            cmd.arg("--no-extra-bufts");
        }
        cmd
    };
    match child_json(make(true), "llama.cpp") {
        Ok((v, _)) => Ok(v),
        // A default llama-cpp-python build can die with SIGILL in ggml's AMX
        // code on CPUs that list AMX but do not allow it: retry without the
        // extra buffer types (the table says so).
        Err(first) => child_json(make(false), "llama.cpp without extra buffer types")
            .map(|(v, _)| v)
            .map_err(|e| e.context(format!("first attempt: {first:#}"))),
    }
}

/// The SmolLM2 greedy test's near-tie rule (`engine::tests::NEAR_TIE`): at
/// a step where llama.cpp's top-2 logit margin is below it, the two engines
/// may pick different tokens without either being wrong (llama.cpp itself
/// does, between its own build options).
const NEAR_TIE: f64 = 0.35;

/// Where the two engines' greedy ids part, and whether that step is a near
/// tie for llama.cpp; `None` when they agree over the tokens both report.
fn greedy_note(ours: &Value, theirs: &Value) -> Option<String> {
    let (a, b) = (
        ours["first_ids"].as_array()?,
        theirs["first_ids"].as_array()?,
    );
    let step = a.iter().zip(b).position(|(x, y)| x != y)?;
    let (x, y) = (&a[step], &b[step]);
    Some(match theirs["top2_margins"].get(step).and_then(Value::as_f64) {
        Some(m) if m < NEAR_TIE => format!(
            "greedy ids agree for {step} tokens, then part at a near tie \
             (ours {x}, llama.cpp {y}; llama.cpp's top-2 margin there {m:.3} < {NEAR_TIE})"
        ),
        Some(m) => format!(
            "greedy ids differ at token {step} where llama.cpp's top-2 margin is {m:.3} \
             (not a near tie): ours {} vs llama.cpp {}",
            ours["first_ids"], theirs["first_ids"]
        ),
        None => format!(
            "greedy ids differ at token {step} (llama.cpp reported no margins): ours {} vs llama.cpp {}",
            ours["first_ids"], theirs["first_ids"]
        ),
    })
}

fn ratio(a: f64, b: f64) -> String {
    if a.is_finite() && b.is_finite() && b > 0.0 {
        format!("{:.2}x", a / b)
    } else {
        "-".into()
    }
}

/// One row group of the table: a model file and how many tokens to generate.
struct Row {
    name: String,
    path: PathBuf,
    gen_tokens: usize,
}

/// The models to measure (see the module doc).
fn rows() -> anyhow::Result<Vec<Row>> {
    if let Some(path) = setting("MLXNET_BENCH_MODEL") {
        let path = PathBuf::from(path);
        if !path.exists() {
            bail!("model {} not found", path.display());
        }
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        return Ok(vec![Row {
            name,
            path,
            gen_tokens: GEN_TOKENS,
        }]);
    }
    let models = workspace().join("models");
    let wanted = setting("MLXNET_BENCH_MODELS")
        .unwrap_or_else(|| "smollm2,gemma3,llama1b-q4km,llama1b-q8".into());
    let mut rows = Vec::new();
    for name in wanted.split(',').map(str::trim).filter(|n| !n.is_empty()) {
        let (path, gen_tokens) = match name {
            "smollm2" => (models.join(SMOLLM2), GEN_TOKENS),
            "gemma3" => (models.join(GEMMA3), GEN_TOKENS),
            "llama1b-q4km" | "llama1b-q8" => {
                let mix = if name == "llama1b-q8" {
                    random_llama::Mix::Q8_0
                } else {
                    random_llama::Mix::Q4KM
                };
                (
                    random_llama::ensure(&models, &models.join(SMOLLM2), mix)?,
                    GEN_TOKENS_1B,
                )
            }
            other => bail!("unknown model {other:?} in MLXNET_BENCH_MODELS"),
        };
        if !path.exists() {
            bail!(
                "model {} not found: fetch it with scripts/fetch-test-model.sh",
                path.display()
            );
        }
        rows.push(Row {
            name: name.to_string(),
            path,
            gen_tokens,
        });
    }
    Ok(rows)
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("--child-ours") {
        let model = PathBuf::from(args.get(1).context("--child-ours <model> <runs> <gen>")?);
        let runs = args.get(2).and_then(|r| r.parse().ok()).unwrap_or(3);
        let gen = args
            .get(3)
            .and_then(|r| r.parse().ok())
            .unwrap_or(GEN_TOKENS);
        println!("{}", run_ours(&model, runs, gen)?);
        return Ok(());
    }
    let rows_wanted = rows()?;
    if args.iter().any(|a| a == "--prepare") {
        // Only write the random models (outside a quiet-machine slot).
        for r in &rows_wanted {
            println!("{}: {}", r.name, r.path.display());
        }
        return Ok(());
    }
    let threads: Vec<usize> = setting("MLXNET_BENCH_THREADS")
        .unwrap_or_else(|| "1,2".into())
        .split(',')
        .filter_map(|t| t.trim().parse().ok())
        .filter(|&t| t > 0)
        .collect();
    let runs: usize = setting("MLXNET_BENCH_RUNS")
        .and_then(|r| r.parse().ok())
        .unwrap_or(3)
        .max(1);
    let prompt_file = Path::new(env!("CARGO_MANIFEST_DIR")).join("benches/prompt-128.txt");

    println!("engine vs llama.cpp: greedy, median of {runs} runs after 1 warm-up");
    let mut rows = Vec::new();
    let mut notes = Vec::new();
    for row in &rows_wanted {
        let model = &row.path;
        let gen = row.gen_tokens;
        for &t in &threads {
            let o = ours(model, t, runs, gen)?;
            let l = match llama(model, t, runs, gen, &prompt_file) {
                Ok(v) if v.get("error").is_some() => {
                    notes.push(format!(
                        "llama.cpp not measured: {}. Install: {}",
                        v["error"].as_str().unwrap_or("?"),
                        v["install"]
                            .as_str()
                            .unwrap_or("pip install llama-cpp-python")
                    ));
                    None
                }
                Ok(v) => Some(v),
                Err(e) => {
                    notes.push(format!(
                        "llama.cpp failed on {} at {t} threads: {e:#}",
                        row.name
                    ));
                    None
                }
            };
            // Every measured round, not only the medians of the table.
            let rounds = |v: &Value, key: &str| {
                numbers(v, key)
                    .iter()
                    .map(|x| format!("{x:.1}"))
                    .collect::<Vec<_>>()
                    .join(" ")
            };
            println!(
                "{} at {t} threads, tokens/s per round: prefill ours [{}] llama.cpp [{}]; decode ours [{}] llama.cpp [{}]",
                row.name,
                rounds(&o, "prefill_tok_s"),
                l.as_ref().map(|l| rounds(l, "prefill_tok_s")).unwrap_or_default(),
                rounds(&o, "decode_tok_s"),
                l.as_ref().map(|l| rounds(l, "decode_tok_s")).unwrap_or_default(),
            );
            let (op, od) = (
                median(numbers(&o, "prefill_tok_s")),
                median(numbers(&o, "decode_tok_s")),
            );
            let (lp, ld) = match &l {
                Some(l) => (
                    median(numbers(l, "prefill_tok_s")),
                    median(numbers(l, "decode_tok_s")),
                ),
                None => (f64::NAN, f64::NAN),
            };
            if let Some(l) = &l {
                if l["prompt_tokens"] != o["prompt_tokens"] {
                    notes.push(format!(
                        "{}: prompt lengths differ: ours {} tokens, llama.cpp {}",
                        row.name, o["prompt_tokens"], l["prompt_tokens"]
                    ));
                }
                if l.get("prompt_ids").is_some() && l["prompt_ids"] != o["prompt_ids"] {
                    notes.push(format!(
                        "{}: prompt tokens differ: ours {} vs llama.cpp {}",
                        row.name, o["prompt_ids"], l["prompt_ids"]
                    ));
                }
                if let Some(note) = greedy_note(&o, l) {
                    notes.push(format!("{} at {t} threads: {note}", row.name));
                }
                if l["extra_bufts"] == json!(false) {
                    notes.push(format!("{}: llama.cpp at {t} threads ran with use_extra_bufts=False (its default build died)", row.name));
                }
            }
            if o["gen_tokens"] != json!(gen) {
                notes.push(format!(
                    "{}: our engine generated {} tokens at {t} threads (finish: {})",
                    row.name, o["gen_tokens"], o["finish"]
                ));
            }
            rows.push((
                row.name.clone(),
                gen,
                t,
                o["prompt_tokens"].clone(),
                op,
                lp,
                od,
                ld,
            ));
        }
    }
    println!();
    println!("| model | new tokens | threads | prompt | prefill ours | prefill llama.cpp | ratio | decode ours | decode llama.cpp | ratio |");
    println!("|:------|-----------:|--------:|-------:|-------------:|------------------:|------:|------------:|-----------------:|------:|");
    for (name, gen, t, p, op, lp, od, ld) in rows {
        println!(
            "| {name} | {gen} | {t} | {p} | {op:.1} | {lp:.1} | {} | {od:.1} | {ld:.1} | {} |",
            ratio(op, lp),
            ratio(od, ld)
        );
    }
    println!("(tokens/s; ratio = ours / llama.cpp, above 1.00x means faster)");
    for n in notes {
        println!("note: {n}");
    }
    Ok(())
}
