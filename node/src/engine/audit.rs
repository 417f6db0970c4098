//! Audits: judging a claimed generation by one teacher-forced forward pass.
//!
//! The auditor feeds prompt + claimed output through the same model file in
//! one batch ([`super::Engine::audit`]), reads the logits at every position,
//! and asks whether the claimed tokens are ones the model would have produced
//! under the job's sampling parameters. This module is the pure part: what one
//! position's logits say about the claimed token ([`score_position`]) and the
//! decision rule over a whole claim ([`judge`]).
//!
//! # The rule
//! Every position is scored on the logits after the job's logit bias and
//! repetition, presence and frequency penalties, through the sampler's own
//! `apply_penalties` (the presence and frequency penalties count the claimed
//! tokens before the position): an honest node that applied them is judged
//! on the distribution it drew from, and one that ignored them is judged on
//! the one it should have drawn from.
//! - **Greedy** (temperature 0): every claimed token must be the argmax, or
//!   within [`GREEDY_MARGIN`] logits of it (honest near ties: batch vs
//!   token-by-token passes, thread counts, kernels and backends round
//!   differently).
//! - **Sampled** (temperature T, top-k, top-p, min-p): a token outside what
//!   the sampler could draw from (by more than [`GREEDY_MARGIN`] logits past
//!   the cut) is impossible. Every other token gets its p-value under the
//!   sampler's distribution q: `u = q(tokens at most as probable as it)`. For
//!   an honest draw `P(u <= a) <= a` at every position (discrete tokens only
//!   make it more conservative), so Fisher's `X = -2 sum ln u` is at most
//!   chi-square with `2n` degrees of freedom; the claim fails when `X` passes
//!   the `1 - TOKENS_ALPHA` quantile.
//! - **Resumed claims** (a job handed off mid-way): the claim covers only
//!   the tokens after the earlier attempts'. The pass feeds input + those
//!   earlier tokens + the claimed ones and scores the claimed ones only;
//!   the penalties count the earlier tokens as generated, `length` counts
//!   them toward `max_tokens`, and prompt tokens include them, as the
//!   generating node counted.
//! - **Finish reason**, to catch a truncated answer claimed as complete:
//!   `length` needs `completion_tokens == max_tokens` (or the context full);
//!   `eos` needs an end-of-generation token to be plausible right after the
//!   last claimed token (greedy: within the margin of the argmax; sampled:
//!   in the support with p-value at least [`EOS_ALPHA`]); `stop` needs one of
//!   the job's stop strings in the decoded output, the claimed text ending
//!   right before it; `handoff` (a drained node's partial claim) claims no
//!   end, and its text may lack a held-back tail of the tokens' text.
//! - **Grammar** (structured output, `Sampling::grammar`): the auditor
//!   replays the job's grammar over the claimed tokens. A token the grammar
//!   forbids at its position is [`Finding::OutsideGrammar`] (whatever its
//!   logits: the node ignored the constraint); every position is scored on
//!   the masked logits (forbidden tokens at `-inf`), the distribution an
//!   honest node drew from, and so is the end (an `eos` claim needs the
//!   grammar to accept there). Past a violation the rest is scored unmasked.
//! - The claim's own counts and text must match: prompt tokens as the auditor
//!   tokenizes the input, completion tokens as listed, text as decoded. (The
//!   price is computed from these counts.)
//!
//! # Calibration
//! Measured with `cargo bench -p mlx-node --bench audit --profile dev
//! --locked` (SmolLM2-135M-Instruct Q4_1, chat jobs of at most 16 tokens,
//! auditor at 2 threads, one batched pass; machine load 6-13 from other
//! builds, which changes times, not verdicts):
//! - honest greedy generated at 1 thread and at 2 threads, and honest
//!   sampled at T=0.7 (top-p 0.9, top-k 40): 0 of 200 accused in each row.
//!   In a 10-job run of every row the largest gap between an honest greedy
//!   token and the auditor's argmax was 0.000 logits (the engine's decode and
//!   the audit's batched pass pick the same argmax), and the largest honest
//!   sampled Fisher statistic was 0.33 of its limit.
//! - The margin is set above every honest difference measured in this
//!   project: batch vs token-by-token logits differ by < 0.05 (the engine's
//!   test), and llama.cpp's own variants (flash attention, f32 KV cache) flip
//!   tokens at top-2 margins up to 0.33 (`engine/tests.rs`, `NEAR_TIE`), so
//!   another backend or kernel is not accused: 0.35.
//! - For sampled tokens the limit comes from theory, not a fit:
//!   `TOKENS_ALPHA` = 1e-4 bounds honest false accusations at 0.01% per job.
//! - Cheats, 200 jobs each: random tokens, a random-weight model's output
//!   and truncated answers claimed as `eos` were caught in 200 of 200 (gaps
//!   of 10-20 logits; eos 10+ logits below the argmax); greedy claims
//!   sampled at T=1.0 in 10 of 10 of the 10-job run.
//!
//! # Failure
//! Pure functions; nothing fails. A claim the engine cannot even score (a
//! token id outside the vocabulary) is judged by [`judge_unscorable`].

use mlxnet_proto::claim;

use super::grammar::Mask;
use super::sampler::{apply_penalties, candidates};
use super::Sampling;

/// Largest logit gap to the argmax that still counts as the model's own
/// choice (greedy), and how far past the sampler's cut a token may sit and
/// still count as inside it (sampled). See the module's calibration notes.
pub const GREEDY_MARGIN: f32 = 0.35;
/// Fisher test level over the sampled tokens: an honest claim fails with
/// probability at most this.
pub const TOKENS_ALPHA: f64 = 1e-4;
/// Level of the end-of-generation test for a sampled `eos` claim.
pub const EOS_ALPHA: f64 = 1e-3;
/// Smallest p-value a position contributes (keeps the statistic finite).
const MIN_U: f64 = 1e-300;

/// What one position's logits say about the token claimed there.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PositionScore {
    /// Best logit minus the claimed token's (after the repetition penalty).
    pub gap: f32,
    /// The token's p-value under the sampler's distribution (1 when greedy).
    pub u: f64,
    /// The sampler could not have drawn it (beyond the margin of its cut).
    pub outside: bool,
}

/// Scores of a whole claim: one per claimed token, and the end-of-generation
/// tokens at the position after the last one.
#[derive(Debug, Clone, PartialEq)]
pub struct Scores {
    /// Prompt tokens as the auditor tokenized the input.
    pub prompt_tokens: usize,
    pub tokens: Vec<PositionScore>,
    /// The most plausible end-of-generation token after the last claimed token.
    pub end: PositionScore,
    /// The claimed tokens, decoded.
    pub decoded_text: String,
    /// The model's context length.
    pub context_length: usize,
    /// The first claimed position whose token the job's grammar forbids.
    pub outside_grammar: Option<usize>,
}

/// What the node claimed besides its tokens.
#[derive(Debug, Clone, PartialEq)]
pub struct ClaimFacts {
    /// "eos", "length" or "stop".
    pub finish_reason: String,
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    pub output_token_ids_len: usize,
    pub output_text: String,
}

/// One reason a claim fails.
#[derive(Debug, Clone, PartialEq)]
pub enum Finding {
    /// A claimed token id the model does not have.
    TokenOutOfVocabulary { position: usize, token: u32 },
    /// The claim counts prompt tokens differently than the input tokenizes.
    PromptTokens { claimed: u32, actual: usize },
    /// `completion_tokens` differs from the number of claimed tokens.
    CompletionTokens { claimed: u32, listed: usize },
    /// A greedy claim's token is not the model's choice.
    NotGreedy { position: usize, gap: f32 },
    /// A sampled claim's token is outside what the sampler draws from.
    OutsideSampler { position: usize },
    /// A claimed token the job's grammar forbids at its position.
    OutsideGrammar { position: usize },
    /// A sampled claim's tokens are jointly too unlikely.
    Unlikely { statistic: f64, limit: f64 },
    /// `length` claimed with fewer tokens than `max_tokens`.
    LengthShort {
        completion: usize,
        max_tokens: usize,
    },
    /// `eos` claimed where the model would not end.
    EosImplausible { gap: f32, u: f64 },
    /// `stop` claimed but no stop string was produced.
    StopMissing,
    /// A finish reason the engine never reports.
    UnknownFinish(String),
    /// The claimed text is not the claimed tokens' text.
    TextMismatch,
}

impl std::fmt::Display for Finding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Finding::TokenOutOfVocabulary { position, token } => {
                write!(f, "token {token} at {position} is not in the vocabulary")
            }
            Finding::PromptTokens { claimed, actual } => {
                write!(f, "claims {claimed} prompt tokens, the input has {actual}")
            }
            Finding::CompletionTokens { claimed, listed } => {
                write!(f, "claims {claimed} completion tokens, lists {listed}")
            }
            Finding::NotGreedy { position, gap } => {
                write!(f, "greedy token at {position} is {gap:.2} logits below the argmax")
            }
            Finding::OutsideSampler { position } => {
                write!(f, "token at {position} is outside the sampler's support")
            }
            Finding::OutsideGrammar { position } => {
                write!(f, "token at {position} is outside the job's grammar")
            }
            Finding::Unlikely { statistic, limit } => {
                write!(f, "tokens too unlikely: fisher {statistic:.1} > {limit:.1}")
            }
            Finding::LengthShort {
                completion,
                max_tokens,
            } => write!(f, "claims length with {completion} of {max_tokens} tokens"),
            Finding::EosImplausible { gap, u } => write!(
                f,
                "claims eos where the model would go on (eos {gap:.2} logits below the argmax, p-value {u:.1e})"
            ),
            Finding::StopMissing => f.write_str("claims stop but no stop string was produced"),
            Finding::UnknownFinish(r) => write!(f, "unknown finish reason {r:?}"),
            Finding::TextMismatch => f.write_str("claimed text differs from the tokens' text"),
        }
    }
}

/// The outcome of an audit.
#[derive(Debug, Clone, PartialEq)]
pub struct Verdict {
    pub findings: Vec<Finding>,
    /// Largest gap between a claimed token and the argmax.
    pub worst_gap: f32,
    /// Fisher's statistic over the sampled tokens, and its limit (0 when greedy).
    pub statistic: f64,
    pub limit: f64,
}

impl Verdict {
    pub fn passed(&self) -> bool {
        self.findings.is_empty()
    }
}

/// Scores the claimed `token` against one position's `logits` (modified:
/// the logit bias and the penalties are applied, as the sampler does).
/// `history` is every token before it (prompt and output), of which
/// `history[output_from..]` were claimed as generated.
pub fn score_position(
    logits: &mut [f32],
    token: u32,
    params: &Sampling,
    (history, output_from): (&[u32], usize),
    scratch: &mut Vec<(u32, f32)>,
) -> PositionScore {
    apply_penalties(logits, history, output_from, params);
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let own = logits
        .get(token as usize)
        .copied()
        .unwrap_or(f32::NEG_INFINITY);
    let gap = max - own;
    if params.temperature <= 0.0 {
        return PositionScore {
            gap,
            u: 1.0,
            outside: false,
        };
    }
    candidates(logits, params, scratch);
    let kept: f64 = scratch.iter().map(|c| f64::from(c.1)).sum();
    let (u, outside) = match scratch.iter().position(|c| c.0 == token) {
        Some(i) => (
            scratch[i..].iter().map(|c| f64::from(c.1)).sum::<f64>() / kept,
            false,
        ),
        None => {
            // Just past the cut (within the margin): numeric noise may have
            // moved it; count it as the least probable kept token.
            let last = scratch.last().copied().unwrap_or((0, 0.0));
            let cut = logits
                .get(last.0 as usize)
                .copied()
                .unwrap_or(f32::INFINITY);
            if own + GREEDY_MARGIN >= cut {
                (f64::from(last.1) / kept, false)
            } else {
                (0.0, true)
            }
        }
    };
    PositionScore { gap, u, outside }
}

/// The best-scoring of the end-of-generation tokens `eog` at one position.
pub fn score_end(
    logits: &mut [f32],
    eog: &[u32],
    params: &Sampling,
    history: (&[u32], usize),
    scratch: &mut Vec<(u32, f32)>,
) -> PositionScore {
    let original = logits.to_vec();
    let mut best: Option<PositionScore> = None;
    for &t in eog {
        logits.copy_from_slice(&original);
        let s = score_position(logits, t, params, history, scratch);
        let better = match &best {
            None => true,
            Some(b) => (s.outside, -s.u, s.gap) < (b.outside, -b.u, b.gap),
        };
        if better {
            best = Some(s);
        }
    }
    best.unwrap_or(PositionScore {
        gap: f32::INFINITY,
        u: 0.0,
        outside: true,
    })
}

/// The verdict on a claim whose tokens were scored.
pub fn judge(scores: &Scores, claim: &ClaimFacts, params: &Sampling) -> Verdict {
    let mut findings = Vec::new();
    if let Some(position) = scores.outside_grammar {
        findings.push(Finding::OutsideGrammar { position });
    }
    if claim.prompt_tokens as usize != scores.prompt_tokens {
        findings.push(Finding::PromptTokens {
            claimed: claim.prompt_tokens,
            actual: scores.prompt_tokens,
        });
    }
    let n = scores.tokens.len();
    if claim.completion_tokens as usize != n {
        findings.push(Finding::CompletionTokens {
            claimed: claim.completion_tokens,
            listed: n,
        });
    }
    let worst_gap = scores.tokens.iter().map(|s| s.gap).fold(0f32, f32::max);
    let greedy = params.temperature <= 0.0;
    let (mut statistic, mut limit) = (0.0, 0.0);
    if greedy {
        if let Some((position, s)) = scores
            .tokens
            .iter()
            .enumerate()
            .find(|(_, s)| s.gap > GREEDY_MARGIN)
        {
            findings.push(Finding::NotGreedy {
                position,
                gap: s.gap,
            });
        }
    } else {
        if let Some(position) = scores.tokens.iter().position(|s| s.outside) {
            findings.push(Finding::OutsideSampler { position });
        }
        statistic = -2.0
            * scores
                .tokens
                .iter()
                .map(|s| s.u.max(MIN_U).ln())
                .sum::<f64>();
        limit = chi_square_quantile(2 * n, TOKENS_ALPHA);
        if n > 0 && statistic > limit {
            findings.push(Finding::Unlikely { statistic, limit });
        }
    }
    let mut expected_text = scores.decoded_text.clone();
    match claim.finish_reason.as_str() {
        "length" => {
            let full = scores.prompt_tokens + n >= scores.context_length;
            if n != params.max_tokens && !full {
                findings.push(Finding::LengthShort {
                    completion: n,
                    max_tokens: params.max_tokens,
                });
            }
        }
        "eos" => {
            let e = scores.end;
            let plausible = if greedy {
                e.gap <= GREEDY_MARGIN
            } else {
                !e.outside && e.u >= EOS_ALPHA
            };
            if !plausible {
                findings.push(Finding::EosImplausible { gap: e.gap, u: e.u });
            }
        }
        "stop" => {
            match params
                .stop
                .iter()
                .filter_map(|s| scores.decoded_text.find(s.as_str()))
                .min()
            {
                Some(at) => expected_text.truncate(at),
                None => findings.push(Finding::StopMissing),
            }
        }
        // A drained node's partial claim: it stopped at a token boundary
        // of its choosing, so no end is claimed. Its text is what it
        // streamed: the tokens' text but what it still held back (a stop
        // string's possible start, an unfinished character), which the
        // next attempt streams.
        claim::FINISH_HANDOFF => {}
        other => findings.push(Finding::UnknownFinish(other.to_owned())),
    }
    let text_ok = if claim.finish_reason == claim::FINISH_HANDOFF {
        expected_text.starts_with(claim.output_text.as_str())
    } else {
        claim.output_text == expected_text
    };
    if !text_ok {
        findings.push(Finding::TextMismatch);
    }
    Verdict {
        findings,
        worst_gap,
        statistic,
        limit,
    }
}

/// The verdict on a claim naming a token the model does not have.
pub fn judge_unscorable(position: usize, token: u32) -> Verdict {
    Verdict {
        findings: vec![Finding::TokenOutOfVocabulary { position, token }],
        worst_gap: f32::INFINITY,
        statistic: 0.0,
        limit: 0.0,
    }
}

/// One claim's teacher-forced pass in progress: the tokens to feed (prompt
/// and claimed output), and the scores of the positions seen so far. The
/// pass may come in any number of chunks, alone ([`super::Engine::audit`])
/// or inside a batch with other sequences (`super::batch`).
#[derive(Debug)]
pub struct AuditPass {
    full: Vec<u32>,
    /// Tokens before the claimed output (the input's, then any resumed).
    prompt_len: usize,
    /// Where the job's generated tokens begin in `full` (the resumed tokens
    /// were generated in this job too: the penalties count them).
    output_from: usize,
    sampling: Sampling,
    facts: ClaimFacts,
    eog: Vec<u32>,
    decoded_text: String,
    context_length: usize,
    tokens: Vec<PositionScore>,
    end: Option<PositionScore>,
    scratch: Vec<(u32, f32)>,
    /// The job's grammar, replayed over the claimed tokens (dropped at the
    /// first violation or engine failure).
    grammar: Option<Mask>,
    outside_grammar: Option<usize>,
}

/// What [`AuditPass::new`] needs to know about the claim and the model.
#[derive(Debug)]
pub struct AuditInput<'a> {
    /// The input's tokens, then the resumed ones (the last `resumed`).
    pub prompt: Vec<u32>,
    /// How many of `prompt`'s tokens are the job's earlier output, which a
    /// resumed claim continues (0 for a whole claim).
    pub resumed: usize,
    pub output: &'a [u32],
    pub sampling: &'a Sampling,
    pub facts: &'a ClaimFacts,
    pub eog: Vec<u32>,
    pub decoded_text: String,
    pub context_length: usize,
    /// The job's grammar at the start of the output (None: free text).
    pub grammar: Option<Mask>,
}

impl AuditPass {
    /// The pass over `input.prompt` followed by the claimed output. The
    /// caller has checked that both fit the context and every token is in
    /// the vocabulary.
    pub fn new(input: AuditInput<'_>) -> AuditPass {
        let prompt_len = input.prompt.len();
        let mut full = input.prompt;
        full.extend_from_slice(input.output);
        AuditPass {
            tokens: Vec::with_capacity(input.output.len()),
            full,
            prompt_len,
            output_from: prompt_len.saturating_sub(input.resumed),
            sampling: input.sampling.clone(),
            facts: input.facts.clone(),
            eog: input.eog,
            decoded_text: input.decoded_text,
            context_length: input.context_length,
            end: None,
            scratch: Vec::new(),
            grammar: input.grammar,
            outside_grammar: None,
        }
    }

    /// Every token the pass feeds.
    pub fn tokens(&self) -> &[u32] {
        &self.full
    }

    /// The first position whose logits are scored (the last prompt token's,
    /// which predict the first claimed token).
    pub fn first_row(&self) -> usize {
        self.prompt_len.saturating_sub(1)
    }

    /// Scores the logits of positions `from..` (`logits`: one row of
    /// `vocab` after another; `from >= first_row()`).
    pub fn score(&mut self, from: usize, logits: &mut [f32], vocab: usize) {
        let output_len = self.full.len() - self.prompt_len;
        for (r, row) in logits.chunks_exact_mut(vocab).enumerate() {
            let Some(i) = (from + r).checked_sub(self.first_row()) else {
                continue;
            };
            let s = &self.sampling;
            if i > output_len {
                continue;
            }
            let token = self.full.get(self.prompt_len + i).copied();
            if let Some(mask) = &mut self.grammar {
                // The node's mask at this position; an engine failure here
                // would have ended an honest generation before it.
                let inside = match (mask.apply(row), token) {
                    (Ok(allowed), Some(t)) => allowed.contains(t) && mask.consume(t).is_ok(),
                    (Ok(_), None) => true,
                    (Err(_), _) => false,
                };
                if !inside {
                    self.outside_grammar = Some(i);
                    self.grammar = None;
                }
            }
            if let Some(token) = token.filter(|_| i < output_len) {
                let history = (&self.full[..self.prompt_len + i], self.output_from);
                self.tokens
                    .push(score_position(row, token, s, history, &mut self.scratch));
            } else if i == output_len {
                let history = (&self.full[..], self.output_from);
                self.end = Some(score_end(row, &self.eog, s, history, &mut self.scratch));
            }
        }
    }

    /// The verdict, once every position from [`AuditPass::first_row`] on was scored.
    pub fn verdict(self) -> Verdict {
        let scores = Scores {
            prompt_tokens: self.prompt_len,
            tokens: self.tokens,
            end: self.end.unwrap_or(PositionScore {
                gap: f32::INFINITY,
                u: 0.0,
                outside: true,
            }),
            decoded_text: self.decoded_text,
            context_length: self.context_length,
            outside_grammar: self.outside_grammar,
        };
        judge(&scores, &self.facts, &self.sampling)
    }
}

/// Upper `alpha` quantile of chi-square with `k` degrees of freedom, `k`
/// even (Fisher's statistic over `n` p-values has `2n`): bisection on the
/// exact tail `P(X > x) = P(Poisson(x/2) < k/2)`, summed in log space.
pub fn chi_square_quantile(k: usize, alpha: f64) -> f64 {
    let n = (k / 2).max(1);
    let tail = |x: f64| {
        let lam = x / 2.0;
        let (mut log_fact, mut max, mut terms) = (0.0f64, f64::NEG_INFINITY, Vec::with_capacity(n));
        for i in 0..n {
            if i > 0 {
                log_fact += (i as f64).ln();
            }
            let t = -lam + i as f64 * lam.ln() - log_fact;
            max = max.max(t);
            terms.push(t);
        }
        max + terms.iter().map(|t| (t - max).exp()).sum::<f64>().ln()
    };
    let target = alpha.ln();
    let (mut lo, mut hi) = (0.0f64, 2.0 * n as f64 + 100.0 * (n as f64).sqrt() + 100.0);
    for _ in 0..100 {
        let mid = 0.5 * (lo + hi);
        if tail(mid) > target {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    hi
}

#[cfg(test)]
mod tests {
    use super::*;

    fn greedy() -> Sampling {
        Sampling {
            max_tokens: 4,
            ..Sampling::default()
        }
    }

    fn sampled(t: f32) -> Sampling {
        Sampling {
            temperature: t,
            max_tokens: 4,
            ..Sampling::default()
        }
    }

    fn pos(gap: f32, u: f64) -> PositionScore {
        PositionScore {
            gap,
            u,
            outside: false,
        }
    }

    fn scores(tokens: Vec<PositionScore>, end: PositionScore) -> Scores {
        Scores {
            prompt_tokens: 10,
            tokens,
            end,
            decoded_text: "abcd".into(),
            context_length: 100,
            outside_grammar: None,
        }
    }

    fn facts(finish: &str, n: u32) -> ClaimFacts {
        ClaimFacts {
            finish_reason: finish.into(),
            prompt_tokens: 10,
            completion_tokens: n,
            output_token_ids_len: n as usize,
            output_text: "abcd".into(),
        }
    }

    #[test]
    fn quantiles_match_tables() {
        // Tables: chi2(10) upper 1% = 23.209; chi2(2) upper 0.01% = 18.421;
        // chi2(40) upper 0.01% = 82.062.
        assert!((chi_square_quantile(10, 0.01) - 23.209).abs() < 1e-3);
        assert!((chi_square_quantile(2, 1e-4) - 18.421).abs() < 1e-3);
        assert!((chi_square_quantile(40, 1e-4) - 82.062).abs() < 1e-3);
    }

    #[test]
    fn greedy_tokens_within_the_margin_pass_and_beyond_it_fail() {
        let s = greedy();
        let near = scores(
            vec![pos(0.0, 1.0), pos(0.3, 1.0), pos(0.0, 1.0), pos(0.1, 1.0)],
            pos(0.2, 1.0),
        );
        assert!(judge(&near, &facts("eos", 4), &s).passed());
        let far = scores(
            vec![pos(0.0, 1.0), pos(0.5, 1.0), pos(0.0, 1.0), pos(0.0, 1.0)],
            pos(0.0, 1.0),
        );
        assert_eq!(
            judge(&far, &facts("length", 4), &s).findings,
            vec![Finding::NotGreedy {
                position: 1,
                gap: 0.5
            }]
        );
    }

    #[test]
    fn finish_reasons_are_checked_against_the_model_and_the_parameters() {
        let s = greedy();
        let ok = vec![pos(0.0, 1.0); 4];
        // eos where the model would go on: a truncated answer.
        let v = judge(&scores(ok.clone(), pos(3.0, 1.0)), &facts("eos", 4), &s);
        assert!(
            matches!(v.findings[..], [Finding::EosImplausible { .. }]),
            "{v:?}"
        );
        // length with fewer tokens than max_tokens.
        let mut short = s.clone();
        short.max_tokens = 8;
        let v = judge(
            &scores(ok.clone(), pos(3.0, 1.0)),
            &facts("length", 4),
            &short,
        );
        assert!(matches!(
            v.findings[..],
            [Finding::LengthShort {
                completion: 4,
                max_tokens: 8
            }]
        ));
        // stop: the claimed text must end right before a stop string.
        let mut stop = s.clone();
        stop.stop = vec!["cd".into()];
        let mut f = facts("stop", 4);
        f.output_text = "ab".into();
        assert!(judge(&scores(ok.clone(), pos(3.0, 1.0)), &f, &stop).passed());
        stop.stop = vec!["zz".into()];
        let v = judge(&scores(ok.clone(), pos(3.0, 1.0)), &f, &stop);
        assert!(v.findings.contains(&Finding::StopMissing));
        let v = judge(&scores(ok, pos(0.0, 1.0)), &facts("done", 4), &s);
        assert_eq!(v.findings, vec![Finding::UnknownFinish("done".into())]);
    }

    #[test]
    fn counts_and_text_must_match_the_tokens() {
        let s = greedy();
        let sc = scores(vec![pos(0.0, 1.0); 4], pos(0.0, 1.0));
        let mut f = facts("eos", 5);
        f.prompt_tokens = 3;
        f.output_text = "abcX".into();
        let v = judge(&sc, &f, &s);
        assert_eq!(
            v.findings,
            vec![
                Finding::PromptTokens {
                    claimed: 3,
                    actual: 10
                },
                Finding::CompletionTokens {
                    claimed: 5,
                    listed: 4
                },
                Finding::TextMismatch
            ]
        );
    }

    #[test]
    fn sampled_tokens_fail_when_jointly_unlikely_or_outside_the_support() {
        let s = sampled(0.7);
        // Typical honest p-values pass.
        let honest = scores(
            vec![pos(1.0, 0.5), pos(0.0, 0.9), pos(2.0, 0.2), pos(0.5, 0.7)],
            pos(0.0, 0.5),
        );
        let v = judge(&honest, &facts("eos", 4), &s);
        assert!(v.passed(), "{v:?}");
        // Four tokens each at p-value 1e-3: X = 55.3 > chi2(8) upper 1e-4 = 31.8.
        let unlikely = scores(vec![pos(5.0, 1e-3); 4], pos(0.0, 0.5));
        assert!(matches!(
            judge(&unlikely, &facts("eos", 4), &s).findings[..],
            [Finding::Unlikely { .. }]
        ));
        let mut outside = honest.clone();
        outside.tokens[2].outside = true;
        assert!(judge(&outside, &facts("eos", 4), &s)
            .findings
            .contains(&Finding::OutsideSampler { position: 2 }));
        // Sampled eos: plausible unless its p-value is below EOS_ALPHA.
        let mut late = honest;
        late.end = pos(4.0, 1e-4);
        assert!(matches!(
            judge(&late, &facts("eos", 4), &s).findings[..],
            [Finding::EosImplausible { .. }]
        ));
    }

    /// The verdict of a whole pass over `prompt` + `output` where every
    /// position's logits are `row` (vocabulary 3, end-of-generation token
    /// 2), claimed as `length` with `max_tokens` = the output's length.
    fn audit_rows(prompt: &[u32], output: &[u32], sampling: &Sampling, row: [f32; 3]) -> Verdict {
        let s = Sampling {
            max_tokens: output.len(),
            ..sampling.clone()
        };
        let f = ClaimFacts {
            prompt_tokens: prompt.len() as u32,
            ..facts("length", output.len() as u32)
        };
        let mut pass = AuditPass::new(AuditInput {
            prompt: prompt.to_vec(),
            resumed: 0,
            output,
            sampling: &s,
            facts: &f,
            eog: vec![2],
            decoded_text: "abcd".into(),
            context_length: 100,
            grammar: None,
        });
        let first = pass.first_row();
        let rows = pass.tokens().len() - first;
        let mut logits: Vec<f32> = row.iter().copied().cycle().take(3 * rows).collect();
        pass.score(first, &mut logits, 3);
        pass.verdict()
    }

    #[test]
    fn the_audit_applies_the_bias_and_penalties_an_honest_node_applied() {
        // Every position: token 0 leads token 1 by 0.5 logits.
        let row = [2.0, 1.5, 0.0];
        // Frequency 1.0: after one 0 its logit is 1.0, so the honest greedy
        // output is [0, 1]; a node that ignored the penalty says [0, 0] (0.5
        // logits below the argmax: more than the margin). The prompt's 0 is
        // not penalised (OpenAI's penalties count generated tokens only): an
        // audit that counted it would accuse the honest first token.
        let freq = Sampling {
            frequency_penalty: 1.0,
            ..greedy()
        };
        let v = audit_rows(&[0], &[0, 1], &freq, row);
        assert!(v.passed(), "{v:?}");
        let v = audit_rows(&[0], &[0, 0], &freq, row);
        assert_eq!(
            v.findings,
            vec![Finding::NotGreedy {
                position: 1,
                gap: 0.5
            }]
        );
        // Presence 1.0: the same, whatever the count.
        let presence = Sampling {
            presence_penalty: 1.0,
            ..greedy()
        };
        assert!(audit_rows(&[0], &[0, 1], &presence, row).passed());
        assert!(!audit_rows(&[0], &[0, 0], &presence, row).passed());
        // Without the penalty, the penalised output is the one accused.
        assert!(!audit_rows(&[0], &[0, 1], &greedy(), row).passed());
        // A bias of -100 on token 0: honest [1, 1]; ignored [0, 0] is 99.5
        // logits below the argmax.
        let banned = Sampling {
            logit_bias: vec![(0, -100.0)],
            ..greedy()
        };
        assert!(audit_rows(&[0], &[1, 1], &banned, row).passed());
        assert_eq!(
            audit_rows(&[0], &[0, 0], &banned, row).findings,
            vec![Finding::NotGreedy {
                position: 0,
                gap: 99.5
            }]
        );
        // Sampled: a banned token drawn twice is jointly impossible (its
        // probability is about e^-100 at each position).
        let hot = Sampling {
            temperature: 1.0,
            ..banned
        };
        assert!(audit_rows(&[0], &[1, 1], &hot, row).passed());
        let v = audit_rows(&[0], &[0, 0], &hot, row);
        assert!(
            matches!(v.findings[..], [Finding::Unlikely { .. }]),
            "{v:?}"
        );
    }

    #[test]
    fn scoring_a_position_follows_the_sampler() {
        let mut scratch = Vec::new();
        // logits: token 0 best, 1 close, 2 far.
        let logits = [2.0f32, 1.9, -5.0];
        let g = greedy();
        let s = score_position(&mut logits.clone(), 1, &g, (&[], 0), &mut scratch);
        assert!((s.gap - 0.1).abs() < 1e-6 && !s.outside);
        let t = sampled(1.0);
        let best = score_position(&mut logits.clone(), 0, &t, (&[], 0), &mut scratch);
        assert!((best.u - 1.0).abs() < 1e-6, "{best:?}");
        let second = score_position(&mut logits.clone(), 1, &t, (&[], 0), &mut scratch);
        assert!(second.u > 0.4 && second.u < 0.5, "{second:?}");
        // top-k 2 cuts token 2 far beyond the margin: impossible.
        let k2 = Sampling {
            top_k: 2,
            ..t.clone()
        };
        assert!(score_position(&mut logits.clone(), 2, &k2, (&[], 0), &mut scratch).outside);
        // top-k 1 cuts token 1, but only 0.1 logits past the cut: tolerated.
        let k1 = Sampling {
            top_k: 1,
            ..t.clone()
        };
        assert!(!score_position(&mut logits.clone(), 1, &k1, (&[], 0), &mut scratch).outside);
        // The repetition penalty applies as in the sampler: token 0 seen
        // before drops from 2.0 to 1.0, so token 1 becomes the argmax.
        let rp = Sampling {
            repetition_penalty: 2.0,
            ..g
        };
        let s = score_position(&mut logits.clone(), 1, &rp, (&[0], 1), &mut scratch);
        assert_eq!(s.gap, 0.0);
        let end = score_end(&mut logits.clone(), &[2, 1], &t, (&[], 0), &mut scratch);
        assert!((end.gap - 0.1).abs() < 1e-6);
    }
}
