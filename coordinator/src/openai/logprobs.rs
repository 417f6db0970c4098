//! Token log-probabilities in OpenAI's shapes: chat's `logprobs.content`
//! (one entry per token: `token`, `logprob`, `bytes`, `top_logprobs`) and
//! the legacy completions' `logprobs` (`tokens`, `token_logprobs`,
//! `top_logprobs` as maps, `text_offset`), built from the entries the node
//! streamed beside its token ids (`TokenLogprob`, checked by the
//! dispatcher: one per id, finite, <= 0).
//!
//! # Invariants
//! - One entry per streamed token, in order, each token once: a retried
//!   attempt's chunks replace the ones at the same indices ([`Collected`]).
//! - A token whose bytes are not valid UTF-8 on their own (part of a
//!   character) shows as its lossy text; `bytes` has the exact bytes.

use mlxnet_proto::v1::{job_event, TokenLogprob};
use serde_json::{json, Map, Value};

fn token_text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Chat's `choices[].logprobs` of `entries`.
pub fn chat(entries: &[TokenLogprob]) -> Value {
    let one = |bytes: &[u8], logprob: f32| json!({"token": token_text(bytes), "logprob": logprob, "bytes": bytes});
    let content: Vec<Value> = entries
        .iter()
        .map(|e| {
            let mut v = one(&e.token, e.logprob);
            v["top_logprobs"] = e.top.iter().map(|t| one(&t.token, t.logprob)).collect();
            v
        })
        .collect();
    json!({"content": content, "refusal": null})
}

/// Completions' `choices[].logprobs` of `entries`, the first token's text
/// starting at character `offset` of the answer's text.
pub fn text(entries: &[TokenLogprob], offset: usize) -> Value {
    let mut at = offset;
    let mut tokens = Vec::with_capacity(entries.len());
    let mut offsets = Vec::with_capacity(entries.len());
    for e in entries {
        let t = token_text(&e.token);
        offsets.push(at);
        at += t.chars().count();
        tokens.push(t);
    }
    let top: Vec<Value> = entries
        .iter()
        .map(|e| {
            let m: Map<String, Value> = e
                .top
                .iter()
                .map(|t| (token_text(&t.token), json!(t.logprob)))
                .collect();
            Value::Object(m)
        })
        .collect();
    json!({
        "tokens": tokens,
        "token_logprobs": entries.iter().map(|e| e.logprob).collect::<Vec<_>>(),
        "top_logprobs": top,
        "text_offset": offsets,
    })
}

/// Characters the tokens of `entries` span (for the next `text_offset`).
pub fn chars(entries: &[TokenLogprob]) -> usize {
    entries
        .iter()
        .map(|e| token_text(&e.token).chars().count())
        .sum()
}

/// The entries of a job's token chunks, by token index.
#[derive(Debug, Default)]
pub struct Collected {
    entries: Vec<TokenLogprob>,
}

impl Collected {
    /// Takes a chunk's entries: they replace any at the same indices (a
    /// retried attempt streams from where it resumed); a chunk past a gap
    /// (an index not seen yet) is left out rather than misplaced.
    pub fn add(&mut self, chunk: &job_event::Tokens) {
        let first = chunk.index as usize;
        if first > self.entries.len() {
            return;
        }
        self.entries.truncate(first);
        self.entries.extend(chunk.logprobs.iter().cloned());
    }

    pub fn into_entries(self) -> Vec<TokenLogprob> {
        self.entries
    }
}
