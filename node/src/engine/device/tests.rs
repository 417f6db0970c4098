//! The device path against the fast CPU path: on every compiled-in candle
//! device (here: `Device::Cpu`), random-weight models of every architecture
//! give the same logits, batched prefill equals token-by-token decoding, and
//! the real SmolLM2 decodes the same greedy ids up to near ties.

use std::path::Path;

use candle_core::quantized::GgmlDType;
use candle_core::{DType, Device};

use super::super::testutil::{self, GgufTweaks, TinySpec};
use super::super::{Engine, FinishReason, PromptInput};
use super::*;

/// Every candle device this build can run on: the CPU always, Metal and
/// CUDA when compiled in and present (candle's own tests do the same).
fn devices() -> Vec<Device> {
    let mut out = vec![Device::Cpu];
    for choice in [DeviceChoice::Metal, DeviceChoice::Cuda] {
        if let Ok(Backend::Device(d)) = resolve(choice) {
            out.push(d);
        }
    }
    out
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn mean_abs(a: &[f32]) -> f32 {
    a.iter().map(|x| x.abs()).sum::<f32>() / a.len() as f32
}

/// Prefill of `prompt`, then `steps` single tokens (the argmax of the fast
/// path each time, so both paths see the same inputs): every pass's logits.
fn passes(engine: &mut Engine, prompt: &[u32], feed: &[u32]) -> Vec<Vec<f32>> {
    engine.model.reset(prompt.len() + feed.len());
    let mut out = vec![engine.model.forward(prompt).unwrap()];
    for &t in feed {
        out.push(engine.model.forward(&[t]).unwrap());
    }
    out
}

fn mean_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).sum::<f32>() / a.len() as f32
}

#[test]
fn the_device_path_computes_the_fast_paths_logits_for_every_architecture() {
    let dir = tempfile::tempdir().unwrap();
    let feed = [5, 9, 3, 11];
    for device in devices() {
        for arch in ["llama", "mistral", "qwen2", "qwen3"] {
            let mut spec = TinySpec::new(arch);
            spec.tied = arch == "qwen3";
            let file = |dtype: GgmlDType| {
                let path = dir.path().join(format!("{arch}-{dtype:?}.gguf"));
                testutil::write_gguf(&path, &spec, dtype, &GgufTweaks::default());
                path
            };
            let (f32_file, q8_file) = (file(GgmlDType::F32), file(GgmlDType::Q8_0));
            let mut fast = Engine::load(&f32_file).unwrap();
            let prompt = fast
                .prompt_tokens(&PromptInput::Text("hello world, hello".into()))
                .unwrap();
            let exact = passes(&mut fast, &prompt, &feed);
            // f32 weights: the same sums in another order.
            let mut dev = Engine::load_on(&f32_file, &Backend::Device(device.clone())).unwrap();
            assert_eq!(fast.info(), dev.info(), "{arch}: same model");
            for (i, (w, g)) in exact
                .iter()
                .zip(passes(&mut dev, &prompt, &feed))
                .enumerate()
            {
                let diff = max_abs_diff(w, &g);
                assert!(
                    diff < 1e-3 * mean_abs(w).max(1.0),
                    "{device:?} {arch} f32 pass {i}: logits differ by {diff}"
                );
            }
            // Q8_0 weights: each path quantizes the activations its own
            // way; the device path must be no noisier than the fast path
            // (both against the f32 model).
            let q_fast = passes(&mut Engine::load(&q8_file).unwrap(), &prompt, &feed);
            let mut q_dev_engine =
                Engine::load_on(&q8_file, &Backend::Device(device.clone())).unwrap();
            let q_dev = passes(&mut q_dev_engine, &prompt, &feed);
            for i in 0..exact.len() {
                let (e_fast, e_dev) = (
                    mean_abs_diff(&q_fast[i], &exact[i]),
                    mean_abs_diff(&q_dev[i], &exact[i]),
                );
                assert!(
                    e_dev <= 2.0 * e_fast + 1e-3 * mean_abs(&exact[i]),
                    "{device:?} {arch} Q8_0 pass {i}: the device path is {e_dev} off the f32 \
                     model, the fast path {e_fast}"
                );
            }
        }
    }
}

#[test]
fn safetensors_models_run_on_the_device_path() {
    let dir = tempfile::tempdir().unwrap();
    let spec = TinySpec::new("qwen2");
    let st = dir.path().join("st");
    testutil::write_safetensors(&st, &spec, DType::F32, None);
    for device in devices() {
        let mut fast = Engine::load(&st).unwrap();
        let mut dev = Engine::load_on(&st, &Backend::Device(device.clone())).unwrap();
        let prompt = fast
            .prompt_tokens(&PromptInput::Text("hello world".into()))
            .unwrap();
        let (w, g) = (
            passes(&mut fast, &prompt, &[4]),
            passes(&mut dev, &prompt, &[4]),
        );
        for (w, g) in w.iter().zip(&g) {
            assert!(max_abs_diff(w, g) < 1e-3, "{device:?}");
        }
    }
}

#[test]
fn batched_rows_equal_token_by_token_passes_on_the_device() {
    // The audit's teacher-forced pass (every row at once, masked) against
    // one token at a time through the cache.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("llama.gguf");
    testutil::write_gguf(
        &path,
        &TinySpec::new("llama"),
        GgmlDType::F32,
        &GgufTweaks::default(),
    );
    for device in devices() {
        let mut e = Engine::load_on(&path, &Backend::Device(device.clone())).unwrap();
        let tokens: Vec<u32> = vec![3, 8, 13, 21, 34, 5, 8];
        e.model.reset(tokens.len());
        let rows = e.model.forward_rows(&tokens, 2).unwrap();
        let vocab = e.info().vocab_size;
        assert_eq!(rows.len(), (tokens.len() - 2) * vocab);
        e.model.reset(tokens.len());
        for (i, &t) in tokens.iter().enumerate() {
            let one = e.model.forward(&[t]).unwrap();
            if i >= 2 {
                let row = &rows[(i - 2) * vocab..(i - 1) * vocab];
                assert!(max_abs_diff(row, &one) < 1e-3, "{device:?} row {i}");
            }
        }
        // A cache reset really empties it: the same pass again, the same logits.
        e.model.reset(tokens.len());
        assert_eq!(e.model.forward_rows(&tokens, 2).unwrap(), rows);
    }
}

/// The best logit's index and its lead over the second best.
fn top2(logits: &[f32]) -> (u32, f32) {
    let (mut best, mut second) = ((0u32, f32::NEG_INFINITY), f32::NEG_INFINITY);
    for (i, &v) in logits.iter().enumerate() {
        if v > best.1 {
            second = best.1;
            best = (i as u32, v);
        } else if v > second {
            second = v;
        }
    }
    (best.0, best.1 - second)
}

#[test]
fn smollm2_greedy_ids_on_the_device_path_equal_the_fast_cpu_paths() {
    let reference = super::super::tests::reference();
    let n = reference["n_predict"].as_u64().unwrap() as usize;
    let eog: Vec<u32> = reference["eog_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect();
    let path = Path::new(super::super::tests::MODEL_PATH);
    let mut fast = super::super::tests::smollm();
    for device in devices() {
        let mut dev = Engine::load_on(path, &Backend::Device(device.clone())).unwrap();
        assert_eq!(dev.backend(), Backend::Device(device.clone()).name());
        // Both paths decode the fast path's greedy sequence (teacher
        // forcing), so a near tie does not end the comparison: at every
        // step the device path picks the fast path's token, except where
        // the fast path's top two logits are nearly tied (the rule of the
        // llama.cpp comparison).
        let (mut steps, mut ties, mut worst) = (0, 0, 0f32);
        for case in reference["greedy"].as_array().unwrap() {
            let input = PromptInput::Text(case["prompt"].as_str().unwrap().to_owned());
            let prompt = fast.prompt_tokens(&input).unwrap();
            fast.model.reset(prompt.len() + n);
            dev.model.reset(prompt.len() + n);
            let mut lf = fast.model.forward(&prompt).unwrap();
            let mut ld = dev.model.forward(&prompt).unwrap();
            for step in 0..n {
                let (want, margin) = top2(&lf);
                let (got, _) = top2(&ld);
                worst = worst.max(max_abs_diff(&lf, &ld));
                steps += 1;
                if got != want {
                    assert!(
                        margin < super::super::tests::NEAR_TIE,
                        "{device:?} {input:?} step {step}: the device path picks {got}, the fast \
                         path {want} with a top-2 margin of {margin} (not a near tie)"
                    );
                    ties += 1;
                }
                if eog.contains(&want) {
                    break;
                }
                lf = fast.model.forward(&[want]).unwrap();
                ld = dev.model.forward(&[want]).unwrap();
            }
        }
        eprintln!(
            "{device:?}: {} of {steps} greedy ids equal the fast path's ({ties} near ties \
             went the other way); largest logit difference {worst}",
            steps - ties
        );
        // The allowance must not swallow the comparison.
        assert!(
            ties * 10 <= steps,
            "{ties} near-tie disagreements in {steps} steps"
        );

        // And a whole job through `generate` on the device.
        let mut chunks = String::new();
        let g = dev
            .generate(&super::super::tests::capital_of_france(), &mut |c| {
                chunks.push_str(&c.text);
                std::ops::ControlFlow::Continue(())
            })
            .unwrap();
        assert!(g.text.contains("Paris"), "{device:?}: {:?}", g.text);
        assert_eq!((g.finish, g.text), (FinishReason::Eos, chunks));
    }
}

#[test]
fn devices_compiled_out_are_typed_errors_and_auto_falls_back() {
    assert!(matches!(resolve(DeviceChoice::Cpu), Ok(Backend::Native)));
    #[cfg(not(feature = "metal"))]
    assert!(matches!(
        resolve(DeviceChoice::Metal),
        Err(DeviceError::NotCompiledWith {
            feature: "metal",
            ..
        })
    ));
    #[cfg(not(feature = "cuda"))]
    {
        let err = resolve(DeviceChoice::Cuda).unwrap_err();
        assert!(
            matches!(
                err,
                DeviceError::NotCompiledWith {
                    feature: "cuda",
                    ..
                }
            ),
            "{err}"
        );
        assert!(err.to_string().contains("`cuda` feature"), "{err}");
    }
    #[cfg(not(any(feature = "metal", feature = "cuda")))]
    assert!(matches!(resolve(DeviceChoice::Auto), Ok(Backend::Native)));
    assert_eq!(
        "Metal".parse::<DeviceChoice>().unwrap(),
        DeviceChoice::Metal
    );
    assert!(matches!(
        "gpu".parse::<DeviceChoice>(),
        Err(DeviceError::Unknown(_))
    ));
}
