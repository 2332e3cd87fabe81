//! A Python callable as the SDK's `Trainer`: the global model is lent to it as a
//! `GlobalModel` (each tensor copied once, straight into whatever writable float32 buffer the
//! trainer names, e.g. a PyTorch parameter's memory), and what it returns is read through the
//! buffer protocol (each tensor copied once into the update). The SDK checks the result as it
//! checks every trainer's (schema, finite values, at least one example) before anything is sent.

use std::sync::{Arc, Mutex};

use pyo3::buffer::PyBuffer;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};
use starling_client::train::{Evaluation as SdkEvaluation, TrainingPlan};
use starling_client::trainer::{ModelTensors, TrainedValues, Trainer, TrainerOutput};
use starling_core::tensor::{TensorSchema, TensorSpec};

use crate::errors::{InvalidInput, ModelError};

/// The run's global model, readable only while the trainer (or evaluator) it was given to runs.
#[pyclass(module = "starling_client._native", frozen)]
pub struct GlobalModel {
    schema: TensorSchema,
    lent: Mutex<Option<Lent>>,
}

/// The SDK's values, borrowed for the length of one call into Python.
struct Lent {
    ptr: *const f32,
    len: usize,
}

#[allow(unsafe_code)]
// SAFETY: `Lent` points at values the SDK keeps alive and unchanged until `Lending::drop`
// clears it, which happens before the call that lent them returns; every read takes the lock.
unsafe impl Send for Lent {}

impl GlobalModel {
    fn tensor(&self, name: &str) -> PyResult<(&TensorSpec, std::ops::Range<usize>)> {
        self.schema.ranges().find(|(t, _)| t.name == name).ok_or_else(|| {
            pyo3::exceptions::PyKeyError::new_err(format!("the run's model has no tensor {name:?}"))
        })
    }

    fn with_values<R>(&self, read: impl FnOnce(&[f32]) -> PyResult<R>) -> PyResult<R> {
        let lent = self.lent.lock().unwrap_or_else(|p| p.into_inner());
        let Some(lent) = lent.as_ref() else {
            return Err(ModelError::new_err(
                "the global model is readable only inside the trainer call it was given to",
            ));
        };
        // SAFETY: see `Lent`; the lock is held for the whole read, so `Lending::drop` cannot
        // end the loan during it.
        #[allow(unsafe_code)]
        let values = unsafe { std::slice::from_raw_parts(lent.ptr, lent.len) };
        read(values)
    }
}

#[pymethods]
impl GlobalModel {
    /// The tensors' names, in the run's schema order.
    fn names(&self) -> Vec<String> {
        self.schema.tensors.iter().map(|t| t.name.clone()).collect()
    }

    /// The named tensor's shape.
    fn shape(&self, name: &str) -> PyResult<Vec<u64>> {
        Ok(self.tensor(name)?.0.shape.clone())
    }

    /// Every tensor's shape, by name.
    fn shapes<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let shapes = PyDict::new(py);
        for t in &self.schema.tensors {
            shapes.set_item(&t.name, t.shape.clone())?;
        }
        Ok(shapes)
    }

    /// Copies the named tensor into `target`, a writable C-contiguous float32 buffer of its
    /// size (a NumPy array, `torch_tensor.numpy()`): the one copy between the SDK and the
    /// trainer's model.
    fn copy_into(&self, py: Python<'_>, name: &str, target: &Bound<'_, PyAny>) -> PyResult<()> {
        let (spec, range) = self.tensor(name)?;
        let buffer = PyBuffer::<f32>::get(target).map_err(|e| {
            InvalidInput::new_err(format!("{name}: the target is not a float32 buffer: {e}"))
        })?;
        if buffer.readonly() || !buffer.is_c_contiguous() {
            return Err(InvalidInput::new_err(format!(
                "{name}: the target must be writable and C-contiguous"
            )));
        }
        if buffer.item_count() != range.len() {
            return Err(InvalidInput::new_err(format!(
                "{name} has {} values (shape {:?}), the target holds {}",
                range.len(),
                spec.shape,
                buffer.item_count()
            )));
        }
        self.with_values(|values| buffer.copy_from_slice(py, &values[range]))
    }

    /// The named tensor's values as little-endian float32 bytes (a copy);
    /// `numpy.frombuffer(..., dtype=numpy.float32)` reads them without another.
    fn tensor_bytes<'py>(&self, py: Python<'py>, name: &str) -> PyResult<Bound<'py, PyBytes>> {
        let (_, range) = self.tensor(name)?;
        self.with_values(|values| {
            PyBytes::new_with(py, range.len() * 4, |out| {
                starling_core::tensor::f32_into_le_bytes(&values[range], out);
                Ok(())
            })
        })
    }

    fn __len__(&self) -> usize {
        self.schema.tensors.len()
    }

    fn __repr__(&self) -> String {
        format!(
            "GlobalModel({} tensors, {} values)",
            self.schema.tensors.len(),
            self.schema.numel()
        )
    }
}

/// Lends `model` to a `GlobalModel` for as long as this lives.
struct Lending(Py<GlobalModel>);

impl Lending {
    fn new(py: Python<'_>, model: ModelTensors<'_>) -> PyResult<Self> {
        let lent = Lent { ptr: model.values.as_ptr(), len: model.values.len() };
        let global = GlobalModel { schema: model.schema.clone(), lent: Mutex::new(Some(lent)) };
        Ok(Lending(Py::new(py, global)?))
    }
}

impl Drop for Lending {
    fn drop(&mut self) {
        // A trainer that kept the object finds it empty from now on, never dangling.
        *self.0.get().lent.lock().unwrap_or_else(|p| p.into_inner()) = None;
    }
}

/// The plan's training section for this round.
#[pyclass(module = "starling_client._native", frozen, get_all)]
#[derive(Debug, Clone)]
pub struct TrainingSettings {
    /// Passes over the local examples.
    pub epochs: u32,
    /// Examples per step.
    pub batch_size: u32,
    /// The learning rate.
    pub learning_rate: f64,
    /// `sgd` or `adam`.
    pub optimizer: String,
    /// FedProx's proximal weight (0: plain FedAvg).
    pub fedprox_mu: f64,
    /// This device's seed for this round: shuffle with it, and a repeated round repeats.
    pub seed: u64,
}

#[pymethods]
impl TrainingSettings {
    fn __repr__(&self) -> String {
        format!("{self:?}")
    }
}

impl From<&TrainingPlan> for TrainingSettings {
    fn from(plan: &TrainingPlan) -> Self {
        TrainingSettings {
            epochs: plan.epochs,
            batch_size: plan.batch_size,
            learning_rate: plan.lr,
            optimizer: plan.optimizer.name().into(),
            fedprox_mu: plan.fedprox_mu,
            seed: plan.seed,
        }
    }
}

/// What a trainer returns: every tensor of the model it was given (any mapping of name to a
/// float32 buffer of the tensor's shape: NumPy arrays, `tensor.detach().numpy()`), the
/// trained values or, with `is_delta`, their change; the examples trained on per epoch (the
/// update's FedAvg weight) and the mean training loss.
#[pyclass(module = "starling_client._native", frozen, get_all)]
pub struct Trained {
    tensors: Py<PyAny>,
    examples: u64,
    loss: f64,
    is_delta: bool,
}

#[pymethods]
impl Trained {
    #[new]
    #[pyo3(signature = (tensors, examples, loss, is_delta = false))]
    fn new(tensors: Py<PyAny>, examples: u64, loss: f64, is_delta: bool) -> Self {
        Trained { tensors, examples, loss, is_delta }
    }
}

/// An evaluation of a model on held-out examples.
#[pyclass(module = "starling_client._native", frozen, get_all)]
#[derive(Debug, Clone, Copy)]
pub struct Evaluation {
    /// Mean loss.
    pub loss: f64,
    /// Fraction classified correctly.
    pub accuracy: f64,
    /// Examples evaluated.
    pub examples: u64,
}

#[pymethods]
impl Evaluation {
    #[new]
    fn new(loss: f64, accuracy: f64, examples: u64) -> Self {
        Evaluation { loss, accuracy, examples }
    }

    fn __repr__(&self) -> String {
        format!("{self:?}")
    }
}

impl From<SdkEvaluation> for Evaluation {
    fn from(e: SdkEvaluation) -> Self {
        Evaluation { loss: e.loss, accuracy: e.accuracy, examples: e.examples }
    }
}

/// Python callables as the SDK's trainer. The exception a callable raised is kept for the
/// participation's error to carry as its cause.
pub(crate) struct PyTrainer {
    train: Py<PyAny>,
    evaluate: Option<Py<PyAny>>,
    raised: Arc<Mutex<Option<PyErr>>>,
}

impl PyTrainer {
    pub(crate) fn new(train: Py<PyAny>, evaluate: Option<Py<PyAny>>) -> Self {
        PyTrainer { train, evaluate, raised: Arc::default() }
    }

    /// Where the exception the trainer raises last is kept.
    pub(crate) fn raised(&self) -> Arc<Mutex<Option<PyErr>>> {
        self.raised.clone()
    }

    /// Keeps the exception a callable raised; its "ValueError: why" for the SDK.
    fn keep(&self, e: PyErr) -> String {
        let why = e.to_string();
        *self.raised.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
        why
    }
}

/// Reads the trainer's tensors into the schema's order: one copy of each.
fn read_trained(
    py: Python<'_>,
    trained: &Trained,
    schema: &TensorSchema,
) -> Result<Vec<f32>, String> {
    let tensors = trained.tensors.bind(py);
    let mut values = vec![0f32; schema.numel() as usize];
    for (spec, range) in schema.ranges() {
        let item = tensors.get_item(&spec.name).map_err(|_| {
            format!("the trainer returned no tensor {} (the run's model has it)", spec.name)
        })?;
        let buffer = PyBuffer::<f32>::get(&item).map_err(|e| {
            format!(
                "the trainer returned {} as something other than float32 values: {e}",
                spec.name
            )
        })?;
        let shape: Vec<u64> = buffer.shape().iter().map(|&d| d as u64).collect();
        if shape != spec.shape {
            return Err(format!(
                "the trainer returned {} as {shape:?}, the run's model has {:?}",
                spec.name, spec.shape
            ));
        }
        buffer.copy_to_slice(py, &mut values[range]).map_err(|e| e.to_string())?;
    }
    Ok(values)
}

impl Trainer for PyTrainer {
    fn train(&self, model: ModelTensors<'_>, plan: &TrainingPlan) -> Result<TrainerOutput, String> {
        Python::attach(|py| {
            let lending = Lending::new(py, model).map_err(|e| e.to_string())?;
            let settings = TrainingSettings::from(plan);
            let returned = self
                .train
                .call1(py, (lending.0.clone_ref(py), settings))
                .map_err(|e| self.keep(e))?;
            drop(lending);
            let trained = returned.bind(py).cast::<Trained>().map_err(|_| {
                format!(
                    "the trainer returned {}, not a starling_client.Trained",
                    returned.bind(py).get_type().name().map(|n| n.to_string()).unwrap_or_default()
                )
            })?;
            let trained = trained.get();
            let values = read_trained(py, trained, model.schema)?;
            Ok(TrainerOutput {
                trained: if trained.is_delta {
                    TrainedValues::Delta(values)
                } else {
                    TrainedValues::Model(values)
                },
                examples: trained.examples,
                loss: trained.loss,
            })
        })
    }

    fn evaluate(&self, model: ModelTensors<'_>) -> Result<Option<SdkEvaluation>, String> {
        let Some(evaluate) = &self.evaluate else { return Ok(None) };
        Python::attach(|py| {
            let lending = Lending::new(py, model).map_err(|e| e.to_string())?;
            let returned =
                evaluate.call1(py, (lending.0.clone_ref(py),)).map_err(|e| self.keep(e))?;
            drop(lending);
            if returned.is_none(py) {
                return Ok(None);
            }
            let evaluation = returned
                .bind(py)
                .cast::<Evaluation>()
                .map_err(
                    |_| "the evaluator returned neither None nor a starling_client.Evaluation",
                )?
                .get();
            Ok(Some(SdkEvaluation {
                loss: evaluation.loss,
                accuracy: evaluation.accuracy,
                examples: evaluation.examples,
            }))
        })
    }
}
