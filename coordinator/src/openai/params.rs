//! Reading an OpenAI request body field by field: each getter takes its
//! field out of the object and checks its type and range, so that what is
//! left at the end ([`Params::finish`]) are the fields nobody knows, refused
//! by name.

use serde_json::{Map, Value};

use super::OpenAiError;

/// A request body being read.
pub struct Params {
    map: Map<String, Value>,
}

type R<T> = Result<T, OpenAiError>;

fn wrong(name: &str, what: &str) -> OpenAiError {
    OpenAiError::invalid(format!("{name} must be {what}"), Some(name))
}

impl Params {
    pub fn new(map: Map<String, Value>) -> Self {
        Self { map }
    }

    /// The field, absent when missing or JSON null.
    pub fn take(&mut self, name: &str) -> Option<Value> {
        self.map.remove(name).filter(|v| !v.is_null())
    }

    pub fn string(&mut self, name: &str) -> R<Option<String>> {
        match self.take(name) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(_) => Err(wrong(name, "a string")),
        }
    }

    pub fn required_string(&mut self, name: &str) -> R<String> {
        self.string(name)?
            .ok_or_else(|| OpenAiError::invalid(format!("{name} is required"), Some(name)))
    }

    pub fn bool(&mut self, name: &str) -> R<Option<bool>> {
        match self.take(name) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(b)),
            Some(_) => Err(wrong(name, "true or false")),
        }
    }

    /// A number within `lo..=hi`.
    pub fn number(&mut self, name: &str, lo: f64, hi: f64) -> R<Option<f64>> {
        match self.take(name) {
            None => Ok(None),
            Some(Value::Number(n)) => match n.as_f64() {
                Some(x) if (lo..=hi).contains(&x) => Ok(Some(x)),
                _ => Err(wrong(name, &format!("a number from {lo} to {hi}"))),
            },
            Some(_) => Err(wrong(name, &format!("a number from {lo} to {hi}"))),
        }
    }

    /// An integer within `lo..=hi`.
    pub fn integer(&mut self, name: &str, lo: i64, hi: i64) -> R<Option<i64>> {
        match self.take(name) {
            None => Ok(None),
            Some(Value::Number(n)) => match n.as_i64() {
                Some(x) if (lo..=hi).contains(&x) => Ok(Some(x)),
                _ => Err(wrong(name, &format!("an integer from {lo} to {hi}"))),
            },
            Some(_) => Err(wrong(name, &format!("an integer from {lo} to {hi}"))),
        }
    }

    /// `seed`: any 64-bit integer, signed or not (a negative one is used as
    /// its two's-complement bits).
    pub fn seed(&mut self, name: &str) -> R<Option<u64>> {
        match self.take(name) {
            None => Ok(None),
            Some(Value::Number(n)) => n
                .as_u64()
                .or_else(|| n.as_i64().map(|i| i as u64))
                .map(Some)
                .ok_or_else(|| wrong(name, "an integer")),
            Some(_) => Err(wrong(name, "an integer")),
        }
    }

    /// `stop`: a string or a list of strings.
    pub fn stop(&mut self, name: &str) -> R<Vec<String>> {
        match self.take(name) {
            None => Ok(Vec::new()),
            Some(Value::String(s)) => Ok(vec![s]),
            Some(Value::Array(items)) => items
                .into_iter()
                .map(|v| match v {
                    Value::String(s) => Ok(s),
                    _ => Err(wrong(name, "a string or a list of strings")),
                })
                .collect(),
            Some(_) => Err(wrong(name, "a string or a list of strings")),
        }
    }

    /// `max_tokens` (and its newer name `max_completion_tokens`): 0 means
    /// the listener's default.
    pub fn max_tokens(&mut self) -> R<u32> {
        let newer = self.integer("max_completion_tokens", 1, i64::from(u32::MAX))?;
        let older = self.integer("max_tokens", 1, i64::from(u32::MAX))?;
        Ok(newer.or(older).map_or(0, |n| n as u32))
    }

    /// `n` (and `best_of`): only 1 is served.
    pub fn only_one(&mut self, name: &str) -> R<()> {
        match self.integer(name, 1, i64::MAX)? {
            None | Some(1) => Ok(()),
            Some(_) => Err(OpenAiError::unsupported(
                name,
                "only 1 choice per request is served; send several requests",
            )),
        }
    }

    /// A penalty this network's sampler does not have: refused unless 0.
    pub fn zero_only(&mut self, name: &str, lo: f64, hi: f64) -> R<()> {
        match self.number(name, lo, hi)? {
            None => Ok(()),
            Some(0.0) => Ok(()),
            Some(_) => Err(OpenAiError::unsupported(
                name,
                "not supported by this network's sampler; use 0 or leave it out",
            )),
        }
    }

    /// `logit_bias`: refused unless empty.
    pub fn no_logit_bias(&mut self) -> R<()> {
        match self.take("logit_bias") {
            None => Ok(()),
            Some(Value::Object(m)) if m.is_empty() => Ok(()),
            Some(Value::Object(_)) => Err(OpenAiError::unsupported(
                "logit_bias",
                "not supported by this network's sampler",
            )),
            Some(_) => Err(wrong("logit_bias", "an object")),
        }
    }

    /// `stream_options.include_usage` (only with `stream`).
    pub fn include_usage(&mut self, stream: bool) -> R<bool> {
        let Some(v) = self.take("stream_options") else {
            return Ok(false);
        };
        if !stream {
            return Err(OpenAiError::invalid(
                "stream_options is only allowed with stream: true",
                Some("stream_options"),
            ));
        }
        let Value::Object(mut o) = v else {
            return Err(wrong("stream_options", "an object"));
        };
        let usage = match o.remove("include_usage") {
            None | Some(Value::Null) => false,
            Some(Value::Bool(b)) => b,
            Some(_) => return Err(wrong("stream_options.include_usage", "true or false")),
        };
        // include_obfuscation pads chunks against length side channels; our
        // chunks carry no secrets from others, so it is accepted and a no-op.
        o.remove("include_obfuscation");
        if let Some(k) = o.keys().next() {
            return Err(OpenAiError::invalid(
                format!("unknown stream_options field {k:?}"),
                Some("stream_options"),
            ));
        }
        Ok(usage)
    }

    /// Refuses whatever field is left: nobody reads it.
    pub fn finish(self) -> R<()> {
        match self.map.into_iter().find(|(_, v)| !v.is_null()) {
            None => Ok(()),
            Some((k, _)) => Err(OpenAiError::invalid(
                format!(
                    "unrecognized request argument supplied: {}",
                    k.chars().take(64).collect::<String>()
                ),
                Some(&k),
            )),
        }
    }
}
