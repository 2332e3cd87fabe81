//! The transformer layers of a spec: learned position embeddings, a pre-norm decoder block
//! (causal multi-head self-attention and a GELU feed-forward net: GPT-2's), RMS norm and
//! Llama's block (rotary positions, grouped-query attention, SwiGLU), as burn modules whose
//! parameter paths are the names `ModelSpec::schema` computes.

use burn::module::{Module, Param};
use burn::nn::{Dropout, DropoutConfig, Initializer, LayerNorm, LayerNormConfig};
use burn::tensor::activation::{gelu, silu, softmax};
use burn::tensor::{Bool, Device, Tensor, TensorData};

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
    /// GELU's tanh approximation (GPT-2's) instead of the exact one.
    gelu_tanh: bool,
}

impl TransformerBlock {
    /// A block of `width` features split over `heads` heads (the spec checked that they divide
    /// it), with a feed-forward net `ffn` wide; `lora` gives each linear map's adapters (rank,
    /// scale) by its field name, `None` for none.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        heads: usize,
        width: usize,
        ffn: usize,
        dropout: f64,
        gelu_tanh: bool,
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
            gelu_tanh,
        }
    }

    /// The block applied to `x`, `[batch, steps, width]`.
    pub fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        let attended = self.attention(self.norm_attention.forward(x.clone()));
        let x = x + self.dropout.forward(attended);
        let inner = self.ffn_inner.forward(self.norm_ffn.forward(x.clone()));
        let hidden = if self.gelu_tanh { gelu_tanh(inner) } else { gelu(inner) };
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
        self.output.forward(causal_attention(q, k, v))
    }
}

/// softmax(QKᵀ/√d + causal mask)·V over `[batch, heads, steps, head_width]` queries, keys and
/// values; the heads concatenated, `[batch, steps, heads·head_width]`.
fn causal_attention(q: Tensor<4>, k: Tensor<4>, v: Tensor<4>) -> Tensor<3> {
    let [batch, heads, steps, head_width] = q.dims();
    let scores = q.matmul(k.swap_dims(2, 3)).div_scalar((head_width as f64).sqrt());
    // True above the diagonal: the steps after each query step, which it may not see.
    let future = Tensor::<2, Bool>::tril_mask([steps, steps], 0, &scores.device())
        .reshape([1, 1, steps, steps])
        .expand([batch, heads, steps, steps]);
    let weights = softmax(scores.mask_fill(future, f32::NEG_INFINITY), 3);
    weights.matmul(v).swap_dims(1, 2).reshape([batch, steps, heads * head_width])
}

/// GELU's tanh approximation: `0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))`.
fn gelu_tanh<const D: usize>(x: Tensor<D>) -> Tensor<D> {
    let cubed = x.clone() * x.clone() * x.clone();
    let inner =
        (x.clone() + cubed.mul_scalar(0.044715)).mul_scalar((2.0 / std::f64::consts::PI).sqrt());
    x.mul_scalar(0.5) * inner.tanh().add_scalar(1.0)
}

/// Root-mean-square normalization over the last dimension: `x / √(mean(x²) + eps) · γ`.
#[derive(Module, Debug)]
pub struct RmsNorm {
    gamma: Param<Tensor<1>>,
    eps: f64,
}

impl RmsNorm {
    /// A norm over `width` features, `γ` at one.
    pub fn new(width: usize, eps: f64, device: &Device) -> Self {
        RmsNorm { gamma: Initializer::Ones.init([width], device), eps }
    }

    /// `x` normalized over its last dimension.
    pub fn forward<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        let mean_square = (x.clone() * x.clone()).mean_dim(D - 1);
        x / mean_square.add_scalar(self.eps).sqrt() * self.gamma.val().unsqueeze()
    }
}

/// Llama's decoder block over `[batch, steps, width]`: `x + attention(rms_norm(x))` with rotary
/// positions and grouped-query attention, then `x + down(silu(gate(n)) · up(n))`,
/// `n = rms_norm(x)`. Field order is parameter order, as `ModelSpec::schema` lists them.
#[derive(Module, Debug)]
pub struct LlamaBlock {
    norm_attention: RmsNorm,
    query: Linear,
    key: Linear,
    value: Linear,
    output: Linear,
    norm_ffn: RmsNorm,
    ffn_gate: Linear,
    ffn_up: Linear,
    ffn_down: Linear,
    heads: usize,
    kv_heads: usize,
    rope_theta: f64,
}

impl LlamaBlock {
    /// A block of `width` features over `heads` query heads and `kv_heads` key/value heads (the
    /// spec checked that they divide), a SwiGLU net `ffn` wide, rotary base `rope_theta`, norms
    /// with `norm_eps`; `lora` gives each linear map's adapters by its field name.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        heads: usize,
        kv_heads: usize,
        width: usize,
        ffn: usize,
        rope_theta: f64,
        norm_eps: f64,
        lora: &dyn Fn(&str) -> Option<(usize, f64)>,
        device: &Device,
    ) -> Self {
        let linear = |name, fan_in, out| Linear::new(fan_in, out, lora(name), device);
        let kv_width = width / heads * kv_heads;
        LlamaBlock {
            norm_attention: RmsNorm::new(width, norm_eps, device),
            query: linear("query", width, width),
            key: linear("key", width, kv_width),
            value: linear("value", width, kv_width),
            output: linear("output", width, width),
            norm_ffn: RmsNorm::new(width, norm_eps, device),
            ffn_gate: linear("ffn_gate", width, ffn),
            ffn_up: linear("ffn_up", width, ffn),
            ffn_down: linear("ffn_down", ffn, width),
            heads,
            kv_heads,
            rope_theta,
        }
    }

    /// The block applied to `x`, `[batch, steps, width]`.
    pub fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        let x = x.clone() + self.attention(self.norm_attention.forward(x));
        let n = self.norm_ffn.forward(x.clone());
        let hidden = silu(self.ffn_gate.forward(n.clone())) * self.ffn_up.forward(n);
        x + self.ffn_down.forward(hidden)
    }

    fn attention(&self, x: Tensor<3>) -> Tensor<3> {
        let [batch, steps, width] = x.dims();
        let head_width = width / self.heads;
        let split = |t: Tensor<3>, heads: usize| {
            t.reshape([batch, steps, heads, head_width]).swap_dims(1, 2)
        };
        let (cos, sin) = rotary_tables(steps, head_width, self.rope_theta, &x.device());
        let rotate = |t: Tensor<4>| rotary(t, cos.clone(), sin.clone());
        let q = rotate(split(self.query.forward(x.clone()), self.heads));
        let k = rotate(split(self.key.forward(x.clone()), self.kv_heads));
        let v = split(self.value.forward(x), self.kv_heads);
        // Each key/value head serves `heads / kv_heads` consecutive query heads.
        let group = self.heads / self.kv_heads;
        let share = |t: Tensor<4>| {
            t.unsqueeze_dim::<5>(2)
                .expand([batch, self.kv_heads, group, steps, head_width])
                .reshape([batch, self.heads, steps, head_width])
        };
        self.output.forward(causal_attention(q, share(k), share(v)))
    }
}

/// cos and sin of every step's rotary angles, `[1, 1, steps, head_width]`: pair `j` of a head
/// turns by `t · theta^(−2j/head_width)` at step `t`, the angles laid out twice (the first half
/// of the head's dimensions pairs with the second, as Hugging Face's Llama has them).
fn rotary_tables(
    steps: usize,
    head_width: usize,
    theta: f64,
    device: &Device,
) -> (Tensor<4>, Tensor<4>) {
    let half = head_width / 2;
    let mut cos = Vec::with_capacity(steps * head_width);
    let mut sin = Vec::with_capacity(steps * head_width);
    for t in 0..steps {
        for d in 0..head_width {
            let j = (d % half) as f64;
            let angle = t as f64 * theta.powf(-2.0 * j / head_width as f64);
            cos.push(angle.cos() as f32);
            sin.push(angle.sin() as f32);
        }
    }
    let table =
        |v: Vec<f32>| Tensor::from_data(TensorData::new(v, [1, 1, steps, head_width]), device);
    (table(cos), table(sin))
}

/// `x·cos + rotate_half(x)·sin`, `rotate_half([a, b]) = [−b, a]` over the last dimension's halves.
fn rotary(x: Tensor<4>, cos: Tensor<4>, sin: Tensor<4>) -> Tensor<4> {
    let [b, h, s, d] = x.dims();
    let first = x.clone().slice([0..b, 0..h, 0..s, 0..d / 2]);
    let second = x.clone().slice([0..b, 0..h, 0..s, d / 2..d]);
    let turned = Tensor::cat(vec![second.neg(), first], 3);
    x * cos + turned * sin
}
