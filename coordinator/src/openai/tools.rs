//! Tool calls on `/v1/chat/completions`: `tools`, `tool_choice` and
//! `parallel_tool_calls` read and checked; the tools rendered into the
//! prompt; the calls generated under a grammar built from the tools' JSON
//! schemas (the job's `SamplingParams.grammar`, so the node masks every
//! token with it, an audit replays it and the signed claim binds its
//! digest); the answer read back as `tool_calls`, whole ([`read_calls`]) or
//! streamed ([`CallStream`]).
//!
//! # The generic tool prompt (what the model is told)
//! The tools are listed in a system message (appended to the conversation's
//! first system message, or a new one before it), see [`preamble`]: one
//! line of JSON per tool (`name`, `description`, `parameters`) and the call
//! format `{"name": <tool name>, "arguments": <the arguments object>}`, one
//! call per line when several calls are allowed. An
//! assistant message carrying `tool_calls` is sent to the model as those
//! calls written in that format (one per line, after any text), and a
//! `role: "tool"` message as a user turn `Tool result (call <id>, <name>):`
//! followed by its content (consecutive results in one turn, so roles keep
//! alternating for templates that require it). The model's own chat
//! template is not given `tools` (the node renders templates with
//! `messages` only): every model gets this generic prompt.
//!
//! # What is generated
//! A call is `{"name":"<name>","arguments":<object>}` (compact, properties
//! in that order, no free whitespace), the arguments matching the tool's
//! `parameters` schema. `tool_choice: "required"`: exactly one call of one
//! of the tools (a JSON-schema grammar), or with `parallel_tool_calls: true`
//! one to [`MAX_CALLS`] calls, one per line. Absent, `parallel_tool_calls`
//! means one call (llama.cpp's default; OpenAI's `true` allows several and
//! never requires them, so one call answers it too): a small model allowed
//! several tends to repeat its call until `max_tokens`, which cuts the
//! answer into text. A named function: exactly one call of it. `"auto"` (OpenAI's default when tools are given): text
//! OR the calls `required` would allow, the model's choice at its first
//! token (see [`Forced::grammar`]): an answer that starts with `{` is calls
//! and must be whole valid ones; any other answer is text (so a text answer
//! cannot start with `{`). Several calls are allowed, never required: the
//! model ends the answer after any whole call. A newline never occurs
//! inside a call (compact JSON escapes it in strings), so the answer reads
//! back line by line. Call ids are `call_<job id>_<i>`, `i` from 0 in the
//! answer's order. `"none"`: the tools are ignored (neither rendered nor
//! enforced).
//!
//! A tool's `parameters` may use local definitions (`$defs` or
//! `definitions` at its root, `$ref: "#/$defs/<name>"`, as pydantic
//! writes them): they are moved to the call grammar's root as
//! `tools<i>_<name>` and the `$ref`s rewritten, so tools' definitions never
//! collide; any other `$ref` is a 400.
//!
//! # Invariants
//! - Everything is checked before the job exists: a bad tool, choice or
//!   message is a 400 naming `tools`, `tool_choice` or `messages`. The
//!   tools' grammar is compiled once (the tools one by one only when it
//!   fails, to name the bad one).
//! - The calls read back are the output's own text: each `arguments` is
//!   the exact substring the model generated (what the signed claim's
//!   tokens decode to), streamed or not.
//!
//! # Failure
//! An output that is not whole calls (cut by `max_tokens` or a stop
//! string) is answered as text with its finish reason, never as calls.

use std::collections::HashMap;

use mlxnet_proto::grammar::Constraint;
use serde_json::{json, Map, Value};

use super::OpenAiError;

/// Most tools in a request (OpenAI's limit).
pub const MAX_TOOLS: usize = 128;

/// Most calls in one answer with `parallel_tool_calls: true`.
pub const MAX_CALLS: usize = 8;

/// A function the model may call.
#[derive(Debug, Clone, PartialEq)]
pub struct Tool {
    /// Its place in the request's `tools` (named in a 400).
    pub index: usize,
    pub name: String,
    pub description: Option<String>,
    /// Its root definitions, hoisted (see [`hoist_defs`]): `$ref`s in
    /// `parameters` point at `#/$defs/tools<index>_<name>`.
    pub defs: Map<String, Value>,
    /// The arguments' JSON schema (`{"type":"object","properties":{},
    /// "additionalProperties":false}`, no arguments,
    /// when the request gave none).
    pub parameters: Value,
}

/// What `tool_choice` leaves the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// A call of one of the tools.
    Required,
    /// A call of the one tool named.
    Named,
    /// Text or a call (the model's choice).
    Auto,
}

/// The calls an answer may be: of `tools`, as `mode` says; several (one
/// per line) when `parallel` (never with [`Mode::Named`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Forced {
    pub tools: Vec<Tool>,
    pub mode: Mode,
    pub parallel: bool,
}

fn bad(param: &str, m: String) -> OpenAiError {
    OpenAiError::invalid(m, Some(param))
}

/// Whether `name` is 1 to 64 of a-z, A-Z, 0-9, `_` and `-` (OpenAI's rule).
fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
}

/// The name tool `i`'s local definition `name` has at the call grammar's
/// root.
fn hoisted(i: usize, name: &str) -> String {
    format!("tools{i}_{name}")
}

/// Points every `$ref` in `v` (tool `i`'s parameters or definitions) at the
/// hoisted copy of the definition it names: only `#/$defs/<name>` (or
/// `#/definitions/<name>`) of the tool's own root definitions `names` is
/// served.
fn rewrite_refs(v: &mut Value, names: &Map<String, Value>, i: usize) -> Result<(), String> {
    match v {
        Value::Object(m) => {
            if let Some(r) = m.get_mut("$ref") {
                let Value::String(s) = r else {
                    return Err("a $ref must be a string".into());
                };
                let name = s
                    .strip_prefix("#/$defs/")
                    .or_else(|| s.strip_prefix("#/definitions/"))
                    .filter(|n| names.contains_key(*n))
                    .ok_or_else(|| {
                        format!(
                            "$ref {:?}: only \"#/$defs/<name>\" of the tool's own root $defs is served",
                            s.chars().take(64).collect::<String>()
                        )
                    })?;
                let to = format!("#/$defs/{}", hoisted(i, name));
                *s = to;
            }
            for (k, x) in m.iter_mut() {
                if k != "$ref" {
                    rewrite_refs(x, names, i)?;
                }
            }
        }
        Value::Array(a) => {
            for x in a {
                rewrite_refs(x, names, i)?;
            }
        }
        _ => {}
    }
    Ok(())
}

/// Takes tool `i`'s root `$defs` (and `definitions`) out of `parameters`,
/// points its `$ref`s at their hoisted names, and returns the definitions
/// under those names (for the call grammar's root, where a `$ref` resolves).
fn hoist_defs(i: usize, parameters: &mut Value) -> Result<Map<String, Value>, String> {
    let Value::Object(root) = parameters else {
        return Ok(Map::new());
    };
    let mut defs = Map::new();
    for key in ["$defs", "definitions"] {
        match root.remove(key) {
            None => {}
            Some(Value::Object(d)) => {
                for (name, def) in d {
                    if !valid_name(&name) {
                        return Err(format!(
                            "{key} names must be 1 to 64 of a-z, A-Z, 0-9, _ and -"
                        ));
                    }
                    defs.insert(name, def);
                }
            }
            Some(_) => return Err(format!("{key} must be an object")),
        }
    }
    rewrite_refs(parameters, &defs, i)?;
    let mut out = Map::new();
    for (name, mut def) in defs.clone() {
        rewrite_refs(&mut def, &defs, i)?;
        out.insert(hoisted(i, &name), def);
    }
    Ok(out)
}

fn tool(i: usize, v: Value) -> Result<Tool, OpenAiError> {
    const P: &str = "tools";
    let at = format!("tools[{i}]");
    let Value::Object(mut t) = v else {
        return Err(bad(P, format!("{at} must be an object")));
    };
    match t.remove("type") {
        Some(Value::String(s)) if s == "function" => {}
        _ => {
            return Err(bad(
                P,
                format!("{at}.type must be \"function\" (the only tool type served)"),
            ))
        }
    }
    let Some(Value::Object(mut f)) = t.remove("function") else {
        return Err(bad(
            P,
            format!("{at}.function is required: {{name, description, parameters}}"),
        ));
    };
    if let Some(k) = t.keys().next() {
        return Err(bad(P, format!("{at}: unknown field {k:?}")));
    }
    let name = match f.remove("name") {
        Some(Value::String(n)) if valid_name(&n) => n,
        _ => {
            return Err(bad(
                P,
                format!("{at}.function.name is required: 1 to 64 of a-z, A-Z, 0-9, _ and -"),
            ))
        }
    };
    let description = match f.remove("description") {
        None | Some(Value::Null) => None,
        Some(Value::String(d)) => Some(d),
        Some(_) => {
            return Err(bad(
                P,
                format!("{at}.function.description must be a string"),
            ))
        }
    };
    if !matches!(
        f.remove("strict"),
        None | Some(Value::Null | Value::Bool(_))
    ) {
        return Err(bad(P, format!("{at}.function.strict must be a boolean")));
    }
    let mut parameters = match f.remove("parameters") {
        None | Some(Value::Null) => {
            json!({"type": "object", "properties": {}, "additionalProperties": false})
        }
        Some(p @ Value::Object(_)) => p,
        Some(_) => {
            return Err(bad(
                P,
                format!("{at}.function.parameters must be a JSON Schema object"),
            ))
        }
    };
    if let Some(k) = f.keys().next() {
        return Err(bad(P, format!("{at}.function: unknown field {k:?}")));
    }
    let defs = hoist_defs(i, &mut parameters)
        .map_err(|e| OpenAiError::unsupported(P, &format!("{at}.function.parameters: {e}")))?;
    // Compiled with the others, in `Forced::grammar` (or `check_each`).
    Ok(Tool {
        index: i,
        name,
        description,
        defs,
        parameters,
    })
}

/// `tools`: absent, or a list of functions with distinct names.
pub fn parse_tools(v: Option<Value>) -> Result<Vec<Tool>, OpenAiError> {
    let items = match v {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Array(items)) => items,
        Some(_) => {
            return Err(bad(
                "tools",
                "tools must be a list of {\"type\": \"function\", \"function\": {...}}".into(),
            ))
        }
    };
    if items.len() > MAX_TOOLS {
        return Err(bad(
            "tools",
            format!("tools has {} entries; at most {MAX_TOOLS}", items.len()),
        ));
    }
    let mut out: Vec<Tool> = Vec::with_capacity(items.len());
    for (i, v) in items.into_iter().enumerate() {
        let t = tool(i, v)?;
        if out.iter().any(|o| o.name == t.name) {
            return Err(bad(
                "tools",
                format!("tools[{i}]: a second tool named {:?}", t.name),
            ));
        }
        out.push(t);
    }
    Ok(out)
}

/// `tool_choice` as asked.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Choice {
    None,
    Auto,
    Required,
    Named(String),
}

fn choice(v: Option<Value>) -> Result<Option<Choice>, OpenAiError> {
    const P: &str = "tool_choice";
    let what = "tool_choice must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", \"function\": {\"name\": ...}}";
    match v {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => match s.as_str() {
            "none" => Ok(Some(Choice::None)),
            "auto" => Ok(Some(Choice::Auto)),
            "required" => Ok(Some(Choice::Required)),
            _ => Err(bad(P, what.into())),
        },
        Some(Value::Object(mut o)) => {
            let named = match (o.remove("type"), o.remove("function")) {
                (Some(Value::String(t)), Some(Value::Object(mut f))) if t == "function" => {
                    match (f.remove("name"), f.is_empty()) {
                        (Some(Value::String(n)), true) => Some(n),
                        _ => None,
                    }
                }
                _ => None,
            };
            match named {
                Some(n) if o.is_empty() => Ok(Some(Choice::Named(n))),
                _ => Err(bad(P, what.into())),
            }
        }
        Some(_) => Err(bad(P, what.into())),
    }
}

/// Compiles each tool's `parameters` alone: the first one the engine
/// cannot enforce is a 400 naming `tools[i].function.parameters`.
fn check_each(tools: &[Tool]) -> Result<(), OpenAiError> {
    for t in tools {
        Constraint::JsonSchema(t.standalone().to_string())
            .check()
            .map_err(|e| {
                bad(
                    "tools",
                    format!("tools[{}].function.parameters: {e}", t.index),
                )
            })?;
    }
    Ok(())
}

/// `tools`, `tool_choice` and `parallel_tool_calls` (absent: false, see
/// the module's header) together: the calls the answer may be, or `None` for a text
/// answer (no tools, or `"none"`: the tools are still checked).
pub fn forced(
    tools: Vec<Tool>,
    choice_v: Option<Value>,
    parallel: Option<bool>,
) -> Result<Option<Forced>, OpenAiError> {
    const P: &str = "tool_choice";
    let asked = choice(choice_v)?;
    let parallel = parallel.unwrap_or(false);
    match (asked, tools.is_empty()) {
        (None | Some(Choice::None | Choice::Auto), true) => Ok(None),
        (Some(Choice::None), false) => check_each(&tools).map(|()| None),
        (Some(Choice::Required | Choice::Named(_)), true) => Err(bad(
            P,
            "tool_choice asks for a tool call but tools is empty".into(),
        )),
        (None | Some(Choice::Auto), false) => Ok(Some(Forced {
            tools,
            mode: Mode::Auto,
            parallel,
        })),
        (Some(Choice::Required), false) => Ok(Some(Forced {
            tools,
            mode: Mode::Required,
            parallel,
        })),
        (Some(Choice::Named(n)), false) => match tools.into_iter().find(|t| t.name == n) {
            Some(t) => Ok(Some(Forced {
                tools: vec![t],
                mode: Mode::Named,
                parallel: false,
            })),
            None => Err(bad(
                P,
                format!(
                    "tool_choice names {:?}, which is not in tools",
                    n.chars().take(64).collect::<String>()
                ),
            )),
        },
    }
}

/// The schema of one call of `t`: `{"name": <const>, "arguments": <its
/// parameters>}`, in that order, nothing else.
impl Tool {
    /// Its parameters with their (hoisted) definitions at the root: a
    /// schema on its own.
    fn standalone(&self) -> Value {
        let mut v = self.parameters.clone();
        if let (Value::Object(m), false) = (&mut v, self.defs.is_empty()) {
            m.insert("$defs".into(), Value::Object(self.defs.clone()));
        }
        v
    }
}

fn call_schema(t: &Tool) -> Value {
    let mut props = Map::new();
    props.insert("name".into(), json!({"const": t.name}));
    props.insert("arguments".into(), t.parameters.clone());
    json!({
        "type": "object",
        "properties": Value::Object(props),
        "required": ["name", "arguments"],
        "additionalProperties": false,
    })
}

impl Forced {
    /// The grammar of the answer. One call (required without
    /// `parallel`, or named): the JSON schema of a call of one of the tools
    /// (`anyOf` over them when there are several). Otherwise a Lark grammar
    /// over `call`, that schema (`%json`, compact): `calls: call more{0,7}`,
    /// `more: "\n" call` with `parallel` (at most [`MAX_CALLS`]), `calls:
    /// call` without; `start: calls` for
    /// `required`, `start: TEXT | calls` for `auto`, where `TEXT` is any text
    /// not starting with `{`. Compiled here, once: a grammar the engine
    /// cannot enforce is a 400, naming the tool whose `parameters` alone
    /// fails to compile, or the whole set (over the size limit).
    pub fn grammar(&self) -> Result<Constraint, OpenAiError> {
        let mut schema = match &self.tools[..] {
            [one] => call_schema(one),
            many => json!({"anyOf": many.iter().map(call_schema).collect::<Vec<_>>()}),
        };
        let defs: Map<String, Value> = self.tools.iter().flat_map(|t| t.defs.clone()).collect();
        if !defs.is_empty() {
            schema["$defs"] = Value::Object(defs);
        }
        let c = match (self.mode, self.parallel) {
            (Mode::Required, false) | (Mode::Named, _) => {
                Constraint::JsonSchema(schema.to_string())
            }
            (mode, parallel) => {
                schema["x-guidance"] = json!({"whitespace_flexible": false});
                let start = match mode {
                    Mode::Auto => "start: TEXT | calls\nTEXT: /[^{](.|\\n)*/",
                    _ => "start: calls",
                };
                let calls = if parallel {
                    format!(
                        "calls: call more{{0,{}}}\nmore: \"\\n\" call",
                        MAX_CALLS - 1
                    )
                } else {
                    "calls: call".to_owned()
                };
                Constraint::Lark(format!("{start}\n{calls}\ncall: %json {schema}\n"))
            }
        };
        if let Err(e) = c.check() {
            check_each(&self.tools)?;
            return Err(bad("tools", format!("tools: {e}")));
        }
        Ok(c)
    }

    /// The system text telling the model the tools and the call format.
    pub fn preamble(&self) -> String {
        let mut s = String::from(
            "You can call the following tools. Each line is one tool as JSON: its name, what it does, and the JSON Schema of its arguments.\n",
        );
        for t in &self.tools {
            let mut line = Map::new();
            line.insert("name".into(), json!(t.name));
            if let Some(d) = &t.description {
                line.insert("description".into(), json!(d));
            }
            line.insert("parameters".into(), t.standalone());
            s.push_str(&Value::Object(line).to_string());
            s.push('\n');
        }
        s.push_str(
            "To call a tool, answer with only this JSON: {\"name\": <the tool's name>, \"arguments\": <its arguments as a JSON object>}. The tool's result comes back in a message starting \"Tool result\".\n",
        );
        if self.parallel {
            s.push_str(&format!(
                "To call several tools at once (at most {MAX_CALLS}), write one call per line.\n"
            ));
        }
        match (&self.tools[..], self.mode) {
            ([t], Mode::Named) => s.push_str(&format!("Call the tool {} now.", t.name)),
            (_, Mode::Auto) => s.push_str(
                "If a tool helps, call it; otherwise answer in plain text (not starting with \"{\").",
            ),
            _ => s.push_str("Call one of these tools now."),
        }
        s
    }
}

/// A call as the model writes it (and as a past call is shown to it).
pub fn call_text(name: &str, arguments: &Value) -> String {
    format!(
        "{{\"name\":{},\"arguments\":{arguments}}}",
        Value::String(name.to_owned())
    )
}

/// The prefix of a call of `name` up to its arguments.
fn call_head(name: &str) -> String {
    format!(
        "{{\"name\":{},\"arguments\":",
        Value::String(name.to_owned())
    )
}

/// The call a line is, when it is exactly one whole call: its tool's name
/// and its arguments' text (as generated).
fn read_call(text: &str) -> Option<(String, &str)> {
    let rest = text.strip_prefix("{\"name\":\"")?;
    let name = &rest[..rest.find('"')?];
    if !valid_name(name) {
        return None;
    }
    let args = text.strip_prefix(&call_head(name))?.strip_suffix('}')?;
    matches!(serde_json::from_str::<Value>(args), Ok(Value::Object(_)))
        .then(|| (name.to_owned(), args))
}

/// The calls an output is, when it is one or more whole calls, one per
/// line (a newline never occurs inside a compact call): each tool's name
/// and its arguments' text (as generated).
pub fn read_calls(text: &str) -> Option<Vec<(String, &str)>> {
    text.split('\n').map(read_call).collect()
}

/// The id of the `index`th call of a job's answer.
pub fn call_id(job: &impl std::fmt::Display, index: usize) -> String {
    format!("call_{job}_{index}")
}

/// OpenAI's `tool_calls` entry of a whole call.
pub fn call_json(id: &str, name: &str, arguments: &str) -> Value {
    json!({"id": id, "type": "function", "function": {"name": name, "arguments": arguments}})
}

/// Renders the calls an assistant message carries (`tool_calls`) as the
/// model writes them, after its text; records each call's id and name.
pub fn assistant_calls(
    at: &str,
    text: String,
    calls: Value,
    names: &mut HashMap<String, String>,
) -> Result<String, OpenAiError> {
    const P: &str = "messages";
    let shape = || {
        bad(
            P,
            format!("{at}.tool_calls must be a list of {{\"id\", \"type\": \"function\", \"function\": {{\"name\", \"arguments\"}}}}"),
        )
    };
    let Value::Array(calls) = calls else {
        return Err(shape());
    };
    let mut lines: Vec<String> = Vec::with_capacity(calls.len() + 1);
    if !text.is_empty() {
        lines.push(text);
    }
    for (j, c) in calls.into_iter().enumerate() {
        let Value::Object(mut c) = c else {
            return Err(shape());
        };
        let id = match c.remove("id") {
            Some(Value::String(id)) if !id.is_empty() => id,
            _ => return Err(shape()),
        };
        match c.remove("type") {
            None | Some(Value::Null) => {}
            Some(Value::String(t)) if t == "function" => {}
            Some(_) => return Err(shape()),
        }
        let Some(Value::Object(mut f)) = c.remove("function") else {
            return Err(shape());
        };
        let (Some(Value::String(name)), Some(Value::String(args))) =
            (f.remove("name"), f.remove("arguments"))
        else {
            return Err(shape());
        };
        let args: Value = serde_json::from_str(&args).map_err(|e| {
            bad(
                P,
                format!("{at}.tool_calls[{j}].function.arguments is not JSON: {e}"),
            )
        })?;
        lines.push(call_text(&name, &args));
        names.insert(id, name);
    }
    Ok(lines.join("\n"))
}

/// A tool result (`role: "tool"`) as the text of a user turn.
pub fn result_text(
    at: &str,
    call: Option<Value>,
    content: &str,
    names: &HashMap<String, String>,
) -> Result<String, OpenAiError> {
    let id = match call {
        Some(Value::String(id)) => id,
        _ => {
            return Err(bad(
                "messages",
                format!("{at}.tool_call_id is required for a tool message"),
            ))
        }
    };
    let name = names.get(&id).ok_or_else(|| {
        bad(
            "messages",
            format!(
                "{at}: tool_call_id {:?} answers no tool call of an earlier assistant message",
                id.chars().take(64).collect::<String>()
            ),
        )
    })?;
    Ok(format!("Tool result (call {id}, {name}):\n{content}"))
}

/// Turns the calls' output text, as it streams, into OpenAI's tool-call
/// deltas, each entry with its call's `index`: the first entry of a call
/// names it (`id`, `type`, `function.name`, empty `arguments`) once the text
/// has reached its arguments; the next carry the arguments' text as it
/// comes, holding back the last character (it may be the call's closing
/// brace, dropped at the end of the call: the newline before the next call,
/// or the end of the output). An output that does not start with `{` (a
/// text answer under `auto`) streams as `content`.
#[derive(Debug)]
pub struct CallStream {
    /// The job, for the calls' ids.
    job: String,
    text: String,
    /// The index of the call being read, and where it starts in `text`.
    index: usize,
    start: usize,
    /// Where its arguments start, once its head is known.
    args_at: Option<usize>,
    /// How much of `text` has been sent.
    sent: usize,
    /// The output is text, not calls.
    prose: bool,
}

impl CallStream {
    pub fn new(job: String) -> Self {
        Self {
            job,
            text: String::new(),
            index: 0,
            start: 0,
            args_at: None,
            sent: 0,
            prose: false,
        }
    }

    /// The delta for `more` text (its field, `tool_calls` or `content`, and
    /// value), if there is one to send.
    pub fn push(&mut self, more: &str) -> Option<(&'static str, Value)> {
        self.text.push_str(more);
        if self.index == 0
            && self.args_at.is_none()
            && !self.text.is_empty()
            && !self.text.starts_with('{')
        {
            self.prose = true;
        }
        if self.prose {
            let t = &self.text[self.sent..];
            self.sent = self.text.len();
            return (!t.is_empty()).then(|| ("content", json!(t)));
        }
        self.call_delta().map(|d| ("tool_calls", d))
    }

    fn call_delta(&mut self) -> Option<Value> {
        let mut entries = Vec::new();
        loop {
            let mut head = None;
            if self.args_at.is_none() {
                let call = &self.text[self.start..];
                let Some(rest) = call.strip_prefix("{\"name\":\"") else {
                    break;
                };
                let Some(quote) = rest.find('"') else { break };
                let name = &rest[..quote];
                let h = call_head(name);
                if !call.starts_with(&h) {
                    break;
                }
                head = Some(name.to_owned());
                self.args_at = Some(self.start + h.len());
                self.sent = self.start + h.len();
            }
            // The call ends before a newline (then its last character, the
            // closing brace, is dropped); until then the last character
            // is held back.
            let newline = self.text[self.sent..].find('\n').map(|i| self.sent + i);
            let upto = match newline {
                Some(at) => at.saturating_sub(1),
                None => self.text.char_indices().last().map_or(0, |(i, _)| i),
            }
            .max(self.sent);
            let args = &self.text[self.sent..upto];
            self.sent = upto;
            match head {
                Some(name) => entries.push(json!({
                    "index": self.index, "id": call_id(&self.job, self.index), "type": "function",
                    "function": {"name": name, "arguments": args},
                })),
                None if !args.is_empty() => entries.push(json!({
                    "index": self.index, "function": {"arguments": args},
                })),
                None => {}
            }
            let Some(at) = newline else { break };
            self.index += 1;
            self.start = at + 1;
            self.sent = at + 1;
            self.args_at = None;
        }
        (!entries.is_empty()).then_some(Value::Array(entries))
    }

    /// At the end of the output: whether it was whole calls, and the last
    /// delta: the rest of the last call's arguments (whole calls), or what
    /// is left of a cut one (`tool_calls`, or `content` when it never
    /// reached its arguments).
    pub fn end(&mut self) -> (bool, Option<(&'static str, Value)>) {
        let whole = !self.prose && read_calls(&self.text).is_some();
        let rest = match (self.args_at, whole) {
            (Some(_), true) => &self.text[self.sent..self.text.len() - 1],
            _ => &self.text[self.sent..],
        };
        self.sent = self.text.len();
        if rest.is_empty() {
            return (whole, None);
        }
        let last = match self.args_at {
            Some(_) => (
                "tool_calls",
                json!([{"index": self.index, "function": {"arguments": rest}}]),
            ),
            None => ("content", json!(rest)),
        };
        (whole, Some(last))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_streamed_call_reassembles_to_the_whole_call() {
        let text = r#"{"name":"get_weather","arguments":{"city":"Paris é"}}"#;
        let whole = read_call(text).expect("a call");
        assert_eq!(whole, ("get_weather".into(), r#"{"city":"Paris é"}"#));
        // Every split into pieces gives the same name and arguments.
        for cut in 1..text.len() {
            let Some(a) = text.get(..cut) else { continue };
            let b = &text[cut..];
            let mut s = CallStream::new("j".into());
            let mut deltas: Vec<Value> = [s.push(a), s.push(b)]
                .into_iter()
                .flatten()
                .map(|(field, d)| {
                    assert_eq!(field, "tool_calls");
                    d
                })
                .collect();
            let (is_call, last) = s.end();
            assert!(is_call);
            if let Some((field, d)) = last {
                assert_eq!(field, "tool_calls");
                deltas.push(d);
            }
            assert_eq!(deltas[0][0]["id"], "call_j_0", "{cut}");
            assert_eq!(deltas[0][0]["type"], "function");
            assert_eq!(deltas[0][0]["function"]["name"], "get_weather");
            let args: String = deltas
                .iter()
                .map(|d| d[0]["function"]["arguments"].as_str().unwrap_or_default())
                .collect();
            assert_eq!(args, whole.1, "cut at {cut}");
            assert!(deltas[1..].iter().all(|d| d[0].get("id").is_none()));
        }
    }

    #[test]
    fn a_cut_output_is_not_a_call() {
        for text in [
            r#"{"name":"get_weather","arguments":{"city":"Par"#,
            r#"{"name":"get_weather","argu"#,
            r#"{"name":"get_weather","arguments":{"city":"Paris"}} "#,
            r#"{"name":"get weather","arguments":{}}"#,
            r#"{"name":"f","arguments":[1]}"#,
            "Paris",
            "",
        ] {
            assert_eq!(read_call(text), None, "{text}");
            assert_eq!(read_calls(text), None, "{text}");
        }
        // Several calls: whole lines only.
        for text in [
            "{\"name\":\"f\",\"arguments\":{}}\n",
            "{\"name\":\"f\",\"arguments\":{}}\n\n{\"name\":\"f\",\"arguments\":{}}",
            "{\"name\":\"f\",\"arguments\":{}}\n{\"name\":\"g\",\"argu",
            "{\"name\":\"f\",\"arguments\":{}}\nand text",
        ] {
            assert_eq!(read_calls(text), None, "{text}");
        }
        let mut s = CallStream::new("j".into());
        assert_eq!(s.push(r#"{"name":"get_wea"#), None);
        let (whole, last) = s.end();
        assert!(!whole);
        assert_eq!(last, Some(("content", json!(r#"{"name":"get_wea"#))));
        // A text answer (auto) streams as content, as it comes.
        let mut s = CallStream::new("j".into());
        assert_eq!(s.push("Par"), Some(("content", json!("Par"))));
        assert_eq!(s.push("is {x}"), Some(("content", json!("is {x}"))));
        assert_eq!(s.end(), (false, None));
    }

    /// Several calls, one per line: each streams under its own index (id
    /// `call_<job>_<i>`, name, then its arguments' pieces) at every split of
    /// the text into three pushes, and reassembles to the calls read whole.
    #[test]
    fn parallel_calls_stream_under_their_indices_and_reassemble() {
        let text = concat!(
            r#"{"name":"get_weather","arguments":{"city":"Paris é"}}"#,
            "\n",
            r#"{"name":"get_time","arguments":{}}"#,
            "\n",
            r#"{"name":"get_weather","arguments":{"city":"Lyon"}}"#,
        );
        let whole = read_calls(text).expect("calls");
        assert_eq!(
            whole,
            vec![
                ("get_weather".into(), r#"{"city":"Paris é"}"#),
                ("get_time".into(), "{}"),
                ("get_weather".into(), r#"{"city":"Lyon"}"#),
            ]
        );
        let cuts: Vec<usize> = (1..text.len())
            .filter(|&c| text.is_char_boundary(c))
            .collect();
        for (k, &a) in cuts.iter().enumerate() {
            for &b in cuts[k..].iter().step_by(7) {
                let mut s = CallStream::new("j".into());
                let mut entries: Vec<Value> = Vec::new();
                for piece in [&text[..a], &text[a..b], &text[b..]] {
                    if let Some((field, d)) = s.push(piece) {
                        assert_eq!(field, "tool_calls", "{a} {b}");
                        entries.extend(d.as_array().cloned().unwrap_or_default());
                    }
                }
                let (is_calls, last) = s.end();
                assert!(is_calls, "{a} {b}");
                if let Some((field, d)) = last {
                    assert_eq!(field, "tool_calls");
                    entries.extend(d.as_array().cloned().unwrap_or_default());
                }
                // Reassembled as a client does: by index.
                let mut got: Vec<(String, String, String)> = Vec::new();
                for e in &entries {
                    let i = e["index"].as_u64().expect("an index") as usize;
                    if let Some(id) = e.get("id") {
                        assert_eq!(i, got.len(), "a call named in order: {a} {b}");
                        got.push((
                            id.as_str().unwrap_or_default().into(),
                            e["function"]["name"].as_str().unwrap_or_default().into(),
                            String::new(),
                        ));
                    }
                    let args = e["function"]["arguments"].as_str().unwrap_or_default();
                    got[i].2.push_str(args);
                }
                let want: Vec<(String, String, String)> = whole
                    .iter()
                    .enumerate()
                    .map(|(i, (n, args))| (call_id(&"j", i), n.clone(), (*args).to_owned()))
                    .collect();
                assert_eq!(got, want, "cut at {a} and {b}");
            }
        }
    }
}
