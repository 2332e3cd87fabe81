//! Starling for apps, through UniFFI: the one object an Android, iOS or other app creates per
//! device ([`StarlingDevice`]), its records, errors and progress listener. There is no training
//! logic here: enrolment, check-in, training and upload are the client SDK's
//! ([`starling_client::participant`]); this crate only makes them callable from Kotlin, Swift
//! and Python, blocking on an internal runtime (apps call it from a background thread).

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use starling_client::backend::{self, Backend, BackendChoice};
use starling_client::examples::Examples;
use starling_client::participant::{
    Outcome, Participant, ParticipantError, ParticipantProgress, ParticipantState, Phase,
};
use starling_client::protocol::{FleetClient, TlsSettings};
use starling_client::train::{Evaluation, TrainError, TrainingPlan};
use starling_client::trainer::{ModelTensors, TrainedValues, Trainer, TrainerOutput};
use starling_core::model_spec::InputSpec;
use starling_core::secagg;

uniffi::setup_scaffolding!();

/// What went wrong, as a typed exception in Kotlin, Swift and Python. The explanation is
/// `reason`: a field named `message` would clash with Kotlin's `Throwable.message`, and the
/// generated Kotlin would not compile.
#[derive(Debug, thiserror::Error, uniffi::Error)]
pub enum StarlingError {
    /// An argument is unusable (wrong lengths, a non-finite value, a bad URL, a shape that
    /// does not fit the run's model).
    #[error("invalid input: {reason}")]
    InvalidInput {
        /// What is wrong.
        reason: String,
    },
    /// There are no examples to train on.
    #[error("the example store is empty: add examples first")]
    NoExamples,
    /// The device has no credential yet.
    #[error("not enrolled: create the device with a credential, or call enroll")]
    NotEnrolled,
    /// The coordinator could not be reached; try again later.
    #[error("the coordinator is unreachable: {reason}")]
    Unreachable {
        /// The transport's explanation.
        reason: String,
    },
    /// The coordinator answered with an error.
    #[error("the coordinator refused: {reason}")]
    Refused {
        /// Its explanation.
        reason: String,
    },
    /// The run's model cannot be built or does not match.
    #[error("model: {reason}")]
    Model {
        /// What does not fit.
        reason: String,
    },
    /// Local training failed.
    #[error("training failed: {reason}")]
    Training {
        /// Why.
        reason: String,
    },
    /// The storage directory could not be read or written.
    #[error("storage: {reason}")]
    Storage {
        /// Why.
        reason: String,
    },
}

/// The shape of each example the app adds.
#[derive(Debug, Clone, Copy, uniffi::Enum)]
pub enum ExampleShape {
    /// A flat feature vector.
    Features {
        /// Values per example.
        size: u64,
    },
    /// An image, channels first.
    Image {
        /// Channels.
        channels: u64,
        /// Height.
        height: u64,
        /// Width.
        width: u64,
    },
    /// A sequence of token ids (passed as whole-number floats).
    Tokens {
        /// Tokens per example.
        length: u64,
        /// Vocabulary size.
        vocab: u64,
    },
}

impl From<ExampleShape> for InputSpec {
    fn from(shape: ExampleShape) -> Self {
        match shape {
            ExampleShape::Features { size } => InputSpec::Features { size },
            ExampleShape::Image { channels, height, width } => {
                InputSpec::Image { channels, height, width }
            }
            ExampleShape::Tokens { length, vocab } => InputSpec::Tokens { length, vocab },
        }
    }
}

/// A model's loss and accuracy on the device's held-out examples.
#[derive(Debug, Clone, Copy, uniffi::Record)]
pub struct ModelMetrics {
    /// Fraction classified correctly.
    pub accuracy: f64,
    /// Mean cross-entropy.
    pub loss: f64,
    /// Examples evaluated.
    pub examples: u64,
}

impl From<Evaluation> for ModelMetrics {
    fn from(e: Evaluation) -> Self {
        ModelMetrics { accuracy: e.accuracy, loss: e.loss, examples: e.examples }
    }
}

/// What one participation did.
#[derive(Debug, Clone, uniffi::Enum)]
pub enum ParticipationOutcome {
    /// No task now; participate again after this long.
    ComeBackLater {
        /// Seconds the coordinator asks the device to wait.
        after_secs: u64,
    },
    /// An update was uploaded and acknowledged.
    Uploaded {
        /// Run.
        run_id: i64,
        /// Round.
        round_idx: i64,
        /// Mean local training loss.
        train_loss: f64,
        /// The global model on held-out examples, when it was evaluated this time.
        evaluation: Option<ModelMetrics>,
    },
    /// An evaluation-only round: the model was evaluated on local data and the metrics
    /// acknowledged; nothing was trained.
    Evaluated {
        /// Run.
        run_id: i64,
        /// Round.
        round_idx: i64,
        /// The evaluation reported.
        evaluation: ModelMetrics,
    },
    /// The round closed before the update arrived.
    RoundMissed {
        /// Run.
        run_id: i64,
        /// Round.
        round_idx: i64,
    },
    /// Selected, but the conditions last set (`set_conditions`) no longer meet the run's
    /// requirements: the device left the round before downloading or training anything.
    ConditionsNotMet {
        /// Run.
        run_id: i64,
        /// Round.
        round_idx: i64,
        /// The requirements not met, named as in the plan (`charging`, `min_battery_percent`,
        /// `unmetered_network`, `idle`, `min_app_version`, `min_free_storage_bytes`).
        unmet: Vec<String>,
    },
}

/// The device's conditions, reported at every check-in: runs whose plan requires some (say,
/// charging on Wi-Fi) select only devices that report them. The SDK checks them again before
/// it downloads and before it trains, so a device unplugged after its check-in leaves the round
/// ([`ParticipationOutcome::ConditionsNotMet`]). Unreported conditions meet no requirement.
#[derive(Debug, Clone, Default, uniffi::Record)]
pub struct DeviceConditions {
    /// On external power.
    #[uniffi(default)]
    pub charging: Option<bool>,
    /// Battery charge, percent (0 to 100).
    #[uniffi(default)]
    pub battery_percent: Option<u8>,
    /// On an unmetered network (Wi-Fi, Ethernet).
    #[uniffi(default)]
    pub unmetered_network: Option<bool>,
    /// Not in use.
    #[uniffi(default)]
    pub idle: Option<bool>,
    /// The app's version, dotted numbers (`4.12.1`).
    #[uniffi(default)]
    pub app_version: Option<String>,
    /// Free storage, in bytes.
    #[uniffi(default)]
    pub free_storage_bytes: Option<u64>,
}

impl From<DeviceConditions> for starling_core::eligibility::DeviceAttributes {
    fn from(c: DeviceConditions) -> Self {
        Self {
            charging: c.charging,
            battery_percent: c.battery_percent,
            unmetered_network: c.unmetered_network,
            idle: c.idle,
            app_version: c.app_version,
            free_storage_bytes: c.free_storage_bytes,
        }
    }
}

/// Where the device stands.
#[derive(Debug, Clone, uniffi::Record)]
pub struct DeviceStatus {
    /// The device id, once enrolled.
    pub device_id: Option<i64>,
    /// Whether it holds a credential.
    pub enrolled: bool,
    /// Examples in the store.
    pub examples: u64,
    /// Participations attempted.
    pub participations: u64,
    /// Updates acknowledged.
    pub uploads: u64,
    /// The backend training runs on.
    pub backend: String,
    /// Mean local training loss of the last upload.
    pub last_train_loss: Option<f64>,
    /// The last evaluation of a global model on held-out examples.
    pub last_evaluation: Option<ModelMetrics>,
}

/// One tensor of the run's model, as an app's own trainer sees it: name, shape and values.
#[derive(Debug, Clone, uniffi::Record)]
pub struct NamedTensor {
    /// Its name in the run's schema (`model.schema` in the plan).
    pub name: String,
    /// Its dimensions, outermost first.
    pub shape: Vec<u64>,
    /// Its values, row-major.
    pub values: Vec<f32>,
}

/// The plan's training section for this round, as an app's trainer reads it.
#[derive(Debug, Clone, uniffi::Record)]
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

/// What an app's trainer trained.
#[derive(Debug, Clone, uniffi::Record)]
pub struct TrainedTensors {
    /// Every tensor of the model it was given, in any order: the trained values, or their
    /// change when `is_delta`.
    pub tensors: Vec<NamedTensor>,
    /// Whether `tensors` hold the change rather than the trained values.
    pub is_delta: bool,
    /// Examples trained on per epoch (the update's weight).
    pub examples: u64,
    /// Mean training loss.
    pub loss: f64,
}

/// Why an app's trainer failed: raise it (Kotlin `TrainerException.Failed`) and the
/// participation ends with nothing sent.
#[derive(Debug, thiserror::Error, uniffi::Error)]
pub enum TrainerError {
    /// The trainer's explanation.
    #[error("{reason}")]
    Failed {
        /// Why.
        reason: String,
    },
}

impl From<uniffi::UnexpectedUniFFICallbackError> for TrainerError {
    fn from(e: uniffi::UnexpectedUniFFICallbackError) -> Self {
        TrainerError::Failed { reason: e.reason }
    }
}

/// An app's own trainer (TensorFlow Lite, ExecuTorch, Core ML, PyTorch, ...): set with
/// [`StarlingDevice::set_trainer`], it trains and evaluates the run's model on the app's own
/// examples, and the SDK does the rest (check-in, eligibility, resumable uploads,
/// compression, DP clipping, SecAgg+ masking, local tensors). Called on a background thread.
#[uniffi::export(foreign)]
pub trait AppTrainer: Send + Sync {
    /// Trains `model` (every tensor of the run's schema, in its order) as `settings` say.
    fn train(
        &self,
        model: Vec<NamedTensor>,
        settings: TrainingSettings,
    ) -> Result<TrainedTensors, TrainerError>;

    /// Evaluates `model` on held-out examples; `None` when the app holds none out.
    fn evaluate(&self, model: Vec<NamedTensor>) -> Result<Option<ModelMetrics>, TrainerError>;
}

/// An [`AppTrainer`] as the SDK's [`Trainer`]: named tensors across the FFI, one copy each way.
struct ForeignTrainer(Arc<dyn AppTrainer>);

fn named_tensors(model: ModelTensors<'_>) -> Vec<NamedTensor> {
    model
        .iter()
        .map(|(t, values)| NamedTensor {
            name: t.name.clone(),
            shape: t.shape.clone(),
            values: values.to_vec(),
        })
        .collect()
}

impl Trainer for ForeignTrainer {
    fn train(&self, model: ModelTensors<'_>, plan: &TrainingPlan) -> Result<TrainerOutput, String> {
        let settings = TrainingSettings {
            epochs: plan.epochs,
            batch_size: plan.batch_size,
            learning_rate: plan.lr,
            optimizer: plan.optimizer.name().into(),
            fedprox_mu: plan.fedprox_mu,
            seed: plan.seed,
        };
        let trained = self.0.train(named_tensors(model), settings).map_err(|e| e.to_string())?;
        // Back in the schema's order, each tensor by name and shape.
        let mut values = Vec::with_capacity(model.values.len());
        for spec in &model.schema.tensors {
            let tensor = trained.tensors.iter().find(|t| t.name == spec.name).ok_or_else(|| {
                format!("the trainer returned no tensor {} (the run's model has it)", spec.name)
            })?;
            if tensor.shape != spec.shape || tensor.values.len() as u64 != spec.numel() {
                return Err(format!(
                    "the trainer returned {} as {:?} with {} values, the run's model has {:?}",
                    spec.name,
                    tensor.shape,
                    tensor.values.len(),
                    spec.shape
                ));
            }
            values.extend_from_slice(&tensor.values);
        }
        let trained_values = if trained.is_delta {
            TrainedValues::Delta(values)
        } else {
            TrainedValues::Model(values)
        };
        Ok(TrainerOutput {
            trained: trained_values,
            examples: trained.examples,
            loss: trained.loss,
        })
    }

    fn evaluate(&self, model: ModelTensors<'_>) -> Result<Option<Evaluation>, String> {
        let metrics = self.0.evaluate(named_tensors(model)).map_err(|e| e.to_string())?;
        Ok(metrics.map(|m| Evaluation { loss: m.loss, accuracy: m.accuracy, examples: m.examples }))
    }
}

/// Progress of a participation, for the app's UI.
#[uniffi::export(foreign)]
pub trait ProgressListener: Send + Sync {
    /// A phase began: `checking_in`, `downloading`, `evaluating`, `training`, `uploading`.
    fn on_phase(&self, phase: String);
    /// A training step finished.
    fn on_step(&self, epoch: u32, batch: u32, batches: u32, loss: f64);
}

/// One device: its coordinator, credential, storage directory and examples.
#[derive(uniffi::Object)]
pub struct StarlingDevice {
    runtime: tokio::runtime::Runtime,
    url: String,
    population: String,
    state_path: PathBuf,
    backend: Backend,
    examples: Mutex<Examples>,
    state: Mutex<ParticipantState>,
    activity: Mutex<Activity>,
    listener: Mutex<Option<Arc<dyn ProgressListener>>>,
    /// The app's own trainer, once set: it trains and evaluates instead of the SDK's.
    trainer: Mutex<Option<Arc<dyn AppTrainer>>>,
    tls: Mutex<TlsSettings>,
    /// Shared with the participation that runs, which reads them before it downloads and
    /// before it trains.
    conditions: Arc<Mutex<starling_core::eligibility::DeviceAttributes>>,
}

/// What the device did since it was created; the rest of [`DeviceStatus`] is read from the
/// state and the example store when asked.
#[derive(Debug, Default)]
struct Activity {
    participations: u64,
    uploads: u64,
    last_train_loss: Option<f64>,
    last_evaluation: Option<ModelMetrics>,
}

/// Held out of the app's examples to evaluate each global model.
const HOLDOUT: f64 = 0.1;

#[uniffi::export]
impl StarlingDevice {
    /// A device for the coordinator at `coordinator_url`, in `population`, taking examples of
    /// `shape`. Its state lives in `storage_dir` (created if missing) and is restored from
    /// there; `credential`, when given, replaces a stored one.
    #[uniffi::constructor]
    pub fn new(
        coordinator_url: String,
        population: String,
        credential: Option<String>,
        storage_dir: String,
        shape: ExampleShape,
    ) -> Result<Arc<Self>, StarlingError> {
        if !starling_core::wire::is_http_url(&coordinator_url) {
            return Err(invalid(format!("{coordinator_url:?} is not an http(s) URL")));
        }
        let input: InputSpec = shape.into();
        let dims: Vec<u64> = match input {
            InputSpec::Features { size } => vec![size],
            InputSpec::Image { channels, height, width } => vec![channels, height, width],
            InputSpec::Tokens { length, vocab } => vec![length, vocab],
        };
        if dims.contains(&0)
            || dims.iter().try_fold(1u64, |a, &d| a.checked_mul(d)).is_none_or(|n| n > 1 << 24)
        {
            return Err(invalid(format!("example shape {input:?} is empty or too large")));
        }
        let dir = PathBuf::from(storage_dir);
        std::fs::create_dir_all(&dir).map_err(storage)?;
        let state_path = dir.join("starling-state.json");
        let mut state = ParticipantState::load(&state_path).map_err(storage)?.unwrap_or_default();
        if credential.is_some() {
            state.credential = credential;
        }
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .map_err(storage)?;
        let backend = backend::select(BackendChoice::Auto).map_err(|e| invalid(e.to_string()))?;
        let device = StarlingDevice {
            runtime,
            url: coordinator_url.trim_end_matches('/').to_owned(),
            population,
            state_path,
            backend,
            examples: Mutex::new(Examples::new(input)),
            state: Mutex::new(state),
            activity: Mutex::default(),
            listener: Mutex::new(None),
            trainer: Mutex::new(None),
            tls: Mutex::default(),
            conditions: Arc::default(),
        };
        device.save_state()?;
        Ok(Arc::new(device))
    }

    /// How to verify an `https://` coordinator: `ca_pem`, the PEM CA certificate(s) its
    /// certificate must chain to (none: the platform's trust store), and `client_identity_pem`,
    /// the device's certificate chain followed by its key, for a coordinator that requires
    /// mutual TLS. Applies to every later call; unusable PEM is refused and changes nothing.
    pub fn set_tls(
        &self,
        ca_pem: Option<String>,
        client_identity_pem: Option<String>,
    ) -> Result<(), StarlingError> {
        let tls = TlsSettings {
            ca_pem: ca_pem.map(String::into_bytes),
            identity_pem: client_identity_pem.map(String::into_bytes),
        };
        FleetClient::with_tls(&self.url, &tls).map_err(|e| invalid(e.to_string()))?;
        *lock(&self.tls) = tls;
        Ok(())
    }

    /// The device's conditions from now on (the app calls this as they change: power,
    /// battery, network, use), also while `participate` runs on another thread. A battery level
    /// over 100 is refused and changes nothing.
    pub fn set_conditions(&self, conditions: DeviceConditions) -> Result<(), StarlingError> {
        if let Some(level) = conditions.battery_percent.filter(|&l| l > 100) {
            return Err(invalid(format!("battery_percent {level} is over 100")));
        }
        *lock(&self.conditions) = conditions.into();
        Ok(())
    }

    /// Trades an operator-issued enrollment token for a credential (stored); the device id.
    pub fn enroll(&self, enrollment_token: String) -> Result<i64, StarlingError> {
        let mut participant =
            self.participant(Examples::new(self.input()), Examples::new(self.input()))?;
        let id = self.runtime.block_on(participant.enroll(&enrollment_token)).map_err(map_error)?;
        *lock(&self.state) = participant.state().clone();
        self.save_state()?;
        Ok(id.0)
    }

    /// This device's identity key, 64 hex digits: what the operator's enrolment authority
    /// certifies (`starling enrolment certify`). Made and saved on first call, before
    /// enrolling; `enroll` then registers this same key.
    pub fn identity_key(&self) -> Result<String, StarlingError> {
        let mut participant =
            self.participant(Examples::new(self.input()), Examples::new(self.input()))?;
        let key = participant.identity_key();
        *lock(&self.state) = participant.state().clone();
        self.save_state()?;
        Ok(secagg::key_hex(&key))
    }

    /// Pins the operator's enrolment authority, `authority` (its public key in hex, shipped
    /// with the app: never taken from the coordinator), and holds this device's `certificate`
    /// from it (128 hex digits, from the operator's provisioning). In secure rounds the device
    /// then joins only neighbours the authority certified. Unreadable hex, or a certificate
    /// that is not the authority's for [`StarlingDevice::identity_key`], is refused and changes
    /// nothing.
    pub fn set_enrolment(
        &self,
        authority: String,
        certificate: Option<String>,
    ) -> Result<(), StarlingError> {
        let enrolment =
            starling_core::participation::Enrolment::from_hex(&authority, certificate.as_deref())
                .map_err(invalid)?;
        let mut participant =
            self.participant(Examples::new(self.input()), Examples::new(self.input()))?;
        participant.set_enrolment(enrolment).map_err(|e| invalid(e.to_string()))?;
        *lock(&self.state) = participant.state().clone();
        self.save_state()
    }

    /// Adds examples: `labels.len()` of them, their features one after another in `features`.
    /// Nothing is added if any example is invalid.
    pub fn add_examples(&self, features: Vec<f32>, labels: Vec<u32>) -> Result<(), StarlingError> {
        let width = Examples::width(self.input());
        if labels.is_empty() || features.len() != labels.len() * width {
            return Err(invalid(format!(
                "{} labels need {} feature values ({width} each), got {}",
                labels.len(),
                labels.len() * width,
                features.len()
            )));
        }
        let mut batch = Examples::new(self.input());
        for (i, (row, &label)) in features.chunks(width).zip(&labels).enumerate() {
            batch.push(row, label).map_err(|e| invalid(format!("example {i}: {e}")))?;
        }
        lock(&self.examples).extend(&batch);
        Ok(())
    }

    /// Removes every example.
    pub fn clear_examples(&self) {
        *lock(&self.examples) = Examples::new(self.input());
    }

    /// One participation: check in and, when selected, evaluate the global model on held-out
    /// examples, train on the rest and upload the update. Blocks until done.
    pub fn participate(&self) -> Result<ParticipationOutcome, StarlingError> {
        let trainer = lock(&self.trainer).clone();
        // With the app's own trainer, its examples are its business: none are copied here.
        let (train_set, holdout) = match &trainer {
            Some(_) => (Examples::new(self.input()), Examples::new(self.input())),
            None => {
                let examples = lock(&self.examples).clone();
                if examples.is_empty() {
                    return Err(StarlingError::NoExamples);
                }
                examples.split_holdout(HOLDOUT, 0)
            }
        };
        if lock(&self.state).credential.is_none() {
            return Err(StarlingError::NotEnrolled);
        }
        let mut participant = self.participant(train_set, holdout)?;
        if let Some(trainer) = trainer {
            participant = participant.training_with(ForeignTrainer(trainer));
        }
        let listener = lock(&self.listener).clone();
        let progress = Box::new(move |p: ParticipantProgress| {
            let Some(listener) = &listener else { return };
            match p {
                ParticipantProgress::Phase(phase) => listener.on_phase(phase_name(phase).into()),
                ParticipantProgress::Step(s) => {
                    listener.on_step(s.epoch, s.batch as u32, s.batches as u32, s.loss)
                }
            }
        });
        lock(&self.activity).participations += 1;
        let outcome = self.runtime.block_on(participant.participate(progress));
        // The state (last evaluated model) advances even when the upload failed.
        *lock(&self.state) = participant.state().clone();
        self.save_state()?;
        let outcome = outcome.map_err(map_error)?;
        let mut activity = lock(&self.activity);
        Ok(match outcome {
            Outcome::ComeBackLater(after) => {
                ParticipationOutcome::ComeBackLater { after_secs: after.as_secs().max(1) }
            }
            Outcome::Uploaded { run_id, round_idx, train_loss, evaluation } => {
                activity.uploads += 1;
                activity.last_train_loss = Some(train_loss);
                if let Some(e) = evaluation {
                    activity.last_evaluation = Some(e.into());
                }
                ParticipationOutcome::Uploaded {
                    run_id: run_id.0,
                    round_idx: round_idx.0,
                    train_loss,
                    evaluation: evaluation.map(Into::into),
                }
            }
            Outcome::Evaluated { run_id, round_idx, evaluation } => {
                activity.last_evaluation = Some(evaluation.into());
                ParticipationOutcome::Evaluated {
                    run_id: run_id.0,
                    round_idx: round_idx.0,
                    evaluation: evaluation.into(),
                }
            }
            Outcome::RoundMissed { run_id, round_idx } => {
                ParticipationOutcome::RoundMissed { run_id: run_id.0, round_idx: round_idx.0 }
            }
            Outcome::ConditionsNotMet { run_id, round_idx, unmet } => {
                ParticipationOutcome::ConditionsNotMet {
                    run_id: run_id.0,
                    round_idx: round_idx.0,
                    unmet: unmet.into_iter().map(str::to_owned).collect(),
                }
            }
        })
    }

    /// Where the device stands.
    pub fn status(&self) -> DeviceStatus {
        let (device_id, enrolled) = {
            let state = lock(&self.state);
            (state.device_id.map(|d| d.0), state.credential.is_some())
        };
        let activity = lock(&self.activity);
        DeviceStatus {
            device_id,
            enrolled,
            examples: lock(&self.examples).len() as u64,
            participations: activity.participations,
            uploads: activity.uploads,
            backend: self.backend.to_string(),
            last_train_loss: activity.last_train_loss,
            last_evaluation: activity.last_evaluation,
        }
    }

    /// The last evaluation of a global model on held-out examples, if any.
    pub fn last_metrics(&self) -> Option<ModelMetrics> {
        lock(&self.activity).last_evaluation
    }

    /// The durable state (credential, last evaluated model) as JSON, for apps that keep it
    /// elsewhere too.
    pub fn export_state(&self) -> String {
        serde_json::to_string(&*lock(&self.state)).expect("the state serializes")
    }

    /// Replaces the durable state with one from [`StarlingDevice::export_state`].
    pub fn restore_state(&self, state_json: String) -> Result<(), StarlingError> {
        let state: ParticipantState =
            serde_json::from_str(&state_json).map_err(|e| invalid(format!("state: {e}")))?;
        *lock(&self.state) = state;
        self.save_state()
    }

    /// Writes the durable state to the storage directory (done after every change anyway).
    pub fn save_state(&self) -> Result<(), StarlingError> {
        lock(&self.state).save(&self.state_path).map_err(storage)
    }

    /// Trains and evaluates with the app's own `trainer` from now on, instead of the SDK's
    /// trainer on the examples added: for runs whose plan names only the model's tensors,
    /// trained in the app's framework. The examples added are not used then.
    pub fn set_trainer(&self, trainer: Arc<dyn AppTrainer>) {
        *lock(&self.trainer) = Some(trainer);
    }

    /// Receives progress from now on (replacing any earlier listener).
    pub fn set_progress_listener(&self, listener: Arc<dyn ProgressListener>) {
        *lock(&self.listener) = Some(listener);
    }
}

impl StarlingDevice {
    fn input(&self) -> InputSpec {
        lock(&self.examples).input()
    }

    fn participant(
        &self,
        train_set: Examples,
        holdout: Examples,
    ) -> Result<Participant, StarlingError> {
        let participant = Participant::new(
            &self.url,
            &self.population,
            train_set,
            holdout,
            self.backend.training_device(),
        )
        .with_tls(&lock(&self.tls))
        .map_err(|e| invalid(e.to_string()))?
        .with_shared_attributes(self.conditions.clone())
        // A trained update is on disk before it is sent: an app killed before the
        // acknowledgement sends it on its next `participate`.
        .keeping_state_in(&self.state_path);
        Ok(participant.restore(lock(&self.state).clone()))
    }
}

fn phase_name(phase: Phase) -> &'static str {
    match phase {
        Phase::CheckingIn => "checking_in",
        Phase::Downloading => "downloading",
        Phase::Evaluating => "evaluating",
        Phase::Training => "training",
        Phase::Uploading => "uploading",
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // A panic while holding one of these locks cannot leave half-written data behind them.
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn invalid(message: String) -> StarlingError {
    StarlingError::InvalidInput { reason: message }
}

fn storage(e: impl std::fmt::Display) -> StarlingError {
    StarlingError::Storage { reason: e.to_string() }
}

fn map_error(e: ParticipantError) -> StarlingError {
    match e {
        ParticipantError::Protocol(c) if c.is_transient() => {
            StarlingError::Unreachable { reason: c.to_string() }
        }
        ParticipantError::Protocol(c) => StarlingError::Refused { reason: c.to_string() },
        ParticipantError::NotEnrolled => StarlingError::NotEnrolled,
        e @ ParticipantError::StateFile { .. } => storage(e),
        ParticipantError::Train(TrainError::NoExamples) => StarlingError::NoExamples,
        ParticipantError::Train(
            e @ (TrainError::InputMismatch { .. } | TrainError::Label { .. }),
        ) => invalid(e.to_string()),
        ParticipantError::Train(e) => StarlingError::Training { reason: e.to_string() },
        e => StarlingError::Model { reason: e.to_string() },
    }
}
