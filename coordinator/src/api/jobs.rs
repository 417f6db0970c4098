//! Jobs: submit (validated; nothing is stored unless every check passes),
//! get, watch (replay, then live, until the job ends), cancel, list.

use std::{pin::Pin, sync::Arc};

use futures::Stream;
use mlxnet_proto::grammar::Constraint;
use mlxnet_proto::money::mlx;
use mlxnet_proto::{
    ids::JobId,
    v1::{
        job_event, job_input, jobs_server::Jobs, CancelJobRequest, GetJobRequest, Job, JobEvent,
        ListJobsRequest, ListJobsResponse, LogitBias, SamplingParams, SubmitJobRequest,
        WatchJobRequest,
    },
};
use tokio::sync::{broadcast::error::RecvError, mpsc};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

use super::{auth::caller, limits::Limits, ApiContext};
use crate::{
    api::error::ApiError,
    catalogue::Catalogue,
    domain::{
        job::{is_terminal_event, terminal_event, to_proto, MAX_BIAS, MAX_LOGIT_BIAS, MAX_PENALTY},
        Caller, CancelOutcome, JobRecord, JobState, JobTerms, NewJob, RelayChunk, Scope, Segment,
    },
    ledger::settle,
    relay::Follower,
    store::{AnyStore, Store, StoreError},
};

/// Chat roles a model template knows.
const ROLES: [&str; 3] = ["system", "user", "assistant"];
/// Highest job priority a client may ask for (see `SubmitJobRequest.priority`).
pub const MAX_PRIORITY: u8 = crate::scheduler::queue::MAX_RANK;
const LIST_DEFAULT: u32 = 20;
const LIST_MAX: u32 = 200;

pub struct JobsApi {
    d: Arc<ApiContext>,
}

impl JobsApi {
    pub fn new(d: Arc<ApiContext>) -> Self {
        Self { d }
    }
}

/// Checks a submit request against the catalogue and limits and returns the
/// job to store, with defaults applied and a seed chosen when none was given.
pub fn validate_submit(
    req: SubmitJobRequest,
    catalogue: &Catalogue,
    limits: &Limits,
    seed: impl FnOnce() -> u64,
) -> Result<NewJob, ApiError> {
    let invalid = |m: String| ApiError::InvalidArgument(m);
    if req.model.is_empty() {
        return Err(invalid("model is required (see `mlxnet models`)".into()));
    }
    let Some(model) = catalogue.get(&req.model) else {
        return Err(ApiError::NotFound(format!(
            "unknown model {:?}; see `mlxnet models` for the catalogue",
            req.model.chars().take(64).collect::<String>()
        )));
    };
    let input = req.input.unwrap_or_default();
    let bytes = match &input.kind {
        None => {
            return Err(invalid(
                "input is required: a prompt or chat messages".into(),
            ))
        }
        Some(job_input::Kind::Prompt(p)) => {
            if p.trim().is_empty() {
                return Err(invalid("prompt is empty".into()));
            }
            p.len()
        }
        Some(job_input::Kind::Chat(chat)) => {
            if chat.messages.is_empty() {
                return Err(invalid("chat has no messages".into()));
            }
            if chat.messages.len() > limits.max_chat_messages {
                return Err(invalid(format!(
                    "chat has {} messages; the limit is {}",
                    chat.messages.len(),
                    limits.max_chat_messages
                )));
            }
            if let Some(m) = chat
                .messages
                .iter()
                .find(|m| !ROLES.contains(&m.role.as_str()))
            {
                return Err(invalid(format!(
                    "chat role {:?} is not one of system, user, assistant",
                    m.role.chars().take(32).collect::<String>()
                )));
            }
            if chat.messages.iter().all(|m| m.content.trim().is_empty()) {
                return Err(invalid(
                    "prompt is empty: every chat message is blank".into(),
                ));
            }
            chat.messages.iter().map(|m| m.content.len()).sum()
        }
    };
    if bytes > limits.max_prompt_bytes {
        return Err(invalid(format!(
            "prompt is {bytes} bytes; the limit is {}",
            limits.max_prompt_bytes
        )));
    }
    let mut s: SamplingParams = req.sampling.unwrap_or_default();
    if s.max_tokens == 0 {
        s.max_tokens = limits.default_max_tokens;
    }
    if s.max_tokens > limits.max_tokens {
        return Err(invalid(format!(
            "max_tokens {} exceeds the limit of {}",
            s.max_tokens, limits.max_tokens
        )));
    }
    if s.max_tokens > model.info.context_length {
        return Err(invalid(format!(
            "max_tokens {} exceeds the model's context of {} tokens",
            s.max_tokens, model.info.context_length
        )));
    }
    let in_range = |name: &str, v: f32, lo: f32, hi: f32| {
        if v.is_finite() && (lo..=hi).contains(&v) {
            Ok(())
        } else {
            Err(invalid(format!(
                "{name} must be between {lo} and {hi}, got {v}"
            )))
        }
    };
    in_range("temperature", s.temperature, 0.0, 2.0)?;
    in_range("top_p", s.top_p, 0.0, 1.0)?;
    in_range("min_p", s.min_p, 0.0, 1.0)?;
    in_range("repetition_penalty", s.repetition_penalty, 0.0, 10.0)?;
    if let Some(k) = s.logprobs.filter(|&k| k > crate::domain::job::MAX_LOGPROBS) {
        return Err(invalid(format!(
            "logprobs {k} must be at most {}",
            crate::domain::job::MAX_LOGPROBS
        )));
    }
    in_range(
        "presence_penalty",
        s.presence_penalty,
        -MAX_PENALTY,
        MAX_PENALTY,
    )?;
    in_range(
        "frequency_penalty",
        s.frequency_penalty,
        -MAX_PENALTY,
        MAX_PENALTY,
    )?;
    check_logit_bias(&s.logit_bias, model.info.vocab_size)?;
    if let Some(g) = &s.grammar {
        // Compiled here, so a grammar no node could enforce is refused
        // before anything is stored or held.
        Constraint::from_wire(g)
            .and_then(|c| c.check())
            .map_err(|e| invalid(format!("grammar (response_format): {e}")))?;
    }
    if s.stop.len() > limits.max_stop_strings {
        return Err(invalid(format!(
            "{} stop strings; the limit is {}",
            s.stop.len(),
            limits.max_stop_strings
        )));
    }
    if let Some(bad) = s
        .stop
        .iter()
        .find(|x| x.is_empty() || x.len() > limits.max_stop_bytes)
    {
        return Err(invalid(format!(
            "stop strings must be 1 to {} bytes, got one of {} bytes",
            limits.max_stop_bytes,
            bad.len()
        )));
    }
    if s.seed.is_none() {
        s.seed = Some(seed());
    }
    let priority = u8::try_from(req.priority)
        .ok()
        .filter(|p| *p <= MAX_PRIORITY)
        .ok_or_else(|| {
            invalid(format!(
                "priority must be 0 to {MAX_PRIORITY}, got {}",
                req.priority
            ))
        })?;
    Ok(NewJob {
        id: JobId::new(),
        model: model.info.id.clone(),
        input,
        sampling: s,
        priority,
    })
}

/// `logit_bias`: at most [`MAX_LOGIT_BIAS`] entries, each id once and in
/// the model's vocabulary of `vocab` tokens (0 = unknown: the node checks),
/// each bias within `-MAX_BIAS..=MAX_BIAS`.
fn check_logit_bias(bias: &[LogitBias], vocab: u32) -> Result<(), ApiError> {
    let invalid = ApiError::InvalidArgument;
    if bias.len() > MAX_LOGIT_BIAS {
        return Err(invalid(format!(
            "logit_bias has {} entries; the limit is {MAX_LOGIT_BIAS}",
            bias.len()
        )));
    }
    let mut seen = std::collections::HashSet::with_capacity(bias.len());
    for b in bias {
        if !(b.bias.is_finite() && b.bias.abs() <= MAX_BIAS) {
            return Err(invalid(format!(
                "logit_bias of token {} must be between -{MAX_BIAS} and {MAX_BIAS}, got {}",
                b.token_id, b.bias
            )));
        }
        if vocab > 0 && b.token_id >= vocab {
            return Err(invalid(format!(
                "logit_bias names token {}, outside the model's vocabulary of {vocab} tokens",
                b.token_id
            )));
        }
        if !seen.insert(b.token_id) {
            return Err(invalid(format!(
                "logit_bias names token {} twice",
                b.token_id
            )));
        }
    }
    Ok(())
}

/// Who pays for `job` and how much it may cost; refuses a job above the
/// client's price limit (`max_price`, 0 = none) before anything is stored.
fn job_terms(
    catalogue: &Catalogue,
    job: &NewJob,
    account: String,
    max_price: u64,
) -> Result<JobTerms, ApiError> {
    let model = catalogue
        .get(&job.model)
        .ok_or_else(|| ApiError::NotFound(format!("unknown model {:?}", job.model)))?;
    let price = model.price();
    let most = settle::max_price(&price, &job.input, job.sampling.max_tokens);
    if max_price > 0 && u64::try_from(most).unwrap_or(u64::MAX) > max_price {
        return Err(ApiError::FailedPrecondition(format!(
            "this job may cost up to {} MLX ({most} micro-MLX), above its max_price of {max_price} micro-MLX; \
             lower max_tokens or raise max_price",
            mlx(most)
        )));
    }
    Ok(JobTerms {
        account,
        price,
        max_price: most,
    })
}

/// A completed job's hand-off segments, which its Completed event carries so
/// a watcher verifies it whole; none for a job in any other state.
async fn completed_segments(store: &AnyStore, job: &JobRecord) -> Result<Vec<Segment>, StoreError> {
    if job.state != JobState::Completed {
        return Ok(Vec::new());
    }
    store.segments(job.id).await
}

/// The events of job `id` from its start (replayed) until it ends, as the
/// gRPC Watch sends them (the caller has checked the job is theirs). The
/// stream ends after the terminal event, or with an error when the
/// coordinator stops or the watch fell behind.
pub async fn watch_events(
    d: &Arc<ApiContext>,
    id: JobId,
) -> Result<mpsc::Receiver<Result<JobEvent, Status>>, ApiError> {
    if let Some(follower) = d.relay.follow(id) {
        return watch_relayed(d, id, follower).await;
    }
    // Subscribe before reading the store, so nothing that happens after
    // the read is missed.
    let sub = d.hub.subscribe(id);
    let job = match d.store.get_job(id).await {
        Ok(Some(job)) => job,
        Ok(None) => {
            drop(sub);
            d.hub.forget_if_idle(id);
            return Err(not_found(id));
        }
        Err(e) => {
            drop(sub);
            d.hub.forget_if_idle(id);
            return Err(ApiError::from(e));
        }
    };
    let segments = match completed_segments(&d.store, &job).await {
        Ok(s) => s,
        Err(e) => {
            drop(sub);
            d.hub.forget_if_idle(id);
            return Err(ApiError::from(e));
        }
    };
    let (tx, rx) = mpsc::channel::<Result<JobEvent, Status>>(64);
    let d = Arc::clone(d);
    tokio::spawn(async move {
        let event = |e: job_event::Event| {
            Ok(JobEvent {
                job_id: id.to_string(),
                event: Some(e),
            })
        };
        if let Some(end) = terminal_event(&job, &segments) {
            drop(sub);
            d.hub.forget_if_idle(id);
            let _ = tx.send(Ok(end)).await;
            return;
        }
        let first = state_event(&job);
        // The first event says the state the store had at the read; an
        // Assigned or Queued published between the subscription and that
        // read is already in it, and sending it again would tell the client
        // of an assignment that never happened (seen as one node assigned
        // twice for one attempt).
        let seen = state_step(&first);
        if tx.send(event(first)).await.is_err() {
            return;
        }
        for chunk in sub.tokens {
            if tx
                .send(event(job_event::Event::Tokens(chunk)))
                .await
                .is_err()
            {
                return;
            }
        }
        let mut rx = sub.rx;
        loop {
            let next = tokio::select! {
                _ = d.shutdown.cancelled() => {
                    let _ = tx.send(Err(Status::unavailable("the coordinator is shutting down"))).await;
                    return;
                }
                _ = tx.closed() => return,
                n = rx.recv() => n,
            };
            match next {
                Ok(e) if is_stale(&e, seen) => {}
                Ok(e) => {
                    let end = is_terminal_event(&e);
                    if tx.send(Ok(e)).await.is_err() || end {
                        return;
                    }
                }
                Err(RecvError::Lagged(_)) | Err(RecvError::Closed) => {
                    // Fell behind, or the job ended and its channel closed:
                    // the store has the truth.
                    let now = match d.store.get_job(id).await {
                        Ok(Some(job)) => completed_segments(&d.store, &job)
                            .await
                            .map(|s| Some((job, s))),
                        Ok(None) => Ok(None),
                        Err(e) => Err(e),
                    };
                    match now {
                        Ok(Some((job, segments))) if job.state.is_terminal() => {
                            if let Some(end) = terminal_event(&job, &segments) {
                                let _ = tx.send(Ok(end)).await;
                            }
                        }
                        Ok(_) => {
                            let _ = tx
                                .send(Err(Status::data_loss(
                                    "the watch fell behind the job; watch again",
                                )))
                                .await;
                        }
                        Err(e) => {
                            let _ = tx.send(Err(ApiError::from(e).into())).await;
                        }
                    }
                    return;
                }
            }
        }
    });
    Ok(rx)
}

/// The event that says an unfinished job's state as stored: Queued or
/// Assigned (a running job is assigned).
fn state_event(job: &JobRecord) -> job_event::Event {
    match job.state {
        JobState::Queued => job_event::Event::Queued(job_event::Queued {
            attempt: job.attempt,
            reason: job.error.clone().unwrap_or_default(),
        }),
        _ => job_event::Event::Assigned(job_event::Assigned {
            node_id: job.node_id.clone().unwrap_or_default(),
            attempt: job.attempt,
        }),
    }
}

/// Where a watcher following the relay stands in a job's stream: the
/// attempt of the last chunk it sent, and the index of the next token.
type Position = Option<(u32, u32)>;

/// What to do with a relayed chunk at `pos` (see [`watch_relayed`]).
#[derive(Debug, PartialEq, Eq)]
enum Placed {
    /// The next tokens (or, from a later attempt, the stream rewinding to
    /// where that attempt resumed): send it.
    Send,
    /// Already sent, or an earlier attempt's: skip it.
    Skip,
    /// Tokens before it are missing (deleted after the job ended while the
    /// watcher lagged): the watch cannot go on whole.
    Gap,
}

fn place(pos: &mut Position, c: &RelayChunk) -> Placed {
    let index = c.chunk.index;
    let placed = match *pos {
        None if index == 0 => Placed::Send,
        None => Placed::Gap,
        Some((attempt, next)) if c.attempt == attempt && index == next => Placed::Send,
        Some((attempt, next)) if c.attempt > attempt && index <= next => Placed::Send,
        Some((attempt, next)) if c.attempt < attempt || index < next => Placed::Skip,
        Some(_) => Placed::Gap,
    };
    if placed == Placed::Send {
        let len = u32::try_from(c.chunk.token_ids.len()).unwrap_or(u32::MAX);
        *pos = Some((c.attempt, index.saturating_add(len)));
    }
    placed
}

/// [`watch_events`] through the token relay (several replicas share the
/// database): every state comes from the job's row and every token from
/// the relayed chunks, read on each wake-up (or poll), so a job running on
/// any replica streams whole. Each pass reads the row first, then the
/// chunks: a row that says the job ended was written after all its chunks
/// (the dispatcher flushes them first), so the last pass sends every token
/// before the end. A queue/assignment step is sent when the row shows a
/// later one than was sent (steps between two reads are not replayed).
async fn watch_relayed(
    d: &Arc<ApiContext>,
    id: JobId,
    mut follower: Follower,
) -> Result<mpsc::Receiver<Result<JobEvent, Status>>, ApiError> {
    let job = d.store.get_job(id).await?.ok_or_else(|| not_found(id))?;
    let segments = completed_segments(&d.store, &job).await?;
    let (tx, rx) = mpsc::channel::<Result<JobEvent, Status>>(64);
    let d = Arc::clone(d);
    tokio::spawn(async move {
        let event = |e: job_event::Event| {
            Ok(JobEvent {
                job_id: id.to_string(),
                event: Some(e),
            })
        };
        if let Some(end) = terminal_event(&job, &segments) {
            let _ = tx.send(Ok(end)).await;
            return;
        }
        let first = state_event(&job);
        let mut seen = state_step(&first);
        if tx.send(event(first)).await.is_err() {
            return;
        }
        let mut pos: Position = None;
        loop {
            let pass = async {
                let job = d.store.get_job(id).await?;
                let chunks = follower.read().await?;
                let segments = match &job {
                    Some(job) => completed_segments(&d.store, job).await?,
                    None => Vec::new(),
                };
                Ok::<_, StoreError>((job, chunks, segments))
            };
            let (job, chunks, segments) = match pass.await {
                Ok((Some(job), chunks, segments)) => (job, chunks, segments),
                Ok((None, _, _)) => {
                    let _ = tx.send(Err(not_found(id).into())).await;
                    return;
                }
                Err(e) => {
                    let _ = tx.send(Err(ApiError::from(e).into())).await;
                    return;
                }
            };
            if !job.state.is_terminal() {
                let now = state_event(&job);
                let step = state_step(&now);
                if step > seen {
                    seen = step;
                    if tx.send(event(now)).await.is_err() {
                        return;
                    }
                }
            }
            for c in chunks {
                match place(&mut pos, &c) {
                    Placed::Send => {
                        if tx
                            .send(event(job_event::Event::Tokens(c.chunk)))
                            .await
                            .is_err()
                        {
                            return;
                        }
                    }
                    Placed::Skip => {}
                    Placed::Gap => {
                        let _ = tx
                            .send(Err(Status::data_loss(
                                "the watch fell behind the job; watch again",
                            )))
                            .await;
                        return;
                    }
                }
            }
            if let Some(end) = terminal_event(&job, &segments) {
                let _ = tx.send(Ok(end)).await;
                return;
            }
            tokio::select! {
                _ = d.shutdown.cancelled() => {
                    let _ = tx.send(Err(Status::unavailable("the coordinator is shutting down"))).await;
                    return;
                }
                _ = tx.closed() => return,
                _ = follower.changed() => {}
            }
        }
    });
    Ok(rx)
}

/// Where a queue/assignment event stands in a job's life: Queued for
/// attempt n, then Assigned for attempt n, then Queued for attempt n + 1.
/// `None` for every other event.
fn state_step(e: &job_event::Event) -> Option<u64> {
    match e {
        job_event::Event::Queued(q) => Some(2 * u64::from(q.attempt)),
        job_event::Event::Assigned(a) => Some(2 * u64::from(a.attempt) + 1),
        _ => None,
    }
}

/// Whether live event `e` is a queue/assignment step the watch's first
/// event (at `seen`) already reported.
fn is_stale(e: &JobEvent, seen: Option<u64>) -> bool {
    match (e.event.as_ref().and_then(state_step), seen) {
        (Some(step), Some(seen)) => step <= seen,
        _ => false,
    }
}

/// Whether an online node that takes jobs holds `model`'s file.
fn serving_now(d: &ApiContext, model: &str) -> bool {
    let Some(m) = d.catalogue.get(model) else {
        return false;
    };
    d.sessions.all().iter().any(|s| s.serves(&m.sha256))
}

/// Validates `request` for `me` and submits it as a job: every check
/// (catalogue, limits, a node that could ever hold it, the price limit, the
/// queue's room, the balance) passes before anything is stored, so a refused
/// request holds no tokens and creates no job. The gRPC Submit and the
/// OpenAI-compatible HTTP API both come through here; with `now`, a job no
/// online node serves at this moment is refused ([`ApiError::NoNode`])
/// instead of queued (an HTTP client waits on its answer).
pub async fn submit_job(
    d: &ApiContext,
    me: &Caller,
    request: SubmitJobRequest,
    now: bool,
) -> Result<JobRecord, ApiError> {
    let price_limit = request.max_price_micro_mlx;
    let job = validate_submit(request, &d.catalogue, &d.limits, rand::random)?;
    if let Some(why) = d.dispatcher.never_fits(&job) {
        return Err(ApiError::NoNode(format!(
            "no online node or pod could ever hold this job: {why}"
        )));
    }
    if now && !serving_now(d, &job.model) {
        return Err(ApiError::NoNode(format!(
            "no online node serves model {} now; try again later",
            job.model
        )));
    }
    let terms = job_terms(&d.catalogue, &job, me.account_id.clone(), price_limit)?;
    let queued = d
        .admission
        .queued(|| d.store.count_queued())
        .await
        .map_err(ApiError::from)?;
    if queued >= d.limits.max_queued_jobs {
        return Err(ApiError::ResourceExhausted(format!(
            "the queue is full ({queued} jobs waiting); try again later"
        )));
    }
    let record = d
        .dispatcher
        .submit(job, &terms)
        .await
        .map_err(ApiError::from)?;
    d.admission.note_queued();
    Ok(record)
}

impl JobsApi {
    /// A job is visible to the account that submitted it, and to admins; to
    /// anyone else it does not exist.
    async fn check_owner(&self, me: &Caller, id: JobId) -> Result<(), ApiError> {
        if me.scopes.allows(Scope::Admin) {
            return Ok(());
        }
        match self.d.ledger.job_terms(id).await? {
            Some(t) if t.account == me.account_id => Ok(()),
            _ => Err(not_found(id)),
        }
    }
}

fn parse_id(id: &str) -> Result<JobId, ApiError> {
    id.parse().map_err(|_| {
        ApiError::InvalidArgument(format!(
            "job id {:?} is not a job id",
            id.chars().take(64).collect::<String>()
        ))
    })
}

fn not_found(id: JobId) -> ApiError {
    ApiError::NotFound(format!("no job {id}"))
}

type EventStream = Pin<Box<dyn Stream<Item = Result<JobEvent, Status>> + Send>>;

#[tonic::async_trait]
impl Jobs for JobsApi {
    async fn submit(&self, req: Request<SubmitJobRequest>) -> Result<Response<Job>, Status> {
        let me = caller(&req)?;
        let record = submit_job(&self.d, &me, req.into_inner(), false).await?;
        Ok(Response::new(to_proto(&record, &[])))
    }

    async fn get(&self, req: Request<GetJobRequest>) -> Result<Response<Job>, Status> {
        let me = caller(&req)?;
        let id = parse_id(&req.into_inner().job_id)?;
        self.check_owner(&me, id).await?;
        let job = self
            .d
            .store
            .get_job(id)
            .await
            .map_err(ApiError::from)?
            .ok_or_else(|| not_found(id))?;
        let segments = self.d.store.segments(id).await.map_err(ApiError::from)?;
        Ok(Response::new(to_proto(&job, &segments)))
    }

    type WatchStream = EventStream;

    async fn watch(
        &self,
        req: Request<WatchJobRequest>,
    ) -> Result<Response<Self::WatchStream>, Status> {
        let me = caller(&req)?;
        let id = parse_id(&req.into_inner().job_id)?;
        self.check_owner(&me, id).await?;
        let rx = watch_events(&self.d, id).await?;
        Ok(Response::new(
            Box::pin(ReceiverStream::new(rx)) as EventStream
        ))
    }

    async fn cancel(&self, req: Request<CancelJobRequest>) -> Result<Response<Job>, Status> {
        let me = caller(&req)?;
        let id = parse_id(&req.into_inner().job_id)?;
        self.check_owner(&me, id).await?;
        match self.d.dispatcher.cancel(id).await.map_err(ApiError::from)? {
            CancelOutcome::NotFound => return Err(not_found(id).into()),
            CancelOutcome::AlreadyFinished(state) if state != JobState::Cancelled => {
                return Err(
                    ApiError::FailedPrecondition(format!("job {id} already {state}")).into(),
                )
            }
            CancelOutcome::AlreadyFinished(_) | CancelOutcome::Cancelled => {}
        }
        let job = self
            .d
            .store
            .get_job(id)
            .await
            .map_err(ApiError::from)?
            .ok_or_else(|| not_found(id))?;
        let segments = self.d.store.segments(id).await.map_err(ApiError::from)?;
        Ok(Response::new(to_proto(&job, &segments)))
    }

    async fn list(
        &self,
        req: Request<ListJobsRequest>,
    ) -> Result<Response<ListJobsResponse>, Status> {
        let me = caller(&req)?;
        let limit = match req.into_inner().limit {
            0 => LIST_DEFAULT,
            n => n.min(LIST_MAX),
        };
        let jobs = if me.scopes.allows(Scope::Admin) {
            self.d
                .store
                .list_jobs(limit)
                .await
                .map_err(ApiError::from)?
        } else {
            let mut jobs = Vec::new();
            for id in self
                .d
                .ledger
                .jobs_of(&me.account_id, limit)
                .await
                .map_err(ApiError::from)?
            {
                if let Some(job) = self
                    .d
                    .store
                    .get_job(parse_id(&id)?)
                    .await
                    .map_err(ApiError::from)?
                {
                    jobs.push(job);
                }
            }
            jobs
        };
        Ok(Response::new(ListJobsResponse {
            jobs: jobs.iter().map(|j| to_proto(j, &[])).collect(),
        }))
    }
}

#[cfg(test)]
mod watch_tests {
    use mlxnet_proto::v1::{job_event, JobEvent};

    use super::{is_stale, place, state_step, Placed, Position};
    use crate::domain::RelayChunk;
    use mlxnet_proto::ids::JobId;

    fn chunk(attempt: u32, index: u32, len: u32) -> RelayChunk {
        RelayChunk {
            job: JobId::new(),
            attempt,
            chunk: job_event::Tokens {
                index,
                token_ids: vec![0; len as usize],
                ..Default::default()
            },
        }
    }

    #[test]
    fn relayed_chunks_are_sent_once_in_order_and_a_later_attempt_rewinds() {
        let mut pos: Position = None;
        assert_eq!(
            place(&mut pos, &chunk(1, 2, 2)),
            Placed::Gap,
            "must start at 0"
        );
        assert_eq!(place(&mut pos, &chunk(1, 0, 3)), Placed::Send);
        assert_eq!(place(&mut pos, &chunk(1, 0, 3)), Placed::Skip, "a repeat");
        assert_eq!(place(&mut pos, &chunk(1, 3, 2)), Placed::Send);
        assert_eq!(
            place(&mut pos, &chunk(1, 7, 1)),
            Placed::Gap,
            "5 and 6 missing"
        );
        // Attempt 2 resumes after the kept 3 tokens: the stream rewinds.
        assert_eq!(place(&mut pos, &chunk(2, 3, 4)), Placed::Send);
        assert_eq!(pos, Some((2, 7)));
        assert_eq!(
            place(&mut pos, &chunk(1, 7, 1)),
            Placed::Skip,
            "an earlier attempt's"
        );
        assert_eq!(
            place(&mut pos, &chunk(3, 8, 1)),
            Placed::Gap,
            "past the end"
        );
    }

    fn queued(attempt: u32) -> job_event::Event {
        job_event::Event::Queued(job_event::Queued {
            attempt,
            reason: String::new(),
        })
    }

    fn assigned(attempt: u32) -> job_event::Event {
        job_event::Event::Assigned(job_event::Assigned {
            node_id: "n".into(),
            attempt,
        })
    }

    fn live(e: job_event::Event) -> JobEvent {
        JobEvent {
            job_id: "j".into(),
            event: Some(e),
        }
    }

    #[test]
    fn a_step_the_first_event_reported_is_not_sent_again() {
        // The read saw attempt 1 assigned: its Assigned (published before
        // the read) and its Queued are stale; the requeue and attempt 2 are not.
        let seen = state_step(&assigned(1));
        assert!(is_stale(&live(assigned(1)), seen));
        assert!(is_stale(&live(queued(1)), seen));
        assert!(!is_stale(&live(queued(2)), seen));
        assert!(!is_stale(&live(assigned(2)), seen));
        // The read saw attempt 2 queued: its assignment is news.
        let seen = state_step(&queued(2));
        assert!(is_stale(&live(queued(2)), seen));
        assert!(is_stale(&live(assigned(1)), seen));
        assert!(!is_stale(&live(assigned(2)), seen));
        // Tokens and the end are never stale.
        let tokens = job_event::Event::Tokens(job_event::Tokens::default());
        assert!(!is_stale(&live(tokens), seen));
        assert!(!is_stale(&live(assigned(1)), None));
    }
}
