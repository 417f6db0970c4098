//! Named weights from a GGUF file or safetensors files, under GGUF names.
//!
//! The model asks for `blk.3.attn_q` and gets a [`Linear`] whatever the file
//! format: safetensors names (`model.layers.3.self_attn.q_proj`) are mapped
//! here. Every tensor's shape is checked against what the model config
//! expects before it is used.
//!
//! # Failure
//! [`EngineError::MissingTensor`] naming the tensor as the file would name it;
//! [`EngineError::TensorShape`] for a shape that does not match the config;
//! [`EngineError::UnsupportedTensorType`] for a dtype we cannot compute with.

use std::sync::Arc;

use candle_core::quantized::{GgmlDType, QMatMul};
use candle_core::safetensors::{Load, SliceSafetensors};
use candle_core::{DType, Device, Tensor};

use super::gguf::GgufFile;
use super::linear::Linear;
use super::EngineError;

/// Where the weights come from.
pub enum WeightSource<'a> {
    Gguf(&'a GgufFile),
    Safetensors(Vec<SliceSafetensors<'a>>),
}

/// The token embedding table, looked up row by row.
#[derive(Debug, Clone)]
pub enum Embedding {
    /// Quantized rows kept as raw ggml blocks, dequantized on lookup.
    Quantized {
        dtype: GgmlDType,
        bytes: Arc<Vec<u8>>,
        row_bytes: usize,
        dim: usize,
        rows: usize,
    },
    /// f32 `[rows, dim]`.
    Dense(Vec<f32>, usize),
}

impl Embedding {
    pub fn rows(&self) -> usize {
        match self {
            Embedding::Quantized { rows, .. } => *rows,
            Embedding::Dense(v, dim) => v.len() / dim,
        }
    }

    /// Rows for `ids` (each `< rows()`, checked by the caller), concatenated.
    pub fn lookup(&self, ids: &[u32]) -> Result<Vec<f32>, EngineError> {
        match self {
            Embedding::Dense(v, dim) => {
                let mut out = Vec::with_capacity(ids.len() * dim);
                for &id in ids {
                    let r = id as usize;
                    out.extend_from_slice(&v[r * dim..(r + 1) * dim]);
                }
                Ok(out)
            }
            Embedding::Quantized {
                dtype,
                bytes,
                row_bytes,
                dim,
                ..
            } => {
                let mut raw = Vec::with_capacity(ids.len() * row_bytes);
                for &id in ids {
                    let r = id as usize;
                    raw.extend_from_slice(&bytes[r * row_bytes..(r + 1) * row_bytes]);
                }
                let q = candle_core::quantized::ggml_file::qtensor_from_ggml(
                    *dtype,
                    &raw,
                    vec![ids.len(), *dim],
                    &Device::Cpu,
                )?;
                Ok(super::ops::to_vec(&q.dequantize(&Device::Cpu)?)?)
            }
        }
    }
}

/// GGUF name → safetensors (Hugging Face) name, without the `.weight`/`.bias` suffix.
fn hf_name(gguf: &str) -> String {
    match gguf {
        "token_embd" => return "model.embed_tokens".into(),
        "output_norm" => return "model.norm".into(),
        "output" => return "lm_head".into(),
        _ => {}
    }
    if let Some(rest) = gguf.strip_prefix("blk.") {
        if let Some((layer, part)) = rest.split_once('.') {
            let hf = match part {
                "attn_norm" => "input_layernorm",
                "ffn_norm" => "post_attention_layernorm",
                "attn_q" => "self_attn.q_proj",
                "attn_k" => "self_attn.k_proj",
                "attn_v" => "self_attn.v_proj",
                "attn_output" => "self_attn.o_proj",
                "attn_q_norm" => "self_attn.q_norm",
                "attn_k_norm" => "self_attn.k_norm",
                "ffn_gate" => "mlp.gate_proj",
                "ffn_up" => "mlp.up_proj",
                "ffn_down" => "mlp.down_proj",
                other => other,
            };
            return format!("model.layers.{layer}.{hf}");
        }
    }
    gguf.to_string()
}

fn check_shape(name: &str, actual: &[usize], expected: &[usize]) -> Result<(), EngineError> {
    if actual != expected {
        return Err(EngineError::TensorShape {
            name: name.to_string(),
            actual: actual.to_vec(),
            expected: expected.to_vec(),
        });
    }
    Ok(())
}

/// The GGUF tensor `name`, checked to have the `expected` shape.
fn gguf_entry<'g>(
    g: &'g GgufFile,
    name: &str,
    expected: &[usize],
) -> Result<&'g super::gguf::TensorEntry, EngineError> {
    let entry = g
        .tensors
        .get(name)
        .ok_or_else(|| EngineError::MissingTensor {
            name: name.to_owned(),
        })?;
    check_shape(name, &entry.shape, expected)?;
    Ok(entry)
}

impl WeightSource<'_> {
    /// The name the file uses for `base` + `suffix`.
    fn file_name(&self, base: &str, suffix: &str) -> String {
        match self {
            WeightSource::Gguf(_) => format!("{base}.{suffix}"),
            WeightSource::Safetensors(_) => format!("{}.{suffix}", hf_name(base)),
        }
    }

    pub fn has(&self, base: &str) -> bool {
        let name = self.file_name(base, "weight");
        match self {
            WeightSource::Gguf(g) => g.tensors.contains_key(&name),
            WeightSource::Safetensors(files) => files.iter().any(|f| f.get(&name).is_ok()),
        }
    }

    /// A float tensor from safetensors, shape-checked, as f32.
    fn st_tensor(
        files: &[SliceSafetensors<'_>],
        name: &str,
        expected: &[usize],
    ) -> Result<Tensor, EngineError> {
        let view = files.iter().find_map(|f| f.get(name).ok()).ok_or_else(|| {
            EngineError::MissingTensor {
                name: name.to_string(),
            }
        })?;
        check_shape(name, view.shape(), expected)?;
        let t = view.load(&Device::Cpu)?;
        match t.dtype() {
            DType::F32 | DType::F16 | DType::BF16 => Ok(t.to_dtype(DType::F32)?),
            other => Err(EngineError::UnsupportedTensorType {
                name: name.to_string(),
                dtype: format!("{other:?}"),
            }),
        }
    }

    /// A 1-D float vector (norm weights, biases) as f32.
    pub fn vector(&self, base: &str, suffix: &str, len: usize) -> Result<Vec<f32>, EngineError> {
        let name = self.file_name(base, suffix);
        let t = match self {
            WeightSource::Gguf(g) => {
                gguf_entry(g, &name, &[len])?;
                g.qtensor(&name)?.dequantize(&Device::Cpu)?
            }
            WeightSource::Safetensors(files) => Self::st_tensor(files, &name, &[len])?,
        };
        Ok(super::ops::to_vec(&t)?)
    }

    /// A projection `[out, in]` with an optional bias `[out]`.
    pub fn linear(
        &self,
        base: &str,
        out: usize,
        inp: usize,
        bias: bool,
    ) -> Result<Linear, EngineError> {
        let name = self.file_name(base, "weight");
        let bias = if bias {
            let b = self.vector(base, "bias", out)?;
            Some(Tensor::from_vec(b, out, &Device::Cpu)?)
        } else {
            None
        };
        match self {
            WeightSource::Gguf(g) => {
                gguf_entry(g, &name, &[out, inp])?;
                Linear::from_qtensor(g.qtensor(&name)?, bias)
            }
            WeightSource::Safetensors(files) => {
                Linear::from_tensor(Self::st_tensor(files, &name, &[out, inp])?, bias)
            }
        }
    }

    /// A projection `[out, in]` with an optional bias `[out]`, placed on
    /// `device` for the device engine (`super::device`): quantized GGUF
    /// weights stay quantized there (candle's `QMatMul`); float weights are
    /// f32 on the CPU and f16 on a GPU.
    pub fn device_linear(
        &self,
        base: &str,
        out: usize,
        inp: usize,
        bias: bool,
        device: &Device,
    ) -> Result<(QMatMul, Option<Tensor>), EngineError> {
        let name = self.file_name(base, "weight");
        let bias = if bias {
            let b = self.vector(base, "bias", out)?;
            Some(Tensor::from_vec(b, out, device)?)
        } else {
            None
        };
        let w = match self {
            WeightSource::Gguf(g) => {
                let entry = gguf_entry(g, &name, &[out, inp])?;
                QMatMul::from_qtensor(candle_core::quantized::ggml_file::qtensor_from_ggml(
                    entry.dtype,
                    g.tensor_bytes(entry),
                    entry.shape.clone(),
                    device,
                )?)?
            }
            WeightSource::Safetensors(files) => {
                let t = Self::st_tensor(files, &name, &[out, inp])?;
                if device.is_cpu() {
                    QMatMul::Tensor(t.to_device(device)?)
                } else {
                    QMatMul::TensorF16(t.to_dtype(DType::F16)?.to_device(device)?)
                }
            }
        };
        Ok((w, bias))
    }

    /// The embedding table `[rows, dim]`.
    pub fn embedding(&self, base: &str, rows: usize, dim: usize) -> Result<Embedding, EngineError> {
        let name = self.file_name(base, "weight");
        match self {
            WeightSource::Gguf(g) => {
                let entry = gguf_entry(g, &name, &[rows, dim])?;
                match entry.dtype {
                    GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16 => {
                        let t = g.qtensor(&name)?.dequantize(&Device::Cpu)?;
                        Ok(Embedding::Dense(super::ops::to_vec(&t)?, dim))
                    }
                    dtype => Ok(Embedding::Quantized {
                        dtype,
                        bytes: Arc::new(g.tensor_bytes(entry).to_vec()),
                        row_bytes: entry.len / rows,
                        dim,
                        rows,
                    }),
                }
            }
            WeightSource::Safetensors(files) => {
                let t = Self::st_tensor(files, &name, &[rows, dim])?;
                Ok(Embedding::Dense(super::ops::to_vec(&t)?, dim))
            }
        }
    }

    /// `n` experts' projections `[out, in]`, stacked in one GGUF tensor
    /// `[n, out, in]` (`blk.i.ffn_gate_exps`), one [`Linear`] each: an
    /// expert's rows are contiguous in the file, so each is cut out whole
    /// and keeps its type (quantized experts stay quantized).
    pub fn experts(
        &self,
        base: &str,
        n: usize,
        out: usize,
        inp: usize,
    ) -> Result<Vec<Linear>, EngineError> {
        let name = self.file_name(base, "weight");
        match self {
            WeightSource::Gguf(g) => {
                let entry = gguf_entry(g, &name, &[n, out, inp])?;
                if !inp.is_multiple_of(entry.dtype.block_size()) {
                    return Err(EngineError::Gguf(format!(
                        "{name}: rows of {inp} values are not whole {:?} blocks",
                        entry.dtype
                    )));
                }
                // The reader checked the length is whole blocks of `dtype`
                // for every element; experts are equal slices of it.
                let per = entry.len / n;
                let bytes = g.tensor_bytes(entry);
                (0..n)
                    .map(|e| {
                        let q = candle_core::quantized::ggml_file::qtensor_from_ggml(
                            entry.dtype,
                            &bytes[e * per..(e + 1) * per],
                            vec![out, inp],
                            &Device::Cpu,
                        )?;
                        Linear::from_qtensor(q, None)
                    })
                    .collect()
            }
            WeightSource::Safetensors(_) => Err(EngineError::UnsupportedArchitecture(
                "stacked experts from safetensors (use the GGUF file)".into(),
            )),
        }
    }

    /// An optional 1-D f32 tensor stored under its full name (e.g. `rope_freqs.weight`).
    pub fn optional_vector(
        &self,
        full_name: &str,
        len: usize,
    ) -> Result<Option<Vec<f32>>, EngineError> {
        match self {
            WeightSource::Gguf(g) => match g.tensors.get(full_name) {
                None => Ok(None),
                Some(entry) => {
                    check_shape(full_name, &entry.shape, &[len])?;
                    let t = g.qtensor(full_name)?.dequantize(&Device::Cpu)?;
                    Ok(Some(super::ops::to_vec(&t)?))
                }
            },
            WeightSource::Safetensors(_) => Ok(None),
        }
    }
}
