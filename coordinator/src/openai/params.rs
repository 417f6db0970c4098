//! Reading an OpenAI request body field by field: each getter takes its
//! field out of the object and checks its type and range, so that what is
//! left at the end ([`Params::finish`]) are the fields nobody knows, refused
//! by name.

use mlxnet_proto::v1::{LogitBias, SamplingParams};
use serde_json::{Map, Value};

use super::OpenAiError;
use crate::domain::job::{MAX_BIAS, MAX_LOGIT_BIAS, MAX_PENALTY};

/// OpenAI's penalties and logit bias as read from a request.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Penalties {
    pub presence: f32,
    pub frequency: f32,
    pub bias: Vec<LogitBias>,
}

impl Penalties {
    /// Puts them in a job's sampling.
    pub fn apply(self, s: &mut SamplingParams) {
        s.presence_penalty = self.presence;
        s.frequency_penalty = self.frequency;
        s.logit_bias = self.bias;
    }
}

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

    /// `presence_penalty`, `frequency_penalty` and `logit_bias`.
    pub fn penalties(&mut self) -> R<Penalties> {
        Ok(Penalties {
            presence: self.penalty("presence_penalty")?,
            frequency: self.penalty("frequency_penalty")?,
            bias: self.logit_bias()?,
        })
    }

    /// `presence_penalty` / `frequency_penalty`: -2 to 2, 0 when absent.
    fn penalty(&mut self, name: &str) -> R<f32> {
        let max = f64::from(MAX_PENALTY);
        Ok(self.number(name, -max, max)?.unwrap_or(0.0) as f32)
    }

    /// `logit_bias`: an object from token ids (decimal strings) to biases
    /// from -100 to 100, at most 300 entries (the ids are checked against
    /// the model's vocabulary at submission).
    fn logit_bias(&mut self) -> R<Vec<LogitBias>> {
        const NAME: &str = "logit_bias";
        let m = match self.take(NAME) {
            None => return Ok(Vec::new()),
            Some(Value::Object(m)) => m,
            Some(_) => return Err(wrong(NAME, "an object from token ids to biases")),
        };
        if m.len() > MAX_LOGIT_BIAS {
            return Err(OpenAiError::invalid(
                format!(
                    "logit_bias has {} entries; at most {MAX_LOGIT_BIAS}",
                    m.len()
                ),
                Some(NAME),
            ));
        }
        let max = f64::from(MAX_BIAS);
        m.into_iter()
            .map(|(k, v)| {
                let token_id = k
                    .parse::<u32>()
                    .ok()
                    .filter(|_| k.bytes().all(|b| b.is_ascii_digit()))
                    .ok_or_else(|| {
                        OpenAiError::invalid(
                            format!(
                                "logit_bias keys must be token ids, got {:?}",
                                k.chars().take(32).collect::<String>()
                            ),
                            Some(NAME),
                        )
                    })?;
                match v.as_f64() {
                    Some(b) if (-max..=max).contains(&b) => Ok(LogitBias {
                        token_id,
                        bias: b as f32,
                    }),
                    _ => Err(wrong(
                        NAME,
                        &format!("an object of biases from -{max} to {max}"),
                    )),
                }
            })
            .collect()
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
