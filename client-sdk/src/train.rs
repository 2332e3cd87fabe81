//! Local training and evaluation of a [`SpecModel`] on a device's own examples.
//!
//! The plan's training configuration ([`TrainingPlan`], core's, checked when the run was
//! created) arrives as JSON text with each task; [`TrainingPlan::from_json`] checks it again
//! on the device. Training is deterministic for a
//! given seed: batches are shuffled with the SDK's own generator.

use burn::module::{Module, ModuleVisitor, Param};
use burn::nn::loss::CrossEntropyLossConfig;
use burn::optim::{AdamConfig, GradientsParams, ModuleOptimizer, Optimizer, SgdState};
use burn::tensor::{Device, Tensor};
use starling_core::model_spec::InputSpec;
use starling_core::rng::SplitMix64;

use crate::examples::Examples;
use crate::model::{Classifier, ModelIo, cpu_kernels};

/// Why training could not run.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum TrainError {
    /// The training configuration is not valid JSON of the expected shape.
    #[error("training config: {0}")]
    Config(String),
    /// There is nothing to train on.
    #[error("the example store is empty")]
    NoExamples,
    /// The examples do not fit the model's input.
    #[error("examples are {got:?}, the model takes {expected:?}")]
    InputMismatch {
        /// The model's input.
        expected: InputSpec,
        /// The examples' shape.
        got: InputSpec,
    },
    /// A label is not below the model's class count.
    #[error("label {label} is not below the model's {classes} classes")]
    Label {
        /// The label.
        label: u32,
        /// Class count.
        classes: u64,
    },
    /// FedProx needs parameters to anchor, and the model has none.
    #[error("the model has no parameters to train")]
    NoParameters,
    /// The loss became NaN or infinite (learning rate too high?).
    #[error("training diverged: the loss is not finite")]
    Diverged,
    /// The caller gave the training up before it finished (its round closed meanwhile).
    #[error("training was given up: its round's report deadline passed")]
    Abandoned,
    /// The app's own trainer failed (see `trainer::Trainer`); its explanation.
    #[error("the app's trainer failed: {0}")]
    Trainer(String),
}

pub use starling_core::plan::{LocalOptimizer, TrainingPlan};

/// What training reports through the progress callback.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Progress {
    /// Epoch, from 0.
    pub epoch: u32,
    /// Step within the epoch, from 0.
    pub batch: usize,
    /// Steps per epoch.
    pub batches: usize,
    /// This step's loss (including the proximal term).
    pub loss: f64,
}

/// The outcome of local training.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TrainReport {
    /// Mean training loss over the last epoch.
    pub loss: f64,
    /// Examples trained on per epoch: the FedAvg weight.
    pub examples: u64,
}

/// Loss and accuracy on a set of examples (core's, since the participation machine reports it).
pub use starling_core::participation::Evaluation;

/// Trains `model` (on an autodiff `device`) on `examples`, which must fit `io`.
pub fn train<M: Classifier>(
    model: M,
    io: ModelIo,
    examples: &Examples,
    config: &TrainingPlan,
    device: &Device,
    on_progress: &mut dyn FnMut(Progress),
) -> Result<(M, TrainReport), TrainError> {
    train_until(model, io, examples, config, device, on_progress, &|| false)
}

/// [`train`], given up with [`TrainError::Abandoned`] before any step at which `give_up` says
/// so (a device whose round's deadline passed while it trained: the work could only be
/// refused, and it would hold the device, or a simulator's core, from the next round).
pub fn train_until<M: Classifier>(
    model: M,
    io: ModelIo,
    examples: &Examples,
    config: &TrainingPlan,
    device: &Device,
    on_progress: &mut dyn FnMut(Progress),
    give_up: &dyn Fn() -> bool,
) -> Result<(M, TrainReport), TrainError> {
    check_examples(io, examples)?;
    let anchor = (config.fedprox_mu > 0.0).then(|| flat_params(&model.valid()));
    let loss_fn = CrossEntropyLossConfig::new().init(device);
    let mut optim = match config.optimizer {
        LocalOptimizer::Sgd => ModuleOptimizer::from(PlainSgd),
        LocalOptimizer::Adam => AdamConfig::new().init(),
    };
    let mut model = model.train();
    let mut order: Vec<usize> = (0..examples.len()).collect();
    let mut rng = SplitMix64(config.seed ^ 0x005E_ED0F_5747_11E6);
    let batch_size = config.batch_size as usize;
    let batches = examples.len().div_ceil(batch_size);
    let mut epoch_loss = 0.0;
    for epoch in 0..config.epochs {
        rng.shuffle(&mut order);
        epoch_loss = 0.0;
        for (batch, idx) in order.chunks(batch_size).enumerate() {
            if give_up() {
                return Err(TrainError::Abandoned);
            }
            let mut step = |model: M| {
                let (input, targets) = examples.batch(idx, device);
                let logits = model.forward(input);
                let mut loss = loss_fn.forward(logits, targets);
                if let Some(anchor) = &anchor {
                    let current = flat_params(&model);
                    let prox = current
                        .into_iter()
                        .zip(anchor)
                        .map(|(w, w0)| (w - w0.clone()).powi_scalar(2).sum())
                        .reduce(|a, b| a + b)
                        .ok_or(TrainError::NoParameters)?;
                    loss = loss + prox.mul_scalar(config.fedprox_mu / 2.0);
                }
                let value = f64::from(loss.clone().into_scalar::<f32>());
                if !value.is_finite() {
                    return Err(TrainError::Diverged);
                }
                let grads = GradientsParams::from_grads(loss.backward(), &model);
                Ok((optim.step(config.lr, model, grads), value))
            };
            let value;
            (model, value) = on_training_threads(|| step(model))?;
            epoch_loss += value * idx.len() as f64;
            on_progress(Progress { epoch, batch, batches, loss: value });
        }
    }
    let report =
        TrainReport { loss: epoch_loss / examples.len() as f64, examples: examples.len() as u64 };
    Ok((model, report))
}

/// Evaluates `model` on `examples` (which must fit `io`) without tracking gradients.
pub fn evaluate<M: Classifier>(
    model: &M,
    io: ModelIo,
    examples: &Examples,
    device: &Device,
) -> Result<Evaluation, TrainError> {
    check_examples(io, examples)?;
    let model = model.valid();
    on_training_threads(|| evaluate_on_this_thread(model, examples, device))
}

fn evaluate_on_this_thread<M: Classifier>(
    model: M,
    examples: &Examples,
    device: &Device,
) -> Result<Evaluation, TrainError> {
    let device = device.clone().inner();
    let loss_fn = CrossEntropyLossConfig::new().init(&device);
    let (mut loss, mut correct) = (0.0, 0u64);
    let idx: Vec<usize> = (0..examples.len()).collect();
    for chunk in idx.chunks(256) {
        let (input, targets) = examples.batch(chunk, &device);
        let logits = model.forward(input);
        let predicted = logits.clone().argmax(1).reshape([chunk.len()]);
        correct += predicted.equal(targets.clone()).int().sum().into_scalar::<i64>() as u64;
        loss +=
            f64::from(loss_fn.forward(logits, targets).into_scalar::<f32>()) * chunk.len() as f64;
    }
    let n = examples.len() as f64;
    Ok(Evaluation { loss: loss / n, accuracy: correct as f64 / n, examples: examples.len() as u64 })
}

/// SGD without momentum or weight decay, as burn's `Sgd` with its default config, stepping
/// each parameter in one pass and in place on flex ([`cpu_kernels::sgd_step`]): burn's takes two
/// passes and a new tensor per parameter, a millisecond a step for the FedAvg CNN's 1.7 M.
#[derive(Debug, Clone, Copy)]
struct PlainSgd;

impl Optimizer for PlainSgd {
    type State<const D: usize> = SgdState<D>;

    fn step<const D: usize>(
        &self,
        lr: f64,
        tensor: Tensor<D>,
        grad: Tensor<D>,
        _state: Option<SgdState<D>>,
    ) -> (Tensor<D>, Option<SgdState<D>>) {
        let stepped = if cpu_kernels::flex_trains(&tensor.device()) {
            cpu_kernels::sgd_step(tensor, grad, lr)
        } else {
            tensor - grad.mul_scalar(lr)
        };
        (stepped, None)
    }

    fn to_device<const D: usize>(state: SgdState<D>, _device: &Device) -> SgdState<D> {
        state
    }
}

/// Runs `work` on a thread of a rayon pool, the one it is on or else the SDK's training pool
/// (one thread per core): flex's kernels then split their work with the pool's other threads
/// directly. Called from outside any pool, each of the dozens of parallel kernels in a step
/// hands its work to the pool and puts the calling thread to sleep until it is done: the FedAvg
/// CNN trained 1.3× faster at B = 10 inside the pool than outside it (docs/benchmarks.md).
/// The simulator's devices are already on their training slot's pool, and stay there.
fn on_training_threads<R: Send>(work: impl FnOnce() -> R + Send) -> R {
    static POOL: std::sync::OnceLock<Option<rayon::ThreadPool>> = std::sync::OnceLock::new();
    if rayon::current_thread_index().is_some() {
        return work();
    }
    let pool = POOL.get_or_init(|| {
        rayon::ThreadPoolBuilder::new()
            .thread_name(|i| format!("starling-training-{i}"))
            .build()
            .inspect_err(|e| {
                tracing::warn!("no training pool ({e}); training on the caller's thread")
            })
            .ok()
    });
    match pool {
        Some(pool) => pool.install(work),
        None => work(),
    }
}

/// Everything burn would panic on is checked here first.
fn check_examples(io: ModelIo, examples: &Examples) -> Result<(), TrainError> {
    if examples.is_empty() {
        return Err(TrainError::NoExamples);
    }
    if examples.input() != io.input {
        return Err(TrainError::InputMismatch { expected: io.input, got: examples.input() });
    }
    let classes = io.classes;
    if let Some(&label) = examples.labels().iter().find(|&&l| u64::from(l) >= classes) {
        return Err(TrainError::Label { label, classes });
    }
    Ok(())
}

/// Every parameter flattened to rank 1, in schema order.
fn flat_params<M: Module>(model: &M) -> Vec<Tensor<1>> {
    struct Flat(Vec<Tensor<1>>);
    impl ModuleVisitor for Flat {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let t = param.val();
            let n = t.shape().num_elements();
            self.0.push(t.reshape([n]));
        }
    }
    let mut flat = Flat(vec![]);
    model.visit(&mut flat);
    flat.0
}

// The tests train on the shared datasets, which the `tools` feature loads.
#[cfg(all(test, feature = "tools"))]
mod tests;
