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
            json!([{"type": "function", "function": {"name": "a b"}}]),
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

/// Whether `text` (whole) is accepted by `g`, over a one-byte vocabulary.
fn grammar_accepts(g: &mlxnet_proto::v1::Grammar, text: &str) -> bool {
    use mlxnet_proto::grammar::{factory, llguidance::toktrie, Constraint};
    use toktrie::ApproximateTokEnv;
    let env = ApproximateTokEnv::single_byte_env();
    let f = factory(env.clone()).expect("a factory");
    let mut m = Constraint::from_wire(g)
        .expect("a wire grammar")
        .matcher(&f)
        .expect("it compiles");
    let toks = env.tokenize_bytes(text.as_bytes());
    m.try_consume_tokens(&toks).ok() == Some(toks.len()) && m.is_accepting().unwrap_or(false)
}

fn weather_tools() -> Value {
    json!([
        {"type": "function", "function": {
            "name": "get_weather",
            "description": "The weather now in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                           "required": ["city"], "additionalProperties": false},
        }},
        {"type": "function", "function": {"name": "get_time"}},
    ])
}

fn grammar_of(c: &chat::ChatRequest) -> Option<mlxnet_proto::v1::Grammar> {
    c.submit.sampling.as_ref().and_then(|s| s.grammar.clone())
}

fn chat_messages(c: &chat::ChatRequest) -> Vec<(String, String)> {
    match c.submit.input.as_ref().and_then(|i| i.kind.as_ref()) {
        Some(job_input::Kind::Chat(m)) => m
            .messages
            .iter()
            .map(|m| (m.role.clone(), m.content.clone()))
            .collect(),
        _ => panic!("a chat input"),
    }
}

#[test]
fn a_required_or_named_tool_call_is_a_grammar_over_the_tools_and_a_prompt() {
    let ask = |choice: Value| {
        chat::parse(obj(json!({
            "model": "m",
            "messages": [{"role": "user", "content": "Weather in Paris?"}],
            "tools": weather_tools(),
            "tool_choice": choice,
        })))
        .expect("served")
    };
    let call = r#"{"name":"get_weather","arguments":{"city":"Paris"}}"#;
    let time = r#"{"name":"get_time","arguments":{}}"#;
    let required = ask(json!("required"));
    let g = grammar_of(&required).expect("a grammar");
    assert!(grammar_accepts(&g, call) && grammar_accepts(&g, time));
    // parallel_tool_calls absent: exactly one call.
    let two = format!("{call}\n{time}");
    assert!(!grammar_accepts(&g, &two));
    assert!(!chat_messages(&required)[0].1.contains("one call per line"));
    // parallel_tool_calls true: 1 to 8 calls, one per line.
    let parallel = |choice: Value| {
        chat::parse(obj(json!({
            "model": "m",
            "messages": [{"role": "user", "content": "Weather in Paris?"}],
            "tools": weather_tools(),
            "tool_choice": choice,
            "parallel_tool_calls": true,
        })))
        .expect("served")
    };
    let several = parallel(json!("required"));
    assert!(chat_messages(&several)[0].1.contains("one call per line"));
    let g = grammar_of(&several).expect("a grammar");
    let calls = |n: usize| vec![call; n].join("\n");
    assert!(grammar_accepts(&g, call) && grammar_accepts(&g, &two));
    assert!(grammar_accepts(&g, &calls(8)) && !grammar_accepts(&g, &calls(9)));
    for bad in [
        r#"{"name":"get_weather","arguments":{}}"#.to_owned(),
        r#"{"name":"get_weather","arguments":{"city":"Paris","x":1}}"#.to_owned(),
        r#"{"name":"nope","arguments":{}}"#.to_owned(),
        "Paris is sunny.".to_owned(),
        format!("{call}\n"),
        format!("{call}\n\n{time}"),
        format!("{call} {time}"),
        format!("{call}\nPARIS"),
    ] {
        assert!(!grammar_accepts(&g, &bad), "{bad}");
    }
    let g = grammar_of(&parallel(json!("auto"))).expect("a grammar");
    assert!(grammar_accepts(&g, &two) && grammar_accepts(&g, "Sunny."));
    // parallel_tool_calls: false: exactly one call.
    for choice in [json!("required"), json!("auto")] {
        let one = chat::parse(obj(json!({
            "model": "m",
            "messages": [{"role": "user", "content": "Weather in Paris?"}],
            "tools": weather_tools(),
            "tool_choice": choice,
            "parallel_tool_calls": false,
        })))
        .expect("served");
        let g = grammar_of(&one).expect("a grammar");
        assert!(
            grammar_accepts(&g, call) && !grammar_accepts(&g, &two),
            "{choice}"
        );
        assert!(!chat_messages(&one)[0].1.contains("one call per line"));
    }
    // The tools are in the prompt: a system message listing them and the
    // call format, before the conversation.
    let m = chat_messages(&required);
    assert_eq!(m[0].0, "system");
    for want in [
        "get_weather",
        "The weather now in a city.",
        "get_time",
        "\"arguments\"",
    ] {
        assert!(m[0].1.contains(want), "{want} missing from {}", m[0].1);
    }
    assert_eq!(m[1], ("user".into(), "Weather in Paris?".into()));
    // Named: only that tool.
    let named = ask(json!({"type": "function", "function": {"name": "get_time"}}));
    let g = grammar_of(&named).expect("a grammar");
    assert!(grammar_accepts(&g, time) && !grammar_accepts(&g, call));
    assert!(!grammar_accepts(&g, &format!("{time}\n{time}")));
    // auto (and absent: OpenAI's default with tools): text, or a whole call.
    for auto in [json!("auto"), Value::Null] {
        let g = grammar_of(&ask(auto)).expect("a grammar");
        assert!(grammar_accepts(&g, call) && grammar_accepts(&g, time));
        assert!(!grammar_accepts(&g, &two));
        assert!(grammar_accepts(&g, "Paris is sunny.\n{not a call}"));
        for bad in [
            r#"{"name":"get_weather","arguments":{}}"#,
            r#"{"name":"nope","arguments":{}}"#,
            r#"{"name":"get_weather","arguments":{"city":"Paris"}} and more"#,
            "{Paris}",
            "",
        ] {
            assert!(!grammar_accepts(&g, bad), "{bad}");
        }
    }
    // none: the tools are ignored (no grammar, no preamble).
    let none = ask(json!("none"));
    assert!(grammar_of(&none).is_none());
    assert_eq!(
        chat_messages(&none),
        vec![("user".into(), "Weather in Paris?".into())]
    );
}

/// Tools with local definitions (`$defs`, as pydantic writes them): each
/// tool's are hoisted under its own names, so two tools defining the same
/// name keep their own meaning; a `$ref` outside the tool's own `$defs` is
/// refused.
#[test]
fn tool_schemas_with_local_defs_are_served() {
    let tools = json!([
        {"type": "function", "function": {"name": "f", "parameters": {
            "type": "object",
            "properties": {"a": {"$ref": "#/$defs/Unit"}},
            "required": ["a"], "additionalProperties": false,
            "$defs": {"Unit": {"enum": ["c", "f"]}},
        }}},
        {"type": "function", "function": {"name": "g", "parameters": {
            "type": "object",
            "properties": {"a": {"$ref": "#/definitions/Unit"}},
            "required": ["a"], "additionalProperties": false,
            "definitions": {"Unit": {"type": "integer"}},
        }}},
    ]);
    for choice in [json!("required"), json!("auto")] {
        let c = chat::parse(obj(json!({
            "model": "m",
            "messages": [{"role": "user", "content": "x"}],
            "tools": tools,
            "tool_choice": choice,
        })))
        .expect("served");
        let g = grammar_of(&c).expect("a grammar");
        assert!(grammar_accepts(&g, r#"{"name":"f","arguments":{"a":"c"}}"#));
        assert!(grammar_accepts(&g, r#"{"name":"g","arguments":{"a":3}}"#));
        assert!(!grammar_accepts(&g, r#"{"name":"f","arguments":{"a":3}}"#));
        assert!(!grammar_accepts(
            &g,
            r#"{"name":"g","arguments":{"a":"c"}}"#
        ));
    }
    for bad in [
        json!({"type": "object", "properties": {"a": {"$ref": "#/$defs/Nope"}}, "$defs": {"Unit": {}}}),
        json!({"type": "object", "properties": {"a": {"$ref": "https://example.com/s.json"}}}),
        json!({"type": "object", "$defs": []}),
    ] {
        let e = chat_err(json!({
            "model": "m", "messages": [{"role": "user", "content": "x"}],
            "tools": [{"type": "function", "function": {"name": "f", "parameters": bad}}],
            "tool_choice": "required",
        }));
        assert_eq!(e.param.as_deref(), Some("tools"), "{e:?}");
    }
}

#[test]
fn an_agent_loop_renders_calls_and_tool_results() {
    let c = chat::parse(obj(json!({
        "model": "m",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": null, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}},
            ]},
            {"role": "tool", "tool_call_id": "call_1", "content": "{\"sky\":\"sunny\"}"},
        ],
        "tools": weather_tools(),
        "tool_choice": "none",
    })))
    .expect("served");
    let m = chat_messages(&c);
    assert_eq!(m.len(), 4, "{m:?}");
    assert_eq!(m[0], ("system".into(), "Be brief.".into()));
    // The call as the model would have written it; the result as a user
    // turn naming the call and its tool (roles keep alternating).
    assert_eq!(m[2].0, "assistant");
    assert_eq!(
        m[2].1,
        r#"{"name":"get_weather","arguments":{"city":"Paris"}}"#
    );
    assert_eq!(m[3].0, "user");
    for want in ["call_1", "get_weather", "{\"sky\":\"sunny\"}"] {
        assert!(m[3].1.contains(want), "{want} missing from {}", m[3].1);
    }
}

#[test]
fn bad_tools_choices_and_tool_messages_are_refused_by_name() {
    let user = json!([{"role": "user", "content": "x"}]);
    let with = |tools: Value, choice: Value| {
        chat_err(json!({"model": "m", "messages": user, "tools": tools, "tool_choice": choice}))
    };
    let f = |function: Value| json!([{"type": "function", "function": function}]);
    let many: Vec<Value> = (0..129)
        .map(|i| json!({"type": "function", "function": {"name": format!("f{i}")}}))
        .collect();
    for (tools, choice, param) in [
        (json!({"name": "f"}), json!("required"), "tools"),
        (json!([{"type": "retrieval"}]), json!("required"), "tools"),
        (json!([{"type": "function"}]), json!("required"), "tools"),
        (f(json!({"name": ""})), json!("required"), "tools"),
        (
            f(json!({"name": "x".repeat(65)})),
            json!("required"),
            "tools",
        ),
        (
            f(json!({"name": "f", "parameters": "{}"})),
            json!("required"),
            "tools",
        ),
        (
            f(json!({"name": "f", "description": 1})),
            json!("required"),
            "tools",
        ),
        (
            f(json!({"name": "f", "extra": 1})),
            json!("required"),
            "tools",
        ),
        (
            f(json!({"name": "f", "parameters": {"type": "array", "uniqueItems": true}})),
            json!("required"),
            "tools",
        ),
        (
            f(
                json!({"name": "f", "parameters": {"type": "object", "properties": {"a": {"$ref": "#/properties/b"}, "b": {"type": "string"}}}}),
            ),
            json!("required"),
            "tools",
        ),
        (
            json!([{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "f"}}]),
            json!("required"),
            "tools",
        ),
        (Value::Array(many), json!("required"), "tools"),
        (
            f(
                json!({"name": "f", "parameters": {"type": "object", "description": "d".repeat(40_000)}}),
            ),
            json!("required"),
            "tools",
        ),
        (f(json!({"name": "f"})), json!("sometimes"), "tool_choice"),
        (
            f(json!({"name": "f"})),
            json!({"type": "function", "function": {"name": "g"}}),
            "tool_choice",
        ),
        (
            f(json!({"name": "f"})),
            json!({"type": "function", "name": "f"}),
            "tool_choice",
        ),
        (json!([]), json!("required"), "tool_choice"),
        (
            json!([]),
            json!({"type": "function", "function": {"name": "f"}}),
            "tool_choice",
        ),
    ] {
        let e = with(tools.clone(), choice.clone());
        assert_eq!(e.status, StatusCode::BAD_REQUEST, "{tools} {choice}: {e:?}");
        assert_eq!(e.param.as_deref(), Some(param), "{tools} {choice}: {e:?}");
    }
    // The tools' grammar is compiled whole; when it fails, the 400 names
    // the tool whose parameters fail alone (here the second), also when
    // only that tool is named, and when tools are listed but not used.
    let bad_second = json!([
        {"type": "function", "function": {"name": "f"}},
        {"type": "function", "function": {"name": "g", "parameters": {"type": "array", "uniqueItems": true}}},
    ]);
    for choice in [
        json!("required"),
        json!("auto"),
        json!("none"),
        json!({"type": "function", "function": {"name": "g"}}),
    ] {
        let e = with(bad_second.clone(), choice.clone());
        assert_eq!(e.param.as_deref(), Some("tools"), "{choice}: {e:?}");
        assert!(
            e.message.starts_with("tools[1].function.parameters: "),
            "{choice}: {e:?}"
        );
    }
    // A forced call and a response format cannot both shape the answer.
    let both = chat_err(json!({
        "model": "m", "messages": user, "tools": f(json!({"name": "f"})), "tool_choice": "required",
        "response_format": {"type": "json_object"},
    }));
    assert_eq!(both.param.as_deref(), Some("response_format"));
    // Tool messages: a result needs the id of an earlier call; calls need
    // JSON arguments; only assistants carry calls.
    let call = json!({"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]});
    for msgs in [
        json!([{"role": "tool", "tool_call_id": "c1", "content": "1"}]),
        json!([call, {"role": "tool", "tool_call_id": "c2", "content": "1"}]),
        json!([call, {"role": "tool", "content": "1"}]),
        json!([{"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]),
        json!([{"role": "assistant", "tool_calls": [{"id": "c1", "function": {"name": "f"}}]}]),
        json!([{"role": "assistant", "tool_calls": {"id": "c1"}}]),
        json!([{"role": "user", "content": "x", "tool_calls": []}]),
        json!([{"role": "user", "content": "x", "tool_call_id": "c1"}]),
        json!([{"role": "function", "name": "f", "content": "1"}]),
    ] {
        let e = chat_err(json!({"model": "m", "messages": msgs}));
        assert_eq!(e.status, StatusCode::BAD_REQUEST, "{msgs}: {e:?}");
        assert!(
            e.param
                .as_deref()
                .is_some_and(|p| p.starts_with("messages")),
            "{msgs}: {e:?}"
        );
    }
}

#[test]
fn a_lark_grammar_travels_with_one_body_and_its_own_digest() {
    use mlxnet_proto::grammar::{Constraint, GrammarError};
    let lark = Constraint::Lark("start: \"a\"".into());
    let wire = lark.to_wire();
    assert_eq!(Constraint::from_wire(&wire), Ok(lark.clone()));
    assert!(wire.json_schema.is_empty());
    let mut both = wire.clone();
    both.json_schema = "{}".into();
    assert_eq!(Constraint::from_wire(&both), Err(GrammarError::TwoBodies));
    let mut schema_and_lark = Constraint::JsonSchema("{}".into()).to_wire();
    schema_and_lark.lark = "start: \"a\"".into();
    assert_eq!(
        Constraint::from_wire(&schema_and_lark),
        Err(GrammarError::TwoBodies)
    );
    assert_ne!(
        lark.digest(),
        Constraint::JsonSchema("start: \"a\"".into()).digest()
    );
    assert!(matches!(
        Constraint::Lark("start: nowhere".into()).check(),
        Err(GrammarError::Refused(_))
    ));
}
