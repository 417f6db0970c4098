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

const FORMATS: [QuantFormat; 7] = [
    QuantFormat::Q4_0,
    QuantFormat::Q4_1,
    QuantFormat::Q8_0,
    QuantFormat::Q5_0,
    QuantFormat::Q4K,
    QuantFormat::Q5K,
    QuantFormat::Q6K,
];

fn f16_bytes(v: f32) -> [u8; 2] {
    half::f16::from_f32(v).to_bits().to_le_bytes()
}

/// Random GGUF blocks for an `n x k` matrix: small positive scales, signed
/// minimums, every quant value (including -128 for `Q8_0`), random high
/// bits and 6-bit (K-quant) sub-block scales.
fn random_weights(rng: &mut StdRng, format: QuantFormat, n: usize, k: usize) -> Vec<u8> {
    let blocks = n * k / format.block_len();
    let mut bytes = Vec::with_capacity(blocks * format.block_bytes());
    if format.is_k() || format == QuantFormat::Q5_0 {
        for _ in 0..blocks {
            let start = bytes.len();
            bytes.extend((0..format.block_bytes()).map(|_| rng.gen::<u8>()));
            let blk = &mut bytes[start..];
            match format {
                QuantFormat::Q5_0 => {
                    blk[0..2].copy_from_slice(&f16_bytes(rng.gen_range(0.001f32..0.05)))
                }
                QuantFormat::Q6K => {
                    blk[208..210].copy_from_slice(&f16_bytes(rng.gen_range(0.0001f32..0.002)))
                }
                _ => {
                    blk[0..2].copy_from_slice(&f16_bytes(rng.gen_range(0.0001f32..0.002)));
                    blk[2..4].copy_from_slice(&f16_bytes(rng.gen_range(0.0001f32..0.004)));
                }
            }
        }
        return bytes;
    }
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
    if w.format.is_k() {
        let kb = k / SUPER;
        let bb = w.format.block_bytes();
        let mut out = vec![0f32; m * n];
        for a in 0..m {
            for r in 0..n {
                let mut sum = 0f32;
                for b in 0..kb {
                    let off = r * w.row_bytes() + b * bb;
                    let x = &scratch.qs[a * k + b * SUPER..a * k + (b + 1) * SUPER];
                    let bs = &scratch.bs[(a * kb + b) * 16..(a * kb + b + 1) * 16];
                    let (sumi, summ, d, dmin) =
                        scalar::block_dot_k(w.format, &w.bytes[off..off + bb], x, bs);
                    let dx = scratch.d[a * kb + b];
                    sum += (d * dx * sumi as f32).abs() + (dmin * dx * summ as f32).abs();
                }
                out[a * n + r] = sum;
            }
        }
        return out;
    }
    let kb = k / BLOCK;
    let bb = w.format.block_bytes();
    let s = match w.format {
        QuantFormat::Q4_1 => &scratch.s81,
        _ => &scratch.sx,
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

/// Matrix shapes for a format: k not divisible by 256 (576, 1536 =
/// SmolLM2's) for the 32-value formats, multiples of 256 for the K-quants;
/// odd row counts for the tile tails.
fn shapes(format: QuantFormat) -> [(usize, usize); 4] {
    if format.is_k() {
        [(13, 512), (9, 1536), (5, 256), (64, 768)]
    } else {
        [(13, 576), (9, 1536), (5, 64), (64, 576)]
    }
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
            if has("avx512f") && has("avx512vl") && has("avx512bw") && has("avx512_vnni") {
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
        "avx512vl" => "avx512vl", "avx512bw" => "avx512bw", "avx512vnni" => "avx512_vnni");
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
    // Cases a SIMD path runs on the portable kernel by design: row-major
    // K-quant matrices on x86-64 (real ones are repacked, and the repacked
    // kernels are checked in the test below).
    let mut portable_by_design = 0;
    for format in FORMATS {
        // Both split modes (m < 8 by weight rows, m >= 8 by activations).
        for (n, k) in shapes(format) {
            let bytes = random_weights(&mut rng, format, n, k);
            let w = QuantMatrix::new(format, n, k, &bytes).expect("valid matrix");
            for &m in &[1usize, 3, 9, 13] {
                let x = random_acts(&mut rng, m * k);
                let mut scratch = Scratch::new();
                scratch.quantize_for(format, &x, m, k).expect("quantize");
                let reference = product(&w, &mut scratch, Isa::Scalar);
                let mags = magnitudes(&w, &scratch);
                cases += 1;
                if cfg!(target_arch = "x86_64") && format.is_k() {
                    portable_by_design += 1;
                }
                for &isa in &paths {
                    let fell_back = SIMD_FELL_BACK.load(std::sync::atomic::Ordering::Relaxed);
                    let got = product(&w, &mut scratch, isa);
                    assert_eq!(
                        SIMD_FELL_BACK.load(std::sync::atomic::Ordering::Relaxed),
                        fell_back,
                        "{isa:?} {format:?} n={n} k={k} m={m}: asked for, but the portable kernel ran"
                    );
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
    // Every format, shape and row count ran on every path the CPU reports,
    // on that path's own kernel wherever it has one.
    assert_every_path_ran(&ran, cases);
    eprintln!(
        "of the {cases} cases per path, {portable_by_design} ran the portable kernel by design \
         (row-major K-quants on x86-64); none fell back otherwise"
    );
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
        let shapes: [(usize, usize); 3] = if format.is_k() {
            [(8, 256), (24, 768), (16, 1536)]
        } else {
            [(8, 32), (24, 576), (16, 1536)]
        };
        for (n, k) in shapes {
            let bytes = random_weights(&mut rng, format, n, k);
            let w = QuantMatrix::new(format, n, k, &bytes).expect("valid matrix");
            let p = packed::Packed::new(&w)
                .expect("packs")
                .expect("n is a multiple of 8");
            let records = n / 8 * k / format.block_len();
            assert_eq!(
                p.bytes.len(),
                records * packed::record_bytes(format),
                "repacked size"
            );
            // The same bytes, or (K-quants) at most 3% more: unpacked scales.
            assert!(p.bytes.len() * 100 <= bytes.len() * 103, "{format:?}");
            for &m in &[1usize, 2, 5, 9] {
                let x = random_acts(&mut rng, m * k);
                let mut scratch = Scratch::new();
                scratch.quantize_for(format, &x, m, k).expect("quantize");
                let reference = product(&w, &mut scratch, Isa::Scalar);
                let mags = magnitudes(&w, &scratch);
                cases += 1;
                // The scalar path reads the packed layout too.
                for &isa in std::iter::once(&Isa::Scalar).chain(&paths) {
                    for decode in [DecodePath::SingleRow, DecodePath::Paired] {
                        let mut got = vec![f32::NAN; m * n];
                        let fell_back = SIMD_FELL_BACK.load(std::sync::atomic::Ordering::Relaxed);
                        matmul_packed(&p, &mut scratch, &mut got, isa, decode)
                            .expect("packed matmul");
                        assert_eq!(
                            SIMD_FELL_BACK.load(std::sync::atomic::Ordering::Relaxed),
                            fell_back,
                            "packed {isa:?} {decode:?} {format:?} n={n} k={k} m={m}: asked for, but the portable kernel ran"
                        );
                        assert_within_rounding(
                            &got,
                            &reference,
                            &mags,
                            &format!("packed {isa:?} {decode:?} {format:?} n={n} k={k} m={m}"),
                        );
                    }
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

fn ggml_dtype(format: QuantFormat) -> GgmlDType {
    match format {
        QuantFormat::Q4_0 => GgmlDType::Q4_0,
        QuantFormat::Q4_1 => GgmlDType::Q4_1,
        QuantFormat::Q8_0 => GgmlDType::Q8_0,
        QuantFormat::Q5_0 => GgmlDType::Q5_0,
        QuantFormat::Q4K => GgmlDType::Q4K,
        QuantFormat::Q5K => GgmlDType::Q5K,
        QuantFormat::Q6K => GgmlDType::Q6K,
    }
}

/// Dequantizes the blocks to f32 with candle's own decoder (an independent
/// reading of the GGUF layouts), for the float reference.
fn dequantize(format: QuantFormat, bytes: &[u8]) -> Vec<f32> {
    let n = bytes.len() / format.block_bytes() * format.block_len();
    candle_core::quantized::ggml_file::qtensor_from_ggml(
        ggml_dtype(format),
        bytes,
        vec![n],
        &Device::Cpu,
    )
    .and_then(|q| q.dequantize(&Device::Cpu))
    .and_then(|t| t.to_vec1::<f32>())
    .expect("candle dequantizes")
}

/// Dequantizes the 32-value formats by ggml's definitions written out here.
fn dequantize_by_hand(format: QuantFormat, bytes: &[u8]) -> Vec<f32> {
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
            _ => out.extend(
                scalar::q5_0_quants(blk)
                    .iter()
                    .map(|&q| d * (f32::from(q) - 16.0)),
            ),
        }
    }
    out
}

#[test]
fn our_block_decoding_agrees_with_candles() {
    let mut rng = StdRng::seed_from_u64(5);
    for format in FORMATS {
        let bytes = random_weights(&mut rng, format, 2, 512);
        let theirs = dequantize(format, &bytes);
        let ours: Vec<f32> = if format.is_k() {
            // value = d * sc * q - dmin * m, from our unpacking.
            bytes
                .chunks_exact(format.block_bytes())
                .flat_map(|blk| {
                    let q = scalar::k_quants(format, blk);
                    (0..SUPER)
                        .map(|i| {
                            if format == QuantFormat::Q6K {
                                let sc = f32::from(blk[192 + i / 16] as i8);
                                scalar::f16_at(blk, 208) * sc * (f32::from(q[i]) - 32.0)
                            } else {
                                let (sc, m) = scalar::scale_min_k4(i / 32, &blk[4..16]);
                                scalar::f16_at(blk, 0) * f32::from(sc) * f32::from(q[i])
                                    - scalar::f16_at(blk, 2) * f32::from(m)
                            }
                        })
                        .collect::<Vec<_>>()
                })
                .collect()
        } else {
            dequantize_by_hand(format, &bytes)
        };
        assert_eq!(ours.len(), theirs.len());
        for (i, (a, b)) in ours.iter().zip(&theirs).enumerate() {
            assert!(
                (a - b).abs() <= 1e-6 * b.abs().max(1.0),
                "{format:?} value {i}: {a} vs candle {b}"
            );
        }
    }
}

#[test]
fn the_reference_is_close_to_the_float_product() {
    let mut rng = StdRng::seed_from_u64(11);
    for format in FORMATS {
        let (n, k, m) = (7, if format.is_k() { 512 } else { 576 }, 2);
        let bytes = random_weights(&mut rng, format, n, k);
        let w = QuantMatrix::new(format, n, k, &bytes).expect("valid matrix");
        let wf = dequantize(format, &bytes);
        let x = random_acts(&mut rng, m * k);
        let mut scratch = Scratch::new();
        scratch.quantize_for(format, &x, m, k).expect("quantize");
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
    for format in FORMATS {
        let dtype = ggml_dtype(format);
        // 40 rows: repacked on x86-64; 12 rows: row-major.
        let (n, k) = (
            if format == QuantFormat::Q4K { 12 } else { 40 },
            if format.is_k() { 512 } else { 576 },
        );
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

/// One input through matrices of both activation schemes (`Q8_0` and
/// `Q8_K`), as a layer's q, k and v may be: the shared path gives each the
/// same result as its own call.
#[test]
fn shared_input_over_mixed_formats_equals_one_call_each() {
    let mut rng = StdRng::seed_from_u64(5);
    let k = 512;
    let formats = [
        QuantFormat::Q4K,
        QuantFormat::Q8_0,
        QuantFormat::Q6K,
        QuantFormat::Q5_0,
    ];
    let linears: Vec<QuantLinear> = formats
        .iter()
        .map(|&format| {
            let wf =
                Tensor::from_vec(random_acts(&mut rng, 16 * k), (16, k), &Device::Cpu).expect("w");
            let qt = QTensor::quantize(&wf, ggml_dtype(format)).expect("quantize weights");
            QuantLinear::from_qtensor(Arc::new(qt)).expect("supported")
        })
        .collect();
    let refs: Vec<&QuantLinear> = linears.iter().collect();
    for rows in [1usize, 9] {
        let x = random_acts(&mut rng, rows * k);
        let mut outs = vec![vec![f32::NAN; rows * 16]; formats.len()];
        {
            let mut views: Vec<&mut [f32]> = outs.iter_mut().map(|o| &mut o[..]).collect();
            QuantLinear::forward_shared(&refs, &x, rows, &mut views).expect("shared");
        }
        for (l, shared) in linears.iter().zip(&outs) {
            let mut alone = vec![f32::NAN; rows * 16];
            l.forward_local(&x, rows, &mut alone).expect("alone");
            assert_eq!(shared, &alone, "{:?} rows={rows}", l.format());
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
        Err(KernelError::RowNotBlocks { k: 60, block: 32 })
    ));
    let w = QuantMatrix::new(QuantFormat::Q4_1, 3, 64, &bytes).expect("valid");
    let mut scratch = Scratch::new();
    scratch.quantize(&[0.5; 64 * 2], 2, 64).expect("quantize");
    let mut short = vec![0f32; 5];
    assert!(matches!(
        matmul(&w, &mut scratch, &mut short, Isa::detect()),
        Err(KernelError::Shape { .. })
    ));
    let k2 = Tensor::zeros((8, 256), DType::F32, &Device::Cpu).expect("zeros");
    let qk = QTensor::quantize(&k2, GgmlDType::Q2K).expect("q2k");
    assert!(matches!(
        QuantLinear::from_qtensor(Arc::new(qk)),
        Err(KernelError::UnsupportedFormat(_))
    ));
    // K-quant rows are whole super-blocks of 256.
    assert!(matches!(
        QuantMatrix::new(QuantFormat::Q4K, 1, 288, &[0u8; 162]),
        Err(KernelError::RowNotBlocks { k: 288, block: 256 })
    ));
    // Activations quantized for one scheme are refused by the other's weights.
    let kbytes = vec![0u8; 144];
    let wk = QuantMatrix::new(QuantFormat::Q4K, 1, 256, &kbytes).expect("valid");
    let mut s32 = Scratch::new();
    s32.quantize(&[0.5; 256], 1, 256).expect("quantize");
    assert!(matches!(
        matmul(&wk, &mut s32, &mut [0f32; 1], Isa::Scalar),
        Err(KernelError::ActsScheme { .. })
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
        // 24 rows repack; 12 stay row-major. Inputs: 18 and 2 blocks of
        // the format (K-quant blocks hold 256 values, the others 32).
        let b = format.block_len();
        for &(n, k) in &[(24usize, 18 * b), (12, 2 * b)] {
            let bytes = random_weights(&mut rng, format, n, k);
            let w = QuantMatrix::new(format, n, k, &bytes).expect("valid matrix");
            // The repacked layout exists on x86 only (`packed`).
            #[cfg(target_arch = "x86_64")]
            let packed = packed::Packed::new(&w).expect("packs");
            for &isa in Isa::available() {
                #[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))]
                let run = |x: &[f32], m: usize, decode: DecodePath| {
                    let mut scratch = Scratch::new();
                    scratch.quantize_for(format, x, m, k).expect("quantize");
                    let mut out = vec![f32::NAN; m * n];
                    #[cfg(target_arch = "x86_64")]
                    if let Some(p) = &packed {
                        matmul_packed(p, &mut scratch, &mut out, isa, decode).expect("matmul");
                        return out;
                    }
                    matmul(&w, &mut scratch, &mut out, isa).expect("matmul");
                    out
                };
                for &m in &[2usize, 5, 8, 13] {
                    let x = random_acts(&mut rng, m * k);
                    let together = run(&x, m, DecodePath::default());
                    // Alone, a row takes the decode path: both kernels of it.
                    for decode in [DecodePath::SingleRow, DecodePath::Paired] {
                        for a in 0..m {
                            let alone = run(&x[a * k..(a + 1) * k], 1, decode);
                            assert_eq!(
                                alone.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                                together[a * n..(a + 1) * n]
                                    .iter()
                                    .map(|v| v.to_bits())
                                    .collect::<Vec<_>>(),
                                "{format:?} {isa:?} {decode:?} n={n} k={k}: row {a} of {m}"
                            );
                        }
                    }
                }
            }
        }
    }
}

/// The 512-bit K-quant kernel runs 8-row groups in pairs: a group's outputs
/// are bit-identical whether it runs paired (on either side) or alone, on
/// every path, so the split of the groups between parts (which follows the
/// thread count) cannot change a result.
#[cfg(target_arch = "x86_64")]
#[test]
fn a_group_gets_the_same_bits_paired_or_alone() {
    let mut rng = StdRng::seed_from_u64(31);
    let (groups, k) = (5usize, 512usize);
    let n = groups * 8;
    for format in [QuantFormat::Q4K, QuantFormat::Q5K, QuantFormat::Q6K] {
        let bytes = random_weights(&mut rng, format, n, k);
        let w = QuantMatrix::new(format, n, k, &bytes).expect("valid matrix");
        let p = packed::Packed::new(&w)
            .expect("packs")
            .expect("n is a multiple of 8");
        for &isa in Isa::available() {
            for &m in &[1usize, 6] {
                let x = random_acts(&mut rng, m * k);
                let mut scratch = Scratch::new();
                scratch.quantize_for(format, &x, m, k).expect("quantize");
                let shape = vec![0f32; m * n];
                let (acts, _) = prepare(format, n, k, &mut scratch, &shape, isa)
                    .expect("prepares")
                    .expect("work to do");
                let per = 8 * m;
                let mut all = vec![f32::NAN; groups * per];
                run_groups(isa, &p, &acts, m, 0, &mut all);
                for start in 0..groups {
                    for len in 1..=groups - start {
                        let mut part = vec![f32::NAN; len * per];
                        run_groups(isa, &p, &acts, m, start, &mut part);
                        // One activation row: the single-row decode kernel too.
                        let mut row = vec![f32::NAN; len * per];
                        if m == 1 {
                            run_row_k(isa, &p, &acts, start, &mut row);
                        }
                        for (got, what) in [(&part, "tile"), (&row, "single-row")] {
                            if what == "single-row" && m != 1 {
                                continue;
                            }
                            assert_eq!(
                                got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                                all[start * per..(start + len) * per]
                                    .iter()
                                    .map(|v| v.to_bits())
                                    .collect::<Vec<_>>(),
                                "{format:?} {isa:?} m={m} {what}: groups {start}..{}",
                                start + len
                            );
                        }
                    }
                }
            }
        }
    }
}
