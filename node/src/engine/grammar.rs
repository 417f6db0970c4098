//! Structured output on the node: a job's grammar (`Sampling::grammar`,
//! `mlxnet_proto::grammar::Constraint`) as a token mask over the model's
//! own vocabulary, applied to the logits at every step of a generation
//! (`super::sequence`) and replayed by the audit (`super::audit`).
//!
//! # Design
//! - The token environment is built once per model, lazily, on the first
//!   job that asks for a grammar ([`GrammarEnv`], held by `TextSide`): a
//!   `llguidance` token trie over each id's raw bytes from the model's own
//!   tokenizer (the GGUF vocabulary); control tokens (no bytes) get a
//!   `0xFF`-marked name so no grammar can produce them as text; the model's
//!   end-of-generation ids are the trie's EOS set, so the mask allows them
//!   exactly when the grammar accepts (or forces the end).
//! - One [`Mask`] (an `llguidance::Matcher`) per sequence: [`Mask::apply`]
//!   sets every logit the grammar forbids to `-inf` (ids past the tokenizer's
//!   vocabulary too), before the sampler's bias and penalties (which keep a
//!   `-inf` at `-inf`), so greedy, sampling and the reported logprobs all see
//!   the constrained distribution; [`Mask::consume`] advances it by the
//!   chosen token.
//! - A job without a grammar never touches this module: its output is
//!   unchanged to the bit.
//!
//! # Failure
//! A grammar the model's vocabulary cannot compile is the client's error
//! (`EngineError::InvalidSampling`); `llguidance` failing mid-generation (or
//! a resumed token the grammar refuses) is `EngineError::Grammar`: the
//! attempt fails, nothing is claimed.

use std::sync::{Arc, OnceLock};

use mlxnet_proto::grammar::llguidance::toktrie::{
    ApproximateTokEnv, SimpleVob, TokEnv, TokRxInfo, TokTrie,
};
use mlxnet_proto::grammar::llguidance::{Matcher, ParserFactory};
use mlxnet_proto::grammar::{self, Constraint};

use super::tokenizer::Tokenizer;
use super::EngineError;

/// A model's grammar compiler, built on first use.
#[derive(Default)]
pub(crate) struct GrammarEnv {
    factory: OnceLock<Result<Arc<ParserFactory>, String>>,
}

impl std::fmt::Debug for GrammarEnv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrammarEnv")
            .field("built", &self.factory.get().is_some())
            .finish()
    }
}

impl GrammarEnv {
    /// A mask for one generation of `c` over `tokenizer`'s vocabulary.
    pub(crate) fn mask(&self, c: &Constraint, tokenizer: &Tokenizer) -> Result<Mask, EngineError> {
        let factory = self
            .factory
            .get_or_init(|| {
                token_env(tokenizer)
                    .and_then(grammar::factory)
                    .map(Arc::new)
            })
            .as_ref()
            .map_err(|e| EngineError::Grammar(format!("token environment: {e}")))?;
        let matcher = c
            .matcher(factory)
            .map_err(|e| EngineError::InvalidSampling(format!("response_format: {e}")))?;
        Ok(Mask {
            matcher,
            vocab: tokenizer.vocab_len(),
        })
    }
}

/// `llguidance`'s view of `tokenizer`: each id's bytes, control tokens
/// marked special, the end-of-generation ids as EOS.
pub(crate) fn token_env(tokenizer: &Tokenizer) -> Result<TokEnv, String> {
    let words: Vec<Vec<u8>> = (0..tokenizer.vocab_len() as u32)
        .map(|id| tokenizer.token_bytes(id).to_vec())
        .collect();
    let mut eog: Vec<u32> = tokenizer.eog.iter().copied().collect();
    eog.sort_unstable();
    if let Some(e) = tokenizer.eos {
        eog.retain(|&x| x != e);
        eog.insert(0, e);
    }
    env_of(words, &eog)
}

/// A token environment over `words` (id = index; empty = a control token)
/// with `eog` (the first is the EOS) ending a generation.
fn env_of(mut words: Vec<Vec<u8>>, eog: &[u32]) -> Result<TokEnv, String> {
    let n = words.len();
    let eog: Vec<u32> = eog.iter().copied().filter(|&e| (e as usize) < n).collect();
    let Some(&eos) = eog.first() else {
        return Err("the model has no end-of-generation token".into());
    };
    for (id, w) in words.iter_mut().enumerate() {
        if w.is_empty() {
            w.push(TokTrie::SPECIAL_TOKEN_MARKER);
            w.extend_from_slice(format!("<|mlxnet_control_{id}|>").as_bytes());
        }
    }
    let info = TokRxInfo::new(n as u32, eos);
    // The trie asserts its own invariants; a vocabulary that breaks one is
    // this model's problem, not a reason to take the node down.
    let trie = std::panic::catch_unwind(|| TokTrie::from(&info, &words).with_eos_tokens(&eog))
        .map_err(|_| "the vocabulary does not form a token trie".to_string())?;
    let env: TokEnv = Arc::new(ApproximateTokEnv::new(trie));
    debug_assert_eq!(env.tok_trie().vocab_size(), n);
    Ok(env)
}

/// One generation's grammar state.
pub struct Mask {
    matcher: Matcher,
    /// Ids at or past this (the tokenizer's vocabulary) are never allowed.
    vocab: usize,
}

impl Mask {
    /// Forbids (`-inf`) every token the grammar does not allow next, and
    /// returns the allowed set.
    pub fn apply(&mut self, logits: &mut [f32]) -> Result<Allowed, EngineError> {
        let allowed = Allowed {
            set: self
                .matcher
                .compute_mask_or_eos()
                .map_err(|e| EngineError::Grammar(e.to_string()))?,
            vocab: self.vocab,
        };
        for (id, l) in logits.iter_mut().enumerate() {
            if !allowed.contains(id as u32) {
                *l = f32::NEG_INFINITY;
            }
        }
        Ok(allowed)
    }

    /// Advances the grammar by `token` (which the mask allowed).
    pub fn consume(&mut self, token: u32) -> Result<(), EngineError> {
        self.matcher
            .consume_token(token)
            .map_err(|e| EngineError::Grammar(e.to_string()))
    }
}

/// The tokens a grammar allows at one position.
pub struct Allowed {
    set: SimpleVob,
    vocab: usize,
}

impl Allowed {
    pub fn contains(&self, token: u32) -> bool {
        (token as usize) < self.vocab && self.set.is_allowed(token)
    }
}

impl std::fmt::Debug for Mask {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mask")
            .field("vocab", &self.vocab)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::audit::{AuditInput, AuditPass, ClaimFacts, Finding};
    use crate::engine::sampler::Sampler;
    use crate::engine::Sampling;

    /// A vocabulary of JSON pieces and junk; 0 is a control token (EOS).
    const WORDS: &[&str] = &[
        "", "{", "}", "\"", "a", "b", "\"a\"", ":", "1", "2", "0", ",", " ", "\n", "x", "{\"",
        "\"b\"", "true", "]",
    ];

    fn words() -> Vec<Vec<u8>> {
        WORDS.iter().map(|w| w.as_bytes().to_vec()).collect()
    }

    fn mask(schema: &str) -> Mask {
        let factory = env_of(words(), &[0])
            .and_then(grammar::factory)
            .unwrap_or_else(|e| panic!("{e}"));
        let c = Constraint::JsonSchema(schema.into());
        Mask {
            matcher: c.matcher(&factory).unwrap_or_else(|e| panic!("{e}")),
            vocab: WORDS.len(),
        }
    }

    const SCHEMA: &str = r#"{"type":"object","properties":{"a":{"type":"integer","minimum":0,"maximum":99},"b":{"type":"boolean"}},"required":["a","b"],"additionalProperties":false}"#;

    fn text(ids: &[u32]) -> String {
        ids.iter().map(|&i| WORDS[i as usize]).collect()
    }

    /// Generates under the mask from `logits_of(step)` (the "model"), as
    /// `Sequence::step` does: mask, sample, stop at EOS, consume.
    fn generate(
        m: &mut Mask,
        sampling: &Sampling,
        logits_of: &mut dyn FnMut(usize) -> Vec<f32>,
    ) -> Vec<u32> {
        let mut sampler = Sampler::new(sampling);
        let mut out = Vec::new();
        for step in 0..64 {
            let mut logits = logits_of(step);
            m.apply(&mut logits).unwrap_or_else(|e| panic!("{e}"));
            let t = sampler.sample(&mut logits, &out, 0);
            if t == 0 {
                return out;
            }
            m.consume(t).unwrap_or_else(|e| panic!("{e}"));
            out.push(t);
        }
        panic!("no end after 64 tokens: {}", text(&out));
    }

    #[test]
    fn the_mask_keeps_any_model_inside_the_schema() {
        use rand::{Rng, SeedableRng};
        // Greedy with a model that always prefers EOS, then junk: the mask
        // still forces a complete, valid object.
        let mut m = mask(SCHEMA);
        let mut junk = |_: usize| {
            let mut l = vec![0.0; WORDS.len()];
            l[0] = 9.0;
            l[14] = 8.0;
            l[13] = 7.0;
            l
        };
        let out = generate(&mut m, &Sampling::default(), &mut junk);
        let v: serde_json::Value =
            serde_json::from_str(&text(&out)).unwrap_or_else(|e| panic!("{e}: {}", text(&out)));
        assert!(v["a"].is_u64() && v["b"].is_boolean(), "{v}");
        // 50 seeded runs of a random model at temperature 1: every output
        // parses and fits the schema.
        for seed in 0..50u64 {
            let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
            let mut m = mask(SCHEMA);
            let s = Sampling {
                temperature: 1.0,
                seed,
                ..Sampling::default()
            };
            let out = generate(&mut m, &s, &mut |_: usize| {
                (0..WORDS.len()).map(|_| rng.gen_range(-3.0..3.0)).collect()
            });
            let t = text(&out);
            let v: serde_json::Value =
                serde_json::from_str(&t).unwrap_or_else(|e| panic!("seed {seed}: {e}: {t}"));
            let obj = v.as_object().unwrap_or_else(|| panic!("{t}"));
            assert_eq!(obj.len(), 2, "{t}");
            assert!(v["a"].as_u64().is_some_and(|a| a <= 99), "{t}");
            assert!(v["b"].is_boolean(), "{t}");
        }
    }

    #[test]
    fn a_forbidden_token_is_minus_infinity_and_the_end_waits_for_the_grammar() {
        let mut m = mask(SCHEMA);
        let mut l = vec![1.0; WORDS.len()];
        let allowed = m.apply(&mut l).unwrap_or_else(|e| panic!("{e}"));
        // At the start only an opening brace can come (alone or with a quote).
        assert!(allowed.contains(1) && allowed.contains(15), "{l:?}");
        for id in [0u32, 2, 3, 4, 8, 12, 13, 14, 18, 99] {
            assert!(!allowed.contains(id), "{id}");
        }
        assert_eq!(l[0], f32::NEG_INFINITY);
        assert_eq!(l[1], 1.0);
        for t in [15u32, 4, 3, 7, 8, 11, 16, 7, 17, 2] {
            let mut l = vec![0.0; WORDS.len()];
            assert!(
                m.apply(&mut l)
                    .unwrap_or_else(|e| panic!("{e}"))
                    .contains(t),
                "{t}"
            );
            assert!(
                !m.apply(&mut l)
                    .unwrap_or_else(|e| panic!("{e}"))
                    .contains(0),
                "EOS before the end"
            );
            m.consume(t).unwrap_or_else(|e| panic!("{e}"));
        }
        // `{"a":1,"b":true}` is complete: now only EOS.
        let mut l = vec![0.0; WORDS.len()];
        let allowed = m.apply(&mut l).unwrap_or_else(|e| panic!("{e}"));
        assert!(allowed.contains(0));
        assert_eq!(l.iter().filter(|x| x.is_finite()).count(), 1, "{l:?}");
    }

    fn audit(
        output: &[u32],
        row: &[f32],
        sampling: &Sampling,
        grammar: Option<Mask>,
    ) -> Vec<Finding> {
        let facts = ClaimFacts {
            finish_reason: "eos".into(),
            prompt_tokens: 2,
            completion_tokens: output.len() as u32,
            output_token_ids_len: output.len(),
            output_text: text(output),
        };
        let mut pass = AuditPass::new(AuditInput {
            prompt: vec![12, 12],
            resumed: 0,
            output,
            sampling,
            facts: &facts,
            eog: vec![0],
            decoded_text: text(output),
            context_length: 100,
            grammar,
        });
        let first = pass.first_row();
        let rows = pass.tokens().len() - first;
        let mut logits: Vec<f32> = row.iter().copied().cycle().take(row.len() * rows).collect();
        pass.score(first, &mut logits, row.len());
        pass.verdict().findings
    }

    #[test]
    fn a_structured_output_audit_catches_a_node_that_ignores_the_grammar() {
        // A "model" whose logits rank the tokens by id: the grammar-free
        // greedy choice is always 18 ("]"), then EOS would never come.
        let row: Vec<f32> = (0..WORDS.len()).map(|i| i as f32 * 0.5).collect();
        let greedy = Sampling::default();
        // The honest node: greedy under the mask.
        let mut m = mask(SCHEMA);
        let honest = generate(&mut m, &greedy, &mut |_: usize| row.clone());
        let t = text(&honest);
        assert!(serde_json::from_str::<serde_json::Value>(&t).is_ok(), "{t}");
        assert_eq!(
            audit(&honest, &row, &greedy, Some(mask(SCHEMA))),
            vec![],
            "{t}"
        );
        // Without the grammar the same honest output is not greedy: the
        // grammar is what made it the model's choice.
        assert!(matches!(
            audit(&honest, &row, &greedy, None)[..],
            [Finding::NotGreedy { position: 0, .. }, ..]
        ));
        // A node that ignored the grammar (took the unmasked argmax) and
        // claims eos after it: caught at position 0, whatever its logits.
        let cheat = vec![18, 18, 18];
        let f = audit(&cheat, &row, &greedy, Some(mask(SCHEMA)));
        assert_eq!(
            f.first(),
            Some(&Finding::OutsideGrammar { position: 0 }),
            "{f:?}"
        );
        // One that follows the grammar, then leaves it mid-object.
        let mut bad = honest.clone();
        bad[2] = 14;
        let f = audit(&bad, &row, &greedy, Some(mask(SCHEMA)));
        assert_eq!(
            f.first(),
            Some(&Finding::OutsideGrammar { position: 2 }),
            "{f:?}"
        );
        // One that stops early (claims eos on an unfinished object): the
        // grammar does not accept there, so eos is implausible.
        let short = &honest[..honest.len() - 1];
        let f = audit(short, &row, &greedy, Some(mask(SCHEMA)));
        assert!(matches!(f[..], [Finding::EosImplausible { .. }]), "{f:?}");
        // Sampled at T=1: the honest draws pass, the cheat is caught.
        let hot = Sampling {
            temperature: 1.0,
            seed: 7,
            ..Sampling::default()
        };
        let mut m = mask(SCHEMA);
        let drawn = generate(&mut m, &hot, &mut |_: usize| row.clone());
        assert_eq!(
            audit(&drawn, &row, &hot, Some(mask(SCHEMA))),
            vec![],
            "{}",
            text(&drawn)
        );
        let f = audit(&cheat, &row, &hot, Some(mask(SCHEMA)));
        assert_eq!(
            f.first(),
            Some(&Finding::OutsideGrammar { position: 0 }),
            "{f:?}"
        );
    }
}
