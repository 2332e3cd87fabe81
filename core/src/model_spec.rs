//! Declarative model specs: a layer list that the client SDK turns into a burn module at run
//! time, and from which the coordinator derives the tensor schema and initial parameters.
//!
//! Changing the model is a plan change, not an app rebuild. The schema computed here names,
//! orders and shapes parameters exactly as burn's module visitor reports them for the module the
//! SDK builds (`layers.{i}.{Variant}.{field}...`, `Option` fields adding no level); the SDK's
//! tests check the two against each other in both directions.

use serde::{Deserialize, Serialize};

use crate::rng::SplitMix64;
use crate::tensor::{DType, MAX_SCHEMA_ELEMENTS, TensorSchema, TensorSpec};

/// A model: what it takes, and the layers applied in order.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSpec {
    /// The shape of one example.
    pub input: InputSpec,
    /// Layers, applied in order; the last one must produce class logits.
    pub layers: Vec<LayerSpec>,
    /// Low-rank adapters on some of the linear maps (LoRA); absent: none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lora: Option<LoraSpec>,
}

/// LoRA (Hu et al. 2021): each targeted linear map `x·W + b` becomes
/// `x·W + b + (alpha / rank)·(x·A)·B`, with `A` (`lora_a`, `[in, rank]`, random) and `B`
/// (`lora_b`, `[rank, out]`, zero, so that the adapted model starts as the base one) two more
/// tensors after the map's own.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LoraSpec {
    /// The adapters' rank, r.
    pub rank: u64,
    /// The scale's numerator: the update is `(alpha / rank)·A·B`.
    pub alpha: f64,
    /// Patterns (`*` matches any run of characters) over the linear maps' paths:
    /// `layers.{i}.Linear` for a linear layer, `layers.{i}.TransformerBlock.{query, key, value,
    /// output, ffn_inner, ffn_outer}` for a transformer block's. Each must match one.
    pub targets: Vec<String>,
}

/// Whether `name` is a LoRA adapter's tensor (`...lora_a` or `...lora_b`).
pub fn is_lora_adapter(name: &str) -> bool {
    name.ends_with(".lora_a") || name.ends_with(".lora_b")
}

impl LoraSpec {
    /// The update's scale, `alpha / rank`.
    pub fn scale(&self) -> f64 {
        self.alpha / self.rank as f64
    }
}

/// The linear maps of a transformer block, in parameter order (`None`: a layer norm).
const BLOCK_SUBLAYERS: [(&str, bool); 8] = [
    ("norm_attention", false),
    ("query", true),
    ("key", true),
    ("value", true),
    ("output", true),
    ("norm_ffn", false),
    ("ffn_inner", true),
    ("ffn_outer", true),
];

/// The linear maps of a Llama block, in parameter order (`false`: an RMS norm).
const LLAMA_SUBLAYERS: [(&str, bool); 9] = [
    ("norm_attention", false),
    ("query", true),
    ("key", true),
    ("value", true),
    ("output", true),
    ("norm_ffn", false),
    ("ffn_gate", true),
    ("ffn_up", true),
    ("ffn_down", true),
];

/// The activation inside a transformer block's feed-forward net.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FfnActivation {
    /// GELU with the exact error function (PyTorch's default, BERT's).
    #[default]
    Gelu,
    /// GELU's tanh approximation, `0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))` (GPT-2's
    /// `gelu_new`).
    GeluTanh,
}

impl FfnActivation {
    fn is_gelu(&self) -> bool {
        *self == FfnActivation::Gelu
    }
}

fn default_rms_eps() -> f64 {
    1e-6
}

fn default_rope_theta() -> f64 {
    10_000.0
}

/// The shape of one example.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind", deny_unknown_fields)]
pub enum InputSpec {
    /// An image, channels first.
    Image {
        /// Channels.
        channels: u64,
        /// Height.
        height: u64,
        /// Width.
        width: u64,
    },
    /// A flat feature vector.
    Features {
        /// Number of features.
        size: u64,
    },
    /// A sequence of token ids.
    Tokens {
        /// Vocabulary size (ids are `0..vocab`).
        vocab: u64,
        /// Sequence length.
        length: u64,
    },
}

/// One layer.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind", deny_unknown_fields)]
pub enum LayerSpec {
    /// Fully connected, on the last dimension.
    Linear {
        /// Output features.
        out: u64,
    },
    /// 2-D convolution, square kernel.
    Conv2d {
        /// Output channels.
        out_channels: u64,
        /// Kernel side.
        kernel: u64,
        /// Zero padding on each side.
        #[serde(default)]
        padding: u64,
    },
    /// 2-D max pooling, square window, stride equal to the window.
    MaxPool2d {
        /// Window side.
        kernel: u64,
    },
    /// Rectified linear unit.
    Relu {},
    /// Dropout while training.
    Dropout {
        /// Probability of zeroing an element.
        prob: f64,
    },
    /// Flattens everything but the batch dimension.
    Flatten {},
    /// Token embedding.
    Embedding {
        /// Embedding width.
        dim: u64,
    },
    /// LSTM over a sequence, batch first.
    Lstm {
        /// Hidden size.
        hidden: u64,
    },
    /// GRU over a sequence, batch first.
    Gru {
        /// Hidden size.
        hidden: u64,
    },
    /// Layer normalization over the last dimension.
    LayerNorm {},
    /// Keeps only the last step of a sequence.
    LastStep {},
    /// Learned position embeddings, one vector per step, added to a sequence.
    PositionEmbedding {},
    /// A pre-norm transformer decoder block: causal multi-head self-attention, then a GELU
    /// feed-forward net, each behind a layer norm and inside a residual connection.
    TransformerBlock {
        /// Attention heads; they split `width` evenly.
        heads: u64,
        /// The block's width: it must equal the features of the sequence it takes (the residual
        /// adds its output to its input).
        width: u64,
        /// Hidden width of the feed-forward net.
        ffn: u64,
        /// Dropout on the attention and feed-forward outputs while training.
        #[serde(default)]
        dropout: f64,
        /// The feed-forward net's activation (default `gelu`; GPT-2's is `gelu_tanh`).
        #[serde(default, skip_serializing_if = "FfnActivation::is_gelu")]
        activation: FfnActivation,
    },
    /// Root-mean-square normalization over the last dimension, `x / √(mean(x²) + eps) · γ`
    /// (Zhang & Sennrich 2019; Llama's norm).
    RmsNorm {
        /// Added to the mean square (default 1e-6).
        #[serde(default = "default_rms_eps")]
        eps: f64,
    },
    /// A Llama decoder block: `x + attention(rms_norm(x))`, causal, with rotary positions on
    /// queries and keys (Su et al. 2021, in the half-split layout of Hugging Face's Llama) and
    /// `kv_heads` key/value heads shared by groups of query heads (grouped-query attention);
    /// then `x + down(silu(gate(n)) · up(n))` with `n = rms_norm(x)` (SwiGLU). Its linear maps
    /// carry biases, zero when imported from a checkpoint without them.
    LlamaBlock {
        /// Query heads; they split `width` evenly.
        heads: u64,
        /// Key/value heads; they divide `heads` (equal: plain multi-head attention).
        kv_heads: u64,
        /// The block's width: the features of the sequence it takes.
        width: u64,
        /// Hidden width of the feed-forward net.
        ffn: u64,
        /// The rotary base: head dimension pair `j` turns by `position · theta^(−2j/head_width)`
        /// (default 10 000).
        #[serde(default = "default_rope_theta")]
        rope_theta: f64,
        /// The RMS norms' `eps` (default 1e-6).
        #[serde(default = "default_rms_eps")]
        norm_eps: f64,
    },
}

/// The shape of the activation between layers (per example, without the batch dimension).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// `[channels, height, width]`.
    Image(u64, u64, u64),
    /// `[features]`.
    Flat(u64),
    /// `[steps, features]`.
    Sequence(u64, u64),
    /// `[steps]` of token ids below `vocab`.
    Tokens {
        /// Vocabulary size.
        vocab: u64,
        /// Steps.
        length: u64,
    },
}

impl From<InputSpec> for Activation {
    fn from(input: InputSpec) -> Self {
        match input {
            InputSpec::Image { channels, height, width } => {
                Activation::Image(channels, height, width)
            }
            InputSpec::Features { size } => Activation::Flat(size),
            InputSpec::Tokens { vocab, length } => Activation::Tokens { vocab, length },
        }
    }
}

/// Why a spec was rejected.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum SpecError {
    /// The spec has no layers.
    #[error("model spec has no layers")]
    Empty,
    /// A size is zero or absurd.
    #[error("layer {layer}: {why}")]
    BadLayer {
        /// Layer index.
        layer: usize,
        /// What is wrong.
        why: String,
    },
    /// A layer cannot take the activation the previous layers produce.
    #[error("layer {layer} ({kind}) cannot take a {got:?} activation")]
    ShapeMismatch {
        /// Layer index.
        layer: usize,
        /// Layer kind.
        kind: &'static str,
        /// The activation it would get.
        got: Activation,
    },
    /// The last layer does not produce flat class logits.
    #[error("the model must end in flat class logits, it ends in {0:?}")]
    BadOutput(Activation),
    /// The `lora` section is out of range or targets nothing.
    #[error("lora: {0}")]
    Lora(String),
}

/// Largest size of any one dimension in a spec.
const MAX_DIM: u64 = 1 << 24;

impl LayerSpec {
    /// The variant name, as burn's module derive names the enum level of the path.
    pub fn variant(&self) -> &'static str {
        match self {
            LayerSpec::Linear { .. } => "Linear",
            LayerSpec::Conv2d { .. } => "Conv2d",
            LayerSpec::MaxPool2d { .. } => "MaxPool2d",
            LayerSpec::Relu {} => "Relu",
            LayerSpec::Dropout { .. } => "Dropout",
            LayerSpec::Flatten {} => "Flatten",
            LayerSpec::Embedding { .. } => "Embedding",
            LayerSpec::Lstm { .. } => "Lstm",
            LayerSpec::Gru { .. } => "Gru",
            LayerSpec::LayerNorm {} => "LayerNorm",
            LayerSpec::LastStep {} => "LastStep",
            LayerSpec::PositionEmbedding {} => "PositionEmbedding",
            LayerSpec::TransformerBlock { .. } => "TransformerBlock",
            LayerSpec::RmsNorm { .. } => "RmsNorm",
            LayerSpec::LlamaBlock { .. } => "LlamaBlock",
        }
    }
}

/// How a parameter is initialized.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Init {
    /// `U(-b, b)`.
    Uniform(f64),
    /// All `v`.
    Constant(f32),
}

impl ModelSpec {
    /// Checks the spec and returns the activation after every layer.
    pub fn activations(&self) -> Result<Vec<Activation>, SpecError> {
        if self.layers.is_empty() {
            return Err(SpecError::Empty);
        }
        let mut act = match self.input {
            InputSpec::Image { channels, height, width } => {
                Activation::Image(channels, height, width)
            }
            InputSpec::Features { size } => Activation::Flat(size),
            InputSpec::Tokens { vocab, length } => Activation::Tokens { vocab, length },
        };
        check_dims(0, &dims_of(act))?;
        let mut out = Vec::with_capacity(self.layers.len());
        for (i, layer) in self.layers.iter().enumerate() {
            let mismatch =
                || SpecError::ShapeMismatch { layer: i, kind: layer.variant(), got: act };
            act = match (*layer, act) {
                (LayerSpec::Linear { out }, Activation::Flat(_)) => Activation::Flat(out),
                (LayerSpec::Linear { out }, Activation::Sequence(t, _)) => {
                    Activation::Sequence(t, out)
                }
                (
                    LayerSpec::Conv2d { out_channels, kernel, padding },
                    Activation::Image(_, h, w),
                ) => {
                    if kernel == 0 || kernel > MAX_DIM || padding > MAX_DIM {
                        return Err(bad(
                            i,
                            &format!(
                                "kernel must be in 1..={MAX_DIM} and padding at most {MAX_DIM}"
                            ),
                        ));
                    }
                    // Every term is at most 3·2^24 here, but the arithmetic stays checked: a
                    // wrapped side would give a schema the SDK cannot build.
                    let side = |x: u64| {
                        x.checked_add(padding.checked_mul(2)?)?.checked_sub(kernel)?.checked_add(1)
                    };
                    match (side(h), side(w)) {
                        (Some(h), Some(w)) => Activation::Image(out_channels, h, w),
                        _ => return Err(bad(i, "kernel is larger than the padded input")),
                    }
                }
                (LayerSpec::MaxPool2d { kernel }, Activation::Image(c, h, w)) => {
                    if kernel == 0 || kernel > h || kernel > w {
                        return Err(bad(i, "pool window is zero or larger than the input"));
                    }
                    Activation::Image(c, h / kernel, w / kernel)
                }
                (
                    LayerSpec::Relu {} | LayerSpec::LayerNorm {},
                    a @ (Activation::Flat(_) | Activation::Sequence(..) | Activation::Image(..)),
                ) => {
                    if matches!(layer, LayerSpec::LayerNorm {})
                        && matches!(a, Activation::Image(..))
                    {
                        return Err(mismatch());
                    }
                    a
                }
                (
                    LayerSpec::Dropout { prob },
                    a @ (Activation::Flat(_) | Activation::Sequence(..) | Activation::Image(..)),
                ) => {
                    if !(0.0..1.0).contains(&prob) {
                        return Err(bad(i, "dropout probability must be in [0, 1)"));
                    }
                    a
                }
                (LayerSpec::Flatten {}, Activation::Image(c, h, w)) => {
                    Activation::Flat(product(i, &[c, h, w])?)
                }
                (LayerSpec::Flatten {}, Activation::Sequence(t, f)) => {
                    Activation::Flat(product(i, &[t, f])?)
                }
                (LayerSpec::Embedding { dim }, Activation::Tokens { length, .. }) => {
                    Activation::Sequence(length, dim)
                }
                (
                    LayerSpec::Lstm { hidden } | LayerSpec::Gru { hidden },
                    Activation::Sequence(t, _),
                ) => Activation::Sequence(t, hidden),
                (LayerSpec::LastStep {}, Activation::Sequence(_, f)) => Activation::Flat(f),
                (LayerSpec::PositionEmbedding {}, a @ Activation::Sequence(..)) => a,
                (
                    LayerSpec::TransformerBlock { heads, width, ffn, dropout, .. },
                    a @ Activation::Sequence(_, f),
                ) => {
                    check_transformer_block(i, heads, width, ffn, dropout, f)?;
                    a
                }
                (
                    LayerSpec::RmsNorm { eps },
                    a @ (Activation::Flat(_) | Activation::Sequence(..)),
                ) => {
                    check_eps(i, eps)?;
                    a
                }
                (
                    LayerSpec::LlamaBlock { heads, kv_heads, width, ffn, rope_theta, norm_eps },
                    a @ Activation::Sequence(_, f),
                ) => {
                    check_transformer_block(i, heads, width, ffn, 0.0, f)?;
                    if kv_heads == 0 || !heads.is_multiple_of(kv_heads) {
                        return Err(bad(
                            i,
                            &format!("{kv_heads} key/value heads do not divide {heads} heads"),
                        ));
                    }
                    if !(width / heads).is_multiple_of(2) {
                        return Err(bad(i, "rotary positions need an even head width"));
                    }
                    if !(rope_theta.is_finite() && rope_theta > 1.0) {
                        return Err(bad(i, "rope_theta must be finite and above 1"));
                    }
                    check_eps(i, norm_eps)?;
                    a
                }
                _ => return Err(mismatch()),
            };
            check_dims(i, &dims_of(act))?;
            out.push(act);
        }
        match act {
            Activation::Flat(n) if n >= 2 => Ok(out),
            other => Err(SpecError::BadOutput(other)),
        }
    }

    /// The paths of the linear maps LoRA may target, in model order (see [`LoraSpec::targets`]).
    pub fn linear_paths(&self) -> Vec<String> {
        let mut paths = vec![];
        for (i, layer) in self.layers.iter().enumerate() {
            match layer {
                LayerSpec::Linear { .. } => paths.push(format!("layers.{i}.Linear")),
                LayerSpec::TransformerBlock { .. } => paths.extend(
                    BLOCK_SUBLAYERS
                        .iter()
                        .filter(|(_, is_linear)| *is_linear)
                        .map(|(name, _)| format!("layers.{i}.TransformerBlock.{name}")),
                ),
                LayerSpec::LlamaBlock { .. } => paths.extend(
                    LLAMA_SUBLAYERS
                        .iter()
                        .filter(|(_, is_linear)| *is_linear)
                        .map(|(name, _)| format!("layers.{i}.LlamaBlock.{name}")),
                ),
                _ => {}
            }
        }
        paths
    }

    /// The adapters' rank on the linear map at `path`, when the spec's LoRA targets it.
    pub fn lora_rank(&self, path: &str) -> Option<u64> {
        let lora = self.lora.as_ref()?;
        lora.targets.iter().any(|p| crate::tensor::name_matches(p, path)).then_some(lora.rank)
    }

    /// The spec without its adapters: the model a LoRA run's merged export is.
    pub fn without_lora(&self) -> ModelSpec {
        ModelSpec { lora: None, ..self.clone() }
    }

    /// A LoRA model's values merged into its base model's (the spec [`Self::without_lora`]):
    /// each adapted weight becomes `W + (alpha / rank)·A·B`, the adapters go; every other
    /// tensor as it is. `values` are the adapted model's, in schema order.
    pub fn merge_lora(&self, values: &[f32]) -> Result<Vec<f32>, SpecError> {
        let schema = self.schema()?;
        let Some(lora) = &self.lora else { return Ok(values.to_vec()) };
        let scale = lora.scale();
        if values.len() as u64 != schema.numel() {
            return Err(SpecError::Lora(format!(
                "{} values given for a model of {}",
                values.len(),
                schema.numel()
            )));
        }
        let mut tensors: Vec<(&TensorSpec, &[f32])> = vec![];
        let mut offset = 0;
        for t in &schema.tensors {
            let n = t.numel() as usize;
            tensors.push((t, &values[offset..offset + n]));
            offset += n;
        }
        let mut out = Vec::with_capacity(values.len());
        let mut i = 0;
        while i < tensors.len() {
            let (t, v) = tensors[i];
            let adapted = t.name.strip_suffix(".weight").filter(|path| {
                let a = tensors.get(i + 2).map(|(a, _)| a.name.as_str());
                self.lora_rank(path).is_some() && a == Some(&format!("{path}.lora_a"))
            });
            match adapted {
                // weight, bias, lora_a, lora_b
                Some(_) => {
                    let (fan_in, outs) = (t.shape[0] as usize, t.shape[1] as usize);
                    let (a, b) = (tensors[i + 2].1, tensors[i + 3].1);
                    let rank = lora.rank as usize;
                    let mut w = v.to_vec();
                    for row in 0..fan_in {
                        for k in 0..rank {
                            let ark = f64::from(a[row * rank + k]) * scale;
                            for col in 0..outs {
                                let m = &mut w[row * outs + col];
                                *m = (f64::from(*m) + ark * f64::from(b[k * outs + col])) as f32;
                            }
                        }
                    }
                    out.extend_from_slice(&w);
                    out.extend_from_slice(tensors[i + 1].1);
                    i += 4;
                }
                None => {
                    out.extend_from_slice(v);
                    i += 1;
                }
            }
        }
        Ok(out)
    }

    fn check_lora(&self) -> Result<(), SpecError> {
        let Some(lora) = &self.lora else { return Ok(()) };
        if lora.rank == 0 || lora.rank > MAX_DIM {
            return Err(SpecError::Lora(format!("rank must be in 1..={MAX_DIM}")));
        }
        if !(lora.alpha.is_finite() && lora.alpha > 0.0) {
            return Err(SpecError::Lora("alpha must be positive and finite".into()));
        }
        if lora.targets.is_empty() || lora.targets.len() > 256 {
            return Err(SpecError::Lora("targets must list 1..=256 patterns".into()));
        }
        let paths = self.linear_paths();
        match lora
            .targets
            .iter()
            .find(|p| !paths.iter().any(|path| crate::tensor::name_matches(p, path)))
        {
            Some(p) => Err(SpecError::Lora(format!(
                "target {p:?} matches no linear map (they are: {})",
                paths.join(", ")
            ))),
            None => Ok(()),
        }
    }

    /// The activation each layer takes: the input for layer 0, then each layer's output.
    pub fn layer_inputs(&self) -> Result<Vec<Activation>, SpecError> {
        let outputs = self.activations()?;
        let mut inputs = vec![Activation::from(self.input)];
        inputs.extend_from_slice(&outputs[..outputs.len() - 1]);
        Ok(inputs)
    }

    /// Number of classes the model predicts.
    pub fn n_classes(&self) -> Result<u64, SpecError> {
        match self.activations()?.last() {
            Some(Activation::Flat(n)) => Ok(*n),
            _ => unreachable!("activations() checked the output"),
        }
    }

    /// The tensor schema of the module the SDK builds from this spec.
    pub fn schema(&self) -> Result<TensorSchema, SpecError> {
        Ok(TensorSchema { tensors: self.parameters()?.into_iter().map(|(spec, _)| spec).collect() })
    }

    /// Initial parameters, flat in schema order, deterministic for `seed`: Kaiming-uniform
    /// weights (as burn's `Linear` and `Conv2d` default), zero biases, unit LayerNorm scales,
    /// unit-variance embeddings, Xavier-uniform recurrent weights.
    pub fn initial_parameters(&self, seed: u64) -> Result<Vec<f32>, SpecError> {
        let mut rng = SplitMix64(seed);
        let mut out = vec![];
        for (spec, init) in self.parameters()? {
            let n = spec.numel() as usize;
            match init {
                Init::Constant(v) => out.extend(std::iter::repeat_n(v, n)),
                Init::Uniform(b) => {
                    out.extend((0..n).map(|_| ((rng.unit() * 2.0 - 1.0) * b) as f32))
                }
            }
        }
        Ok(out)
    }

    fn parameters(&self) -> Result<Vec<(TensorSpec, Init)>, SpecError> {
        let inputs = self.layer_inputs()?;
        self.check_lora()?;
        let mut params = Params(vec![]);
        for (i, layer) in self.layers.iter().enumerate() {
            let prefix = format!("layers.{i}.{}", layer.variant());
            match (*layer, inputs[i]) {
                (LayerSpec::Linear { out }, Activation::Flat(f) | Activation::Sequence(_, f)) => {
                    params.linear(&prefix, f, out, self.lora_rank(&prefix));
                }
                (LayerSpec::Conv2d { out_channels, kernel, .. }, Activation::Image(c, _, _)) => {
                    // In f64: the product of three dimensions can exceed u64 before the size
                    // check below refuses the tensor.
                    let fan_in = c as f64 * kernel as f64 * kernel as f64;
                    params.push(
                        &prefix,
                        "weight",
                        vec![out_channels, c, kernel, kernel],
                        Init::Uniform((1.0 / fan_in).sqrt()),
                    );
                    params.push(&prefix, "bias", vec![out_channels], Init::Constant(0.0));
                }
                (LayerSpec::Embedding { dim }, Activation::Tokens { vocab, .. }) => {
                    params.push(&prefix, "weight", vec![vocab, dim], Init::Uniform(3f64.sqrt()));
                }
                (LayerSpec::LayerNorm {}, Activation::Flat(f) | Activation::Sequence(_, f)) => {
                    params.layer_norm(&prefix, f);
                }
                (
                    LayerSpec::Lstm { hidden } | LayerSpec::Gru { hidden },
                    Activation::Sequence(_, f),
                ) => {
                    let gates: &[&str] = if matches!(layer, LayerSpec::Lstm { .. }) {
                        &["input_gate", "forget_gate", "output_gate", "cell_gate"]
                    } else {
                        &["update_gate", "reset_gate", "new_gate"]
                    };
                    for gate in gates {
                        for (transform, fan_in) in
                            [("input_transform", f), ("hidden_transform", hidden)]
                        {
                            let bound = (6.0 / (fan_in + hidden) as f64).sqrt();
                            let path = format!("{prefix}.{gate}.{transform}");
                            params.push(
                                &path,
                                "weight",
                                vec![fan_in, hidden],
                                Init::Uniform(bound),
                            );
                            params.push(&path, "bias", vec![hidden], Init::Constant(0.0));
                        }
                    }
                }
                (LayerSpec::PositionEmbedding {}, Activation::Sequence(t, f)) => {
                    params.push(&prefix, "weight", vec![t, f], Init::Uniform(3f64.sqrt()));
                }
                (LayerSpec::TransformerBlock { width: w, ffn, .. }, Activation::Sequence(..)) => {
                    // The field order of the SDK's `TransformerBlock`, which burn visits.
                    for (name, is_linear) in BLOCK_SUBLAYERS {
                        let path = format!("{prefix}.{name}");
                        let (fan_in, out) = match name {
                            "ffn_inner" => (w, ffn),
                            "ffn_outer" => (ffn, w),
                            _ => (w, w),
                        };
                        if is_linear {
                            params.linear(&path, fan_in, out, self.lora_rank(&path));
                        } else {
                            params.layer_norm(&path, w);
                        }
                    }
                }
                (LayerSpec::RmsNorm { .. }, Activation::Flat(f) | Activation::Sequence(_, f)) => {
                    params.push(&prefix, "gamma", vec![f], Init::Constant(1.0));
                }
                (
                    LayerSpec::LlamaBlock { heads, kv_heads, width: w, ffn, .. },
                    Activation::Sequence(..),
                ) => {
                    // The field order of the SDK's `LlamaBlock`, which burn visits.
                    let kv_width = w / heads * kv_heads;
                    for (name, is_linear) in LLAMA_SUBLAYERS {
                        let path = format!("{prefix}.{name}");
                        let (fan_in, out) = match name {
                            "key" | "value" => (w, kv_width),
                            "ffn_gate" | "ffn_up" => (w, ffn),
                            "ffn_down" => (ffn, w),
                            _ => (w, w),
                        };
                        if is_linear {
                            params.linear(&path, fan_in, out, self.lora_rank(&path));
                        } else {
                            params.push(&path, "gamma", vec![w], Init::Constant(1.0));
                        }
                    }
                }
                _ => {}
            }
        }
        let params = params.0;
        if params.is_empty() {
            return Err(SpecError::BadLayer {
                layer: 0,
                why: "the model has no trainable parameters".into(),
            });
        }
        let mut total: u64 = 0;
        for (spec, _) in &params {
            let layer = spec.name.split('.').nth(1).and_then(|i| i.parse().ok()).unwrap_or(0);
            let numel = spec
                .shape
                .iter()
                .try_fold(1u64, |acc, &d| acc.checked_mul(d))
                .filter(|&n| n <= MAX_SCHEMA_ELEMENTS)
                .ok_or_else(|| {
                    bad(
                        layer,
                        &format!(
                            "parameter {} {:?} has more than {MAX_SCHEMA_ELEMENTS} elements",
                            spec.name, spec.shape
                        ),
                    )
                })?;
            total = total.saturating_add(numel);
        }
        if total > MAX_SCHEMA_ELEMENTS {
            return Err(bad(
                0,
                &format!("the model has {total} parameters, more than {MAX_SCHEMA_ELEMENTS}"),
            ));
        }
        Ok(params)
    }
}

/// A model's parameters as they are listed, in burn's visiting order.
struct Params(Vec<(TensorSpec, Init)>);

impl Params {
    fn push(&mut self, path: &str, field: &str, shape: Vec<u64>, init: Init) {
        let name = format!("{path}.{field}");
        self.0.push((TensorSpec { name, shape, dtype: DType::F32 }, init));
    }

    /// A linear map's weight and bias (Kaiming-uniform and zero, as burn's `Linear`), then its
    /// LoRA adapters when it has a rank: `A` like the weight, `B` zero.
    fn linear(&mut self, path: &str, fan_in: u64, out: u64, lora_rank: Option<u64>) {
        let bound = (1.0 / fan_in as f64).sqrt();
        self.push(path, "weight", vec![fan_in, out], Init::Uniform(bound));
        self.push(path, "bias", vec![out], Init::Constant(0.0));
        if let Some(rank) = lora_rank {
            self.push(path, "lora_a", vec![fan_in, rank], Init::Uniform(bound));
            self.push(path, "lora_b", vec![rank, out], Init::Constant(0.0));
        }
    }

    fn layer_norm(&mut self, path: &str, width: u64) {
        self.push(path, "gamma", vec![width], Init::Constant(1.0));
        self.push(path, "beta", vec![width], Init::Constant(0.0));
    }
}

fn dims_of(a: Activation) -> Vec<u64> {
    match a {
        Activation::Image(c, h, w) => vec![c, h, w],
        Activation::Flat(f) => vec![f],
        Activation::Sequence(t, f) => vec![t, f],
        Activation::Tokens { vocab, length } => vec![vocab, length],
    }
}

/// The product of `dims`, as long as it is a valid dimension (at most [`MAX_DIM`]).
fn product(layer: usize, dims: &[u64]) -> Result<u64, SpecError> {
    dims.iter().try_fold(1u64, |acc, &d| acc.checked_mul(d)).filter(|&n| n <= MAX_DIM).ok_or_else(
        || bad(layer, &format!("flattening {dims:?} gives more than {MAX_DIM} features")),
    )
}

fn check_dims(layer: usize, dims: &[u64]) -> Result<(), SpecError> {
    match dims.iter().find(|&&d| d == 0 || d > MAX_DIM) {
        Some(d) => Err(bad(layer, &format!("dimension {d} is outside 1..={MAX_DIM}"))),
        None => Ok(()),
    }
}

/// A transformer block's sizes, against the `features` of the sequence it takes.
fn check_transformer_block(
    layer: usize,
    heads: u64,
    width: u64,
    ffn: u64,
    dropout: f64,
    features: u64,
) -> Result<(), SpecError> {
    if width != features {
        return Err(bad(
            layer,
            &format!("width {width} must equal the {features} features of the sequence it takes"),
        ));
    }
    if heads == 0 || !width.is_multiple_of(heads) {
        return Err(bad(layer, &format!("{heads} heads do not split width {width} evenly")));
    }
    if ffn == 0 || ffn > MAX_DIM {
        return Err(bad(layer, &format!("ffn width must be in 1..={MAX_DIM}")));
    }
    if !(0.0..1.0).contains(&dropout) {
        return Err(bad(layer, "dropout probability must be in [0, 1)"));
    }
    Ok(())
}

fn check_eps(layer: usize, eps: f64) -> Result<(), SpecError> {
    if !(eps.is_finite() && eps > 0.0 && eps < 1.0) {
        return Err(bad(layer, "a norm's eps must be in (0, 1)"));
    }
    Ok(())
}

fn bad(layer: usize, why: &str) -> SpecError {
    SpecError::BadLayer { layer, why: why.to_owned() }
}

#[cfg(test)]
mod tests;
