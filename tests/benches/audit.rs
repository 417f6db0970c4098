//! Audit benchmark: how often audits catch cheating nodes, how often they
//! accuse honest ones, and what auditing costs (issue 7, must-show 2 and 3),
//! first for one auditor's verdict, then through the coordinator's auditor
//! selection and confirmation (issue 16).
//!
//! `cargo bench -p mlxnet-tests --bench audit --profile dev --locked`
//!
//! Every job is a chat question to SmolLM2-135M-Instruct (Q4_1), at most
//! [`MAX_TOKENS`] generated tokens; greedy jobs and sampled jobs
//! (temperature 0.7, top-p 0.9, top-k 40, a seed per job) alternate where a
//! row mixes both. Each claim is audited by [`Engine::audit`]: one
//! teacher-forced pass and the decision rule of `engine/audit.rs`. Rows:
//! - honest, greedy, generated at 1 thread (a child process, so it has its
//!   own thread pool) and at the auditor's thread count;
//! - honest, sampled at temperature 0.7;
//! - (a) random token ids claimed as the output;
//! - (b) the output of a random-weight model of SmolLM2's shape and
//!   tokenizer (written to a temporary GGUF by this bench);
//! - (c) an honest output cut short and claimed as finished (`eos`);
//! - (d) a greedy job answered by sampling at temperature 1.0.
//!
//! Then each claim's audit as the coordinator runs it, in fleets of eight
//! auditors (each its own operator): auditors drawn one after another by
//! the coordinator's own [`audit::draw`] (a `StdRng` seeded per audit, as
//! `dispatch::audit` seeds it) and their verdicts settled by its own
//! [`audit::decide`] (a first pass settles; a failure needs a second
//! failing verdict; a split goes to a third). An honest auditor's verdict
//! is this engine's verdict on the claim; a liar fails every claim (to
//! void honest pay and ban honest nodes); a colluder passes every claim (to
//! cover a cheater). The draw is weighted by reputation: every honest
//! auditor is long established (weight 1 + `reputation_cap`). Fleets: 8
//! honest; 7 honest and 1 liar; 6 honest and 2 liars; 7 honest and 1
//! colluder, their hostile nodes as reputable as the honest ones (the
//! worst case: they served honestly until established, then turned); 6
//! honest and 2 liars on probation (new keys: weight 0, never drawn); 7
//! honest and 1 colluder just off probation (weight 2). A liar's or colluder's record is never
//! banned here (every audit starts from the same fleet), so the adversarial
//! columns are per audit, before the minority counts ban them.
//!
//! Then the cost: audit time / generation time per job (the same work a
//! node is paid for), times the honest audit runs each audit took in each
//! fleet, times the coordinator's audit rates (`coordinator/src/audit.rs`:
//! new nodes, and the floor an established clean node decays to): the
//! share of served compute spent on audits.
//!
//! Settings (environment, optional): `MLXNET_BENCH_MODEL` (GGUF path,
//! default `models/SmolLM2-135M-Instruct.Q4_1.gguf` in the workspace),
//! `MLXNET_AUDIT_JOBS` (jobs per row, default 200).

#![allow(
    clippy::expect_used,
    reason = "a bench binary: a failed step ends the run"
)]

use std::io::{BufRead, Write};
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use anyhow::{bail, Context};
use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use ed25519_dalek::SigningKey;
use mlx_node::engine::{
    audit::{ClaimFacts, Verdict},
    AuditRequest, ChatTurn, Engine, GenerateRequest, Generation, PromptInput, Sampling,
};
use mlx_node::test_utils::{setting, workspace};
use mlxnet_coordinator::audit::{self, Candidate, Decision};
use mlxnet_proto::ids::NodeId;
use rand::{rngs::StdRng, Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::{json, Value};

/// Generated tokens per job: short, so the whole bench runs in minutes.
const MAX_TOKENS: usize = 16;
/// Jobs generated then audited back to back for the cost figure.
const COST_JOBS: usize = 40;

/// The i-th question: subjects x forms, short answers first.
fn question(i: usize) -> String {
    const SUBJECTS: [&str; 40] = [
        "France",
        "the Moon",
        "water",
        "Python",
        "a volcano",
        "the heart",
        "gravity",
        "Japan",
        "a rainbow",
        "bread",
        "the ocean",
        "a computer",
        "music",
        "the Sun",
        "an elephant",
        "Mars",
        "coffee",
        "a bicycle",
        "snow",
        "the Internet",
        "Egypt",
        "a tiger",
        "chess",
        "electricity",
        "a tree",
        "Canada",
        "honey",
        "a river",
        "the brain",
        "salt",
        "Brazil",
        "an airplane",
        "a diamond",
        "the wind",
        "tea",
        "a spider",
        "Italy",
        "glass",
        "a cloud",
        "sugar",
    ];
    const FORMS: [&str; 5] = [
        "In one word, what colour is usually associated with {}?",
        "What is {}? Answer in one short sentence.",
        "Tell me one fact about {}.",
        "Write a short poem about {}.",
        "Explain {} to a child.",
    ];
    let subject = SUBJECTS[i % SUBJECTS.len()];
    FORMS[(i / SUBJECTS.len()) % FORMS.len()].replace("{}", subject)
}

fn input(i: usize) -> PromptInput {
    PromptInput::Chat(vec![
        ChatTurn {
            role: "system".into(),
            content: "You are a helpful assistant.".into(),
        },
        ChatTurn {
            role: "user".into(),
            content: question(i),
        },
    ])
}

fn greedy() -> Sampling {
    Sampling {
        max_tokens: MAX_TOKENS,
        ..Sampling::default()
    }
}

fn sampled(temperature: f32, seed: u64) -> Sampling {
    Sampling {
        temperature,
        top_p: 0.9,
        top_k: 40,
        seed,
        max_tokens: MAX_TOKENS,
        ..Sampling::default()
    }
}

/// What a node claims about job `i`.
#[derive(Debug, Clone)]
struct Claim {
    job: usize,
    /// The job's parameters (what the claim is audited against).
    sampling: Sampling,
    ids: Vec<u32>,
    text: String,
    finish: String,
    prompt_tokens: u32,
    /// Seconds the generation took (served compute).
    gen_s: f64,
}

impl Claim {
    fn to_json(&self) -> Value {
        json!({"job": self.job, "ids": self.ids, "text": self.text, "finish": self.finish,
               "prompt_tokens": self.prompt_tokens, "gen_s": self.gen_s})
    }

    fn from_json(v: &Value, sampling: Sampling) -> anyhow::Result<Self> {
        Ok(Claim {
            job: v["job"].as_u64().context("job")? as usize,
            sampling,
            ids: v["ids"]
                .as_array()
                .context("ids")?
                .iter()
                .filter_map(|x| x.as_u64().map(|x| x as u32))
                .collect(),
            text: v["text"].as_str().context("text")?.to_string(),
            finish: v["finish"].as_str().context("finish")?.to_string(),
            prompt_tokens: v["prompt_tokens"].as_u64().context("prompt_tokens")? as u32,
            gen_s: v["gen_s"].as_f64().context("gen_s")?,
        })
    }
}

/// Runs job `i` with `run_as` and claims it as a job with `claimed` parameters.
fn generate(engine: &mut Engine, i: usize, run_as: &Sampling, claimed: &Sampling) -> Claim {
    let request = GenerateRequest {
        input: input(i),
        sampling: run_as.clone(),
        resume: Default::default(),
    };
    let t = Instant::now();
    let g: Generation = engine
        .generate(&request, &mut |_| ControlFlow::Continue(()))
        .expect("generation");
    Claim {
        job: i,
        sampling: claimed.clone(),
        ids: g.output_token_ids,
        text: g.text,
        finish: g.finish.as_str().to_string(),
        prompt_tokens: g.prompt_tokens as u32,
        gen_s: t.elapsed().as_secs_f64(),
    }
}

/// The audit of one claim, and its time.
fn audit(engine: &mut Engine, c: &Claim) -> (Verdict, f64) {
    let req = AuditRequest {
        input: input(c.job),
        sampling: c.sampling.clone(),
        resume: Default::default(),
        output_token_ids: c.ids.clone(),
        facts: ClaimFacts {
            finish_reason: c.finish.clone(),
            prompt_tokens: c.prompt_tokens,
            completion_tokens: c.ids.len() as u32,
            output_token_ids_len: c.ids.len(),
            output_text: c.text.clone(),
        },
    };
    let t = Instant::now();
    let v = engine.audit(&req).expect("audit");
    (v, t.elapsed().as_secs_f64())
}

/// One table row: how many of its claims failed the audit.
struct Row {
    name: String,
    honest: bool,
    jobs: usize,
    failed: usize,
    /// Largest greedy gap among passing greedy claims, and largest X/limit
    /// among sampled ones (how close honest claims came to the line).
    worst_gap: f32,
    worst_ratio: f64,
    audit_s: f64,
    example: Option<String>,
    /// This engine's verdict on each claim (`true`: passed).
    verdicts: Vec<bool>,
}

fn row(name: &str, honest: bool, engine: &mut Engine, claims: &[Claim]) -> Row {
    let mut r = Row {
        name: name.to_string(),
        honest,
        jobs: claims.len(),
        failed: 0,
        worst_gap: 0.0,
        worst_ratio: 0.0,
        audit_s: 0.0,
        example: None,
        verdicts: Vec::with_capacity(claims.len()),
    };
    for c in claims {
        let (v, secs) = audit(engine, c);
        r.audit_s += secs;
        r.verdicts.push(v.passed());
        if !v.passed() {
            r.failed += 1;
            if r.example.is_none() || honest {
                r.example = Some(format!("job {}: {}", c.job, v.findings[0]));
            }
        }
        if c.sampling.temperature <= 0.0 && v.worst_gap.is_finite() {
            r.worst_gap = r.worst_gap.max(v.worst_gap);
        }
        if v.limit > 0.0 {
            r.worst_ratio = r.worst_ratio.max(v.statistic / v.limit);
        }
    }
    eprintln!("  {name}: {} of {} failed", r.failed, r.jobs);
    r
}

/// Child mode: honest greedy claims at this process's thread count, as JSON lines.
fn child_generate(model: &Path, jobs: usize) -> anyhow::Result<()> {
    let mut engine = Engine::load(model)?;
    let mut out = std::io::stdout().lock();
    for i in 0..jobs {
        let c = generate(&mut engine, i, &greedy(), &greedy());
        writeln!(out, "{}", c.to_json())?;
    }
    Ok(())
}

fn claims_at_threads(model: &Path, jobs: usize, threads: usize) -> anyhow::Result<Vec<Claim>> {
    let mut child = Command::new(std::env::current_exe()?)
        .args([
            "--child-generate",
            &model.display().to_string(),
            &jobs.to_string(),
        ])
        .env("CANDLE_NUM_THREADS", threads.to_string())
        .env("RAYON_NUM_THREADS", threads.to_string())
        .stdout(Stdio::piped())
        .spawn()
        .context("starting the generating child")?;
    let stdout = child.stdout.take().context("child stdout")?;
    let mut claims = Vec::new();
    for line in std::io::BufReader::new(stdout).lines() {
        let v: Value = serde_json::from_str(&line?)?;
        claims.push(Claim::from_json(&v, greedy())?);
    }
    if !child.wait()?.success() {
        bail!("the generating child failed");
    }
    Ok(claims)
}

/// A uniform value with standard deviation `std`.
fn noise(rng: &mut ChaCha8Rng, std: f32) -> f32 {
    (rng.gen::<f32>() * 2.0 - 1.0) * std * 3f32.sqrt()
}

/// Writes a model with `model`'s metadata (architecture, tokenizer, chat
/// template) and tensor shapes and types, but random weights.
fn write_random_model(model: &Path, out: &Path) -> anyhow::Result<()> {
    let mut f = std::fs::File::open(model)?;
    let content = gguf_file::Content::read(&mut f)?;
    let mut rng = ChaCha8Rng::seed_from_u64(42);
    let mut names: Vec<&String> = content.tensor_infos.keys().collect();
    names.sort();
    let mut tensors = Vec::with_capacity(names.len());
    for name in &names {
        let info = &content.tensor_infos[*name];
        let dims = info.shape.dims().to_vec();
        let n: usize = dims.iter().product();
        let t = if dims.len() == 1 {
            Tensor::ones(n, candle_core::DType::F32, &Device::Cpu)?
        } else {
            let data: Vec<f32> = (0..n).map(|_| noise(&mut rng, 0.05)).collect();
            Tensor::from_vec(data, dims.as_slice(), &Device::Cpu)?
        };
        let dtype = match info.ggml_dtype {
            GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16 => GgmlDType::F32,
            other => other,
        };
        tensors.push(QTensor::quantize(&t, dtype)?);
    }
    let mut meta: Vec<(&str, &gguf_file::Value)> = content
        .metadata
        .iter()
        .map(|(k, v)| (k.as_str(), v))
        .collect();
    meta.sort_by_key(|(k, _)| *k);
    let refs: Vec<(&str, &QTensor)> = names
        .iter()
        .map(|n| n.as_str())
        .zip(tensors.iter())
        .collect();
    let mut w = std::io::BufWriter::new(std::fs::File::create(out)?);
    gguf_file::write(&mut w, &meta, &refs)?;
    w.flush()?;
    Ok(())
}

/// How an auditor in a fleet answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Auditor {
    /// Runs the audit: its verdict is this engine's.
    Honest,
    /// Fails every claim (to void honest pay and ban honest nodes).
    Liar,
    /// Passes every claim (to cover a cheater).
    Colluder,
}

/// A fleet of auditors as the coordinator sees them: each an able
/// [`Candidate`] with an operator of its own.
struct Fleet {
    name: &'static str,
    candidates: Vec<Candidate>,
    kinds: Vec<(NodeId, Auditor)>,
}

/// A node id from a fixed seed (a valid ed25519 key).
fn node_id(seed: u8) -> NodeId {
    NodeId::from_key(&SigningKey::from_bytes(&[seed; 32]).verifying_key())
}

/// The node whose claims are audited, and its operator.
const AUDITED: u8 = 0;
const AUDITED_OPERATOR: &str = "operator-audited";

/// The draw weight of a long-established honest auditor (clean audits at
/// the coordinator's default `reputation_cap`).
fn established() -> u32 {
    1 + audit::AuditConfig::default().reputation_cap
}

/// A fleet of `honest` established auditors and `liars` and `colluders`
/// whose draw weight is `hostile` (0: on probation, never drawn;
/// [`established`]: as reputable as the honest ones, the worst case).
fn fleet(name: &'static str, honest: usize, liars: usize, colluders: usize, hostile: u32) -> Fleet {
    let kinds: Vec<(NodeId, Auditor)> = std::iter::repeat_n(Auditor::Honest, honest)
        .chain(std::iter::repeat_n(Auditor::Liar, liars))
        .chain(std::iter::repeat_n(Auditor::Colluder, colluders))
        .enumerate()
        .map(|(i, kind)| (node_id(i as u8 + 1), kind))
        .collect();
    let candidates = kinds
        .iter()
        .enumerate()
        .map(|(i, (node, kind))| Candidate {
            node: *node,
            operator: format!("operator-{i}"),
            able: true,
            reputation: match kind {
                Auditor::Honest => established(),
                _ => hostile,
            },
        })
        .collect();
    Fleet {
        name,
        candidates,
        kinds,
    }
}

fn fleets() -> Vec<Fleet> {
    let top = established();
    vec![
        fleet("8 honest", 8, 0, 0, top),
        fleet("7 honest + 1 liar", 7, 1, 0, top),
        fleet("6 honest + 2 liars", 6, 2, 0, top),
        fleet("6 honest + 2 liars on probation", 6, 2, 0, 0),
        fleet("7 honest + 1 colluder", 7, 0, 1, top),
        fleet("7 honest + 1 colluder just off probation", 7, 0, 1, 2),
    ]
}

/// How one audit of one claim ended in a fleet.
#[derive(Default)]
struct FleetAudit {
    /// `None`: no auditor was left before it was decided (missed: paid).
    passed: Option<bool>,
    /// Verdicts given by honest auditors (each one audit's compute).
    honest_runs: usize,
    /// Auditors in the minority (counted against): honest ones, and the others.
    against_honest: usize,
    against_adversaries: usize,
}

/// Audits a claim that this engine judges `engine_passed` as the
/// coordinator does: draws distinct auditors with [`audit::draw`] (a
/// `StdRng` from `seed`) until [`audit::decide`] settles it.
fn audit_in(fleet: &Fleet, engine_passed: bool, seed: u64) -> FleetAudit {
    let mut rng = StdRng::seed_from_u64(seed);
    let audited = node_id(AUDITED);
    let (mut asked, mut verdicts, mut kinds) = (Vec::new(), Vec::new(), Vec::new());
    let mut out = FleetAudit::default();
    while let Some(auditor) = audit::draw(
        &fleet.candidates,
        &audited,
        AUDITED_OPERATOR,
        &asked,
        &mut rng,
    ) {
        let kind = fleet
            .kinds
            .iter()
            .find(|(n, _)| *n == auditor)
            .map(|(_, k)| *k)
            .expect("drawn from the fleet");
        let passed = match kind {
            Auditor::Honest => {
                out.honest_runs += 1;
                engine_passed
            }
            Auditor::Liar => false,
            Auditor::Colluder => true,
        };
        asked.push(auditor);
        verdicts.push(passed);
        kinds.push(kind);
        if let Decision::Decided { passed, against } = audit::decide(&verdicts) {
            out.passed = Some(passed);
            for i in against {
                match kinds[i] {
                    Auditor::Honest => out.against_honest += 1,
                    _ => out.against_adversaries += 1,
                }
            }
            return out;
        }
    }
    out
}

/// One claim row's audits in one fleet, summed.
#[derive(Default)]
struct FleetRow {
    audits: usize,
    failed: usize,
    missed: usize,
    honest_runs: usize,
    against_honest: usize,
    against_adversaries: usize,
}

fn fleet_row(fleet: &Fleet, fleet_index: usize, row_index: usize, verdicts: &[bool]) -> FleetRow {
    let mut r = FleetRow::default();
    for (job, &engine_passed) in verdicts.iter().enumerate() {
        // One seed per audit, as the dispatcher draws one per audit.
        let seed = ((fleet_index as u64) << 40) | ((row_index as u64) << 20) | job as u64;
        let a = audit_in(fleet, engine_passed, seed);
        r.audits += 1;
        match a.passed {
            Some(false) => r.failed += 1,
            Some(true) => {}
            None => r.missed += 1,
        }
        r.honest_runs += a.honest_runs;
        r.against_honest += a.against_honest;
        r.against_adversaries += a.against_adversaries;
    }
    r
}

/// Job `i`'s parameters in a row that alternates greedy and sampled jobs.
fn mixed(i: usize) -> Sampling {
    if i.is_multiple_of(2) {
        greedy()
    } else {
        sampled(0.7, 1000 + i as u64)
    }
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("--child-generate") {
        let model = PathBuf::from(args.get(1).context("--child-generate <model> <jobs>")?);
        let jobs = args.get(2).and_then(|j| j.parse().ok()).unwrap_or(200);
        return child_generate(&model, jobs);
    }
    let model = setting("MLXNET_BENCH_MODEL")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace().join("models/SmolLM2-135M-Instruct.Q4_1.gguf"));
    let jobs: usize = setting("MLXNET_AUDIT_JOBS")
        .and_then(|j| j.parse().ok())
        .unwrap_or(200);
    let started = Instant::now();
    let mut engine =
        Engine::load(&model).with_context(|| format!("loading {}", model.display()))?;
    let threads = candle_core::utils::get_num_threads();
    let vocab = engine.info().vocab_size as u32;
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let mut rows = Vec::new();

    eprintln!("generating: honest greedy at 1 thread (child process)");
    let honest_t1 = claims_at_threads(&model, jobs, 1)?;
    eprintln!("generating: honest greedy at {threads} threads, honest sampled");
    let honest: Vec<Claim> = (0..jobs)
        .map(|i| generate(&mut engine, i, &greedy(), &greedy()))
        .collect();
    let honest_sampled: Vec<Claim> = (0..jobs)
        .map(|i| {
            let s = sampled(0.7, 1000 + i as u64);
            generate(&mut engine, i, &s, &s)
        })
        .collect();
    eprintln!("auditing");
    rows.push(row(
        "honest, greedy, 1 thread",
        true,
        &mut engine,
        &honest_t1,
    ));
    rows.push(row(
        &format!("honest, greedy, {threads} threads"),
        true,
        &mut engine,
        &honest,
    ));
    rows.push(row(
        "honest, sampled T=0.7",
        true,
        &mut engine,
        &honest_sampled,
    ));

    // (a) random tokens, claimed as a full-length answer.
    let random: Vec<Claim> = (0..jobs)
        .map(|i| {
            let ids: Vec<u32> = (0..MAX_TOKENS).map(|_| rng.gen_range(0..vocab)).collect();
            Claim {
                job: i,
                sampling: mixed(i),
                text: engine.detokenize(&ids),
                ids,
                finish: "length".into(),
                prompt_tokens: honest[i].prompt_tokens,
                gen_s: 0.0,
            }
        })
        .collect();
    rows.push(row("(a) random tokens", false, &mut engine, &random));

    // (b) a random-weight model of the same shape and tokenizer.
    let dir = tempfile::tempdir()?;
    let fake_path = dir.path().join("random-smollm2.gguf");
    eprintln!("writing a random-weight model");
    write_random_model(&model, &fake_path)?;
    let mut fake = Engine::load(&fake_path)?;
    let other_model: Vec<Claim> = (0..jobs)
        .map(|i| {
            let s = mixed(i);
            generate(&mut fake, i, &s, &s)
        })
        .collect();
    drop(fake);
    rows.push(row(
        "(b) random-weight model",
        false,
        &mut engine,
        &other_model,
    ));

    // (c) an honest answer cut short, claimed as finished.
    let truncated: Vec<Claim> = (0..jobs)
        .map(|i| {
            let base = if i.is_multiple_of(2) {
                &honest[i]
            } else {
                &honest_sampled[i]
            };
            let mut c = base.clone();
            let n = c.ids.len().max(2);
            let keep = rng.gen_range(1..n).min(c.ids.len());
            c.ids.truncate(keep);
            c.text = engine.detokenize(&c.ids);
            c.finish = "eos".into();
            c
        })
        .collect();
    rows.push(row(
        "(c) truncated, claimed eos",
        false,
        &mut engine,
        &truncated,
    ));

    // (d) greedy claimed, sampled at a high temperature.
    let hot: Vec<Claim> = (0..jobs)
        .map(|i| {
            let run_as = Sampling {
                temperature: 1.0,
                seed: 5000 + i as u64,
                max_tokens: MAX_TOKENS,
                ..Sampling::default()
            };
            generate(&mut engine, i, &run_as, &greedy())
        })
        .collect();
    rows.push(row(
        "(d) greedy claimed, sampled T=1.0",
        false,
        &mut engine,
        &hot,
    ));

    println!();
    println!(
        "Audits of SmolLM2-135M-Instruct Q4_1 claims: {jobs} jobs per row, up to {MAX_TOKENS} \
         tokens each, auditor at {threads} threads"
    );
    println!();
    println!("| claims | jobs | failed audit | rate | goal | closest honest call | audit ms/job | example finding |");
    println!("|---|--:|--:|--:|---|---|--:|---|");
    for r in &rows {
        let rate = 100.0 * r.failed as f64 / r.jobs.max(1) as f64;
        let (what, goal) = if r.honest {
            ("accused", "<= 1%")
        } else {
            ("caught", ">= 99%")
        };
        let closest = if r.honest {
            format!("gap {:.3} / X {:.2} of limit", r.worst_gap, r.worst_ratio)
        } else {
            String::new()
        };
        println!(
            "| {} | {} | {} | {rate:.1}% {what} | {goal} | {closest} | {:.0} | {} |",
            r.name,
            r.jobs,
            r.failed,
            1000.0 * r.audit_s / r.jobs.max(1) as f64,
            r.example.clone().unwrap_or_default()
        );
    }

    // Each claim's audit through the coordinator's selection and
    // confirmation, in each fleet.
    let fleets = fleets();
    let by_fleet: Vec<Vec<FleetRow>> = fleets
        .iter()
        .enumerate()
        .map(|(f, fleet)| {
            rows.iter()
                .enumerate()
                .map(|(r, row)| fleet_row(fleet, f, r, &row.verdicts))
                .collect()
        })
        .collect();
    println!();
    println!(
        "The same claims audited as the coordinator audits them (audit::draw among 8 \
         auditors of 8 operators weighted by reputation, audit::decide: a failure needs a second; a split a third)"
    );
    println!();
    let header: Vec<&str> = fleets.iter().map(|f| f.name).collect();
    println!("| claims | goal | one auditor | {} |", header.join(" | "));
    println!("|---|---|--:|{}", "--:|".repeat(fleets.len()));
    for (r, row) in rows.iter().enumerate() {
        let (what, goal) = if row.honest {
            ("accused", "<= 1%")
        } else {
            ("caught", ">= 99%")
        };
        let pct = |n: usize, of: usize| 100.0 * n as f64 / of.max(1) as f64;
        let cells: Vec<String> = by_fleet
            .iter()
            .map(|f| {
                let c = &f[r];
                let missed = if c.missed > 0 {
                    format!(", {} missed", c.missed)
                } else {
                    String::new()
                };
                format!(
                    "{:.1}% ({}/{}){missed}",
                    pct(c.failed, c.audits),
                    c.failed,
                    c.audits
                )
            })
            .collect();
        println!(
            "| {} | {goal} | {:.1}% {what} | {} |",
            row.name,
            pct(row.failed, row.jobs),
            cells.join(" | ")
        );
    }
    println!();
    println!("| fleet | honest audit runs per audit (honest claims) | (cheating claims) | honest auditors counted against | liars/colluders counted against |");
    println!("|---|--:|--:|--:|--:|");
    // Honest audit runs per audit over the honest rows: what auditing
    // honest work costs in each fleet.
    let mut runs_per_audit = Vec::new();
    for (fleet, f) in fleets.iter().zip(&by_fleet) {
        let sum = |honest: bool, pick: fn(&FleetRow) -> usize| -> usize {
            rows.iter()
                .zip(f)
                .filter(|(row, _)| row.honest == honest)
                .map(|(_, c)| pick(c))
                .sum()
        };
        let per = |honest: bool| {
            sum(honest, |c| c.honest_runs) as f64 / sum(honest, |c| c.audits).max(1) as f64
        };
        let all = |pick: fn(&FleetRow) -> usize| sum(true, pick) + sum(false, pick);
        runs_per_audit.push((fleet.name, per(true)));
        println!(
            "| {} | {:.3} | {:.3} | {} | {} |",
            fleet.name,
            per(true),
            per(false),
            all(|c| c.against_honest),
            all(|c| c.against_adversaries)
        );
    }

    // Cost: each job generated and then audited back to back, so both see
    // the same machine load; greedy and sampled jobs alternate.
    let (mut served, mut audited) = (0.0, 0.0);
    for i in 0..COST_JOBS.min(jobs) {
        let s = mixed(i);
        let c = generate(&mut engine, i, &s, &s);
        let (_, secs) = audit(&mut engine, &c);
        served += c.gen_s;
        audited += secs;
    }
    let per_job = audited / served;
    println!();
    println!(
        "Audit cost: one audit takes {:.1}% of the compute of the job it audits \
         ({audited:.2} s of audits for {served:.2} s of generation, {} jobs measured in pairs)",
        100.0 * per_job,
        COST_JOBS.min(jobs)
    );
    println!();
    let rates = audit::AuditConfig::default();
    println!(
        "| fleet | audit rate | honest audit runs per audit | audited / served compute | goal |"
    );
    println!("|---|---|--:|--:|---|");
    for (name, runs) in &runs_per_audit {
        println!(
            "| {name} | {:.0}% (floor: established clean node, the default) | {runs:.3} | {:.2}% | <= 5% |",
            100.0 * rates.rate_floor,
            100.0 * rates.rate_floor * runs * per_job
        );
        println!(
            "| {name} | {:.0}% (new node) | {runs:.3} | {:.2}% | |",
            100.0 * rates.rate_new,
            100.0 * rates.rate_new * runs * per_job
        );
    }
    println!();
    println!("total bench time {:.0} s", started.elapsed().as_secs_f64());
    Ok(())
}
