//! The OpenAI-compatible HTTP API under `/v1` on the coordinator's HTTP
//! listener: `POST /v1/chat/completions` and `POST /v1/completions`
//! (streaming and not), `GET /v1/models` and `GET /v1/models/{id}`; and
//! Anthropic's `POST /v1/messages` ([`messages`], coding agents speak it).
//!
//! Why: clients reach inference through the OpenAI API (the official SDKs,
//! LangChain, coding agents); this lets them use the network unchanged.
//!
//! # Invariants
//! - A request is a job, through the same pipeline as the gRPC Submit
//!   ([`crate::api::jobs::submit_job`]): the same API keys (`Authorization:
//!   Bearer`, scope `submit`), the same per-key and global limits
//!   ([`crate::api::limits::Admission`], held until the response body ends),
//!   the same validation, escrow hold, placement, signed claim and
//!   settlement.
//! - Nothing is half-done: every parameter is checked before the job is
//!   submitted, so a refused request holds no tokens and creates no job. A
//!   parameter this network cannot honour is refused with 400 naming it,
//!   never parsed and ignored; an unknown one too (as OpenAI does).
//! - Every answer names its job: `id` is the job id (`mlxnet verify <id>`
//!   checks the signed claim behind it) and the `x-mlxnet-job-id` header
//!   carries it; `system_fingerprint` is the model file's SHA-256.
//! - A client that goes away (closes the stream, drops the connection)
//!   cancels its job.
//!
//! # Failure
//! Errors have OpenAI's shape `{"error": {"message", "type", "param",
//! "code"}}` ([`OpenAiError`]): 400 invalid request, 401 missing or bad key,
//! 402 insufficient balance (always 402), 403 a key without the scope, 404
//! unknown model, 413 a body over the limit, 429 (with `Retry-After`) on
//! limits and overload, 503 (with `Retry-After`) when no node serves the
//! model now. A job that fails after it started streams a final
//! `data: {"error": ...}` event (non-streaming: 500 or 503).

mod chat;
mod completions;
mod logprobs;
pub mod messages;
mod params;
mod stream;
mod tools;

use std::{sync::Arc, time::Duration};

use axum::{
    body::{Body, Bytes},
    extract::{Path, Request, State},
    http::{header, HeaderMap, HeaderValue, StatusCode},
    response::{IntoResponse, Response},
    routing::{any, get, post},
    Json, Router,
};
use mlxnet_proto::{
    ids::JobId,
    v1::{job_event, job_input, JobEvent, JobInput, SamplingParams, SubmitJobRequest},
};
use serde_json::{json, Value};

use crate::{
    api::{
        auth::admit_keyed,
        error::ApiError,
        jobs::{submit_job, watch_events},
        limits::Permit,
        ApiContext,
    },
    domain::{Caller, JobRecord, Scope},
    util::{error_chain, net::Held},
};

pub use stream::Outcome;

/// The header naming the job behind an answer.
pub const JOB_HEADER: &str = "x-mlxnet-job-id";

/// The `/v1` routes over the client API's context.
pub fn router(ctx: Arc<ApiContext>) -> Router {
    Router::new()
        .route(
            "/v1/chat/completions",
            post(
                |State(d): State<Arc<ApiContext>>, req: Request| async move {
                    answer(chat::run(&d, req).await)
                },
            ),
        )
        .route(
            "/v1/completions",
            post(
                |State(d): State<Arc<ApiContext>>, req: Request| async move {
                    answer(completions::run(&d, req).await)
                },
            ),
        )
        .route("/v1/messages", post(messages::handle))
        .route("/v1/models", get(list_models))
        .route("/v1/models/{*id}", get(get_model))
        .route("/v1", any(unknown_route))
        .route("/v1/{*rest}", any(unknown_route))
        .with_state(ctx)
}

/// A route's answer, or its error as a response.
fn answer(r: Result<Response, OpenAiError>) -> Response {
    r.unwrap_or_else(IntoResponse::into_response)
}

/// The sampling of an OpenAI-style request, with OpenAI's defaults
/// (temperature 1, top_p 1); `max_tokens` 0 is the listener's default.
fn sampling(
    temperature: Option<f64>,
    top_p: Option<f64>,
    seed: Option<u64>,
    stop: Vec<String>,
    max_tokens: u32,
) -> SamplingParams {
    SamplingParams {
        temperature: temperature.unwrap_or(1.0) as f32,
        top_p: top_p.unwrap_or(1.0) as f32,
        seed,
        stop,
        max_tokens,
        ..SamplingParams::default()
    }
}

/// The job request of `model` on `input`.
fn job(model: String, input: job_input::Kind, sampling: SamplingParams) -> SubmitJobRequest {
    SubmitJobRequest {
        model,
        input: Some(JobInput { kind: Some(input) }),
        sampling: Some(sampling),
        max_price_micro_mlx: 0,
        priority: 0,
    }
}

/// An error in OpenAI's shape, with its HTTP status.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OpenAiError {
    pub status: StatusCode,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
}

impl OpenAiError {
    /// 400 `invalid_request_error`.
    pub fn invalid(message: impl Into<String>, param: Option<&str>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: param.map(str::to_owned),
            code: None,
        }
    }

    /// 400 for a parameter this network does not honour (yet).
    pub fn unsupported(param: &str, why: &str) -> Self {
        Self {
            code: Some("unsupported_parameter"),
            ..Self::invalid(format!("{param}: {why}"), Some(param))
        }
    }

    /// 413: the request body is over the listener's limit.
    pub fn too_large(limit: usize) -> Self {
        Self {
            status: StatusCode::PAYLOAD_TOO_LARGE,
            message: format!("request body is over the limit of {limit} bytes"),
            kind: "invalid_request_error",
            param: None,
            code: Some("request_too_large"),
        }
    }

    /// 429: too many requests in flight or too fast.
    pub fn overloaded(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::TOO_MANY_REQUESTS,
            message: message.into(),
            kind: "rate_limit_error",
            param: None,
            code: Some("rate_limit_exceeded"),
        }
    }

    /// The JSON body.
    pub fn body(&self) -> Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }
}

impl From<ApiError> for OpenAiError {
    fn from(e: ApiError) -> Self {
        let with = |status, kind, code, message: String| Self {
            status,
            message,
            kind,
            param: None,
            code,
        };
        match e {
            ApiError::InvalidArgument(m) | ApiError::FailedPrecondition(m) => {
                Self::invalid(m, None)
            }
            ApiError::NotFound(m) => Self {
                param: Some("model".into()),
                ..with(
                    StatusCode::NOT_FOUND,
                    "invalid_request_error",
                    Some("model_not_found"),
                    m,
                )
            },
            ApiError::ResourceExhausted(m) => Self::overloaded(m),
            ApiError::InsufficientFunds(m) => with(
                StatusCode::PAYMENT_REQUIRED,
                "insufficient_quota",
                Some("insufficient_balance"),
                m,
            ),
            ApiError::NoNode(m) => with(
                StatusCode::SERVICE_UNAVAILABLE,
                "server_error",
                Some("no_node_available"),
                m,
            ),
            ApiError::Unauthenticated => with(
                StatusCode::UNAUTHORIZED,
                "invalid_request_error",
                Some("invalid_api_key"),
                crate::api::error::UNAUTHENTICATED.into(),
            ),
            ApiError::PermissionDenied(m) => with(
                StatusCode::FORBIDDEN,
                "permission_error",
                Some("insufficient_permissions"),
                m,
            ),
            ApiError::Internal(source) => {
                tracing::error!(error = %error_chain(&source), "OpenAI API request failed");
                internal()
            }
            ApiError::Ledger(source) => {
                tracing::error!(error = %error_chain(&source), "OpenAI API request failed");
                internal()
            }
        }
    }
}

fn internal() -> OpenAiError {
    OpenAiError {
        status: StatusCode::INTERNAL_SERVER_ERROR,
        message: "internal error".into(),
        kind: "server_error",
        param: None,
        code: None,
    }
}

impl IntoResponse for OpenAiError {
    fn into_response(self) -> Response {
        let retry = matches!(
            self.status,
            StatusCode::TOO_MANY_REQUESTS | StatusCode::SERVICE_UNAVAILABLE
        );
        let mut resp = (self.status, Json(self.body())).into_response();
        if retry {
            resp.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        resp
    }
}

/// The caller behind a request's key (`Authorization: Bearer`, or
/// Anthropic's `x-api-key`), admitted under the same limits as gRPC: the
/// permit must be held until the response ends.
async fn admit(d: &ApiContext, headers: &HeaderMap) -> Result<(Caller, Permit), OpenAiError> {
    Ok(admit_keyed(&d.ledger, &d.admission, headers, Scope::Submit).await?)
}

/// Reads the request body as a JSON object within the listener's timeout.
async fn read_json(
    d: &ApiContext,
    req: Request,
) -> Result<serde_json::Map<String, Value>, OpenAiError> {
    let read = axum::body::to_bytes(req.into_body(), usize::MAX);
    let bytes: Bytes = match tokio::time::timeout(
        Duration::from_millis(d.limits.request_timeout_ms),
        read,
    )
    .await
    {
        Err(_) => {
            return Err(OpenAiError::invalid(
                "the request body came too slowly",
                None,
            ))
        }
        Ok(Err(e)) => {
            // The listener's body cap cut it off (no content-length).
            if std::error::Error::source(&e)
                .is_some_and(|s| s.is::<http_body_util::LengthLimitError>())
            {
                return Err(OpenAiError::too_large(d.limits.max_http_body_bytes));
            }
            return Err(OpenAiError::invalid(
                "the request body could not be read",
                None,
            ));
        }
        Ok(Ok(b)) => b,
    };
    match serde_json::from_slice::<Value>(&bytes) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(_) => Err(OpenAiError::invalid(
            "the request body must be a JSON object",
            None,
        )),
        Err(e) => Err(OpenAiError::invalid(
            format!("the request body is not valid JSON: {e}"),
            None,
        )),
    }
}

/// What a handler knows about the job it submitted, to name it in the answer.
#[derive(Clone, Debug)]
pub struct JobMeta {
    pub id: JobId,
    pub model: String,
    pub created: i64,
    pub fingerprint: String,
}

/// The live events of a job.
pub type Events = tokio::sync::mpsc::Receiver<Result<JobEvent, tonic::Status>>;

/// An admitted request: its caller, its permit (held until the answer's
/// body ends) and its body.
async fn accept(
    d: &ApiContext,
    headers: &HeaderMap,
    req: Request,
) -> Result<(Caller, Permit, serde_json::Map<String, Value>), OpenAiError> {
    let (caller, permit) = admit(d, headers).await?;
    let body = read_json(d, req).await?;
    Ok((caller, permit, body))
}

/// A submitted job being answered.
pub struct Started {
    pub meta: JobMeta,
    events: Events,
    cancel: CancelOnDrop,
    permit: Permit,
}

impl Started {
    /// Submits `request` for `caller` (refused unless a node serves the
    /// model now) and follows its events; the job is cancelled if the
    /// answer is dropped before the job ends.
    async fn new(
        d: &Arc<ApiContext>,
        caller: &Caller,
        request: SubmitJobRequest,
        permit: Permit,
    ) -> Result<Self, OpenAiError> {
        let record: JobRecord = submit_job(d, caller, request, true).await?;
        let cancel = CancelOnDrop {
            d: Some(Arc::clone(d)),
            id: record.id,
        };
        let fingerprint = d
            .catalogue
            .get(&record.model)
            .map(|m| hex::encode(m.sha256))
            .unwrap_or_default();
        let meta = JobMeta {
            id: record.id,
            model: record.model.clone(),
            created: record.created_at_ms / 1000,
            fingerprint,
        };
        let events = watch_events(d, record.id).await?;
        Ok(Self {
            meta,
            events,
            cancel,
            permit,
        })
    }

    /// The streamed answer `sse` makes of the events.
    fn stream(self, sse: impl FnOnce(JobMeta, Events, CancelOnDrop) -> Response) -> Response {
        let id = self.meta.id;
        with_job(sse(self.meta, self.events, self.cancel), id, self.permit)
    }

    /// Waits for the job's end; the answer `ok` makes of it, or `err`'s of
    /// the failure, with the job header either way.
    async fn finish(
        mut self,
        ok: impl FnOnce(&JobMeta, Outcome) -> Response,
        err: impl FnOnce(OpenAiError) -> Response,
    ) -> Response {
        let mut end = Err(stream::ended_early());
        let mut collected = logprobs::Collected::default();
        while let Some(e) = self.events.recv().await {
            if let Ok(JobEvent {
                event: Some(job_event::Event::Tokens(chunk)),
                ..
            }) = &e
            {
                collected.add(chunk);
                continue;
            }
            match stream::outcome(e) {
                Ok(None) => continue,
                Ok(Some(o)) => end = Ok(o),
                Err(e) => end = Err(e),
            }
            break;
        }
        self.cancel.disarm();
        let resp = match end {
            Ok(mut o) => {
                o.logprobs = collected.into_entries();
                ok(&self.meta, o)
            }
            Err(e) => err(e),
        };
        with_job(resp, self.meta.id, self.permit)
    }
}

/// Cancels its job when dropped (the client went away), unless disarmed
/// once the job has ended.
pub struct CancelOnDrop {
    d: Option<Arc<ApiContext>>,
    id: JobId,
}

impl CancelOnDrop {
    pub fn disarm(&mut self) {
        self.d = None;
    }
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if let Some(d) = self.d.take() {
            let id = self.id;
            tokio::spawn(async move {
                if let Err(e) = d.dispatcher.cancel(id).await {
                    tracing::warn!(job = %id, error = %error_chain(&e), "cancelling an abandoned job failed");
                }
            });
        }
    }
}

/// A response with the job header, holding the request's permit until its
/// body ends.
fn with_job(resp: Response, id: JobId, permit: Permit) -> Response {
    let mut resp = resp.map(|b| Body::new(Held::new(b, Some(permit))));
    if let Ok(v) = HeaderValue::from_str(&id.to_string()) {
        resp.headers_mut().insert(JOB_HEADER, v);
    }
    resp
}

/// The OpenAI `finish_reason` of a claim's.
pub fn finish_reason(claim: &str) -> &'static str {
    match claim {
        "length" => "length",
        _ => "stop",
    }
}

async fn list_models(State(d): State<Arc<ApiContext>>) -> Response {
    let data: Vec<Value> = d
        .catalogue
        .models()
        .iter()
        .map(|m| model_json(&d, m))
        .collect();
    Json(json!({"object": "list", "data": data})).into_response()
}

async fn get_model(State(d): State<Arc<ApiContext>>, Path(id): Path<String>) -> Response {
    match d.catalogue.get(&id) {
        Some(m) => Json(model_json(&d, m)).into_response(),
        None => OpenAiError::from(ApiError::NotFound(format!(
            "the model {:?} does not exist; GET /v1/models lists the catalogue",
            id.chars().take(64).collect::<String>()
        )))
        .into_response(),
    }
}

/// A catalogue model as OpenAI's model object, with the network's extra
/// fields (nodes serving it now, prices, context, file digest).
fn model_json(d: &ApiContext, m: &crate::catalogue::Model) -> Value {
    let serving = d
        .sessions
        .all()
        .iter()
        .filter(|s| s.serves(&m.sha256))
        .count();
    json!({
        "id": m.info.id,
        "object": "model",
        "created": 0,
        "owned_by": "mlx-network",
        "context_length": m.info.context_length,
        "architecture": m.info.architecture,
        "parameters": m.info.parameters,
        "sha256": hex::encode(m.sha256),
        "nodes_serving": serving,
        "price_input_micro_mlx_per_mtok": m.price().input_per_mtok,
        "price_output_micro_mlx_per_mtok": m.price().output_per_mtok,
    })
}

async fn unknown_route(req: Request) -> Response {
    OpenAiError {
        status: StatusCode::NOT_FOUND,
        message: format!("unknown route {} {}", req.method(), req.uri().path()),
        kind: "invalid_request_error",
        param: None,
        code: Some("unknown_url"),
    }
    .into_response()
}

/// What a stream sends of a token event: its text, if it has any and is
/// new, and the log-probabilities of its new tokens.
#[derive(Debug, Default)]
struct Fresh {
    text: Option<String>,
    logprobs: Vec<mlxnet_proto::v1::TokenLogprob>,
}

/// What a stream sends of event `e`: `None` if it is not a token event;
/// else what is new in it (a retried attempt replays from its start: only
/// tokens past `sent` are sent on).
fn new_tokens(e: &Result<JobEvent, tonic::Status>, sent: &mut u32) -> Option<Fresh> {
    let Ok(JobEvent {
        event: Some(job_event::Event::Tokens(chunk)),
        ..
    }) = e
    else {
        return None;
    };
    let fresh = chunk.index >= *sent && !chunk.text.is_empty();
    let skip = (*sent).saturating_sub(chunk.index) as usize;
    let logprobs = chunk.logprobs.iter().skip(skip).cloned().collect();
    *sent = (*sent).max(chunk.index + chunk.token_ids.len() as u32);
    Some(Fresh {
        text: fresh.then(|| chunk.text.clone()),
        logprobs,
    })
}

/// [`new_tokens`]'s text only.
fn new_text(e: &Result<JobEvent, tonic::Status>, sent: &mut u32) -> Option<Option<String>> {
    new_tokens(e, sent).map(|f| f.text)
}

#[cfg(test)]
mod tests;
