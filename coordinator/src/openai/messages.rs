//! Anthropic's Messages API, `POST /v1/messages` (coding agents speak it):
//! the same chat jobs as `/v1/chat/completions`, Anthropic's shapes.
//!
//! Read: `model`, `max_tokens` (required), `messages` (user and assistant;
//! content a string or text blocks), `system` (a string or text blocks),
//! `stop_sequences`, `temperature` (0-1), `top_p`, `top_k`, `stream`,
//! `metadata.user_id`. `tools`, `tool_choice` and `thinking` are refused
//! (400) until the network serves them. The key comes in `x-api-key` (or
//! `Authorization: Bearer`); `anthropic-version` is accepted.
//!
//! Streaming sends Anthropic's events: `message_start`,
//! `content_block_start`, `ping`, `content_block_delta`*,
//! `content_block_stop`, `message_delta` (stop reason, output tokens),
//! `message_stop`; a job that fails mid-stream ends with an `error` event.
//! Errors are `{"type": "error", "error": {"type", "message"}}` with the
//! statuses of the OpenAI routes.

use std::{convert::Infallible, sync::Arc};

use axum::{
    extract::{Request, State},
    http::{header, HeaderMap, HeaderValue, StatusCode},
    response::{
        sse::{Event, KeepAlive, Sse},
        IntoResponse, Response,
    },
    Json,
};
use mlxnet_proto::v1::{job_input, ChatMessage, ChatMessages, SamplingParams, SubmitJobRequest};
use serde_json::{json, Value};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use super::{
    accept, chat::content, job, new_text, params::Params, stream, CancelOnDrop, Events, JobMeta,
    OpenAiError, Outcome, Started,
};
use crate::api::ApiContext;

/// A parsed Messages request.
#[derive(Debug, Clone, PartialEq)]
pub struct MessagesRequest {
    pub submit: SubmitJobRequest,
    pub stream: bool,
}

/// An OpenAI-shaped error as Anthropic's.
fn anthropic(e: OpenAiError) -> Response {
    let kind = match e.status {
        StatusCode::BAD_REQUEST => "invalid_request_error",
        StatusCode::UNAUTHORIZED => "authentication_error",
        StatusCode::PAYMENT_REQUIRED => "billing_error",
        StatusCode::FORBIDDEN => "permission_error",
        StatusCode::NOT_FOUND => "not_found_error",
        StatusCode::PAYLOAD_TOO_LARGE => "request_too_large",
        StatusCode::TOO_MANY_REQUESTS => "rate_limit_error",
        StatusCode::SERVICE_UNAVAILABLE => "overloaded_error",
        _ => "api_error",
    };
    let retry = matches!(
        e.status,
        StatusCode::TOO_MANY_REQUESTS | StatusCode::SERVICE_UNAVAILABLE
    );
    let body = json!({"type": "error", "error": {"type": kind, "message": e.message}});
    let mut resp = (e.status, Json(body)).into_response();
    if retry {
        resp.headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    }
    resp
}

/// `x-api-key` as the bearer the key check reads.
fn with_bearer(headers: &HeaderMap) -> HeaderMap {
    let mut h = headers.clone();
    if let Some(k) = headers.get("x-api-key").and_then(|v| v.to_str().ok()) {
        if let Ok(v) = HeaderValue::from_str(&format!("Bearer {}", k.trim())) {
            h.insert(header::AUTHORIZATION, v);
        }
    }
    h
}

fn system(v: Option<Value>) -> Result<Option<String>, OpenAiError> {
    let text = content(v, "system")?;
    Ok((!text.is_empty()).then_some(text))
}

/// Parses a Messages request body (nothing is submitted here).
pub fn parse(map: serde_json::Map<String, Value>) -> Result<MessagesRequest, OpenAiError> {
    let mut p = Params::new(map);
    let model = p.required_string("model")?;
    let max_tokens = p
        .integer("max_tokens", 1, i64::from(u32::MAX))?
        .ok_or_else(|| OpenAiError::invalid("max_tokens is required", Some("max_tokens")))?;
    let mut msgs = Vec::new();
    if let Some(s) = system(p.take("system"))? {
        msgs.push(ChatMessage {
            role: "system".into(),
            content: s,
        });
    }
    let Some(Value::Array(items)) = p.take("messages") else {
        return Err(OpenAiError::invalid(
            "messages is required: a list of {role, content}",
            Some("messages"),
        ));
    };
    for (i, m) in items.into_iter().enumerate() {
        let at = format!("messages[{i}]");
        let role = match m.get("role").and_then(Value::as_str) {
            Some(r @ ("user" | "assistant")) => r.to_owned(),
            _ => {
                return Err(OpenAiError::invalid(
                    format!("{at}.role must be user or assistant"),
                    Some("messages"),
                ))
            }
        };
        msgs.push(ChatMessage {
            role,
            content: content(m.get("content").cloned(), &format!("{at}.content"))?,
        });
    }
    let stop = match p.take("stop_sequences") {
        None => Vec::new(),
        Some(Value::Array(v)) => v
            .into_iter()
            .map(|s| match s {
                Value::String(s) => Ok(s),
                _ => Err(OpenAiError::invalid(
                    "stop_sequences must be a list of strings",
                    Some("stop_sequences"),
                )),
            })
            .collect::<Result<_, _>>()?,
        Some(_) => {
            return Err(OpenAiError::invalid(
                "stop_sequences must be a list of strings",
                Some("stop_sequences"),
            ))
        }
    };
    let temperature = p.number("temperature", 0.0, 1.0)?;
    let top_p = p.number("top_p", 0.0, 1.0)?;
    let top_k = p.integer("top_k", 0, i64::from(u32::MAX))?;
    let stream = p.bool("stream")?.unwrap_or(false);
    match p.take("metadata") {
        None => {}
        Some(Value::Object(mut m)) => {
            m.remove("user_id");
            if let Some(k) = m.keys().next() {
                return Err(OpenAiError::invalid(
                    format!("unknown metadata field {k:?}"),
                    Some("metadata"),
                ));
            }
        }
        Some(_) => {
            return Err(OpenAiError::invalid(
                "metadata must be an object",
                Some("metadata"),
            ))
        }
    }
    for name in ["tools", "tool_choice", "thinking"] {
        if p.take(name).is_some() {
            return Err(OpenAiError::unsupported(
                name,
                "not served yet by this network",
            ));
        }
    }
    p.finish()?;
    Ok(MessagesRequest {
        submit: job(
            model,
            job_input::Kind::Chat(ChatMessages { messages: msgs }),
            SamplingParams {
                top_k: top_k.map_or(0, |k| k as u32),
                ..super::sampling(temperature, top_p, None, stop, max_tokens as u32)
            },
        ),
        stream,
    })
}

/// Anthropic's `stop_reason` (and `stop_sequence`, when one was asked for
/// and the claim says a stop string ended the job) of a claim's finish.
fn stop_reason(claim: &str, stops: &[String]) -> (&'static str, Value) {
    match claim {
        "length" => ("max_tokens", Value::Null),
        "stop" => (
            "stop_sequence",
            match stops {
                [one] => json!(one),
                _ => Value::Null,
            },
        ),
        _ => ("end_turn", Value::Null),
    }
}

pub async fn handle(State(d): State<Arc<ApiContext>>, req: Request) -> Response {
    run(&d, req).await.unwrap_or_else(anthropic)
}

async fn run(d: &Arc<ApiContext>, req: Request) -> Result<Response, OpenAiError> {
    let headers = with_bearer(req.headers());
    let (caller, permit, body) = accept(d, &headers, req).await?;
    let m = parse(body)?;
    let stops = m
        .submit
        .sampling
        .as_ref()
        .map(|s| s.stop.clone())
        .unwrap_or_default();
    let job = Started::new(d, &caller, m.submit, permit).await?;
    if m.stream {
        return Ok(job.stream(|meta, events, cancel| sse(meta, events, cancel, stops)));
    }
    let ok = |meta: &JobMeta, end: Outcome| {
        let (reason, seq) = stop_reason(&end.claim_finish, &stops);
        Json(json!({
            "id": meta.id.to_string(),
            "type": "message",
            "role": "assistant",
            "model": meta.model,
            "content": [{"type": "text", "text": end.text}],
            "stop_reason": reason,
            "stop_sequence": seq,
            "usage": {"input_tokens": end.prompt_tokens, "output_tokens": end.completion_tokens},
        }))
        .into_response()
    };
    Ok(job.finish(ok, anthropic).await)
}

fn event(name: &str, v: Value) -> Event {
    Event::default().event(name).data(v.to_string())
}

fn error_event(message: &str) -> Event {
    event(
        "error",
        json!({"type": "error", "error": {"type": "api_error", "message": message}}),
    )
}

fn sse(
    meta: JobMeta,
    mut events: Events,
    mut cancel: CancelOnDrop,
    stops: Vec<String>,
) -> Response {
    let (tx, rx) = mpsc::channel::<Result<Event, Infallible>>(32);
    tokio::spawn(async move {
        let start = json!({"type": "message_start", "message": {
            "id": meta.id.to_string(), "type": "message", "role": "assistant",
            "model": meta.model, "content": [], "stop_reason": null, "stop_sequence": null,
            "usage": {"input_tokens": 0, "output_tokens": 0},
        }});
        let opening = [
            event("message_start", start),
            event(
                "content_block_start",
                json!({"type": "content_block_start", "index": 0,
                       "content_block": {"type": "text", "text": ""}}),
            ),
            event("ping", json!({"type": "ping"})),
        ];
        for e in opening {
            if tx.send(Ok(e)).await.is_err() {
                return;
            }
        }
        let mut sent = 0u32;
        loop {
            let next = tokio::select! {
                _ = tx.closed() => return,
                e = events.recv() => e,
            };
            let Some(e) = next else {
                let _ = tx
                    .send(Ok(error_event(&stream::ended_early().message)))
                    .await;
                return;
            };
            if let Some(text) = new_text(&e, &mut sent) {
                if let Some(text) = text {
                    let delta = json!({"type": "content_block_delta", "index": 0,
                                       "delta": {"type": "text_delta", "text": text}});
                    if tx
                        .send(Ok(event("content_block_delta", delta)))
                        .await
                        .is_err()
                    {
                        return;
                    }
                }
                continue;
            }
            match stream::outcome(e) {
                Ok(None) => continue,
                Ok(Some(end)) => {
                    cancel.disarm();
                    let (reason, seq) = stop_reason(&end.claim_finish, &stops);
                    let closing = [
                        event(
                            "content_block_stop",
                            json!({"type": "content_block_stop", "index": 0}),
                        ),
                        event(
                            "message_delta",
                            json!({"type": "message_delta",
                                   "delta": {"stop_reason": reason, "stop_sequence": seq},
                                   "usage": {"output_tokens": end.completion_tokens}}),
                        ),
                        event("message_stop", json!({"type": "message_stop"})),
                    ];
                    for e in closing {
                        let _ = tx.send(Ok(e)).await;
                    }
                    return;
                }
                Err(err) => {
                    cancel.disarm();
                    let _ = tx.send(Ok(error_event(&err.message))).await;
                    return;
                }
            }
        }
    });
    Sse::new(ReceiverStream::new(rx))
        .keep_alive(KeepAlive::default())
        .into_response()
}
