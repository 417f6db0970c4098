//! The weight matmul: `y = x · Wᵀ (+ b)` for every projection in the model.
//!
//! Every weight multiplication of the model goes through [`Linear`], so a
//! faster kernel for a quantized format is swapped in here and nowhere else.
//! GGUF Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K and Q6_K weights go through our
//! SIMD kernels ([`super::kernels::QuantLinear`]); other quantized weights
//! (Q5_1, Q2_K, Q3_K) stay quantized and go through candle's `QMatMul`; float
//! weights (F32/F16/BF16) are kept as f32.
//!
//! # Invariants
//! - The weight is `[out_features, in_features]`; the input's last dimension is
//!   `in_features` (checked at construction against the model config).

use std::sync::Arc;

use candle_core::quantized::{QMatMul, QTensor};
use candle_core::{DType, Module, Tensor};

use super::kernels::QuantLinear;
use super::profile::{self, Part};
use super::EngineError;

/// How the weight is multiplied.
#[derive(Debug, Clone)]
enum Weight {
    /// Blocks of a format our kernels take.
    Fast(QuantLinear),
    /// Anything else, through candle.
    Candle(QMatMul),
}

/// One projection with an optional bias.
#[derive(Debug, Clone)]
pub struct Linear {
    weight: Weight,
    /// The bias as f32 values.
    bias: Option<Vec<f32>>,
    out_features: usize,
    in_features: usize,
}

impl Linear {
    /// From a (possibly quantized) GGUF tensor.
    pub fn from_qtensor(weight: QTensor, bias: Option<Tensor>) -> Result<Self, EngineError> {
        let (out_features, in_features) = weight.shape().dims2()?;
        let weight = if QuantLinear::supports(weight.dtype())
            && in_features.is_multiple_of(weight.dtype().block_size())
        {
            Weight::Fast(
                QuantLinear::from_qtensor(Arc::new(weight)).map_err(candle_core::Error::wrap)?,
            )
        } else {
            Weight::Candle(QMatMul::from_qtensor(weight)?)
        };
        Ok(Linear {
            weight,
            bias: bias_values(&bias)?,
            out_features,
            in_features,
        })
    }

    /// From a float tensor `[out, in]`; stored as f32.
    pub fn from_tensor(weight: Tensor, bias: Option<Tensor>) -> Result<Self, EngineError> {
        let (out_features, in_features) = weight.dims2()?;
        let weight = weight.to_dtype(DType::F32)?.contiguous()?;
        Ok(Linear {
            weight: Weight::Candle(QMatMul::Tensor(weight)),
            bias: bias_values(&bias)?,
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

    /// `x`: `[rows][in_features]` → `[rows][out_features]`, on plain slices.
    /// The fast kernels run straight on `x` (no tensor is built), which is what
    /// single-token decoding needs: per call it allocates only the output.
    pub fn forward_slice(&self, x: &[f32], rows: usize) -> candle_core::Result<Vec<f32>> {
        profile::time(Part::Matmul, || self.forward_unprofiled(x, rows))
    }

    fn forward_unprofiled(&self, x: &[f32], rows: usize) -> candle_core::Result<Vec<f32>> {
        let n = self.out_features;
        let mut y = match &self.weight {
            Weight::Fast(w) => {
                let mut out = vec![0f32; rows * n];
                w.forward_local(x, rows, &mut out)
                    .map_err(candle_core::Error::wrap)?;
                out
            }
            Weight::Candle(w) => {
                let x = Tensor::from_slice(x, (rows, self.in_features), &candle_core::Device::Cpu)?;
                w.forward(&x)?.flatten_all()?.to_vec1::<f32>()?
            }
        };
        self.add_bias(&mut y);
        Ok(y)
    }

    fn add_bias(&self, y: &mut [f32]) {
        if let Some(b) = &self.bias {
            for row in y.chunks_exact_mut(self.out_features) {
                for (v, bi) in row.iter_mut().zip(b) {
                    *v += bi;
                }
            }
        }
    }

    /// [`Linear::forward_slice`] of several projections of the same input
    /// (q, k and v; gate and up): when our kernels run all of them, the
    /// input is quantized once for all, not once per projection. The
    /// results are the same either way.
    pub fn forward_shared<const N: usize>(
        ls: [&Linear; N],
        x: &[f32],
        rows: usize,
    ) -> candle_core::Result<[Vec<f32>; N]> {
        profile::time(Part::Matmul, || {
            let fast: Option<Vec<&QuantLinear>> = ls
                .iter()
                .map(|l| match &l.weight {
                    Weight::Fast(w) => Some(w),
                    Weight::Candle(_) => None,
                })
                .collect();
            let Some(fast) = fast else {
                let mut out: [Vec<f32>; N] = std::array::from_fn(|_| Vec::new());
                for (o, l) in out.iter_mut().zip(ls) {
                    *o = l.forward_unprofiled(x, rows)?;
                }
                return Ok(out);
            };
            let mut out: [Vec<f32>; N] =
                std::array::from_fn(|i| vec![0f32; rows * ls[i].out_features]);
            {
                let mut views: [&mut [f32]; N] = {
                    let mut it = out.iter_mut();
                    std::array::from_fn(|_| it.next().map_or(&mut [][..], |v| &mut v[..]))
                };
                QuantLinear::forward_shared(&fast, x, rows, &mut views)
                    .map_err(candle_core::Error::wrap)?;
            }
            for (o, l) in out.iter_mut().zip(ls) {
                l.add_bias(o);
            }
            Ok(out)
        })
    }
}

fn bias_values(bias: &Option<Tensor>) -> Result<Option<Vec<f32>>, EngineError> {
    Ok(match bias {
        Some(b) => Some(b.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?),
        None => None,
    })
}
