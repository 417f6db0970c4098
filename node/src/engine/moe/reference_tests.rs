//! `qwen3moe` against llama.cpp: random-weight files written by
//! [`testutil::write_gguf`] and run by llama.cpp (llama-cpp-python, through
//! `scripts/llama_cpp_reference.py qwen3moe`), whose greedy tokens and top
//! logits at every step are recorded in `testdata/llama_cpp_reference_qwen3moe.json`.
//!
//! Why: the MoE tests beside this one check the engine against itself (a MoE
//! of identical experts against its dense twin, batched against alone); only
//! an independent implementation shows that routing, the expert cut of the
//! stacked tensors, Qwen3's q/k norms and the weighted sum are what the file
//! format means.
//!
//! How: each file is written again here from its spec; its SHA-256 must be
//! the one recorded (else the writer changed and the reference must be
//! regenerated). The engine is teacher-forced on llama.cpp's own tokens, so a
//! step that differs does not change the steps after it. At each step:
//! - the engine's logits at llama.cpp's top tokens are within the file's
//!   tolerance ([`tolerance`]) of llama.cpp's;
//! - the engine's greedy token equals llama.cpp's unless llama.cpp's own
//!   margin between its best and second-best logit is under twice that
//!   tolerance (logits within it cannot order a wider gap otherwise). This
//!   is stricter than the SmolLM2 test's `engine::tests::NEAR_TIE`
//!   (0.35): these random models' top logits are only about 0.2 apart;
//! - except at a router near tie: a step where some layer's router had its
//!   k-th and (k+1)-th expert within [`ROUTER_TIE`] of each other may
//!   choose the other expert than llama.cpp (the hidden state differs by
//!   rounding), and then its logits differ by more. Such steps are counted
//!   and printed; a step beyond tolerance with no router near tie fails.
//!
//! Files: top-2 of 8 experts in F16, Q8_0 and Q4_K (experts 256 wide, the
//! K-quants' block), and every expert used (`used == experts`, where no
//! routing choice exists to sit near a tie) in F16 and Q8_0.
//!
//! Writing the files for the script: `MLXNET_MOE_REFERENCE_DIR=<dir> cargo
//! nextest run -p mlx-node --run-ignored only -E 'test(write_the_reference_files)'`.

use std::path::Path;

use candle_core::quantized::GgmlDType;
use sha2::{Digest, Sha256};

use crate::engine::moe::ROUTER_MARGINS;
use crate::engine::testutil::{self, GgufTweaks, MoeSpec, TinySpec};
use crate::engine::Engine;

const REFERENCE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/src/engine/testdata/llama_cpp_reference_qwen3moe.json"
);

/// Largest difference allowed between the engine's logit and llama.cpp's at
/// each of llama.cpp's top tokens of a step, by tensor type. Measured with
/// llama-cpp-python 0.3.36 on these files (largest differences outside
/// router near ties: F16 0.0024, Q8_0 0.029, Q4_K 0.044), and set at about
/// 2.5 to 4 times that, for other ISAs' rounding; a wrong expert or scale
/// moves these logits by tenths to whole units.
fn tolerance(dtype: GgmlDType) -> f32 {
    match dtype {
        GgmlDType::F16 => 0.01,
        GgmlDType::Q8_0 => 0.08,
        _ => 0.1,
    }
}

/// A router margin (k-th minus (k+1)-th logit) under this is a near tie.
const ROUTER_TIE: f32 = 0.01;

/// Steps per file allowed beyond tolerance at a router near tie: one seen
/// (routed-Q8_0, margin printed by the test), room for one more elsewhere.
const MAX_ROUTER_TIE_STEPS: usize = 2;

/// The reference files: name, spec, tensor type.
fn files() -> Vec<(&'static str, TinySpec, GgmlDType)> {
    let moe = |used, ffn| TinySpec {
        ffn,
        moe: Some(MoeSpec {
            experts: 8,
            used,
            identical: false,
        }),
        ..TinySpec::new("qwen3moe")
    };
    vec![
        ("routed-F16", moe(2, 128), GgmlDType::F16),
        ("routed-Q8_0", moe(2, 128), GgmlDType::Q8_0),
        ("routed-Q4_K", moe(2, 256), GgmlDType::Q4K),
        ("every-F16", moe(8, 128), GgmlDType::F16),
        ("every-Q8_0", moe(8, 128), GgmlDType::Q8_0),
    ]
}

fn write_all(dir: &Path) -> Vec<(&'static str, GgmlDType, std::path::PathBuf)> {
    files()
        .into_iter()
        .map(|(name, spec, dtype)| {
            let path = dir.join(format!("qwen3moe-{name}.gguf"));
            testutil::write_gguf(&path, &spec, dtype, &GgufTweaks::default());
            (name, dtype, path)
        })
        .collect()
}

fn sha256(path: &Path) -> String {
    hex::encode(Sha256::digest(std::fs::read(path).unwrap()))
}

/// Writes the reference files into `MLXNET_MOE_REFERENCE_DIR` for
/// `scripts/llama_cpp_reference.py qwen3moe <dir>`.
#[test]
#[ignore = "writes the files llama.cpp's reference is recorded from"]
fn write_the_reference_files() {
    let dir = std::env::var("MLXNET_MOE_REFERENCE_DIR").expect("MLXNET_MOE_REFERENCE_DIR");
    std::fs::create_dir_all(&dir).unwrap();
    for (name, _, path) in write_all(Path::new(&dir)) {
        println!("{name} {} {}", path.display(), sha256(&path));
    }
}

fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

#[test]
fn qwen3moe_greedy_and_logits_match_llama_cpp() {
    let text = std::fs::read_to_string(REFERENCE).unwrap_or_else(|e| {
        panic!("{REFERENCE}: {e} (regenerate with scripts/llama_cpp_reference.py qwen3moe)")
    });
    let reference: serde_json::Value = serde_json::from_str(&text).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let written = write_all(dir.path());
    let recorded = reference["files"].as_array().unwrap();
    assert_eq!(
        recorded.len(),
        written.len(),
        "the reference records other files than this test writes"
    );
    let mut report = Vec::new();
    let mut wrong = Vec::new();
    for ((name, dtype, path), file) in written.iter().zip(recorded) {
        assert_eq!(file["name"].as_str().unwrap(), *name);
        assert_eq!(
            file["sha256"].as_str().unwrap(),
            sha256(path),
            "{name}: the writer no longer writes the file the reference was recorded from: \
             regenerate with scripts/llama_cpp_reference.py qwen3moe"
        );
        let tol = tolerance(*dtype);
        let mut engine = Engine::load(path).unwrap();
        let (mut steps, mut same, mut ties, mut router_ties, mut worst) = (0, 0, 0, 0, 0f32);
        for (p, case) in file["greedy"].as_array().unwrap().iter().enumerate() {
            let prompt = ids(&case["prompt_tokens"]);
            let output = ids(&case["output_tokens"]);
            let margins = case["top2_margins"].as_array().unwrap();
            let tops = case["top_logits"].as_array().unwrap();
            engine.model.reset(prompt.len() + output.len());
            ROUTER_MARGINS.with(|m| m.borrow_mut().clear());
            let mut logits = engine.model.forward(&prompt).unwrap();
            for (s, &want) in output.iter().enumerate() {
                // The smallest router margin of this step's token (the
                // prompt's last token at step 0), over every layer.
                // Each layer routes every token of a pass in order.
                let router = ROUTER_MARGINS.with(|m| {
                    let m = std::mem::take(&mut *m.borrow_mut());
                    let tokens = if s == 0 { prompt.len() } else { 1 };
                    m.iter()
                        .skip(tokens - 1)
                        .step_by(tokens)
                        .copied()
                        .fold(f32::INFINITY, f32::min)
                });
                steps += 1;
                let mut beyond = 0f32;
                for pair in tops[s].as_array().unwrap() {
                    let id = pair[0].as_u64().unwrap() as usize;
                    let theirs = pair[1].as_f64().unwrap() as f32;
                    beyond = beyond.max((logits[id] - theirs).abs());
                }
                let at_router_tie = router < ROUTER_TIE;
                if !(beyond > tol && at_router_tie) {
                    worst = worst.max(beyond);
                }
                if beyond > tol && at_router_tie {
                    router_ties += 1;
                    println!(
                        "{name} prompt {p} step {s}: logits differ by {beyond:.4} at a router near tie (margin {router:.5})"
                    );
                } else if beyond > tol {
                    wrong.push(format!(
                        "{name} prompt {p} step {s}: a logit differs by {beyond} from llama.cpp's \
                         (tolerance {tol}; smallest router margin {router})"
                    ));
                }
                let ours = argmax(&logits);
                let margin = margins[s].as_f64().unwrap() as f32;
                if ours == want {
                    same += 1;
                } else if margin < 2.0 * tol || at_router_tie {
                    ties += 1;
                } else {
                    wrong.push(format!(
                        "{name} prompt {p} step {s}: ours {ours}, llama.cpp {want} (margin {margin})"
                    ));
                }
                logits = engine.model.forward(&[want]).unwrap();
            }
        }
        if router_ties > MAX_ROUTER_TIE_STEPS {
            wrong.push(format!(
                "{name}: {router_ties} steps beyond tolerance at router near ties (at most {MAX_ROUTER_TIE_STEPS})"
            ));
        }
        report.push(format!(
            "{name}: {same} of {steps} greedy tokens equal, {ties} near ties; largest logit \
             difference {worst:.5} (tolerance {tol}) apart from {router_ties} steps at router near ties"
        ));
    }
    println!("{}", report.join("\n"));
    assert!(
        wrong.is_empty(),
        "{}\n{}",
        report.join("\n"),
        wrong.join("\n")
    );
}

fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] {
            best = i;
        }
    }
    best as u32
}
