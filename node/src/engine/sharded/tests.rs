//! A split model must compute what the whole model computes: logits within
//! 1e-3 (relative to the largest logit) of the unsplit engine's at every
//! step, and the same greedy tokens, for tensor parallel over 2 (uneven) and
//! 3 ranks and pipeline parallel over 2 and 3 stages, on a random-weight
//! model and on SmolLM2-135M.

use std::path::{Path, PathBuf};

use candle_core::quantized::GgmlDType;

use super::*;
use crate::collectives::tcp::TcpOptions;
use crate::collectives::tests::tcp_pod;
use crate::collectives::GroupOptions;
use crate::engine::audit;
use crate::engine::model::Model;
use crate::engine::testutil::{self, GgufTweaks, TinySpec};

const SMOLLM: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../models/SmolLM2-135M-Instruct.Q4_1.gguf"
);

/// The unsplit engine's greedy run: logits of every step, tokens.
fn reference(path: &Path, prompt: &[u32], steps: usize) -> (Vec<Vec<f32>>, Vec<u32>) {
    let file = GgufFile::open(path).unwrap();
    let vocab = file.tensors.get("token_embd.weight").map(|e| e.shape[0]);
    let cfg = ModelConfig::from_gguf(&file.metadata, vocab).unwrap();
    let mut m = Model::load(cfg, &WeightSource::Gguf(&file)).unwrap();
    m.reset(prompt.len() + steps);
    let (mut logits, mut out) = (Vec::new(), Vec::new());
    let mut step: Vec<u32> = prompt.to_vec();
    for _ in 0..steps {
        let l = m.forward(&step).unwrap();
        let next = l
            .iter()
            .enumerate()
            .fold(
                (0, f32::NEG_INFINITY),
                |b, (i, &v)| if v > b.1 { (i, v) } else { b },
            )
            .0 as u32;
        logits.push(l);
        out.push(next);
        step = vec![next];
    }
    (logits, out)
}

/// Runs the pod: one thread per rank over TCP on loopback.
fn pod_run(
    path: &Path,
    plan: PodPlan,
    compute: Compute,
    prompt: &[u32],
    steps: usize,
) -> (Vec<Vec<f32>>, Vec<u32>) {
    let n = plan.ranks();
    let comms = tcp_pod(n, TcpOptions::default(), GroupOptions::default());
    let handles: Vec<_> = comms
        .into_iter()
        .enumerate()
        .map(|(rank, mut comm)| {
            let (path, plan) = (path.to_path_buf(), plan.clone());
            let prompt = if rank == 0 {
                prompt.to_vec()
            } else {
                Vec::new()
            };
            std::thread::spawn(move || {
                let mut m = PodModel::load_gguf(&path, plan, rank, compute).unwrap();
                generate_greedy(&mut m, comm.as_mut(), &prompt, steps).unwrap()
            })
        })
        .collect();
    let mut results: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    for (rank, r) in results.iter().enumerate().skip(1) {
        assert!(
            r.0.is_empty() && r.1.is_empty(),
            "rank {rank} produced output"
        );
    }
    results.swap_remove(0)
}

fn assert_same(what: &str, got: &(Vec<Vec<f32>>, Vec<u32>), want: &(Vec<Vec<f32>>, Vec<u32>)) {
    for (step, (g, w)) in got.0.iter().zip(&want.0).enumerate() {
        assert_eq!(g.len(), w.len());
        let scale = w.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let worst = g
            .iter()
            .zip(w)
            .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
        if step == 0 {
            eprintln!(
                "{what}: step 0 max relative logit difference {}",
                worst / scale
            );
        }
        assert!(
            worst / scale <= 1e-3,
            "{what}: step {step} logits differ by {worst} (relative {})",
            worst / scale
        );
    }
    assert_eq!(got.1, want.1, "{what}: greedy tokens differ");
}

fn plans(path: &Path) -> Vec<(String, PodPlan)> {
    let (cfg, unit) = PodModel::ffn_unit(path).unwrap();
    vec![
        (
            "tensor x2".into(),
            PodPlan::tensor(&cfg, unit, &[1.0, 1.0]).unwrap(),
        ),
        (
            "tensor x3".into(),
            PodPlan::tensor(&cfg, unit, &[1.0, 1.0, 1.0]).unwrap(),
        ),
        (
            "pipeline x2".into(),
            PodPlan::pipeline(&cfg, &[2.0, 1.0]).unwrap(),
        ),
        (
            "pipeline x3".into(),
            PodPlan::pipeline(&cfg, &[1.0, 1.0, 1.0]).unwrap(),
        ),
    ]
}

fn random_model(dir: &Path, dtype: GgmlDType) -> PathBuf {
    // Three KV heads so two ranks split them 2 + 1, as SmolLM2's.
    let spec = TinySpec {
        heads: 6,
        kv_heads: 3,
        layers: 3,
        ..TinySpec::new("llama")
    };
    let path = dir.join(format!("tp-{dtype:?}.gguf"));
    testutil::write_gguf(&path, &spec, dtype, &GgufTweaks::default());
    path
}

fn whole_f32(path: &Path, prompt: &[u32], steps: usize) -> (Vec<Vec<f32>>, Vec<u32>) {
    let (cfg, unit) = PodModel::ffn_unit(path).unwrap();
    let one = PodPlan::tensor(&cfg, unit, &[1.0]).unwrap();
    pod_run(path, one, Compute::F32, prompt, steps)
}

#[test]
fn split_random_model_matches_the_whole_model() {
    let dir = tempfile::tempdir().unwrap();
    for dtype in [GgmlDType::F32, GgmlDType::Q4_1] {
        let path = random_model(dir.path(), dtype);
        let prompt = [1u32, 40, 41, 42, 100, 7];
        let want = reference(&path, &prompt, 8);
        let want_f32 = whole_f32(&path, &prompt, 8);
        // One rank is the engine's model exactly.
        let (cfg, unit) = PodModel::ffn_unit(&path).unwrap();
        let one = PodPlan::tensor(&cfg, unit, &[1.0]).unwrap();
        assert_eq!(pod_run(&path, one, Compute::Native, &prompt, 8), want);
        for (name, plan) in plans(&path) {
            if name == "tensor x2" {
                let PodPlan::Tensor { kv_heads, .. } = &plan else {
                    unreachable!()
                };
                assert_eq!(kv_heads, &vec![0..2, 2..3], "uneven split");
            }
            let got = pod_run(&path, plan.clone(), Compute::Native, &prompt, 8);
            if name.starts_with("pipeline") {
                // Whole layers: the same arithmetic, bit for bit.
                assert_eq!(got, want, "{dtype:?} {name}");
            } else if dtype == GgmlDType::F32 {
                assert_same(&format!("{dtype:?} {name}"), &got, &want);
            } else {
                // Quantized compute: the kernels quantize each rank's partial
                // activations to 8 bits per block, so split sums that differ
                // by ~1e-7 can flip a rounding and the difference compounds
                // step after step. Only the first step is held to 1e-3; the
                // f32 comparison below is the exactness check.
                let first = (vec![got.0[0].clone()], Vec::new());
                let first_want = (vec![want.0[0].clone()], Vec::new());
                assert_same(&format!("{dtype:?} {name} first step"), &first, &first_want);
            }
            let got = pod_run(&path, plan, Compute::F32, &prompt, 8);
            assert_same(&format!("{dtype:?} {name} f32"), &got, &want_f32);
        }
    }
}

/// SmolLM2-135M (30 layers, 3 KV heads) with f32 compute: every split within
/// 1e-3 of the whole. Pipeline with the file's own quantized compute is
/// bit-exact. (Tensor parallel with quantized compute is not compared: the
/// per-block quantization of activations turns the 1e-7 differences of the
/// split sums into rounding flips that 30 layers amplify to a few percent.)
#[test]
fn split_smollm2_matches_the_whole_model() {
    let path = Path::new(SMOLLM);
    assert!(
        path.exists(),
        "the test model {SMOLLM} is missing: run scripts/fetch-test-model.sh"
    );
    let engine = crate::engine::Engine::load(path).unwrap();
    let prompt = engine
        .prompt_tokens(&crate::engine::PromptInput::Text(
            "The capital of France is".into(),
        ))
        .unwrap();
    drop(engine);
    let steps = 6;
    let want = reference(path, &prompt, steps);
    let want_f32 = whole_f32(path, &prompt, steps);
    // f32 compute itself agrees with the quantized engine on the first tokens
    // (it may part ways later, where two tokens are nearly tied).
    assert_eq!(want_f32.1[..4], want.1[..4]);
    for (name, plan) in plans(path) {
        if name.starts_with("pipeline") {
            let got = pod_run(path, plan.clone(), Compute::Native, &prompt, steps);
            assert_eq!(got, want, "SmolLM2 {name}");
        }
        let got = pod_run(path, plan, Compute::F32, &prompt, steps);
        assert_same(&format!("SmolLM2 {name} f32"), &got, &want_f32);
    }
}

/// Runs the pod teacher-forced: every rank feeds `prompt`, then each of
/// `forced` one at a time (the same tokens on every rank, whatever rank 0's
/// logits say), so the logits of each step can be compared with the whole
/// model's on the very same sequence. Returns rank 0's logits per step.
fn pod_forced(path: &Path, plan: PodPlan, prompt: &[u32], forced: &[u32]) -> Vec<Vec<f32>> {
    let n = plan.ranks();
    let comms = tcp_pod(n, TcpOptions::default(), GroupOptions::default());
    let handles: Vec<_> = comms
        .into_iter()
        .enumerate()
        .map(|(rank, mut comm)| {
            let (path, plan) = (path.to_path_buf(), plan.clone());
            let (prompt, forced) = (prompt.to_vec(), forced.to_vec());
            std::thread::spawn(move || {
                let mut m = PodModel::load_gguf(&path, plan, rank, Compute::Native).unwrap();
                m.reset(prompt.len() + forced.len());
                let mut out = Vec::new();
                let steps = std::iter::once(prompt).chain(forced.iter().map(|&t| vec![t]));
                for step in steps {
                    if let Some(l) = m.forward(&step, comm.as_mut()).unwrap() {
                        out.push(l);
                    }
                }
                out
            })
        })
        .collect();
    let mut results: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    results.swap_remove(0)
}

fn argmax(v: &[f32]) -> usize {
    v.iter()
        .enumerate()
        .fold(
            (0, f32::NEG_INFINITY),
            |b, (i, &x)| if x > b.1 { (i, x) } else { b },
        )
        .0
}

/// The whole model's logits on `prompt` then each of `forced`.
fn whole_forced(path: &Path, prompt: &[u32], forced: &[u32]) -> Vec<Vec<f32>> {
    let file = GgufFile::open(path).unwrap();
    let vocab = file.tensors.get("token_embd.weight").map(|e| e.shape[0]);
    let cfg = ModelConfig::from_gguf(&file.metadata, vocab).unwrap();
    let mut m = Model::load(cfg, &WeightSource::Gguf(&file)).unwrap();
    m.reset(prompt.len() + forced.len());
    let mut out = vec![m.forward(prompt).unwrap()];
    for &t in forced {
        out.push(m.forward(&[t]).unwrap());
    }
    out
}

/// Largest difference of a tensor-parallel pod's logits (SmolLM2's own
/// quantized compute) from the single node's on the same sequence, at the
/// single node's 10 most likely tokens (where a greedy choice is made). The
/// pod's split sums round differently and the 8-bit activation blocks of
/// the next layer can round the other way, so the pod drifts. Measured:
/// 0.81 logits (tensor x2, "def fibonacci(n):", step 12), larger than the
/// audit's [`audit::GREEDY_MARGIN`] (0.35): at a near tie the pod's greedy
/// token can fall outside the margin, so the margin alone does not rule out
/// accusing an honest pod (see the issue-23 note).
const TP_TOP_DRIFT_BOUND: f32 = 1.2;

/// Relative RMS difference of the pod's whole logit vector from the single
/// node's. Measured: 0.13 (tensor x2, "def fibonacci(n):", step 13).
const TP_REL_DRIFT_BOUND: f32 = 0.2;

/// How far below the single node's best token the pod's greedy choice may
/// sit, and the largest gap its audited jobs may show: half the audit's
/// margin. Measured: 0.059.
const TP_CHOICE_GAP_BOUND: f32 = audit::GREEDY_MARGIN / 2.0;

/// The tensor-parallel pod with quantized compute (what a pod of Macs runs)
/// against the single node, teacher forced so each step compares the same
/// sequence: logits within [`TP_REL_DRIFT_BOUND`] and, at the tokens a
/// greedy choice is made among, within [`TP_TOP_DRIFT_BOUND`]; the pod's
/// greedy choice within [`TP_CHOICE_GAP_BOUND`] of the single node's best;
/// and its own greedy jobs, audited by the single-node engine as the
/// coordinator's auditors do, pass with a gap within that bound.
#[test]
fn tensor_parallel_quantized_smollm2_stays_near_the_single_node_and_passes_its_audits() {
    use crate::engine::{AuditRequest, Engine, PromptInput, Sampling};
    let path = Path::new(SMOLLM);
    assert!(
        path.exists(),
        "the test model {SMOLLM} is missing: run scripts/fetch-test-model.sh"
    );
    let mut engine = Engine::load(path).unwrap();
    let steps = 16;
    // Two prompts (a third, a story opening, drifted less): the test runs
    // four pods per prompt.
    let prompts = ["The capital of France is", "def fibonacci(n):"];
    let (cfg, unit) = PodModel::ffn_unit(path).unwrap();
    let tp = [
        (
            "tensor x2",
            PodPlan::tensor(&cfg, unit, &[1.0, 1.0]).unwrap(),
        ),
        (
            "tensor x3",
            PodPlan::tensor(&cfg, unit, &[1.0, 1.0, 1.0]).unwrap(),
        ),
    ];
    let (mut worst_top, mut worst_rel, mut worst_max, mut worst_gap) = (0f32, 0f32, 0f32, 0f32);
    let mut failures = Vec::new();
    for text in prompts {
        let input = PromptInput::Text(text.into());
        let prompt = engine.prompt_tokens(&input).unwrap();
        // The single node's own greedy continuation is the forced sequence.
        let forced: Vec<u32> = engine
            .greedy_trace(&input, steps)
            .unwrap()
            .into_iter()
            .map(|(t, _)| t)
            .collect();
        let want = whole_forced(path, &prompt, &forced);
        for (name, plan) in &tp {
            let got = pod_forced(path, plan.clone(), &prompt, &forced);
            assert_eq!(got.len(), want.len(), "{name}: steps");
            for (step, (g, w)) in got.iter().zip(&want).enumerate() {
                let max = g.iter().zip(w).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
                let norm = w.iter().map(|x| x * x).sum::<f32>();
                let rel =
                    (g.iter().zip(w).map(|(a, b)| (a - b) * (a - b)).sum::<f32>() / norm).sqrt();
                let mut order: Vec<usize> = (0..w.len()).collect();
                order.sort_by(|a, b| w[*b].total_cmp(&w[*a]));
                let top = order[..10]
                    .iter()
                    .map(|&i| (g[i] - w[i]).abs())
                    .fold(0f32, f32::max);
                // How far below the single node's best the pod's choice is.
                let gap = w[order[0]] - w[argmax(g)];
                (worst_top, worst_rel, worst_max, worst_gap) = (
                    worst_top.max(top),
                    worst_rel.max(rel),
                    worst_max.max(max),
                    worst_gap.max(gap),
                );
                if top > TP_TOP_DRIFT_BOUND || rel > TP_REL_DRIFT_BOUND || gap > TP_CHOICE_GAP_BOUND
                {
                    failures.push(format!(
                        "{name} on {text:?}, step {step}: drift {top} at the top 10 \
                         (bound {TP_TOP_DRIFT_BOUND}), {rel} relative (bound {TP_REL_DRIFT_BOUND}), \
                         the pod's choice {gap} below the best (bound {TP_CHOICE_GAP_BOUND})"
                    ));
                }
            }
            // The pod's own greedy job, audited by the single node.
            let (_, tokens) = pod_run(path, plan.clone(), Compute::Native, &prompt, steps);
            let request = AuditRequest {
                input: input.clone(),
                sampling: Sampling {
                    max_tokens: steps,
                    ..Sampling::default()
                },
                resume: Default::default(),
                output_token_ids: tokens.clone(),
                facts: audit::ClaimFacts {
                    finish_reason: "length".into(),
                    prompt_tokens: prompt.len() as u32,
                    completion_tokens: tokens.len() as u32,
                    output_token_ids_len: tokens.len(),
                    output_text: engine.detokenize(&tokens),
                },
            };
            let verdict = engine.audit(&request).unwrap();
            worst_gap = worst_gap.max(verdict.worst_gap);
            if !verdict.passed() || verdict.worst_gap > TP_CHOICE_GAP_BOUND {
                failures.push(format!(
                    "{name} on {text:?}: the honest pod's job, audited: {verdict:?}"
                ));
            }
        }
    }
    eprintln!(
        "tensor-parallel SmolLM2 (quantized compute) against the single node: largest drift \
         {worst_top:.4} at the top 10, {worst_rel:.4} relative, {worst_max:.4} anywhere; largest \
         gap of the pod's greedy choice {worst_gap:.4} (audit margin {})",
        audit::GREEDY_MARGIN
    );
    assert!(failures.is_empty(), "{failures:#?}");
}

#[test]
fn plans_the_model_cannot_take_are_typed_errors() {
    let dir = tempfile::tempdir().unwrap();
    let path = random_model(dir.path(), GgmlDType::Q8_0);
    let (cfg, unit) = PodModel::ffn_unit(&path).unwrap();
    assert!(matches!(
        PodPlan::tensor(&cfg, unit, &[1.0; 4]),
        Err(ShardError::TooFewUnits {
            what: "kv heads",
            total: 3,
            ranks: 4
        })
    ));
    let bad = PodPlan::Tensor {
        kv_heads: vec![0..1, 2..3],
        ffn: vec![0..256, 256..512],
        vocab: vec![0..100, 100..cfg.vocab_size],
    };
    assert!(matches!(
        PodModel::load_gguf(&path, bad, 0, Compute::Native),
        Err(PodModelError::Plan(_))
    ));
    let plan = PodPlan::pipeline(&cfg, &[1.0, 1.0]).unwrap();
    assert!(matches!(
        PodModel::load_gguf(&path, plan, 2, Compute::Native),
        Err(PodModelError::Plan(_))
    ));
}

/// A pipeline stage refuses, before reading any weight, a layer range whose
/// weights plus KV cache exceed its memory budget; the error names the
/// rank, its layers and the figures. Exactly enough memory loads.
#[test]
fn a_stage_refuses_layers_over_its_memory_budget() {
    let path = PathBuf::from(SMOLLM);
    let file = GgufFile::open(&path).unwrap();
    let vocab = file.tensors.get("token_embd.weight").map(|e| e.shape[0]);
    let cfg = ModelConfig::from_gguf(&file.metadata, vocab).unwrap();
    let plan = PodPlan::pipeline(&cfg, &[1.0, 1.0]).unwrap();
    assert_eq!(plan.describe(1), "layers 15..30");
    let positions = 2048;
    let stage = |rank| share_bytes(&file, &cfg, &plan, rank, Compute::Native, positions).unwrap();
    let ((w0, kv0), (w1, kv1)) = (stage(0), stage(1));
    // f32 keys and values: 15 layers x 2 x 3 kv heads x 64 dims x positions.
    assert_eq!(kv1, 15 * 2 * 3 * 64 * 2048 * 4);
    assert_eq!(kv0, kv1);
    // The stages hold every tensor of the file once, and the tied
    // embedding twice (rank 0 embeds, the last stage's head reads it).
    let total: u64 = file.tensors.values().map(|e| e.len as u64).sum();
    let tied = file.tensors["token_embd.weight"].len as u64;
    assert!(!file.tensors.contains_key("output.weight"));
    assert_eq!(w0 + w1, total + tied);

    let load = |bytes| {
        PodModel::load_gguf_within(
            &path,
            plan.clone(),
            1,
            Compute::Native,
            MemoryBudget { bytes, positions },
        )
    };
    assert!(load(w1 + kv1).is_ok(), "exactly enough memory loads");
    let err = load(w1 + kv1 - 1).unwrap_err();
    match &err {
        PodModelError::OverBudget {
            rank,
            share,
            weights,
            kv,
            positions: p,
            budget,
        } => {
            assert_eq!((*rank, share.as_str()), (1, "layers 15..30"));
            assert_eq!(
                (*weights, *kv, *p, *budget),
                (w1, kv1, positions, w1 + kv1 - 1)
            );
        }
        other => panic!("expected OverBudget, got {other}"),
    }
    let msg = err.to_string();
    assert!(
        msg.starts_with("rank 1 refuses layers 15..30") && msg.contains("exceed its memory budget"),
        "{msg}"
    );
    // The same budget that holds 2048 positions refuses 4096.
    let longer = PodModel::load_gguf_within(
        &path,
        plan.clone(),
        1,
        Compute::Native,
        MemoryBudget {
            bytes: w1 + kv1,
            positions: 4096,
        },
    );
    assert!(matches!(longer, Err(PodModelError::OverBudget { .. })));
}

/// A collective that counts the messages each rank sends and their sizes.
struct Counting<'a> {
    inner: &'a mut dyn Collective,
    sends: Vec<(usize, usize)>,
}

impl Collective for Counting<'_> {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn size(&self) -> usize {
        self.inner.size()
    }
    fn all_reduce_sum(
        &mut self,
        data: &mut [u8],
        dtype: crate::collectives::DType,
    ) -> Result<(), CollectiveError> {
        self.inner.all_reduce_sum(data, dtype)
    }
    fn all_gather(&mut self, input: &[u8], output: &mut [u8]) -> Result<(), CollectiveError> {
        self.inner.all_gather(input, output)
    }
    fn broadcast(&mut self, data: &mut [u8], root: usize) -> Result<(), CollectiveError> {
        self.inner.broadcast(data, root)
    }
    fn send(&mut self, data: &[u8], to: usize) -> Result<(), CollectiveError> {
        self.sends.push((to, data.len()));
        self.inner.send(data, to)
    }
    fn recv(&mut self, data: &mut [u8], from: usize) -> Result<(), CollectiveError> {
        self.inner.recv(data, from)
    }
    fn barrier(&mut self) -> Result<(), CollectiveError> {
        self.inner.barrier()
    }
}

/// A long prompt goes through a pipeline in micro-batches (stage 0 sends
/// one message per chunk to stage 1), and chunked prefill computes what the
/// whole model computes in one pass over the prompt: the same logits, bit
/// for bit, and the same greedy tokens, for 2 and 3 stages and a last chunk
/// shorter than the others.
#[test]
fn pipeline_prefill_in_micro_batches_matches_one_pass() {
    let dir = tempfile::tempdir().unwrap();
    let prompt: Vec<u32> = (0..61).map(|i| 3 + (i * 37 % 250) as u32).collect();
    for dtype in [GgmlDType::F32, GgmlDType::Q4_1] {
        let path = random_model(dir.path(), dtype);
        let want = reference(&path, &prompt, 4);
        let (cfg, _) = PodModel::ffn_unit(&path).unwrap();
        for stages in [2usize, 3] {
            let plan = PodPlan::pipeline(&cfg, &vec![1.0; stages]).unwrap();
            let comms = tcp_pod(stages, TcpOptions::default(), GroupOptions::default());
            let handles: Vec<_> = comms
                .into_iter()
                .enumerate()
                .map(|(rank, mut comm)| {
                    let (path, plan) = (path.clone(), plan.clone());
                    let prompt = if rank == 0 {
                        prompt.clone()
                    } else {
                        Vec::new()
                    };
                    std::thread::spawn(move || {
                        let mut m =
                            PodModel::load_gguf(&path, plan, rank, Compute::Native).unwrap();
                        m.set_micro_batch(Some(16));
                        let mut c = Counting {
                            inner: comm.as_mut(),
                            sends: Vec::new(),
                        };
                        let out = generate_greedy(&mut m, &mut c, &prompt, 4).unwrap();
                        (out, c.sends)
                    })
                })
                .collect();
            let mut results: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
            let h = cfg.hidden_size * 4;
            // 61 tokens in chunks of 16: 16, 16, 16 and 13 tokens; then one
            // token per decode step.
            let prefill: Vec<(usize, usize)> =
                [16, 16, 16, 13].iter().map(|t| (1, t * h)).collect();
            assert_eq!(results[0].1[..4], prefill[..], "{dtype:?} x{stages}");
            let got = results.swap_remove(0).0;
            assert_eq!(got, want, "{dtype:?} pipeline x{stages} in micro-batches");
        }
    }
}

#[test]
fn micro_batches_are_sized_from_the_prompt_and_stages() {
    let dir = tempfile::tempdir().unwrap();
    let path = random_model(dir.path(), GgmlDType::F32);
    let (cfg, _) = PodModel::ffn_unit(&path).unwrap();
    let plan = PodPlan::pipeline(&cfg, &[1.0, 1.0]).unwrap();
    let mut m = PodModel::load_gguf(&path, plan, 0, Compute::Native).unwrap();
    // 2048 tokens over 2 stages: 16 chunks of 128; over 4: 32 of 64.
    assert_eq!(m.micro_batch(2048, 2), 128);
    assert_eq!(m.micro_batch(2048, 4), MIN_MICRO_BATCH);
    // Never below the minimum, never above the engine's prefill chunk,
    // always whole groups of 8 rows.
    assert_eq!(m.micro_batch(1, 2), MIN_MICRO_BATCH);
    assert_eq!(m.micro_batch(100_000, 2), MAX_MICRO_BATCH);
    assert_eq!(m.micro_batch(3000, 2), 192);
    m.set_micro_batch(Some(20));
    assert_eq!(m.micro_batch(2048, 2), 24);
    m.set_micro_batch(Some(0));
    assert_eq!(m.micro_batch(2048, 2), 128, "zero means chosen per pass");
}
