//! One generation as a state machine, apart from the forward pass that
//! feeds it: what to compute next, and what to do with the logits that
//! come back (sample, detokenize, hold back possible stop strings, stream,
//! decide when to stop).
//!
//! Both ways of running a generation drive the same [`Sequence`]:
//! `TextSide::generate` (one sequence, one forward pass after another, also
//! across a pod) and the batcher ([`super::batch`]), which runs many
//! sequences in one pass and may stop a sequence, drop its cache and compute
//! it again later. So sampling, stop strings, resumption, cancellation and
//! the text invariants of the engine (module `engine`) hold however a
//! sequence was scheduled.
//!
//! # Invariants
//! - `history` is the prompt (with resumed tokens) and every token sampled
//!   since; whoever drives it computes positions up to `history.len()` and
//!   passes the logits of the last one to [`Sequence::step`], which samples
//!   from them.
//! - Only [`Sequence::step`] and [`Sequence::cancel`] emit text; each token
//!   is emitted once, in order, whatever was recomputed.
//! - With a grammar (`Sampling::grammar`), every token is chosen from the
//!   logits after the grammar's mask (`super::grammar`), and the mask has
//!   consumed every token in `history` past the prompt (resumed ones too).

use std::ops::ControlFlow;
use std::time::{Duration, Instant};

use super::grammar::Mask;
use super::sampler::{self, Sampler, StopBuffer, StopCheck};
use super::tokenizer::Detokenizer;
use super::{
    EngineError, FinishReason, GenerateRequest, Generation, Logprob, TextSide, TokenChunk,
    TokenLogprobs,
};

/// What a request turned into.
pub(crate) enum Begin {
    /// Nothing to compute (resumed at its end): the finished generation.
    Done(Generation),
    /// A sequence that needs its prompt computed.
    Run(Box<Sequence>),
}

/// One running generation.
pub(crate) struct Sequence {
    sampler: Sampler,
    /// Alternatives per token's log-probabilities (`Sampling::logprobs`).
    logprobs: Option<usize>,
    stop: StopBuffer,
    detok: Detokenizer,
    /// Text of resumed tokens the client does not have yet.
    unsent: String,
    history: Vec<u32>,
    /// Prompt tokens (resumed ones included).
    prompt_len: usize,
    /// Tokens an earlier attempt produced (`Resume::token_ids`).
    resumed: usize,
    /// Most tokens this attempt may add.
    max_new: usize,
    generation: Generation,
    start: Instant,
    decode_start: Option<Instant>,
    done: bool,
    /// Structured output's mask (`Sampling::grammar`), past the resumed tokens.
    grammar: Option<Mask>,
    /// Why it ended early (the grammar engine failed): [`Sequence::finish`]'s error.
    failed: Option<EngineError>,
}

impl TextSide {
    /// Checks `request` and tokenizes it for a model of context length
    /// `ctx`; `start` is when the client's wait began (the generation's
    /// prefill time runs from there to the first token).
    pub(crate) fn begin(
        &self,
        request: &GenerateRequest,
        ctx: usize,
        start: Instant,
    ) -> Result<Begin, EngineError> {
        let s = &request.sampling;
        let vocab = self.tokenizer.vocab_len();
        sampler::validate(s, vocab)?;
        let resume = &request.resume;
        // Resumed ids come from another node through the coordinator: one
        // outside the vocabulary is refused here, not fed to the model.
        if let Some(&id) = resume.token_ids.iter().find(|&&t| t as usize >= vocab) {
            return Err(EngineError::ResumeToken { id, vocab });
        }
        let mut prompt = self.prompt_tokens(&request.input)?;
        prompt.extend_from_slice(&resume.token_ids);
        if prompt.len() >= ctx {
            return Err(EngineError::PromptTooLong {
                tokens: prompt.len(),
                max: ctx.saturating_sub(1),
            });
        }
        let max_new = s
            .max_tokens
            .saturating_sub(resume.token_ids.len())
            .min(ctx - prompt.len());
        let mut generation = Generation {
            prompt_tokens: prompt.len(),
            output_token_ids: Vec::new(),
            text: String::new(),
            finish: FinishReason::Length,
            prefill: Duration::ZERO,
            decode: Duration::ZERO,
        };
        let mut detok = Detokenizer::default();
        // Text of the resumed tokens the client has not received yet: it
        // goes out before (in front of) the first new token's text.
        let mut unsent = self.unsent_resume_text(resume, &mut detok)?;
        let ended = resume
            .token_ids
            .last()
            .is_some_and(|t| self.tokenizer.eog.contains(t));
        if max_new == 0 || ended {
            unsent.push_str(&detok.finish());
            generation.text = unsent;
            if ended {
                generation.finish = FinishReason::Eos;
            }
            return Ok(Begin::Done(generation));
        }
        let grammar = match &s.grammar {
            None => None,
            Some(c) => {
                let mut mask = self.grammar.mask(c, &self.tokenizer)?;
                for &t in &resume.token_ids {
                    mask.consume(t)?;
                }
                Some(mask)
            }
        };
        let mut sampler = Sampler::new(s);
        sampler.skip(resume.token_ids.len());
        Ok(Begin::Run(Box::new(Sequence {
            sampler,
            logprobs: s.logprobs,
            stop: StopBuffer::new(&s.stop),
            detok,
            unsent,
            prompt_len: prompt.len(),
            history: prompt,
            resumed: resume.token_ids.len(),
            max_new,
            generation,
            start,
            decode_start: None,
            done: false,
            grammar,
            failed: None,
        })))
    }
}

impl Sequence {
    /// The prompt and every token sampled so far.
    pub(crate) fn tokens(&self) -> &[u32] {
        &self.history
    }

    /// Most positions the forward pass will ever hold for it.
    pub(crate) fn capacity(&self) -> usize {
        self.prompt_len + self.max_new
    }

    /// Whether it has streamed its first token (so it is decoding).
    pub(crate) fn started(&self) -> bool {
        self.decode_start.is_some()
    }

    /// Samples the next token from `logits` (those after its last token)
    /// and streams it. `Continue`: feed the new last token next; `Break`:
    /// the generation is over ([`Sequence::finish`]).
    pub(crate) fn step(
        &mut self,
        text: &TextSide,
        logits: &mut [f32],
        on_token: &mut dyn FnMut(&TokenChunk) -> ControlFlow<()>,
    ) -> ControlFlow<()> {
        if self.done {
            return ControlFlow::Break(());
        }
        // Resumed tokens were generated in this job too: the presence and
        // frequency penalties count them.
        let output_from = self.prompt_len - self.resumed;
        // The grammar's mask first: the bias and penalties keep a forbidden
        // token at -inf, so every choice below sees the constrained logits.
        if let Some(e) = self.grammar.as_mut().and_then(|m| m.apply(logits).err()) {
            return self.fail(e);
        }
        let token = self.sampler.sample(logits, &self.history, output_from);
        // From the logits the sampler chose from (biased and penalised in place).
        let logprobs = self.logprobs.map(|k| {
            let (chosen, top) = sampler::logprobs(logits, token, k);
            let entry = |token_id: u32, logprob: f32| Logprob {
                token_id,
                logprob,
                bytes: text.tokenizer.token_bytes(token_id).to_vec(),
            };
            TokenLogprobs {
                chosen: entry(token, chosen),
                top: top.into_iter().map(|(id, lp)| entry(id, lp)).collect(),
            }
        });
        if self.decode_start.is_none() {
            self.generation.prefill = self.start.elapsed();
            self.decode_start = Some(Instant::now());
        }
        let g = &mut self.generation;
        let index = self.resumed + g.output_token_ids.len();
        if text.tokenizer.eog.contains(&token) {
            g.finish = FinishReason::Eos;
            let (StopCheck::Stopped(mut out) | StopCheck::Emit(mut out)) = self
                .stop
                .push(&(std::mem::take(&mut self.unsent) + &self.detok.finish()));
            out.push_str(&self.stop.finish());
            if !out.is_empty() {
                g.text.push_str(&out);
                let chunk = TokenChunk {
                    index,
                    token_id: token,
                    text: out,
                    logprobs,
                };
                if on_token(&chunk).is_break() {
                    g.finish = FinishReason::Cancelled;
                }
            }
            self.done = true;
            return ControlFlow::Break(());
        }
        if let Some(e) = self.grammar.as_mut().and_then(|m| m.consume(token).err()) {
            return self.fail(e);
        }
        let g = &mut self.generation;
        g.output_token_ids.push(token);
        self.history.push(token);
        let last = g.output_token_ids.len() == self.max_new;
        let mut piece = std::mem::take(&mut self.unsent);
        piece.push_str(&self.detok.push(text.tokenizer.token_bytes(token)));
        if last {
            piece.push_str(&self.detok.finish());
        }
        let (mut out, stopped) = match self.stop.push(&piece) {
            StopCheck::Emit(t) => (t, false),
            StopCheck::Stopped(t) => (t, true),
        };
        if last && !stopped {
            out.push_str(&self.stop.finish());
        }
        g.text.push_str(&out);
        let chunk = TokenChunk {
            index,
            token_id: token,
            text: out,
            logprobs,
        };
        let flow = on_token(&chunk);
        self.done = true;
        if stopped {
            g.finish = FinishReason::Stop;
        } else if flow.is_break() {
            g.finish = FinishReason::Cancelled;
        } else if last {
            g.finish = FinishReason::Length;
        } else {
            self.done = false;
            return ControlFlow::Continue(());
        }
        ControlFlow::Break(())
    }

    /// Ends it with `e`, before its next token.
    fn fail(&mut self, e: EngineError) -> ControlFlow<()> {
        self.failed = Some(e);
        self.done = true;
        ControlFlow::Break(())
    }

    /// Ends it as cancelled, before its next token.
    pub(crate) fn cancel(&mut self) {
        if !self.done {
            self.generation.finish = FinishReason::Cancelled;
            self.done = true;
        }
    }

    /// The generation so far (its end, once [`Sequence::step`] said
    /// `Break`), or why it failed.
    pub(crate) fn finish(mut self) -> Result<Generation, EngineError> {
        if let Some(e) = self.failed.take() {
            return Err(e);
        }
        if let Some(d) = self.decode_start {
            self.generation.decode = d.elapsed();
        }
        Ok(self.generation)
    }
}
