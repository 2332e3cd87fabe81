//! Builds a burn module from a run's [`ModelSpec`] at run time, and moves its parameters to and
//! from the flat, schema-ordered vectors the coordinator exchanges.
//!
//! Rust apps may instead bring their own burn module: anything implementing [`Classifier`]
//! trains, and [`schema_of`], [`parameters_of`] and [`load_parameters`] work on every module.
//!
//! The module is a `Vec` of a layer enum, so burn's visitor reports parameters as
//! `layers.{i}.{Variant}.{field}`: exactly the names `ModelSpec::schema` computes without burn.
//! [`SpecModel::schema`] reads them back from the module, and the tests hold the two equal.

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::pool::{MaxPool2d, MaxPool2dConfig};
use burn::nn::{
    Dropout, DropoutConfig, Embedding, EmbeddingConfig, Gru, GruConfig, LayerNorm, LayerNormConfig,
    Lstm, LstmConfig, PaddingConfig2d, Relu,
};
use burn::tensor::activation::relu;
use burn::tensor::{Device, Int, Tensor, TensorData};
use starling_core::model_spec::{Activation, InputSpec, LayerSpec, ModelSpec, SpecError};
use starling_core::tensor::{DType, TensorSchema, TensorSpec};

pub use linear::Linear;
pub use transformer::{LlamaBlock, PositionEmbedding, RmsNorm, TransformerBlock};

pub mod cpu_kernels;
mod linear;
mod transformer;

/// Why a model could not be built or loaded.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum ModelError {
    /// The spec is invalid.
    #[error(transparent)]
    Spec(#[from] SpecError),
    /// Flat parameters of the wrong length for the model.
    #[error("the model has {expected} parameters, {got} were given")]
    ParameterCount {
        /// The model's parameter count.
        expected: usize,
        /// Values given.
        got: usize,
    },
}

/// A model the SDK can train and exchange: a burn module whose forward pass maps a [`Batch`] to
/// class logits `[batch, classes]`. [`SpecModel`] is the one built from a run's spec; a Rust app
/// may implement it for its own `#[derive(Module)]` struct, whose parameter names and shapes (as
/// [`schema_of`] reads them) must then equal the run's schema.
pub trait Classifier: Module + 'static {
    /// Class logits, `[batch, classes]`.
    fn forward(&self, input: Batch) -> Tensor<2>;
}

/// What a classifier takes and gives; examples are checked against it before training.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModelIo {
    /// The input each example must have.
    pub input: InputSpec,
    /// Labels must be below this.
    pub classes: u64,
}

impl ModelIo {
    /// The input and class count of a spec's model.
    pub fn of_spec(spec: &ModelSpec) -> Result<Self, ModelError> {
        Ok(ModelIo { input: spec.input, classes: spec.n_classes()? })
    }
}

/// The schema of any module's float parameters, named by burn's visitor paths.
pub fn schema_of<M: Module>(module: &M) -> TensorSchema {
    let mut reader = Reader { path: vec![], tensors: vec![], values: None };
    module.visit(&mut reader);
    TensorSchema { tensors: reader.tensors }
}

/// All of a module's float parameters, flat, in schema order.
pub fn parameters_of<M: Module>(module: &M) -> Vec<f32> {
    let mut reader = Reader { path: vec![], tensors: vec![], values: Some(vec![]) };
    module.visit(&mut reader);
    reader.values.unwrap_or_default()
}

/// Replaces every float parameter of `module` with `values` (flat, schema order), keeping
/// gradient tracking.
pub fn load_parameters<M: Module>(module: M, values: &[f32]) -> Result<M, ModelError> {
    let expected = schema_of(&module).numel() as usize;
    if values.len() != expected {
        return Err(ModelError::ParameterCount { expected, got: values.len() });
    }
    let mut writer = Writer { values, offset: 0 };
    Ok(module.map(&mut writer))
}

/// Like [`load_parameters`], then freezes every tensor `trains` (one flag per tensor, schema
/// order) marks false: training computes no gradient for it and leaves its values as loaded.
pub fn load_parameters_freezing<M: Module>(
    module: M,
    values: &[f32],
    trains: &[bool],
) -> Result<M, ModelError> {
    let module = load_parameters(module, values)?;
    let mut freezer = Freezer { trains, index: 0 };
    Ok(module.map(&mut freezer))
}

/// Turns gradient tracking off for the tensors not marked as trained, in visiting order.
struct Freezer<'a> {
    trains: &'a [bool],
    index: usize,
}

impl ModuleMapper for Freezer<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let trains = self.trains.get(self.index).copied().unwrap_or(true);
        self.index += 1;
        if trains { param } else { param.set_require_grad(false) }
    }
}

/// A model built from a spec.
#[derive(Module, Debug)]
pub struct SpecModel {
    layers: Vec<Layer>,
}

/// One layer of a [`SpecModel`].
#[derive(Module, Debug)]
#[allow(missing_docs)]
// Each variant is the burn layer of the same name.
// A model holds a handful of layers, so the LSTM variant's size costs nothing worth boxing for
// (and burn's Module derive would then need Box<T>: Module).
#[allow(clippy::large_enum_variant)]
pub enum Layer {
    Linear(Linear),
    Conv2d(Conv2d),
    MaxPool2d(MaxPool2d),
    Relu(Relu),
    Dropout(Dropout),
    Flatten(Flatten),
    Embedding(Embedding),
    Lstm(Lstm),
    Gru(Gru),
    LayerNorm(LayerNorm),
    LastStep(LastStep),
    PositionEmbedding(PositionEmbedding),
    TransformerBlock(TransformerBlock),
    RmsNorm(RmsNorm),
    LlamaBlock(LlamaBlock),
}

/// Flattens all but the batch dimension.
#[derive(Module, Debug, Default)]
pub struct Flatten;

/// Keeps the last step of a `[batch, steps, features]` sequence.
#[derive(Module, Debug, Default)]
pub struct LastStep;

/// A batch on its way through the layers; the spec fixes which rank each layer sees.
#[derive(Debug, Clone)]
pub enum Batch {
    /// `[batch, features]`.
    Flat(Tensor<2>),
    /// `[batch, steps, features]`.
    Sequence(Tensor<3>),
    /// `[batch, channels, height, width]`.
    Image(Tensor<4>),
    /// `[batch, steps]` token ids.
    Tokens(Tensor<2, Int>),
}

impl SpecModel {
    /// Builds the model for `spec` on `device`, with burn's default initialization.
    pub fn build(spec: &ModelSpec, device: &Device) -> Result<Self, ModelError> {
        let inputs = spec.layer_inputs()?;
        // The schema checks the spec's LoRA section (targets, rank, alpha).
        spec.schema()?;
        let scale = spec.lora.as_ref().map_or(0.0, |l| l.scale());
        let lora = |path: &str| spec.lora_rank(path).map(|rank| (rank as usize, scale));
        let mut layers = Vec::with_capacity(spec.layers.len());
        for (i, layer) in spec.layers.iter().enumerate() {
            let u = |v: u64| v as usize;
            let built = match (*layer, inputs[i]) {
                (LayerSpec::Linear { out }, Activation::Flat(f) | Activation::Sequence(_, f)) => {
                    let lora = lora(&format!("layers.{i}.Linear"));
                    Layer::Linear(Linear::new(u(f), u(out), lora, device))
                }
                (
                    LayerSpec::Conv2d { out_channels, kernel, padding },
                    Activation::Image(c, _, _),
                ) => Layer::Conv2d(
                    Conv2dConfig::new([u(c), u(out_channels)], [u(kernel), u(kernel)])
                        .with_padding(PaddingConfig2d::Explicit(
                            u(padding),
                            u(padding),
                            u(padding),
                            u(padding),
                        ))
                        .init(device),
                ),
                (LayerSpec::MaxPool2d { kernel }, _) => {
                    Layer::MaxPool2d(MaxPool2dConfig::new([u(kernel), u(kernel)]).init())
                }
                (LayerSpec::Relu {}, _) => Layer::Relu(Relu::new()),
                (LayerSpec::Dropout { prob }, _) => Layer::Dropout(DropoutConfig::new(prob).init()),
                (LayerSpec::Flatten {}, _) => Layer::Flatten(Flatten),
                (LayerSpec::Embedding { dim }, Activation::Tokens { vocab, .. }) => {
                    Layer::Embedding(EmbeddingConfig::new(u(vocab), u(dim)).init(device))
                }
                (LayerSpec::Lstm { hidden }, Activation::Sequence(_, f)) => {
                    Layer::Lstm(LstmConfig::new(u(f), u(hidden), true).init(device))
                }
                (LayerSpec::Gru { hidden }, Activation::Sequence(_, f)) => {
                    Layer::Gru(GruConfig::new(u(f), u(hidden), true).init(device))
                }
                (LayerSpec::LayerNorm {}, Activation::Flat(f) | Activation::Sequence(_, f)) => {
                    Layer::LayerNorm(LayerNormConfig::new(u(f)).init(device))
                }
                (LayerSpec::LastStep {}, _) => Layer::LastStep(LastStep),
                (LayerSpec::PositionEmbedding {}, Activation::Sequence(t, f)) => {
                    Layer::PositionEmbedding(PositionEmbedding::new(u(t), u(f), device))
                }
                (
                    LayerSpec::TransformerBlock { heads, width, ffn, dropout, activation },
                    Activation::Sequence(..),
                ) => Layer::TransformerBlock(TransformerBlock::new(
                    u(heads),
                    u(width),
                    u(ffn),
                    dropout,
                    activation == starling_core::model_spec::FfnActivation::GeluTanh,
                    &|name| lora(&format!("layers.{i}.TransformerBlock.{name}")),
                    device,
                )),
                (LayerSpec::RmsNorm { eps }, Activation::Flat(f) | Activation::Sequence(_, f)) => {
                    Layer::RmsNorm(RmsNorm::new(u(f), eps, device))
                }
                (
                    LayerSpec::LlamaBlock { heads, kv_heads, width, ffn, rope_theta, norm_eps },
                    Activation::Sequence(..),
                ) => Layer::LlamaBlock(LlamaBlock::new(
                    u(heads),
                    u(kv_heads),
                    u(width),
                    u(ffn),
                    rope_theta,
                    norm_eps,
                    &|name| lora(&format!("layers.{i}.LlamaBlock.{name}")),
                    device,
                )),
                (layer, act) => unreachable!("spec validation admitted {layer:?} on {act:?}"),
            };
            layers.push(built);
        }
        Ok(SpecModel { layers })
    }

    /// Class logits, `[batch, classes]`.
    pub fn forward(&self, input: Batch) -> Tensor<2> {
        Classifier::forward(self, input)
    }

    /// The schema of this module's parameters, as burn visits them.
    pub fn schema(&self) -> TensorSchema {
        schema_of(self)
    }

    /// All parameters, flat, in schema order.
    pub fn parameters(&self) -> Vec<f32> {
        parameters_of(self)
    }

    /// Replaces every parameter with `values` (flat, schema order), keeping gradient tracking.
    pub fn load_parameters(self, values: &[f32]) -> Result<Self, ModelError> {
        load_parameters(self, values)
    }
}

impl Classifier for SpecModel {
    fn forward(&self, input: Batch) -> Tensor<2> {
        let mut x = input;
        let mut rest = &self.layers[..];
        while let [layer, after @ ..] = rest {
            (x, rest) = match (fused_pool(rest), x) {
                (Some((relu, taken)), Batch::Image(t)) if cpu_kernels::flex_trains(&t.device()) => {
                    (Batch::Image(cpu_kernels::max_pool_2x2(t, relu)), &rest[taken..])
                }
                (_, x) => (layer.forward(x), after),
            };
        }
        match x {
            Batch::Flat(logits) => logits,
            other => unreachable!("spec validation guarantees flat logits, got {other:?}"),
        }
    }
}

/// Whether `layers` begins with a 2×2, stride-2 max-pool that [`cpu_kernels::max_pool_2x2`] runs
/// in one pass, with a ReLU just before or after it (the two commute: ReLU is monotone): whether
/// that ReLU is there, and how many layers the pass stands for.
fn fused_pool(layers: &[Layer]) -> Option<(bool, usize)> {
    let plain_2x2 = |layer: &Layer| {
        matches!(layer, Layer::MaxPool2d(p) if p.kernel_size == [2, 2]
            && p.stride == [2, 2]
            && p.dilation == [1, 1]
            && !p.ceil_mode
            && matches!(p.padding, PaddingConfig2d::Valid | PaddingConfig2d::Explicit(0, 0, 0, 0)))
    };
    match layers {
        [Layer::Relu(_), pool, ..] | [pool, Layer::Relu(_), ..] if plain_2x2(pool) => {
            Some((true, 2))
        }
        [pool, ..] if plain_2x2(pool) => Some((false, 1)),
        _ => None,
    }
}

impl Layer {
    fn forward(&self, x: Batch) -> Batch {
        match (self, x) {
            (Layer::Linear(l), Batch::Flat(t)) => Batch::Flat(l.forward(t)),
            (Layer::Linear(l), Batch::Sequence(t)) => Batch::Sequence(l.forward(t)),
            (Layer::Conv2d(c), Batch::Image(t)) => Batch::Image(conv2d(c, t)),
            (Layer::MaxPool2d(p), Batch::Image(t)) => Batch::Image(p.forward(t)),
            (Layer::Relu(_), Batch::Flat(t)) => Batch::Flat(relu(t)),
            (Layer::Relu(_), Batch::Sequence(t)) => Batch::Sequence(relu(t)),
            (Layer::Relu(_), Batch::Image(t)) => Batch::Image(relu(t)),
            (Layer::Dropout(d), Batch::Flat(t)) => Batch::Flat(d.forward(t)),
            (Layer::Dropout(d), Batch::Sequence(t)) => Batch::Sequence(d.forward(t)),
            (Layer::Dropout(d), Batch::Image(t)) => Batch::Image(d.forward(t)),
            (Layer::Flatten(_), Batch::Image(t)) => Batch::Flat(t.flatten(1, 3)),
            (Layer::Flatten(_), Batch::Sequence(t)) => Batch::Flat(t.flatten(1, 2)),
            (Layer::Embedding(e), Batch::Tokens(t)) => Batch::Sequence(e.forward(t)),
            (Layer::Lstm(l), Batch::Sequence(t)) => Batch::Sequence(l.forward(t, None).0),
            (Layer::Gru(g), Batch::Sequence(t)) => Batch::Sequence(g.forward(t, None)),
            (Layer::LayerNorm(n), Batch::Flat(t)) => Batch::Flat(n.forward(t)),
            (Layer::LayerNorm(n), Batch::Sequence(t)) => Batch::Sequence(n.forward(t)),
            (Layer::PositionEmbedding(p), Batch::Sequence(t)) => Batch::Sequence(p.forward(t)),
            (Layer::TransformerBlock(b), Batch::Sequence(t)) => Batch::Sequence(b.forward(t)),
            (Layer::RmsNorm(n), Batch::Flat(t)) => Batch::Flat(n.forward(t)),
            (Layer::RmsNorm(n), Batch::Sequence(t)) => Batch::Sequence(n.forward(t)),
            (Layer::LlamaBlock(b), Batch::Sequence(t)) => Batch::Sequence(b.forward(t)),
            (Layer::LastStep(_), Batch::Sequence(t)) => {
                let [b, s, f] = t.dims();
                Batch::Flat(t.slice([0..b, s - 1..s, 0..f]).reshape([b, f]))
            }
            (layer, x) => unreachable!("spec validation admitted {layer:?} on {x:?}"),
        }
    }
}

/// Collects names and shapes (and optionally values) in visiting order.
struct Reader {
    path: Vec<String>,
    tensors: Vec<TensorSpec>,
    values: Option<Vec<f32>>,
}

impl ModuleVisitor for Reader {
    fn enter_module(&mut self, name: &str, _container_type: &str) {
        self.path.push(name.to_owned());
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.pop();
    }

    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let tensor = param.val();
        let shape = tensor.dims().iter().map(|&d| d as u64).collect();
        self.tensors.push(TensorSpec { name: self.path.join("."), shape, dtype: DType::F32 });
        if let Some(values) = &mut self.values {
            let data = tensor.into_data();
            values.extend(data.iter::<f32>());
        }
    }
}

/// Replaces parameters from a flat slice, in visiting order.
struct Writer<'a> {
    values: &'a [f32],
    offset: usize,
}

impl ModuleMapper for Writer<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        param.map(|old| {
            let dims = old.dims();
            let n: usize = dims.iter().product();
            let slice = &self.values[self.offset..self.offset + n];
            self.offset += n;
            let new = Tensor::<D>::from_data(TensorData::new(slice.to_vec(), dims), &old.device());
            // A rebuilt tensor does not track gradients; the next backward() needs it to.
            if old.is_require_grad() { new.require_grad() } else { new }
        })
    }
}

#[cfg(test)]
mod tests;

/// A convolution layer's forward pass. On flex, a convolution with stride 1, a square kernel and
/// the same padding on every side is a matrix multiply over its input's patches, a group of
/// images at a time ([`cpu_kernels::conv2d_by_patches`]), and so is each of its two gradients;
/// the input's gradient is not computed where the input carries none (the model's first layer).
/// flex's own convolution (a direct forward pass, an input gradient by transposed convolution and
/// a weight gradient by convolving the input with the output gradient) ran the FedAvg CNN's
/// layers at 5–8 GFLOP/s (first) and ~150–200 (second); docs/benchmarks.md has what this path
/// reaches (`train_profile`). On wgpu, and for any other convolution, burn's own runs.
fn conv2d(c: &Conv2d, x: Tensor<4>) -> Tensor<4> {
    /// Most bytes the whole batch's patches may take; past this burn's convolution runs. (The
    /// patches are gathered a group of images at a time, and not kept, since this bound was set.)
    const MAX_PATCH_BYTES: usize = 64 << 20;
    let [b, ch, h, w] = x.dims();
    let [_, _, k, kw] = c.weight.dims();
    let PaddingConfig2d::Explicit(p, p_left, p_bottom, p_right) = c.padding else {
        return c.forward(x);
    };
    let (ho, wo) = ((h + 2 * p + 1).saturating_sub(k), (w + 2 * p + 1).saturating_sub(k));
    let patch_bytes = b * ch * k * k * ho * wo * std::mem::size_of::<f32>();
    let suits = cpu_kernels::flex_trains(&x.device())
        && k == kw
        && [p_left, p_bottom, p_right] == [p; 3]
        && c.stride == [1, 1]
        && c.dilation == [1, 1]
        && c.groups == 1
        && ho * wo > 0
        && patch_bytes <= MAX_PATCH_BYTES;
    if !suits {
        return c.forward(x);
    }
    let out = cpu_kernels::conv2d_by_patches(x, c.weight.val(), p);
    match &c.bias {
        Some(bias) => out + bias.val().reshape([1, bias.dims()[0], 1, 1]),
        None => out,
    }
}
