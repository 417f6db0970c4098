//! The request parsers: what is read, what is refused and with which
//! parameter named (the whole API runs against a real node in the tests
//! crate).

use axum::http::StatusCode;
use mlxnet_proto::v1::job_input;
use serde_json::{json, Value};

use super::{chat, completions, messages, OpenAiError};

fn obj(v: Value) -> serde_json::Map<String, Value> {
    match v {
        Value::Object(m) => m,
        _ => unreachable!("test bodies are objects"),
    }
}

fn chat_err(v: Value) -> OpenAiError {
    chat::parse(obj(v)).expect_err("refused")
}

#[test]
fn a_chat_request_becomes_a_chat_job() {
    let c = chat::parse(obj(json!({
        "model": "m",
        "messages": [
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]},
        ],
        "max_completion_tokens": 7,
        "temperature": 0,
        "seed": -1,
        "stop": "\n",
        "stream": true,
        "stream_options": {"include_usage": true},
        "user": "u1",
        "n": 1,
        "presence_penalty": 0,
        "logprobs": false,
        "tool_choice": "none",
    })))
    .expect("valid");
    assert!(c.stream && c.include_usage);
    let s = c.submit.sampling.expect("sampling");
    assert_eq!(
        (s.max_tokens, s.temperature, s.seed),
        (7, 0.0, Some(u64::MAX))
    );
    assert_eq!(s.stop, vec!["\n".to_string()]);
    let Some(job_input::Kind::Chat(m)) = c.submit.input.and_then(|i| i.kind) else {
        panic!("a chat input");
    };
    assert_eq!(m.messages[0].role, "system");
    assert_eq!(m.messages[1].content, "Hi there");
}

#[test]
fn openai_defaults_apply() {
    let c = chat::parse(obj(
        json!({"model": "m", "messages": [{"role": "user", "content": "x"}]}),
    ))
    .expect("valid");
    let s = c.submit.sampling.expect("sampling");
    // OpenAI's temperature default is 1; max_tokens 0 = the listener's default.
    assert_eq!(
        (s.temperature, s.top_p, s.max_tokens, s.seed),
        (1.0, 1.0, 0, None)
    );
    let t = completions::parse(obj(json!({"model": "m", "prompt": ["once"]}))).expect("valid");
    assert_eq!(
        t.submit.sampling.expect("sampling").max_tokens,
        completions::DEFAULT_MAX_TOKENS
    );
}

#[test]
fn what_cannot_be_honoured_is_refused_by_name() {
    let base = || json!({"model": "m", "messages": [{"role": "user", "content": "x"}]});
    let with = |k: &str, v: Value| {
        let mut b = base();
        b[k] = v;
        chat_err(b)
    };
    for (k, v) in [
        ("temperature", json!(2.5)),
        ("top_p", json!(-0.1)),
        ("n", json!(2)),
        ("presence_penalty", json!(2.5)),
        ("frequency_penalty", json!(-2.01)),
        ("frequency_penalty", json!("1")),
        ("logit_bias", json!({"50256": -101})),
        ("logit_bias", json!({"50256": "1"})),
        ("logit_bias", json!({"abc": 1})),
        ("logit_bias", json!({"-1": 1})),
        ("logit_bias", json!({"+7": 1})),
        ("logit_bias", json!({"4294967296": 1})),
        ("logit_bias", json!([1, 2])),
        (
            "logit_bias",
            Value::Object((0..301).map(|i| (i.to_string(), json!(1))).collect()),
        ),
        ("response_format", json!({"type": "xml"})),
        ("response_format", json!("json_object")),
        (
            "response_format",
            json!({"type": "json_object", "schema": {}}),
        ),
        (
            "response_format",
            json!({"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}),
        ),
        (
            "response_format",
            json!({"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}),
        ),
        (
            "response_format",
            json!({"type": "json_schema", "json_schema": {"name": "x", "schema": "{}"}}),
        ),
        (
            "response_format",
            json!({"type": "json_schema", "json_schema": {"name": "x"}}),
        ),
        (
            "response_format",
            json!({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "array", "uniqueItems": true}}}),
        ),
        (
            "response_format",
            json!({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}),
        ),
        (
            "response_format",
            json!({"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "https://example.com/s.json"}}}),
        ),
        (
            "response_format",
            json!({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "description": "d".repeat(40_000)}}}),
        ),
        (
            "tools",
            json!([{"type": "function", "function": {"name": "f"}}]),
        ),
        ("tool_choice", json!("required")),
        ("logprobs", json!("yes")),
        ("top_logprobs", json!(21)),
        ("top_logprobs", json!(-1)),
        ("top_logprobs", json!(3)),
        ("stream_options", json!({"include_usage": true})),
        ("max_tokens", json!(0)),
        ("seed", json!("7")),
        ("frobnicate", json!(1)),
    ] {
        let e = with(k, v);
        assert_eq!(e.status, StatusCode::BAD_REQUEST, "{k}: {e:?}");
        assert_eq!(e.param.as_deref(), Some(k), "{k}: {e:?}");
        assert_eq!(e.body()["error"]["type"], "invalid_request_error");
    }
    let bad_role =
        chat_err(json!({"model": "m", "messages": [{"role": "wizard", "content": "x"}]}));
    assert_eq!(bad_role.param.as_deref(), Some("messages"));
    let no_model = chat_err(json!({"messages": []}));
    assert_eq!(no_model.param.as_deref(), Some("model"));
    let image = chat_err(
        json!({"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
    );
    assert_eq!(image.code, Some("unsupported_parameter"));
    let suffix = completions::parse(obj(json!({"model": "m", "prompt": "a", "suffix": "b"})))
        .expect_err("refused");
    assert_eq!(suffix.param.as_deref(), Some("suffix"));
    let many =
        completions::parse(obj(json!({"model": "m", "prompt": ["a", "b"]}))).expect_err("refused");
    assert_eq!(many.param.as_deref(), Some("prompt"));
}

#[test]
fn penalties_and_logit_bias_reach_the_job() {
    let c = chat::parse(obj(json!({
        "model": "m",
        "messages": [{"role": "user", "content": "x"}],
        "presence_penalty": -2,
        "frequency_penalty": 1.5,
        "logit_bias": {"7": -100, "300": 100, "0012": 0.5},
    })))
    .expect("valid");
    let s = c.submit.sampling.expect("sampling");
    assert_eq!((s.presence_penalty, s.frequency_penalty), (-2.0, 1.5));
    let mut bias: Vec<(u32, f32)> = s.logit_bias.iter().map(|b| (b.token_id, b.bias)).collect();
    bias.sort_by_key(|b| b.0);
    assert_eq!(bias, vec![(7, -100.0), (12, 0.5), (300, 100.0)]);
    let t = completions::parse(obj(json!({
        "model": "m",
        "prompt": "a",
        "frequency_penalty": -0.5,
        "logit_bias": Value::Object((0..300).map(|i| (i.to_string(), json!(-1))).collect()),
    })))
    .expect("300 entries are allowed");
    let s = t.submit.sampling.expect("sampling");
    assert_eq!((s.presence_penalty, s.frequency_penalty), (0.0, -0.5));
    assert_eq!(s.logit_bias.len(), 300);
    // Absent or null: off.
    let d = chat::parse(obj(json!({
        "model": "m",
        "messages": [{"role": "user", "content": "x"}],
        "logit_bias": null,
    })))
    .expect("valid");
    let s = d.submit.sampling.expect("sampling");
    assert!(s.logit_bias.is_empty() && s.presence_penalty == 0.0 && s.frequency_penalty == 0.0);
    for bad in [
        json!({"presence_penalty": 3}),
        json!({"logit_bias": {"x": 1}}),
    ] {
        let mut b = json!({"model": "m", "prompt": "a"});
        for (k, v) in bad.as_object().expect("object") {
            b[k] = v.clone();
        }
        let e = completions::parse(obj(b)).expect_err("refused");
        assert_eq!(e.status, StatusCode::BAD_REQUEST, "{bad}");
        assert!(e.param.is_some(), "{e:?}");
    }
}

#[test]
fn logprobs_are_asked_for_in_openai_terms() {
    let chat_k = |extra: Value| {
        let mut b = json!({"model": "m", "messages": [{"role": "user", "content": "x"}]});
        for (k, v) in extra.as_object().expect("object") {
            b[k] = v.clone();
        }
        chat::parse(obj(b)).map(|c| c.submit.sampling.expect("sampling").logprobs)
    };
    assert_eq!(chat_k(json!({})).expect("valid"), None);
    assert_eq!(chat_k(json!({"logprobs": false})).expect("valid"), None);
    assert_eq!(chat_k(json!({"logprobs": true})).expect("valid"), Some(0));
    assert_eq!(
        chat_k(json!({"logprobs": true, "top_logprobs": 20})).expect("valid"),
        Some(20)
    );
    for bad in [
        json!({"logprobs": true, "top_logprobs": 21}),
        json!({"logprobs": true, "top_logprobs": -1}),
        json!({"logprobs": true, "top_logprobs": 2.5}),
        json!({"logprobs": false, "top_logprobs": 2}),
    ] {
        let e = chat_k(bad.clone()).expect_err("refused");
        assert_eq!(e.status, StatusCode::BAD_REQUEST, "{bad}");
        assert_eq!(e.param.as_deref(), Some("top_logprobs"), "{bad}");
    }
    let text_k = |v: Value| {
        completions::parse(obj(v)).map(|c| c.submit.sampling.expect("sampling").logprobs)
    };
    assert_eq!(
        text_k(json!({"model": "m", "prompt": "a", "logprobs": 3})).expect("valid"),
        Some(3)
    );
    assert_eq!(
        text_k(json!({"model": "m", "prompt": "a", "logprobs": 0})).expect("valid"),
        Some(0)
    );
    for bad in [
        json!({"model": "m", "prompt": "a", "logprobs": 21}),
        json!({"model": "m", "prompt": "a", "logprobs": -1}),
        json!({"model": "m", "prompt": "a", "logprobs": 1, "echo": true}),
    ] {
        let e = text_k(bad.clone()).expect_err("refused");
        assert_eq!(e.status, StatusCode::BAD_REQUEST, "{bad}");
        assert_eq!(e.param.as_deref(), Some("logprobs"), "{bad}");
    }
}

fn entry(token: &str, logprob: f32, top: &[(u32, &str, f32)]) -> mlxnet_proto::v1::TokenLogprob {
    mlxnet_proto::v1::TokenLogprob {
        logprob,
        token: token.as_bytes().to_vec(),
        top: top
            .iter()
            .map(|&(token_id, t, logprob)| mlxnet_proto::v1::TopLogprob {
                token_id,
                logprob,
                token: t.as_bytes().to_vec(),
            })
            .collect(),
    }
}

#[test]
fn logprobs_have_openai_shapes() {
    let entries = [
        entry("Hi", -0.25, &[(5, "Hi", -0.25), (6, "Hey", -1.5)]),
        entry(" you", -2.0, &[(7, " there", -0.5), (8, " you", -2.0)]),
    ];
    let c = super::logprobs::chat(&entries);
    assert_eq!(c["refusal"], Value::Null);
    assert_eq!(c["content"][0]["token"], "Hi");
    assert_eq!(c["content"][0]["logprob"], -0.25);
    assert_eq!(c["content"][0]["bytes"], json!([72, 105]));
    assert_eq!(c["content"][1]["top_logprobs"][0]["token"], " there");
    assert_eq!(c["content"][1]["top_logprobs"][1]["logprob"], -2.0);
    let t = super::logprobs::text(&entries, 3);
    assert_eq!(t["tokens"], json!(["Hi", " you"]));
    assert_eq!(t["token_logprobs"], json!([-0.25, -2.0]));
    assert_eq!(t["top_logprobs"][1], json!({" there": -0.5, " you": -2.0}));
    assert_eq!(t["text_offset"], json!([3, 5]));
    // A token that is part of a character: lossy text, exact bytes.
    let half = mlxnet_proto::v1::TokenLogprob {
        logprob: -1.0,
        token: vec![0xE2, 0x82],
        top: Vec::new(),
    };
    let c = super::logprobs::chat(std::slice::from_ref(&half));
    assert_eq!(c["content"][0]["bytes"], json!([0xE2, 0x82]));
    assert_eq!(c["content"][0]["token"], "\u{FFFD}");
}

#[test]
fn a_retried_attempt_replaces_the_logprobs_it_streams_again() {
    use mlxnet_proto::v1::job_event::Tokens;
    let chunk = |index: u32, lps: &[f32]| Tokens {
        index,
        token_ids: (0..lps.len() as u32).collect(),
        text: String::new(),
        logprobs: lps.iter().map(|&l| entry("x", l, &[])).collect(),
    };
    let mut c = super::logprobs::Collected::default();
    c.add(&chunk(0, &[-1.0, -2.0]));
    c.add(&chunk(2, &[-3.0]));
    // The attempt failed; the next one resumes after token 1.
    c.add(&chunk(1, &[-2.5, -3.5]));
    // A chunk past a gap is left out, not misplaced.
    c.add(&chunk(9, &[-9.0]));
    let got: Vec<f32> = c.into_entries().iter().map(|e| e.logprob).collect();
    assert_eq!(got, vec![-1.0, -2.5, -3.5]);
}

#[test]
fn errors_have_openai_shape_and_status() {
    use crate::api::error::ApiError;
    let cases = [
        (
            ApiError::InvalidArgument("x".into()),
            400,
            "invalid_request_error",
        ),
        (ApiError::NotFound("x".into()), 404, "invalid_request_error"),
        (
            ApiError::ResourceExhausted("x".into()),
            429,
            "rate_limit_error",
        ),
        (
            ApiError::InsufficientFunds("x".into()),
            402,
            "insufficient_quota",
        ),
        (ApiError::NoNode("x".into()), 503, "server_error"),
        (ApiError::Unauthenticated, 401, "invalid_request_error"),
        (
            ApiError::PermissionDenied("x".into()),
            403,
            "permission_error",
        ),
    ];
    for (e, status, kind) in cases {
        let o = OpenAiError::from(e);
        assert_eq!(o.status.as_u16(), status);
        let b = o.body();
        assert_eq!(b["error"]["type"], kind);
        for k in ["message", "type", "param", "code"] {
            assert!(b["error"].get(k).is_some(), "{k} missing from {b}");
        }
    }
}

#[test]
fn an_anthropic_request_becomes_a_chat_job() {
    let m = messages::parse(obj(json!({
        "model": "m",
        "max_tokens": 5,
        "system": [{"type": "text", "text": "Be brief."}],
        "messages": [{"role": "user", "content": "Hi"}],
        "stop_sequences": ["."],
        "top_k": 3,
        "metadata": {"user_id": "u"},
    })))
    .expect("valid");
    let s = m.submit.sampling.expect("sampling");
    assert_eq!(
        (s.max_tokens, s.top_k, s.stop.clone()),
        (5, 3, vec![".".to_string()])
    );
    let Some(job_input::Kind::Chat(c)) = m.submit.input.and_then(|i| i.kind) else {
        panic!("a chat input");
    };
    assert_eq!(
        (c.messages[0].role.as_str(), c.messages[0].content.as_str()),
        ("system", "Be brief.")
    );
    let no_max = messages::parse(obj(json!({"model": "m", "messages": []}))).expect_err("refused");
    assert_eq!(no_max.param.as_deref(), Some("max_tokens"));
    let tools = messages::parse(obj(
        json!({"model": "m", "max_tokens": 1, "messages": [], "tools": []}),
    ))
    .expect_err("refused");
    assert_eq!(tools.param.as_deref(), Some("tools"));
}

#[test]
fn response_format_becomes_the_jobs_grammar() {
    use mlxnet_proto::grammar::Constraint;
    let grammar = |rf: Value| {
        let req = chat::parse(obj(json!({
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "response_format": rf,
        })))
        .unwrap_or_else(|e| panic!("{e:?}"));
        let g = req.submit.sampling.and_then(|s| s.grammar);
        g.map(|g| Constraint::from_wire(&g).unwrap_or_else(|e| panic!("{e}")))
    };
    assert_eq!(grammar(json!({"type": "text"})), None);
    assert_eq!(grammar(Value::Null), None);
    assert_eq!(
        grammar(json!({"type": "json_object"})),
        Some(Constraint::JsonObject)
    );
    // The schema's text keeps the client's key order (properties are
    // generated in that order).
    let schema = json!({"type": "object", "properties": {"z": {"type": "integer"}, "a": {"type": "string"}}, "required": ["z", "a"]});
    assert_eq!(
        grammar(json!({"type": "json_schema", "json_schema": {"name": "person", "strict": true, "description": "d", "schema": schema}})),
        Some(Constraint::JsonSchema(
            r#"{"type":"object","properties":{"z":{"type":"integer"},"a":{"type":"string"}},"required":["z","a"]}"#.into()
        ))
    );
}
