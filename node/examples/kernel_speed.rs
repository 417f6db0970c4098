//! Kernel speed per format: GMAC/s of `QuantLinear` on random weights.
//! `cargo run --profile bench -p mlx-node --example kernel_speed -- [m] [n] [k]`
use std::sync::Arc;
use std::time::Instant;

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use mlx_node::engine::kernels::{Isa, QuantLinear};

fn main() -> anyhow::Result<()> {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let m = args.first().copied().unwrap_or(128);
    let n = args.get(1).copied().unwrap_or(2048);
    let k = args.get(2).copied().unwrap_or(2048);
    let w = Tensor::randn(0f32, 1.0, (n, k), &Device::Cpu)?;
    let x: Vec<f32> = Tensor::randn(0f32, 1.0, (m * k,), &Device::Cpu)?.to_vec1()?;
    let formats = std::env::var("FORMATS").unwrap_or_else(|_| "q4k,q6k,q8_0".into());
    for f in formats.split(',') {
        let dt = match f {
            "q4k" => GgmlDType::Q4K,
            "q5k" => GgmlDType::Q5K,
            "q6k" => GgmlDType::Q6K,
            "q8_0" => GgmlDType::Q8_0,
            "q4_0" => GgmlDType::Q4_0,
            "q5_0" => GgmlDType::Q5_0,
            _ => continue,
        };
        let q = Arc::new(QTensor::quantize(&w, dt)?);
        for &isa in Isa::available() {
            if isa == Isa::Scalar {
                continue;
            }
            let l = QuantLinear::from_qtensor(q.clone())?.with_isa(isa)?;
            let mut out = vec![0f32; m * n];
            l.forward_local(&x, m, &mut out)?;
            let reps = 5;
            let t = Instant::now();
            for _ in 0..reps {
                l.forward_local(&x, m, &mut out)?;
            }
            let s = t.elapsed().as_secs_f64() / reps as f64;
            println!(
                "{f} {isa:?} m={m} n={n} k={k}: {:.2} ms, {:.1} GMAC/s",
                s * 1e3,
                (m * n * k) as f64 / s / 1e9
            );
        }
    }
    Ok(())
}
