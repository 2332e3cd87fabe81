//! Central evaluation: a process on the operator's side that evaluates every committed model of
//! a run on a held-out set of its own and reports the metrics through the admin API, so the
//! dashboard shows the server's view of accuracy beside the devices' federated one.
//!
//! It needs the operator's credential only (models are downloaded through the admin API) and
//! builds the model from the run's plan, as devices do.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use starling_core::RunId;
use starling_core::admin::CentralEvaluation;
use starling_core::model_spec::ModelSpec;
use starling_core::tensor::TensorSchema;
use starling_core::wire::ErrorCode;

use crate::backend::Backend;
use crate::data::DataError;
use crate::data::{Dataset, Partition, federated_data};
use crate::examples::Examples;
use crate::model::{ModelIo, SpecModel};
use crate::protocol::{AdminClient, ClientError, TlsSettings};
use crate::train::{Evaluation, TrainError, evaluate};

/// What a central evaluator needs.
#[derive(Debug, Clone)]
pub struct EvaluatorConfig {
    /// Coordinator base URL.
    pub url: String,
    /// Operator token.
    pub operator_token: String,
    /// How to verify an `https://` coordinator.
    pub tls: TlsSettings,
    /// The run whose models to evaluate.
    pub run: RunId,
    /// The name the evaluations are reported under.
    pub name: String,
    /// The held-out set: this dataset's test split.
    pub dataset: Dataset,
    /// `shared/data`.
    pub data_dir: PathBuf,
    /// Seed of the split (the digits have no official test split; the simulator's seed gives
    /// the simulator's).
    pub seed: u64,
    /// Where to evaluate.
    pub backend: Backend,
    /// Keep evaluating new models until the run ends, rather than stopping once every model
    /// committed so far is evaluated.
    pub follow: bool,
}

/// Why central evaluation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EvaluateError {
    /// The held-out set could not be loaded.
    #[error(transparent)]
    Data(#[from] DataError),
    /// The coordinator refused or could not be reached.
    #[error(transparent)]
    Protocol(#[from] ClientError),
    /// The run's plan has no model spec, or one this SDK cannot build.
    #[error("the run's model: {0}")]
    Model(String),
    /// Evaluating failed (e.g. the held-out set does not fit the model's input).
    #[error(transparent)]
    Train(#[from] TrainError),
}

/// Evaluates a model with `values` built from `spec` on `test`.
pub fn evaluate_values(
    spec: &ModelSpec,
    values: &[f32],
    test: &Examples,
    backend: &Backend,
) -> Result<Evaluation, EvaluateError> {
    let io = ModelIo::of_spec(spec).map_err(|e| EvaluateError::Model(e.to_string()))?;
    let model = SpecModel::build(spec, &backend.device)
        .and_then(|m| m.load_parameters(values))
        .map_err(|e| EvaluateError::Model(e.to_string()))?;
    Ok(evaluate(&model, io, test, &backend.device)?)
}

/// The report of an evaluation under `name`.
pub fn central_report(name: &str, evaluation: &Evaluation) -> CentralEvaluation {
    CentralEvaluation {
        evaluator: name.to_owned(),
        example_count: evaluation.examples,
        metrics: evaluation.metrics(),
    }
}

/// Evaluates one run's models on one held-out set and reports each evaluation under one name:
/// what the `evaluate` command and the simulator share.
pub struct CentralEvaluator {
    admin: AdminClient,
    run: RunId,
    name: String,
    spec: ModelSpec,
    schema: TensorSchema,
    test: Arc<Examples>,
    backend: Backend,
}

impl CentralEvaluator {
    /// An evaluator of `run`'s models, which it builds from `spec` (the run's plan's).
    pub fn new(
        admin: AdminClient,
        run: RunId,
        name: &str,
        spec: ModelSpec,
        test: Examples,
        backend: Backend,
    ) -> Result<Self, EvaluateError> {
        let schema = spec.schema().map_err(|e| EvaluateError::Model(e.to_string()))?;
        Ok(Self { admin, run, name: name.to_owned(), spec, schema, test: Arc::new(test), backend })
    }

    /// The run's plan's model spec, as the coordinator gives it to central evaluators: a run
    /// of kind `tensors` has none, and its 422 says how to evaluate such a run instead.
    pub async fn spec_of_run(admin: &AdminClient, run: RunId) -> Result<ModelSpec, EvaluateError> {
        let spec = admin.model_spec(run).await?;
        serde_json::from_value(spec).map_err(|e| EvaluateError::Model(e.to_string()))
    }

    /// Downloads model `version`, evaluates it off the runtime and reports the evaluation;
    /// `None` for a version whose bytes its run gave up (a later checkpoint was written first:
    /// see the plan's `checkpoint_interval`), which there is nothing left to evaluate of.
    pub async fn evaluate_version(
        &self,
        version: i64,
    ) -> Result<Option<Evaluation>, EvaluateError> {
        let payload = match self.admin.model_payload(self.run, version).await {
            Ok(payload) => payload,
            Err(e) if e.code() == Some(ErrorCode::ModelNotKept) => return Ok(None),
            Err(e) => return Err(e.into()),
        };
        let values = self
            .schema
            .decode_f32(&payload)
            .map_err(|e| EvaluateError::Model(format!("model {version}: {e}")))?;
        let (spec, test, backend) = (self.spec.clone(), self.test.clone(), self.backend.clone());
        let evaluation =
            tokio::task::spawn_blocking(move || evaluate_values(&spec, &values, &test, &backend))
                .await
                .expect("evaluation panicked")?;
        let report = central_report(&self.name, &evaluation);
        self.admin.report_central_evaluation(self.run, version, &report).await?;
        Ok(Some(evaluation))
    }

    /// Evaluates every committed model this evaluator has not reported yet, calling `on_model`
    /// with each version and its evaluation, in order. Versions given up by the run's
    /// checkpoint interval are passed over: they can no longer be evaluated.
    pub async fn catch_up(
        &self,
        on_model: &mut impl FnMut(i64, &Evaluation),
    ) -> Result<usize, EvaluateError> {
        let mut evaluated = 0;
        for model in self.admin.models(self.run).await? {
            if model.given_up || model.central.iter().any(|c| c.evaluator == self.name) {
                continue;
            }
            if let Some(evaluation) = self.evaluate_version(model.version).await? {
                on_model(model.version, &evaluation);
                evaluated += 1;
            }
        }
        Ok(evaluated)
    }
}

/// Evaluates the run's committed models that no evaluator of this name has evaluated yet,
/// reporting each; with `follow`, keeps going until the run has ended and every model is
/// evaluated. Returns how many models it evaluated.
pub async fn evaluate_run(
    config: EvaluatorConfig,
    mut on_model: impl FnMut(i64, &Evaluation),
) -> Result<usize, EvaluateError> {
    let admin = AdminClient::with_tls(&config.url, &config.operator_token, &config.tls)?;
    let spec = CentralEvaluator::spec_of_run(&admin, config.run).await?;
    let (dataset, dir, seed) = (config.dataset, config.data_dir.clone(), config.seed);
    let test = tokio::task::spawn_blocking(move || {
        federated_data(dataset, &dir, 1, Partition::Iid, 0, seed).map(|d| d.test)
    })
    .await
    .expect("loading the held-out set panicked")?;
    let evaluator =
        CentralEvaluator::new(admin.clone(), config.run, &config.name, spec, test, config.backend)?;
    let mut evaluated = 0;
    loop {
        let running = admin.run(config.run).await?.status == "running";
        evaluated += evaluator.catch_up(&mut on_model).await?;
        if !config.follow || !running {
            return Ok(evaluated);
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}
