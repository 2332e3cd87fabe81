//! The hand-off to an app's own trainer: a device whose model lives in another framework
//! (TensorFlow Lite, ExecuTorch, Core ML, PyTorch) trains it there, and the SDK does the rest
//! of the participation (check-in, eligibility, resumable uploads, compression, DP clipping,
//! SecAgg+ masking, local tensors) exactly as for its own burn trainer.
//!
//! The trainer sees the global model as named tensors (the run's schema order, with the
//! device's local tensors laid over) and the plan's training section, and returns the trained
//! values (or the delta), the example count and the loss. What it returns is checked before
//! anything is sent: the schema's length, finite values, at least one example.

use starling_core::plan::TrainingPlan;
use starling_core::tensor::{TensorSchema, TensorSpec};

use crate::train::{Evaluation, TrainError};

/// A model as the run's named tensors: `values` holds them one after another, in `schema`'s
/// order.
#[derive(Debug, Clone, Copy)]
pub struct ModelTensors<'a> {
    /// Names, shapes and order.
    pub schema: &'a TensorSchema,
    /// All values, flat.
    pub values: &'a [f32],
}

impl<'a> ModelTensors<'a> {
    /// Each tensor with its values.
    pub fn iter(&self) -> impl Iterator<Item = (&'a TensorSpec, &'a [f32])> + 'a {
        let values = self.values;
        self.schema.ranges().map(move |(t, range)| (t, &values[range]))
    }

    /// The values of the tensor named `name`.
    pub fn get(&self, name: &str) -> Option<&'a [f32]> {
        self.iter().find(|(t, _)| t.name == name).map(|(_, v)| v)
    }
}

/// What a trainer trained: the whole model, or its change.
#[derive(Debug, Clone, PartialEq)]
pub enum TrainedValues {
    /// The trained model's values, in the schema's order.
    Model(Vec<f32>),
    /// The trained model minus the one it was given, in the schema's order.
    Delta(Vec<f32>),
}

/// What a trainer reports.
#[derive(Debug, Clone, PartialEq)]
pub struct TrainerOutput {
    /// The trained values.
    pub trained: TrainedValues,
    /// Examples trained on (per epoch): the update's FedAvg weight.
    pub examples: u64,
    /// Mean training loss.
    pub loss: f64,
}

/// An app's own trainer. It runs on a blocking thread: it may take as long as it needs.
pub trait Trainer: Send + Sync + 'static {
    /// Trains `model` on the device's examples as `plan` says (its seed is this device's for
    /// this round). An error ends the participation with nothing sent.
    fn train(&self, model: ModelTensors<'_>, plan: &TrainingPlan) -> Result<TrainerOutput, String>;

    /// Evaluates `model` on the device's held-out examples; `None` when it holds none out
    /// (the default).
    fn evaluate(&self, model: ModelTensors<'_>) -> Result<Option<Evaluation>, String> {
        let _ = model;
        Ok(None)
    }
}

/// Why a trainer's output cannot be sent.
#[derive(Debug)]
pub(crate) enum Unusable {
    /// It is not the run's model's length: the schema's mismatch, explained.
    Length(String),
    /// It is not finite, or weighs nothing.
    Values(TrainError),
}

/// The trained model's values from a trainer's output, once it fits `schema` and is usable.
pub(crate) fn trained_model(
    schema: &TensorSchema,
    from: &[f32],
    output: TrainerOutput,
) -> Result<Vec<f32>, Unusable> {
    let (values, is_delta) = match output.trained {
        TrainedValues::Model(values) => (values, false),
        TrainedValues::Delta(values) => (values, true),
    };
    if values.len() != from.len() {
        return Err(Unusable::Length(format!(
            "the trainer returned a {} of {} values, the run's model has {} ({} tensors)",
            if is_delta { "delta" } else { "model" },
            values.len(),
            from.len(),
            schema.tensors.len()
        )));
    }
    if output.examples == 0 {
        return Err(Unusable::Values(TrainError::NoExamples));
    }
    if !output.loss.is_finite() || values.iter().any(|v| !v.is_finite()) {
        return Err(Unusable::Values(TrainError::Diverged));
    }
    Ok(if is_delta { from.iter().zip(&values).map(|(f, d)| f + d).collect() } else { values })
}

/// A trainer's evaluation, once it is usable.
pub(crate) fn checked_evaluation(evaluation: Evaluation) -> Result<Evaluation, TrainError> {
    let usable = evaluation.examples > 0
        && evaluation.loss.is_finite()
        && (0.0..=1.0).contains(&evaluation.accuracy);
    if usable {
        Ok(evaluation)
    } else {
        Err(TrainError::Trainer(format!(
            "an evaluation needs examples, a finite loss and an accuracy in [0, 1]: {evaluation:?}"
        )))
    }
}
