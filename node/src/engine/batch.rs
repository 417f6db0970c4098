//! Continuous batching: one model serving many sequences at once, every
//! step one forward pass over all of them, so the weights are read once for
//! many tokens.
//!
//! # The pieces
//! - The model side, [`BatchModel`]: one pass over [`SeqChunk`]s (each a
//!   sequence's next tokens, its first position and its pages in a shared
//!   [`KvPool`]), returning the logits the chunks ask for. An architecture
//!   plugs in by implementing it (the Llama family: `Model::forward_batch`;
//!   a pod leader: across its pod); [`Pass`] is the common start of every
//!   implementation (the checked rows, tokens and which rows need logits).
//! - The scheduler, [`Batcher`]: sequences join and leave between steps. A
//!   step runs one token of every decoding sequence, and fills the rest of
//!   its token budget ([`BatchConfig::step_tokens`]) with chunks of the
//!   prompts waiting to be prefilled, oldest first, so a long prompt never
//!   stalls the running streams for more than one step. Sampling, stop
//!   strings, resumption and cancellation stay per sequence
//!   ([`super::sequence`]). Audits run the same way, as sequences whose
//!   every row is scored.
//! - Memory: a sequence is admitted when its prompt's pages are free (or
//!   can be freed from the prefix cache); its decode pages are taken one by
//!   one. When the pool runs dry, cached prefixes are evicted first, then
//!   the youngest sequence is preempted: its pages go back (its full pages
//!   into the prefix cache), its tokens and sampler are kept, and it is
//!   computed again when pages free up. Nothing is ever allocated beyond
//!   the pool.
//! - The prefix cache ([`super::prefix`]): an admitted prompt starts from
//!   the longest run of cached pages of its prefix; the pages a sequence
//!   computes are offered to the cache.
//! - The thread, [`BatchThread`]: owns the model and the scheduler, takes
//!   work from a channel, never blocks on a client.
//!
//! # Invariants
//! - A sequence's outputs do not depend on what else runs: the kernels give
//!   every row the result it would get alone (`super::kv`, `super::kernels`),
//!   so a greedy sequence produces the same tokens alone, in any batch,
//!   preempted and recomputed, or started from cached pages.
//! - Every submitted job is answered exactly once ([`JobSink::done`]), with
//!   its generation or an error; a cancelled one with what it streamed.
//! - A page is held by exactly the sequences whose page table lists it and
//!   by the prefix cache; when no job runs, every page is free or cached.
//!
//! # Failure
//! A request the engine refuses (bad sampling, prompt too long) is
//! answered at once with that [`EngineError`]. A sequence that cannot fit
//! the pool even alone fails with [`EngineError::KvPoolTooSmall`]. A failed
//! forward pass fails every sequence in it ([`EngineError::Batch`]); the
//! others go on.

use std::collections::VecDeque;
use std::ops::ControlFlow;
use std::sync::mpsc;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

use super::audit::{AuditPass, Verdict};
use super::device::EngineModel;
use super::kv::{KvPool, KvShape, PageId, RowRun, Rows, PAGE};
use super::model::Model;
use super::prefix::PrefixCache;
use super::sequence::{Begin, Sequence};
use super::{
    AuditRequest, Engine, EngineError, GenerateRequest, Generation, TextSide, TokenChunk,
    PREFILL_CHUNK,
};

/// Which rows of a chunk the pass returns logits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Logits {
    /// None (a prompt chunk that is not the prompt's last).
    None,
    /// The last row (to sample the next token).
    Last,
    /// Rows `from..` of the chunk (an audit scores every position).
    From(usize),
}

/// One sequence's part of a pass: `tokens` at positions `pos..`, stored
/// through `pages` (which cover them).
#[derive(Debug, Clone, Copy)]
pub struct SeqChunk<'a> {
    pub tokens: &'a [u32],
    pub pos: usize,
    pub pages: &'a [PageId],
    pub logits: Logits,
    /// Most positions the sequence will ever hold (what a model keeping
    /// its own cache allocates when the sequence starts at position 0).
    pub capacity: usize,
}

/// A forward pass over several sequences, one pool of pages. Implemented
/// per architecture; the scheduler is the same for all.
pub trait BatchModel {
    /// What one position takes in the pool.
    fn kv_shape(&self) -> KvShape;
    /// Longest sequence (prompt + generated) it accepts.
    fn context_length(&self) -> usize;
    /// Length of a logits row.
    fn vocab_size(&self) -> usize;
    /// Runs every chunk (see [`SeqChunk`]) and returns the logits rows they
    /// ask for, chunk after chunk (`[rows][vocab_size]`). Each chunk's
    /// results must be those it would get alone.
    fn forward_batch(
        &mut self,
        pool: &mut KvPool,
        chunks: &[SeqChunk<'_>],
    ) -> Result<Vec<f32>, EngineError>;
    /// Most sequences one pass may hold: `None` for a model whose keys and
    /// values live in the pool's pages; `Some(1)` for one that keeps a
    /// single sequence's cache itself (the device path), which the
    /// scheduler then runs one sequence at a time, without the prefix cache
    /// (its pages hold nothing for such a model).
    fn max_sequences(&self) -> Option<usize> {
        None
    }
}

impl BatchModel for Model {
    fn kv_shape(&self) -> KvShape {
        Model::kv_shape(self)
    }
    fn context_length(&self) -> usize {
        self.cfg.context_length
    }
    fn vocab_size(&self) -> usize {
        self.cfg.vocab_size
    }
    fn forward_batch(
        &mut self,
        pool: &mut KvPool,
        chunks: &[SeqChunk<'_>],
    ) -> Result<Vec<f32>, EngineError> {
        Model::forward_batch(self, pool, chunks)
    }
}

/// The fast CPU path batches through the pool; the device path runs one
/// sequence at a time in its own device cache.
impl BatchModel for EngineModel {
    fn kv_shape(&self) -> KvShape {
        let cfg = self.cfg();
        KvShape {
            layers: cfg.layers,
            kv_heads: cfg.kv_heads,
            head_dim: cfg.head_dim,
        }
    }
    fn context_length(&self) -> usize {
        self.cfg().context_length
    }
    fn vocab_size(&self) -> usize {
        self.cfg().vocab_size
    }
    fn forward_batch(
        &mut self,
        pool: &mut KvPool,
        chunks: &[SeqChunk<'_>],
    ) -> Result<Vec<f32>, EngineError> {
        match self {
            EngineModel::Native(m) => m.forward_batch(pool, chunks),
            EngineModel::Device(m) => match chunks {
                [chunk] => m.forward_chunk(chunk),
                _ => Err(EngineError::Batch(format!(
                    "the device path runs one sequence per pass, not {}",
                    chunks.len()
                ))),
            },
        }
    }
    fn max_sequences(&self) -> Option<usize> {
        match self {
            EngineModel::Native(_) => None,
            EngineModel::Device(_) => Some(1),
        }
    }
}

/// The checked layout of a pass, the start of every [`BatchModel`]:
/// where each row goes, the tokens to embed, the rows that need logits.
#[derive(Debug)]
pub struct Pass<'a> {
    pub rows: Rows<'a>,
    pub tokens: Vec<u32>,
    /// Rows (of the whole pass) whose logits are returned, in order.
    pub logit_rows: Vec<usize>,
}

impl<'a> Pass<'a> {
    /// Checks `chunks` against a pool and a model of `shape` and `vocab`:
    /// every chunk has tokens, every token is in the vocabulary, every page
    /// table covers its chunk's positions inside the pool.
    pub fn new(
        chunks: &[SeqChunk<'a>],
        pool: &KvPool,
        shape: KvShape,
        vocab: usize,
    ) -> Result<Pass<'a>, EngineError> {
        let bad = |m: String| Err(EngineError::Batch(m));
        if pool.shape() != shape {
            return bad(format!(
                "a pool of {:?} for a model of {shape:?}",
                pool.shape()
            ));
        }
        let mut tokens = Vec::with_capacity(chunks.iter().map(|c| c.tokens.len()).sum());
        let mut logit_rows = Vec::new();
        let mut runs = Vec::with_capacity(chunks.len());
        for (i, c) in chunks.iter().enumerate() {
            if c.tokens.is_empty() {
                return bad(format!("chunk {i} has no tokens"));
            }
            if let Some(t) = c.tokens.iter().find(|&&t| t as usize >= vocab) {
                return bad(format!("token {t} is outside the vocabulary of {vocab}"));
            }
            let first = tokens.len();
            match c.logits {
                Logits::None => {}
                Logits::Last => logit_rows.push(first + c.tokens.len() - 1),
                Logits::From(k) => logit_rows.extend(first + k..first + c.tokens.len()),
            }
            tokens.extend_from_slice(c.tokens);
            runs.push(RowRun {
                pos: c.pos,
                len: c.tokens.len(),
                pages: c.pages,
            });
        }
        let rows = Rows::new(runs);
        rows.check(pool.pages(), PAGE).map_err(EngineError::Batch)?;
        Ok(Pass {
            rows,
            tokens,
            logit_rows,
        })
    }

    /// The hidden states (`x`: `[rows][hidden]`) of the rows that need
    /// logits, and how many there are.
    pub fn gather(&self, x: &[f32], hidden: usize) -> (Vec<f32>, usize) {
        let mut out = Vec::with_capacity(self.logit_rows.len() * hidden);
        for &r in &self.logit_rows {
            out.extend_from_slice(&x[r * hidden..(r + 1) * hidden]);
        }
        (out, self.logit_rows.len())
    }
}

/// Where a job's tokens and its end go. The scheduler calls it from its
/// thread; nothing here may block.
pub trait JobSink: Send {
    /// One streamed token; `Break` cancels the sequence (the token counts).
    fn token(&mut self, chunk: &TokenChunk) -> ControlFlow<()>;
    /// Polled every step: true cancels the sequence before its next token
    /// (also while it waits or is being prefilled).
    fn cancelled(&self) -> bool {
        false
    }
    /// The job's end, called exactly once.
    fn done(self: Box<Self>, result: Result<Generation, EngineError>);
}

/// An audit's end.
pub type AuditDone = Box<dyn FnOnce(Result<Verdict, EngineError>) + Send>;

/// How a model's batch runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchConfig {
    /// Most sequences (and audits) in one pass.
    pub slots: usize,
    /// Pages in the pool.
    pub kv_pages: usize,
    /// Most tokens in one pass: every decoding sequence's one, then chunks
    /// of prompts being prefilled (at least one token of them).
    pub step_tokens: usize,
    /// Keep computed prefixes for later sequences.
    pub prefix_cache: bool,
}

impl BatchConfig {
    /// `slots` sequences over a pool of `kv_bytes` for a model of `shape`,
    /// with the default step budget and the prefix cache on.
    pub fn new(slots: usize, shape: KvShape, kv_bytes: u64) -> BatchConfig {
        BatchConfig {
            slots: slots.max(1),
            kv_pages: usize::try_from(kv_bytes / shape.page_bytes().max(1)).unwrap_or(usize::MAX),
            step_tokens: DEFAULT_STEP_TOKENS,
            prefix_cache: true,
        }
    }
}

/// Tokens per pass by default: large enough that prefill runs near its
/// batched speed, small enough that a pass with a prompt chunk delays the
/// running streams' next token by well under a tenth of a second on a
/// laptop-class CPU.
pub const DEFAULT_STEP_TOKENS: usize = 128;

/// What a batch is doing, for the node's reports.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BatchStats {
    pub slots: usize,
    /// Sequences (and audits) in the batch now.
    pub running: usize,
    /// Admitted-but-not-running and preempted ones.
    pub waiting: usize,
    pub kv_pages: usize,
    /// Pages free now or freeable (cached prefixes no sequence uses).
    pub kv_pages_free: usize,
    /// Pages the prefix cache holds.
    pub prefix_pages: usize,
    /// Since start: prompt tokens admitted, and how many of them came from
    /// the prefix cache.
    pub prompt_tokens: u64,
    pub prefix_hit_tokens: u64,
    /// Since start: sequences preempted for lack of pages.
    pub preemptions: u64,
    /// Since start: forward passes run.
    pub steps: u64,
}

/// A generation and who waits for it.
struct Gen {
    seq: Box<Sequence>,
    sink: Box<dyn JobSink>,
}

/// An audit in progress.
struct Audit {
    pass: AuditPass,
    done: AuditDone,
}

enum Work {
    Gen(Gen),
    Audit(Box<Audit>),
}

impl Work {
    fn tokens(&self) -> &[u32] {
        match self {
            Work::Gen(g) => g.seq.tokens(),
            Work::Audit(a) => a.pass.tokens(),
        }
    }

    /// Most positions it will ever hold in the pool (its last sampled
    /// token is never fed).
    fn max_positions(&self) -> usize {
        match self {
            Work::Gen(g) => g.seq.capacity().saturating_sub(1).max(g.seq.tokens().len()),
            Work::Audit(a) => a.pass.tokens().len(),
        }
    }

    /// Positions that may come from the prefix cache: all but those whose
    /// logits are needed.
    fn cacheable(&self) -> usize {
        match self {
            Work::Gen(g) => g.seq.tokens().len() - 1,
            Work::Audit(a) => a.pass.first_row(),
        }
    }

    fn decoding(&self, computed: usize) -> bool {
        match self {
            Work::Gen(g) => g.seq.started() && g.seq.tokens().len() - computed == 1,
            Work::Audit(_) => false,
        }
    }

    fn cancelled(&self) -> bool {
        match self {
            Work::Gen(g) => g.sink.cancelled(),
            Work::Audit(_) => false,
        }
    }

    fn fail(self, e: EngineError) {
        match self {
            Work::Gen(g) => g.sink.done(Err(e)),
            Work::Audit(a) => (a.done)(Err(e)),
        }
    }
}

/// A sequence (or audit) and its place in the pool.
struct Entry {
    /// Order of arrival: smaller is older. Kept across preemption.
    id: u64,
    work: Work,
    pages: Vec<PageId>,
    /// Positions computed (their keys and values are in `pages`).
    computed: usize,
    /// Prompt tokens counted in the stats already (not again on re-admission).
    counted: bool,
}

/// The scheduler: sequences, the pool, the prefix cache. Driven by
/// [`Batcher::step`] (by [`BatchThread`] on a node; directly in tests).
pub struct Batcher {
    text: Arc<TextSide>,
    cfg: BatchConfig,
    pool: KvPool,
    prefix: PrefixCache,
    context: usize,
    vocab: usize,
    waiting: VecDeque<Entry>,
    /// Oldest first.
    running: Vec<Entry>,
    next_id: u64,
    stats: BatchStats,
}

impl std::fmt::Debug for Batcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Batcher")
            .field("cfg", &self.cfg)
            .field("pool", &self.pool)
            .field("running", &self.running.len())
            .field("waiting", &self.waiting.len())
            .finish()
    }
}

impl Batcher {
    /// A batch for `model` (whose pool it builds from `cfg`).
    pub fn new(
        model: &dyn BatchModel,
        text: Arc<TextSide>,
        cfg: BatchConfig,
    ) -> Result<Batcher, EngineError> {
        let pool = KvPool::new(model.kv_shape(), cfg.kv_pages)
            .map_err(|e| EngineError::Config(format!("kv cache: {e}")))?;
        // A model that keeps its own cache runs its prompts in the chunks
        // `Engine::generate` uses: its arithmetic (unlike the pool's) may
        // depend on how a prompt is cut, and its outputs are then those of
        // `generate`.
        let (slots, step_tokens, prefix_cache) = match model.max_sequences() {
            Some(most) => (cfg.slots.clamp(1, most.max(1)), PREFILL_CHUNK, false),
            None => (cfg.slots.max(1), cfg.step_tokens.max(1), cfg.prefix_cache),
        };
        Ok(Batcher {
            text,
            cfg: BatchConfig {
                slots,
                step_tokens,
                prefix_cache,
                ..cfg
            },
            pool,
            prefix: PrefixCache::new(),
            context: model.context_length(),
            vocab: model.vocab_size(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            next_id: 0,
            stats: BatchStats::default(),
        })
    }

    /// Nothing running or waiting.
    pub fn is_idle(&self) -> bool {
        self.running.is_empty() && self.waiting.is_empty()
    }

    pub fn stats(&self) -> BatchStats {
        BatchStats {
            slots: self.cfg.slots,
            running: self.running.len(),
            waiting: self.waiting.len(),
            kv_pages: self.pool.pages(),
            kv_pages_free: self.pool.free_pages() + self.prefix.evictable(&self.pool),
            prefix_pages: self.prefix.pages(),
            ..self.stats
        }
    }

    fn enqueue(&mut self, work: Work) {
        self.next_id += 1;
        self.waiting.push_back(Entry {
            id: self.next_id,
            work,
            pages: Vec::new(),
            computed: 0,
            counted: false,
        });
    }

    /// Queues a generation; `submitted` is when the client's wait began.
    /// A request the engine refuses is answered at once.
    pub fn submit(
        &mut self,
        request: &GenerateRequest,
        sink: Box<dyn JobSink>,
        submitted: Instant,
    ) {
        match self.text.begin(request, self.context, submitted) {
            Err(e) => sink.done(Err(e)),
            Ok(Begin::Done(g)) => sink.done(Ok(g)),
            Ok(Begin::Run(seq)) => self.enqueue(Work::Gen(Gen { seq, sink })),
        }
    }

    /// Queues an audit.
    pub fn audit(&mut self, request: &AuditRequest, done: AuditDone) {
        match self.text.audit_pass(request, self.context, self.vocab) {
            Err(e) => done(Err(e)),
            Ok(Err(verdict)) => done(Ok(verdict)),
            Ok(Ok(pass)) => self.enqueue(Work::Audit(Box::new(Audit { pass, done }))),
        }
    }

    /// Gives an entry's pages back, first offering its computed full pages
    /// to the prefix cache.
    fn release(&mut self, entry: &mut Entry, cache: bool) {
        if cache && self.cfg.prefix_cache {
            let done = entry.computed.min(entry.work.tokens().len());
            self.prefix
                .insert(&mut self.pool, &entry.work.tokens()[..done], &entry.pages);
        }
        for p in entry.pages.drain(..) {
            self.pool.release(p);
        }
        entry.computed = 0;
    }

    /// Ends a finished or cancelled generation, or a scored audit.
    fn retire(&mut self, mut entry: Entry) {
        self.release(&mut entry, true);
        match entry.work {
            Work::Gen(g) => g.sink.done(g.seq.finish()),
            Work::Audit(a) => (a.done)(Ok(a.pass.verdict())),
        }
    }

    fn fail(&mut self, mut entry: Entry, e: EngineError) {
        self.release(&mut entry, false);
        entry.work.fail(e);
    }

    /// One free page, evicting a cached prefix if need be.
    fn take_page(&mut self) -> Option<PageId> {
        loop {
            if let Some(p) = self.pool.alloc() {
                return Some(p);
            }
            if !self.prefix.evict(&mut self.pool) {
                return None;
            }
        }
    }

    /// Cancels whatever its client gave up on.
    fn reap_cancelled(&mut self) {
        let mut i = 0;
        while i < self.running.len() {
            if self.running[i].work.cancelled() {
                let mut e = self.running.remove(i);
                if let Work::Gen(g) = &mut e.work {
                    g.seq.cancel();
                }
                self.retire(e);
            } else {
                i += 1;
            }
        }
        let waiting = std::mem::take(&mut self.waiting);
        for mut e in waiting {
            if e.work.cancelled() {
                if let Work::Gen(g) = &mut e.work {
                    g.seq.cancel();
                }
                self.retire(e);
            } else {
                self.waiting.push_back(e);
            }
        }
    }

    /// Moves waiting entries into the batch while slots and pages allow.
    fn admit(&mut self) {
        while self.running.len() < self.cfg.slots {
            let Some(mut e) = self.waiting.pop_front() else {
                return;
            };
            let len = e.work.tokens().len();
            let need = KvShape::pages_for(len);
            // A sequence must be able to finish alone.
            let most = e.work.max_positions();
            if KvShape::pages_for(most) > self.pool.pages() {
                let capacity = self.pool.pages() * PAGE;
                self.fail(
                    e,
                    EngineError::KvPoolTooSmall {
                        positions: most,
                        capacity,
                    },
                );
                continue;
            }
            let hits = if self.cfg.prefix_cache {
                self.prefix
                    .lookup(&mut self.pool, e.work.tokens(), e.work.cacheable() / PAGE)
            } else {
                Vec::new()
            };
            // Room for the prompt, and a page of headroom for every
            // decoding sequence, or wait (unless nothing else runs).
            let headroom = self.running.len();
            let free = self.pool.free_pages() + self.prefix.evictable(&self.pool);
            if !self.running.is_empty() && need - hits.len() + headroom > free {
                for p in hits {
                    self.pool.release(p);
                }
                self.waiting.push_front(e);
                return;
            }
            if !e.counted {
                e.counted = true;
                self.stats.prompt_tokens += len as u64;
                self.stats.prefix_hit_tokens += (hits.len() * PAGE) as u64;
            }
            e.computed = hits.len() * PAGE;
            e.pages = hits;
            while e.pages.len() < need {
                match self.take_page() {
                    Some(p) => e.pages.push(p),
                    None => break,
                }
            }
            if e.pages.len() < need {
                // Only when nothing else runs could this happen, and then
                // the pool is smaller than the prompt plus the cache's
                // pinned pages: give the pages back and wait for the rest.
                self.release(&mut e, false);
                self.waiting.push_front(e);
                return;
            }
            let at = self.running.partition_point(|r| r.id < e.id);
            self.running.insert(at, e);
        }
    }

    /// Takes the youngest running entry out of the batch (its pages back,
    /// its full ones cached), to run again later.
    fn preempt_youngest(&mut self) {
        if let Some(mut e) = self.running.pop() {
            self.release(&mut e, true);
            self.stats.preemptions += 1;
            self.waiting.push_front(e);
        }
    }

    /// Chunk sizes for this step (per running entry, by age), with every
    /// page they need taken: decoding sequences first, then prompt chunks
    /// in age order within the token budget.
    fn plan(&mut self) -> Vec<usize> {
        let decoders = self
            .running
            .iter()
            .filter(|e| e.work.decoding(e.computed))
            .count();
        let mut budget = self.cfg.step_tokens.saturating_sub(decoders).max(1);
        let mut sizes: Vec<usize> = self
            .running
            .iter()
            .map(|e| {
                let pending = e.work.tokens().len() - e.computed;
                if e.work.decoding(e.computed) {
                    1
                } else {
                    let n = pending.min(budget);
                    budget -= n;
                    n
                }
            })
            .collect();
        // Pages in age order; on a shortage the youngest goes.
        let mut i = 0;
        'entries: while i < self.running.len() {
            let need = KvShape::pages_for(self.running[i].computed + sizes[i]);
            while self.running[i].pages.len() < need {
                if let Some(p) = self.take_page() {
                    self.running[i].pages.push(p);
                    continue;
                }
                if self.running.len() == 1 {
                    // Alone and still short: the sequence outgrew the pool.
                    let e = self.running.remove(0);
                    let positions = e.computed + sizes[0];
                    let capacity = self.pool.pages() * PAGE;
                    self.fail(
                        e,
                        EngineError::KvPoolTooSmall {
                            positions,
                            capacity,
                        },
                    );
                    sizes.clear();
                    break 'entries;
                }
                let youngest = self.running.len() - 1;
                self.preempt_youngest();
                sizes.pop();
                if youngest == i {
                    break 'entries;
                }
            }
            i += 1;
        }
        sizes
    }

    /// Runs one step: cancellations, admissions, one forward pass, then
    /// sampling and streaming for every sequence that got its logits.
    /// Returns false when there was nothing to do.
    pub fn step(&mut self, model: &mut dyn BatchModel) -> bool {
        self.reap_cancelled();
        self.admit();
        if self.running.is_empty() {
            return false;
        }
        let sizes = self.plan();
        if sizes.iter().all(|&n| n == 0) {
            return !self.is_idle();
        }
        let logits = {
            let chunks: Vec<SeqChunk<'_>> = self
                .running
                .iter()
                .zip(&sizes)
                .filter(|(_, &n)| n > 0)
                .map(|(e, &n)| {
                    let tokens = &e.work.tokens()[e.computed..e.computed + n];
                    let reaches_end = e.computed + n == e.work.tokens().len();
                    let logits = match &e.work {
                        Work::Gen(_) if reaches_end => Logits::Last,
                        Work::Gen(_) => Logits::None,
                        Work::Audit(a) => {
                            let first = a.pass.first_row();
                            if e.computed + n > first {
                                Logits::From(first.saturating_sub(e.computed))
                            } else {
                                Logits::None
                            }
                        }
                    };
                    SeqChunk {
                        tokens,
                        pos: e.computed,
                        pages: &e.pages,
                        logits,
                        capacity: e.work.max_positions(),
                    }
                })
                .collect();
            model.forward_batch(&mut self.pool, &chunks)
        };
        self.stats.steps += 1;
        let mut logits = match logits {
            Ok(l) => l,
            Err(e) => {
                let msg = e.to_string();
                let ran: Vec<Entry> = {
                    let mut keep = Vec::new();
                    let mut ran = Vec::new();
                    for (entry, &n) in std::mem::take(&mut self.running).into_iter().zip(&sizes) {
                        if n > 0 {
                            ran.push(entry);
                        } else {
                            keep.push(entry);
                        }
                    }
                    self.running = keep;
                    ran
                };
                for entry in ran {
                    self.fail(entry, EngineError::Batch(msg.clone()));
                }
                return true;
            }
        };
        // Hand each entry its rows, oldest first; collect the finished.
        let vocab = self.vocab;
        let mut rows = logits.chunks_exact_mut(vocab);
        let mut finished = Vec::new();
        for (i, &n) in sizes.iter().enumerate() {
            if n == 0 {
                continue;
            }
            let e = &mut self.running[i];
            let from = e.computed;
            e.computed += n;
            let crossed = from / PAGE != e.computed / PAGE;
            match &mut e.work {
                Work::Gen(g) => {
                    if e.computed == g.seq.tokens().len() {
                        let Some(row) = rows.next() else { break };
                        let sink = &mut g.sink;
                        let flow = g.seq.step(&self.text, row, &mut |chunk| sink.token(chunk));
                        if flow.is_break() {
                            finished.push(i);
                        }
                    }
                }
                Work::Audit(a) => {
                    let first = a.pass.first_row();
                    if e.computed > first {
                        let start = from.max(first);
                        let count = e.computed - start;
                        let mut block = Vec::with_capacity(count * vocab);
                        for _ in 0..count {
                            if let Some(row) = rows.next() {
                                block.extend_from_slice(row);
                            }
                        }
                        a.pass.score(start, &mut block, vocab);
                    }
                    if e.computed == a.pass.tokens().len() {
                        finished.push(i);
                    }
                }
            }
            if crossed && self.cfg.prefix_cache && !finished.contains(&i) {
                let e = &self.running[i];
                self.prefix
                    .insert(&mut self.pool, &e.work.tokens()[..e.computed], &e.pages);
            }
        }
        for i in finished.into_iter().rev() {
            let e = self.running.remove(i);
            self.retire(e);
        }
        true
    }
}

/// Steps between two publications of a [`BatchThread`]'s stats.
const STATS_EVERY: u64 = 16;

/// Work for a [`BatchThread`].
enum Command {
    Generate {
        request: Box<GenerateRequest>,
        sink: Box<dyn JobSink>,
        submitted: Instant,
    },
    Audit {
        request: Box<AuditRequest>,
        done: AuditDone,
    },
}

/// A model's batch on its own thread. Dropping the last handle lets the
/// thread finish what it holds and end.
#[derive(Clone)]
pub struct BatchThread {
    tx: mpsc::Sender<Command>,
    stats: Arc<Mutex<BatchStats>>,
}

impl std::fmt::Debug for BatchThread {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BatchThread")
            .field("stats", &self.stats())
            .finish()
    }
}

impl BatchThread {
    /// Starts the thread for `model` (any architecture).
    pub fn start<M: BatchModel + Send + 'static>(
        mut model: M,
        text: Arc<TextSide>,
        cfg: BatchConfig,
    ) -> Result<BatchThread, EngineError> {
        let mut batcher = Batcher::new(&model, text, cfg)?;
        let stats = Arc::new(Mutex::new(batcher.stats()));
        let (tx, rx) = mpsc::channel::<Command>();
        let shared = stats.clone();
        std::thread::Builder::new()
            .name("mlx-batch".into())
            .spawn(move || {
                let take = |batcher: &mut Batcher, cmd: Command| match cmd {
                    Command::Generate {
                        request,
                        sink,
                        submitted,
                    } => batcher.submit(&request, sink, submitted),
                    Command::Audit { request, done } => batcher.audit(&request, done),
                };
                loop {
                    if batcher.is_idle() {
                        match rx.recv() {
                            Ok(cmd) => take(&mut batcher, cmd),
                            Err(_) => break,
                        }
                    }
                    while let Ok(cmd) = rx.try_recv() {
                        take(&mut batcher, cmd);
                    }
                    batcher.step(&mut model);
                    // Stats cost a walk over the prefix cache: published
                    // every few steps and whenever the batch empties.
                    if batcher.is_idle() || batcher.stats.steps % STATS_EVERY == 0 {
                        *shared.lock().unwrap_or_else(PoisonError::into_inner) = batcher.stats();
                    }
                }
            })
            .map_err(|e| EngineError::Batch(format!("cannot start the batch thread: {e}")))?;
        Ok(BatchThread { tx, stats })
    }

    /// [`BatchThread::start`] with a loaded engine's model and text side.
    pub fn for_engine(engine: Engine, cfg: BatchConfig) -> Result<BatchThread, EngineError> {
        BatchThread::start(engine.model, engine.text, cfg)
    }

    /// Queues a generation; `sink` hears every token and the end. Never blocks.
    pub fn generate(&self, request: GenerateRequest, sink: Box<dyn JobSink>) {
        let cmd = Command::Generate {
            request: Box::new(request),
            sink,
            submitted: Instant::now(),
        };
        if let Err(mpsc::SendError(Command::Generate { sink, .. })) = self.tx.send(cmd) {
            sink.done(Err(EngineError::Batch("the batch thread ended".into())));
        }
    }

    /// Queues an audit. Never blocks.
    pub fn audit(&self, request: AuditRequest, done: AuditDone) {
        let cmd = Command::Audit {
            request: Box::new(request),
            done,
        };
        if let Err(mpsc::SendError(Command::Audit { done, .. })) = self.tx.send(cmd) {
            done(Err(EngineError::Batch("the batch thread ended".into())));
        }
    }

    /// What the batch did as of its last step.
    pub fn stats(&self) -> BatchStats {
        *self.stats.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests;
