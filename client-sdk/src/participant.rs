//! One device's participation in federated training: check in, download the global model,
//! evaluate it on local held-out data, train on local examples, upload the delta.
//!
//! The examples never leave the device: only the parameter delta, the example count and
//! metrics do. The participant's durable state ([`ParticipantState`]) is `Serialize`, so an app
//! that gets killed saves it and restores it on the next start. A device is not always on: with
//! a state file ([`Participant::keeping_state_in`]) a trained update is written there before it
//! is sent, and a device killed before the acknowledgement sends that same update on its next
//! participation instead of training again (the coordinator takes one update per device and
//! task). The plan's requirements on the device's conditions (charging, battery, network) are
//! checked again with the conditions of the moment before the model is downloaded, evaluated
//! and trained.
//!
//! What is trained comes from a [`ModelFactory`]: by default [`FromPlan`] builds the run's
//! declarative spec (a new model needs no app release); a Rust app may bring its own burn module
//! with [`OwnModule`]. Either way the module's schema must equal the task's before anything runs.

use starling_core::eligibility::DeviceAttributes;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use burn::tensor::Device;
use serde::{Deserialize, Serialize};
use starling_core::compression::{Compression, ErrorFeedback};
use starling_core::model_spec::ModelSpec;
use starling_core::plan::ModelParts;
use starling_core::rng::SplitMix64;
use starling_core::secagg::DeviceIdentity;
use starling_core::tensor::{SchemaId, TensorPayload, TensorSchema};
use starling_core::wire::{
    CheckInResponse, ErrorCode, EvaluationReport, TaskAssignment, UploadRequest, UploadTarget,
};
use starling_core::{DeviceId, ModelVersion, RoundIdx, RunId};

use crate::examples::Examples;
use crate::model::{
    Classifier, ModelError, ModelIo, SpecModel, load_parameters, load_parameters_freezing,
    parameters_of, schema_of,
};
use crate::protocol::{self, ClientError, FleetClient, TlsSettings, retrying};
use crate::secure::{SecureError, SecureSession};
use crate::train::{Evaluation, Progress, TrainError, TrainingPlan, evaluate, train_until};

pub use local_part::{LocalPart, LocalTensor};

mod base_model;
mod local_part;

/// Attempts per request on transient failures.
const TRIES: u32 = 4;

/// Why a participation failed; nothing of the device's data was sent in any case.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ParticipantError {
    /// The coordinator refused or could not be reached.
    #[error(transparent)]
    Protocol(#[from] ClientError),
    /// The run's plan has no model spec this SDK can build.
    #[error("the run's plan has no model spec")]
    NoModelSpec,
    /// The model could not be built or loaded.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// The app's module does not have the run's parameters.
    #[error("the model's parameters do not match the run's schema: {0}")]
    SchemaMismatch(String),
    /// Local training failed.
    #[error(transparent)]
    Train(#[from] TrainError),
    /// The participant is not enrolled.
    #[error("not enrolled: call enroll first")]
    NotEnrolled,
    /// The secure-aggregation protocol failed on this device.
    #[error(transparent)]
    SecureAggregation(crate::secure::SecureError),
    /// The saved state could not be read or written.
    #[error("state file {path}: {why}")]
    StateFile {
        /// The file.
        path: String,
        /// What went wrong.
        why: String,
    },
}

/// What a participation did.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// Nothing to do now; check in again after this long.
    ComeBackLater(Duration),
    /// An update was uploaded and acknowledged (it is durable at the coordinator).
    Uploaded {
        /// Run.
        run_id: RunId,
        /// Round.
        round_idx: RoundIdx,
        /// Mean local training loss.
        train_loss: f64,
        /// The global model's evaluation on local held-out data, when it was evaluated.
        evaluation: Option<Evaluation>,
    },
    /// An evaluation-only round: the global model was evaluated on local data and the metrics
    /// acknowledged (durable at the coordinator); nothing was trained.
    Evaluated {
        /// Run.
        run_id: RunId,
        /// Round.
        round_idx: RoundIdx,
        /// The evaluation reported.
        evaluation: Evaluation,
    },
    /// The round closed before the update arrived; nothing was lost but this round's work.
    RoundMissed {
        /// Run.
        run_id: RunId,
        /// Round.
        round_idx: RoundIdx,
    },
    /// Selected, but the device's conditions (as last set) no longer meet the run's
    /// requirements: it left the round before training (and before downloading or evaluating,
    /// when they changed earlier). Check in again when they change.
    ConditionsNotMet {
        /// Run.
        run_id: RunId,
        /// Round.
        round_idx: RoundIdx,
        /// The requirements not met, named as in the plan's `eligibility` (`charging`,
        /// `min_battery_percent`, `unmetered_network`, ...).
        unmet: Vec<&'static str>,
    },
}

/// Where a participation is; reported to the app's progress callback.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Asking the coordinator for a task.
    CheckingIn,
    /// Fetching the global model (skipped when cached).
    Downloading,
    /// Evaluating the global model on local held-out data.
    Evaluating,
    /// Training on local examples; [`ParticipantProgress::Step`] follows for each batch.
    Training,
    /// Sending the update.
    Uploading,
}

/// What the progress callback receives.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ParticipantProgress {
    /// A new phase began.
    Phase(Phase),
    /// A training step finished (epoch, batch, loss).
    Step(Progress),
}

/// The app's progress callback.
pub type ProgressCallback = Box<dyn FnMut(ParticipantProgress) + Send>;

/// How a participant gets the (untrained) module it trains for a task.
pub trait ModelFactory: Send + Sync + 'static {
    /// The module.
    type Model: Classifier;
    /// Builds the module on `device` for a task whose plan carries `spec` (if any), with what
    /// it takes and gives.
    fn build(
        &self,
        spec: Option<&ModelSpec>,
        device: &Device,
    ) -> Result<(Self::Model, ModelIo), ParticipantError>;
}

/// Builds the run's declarative model spec: the default.
#[derive(Debug, Clone, Copy, Default)]
pub struct FromPlan;

impl ModelFactory for FromPlan {
    type Model = SpecModel;

    fn build(
        &self,
        spec: Option<&ModelSpec>,
        device: &Device,
    ) -> Result<(SpecModel, ModelIo), ParticipantError> {
        let spec = spec.ok_or(ParticipantError::NoModelSpec)?;
        Ok((SpecModel::build(spec, device)?, ModelIo::of_spec(spec)?))
    }
}

/// An app's own burn module (Rust embedders): `make` builds it on a device, `io` says what it
/// takes and gives. The run's plan then names its schema (`model.schema`) instead of a spec.
pub struct OwnModule<F> {
    make: F,
    io: ModelIo,
}

impl<F> OwnModule<F> {
    /// Wraps the app's constructor.
    pub fn new(make: F, io: ModelIo) -> Self {
        OwnModule { make, io }
    }
}

impl<F, M> ModelFactory for OwnModule<F>
where
    F: Fn(&Device) -> M + Send + Sync + 'static,
    M: Classifier,
{
    type Model = M;

    fn build(
        &self,
        _spec: Option<&ModelSpec>,
        device: &Device,
    ) -> Result<(M, ModelIo), ParticipantError> {
        Ok(((self.make)(device), self.io))
    }
}

/// The shuffling seed of one device's training in one round: the plan's seed mixed with the
/// device, run and round, so that no two devices and no two rounds repeat a batch order, and a
/// simulation stays reproducible.
pub fn round_seed(plan_seed: u64, device: Option<DeviceId>, run: RunId, round: RoundIdx) -> u64 {
    let mut rng = starling_core::rng::SplitMix64(plan_seed);
    for part in [device.map_or(u64::MAX, |d| d.0 as u64), run.0 as u64, round.0 as u64] {
        // Each part goes through the full mixing function, not just the additive state.
        rng.0 = rng.next_u64() ^ part;
    }
    rng.next_u64()
}

/// Builds the task's module and loads `values` into it, after checking it has the task's schema;
/// with `trains` (one flag per tensor, schema order), the tensors it marks false are frozen.
fn task_model<F: ModelFactory>(
    factory: &F,
    task_spec: Option<&ModelSpec>,
    schema: &TensorSchema,
    device: &Device,
    values: &[f32],
    trains: Option<&[bool]>,
) -> Result<(F::Model, ModelIo), ParticipantError> {
    let (model, io) = factory.build(task_spec, device)?;
    let actual = schema_of(&model);
    if actual != *schema {
        let describe = |s: &TensorSchema| {
            s.tensors
                .iter()
                .map(|t| format!("{}{:?}", t.name, t.shape))
                .collect::<Vec<_>>()
                .join(", ")
        };
        return Err(ParticipantError::SchemaMismatch(format!(
            "the run has [{}], the module has [{}]",
            describe(schema),
            describe(&actual)
        )));
    }
    let model = match trains {
        Some(trains) => load_parameters_freezing(model, values, trains)?,
        None => load_parameters(model, values)?,
    };
    Ok((model, io))
}

/// Which of the task's tensors the device uploads and keeps; an update schema that is not part
/// of the task's model is the coordinator's error, refused before anything trains.
fn task_parts(task: &TaskAssignment) -> Result<ModelParts, ParticipantError> {
    let update = task.update_schema.clone().unwrap_or_else(|| task.schema.clone());
    ModelParts::of_update(&task.schema, update, task.local_tensors.clone()).ok_or_else(|| {
        ParticipantError::SchemaMismatch(
            "the task's update schema is not a part of its model's schema".into(),
        )
    })
}

/// One flag per tensor of the task's model: whether the device trains it (it is in the update
/// or local); `None` when it trains them all.
fn trained_tensors(task: &TaskAssignment, parts: &ModelParts) -> Option<Vec<bool>> {
    if parts.is_whole() {
        return None;
    }
    Some(task.schema.tensors.iter().map(|t| parts.trains(t)).collect())
}

/// What survives an app restart.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ParticipantState {
    /// The device id, once enrolled.
    pub device_id: Option<DeviceId>,
    /// The device credential, once enrolled.
    pub credential: Option<String>,
    /// The secret of the identity key registered at enrollment, which signs the device's keys
    /// in secure rounds; `None` for a device enrolled before identities (plain runs only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub identity: Option<[u8; 32]>,
    /// The last model version evaluated, so it is reported once.
    pub last_evaluated: Option<(RunId, ModelVersion)>,
    /// What top-k compression has not sent yet, for the run it was computed in: added to
    /// that run's next delta (error feedback), dropped when another run's task comes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error_feedback: Option<(RunId, ErrorFeedback)>,
    /// A trained update not yet acknowledged: written before it is sent, cleared once it is
    /// acknowledged or can no longer be, so that a device killed in between sends this same
    /// update on its next participation instead of checking in and training again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pending_upload: Option<PendingUpload>,
    /// The local tensors (personalization) of the runs this device trained most recently:
    /// laid over each model of that run it downloads, never uploaded.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub local_parts: Vec<LocalPart>,
}

/// An update trained for a task and not yet acknowledged (see
/// [`ParticipantState::pending_upload`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PendingUpload {
    /// Run.
    pub run_id: RunId,
    /// Round.
    pub round_idx: RoundIdx,
    /// The aggregator the task sent the update to, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub upload_to: Option<UploadTarget>,
    /// The model version trained from.
    pub model_version: ModelVersion,
    /// Examples trained on.
    pub example_count: u64,
    /// The metrics sent with the update.
    pub metrics: BTreeMap<String, f64>,
    /// The schema the delta is encoded in.
    pub schema_id: SchemaId,
    /// The encoded delta, as sent (base64 in the state file).
    #[serde(with = "base64_bytes")]
    pub delta: Vec<u8>,
    /// Mean local training loss.
    pub train_loss: f64,
    /// The global model's evaluation on held-out data, when it was evaluated.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub evaluation: Option<Evaluation>,
    /// Top-k's residual once this update is in (error feedback); kept only then.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error_feedback: Option<ErrorFeedback>,
}

/// Bytes as base64 text: a pending delta in the JSON state file takes 4/3 of its size, not the
/// 3–4 characters a byte takes as a JSON array.
mod base64_bytes {
    use base64::Engine;
    use base64::engine::general_purpose::STANDARD;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(bytes: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&STANDARD.encode(bytes))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        let text = String::deserialize(d)?;
        STANDARD.decode(text).map_err(serde::de::Error::custom)
    }
}

impl ParticipantState {
    /// Reads a state file written by [`ParticipantState::save`]; `None` when there is none yet.
    pub fn load(path: &Path) -> Result<Option<Self>, ParticipantError> {
        let fail =
            |why: String| ParticipantError::StateFile { path: path.display().to_string(), why };
        match std::fs::read(path) {
            Ok(bytes) => serde_json::from_slice(&bytes)
                .map(Some)
                .map_err(|e| fail(format!("not a Starling device state file: {e}"))),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(fail(e.to_string())),
        }
    }

    /// Writes the state to `path`: aside first, then renamed, so a crash never leaves half a
    /// credential behind.
    pub fn save(&self, path: &Path) -> Result<(), ParticipantError> {
        let fail = |e: std::io::Error| ParticipantError::StateFile {
            path: path.display().to_string(),
            why: e.to_string(),
        };
        let json = serde_json::to_vec_pretty(self).expect("the state serializes");
        let tmp = path.with_extension("tmp");
        std::fs::write(&tmp, json).map_err(fail)?;
        std::fs::rename(&tmp, path).map_err(fail)
    }
}

/// A device taking part in training.
pub struct Participant<F: ModelFactory = FromPlan> {
    url: String,
    fleet: FleetClient,
    population: String,
    train_set: Arc<Examples>,
    holdout: Arc<Examples>,
    device: Device,
    state: ParticipantState,
    cached_model: Option<(String, Arc<Vec<f32>>)>,
    /// The pretrained model the last task's frozen tensors came from, by content hash.
    cached_base: Option<(String, Arc<base_model::BaseModel>)>,
    factory: Arc<F>,
    /// The device's conditions: reported at check-in, and checked against the task's
    /// requirements before downloading, evaluating and training. Shared, so that an app can change
    /// them while a participation runs on another thread.
    attributes: Arc<Mutex<DeviceAttributes>>,
    /// Where the state is saved at each point a kill must not lose (see
    /// [`Participant::keeping_state_in`]).
    state_file: Option<PathBuf>,
    /// What a simulated poisoning device does to its honest delta before uploading (see
    /// `simulate::Attack`); never set outside the simulator.
    tamper: Option<Tamper>,
    /// A simulated slow device: after training it waits this many times its training time
    /// more (see `simulate::Slowdown`); never set outside the simulator.
    slowdown: Option<f64>,
    /// A simulated device whose training seeds depend on this key and the round only, not on
    /// the ids the coordinator gave it and its run (see `simulate::SimulationConfig`'s seeded
    /// cohorts); never set outside the simulator.
    seed_key: Option<u64>,
    /// Simulated devices sharing one machine take a slot here to train, so that no more of
    /// them train at once than it has cores (see `Participant::sharing_cores`); never set
    /// outside the simulator.
    #[cfg_attr(not(feature = "tools"), allow(dead_code))]
    training_slots: Option<Arc<TrainingSlots>>,
}

/// The cores of one machine, shared by the simulated devices on it: a device trains only
/// while it holds a slot, and a slot is one core (a single-threaded rayon pool that flex's
/// kernels run in), so at most one thread per core trains and none waits on another's pool.
#[cfg(feature = "tools")]
pub(crate) struct TrainingSlots {
    free: Mutex<Vec<Arc<rayon::ThreadPool>>>,
    /// One permit per pool in `free`.
    available: Arc<tokio::sync::Semaphore>,
}

#[cfg(feature = "tools")]
impl TrainingSlots {
    /// One slot per core of this machine.
    pub(crate) fn one_per_core() -> std::io::Result<Arc<Self>> {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let pools = (0..cores)
            .map(|i| {
                rayon::ThreadPoolBuilder::new()
                    .num_threads(1)
                    .thread_name(move |_| format!("training-slot-{i}"))
                    .build()
                    .map(Arc::new)
                    .map_err(std::io::Error::other)
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Arc::new(TrainingSlots {
            free: Mutex::new(pools),
            available: Arc::new(tokio::sync::Semaphore::new(cores)),
        }))
    }

    /// Waits for a free slot.
    async fn take(self: &Arc<Self>) -> TrainingSlot {
        let permit = self.available.clone().acquire_owned().await.expect("never closed");
        let pool = self.free.lock().expect("no panic holding it").pop().expect("one per permit");
        TrainingSlot { slots: self.clone(), pool, _permit: permit }
    }
}

/// A slot held: its pool goes back when it is dropped, and then (the permit dropping after
/// `drop` ran) the next device may take it.
#[cfg(feature = "tools")]
struct TrainingSlot {
    slots: Arc<TrainingSlots>,
    pool: Arc<rayon::ThreadPool>,
    _permit: tokio::sync::OwnedSemaphorePermit,
}

#[cfg(feature = "tools")]
impl Drop for TrainingSlot {
    fn drop(&mut self) {
        self.slots.free.lock().expect("no panic holding it").push(self.pool.clone());
    }
}

/// Without the simulator, no device shares its cores.
#[cfg(not(feature = "tools"))]
pub(crate) enum TrainingSlots {}

/// A change to a trained delta before upload: how the simulator makes a device misbehave.
pub(crate) type Tamper = Arc<dyn Fn(&mut [f32]) + Send + Sync>;

impl Participant<FromPlan> {
    /// A participant for the coordinator at `url`, training on `train_set`, evaluating on
    /// `holdout`, computing on `device` (an autodiff device).
    pub fn new(
        url: &str,
        population: &str,
        train_set: Examples,
        holdout: Examples,
        device: Device,
    ) -> Self {
        Participant {
            url: url.to_owned(),
            fleet: FleetClient::new(url),
            population: population.to_owned(),
            train_set: Arc::new(train_set),
            holdout: Arc::new(holdout),
            device,
            state: ParticipantState::default(),
            cached_model: None,
            cached_base: None,
            factory: Arc::new(FromPlan),
            attributes: Arc::default(),
            state_file: None,
            tamper: None,
            slowdown: None,
            seed_key: None,
            training_slots: None,
        }
    }
}

impl<F: ModelFactory> Participant<F> {
    /// The same participant training the module `factory` builds instead.
    pub fn with_model<G: ModelFactory>(self, factory: G) -> Participant<G> {
        Participant {
            url: self.url,
            fleet: self.fleet,
            population: self.population,
            train_set: self.train_set,
            holdout: self.holdout,
            device: self.device,
            state: self.state,
            cached_model: self.cached_model,
            cached_base: self.cached_base,
            factory: Arc::new(factory),
            attributes: self.attributes,
            state_file: self.state_file,
            tamper: self.tamper,
            slowdown: self.slowdown,
            seed_key: self.seed_key,
            training_slots: self.training_slots,
        }
    }

    /// The same participant changing every trained delta with `tamper` before it uploads it:
    /// a poisoning device, for simulations that measure robust aggregation. Crate-private so
    /// that no app can ship one.
    #[cfg_attr(not(feature = "tools"), allow(dead_code))]
    pub(crate) fn tampering(mut self, tamper: Tamper) -> Self {
        self.tamper = Some(tamper);
        self
    }

    /// The same participant taking `factor` times as long to train (it trains, then waits
    /// `factor − 1` times the training time): a slow device in a simulation of a fleet's
    /// heterogeneity, without spending the CPU the other simulated devices share.
    #[cfg_attr(not(feature = "tools"), allow(dead_code))]
    pub(crate) fn slowed(mut self, factor: f64) -> Self {
        self.slowdown = Some(factor);
        self
    }

    /// The same participant training only while it holds one of `slots`: simulated devices on
    /// one machine then train as many at a time as it has cores, not all at once, each round
    /// of theirs taking its slot for the whole of its local training.
    #[cfg(feature = "tools")]
    pub(crate) fn sharing_cores(mut self, slots: Arc<TrainingSlots>) -> Self {
        self.training_slots = Some(slots);
        self
    }

    /// The same participant deriving its training seeds from `key` and the round alone, so
    /// that a simulation repeated with the same seed trains the same batches in every round.
    #[cfg_attr(not(feature = "tools"), allow(dead_code))]
    pub(crate) fn seeded_as(mut self, key: u64) -> Self {
        self.seed_key = Some(key);
        self
    }

    /// Reports these conditions at every check-in from now on (charging, network, idle, app
    /// version, free storage): runs whose plan requires some select only devices that say so.
    /// An app updates them as they change.
    pub fn set_attributes(&mut self, attributes: DeviceAttributes) {
        *lock(&self.attributes) = attributes;
    }

    /// The same participant reading its conditions from `shared`, which the app updates as
    /// they change, also while a participation runs: one unplugged between its check-in and
    /// its training leaves the round instead of training.
    pub fn with_shared_attributes(mut self, shared: Arc<Mutex<DeviceAttributes>>) -> Self {
        self.attributes = shared;
        self
    }

    /// The same participant saving its state to `path` itself whenever a kill must not lose
    /// it: once an update is trained (before it is sent) and once it is acknowledged. The app
    /// still saves after enrollment and after each participation, as before.
    pub fn keeping_state_in(mut self, path: impl Into<PathBuf>) -> Self {
        self.state_file = Some(path.into());
        self
    }

    fn attributes(&self) -> DeviceAttributes {
        lock(&self.attributes).clone()
    }

    /// Writes the state to the state file, when there is one.
    fn persist(&self) -> Result<(), ParticipantError> {
        match &self.state_file {
            Some(path) => self.state.save(path),
            None => Ok(()),
        }
    }

    /// The outcome of leaving `task` because the device's conditions no longer meet its
    /// requirements; `None` while they do.
    fn conditions_unmet(&self, task: &TaskAssignment) -> Option<Outcome> {
        let unmet = task.eligibility.unmet(&self.attributes());
        (!unmet.is_empty()).then_some(Outcome::ConditionsNotMet {
            run_id: task.run_id,
            round_idx: task.round_idx,
            unmet,
        })
    }

    /// The same participant verifying the coordinator (and presenting a device certificate)
    /// as `tls` says.
    pub fn with_tls(mut self, tls: &TlsSettings) -> Result<Self, ClientError> {
        let mut fleet = FleetClient::with_tls(&self.url, tls)?;
        fleet.set_credential(self.fleet.credential());
        fleet.set_identity(self.fleet.identity().cloned());
        self.fleet = fleet;
        Ok(self)
    }

    /// Restores a saved state (credential included).
    pub fn restore(mut self, state: ParticipantState) -> Self {
        self.fleet.set_credential(state.credential.as_deref());
        self.fleet.set_identity(state.identity.map(DeviceIdentity::from_secret));
        self.state = state;
        self
    }

    /// The state to save.
    pub fn state(&self) -> &ParticipantState {
        &self.state
    }

    /// Enrolls with an operator-issued token.
    pub async fn enroll(&mut self, enrollment_token: &str) -> Result<DeviceId, ParticipantError> {
        // One identity for every attempt: the one registered is the one kept.
        let identity = protocol::new_identity();
        self.fleet.set_identity(Some(identity.clone()));
        let res = retrying(TRIES, || {
            let mut fleet = self.fleet.clone();
            async move { fleet.enroll(enrollment_token).await }
        })
        .await?;
        self.fleet.set_credential(Some(&res.credential));
        self.state.device_id = Some(res.device_id);
        self.state.credential = Some(res.credential);
        self.state.identity = Some(identity.secret());
        Ok(res.device_id)
    }

    /// One participation: check in, and if selected, evaluate, train and upload. A device
    /// holding an update it trained and could not yet deliver sends that instead, without
    /// checking in.
    pub async fn participate(
        &mut self,
        on_progress: ProgressCallback,
    ) -> Result<Outcome, ParticipantError> {
        if self.state.credential.is_none() {
            return Err(ParticipantError::NotEnrolled);
        }
        // Shared with the training thread, which reports steps while this task waits.
        let progress = Arc::new(std::sync::Mutex::new(on_progress));
        let report = {
            let progress = progress.clone();
            move |p: ParticipantProgress| (progress.lock().expect("progress callback panicked"))(p)
        };
        if let Some(pending) = self.state.pending_upload.take() {
            report(ParticipantProgress::Phase(Phase::Uploading));
            return self.deliver(pending).await;
        }
        report(ParticipantProgress::Phase(Phase::CheckingIn));
        let (population, attributes) = (self.population.clone(), self.attributes());
        let task =
            match retrying(TRIES, || self.fleet.check_in_with(&population, &attributes)).await? {
                CheckInResponse::ComeBackLater { retry_after_secs } => {
                    return Ok(Outcome::ComeBackLater(Duration::from_secs(u64::from(
                        retry_after_secs,
                    ))));
                }
                CheckInResponse::Task(task) => task,
            };
        let (run_id, round_idx) = (task.run_id, task.round_idx);
        if let Some(left) = self.conditions_unmet(&task) {
            return Ok(left);
        }
        // A secure round's short key stages come before training; the masked input after it.
        let mut secure = match task.secure_aggregation {
            None => None,
            Some(secure_task) => {
                let joined = async {
                    let mut session =
                        SecureSession::advertise(&self.fleet, run_id, round_idx, secure_task)
                            .await?;
                    session.share_keys(&self.fleet).await?;
                    Ok::<_, SecureError>(session)
                };
                match joined.await {
                    Ok(session) => Some(session),
                    Err(e) => return secure_outcome(run_id, round_idx, e),
                }
            }
        };
        report(ParticipantProgress::Phase(Phase::Downloading));
        let global = match self.global_model(&task).await {
            Ok(global) => global,
            // The task's version was given up by a later checkpoint (an asynchronous run moved
            // on while this device waited): like a round closed under it.
            Err(ParticipantError::Protocol(e)) if e.code() == Some(ErrorCode::ModelNotKept) => {
                return Ok(Outcome::RoundMissed { run_id, round_idx });
            }
            Err(e) => return Err(e),
        };
        // The conditions may have changed while the model downloaded (the phone unplugged).
        if let Some(left) = self.conditions_unmet(&task) {
            return Ok(left);
        }
        let parts = task_parts(&task)?;
        // A personalized run's model is the global one with this device's own local tensors.
        let global = self.with_local_part(&task, global);
        report(ParticipantProgress::Phase(Phase::Evaluating));
        if task.evaluate_only {
            return self.report_evaluation_round(&task, &global).await;
        }
        // A secure round's evaluation rides in the masked input (only the cohort's pooled
        // evaluation is revealed); a plain round's is reported once per model version.
        let evaluation = match secure {
            Some(_) => self.evaluate(&task, &global).await?,
            None => self.evaluate_once(&task, &global).await?,
        };
        // And while it was evaluated.
        if let Some(left) = self.conditions_unmet(&task) {
            return Ok(left);
        }
        report(ParticipantProgress::Phase(Phase::Training));
        let mut config = TrainingPlan::from_json(&task.training_config)
            .map_err(|e| TrainError::Config(e.to_string()))?;
        // The plan's seed is the run's; each device shuffles differently in every round.
        config.seed = match self.seed_key {
            Some(key) => round_seed(config.seed, Some(DeviceId(key as i64)), RunId(0), round_idx),
            None => round_seed(config.seed, self.state.device_id, run_id, round_idx),
        };
        let (train_set, device) = (self.train_set.clone(), self.device.clone());
        let (factory, spec, schema) =
            (self.factory.clone(), task.model_spec.clone(), task.schema.clone());
        let trained_from = global.clone();
        let step = report.clone();
        let tamper = self.tamper.clone();
        let compression = task.compression;
        let mut feedback = match &self.state.error_feedback {
            Some((run, feedback)) if *run == run_id => feedback.clone(),
            _ => ErrorFeedback::default(),
        };
        // Int8's stochastic rounding draws from the round's own seed, so a device never
        // repeats its rounding pattern.
        let mut rounding = SplitMix64(config.seed ^ 0x5eed_c0de_d0e1_7a5e);
        // A secure round masks the f32 delta itself: nothing to encode.
        let plain = secure.is_none();
        let trains = trained_tensors(&task, &parts);
        let local = task.local_tensors.clone();
        #[cfg(feature = "tools")]
        let slot = match &self.training_slots {
            Some(slots) => Some(slots.take().await),
            None => None,
        };
        #[cfg(feature = "tools")]
        let pool = slot.as_ref().map(|s| s.pool.clone());
        // A task whose round closed while the device waited (for a training slot, say) is given
        // up rather than trained for a round that can only refuse it; so is one whose deadline
        // passes mid-training.
        let deadline = task.report_deadline_ms;
        if past_deadline(deadline) {
            return Ok(Outcome::RoundMissed { run_id, round_idx });
        }
        let training_started = std::time::Instant::now();
        let training = move || {
            let mut on_step = |p: Progress| step(ParticipantProgress::Step(p));
            let (model, io) = task_model(
                &*factory,
                spec.as_ref(),
                &schema,
                &device,
                &trained_from,
                trains.as_deref(),
            )?;
            let give_up = move || past_deadline(deadline);
            let (model, report) =
                train_until(model, io, &train_set, &config, &device, &mut on_step, &give_up)?;
            let trained = parameters_of(&model);
            let local_part =
                (!local.is_empty()).then(|| LocalPart::of(run_id, &schema, &trained, &local));
            let delta: Vec<f32> =
                trained.iter().zip(trained_from.iter()).map(|(t, g)| t - g).collect();
            // Only the update's tensors leave the device.
            let mut delta = parts.update_of(&delta);
            if let Some(tamper) = tamper {
                tamper(&mut delta);
            }
            let encoded = plain.then(|| compression.encode(&delta, &mut rounding, &mut feedback));
            Ok::<_, ParticipantError>((delta, encoded, feedback, report, parts, local_part))
        };
        let trained = tokio::task::spawn_blocking(move || {
            // A simulated device trains in its slot's pool: flex's kernels stay on that core.
            #[cfg(feature = "tools")]
            if let Some(pool) = pool {
                return pool.install(training);
            }
            training()
        })
        .await
        .expect("training task panicked");
        let (delta, encoded, feedback, trained, parts, local_part) = match trained {
            Err(ParticipantError::Train(TrainError::Abandoned)) => {
                return Ok(Outcome::RoundMissed { run_id, round_idx });
            }
            trained => trained?,
        };
        #[cfg(feature = "tools")]
        drop(slot);
        if let Some(factor) = self.slowdown {
            tokio::time::sleep(training_started.elapsed().mul_f64(factor - 1.0)).await;
        }
        // Kept whatever becomes of the upload: the device trained it, and it never travels.
        if let Some(part) = local_part {
            local_part::keep(&mut self.state.local_parts, part);
        }
        if let Some(session) = secure.as_mut() {
            // A secure round's update is masked for keys that live only in this session: it
            // cannot be sent after a restart, so it is not kept.
            report(ParticipantProgress::Phase(Phase::Uploading));
            let sent = async {
                let pooled = evaluation.map(|e| starling_core::secagg::EvaluationInput {
                    examples: e.examples,
                    accuracy: e.accuracy,
                    loss: e.loss,
                });
                session
                    .send_masked(&self.fleet, task.model_version, &delta, trained.examples, pooled)
                    .await?;
                session.unmask(&self.fleet).await
            };
            return match sent.await {
                Ok(()) => Ok(Outcome::Uploaded {
                    run_id,
                    round_idx,
                    train_loss: trained.loss,
                    evaluation,
                }),
                Err(e) => secure_outcome(run_id, round_idx, e),
            };
        }
        let pending = PendingUpload {
            run_id,
            round_idx,
            upload_to: task.upload_to.clone(),
            model_version: task.model_version,
            example_count: trained.examples,
            metrics: upload_metrics(&task, trained.loss, evaluation.as_ref()),
            schema_id: parts.update_schema().schema_id(),
            delta: encoded.expect("a plain round encodes its delta"),
            train_loss: trained.loss,
            evaluation,
            // Only what reached the coordinator leaves the residual.
            error_feedback: matches!(compression, Compression::TopK { .. }).then_some(feedback),
        };
        // On disk before it is sent; `deliver` clears it from the state once it is in.
        self.state.pending_upload = Some(pending);
        self.persist()?;
        let pending = self.state.pending_upload.take().expect("just set");
        report(ParticipantProgress::Phase(Phase::Uploading));
        self.deliver(pending).await
    }

    /// Sends a trained update (taken out of the state, still in the state file) and saves the
    /// state without it once it is in, or once it can no longer be (its round closed, the
    /// coordinator refused it for good). A transient failure puts it back for the next
    /// participation. The model-sized delta moves into the request and back, never copied.
    async fn deliver(&mut self, mut pending: PendingUpload) -> Result<Outcome, ParticipantError> {
        let (run_id, round_idx) = (pending.run_id, pending.round_idx);
        let upload = UploadRequest {
            model_version: pending.model_version,
            example_count: pending.example_count,
            metrics: std::mem::take(&mut pending.metrics),
            delta: TensorPayload {
                schema_id: pending.schema_id,
                data: std::mem::take(&mut pending.delta),
            },
        };
        let sent = retrying(TRIES, || async {
            match &pending.upload_to {
                Some(target) => {
                    self.fleet.upload_to_aggregator(target, run_id, round_idx, &upload).await
                }
                None => self.fleet.upload(run_id, round_idx, &upload).await,
            }
        })
        .await;
        let outcome = match sent {
            // A resent update whose first attempt landed is a duplicate: it is in.
            Ok(_)
            | Err(ClientError::Api {
                body: starling_core::wire::ErrorBody { code: ErrorCode::DuplicateUpload, .. },
                ..
            }) => {
                if let Some(feedback) = pending.error_feedback {
                    self.state.error_feedback = Some((run_id, feedback));
                }
                Ok(Outcome::Uploaded {
                    run_id,
                    round_idx,
                    train_loss: pending.train_loss,
                    evaluation: pending.evaluation,
                })
            }
            Err(e) if matches!(e.code(), Some(ErrorCode::RoundClosed | ErrorCode::StaleModel)) => {
                Ok(Outcome::RoundMissed { run_id, round_idx })
            }
            // An aggregator that is gone takes its round's shard with it: like a round closed
            // under the device, not an error of the device's.
            Err(e) if pending.upload_to.is_some() && e.is_transient() => {
                tracing::warn!(%run_id, %round_idx, error = %e, "the assigned aggregator is unreachable; round missed");
                Ok(Outcome::RoundMissed { run_id, round_idx })
            }
            // Kept for the next participation: the coordinator may take it yet.
            Err(e) if e.is_transient() => {
                pending.metrics = upload.metrics;
                pending.delta = upload.delta.data;
                self.state.pending_upload = Some(pending);
                return Err(e.into());
            }
            // Refused for good (a revoked credential, an update it will never take): sending it
            // again cannot help, so it is dropped and the device checks in afresh next time.
            Err(e) => Err(e.into()),
        };
        self.persist()?;
        outcome
    }

    /// An evaluation-only round: evaluate the model on the held-out examples (on all local
    /// examples when none are held out: nothing trains on them in such a run) and upload the
    /// metrics, with an empty delta, as the round's report.
    async fn report_evaluation_round(
        &self,
        task: &TaskAssignment,
        global: &Arc<Vec<f32>>,
    ) -> Result<Outcome, ParticipantError> {
        let (run_id, round_idx) = (task.run_id, task.round_idx);
        let examples =
            if self.holdout.is_empty() { self.train_set.clone() } else { self.holdout.clone() };
        let evaluation = self.evaluate_on(task, global, examples).await?;
        let upload = UploadRequest {
            model_version: task.model_version,
            example_count: evaluation.examples,
            metrics: evaluation.metrics(),
            delta: TensorSchema { tensors: vec![] }.encode_f32(&[]),
        };
        match retrying(TRIES, || self.fleet.upload(run_id, round_idx, &upload)).await {
            Ok(_)
            | Err(ClientError::Api {
                body: starling_core::wire::ErrorBody { code: ErrorCode::DuplicateUpload, .. },
                ..
            }) => Ok(Outcome::Evaluated { run_id, round_idx, evaluation }),
            Err(e) if matches!(e.code(), Some(ErrorCode::RoundClosed | ErrorCode::StaleModel)) => {
                Ok(Outcome::RoundMissed { run_id, round_idx })
            }
            Err(e) => Err(e.into()),
        }
    }

    /// `global` with this device's local part of the task's run laid over it, when the run has
    /// local tensors and the device has trained them before.
    fn with_local_part(&self, task: &TaskAssignment, global: Arc<Vec<f32>>) -> Arc<Vec<f32>> {
        if task.local_tensors.is_empty() {
            return global;
        }
        match self.state.local_parts.iter().find(|p| p.run_id == task.run_id) {
            Some(part) => {
                let model = Arc::unwrap_or_clone(global);
                Arc::new(part.laid_over(&task.schema, model, &task.local_tensors))
            }
            None => global,
        }
    }

    /// The imported model `hash`: in memory, on disk beside the state file, or downloaded (and
    /// then kept there), verified against its hash each time it is read.
    async fn base_model(
        &mut self,
        hash: &str,
    ) -> Result<Arc<base_model::BaseModel>, ParticipantError> {
        if let Some((cached, base)) = &self.cached_base
            && cached == hash
        {
            return Ok(base.clone());
        }
        let file = self.state_file.as_deref().map(|f| base_model::BaseModel::cache_file(f, hash));
        let kept = file.as_deref().and_then(|f| base_model::BaseModel::read_cached(f, hash));
        let base = match kept {
            Some(base) => base,
            None => {
                let download = retrying(TRIES, || self.fleet.base_model(hash)).await?;
                if let Some(file) = &file {
                    // A cache that cannot be written costs a download next time, nothing more.
                    if let Err(e) = base_model::BaseModel::write_cache(file, &download) {
                        tracing::warn!(file = %file.display(), error = %e, "base model not kept");
                    }
                }
                base_model::BaseModel::verified(download, hash)?
            }
        };
        let base = Arc::new(base);
        self.cached_base = Some((hash.to_owned(), base.clone()));
        Ok(base)
    }

    /// The task's global model, from the cache when the hash matches.
    async fn global_model(
        &mut self,
        task: &TaskAssignment,
    ) -> Result<Arc<Vec<f32>>, ParticipantError> {
        if let Some((hash, values)) = &self.cached_model
            && *hash == task.model_hash
        {
            return Ok(values.clone());
        }
        if let Some(base_hash) = &task.base_model {
            // The frozen tensors from the base (fetched once), the trained ones from the round.
            let base = self.base_model(base_hash).await?;
            let trained =
                retrying(TRIES, || self.fleet.trained_part(task.run_id, &task.model_hash)).await?;
            let values = base.with_trained(&task.schema, &task_parts(task)?, &trained)?;
            self.cached_model = Some((task.model_hash.clone(), values.clone()));
            return Ok(values);
        }
        let payload =
            retrying(TRIES, || self.fleet.model_in(&task.model_hash, task.model_download)).await?;
        let values = Arc::new(decode_model_in(&task.schema, payload, task.model_download)?);
        self.cached_model = Some((task.model_hash.clone(), values.clone()));
        Ok(values)
    }

    /// Evaluates the task's model on the held-out examples (none without any).
    async fn evaluate(
        &self,
        task: &TaskAssignment,
        global: &Arc<Vec<f32>>,
    ) -> Result<Option<Evaluation>, ParticipantError> {
        if self.holdout.is_empty() {
            return Ok(None);
        }
        Ok(Some(self.evaluate_on(task, global, self.holdout.clone()).await?))
    }

    /// Evaluates the task's model on `examples`, off the async threads.
    async fn evaluate_on(
        &self,
        task: &TaskAssignment,
        global: &Arc<Vec<f32>>,
        examples: Arc<Examples>,
    ) -> Result<Evaluation, ParticipantError> {
        let (device, global) = (self.device.clone(), global.clone());
        let (factory, spec, schema) =
            (self.factory.clone(), task.model_spec.clone(), task.schema.clone());
        tokio::task::spawn_blocking(move || {
            let (model, io) =
                task_model(&*factory, spec.as_ref(), &schema, &device, &global, None)?;
            Ok::<_, ParticipantError>(evaluate(&model, io, &examples, &device)?)
        })
        .await
        .expect("evaluation task panicked")
    }

    /// Evaluates a model version on the held-out examples and reports it, once per version.
    async fn evaluate_once(
        &mut self,
        task: &TaskAssignment,
        global: &Arc<Vec<f32>>,
    ) -> Result<Option<Evaluation>, ParticipantError> {
        if self.state.last_evaluated == Some((task.run_id, task.model_version)) {
            return Ok(None);
        }
        let Some(evaluation) = self.evaluate(task, global).await? else { return Ok(None) };
        if task.withhold_metrics || task.evaluation_in_update {
            // A DP run takes no evaluation on its own: it withholds it, or it rides with the
            // update to be noised with the cohort's.
            return Ok(Some(evaluation));
        }
        let report = EvaluationReport {
            model_version: task.model_version,
            example_count: evaluation.examples,
            metrics: evaluation.metrics(),
        };
        match retrying(TRIES, || self.fleet.evaluate(task.run_id, &report)).await {
            Ok(()) => {}
            Err(e) if e.code() == Some(ErrorCode::DuplicateUpload) => {}
            Err(e) => return Err(e.into()),
        }
        self.state.last_evaluated = Some((task.run_id, task.model_version));
        Ok(Some(evaluation))
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // The attributes are replaced whole: a panic elsewhere cannot leave them half-written.
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The metrics a plain round's upload carries: the training loss, and this version's
/// evaluation when the run noises it with the cohort's; none when a DP run withholds them
/// (they would leave it un-noised).
fn upload_metrics(
    task: &TaskAssignment,
    train_loss: f64,
    evaluation: Option<&Evaluation>,
) -> BTreeMap<String, f64> {
    if task.withhold_metrics {
        return BTreeMap::new();
    }
    let mut metrics = BTreeMap::from([("loss".to_owned(), train_loss)]);
    if let (true, Some(e)) = (task.evaluation_in_update, evaluation) {
        use starling_core::privacy::metrics::{UPLOAD_EVAL_ACCURACY, UPLOAD_EVAL_LOSS};
        metrics.insert(UPLOAD_EVAL_ACCURACY.to_owned(), e.accuracy);
        metrics.insert(UPLOAD_EVAL_LOSS.to_owned(), e.loss);
    }
    metrics
}

/// A secure round this device could not finish: missing it is an outcome, anything else an
/// error.
fn secure_outcome(
    run_id: RunId,
    round_idx: RoundIdx,
    e: SecureError,
) -> Result<Outcome, ParticipantError> {
    match e {
        SecureError::Excluded(why) => {
            tracing::info!(%run_id, %round_idx, %why, "left out of the secure round");
            Ok(Outcome::RoundMissed { run_id, round_idx })
        }
        SecureError::Protocol(e)
            if matches!(e.code(), Some(ErrorCode::RoundClosed | ErrorCode::Conflict)) =>
        {
            Ok(Outcome::RoundMissed { run_id, round_idx })
        }
        e => Err(ParticipantError::SecureAggregation(e)),
    }
}

/// Decodes a downloaded model for `schema`.
pub fn decode_model(
    schema: &TensorSchema,
    payload: &starling_core::tensor::TensorPayload,
) -> Result<Vec<f32>, ParticipantError> {
    schema.decode_f32(payload).map_err(global_model_error)
}

/// A global model that does not decode, as the participant reports it.
fn global_model_error(e: impl std::fmt::Display) -> ParticipantError {
    ParticipantError::Protocol(ClientError::Decode(format!("global model: {e}")))
}

/// Decodes a global model downloaded in `compression` (a task's `model_download`): checked
/// like an uploaded delta in that encoding (schema, exact length, finite values and scales),
/// then expanded to the f32 values training starts from.
pub fn decode_model_in(
    schema: &TensorSchema,
    payload: starling_core::tensor::TensorPayload,
    compression: starling_core::compression::Compression,
) -> Result<Vec<f32>, ParticipantError> {
    if compression.is_f32() {
        return decode_model(schema, &payload);
    }
    if payload.schema_id != schema.schema_id() {
        return Err(global_model_error(format!("schema {} is not the task's", payload.schema_id)));
    }
    let n = usize::try_from(schema.byte_len() / 4).map_err(global_model_error)?;
    let decoded = compression.validate(n, payload.data).map_err(global_model_error)?;
    Ok(decoded.to_f32())
}

/// How long past its round's report deadline (by this device's clock) a task is still trained:
/// room for a device clock a little ahead of the coordinator's, and for the round's grace.
const DEADLINE_SLACK_MS: i64 = 10_000;

/// Whether a task due at `deadline_ms` (the coordinator's clock, ms since the epoch) is past
/// saving: its round has closed, or its buffer dropped it.
fn past_deadline(deadline_ms: i64) -> bool {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64);
    now > deadline_ms.saturating_add(DEADLINE_SLACK_MS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_device_and_round_shuffles_with_its_own_seed() {
        let seed = |device: i64, round: i64| {
            round_seed(7, Some(DeviceId(device)), RunId(3), RoundIdx(round))
        };
        let seeds: std::collections::BTreeSet<u64> =
            (1..=20).flat_map(|d| (0..20).map(move |r| seed(d, r))).collect();
        assert_eq!(seeds.len(), 400, "a seed repeats across devices or rounds");
        // Reproducible: the same device, run and round give the same seed.
        assert_eq!(seed(5, 9), seed(5, 9));
        assert_ne!(round_seed(8, Some(DeviceId(5)), RunId(3), RoundIdx(9)), seed(5, 9));
        assert_ne!(round_seed(7, Some(DeviceId(5)), RunId(4), RoundIdx(9)), seed(5, 9));
    }

    #[cfg(feature = "tools")]
    #[tokio::test]
    async fn simulated_devices_train_one_per_core_each_on_a_single_thread() {
        let slots = TrainingSlots::one_per_core().unwrap();
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let mut held = Vec::new();
        for _ in 0..cores {
            held.push(slots.take().await);
        }
        let threads: Vec<usize> =
            held.iter().map(|slot| slot.pool.install(rayon::current_num_threads)).collect();
        assert_eq!(threads, vec![1; cores], "a slot's kernels run on one thread");
        // Every core is taken: the next device waits until one is given back.
        let next = tokio::spawn({
            let slots = slots.clone();
            async move { slots.take().await.pool.current_num_threads() == 1 }
        });
        tokio::task::yield_now().await;
        assert!(!next.is_finished(), "a device trained with every core taken");
        held.pop();
        let deadline = std::time::Duration::from_secs(10);
        assert!(
            tokio::time::timeout(deadline, next).await.expect("a freed slot is taken").unwrap()
        );
    }

    /// A task is given up once its deadline is past by more than the slack, not before.
    #[test]
    fn a_task_is_past_saving_only_beyond_its_deadline_and_the_slack() {
        let now =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis()
                as i64;
        assert!(!past_deadline(now + 60_000), "a round still open");
        assert!(!past_deadline(now - DEADLINE_SLACK_MS / 2), "within the slack");
        assert!(past_deadline(now - 2 * DEADLINE_SLACK_MS), "a round long closed");
    }
}
