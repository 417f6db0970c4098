//! Tensor-parallel decode speed-up (issue 4, must-show 4b): decode tokens/s
//! of 2 ranks, each pinned to its own core, against 1 rank pinned to one
//! core, as separate processes on loopback TCP.
//!
//! The model is a random-weight llama written at bench time (by the engine
//! tests' GGUF writer, `src/engine/testutil.rs`) into the target dir and
//! reused by later runs: hidden 3072, 24 heads of 128 in 6 KV-head groups
//! (6 divides by 2 and by 3, so every rank gets the same share of attention),
//! feed-forward 8192, run with the production compute (`Compute::Native`).
//! One 1-rank decode step takes over 50 ms on one core; the bench prints it.
//!
//! With no settings it measures two regimes, each in its own process:
//! - **compute-bound**: Q4_K weights (candle's kernel), 5 layers. The ranks'
//!   arithmetic is what is split, so this is the figure for the goal.
//! - **memory-bound**: Q4_0 weights (our kernels, which stream the weights
//!   near the memory bus's speed), 16 layers. Here the two pinned ranks
//!   share one memory bus (two Macs have one each), so the bench also
//!   measures that bus with 1 and 2 cores: its scaling bounds this ratio.
//!
//! `cargo bench --profile dev -p mlx-node --bench pod_tp` (Linux; pins with
//! `taskset`). Settings (any one picks a single regime):
//! `MLXNET_POD_TP_DTYPE` (q4_0, q4_1, q8_0, q4_k, q6_k, f16),
//! `MLXNET_POD_TP_LAYERS=N`, `MLXNET_POD_TP_COMPUTE=f32` (dequantize at load),
//! `MLXNET_POD_TP_ROUNDS=N` (default 3), `MLXNET_POD_TP_SPIN_US`,
//! `MLXNET_POD_TP_CORES=1,0` (the core of each rank; default rank r on core r).
//!
//! Prints the 1-rank step time, decode tokens/s of each, the ratio against
//! the goal (>= 1.9x), each rank's time waiting in the collectives, the
//! all-reduce alone, the memory bus and the load average.
//!
//! Each round also runs the two shares at the same time with nothing sent
//! between them ([`Detached`]): the speed this machine gives two ranks
//! before any synchronisation. A pod steps at its slower rank, so the
//! 1-rank step over the slower of these is the most 2 ranks can reach here
//! (the "ceiling"), and the pod's speed-up over it is what the
//! synchronisation costs. And each share once more alone on the machine
//! (the other core idle, `Mode::Solo`): what the share itself costs, so
//! work every rank repeats shows apart from the host's contention.
//!
//! Every step is broken down per rank ([`mlx_node::engine::profile`]):
//! matmuls, attention, norms (and the other element-wise work), activation
//! quantization, collectives, other; each part is printed against the
//! 1-rank step's same part (50%: split cleanly; 100%: repeated by every
//! rank).
//!
//! **Pipeline prefill** (`MLXNET_POD_TP_MODE=prefill`, and last in the
//! default run): SmolLM2-135M on a 2,048-token prompt, one node (one core,
//! the engine's 256-token prefill chunks) against a 2-stage pipeline (one
//! core each, the prompt in micro-batches flowing through both stages),
//! alternating over rounds; prints both prefill times, the speed-up (goal:
//! at least 1.6x) and whether the outputs are equal (the prompt's logits bit for
//! bit, and 8 greedy tokens after it). `MLXNET_POD_PP_MICRO=N` fixes the
//! micro-batch.

#![allow(
    clippy::expect_used,
    reason = "a bench binary: a failed step ends the run"
)]

use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use candle_core::quantized::GgmlDType;
use mlx_node::collectives::tcp::{TcpOptions, TcpTransport};
use mlx_node::collectives::{all_reduce, Collective, CollectiveError, DType, Group, GroupOptions};
use mlx_node::engine::profile::{self, Breakdown, Part};
use mlx_node::engine::sharded::{Compute, PodModel, PodPlan};
use mlx_node::engine::{PromptInput, TextSide};

use mlx_node::test_utils::{self as testutil, setting, GgufTweaks, TinySpec};

const STEPS: usize = 24;
const GOAL: f64 = 1.9;

/// The weight format: `MLXNET_POD_TP_DTYPE` (q4_0, q4_1, q8_0, q4_k, q6_k, f16).
fn dtype() -> GgmlDType {
    match setting("MLXNET_POD_TP_DTYPE").as_deref() {
        Some("q4_1") => GgmlDType::Q4_1,
        Some("q8_0") => GgmlDType::Q8_0,
        Some("q4_k") => GgmlDType::Q4K,
        Some("q6_k") => GgmlDType::Q6K,
        Some("f16") => GgmlDType::F16,
        _ => GgmlDType::Q4_0,
    }
}

fn spec() -> TinySpec {
    TinySpec {
        hidden: 3072,
        layers: setting("MLXNET_POD_TP_LAYERS")
            .and_then(|l| l.parse().ok())
            .unwrap_or(16),
        heads: 24,
        kv_heads: 6,
        head_dim: 128,
        ffn: 8192,
        context: 4096,
        tied: false,
        seed: 11,
        ..TinySpec::new("llama")
    }
}

fn compute() -> Compute {
    match setting("MLXNET_POD_TP_COMPUTE").as_deref() {
        Some("f32") => Compute::F32,
        _ => Compute::Native,
    }
}

/// The random-weight model, written once into the target dir.
fn model_path() -> PathBuf {
    let s = spec();
    let dir = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| testutil::workspace().join("target"));
    dir.join(format!(
        "pod_tp-random-h{}-l{}-kv{}-ff{}-{:?}.gguf",
        s.hidden,
        s.layers,
        s.kv_heads,
        s.ffn,
        dtype()
    ))
}

fn ensure_model(path: &Path) -> Result<(), String> {
    if path.exists() {
        return Ok(());
    }
    eprintln!("writing the random-weight model to {}", path.display());
    // The workspace's target dir may not exist when the bench is built in
    // another one (CARGO_TARGET_DIR).
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    }
    let tmp = path.with_extension("tmp");
    testutil::write_gguf(&tmp, &spec(), dtype(), &GgufTweaks::default());
    std::fs::rename(&tmp, path).map_err(|e| format!("renaming {}: {e}", tmp.display()))
}

/// A collective that counts the time spent inside it (waiting for peers and
/// moving bytes): rank 0's step splits into this and compute.
struct Timed {
    inner: Box<dyn Collective>,
    spent: Duration,
}

impl Timed {
    fn time<R>(&mut self, f: impl FnOnce(&mut dyn Collective) -> R) -> R {
        let start = Instant::now();
        let r = f(self.inner.as_mut());
        self.spent += start.elapsed();
        r
    }
}

impl Collective for Timed {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn size(&self) -> usize {
        self.inner.size()
    }
    fn all_reduce_sum(&mut self, data: &mut [u8], dtype: DType) -> Result<(), CollectiveError> {
        self.time(|c| c.all_reduce_sum(data, dtype))
    }
    fn all_gather(&mut self, input: &[u8], output: &mut [u8]) -> Result<(), CollectiveError> {
        self.time(|c| c.all_gather(input, output))
    }
    fn broadcast(&mut self, data: &mut [u8], root: usize) -> Result<(), CollectiveError> {
        self.time(|c| c.broadcast(data, root))
    }
    fn send(&mut self, data: &[u8], to: usize) -> Result<(), CollectiveError> {
        self.time(|c| c.send(data, to))
    }
    fn recv(&mut self, data: &mut [u8], from: usize) -> Result<(), CollectiveError> {
        self.time(|c| c.recv(data, from))
    }
    fn barrier(&mut self) -> Result<(), CollectiveError> {
        self.time(|c| c.barrier())
    }
}

/// A collective that moves nothing: with it each rank runs its share alone,
/// never waiting, so 2 of them measure the split's compute on the shared
/// machine without the synchronisation.
struct Detached {
    rank: usize,
    size: usize,
}

impl Collective for Detached {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.size
    }
    fn all_reduce_sum(&mut self, _: &mut [u8], _: DType) -> Result<(), CollectiveError> {
        Ok(())
    }
    fn all_gather(&mut self, _: &[u8], _: &mut [u8]) -> Result<(), CollectiveError> {
        Ok(())
    }
    fn broadcast(&mut self, _: &mut [u8], _: usize) -> Result<(), CollectiveError> {
        Ok(())
    }
    fn send(&mut self, _: &[u8], _: usize) -> Result<(), CollectiveError> {
        Ok(())
    }
    fn recv(&mut self, _: &mut [u8], _: usize) -> Result<(), CollectiveError> {
        Ok(())
    }
    fn barrier(&mut self) -> Result<(), CollectiveError> {
        Ok(())
    }
}

/// One rank: loads its shard, runs prefill + STEPS greedy steps; rank 0
/// prints the decode time per token and the part spent in collectives.
fn rank_main(rank: usize, addrs: Vec<SocketAddr>) {
    // Solo: this rank's share alone in the whole machine, nobody to talk to.
    let solo = std::env::var_os("POD_TP_SOLO").is_some();
    let spin = setting("MLXNET_POD_TP_SPIN_US").and_then(|s| s.parse().ok());
    let opts = TcpOptions {
        spin: spin.map_or(TcpOptions::default().spin, Duration::from_micros),
        ..TcpOptions::default()
    };
    let mut comm = Timed {
        inner: if solo {
            Box::new(Detached {
                rank,
                size: addrs.len(),
            })
        } else {
            let listener = TcpListener::bind(addrs[rank]).expect("bind");
            let t = TcpTransport::connect(rank, listener, &addrs, opts).expect("pod");
            Box::new(Group::new(t, GroupOptions::default()))
        },
        spent: Duration::ZERO,
    };
    let path = model_path();
    let (cfg, unit) = PodModel::ffn_unit(&path).expect("model");
    let speeds = vec![1.0; addrs.len()];
    let plan = PodPlan::tensor(&cfg, unit, &speeds).expect("plan");
    let mut m = PodModel::load_gguf(&path, plan, rank, compute()).expect("load");
    let prompt = [1u32, 104, 101, 108, 108, 111];
    m.reset(prompt.len() + STEPS + 1);
    comm.barrier().expect("barrier");
    // The wire alone: all-reduces of one hidden state between these ranks.
    let mut hidden = vec![1.0f32; cfg.hidden_size];
    let mut lat: Vec<Duration> = (0..200)
        .map(|_| {
            let start = Instant::now();
            all_reduce(comm.inner.as_mut(), &mut hidden).expect("all-reduce");
            start.elapsed()
        })
        .collect();
    lat.sort();
    let mut tokens = prompt.to_vec();
    let (mut decode, mut waiting) = (Duration::ZERO, Duration::ZERO);
    let mut parts = Breakdown::default();
    let mut detached = std::env::var_os("POD_TP_DETACHED").map(|_| Detached {
        rank,
        size: addrs.len(),
    });
    for step in 0..=STEPS {
        let start = Instant::now();
        let before = comm.spent;
        profile::start();
        let logits = match &mut detached {
            Some(d) => m.forward(&tokens, d),
            None => m.forward(&tokens, &mut comm),
        }
        .expect("forward");
        let mut next = [0u32];
        if let Some(l) = logits {
            next[0] = l
                .iter()
                .enumerate()
                .fold(
                    (0, f32::NEG_INFINITY),
                    |b, (i, &v)| if v > b.1 { (i, v) } else { b },
                )
                .0 as u32;
        }
        if detached.is_none() && !solo {
            profile::time(Part::Collective, || {
                comm.broadcast(bytemuck::cast_slice_mut(&mut next), 0)
            })
            .expect("broadcast");
        } else {
            next[0] = 1 + step as u32;
        }
        let b = profile::take();
        if step > 0 {
            decode += start.elapsed();
            waiting += comm.spent - before;
            parts.add(&b);
        }
        tokens = vec![next[0]];
    }
    let per_step = |d: Duration| d.as_secs_f64() / STEPS as f64;
    println!(
        "RESULT {} {} {} {}",
        per_step(decode),
        per_step(waiting),
        lat[lat.len() / 2].as_secs_f64(),
        Part::ALL
            .iter()
            .map(|&p| per_step(parts.get(p)).to_string())
            .collect::<Vec<_>>()
            .join(" ")
    );
}

/// How the rank processes of one run relate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// A pod: every rank's collectives reach the others.
    Synced,
    /// Every rank at once, nothing sent between them (see [`Detached`]).
    Detached,
    /// Only the given rank's share, alone on the machine (the other core
    /// idle): what the share itself costs, without the host's contention.
    Solo(usize),
}

/// What one run measured, per rank, in seconds per step.
#[derive(Debug, Clone)]
struct Run {
    step: Vec<f64>,
    wait: Vec<f64>,
    /// Rank 0's all-reduce of one hidden state alone.
    wire: f64,
    /// Per rank: seconds per step in each [`Part`].
    parts: Vec<[f64; 6]>,
}

/// Per-step decode time (rank 0), each rank's time in collectives per step,
/// and the median all-reduce of one hidden state (rank 0), in seconds.
fn run_pod(ranks: usize) -> Result<Run, String> {
    spawn_ranks(ranks, Mode::Synced)
}

/// Runs `ranks` rank processes (or, solo, the one share) in `mode`.
fn spawn_ranks(ranks: usize, mode: Mode) -> Result<Run, String> {
    let (which, env): (Vec<usize>, &[(&str, &str)]) = match mode {
        Mode::Solo(r) => (vec![r], &[("POD_TP_SOLO", "1")]),
        Mode::Detached => ((0..ranks).collect(), &[("POD_TP_DETACHED", "1")]),
        Mode::Synced => ((0..ranks).collect(), &[]),
    };
    let results = spawn(ranks, &which, env)?;
    let results = results
        .iter()
        .map(|v| {
            let parts: [f64; 6] = v.get(3..9)?.try_into().ok()?;
            Some((v[0], v[1], v[2], parts))
        })
        .collect::<Option<Vec<_>>>()
        .ok_or("a rank printed a short result")?;
    Ok(Run {
        step: results.iter().map(|r| r.0).collect(),
        wait: results.iter().map(|r| r.1).collect(),
        wire: results[0].2,
        parts: results.iter().map(|r| r.3).collect(),
    })
}

/// Starts this bench again as ranks `which` of a pod of `ranks` (each
/// pinned to its core, one thread, with `env`), waits for them, and returns
/// the numbers each printed on its `RESULT` line.
fn spawn(ranks: usize, which: &[usize], env: &[(&str, &str)]) -> Result<Vec<Vec<f64>>, String> {
    let ports: Vec<SocketAddr> = (0..ranks)
        .map(|_| {
            TcpListener::bind("127.0.0.1:0")
                .and_then(|l| l.local_addr())
                .map_err(|e| e.to_string())
        })
        .collect::<Result<_, _>>()?;
    let list = ports
        .iter()
        .map(|a| a.to_string())
        .collect::<Vec<_>>()
        .join(",");
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let children: Vec<_> = which
        .iter()
        .map(|&r| {
            let mut c = Command::new("taskset");
            c.envs(env.iter().copied())
                .args(["-c", &core_of(r).to_string()])
                .arg(&exe)
                .env("POD_TP_RANK", r.to_string())
                .env("POD_TP_ADDRS", &list)
                .env("RAYON_NUM_THREADS", "1")
                .env("CANDLE_NUM_THREADS", "1")
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
        })
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("taskset: {e}"))?;
    let children: Vec<_> = children
        .into_iter()
        .map(|c| c.wait_with_output())
        .collect::<Result<_, _>>()
        .map_err(|e| format!("waiting for a rank: {e}"))?;
    children
        .iter()
        .enumerate()
        .map(|(r, c)| {
            String::from_utf8_lossy(&c.stdout)
                .lines()
                .find_map(|l| l.strip_prefix("RESULT "))
                .and_then(|v| {
                    v.split_whitespace()
                        .map(|x| x.parse::<f64>().ok())
                        .collect::<Option<Vec<f64>>>()
                })
                .ok_or_else(|| {
                    format!(
                        "rank {r} printed no result: {}",
                        String::from_utf8_lossy(&c.stderr)
                    )
                })
        })
        .collect()
}

// ---- pipeline prefill ----

/// Prompt tokens of the pipeline-prefill run, and greedy tokens after it.
const PREFILL_TOKENS: usize = 2048;
const PREFILL_STEPS: usize = 8;
const PREFILL_GOAL: f64 = 1.6;

/// The real test model (SmolLM2-135M, 30 layers), fetched by
/// `scripts/fetch-test-model.sh`.
fn smollm() -> PathBuf {
    testutil::workspace().join("models/SmolLM2-135M-Instruct.Q4_1.gguf")
}

/// A 2,048-token prompt: the bench's 128-token text, tokenized by the
/// model's own tokenizer, repeated.
fn prefill_prompt(path: &Path) -> Vec<u32> {
    let text = std::fs::read_to_string(testutil::workspace().join("node/benches/prompt-128.txt"))
        .expect("prompt-128.txt");
    let base = TextSide::load_gguf(path)
        .expect("tokenizer")
        .prompt_tokens(&PromptInput::Text(text))
        .expect("tokens");
    base.iter().copied().cycle().take(PREFILL_TOKENS).collect()
}

/// FNV-1a over the bits of `v`, as two exact 32-bit halves.
fn fingerprint(v: &[f32]) -> (u32, u32) {
    let h = v.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, x| {
        (h ^ u64::from(x.to_bits())).wrapping_mul(0x1000_0000_01b3)
    });
    ((h >> 32) as u32, h as u32)
}

fn argmax(l: &[f32]) -> u32 {
    l.iter()
        .enumerate()
        .fold(
            (0, f32::NEG_INFINITY),
            |b, (i, &v)| if v > b.1 { (i, v) } else { b },
        )
        .0 as u32
}

/// One rank of the prefill run: a single node (a pod of 1, prefilling in
/// the engine's chunks of 256) or a pipeline stage (the whole prompt in one
/// pass, in micro-batches). Rank 0 prints the prefill time, its time in
/// collectives during it, the fingerprint of the prompt's logits and the
/// greedy tokens after it; other ranks print their prefill time.
fn prefill_main(rank: usize, addrs: Vec<SocketAddr>) {
    let n = addrs.len();
    let mut comm: Box<dyn Collective> = if n == 1 {
        Box::new(Detached { rank: 0, size: 1 })
    } else {
        let listener = TcpListener::bind(addrs[rank]).expect("bind");
        let t = TcpTransport::connect(rank, listener, &addrs, TcpOptions::default()).expect("pod");
        Box::new(Group::new(t, GroupOptions::default()))
    };
    let path = smollm();
    let (cfg, unit) = PodModel::ffn_unit(&path).expect("model");
    let plan = if n == 1 {
        PodPlan::tensor(&cfg, unit, &[1.0])
    } else {
        PodPlan::pipeline(&cfg, &vec![1.0; n])
    }
    .expect("plan");
    let mut m = PodModel::load_gguf(&path, plan, rank, Compute::Native).expect("load");
    m.set_micro_batch(setting("MLXNET_POD_PP_MICRO").and_then(|v| v.parse().ok()));
    let prompt = prefill_prompt(&path);
    m.reset(prompt.len() + PREFILL_STEPS);
    comm.barrier().expect("barrier");
    profile::start();
    let start = Instant::now();
    let mut logits = None;
    if n == 1 {
        for chunk in prompt.chunks(mlx_node::engine::PREFILL_CHUNK) {
            logits = m.forward(chunk, comm.as_mut()).expect("prefill");
        }
    } else {
        logits = m.forward(&prompt, comm.as_mut()).expect("prefill");
    }
    let prefill = start.elapsed().as_secs_f64();
    let waited = profile::take().get(Part::Collective).as_secs_f64();
    let (hi, lo) = logits.as_deref().map_or((0, 0), fingerprint);
    let mut tokens = Vec::new();
    for _ in 0..PREFILL_STEPS {
        let mut next = [logits.as_deref().map_or(0, argmax)];
        if n > 1 {
            comm.broadcast(bytemuck::cast_slice_mut(&mut next), 0)
                .expect("broadcast");
        }
        tokens.push(next[0]);
        logits = m.forward(&next, comm.as_mut()).expect("decode");
    }
    println!(
        "RESULT {prefill} {waited} {hi} {lo} {}",
        tokens
            .iter()
            .map(u32::to_string)
            .collect::<Vec<_>>()
            .join(" ")
    );
}

/// The pipeline-prefill regime: one node and a 2-stage pod alternate over
/// rounds; prints the prefill times, the speed-up and whether the outputs
/// are equal.
fn prefill_regime() {
    if !smollm().exists() {
        return println!(
            "failed: {} is missing: run scripts/fetch-test-model.sh",
            smollm().display()
        );
    }
    let rounds: usize = setting("MLXNET_POD_TP_ROUNDS")
        .and_then(|r| r.parse().ok())
        .unwrap_or(3)
        .max(1);
    let env = [("POD_TP_PREFILL", "1")];
    let load_before = loadavg();
    let mut runs = Vec::with_capacity(rounds);
    for _ in 0..rounds {
        let round = spawn(1, &[0], &env).and_then(|one| Ok((one, spawn(2, &[0, 1], &env)?)));
        match round {
            Ok(r) => runs.push(r),
            Err(e) => return println!("failed: {e}"),
        }
    }
    let load_after = loadavg();
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let one: Vec<f64> = runs.iter().map(|r| r.0[0][0]).collect();
    let two: Vec<f64> = runs.iter().map(|r| r.1[0][0]).collect();
    let secs = |v: &[f64]| {
        v.iter()
            .map(|x| format!("{x:.2}"))
            .collect::<Vec<_>>()
            .join(" ")
    };
    let (a, b) = (median(one.clone()), median(two.clone()));
    let micro = setting("MLXNET_POD_PP_MICRO").map_or_else(
        || {
            format!(
                "chosen per pass ({} for 2 stages)",
                PREFILL_TOKENS.div_ceil(16).clamp(64, 256)
            )
        },
        |m| m.to_string(),
    );
    println!(
        "pipeline prefill, SmolLM2-135M Q4_1 (30 layers, 15 per stage), {PREFILL_TOKENS}-token \
         prompt, 1 core per rank, micro-batch {micro}, median of {rounds} alternating rounds:"
    );
    println!(
        "  1 node:   {a:.2} s ({:.0} tok/s)   [rounds: {} s]",
        PREFILL_TOKENS as f64 / a,
        secs(&one)
    );
    println!(
        "  2 stages: {b:.2} s ({:.0} tok/s)   [rounds: {} s]",
        PREFILL_TOKENS as f64 / b,
        secs(&two)
    );
    for (i, r) in runs.iter().enumerate() {
        println!(
            "    round {i}: prefill done after {:.2} s on stage 0 (logits back), {:.2} s on stage 1 \
             (logits sent); stage 0 in collectives {:.2} s",
            r.1[0][0], r.1[1][0], r.1[0][1]
        );
    }
    println!(
        "  speed-up {:.2}x (goal >= {PREFILL_GOAL}x); per round: {}",
        a / b,
        one.iter()
            .zip(&two)
            .map(|(x, y)| format!("{:.2}x", x / y))
            .collect::<Vec<_>>()
            .join(" ")
    );
    // Rank 0's fingerprint of the prompt's logits and its greedy tokens.
    let outputs: Vec<&[f64]> = runs
        .iter()
        .flat_map(|r| [&r.0[0][2..], &r.1[0][2..]])
        .collect();
    let equal = outputs.windows(2).all(|w| w[0] == w[1]);
    println!(
        "  outputs equal: {} (the prompt's logits bit for bit, and the {PREFILL_STEPS} greedy \
         tokens after it: {:?})",
        if equal { "yes" } else { "NO" },
        outputs[0].get(2..).unwrap_or(&[])
    );
    println!("  load average: {load_before} before, {load_after} after");
}

/// Bytes each memory-bandwidth child streams through, per pass.
const STREAM_BYTES: usize = 512 << 20;

/// A child that reads a buffer much larger than the caches over and over
/// and prints its best read bandwidth in bytes/s.
/// A probe child (`POD_TP_STREAM`): `memory` streams a buffer and prints its
/// read bandwidth (bytes/s); `compute` runs a fixed dependent floating-point
/// chain and prints its rate (operations/s).
fn stream_main(kind: &str) {
    let mut best = f64::INFINITY;
    if kind == "compute" {
        const OPS: u64 = 100_000_000;
        for _ in 0..3 {
            let start = Instant::now();
            let mut x = 1.0f64;
            for _ in 0..OPS {
                x = std::hint::black_box(x * 1.000_000_1 + 1e-9);
            }
            std::hint::black_box(x);
            best = best.min(start.elapsed().as_secs_f64());
        }
        return println!("STREAM {}", OPS as f64 / best);
    }
    let buf: Vec<u64> = (0..STREAM_BYTES / 8).map(|i| i as u64).collect();
    let mut sink = 0u64;
    for _ in 0..8 {
        let start = Instant::now();
        sink = sink.wrapping_add(buf.iter().fold(0u64, |a, &x| a.wrapping_add(x)));
        best = best.min(start.elapsed().as_secs_f64());
    }
    std::hint::black_box(sink);
    println!("STREAM {}", STREAM_BYTES as f64 / best);
}

/// The rate of each of `cores` probe processes (`kind`: memory or compute)
/// pinned to cores 0.., running at the same time.
fn stream(cores: usize, kind: &str) -> Result<Vec<f64>, String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let children = (0..cores)
        .map(|r| {
            Command::new("taskset")
                .args(["-c", &r.to_string()])
                .arg(&exe)
                .env("POD_TP_STREAM", kind)
                .stdout(std::process::Stdio::piped())
                .spawn()
        })
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("taskset: {e}"))?;
    children
        .into_iter()
        .map(|c| {
            let out = c.wait_with_output().map_err(|e| e.to_string())?;
            String::from_utf8_lossy(&out.stdout)
                .lines()
                .find_map(|l| l.strip_prefix("STREAM "))
                .and_then(|v| v.trim().parse().ok())
                .ok_or_else(|| "a stream child printed nothing".to_string())
        })
        .collect()
}

/// The core rank `r` is pinned to: `r`, or the `r`-th entry of
/// `MLXNET_POD_TP_CORES` (e.g. `1,0`: whether a slow rank follows its core
/// or its share).
fn core_of(r: usize) -> usize {
    setting("MLXNET_POD_TP_CORES")
        .and_then(|c| c.split(',').nth(r).and_then(|c| c.trim().parse().ok()))
        .unwrap_or(r)
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "unknown".into())
}

/// Runs this bench again for each regime (every rank reads its settings
/// from the environment, so a regime is a process).
fn both_regimes() {
    let exe = match std::env::current_exe() {
        Ok(exe) => exe,
        Err(e) => return println!("failed: {e}"),
    };
    for (dtype, layers, regime) in [
        ("q4_k", "5", "compute-bound (the goal's figure)"),
        (
            "q4_0",
            "16",
            "memory-bound (bounded by the shared memory bus)",
        ),
    ] {
        println!("== {regime}");
        let status = Command::new(&exe)
            .env("MLXNET_POD_TP_DTYPE", dtype)
            .env("MLXNET_POD_TP_LAYERS", layers)
            .status();
        if let Err(e) = status {
            println!("failed: {e}");
        }
    }
    println!("== pipeline prefill");
    prefill_regime();
}

fn main() {
    if let (Ok(rank), Ok(addrs)) = (std::env::var("POD_TP_RANK"), std::env::var("POD_TP_ADDRS")) {
        let addrs: Vec<SocketAddr> = addrs
            .split(',')
            .map(|a| a.parse().expect("address"))
            .collect();
        let rank = rank.parse().expect("rank");
        if std::env::var_os("POD_TP_PREFILL").is_some() {
            prefill_main(rank, addrs);
        } else {
            rank_main(rank, addrs);
        }
        return;
    }
    if setting("MLXNET_POD_TP_MODE").as_deref() == Some("prefill") {
        prefill_regime();
        return;
    }
    if let Ok(kind) = std::env::var("POD_TP_STREAM") {
        stream_main(&kind);
        return;
    }
    if [
        "MLXNET_POD_TP_DTYPE",
        "MLXNET_POD_TP_LAYERS",
        "MLXNET_POD_TP_COMPUTE",
    ]
    .iter()
    .all(|k| setting(k).is_none())
    {
        both_regimes();
        return;
    }
    if let Err(e) = ensure_model(&model_path()) {
        println!("failed: {e}");
        return;
    }
    let s = spec();
    let what = format!(
        "random-weight llama h{} x{} layers, {} KV heads, ffn {}, {:?}, {:?} compute",
        s.hidden,
        s.layers,
        s.kv_heads,
        s.ffn,
        dtype(),
        compute()
    );
    let rounds: usize = setting("MLXNET_POD_TP_ROUNDS")
        .and_then(|r| r.parse().ok())
        .unwrap_or(3)
        .max(1);
    let load_before = loadavg();
    // 1 rank and 2 ranks alternate, so drift in the machine's load hits both.
    let mut runs: Vec<(Run, Run)> = Vec::with_capacity(rounds);
    let mut alone: Vec<Run> = Vec::with_capacity(rounds);
    let mut solo: Vec<[Run; 2]> = Vec::with_capacity(rounds);
    for _ in 0..rounds {
        let round = run_pod(1).and_then(|one| {
            let two = run_pod(2)?;
            let unsynced = spawn_ranks(2, Mode::Detached)?;
            let each = [
                spawn_ranks(2, Mode::Solo(0))?,
                spawn_ranks(2, Mode::Solo(1))?,
            ];
            Ok((one, two, unsynced, each))
        });
        match round {
            Ok((one, two, unsynced, each)) => {
                runs.push((one, two));
                alone.push(unsynced);
                solo.push(each);
            }
            Err(e) => {
                println!("failed: {e}");
                return;
            }
        }
    }
    let bus =
        stream(1, "memory").and_then(|one| Ok((one[0], stream(2, "memory")?.iter().sum::<f64>())));
    let cpu = stream(1, "compute").and_then(|one| {
        let two = stream(2, "compute")?;
        Ok((one[0], two.into_iter().fold(f64::INFINITY, f64::min)))
    });
    let load_after = loadavg();
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let a = median(runs.iter().map(|r| r.0.step[0]).collect());
    let b = median(runs.iter().map(|r| r.1.step[0]).collect());
    let ms = |v: &[f64]| {
        v.iter()
            .map(|x| format!("{:.1}", x * 1e3))
            .collect::<Vec<_>>()
            .join(" ")
    };
    println!("tensor parallel decode, {what}, 1 core per rank, {STEPS} steps, median of {rounds} alternating rounds:");
    println!(
        "  1 rank:  {:.1} ms/step ({}), {:.2} tok/s   [rounds: {} ms]",
        a * 1e3,
        if a >= 0.05 { ">= 50 ms" } else { "UNDER 50 ms" },
        1.0 / a,
        ms(&runs.iter().map(|r| r.0.step[0]).collect::<Vec<_>>())
    );
    println!(
        "  2 ranks: {:.1} ms/step, {:.2} tok/s   [rounds: {} ms]",
        b * 1e3,
        1.0 / b,
        ms(&runs.iter().map(|r| r.1.step[0]).collect::<Vec<_>>())
    );
    for (i, (_, two)) in runs.iter().enumerate() {
        println!(
            "    round {i}: in collectives per step: {} ms (rank 0, rank 1); \
             all-reduce of one hidden state alone: {:.1} us (median)",
            ms(&two.wait),
            two.wire * 1e6
        );
    }
    println!(
        "  speed-up {:.2}x (goal >= {GOAL}x); per round: {}",
        a / b,
        runs.iter()
            .map(|r| format!("{:.2}x", r.0.step[0] / r.1.step[0]))
            .collect::<Vec<_>>()
            .join(" ")
    );
    // The same two shares on the same two cores at the same time, each
    // running alone (nothing sent, nobody waited for): what this machine
    // gives two ranks before any synchronisation. The pod runs at its
    // slower rank, so the ceiling is the 1-rank step over the slower one.
    let slower: Vec<f64> = alone
        .iter()
        .map(|r| r.step.iter().copied().fold(0.0, f64::max))
        .collect();
    let ceiling = median(
        runs.iter()
            .zip(&slower)
            .map(|(r, s)| r.0.step[0] / s)
            .collect(),
    );
    // Per round: the slower rank alone against the synchronised pod.
    let kept = median(
        runs.iter()
            .zip(&slower)
            .map(|(r, s)| s / r.1.step[0])
            .collect(),
    );
    println!(
        "  2 ranks unsynchronised (each its share alone, at the same time): {} ms/step \
         (rank 0 / rank 1 per round); this machine's ceiling for 2 ranks {:.2}x; \
         synchronised, the pod keeps {:.0}% of its slower rank's speed (median of rounds)",
        alone
            .iter()
            .map(|r| ms(&r.step).replace(' ', "/"))
            .collect::<Vec<_>>()
            .join(" "),
        ceiling,
        kept * 100.0
    );
    // Each share as a fraction of the whole step, per round: at the same
    // time (the host's contention included) and alone (the share itself).
    let pct = |share: f64, whole: f64| format!("{:.1}%", share / whole * 100.0);
    for r in 0..2 {
        let together: Vec<String> = runs
            .iter()
            .zip(&alone)
            .map(|(one, a)| pct(a.step[r], one.0.step[0]))
            .collect();
        let by_itself: Vec<String> = runs
            .iter()
            .zip(&solo)
            .map(|(one, s)| pct(s[r].step[0], one.0.step[0]))
            .collect();
        println!(
            "  rank {r}'s share of the 1-rank step (goal <= 51.5%): both ranks at once {} \
             (median {}); alone on the machine {} (median {})",
            together.join(" "),
            pct(median(alone.iter().map(|a| a.step[r]).collect()), a),
            by_itself.join(" "),
            pct(median(solo.iter().map(|s| s[r].step[0]).collect()), a),
        );
    }
    // Where a step goes, per rank: mean over rounds, ms per step, and each
    // part against the 1-rank step's (50% is a clean split; 100% is work
    // every rank repeats).
    let mean_parts = |pick: &dyn Fn(usize) -> [f64; 6]| -> [f64; 6] {
        let mut m = [0.0; 6];
        for i in 0..rounds {
            for (a, b) in m.iter_mut().zip(pick(i)) {
                *a += b / rounds as f64;
            }
        }
        m
    };
    let whole = mean_parts(&|i| runs[i].0.parts[0]);
    let rows: Vec<(String, [f64; 6])> = vec![
        ("1 rank".into(), whole),
        ("pod rank 0".into(), mean_parts(&|i| runs[i].1.parts[0])),
        ("pod rank 1".into(), mean_parts(&|i| runs[i].1.parts[1])),
        ("rank 0 alone".into(), mean_parts(&|i| solo[i][0].parts[0])),
        ("rank 1 alone".into(), mean_parts(&|i| solo[i][1].parts[0])),
    ];
    println!(
        "  where a step goes (ms per step, mean of rounds; in brackets: against the 1-rank step's part):"
    );
    println!(
        "    {:<13} {}",
        "",
        Part::ALL
            .iter()
            .map(|p| format!("{:>20}", p.name()))
            .collect::<String>()
    );
    for (name, parts) in rows {
        let cells: String = parts
            .iter()
            .zip(whole)
            .map(|(x, w)| {
                let share = if w > 0.0 {
                    format!("({:.0}%)", x / w * 100.0)
                } else {
                    String::new()
                };
                format!("{:>13.2} {:>6}", x * 1e3, share)
            })
            .collect();
        println!(
            "    {name:<13} {cells}   total {:.2}",
            parts.iter().sum::<f64>() * 1e3
        );
    }
    match bus {
        Ok((one, two)) => println!(
            "  memory read bandwidth, same machine: 1 core {:.1} GB/s, 2 cores {:.1} GB/s \
             together ({:.2}x); 1-rank decode reads weights at {:.1} GB/s",
            one / 1e9,
            two / 1e9,
            two / one,
            std::fs::metadata(model_path()).map_or(0.0, |m| m.len() as f64) / a / 1e9
        ),
        Err(e) => println!("  memory bandwidth: not measured: {e}"),
    }
    match cpu {
        Ok((one, slower)) => println!(
            "  arithmetic, same machine: with both cores busy the slower runs at {:.0}% of one \
             core alone, so 2 ranks can be at most {:.2}x here",
            slower / one * 100.0,
            2.0 * slower / one
        ),
        Err(e) => println!("  arithmetic scaling: not measured: {e}"),
    }
    println!("  load average: {load_before} before, {load_after} after");
}
