//! `POST /v1/completions`: OpenAI (legacy) text completions as prompt jobs.
//!
//! Read: `model`, `prompt` (a string, or a list of one string), `stream`,
//! `stream_options.include_usage`, `max_tokens` (default 16, as OpenAI's),
//! `temperature`, `top_p`, `seed`, `stop`, `echo`, `n` and `best_of` (1),
//! `user`, `presence_penalty` / `frequency_penalty` (-2 to 2), `logit_bias`
//! (token id -> -100 to 100, at most 300), `logprobs` (0-20 alternatives;
//! not with `echo`: the prompt's are not computed), `suffix` (refused: no
//! catalogue model does fill-in-the-middle).

use std::sync::Arc;

use axum::{
    extract::Request,
    response::{IntoResponse, Response},
    Json,
};
use mlxnet_proto::v1::{job_input, SubmitJobRequest};
use serde_json::{json, Value};

use super::{
    accept, job, logprobs, params::Params, sampling, stream, JobMeta, OpenAiError, Outcome, Started,
};
use crate::{api::ApiContext, domain::job::MAX_LOGPROBS};

/// OpenAI's default `max_tokens` for completions.
pub const DEFAULT_MAX_TOKENS: u32 = 16;

/// A parsed completions request.
#[derive(Debug, Clone, PartialEq)]
pub struct CompletionRequest {
    pub submit: SubmitJobRequest,
    pub stream: bool,
    pub include_usage: bool,
    /// The prompt, when `echo` asks for it before the completion.
    pub echo: Option<String>,
}

fn prompt(v: Option<Value>) -> Result<String, OpenAiError> {
    let bad = || {
        OpenAiError::invalid(
            "prompt must be a string or a list of one string",
            Some("prompt"),
        )
    };
    match v {
        None => Err(OpenAiError::invalid("prompt is required", Some("prompt"))),
        Some(Value::String(s)) => Ok(s),
        Some(Value::Array(mut items)) => match (items.len(), items.pop()) {
            (1, Some(Value::String(s))) => Ok(s),
            (n, _) if n > 1 => Err(OpenAiError::unsupported(
                "prompt",
                "one prompt per request is served; send several requests",
            )),
            _ => Err(bad()),
        },
        Some(_) => Err(bad()),
    }
}

/// Parses a completions request body (nothing is submitted here).
pub fn parse(map: serde_json::Map<String, Value>) -> Result<CompletionRequest, OpenAiError> {
    let mut p = Params::new(map);
    let model = p.required_string("model")?;
    let text = prompt(p.take("prompt"))?;
    let stream = p.bool("stream")?.unwrap_or(false);
    let include_usage = p.include_usage(stream)?;
    let max_tokens = p.max_tokens()?;
    let temperature = p.number("temperature", 0.0, 2.0)?;
    let top_p = p.number("top_p", 0.0, 1.0)?;
    let seed = p.seed("seed")?;
    let stop = p.stop("stop")?;
    let echo = p.bool("echo")?.unwrap_or(false);
    p.only_one("n")?;
    p.only_one("best_of")?;
    p.string("user")?;
    let penalties = p.penalties()?;
    let logprobs = p.integer("logprobs", 0, i64::from(MAX_LOGPROBS))?;
    if logprobs.is_some() && echo {
        return Err(OpenAiError::unsupported(
            "logprobs",
            "the prompt's log probabilities (echo with logprobs) are not served",
        ));
    }
    if p.string("suffix")?.is_some_and(|s| !s.is_empty()) {
        return Err(OpenAiError::unsupported(
            "suffix",
            "this model does not support fill-in-the-middle",
        ));
    }
    p.finish()?;
    let mut sampling = sampling(
        temperature,
        top_p,
        seed,
        stop,
        if max_tokens == 0 {
            DEFAULT_MAX_TOKENS
        } else {
            max_tokens
        },
    );
    sampling.logprobs = logprobs.map(|k| k as u32);
    penalties.apply(&mut sampling);
    Ok(CompletionRequest {
        echo: echo.then(|| text.clone()),
        submit: job(model, job_input::Kind::Prompt(text), sampling),
        stream,
        include_usage,
    })
}

pub async fn run(d: &Arc<ApiContext>, req: Request) -> Result<Response, OpenAiError> {
    let headers = req.headers().clone();
    let (caller, permit, body) = accept(d, &headers, req).await?;
    let c = parse(body)?;
    let asked = c
        .submit
        .sampling
        .as_ref()
        .is_some_and(|s| s.logprobs.is_some());
    let job = Started::new(d, &caller, c.submit, permit).await?;
    if c.stream {
        let (usage, shape) = (c.include_usage, stream::Shape::Text { echo: c.echo });
        return Ok(job.stream(|m, e, cancel| stream::sse(m, e, cancel, shape, usage)));
    }
    let echo = c.echo;
    let ok = |meta: &JobMeta, end: Outcome| {
        let text = echo.unwrap_or_default() + &end.text;
        Json(json!({
            "id": meta.id.to_string(),
            "object": "text_completion",
            "created": meta.created,
            "model": meta.model,
            "system_fingerprint": meta.fingerprint,
            "choices": [{
                "index": 0,
                "text": text,
                "logprobs": asked.then(|| logprobs::text(&end.logprobs, 0)),
                "finish_reason": end.finish,
            }],
            "usage": end.usage(),
        }))
        .into_response()
    };
    Ok(job.finish(ok, IntoResponse::into_response).await)
}
