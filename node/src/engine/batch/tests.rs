//! The batch against the engine alone, on the real SmolLM2 model: every
//! sequence's tokens, text and stream must equal those of the same request
//! run alone by `Engine::generate`, exactly (see the module's invariant:
//! the kernels give each row the same result whatever else is in the pass,
//! so no tolerance is needed; a difference is a bug).

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::*;
use crate::engine::tests::{claim_of, run};
use crate::engine::{ChatTurn, FinishReason, PromptInput, Resume, Sampling};

const MODEL: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../models/SmolLM2-135M-Instruct.Q4_1.gguf"
);

fn engine() -> Engine {
    let path = Path::new(MODEL);
    assert!(
        path.exists(),
        "the test model {MODEL} is missing: run scripts/fetch-test-model.sh"
    );
    Engine::load(path).unwrap()
}

/// What a job's sink saw.
#[derive(Debug, Default)]
struct Seen {
    chunks: Vec<TokenChunk>,
    result: Option<Result<Generation, String>>,
}

type Board = Arc<Mutex<BTreeMap<usize, Seen>>>;

/// Records into `board[key]`; cancels by flag (polled) or after
/// `break_after` tokens (by the token's answer).
struct Recorder {
    key: usize,
    board: Board,
    cancel: Arc<AtomicBool>,
    /// Set the flag once this many tokens arrived.
    flag_after: Option<usize>,
    break_after: Option<usize>,
}

impl Recorder {
    fn new(key: usize, board: &Board) -> Recorder {
        Recorder {
            key,
            board: board.clone(),
            cancel: Arc::default(),
            flag_after: None,
            break_after: None,
        }
    }
}

impl JobSink for Recorder {
    fn token(&mut self, chunk: &TokenChunk) -> ControlFlow<()> {
        let mut board = self.board.lock().unwrap();
        let seen = board.entry(self.key).or_default();
        seen.chunks.push(chunk.clone());
        let n = seen.chunks.len();
        if self.flag_after == Some(n) {
            self.cancel.store(true, Ordering::Relaxed);
        }
        if self.break_after == Some(n) {
            ControlFlow::Break(())
        } else {
            ControlFlow::Continue(())
        }
    }
    fn cancelled(&self) -> bool {
        self.cancel.load(Ordering::Relaxed)
    }
    fn done(self: Box<Self>, result: Result<Generation, EngineError>) {
        let mut board = self.board.lock().unwrap();
        let seen = board.entry(self.key).or_default();
        assert!(seen.result.is_none(), "job {} answered twice", self.key);
        seen.result = Some(result.map_err(|e| e.to_string()));
    }
}

/// The engine's model, and a batch over it with the prefix cache on.
fn batcher(
    engine: Engine,
    slots: usize,
    kv_pages: usize,
    step_tokens: usize,
) -> (EngineModel, Batcher) {
    let Engine { model, text, .. } = engine;
    let cfg = BatchConfig {
        slots,
        kv_pages,
        step_tokens,
        prefix_cache: true,
    };
    let b = Batcher::new(&model, text, cfg).unwrap();
    (model, b)
}

fn chat(system: &str, question: &str, sampling: Sampling) -> GenerateRequest {
    let mut turns = Vec::new();
    if !system.is_empty() {
        turns.push(ChatTurn {
            role: "system".into(),
            content: system.into(),
        });
    }
    turns.push(ChatTurn {
        role: "user".into(),
        content: question.into(),
    });
    GenerateRequest {
        input: PromptInput::Chat(turns),
        sampling,
        resume: Resume::default(),
    }
}

fn text(prompt: &str, sampling: Sampling) -> GenerateRequest {
    GenerateRequest {
        input: PromptInput::Text(prompt.into()),
        sampling,
        resume: Resume::default(),
    }
}

const QUESTIONS: [&str; 8] = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis to a child.",
    "List three uses of a paperclip.",
    "Why is the sky blue?",
    "Tell me a story about a lighthouse keeper.",
    "What is 12 times 7?",
    "Name a famous painting and its painter.",
];

/// Sixteen different requests: chat and raw text, greedy and sampled, with
/// a stop string, a repetition penalty, different lengths.
fn mixed_requests(rng: &mut ChaCha8Rng) -> Vec<GenerateRequest> {
    (0..16)
        .map(|i| {
            let mut s = Sampling {
                max_tokens: rng.gen_range(4..24),
                ..Sampling::default()
            };
            match i % 4 {
                1 => {
                    s.temperature = 0.8;
                    s.top_k = 40;
                    s.top_p = 0.95;
                    s.seed = i as u64;
                }
                2 => s.repetition_penalty = 1.3,
                3 => s.stop = vec![".".into()],
                _ => {}
            }
            let q = QUESTIONS[i % QUESTIONS.len()];
            match i % 3 {
                0 => chat("You are a helpful assistant.", q, s),
                1 => chat("", q, s),
                _ => text(&format!("Question: {q}\nAnswer:"), s),
            }
        })
        .collect()
}

/// Every page is free or cached once nothing runs.
fn assert_pages_accounted(b: &Batcher) {
    assert!(b.is_idle());
    assert_eq!(
        b.pool.free_pages() + b.prefix.pages(),
        b.pool.pages(),
        "pages leaked"
    );
}

fn assert_same(key: usize, seen: &Seen, want: &(Generation, Vec<TokenChunk>)) {
    let got = seen
        .result
        .as_ref()
        .unwrap_or_else(|| panic!("job {key} got no answer"))
        .as_ref()
        .unwrap_or_else(|e| panic!("job {key} failed: {e}"));
    assert_eq!(
        got.output_token_ids, want.0.output_token_ids,
        "tokens of job {key}"
    );
    assert_eq!(got.text, want.0.text, "text of job {key}");
    assert_eq!(got.finish, want.0.finish, "finish of job {key}");
    assert_eq!(got.prompt_tokens, want.0.prompt_tokens);
    assert_eq!(seen.chunks, want.1, "stream of job {key}");
}

/// Runs `requests` through `b`, each submitted at its step in `join`,
/// until every one is answered.
fn drive(
    b: &mut Batcher,
    model: &mut dyn BatchModel,
    requests: &[GenerateRequest],
    join: &[usize],
    sinks: &mut dyn FnMut(usize, &Board) -> Recorder,
) -> Board {
    let board: Board = Arc::default();
    let last = join.iter().copied().max().unwrap_or(0);
    let mut step = 0;
    loop {
        for (i, r) in requests.iter().enumerate() {
            if join[i] == step {
                b.submit(r, Box::new(sinks(i, &board)), Instant::now());
            }
        }
        let worked = b.step(model);
        step += 1;
        assert!(step < 10_000, "the batch does not finish");
        if step > last && !worked && b.is_idle() {
            break;
        }
    }
    board
}

#[test]
fn batched_outputs_equal_solo_for_16_mixed_sequences_joining_and_leaving_at_random_steps() {
    let mut rng = ChaCha8Rng::seed_from_u64(25);
    let mut engine = engine();
    let mut requests = mixed_requests(&mut rng);
    // One more kind: a hand-off resumed from another attempt's tokens.
    let (first, chunks) = run(&mut engine, &requests[0]);
    assert!(first.output_token_ids.len() > 4, "{first:?}");
    requests[8].resume = Resume {
        token_ids: first.output_token_ids[..3].to_vec(),
        text: chunks[..3].iter().map(|c| c.text.as_str()).collect(),
    };
    requests[8].input = requests[0].input.clone();
    requests[8].sampling = requests[0].sampling.clone();
    let want: Vec<_> = requests.iter().map(|r| run(&mut engine, r)).collect();
    let join: Vec<usize> = (0..16).map(|_| rng.gen_range(0..40)).collect();
    let Engine {
        mut model, text, ..
    } = engine;
    let shape = model.kv_shape();
    let cfg = BatchConfig {
        slots: 6,
        kv_pages: 256,
        step_tokens: 40,
        prefix_cache: true,
    };
    assert_eq!(shape.layers, 30);
    let mut b = Batcher::new(&model, text, cfg).unwrap();
    let board = drive(&mut b, &mut model, &requests, &join, &mut |i, board| {
        Recorder::new(i, board)
    });
    let board = board.lock().unwrap();
    for (i, w) in want.iter().enumerate() {
        assert_same(i, &board[&i], w);
    }
    let stats = b.stats();
    assert!(stats.steps > 0 && stats.preemptions == 0, "{stats:?}");
    assert!(
        stats.prefix_hit_tokens > 0,
        "the chat template's shared start was never reused: {stats:?}"
    );
    assert_pages_accounted(&b);
}

#[test]
fn a_pool_too_small_for_the_load_preempts_and_still_completes_every_job() {
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let mut engine = engine();
    // Story openings, which the model continues to the length cap.
    let requests: Vec<GenerateRequest> = (0..5)
        .map(|i| {
            let s = Sampling {
                max_tokens: 40,
                temperature: if i % 2 == 1 { 0.7 } else { 0.0 },
                seed: i as u64,
                ..Sampling::default()
            };
            text(&format!("Chapter {}. The old lighthouse keeper", i + 1), s)
        })
        .collect();
    let want: Vec<_> = requests.iter().map(|r| run(&mut engine, r)).collect();
    let longest = want
        .iter()
        .map(|(g, _)| g.prompt_tokens + g.output_token_ids.len())
        .max()
        .unwrap();
    let Engine {
        mut model, text, ..
    } = engine;
    // Room for the longest job and two pages: admission lets three start
    // (their prompts fit), and they cannot all grow to their length.
    let pages = KvShape::pages_for(longest) + 2;
    for prefix_cache in [true, false] {
        let cfg = BatchConfig {
            slots: 5,
            kv_pages: pages,
            step_tokens: 64,
            prefix_cache,
        };
        let mut b = Batcher::new(&model, text.clone(), cfg).unwrap();
        let join: Vec<usize> = (0..5).map(|_| rng.gen_range(0..3)).collect();
        let board = drive(&mut b, &mut model, &requests, &join, &mut |i, board| {
            Recorder::new(i, board)
        });
        {
            let board = board.lock().unwrap();
            for (i, w) in want.iter().enumerate() {
                assert_same(i, &board[&i], w);
            }
        }
        let stats = b.stats();
        assert!(
            stats.preemptions > 0,
            "a pool of {pages} pages never ran short: {stats:?}"
        );
        assert_pages_accounted(&b);
    }
}

#[test]
fn cancelling_one_sequence_leaves_the_others_untouched() {
    let mut engine = engine();
    let requests: Vec<GenerateRequest> = (0..5)
        .map(|i| {
            chat(
                "",
                QUESTIONS[i],
                Sampling {
                    max_tokens: 24,
                    ..Sampling::default()
                },
            )
        })
        .collect();
    let want: Vec<_> = requests.iter().map(|r| run(&mut engine, r)).collect();
    let (mut model, mut b) = batcher(engine, 3, 128, 32);
    let mut waiting_cancel = None;
    let board = drive(
        &mut b,
        &mut model,
        &requests,
        &[0, 0, 0, 0, 0],
        &mut |i, board| {
            let mut r = Recorder::new(i, board);
            match i {
                // Cancelled by its client (the flag) after 3 tokens.
                1 => r.flag_after = Some(3),
                // Its sink refuses the 5th token.
                2 => r.break_after = Some(5),
                // Gives up while it still waits for a slot.
                4 => {
                    r.cancel.store(true, Ordering::Relaxed);
                    waiting_cancel = Some(r.cancel.clone());
                }
                _ => {}
            }
            r
        },
    );
    assert!(waiting_cancel.is_some());
    let board = board.lock().unwrap();
    for i in [0, 3] {
        assert_same(i, &board[&i], &want[i]);
    }
    for (i, streamed) in [(1usize, 3usize), (2, 5), (4, 0)] {
        let seen = board.get(&i);
        let chunks = seen.map_or(&[][..], |s| &s.chunks[..]);
        let g = seen
            .and_then(|s| s.result.as_ref())
            .unwrap_or_else(|| panic!("job {i} got no answer"))
            .as_ref()
            .unwrap();
        assert_eq!(g.finish, FinishReason::Cancelled, "job {i}");
        assert_eq!(chunks.len(), streamed, "job {i} streamed");
        assert_eq!(g.output_token_ids.len(), streamed, "job {i}");
        assert_eq!(
            chunks,
            &want[i].1[..streamed],
            "job {i}'s tokens before the cancel"
        );
    }
    assert_pages_accounted(&b);
}

/// A long shared system prompt, then different questions.
fn long_system() -> String {
    let sentence = "You are a careful assistant for a library; you answer briefly, cite the \
        shelf a book stands on, and never invent titles. ";
    sentence.repeat(8)
}

#[test]
fn prefix_cache_hits_give_the_same_outputs_as_misses() {
    let mut engine = engine();
    let system = long_system();
    let greedy = Sampling {
        max_tokens: 16,
        ..Sampling::default()
    };
    let sampled = Sampling {
        temperature: 0.9,
        seed: 5,
        ..greedy.clone()
    };
    let requests = vec![
        chat(&system, QUESTIONS[0], greedy.clone()),
        chat(&system, QUESTIONS[1], greedy.clone()),
        chat(&system, QUESTIONS[0], greedy),
        chat(&system, QUESTIONS[2], sampled),
    ];
    let want: Vec<_> = requests.iter().map(|r| run(&mut engine, r)).collect();
    let prompt = want[0].0.prompt_tokens;
    assert!(prompt > 150, "the shared prompt is {prompt} tokens");
    let (mut model, mut b) = batcher(engine, 4, 128, 256);
    // One after the other, so each later one finds the earlier ones' pages.
    let board = drive(
        &mut b,
        &mut model,
        &requests,
        &[0, 30, 60, 90],
        &mut |i, board| Recorder::new(i, board),
    );
    let board = board.lock().unwrap();
    for (i, w) in want.iter().enumerate() {
        assert_same(i, &board[&i], w);
    }
    let stats = b.stats();
    // Each later job reuses at least the system prompt's whole pages.
    let shared = (prompt - 20) / PAGE * PAGE;
    assert!(
        stats.prefix_hit_tokens >= 3 * shared as u64,
        "{stats:?}, shared prefix {shared}"
    );
    assert_pages_accounted(&b);
}

#[test]
fn audits_in_a_batch_give_the_verdicts_of_an_audit_alone() {
    let mut engine = engine();
    let job = chat(
        "",
        QUESTIONS[5],
        Sampling {
            max_tokens: 20,
            ..Sampling::default()
        },
    );
    let (g, _) = run(&mut engine, &job);
    let audit = |tokens: Vec<u32>| claim_of(&engine, &job, &g, tokens);
    let honest = audit(g.output_token_ids.clone());
    let mut forged = g.output_token_ids.clone();
    forged[3] = (forged[3] + 1000) % 49_152;
    let forged = audit(forged);
    let want = [
        engine.audit(&honest).unwrap(),
        engine.audit(&forged).unwrap(),
    ];
    assert!(want[0].passed() && !want[1].passed(), "{want:?}");
    let (mut model, mut b) = batcher(engine, 4, 128, 16);
    let verdicts: Arc<Mutex<BTreeMap<usize, Verdict>>> = Arc::default();
    let board: Board = Arc::default();
    b.submit(&job, Box::new(Recorder::new(0, &board)), Instant::now());
    for (i, req) in [honest, forged].iter().enumerate() {
        let v = verdicts.clone();
        b.audit(
            req,
            Box::new(move |r| {
                v.lock().unwrap().insert(i, r.unwrap());
            }),
        );
    }
    while b.step(&mut model) {}
    let verdicts = verdicts.lock().unwrap();
    assert_eq!(verdicts[&0], want[0]);
    assert_eq!(verdicts[&1], want[1]);
    let board = board.lock().unwrap();
    assert_eq!(
        board[&0]
            .result
            .as_ref()
            .unwrap()
            .as_ref()
            .unwrap()
            .output_token_ids,
        g.output_token_ids
    );
    assert_pages_accounted(&b);
}

#[test]
fn requests_the_engine_refuses_or_the_pool_cannot_hold_are_answered_at_once() {
    let (mut model, mut b) = batcher(engine(), 2, 3, 32);
    let board: Board = Arc::default();
    let empty = text_request("", 4);
    b.submit(&empty, Box::new(Recorder::new(0, &board)), Instant::now());
    // 3 pages hold 48 positions; this one may need 100.
    let long = text_request("Once upon a time", 100);
    b.submit(&long, Box::new(Recorder::new(1, &board)), Instant::now());
    let fits = text_request("Once upon a time", 8);
    b.submit(&fits, Box::new(Recorder::new(2, &board)), Instant::now());
    while b.step(&mut model) {}
    let board = board.lock().unwrap();
    let err = |i: usize| {
        board[&i]
            .result
            .as_ref()
            .unwrap()
            .as_ref()
            .unwrap_err()
            .clone()
    };
    assert!(err(0).contains("empty prompt"), "{}", err(0));
    assert!(err(1).contains("kv cache"), "{}", err(1));
    assert!(board[&1].chunks.is_empty(), "refused before any token");
    let g = board[&2].result.as_ref().unwrap().as_ref().unwrap();
    assert_eq!(g.output_token_ids.len(), 8);
    assert_pages_accounted(&b);
}

fn text_request(prompt: &str, max_tokens: usize) -> GenerateRequest {
    text(
        prompt,
        Sampling {
            max_tokens,
            ..Sampling::default()
        },
    )
}

/// The thread front: jobs submitted from other threads all come back.
#[test]
fn the_batch_thread_answers_every_job_from_any_thread() {
    let engine = engine();
    let shape = engine.model.kv_shape();
    let thread = BatchThread::for_engine(engine, BatchConfig::new(4, shape, 64 << 20)).unwrap();
    let board: Board = Arc::default();
    let handles: Vec<_> = (0..6)
        .map(|i| {
            let (t, board) = (thread.clone(), board.clone());
            std::thread::spawn(move || {
                let (tx, rx) = std::sync::mpsc::channel();
                struct Signal(Recorder, std::sync::mpsc::Sender<()>);
                impl JobSink for Signal {
                    fn token(&mut self, c: &TokenChunk) -> ControlFlow<()> {
                        self.0.token(c)
                    }
                    fn done(self: Box<Self>, r: Result<Generation, EngineError>) {
                        let Signal(rec, tx) = *self;
                        Box::new(rec).done(r);
                        let _ = tx.send(());
                    }
                }
                t.generate(
                    text_request(QUESTIONS[i], 6),
                    Box::new(Signal(Recorder::new(i, &board), tx)),
                );
                rx.recv().unwrap();
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    let board = board.lock().unwrap();
    assert_eq!(board.len(), 6);
    for seen in board.values() {
        let g = seen.result.as_ref().unwrap().as_ref().unwrap();
        assert_eq!(g.output_token_ids.len().min(6), g.output_token_ids.len());
    }
    assert_eq!(thread.stats().slots, 4);
}

#[test]
fn the_device_path_runs_one_sequence_at_a_time_with_the_outputs_of_its_own_generate() {
    use crate::engine::device::Backend;
    let mut rng = ChaCha8Rng::seed_from_u64(18);
    let mut engine =
        Engine::load_on(Path::new(MODEL), &Backend::Device(candle_core::Device::Cpu)).unwrap();
    // Greedy with a system prompt, sampled, with a repetition penalty.
    let requests: Vec<GenerateRequest> = mixed_requests(&mut rng)
        .into_iter()
        .take(3)
        .map(|mut r| {
            r.sampling.max_tokens = r.sampling.max_tokens.min(8);
            r
        })
        .collect();
    let want: Vec<_> = requests.iter().map(|r| run(&mut engine, r)).collect();
    // Asked for four slots, 16-token steps and the prefix cache, the device
    // model gets one slot, `generate`'s prefill chunks and no cache (its
    // keys live on the device, not in the pool).
    let (mut model, mut b) = batcher(engine, 4, 64, 16);
    assert_eq!(b.stats().slots, 1);
    let board = drive(
        &mut b,
        &mut model,
        &requests,
        &[0, 0, 1],
        &mut |i, board| Recorder::new(i, board),
    );
    let board = board.lock().unwrap();
    for (i, w) in want.iter().enumerate() {
        assert_same(i, &board[&i], w);
    }
    let stats = b.stats();
    assert_eq!(stats.prefix_hit_tokens, 0, "{stats:?}");
    assert_eq!(stats.prefix_pages, 0, "{stats:?}");
    assert_pages_accounted(&b);
}
