//! Choosing the next token from the logits, and spotting stop strings.
//!
//! Sampling order: the logit bias, the repetition penalty (over prompt and
//! output, as llama.cpp's), the presence and frequency penalties (over the
//! tokens generated in this job, as OpenAI's and vLLM's), together
//! [`apply_penalties`]; then greedy (temperature 0) or top-k, temperature,
//! softmax, top-p, min-p and a draw from a ChaCha generator seeded with the
//! request's seed.
//!
//! Log-probabilities ([`logprobs`]) are those of the model's distribution at
//! the position: the log-softmax of the logits after [`apply_penalties`],
//! before temperature, top-k, top-p and min-p (what OpenAI and vLLM report by
//! default). So they do not depend on the temperature, a greedy step reports
//! real alternatives (not a point mass), and the chosen token of a greedy
//! step is always the most probable one.
//!
//! # Invariants
//! - Same logits, same history, same seed: same token. The generator is the
//!   only source of randomness and is created per generation.
//! - The audit (`super::audit`) re-scores a claim through the same
//!   [`apply_penalties`] and [`candidates`], so it judges the distribution
//!   the sampler drew from.
//! - [`StopBuffer`] never emits text that could still turn out to be the
//!   start of a stop string, and never emits any part of a stop string.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use std::collections::HashMap;

use super::{EngineError, Sampling, MAX_LOGIT_BIAS, MAX_LOGPROBS};

/// The floor of a reported log-probability (OpenAI's): a token the model
/// gives no weight at all still gets a finite, JSON-representable value.
pub const LOGPROB_FLOOR: f32 = -9999.0;

/// Largest presence or frequency penalty, either sign (OpenAI's bound).
pub const MAX_PENALTY: f32 = 2.0;
/// Largest logit bias, either sign (OpenAI's bound).
pub const MAX_BIAS: f32 = 100.0;

/// Checks the parameters a client sent, for a model of `vocab` tokens.
pub fn validate(s: &Sampling, vocab: usize) -> Result<(), EngineError> {
    let bad = |m: String| Err(EngineError::InvalidSampling(m));
    if !(s.temperature.is_finite() && s.temperature >= 0.0) {
        return bad(format!(
            "temperature {} must be a number >= 0",
            s.temperature
        ));
    }
    if !(s.top_p.is_finite() && s.top_p >= 0.0) {
        return bad(format!("top_p {} must be a number >= 0", s.top_p));
    }
    if !(s.min_p.is_finite() && (0.0..=1.0).contains(&s.min_p)) {
        return bad(format!("min_p {} must be between 0 and 1", s.min_p));
    }
    if !(s.repetition_penalty.is_finite() && s.repetition_penalty >= 0.0) {
        return bad(format!(
            "repetition_penalty {} must be a number >= 0",
            s.repetition_penalty
        ));
    }
    if s.stop.iter().any(String::is_empty) {
        return bad("stop strings must not be empty".to_string());
    }
    if let Some(k) = s.logprobs.filter(|&k| k > MAX_LOGPROBS) {
        return bad(format!("logprobs {k} must be at most {MAX_LOGPROBS}"));
    }
    for (name, v) in [
        ("presence_penalty", s.presence_penalty),
        ("frequency_penalty", s.frequency_penalty),
    ] {
        if !(v.is_finite() && v.abs() <= MAX_PENALTY) {
            return bad(format!(
                "{name} {v} must be between -{MAX_PENALTY} and {MAX_PENALTY}"
            ));
        }
    }
    if s.logit_bias.len() > MAX_LOGIT_BIAS {
        return bad(format!(
            "logit_bias has {} entries; at most {MAX_LOGIT_BIAS}",
            s.logit_bias.len()
        ));
    }
    let mut seen = std::collections::HashSet::with_capacity(s.logit_bias.len());
    for &(id, b) in &s.logit_bias {
        if !(b.is_finite() && b.abs() <= MAX_BIAS) {
            return bad(format!(
                "logit_bias {b} for token {id} must be between -{MAX_BIAS} and {MAX_BIAS}"
            ));
        }
        if id as usize >= vocab {
            return bad(format!(
                "logit_bias names token {id}, outside the vocabulary of {vocab}"
            ));
        }
        if !seen.insert(id) {
            return bad(format!("logit_bias names token {id} twice"));
        }
    }
    Ok(())
}

/// Picks tokens for one generation.
pub struct Sampler {
    params: Sampling,
    rng: ChaCha8Rng,
    /// Scratch: (id, value) candidates.
    cands: Vec<(u32, f32)>,
}

impl Sampler {
    pub fn new(params: &Sampling) -> Self {
        Sampler {
            params: params.clone(),
            rng: ChaCha8Rng::seed_from_u64(params.seed),
            cands: Vec::new(),
        }
    }

    /// Advances the random stream as `n` sampled tokens would have (a
    /// greedy sampler draws nothing), so a resumed generation continues
    /// the uninterrupted run's draws.
    pub fn skip(&mut self, n: usize) {
        if self.params.temperature > 0.0 {
            for _ in 0..n {
                let _: f64 = self.rng.gen();
            }
        }
    }

    /// The next token. `history` is every token so far (prompt and output),
    /// of which `history[output_from..]` were generated in this job
    /// ([`apply_penalties`]). `logits` is modified: on return it holds the
    /// logits after the bias and penalties.
    pub fn sample(&mut self, logits: &mut [f32], history: &[u32], output_from: usize) -> u32 {
        let p = &self.params;
        apply_penalties(logits, history, output_from, p);
        if p.temperature <= 0.0 {
            return argmax(logits);
        }
        candidates(logits, p, &mut self.cands);
        let cands = &self.cands;
        let total: f64 = cands.iter().map(|c| f64::from(c.1)).sum();
        let mut r = self.rng.gen::<f64>() * total;
        for c in cands.iter() {
            r -= f64::from(c.1);
            if r < 0.0 {
                return c.0;
            }
        }
        cands.last().map_or(0, |c| c.0)
    }
}

/// What changes the model's logits before a token is chosen, in order:
/// `logit_bias` added; the repetition penalty over `history` (prompt and
/// output); the presence and frequency penalties over
/// `history[output_from..]` (the tokens generated in this job, resumed ones
/// included): `l -= frequency_penalty * count + presence_penalty` for each
/// token generated `count > 0` times. A bias for an id past the logits is
/// skipped (validation refuses it first).
pub fn apply_penalties(logits: &mut [f32], history: &[u32], output_from: usize, p: &Sampling) {
    for &(id, bias) in &p.logit_bias {
        if let Some(l) = logits.get_mut(id as usize) {
            *l += bias;
        }
    }
    apply_repetition_penalty(logits, history, p.repetition_penalty);
    if p.presence_penalty == 0.0 && p.frequency_penalty == 0.0 {
        return;
    }
    let generated = history.get(output_from..).unwrap_or_default();
    let mut counts: HashMap<u32, u32> = HashMap::with_capacity(generated.len());
    for &t in generated {
        *counts.entry(t).or_default() += 1;
    }
    for (t, n) in counts {
        if let Some(l) = logits.get_mut(t as usize) {
            *l -= p.frequency_penalty * n as f32 + p.presence_penalty;
        }
    }
}

/// Divides positive (multiplies negative) logits of every token in
/// `history` by `penalty`, once per distinct token; 0 or 1 is off.
fn apply_repetition_penalty(logits: &mut [f32], history: &[u32], penalty: f32) {
    if penalty <= 0.0 || penalty == 1.0 {
        return;
    }
    let mut seen = std::collections::HashSet::with_capacity(history.len());
    for &t in history {
        if seen.insert(t) {
            if let Some(l) = logits.get_mut(t as usize) {
                *l = if *l > 0.0 { *l / penalty } else { *l * penalty };
            }
        }
    }
}

/// The tokens a sampled (temperature > 0) draw chooses from, most probable
/// first, with their probabilities: top-k, temperature, softmax, top-p,
/// min-p. The probabilities are those of the tempered softmax over the top-k
/// survivors; top-p and min-p only cut the tail (the draw renormalises).
pub fn candidates(logits: &[f32], p: &Sampling, cands: &mut Vec<(u32, f32)>) {
    cands.clear();
    cands.extend(logits.iter().enumerate().map(|(i, &l)| (i as u32, l)));
    let by_logit_desc = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
    if p.top_k > 0 && p.top_k < cands.len() {
        cands.select_nth_unstable_by(p.top_k - 1, by_logit_desc);
        cands.truncate(p.top_k);
    }
    cands.sort_unstable_by(by_logit_desc);
    // Softmax with temperature.
    let max = cands.first().map_or(0.0, |c| c.1);
    let mut sum = 0.0f64;
    for c in cands.iter_mut() {
        c.1 = ((c.1 - max) / p.temperature).exp();
        sum += f64::from(c.1);
    }
    for c in cands.iter_mut() {
        c.1 = (f64::from(c.1) / sum) as f32;
    }
    if p.top_p > 0.0 && p.top_p < 1.0 {
        let mut acc = 0.0f32;
        let mut keep = cands.len();
        for (i, c) in cands.iter().enumerate() {
            acc += c.1;
            if acc >= p.top_p {
                keep = i + 1;
                break;
            }
        }
        cands.truncate(keep.max(1));
    }
    if p.min_p > 0.0 {
        let threshold = cands.first().map_or(0.0, |c| c.1) * p.min_p;
        let keep = cands.iter().take_while(|c| c.1 >= threshold).count();
        cands.truncate(keep.max(1));
    }
}

/// The log-probability of `chosen` and the `k` most probable tokens (most
/// probable first, lower id first on ties) under `softmax(logits)`, each
/// `logit - logsumexp(logits)` computed in f64 and floored at
/// [`LOGPROB_FLOOR`]; a non-finite logit counts as probability 0.
/// `logits` are the ones the sampler chose from (after the repetition
/// penalty, before temperature), so at temperature 0 `chosen` is the first
/// of the top ones.
pub fn logprobs(logits: &[f32], chosen: u32, k: usize) -> (f32, Vec<(u32, f32)>) {
    let finite = || logits.iter().copied().filter(|l| l.is_finite());
    let max = finite().fold(f32::NEG_INFINITY, f32::max);
    let lse = if max.is_finite() {
        let sum: f64 = finite()
            .map(|l| (f64::from(l) - f64::from(max)).exp())
            .sum();
        f64::from(max) + sum.ln()
    } else {
        0.0
    };
    let of = |l: f32| -> f32 {
        if !l.is_finite() || !max.is_finite() {
            return LOGPROB_FLOOR;
        }
        ((f64::from(l) - lse).min(0.0) as f32).max(LOGPROB_FLOOR)
    };
    let chosen_lp = logits
        .get(chosen as usize)
        .map_or(LOGPROB_FLOOR, |&l| of(l));
    let key = |i: usize| {
        let l = logits[i];
        if l.is_finite() {
            l
        } else {
            f32::NEG_INFINITY
        }
    };
    let mut idx: Vec<usize> = (0..logits.len()).collect();
    let by_desc = |a: &usize, b: &usize| key(*b).total_cmp(&key(*a)).then(a.cmp(b));
    let k = k.min(idx.len());
    if k > 0 && k < idx.len() {
        idx.select_nth_unstable_by(k - 1, by_desc);
    }
    idx.truncate(k);
    idx.sort_unstable_by(by_desc);
    let top = idx.into_iter().map(|i| (i as u32, of(logits[i]))).collect();
    (chosen_lp, top)
}

/// Index of the largest value (the first one on ties).
pub fn argmax(v: &[f32]) -> u32 {
    let mut best = 0usize;
    let mut best_v = f32::NEG_INFINITY;
    for (i, &x) in v.iter().enumerate() {
        if x > best_v {
            best = i;
            best_v = x;
        }
    }
    best as u32
}

/// Holds back output text while it might be the start of a stop string.
#[derive(Debug, Default)]
pub struct StopBuffer {
    stops: Vec<String>,
    held: String,
}

/// What [`StopBuffer::push`] found.
#[derive(Debug, PartialEq, Eq)]
pub enum StopCheck {
    /// Safe to emit; no stop string yet.
    Emit(String),
    /// A stop string appeared: emit this (the text before it) and finish.
    Stopped(String),
}

impl StopBuffer {
    pub fn new(stops: &[String]) -> Self {
        StopBuffer {
            stops: stops.to_vec(),
            held: String::new(),
        }
    }

    pub fn push(&mut self, text: &str) -> StopCheck {
        if self.stops.is_empty() {
            return StopCheck::Emit(text.to_string());
        }
        self.held.push_str(text);
        // The earliest stop string wins.
        let first = self
            .stops
            .iter()
            .filter_map(|s| self.held.find(s.as_str()))
            .min();
        if let Some(at) = first {
            let before = self.held[..at].to_string();
            self.held.clear();
            return StopCheck::Stopped(before);
        }
        // Keep the longest suffix that is a proper prefix of some stop string.
        let mut keep_from = self.held.len();
        for (i, _) in self.held.char_indices() {
            let suffix = &self.held[i..];
            if self.stops.iter().any(|s| s.starts_with(suffix)) {
                keep_from = i;
                break;
            }
        }
        let emit = self.held[..keep_from].to_string();
        self.held.drain(..keep_from);
        StopCheck::Emit(emit)
    }

    /// Text held back when generation ends for another reason.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Within f32 rounding of a value computed by hand.
    fn near(a: f32, b: f64) -> bool {
        (f64::from(a) - b).abs() < 1e-5
    }

    #[test]
    fn logprobs_are_the_log_softmax_computed_by_hand() {
        // softmax of [1, 2, 3, 0]: sum of exps = e + e^2 + e^3 + 1
        // = 2.718282 + 7.389056 + 20.085537 + 1 = 31.192875, ln = 3.440190.
        let logits = [1.0, 2.0, 3.0, 0.0];
        let (chosen, top) = logprobs(&logits, 0, 2);
        assert!(near(chosen, 1.0 - 3.440_190), "{chosen}");
        assert_eq!(top.len(), 2);
        assert_eq!((top[0].0, top[1].0), (2, 1));
        assert!(near(top[0].1, 3.0 - 3.440_190), "{top:?}");
        assert!(near(top[1].1, 2.0 - 3.440_190), "{top:?}");
        // All of them: the probabilities add up to 1, most probable first.
        let (_, all) = logprobs(&logits, 3, 4);
        assert_eq!(
            all.iter().map(|t| t.0).collect::<Vec<_>>(),
            vec![2, 1, 0, 3]
        );
        let total: f64 = all.iter().map(|t| f64::from(t.1).exp()).sum();
        assert!((total - 1.0).abs() < 1e-6, "{total}");
        assert!(all.iter().all(|t| t.1 <= 0.0));
        // k 0: the chosen token only; k past the vocabulary: all of it.
        assert!(logprobs(&logits, 1, 0).1.is_empty());
        assert_eq!(logprobs(&logits, 1, 20).1.len(), 4);
    }

    #[test]
    fn ties_go_to_the_lower_id_and_nothing_is_below_the_floor() {
        // Two equal logits: ln(1/2) each, id 0 first (as argmax picks it).
        let (c, top) = logprobs(&[0.5, 0.5], 1, 2);
        assert!(near(c, -std::f64::consts::LN_2), "{c}");
        assert_eq!((top[0].0, top[1].0), (0, 1));
        assert_eq!(argmax(&[0.5, 0.5]), top[0].0);
        // A token the model rules out (-inf) or a gap past f32's exp range.
        let (c, top) = logprobs(&[f32::NEG_INFINITY, 0.0, -20_000.0], 0, 3);
        assert_eq!(c, LOGPROB_FLOOR);
        assert_eq!(top[0], (1, 0.0));
        assert_eq!(top[1], (2, LOGPROB_FLOOR));
        assert_eq!(top[2], (0, LOGPROB_FLOOR));
    }

    #[test]
    fn logprobs_follow_the_repetition_penalty_and_a_greedy_pick_is_the_top_one() {
        // Token 1 leads, but it was seen: penalty 4 takes its logit 2 to 0.5,
        // below token 0's 1.0, so a greedy step picks 0 and reports the
        // penalised distribution: softmax of [1, 0.5, 0].
        let sampling = Sampling {
            repetition_penalty: 4.0,
            logprobs: Some(3),
            ..Sampling::default()
        };
        let mut s = Sampler::new(&sampling);
        let mut logits = vec![1.0, 2.0, 0.0];
        let token = s.sample(&mut logits, &[1], 1);
        assert_eq!(token, 0);
        let (chosen, top) = logprobs(&logits, token, 3);
        // e^1 + e^0.5 + e^0 = 2.718282 + 1.648721 + 1 = 5.367003, ln = 1.680270.
        assert!(near(chosen, 1.0 - 1.680_270), "{chosen}");
        assert_eq!(top[0].0, token);
        assert!(near(top[1].1, 0.5 - 1.680_270), "{top:?}");
    }

    #[test]
    fn bias_and_penalties_follow_openai_arithmetic() {
        // Prompt [3, 0], then generated [2, 2, 1] (output_from 2).
        let history = [3, 0, 2, 2, 1];
        let p = Sampling {
            presence_penalty: 0.5,
            frequency_penalty: 1.0,
            logit_bias: vec![(3, 10.0), (0, -1.0)],
            ..Sampling::default()
        };
        let mut l = vec![1.0, 2.0, 3.0, 0.5];
        apply_penalties(&mut l, &history, 2, &p);
        // Bias: 0 -> 0.0, 3 -> 10.5. Token 2 generated twice: 3 - (2 * 1.0
        // + 0.5) = 0.5; token 1 once: 2 - (1.0 + 0.5) = 0.5. Tokens 3 and 0
        // are only in the prompt: no presence or frequency penalty.
        assert_eq!(l, vec![0.0, 0.5, 0.5, 10.5]);
        // With the repetition penalty 2 (over prompt and output), after the
        // bias, before the OpenAI penalties: 3: (0.5 + 1.5) / 2 = 1.0;
        // 0: 1 / 2 = 0.5; 2: 3 / 2 - 2.5 = -1.0; 1: 2 / 2 - 1.5 = -0.5.
        let p2 = Sampling {
            repetition_penalty: 2.0,
            logit_bias: vec![(3, 1.5)],
            ..p.clone()
        };
        let mut l = vec![1.0, 2.0, 3.0, 0.5];
        apply_penalties(&mut l, &history, 2, &p2);
        assert_eq!(l, vec![0.5, -0.5, -1.0, 1.0]);
        // Negative penalties encourage what was generated: 2 -> 3 + 2 * 2 + 2.
        let eager = Sampling {
            presence_penalty: -2.0,
            frequency_penalty: -2.0,
            ..Sampling::default()
        };
        let mut l = vec![1.0, 2.0, 3.0, 0.5];
        apply_penalties(&mut l, &history, 2, &eager);
        assert_eq!(l, vec![1.0, 6.0, 9.0, 0.5]);
        // The sampler chooses from the same logits, greedy and sampled.
        let mut s = Sampler::new(&p);
        let mut l = vec![1.0, 2.0, 3.0, 0.5];
        assert_eq!(s.sample(&mut l, &history, 2), 3);
        assert_eq!(l, vec![0.0, 0.5, 0.5, 10.5]);
        let banned = Sampling {
            logit_bias: vec![(2, -100.0)],
            ..Sampling::default()
        };
        assert_eq!(
            Sampler::new(&banned).sample(&mut [1.0, 2.0, 3.0, 0.5], &[], 0),
            1
        );
        let hot = Sampling {
            temperature: 1.0,
            seed: 9,
            ..banned
        };
        let mut s = Sampler::new(&hot);
        for _ in 0..200 {
            assert_ne!(s.sample(&mut [1.0, 2.0, 3.0, 0.5], &[], 0), 2);
        }
        // Nothing generated yet: only the bias applies.
        let mut l = vec![1.0, 2.0, 3.0, 0.5];
        apply_penalties(&mut l, &history, history.len(), &p);
        assert_eq!(l, vec![0.0, 2.0, 3.0, 10.5]);
    }

    #[test]
    fn penalties_and_biases_out_of_range_are_refused() {
        let ok = |s: &Sampling| validate(s, 1000).is_ok();
        let pen = |presence_penalty, frequency_penalty| Sampling {
            presence_penalty,
            frequency_penalty,
            ..Sampling::default()
        };
        assert!(ok(&pen(2.0, -2.0)) && ok(&pen(-2.0, 2.0)));
        for (p, f) in [
            (2.01, 0.0),
            (0.0, -2.5),
            (f32::NAN, 0.0),
            (0.0, f32::INFINITY),
        ] {
            assert!(!ok(&pen(p, f)), "{p} {f}");
        }
        let bias = |logit_bias: Vec<(u32, f32)>| Sampling {
            logit_bias,
            ..Sampling::default()
        };
        assert!(ok(&bias(vec![(0, -100.0), (999, 100.0)])));
        assert!(ok(&bias((0..300).map(|i| (i, 1.0)).collect())));
        assert!(!ok(&bias((0..301).map(|i| (i, 1.0)).collect())));
        assert!(!ok(&bias(vec![(1000, 1.0)])), "past the vocabulary");
        assert!(!ok(&bias(vec![(5, 1.0), (5, 2.0)])), "an id twice");
        for b in [100.5, -101.0, f32::NAN, f32::NEG_INFINITY] {
            assert!(!ok(&bias(vec![(1, b)])), "{b}");
        }
    }

    #[test]
    fn more_than_twenty_alternatives_are_refused() {
        let k = |k| Sampling {
            logprobs: Some(k),
            ..Sampling::default()
        };
        assert!(validate(&k(20), 10).is_ok());
        assert!(validate(&k(0), 10).is_ok());
        assert!(matches!(
            validate(&k(21), 10),
            Err(EngineError::InvalidSampling(_))
        ));
    }
}
