//! The weight matmul: `y = x · Wᵀ (+ b)` for every projection in the model.
//!
//! Every weight multiplication of the model goes through [`Linear`], so a
//! faster kernel for a quantized format is swapped in here and nowhere else.
//! Quantized weights (GGUF Q4_0, Q4_1, Q8_0, K-quants) stay quantized and go
//! through candle's `QMatMul`; float weights (F32/F16/BF16) are kept as f32.
//!
//! # Invariants
//! - The weight is `[out_features, in_features]`; the input's last dimension is
//!   `in_features` (checked at construction against the model config).

use candle_core::quantized::{QMatMul, QTensor};
use candle_core::{DType, Module, Tensor};

use super::EngineError;

/// One projection with an optional bias.
#[derive(Debug, Clone)]
pub struct Linear {
    weight: QMatMul,
    bias: Option<Tensor>,
    out_features: usize,
    in_features: usize,
}

impl Linear {
    /// From a (possibly quantized) GGUF tensor.
    pub fn from_qtensor(weight: QTensor, bias: Option<Tensor>) -> Result<Self, EngineError> {
        let (out_features, in_features) = weight.shape().dims2()?;
        Ok(Linear {
            weight: QMatMul::from_qtensor(weight)?,
            bias,
            out_features,
            in_features,
        })
    }

    /// From a float tensor `[out, in]`; stored as f32.
    pub fn from_tensor(weight: Tensor, bias: Option<Tensor>) -> Result<Self, EngineError> {
        let (out_features, in_features) = weight.dims2()?;
        let weight = weight.to_dtype(DType::F32)?.contiguous()?;
        Ok(Linear {
            weight: QMatMul::Tensor(weight),
            bias,
            out_features,
            in_features,
        })
    }

    pub fn out_features(&self) -> usize {
        self.out_features
    }

    pub fn in_features(&self) -> usize {
        self.in_features
    }

    /// `x`: `[.., in_features]` f32 → `[.., out_features]`.
    pub fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let y = self.weight.forward(x)?;
        match &self.bias {
            Some(b) => y.broadcast_add(b),
            None => Ok(y),
        }
    }
}
