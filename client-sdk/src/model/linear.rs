//! The spec's linear map, `x·W + b`, with LoRA adapters when the spec targets it:
//! `x·W + b + (alpha / rank)·(x·A)·B`. burn's own `Linear` has no place for adapters; this one
//! has its field names (`weight`, `bias`), so a model without LoRA has the same schema.

use burn::module::{Module, Param};
use burn::nn::Initializer;
use burn::tensor::{Device, Tensor};

/// A linear map, optionally adapted.
#[derive(Module, Debug)]
pub struct Linear {
    weight: Param<Tensor<2>>,
    bias: Param<Tensor<1>>,
    lora_a: Option<Param<Tensor<2>>>,
    lora_b: Option<Param<Tensor<2>>>,
    scale: f64,
}

impl Linear {
    /// A map from `fan_in` to `out` features, with adapters of `rank` scaled by `scale`
    /// (`alpha / rank`) when `lora` says so. Initialized as burn's `Linear` (`B` at zero).
    pub fn new(fan_in: usize, out: usize, lora: Option<(usize, f64)>, device: &Device) -> Self {
        let bound = (1.0 / fan_in as f64).sqrt();
        let uniform = Initializer::Uniform { min: -bound, max: bound };
        let (lora_a, lora_b, scale) = match lora {
            Some((rank, scale)) => (
                Some(uniform.init([fan_in, rank], device)),
                Some(Initializer::Zeros.init([rank, out], device)),
                scale,
            ),
            None => (None, None, 0.0),
        };
        Linear {
            weight: uniform.init([fan_in, out], device),
            bias: Initializer::Zeros.init([out], device),
            lora_a,
            lora_b,
            scale,
        }
    }

    /// The map on the last dimension of `x`.
    pub fn forward<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        let base =
            burn::tensor::module::linear(x.clone(), self.weight.val(), Some(self.bias.val()));
        match (&self.lora_a, &self.lora_b) {
            (Some(a), Some(b)) => {
                let low_rank = x.matmul(a.val().unsqueeze()).matmul(b.val().unsqueeze());
                base + low_rank.mul_scalar(self.scale)
            }
            _ => base,
        }
    }
}
