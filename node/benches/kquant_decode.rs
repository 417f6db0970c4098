//! K-quant decode microbenchmark: one activation row against weight matrices
//! the size of a 1B-class Llama's (`Q4_K`: attention 2048x2048, feed-forward
//! 8192x2048 and 2048x8192; `Q6_K`: the same `ffn_down` and a 49,152-token
//! output head), on every instruction set this CPU runs, with the paired
//! 16-row kernel (the prefill kernel, which decode used before) beside the
//! single-row decode kernel, measured in the same run.
//!
//! `cargo bench -p mlx-node --bench kquant_decode`
//!
//! Prints, per matrix and path, the fastest time of one product over rounds
//! that alternate between the two kernels (so both see the same load), the
//! weight bytes read per second, and the ratio paired / single-row (above
//! 1.00x: the decode kernel is faster). Nothing is asserted: the numbers are
//! only as steady as the machine. With `-- --engine <gguf>` it also decodes
//! 32 tokens of that model on one thread and prints where the time went
//! (`engine::profile`).
//!
//! Settings (environment): `MLXNET_BENCH_ROUNDS` (rounds per kernel, default 30).

use std::ops::ControlFlow;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use candle_core::quantized::{ggml_file, GgmlDType};
use candle_core::Device;
use mlx_node::engine::kernels::{DecodePath, Isa, QuantLinear, Scratch};
use mlx_node::engine::profile::{self, Part};
use mlx_node::engine::{Engine, GenerateRequest, PromptInput, Resume, Sampling};
use mlx_node::test_utils::setting;
use rand::{Rng, SeedableRng};

/// Random GGUF blocks with sane f16 scales (the quants are random bytes).
fn random_blocks(rng: &mut rand::rngs::StdRng, dtype: GgmlDType, n: usize, k: usize) -> Vec<u8> {
    let (bytes, scale_at): (usize, &[usize]) = match dtype {
        GgmlDType::Q4K => (144, &[0, 2]),
        GgmlDType::Q6K => (210, &[208]),
        _ => unreachable!("only K-quants here"),
    };
    let blocks = n * k / 256;
    let mut out: Vec<u8> = (0..blocks * bytes).map(|_| rng.gen()).collect();
    for b in out.chunks_exact_mut(bytes) {
        for &at in scale_at {
            let d = half::f16::from_f32(rng.gen_range(0.0001f32..0.002));
            b[at..at + 2].copy_from_slice(&d.to_bits().to_le_bytes());
        }
    }
    out
}

/// Fastest time of one product of `a`, and of `b`, with one activation
/// row: rounds alternate between the two so that both see the same load,
/// and the minimum is the figure least disturbed by other processes.
fn time_pair(
    a: &QuantLinear,
    b: &QuantLinear,
    x: &[f32],
    out: &mut [f32],
) -> anyhow::Result<[Duration; 2]> {
    let mut scratch = Scratch::new();
    let mut once = |l: &QuantLinear| l.forward_slice(x, 1, out, &mut scratch);
    for _ in 0..3 {
        once(a)?;
        once(b)?;
    }
    // Repetitions per round: about 2 ms of work.
    let t = Instant::now();
    once(a)?;
    let reps = (2e-3 / t.elapsed().as_secs_f64().max(1e-7)).clamp(1.0, 200.0) as u32;
    let rounds: u32 = setting("MLXNET_BENCH_ROUNDS")
        .and_then(|r| r.parse().ok())
        .unwrap_or(30);
    let mut best = [Duration::MAX; 2];
    for _ in 0..rounds {
        for (i, l) in [a, b].into_iter().enumerate() {
            let t = Instant::now();
            for _ in 0..reps {
                once(l)?;
            }
            best[i] = best[i].min(t.elapsed() / reps);
        }
    }
    Ok(best)
}

fn matrices() -> anyhow::Result<()> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(18);
    let shapes = [
        ("attn_q Q4_K", GgmlDType::Q4K, 2048, 2048),
        ("ffn_up Q4_K", GgmlDType::Q4K, 8192, 2048),
        ("ffn_down Q4_K", GgmlDType::Q4K, 2048, 8192),
        ("ffn_down Q6_K", GgmlDType::Q6K, 2048, 8192),
        ("output Q6_K", GgmlDType::Q6K, 49152, 2048),
        // Larger than this machine's 32 MiB L3: streamed from memory, as
        // in a real decode step (the ones above stay in cache between products).
        ("6x ffn_up Q4_K", GgmlDType::Q4K, 49152, 2048),
    ];
    println!(
        "one activation row, {} thread(s), fastest of alternating rounds",
        mlx_node::engine::kernels::pool_threads()
    );
    println!("| matrix | isa | paired (old) | GB/s | single-row | GB/s | ratio |");
    println!("|:--|:--|--:|--:|--:|--:|--:|");
    for (name, dtype, n, k) in shapes {
        let bytes = random_blocks(&mut rng, dtype, n, k);
        let qt = ggml_file::qtensor_from_ggml(dtype, &bytes, vec![n, k], &Device::Cpu)?;
        let base = QuantLinear::from_qtensor(Arc::new(qt))?;
        let x: Vec<f32> = (0..k).map(|_| rng.gen_range(-1.0f32..1.0)).collect();
        let mut out = vec![0f32; n];
        for &isa in Isa::available().iter().filter(|i| **i != Isa::Scalar) {
            let l = base.clone().with_isa(isa)?;
            let [old, new] = time_pair(
                &l.clone().with_decode_path(DecodePath::Paired),
                &l.with_decode_path(DecodePath::SingleRow),
                &x,
                &mut out,
            )?;
            let gbs = |t: Duration| bytes.len() as f64 / t.as_secs_f64() / 1e9;
            println!(
                "| {name} | {isa:?} | {:.0} us | {:.1} | {:.0} us | {:.1} | {:.2}x |",
                old.as_secs_f64() * 1e6,
                gbs(old),
                new.as_secs_f64() * 1e6,
                gbs(new),
                old.as_secs_f64() / new.as_secs_f64()
            );
        }
    }
    Ok(())
}

/// Decodes 32 tokens of `model` after a short prompt and prints where the time went.
fn engine(model: PathBuf) -> anyhow::Result<()> {
    let mut engine =
        Engine::load(&model).with_context(|| format!("loading {}", model.display()))?;
    let request = GenerateRequest {
        input: PromptInput::Text("Hello".into()),
        sampling: Sampling {
            max_tokens: 32,
            ..Sampling::default()
        },
        resume: Resume::default(),
    };
    let noop = &mut |_: &_| ControlFlow::Continue(());
    engine.generate(&request, noop)?;
    profile::start();
    let t = Instant::now();
    let g = engine.generate(&request, noop)?;
    let wall = t.elapsed();
    let b = profile::take();
    println!(
        "{}: {} tokens in {:.0} ms (decode {:.1} tok/s); calling thread's time:",
        model.display(),
        g.output_token_ids.len(),
        wall.as_secs_f64() * 1e3,
        g.output_token_ids.len().saturating_sub(1) as f64 / g.decode.as_secs_f64()
    );
    for part in Part::ALL {
        println!(
            "  {:>12}: {:7.1} ms",
            part.name(),
            b.get(part).as_secs_f64() * 1e3
        );
    }
    Ok(())
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let Some(i) = args.iter().position(|a| a == "--engine") {
        let model = args.get(i + 1).context("--engine <gguf>")?;
        return engine(PathBuf::from(model));
    }
    matrices()
}
