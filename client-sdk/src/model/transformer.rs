//! The transformer layers of a spec: learned position embeddings and a pre-norm decoder block
//! (causal multi-head self-attention and a GELU feed-forward net), as burn modules whose
//! parameter paths are the names `ModelSpec::schema` computes.

use burn::module::{Module, Param};
use burn::nn::{Dropout, DropoutConfig, Initializer, LayerNorm, LayerNormConfig};
use burn::tensor::activation::{gelu, softmax};
use burn::tensor::{Bool, Device, Tensor};

use super::Linear;

/// A learned vector per step, added to a `[batch, steps, features]` sequence.
#[derive(Module, Debug)]
pub struct PositionEmbedding {
    weight: Param<Tensor<2>>,
}

impl PositionEmbedding {
    /// Positions for `steps` steps of `features` features, unit-variance like token embeddings.
    pub fn new(steps: usize, features: usize, device: &Device) -> Self {
        let weight = Initializer::Normal { mean: 0.0, std: 1.0 }.init([steps, features], device);
        PositionEmbedding { weight }
    }

    /// `x` plus each step's position vector.
    pub fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        x + self.weight.val().unsqueeze_dim(0)
    }
}

/// A pre-norm transformer decoder block over `[batch, steps, width]`:
/// `x + attention(norm(x))`, then `x + ffn(norm(x))`. Step `t` attends to steps `0..=t` only.
/// Field order is parameter order: `ModelSpec::schema` lists the same names in the same order.
#[derive(Module, Debug)]
pub struct TransformerBlock {
    norm_attention: LayerNorm,
    query: Linear,
    key: Linear,
    value: Linear,
    output: Linear,
    norm_ffn: LayerNorm,
    ffn_inner: Linear,
    ffn_outer: Linear,
    dropout: Dropout,
    heads: usize,
}

impl TransformerBlock {
    /// A block of `width` features split over `heads` heads (the spec checked that they divide
    /// it), with a feed-forward net `ffn` wide; `lora` gives each linear map's adapters (rank,
    /// scale) by its field name, `None` for none.
    pub fn new(
        heads: usize,
        width: usize,
        ffn: usize,
        dropout: f64,
        lora: &dyn Fn(&str) -> Option<(usize, f64)>,
        device: &Device,
    ) -> Self {
        let linear = |name, fan_in, out| Linear::new(fan_in, out, lora(name), device);
        TransformerBlock {
            norm_attention: LayerNormConfig::new(width).init(device),
            query: linear("query", width, width),
            key: linear("key", width, width),
            value: linear("value", width, width),
            output: linear("output", width, width),
            norm_ffn: LayerNormConfig::new(width).init(device),
            ffn_inner: linear("ffn_inner", width, ffn),
            ffn_outer: linear("ffn_outer", ffn, width),
            dropout: DropoutConfig::new(dropout).init(),
            heads,
        }
    }

    /// The block applied to `x`, `[batch, steps, width]`.
    pub fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        let attended = self.attention(self.norm_attention.forward(x.clone()));
        let x = x + self.dropout.forward(attended);
        let hidden = gelu(self.ffn_inner.forward(self.norm_ffn.forward(x.clone())));
        x.clone() + self.dropout.forward(self.ffn_outer.forward(hidden))
    }

    /// Causal multi-head self-attention: softmax(QKᵀ/√d + mask)·V per head, heads concatenated
    /// and projected.
    fn attention(&self, x: Tensor<3>) -> Tensor<3> {
        let [batch, steps, width] = x.dims();
        let head_width = width / self.heads;
        // [batch, steps, width] → [batch, heads, steps, head_width]
        let split =
            |t: Tensor<3>| t.reshape([batch, steps, self.heads, head_width]).swap_dims(1, 2);
        let q = split(self.query.forward(x.clone()));
        let k = split(self.key.forward(x.clone()));
        let v = split(self.value.forward(x));
        let scores = q.matmul(k.swap_dims(2, 3)).div_scalar((head_width as f64).sqrt());
        // True above the diagonal: the steps after each query step, which it may not see.
        let future = Tensor::<2, Bool>::tril_mask([steps, steps], 0, &scores.device())
            .reshape([1, 1, steps, steps])
            .expand([batch, self.heads, steps, steps]);
        let weights = softmax(scores.mask_fill(future, f32::NEG_INFINITY), 3);
        let heads = weights.matmul(v).swap_dims(1, 2).reshape([batch, steps, width]);
        self.output.forward(heads)
    }
}
