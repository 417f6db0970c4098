//! One job attempt on its own bidirectional stream: read the `Assignment`,
//! check it, run the engine, stream tokens, send the signed claim. An audit
//! assignment (`Assignment.audit` set) instead re-scores another node's
//! claim with one teacher-forced pass ([`crate::engine::Engine::audit`]) and
//! sends a signed verdict.
//!
//! # Invariants
//! - A job runs only on a held model file with exactly the digest the
//!   assignment names; anything else is refused with `retryable = false`.
//! - The engine runs on its model's batch thread (with the node's other
//!   jobs of that model) and never waits on the network: each token is
//!   offered to a bounded channel with `try_send`; while the channel is
//!   full, tokens are coalesced into one pending batch, so the client still
//!   receives every token, in order, in fewer frames.
//! - The claim covers exactly what was streamed: its `output_text` is the
//!   concatenation of the streamed texts (the engine's invariant) and its
//!   token ids are the streamed ids. It binds the job's grammar
//!   (`grammar::claim_digest` of the assignment's, none without one): the
//!   constraint its tokens were masked with.
//! - A stream reset (or stop) by the coordinator cancels the generation at
//!   the next token; nothing more is sent.
//! - A resumed assignment (`Assignment.resume`) continues the job's stream:
//!   token indices go on from the resumed count and the claim binds the
//!   input plus the resumed tokens (`claim::resumed_input_digest`), while
//!   its tokens and text are only what this attempt produced.
//! - While the node drains no job starts (refused, retryable); on hand-off
//!   a running job stops at the next token and sends a partial claim
//!   (`finish_reason` "handoff") of exactly the tokens it streamed.
//!
//! # Failure
//! The job's own fault (model not held, digest mismatch, no input, engine
//! client error such as a too-long prompt) is `Failure{retryable: false}`;
//! the node's fault (busy, engine failure, crash) is `retryable: true`.
//! Stream I/O errors end the task (the coordinator re-queues the attempt).

use std::{
    ops::ControlFlow,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc, PoisonError,
    },
    time::Duration,
};

use mlxnet_proto::{
    claim,
    frame::{read_frame, write_frame, FrameError},
    grammar::{self, Constraint, GrammarError},
    v1::{
        job_input, job_update, Assignment, AuditTask, AuditVerdict, JobInput, JobUpdate,
        ResultClaim, SamplingParams, SignedClaim, TokenLogprob, TopLogprob,
    },
};
use tokio::sync::mpsc;
use tracing::Instrument;

use super::{drain::DrainState, LinkContext};
use crate::engine::{
    audit::ClaimFacts, batch::JobSink, AuditRequest, ChatTurn, EngineError, FinishReason,
    GenerateRequest, Generation, PromptInput, Resume, Sampling, TokenChunk,
};
use crate::models::{LoadedModel, Refusal};

/// How long the coordinator may take to send the assignment after opening
/// the stream.
const ASSIGNMENT_TIMEOUT: Duration = Duration::from_secs(30);
/// Token batches in flight between the engine thread and the stream.
const TOKEN_CHANNEL: usize = 32;

/// Why a job stream ended without a normal result.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum JobError {
    #[error("job stream: {0}")]
    Frame(#[from] FrameError),
    #[error("no assignment within {0:?}")]
    AssignmentTimeout(Duration),
    #[error("job stream closed: {0}")]
    Closed(#[from] quinn::ClosedStream),
}

/// Consecutive tokens not yet sent: the first index, the ids, their text,
/// and (when the job asked for them) one log-probability entry per id.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenBatch {
    pub index: usize,
    pub token_ids: Vec<u32>,
    pub text: String,
    pub logprobs: Vec<TokenLogprob>,
}

/// A token's log-probabilities as they travel.
fn logprob_entry(l: &crate::engine::TokenLogprobs) -> TokenLogprob {
    TokenLogprob {
        logprob: l.chosen.logprob,
        token: l.chosen.bytes.clone(),
        top: l
            .top
            .iter()
            .map(|t| TopLogprob {
                token_id: t.token_id,
                logprob: t.logprob,
                token: t.bytes.clone(),
            })
            .collect(),
    }
}

impl TokenBatch {
    fn update(self) -> JobUpdate {
        JobUpdate {
            msg: Some(job_update::Msg::Tokens(job_update::Tokens {
                index: self.index as u32,
                token_ids: self.token_ids,
                text: self.text,
                logprobs: self.logprobs,
            })),
        }
    }
}

/// The engine-side end of the token channel: never blocks on the network
/// (it may rest between tokens to keep a GPU share, see [`DutyCycle`]).
pub struct Coalescer {
    tx: mpsc::Sender<TokenBatch>,
    pending: Option<TokenBatch>,
    cancel: Arc<AtomicBool>,
    drain: Arc<DrainState>,
    duty: Option<DutyCycle>,
}

/// Keeps the engine computing at most `share` of the wall time: after each
/// token it rests `compute x (1 / share - 1)` (`lending.gpu_share`).
#[derive(Debug)]
pub struct DutyCycle {
    share: f64,
    since: std::time::Instant,
}

impl DutyCycle {
    pub fn new(share: f64) -> Option<Self> {
        (share > 0.0 && share < 1.0).then(|| Self {
            share,
            since: std::time::Instant::now(),
        })
    }

    /// How long to rest after computing for `compute`.
    pub fn rest_after(&self, compute: Duration) -> Duration {
        compute.mul_f64(1.0 / self.share - 1.0)
    }

    fn after_token(&mut self) {
        std::thread::sleep(self.rest_after(self.since.elapsed()));
        self.since = std::time::Instant::now();
    }
}

impl Coalescer {
    pub fn new(
        tx: mpsc::Sender<TokenBatch>,
        cancel: Arc<AtomicBool>,
        drain: Arc<DrainState>,
    ) -> Self {
        Self {
            tx,
            pending: None,
            cancel,
            drain,
            duty: None,
        }
    }

    /// Rests between tokens to keep the engine's share of the time.
    pub fn set_duty(&mut self, duty: Option<DutyCycle>) {
        self.duty = duty;
    }

    /// Offers one token; `Break` (the token is not taken) when the job was
    /// cancelled, the node hands its jobs off, or nobody listens.
    pub fn push(&mut self, chunk: &TokenChunk) -> ControlFlow<()> {
        if let Some(d) = &mut self.duty {
            d.after_token();
        }
        if self.cancelled() {
            return ControlFlow::Break(());
        }
        match &mut self.pending {
            Some(batch) => {
                batch.token_ids.push(chunk.token_id);
                batch.text.push_str(&chunk.text);
                batch
                    .logprobs
                    .extend(chunk.logprobs.as_ref().map(logprob_entry));
            }
            None => {
                self.pending = Some(TokenBatch {
                    index: chunk.index,
                    token_ids: vec![chunk.token_id],
                    text: chunk.text.clone(),
                    logprobs: chunk
                        .logprobs
                        .as_ref()
                        .map(logprob_entry)
                        .into_iter()
                        .collect(),
                })
            }
        }
        if let Some(batch) = self.pending.take() {
            match self.tx.try_send(batch) {
                Ok(()) => {}
                Err(mpsc::error::TrySendError::Full(batch)) => self.pending = Some(batch),
                Err(mpsc::error::TrySendError::Closed(_)) => return ControlFlow::Break(()),
            }
        }
        ControlFlow::Continue(())
    }

    /// Whether the job should stop before its next token: the coordinator
    /// cancelled it or the node hands its jobs off.
    pub fn cancelled(&self) -> bool {
        self.cancel.load(Ordering::Relaxed) || self.drain.is_handing_off()
    }

    /// Tokens still waiting when the generation ended (drops the sender).
    pub fn finish(self) -> Option<TokenBatch> {
        self.pending
    }
}

/// What the job's task gets back from the batch: the generation (or why
/// not) and the tokens the coalescer still held.
type Ended = (Result<Generation, EngineError>, Option<TokenBatch>);

/// The batch's end of one job: tokens into the coalescer, the end back to
/// the job's task.
struct BatchSink {
    coalescer: Coalescer,
    done: tokio::sync::oneshot::Sender<Ended>,
}

impl JobSink for BatchSink {
    fn token(&mut self, chunk: &TokenChunk) -> ControlFlow<()> {
        self.coalescer.push(chunk)
    }
    fn cancelled(&self) -> bool {
        self.coalescer.cancelled()
    }
    fn done(self: Box<Self>, result: Result<Generation, EngineError>) {
        let BatchSink { coalescer, done } = *self;
        let _ = done.send((result, coalescer.finish()));
    }
}

/// Serves one job stream to its end.
pub async fn serve(
    ctx: Arc<LinkContext>,
    mut send: quinn::SendStream,
    mut recv: quinn::RecvStream,
) {
    let assignment = match tokio::time::timeout(
        ASSIGNMENT_TIMEOUT,
        read_frame::<_, Assignment>(&mut recv),
    )
    .await
    {
        Ok(Ok(a)) => a,
        Ok(Err(e)) => {
            tracing::warn!(error = %e, "bad job stream");
            let _ = send.reset(1u32.into());
            return;
        }
        Err(_) => {
            tracing::warn!(error = %JobError::AssignmentTimeout(ASSIGNMENT_TIMEOUT), "job stream idle");
            let _ = send.reset(1u32.into());
            return;
        }
    };
    let span = tracing::info_span!("job", job_id = %assignment.job_id, attempt = assignment.attempt, model = %assignment.model);
    if let Err(e) = run(&ctx, &assignment, &mut send, recv)
        .instrument(span)
        .await
    {
        tracing::warn!(job_id = %assignment.job_id, error = %e, "job stream ended early");
    }
}

/// Where a job runs: this node's engine, or across its pod (leader).
enum Runner {
    Local(Arc<crate::models::LoadedModel>),
    Pod(Arc<super::PodLink>),
}

/// What ended a job, as sent to the coordinator.
enum Outcome {
    Claim(SignedClaim),
    Verdict(mlxnet_proto::v1::SignedVerdict),
    Failure {
        reason: String,
        retryable: bool,
    },
    /// Cancelled by the coordinator: send nothing.
    Cancelled,
}

async fn run(
    ctx: &LinkContext,
    a: &Assignment,
    send: &mut quinn::SendStream,
    recv: quinn::RecvStream,
) -> Result<(), JobError> {
    if ctx.drain.is_draining() {
        let outcome = Outcome::Failure {
            reason: "node is draining".into(),
            retryable: true,
        };
        return finish(send, outcome).await;
    }
    let resolved = match &ctx.pod {
        Some(pod) => {
            if pod.held.id != a.model {
                Err(Refusal::NotHeld(a.model.clone()))
            } else {
                pod.held
                    .check_digest(&a.model_sha256)
                    .map(|()| Runner::Pod(pod.clone()))
            }
        }
        None => ctx
            .models
            .resolve(&a.model, &a.model_sha256)
            .map(Runner::Local),
    };
    if let (Ok(Runner::Local(_)), Some(store)) = (&resolved, ctx.models.store()) {
        // Least-recently-used eviction counts jobs, not only start-ups.
        let (store, id) = (store.clone(), a.model.clone());
        tokio::task::spawn_blocking(move || {
            if let Err(e) = store.touch(&id) {
                tracing::warn!(model = %id, error = %e, "cannot record the model's use");
            }
        });
    }
    let runner = match resolved {
        Ok(r) => r,
        Err(refusal) => {
            let outcome = Outcome::Failure {
                reason: refusal.to_string(),
                retryable: false,
            };
            return finish(send, outcome).await;
        }
    };
    let Some(input) = a.input.clone().filter(|i| i.kind.is_some()) else {
        let outcome = Outcome::Failure {
            reason: "assignment has no input".into(),
            retryable: false,
        };
        return finish(send, outcome).await;
    };
    // A refusal for good (a model or digest the node does not hold, no
    // input) needs no slot, so it never makes the next job see the node busy.
    // The slot is given back before the job's last frame is written: the
    // coordinator frees its count of this node when it reads that frame, and
    // may send the next job at once.
    let Ok(permit) = ctx.slots.clone().try_acquire_owned() else {
        let reason = format!(
            "node is busy: all {} job slots in use",
            ctx.max_concurrent_jobs
        );
        return finish(
            send,
            Outcome::Failure {
                reason,
                retryable: true,
            },
        )
        .await;
    };
    let model_sha256 = match &runner {
        Runner::Local(m) => m.held.sha256,
        Runner::Pod(p) => p.held.sha256,
    };
    let sampling = match sampling(a.sampling.as_ref()) {
        Ok(s) => s,
        Err(e) => {
            let outcome = Outcome::Failure {
                reason: format!("response_format: {e}"),
                retryable: false,
            };
            return finish(send, outcome).await;
        }
    };
    let resume = a.resume.clone().unwrap_or_default();
    let request = GenerateRequest {
        input: prompt_input(&input),
        sampling,
        resume: Resume {
            token_ids: resume.token_ids,
            text: resume.text,
        },
    };
    let prompt_sha256 = claim::resumed_input_digest(&input, &request.resume.token_ids);
    write_frame(
        send,
        &JobUpdate {
            msg: Some(job_update::Msg::Started(job_update::Started {})),
        },
    )
    .await?;
    if let Some(task) = &a.audit {
        tracing::info!(job_id = %a.job_id, "audit started");
        let outcome = match &runner {
            Runner::Local(model) => audit(ctx, a, &input, model, task).await,
            // A pod serves its one model across its members; audits go to
            // single nodes.
            Runner::Pod(_) => Outcome::Failure {
                reason: "a pod does not run audits".into(),
                retryable: true,
            },
        };
        drop(permit);
        return finish(send, outcome).await;
    }
    tracing::info!(job_id = %a.job_id, attempt = a.attempt, "job started");
    let mut watch = JobWatch::start(ctx, a);

    let cancel = Arc::new(AtomicBool::new(false));
    let (tx, mut rx) = mpsc::channel(TOKEN_CHANNEL);
    let mut coalescer = Coalescer::new(tx, cancel.clone(), ctx.drain.clone());
    let generation = match runner {
        Runner::Local(model) => {
            // A GPU model runs one job at a time (its batch has one slot),
            // so resting between its tokens keeps the owner's GPU share.
            if matches!(model.backend, "metal" | "cuda") {
                coalescer.set_duty(ctx.gpu_share.and_then(DutyCycle::new));
            }
            let (done, ended) = tokio::sync::oneshot::channel();
            model
                .batch
                .generate(request, Box::new(BatchSink { coalescer, done }));
            tokio::spawn(async move {
                // Held until the job ends: the model folder never evicts a
                // model a job holds (`ModelSet::busy`).
                let _held = model;
                match ended.await {
                    Ok((result, leftover)) => (
                        result.map_err(|e| (e.to_string(), !e.is_client_error())),
                        leftover,
                    ),
                    Err(_) => (Err(("the model's batch thread ended".into(), true)), None),
                }
            })
        }
        Runner::Pod(pod) => tokio::spawn(async move {
            // The sink lives in the pod's thread; the coalescer comes back
            // through the shared slot once the generation ended.
            let slot = Arc::new(std::sync::Mutex::new(Some(coalescer)));
            let sink = slot.clone();
            let (result, _sink) = pod
                .runtime
                .submit(
                    request,
                    Box::new(move |chunk| {
                        match sink.lock().unwrap_or_else(PoisonError::into_inner).as_mut() {
                            Some(c) => c.push(chunk),
                            None => ControlFlow::Break(()),
                        }
                    }),
                )
                .await;
            let result = result.map_err(|e| (e.to_string(), !e.is_client_error()));
            let leftover = slot
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .take()
                .and_then(Coalescer::finish);
            (result, leftover)
        }),
    };

    let peer_cancel = watch_cancel(recv, send.stopped());
    tokio::pin!(peer_cancel);
    let mut cancelled = false;
    let mut write_failed = None;
    let mut streamed = Streamed::default();
    // Forward batches until the engine drops its sender (generation ended).
    loop {
        tokio::select! {
            batch = rx.recv() => match batch {
                Some(batch) => {
                    if write_failed.is_none() {
                        streamed.add(&batch);
                        ctx.board.job_tokens(&a.job_id, batch.token_ids.len());
                        if let Err(e) = write_frame(send, &batch.update()).await {
                            cancel.store(true, Ordering::Relaxed);
                            write_failed = Some(e);
                        }
                    }
                }
                None => break,
            },
            _ = &mut peer_cancel, if !cancelled => {
                cancel.store(true, Ordering::Relaxed);
                cancelled = true;
            }
        }
    }
    let joined = generation.await;
    if let Some(e) = write_failed {
        return Err(e.into());
    }
    if cancelled {
        tracing::info!(job_id = %a.job_id, "job cancelled by the coordinator");
        return Ok(());
    }
    let outcome = match joined {
        Err(join) => Outcome::Failure {
            reason: format!("engine crashed: {join}"),
            retryable: true,
        },
        Ok((result, leftover)) => {
            if let Some(batch) = leftover {
                streamed.add(&batch);
                ctx.board.job_tokens(&a.job_id, batch.token_ids.len());
                write_frame(send, &batch.update()).await?;
            }
            let attempt = Attempt {
                a,
                prompt_sha256,
                model_sha256: &model_sha256,
                grammar_sha256: grammar::claim_digest(
                    a.sampling.as_ref().and_then(|s| s.grammar.as_ref()),
                ),
                joules: watch.joules(),
            };
            outcome(ctx, &attempt, result, streamed)
        }
    };
    if let Outcome::Claim(signed) = &outcome {
        watch.signed(signed);
    }
    // The board, the journal and the slot are done with before the
    // coordinator hears the end (see the slot above).
    drop(watch);
    drop(permit);
    finish(send, outcome).await
}

/// A job on the owner's board from its start to its end (however it ends),
/// with its energy; a signed attempt goes into the journal.
struct JobWatch<'a> {
    ctx: &'a LinkContext,
    job_id: String,
    model: String,
    span: Option<crate::energy::Span>,
    entry: Option<crate::status::JournalEntry>,
}

impl<'a> JobWatch<'a> {
    fn start(ctx: &'a LinkContext, a: &Assignment) -> Self {
        ctx.board.job_started(&a.job_id, &a.model);
        Self {
            ctx,
            job_id: a.job_id.clone(),
            model: a.model.clone(),
            span: ctx.energy.as_ref().and_then(crate::energy::Span::start),
            entry: None,
        }
    }

    /// The joules of this job so far: the machine's energy over the job,
    /// shared with the jobs running beside it.
    fn joules(&self) -> Option<f64> {
        let j = self.span.as_ref()?.joules();
        Some(j / f64::from(self.ctx.running_jobs().max(1)))
    }

    /// Journals the attempt `signed` claims, with the energy it claims.
    fn signed(&mut self, signed: &SignedClaim) {
        let Some(c) = &signed.claim else { return };
        let joules = match (c.energy_microjoules, &self.span) {
            (0, None) => None,
            (uj, _) => Some(uj as f64 / 1e6),
        };
        self.entry = Some(crate::status::JournalEntry {
            ts_ms: crate::status::now_ms(),
            job_id: c.job_id.clone(),
            attempt: c.attempt,
            model: self.model.clone(),
            prompt_tokens: u64::from(c.prompt_tokens),
            tokens: u64::from(c.completion_tokens),
            finish: c.finish_reason.clone(),
            joules,
        });
    }
}

impl Drop for JobWatch<'_> {
    fn drop(&mut self) {
        self.ctx.board.job_finished(&self.job_id, self.entry.take());
    }
}

/// Resolves when the coordinator resets our receive side or stops our send
/// side; a clean finish of its side is not a cancel.
async fn watch_cancel(
    mut recv: quinn::RecvStream,
    stopped: impl std::future::Future<Output = Result<Option<quinn::VarInt>, quinn::StoppedError>>,
) {
    let reset = async {
        let mut buf = [0u8; 64];
        loop {
            match recv.read(&mut buf).await {
                Ok(Some(_)) => continue, // nothing more is expected; ignore
                Ok(None) => std::future::pending::<()>().await,
                Err(_) => return,
            }
        }
    };
    let stopped = async {
        match stopped.await {
            Ok(Some(_)) | Err(_) => {}
            // Finished and acknowledged: cannot happen before we finish.
            Ok(None) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = reset => {}
        _ = stopped => {}
    }
}

/// What the node streamed of one attempt, as sent.
#[derive(Debug, Default)]
struct Streamed {
    token_ids: Vec<u32>,
    text: String,
}

impl Streamed {
    fn add(&mut self, batch: &TokenBatch) {
        self.token_ids.extend_from_slice(&batch.token_ids);
        self.text.push_str(&batch.text);
    }
}

/// What a claim of this attempt binds.
struct Attempt<'a> {
    a: &'a Assignment,
    prompt_sha256: [u8; 32],
    model_sha256: &'a [u8; 32],
    /// The job's grammar (`grammar::claim_digest`), none without one.
    grammar_sha256: Option<[u8; 32]>,
    /// The attempt's energy ([`JobWatch::joules`]), none without a meter.
    joules: Option<f64>,
}

fn outcome(
    ctx: &LinkContext,
    at: &Attempt<'_>,
    result: Result<Generation, (String, bool)>,
    streamed: Streamed,
) -> Outcome {
    let energy_microjoules = at.joules.map_or(0, |j| (j.max(0.0) * 1e6).round() as u64);
    let claim = |g: &Generation, token_ids: Vec<u32>, text: String, finish: &str| {
        let completion_tokens = token_ids.len() as u32;
        claim::sign(
            ResultClaim {
                job_id: at.a.job_id.clone(),
                attempt: at.a.attempt,
                model_sha256: at.model_sha256.to_vec(),
                prompt_sha256: at.prompt_sha256.to_vec(),
                completion_tokens,
                output_token_ids: token_ids,
                output_text: text,
                prompt_tokens: g.prompt_tokens as u32,
                prefill_micros: g.prefill.as_micros() as u64,
                decode_micros: g.decode.as_micros() as u64,
                node_id: ctx.identity.node_id().as_bytes().to_vec(),
                finish_reason: finish.into(),
                grammar_sha256: at.grammar_sha256.map(|d| d.to_vec()).unwrap_or_default(),
                energy_microjoules,
                microjoules_per_token: claim::microjoules_per_token(
                    energy_microjoules,
                    completion_tokens,
                ),
            },
            ctx.identity.signing_key(),
        )
    };
    match result {
        // Stopped for the hand-off: a partial claim of what was streamed.
        Ok(g) if g.finish == FinishReason::Cancelled && ctx.drain.is_handing_off() => {
            tracing::info!(
                tokens = streamed.token_ids.len(),
                "handing the job off at a token boundary"
            );
            Outcome::Claim(claim(
                &g,
                streamed.token_ids,
                streamed.text,
                claim::FINISH_HANDOFF,
            ))
        }
        Ok(g) if g.finish == FinishReason::Cancelled => Outcome::Cancelled,
        Ok(mut g) => {
            if ctx.test_cheat {
                // Another token for every one generated, as a node that did
                // not run the model would claim (test knob, see the config;
                // the modulus is the test model's vocabulary).
                for t in &mut g.output_token_ids {
                    *t = (*t + 1000) % 49_152;
                }
            }
            Outcome::Claim(claim(
                &g,
                g.output_token_ids.clone(),
                g.text.clone(),
                g.finish.as_str(),
            ))
        }
        Err((reason, retryable)) => Outcome::Failure { reason, retryable },
    }
}

/// Re-scores the claim of `task` (an audit assignment) and signs the verdict.
/// A claim about another job or model file, or one that does not verify,
/// is refused (not judged): the coordinator sent the wrong thing.
async fn audit(
    ctx: &LinkContext,
    a: &Assignment,
    input: &JobInput,
    model: &std::sync::Arc<LoadedModel>,
    task: &AuditTask,
) -> Outcome {
    let refuse = |reason: String| Outcome::Failure {
        reason,
        retryable: false,
    };
    let Some(signed) = task.claim.as_ref() else {
        return refuse("audit without a claim".into());
    };
    if let Err(e) = claim::verify(signed) {
        return refuse(format!("audited claim does not verify: {e}"));
    }
    let Some(c) = signed.claim.as_ref() else {
        return refuse("audit without a claim".into());
    };
    // A claim continuing a handed-off job is bound to the input plus the
    // tokens before it, which the assignment sends as its resumed prefix.
    let resume = a.resume.clone().unwrap_or_default();
    if c.job_id != a.job_id
        || c.model_sha256 != model.held.sha256
        || c.prompt_sha256 != claim::resumed_input_digest(input, &resume.token_ids)
    {
        return refuse("audited claim is about another job, input or model".into());
    }
    let sampling = match sampling(a.sampling.as_ref()) {
        Ok(s) => s,
        Err(e) => return refuse(format!("response_format: {e}")),
    };
    let request = AuditRequest {
        input: prompt_input(input),
        sampling,
        resume: Resume {
            token_ids: resume.token_ids,
            text: resume.text,
        },
        output_token_ids: c.output_token_ids.clone(),
        facts: ClaimFacts {
            finish_reason: c.finish_reason.clone(),
            prompt_tokens: c.prompt_tokens,
            completion_tokens: c.completion_tokens,
            output_token_ids_len: c.output_token_ids.len(),
            output_text: c.output_text.clone(),
        },
    };
    let (done, judged) = tokio::sync::oneshot::channel();
    model.batch.audit(
        request,
        Box::new(move |verdict| {
            let _ = done.send(verdict);
        }),
    );
    let verdict = match judged.await {
        Ok(Ok(v)) => v,
        Ok(Err(e)) => {
            return Outcome::Failure {
                retryable: !e.is_client_error(),
                reason: format!("audit failed: {e}"),
            }
        }
        Err(_) => {
            return Outcome::Failure {
                reason: "the model's batch thread ended".into(),
                retryable: true,
            }
        }
    };
    Outcome::Verdict(claim::sign_verdict(
        AuditVerdict {
            job_id: a.job_id.clone(),
            claim_signature: signed.signature.clone(),
            passed: verdict.passed(),
            findings: verdict.findings.iter().map(ToString::to_string).collect(),
            worst_gap: verdict.worst_gap,
            statistic: verdict.statistic,
            limit: verdict.limit,
            auditor_id: ctx.identity.node_id().as_bytes().to_vec(),
        },
        ctx.identity.signing_key(),
    ))
}

/// Sends the job's last message and finishes the stream.
async fn finish(send: &mut quinn::SendStream, outcome: Outcome) -> Result<(), JobError> {
    let msg = match outcome {
        Outcome::Cancelled => return Ok(()),
        Outcome::Claim(signed) => {
            if let Some(c) = &signed.claim {
                tracing::info!(tokens = c.completion_tokens, finish = %c.finish_reason, "job done");
            }
            job_update::Msg::Result(signed)
        }
        Outcome::Verdict(v) => {
            if let Some(v) = &v.verdict {
                tracing::info!(passed = v.passed, findings = ?v.findings, "audit done");
            }
            job_update::Msg::Verdict(v)
        }
        Outcome::Failure { reason, retryable } => {
            tracing::info!(%reason, retryable, "job refused or failed");
            job_update::Msg::Failure(job_update::Failure { reason, retryable })
        }
    };
    match write_frame(send, &JobUpdate { msg: Some(msg) }).await {
        // Checked before any byte is written, so the stream is still clean.
        Err(FrameError::TooLarge { len, max }) => {
            let failure = job_update::Failure {
                reason: format!("result of {len} bytes exceeds the {max}-byte frame cap"),
                retryable: false,
            };
            write_frame(
                send,
                &JobUpdate {
                    msg: Some(job_update::Msg::Failure(failure)),
                },
            )
            .await?;
        }
        other => other?,
    }
    send.finish()?;
    Ok(())
}

/// The engine's input for a job's input.
fn prompt_input(input: &JobInput) -> PromptInput {
    match &input.kind {
        Some(job_input::Kind::Chat(chat)) => PromptInput::Chat(
            chat.messages
                .iter()
                .map(|m| ChatTurn {
                    role: m.role.clone(),
                    content: m.content.clone(),
                })
                .collect(),
        ),
        Some(job_input::Kind::Prompt(p)) => PromptInput::Text(p.clone()),
        None => PromptInput::Text(String::new()),
    }
}

/// The engine's sampling for a job's parameters; zero values mean the
/// documented defaults (`common.proto`), `max_tokens` 0 the engine default.
/// A malformed grammar (the coordinator checks it first) is refused.
fn sampling(p: Option<&SamplingParams>) -> Result<Sampling, GrammarError> {
    let defaults = Sampling::default();
    let Some(p) = p else { return Ok(defaults) };
    Ok(Sampling {
        temperature: p.temperature,
        top_k: p.top_k as usize,
        top_p: p.top_p,
        min_p: p.min_p,
        repetition_penalty: p.repetition_penalty,
        // The coordinator always sets a seed; absent, 0 keeps the run reproducible.
        seed: p.seed.unwrap_or(0),
        max_tokens: if p.max_tokens == 0 {
            defaults.max_tokens
        } else {
            p.max_tokens as usize
        },
        stop: p.stop.clone(),
        logprobs: p.logprobs.map(|k| k as usize),
        presence_penalty: p.presence_penalty,
        frequency_penalty: p.frequency_penalty,
        logit_bias: p.logit_bias.iter().map(|b| (b.token_id, b.bias)).collect(),
        grammar: p.grammar.as_ref().map(Constraint::from_wire).transpose()?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunk(index: usize) -> TokenChunk {
        TokenChunk {
            index,
            token_id: 100 + index as u32,
            text: format!("t{index}"),
            logprobs: None,
        }
    }

    #[test]
    fn tokens_coalesce_while_the_channel_is_full_and_none_are_lost() {
        let (tx, mut rx) = mpsc::channel(1);
        let mut c = Coalescer::new(tx, Arc::new(AtomicBool::new(false)), Arc::default());
        for i in 0..5 {
            assert!(c.push(&chunk(i)).is_continue());
        }
        // The first token went through; the next four wait as one batch.
        assert_eq!(
            rx.try_recv().unwrap(),
            TokenBatch {
                index: 0,
                token_ids: vec![100],
                text: "t0".into(),
                logprobs: Vec::new(),
            }
        );
        assert!(rx.try_recv().is_err());
        assert!(c.push(&chunk(5)).is_continue());
        assert_eq!(
            rx.try_recv().unwrap(),
            TokenBatch {
                index: 1,
                token_ids: vec![101, 102, 103, 104, 105],
                text: "t1t2t3t4t5".into(),
                logprobs: Vec::new(),
            }
        );
        assert!(c.push(&chunk(6)).is_continue());
        assert!(c.push(&chunk(7)).is_continue());
        // What could not be sent yet is handed back at the end.
        assert_eq!(
            c.finish().map(|b| (b.index, b.token_ids)),
            Some((7, vec![107]))
        );
        assert_eq!(rx.try_recv().unwrap().index, 6);
    }

    #[test]
    fn coalesced_tokens_keep_one_logprob_entry_per_id() {
        use crate::engine::{Logprob, TokenLogprobs};
        let with_lp = |index: usize| TokenChunk {
            logprobs: Some(TokenLogprobs {
                chosen: Logprob {
                    token_id: 100 + index as u32,
                    logprob: -(index as f32),
                    bytes: b"t".to_vec(),
                },
                top: vec![Logprob {
                    token_id: 1,
                    logprob: -0.0,
                    bytes: b"a".to_vec(),
                }],
            }),
            ..chunk(index)
        };
        let (tx, mut rx) = mpsc::channel(1);
        let mut c = Coalescer::new(tx, Arc::new(AtomicBool::new(false)), Arc::default());
        for i in 0..4 {
            assert!(c.push(&with_lp(i)).is_continue());
        }
        let first = rx.try_recv().unwrap();
        let rest = c.finish().expect("the held batch");
        for b in [first, rest] {
            assert_eq!(b.logprobs.len(), b.token_ids.len());
            for (i, l) in b.logprobs.iter().enumerate() {
                assert_eq!(l.logprob, -((b.index + i) as f32));
                assert_eq!((l.token.as_slice(), l.top[0].token_id), (&b"t"[..], 1));
            }
        }
    }

    #[test]
    fn cancel_or_a_gone_listener_stops_the_engine() {
        let (tx, _rx) = mpsc::channel(4);
        let cancel = Arc::new(AtomicBool::new(false));
        let mut c = Coalescer::new(tx, cancel.clone(), Arc::default());
        assert!(c.push(&chunk(0)).is_continue());
        cancel.store(true, Ordering::Relaxed);
        assert!(c.push(&chunk(1)).is_break());

        let (tx, rx) = mpsc::channel(4);
        let mut c = Coalescer::new(tx, Arc::new(AtomicBool::new(false)), Arc::default());
        drop(rx);
        assert!(c.push(&chunk(0)).is_break());

        // A hand-off stops it too, and the refused token is not taken.
        let (tx, mut rx) = mpsc::channel(4);
        let drain = Arc::new(DrainState::default());
        let mut c = Coalescer::new(tx, Arc::new(AtomicBool::new(false)), drain.clone());
        assert!(c.push(&chunk(0)).is_continue());
        drain.start();
        assert!(
            c.push(&chunk(1)).is_continue(),
            "draining alone lets jobs run"
        );
        drain.hand_off();
        assert!(c.push(&chunk(2)).is_break());
        assert_eq!(c.finish(), None);
        assert_eq!(rx.try_recv().unwrap().index, 0);
        assert_eq!(rx.try_recv().unwrap().index, 1);
        assert!(rx.try_recv().is_err());
    }

    #[test]
    fn sampling_zero_values_mean_defaults() {
        let s = sampling(Some(&SamplingParams {
            temperature: 0.7,
            top_k: 40,
            seed: None,
            max_tokens: 0,
            stop: vec!["\n\n".into()],
            presence_penalty: -0.5,
            frequency_penalty: 1.5,
            logit_bias: vec![
                mlxnet_proto::v1::LogitBias {
                    token_id: 7,
                    bias: -100.0,
                },
                mlxnet_proto::v1::LogitBias {
                    token_id: 3,
                    bias: 2.5,
                },
            ],
            grammar: Some(Constraint::JsonObject.to_wire()),
            ..Default::default()
        }))
        .unwrap();
        assert_eq!(s.grammar, Some(Constraint::JsonObject));
        let unnamed = SamplingParams {
            grammar: Some(mlxnet_proto::v1::Grammar::default()),
            ..Default::default()
        };
        assert_eq!(sampling(Some(&unnamed)), Err(GrammarError::NoKind));
        assert_eq!(s.max_tokens, Sampling::default().max_tokens);
        assert_eq!((s.seed, s.top_k, s.temperature), (0, 40, 0.7));
        assert_eq!(s.stop, vec!["\n\n".to_string()]);
        assert_eq!((s.presence_penalty, s.frequency_penalty), (-0.5, 1.5));
        assert_eq!(s.logit_bias, vec![(7, -100.0), (3, 2.5)]);
        assert_eq!(sampling(None), Ok(Sampling::default()));
        let chat = JobInput {
            kind: Some(job_input::Kind::Chat(mlxnet_proto::v1::ChatMessages {
                messages: vec![mlxnet_proto::v1::ChatMessage {
                    role: "user".into(),
                    content: "hi".into(),
                }],
            })),
        };
        assert_eq!(
            prompt_input(&chat),
            PromptInput::Chat(vec![ChatTurn {
                role: "user".into(),
                content: "hi".into()
            }])
        );
    }
}
