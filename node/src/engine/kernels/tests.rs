//! Every instruction-set path against the scalar reference, the reference against
//! a plain f32 product, and `QuantLinear` against candle's own quantized matmul.
//!
//! Which SIMD paths a test must run comes from the CPU's own report
//! (`/proc/cpuinfo` on Linux; on aarch64 NEON is baseline), not from
//! [`Isa::available`]: a detection bug that hides a path fails the test
//! instead of silently skipping that path.

use super::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const FORMATS: [QuantFormat; 3] = [QuantFormat::Q4_0, QuantFormat::Q4_1, QuantFormat::Q8_0];

/// Random GGUF blocks for an `n x k` matrix: small positive scales, signed
/// minimums, every quant value (including -128 for `Q8_0`).
fn random_weights(rng: &mut StdRng, format: QuantFormat, n: usize, k: usize) -> Vec<u8> {
    let blocks = n * k / BLOCK;
    let mut bytes = Vec::with_capacity(blocks * format.block_bytes());
    for _ in 0..blocks {
        let d = half::f16::from_f32(rng.gen_range(0.001f32..0.05));
        bytes.extend_from_slice(&d.to_bits().to_le_bytes());
        if format == QuantFormat::Q4_1 {
            let m = half::f16::from_f32(rng.gen_range(-0.4f32..0.1));
            bytes.extend_from_slice(&m.to_bits().to_le_bytes());
        }
        let quants = if format == QuantFormat::Q8_0 { 32 } else { 16 };
        for _ in 0..quants {
            bytes.push(rng.gen());
        }
    }
    bytes
}

fn random_acts(rng: &mut StdRng, len: usize) -> Vec<f32> {
    (0..len).map(|_| rng.gen_range(-2.0f32..2.0)).collect()
}

/// A bound on f32 rounding for each output: the sum of the magnitudes of its terms.
fn magnitudes(w: &QuantMatrix<'_>, scratch: &Scratch) -> Vec<f32> {
    let (m, n, k) = (scratch.rows, w.n, w.k);
    let kb = k / BLOCK;
    let bb = w.format.block_bytes();
    let s = match w.format {
        QuantFormat::Q4_0 => &scratch.sx,
        QuantFormat::Q4_1 => &scratch.s81,
        QuantFormat::Q8_0 => &scratch.sx,
    };
    let mut out = vec![0f32; m * n];
    for a in 0..m {
        for r in 0..n {
            let mut sum = 0f32;
            for b in 0..kb {
                let off = r * w.row_bytes() + b * bb;
                let x = &scratch.qs[a * k + b * BLOCK..a * k + (b + 1) * BLOCK];
                let (dot, d, mw) = scalar::block_dot(w.format, &w.bytes[off..off + bb], x);
                sum += (d * scratch.d[a * kb + b] * dot as f32).abs() + (mw * s[a * kb + b]).abs();
            }
            out[a * n + r] = sum;
        }
    }
    out
}

/// Every output within f32 rounding of the scalar reference: `1e-5` of the
/// sum of its terms' magnitudes (`mags`), plus `1e-6`.
fn assert_within_rounding(got: &[f32], reference: &[f32], mags: &[f32], what: &str) {
    for (i, ((g, r), mag)) in got.iter().zip(reference).zip(mags).enumerate() {
        let tol = 1e-5 * mag + 1e-6;
        assert!(
            (g - r).abs() <= tol,
            "{what} out[{i}]: {g} vs scalar {r} (tol {tol})"
        );
    }
    assert_eq!(got.len(), reference.len(), "{what}: output length");
}

fn product(w: &QuantMatrix<'_>, scratch: &mut Scratch, isa: Isa) -> Vec<f32> {
    let mut out = vec![f32::NAN; scratch.rows * w.n];
    matmul(w, scratch, &mut out, isa).expect("matmul");
    out
}

/// The SIMD paths this CPU reports it can run, from the operating system's
/// report rather than from [`Isa::available`] (which is under test).
fn cpu_reported_isas() -> Vec<Isa> {
    #[cfg(target_arch = "x86_64")]
    {
        let flags = cpu_flags();
        let has = |f: &str| flags.iter().any(|x| x == f);
        let mut isas = Vec::new();
        if has("avx2") && has("fma") && has("f16c") {
            isas.push(Isa::Avx2);
            if has("avx512f") && has("avx512vl") && has("avx512_vnni") {
                isas.push(Isa::Avx512Vnni);
            }
        }
        isas
    }
    #[cfg(target_arch = "aarch64")]
    {
        // Advanced SIMD is part of every aarch64 target.
        vec![Isa::Neon]
    }
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    {
        Vec::new()
    }
}

/// The CPU flags Linux reports (`/proc/cpuinfo`); elsewhere, the ones the
/// standard library detects, under Linux's names.
#[cfg(target_arch = "x86_64")]
fn cpu_flags() -> Vec<String> {
    if let Ok(info) = std::fs::read_to_string("/proc/cpuinfo") {
        if let Some(line) = info.lines().find(|l| l.starts_with("flags")) {
            return line
                .split(':')
                .nth(1)
                .unwrap_or("")
                .split_whitespace()
                .map(str::to_owned)
                .collect();
        }
    }
    let mut flags = Vec::new();
    macro_rules! probe {
        ($($f:tt => $name:expr),*) => {
            $(if std::arch::is_x86_feature_detected!($f) { flags.push($name.to_owned()); })*
        };
    }
    probe!("avx2" => "avx2", "fma" => "fma", "f16c" => "f16c", "avx512f" => "avx512f",
        "avx512vl" => "avx512vl", "avx512vnni" => "avx512_vnni");
    flags
}

/// The SIMD paths a test must exercise: every one the CPU reports, and
/// [`Isa::available`] must offer exactly those (after `Scalar`).
fn simd_paths() -> Vec<Isa> {
    let reported = cpu_reported_isas();
    let offered: Vec<Isa> = Isa::available()
        .iter()
        .copied()
        .filter(|&i| i != Isa::Scalar)
        .collect();
    eprintln!("SIMD paths the CPU reports: {reported:?}; offered: {offered:?}");
    assert_eq!(
        offered, reported,
        "the kernels offer other SIMD paths than the CPU reports"
    );
    reported
}

/// Fails unless every path the CPU reports ran `expected` times.
fn assert_every_path_ran(ran: &std::collections::HashMap<Isa, usize>, expected: usize) {
    let paths = simd_paths();
    for isa in &paths {
        assert_eq!(
            ran.get(isa).copied().unwrap_or(0),
            expected,
            "{isa:?}: the CPU reports it, but it did not run every case"
        );
    }
    assert_eq!(ran.len(), paths.len(), "paths run: {ran:?}");
    eprintln!("SIMD paths exercised against the scalar reference: {ran:?}");
}

#[test]
fn every_available_isa_matches_the_scalar_reference() {
    let mut rng = StdRng::seed_from_u64(7);
    let paths = simd_paths();
    let mut ran = std::collections::HashMap::new();
    let mut cases = 0;
    for format in FORMATS {
        // k not divisible by 256 (576, 1536 = SmolLM2's), odd row counts for the
        // tile tails, and both split modes (m < 8 by weight rows, m >= 8 by activations).
        for &(n, k) in &[(13usize, 576usize), (9, 1536), (5, 64), (64, 576)] {
            let bytes = random_weights(&mut rng, format, n, k);
            let w = QuantMatrix::new(format, n, k, &bytes).expect("valid matrix");
            for &m in &[1usize, 3, 9, 13] {
                let x = random_acts(&mut rng, m * k);
                let mut scratch = Scratch::new();
                scratch.quantize(&x, m, k).expect("quantize");
                let reference = product(&w, &mut scratch, Isa::Scalar);
                let mags = magnitudes(&w, &scratch);
                cases += 1;
                for &isa in &paths {
                    let got = product(&w, &mut scratch, isa);
                    assert_within_rounding(
                        &got,
                        &reference,
                        &mags,
                        &format!("{isa:?} {format:?} n={n} k={k} m={m}"),
                    );
                    *ran.entry(isa).or_insert(0) += 1;
                }
            }
        }
    }
    // Every format, shape and row count ran on every path the CPU reports.
    assert_every_path_ran(&ran, cases);
}

#[cfg(target_arch = "x86_64")]
#[test]
fn repacked_weights_match_the_row_major_reference_on_every_isa() {
    let mut rng = StdRng::seed_from_u64(11);
    let paths = simd_paths();
    let mut ran = std::collections::HashMap::new();
    let mut cases = 0;
    for format in FORMATS {
        // One group, several groups, SmolLM2's k; activation rows that cover the
        // 4-row tiles, their tails and the transposed output of m > 1.
        for &(n, k) in &[(8usize, 32usize), (24, 576), (16, 1536)] {
            let bytes = random_weights(&mut rng, format, n, k);
            let w = QuantMatrix::new(format, n, k, &bytes).expect("valid matrix");
            let p = packed::Packed::new(&w)
                .expect("packs")
                .expect("n is a multiple of 8");
            assert_eq!(p.bytes.len(), bytes.len(), "repacking keeps the size");
            for &m in &[1usize, 2, 5, 9] {
                let x = random_acts(&mut rng, m * k);
                let mut scratch = Scratch::new();
                scratch.quantize(&x, m, k).expect("quantize");
                let reference = product(&w, &mut scratch, Isa::Scalar);
                let mags = magnitudes(&w, &scratch);
                cases += 1;
                // The scalar path reads the packed layout too.
                for &isa in std::iter::once(&Isa::Scalar).chain(&paths) {
                    let mut got = vec![f32::NAN; m * n];
                    matmul_packed(&p, &mut scratch, &mut got, isa).expect("packed matmul");
                    assert_within_rounding(
                        &got,
                        &reference,
                        &mags,
                        &format!("packed {isa:?} {format:?} n={n} k={k} m={m}"),
                    );
                    *ran.entry(isa).or_insert(0) += 1;
                }
            }
        }
    }
    assert_eq!(ran.remove(&Isa::Scalar), Some(cases), "packed scalar path");
    assert_every_path_ran(&ran, cases);
    // Rows not in groups of 8 keep the row-major layout.
    let bytes = random_weights(&mut rng, QuantFormat::Q4_1, 12, 64);
    let w = QuantMatrix::new(QuantFormat::Q4_1, 12, 64, &bytes).expect("valid matrix");
    assert!(packed::Packed::new(&w).expect("checks").is_none());
}

/// Dequantizes the blocks to f32 (ggml's definitions), for the float reference.
fn dequantize(format: QuantFormat, bytes: &[u8]) -> Vec<f32> {
    let mut out = Vec::new();
    for blk in bytes.chunks_exact(format.block_bytes()) {
        let d = scalar::f16_at(blk, 0);
        match format {
            QuantFormat::Q4_0 | QuantFormat::Q4_1 => {
                let (m, qs) = if format == QuantFormat::Q4_0 {
                    (-8.0 * d, &blk[2..18])
                } else {
                    (scalar::f16_at(blk, 2), &blk[4..20])
                };
                let lo = qs.iter().map(|q| d * f32::from(q & 0x0f) + m);
                let hi = qs.iter().map(|q| d * f32::from(q >> 4) + m);
                out.extend(lo.collect::<Vec<_>>());
                out.extend(hi.collect::<Vec<_>>());
            }
            QuantFormat::Q8_0 => out.extend(blk[2..34].iter().map(|&q| d * f32::from(q as i8))),
        }
    }
    out
}

#[test]
fn the_reference_is_close_to_the_float_product() {
    let mut rng = StdRng::seed_from_u64(11);
    let (n, k, m) = (7, 576, 2);
    for format in FORMATS {
        let bytes = random_weights(&mut rng, format, n, k);
        let w = QuantMatrix::new(format, n, k, &bytes).expect("valid matrix");
        let wf = dequantize(format, &bytes);
        let x = random_acts(&mut rng, m * k);
        let mut scratch = Scratch::new();
        scratch.quantize(&x, m, k).expect("quantize");
        let got = product(&w, &mut scratch, Isa::Scalar);
        for a in 0..m {
            for r in 0..n {
                let row = &wf[r * k..(r + 1) * k];
                let exact: f32 = row
                    .iter()
                    .zip(&x[a * k..(a + 1) * k])
                    .map(|(w, x)| w * x)
                    .sum();
                let scale: f32 = row
                    .iter()
                    .zip(&x[a * k..(a + 1) * k])
                    .map(|(w, x)| (w * x).abs())
                    .sum();
                // 8-bit activations: about 1/254 relative error per value, mostly cancelling.
                assert!(
                    (got[a * n + r] - exact).abs() <= 0.01 * scale,
                    "{format:?} out[{a},{r}]: {} vs float {exact} (scale {scale})",
                    got[a * n + r]
                );
            }
        }
    }
}

#[test]
fn quant_linear_matches_candles_quantized_matmul() {
    use candle_core::quantized::QMatMul;
    use candle_core::Module;
    let mut rng = StdRng::seed_from_u64(3);
    let (n, k) = (40, 576);
    for (dtype, format) in [
        (GgmlDType::Q4_0, QuantFormat::Q4_0),
        (GgmlDType::Q4_1, QuantFormat::Q4_1),
        (GgmlDType::Q8_0, QuantFormat::Q8_0),
    ] {
        let wf = Tensor::from_vec(random_acts(&mut rng, n * k), (n, k), &Device::Cpu).expect("w");
        let qt = Arc::new(QTensor::quantize(&wf, dtype).expect("quantize weights"));
        let ours = QuantLinear::from_qtensor(qt.clone()).expect("supported");
        assert_eq!(ours.format(), format);
        let theirs = QMatMul::from_arc(qt).expect("qmatmul");
        for rows in [1usize, 16] {
            let x = Tensor::from_vec(random_acts(&mut rng, rows * k), (1, rows, k), &Device::Cpu)
                .expect("x");
            let a = ours.forward(&x).expect("ours");
            let b = theirs.forward(&x).expect("candle");
            assert_eq!(a.dims(), &[1, rows, n]);
            let a: Vec<f32> = a.flatten_all().and_then(|t| t.to_vec1()).expect("a");
            let b: Vec<f32> = b.flatten_all().and_then(|t| t.to_vec1()).expect("b");
            let scale = b.iter().fold(0f32, |m, v| m.max(v.abs()));
            for (i, (x, y)) in a.iter().zip(&b).enumerate() {
                assert!(
                    (x - y).abs() <= 2e-3 * scale,
                    "{dtype:?} rows={rows} out[{i}]: {x} vs candle {y}"
                );
            }
        }
    }
}

#[test]
fn bad_inputs_are_typed_errors() {
    let bytes = vec![0u8; 3 * 2 * 20];
    assert!(matches!(
        QuantMatrix::new(QuantFormat::Q4_1, 3, 64, &bytes[1..]),
        Err(KernelError::ByteLength {
            expected: 120,
            got: 119,
            ..
        })
    ));
    assert!(matches!(
        QuantMatrix::new(QuantFormat::Q4_1, 3, 60, &bytes),
        Err(KernelError::RowNotBlocks { k: 60 })
    ));
    let w = QuantMatrix::new(QuantFormat::Q4_1, 3, 64, &bytes).expect("valid");
    let mut scratch = Scratch::new();
    scratch.quantize(&[0.5; 64 * 2], 2, 64).expect("quantize");
    let mut short = vec![0f32; 5];
    assert!(matches!(
        matmul(&w, &mut scratch, &mut short, Isa::detect()),
        Err(KernelError::Shape { .. })
    ));
    let k4 = Tensor::zeros((8, 256), DType::F32, &Device::Cpu).expect("zeros");
    let qk = QTensor::quantize(&k4, GgmlDType::Q4K).expect("q4k");
    assert!(matches!(
        QuantLinear::from_qtensor(Arc::new(qk)),
        Err(KernelError::UnsupportedFormat(_))
    ));
    let data: Arc<dyn AsRef<[u8]> + Send + Sync> = Arc::new(bytes);
    assert!(matches!(
        QuantLinear::from_bytes(QuantFormat::Q4_1, 4, 64, data.clone(), 0),
        Err(KernelError::ByteLength {
            expected: 160,
            got: 120,
            ..
        })
    ));
    let lin = QuantLinear::from_bytes(QuantFormat::Q4_1, 3, 64, data, 0).expect("fits");
    let wrong_k = Tensor::zeros((1, 32), DType::F32, &Device::Cpu).expect("zeros");
    assert!(lin.forward(&wrong_k).is_err());
}

#[test]
fn par_chunks_mut_visits_every_chunk_once_with_its_index() {
    // More chunks than slots, and a short last chunk.
    let mut out = vec![0f32; 1000 * 3 + 2];
    par_chunks_mut(&mut out, 3, |i, chunk| {
        for v in chunk.iter_mut() {
            *v += i as f32 + 1.0;
        }
    });
    for (i, chunk) in out.chunks(3).enumerate() {
        assert!(
            chunk.iter().all(|&v| v == i as f32 + 1.0),
            "chunk {i}: {chunk:?}"
        );
    }
}

/// Continuous batching relies on it (`engine::batch`): an activation row's
/// outputs are bit-identical whatever other rows share the call, for every
/// format, layout (row-major and repacked), instruction set and split of
/// the work (one row, the transposed decode path, the prefill path).
#[test]
fn each_row_gets_the_same_bits_alone_and_in_any_batch() {
    let mut rng = StdRng::seed_from_u64(25);
    for format in FORMATS {
        // 24 rows repack; 12 stay row-major.
        for &(n, k) in &[(24usize, 576usize), (12, 64)] {
            let bytes = random_weights(&mut rng, format, n, k);
            let w = QuantMatrix::new(format, n, k, &bytes).expect("valid matrix");
            // The repacked layout exists on x86 only (`packed`).
            #[cfg(target_arch = "x86_64")]
            let packed = packed::Packed::new(&w).expect("packs");
            for &isa in Isa::available() {
                let run = |x: &[f32], m: usize| {
                    let mut scratch = Scratch::new();
                    scratch.quantize(x, m, k).expect("quantize");
                    let mut out = vec![f32::NAN; m * n];
                    #[cfg(target_arch = "x86_64")]
                    if let Some(p) = &packed {
                        matmul_packed(p, &mut scratch, &mut out, isa).expect("matmul");
                        return out;
                    }
                    matmul(&w, &mut scratch, &mut out, isa).expect("matmul");
                    out
                };
                for &m in &[2usize, 5, 8, 13] {
                    let x = random_acts(&mut rng, m * k);
                    let together = run(&x, m);
                    for a in 0..m {
                        let alone = run(&x[a * k..(a + 1) * k], 1);
                        assert_eq!(
                            alone.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                            together[a * n..(a + 1) * n]
                                .iter()
                                .map(|v| v.to_bits())
                                .collect::<Vec<_>>(),
                            "{format:?} {isa:?} n={n} k={k}: row {a} of {m}"
                        );
                    }
                }
            }
        }
    }
}
