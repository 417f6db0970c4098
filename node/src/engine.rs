//! Inference engine: runs generations of a Llama-family model on candle-core.
//!
//! The node agent loads an [`Engine`] per model file and hands it to a
//! [`batch::BatchThread`], which runs every job and audit of that model in
//! one continuous batch; [`Engine::generate`] runs one generation alone (the
//! CLI, tests, benches). Everything a generation needs comes from the model
//! file itself: weights, tokenizer, chat template, special tokens.
//!
//! # Layout
//! - `gguf`: a bounds-checked GGUF reader over a memory map (metadata and tensor
//!   directory); candle never sees bytes we have not validated.
//! - `config`: the model hyper-parameters, read from GGUF metadata or `config.json`.
//! - `weights`: named tensors from GGUF or safetensors, under GGUF names.
//! - `linear`: the one type through which every weight matmul goes (the place
//!   where faster kernels are swapped in).
//! - `model`: the Llama-family transformer (Llama 2/3, SmolLM2, Mistral, Qwen2,
//!   Qwen3) with a preallocated KV cache; layers are separate modules so a later
//!   pod can shard heads and feed-forward columns.
//! - `gemma3`: what Gemma 3 adds to that block (post norms, GeGLU, scaled
//!   embeddings, interleaved sliding-window and global layers).
//! - `moe`: routed experts as a block's feed-forward (Qwen3-MoE): the
//!   router, top-k gating, each chosen expert run once per pass.
//! - [`kv`]: the paged KV cache (a fixed pool of pages shared by the
//!   sequences of a batch) and the attention over it.
//! - [`batch`]: continuous batching: [`batch::BatchModel`] (the per-
//!   architecture pass over many sequences), the scheduler, its thread.
//! - [`prefix`]: the prefix cache (computed prompt pages, by content).
//! - `sequence`: one generation as a state machine (sampling, stop strings,
//!   streaming), driven alone or by the batch.
//! - [`sharded`]: the model split across a pod (tensor or pipeline parallel).
//! - `tokenizer`: a `tokenizers::Tokenizer` built from GGUF metadata or
//!   `tokenizer.json`, plus the incremental detokenizer used for streaming.
//! - `template`: the model's chat template, rendered with minijinja.
//! - `sampler`: greedy / temperature / top-k / top-p / min-p / repetition
//!   penalty with a seeded generator, and a token's log-probabilities;
//!   `stop`: stop strings.
//! - [`audit`]: the decision rule that judges a claimed generation from one
//!   teacher-forced pass ([`Engine::audit`]).
//! - [`cli`]: `mlx-node generate` and `mlx-node bench`.
//!
//! # Invariants
//! - A [`Generation`]'s `text` equals the concatenation of the texts of the
//!   [`TokenChunk`]s passed to the callback, and never contains a stop string.
//! - The KV cache is reset at the start of every [`Engine::generate`] call, and
//!   a batched sequence reads only its own pages (and cached pages of its
//!   own prefix), so one generation never sees another's context.
//! - A sequence's logits do not depend on what else is in its pass or how
//!   its prompt was chunked (see [`kv`] and [`kernels`]): greedy output is
//!   the same alone and in any batch.
//! - The same request with the same seed gives the same output.
//!
//! # Failure
//! Every failure is an [`EngineError`] naming what is wrong (which file, which
//! tensor, which key); malformed model files are rejected before their bytes
//! reach candle, so they never panic. Client mistakes (empty or too long
//! prompt, a chat the template refuses) are told apart by
//! [`EngineError::is_client_error`].

use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

pub mod audit;
pub mod batch;
pub mod cli;
pub(crate) mod config;
pub mod device;
mod gemma3;
mod gguf;
pub mod grammar;
pub mod kernels;
pub mod kv;
mod linear;
mod model;
mod moe;
mod ops;
pub mod prefix;
pub mod profile;
mod sampler;
mod sequence;
pub mod sharded;
mod template;
mod tokenizer;
mod weights;

#[cfg(test)]
mod tests;
#[cfg(any(test, feature = "test-utils"))]
#[allow(
    clippy::unwrap_used,
    reason = "test harness: a failed unwrap is a failed test"
)]
pub(crate) mod testutil;

use model::Model;
use sequence::Begin;
use template::ChatTemplate;
use tokenizer::{Detokenizer, Tokenizer};

/// Prompt tokens processed per forward pass during prefill (bounds the
/// memory of one pass on long prompts).
pub const PREFILL_CHUNK: usize = 256;

/// A loaded model, ready to generate. `Send`, so it can be moved into a
/// blocking task; not `Sync` (one generation at a time).
pub struct Engine {
    info: ModelInfo,
    model: device::EngineModel,
    text: std::sync::Arc<TextSide>,
}

/// What generation needs from a model besides its forward pass: the
/// tokenizer and the chat template. A pod leader holds this and only its
/// share of the weights.
pub struct TextSide {
    tokenizer: Tokenizer,
    /// The compiled chat template, or why there is none.
    template: Result<ChatTemplate, String>,
    /// Structured output's compiler over this tokenizer (built on first use).
    grammar: grammar::GrammarEnv,
}

impl std::fmt::Debug for TextSide {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TextSide").finish_non_exhaustive()
    }
}

/// The forward pass generation drives: room for a sequence, then passes
/// that return the last position's logits. Two implementations: the whole
/// model on this machine, and a pod leader driving the sharded model
/// across its pod (`pod::runtime`).
pub trait Forward {
    type Error: From<EngineError>;
    /// Longest sequence (prompt + generated) it accepts.
    fn context_length(&self) -> usize;
    /// Empties the cache and makes room for `capacity` positions.
    fn reset(&mut self, capacity: usize) -> Result<(), Self::Error>;
    /// Runs `tokens` at the next positions; the logits of the last one.
    fn forward(&mut self, tokens: &[u32]) -> Result<Vec<f32>, Self::Error>;
    /// Most prompt tokens to pass to one [`Forward::forward`] call during
    /// prefill (a pipeline-parallel pod takes the whole prompt at once and
    /// splits it into micro-batches that flow through its stages).
    fn prefill_chunk(&self) -> usize {
        PREFILL_CHUNK
    }
}

impl Forward for Model {
    type Error = EngineError;
    fn context_length(&self) -> usize {
        self.cfg.context_length
    }
    fn reset(&mut self, capacity: usize) -> Result<(), EngineError> {
        Model::reset(self, capacity);
        Ok(())
    }
    fn forward(&mut self, tokens: &[u32]) -> Result<Vec<f32>, EngineError> {
        Model::forward(self, tokens)
    }
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine").field("info", &self.info).finish()
    }
}

/// What a loaded model is, for the node's hardware/model report and limits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelInfo {
    /// `general.architecture` (GGUF) or `model_type` (config.json): "llama", "qwen2", "qwen3", ...
    pub architecture: String,
    /// Total number of weights.
    pub parameters: u64,
    /// Weights one token reads: `parameters` less the routed experts a
    /// token does not use (equal to `parameters` for a dense model).
    pub active_parameters: u64,
    /// The longest sequence (prompt + generated) the model accepts.
    pub context_length: usize,
    pub layers: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub vocab_size: usize,
}

/// What to generate from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PromptInput {
    /// Raw text, tokenized as is (with the model's BOS token if it wants one).
    Text(String),
    /// Chat messages, rendered through the model's chat template with a generation prompt.
    Chat(Vec<ChatTurn>),
}

/// One chat message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatTurn {
    /// "system", "user" or "assistant" (passed to the template as is).
    pub role: String,
    pub content: String,
}

/// One generation job.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerateRequest {
    pub input: PromptInput,
    pub sampling: Sampling,
    /// Where an earlier attempt stopped (hand-off); empty for a fresh job.
    pub resume: Resume,
}

/// The tokens an earlier attempt of the same job already produced and the
/// text its client already received. A resumed generation prefills the
/// prompt followed by `token_ids`, numbers its tokens from
/// `token_ids.len()`, counts them against the same `max_tokens`, and first
/// emits whatever text of `token_ids` the client has not seen yet (an
/// unfinished character, or text held back for a stop string), so the
/// client's stream continues with no gap and no repeat. A sampled
/// (temperature > 0) generation skips one random draw per resumed token, so
/// it continues exactly as the uninterrupted run would.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Resume {
    pub token_ids: Vec<u32>,
    /// The text already streamed; must be a prefix of the tokens' text.
    pub text: String,
}

/// How to pick tokens and when to stop.
#[derive(Debug, Clone, PartialEq)]
pub struct Sampling {
    /// 0 => greedy.
    pub temperature: f32,
    /// 0 => off.
    pub top_k: usize,
    /// >= 1.0 or 0 => off.
    pub top_p: f32,
    /// 0 => off.
    pub min_p: f32,
    /// 1.0 (or 0) => off.
    pub repetition_penalty: f32,
    pub seed: u64,
    pub max_tokens: usize,
    /// Generation ends when the output contains one of these; the stop string
    /// itself is not part of the output.
    pub stop: Vec<String>,
    /// `Some(k)`: each streamed token carries its log-probability and the
    /// `k` (at most [`MAX_LOGPROBS`]) most probable alternatives
    /// ([`TokenChunk::logprobs`]).
    pub logprobs: Option<usize>,
    /// OpenAI's presence penalty (-2 to 2, 0 off): subtracted once from the
    /// logit of every token generated so far in this job.
    pub presence_penalty: f32,
    /// OpenAI's frequency penalty (-2 to 2, 0 off): subtracted from a
    /// token's logit once per time it was generated so far in this job.
    pub frequency_penalty: f32,
    /// (token id, bias) added to the logits before the penalties: -100 to
    /// 100 each, at most [`MAX_LOGIT_BIAS`], each id once, ids in the
    /// vocabulary.
    pub logit_bias: Vec<(u32, f32)>,
    /// Structured output: every token keeps the output inside this grammar
    /// (module `grammar`); None = free text.
    pub grammar: Option<mlxnet_proto::grammar::Constraint>,
}

/// Most alternatives a token's log-probabilities may list (OpenAI's bound).
pub const MAX_LOGPROBS: usize = 20;
/// Most entries a logit bias may have (OpenAI's bound).
pub const MAX_LOGIT_BIAS: usize = 300;

impl Default for Sampling {
    fn default() -> Self {
        Sampling {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            seed: 0,
            max_tokens: 128,
            stop: Vec::new(),
            logprobs: None,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            logit_bias: Vec::new(),
            grammar: None,
        }
    }
}

/// One generated token, as streamed to the callback.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenChunk {
    /// 0-based index of this token in the job (resumed tokens count).
    pub index: usize,
    pub token_id: u32,
    /// Newly decodable text: valid UTF-8, may be empty (an incomplete
    /// character, or text that might start a stop string, is held back).
    pub text: String,
    /// With [`Sampling::logprobs`]: this token's log-probability and the
    /// most probable alternatives at its position.
    pub logprobs: Option<TokenLogprobs>,
}

/// A token's log-probability under the model's distribution at its
/// position (see `sampler::logprobs`) and the most probable tokens there.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprobs {
    pub chosen: Logprob,
    /// Most probable first (ties: lower id first), `k` of them.
    pub top: Vec<Logprob>,
}

/// One token with its log-probability (finite, <= 0) and its bytes.
#[derive(Debug, Clone, PartialEq)]
pub struct Logprob {
    pub token_id: u32,
    pub logprob: f32,
    pub bytes: Vec<u8>,
}

/// The result of one generation.
#[derive(Debug, Clone, PartialEq)]
pub struct Generation {
    pub prompt_tokens: usize,
    /// Generated ids, EOS excluded.
    pub output_token_ids: Vec<u32>,
    /// Decoded output, stop string excluded; equals the concatenation of all chunk texts.
    pub text: String,
    pub finish: FinishReason,
    /// Time spent on the prompt (up to the first sampled token).
    pub prefill: Duration,
    /// Time spent generating the rest.
    pub decode: Duration,
}

/// Why a generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// The model emitted an end-of-sequence (or end-of-turn) token.
    Eos,
    /// `max_tokens` or the context length was reached.
    Length,
    /// A stop string was produced.
    Stop,
    /// The callback returned `ControlFlow::Break`.
    Cancelled,
}

impl FinishReason {
    pub fn as_str(&self) -> &'static str {
        match self {
            FinishReason::Eos => "eos",
            FinishReason::Length => "length",
            FinishReason::Stop => "stop",
            FinishReason::Cancelled => "cancelled",
        }
    }
}

/// Why loading a model or generating failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EngineError {
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("invalid gguf file: {0}")]
    Gguf(String),
    #[error("invalid safetensors model: {0}")]
    Safetensors(String),
    #[error("invalid model config: {0}")]
    Config(String),
    #[error("missing tensor {name}")]
    MissingTensor { name: String },
    #[error("tensor {name} has shape {actual:?}, expected {expected:?}")]
    TensorShape {
        name: String,
        actual: Vec<usize>,
        expected: Vec<usize>,
    },
    #[error("unsupported tensor type for {name}: {dtype}")]
    UnsupportedTensorType { name: String, dtype: String },
    #[error(
        "unsupported model architecture {0:?} (supported: llama, mistral, qwen2, qwen3, qwen3moe, gemma3)"
    )]
    UnsupportedArchitecture(String),
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("chat template: {0}")]
    Template(String),
    #[error("prompt has {tokens} tokens, the model accepts at most {max}")]
    PromptTooLong { tokens: usize, max: usize },
    #[error("empty prompt")]
    EmptyPrompt,
    #[error("invalid sampling parameters: {0}")]
    InvalidSampling(String),
    #[error("tensor computation failed: {0}")]
    Candle(#[from] candle_core::Error),
    #[error("resume text is not a prefix of the resumed tokens' text")]
    ResumeMismatch,
    #[error(
        "the sequence needs {positions} positions of kv cache, this node's pool holds {capacity}"
    )]
    KvPoolTooSmall { positions: usize, capacity: usize },
    #[error("batched step: {0}")]
    Batch(String),
    #[error("resumed token id {id} is outside the model's vocabulary of {vocab}")]
    ResumeToken { id: u32, vocab: usize },
    #[error("structured output failed: {0}")]
    Grammar(String),
}

impl EngineError {
    /// True when the request, not the node or the model, is at fault.
    pub fn is_client_error(&self) -> bool {
        matches!(
            self,
            EngineError::PromptTooLong { .. }
                | EngineError::EmptyPrompt
                | EngineError::Template(_)
                | EngineError::InvalidSampling(_)
                | EngineError::ResumeMismatch
                | EngineError::ResumeToken { .. }
        )
    }
}

impl Engine {
    /// Loads a GGUF file, or a safetensors model (a directory holding
    /// `config.json`, `tokenizer.json` and `*.safetensors`, or one
    /// `.safetensors` file next to them).
    pub fn load(path: &Path) -> Result<Engine, EngineError> {
        Self::load_on(path, &device::Backend::Native)
    }

    /// [`Engine::load`] onto `backend` (the fast CPU path, or a candle
    /// device: see [`device`]).
    pub fn load_on(path: &Path, backend: &device::Backend) -> Result<Engine, EngineError> {
        let meta = std::fs::metadata(path).map_err(|source| EngineError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let is_safetensors =
            meta.is_dir() || path.extension().and_then(|e| e.to_str()) == Some("safetensors");
        let (model, tokenizer, template_source) = if is_safetensors {
            load_safetensors(path, backend)?
        } else {
            load_gguf(path, backend)?
        };
        if tokenizer.vocab_size() > model.cfg().vocab_size {
            return Err(EngineError::Tokenizer(format!(
                "the tokenizer has {} tokens, the model's embedding only {}",
                tokenizer.vocab_size(),
                model.cfg().vocab_size
            )));
        }
        let template = compile_template(template_source);
        let cfg = model.cfg();
        let info = ModelInfo {
            architecture: cfg.architecture_name.clone(),
            parameters: model.parameters(),
            active_parameters: model.active_parameters(),
            context_length: cfg.context_length,
            layers: cfg.layers,
            kv_heads: cfg.kv_heads,
            head_dim: cfg.head_dim,
            vocab_size: cfg.vocab_size,
        };
        Ok(Engine {
            info,
            model,
            text: std::sync::Arc::new(TextSide {
                tokenizer,
                template,
                grammar: grammar::GrammarEnv::default(),
            }),
        })
    }

    pub fn info(&self) -> &ModelInfo {
        &self.info
    }

    /// What one position of a sequence takes in a KV pool for this model.
    pub fn kv_shape(&self) -> kv::KvShape {
        batch::BatchModel::kv_shape(&self.model)
    }

    /// Where it computes: "cpu" (the fast CPU path), "metal", "cuda", or
    /// "candle-cpu" (the device path on the CPU).
    pub fn backend(&self) -> &'static str {
        self.model.backend_name()
    }

    /// The prompt's token ids as [`Engine::generate`] would feed them
    /// (chat template applied, BOS added when the model wants it).
    pub fn prompt_tokens(&self, input: &PromptInput) -> Result<Vec<u32>, EngineError> {
        self.text.prompt_tokens(input)
    }

    /// Tokenizes `text` as is (special tokens recognised, no BOS).
    pub fn tokenize(&self, text: &str) -> Result<Vec<u32>, EngineError> {
        self.text.tokenize(text)
    }

    /// Decodes ids to text.
    pub fn detokenize(&self, ids: &[u32]) -> String {
        self.text.detokenize(ids)
    }

    /// Runs one generation; see the module invariants.
    ///
    /// Text held back at the end (a partial stop string, an unfinished
    /// character) is delivered when the generation ends: with the last
    /// token's chunk, or, when the model ends with EOS, in one more chunk
    /// carrying the EOS id (its `index` equals the number of output tokens).
    pub fn generate(
        &mut self,
        request: &GenerateRequest,
        on_token: &mut dyn FnMut(&TokenChunk) -> ControlFlow<()>,
    ) -> Result<Generation, EngineError> {
        self.text.generate(&mut self.model, request, on_token)
    }
}

impl Engine {
    /// Greedy decoding of `input` for at most `steps` tokens, stopping
    /// before an end-of-generation token: each token with its top-2 logit
    /// margin (how near a tie the choice was). The reference a sharded run
    /// is compared against, where a near tie may go either way.
    pub fn greedy_trace(
        &mut self,
        input: &PromptInput,
        steps: usize,
    ) -> Result<Vec<(u32, f32)>, EngineError> {
        let prompt = self.prompt_tokens(input)?;
        self.model.reset(prompt.len() + steps);
        let mut logits = self.model.forward(&prompt)?;
        let mut out = Vec::with_capacity(steps);
        for _ in 0..steps {
            let (mut best, mut second) = ((0u32, f32::NEG_INFINITY), f32::NEG_INFINITY);
            for (i, &v) in logits.iter().enumerate() {
                if v > best.1 {
                    second = best.1;
                    best = (i as u32, v);
                } else if v > second {
                    second = v;
                }
            }
            if self.text.tokenizer.eog.contains(&best.0) {
                break;
            }
            out.push((best.0, best.1 - second));
            logits = self.model.forward(&[best.0])?;
        }
        Ok(out)
    }
}

impl TextSide {
    /// The tokenizer and chat template of a GGUF file, without its weights.
    pub fn load_gguf(path: &Path) -> Result<TextSide, EngineError> {
        let file = gguf::GgufFile::open(path)?;
        let tokenizer = Tokenizer::from_gguf(&file.metadata)?;
        let template = compile_template(
            file.get("tokenizer.chat_template")
                .and_then(gguf::MetaValue::as_str)
                .map(str::to_string),
        );
        Ok(TextSide {
            tokenizer,
            template,
            grammar: grammar::GrammarEnv::default(),
        })
    }

    /// The prompt's token ids as [`Engine::generate`] would feed them
    /// (chat template applied, BOS added when the model wants it).
    pub fn prompt_tokens(&self, input: &PromptInput) -> Result<Vec<u32>, EngineError> {
        let text = match input {
            PromptInput::Text(t) => {
                if t.is_empty() {
                    return Err(EngineError::EmptyPrompt);
                }
                t.clone()
            }
            PromptInput::Chat(turns) => {
                if turns.is_empty() {
                    return Err(EngineError::EmptyPrompt);
                }
                let template = self
                    .template
                    .as_ref()
                    .map_err(|e| EngineError::Template(e.clone()))?;
                template.render(turns, &self.tokenizer.bos_text, &self.tokenizer.eos_text)?
            }
        };
        let ids = self.tokenizer.encode_prompt(&text)?;
        if ids.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        Ok(ids)
    }

    /// Tokenizes `text` as is (special tokens recognised, no BOS).
    pub fn tokenize(&self, text: &str) -> Result<Vec<u32>, EngineError> {
        self.tokenizer.encode(text)
    }

    /// Decodes ids to text.
    pub fn detokenize(&self, ids: &[u32]) -> String {
        self.tokenizer.decode(ids)
    }

    /// Runs one generation; see the module invariants.
    ///
    /// Text held back at the end (a partial stop string, an unfinished
    /// character) is delivered when the generation ends: with the last
    /// token's chunk, or, when the model ends with EOS, in one more chunk
    /// carrying the EOS id (its `index` equals the number of output tokens).
    pub fn generate<F: Forward>(
        &self,
        model: &mut F,
        request: &GenerateRequest,
        on_token: &mut dyn FnMut(&TokenChunk) -> ControlFlow<()>,
    ) -> Result<Generation, F::Error> {
        let mut seq = match self.begin(request, model.context_length(), Instant::now())? {
            Begin::Done(generation) => return Ok(generation),
            Begin::Run(seq) => seq,
        };
        model.reset(seq.capacity())?;
        let mut logits = Vec::new();
        for chunk in seq.tokens().chunks(model.prefill_chunk().max(1)) {
            logits = model.forward(chunk)?;
        }
        while seq.step(self, &mut logits, on_token).is_continue() {
            let Some(&last) = seq.tokens().last() else {
                break;
            };
            logits = model.forward(&[last])?;
        }
        Ok(seq.finish()?)
    }

    /// Feeds the resumed tokens to `detok` and returns the part of their
    /// text that `resume.text` (what the client has) does not cover.
    fn unsent_resume_text(
        &self,
        resume: &Resume,
        detok: &mut Detokenizer,
    ) -> Result<String, EngineError> {
        let mut decoded = String::new();
        for &t in &resume.token_ids {
            if !self.tokenizer.eog.contains(&t) {
                decoded.push_str(&detok.push(self.tokenizer.token_bytes(t)));
            }
        }
        decoded
            .strip_prefix(resume.text.as_str())
            .map(str::to_owned)
            .ok_or(EngineError::ResumeMismatch)
    }
}

fn compile_template(source: Option<String>) -> Result<ChatTemplate, String> {
    match source {
        Some(src) => ChatTemplate::new(&src).map_err(|e| e.to_string()),
        None => Err("the model file has no chat template".to_string()),
    }
}

impl Engine {
    /// Audits a claimed generation: one teacher-forced pass of prompt +
    /// claimed tokens (batched, in [`PREFILL_CHUNK`]s), every position scored
    /// against the job's sampling parameters, and the claim judged by
    /// [`audit::judge`]. Errors only when the input itself cannot run (the
    /// job would have failed the same way).
    pub fn audit(&mut self, req: &AuditRequest) -> Result<audit::Verdict, EngineError> {
        let ctx = self.model.cfg().context_length;
        let vocab = self.model.cfg().vocab_size;
        let mut pass = match self.text.audit_pass(req, ctx, vocab)? {
            Ok(pass) => pass,
            Err(verdict) => return Ok(verdict),
        };
        // Rows from the last prompt token on: row i predicts output token i;
        // the last row predicts what follows the claimed output.
        let first_row = pass.first_row();
        let full = pass.tokens().to_vec();
        self.model.reset(full.len());
        for (c, chunk) in full.chunks(PREFILL_CHUNK).enumerate() {
            let start = c * PREFILL_CHUNK;
            let from = first_row.saturating_sub(start).min(chunk.len());
            let mut rows = self.model.forward_rows(chunk, from)?;
            pass.score(start + from, &mut rows, vocab);
        }
        Ok(pass.verdict())
    }
}

impl TextSide {
    /// The teacher-forced pass that audits `req` on a model of context
    /// length `ctx` and vocabulary `vocab`, or the verdict at once when the
    /// claim cannot even be scored. Errors only when the input itself
    /// cannot run (the job would have failed the same way).
    pub(crate) fn audit_pass(
        &self,
        req: &AuditRequest,
        ctx: usize,
        vocab: usize,
    ) -> Result<Result<audit::AuditPass, audit::Verdict>, EngineError> {
        // As `begin` validates it: the job would have been refused the same way.
        sampler::validate(&req.sampling, self.tokenizer.vocab_len())?;
        let resumed = &req.resume.token_ids;
        if let Some(&id) = resumed.iter().find(|&&t| t as usize >= vocab) {
            return Err(EngineError::ResumeToken { id, vocab });
        }
        let mut prompt = self.prompt_tokens(&req.input)?;
        prompt.extend_from_slice(resumed);
        let output = &req.output_token_ids;
        if let Some((i, &t)) = output
            .iter()
            .enumerate()
            .find(|(_, &t)| t as usize >= vocab)
        {
            return Ok(Err(audit::judge_unscorable(i, t)));
        }
        let total = prompt.len() + output.len();
        if total > ctx || prompt.len() >= ctx {
            return Err(EngineError::PromptTooLong {
                tokens: total,
                max: ctx,
            });
        }
        // As `begin` compiles it (and replays the resumed tokens through
        // it): a grammar the job could not have run with is refused the
        // same way.
        let grammar = match &req.sampling.grammar {
            None => None,
            Some(c) => {
                let mut mask = self.grammar.mask(c, &self.tokenizer)?;
                for &t in resumed {
                    mask.consume(t)?;
                }
                Some(mask)
            }
        };
        // A resumed claim may have only what is left of `max_tokens`, and
        // its text is what follows the text the client already had.
        let sampling = Sampling {
            max_tokens: req.sampling.max_tokens.saturating_sub(resumed.len()),
            ..req.sampling.clone()
        };
        let decoded_text = if resumed.is_empty() {
            self.tokenizer.decode(output)
        } else {
            let mut all = resumed.clone();
            all.extend_from_slice(output);
            match self.tokenizer.decode(&all).strip_prefix(&req.resume.text) {
                Some(rest) => rest.to_owned(),
                None => self.tokenizer.decode(output),
            }
        };
        Ok(Ok(audit::AuditPass::new(audit::AuditInput {
            prompt,
            resumed: resumed.len(),
            output,
            sampling: &sampling,
            facts: &req.facts,
            eog: self.tokenizer.eog.iter().copied().collect(),
            decoded_text,
            context_length: ctx,
            grammar,
        })))
    }
}

/// A claimed generation to audit: the job's input and parameters, and what
/// the node claimed (after the job's earlier attempts' tokens, `resume`,
/// when the claim continues a handed-off job).
#[derive(Debug, Clone, PartialEq)]
pub struct AuditRequest {
    pub input: PromptInput,
    pub sampling: Sampling,
    /// The tokens (and the text the client had) before the claimed ones.
    pub resume: Resume,
    pub output_token_ids: Vec<u32>,
    pub facts: audit::ClaimFacts,
}

/// What a GGUF file says about itself: the facts of a catalogue entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileFacts {
    pub architecture: String,
    /// Elements of every tensor.
    pub parameters: u64,
    /// Elements one token reads: `parameters` less the routed experts it
    /// does not use (stacked `*_exps` tensors count `expert_used_count` of
    /// their `expert_count` experts); `parameters` for a dense file.
    pub active_parameters: u64,
    /// From `general.file_type` ("Q4_K_M", "Q8_0", ...), or "unknown".
    pub quantization: String,
    pub context_length: usize,
    /// `general.license`, if the file names one.
    pub license: Option<String>,
    pub layers: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub hidden_size: usize,
    /// Entries of `tokenizer.ggml.tokens` (0 when the file has none).
    pub vocab_size: usize,
}

/// llama.cpp's `llama_ftype` names.
fn file_type_name(t: u64) -> &'static str {
    match t {
        0 => "F32",
        1 => "F16",
        2 => "Q4_0",
        3 => "Q4_1",
        7 => "Q8_0",
        8 => "Q5_0",
        9 => "Q5_1",
        10 => "Q2_K",
        11 => "Q3_K_S",
        12 => "Q3_K_M",
        13 => "Q3_K_L",
        14 => "Q4_K_S",
        15 => "Q4_K_M",
        16 => "Q5_K_S",
        17 => "Q5_K_M",
        18 => "Q6_K",
        32 => "BF16",
        _ => "unknown",
    }
}

/// Reads a GGUF file's header (metadata and tensor directory, no weights)
/// for its catalogue facts; any architecture, supported here or not.
pub fn describe_gguf(path: &Path) -> Result<FileFacts, EngineError> {
    let file = gguf::GgufFile::open(path)?;
    let arch = file
        .get("general.architecture")
        .and_then(gguf::MetaValue::as_str)
        .ok_or_else(|| EngineError::Config("missing general.architecture".into()))?
        .to_string();
    let int = |k: &str| {
        file.get(&format!("{arch}.{k}"))
            .and_then(gguf::MetaValue::as_u64)
            .map(|v| v as usize)
    };
    let hidden_size = int("embedding_length").unwrap_or(0);
    let heads = int("attention.head_count").unwrap_or(0);
    let parameters = file
        .tensors
        .values()
        .map(|t| t.shape.iter().product::<usize>() as u64)
        .sum();
    let unused_experts: u64 = match (int("expert_count"), int("expert_used_count")) {
        (Some(n), Some(used)) if used <= n => file
            .tensors
            .iter()
            .filter(|(name, t)| name.contains("_exps.") && t.shape.first() == Some(&n))
            .map(|(_, t)| (t.shape.iter().product::<usize>() / n * (n - used)) as u64)
            .sum(),
        _ => 0,
    };
    Ok(FileFacts {
        parameters,
        active_parameters: parameters - unused_experts,
        quantization: file
            .get("general.file_type")
            .and_then(gguf::MetaValue::as_u64)
            .map_or("unknown", file_type_name)
            .to_string(),
        context_length: int("context_length").unwrap_or(0),
        license: file
            .get("general.license")
            .and_then(gguf::MetaValue::as_str)
            .map(str::to_string),
        layers: int("block_count").unwrap_or(0),
        kv_heads: int("attention.head_count_kv").unwrap_or(heads),
        head_dim: int("attention.key_length")
            .or_else(|| hidden_size.checked_div(heads))
            .unwrap_or(0),
        hidden_size,
        vocab_size: file
            .get("tokenizer.ggml.tokens")
            .and_then(gguf::MetaValue::as_array)
            .map_or(0, <[gguf::MetaValue]>::len),
        architecture: arch,
    })
}

type Loaded = (device::EngineModel, Tokenizer, Option<String>);

fn load_gguf(path: &Path, backend: &device::Backend) -> Result<Loaded, EngineError> {
    let file = gguf::GgufFile::open(path)?;
    let tokenizer = Tokenizer::from_gguf(&file.metadata)?;
    // Without `<arch>.vocab_size`, the embedding's rows are the vocabulary.
    let vocab = file
        .tensors
        .get("token_embd.weight")
        .and_then(|e| e.shape.first().copied())
        .unwrap_or(tokenizer.vocab_size());
    let cfg = config::ModelConfig::from_gguf(&file.metadata, Some(vocab))?;
    let model = device::EngineModel::load(cfg, &weights::WeightSource::Gguf(&file), backend)?;
    let template = file
        .get("tokenizer.chat_template")
        .and_then(gguf::MetaValue::as_str)
        .map(str::to_string);
    Ok((model, tokenizer, template))
}

fn read_file(path: &Path) -> Result<Vec<u8>, EngineError> {
    std::fs::read(path).map_err(|source| EngineError::Io {
        path: path.to_path_buf(),
        source,
    })
}

/// `eos_token_id` of a config file: a number or a list of numbers.
fn eos_ids(v: &serde_json::Value) -> Vec<u32> {
    match v.get("eos_token_id") {
        Some(serde_json::Value::Number(n)) => n
            .as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .into_iter()
            .collect(),
        Some(serde_json::Value::Array(a)) => a
            .iter()
            .filter_map(|n| n.as_u64().and_then(|n| u32::try_from(n).ok()))
            .collect(),
        _ => Vec::new(),
    }
}

fn load_safetensors(path: &Path, backend: &device::Backend) -> Result<Loaded, EngineError> {
    let (dir, files) = if path.is_dir() {
        let mut files = Vec::new();
        let entries = std::fs::read_dir(path).map_err(|source| EngineError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        for entry in entries {
            let entry = entry.map_err(|source| EngineError::Io {
                path: path.to_path_buf(),
                source,
            })?;
            let p = entry.path();
            if p.extension().and_then(|e| e.to_str()) == Some("safetensors") {
                files.push(p);
            }
        }
        files.sort();
        if files.is_empty() {
            return Err(EngineError::Safetensors(format!(
                "no .safetensors file in {}",
                path.display()
            )));
        }
        (path.to_path_buf(), files)
    } else {
        let dir = path
            .parent()
            .map(Path::to_path_buf)
            .unwrap_or_else(|| PathBuf::from("."));
        (dir, vec![path.to_path_buf()])
    };
    let config_text = String::from_utf8(read_file(&dir.join("config.json"))?)
        .map_err(|_| EngineError::Config("config.json is not UTF-8".into()))?;
    let cfg = config::ModelConfig::from_json(&config_text)?;
    let config_json: serde_json::Value = serde_json::from_str(&config_text)
        .map_err(|e| EngineError::Config(format!("config.json: {e}")))?;
    let tok_config: Option<serde_json::Value> =
        match std::fs::read(dir.join("tokenizer_config.json")) {
            Ok(b) => Some(
                serde_json::from_slice(&b)
                    .map_err(|e| EngineError::Tokenizer(format!("tokenizer_config.json: {e}")))?,
            ),
            Err(_) => None,
        };
    let mut extra_eos = eos_ids(&config_json);
    if let Ok(b) = std::fs::read(dir.join("generation_config.json")) {
        if let Ok(v) = serde_json::from_slice::<serde_json::Value>(&b) {
            extra_eos.extend(eos_ids(&v));
        }
    }
    let tokenizer = Tokenizer::from_json(
        &read_file(&dir.join("tokenizer.json"))?,
        tok_config.as_ref(),
        &extra_eos,
    )?;
    let template = tok_config
        .as_ref()
        .and_then(|c| match c.get("chat_template")? {
            serde_json::Value::String(s) => Some(s.clone()),
            serde_json::Value::Array(list) => list
                .iter()
                .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                .or_else(|| list.first())
                .and_then(|t| t.get("template")?.as_str().map(str::to_string)),
            _ => None,
        });
    let maps = files
        .iter()
        .map(|f| gguf::map_file(f))
        .collect::<Result<Vec<_>, _>>()?;
    let mut views = Vec::with_capacity(maps.len());
    for (map, file) in maps.iter().zip(&files) {
        views.push(
            candle_core::safetensors::SliceSafetensors::new(&map[..])
                .map_err(|e| EngineError::Safetensors(format!("{}: {e}", file.display())))?,
        );
    }
    let model =
        device::EngineModel::load(cfg, &weights::WeightSource::Safetensors(views), backend)?;
    Ok((model, tokenizer, template))
}
