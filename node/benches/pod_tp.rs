//! Tensor-parallel decode speed-up: SmolLM2-135M with f32 compute (about
//! 0.5 GB of weights read per token, so one decode step takes tens of
//! milliseconds on one core), 1 rank pinned to one core against 2 ranks
//! (2 + 1 KV heads, half the feed-forward columns each) pinned to one core
//! each, as separate processes on loopback TCP.
//!
//! `cargo bench -p mlx-node --bench pod_tp` (Linux; pins with `taskset`).
//! Prints decode tokens/s of each and the ratio. Goal (issue 4): >= 1.9x.

use std::net::{SocketAddr, TcpListener};
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use mlx_node::collectives::tcp::{TcpOptions, TcpTransport};
use mlx_node::collectives::{Collective, Group, GroupOptions};
use mlx_node::engine::sharded::{Compute, PodModel, PodPlan};

const STEPS: usize = 24;

fn model_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/SmolLM2-135M-Instruct.Q4_1.gguf")
}

/// One rank: loads its shard, runs prefill + STEPS greedy steps; rank 0
/// prints the decode time per token.
fn rank_main(rank: usize, addrs: Vec<SocketAddr>) {
    let listener = TcpListener::bind(addrs[rank]).expect("bind");
    let t = TcpTransport::connect(rank, listener, &addrs, TcpOptions::default()).expect("pod");
    let mut comm = Group::new(t, GroupOptions::default());
    let path = model_path();
    let (cfg, unit) = PodModel::ffn_unit(&path).expect("model");
    let speeds = vec![1.0; addrs.len()];
    let plan = PodPlan::tensor(&cfg, unit, &speeds).expect("plan");
    let mut m = PodModel::load_gguf(&path, plan, rank, Compute::F32).expect("load");
    let prompt = [1u32, 504, 3575, 282, 4649, 314];
    m.reset(prompt.len() + STEPS + 1);
    let mut tokens = prompt.to_vec();
    let mut decode = Duration::ZERO;
    for step in 0..=STEPS {
        let start = Instant::now();
        let logits = m.forward(&tokens, &mut comm).expect("forward");
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
        comm.broadcast(bytemuck::cast_slice_mut(&mut next), 0)
            .expect("broadcast");
        if step > 0 {
            decode += start.elapsed();
        }
        tokens = vec![next[0]];
    }
    if rank == 0 {
        println!(
            "DECODE_TOKENS_PER_S {}",
            STEPS as f64 / decode.as_secs_f64()
        );
    }
}

fn run_pod(ranks: usize) -> Result<f64, String> {
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
    let children: Vec<_> = (0..ranks)
        .map(|r| {
            Command::new("taskset")
                .args(["-c", &r.to_string()])
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
    let out = String::from_utf8_lossy(&children[0].stdout);
    out.lines()
        .find_map(|l| l.strip_prefix("DECODE_TOKENS_PER_S "))
        .and_then(|v| v.trim().parse().ok())
        .ok_or_else(|| {
            format!(
                "rank 0 printed no result: {}",
                String::from_utf8_lossy(&children[0].stderr)
            )
        })
}

fn main() {
    if let (Ok(rank), Ok(addrs)) = (std::env::var("POD_TP_RANK"), std::env::var("POD_TP_ADDRS")) {
        let addrs: Vec<SocketAddr> = addrs
            .split(',')
            .map(|a| a.parse().expect("address"))
            .collect();
        rank_main(rank.parse().expect("rank"), addrs);
        return;
    }
    if !model_path().exists() {
        println!(
            "skipped: {} is missing (scripts/fetch-test-model.sh)",
            model_path().display()
        );
        return;
    }
    let one = run_pod(1);
    let two = run_pod(2);
    match (one, two) {
        (Ok(a), Ok(b)) => println!(
            "tensor parallel decode, SmolLM2-135M f32 compute, 1 core per rank: \
             1 rank {a:.1} tok/s, 2 ranks {b:.1} tok/s -> speed-up {:.2}x (goal >= 1.9x)",
            b / a
        ),
        (a, b) => println!("failed: 1 rank {a:?}, 2 ranks {b:?}"),
    }
}
