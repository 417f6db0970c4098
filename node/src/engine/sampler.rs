//! Choosing the next token from the logits, and spotting stop strings.
//!
//! Sampling order (as in llama.cpp's default chain): repetition penalty, then
//! greedy (temperature 0) or top-k, temperature, softmax, top-p, min-p and a
//! draw from a ChaCha generator seeded with the request's seed.
//!
//! # Invariants
//! - Same logits, same history, same seed: same token. The generator is the
//!   only source of randomness and is created per generation.
//! - [`StopBuffer`] never emits text that could still turn out to be the
//!   start of a stop string, and never emits any part of a stop string.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::{EngineError, Sampling};

/// Checks the parameters a client sent.
pub fn validate(s: &Sampling) -> Result<(), EngineError> {
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
    /// used by the repetition penalty. `logits` is modified.
    pub fn sample(&mut self, logits: &mut [f32], history: &[u32]) -> u32 {
        let p = &self.params;
        apply_repetition_penalty(logits, history, p.repetition_penalty);
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

/// Divides positive (multiplies negative) logits of every token in
/// `history` by `penalty`, once per distinct token; 0 or 1 is off.
pub fn apply_repetition_penalty(logits: &mut [f32], history: &[u32], penalty: f32) {
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
