//! Text ↔ token ids, built from the model file, and streaming detokenization.
//!
//! From GGUF metadata we build a `tokenizers::Tokenizer` by hand, because the
//! file only holds the vocabulary, merges and the name of the pre-tokenizer:
//! - `tokenizer.ggml.model = "gpt2"`: byte-level BPE. The pre-tokenizer
//!   follows `tokenizer.ggml.pre` the way llama.cpp does (e.g. `smollm` splits
//!   every digit on its own and adds no prefix space; `llama-bpe` and `qwen2`
//!   use their own split regexes).
//! - `tokenizer.ggml.model = "llama"`: SentencePiece BPE with byte fallback,
//!   merges derived from the scored vocabulary, `▁` for spaces.
//!
//! Control and user-defined tokens (`<|im_start|>`, ...) are matched as whole
//! special tokens in the text, as llama.cpp does when parsing specials.
//!
//! Decoding does not go through `tokenizers`: each id maps to its raw bytes
//! (control tokens to none), and [`Detokenizer`] emits only complete UTF-8,
//! holding back a partial character until its last byte arrives.
//!
//! # Failure
//! [`EngineError::Tokenizer`] naming the missing or malformed metadata key.

use std::collections::{HashMap, HashSet};

use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::normalizers::{NormalizerWrapper, Prepend, Replace};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::{AddedToken, SplitDelimiterBehavior};

use super::gguf::MetaValue;
use super::EngineError;

fn terr(msg: impl Into<String>) -> EngineError {
    EngineError::Tokenizer(msg.into())
}

// Token types of `tokenizer.ggml.token_type` (llama.cpp's llama_token_type).
const TYPE_NORMAL: i64 = 1;
const TYPE_CONTROL: i64 = 3;
const TYPE_USER_DEFINED: i64 = 4;
const TYPE_BYTE: i64 = 6;

/// Names llama.cpp treats as end-of-generation when they are special tokens.
const EOG_NAMES: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|eom_id|>",
    "<EOT>",
    "<|end_of_text|>",
    "</s>",
];

/// GPT-2's printable stand-ins for bytes (`bytes_to_unicode`), inverted.
fn byte_level_decoder() -> HashMap<char, u8> {
    let mut map = HashMap::with_capacity(256);
    let mut n = 0u32;
    for b in 0u32..=255 {
        let printable =
            (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
        let c = if printable {
            b
        } else {
            let c = 256 + n;
            n += 1;
            c
        };
        if let Some(ch) = char::from_u32(c) {
            map.insert(ch, b as u8);
        }
    }
    map
}

/// Bytes of a byte-level BPE token string.
fn byte_level_bytes(token: &str, map: &HashMap<char, u8>) -> Vec<u8> {
    let mut out = Vec::with_capacity(token.len());
    for ch in token.chars() {
        match map.get(&ch) {
            Some(&b) => out.push(b),
            None => {
                let mut buf = [0u8; 4];
                out.extend_from_slice(ch.encode_utf8(&mut buf).as_bytes());
            }
        }
    }
    out
}

/// Bytes of a SentencePiece token: `<0xAB>` is one raw byte, `▁` is a space.
fn sentencepiece_bytes(token: &str) -> Vec<u8> {
    if token.len() == 6 && token.starts_with("<0x") && token.ends_with('>') {
        if let Ok(b) = u8::from_str_radix(&token[3..5], 16) {
            return vec![b];
        }
    }
    token.replace('\u{2581}', " ").into_bytes()
}

/// A model's tokenizer plus what generation needs to know about special tokens.
#[derive(Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// Raw bytes of each id; empty for control tokens.
    token_bytes: Vec<Vec<u8>>,
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    /// Every id that ends a generation (EOS, end-of-turn, ...).
    pub eog: HashSet<u32>,
    /// Whether a BOS token is put in front of a prompt.
    pub add_bos: bool,
    /// Token strings for the chat template's `bos_token` / `eos_token`.
    pub bos_text: String,
    pub eos_text: String,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab", &self.token_bytes.len())
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .finish()
    }
}

fn meta_u32(meta: &HashMap<String, MetaValue>, key: &str) -> Option<u32> {
    meta.get(key)
        .and_then(MetaValue::as_u64)
        .and_then(|v| u32::try_from(v).ok())
}

impl Tokenizer {
    /// Builds the tokenizer described by GGUF metadata.
    pub fn from_gguf(meta: &HashMap<String, MetaValue>) -> Result<Self, EngineError> {
        let model = meta
            .get("tokenizer.ggml.model")
            .and_then(MetaValue::as_str)
            .ok_or_else(|| terr("missing tokenizer.ggml.model"))?;
        let tokens: Vec<String> = meta
            .get("tokenizer.ggml.tokens")
            .and_then(MetaValue::as_array)
            .ok_or_else(|| terr("missing tokenizer.ggml.tokens"))?
            .iter()
            .map(|v| v.as_str().map(str::to_string))
            .collect::<Option<_>>()
            .ok_or_else(|| terr("tokenizer.ggml.tokens holds a non-string"))?;
        if tokens.is_empty() || tokens.len() > u32::MAX as usize {
            return Err(terr(format!(
                "tokenizer.ggml.tokens has {} entries",
                tokens.len()
            )));
        }
        let n = tokens.len();
        let types: Vec<i64> = match meta
            .get("tokenizer.ggml.token_type")
            .and_then(MetaValue::as_array)
        {
            Some(a) if a.len() == n => a
                .iter()
                .map(|v| match *v {
                    MetaValue::I32(t) => i64::from(t),
                    _ => v.as_u64().map_or(TYPE_NORMAL, |t| t as i64),
                })
                .collect(),
            Some(a) => {
                return Err(terr(format!(
                    "tokenizer.ggml.token_type has {} entries for {n} tokens",
                    a.len()
                )))
            }
            None => vec![TYPE_NORMAL; n],
        };
        let id_of = |key: &str| -> Result<Option<u32>, EngineError> {
            match meta.get(key) {
                None => Ok(None),
                Some(_) => match meta_u32(meta, key) {
                    Some(id) if (id as usize) < n => Ok(Some(id)),
                    _ => Err(terr(format!("{key} is not a token id below {n}"))),
                },
            }
        };
        let bos = id_of("tokenizer.ggml.bos_token_id")?;
        let eos = id_of("tokenizer.ggml.eos_token_id")?;
        let eot = id_of("tokenizer.ggml.eot_token_id")?;
        let eom = id_of("tokenizer.ggml.eom_token_id")?;
        let add_bos_default = model == "llama";
        let add_bos = meta
            .get("tokenizer.ggml.add_bos_token")
            .and_then(MetaValue::as_bool)
            .unwrap_or(add_bos_default);

        let mut vocab: Vocab = Vocab::default();
        for (i, t) in tokens.iter().enumerate() {
            // Duplicate strings exist in some vocabularies; the first id wins.
            vocab.entry(t.clone()).or_insert(i as u32);
        }
        let special: Vec<AddedToken> = tokens
            .iter()
            .zip(&types)
            .filter(|(_, &t)| t == TYPE_CONTROL || t == TYPE_USER_DEFINED)
            .map(|(s, &t)| AddedToken::from(s.clone(), t == TYPE_CONTROL))
            .collect();

        let (mut inner, token_bytes) = match model {
            "gpt2" => {
                let merges = parse_merges(meta)?;
                let bpe = BPE::builder()
                    .vocab_and_merges(vocab, merges)
                    .ignore_merges(false)
                    .build()
                    .map_err(|e| terr(format!("byte-level bpe: {e}")))?;
                let pre = meta
                    .get("tokenizer.ggml.pre")
                    .and_then(MetaValue::as_str)
                    .unwrap_or("default");
                let mut t = tokenizers::Tokenizer::new(bpe);
                t.with_pre_tokenizer(Some(byte_level_pre_tokenizer(pre)?));
                let map = byte_level_decoder();
                let bytes = tokens
                    .iter()
                    .zip(&types)
                    .map(|(s, &ty)| match ty {
                        TYPE_CONTROL => Vec::new(),
                        TYPE_USER_DEFINED => s.as_bytes().to_vec(),
                        _ => byte_level_bytes(s, &map),
                    })
                    .collect();
                (t, bytes)
            }
            "llama" => {
                let scores: Vec<f32> = match meta
                    .get("tokenizer.ggml.scores")
                    .and_then(MetaValue::as_array)
                {
                    Some(a) if a.len() == n => {
                        a.iter().map(|v| v.as_f64().unwrap_or(0.0) as f32).collect()
                    }
                    Some(a) => {
                        return Err(terr(format!(
                            "tokenizer.ggml.scores has {} entries for {n} tokens",
                            a.len()
                        )))
                    }
                    None => (0..n).map(|i| -(i as f32)).collect(),
                };
                let merges = sentencepiece_merges(&tokens, &types, &scores, &vocab);
                let unk =
                    id_of("tokenizer.ggml.unknown_token_id")?.map(|i| tokens[i as usize].clone());
                let mut builder = BPE::builder()
                    .vocab_and_merges(vocab, merges)
                    .byte_fallback(true)
                    .fuse_unk(true);
                if let Some(unk) = unk {
                    builder = builder.unk_token(unk);
                }
                let bpe = builder
                    .build()
                    .map_err(|e| terr(format!("sentencepiece bpe: {e}")))?;
                let mut t = tokenizers::Tokenizer::new(bpe);
                let add_space = meta
                    .get("tokenizer.ggml.add_space_prefix")
                    .and_then(MetaValue::as_bool)
                    .unwrap_or(true);
                let replace =
                    Replace::new(" ", "\u{2581}").map_err(|e| terr(format!("normalizer: {e}")))?;
                let mut norms: Vec<NormalizerWrapper> = Vec::new();
                if add_space {
                    norms.push(Prepend::new("\u{2581}".to_string()).into());
                }
                norms.push(replace.into());
                t.with_normalizer(Some(tokenizers::normalizers::Sequence::new(norms)))
                    .map_err(|e| terr(format!("normalizer: {e}")))?;
                let bytes = tokens
                    .iter()
                    .zip(&types)
                    .map(|(s, &ty)| match ty {
                        TYPE_CONTROL => Vec::new(),
                        TYPE_BYTE => sentencepiece_bytes(s),
                        TYPE_USER_DEFINED => s.as_bytes().to_vec(),
                        _ => sentencepiece_bytes(s),
                    })
                    .collect();
                (t, bytes)
            }
            other => return Err(terr(format!("unsupported tokenizer.ggml.model {other:?}"))),
        };
        inner
            .add_special_tokens(special)
            .map_err(|e| terr(format!("special tokens: {e}")))?;

        let mut eog: HashSet<u32> = [eos, eot, eom].into_iter().flatten().collect();
        for (i, (t, &ty)) in tokens.iter().zip(&types).enumerate() {
            if ty == TYPE_CONTROL && EOG_NAMES.contains(&t.as_str()) {
                eog.insert(i as u32);
            }
        }
        let text_of = |id: Option<u32>| id.map(|i| tokens[i as usize].clone()).unwrap_or_default();
        Ok(Tokenizer {
            inner,
            token_bytes,
            bos,
            eos,
            eog,
            add_bos,
            bos_text: text_of(bos),
            eos_text: text_of(eos),
        })
    }

    /// Loads `tokenizer.json`; `tokenizer_config` (the parsed
    /// `tokenizer_config.json`, if any) names BOS/EOS; `extra_eos` come from
    /// `config.json` / `generation_config.json`.
    pub fn from_json(
        json: &[u8],
        tokenizer_config: Option<&serde_json::Value>,
        extra_eos: &[u32],
    ) -> Result<Self, EngineError> {
        let inner = tokenizers::Tokenizer::from_bytes(json)
            .map_err(|e| terr(format!("tokenizer.json: {e}")))?;
        let parsed: serde_json::Value =
            serde_json::from_slice(json).map_err(|e| terr(format!("tokenizer.json: {e}")))?;
        let byte_level = parsed
            .get("decoder")
            .map(|d| d.to_string().contains("ByteLevel"))
            .unwrap_or(false);
        let vocab = inner.get_vocab(true);
        let n = inner.get_vocab_size(true);
        let mut token_bytes = vec![Vec::new(); n];
        let map = byte_level_decoder();
        let specials: HashSet<u32> = inner
            .get_added_tokens_decoder()
            .iter()
            .filter(|(_, t)| t.special)
            .map(|(id, _)| *id)
            .collect();
        for (s, &id) in &vocab {
            let Some(slot) = token_bytes.get_mut(id as usize) else {
                continue;
            };
            if specials.contains(&id) {
                continue;
            }
            *slot = if byte_level {
                byte_level_bytes(s, &map)
            } else {
                sentencepiece_bytes(s)
            };
        }
        let token_name = |key: &str| -> Option<String> {
            let v = tokenizer_config?.get(key)?;
            match v {
                serde_json::Value::String(s) => Some(s.clone()),
                serde_json::Value::Object(o) => o.get("content")?.as_str().map(str::to_string),
                _ => None,
            }
        };
        let bos_text = token_name("bos_token").unwrap_or_default();
        let eos_text = token_name("eos_token").unwrap_or_default();
        let bos = inner.token_to_id(&bos_text);
        let eos = inner.token_to_id(&eos_text);
        let add_bos = tokenizer_config
            .and_then(|c| c.get("add_bos_token"))
            .and_then(serde_json::Value::as_bool)
            .unwrap_or(false);
        let mut eog: HashSet<u32> = eos.into_iter().chain(extra_eos.iter().copied()).collect();
        for name in EOG_NAMES {
            if let Some(id) = inner.token_to_id(name) {
                if specials.contains(&id) {
                    eog.insert(id);
                }
            }
        }
        Ok(Tokenizer {
            inner,
            token_bytes,
            bos,
            eos,
            eog,
            add_bos,
            bos_text,
            eos_text,
        })
    }

    /// Number of ids.
    pub fn vocab_size(&self) -> usize {
        self.token_bytes.len()
    }

    /// Tokenizes `text` (special tokens in it are recognised), without BOS.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, EngineError> {
        let enc = self
            .inner
            .encode(text, false)
            .map_err(|e| terr(format!("encoding failed: {e}")))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Tokenizes a prompt: BOS first when the model wants one (and the text
    /// does not already start with it).
    pub fn encode_prompt(&self, text: &str) -> Result<Vec<u32>, EngineError> {
        let mut ids = Vec::new();
        if let Some(bos) = self.bos.filter(|_| self.add_bos) {
            if self.bos_text.is_empty() || !text.starts_with(&self.bos_text) {
                ids.push(bos);
            }
        }
        ids.extend(self.encode(text)?);
        Ok(ids)
    }

    /// How many token ids the vocabulary has (ids are below this).
    pub fn vocab_len(&self) -> usize {
        self.token_bytes.len()
    }

    /// The raw bytes of `id` (empty for control tokens and unknown ids).
    pub fn token_bytes(&self, id: u32) -> &[u8] {
        self.token_bytes.get(id as usize).map_or(&[], Vec::as_slice)
    }

    /// Decodes ids to text (invalid UTF-8 replaced).
    pub fn decode(&self, ids: &[u32]) -> String {
        let bytes: Vec<u8> = ids
            .iter()
            .flat_map(|&i| self.token_bytes(i).iter().copied())
            .collect();
        String::from_utf8_lossy(&bytes).into_owned()
    }
}

fn parse_merges(meta: &HashMap<String, MetaValue>) -> Result<Vec<(String, String)>, EngineError> {
    let merges = meta
        .get("tokenizer.ggml.merges")
        .and_then(MetaValue::as_array)
        .ok_or_else(|| terr("missing tokenizer.ggml.merges"))?;
    merges
        .iter()
        .enumerate()
        .map(|(i, m)| {
            let s = m
                .as_str()
                .ok_or_else(|| terr(format!("tokenizer.ggml.merges[{i}] is not a string")))?;
            let (a, b) = s
                .split_once(' ')
                .ok_or_else(|| terr(format!("tokenizer.ggml.merges[{i}] {s:?} has no space")))?;
            Ok((a.to_string(), b.to_string()))
        })
        .collect()
}

/// Merges of a SentencePiece BPE vocabulary: every way of writing a piece as
/// two pieces, best-scored result first (as Hugging Face's converter does).
fn sentencepiece_merges(
    tokens: &[String],
    types: &[i64],
    scores: &[f32],
    vocab: &Vocab,
) -> Vec<(String, String)> {
    let mut merges: Vec<(f32, u32, u32, u32, String, String)> = Vec::new();
    for (id, piece) in tokens.iter().enumerate() {
        if types[id] != TYPE_NORMAL || piece.chars().nth(1).is_none() {
            continue;
        }
        for (split, _) in piece.char_indices().skip(1) {
            let (l, r) = piece.split_at(split);
            if let (Some(&li), Some(&ri)) = (vocab.get(l), vocab.get(r)) {
                merges.push((scores[id], id as u32, li, ri, l.to_string(), r.to_string()));
            }
        }
    }
    merges.sort_by(|a, b| {
        b.0.total_cmp(&a.0)
            .then(a.1.cmp(&b.1))
            .then(a.2.cmp(&b.2))
            .then(a.3.cmp(&b.3))
    });
    merges.into_iter().map(|m| (m.4, m.5)).collect()
}

/// llama.cpp's split regexes for byte-level BPE, by `tokenizer.ggml.pre`.
fn byte_level_pre_tokenizer(pre: &str) -> Result<Sequence, EngineError> {
    const GPT2: &str =
        r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";
    const LLAMA3: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
    const QWEN2: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
    let split = |re: &str| -> Result<PreTokenizerWrapper, EngineError> {
        Ok(Split::new(
            SplitPattern::Regex(re.to_string()),
            SplitDelimiterBehavior::Isolated,
            false,
        )
        .map_err(|e| terr(format!("pre-tokenizer regex: {e}")))?
        .into())
    };
    let bytes = || PreTokenizerWrapper::from(ByteLevel::new(false, false, false));
    let parts: Vec<PreTokenizerWrapper> = match pre {
        // Digits one by one, then GPT-2's split (llama.cpp's SMOLLM/STARCODER family).
        "smollm" | "starcoder" | "refact" | "codeshell" | "command-r" => {
            vec![Digits::new(true).into(), split(GPT2)?, bytes()]
        }
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "pixtral" => {
            vec![split(LLAMA3)?, bytes()]
        }
        "qwen2" | "deepseek-r1-qwen" | "megrez" => vec![split(QWEN2)?, bytes()],
        _ => vec![split(GPT2)?, bytes()],
    };
    Ok(Sequence::new(parts))
}

/// Turns a stream of token bytes into a stream of complete UTF-8 text.
#[derive(Debug, Default)]
pub struct Detokenizer {
    pending: Vec<u8>,
}

impl Detokenizer {
    /// Adds a token's bytes; returns the text that became complete.
    pub fn push(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        let mut out = String::new();
        loop {
            match std::str::from_utf8(&self.pending) {
                Ok(s) => {
                    out.push_str(s);
                    self.pending.clear();
                    return out;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    // The prefix was just validated by from_utf8.
                    out.push_str(&String::from_utf8_lossy(&self.pending[..valid]));
                    match e.error_len() {
                        // An incomplete character at the end: wait for more bytes.
                        None => {
                            self.pending.drain(..valid);
                            return out;
                        }
                        // Bytes that can never be valid: replace and go on.
                        Some(bad) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            self.pending.drain(..valid + bad);
                        }
                    }
                }
            }
        }
    }

    /// Whatever is left (an unfinished character becomes U+FFFD).
    pub fn finish(&mut self) -> String {
        let s = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        s
    }
}
