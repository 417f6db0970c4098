//! Structured output: the grammar a job's output must match, as it travels
//! (`SamplingParams.grammar`), its digest, and (feature `grammar`) its
//! compilation by `llguidance`, shared by the coordinator (which refuses a
//! grammar it cannot compile before anything is stored or held) and the node
//! (which masks the logits with it at every step, and replays it in audits).
//!
//! # Why here
//! Both sides must agree byte for byte on what a grammar means: the same
//! schema text turns into the same `llguidance` grammar through the one
//! function [`Constraint::schema`], and the same digest through
//! [`Constraint::digest`]. The compiler (`llguidance`, a few MB of code) sits
//! behind the `grammar` feature so the client (which only needs the digest)
//! does not build it.
//!
//! # What a grammar is
//! - `json_object`: any JSON object (the schema `{"type": "object"}`).
//! - `json_schema`: a JSON Schema (an object, at most [`MAX_SCHEMA_BYTES`] of
//!   text; local `$ref` only: `llguidance` is built without its remote
//!   resolver).
//! - `lark`: a grammar in `llguidance`'s Lark dialect (at most
//!   [`MAX_SCHEMA_BYTES`]; compiled with llguidance's own size limits): what
//!   the coordinator builds for `tool_choice: "auto"` (free text or a tool
//!   call), or a gRPC client's own; its `%json` parts carry their own
//!   `x-guidance` (none is added).
//!
//! The JSON kinds are compiled with compact separators and no free whitespace between
//! tokens (`x-guidance: {whitespace_flexible: false}` set by us, replacing
//! any the client sent): the output is `{"a":1}`, never an endless run of
//! newlines that eats `max_tokens` (a small model at temperature > 0 would
//! otherwise often never close the object).
//!
//! # Failure
//! [`GrammarError`]: empty kind, too large, not JSON, not an object, or
//! (with the feature) refused by `llguidance` (an unsupported keyword, a
//! remote `$ref`, an unsatisfiable schema it detects). Each is the client's
//! error.

use sha2::{Digest, Sha256};

use crate::v1;

/// Most bytes of a JSON schema's text.
pub const MAX_SCHEMA_BYTES: usize = 32 * 1024;

/// Domain separator of [`Constraint::digest`].
const DIGEST_DOMAIN: &[u8] = b"mlxnet-grammar-v1\0";

/// Why a grammar is refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum GrammarError {
    #[error("grammar kind must be json_object, json_schema or lark")]
    NoKind,
    #[error("json_object takes no schema")]
    SchemaWithObject,
    #[error("a grammar has one body: a schema or a Lark grammar")]
    TwoBodies,
    #[error("the JSON schema is empty")]
    EmptySchema,
    #[error("the JSON schema is {0} bytes; the limit is {MAX_SCHEMA_BYTES}")]
    TooLarge(usize),
    #[error("the JSON schema is not JSON: {0}")]
    NotJson(String),
    #[error("the JSON schema must be a JSON object")]
    NotObject,
    #[error("the JSON schema cannot be enforced: {0}")]
    Refused(String),
}

/// A grammar as both sides use it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Constraint {
    /// Any JSON object.
    JsonObject,
    /// JSON matching this schema (its text, as the client sent it).
    JsonSchema(String),
    /// Text matching this Lark grammar (llguidance's dialect).
    Lark(String),
}

impl Constraint {
    /// The constraint of a job's wire grammar (checked: kind, size, JSON
    /// object; not compiled, see `check`).
    pub fn from_wire(g: &v1::Grammar) -> Result<Constraint, GrammarError> {
        use v1::grammar::Kind;
        let kind = Kind::try_from(g.kind).map_err(|_| GrammarError::NoKind)?;
        if kind != Kind::Lark && !g.lark.is_empty() {
            return Err(GrammarError::TwoBodies);
        }
        let c = match kind {
            Kind::JsonObject if g.json_schema.is_empty() => Constraint::JsonObject,
            Kind::JsonObject => return Err(GrammarError::SchemaWithObject),
            Kind::JsonSchema => Constraint::JsonSchema(g.json_schema.clone()),
            Kind::Lark if g.json_schema.is_empty() => Constraint::Lark(g.lark.clone()),
            Kind::Lark => return Err(GrammarError::TwoBodies),
            Kind::Unspecified => return Err(GrammarError::NoKind),
        };
        c.schema_value()?;
        Ok(c)
    }

    /// The wire form.
    pub fn to_wire(&self) -> v1::Grammar {
        match self {
            Constraint::JsonObject => v1::Grammar {
                kind: v1::grammar::Kind::JsonObject as i32,
                ..v1::Grammar::default()
            },
            Constraint::JsonSchema(s) => v1::Grammar {
                kind: v1::grammar::Kind::JsonSchema as i32,
                json_schema: s.clone(),
                ..v1::Grammar::default()
            },
            Constraint::Lark(s) => v1::Grammar {
                kind: v1::grammar::Kind::Lark as i32,
                lark: s.clone(),
                ..v1::Grammar::default()
            },
        }
    }

    /// SHA-256 over the domain, the kind (1 byte: 1 object, 2 schema, 3
    /// Lark) and the schema's or grammar's text as sent: what a signed claim
    /// binds.
    pub fn digest(&self) -> [u8; 32] {
        let mut h = Sha256::new();
        h.update(DIGEST_DOMAIN);
        match self {
            Constraint::JsonObject => h.update([1u8]),
            Constraint::JsonSchema(s) => {
                h.update([2u8]);
                h.update(s.as_bytes());
            }
            Constraint::Lark(s) => {
                h.update([3u8]);
                h.update(s.as_bytes());
            }
        }
        h.finalize().into()
    }

    /// Checks size and shape; returns the schema (or Lark) text to parse
    /// (None for `json_object`).
    fn schema_value(&self) -> Result<Option<&str>, GrammarError> {
        let (Constraint::JsonSchema(s) | Constraint::Lark(s)) = self else {
            return Ok(None);
        };
        if s.trim().is_empty() {
            return Err(GrammarError::EmptySchema);
        }
        if s.len() > MAX_SCHEMA_BYTES {
            return Err(GrammarError::TooLarge(s.len()));
        }
        Ok(Some(s))
    }
}

/// What a signed claim binds of a job's grammar (`ResultClaim.grammar_sha256`,
/// checked by the coordinator and by any client's verify): None for a job
/// without one, else its [`Constraint::digest`]. The one function the node
/// (which signs it) and every checker call on the job's wire grammar. A
/// wire grammar that does not read as a constraint (the coordinator refuses
/// it before any job exists, and a node refuses to run it) still has a
/// digest: of its raw kind and bodies under kind byte 0, which no
/// constraint's digest starts with.
pub fn claim_digest(g: Option<&v1::Grammar>) -> Option<[u8; 32]> {
    let g = g?;
    Some(match Constraint::from_wire(g) {
        Ok(c) => c.digest(),
        Err(_) => {
            let mut h = Sha256::new();
            h.update(DIGEST_DOMAIN);
            h.update([0u8]);
            h.update(g.kind.to_le_bytes());
            h.update((g.json_schema.len() as u64).to_le_bytes());
            h.update(g.json_schema.as_bytes());
            h.update(g.lark.as_bytes());
            h.finalize().into()
        }
    })
}

#[cfg(feature = "grammar")]
pub use compile::*;

#[cfg(feature = "grammar")]
mod compile {
    use std::collections::VecDeque;
    use std::sync::{Mutex, OnceLock, PoisonError};

    pub use llguidance;
    use llguidance::api::TopLevelGrammar;
    use llguidance::toktrie::{ApproximateTokEnv, TokEnv};
    use llguidance::{Matcher, ParserFactory};
    use serde_json::{json, Map, Value};

    use super::{Constraint, GrammarError};

    /// How many compiled grammars' digests [`Constraint::check`] keeps.
    pub const PASSED_KEPT: usize = 256;

    impl Constraint {
        /// The JSON schema `llguidance` compiles: the client's (or
        /// `{"type": "object"}`), with our `x-guidance` options (a Lark
        /// grammar has none: `NotObject`).
        pub fn schema(&self) -> Result<Value, GrammarError> {
            if let Constraint::Lark(_) = self {
                return Err(GrammarError::NotObject);
            }
            let mut v = match self.schema_value()? {
                None => json!({"type": "object"}),
                Some(text) => serde_json::from_str::<Value>(text)
                    .map_err(|e| GrammarError::NotJson(e.to_string()))?,
            };
            let Value::Object(map) = &mut v else {
                return Err(GrammarError::NotObject);
            };
            let mut opts = Map::new();
            opts.insert("whitespace_flexible".into(), Value::Bool(false));
            map.insert("x-guidance".into(), Value::Object(opts));
            Ok(v)
        }

        /// A matcher for one generation over `factory`'s vocabulary, at the
        /// start of the output.
        pub fn matcher(&self, factory: &ParserFactory) -> Result<Matcher, GrammarError> {
            let grammar = match self {
                Constraint::Lark(text) => {
                    self.schema_value()?;
                    TopLevelGrammar::from_lark(text.clone())
                }
                _ => TopLevelGrammar::from_json_schema(self.schema()?),
            };
            let parser = factory
                .create_parser(grammar)
                .map_err(|e| GrammarError::Refused(short(&e.to_string())))?;
            let m = Matcher::new(Ok(parser));
            match m.get_error() {
                Some(e) => Err(GrammarError::Refused(short(&e))),
                None => Ok(m),
            }
        }

        /// Compiles it against a one-byte-per-token vocabulary: what the
        /// coordinator runs before it accepts a job (the node compiles it
        /// again against the model's own vocabulary). The digests of the
        /// last [`PASSED_KEPT`] grammars that compiled are kept, so the same
        /// grammar checked again (the OpenAI layer's check, then Submit's;
        /// a client's repeated request) is not compiled again.
        pub fn check(&self) -> Result<(), GrammarError> {
            static FACTORY: OnceLock<Result<ParserFactory, String>> = OnceLock::new();
            static PASSED: Mutex<VecDeque<[u8; 32]>> = Mutex::new(VecDeque::new());
            let digest = self.digest();
            let passed = || PASSED.lock().unwrap_or_else(PoisonError::into_inner);
            if passed().contains(&digest) {
                return Ok(());
            }
            let factory = FACTORY
                .get_or_init(|| factory(ApproximateTokEnv::single_byte_env()))
                .as_ref()
                .map_err(|e| GrammarError::Refused(e.clone()))?;
            self.matcher(factory)?;
            let mut kept = passed();
            if kept.len() >= PASSED_KEPT {
                kept.pop_front();
            }
            kept.push_back(digest);
            Ok(())
        }
    }

    /// A quiet factory (no logging to stderr) over `env`.
    pub fn factory(env: TokEnv) -> Result<ParserFactory, String> {
        let mut f = ParserFactory::new_simple(&env).map_err(|e| e.to_string())?;
        f.quiet();
        Ok(f)
    }

    /// `llguidance`'s messages can carry the whole grammar: the first line,
    /// at most 300 characters.
    fn short(e: &str) -> String {
        let line = e.lines().next().unwrap_or_default();
        line.chars().take(300).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_wire_form_round_trips_and_bad_shapes_are_refused() {
        let s = Constraint::JsonSchema(r#"{"type":"string"}"#.into());
        assert_eq!(Constraint::from_wire(&s.to_wire()), Ok(s.clone()));
        let o = Constraint::JsonObject;
        assert_eq!(Constraint::from_wire(&o.to_wire()), Ok(o.clone()));
        let mut w = o.to_wire();
        w.json_schema = "{}".into();
        assert_eq!(
            Constraint::from_wire(&w),
            Err(GrammarError::SchemaWithObject)
        );
        w.kind = 0;
        assert_eq!(Constraint::from_wire(&w), Err(GrammarError::NoKind));
        w.kind = 9;
        assert_eq!(Constraint::from_wire(&w), Err(GrammarError::NoKind));
        let big = Constraint::JsonSchema(" ".repeat(10) + &"x".repeat(MAX_SCHEMA_BYTES));
        assert_eq!(
            Constraint::from_wire(&big.to_wire()),
            Err(GrammarError::TooLarge(MAX_SCHEMA_BYTES + 10))
        );
        let empty = Constraint::JsonSchema("  ".into());
        assert_eq!(
            Constraint::from_wire(&empty.to_wire()),
            Err(GrammarError::EmptySchema)
        );
    }

    #[test]
    fn a_claims_grammar_digest_is_the_constraints_and_total_over_the_wire() {
        assert_eq!(claim_digest(None), None);
        for c in [
            Constraint::JsonObject,
            Constraint::JsonSchema(r#"{"type":"object"}"#.into()),
            Constraint::Lark("start: \"a\"".into()),
        ] {
            assert_eq!(claim_digest(Some(&c.to_wire())), Some(c.digest()));
        }
        let broken = v1::Grammar::default();
        let d = claim_digest(Some(&broken)).expect("a digest");
        assert_ne!(d, Constraint::JsonObject.digest());
        let mut other = broken.clone();
        other.lark = "x".into();
        assert_ne!(claim_digest(Some(&other)), Some(d));
    }

    #[test]
    fn the_digest_binds_kind_and_text() {
        let a = Constraint::JsonSchema(r#"{"type":"object"}"#.into());
        let b = Constraint::JsonSchema(r#"{"type": "object"}"#.into());
        assert_ne!(a.digest(), b.digest());
        assert_ne!(a.digest(), Constraint::JsonObject.digest());
        assert_eq!(a.digest(), a.clone().digest());
        assert_ne!(
            Constraint::JsonSchema(String::new()).digest(),
            Constraint::JsonObject.digest()
        );
    }

    #[cfg(feature = "grammar")]
    #[test]
    fn schemas_llguidance_refuses_are_refused_before_any_job() {
        let ok = [
            r#"{"type":"object","properties":{"a":{"type":"integer"}},"required":["a"]}"#,
            r##"{"$defs":{"n":{"type":"string"}},"type":"object","properties":{"a":{"$ref":"#/$defs/n"}}}"##,
        ];
        for s in ok {
            assert_eq!(Constraint::JsonSchema(s.into()).check(), Ok(()), "{s}");
        }
        assert_eq!(Constraint::JsonObject.check(), Ok(()));
        let not_json = Constraint::JsonSchema("{\"type\":".into()).check();
        assert!(
            matches!(not_json, Err(GrammarError::NotJson(_))),
            "{not_json:?}"
        );
        let array = Constraint::JsonSchema("[1]".into()).check();
        assert_eq!(array, Err(GrammarError::NotObject));
        for s in [
            r#"{"type":"array","uniqueItems":true}"#,
            r#"{"type":"object","not":{"required":["a"]}}"#,
            r#"{"type":"nonsense"}"#,
            r#"{"$ref":"https://example.com/schema.json"}"#,
        ] {
            let r = Constraint::JsonSchema(s.into()).check();
            assert!(matches!(r, Err(GrammarError::Refused(_))), "{s}: {r:?}");
        }
    }
}
