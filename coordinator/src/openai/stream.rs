//! A job's events as OpenAI answers: the outcome a non-streaming answer is
//! built from ([`outcome`]), and the server-sent-event stream of chunks
//! ([`sse`]): the first chunk (the chat role), one chunk per token event,
//! a last chunk with `finish_reason`, with `stream_options.include_usage` a
//! usage chunk with `choices: []`, then `data: [DONE]`. Tool calls stream
//! as `delta.tool_calls` entries, one index per call
//! ([`super::tools::CallStream`]), and end with
//! `finish_reason: "tool_calls"`. A job that fails
//! mid-stream ends it with `data: {"error": ...}` (what the official clients
//! raise as an error).

use std::convert::Infallible;

use axum::{
    http::StatusCode,
    response::{
        sse::{Event, KeepAlive, Sse},
        IntoResponse, Response,
    },
};
use mlxnet_proto::v1::{job_event, JobEvent, TokenLogprob};
use serde_json::{json, Value};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use super::{
    finish_reason, logprobs, new_tokens, tools::CallStream, CancelOnDrop, Events, JobMeta,
    OpenAiError,
};

/// How a job ended well.
#[derive(Clone, Debug, PartialEq)]
pub struct Outcome {
    pub text: String,
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    /// OpenAI's `finish_reason`.
    pub finish: &'static str,
    /// The claim's own: "eos", "stop" (a stop string) or "length".
    pub claim_finish: String,
    /// One entry per streamed token when the job asked for logprobs (the
    /// node streams an end-of-generation token's id, and so its entry, when
    /// it held text back until the end).
    pub logprobs: Vec<TokenLogprob>,
}

impl Outcome {
    pub fn usage(&self) -> Value {
        json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        })
    }
}

fn server_error(status: StatusCode, message: String) -> OpenAiError {
    OpenAiError {
        status,
        message,
        kind: "server_error",
        param: None,
        code: None,
    }
}

/// The watch stopped before the job ended.
pub fn ended_early() -> OpenAiError {
    server_error(
        StatusCode::SERVICE_UNAVAILABLE,
        "the job's event stream ended before the job did".into(),
    )
}

/// The outcome an event ends the job with (`None`: not an ending).
pub fn outcome(e: Result<JobEvent, tonic::Status>) -> Result<Option<Outcome>, OpenAiError> {
    let e = e.map_err(|s| server_error(StatusCode::SERVICE_UNAVAILABLE, s.message().to_owned()))?;
    match e.event {
        Some(job_event::Event::Completed(c)) => {
            let job = c.job.unwrap_or_default();
            let claim = job.result.and_then(|r| r.claim).unwrap_or_default();
            Ok(Some(Outcome {
                text: job.output_text,
                prompt_tokens: claim.prompt_tokens,
                completion_tokens: claim.completion_tokens,
                finish: finish_reason(&claim.finish_reason),
                claim_finish: claim.finish_reason,
                logprobs: Vec::new(),
            }))
        }
        Some(job_event::Event::Failed(f)) => Err(server_error(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("the job failed: {}", f.reason),
        )),
        Some(job_event::Event::Cancelled(_)) => Err(server_error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "the job was cancelled".into(),
        )),
        _ => Ok(None),
    }
}

/// Which API's chunks.
#[derive(Clone, Debug)]
pub enum Shape {
    /// `chat.completion.chunk` with deltas.
    Chat,
    /// `chat.completion.chunk`s of a forced tool call: `delta.tool_calls`.
    ChatCall,
    /// `text_completion` chunks; `echo` is the prompt sent first.
    Text { echo: Option<String> },
}

impl Shape {
    /// A chunk of `text` (chat: a delta), the log-probabilities of its
    /// tokens (`logprobs`, the first at character `offset` of a completion's
    /// text) when the job asked for them.
    fn chunk(
        &self,
        meta: &JobMeta,
        text: Option<&str>,
        finish: Option<&str>,
        role: bool,
        lp: Option<(&[TokenLogprob], usize)>,
    ) -> Value {
        let choice = match self {
            Shape::Chat | Shape::ChatCall => {
                let mut delta = serde_json::Map::new();
                if role {
                    delta.insert("role".into(), json!("assistant"));
                }
                if let Some(t) = text {
                    delta.insert("content".into(), json!(t));
                }
                return self.delta(meta, delta, finish, lp.map(|(e, _)| e));
            }
            Shape::Text { .. } => {
                let lp = lp.map_or(Value::Null, |(e, at)| logprobs::text(e, at));
                json!({"index": 0, "text": text.unwrap_or(""), "logprobs": lp, "finish_reason": finish})
            }
        };
        self.object(meta, vec![choice])
    }

    /// A chat chunk of `delta`.
    fn delta(
        &self,
        meta: &JobMeta,
        delta: serde_json::Map<String, Value>,
        finish: Option<&str>,
        lp: Option<&[TokenLogprob]>,
    ) -> Value {
        let lp = lp.map_or(Value::Null, logprobs::chat);
        let choice = json!({"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish});
        self.object(meta, vec![choice])
    }

    fn object(&self, meta: &JobMeta, choices: Vec<Value>) -> Value {
        let object = match self {
            Shape::Chat | Shape::ChatCall => "chat.completion.chunk",
            Shape::Text { .. } => "text_completion",
        };
        json!({
            "id": meta.id.to_string(),
            "object": object,
            "created": meta.created,
            "model": meta.model,
            "system_fingerprint": meta.fingerprint,
            "choices": choices,
        })
    }
}

fn data(v: &Value) -> Event {
    Event::default().data(v.to_string())
}

/// The SSE answer following `events` to the job's end.
pub fn sse(
    meta: JobMeta,
    mut events: Events,
    mut cancel: CancelOnDrop,
    shape: Shape,
    include_usage: bool,
) -> Response {
    let (tx, rx) = mpsc::channel::<Result<Event, Infallible>>(32);
    tokio::spawn(async move {
        let with_usage = |mut v: Value| {
            if include_usage {
                v["usage"] = Value::Null;
            }
            v
        };
        let first = match &shape {
            Shape::Chat => Some(shape.chunk(&meta, Some(""), None, true, None)),
            Shape::ChatCall => Some(shape.chunk(&meta, None, None, true, None)),
            Shape::Text { echo: Some(p) } => Some(shape.chunk(&meta, Some(p), None, false, None)),
            Shape::Text { echo: None } => None,
        };
        if let Some(first) = first {
            if tx.send(Ok(data(&with_usage(first)))).await.is_err() {
                return;
            }
        }
        let mut call =
            matches!(shape, Shape::ChatCall).then(|| CallStream::new(meta.id.to_string()));
        let mut sent = 0u32;
        // Characters of the completion the tokens so far span.
        let mut offset = 0usize;
        loop {
            let next = tokio::select! {
                _ = tx.closed() => return,
                e = events.recv() => e,
            };
            let Some(e) = next else {
                let _ = tx.send(Ok(data(&ended_early().body()))).await;
                return;
            };
            if let Some(fresh) = new_tokens(&e, &mut sent) {
                // A chunk for new text, and for new tokens' logprobs even
                // when their text is held back (content "").
                let lp = (!fresh.logprobs.is_empty()).then_some((&fresh.logprobs[..], offset));
                if let Some(call) = call.as_mut() {
                    let more = fresh.text.as_deref().and_then(|t| call.push(t));
                    if more.is_some() || lp.is_some() {
                        let mut delta = serde_json::Map::new();
                        if let Some((field, v)) = more {
                            delta.insert(field.into(), v);
                        }
                        let v = with_usage(shape.delta(&meta, delta, None, lp.map(|l| l.0)));
                        if tx.send(Ok(data(&v))).await.is_err() {
                            return;
                        }
                    }
                    continue;
                }
                if fresh.text.is_some() || lp.is_some() {
                    let text = fresh.text.as_deref().unwrap_or("");
                    let v = with_usage(shape.chunk(&meta, Some(text), None, false, lp));
                    offset += logprobs::chars(&fresh.logprobs);
                    if tx.send(Ok(data(&v))).await.is_err() {
                        return;
                    }
                }
                continue;
            }
            match outcome(e) {
                Ok(None) => continue,
                Ok(Some(end)) => {
                    cancel.disarm();
                    let mut finish = end.finish;
                    if let Some(call) = call.as_mut() {
                        let (whole, rest) = call.end();
                        if whole {
                            finish = "tool_calls";
                        }
                        if let Some((field, v)) = rest {
                            let mut delta = serde_json::Map::new();
                            delta.insert(field.into(), v);
                            let v = with_usage(shape.delta(&meta, delta, None, None));
                            let _ = tx.send(Ok(data(&v))).await;
                        }
                    }
                    let last = with_usage(shape.chunk(&meta, None, Some(finish), false, None));
                    let _ = tx.send(Ok(data(&last))).await;
                    if include_usage {
                        let mut u = shape.object(&meta, Vec::new());
                        u["usage"] = end.usage();
                        let _ = tx.send(Ok(data(&u))).await;
                    }
                    let _ = tx.send(Ok(Event::default().data("[DONE]"))).await;
                    return;
                }
                Err(err) => {
                    cancel.disarm();
                    let _ = tx.send(Ok(data(&err.body()))).await;
                    return;
                }
            }
        }
    });
    Sse::new(ReceiverStream::new(rx))
        .keep_alive(KeepAlive::default())
        .into_response()
}
