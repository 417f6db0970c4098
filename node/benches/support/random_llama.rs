//! A random-weight 1B-class Llama GGUF for the engine benchmark (included
//! with `#[path]`): Llama 3.2 1B's shape (hidden 2048, 16 layers, 32 heads,
//! 8 KV heads, feed-forward 8192) with SmolLM2's tokenizer (49,152 tokens,
//! copied from the test model's metadata, so both engines tokenize the
//! bench prompt the same way), 1.17 billion weights.
//!
//! Two quantizations: `Q8_0` everywhere, or `Q4_K_M` as llama.cpp's
//! quantizer mixes it (Q4_K, with Q6_K for the output head and for
//! `attn_v` / `ffn_down` of the first and last eighth of the layers and of
//! every third layer between). The file is written once into `models/`
//! (seeded, so every machine writes the same bytes) and reused.

use std::path::{Path, PathBuf};

use anyhow::Context;
use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use rand::{Rng, SeedableRng};

const HIDDEN: usize = 2048;
const LAYERS: usize = 16;
const HEADS: usize = 32;
const KV_HEADS: usize = 8;
const HEAD_DIM: usize = 64;
const FFN: usize = 8192;

/// `Q8_0` or `Q4_K_M`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mix {
    Q8_0,
    Q4KM,
}

impl Mix {
    fn label(self) -> &'static str {
        match self {
            Mix::Q8_0 => "q8_0",
            Mix::Q4KM => "q4_k_m",
        }
    }

    /// llama.cpp's `general.file_type`.
    fn file_type(self) -> u32 {
        match self {
            Mix::Q8_0 => 7,
            Mix::Q4KM => 15,
        }
    }

    /// The type of a matrix (`layer` for block tensors).
    fn dtype(self, name: &str, layer: Option<usize>) -> GgmlDType {
        match self {
            Mix::Q8_0 => GgmlDType::Q8_0,
            Mix::Q4KM => {
                // llama.cpp's `use_more_bits`.
                let more = |i: usize| {
                    !(LAYERS / 8..7 * LAYERS / 8).contains(&i) || (i - LAYERS / 8) % 3 == 2
                };
                let six = name == "output.weight"
                    || ((name.ends_with("attn_v.weight") || name.ends_with("ffn_down.weight"))
                        && layer.is_some_and(more));
                if six {
                    GgmlDType::Q6K
                } else {
                    GgmlDType::Q4K
                }
            }
        }
    }
}

/// The file for `mix`, written on first use from the tokenizer of `tokenizer_from`.
pub fn ensure(models: &Path, tokenizer_from: &Path, mix: Mix) -> anyhow::Result<PathBuf> {
    let path = models.join(format!("bench-llama-1b-random-{}.gguf", mix.label()));
    if path.exists() {
        return Ok(path);
    }
    eprintln!("writing {} (once; a minute or two)", path.display());
    let mut src = std::fs::File::open(tokenizer_from)
        .with_context(|| format!("opening {}", tokenizer_from.display()))?;
    let content = gguf_file::Content::read(&mut src)
        .with_context(|| format!("reading {}", tokenizer_from.display()))?;
    let vocab = match content.metadata.get("tokenizer.ggml.tokens") {
        Some(Value::Array(tokens)) => tokens.len(),
        _ => anyhow::bail!("{} has no token list", tokenizer_from.display()),
    };
    let mut meta: Vec<(String, Value)> = content
        .metadata
        .iter()
        .filter(|(k, _)| k.starts_with("tokenizer."))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    let a = |k: &str| format!("llama.{k}");
    meta.extend([
        ("general.architecture".into(), Value::String("llama".into())),
        (
            "general.name".into(),
            Value::String("random 1B llama".into()),
        ),
        ("general.file_type".into(), Value::U32(mix.file_type())),
        (a("block_count"), Value::U32(LAYERS as u32)),
        (a("context_length"), Value::U32(8192)),
        (a("embedding_length"), Value::U32(HIDDEN as u32)),
        (a("feed_forward_length"), Value::U32(FFN as u32)),
        (a("attention.head_count"), Value::U32(HEADS as u32)),
        (a("attention.head_count_kv"), Value::U32(KV_HEADS as u32)),
        (a("rope.freq_base"), Value::F32(500_000.0)),
        (a("rope.dimension_count"), Value::U32(HEAD_DIM as u32)),
        (a("attention.layer_norm_rms_epsilon"), Value::F32(1e-5)),
        (a("vocab_size"), Value::U32(vocab as u32)),
    ]);
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1);
    let mut tensors: Vec<(String, QTensor)> = Vec::new();
    let mut put = |name: String, shape: &[usize], layer: Option<usize>| -> anyhow::Result<()> {
        let n: usize = shape.iter().product();
        let (center, spread, dtype) = if shape.len() == 1 {
            (1.0f32, 0.05f32, GgmlDType::F32)
        } else {
            (0.0, 0.04, mix.dtype(&name, layer))
        };
        let data: Vec<f32> = (0..n)
            .map(|_| center + rng.gen_range(-spread..spread))
            .collect();
        let t = Tensor::from_vec(data, shape, &Device::Cpu)?;
        tensors.push((name, QTensor::quantize(&t, dtype)?));
        Ok(())
    };
    put("token_embd.weight".into(), &[vocab, HIDDEN], None)?;
    for i in 0..LAYERS {
        let p = |s: &str| format!("blk.{i}.{s}.weight");
        put(p("attn_norm"), &[HIDDEN], Some(i))?;
        put(p("attn_q"), &[HEADS * HEAD_DIM, HIDDEN], Some(i))?;
        put(p("attn_k"), &[KV_HEADS * HEAD_DIM, HIDDEN], Some(i))?;
        put(p("attn_v"), &[KV_HEADS * HEAD_DIM, HIDDEN], Some(i))?;
        put(p("attn_output"), &[HIDDEN, HEADS * HEAD_DIM], Some(i))?;
        put(p("ffn_norm"), &[HIDDEN], Some(i))?;
        put(p("ffn_gate"), &[FFN, HIDDEN], Some(i))?;
        put(p("ffn_up"), &[FFN, HIDDEN], Some(i))?;
        put(p("ffn_down"), &[HIDDEN, FFN], Some(i))?;
    }
    put("output_norm.weight".into(), &[HIDDEN], None)?;
    put("output.weight".into(), &[vocab, HIDDEN], None)?;
    let tmp = path.with_extension("gguf.tmp");
    {
        let meta_refs: Vec<(&str, &Value)> = meta.iter().map(|(k, v)| (k.as_str(), v)).collect();
        let tensor_refs: Vec<(&str, &QTensor)> =
            tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
        let mut f = std::io::BufWriter::new(
            std::fs::File::create(&tmp).with_context(|| format!("creating {}", tmp.display()))?,
        );
        gguf_file::write(&mut f, &meta_refs, &tensor_refs)?;
        std::io::Write::flush(&mut f)?;
    }
    std::fs::rename(&tmp, &path)?;
    Ok(path)
}
