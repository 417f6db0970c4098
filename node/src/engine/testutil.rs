//! Writers of small random-weight model files for fast tests: GGUF (every
//! supported tensor type, every architecture, Qwen3-MoE's stacked experts)
//! and safetensors directories (config.json, tokenizer.json, f32/f16/bf16
//! weights).
//!
//! Weights are drawn from a ChaCha generator with a fixed seed, in Hugging
//! Face layout; the GGUF writer permutes the q/k rows of "llama" files exactly
//! as llama.cpp's converter does, so a GGUF and a safetensors file written
//! from the same spec compute the same function.

use std::collections::BTreeMap;
use std::path::Path;

use candle_core::quantized::gguf_file::Value;
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// The routed experts of a tiny `qwen3moe` model (each expert's MLP is
/// [`TinySpec::ffn`] wide).
#[derive(Debug, Clone, PartialEq)]
pub struct MoeSpec {
    pub experts: usize,
    /// Experts chosen per token.
    pub used: usize,
    /// Every expert is the MLP a `qwen3` spec of the same sizes and seed
    /// draws for that layer (so with normalised weights the MoE file
    /// computes what that dense file computes); otherwise each expert is
    /// drawn on its own.
    pub identical: bool,
}

/// Shape and kind of a tiny model.
#[derive(Debug, Clone)]
pub struct TinySpec {
    /// "llama", "mistral", "qwen2", "qwen3", "qwen3moe" or "gemma3" (GGUF
    /// writes mistral as llama).
    pub arch: &'static str,
    pub hidden: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub ffn: usize,
    pub context: usize,
    pub tied: bool,
    pub seed: u64,
    /// Gemma 3: sliding window and local/global pattern written to the file.
    pub sliding_window: Option<(usize, usize)>,
    /// `qwen3moe`: the experts (None for the dense architectures).
    pub moe: Option<MoeSpec>,
}

impl TinySpec {
    /// A model every quantized type can hold (sizes are multiples of 256).
    /// Gemma 3 ties its output head and windows both layers by 4 positions;
    /// `qwen3moe` has 8 experts of width 128 (a multiple of the 32-value
    /// blocks, not of the K-quants' 256), 2 used per token.
    pub fn new(arch: &'static str) -> Self {
        let gemma = arch == "gemma3";
        let moe = arch == "qwen3moe";
        TinySpec {
            arch,
            hidden: 256,
            layers: 2,
            heads: 4,
            kv_heads: 2,
            head_dim: 64,
            ffn: if moe { 128 } else { 512 },
            context: 128,
            tied: gemma,
            seed: 7,
            sliding_window: gemma.then_some((4, 6)),
            moe: moe.then_some(MoeSpec {
                experts: 8,
                used: 2,
                identical: false,
            }),
        }
    }
}

/// Special tokens of the tiny vocabulary (ids 0, 1, 2).
pub const SPECIALS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];
/// Merges of the tiny byte-level vocabulary.
const MERGES: [(&str, &str); 5] = [("h", "e"), ("l", "l"), ("he", "ll"), ("Ġ", "w"), ("o", "r")];
pub const CHATML: &str = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

/// GPT-2's byte → printable char map.
fn byte_chars() -> Vec<char> {
    let mut out = vec!['\0'; 256];
    let mut n = 0u32;
    for b in 0u32..=255 {
        let printable =
            (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
        let c = if printable {
            b
        } else {
            n += 1;
            256 + n - 1
        };
        out[b as usize] = char::from_u32(c).unwrap_or('?');
    }
    out
}

/// The tiny byte-level vocabulary: specials, 256 bytes, merged tokens.
pub fn tiny_vocab() -> Vec<String> {
    let mut v: Vec<String> = SPECIALS.iter().map(|s| s.to_string()).collect();
    v.extend(byte_chars().into_iter().map(String::from));
    v.extend(MERGES.iter().map(|(a, b)| format!("{a}{b}")));
    v
}

fn rand_tensor(rng: &mut ChaCha8Rng, shape: &[usize], center: f32, spread: f32) -> Tensor {
    let n: usize = shape.iter().product();
    let data: Vec<f32> = (0..n)
        .map(|_| center + rng.gen_range(-spread..spread))
        .collect();
    Tensor::from_vec(data, shape, &Device::Cpu).unwrap()
}

/// Random weights under Hugging Face names, in Hugging Face layout.
pub fn hf_weights(spec: &TinySpec) -> BTreeMap<String, Tensor> {
    let mut w = BTreeMap::new();
    each_hf_weight(spec, &mut |name, t| {
        w.insert(name, t);
    });
    w
}

/// The weights of [`hf_weights`], handed to `f` one at a time as they are
/// drawn (so a large model never holds all its f32 weights at once).
///
/// A `qwen3moe` spec draws everything a `qwen3` spec of the same sizes and
/// seed draws, in the same order from the same generator (its dense MLP
/// included, which becomes every expert when [`MoeSpec::identical`]); the
/// router and independent experts come from a second generator, so the two
/// files share their attention, norms and embeddings.
pub fn each_hf_weight(spec: &TinySpec, f: &mut dyn FnMut(String, Tensor)) {
    let mut rng = ChaCha8Rng::seed_from_u64(spec.seed);
    let mut moe_rng = ChaCha8Rng::seed_from_u64(spec.seed ^ 0x6d6f_655f_7267);
    let vocab = tiny_vocab().len();
    let (h, hd, ff) = (spec.hidden, spec.head_dim, spec.ffn);
    let put = |f: &mut dyn FnMut(String, Tensor),
               rng: &mut ChaCha8Rng,
               name: String,
               shape: &[usize],
               center: f32,
               spread: f32| {
        f(name, rand_tensor(rng, shape, center, spread));
    };
    put(
        f,
        &mut rng,
        "model.embed_tokens.weight".into(),
        &[vocab, h],
        0.0,
        0.5,
    );
    for i in 0..spec.layers {
        let p = format!("model.layers.{i}");
        put(
            f,
            &mut rng,
            format!("{p}.input_layernorm.weight"),
            &[h],
            1.0,
            0.1,
        );
        put(
            f,
            &mut rng,
            format!("{p}.post_attention_layernorm.weight"),
            &[h],
            1.0,
            0.1,
        );
        put(
            f,
            &mut rng,
            format!("{p}.self_attn.q_proj.weight"),
            &[spec.heads * hd, h],
            0.0,
            0.1,
        );
        put(
            f,
            &mut rng,
            format!("{p}.self_attn.k_proj.weight"),
            &[spec.kv_heads * hd, h],
            0.0,
            0.1,
        );
        put(
            f,
            &mut rng,
            format!("{p}.self_attn.v_proj.weight"),
            &[spec.kv_heads * hd, h],
            0.0,
            0.1,
        );
        put(
            f,
            &mut rng,
            format!("{p}.self_attn.o_proj.weight"),
            &[h, spec.heads * hd],
            0.0,
            0.1,
        );
        match &spec.moe {
            None => {
                put(
                    f,
                    &mut rng,
                    format!("{p}.mlp.gate_proj.weight"),
                    &[ff, h],
                    0.0,
                    0.1,
                );
                put(
                    f,
                    &mut rng,
                    format!("{p}.mlp.up_proj.weight"),
                    &[ff, h],
                    0.0,
                    0.1,
                );
                put(
                    f,
                    &mut rng,
                    format!("{p}.mlp.down_proj.weight"),
                    &[h, ff],
                    0.0,
                    0.1,
                );
            }
            Some(moe) => {
                let shapes = [
                    ("gate_proj", [ff, h]),
                    ("up_proj", [ff, h]),
                    ("down_proj", [h, ff]),
                ];
                // The dense MLP a qwen3 spec draws here (keeps the two in step).
                let dense: Vec<Tensor> = shapes
                    .iter()
                    .map(|(_, shape)| rand_tensor(&mut rng, shape, 0.0, 0.1))
                    .collect();
                let router = rand_tensor(&mut moe_rng, &[moe.experts, h], 0.0, 0.1);
                f(format!("{p}.mlp.gate.weight"), router);
                for e in 0..moe.experts {
                    for ((name, shape), d) in shapes.iter().zip(&dense) {
                        let t = if moe.identical {
                            d.clone()
                        } else {
                            rand_tensor(&mut moe_rng, shape, 0.0, 0.1)
                        };
                        f(format!("{p}.mlp.experts.{e}.{name}.weight"), t);
                    }
                }
            }
        }
        if spec.arch == "qwen2" {
            put(
                f,
                &mut rng,
                format!("{p}.self_attn.q_proj.bias"),
                &[spec.heads * hd],
                0.0,
                0.1,
            );
            put(
                f,
                &mut rng,
                format!("{p}.self_attn.k_proj.bias"),
                &[spec.kv_heads * hd],
                0.0,
                0.1,
            );
            put(
                f,
                &mut rng,
                format!("{p}.self_attn.v_proj.bias"),
                &[spec.kv_heads * hd],
                0.0,
                0.1,
            );
        }
        if matches!(spec.arch, "qwen3" | "qwen3moe" | "gemma3") {
            put(
                f,
                &mut rng,
                format!("{p}.self_attn.q_norm.weight"),
                &[hd],
                1.0,
                0.1,
            );
            put(
                f,
                &mut rng,
                format!("{p}.self_attn.k_norm.weight"),
                &[hd],
                1.0,
                0.1,
            );
        }
        if spec.arch == "gemma3" {
            // Test-only names for Gemma's two extra norms (GGUF is the only
            // Gemma form read).
            put(
                f,
                &mut rng,
                format!("{p}.gemma_post_attn_norm.weight"),
                &[h],
                1.0,
                0.1,
            );
            put(
                f,
                &mut rng,
                format!("{p}.gemma_post_ffw_norm.weight"),
                &[h],
                1.0,
                0.1,
            );
        }
    }
    put(f, &mut rng, "model.norm.weight".into(), &[h], 1.0, 0.1);
    if !spec.tied {
        put(f, &mut rng, "lm_head.weight".into(), &[vocab, h], 0.0, 0.1);
    }
}

/// llama.cpp's `permute` of q/k rows: each head's two halves interleaved.
fn permute_rows(t: &Tensor, heads: usize) -> Tensor {
    let (rows, cols) = t.dims2().unwrap();
    let hd = rows / heads;
    t.reshape((heads, 2, hd / 2, cols))
        .unwrap()
        .transpose(1, 2)
        .unwrap()
        .reshape((rows, cols))
        .unwrap()
        .contiguous()
        .unwrap()
}

fn gguf_name(hf: &str) -> String {
    let hf = hf.to_string();
    let (base, suffix) = hf.rsplit_once('.').unwrap();
    let g = match base {
        "model.embed_tokens" => "token_embd".to_string(),
        "model.norm" => "output_norm".to_string(),
        "lm_head" => "output".to_string(),
        _ => {
            let rest = base.strip_prefix("model.layers.").unwrap();
            let (i, part) = rest.split_once('.').unwrap();
            let g = match part {
                "input_layernorm" => "attn_norm",
                "post_attention_layernorm" => "ffn_norm",
                "self_attn.q_proj" => "attn_q",
                "self_attn.k_proj" => "attn_k",
                "self_attn.v_proj" => "attn_v",
                "self_attn.o_proj" => "attn_output",
                "self_attn.q_norm" => "attn_q_norm",
                "self_attn.k_norm" => "attn_k_norm",
                "mlp.gate_proj" => "ffn_gate",
                "mlp.up_proj" => "ffn_up",
                "mlp.down_proj" => "ffn_down",
                "mlp.gate" => "ffn_gate_inp",
                "gemma_post_attn_norm" => "post_attention_norm",
                "gemma_post_ffw_norm" => "post_ffw_norm",
                other => panic!("unknown {other}"),
            };
            format!("blk.{i}.{g}")
        }
    };
    format!("{g}.{suffix}")
}

/// What to change when writing a GGUF file (for corrupt-file tests, and
/// wrong weights that a tolerance must reject). Tensor names are GGUF names.
#[derive(Debug, Clone, Default)]
pub struct GgufTweaks {
    pub architecture: Option<String>,
    pub drop_tensor: Option<String>,
    /// This matrix's rows in a (seeded) random order.
    pub shuffle_rows: Option<String>,
    /// This matrix times a factor: a wrong scale.
    pub scale: Option<(String, f32)>,
    /// Every matrix quantized to this type and back to f32 before it is
    /// written: an f32 file holding exactly the values a file of that type
    /// holds (the exact function a quantized file stands for).
    pub roundtrip: Option<GgmlDType>,
    /// Metadata written after the spec's own, replacing a key of the same
    /// name (malformed-metadata tests).
    pub meta: Vec<(String, Value)>,
    /// Metadata keys left out.
    pub drop_meta: Vec<String>,
}

/// The expert index and GGUF stacked name of a Hugging Face expert weight
/// (`model.layers.3.mlp.experts.5.up_proj.weight` -> 5, `blk.3.ffn_up_exps.weight`).
fn expert_name(hf: &str) -> Option<(usize, String)> {
    let rest = hf.strip_prefix("model.layers.")?;
    let (layer, rest) = rest.split_once(".mlp.experts.")?;
    let (e, proj) = rest.split_once('.')?;
    let g = match proj {
        "gate_proj.weight" => "ffn_gate_exps",
        "up_proj.weight" => "ffn_up_exps",
        "down_proj.weight" => "ffn_down_exps",
        _ => return None,
    };
    Some((e.parse().ok()?, format!("blk.{layer}.{g}.weight")))
}

/// `t` quantized to `dtype` and back to f32.
pub fn roundtrip(t: &Tensor, dtype: GgmlDType) -> Tensor {
    QTensor::quantize(t, dtype)
        .unwrap()
        .dequantize(&Device::Cpu)
        .unwrap()
}

/// `t`'s rows in a random order fixed by `seed`.
pub fn shuffle_rows(t: &Tensor, seed: u64) -> Tensor {
    use rand::seq::SliceRandom;
    let rows = t.dims()[0];
    let mut order: Vec<u32> = (0..rows as u32).collect();
    order.shuffle(&mut ChaCha8Rng::seed_from_u64(seed));
    let index = Tensor::from_vec(order, rows, t.device()).unwrap();
    t.index_select(&index, 0).unwrap()
}

/// Writes a GGUF file of `spec` with matrices stored as `dtype` (norms and
/// biases stay F32, as llama.cpp stores them).
pub fn write_gguf(path: &Path, spec: &TinySpec, dtype: GgmlDType, tweaks: &GgufTweaks) {
    let gguf_arch = if spec.arch == "mistral" {
        "llama"
    } else {
        spec.arch
    };
    let arch = tweaks
        .architecture
        .clone()
        .unwrap_or_else(|| gguf_arch.to_string());
    let vocab = tiny_vocab();
    let mut types = vec![Value::I32(3); SPECIALS.len()];
    types.extend(std::iter::repeat_n(
        Value::I32(1),
        vocab.len() - SPECIALS.len(),
    ));
    let a = |k: &str| format!("{arch}.{k}");
    let meta: Vec<(String, Value)> = vec![
        ("general.architecture".into(), Value::String(arch.clone())),
        (a("block_count"), Value::U32(spec.layers as u32)),
        (a("context_length"), Value::U32(spec.context as u32)),
        (a("embedding_length"), Value::U32(spec.hidden as u32)),
        (a("feed_forward_length"), Value::U32(spec.ffn as u32)),
        (a("attention.head_count"), Value::U32(spec.heads as u32)),
        (
            a("attention.head_count_kv"),
            Value::U32(spec.kv_heads as u32),
        ),
        (a("attention.key_length"), Value::U32(spec.head_dim as u32)),
        (a("rope.freq_base"), Value::F32(10_000.0)),
        (a("attention.layer_norm_rms_epsilon"), Value::F32(1e-5)),
        ("tokenizer.ggml.model".into(), Value::String("gpt2".into())),
        ("tokenizer.ggml.pre".into(), Value::String("smollm".into())),
        (
            "tokenizer.ggml.tokens".into(),
            Value::Array(vocab.iter().cloned().map(Value::String).collect()),
        ),
        ("tokenizer.ggml.token_type".into(), Value::Array(types)),
        (
            "tokenizer.ggml.merges".into(),
            Value::Array(
                MERGES
                    .iter()
                    .map(|(a, b)| Value::String(format!("{a} {b}")))
                    .collect(),
            ),
        ),
        ("tokenizer.ggml.bos_token_id".into(), Value::U32(1)),
        ("tokenizer.ggml.eos_token_id".into(), Value::U32(2)),
        ("tokenizer.ggml.add_bos_token".into(), Value::Bool(false)),
        (
            "tokenizer.chat_template".into(),
            Value::String(CHATML.into()),
        ),
    ];
    let mut meta = meta;
    if let Some(moe) = &spec.moe {
        meta.push((a("expert_count"), Value::U32(moe.experts as u32)));
        meta.push((a("expert_used_count"), Value::U32(moe.used as u32)));
        meta.push((a("expert_feed_forward_length"), Value::U32(spec.ffn as u32)));
    }
    for (k, v) in &tweaks.meta {
        meta.retain(|(have, _)| have != k);
        meta.push((k.clone(), v.clone()));
    }
    meta.retain(|(k, _)| !tweaks.drop_meta.contains(k));
    if let Some((window, pattern)) = spec.sliding_window {
        meta.push((a("attention.sliding_window"), Value::U32(window as u32)));
        meta.push((
            a("attention.sliding_window_pattern"),
            Value::U32(pattern as u32),
        ));
    }
    // Quantized as drawn; written in Hugging Face name order.
    let mut tensors: Vec<(String, String, QTensor)> = Vec::new();
    // Experts of each stacked tensor, until the last one is drawn.
    let mut stacking: BTreeMap<String, Vec<Tensor>> = BTreeMap::new();
    each_hf_weight(spec, &mut |name, t| {
        let (name, t, g) = match expert_name(&name) {
            None => {
                let g = gguf_name(&name);
                (name, t, g)
            }
            Some((e, g)) => {
                let experts = stacking.entry(g.clone()).or_default();
                experts.push(t);
                if e + 1 < spec.moe.as_ref().map_or(0, |m| m.experts) {
                    return;
                }
                let stacked = Tensor::stack(&std::mem::take(experts), 0).unwrap();
                (g.clone(), stacked, g)
            }
        };
        if tweaks.drop_tensor.as_deref() == Some(g.as_str()) {
            return;
        }
        let t = if tweaks.shuffle_rows.as_deref() == Some(g.as_str()) {
            shuffle_rows(&t, spec.seed)
        } else {
            t
        };
        let t = match &tweaks.scale {
            Some((name, factor)) if name == &g => t.affine(f64::from(*factor), 0.0).unwrap(),
            _ => t,
        };
        let t = if gguf_arch == "llama" && name.ends_with("q_proj.weight") {
            permute_rows(&t, spec.heads)
        } else if gguf_arch == "llama" && name.ends_with("k_proj.weight") {
            permute_rows(&t, spec.kv_heads)
        } else {
            t
        };
        // Norms, biases and routers stay F32, as llama.cpp stores them.
        let q = if t.rank() == 1 || g.contains("ffn_gate_inp") {
            QTensor::quantize(&t, GgmlDType::F32).unwrap()
        } else if let Some(through) = tweaks.roundtrip {
            QTensor::quantize(&roundtrip(&t, through), dtype).unwrap()
        } else {
            QTensor::quantize(&t, dtype).unwrap()
        };
        tensors.push((name, g, q));
    });
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    let meta_refs: Vec<(&str, &Value)> = meta.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let tensor_refs: Vec<(&str, &QTensor)> =
        tensors.iter().map(|(_, k, v)| (k.as_str(), v)).collect();
    let mut f = std::io::BufWriter::new(std::fs::File::create(path).unwrap());
    candle_core::quantized::gguf_file::write(&mut f, &meta_refs, &tensor_refs).unwrap();
    std::io::Write::flush(&mut f).unwrap();
}

/// The tiny vocabulary as a `tokenizer.json`.
pub fn tokenizer_json() -> String {
    let vocab = tiny_vocab();
    let vocab_map: serde_json::Map<String, serde_json::Value> = vocab
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), serde_json::json!(i)))
        .collect();
    let added: Vec<serde_json::Value> = SPECIALS
        .iter()
        .enumerate()
        .map(|(i, s)| {
            serde_json::json!({"id": i, "content": s, "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": false, "special": true})
        })
        .collect();
    serde_json::json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
            "vocab": vocab_map,
            "merges": MERGES.iter().map(|(a, b)| format!("{a} {b}")).collect::<Vec<_>>()}
    })
    .to_string()
}

/// Writes a safetensors model directory (config.json, tokenizer.json,
/// tokenizer_config.json, model.safetensors) with weights stored as `dtype`.
/// `drop` leaves out one tensor (Hugging Face name).
pub fn write_safetensors(dir: &Path, spec: &TinySpec, dtype: DType, drop: Option<&str>) {
    write_safetensors_through(dir, spec, dtype, drop, dtype);
}

/// [`write_safetensors`] in f32 of the weights rounded to `through` (f16,
/// bf16): exactly the values a `through` file holds.
pub fn write_safetensors_rounded(dir: &Path, spec: &TinySpec, through: DType) {
    write_safetensors_through(dir, spec, DType::F32, None, through);
}

fn write_safetensors_through(
    dir: &Path,
    spec: &TinySpec,
    dtype: DType,
    drop: Option<&str>,
    through: DType,
) {
    std::fs::create_dir_all(dir).unwrap();
    let weights: BTreeMap<String, Tensor> = hf_weights(spec)
        .into_iter()
        .filter(|(k, _)| Some(k.as_str()) != drop)
        .map(|(k, t)| (k, t.to_dtype(through).unwrap().to_dtype(dtype).unwrap()))
        .collect();
    candle_core::safetensors::save(
        &weights.into_iter().collect(),
        dir.join("model.safetensors"),
    )
    .unwrap();
    let config = serde_json::json!({
        "model_type": spec.arch,
        "hidden_size": spec.hidden,
        "intermediate_size": spec.ffn,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "head_dim": spec.head_dim,
        "vocab_size": tiny_vocab().len(),
        "max_position_embeddings": spec.context,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": spec.tied,
        "eos_token_id": 2,
    });
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    std::fs::write(dir.join("tokenizer.json"), tokenizer_json()).unwrap();
    let tok_config = serde_json::json!({
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "add_bos_token": false,
        "chat_template": CHATML,
    });
    std::fs::write(dir.join("tokenizer_config.json"), tok_config.to_string()).unwrap();
}

/// A SentencePiece ("llama" tokenizer model) GGUF with a tiny vocabulary.
pub fn write_spm_gguf(path: &Path) {
    let spec = TinySpec::new("llama");
    let mut tokens: Vec<String> = vec!["<unk>".into(), "<s>".into(), "</s>".into()];
    let mut types = vec![Value::I32(2), Value::I32(3), Value::I32(3)];
    for b in 0..=255u8 {
        tokens.push(format!("<0x{b:02X}>"));
        types.push(Value::I32(6));
    }
    let pieces = [
        "\u{2581}",
        "h",
        "e",
        "l",
        "o",
        "w",
        "r",
        "d",
        "he",
        "ll",
        "\u{2581}h",
        "\u{2581}w",
        "or",
        "ld",
        "hell",
        "\u{2581}hell",
        "\u{2581}hello",
        "\u{2581}wor",
        "\u{2581}world",
    ];
    for p in pieces {
        tokens.push(p.to_string());
        types.push(Value::I32(1));
    }
    // Longer pieces score higher, so they are merged first.
    let scores: Vec<Value> = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| {
            Value::F32(if i < 259 {
                0.0
            } else {
                t.chars().count() as f32 - i as f32 * 1e-3
            })
        })
        .collect();
    let vocab_len = tokens.len();
    let meta: Vec<(String, Value)> = vec![
        ("general.architecture".into(), Value::String("llama".into())),
        ("llama.block_count".into(), Value::U32(spec.layers as u32)),
        (
            "llama.context_length".into(),
            Value::U32(spec.context as u32),
        ),
        (
            "llama.embedding_length".into(),
            Value::U32(spec.hidden as u32),
        ),
        (
            "llama.feed_forward_length".into(),
            Value::U32(spec.ffn as u32),
        ),
        (
            "llama.attention.head_count".into(),
            Value::U32(spec.heads as u32),
        ),
        (
            "llama.attention.head_count_kv".into(),
            Value::U32(spec.kv_heads as u32),
        ),
        ("tokenizer.ggml.model".into(), Value::String("llama".into())),
        (
            "tokenizer.ggml.tokens".into(),
            Value::Array(tokens.into_iter().map(Value::String).collect()),
        ),
        ("tokenizer.ggml.token_type".into(), Value::Array(types)),
        ("tokenizer.ggml.scores".into(), Value::Array(scores)),
        ("tokenizer.ggml.bos_token_id".into(), Value::U32(1)),
        ("tokenizer.ggml.eos_token_id".into(), Value::U32(2)),
        ("tokenizer.ggml.unknown_token_id".into(), Value::U32(0)),
    ];
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    let mut tensors: Vec<(String, QTensor)> = Vec::new();
    for (name, t) in hf_weights(&spec) {
        let shape = t.dims().to_vec();
        let shape = if name.contains("embed_tokens") || name.starts_with("lm_head") {
            vec![vocab_len, shape[1]]
        } else {
            shape
        };
        let t = rand_tensor(
            &mut rng,
            &shape,
            if shape.len() == 1 { 1.0 } else { 0.0 },
            0.1,
        );
        tensors.push((
            gguf_name(&name),
            QTensor::quantize(&t, GgmlDType::F32).unwrap(),
        ));
    }
    let meta_refs: Vec<(&str, &Value)> = meta.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let tensor_refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let mut f = std::fs::File::create(path).unwrap();
    candle_core::quantized::gguf_file::write(&mut f, &meta_refs, &tensor_refs).unwrap();
}
