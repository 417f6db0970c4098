//! `POST /v1/chat/completions`: OpenAI chat requests as chat jobs.
//!
//! Read: `model`, `messages` (roles system, developer (as system), user,
//! assistant (with `tool_calls`), tool (with `tool_call_id`); content a
//! string or a list of text parts), `stream`,
//! `stream_options.include_usage`, `max_tokens` / `max_completion_tokens`,
//! `temperature` (0-2), `top_p` (0-1), `seed`, `stop` (string or list), `n`
//! (1), `user`, `parallel_tool_calls`, `presence_penalty` /
//! `frequency_penalty` (-2 to 2), `logit_bias` (token id -> -100 to 100, at
//! most 300, ids in the model's vocabulary), `response_format` (`text`,
//! `json_object`, `json_schema`: enforced on the node by a token mask, see
//! `mlxnet_proto::grammar`), `tools`, `tool_choice` (`none`, `auto`,
//! `required`, a named function) and `parallel_tool_calls` (see
//! [`super::tools`]: calls are generated under a grammar and answered as
//! `tool_calls`, several allowed when `parallel_tool_calls` is true or
//! absent), `logprobs` and `top_logprobs` (0-20, only with
//! `logprobs: true`). Anything else, or a value this network cannot honour,
//! is a 400 naming the parameter.

use std::{collections::HashMap, sync::Arc};

use axum::{
    extract::Request,
    response::{IntoResponse, Response},
    Json,
};
use mlxnet_proto::grammar::Constraint;
use mlxnet_proto::v1::{job_input, ChatMessage, ChatMessages, SubmitJobRequest};
use serde_json::{json, Value};

use super::{
    accept, job, logprobs, params::Params, sampling, stream, tools, JobMeta, OpenAiError, Outcome,
    Started,
};
use crate::{api::ApiContext, domain::job::MAX_LOGPROBS};

/// A parsed chat request.
#[derive(Debug, Clone, PartialEq)]
pub struct ChatRequest {
    pub submit: SubmitJobRequest,
    pub stream: bool,
    pub include_usage: bool,
    /// The answer may be a tool call: read back as `tool_calls` when it is
    /// a whole one.
    pub tool_call: bool,
}

/// The chat role a message's role is sent to the model as.
fn role(r: &str) -> Result<&'static str, OpenAiError> {
    match r {
        "system" | "developer" => Ok("system"),
        "user" => Ok("user"),
        "assistant" => Ok("assistant"),
        "tool" => Ok("tool"),
        "function" => Err(OpenAiError::unsupported(
            "messages",
            "the deprecated role \"function\" is not served: send tool results as role \"tool\"",
        )),
        other => Err(OpenAiError::invalid(
            format!(
                "invalid role {:?}: one of system, developer, user, assistant, tool",
                other.chars().take(32).collect::<String>()
            ),
            Some("messages"),
        )),
    }
}

/// A message's content: a string, or a list of text parts joined.
pub fn content(v: Option<Value>, at: &str) -> Result<String, OpenAiError> {
    match v {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s),
        Some(Value::Array(parts)) => {
            let mut text = String::new();
            for p in parts {
                match (p.get("type").and_then(Value::as_str), p.get("text")) {
                    (Some("text"), Some(Value::String(t))) => text.push_str(t),
                    (Some(kind), _) if kind != "text" => {
                        return Err(OpenAiError::unsupported(
                            at,
                            &format!("content parts of type {kind:?} are not served (text only)"),
                        ))
                    }
                    _ => {
                        return Err(OpenAiError::invalid(
                            format!("{at}: a content part must be {{\"type\": \"text\", \"text\": \"...\"}}"),
                            Some(at),
                        ))
                    }
                }
            }
            Ok(text)
        }
        Some(_) => Err(OpenAiError::invalid(
            format!("{at}: content must be a string or a list of text parts"),
            Some(at),
        )),
    }
}

fn messages(v: Option<Value>) -> Result<Vec<ChatMessage>, OpenAiError> {
    let Some(Value::Array(items)) = v else {
        return Err(OpenAiError::invalid(
            "messages is required: a list of {role, content}",
            Some("messages"),
        ));
    };
    let mut out: Vec<ChatMessage> = Vec::with_capacity(items.len());
    // The tool calls of earlier assistant messages: id -> tool name.
    let mut calls = HashMap::new();
    // The last message sent is tool results (the next one joins it).
    let mut after_result = false;
    for (i, m) in items.into_iter().enumerate() {
        let at = format!("messages[{i}]");
        let Value::Object(mut m) = m else {
            return Err(OpenAiError::invalid(
                format!("{at} must be an object"),
                Some(&at),
            ));
        };
        let r = match m.remove("role") {
            Some(Value::String(r)) => role(&r)?,
            _ => {
                return Err(OpenAiError::invalid(
                    format!("{at}.role is required"),
                    Some(&at),
                ))
            }
        };
        let mut text = content(m.remove("content"), &format!("{at}.content"))?;
        match (r, m.remove("tool_calls").filter(|v| !v.is_null())) {
            ("assistant", Some(c)) => text = tools::assistant_calls(&at, text, c, &mut calls)?,
            (_, Some(_)) => {
                return Err(OpenAiError::invalid(
                    format!("{at}: only assistant messages carry tool_calls"),
                    Some("messages"),
                ))
            }
            (_, None) => {}
        }
        let call = if r == "tool" {
            m.remove("tool_call_id")
        } else {
            None
        };
        // `name` labels a participant; the templates have no place for it.
        m.remove("name");
        m.remove("refusal");
        if let Some(k) = m.keys().find(|k| !m[k.as_str()].is_null()) {
            return Err(OpenAiError::invalid(
                format!("{at}: unknown field {k:?}"),
                Some(&at),
            ));
        }
        if r == "tool" {
            // A tool result is a user turn naming its call (every template
            // has a user role; consecutive results make one turn).
            let result = tools::result_text(&at, call, &text, &calls)?;
            match out.last_mut() {
                Some(last) if after_result => {
                    last.content.push_str("\n\n");
                    last.content.push_str(&result);
                }
                _ => out.push(ChatMessage {
                    role: "user".into(),
                    content: result,
                }),
            }
            after_result = true;
            continue;
        }
        after_result = false;
        out.push(ChatMessage {
            role: r.into(),
            content: text,
        });
    }
    Ok(out)
}

/// `response_format`: `text` (or absent) is free text; `json_object` any
/// JSON object; `json_schema` `{name, schema, strict?, description?}` the
/// schema, as its JSON text (keys in the client's order). Enforced whatever
/// `strict` says (a mask never hopes). The grammar is compiled here, so a
/// schema the engine cannot enforce is a 400 naming `response_format`
/// before anything is stored or held.
fn response_format(v: Option<Value>) -> Result<Option<Constraint>, OpenAiError> {
    const P: &str = "response_format";
    let bad = |m: String| OpenAiError::invalid(m, Some(P));
    let Some(v) = v.filter(|v| !v.is_null()) else {
        return Ok(None);
    };
    let Value::Object(mut rf) = v else {
        return Err(bad("response_format must be an object with a type".into()));
    };
    let kind = match rf.remove("type") {
        Some(Value::String(t)) => t,
        _ => {
            return Err(bad(
                "response_format.type must be text, json_object or json_schema".into(),
            ))
        }
    };
    let c = match kind.as_str() {
        "text" => None,
        "json_object" => Some(Constraint::JsonObject),
        "json_schema" => {
            let Some(Value::Object(mut js)) = rf.remove("json_schema") else {
                return Err(bad(
                    "response_format.json_schema is required: {name, schema, strict}".into(),
                ));
            };
            match js.remove("name") {
                Some(Value::String(n))
                    if !n.is_empty()
                        && n.len() <= 64
                        && n.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-') => {}
                _ => {
                    return Err(bad(
                        "response_format.json_schema.name is required: 1 to 64 of a-z, A-Z, 0-9, _ and -"
                            .into(),
                    ))
                }
            }
            if !matches!(
                js.remove("description"),
                None | Some(Value::Null | Value::String(_))
            ) {
                return Err(bad(
                    "response_format.json_schema.description must be a string".into(),
                ));
            }
            if !matches!(
                js.remove("strict"),
                None | Some(Value::Null | Value::Bool(_))
            ) {
                return Err(bad(
                    "response_format.json_schema.strict must be a boolean".into()
                ));
            }
            let schema = match js.remove("schema") {
                Some(schema @ Value::Object(_)) => schema,
                _ => {
                    return Err(bad(
                        "response_format.json_schema.schema is required: a JSON Schema object"
                            .into(),
                    ))
                }
            };
            if let Some(k) = js.keys().next() {
                return Err(bad(format!(
                    "response_format.json_schema: unknown field {k:?}"
                )));
            }
            Some(Constraint::JsonSchema(schema.to_string()))
        }
        _ => {
            return Err(bad(
                "response_format.type must be text, json_object or json_schema".into(),
            ))
        }
    };
    if let Some(k) = rf.keys().next() {
        return Err(bad(format!("response_format: unknown field {k:?}")));
    }
    if let Some(c) = &c {
        c.check()
            .map_err(|e| bad(format!("response_format: {e}")))?;
    }
    Ok(c)
}

/// Parses a chat request body (nothing is submitted here).
pub fn parse(map: serde_json::Map<String, Value>) -> Result<ChatRequest, OpenAiError> {
    let mut p = Params::new(map);
    let model = p.required_string("model")?;
    let mut msgs = messages(p.take("messages"))?;
    let stream = p.bool("stream")?.unwrap_or(false);
    let include_usage = p.include_usage(stream)?;
    let max_tokens = p.max_tokens()?;
    let temperature = p.number("temperature", 0.0, 2.0)?;
    let top_p = p.number("top_p", 0.0, 1.0)?;
    let seed = p.seed("seed")?;
    let stop = p.stop("stop")?;
    p.only_one("n")?;
    p.string("user")?;
    let parallel = p.bool("parallel_tool_calls")?;
    let penalties = p.penalties()?;
    let mut grammar = response_format(p.take("response_format"))?;
    let tools = tools::parse_tools(p.take("tools"))?;
    let forced = tools::forced(tools, p.take("tool_choice"), parallel)?;
    if let Some(f) = &forced {
        if grammar.is_some() {
            return Err(OpenAiError::invalid(
                "response_format cannot be combined with tools (unless tool_choice is \"none\"): the answer's grammar is the tools'",
                Some("response_format"),
            ));
        }
        grammar = Some(f.grammar()?);
        let preamble = f.preamble();
        match msgs.first_mut() {
            Some(first) if first.role == "system" => {
                first.content.push_str("\n\n");
                first.content.push_str(&preamble);
            }
            _ => msgs.insert(
                0,
                ChatMessage {
                    role: "system".into(),
                    content: preamble,
                },
            ),
        }
    }
    let logprobs = p.bool("logprobs")?.unwrap_or(false);
    let top = p.integer("top_logprobs", 0, i64::from(MAX_LOGPROBS))?;
    if top.is_some() && !logprobs {
        return Err(OpenAiError::invalid(
            "top_logprobs requires logprobs: true",
            Some("top_logprobs"),
        ));
    }
    p.finish()?;
    let mut sampling = sampling(temperature, top_p, seed, stop, max_tokens);
    penalties.apply(&mut sampling);
    sampling.logprobs = logprobs.then(|| top.unwrap_or(0) as u32);
    sampling.grammar = grammar.map(|g| g.to_wire());
    Ok(ChatRequest {
        submit: job(
            model,
            job_input::Kind::Chat(ChatMessages { messages: msgs }),
            sampling,
        ),
        stream,
        include_usage,
        tool_call: forced.is_some(),
    })
}

pub async fn run(d: &Arc<ApiContext>, req: Request) -> Result<Response, OpenAiError> {
    let headers = req.headers().clone();
    let (caller, permit, body) = accept(d, &headers, req).await?;
    let chat = parse(body)?;
    let asked = chat
        .submit
        .sampling
        .as_ref()
        .is_some_and(|s| s.logprobs.is_some());
    let tool_call = chat.tool_call;
    let job = Started::new(d, &caller, chat.submit, permit).await?;
    if chat.stream {
        let usage = chat.include_usage;
        let shape = if tool_call {
            stream::Shape::ChatCall
        } else {
            stream::Shape::Chat
        };
        return Ok(job.stream(|m, e, c| stream::sse(m, e, c, shape, usage)));
    }
    let ok = |meta: &JobMeta, end: Outcome| {
        let calls = tool_call.then(|| tools::read_calls(&end.text)).flatten();
        let (message, finish) = match calls {
            Some(calls) => (
                json!({
                    "role": "assistant",
                    "content": null,
                    "tool_calls": calls
                        .iter()
                        .enumerate()
                        .map(|(i, (name, args))| {
                            tools::call_json(&tools::call_id(&meta.id, i), name, args)
                        })
                        .collect::<Vec<_>>(),
                    "refusal": null,
                }),
                "tool_calls",
            ),
            None => (
                json!({"role": "assistant", "content": end.text, "refusal": null}),
                end.finish,
            ),
        };
        Json(json!({
            "id": meta.id.to_string(),
            "object": "chat.completion",
            "created": meta.created,
            "model": meta.model,
            "system_fingerprint": meta.fingerprint,
            "choices": [{
                "index": 0,
                "message": message,
                "logprobs": asked.then(|| logprobs::chat(&end.logprobs)),
                "finish_reason": finish,
            }],
            "usage": end.usage(),
        }))
        .into_response()
    };
    Ok(job.finish(ok, IntoResponse::into_response).await)
}
