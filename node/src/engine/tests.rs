//! Engine tests: random-weight files for every architecture and tensor type,
//! corrupt files, the generation contract, and the real SmolLM2 model checked
//! against llama.cpp's recorded token ids.

use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};

use candle_core::quantized::GgmlDType;
use candle_core::DType;

use super::testutil::{self, GgufTweaks, TinySpec};
use super::*;

fn greedy(max_tokens: usize) -> Sampling {
    Sampling {
        max_tokens,
        ..Sampling::default()
    }
}

fn text(prompt: &str, sampling: Sampling) -> GenerateRequest {
    GenerateRequest {
        input: PromptInput::Text(prompt.to_string()),
        sampling,
        resume: Resume::default(),
    }
}

fn chat(question: &str, sampling: Sampling) -> GenerateRequest {
    GenerateRequest {
        input: PromptInput::Chat(vec![ChatTurn {
            role: "user".into(),
            content: question.into(),
        }]),
        sampling,
        resume: Resume::default(),
    }
}

/// Runs a generation, collecting the chunks.
pub(super) fn run(engine: &mut Engine, req: &GenerateRequest) -> (Generation, Vec<TokenChunk>) {
    let mut chunks = Vec::new();
    let g = engine
        .generate(req, &mut |c| {
            chunks.push(c.clone());
            ControlFlow::Continue(())
        })
        .unwrap();
    (g, chunks)
}

fn tiny_gguf(dir: &Path, spec: &TinySpec, dtype: GgmlDType) -> PathBuf {
    let path = dir.join(format!("{}-{dtype:?}.gguf", spec.arch));
    testutil::write_gguf(&path, spec, dtype, &GgufTweaks::default());
    path
}

fn load_err(path: &Path) -> EngineError {
    match Engine::load(path) {
        Ok(_) => panic!("{} loaded but should not have", path.display()),
        Err(e) => e,
    }
}

// ---------------------------------------------------------------- loading

#[test]
fn gguf_loads_every_architecture() {
    let dir = tempfile::tempdir().unwrap();
    for arch in ["llama", "mistral", "qwen2", "qwen3", "gemma3"] {
        let spec = TinySpec::new(arch);
        let path = tiny_gguf(dir.path(), &spec, GgmlDType::Q8_0);
        let mut engine = Engine::load(&path).unwrap();
        let info = engine.info().clone();
        let expected_arch = if arch == "mistral" { "llama" } else { arch };
        assert_eq!(info.architecture, expected_arch);
        assert_eq!(info.layers, spec.layers);
        assert_eq!(info.kv_heads, spec.kv_heads);
        assert_eq!(info.head_dim, spec.head_dim);
        assert_eq!(info.vocab_size, testutil::tiny_vocab().len());
        assert_eq!(info.context_length, spec.context);
        let (g, _) = run(&mut engine, &text("hello world", greedy(5)));
        assert_eq!(
            g.prompt_tokens,
            engine.tokenize("hello world").unwrap().len()
        );
        assert!(g.output_token_ids.len() <= 5, "{arch}: {g:?}");
        let (again, _) = run(&mut engine, &text("hello world", greedy(5)));
        assert_eq!(
            g.output_token_ids, again.output_token_ids,
            "{arch}: greedy is deterministic"
        );
    }
}

/// Relative RMS difference `|got - want| / |want|`.
fn rel_rms(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len());
    let err: f64 = got
        .iter()
        .zip(want)
        .map(|(a, b)| f64::from(a - b).powi(2))
        .sum();
    let norm: f64 = want.iter().map(|b| f64::from(*b).powi(2)).sum();
    (err / norm).sqrt() as f32
}

/// The relative RMS error that storing `spec`'s weight matrices through
/// `store` (quantize, then back to f32) puts into them: the format's own
/// quantization error, measured on the very weights the model files hold.
fn storage_error(
    spec: &TinySpec,
    store: &dyn Fn(&candle_core::Tensor) -> candle_core::Tensor,
) -> f32 {
    let (mut err, mut norm) = (0f64, 0f64);
    testutil::each_hf_weight(spec, &mut |_, t| {
        if t.rank() != 2 {
            return;
        }
        let back = store(&t);
        let a = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let b = back.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        for (x, y) in a.iter().zip(&b) {
            err += f64::from(x - y).powi(2);
            norm += f64::from(*x).powi(2);
        }
    });
    (err / norm).sqrt() as f32
}

fn gguf_storage_error(spec: &TinySpec, dtype: GgmlDType) -> f32 {
    storage_error(spec, &|t| {
        candle_core::quantized::QTensor::quantize(t, dtype)
            .unwrap()
            .dequantize(&candle_core::Device::Cpu)
            .unwrap()
    })
}

/// How much a relative error in the weights grows into a relative error in
/// the logits of the tiny test models (2 layers, random weights), for the
/// weights alone: a model holding exactly a format's values (quantized and
/// back, in f32) against the f32 model. Measured (the tests print it): 3.3 x
/// (Q5_1, Q2K) to 4.5 x (F16) for GGUF, 4.7 x (bf16) and 5.2 x (f16) for
/// safetensors.
const WEIGHT_GAIN: f32 = 8.0;

/// The same for the compute path alone (the 8-bit activation blocks of the
/// quantized matmuls): a format's file against the f32 file of exactly its
/// values. Measured: 4.1 x (Q5_0) to 7.0 x (Q6K) the activations' Q8_0
/// error; 0 for f16/bf16 (computed in f32 after loading). A file with one
/// wrong tensor lands 7 to 400 x the resulting bound above it.
const COMPUTE_GAIN: f32 = 12.0;

/// The logits of `path`'s engine on `prompt` (from a fresh cache).
fn logits_of(path: &Path, prompt: &[u32]) -> Vec<f32> {
    let mut engine = Engine::load(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    engine.model.reset(prompt.len());
    engine.model.forward(prompt).unwrap()
}

/// The old test's figure: mean absolute logit error over the mean logit.
fn mean_error(got: &[f32], want: &[f32]) -> f32 {
    let err: f32 = got.iter().zip(want).map(|(a, b)| (a - b).abs()).sum();
    let scale: f32 = want.iter().map(|a| a.abs()).sum();
    err / scale
}

/// Every tensor type loads and computes its file's function, up to bounds
/// derived from the format's own rounding:
/// - the file against an f32 file of exactly its values (every matrix
///   quantized and back): only the compute path differs, within
///   [`COMPUTE_GAIN`] x the 8-bit activation error (quantized formats; for
///   f16/bf16 the format's own error);
/// - that f32 file against the f32 model: only the weights differ, within
///   [`WEIGHT_GAIN`] x the format's weight error.
///
/// A file with one wrong tensor (rows shuffled, a wrong scale) in the same
/// format must break the first bound.
#[test]
fn gguf_loads_every_tensor_type() {
    let dir = tempfile::tempdir().unwrap();
    let spec = TinySpec::new("llama");
    let f32_path = tiny_gguf(dir.path(), &spec, GgmlDType::F32);
    let reference = Engine::load(&f32_path).unwrap();
    let prompt = reference
        .prompt_tokens(&PromptInput::Text("hello world".into()))
        .unwrap();
    drop(reference);
    let want = logits_of(&f32_path, &prompt);
    // Activations go through the quantized matmuls as 8-bit blocks (ours:
    // Q8_0/Q8_1; candle's K-quant kernels: Q8_K): about Q8_0's own error.
    let act_error = gguf_storage_error(&spec, GgmlDType::Q8_0);
    let wrong: [(&str, GgufTweaks); 2] = [
        (
            "rows of blk.1.ffn_down shuffled",
            GgufTweaks {
                shuffle_rows: Some("blk.1.ffn_down.weight".into()),
                ..GgufTweaks::default()
            },
        ),
        (
            "blk.0.attn_v scaled by 1.5",
            GgufTweaks {
                scale: Some(("blk.0.attn_v.weight".into(), 1.5)),
                ..GgufTweaks::default()
            },
        ),
    ];
    let mut failures = Vec::new();
    for dtype in [
        GgmlDType::F16,
        GgmlDType::BF16,
        GgmlDType::Q4_0,
        GgmlDType::Q4_1,
        GgmlDType::Q5_0,
        GgmlDType::Q5_1,
        GgmlDType::Q8_0,
        GgmlDType::Q2K,
        GgmlDType::Q3K,
        GgmlDType::Q4K,
        GgmlDType::Q5K,
        GgmlDType::Q6K,
    ] {
        let got = logits_of(&tiny_gguf(dir.path(), &spec, dtype), &prompt);
        let exact_path = dir.path().join(format!("exact-{dtype:?}.gguf"));
        testutil::write_gguf(
            &exact_path,
            &spec,
            GgmlDType::F32,
            &GgufTweaks {
                roundtrip: Some(dtype),
                ..GgufTweaks::default()
            },
        );
        let exact = logits_of(&exact_path, &prompt);
        let weight_error = gguf_storage_error(&spec, dtype);
        let half = matches!(dtype, GgmlDType::F16 | GgmlDType::BF16);
        let compute_error = if half { weight_error } else { act_error };
        let compute_bound = COMPUTE_GAIN * compute_error;
        let weight_bound = WEIGHT_GAIN * weight_error;
        let (compute, weights) = (rel_rms(&got, &exact), rel_rms(&exact, &want));
        eprintln!(
            "{dtype:?}: weight error {weight_error:.2e}, compute error {compute_error:.2e}; \
             file vs its values in f32 {compute:.2e} ({:.2} x, bound {compute_bound:.2e}); \
             its values vs the f32 model {weights:.2e} ({:.2} x, bound {weight_bound:.2e}); \
             file vs the f32 model {:.2e} (old figure {:.3})",
            compute / compute_error,
            weights / weight_error,
            rel_rms(&got, &want),
            mean_error(&got, &want),
        );
        if compute > compute_bound {
            failures.push(format!(
                "{dtype:?}: {compute:.3e} from its own values in f32, over {compute_bound:.3e}"
            ));
        }
        if weights > weight_bound {
            failures.push(format!(
                "{dtype:?}: its values compute {weights:.3e} from the f32 model, over {weight_bound:.3e}"
            ));
        }
        for (what, tweaks) in &wrong {
            let bad = dir.path().join(format!("wrong-{dtype:?}.gguf"));
            testutil::write_gguf(&bad, &spec, dtype, tweaks);
            let bad_logits = logits_of(&bad, &prompt);
            let bad_err = rel_rms(&bad_logits, &exact);
            eprintln!(
                "{dtype:?} with {what}: {bad_err:.2e} from the right values ({:.1} x the bound); \
                 old figure {:.3}",
                bad_err / compute_bound,
                mean_error(&bad_logits, &want)
            );
            if bad_err <= compute_bound {
                failures.push(format!(
                    "{dtype:?}: the bound {compute_bound:.3e} does not reject a file with {what} \
                     ({bad_err:.3e})"
                ));
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

#[test]
fn safetensors_and_gguf_compute_the_same_model() {
    let dir = tempfile::tempdir().unwrap();
    for arch in ["llama", "mistral", "qwen2", "qwen3"] {
        let spec = TinySpec::new(arch);
        let gguf = tiny_gguf(dir.path(), &spec, GgmlDType::F32);
        let st_dir = dir.path().join(format!("{arch}-st"));
        testutil::write_safetensors(&st_dir, &spec, DType::F32, None);
        let mut a = Engine::load(&gguf).unwrap();
        let mut b = Engine::load(&st_dir).unwrap();
        assert_eq!(b.info().architecture, arch);
        let pa = a
            .prompt_tokens(&PromptInput::Text("hello world, hello".into()))
            .unwrap();
        let pb = b
            .prompt_tokens(&PromptInput::Text("hello world, hello".into()))
            .unwrap();
        assert_eq!(pa, pb, "{arch}: both tokenizers agree");
        a.model.reset(pa.len());
        b.model.reset(pb.len());
        let la = a.model.forward(&pa).unwrap();
        let lb = b.model.forward(&pb).unwrap();
        let max = la
            .iter()
            .zip(&lb)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0f32, f32::max);
        assert!(
            max < 1e-3,
            "{arch}: gguf and safetensors logits differ by {max}"
        );
        // And the single .safetensors file path works too.
        assert!(Engine::load(&st_dir.join("model.safetensors")).is_ok());
    }
}

/// f16 and bf16 safetensors load and compute their file's function, with
/// the bounds of [`gguf_loads_every_tensor_type`]: the file against an f32
/// file of exactly its values within [`COMPUTE_GAIN`] x the format's error,
/// those values against the f32 model within [`WEIGHT_GAIN`] x it; and
/// they generate.
#[test]
fn safetensors_loads_half_precision() {
    let dir = tempfile::tempdir().unwrap();
    let spec = TinySpec::new("qwen2");
    let f32_dir = dir.path().join("f32");
    testutil::write_safetensors(&f32_dir, &spec, DType::F32, None);
    let reference = Engine::load(&f32_dir).unwrap();
    let prompt = reference
        .prompt_tokens(&PromptInput::Text("hello world, hello".into()))
        .unwrap();
    drop(reference);
    let want = logits_of(&f32_dir, &prompt);
    let mut failures = Vec::new();
    for (dtype, name) in [(DType::F16, "f16"), (DType::BF16, "bf16")] {
        let st_dir = dir.path().join(name);
        testutil::write_safetensors(&st_dir, &spec, dtype, None);
        let exact_dir = dir.path().join(format!("exact-{name}"));
        testutil::write_safetensors_rounded(&exact_dir, &spec, dtype);
        let weight_error = storage_error(&spec, &|t| {
            t.to_dtype(dtype).unwrap().to_dtype(DType::F32).unwrap()
        });
        let (got, exact) = (logits_of(&st_dir, &prompt), logits_of(&exact_dir, &prompt));
        let (compute, weights) = (rel_rms(&got, &exact), rel_rms(&exact, &want));
        let (compute_bound, weight_bound) =
            (COMPUTE_GAIN * weight_error, WEIGHT_GAIN * weight_error);
        eprintln!(
            "{name}: weight error {weight_error:.2e}; file vs its values in f32 {compute:.2e} \
             ({:.2} x, bound {compute_bound:.2e}); its values vs the f32 model {weights:.2e} \
             ({:.2} x, bound {weight_bound:.2e})",
            compute / weight_error,
            weights / weight_error
        );
        if compute > compute_bound {
            failures.push(format!(
                "{name}: {compute:.3e} from its own values, over {compute_bound:.3e}"
            ));
        }
        if weights > weight_bound {
            failures.push(format!("{name}: its values compute {weights:.3e} from the f32 model, over {weight_bound:.3e}"));
        }
        let mut engine = Engine::load(&st_dir).unwrap_or_else(|e| panic!("{name}: {e}"));
        let (g, chunks) = run(&mut engine, &chat("hi", greedy(4)));
        assert_eq!(g.output_token_ids.len(), 4, "{name}: {g:?}");
        assert_eq!(
            g.text,
            chunks.iter().map(|c| c.text.as_str()).collect::<String>()
        );
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

#[test]
fn tied_embeddings_load_without_an_output_matrix() {
    let dir = tempfile::tempdir().unwrap();
    let mut spec = TinySpec::new("llama");
    spec.tied = true;
    let tied = tiny_gguf(dir.path(), &spec, GgmlDType::Q8_0);
    spec.tied = false;
    let untied_dir = dir.path().join("untied");
    std::fs::create_dir_all(&untied_dir).unwrap();
    let untied = tiny_gguf(&untied_dir, &spec, GgmlDType::Q8_0);
    let t = Engine::load(&tied).unwrap();
    let u = Engine::load(&untied).unwrap();
    let vocab_x_hidden = (testutil::tiny_vocab().len() * spec.hidden) as u64;
    assert_eq!(u.info().parameters - t.info().parameters, vocab_x_hidden);
}

// ---------------------------------------------------------------- corrupt files

#[test]
fn truncated_gguf_is_reported_as_truncated() {
    let dir = tempfile::tempdir().unwrap();
    let path = tiny_gguf(dir.path(), &TinySpec::new("llama"), GgmlDType::Q4_0);
    let bytes = std::fs::read(&path).unwrap();
    for cut in [bytes.len() - 100, bytes.len() / 2, 2000, 30] {
        std::fs::write(&path, &bytes[..cut]).unwrap();
        let e = load_err(&path);
        assert!(matches!(e, EngineError::Gguf(_)), "{e}");
        assert!(e.to_string().contains("truncated"), "cut at {cut}: {e}");
    }
}

#[test]
fn bad_magic_empty_and_missing_files_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let path = tiny_gguf(dir.path(), &TinySpec::new("llama"), GgmlDType::Q4_0);
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[..4].copy_from_slice(b"GGML");
    std::fs::write(&path, &bytes).unwrap();
    let e = load_err(&path);
    assert!(e.to_string().contains("bad magic"), "{e}");

    std::fs::write(&path, b"").unwrap();
    let e = load_err(&path);
    assert!(e.to_string().contains("not a gguf file"), "{e}");

    let missing = dir.path().join("nope.gguf");
    let e = load_err(&missing);
    assert!(matches!(e, EngineError::Io { .. }), "{e}");
    assert!(e.to_string().contains("nope.gguf"), "{e}");
}

#[test]
fn absurd_lengths_in_the_header_are_rejected_without_allocating() {
    let dir = tempfile::tempdir().unwrap();
    let path = tiny_gguf(dir.path(), &TinySpec::new("llama"), GgmlDType::Q4_0);
    let mut bytes = std::fs::read(&path).unwrap();
    // The first metadata key's length (bytes 24..32) claims an exabyte.
    bytes[24..32].copy_from_slice(&(1u64 << 60).to_le_bytes());
    std::fs::write(&path, &bytes).unwrap();
    let e = load_err(&path);
    assert!(e.to_string().contains("metadata key"), "{e}");
    // And a metadata count larger than the file.
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[16..24].copy_from_slice(&u64::MAX.to_le_bytes());
    std::fs::write(&path, &bytes).unwrap();
    let e = load_err(&path);
    assert!(e.to_string().contains("corrupt header"), "{e}");
}

#[test]
fn missing_tensor_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("missing.gguf");
    let tweaks = GgufTweaks {
        drop_tensor: Some("blk.1.ffn_up.weight".into()),
        ..GgufTweaks::default()
    };
    testutil::write_gguf(&path, &TinySpec::new("llama"), GgmlDType::Q8_0, &tweaks);
    let e = load_err(&path);
    assert!(
        matches!(&e, EngineError::MissingTensor { name } if name == "blk.1.ffn_up.weight"),
        "{e}"
    );

    let st = dir.path().join("st");
    testutil::write_safetensors(
        &st,
        &TinySpec::new("qwen2"),
        DType::F32,
        Some("model.layers.0.self_attn.k_proj.bias"),
    );
    let e = load_err(&st);
    assert!(
        e.to_string()
            .contains("model.layers.0.self_attn.k_proj.bias"),
        "{e}"
    );
}

#[test]
fn wrong_architecture_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("neox.gguf");
    let tweaks = GgufTweaks {
        architecture: Some("gptneox".into()),
        ..GgufTweaks::default()
    };
    testutil::write_gguf(&path, &TinySpec::new("llama"), GgmlDType::Q8_0, &tweaks);
    let e = load_err(&path);
    assert!(
        matches!(&e, EngineError::UnsupportedArchitecture(a) if a == "gptneox"),
        "{e}"
    );
    assert!(e.to_string().contains("gptneox"));
}

#[test]
fn corrupt_safetensors_is_reported() {
    let dir = tempfile::tempdir().unwrap();
    let st = dir.path().join("st");
    testutil::write_safetensors(&st, &TinySpec::new("llama"), DType::F32, None);
    let file = st.join("model.safetensors");
    let bytes = std::fs::read(&file).unwrap();
    std::fs::write(&file, &bytes[..bytes.len() / 2]).unwrap();
    let e = load_err(&st);
    assert!(matches!(e, EngineError::Safetensors(_)), "{e}");
    assert!(e.to_string().contains("model.safetensors"), "{e}");

    std::fs::remove_file(st.join("config.json")).unwrap();
    let e = load_err(&st);
    assert!(e.to_string().contains("config.json"), "{e}");
}

// ---------------------------------------------------------------- generation contract

fn tiny_engine(dir: &Path) -> Engine {
    let path = tiny_gguf(dir, &TinySpec::new("llama"), GgmlDType::Q8_0);
    Engine::load(&path).unwrap()
}

#[test]
fn chunks_add_up_to_the_text_and_max_tokens_is_honoured() {
    let dir = tempfile::tempdir().unwrap();
    let mut engine = tiny_engine(dir.path());
    // Greedy on the tiny model's fixed random weights: on this prompt it
    // emits no end-of-generation token within 40 tokens (checked here), so
    // every run below ends by its length, and the length check always runs.
    let (long, _) = run(&mut engine, &text("hello", greedy(40)));
    assert_eq!(
        (long.finish, long.output_token_ids.len()),
        (FinishReason::Length, 40),
        "{long:?}"
    );
    for max_tokens in [1, 2, 7, 40] {
        let (g, chunks) = run(&mut engine, &text("hello", greedy(max_tokens)));
        assert_eq!(g.finish, FinishReason::Length, "{g:?}");
        assert_eq!(g.output_token_ids.len(), max_tokens, "{g:?}");
        assert_eq!(g.output_token_ids[..], long.output_token_ids[..max_tokens]);
        let joined: String = chunks.iter().map(|c| c.text.as_str()).collect();
        assert_eq!(g.text, joined);
        assert_eq!(chunks.len(), max_tokens, "one chunk per token");
        for (i, c) in chunks.iter().enumerate() {
            assert_eq!(c.index, i);
            assert_eq!(c.token_id, g.output_token_ids[i]);
        }
    }
}

#[test]
fn cancelling_stops_after_the_current_token() {
    let dir = tempfile::tempdir().unwrap();
    let mut engine = tiny_engine(dir.path());
    let mut seen = 0;
    let sampling = Sampling {
        temperature: 1.0,
        seed: 3,
        max_tokens: 50,
        ..Sampling::default()
    };
    let g = engine
        .generate(&text("hello", sampling), &mut |_| {
            seen += 1;
            if seen == 2 {
                ControlFlow::Break(())
            } else {
                ControlFlow::Continue(())
            }
        })
        .unwrap();
    if g.finish == FinishReason::Cancelled {
        assert_eq!(g.output_token_ids.len(), 2);
        assert_eq!(seen, 2);
    } else {
        // Only an early EOS could end it first.
        assert_eq!(g.finish, FinishReason::Eos, "{g:?}");
        assert!(g.output_token_ids.len() < 2);
    }
}

#[test]
fn bad_requests_are_client_errors() {
    let dir = tempfile::tempdir().unwrap();
    let mut engine = tiny_engine(dir.path());
    let mut noop = |_: &TokenChunk| ControlFlow::Continue(());
    let e = engine
        .generate(&text("", greedy(3)), &mut noop)
        .unwrap_err();
    assert!(matches!(e, EngineError::EmptyPrompt) && e.is_client_error());

    let long = "hello ".repeat(200);
    let e = engine
        .generate(&text(&long, greedy(3)), &mut noop)
        .unwrap_err();
    assert!(
        matches!(e, EngineError::PromptTooLong { max: 127, .. }),
        "{e}"
    );
    assert!(e.is_client_error());

    let bad = Sampling {
        temperature: f32::NAN,
        ..Sampling::default()
    };
    let e = engine.generate(&text("hi", bad), &mut noop).unwrap_err();
    assert!(e.is_client_error(), "{e}");

    // A long request near the context end stops at the context length.
    let prompt = "hello ".repeat(35);
    let n = engine
        .prompt_tokens(&PromptInput::Text(prompt.clone()))
        .unwrap()
        .len();
    let g = engine
        .generate(&text(&prompt, greedy(1000)), &mut noop)
        .unwrap();
    assert!(
        n + g.output_token_ids.len() <= 128,
        "{n} + {}",
        g.output_token_ids.len()
    );
}

#[test]
fn stop_strings_end_the_output_and_are_excluded() {
    let dir = tempfile::tempdir().unwrap();
    let mut engine = tiny_engine(dir.path());
    let sampling = Sampling {
        temperature: 1.0,
        seed: 11,
        max_tokens: 40,
        ..Sampling::default()
    };
    let (full, _) = run(&mut engine, &text("hello", sampling.clone()));
    // Pick a stop string from the middle of the unconstrained output.
    let chars: Vec<char> = full.text.chars().collect();
    assert!(
        chars.len() >= 6,
        "output too short for this test: {:?}",
        full.text
    );
    let stop: String = chars[chars.len() / 2..chars.len() / 2 + 2].iter().collect();
    let stopped_sampling = Sampling {
        stop: vec![stop.clone()],
        ..sampling
    };
    let (g, chunks) = run(&mut engine, &text("hello", stopped_sampling));
    assert_eq!(g.finish, FinishReason::Stop);
    assert!(!g.text.contains(&stop));
    let cut = full.text.find(&stop).unwrap();
    assert_eq!(g.text, full.text[..cut]);
    assert_eq!(
        g.text,
        chunks.iter().map(|c| c.text.as_str()).collect::<String>()
    );
}

#[test]
fn stop_buffer_holds_back_possible_prefixes() {
    let mut s = sampler::StopBuffer::new(&["</end>".to_string()]);
    assert_eq!(s.push("abc<"), sampler::StopCheck::Emit("abc".into()));
    assert_eq!(s.push("/e"), sampler::StopCheck::Emit(String::new()));
    assert_eq!(s.push("x"), sampler::StopCheck::Emit("</ex".into()));
    assert_eq!(s.push("y</en"), sampler::StopCheck::Emit("y".into()));
    assert_eq!(s.push("d>tail"), sampler::StopCheck::Stopped(String::new()));
    let mut s = sampler::StopBuffer::new(&["ab".to_string()]);
    assert_eq!(s.push("xa"), sampler::StopCheck::Emit("x".into()));
    assert_eq!(s.finish(), "a");
}

#[test]
fn sampler_is_seeded_and_filters() {
    let logits: Vec<f32> = (0..100).map(|i| ((i * 37) % 17) as f32 * 0.3).collect();
    let draw = |s: &Sampling| {
        let mut sampler = sampler::Sampler::new(s);
        (0..30)
            .map(|_| sampler.sample(&mut logits.clone(), &[], 0))
            .collect::<Vec<_>>()
    };
    let hot = Sampling {
        temperature: 1.5,
        seed: 1,
        ..Sampling::default()
    };
    assert_eq!(draw(&hot), draw(&hot));
    assert_ne!(
        draw(&hot),
        draw(&Sampling {
            seed: 2,
            ..hot.clone()
        })
    );
    let top1 = Sampling {
        top_k: 1,
        ..hot.clone()
    };
    let best = sampler::argmax(&logits);
    assert!(draw(&top1).iter().all(|&t| t == best));
    let min_p = Sampling {
        min_p: 0.99,
        ..hot.clone()
    };
    assert!(draw(&min_p)
        .iter()
        .all(|&t| logits[t as usize] == logits[best as usize]));
    // A penalty on the best token moves greedy elsewhere.
    let mut l = logits.clone();
    let mut s = sampler::Sampler::new(&Sampling {
        repetition_penalty: 100.0,
        ..Sampling::default()
    });
    assert_ne!(s.sample(&mut l, &[best], 1), best);
}

#[test]
fn detokenizer_streams_whole_characters() {
    let mut d = tokenizer::Detokenizer::default();
    let bytes = "é日🎉".as_bytes();
    let mut out = String::new();
    for b in bytes {
        let piece = d.push(&[*b]);
        assert!(piece.chars().count() <= 1);
        out.push_str(&piece);
    }
    assert_eq!(out, "é日🎉");
    assert_eq!(d.push(&[0xff, b'a']), "\u{fffd}a");
    assert_eq!(d.push(&[0xe6]), "");
    assert_eq!(d.finish(), "\u{fffd}");
}

#[test]
fn sentencepiece_tokenizer_round_trips() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("spm.gguf");
    testutil::write_spm_gguf(&path);
    let engine = Engine::load(&path).unwrap();
    let ids = engine.tokenize("hello world").unwrap();
    // "▁hello" and "▁world" are whole pieces of the vocabulary, each reachable
    // by merging two pieces at a time (as in a real SentencePiece BPE vocabulary).
    assert_eq!(ids.len(), 2, "{ids:?}");
    assert_eq!(engine.detokenize(&ids), " hello world");
    // Characters outside the vocabulary fall back to bytes.
    let ids = engine.tokenize("hé").unwrap();
    assert_eq!(engine.detokenize(&ids), " hé");
    // BOS is added for SentencePiece models.
    let p = engine
        .prompt_tokens(&PromptInput::Text("hello".into()))
        .unwrap();
    assert_eq!(p[0], 1);
}

#[test]
fn chat_template_renders_and_rejects() {
    let t = template::ChatTemplate::new(testutil::CHATML).unwrap();
    let turns = vec![ChatTurn {
        role: "user".into(),
        content: "Hi".into(),
    }];
    assert_eq!(
        t.render(&turns, "", "").unwrap(),
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    );
    let strict = template::ChatTemplate::new(
        "{% if messages[0]['role'] != 'system' %}{{ raise_exception('first message must be system') }}{% endif %}{{ messages[0]['content'].strip() }}",
    )
    .unwrap();
    let e = strict.render(&turns, "", "").unwrap_err();
    assert!(e.is_client_error());
    assert!(
        e.to_string().contains("first message must be system"),
        "{e}"
    );
    let ok = vec![ChatTurn {
        role: "system".into(),
        content: "  padded  ".into(),
    }];
    assert_eq!(strict.render(&ok, "", "").unwrap(), "padded");
    assert!(template::ChatTemplate::new("{% if %}").is_err());
}

// ---------------------------------------------------------------- gemma 3

/// Last-position logits of `tokens` from a fresh cache.
fn last_logits(engine: &mut Engine, tokens: &[u32]) -> Vec<f32> {
    engine.model.reset(tokens.len());
    engine.model.forward(tokens).unwrap()
}

#[test]
fn gemma3_windowed_layers_see_only_their_window() {
    let dir = tempfile::tempdir().unwrap();
    // Both layers local (pattern 6), window 4: the last of 12 positions
    // depends on positions 12 - 2 * 3 - 1 = 5 and later only.
    let spec = TinySpec::new("gemma3");
    let mut local = Engine::load(&tiny_gguf(dir.path(), &spec, GgmlDType::F32)).unwrap();
    assert_eq!(local.info().architecture, "gemma3");
    let a: Vec<u32> = (3..15).collect();
    let mut far = a.clone();
    far[0] = 200;
    far[3] = 201;
    let mut near = a.clone();
    near[6] = 202;
    let base = last_logits(&mut local, &a);
    assert_eq!(
        base,
        last_logits(&mut local, &far),
        "tokens outside the window changed the output"
    );
    assert_ne!(
        base,
        last_logits(&mut local, &near),
        "a token inside the window must matter"
    );

    // Layer 1 global (pattern 2): every position matters again.
    let global_spec = TinySpec {
        sliding_window: Some((4, 2)),
        ..TinySpec::new("gemma3")
    };
    let sub = dir.path().join("global");
    std::fs::create_dir_all(&sub).unwrap();
    let mut mixed = Engine::load(&tiny_gguf(&sub, &global_spec, GgmlDType::F32)).unwrap();
    assert_ne!(last_logits(&mut mixed, &a), last_logits(&mut mixed, &far));
    // The window holds the same in a batched prefill and one token at a time.
    let mut single = Vec::new();
    local.model.reset(a.len());
    for &t in &a {
        single = local.model.forward(&[t]).unwrap();
    }
    let diff = base
        .iter()
        .zip(&single)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max);
    assert!(
        diff < 1e-3,
        "batched and one-by-one prefill differ by {diff}"
    );
}

#[test]
fn gemma3_config_reads_its_hyper_parameters() {
    let dir = tempfile::tempdir().unwrap();
    let spec = TinySpec::new("gemma3");
    let engine = Engine::load(&tiny_gguf(dir.path(), &spec, GgmlDType::Q8_0)).unwrap();
    let cfg = engine.model.cfg();
    assert!(cfg.post_norms && cfg.qk_norm && !cfg.rope_interleaved);
    assert_eq!(cfg.activation, config::Activation::GeluTanh);
    assert_eq!(cfg.embed_scale, (spec.hidden as f32).sqrt());
    assert_eq!(cfg.attn_scale, 1.0 / (spec.head_dim as f32).sqrt());
    let w = cfg.sliding_window.as_ref().unwrap();
    assert_eq!((w.window, w.pattern, w.rope_theta), (4, 6, 10_000.0));
    // Tied head, two extra norms per layer counted.
    let h = spec.hidden as u64;
    let per_layer = 4 * h
        + 2 * spec.head_dim as u64
        + (2 * (spec.heads + spec.kv_heads) * spec.head_dim) as u64 * h
        + 3 * (spec.ffn as u64) * h;
    let embed = testutil::tiny_vocab().len() as u64 * h;
    assert_eq!(
        engine.info().parameters,
        embed + h + spec.layers as u64 * per_layer
    );
}

// ---------------------------------------------------------------- the real model

pub(super) const MODEL_PATH: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../models/SmolLM2-135M-Instruct.Q4_1.gguf"
);
const REFERENCE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/src/engine/testdata/llama_cpp_reference.json"
);

pub(super) fn smollm() -> std::sync::MutexGuard<'static, Engine> {
    static ENGINE: OnceLock<Mutex<Engine>> = OnceLock::new();
    ENGINE
        .get_or_init(|| {
            let path = Path::new(MODEL_PATH);
            assert!(
                path.exists(),
                "the test model {MODEL_PATH} is missing: run scripts/fetch-test-model.sh"
            );
            Mutex::new(Engine::load(path).unwrap())
        })
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

pub(super) fn reference() -> serde_json::Value {
    let text = std::fs::read_to_string(REFERENCE).unwrap_or_else(|e| {
        panic!("{REFERENCE}: {e} (regenerate with scripts/llama_cpp_reference.py)")
    });
    serde_json::from_str(&text).unwrap()
}

fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// Below this gap between llama.cpp's best and second-best logit, a step is a
/// near tie: llama.cpp itself picks differently there depending on how it is
/// run. Measured with llama-cpp-python 0.3.36 on the three reference prompts
/// (scripts/llama_cpp_reference.py records the margins): flash attention and
/// token-by-token prefill both leave the reference at a step with margin
/// 0.12, an f32 KV cache at one with margin 0.33; 2 threads vs 1 thread and
/// batched prefill agree everywhere. Our engine (8-row repacked kernels, which
/// sum each block's integer dot exactly before scaling where ggml scales 8
/// partial sums) leaves it at the fibonacci prompt's step 12, margin 0.12, the
/// same step as llama.cpp's flash attention.
pub(super) const NEAR_TIE: f32 = 0.35;

/// Tokens of each reference prompt (in the file's order) that equal
/// llama.cpp's today, id for id: all 32 of the first, 12 of the fibonacci
/// prompt (it leaves at step 12, a near tie of margin 0.12, see
/// [`NEAR_TIE`]), all 7 of the chat prompt; 51 of 71 in all. A change that
/// makes any prompt leave earlier fails, even at a near tie.
const MATCHED_TODAY: [usize; 3] = [32, 12, 7];

/// The reference's greedy prompts as requests, in the file's order, after
/// checking that `engine` tokenizes each as llama.cpp did.
fn reference_requests(engine: &Engine, reference: &serde_json::Value) -> Vec<GenerateRequest> {
    let n_predict = reference["n_predict"].as_u64().unwrap() as usize;
    let cases = reference["greedy"].as_array().unwrap();
    cases
        .iter()
        .map(|case| {
            let prompt = case["prompt"].as_str().unwrap();
            let input = PromptInput::Text(prompt.to_string());
            assert_eq!(
                engine.prompt_tokens(&input).unwrap(),
                ids(&case["prompt_tokens"]),
                "prompt tokens of {prompt:?}"
            );
            text(prompt, greedy(n_predict))
        })
        .collect()
}

/// Every reference prompt run alone by `Engine::generate`.
fn generate_alone(engine: &mut Engine, reference: &serde_json::Value) -> Vec<Generation> {
    let requests = reference_requests(engine, reference);
    requests.iter().map(|r| run(engine, r).0).collect()
}

/// Each batched job's end, by index, once it came.
type Ends = Arc<Mutex<Vec<Option<Result<Generation, String>>>>>;

/// Where one batched job's end goes.
struct KeepEnd {
    index: usize,
    ends: Ends,
}

impl batch::JobSink for KeepEnd {
    fn token(&mut self, _: &TokenChunk) -> ControlFlow<()> {
        ControlFlow::Continue(())
    }
    fn done(self: Box<Self>, result: Result<Generation, EngineError>) {
        let mut ends = self.ends.lock().unwrap();
        assert!(ends[self.index].is_none(), "job {} ended twice", self.index);
        ends[self.index] = Some(result.map_err(|e| e.to_string()));
    }
}

/// Every reference prompt run in one continuous batch over `engine`'s
/// model and a paged KV pool, as the node serves them: prompt `i` joins at
/// step `3 * i`, and each pass takes at most 64 tokens, so a long prompt is
/// prefilled in chunks beside the others' decoding.
fn generate_batched(engine: &mut Engine, reference: &serde_json::Value) -> Vec<Generation> {
    let requests = reference_requests(engine, reference);
    let cfg = batch::BatchConfig {
        slots: requests.len(),
        kv_pages: 256,
        step_tokens: 64,
        prefix_cache: true,
    };
    let mut b = batch::Batcher::new(&engine.model, engine.text.clone(), cfg).unwrap();
    let ends: Ends = Arc::new(Mutex::new(vec![None; requests.len()]));
    let mut step = 0;
    loop {
        for (i, r) in requests.iter().enumerate() {
            if 3 * i == step {
                let sink = KeepEnd {
                    index: i,
                    ends: ends.clone(),
                };
                b.submit(r, Box::new(sink), std::time::Instant::now());
            }
        }
        let worked = b.step(&mut engine.model);
        step += 1;
        assert!(step < 10_000, "the batch does not finish");
        if step > 3 * requests.len() && !worked && b.is_idle() {
            break;
        }
    }
    let ends = std::mem::take(&mut *ends.lock().unwrap());
    ends.into_iter()
        .enumerate()
        .map(|(i, end)| {
            end.unwrap_or_else(|| panic!("job {i} got no answer"))
                .unwrap_or_else(|e| panic!("job {i} failed: {e}"))
        })
        .collect()
}

/// Greedy outputs of every reference prompt (`outputs`, in the file's
/// order) against llama.cpp's ids: equal token for token, except that after
/// a near tie (llama.cpp's top-2 margin below `near_tie`) the two may
/// branch, and every prompt must match at least as many tokens as
/// `matched_today` says (one figure per prompt). Returns the tokens compared.
fn greedy_against_llama_cpp(
    outputs: &[Generation],
    reference: &serde_json::Value,
    near_tie: f32,
    matched_today: &[usize],
) -> usize {
    let mut compared_total = 0;
    let cases = reference["greedy"].as_array().unwrap();
    assert_eq!(
        cases.len(),
        matched_today.len(),
        "one figure per reference prompt"
    );
    assert_eq!(
        cases.len(),
        outputs.len(),
        "one output per reference prompt"
    );
    for ((case, &today), g) in cases.iter().zip(matched_today).zip(outputs) {
        let prompt = case["prompt"].as_str().unwrap();
        let want = ids(&case["output_tokens"]);
        let margins: Vec<f32> = case["top2_margins"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m.as_f64().unwrap() as f32)
            .collect();
        // Every token equals llama.cpp's. The one allowance: at a near tie
        // the two engines may take different branches, after which the texts
        // differ and comparing further means nothing.
        let compared = match g
            .output_token_ids
            .iter()
            .zip(&want)
            .position(|(a, b)| a != b)
        {
            None => {
                assert_eq!(g.output_token_ids.len(), want.len(), "length of {prompt:?}");
                want.len()
            }
            Some(step) => {
                assert!(
                    margins[step] < near_tie,
                    "greedy output of {prompt:?} leaves llama.cpp's at step {step}, where \
                     llama.cpp's top-2 margin is {} (not a near tie): ours {:?}, llama.cpp {:?}",
                    margins[step],
                    &g.output_token_ids[..=step],
                    &want[..=step]
                );
                step
            }
        };
        eprintln!(
            "{:?}: {compared} of {} tokens equal llama.cpp's",
            &prompt[..prompt.len().min(40)],
            want.len()
        );
        // The near-tie allowance must not swallow the comparison: every
        // prompt matches at least as far as it does today.
        assert!(
            compared >= today,
            "{prompt:?}: {compared} tokens equal llama.cpp's, {today} did before"
        );
        compared_total += compared;
    }
    compared_total
}

#[test]
fn smollm_greedy_matches_llama_cpp() {
    let reference = reference();
    let outputs = generate_alone(&mut smollm(), &reference);
    let compared = greedy_against_llama_cpp(&outputs, &reference, NEAR_TIE, &MATCHED_TODAY);
    assert!(compared >= MATCHED_TODAY.iter().sum::<usize>());
}

#[test]
fn smollm_chat_prompt_matches_llama_cpp_template_rendering() {
    let reference = reference();
    let question = reference["chat_question"].as_str().unwrap();
    let chat_case = reference["greedy"]
        .as_array()
        .unwrap()
        .last()
        .unwrap()
        .clone();
    let system = reference["chat_system"].as_str().unwrap();
    let engine = smollm();
    let input = PromptInput::Chat(vec![
        ChatTurn {
            role: "system".into(),
            content: system.into(),
        },
        ChatTurn {
            role: "user".into(),
            content: question.into(),
        },
    ]);
    assert_eq!(
        engine.prompt_tokens(&input).unwrap(),
        ids(&chat_case["prompt_tokens"])
    );
}

/// The chat job "What is the capital of France?" with a plain system
/// prompt, greedy, 64 tokens.
pub(super) fn capital_of_france() -> GenerateRequest {
    // With the template's default system prompt this small model rambles
    // (llama.cpp too, greedy); a plain system prompt gets a straight answer.
    GenerateRequest {
        input: PromptInput::Chat(vec![
            ChatTurn {
                role: "system".into(),
                content: "You are a helpful assistant.".into(),
            },
            ChatTurn {
                role: "user".into(),
                content: "What is the capital of France?".into(),
            },
        ]),
        sampling: greedy(64),
        resume: Resume::default(),
    }
}

#[test]
fn smollm_knows_the_capital_of_france() {
    let mut engine = smollm();
    let request = capital_of_france();
    let (g, chunks) = run(&mut engine, &request);
    assert!(g.text.contains("Paris"), "answer: {:?}", g.text);
    assert_eq!(g.finish, FinishReason::Eos, "{g:?}");
    assert_eq!(
        g.text,
        chunks.iter().map(|c| c.text.as_str()).collect::<String>()
    );
}

#[test]
fn smollm_same_seed_same_output_different_seed_differs() {
    let mut engine = smollm();
    let sampling = |seed| Sampling {
        temperature: 0.9,
        top_p: 0.95,
        top_k: 50,
        seed,
        max_tokens: 32,
        ..Sampling::default()
    };
    let prompt = "Write a short poem about the sea.";
    let (a, _) = run(&mut engine, &chat(prompt, sampling(1)));
    let (b, _) = run(&mut engine, &chat(prompt, sampling(1)));
    let (c, _) = run(&mut engine, &chat(prompt, sampling(2)));
    assert_eq!(a.output_token_ids, b.output_token_ids);
    assert_eq!(a.text, b.text);
    assert_ne!(a.output_token_ids, c.output_token_ids);
}

#[test]
fn smollm_tokenizer_matches_llama_cpp() {
    let reference = reference();
    let engine = smollm();
    let mut failures = Vec::new();
    for case in reference["tokenize"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        let got = engine.tokenize(text).unwrap();
        if got != ids(&case["ids"]) {
            failures.push(format!(
                "{text:?}: ours {got:?}, llama.cpp {:?}",
                ids(&case["ids"])
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn smollm_long_prompt_prefill_in_one_batch_equals_token_by_token() {
    // 128 tokens: past the length where attention and the matmuls split work
    // across threads and activation rows differently than for one token.
    let mut engine = smollm();
    let text = include_str!("../../benches/prompt-128.txt");
    let mut prompt = engine.tokenize(text).unwrap();
    prompt.truncate(128);
    engine.model.reset(prompt.len());
    let batch = engine.model.forward(&prompt).unwrap();
    engine.model.reset(prompt.len());
    let mut single = Vec::new();
    for &t in &prompt {
        single = engine.model.forward(&[t]).unwrap();
    }
    let argmax = |v: &[f32]| {
        v.iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .map(|(i, _)| i)
            .unwrap()
    };
    let max_diff = batch
        .iter()
        .zip(&single)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(max_diff < 0.05, "logits differ by up to {max_diff}");
    assert_eq!(argmax(&batch), argmax(&single));
}

/// A job resumed from any token of an earlier attempt continues that
/// attempt's stream: indices go on from the cut, the texts join without a
/// gap or a repeat, and the tokens are the uninterrupted run's (greedy, and
/// sampled with the same seed, since the sampler skips the resumed draws).
#[test]
fn smollm_resumed_generation_continues_the_uninterrupted_stream() {
    let mut engine = smollm();
    let sampled = Sampling {
        temperature: 0.8,
        top_k: 40,
        seed: 7,
        max_tokens: 40,
        ..Sampling::default()
    };
    for sampling in [greedy(40), sampled] {
        let request = chat("Tell me a story about a lighthouse keeper.", sampling);
        let (full, chunks) = run(&mut engine, &request);
        assert!(chunks.len() > 20, "the reference run is too short");
        for cut in [1, 7, chunks.len() - 1] {
            let resumed = GenerateRequest {
                resume: Resume {
                    token_ids: chunks[..cut].iter().map(|c| c.token_id).collect(),
                    text: chunks[..cut].iter().map(|c| c.text.as_str()).collect(),
                },
                ..request.clone()
            };
            let (rest, rest_chunks) = run(&mut engine, &resumed);
            assert_eq!(rest_chunks[0].index, cut, "indices go on from the cut");
            let mut ids = resumed.resume.token_ids.clone();
            ids.extend(&rest.output_token_ids);
            assert_eq!(ids, full.output_token_ids, "cut at {cut}");
            assert_eq!(resumed.resume.text + &rest.text, full.text, "cut at {cut}");
            assert_eq!(rest.finish, full.finish);
        }
    }
    // Text the client does not have is refused, not silently repeated.
    let bad = GenerateRequest {
        resume: Resume {
            token_ids: vec![1, 2],
            text: "not the tokens' text".into(),
        },
        ..chat("Hi", greedy(4))
    };
    let err = engine
        .generate(&bad, &mut |_| ControlFlow::Continue(()))
        .unwrap_err();
    assert!(matches!(err, EngineError::ResumeMismatch), "{err}");
    // An id outside the vocabulary (from a hostile node, through the
    // coordinator) is refused as the request's fault; it panicked before.
    let foreign = GenerateRequest {
        resume: Resume {
            token_ids: vec![1, u32::MAX],
            text: String::new(),
        },
        ..chat("Hi", greedy(4))
    };
    let err = engine
        .generate(&foreign, &mut |_| ControlFlow::Continue(()))
        .unwrap_err();
    assert!(
        matches!(err, EngineError::ResumeToken { id: u32::MAX, .. }),
        "{err}"
    );
    assert!(err.is_client_error());
}

// ---------------------------------------------------------------- gemma 3 270m

const GEMMA_PATH: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../models/gemma-3-270m-q4_k_m.gguf"
);
const GEMMA_REFERENCE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/src/engine/testdata/llama_cpp_reference_gemma3.json"
);

fn gemma() -> std::sync::MutexGuard<'static, Engine> {
    static ENGINE: OnceLock<Mutex<Engine>> = OnceLock::new();
    ENGINE
        .get_or_init(|| {
            let path = Path::new(GEMMA_PATH);
            assert!(
                path.exists(),
                "the test model {GEMMA_PATH} is missing: run scripts/fetch-test-model.sh"
            );
            Mutex::new(Engine::load(path).unwrap())
        })
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Tokens of each Gemma reference prompt (in the file's order) that equal
/// llama.cpp's today, id for id, run in one batch (see [`MATCHED_TODAY`]):
/// 11 of the capital prompt (it leaves at step 11, a near tie of margin
/// 0.035), 23 of the fibonacci prompt (step 23, margin 0.25), all 32 of the
/// 650-token lighthouse prompt (past the 512-position window); 66 of 96.
const GEMMA_MATCHED_TODAY: [usize; 3] = [11, 23, 32];

fn gemma_reference() -> serde_json::Value {
    let text = std::fs::read_to_string(GEMMA_REFERENCE).unwrap_or_else(|e| {
        panic!("{GEMMA_REFERENCE}: {e} (regenerate with scripts/llama_cpp_reference.py gemma3)")
    });
    serde_json::from_str(&text).unwrap()
}

#[test]
fn gemma3_greedy_matches_llama_cpp() {
    let reference = gemma_reference();
    assert_eq!(
        reference["model_sha256"].as_str(),
        Some("a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818")
    );
    let mut engine = gemma();
    assert_eq!(engine.info().architecture, "gemma3");
    // As the node serves it: in a continuous batch over the paged KV pool.
    let outputs = generate_batched(&mut engine, &reference);
    let compared = greedy_against_llama_cpp(&outputs, &reference, NEAR_TIE, &GEMMA_MATCHED_TODAY);
    assert!(compared >= GEMMA_MATCHED_TODAY.iter().sum::<usize>());
}

#[test]
fn gemma3_tokenizer_matches_llama_cpp() {
    let reference = gemma_reference();
    let engine = gemma();
    let mut failures = Vec::new();
    for case in reference["tokenize"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        let got = engine.tokenize(text).unwrap();
        if got != ids(&case["ids"]) {
            failures.push(format!(
                "{text:?}: ours {got:?}, llama.cpp {:?}",
                ids(&case["ids"])
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn streamed_tokens_carry_their_logprobs_and_asking_for_them_changes_no_token() {
    let dir = tempfile::tempdir().unwrap();
    let mut engine = tiny_engine(dir.path());
    for temperature in [0.0, 1.0] {
        let plain = Sampling {
            temperature,
            seed: 7,
            ..greedy(12)
        };
        let asked = Sampling {
            logprobs: Some(5),
            ..plain.clone()
        };
        let (want, plain_chunks) = run(&mut engine, &text("hello", plain));
        let (got, chunks) = run(&mut engine, &text("hello", asked));
        assert_eq!(
            got.output_token_ids, want.output_token_ids,
            "t={temperature}"
        );
        assert!(plain_chunks.iter().all(|c| c.logprobs.is_none()));
        assert!(!chunks.is_empty());
        for c in &chunks {
            let l = c.logprobs.as_ref().expect("every chunk has its logprobs");
            assert_eq!(l.chosen.token_id, c.token_id);
            assert_eq!(
                l.chosen.bytes,
                engine.text.tokenizer.token_bytes(c.token_id)
            );
            assert!(l.chosen.logprob <= 0.0 && l.chosen.logprob.is_finite());
            assert_eq!(l.top.len(), 5);
            assert!(l.top.windows(2).all(|w| w[0].logprob >= w[1].logprob));
            assert!(l.top.iter().all(|t| t.logprob <= 0.0));
            assert!(l.chosen.logprob <= l.top[0].logprob);
            if temperature == 0.0 {
                // Greedy: the chosen token is the most probable one.
                assert_eq!(l.top[0].token_id, c.token_id);
                assert_eq!(l.top[0].logprob, l.chosen.logprob);
            }
        }
    }
}

/// The audit of a claim that `req` produced `tokens`, with `g`'s finish
/// reason and prompt count (what a node would sign).
pub(super) fn claim_of(
    engine: &Engine,
    req: &GenerateRequest,
    g: &Generation,
    tokens: Vec<u32>,
) -> AuditRequest {
    AuditRequest {
        input: req.input.clone(),
        sampling: req.sampling.clone(),
        resume: Resume::default(),
        facts: audit::ClaimFacts {
            finish_reason: g.finish.as_str().into(),
            prompt_tokens: g.prompt_tokens as u32,
            completion_tokens: tokens.len() as u32,
            output_token_ids_len: tokens.len(),
            output_text: engine.detokenize(&tokens),
        },
        output_token_ids: tokens,
    }
}

/// The verdict on a claim that `req` produced `g`.
fn audit_of(engine: &mut Engine, req: &GenerateRequest, g: &Generation) -> audit::Verdict {
    let claim = claim_of(engine, req, g, g.output_token_ids.clone());
    engine.audit(&claim).unwrap()
}

#[test]
fn penalties_and_logit_bias_steer_generation_and_the_audit_holds_nodes_to_them() {
    let dir = tempfile::tempdir().unwrap();
    let mut engine = tiny_engine(dir.path());
    for temperature in [0.0, 1.0] {
        let plain = Sampling {
            temperature,
            seed: 11,
            ..greedy(24)
        };
        let (unsteered, _) = run(&mut engine, &text("hello", plain.clone()));
        // The plain run's first token, banned; and the penalties on.
        let first = unsteered.output_token_ids[0];
        let steered = Sampling {
            presence_penalty: 1.5,
            frequency_penalty: 0.75,
            logit_bias: vec![(first, -100.0)],
            ..plain.clone()
        };
        let req = text("hello", steered.clone());
        let (g, chunks) = run(&mut engine, &req);
        assert!(
            !g.output_token_ids.contains(&first),
            "t={temperature}: banned {first} in {:?}",
            g.output_token_ids
        );
        // An honest node that applied them passes its audit.
        let v = audit_of(&mut engine, &req, &g);
        assert!(v.passed(), "t={temperature}: honest {v:?}");
        // A node that ignored them (claims the plain run for the steered
        // job) is caught.
        let v = audit_of(&mut engine, &req, &unsteered);
        assert!(!v.passed(), "t={temperature}: ignored {v:?}");
        // A resumed generation counts the resumed tokens as generated: it
        // continues the uninterrupted stream.
        let cut = 5;
        let resumed = GenerateRequest {
            resume: Resume {
                token_ids: g.output_token_ids[..cut].to_vec(),
                text: chunks[..cut].iter().map(|c| c.text.as_str()).collect(),
            },
            ..req.clone()
        };
        let (rest, _) = run(&mut engine, &resumed);
        let mut ids = resumed.resume.token_ids.clone();
        ids.extend(&rest.output_token_ids);
        assert_eq!(ids, g.output_token_ids, "t={temperature}: resumed at {cut}");
    }
    // Out of range, or an id outside the vocabulary: a client error.
    let vocab = engine.text.tokenizer.vocab_len() as u32;
    for bad in [
        Sampling {
            frequency_penalty: 2.5,
            ..greedy(4)
        },
        Sampling {
            logit_bias: vec![(vocab, 1.0)],
            ..greedy(4)
        },
    ] {
        let e = engine
            .generate(&text("hello", bad), &mut |_| ControlFlow::Continue(()))
            .unwrap_err();
        assert!(
            matches!(e, EngineError::InvalidSampling(_)) && e.is_client_error(),
            "{e}"
        );
    }
}

/// A small schema the e2e test uses too: bounded fields, so a complete
/// object fits a short `max_tokens`.
const PERSON_SCHEMA: &str = r#"{"type":"object","properties":{"name":{"type":"string","minLength":1,"maxLength":12},"age":{"type":"integer","minimum":0,"maximum":120},"member":{"type":"boolean"}},"required":["name","age","member"],"additionalProperties":false}"#;

/// Checks `text` against [`PERSON_SCHEMA`] by hand.
fn is_person(text: &str) -> Result<(), String> {
    let v: serde_json::Value = serde_json::from_str(text).map_err(|e| format!("{e}: {text}"))?;
    let o = v.as_object().ok_or(format!("not an object: {text}"))?;
    let name = o["name"].as_str().ok_or(format!("name: {text}"))?;
    let ok = o.len() == 3
        && (1..=12).contains(&name.chars().count())
        && o["age"].as_u64().is_some_and(|a| a <= 120)
        && o["member"].is_boolean();
    ok.then_some(())
        .ok_or(format!("does not fit the schema: {text}"))
}

#[test]
fn smollm_json_schema_output_parses_validates_and_passes_its_audit() {
    use mlxnet_proto::grammar::Constraint;
    let mut engine = smollm();
    let schema = Constraint::JsonSchema(PERSON_SCHEMA.into());
    let prompt = "Describe a person as JSON with name, age and member.";
    let sampling = |temperature, seed| Sampling {
        temperature,
        seed,
        max_tokens: 40,
        grammar: Some(schema.clone()),
        ..Sampling::default()
    };
    // Greedy: valid, ends by the model's own EOS once the object closes,
    // and its claim passes the audit; the free-text output is not JSON.
    let req = chat(prompt, sampling(0.0, 0));
    let (g, chunks) = run(&mut engine, &req);
    is_person(&g.text).unwrap();
    assert_eq!(g.finish, FinishReason::Eos, "{g:?}");
    assert_eq!(
        g.text,
        chunks.iter().map(|c| c.text.as_str()).collect::<String>()
    );
    let v = audit_of(&mut engine, &req, &g);
    assert!(v.passed(), "{v:?}");
    let free = chat(
        prompt,
        Sampling {
            grammar: None,
            ..sampling(0.0, 0)
        },
    );
    let (f, _) = run(&mut engine, &free);
    assert!(is_person(&f.text).is_err(), "{}", f.text);
    // The free output claimed for the constrained job: caught by the grammar.
    let cheat = claim_of(&engine, &req, &f, f.output_token_ids.clone());
    let v = engine.audit(&cheat).unwrap();
    assert!(
        matches!(
            v.findings.first(),
            Some(audit::Finding::OutsideGrammar { .. })
        ),
        "{v:?}"
    );
    // Sampled at T=1, 20 seeds (50 more in the e2e): each valid; the first
    // few audited.
    for seed in 0..20 {
        let req = chat(prompt, sampling(1.0, seed));
        let (g, _) = run(&mut engine, &req);
        is_person(&g.text).unwrap_or_else(|e| panic!("seed {seed}: {e}"));
        if seed < 3 {
            let v = audit_of(&mut engine, &req, &g);
            assert!(v.passed(), "seed {seed}: {v:?}");
        }
    }
    // json_object: an object, whatever its keys.
    let req = chat(
        prompt,
        Sampling {
            grammar: Some(Constraint::JsonObject),
            ..sampling(0.0, 0)
        },
    );
    // (Greedy SmolLM2 nests `{"name":{"name":...` until max_tokens here:
    // any object is allowed, so only a complete answer must parse.)
    let (g, _) = run(&mut engine, &req);
    assert!(g.text.starts_with('{'), "{}", g.text);
    if g.finish == FinishReason::Eos {
        let v: serde_json::Value =
            serde_json::from_str(&g.text).unwrap_or_else(|e| panic!("{e}: {}", g.text));
        assert!(v.is_object(), "{}", g.text);
    }
    let v = audit_of(&mut engine, &req, &g);
    assert!(v.passed(), "{v:?}");
    // A schema the engine cannot enforce: the client's error.
    let bad = chat(
        prompt,
        Sampling {
            grammar: Some(Constraint::JsonSchema(
                r#"{"type":"array","uniqueItems":true}"#.into(),
            )),
            ..sampling(0.0, 0)
        },
    );
    let e = engine
        .generate(&bad, &mut |_| ControlFlow::Continue(()))
        .unwrap_err();
    assert!(
        matches!(e, EngineError::InvalidSampling(_)) && e.is_client_error(),
        "{e}"
    );
}

/// Resumed jobs are audited like any other claim: the finisher's claim and
/// a drained node's hand-off segment are each scored after the tokens
/// before them (the penalties count those, `length` counts them toward
/// `max_tokens`), and pass when honest; a fabricated segment fails.
#[test]
fn a_resumed_claim_and_a_handoff_segment_are_audited_after_the_tokens_before_them() {
    let dir = tempfile::tempdir().unwrap();
    let mut engine = tiny_engine(dir.path());
    for temperature in [0.0, 1.0] {
        let plain = Sampling {
            temperature,
            seed: 11,
            frequency_penalty: 0.75,
            ..greedy(16)
        };
        // A token the job bans: claiming it is a cheat at any temperature.
        let (unsteered, _) = run(&mut engine, &text("hello", plain.clone()));
        let banned = unsteered.output_token_ids[0];
        let sampling = Sampling {
            logit_bias: vec![(banned, -100.0)],
            ..plain
        };
        let req = text("hello", sampling);
        let (g, chunks) = run(&mut engine, &req);
        assert!(g.output_token_ids.len() > 9, "t={temperature}: {g:?}");
        let (cut, end) = (5, 9);
        let streamed = |from: usize, to: usize| -> String {
            chunks[from..to].iter().map(|c| c.text.as_str()).collect()
        };
        let prefix = Resume {
            token_ids: g.output_token_ids[..cut].to_vec(),
            text: streamed(0, cut),
        };
        let base = claim_of(&engine, &req, &g, Vec::new());
        let claim = |resume: &Resume, ids: Vec<u32>, text: String, finish: &str| AuditRequest {
            resume: resume.clone(),
            facts: audit::ClaimFacts {
                finish_reason: finish.into(),
                prompt_tokens: (g.prompt_tokens + resume.token_ids.len()) as u32,
                completion_tokens: ids.len() as u32,
                output_token_ids_len: ids.len(),
                output_text: text,
            },
            output_token_ids: ids,
            ..base.clone()
        };

        // The finisher's honest claim, resumed after `cut`.
        let (rest, _) = run(
            &mut engine,
            &GenerateRequest {
                resume: prefix.clone(),
                ..req.clone()
            },
        );
        assert_eq!(rest.output_token_ids, g.output_token_ids[cut..]);
        let finisher = claim(
            &prefix,
            rest.output_token_ids.clone(),
            rest.text.clone(),
            rest.finish.as_str(),
        );
        assert_eq!(finisher.facts.prompt_tokens as usize, rest.prompt_tokens);
        let v = engine.audit(&finisher).unwrap();
        assert!(v.passed(), "t={temperature}: honest resumed claim {v:?}");

        // A drained node's honest segment: tokens cut..end, its streamed text.
        let segment = claim(
            &prefix,
            g.output_token_ids[cut..end].to_vec(),
            streamed(cut, end),
            mlxnet_proto::claim::FINISH_HANDOFF,
        );
        let v = engine.audit(&segment).unwrap();
        assert!(v.passed(), "t={temperature}: honest segment {v:?}");

        // A fabricated segment: the banned token, four times.
        let junk = vec![banned; 4];
        let text = engine.detokenize(&junk);
        let fabricated = claim(&prefix, junk, text, mlxnet_proto::claim::FINISH_HANDOFF);
        let v = engine.audit(&fabricated).unwrap();
        assert!(!v.passed(), "t={temperature}: fabricated segment {v:?}");
    }
}
