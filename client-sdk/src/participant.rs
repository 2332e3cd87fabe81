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

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use burn::tensor::Device;
use starling_core::DeviceId;
use starling_core::backoff::Backoff;
use starling_core::eligibility::DeviceAttributes;
use starling_core::model_spec::ModelSpec;
use starling_core::participation::{
    self, Action, Enrolment, Entropy, EvaluationSet, Event, Failure, Participation, Refusal,
    Settings, Trained, TrainingOrder,
};
use starling_core::secagg::{self, DeviceIdentity};
use starling_core::tensor::TensorSchema;
use starling_core::wire::{ErrorCode, TaskAssignment, UploadRequest, UploadTarget};
use starling_core::{RoundIdx, RunId};

use crate::examples::Examples;
use crate::model::{
    Classifier, ModelError, ModelIo, SpecModel, load_parameters, load_parameters_freezing,
    parameters_of, schema_of,
};
use crate::protocol::{self, ClientError, FleetClient, TlsSettings, retrying};
use crate::secure::{self, SecureError};
use crate::train::{Evaluation, Progress, TrainError, evaluate, train_until};
use crate::trainer::{self, ModelTensors, Trainer};

pub(crate) use slots::TrainingSlots;
pub use starling_core::participation::{
    LocalPart, LocalTensor, Notice, Outcome, ParticipantState, PendingUpload, Phase, round_seed,
};
/// A change to a trained delta before upload: how the simulator makes a device misbehave.
pub(crate) type Tamper = participation::Tamper;

mod base_model;
mod slots;
mod text;

pub use text::DeviceText;

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
    /// The participation machine and its driver disagree (a bug: please report it).
    #[error("participation: {0}")]
    Participation(String),
    /// The enrolment certificate given is not the pinned authority's for this device's
    /// identity key.
    #[error(
        "the enrolment certificate is not the pinned authority's for this device's identity key"
    )]
    CertificateMismatch,
    /// The device's examples are text and the task's plan names no tokenizer to make them
    /// tokens with.
    #[error("this device's examples are text, and the run's plan names no tokenizer")]
    NoTokenizer,
    /// The tokenizer the task names could not be loaded, or gave ids the model does not take.
    #[error("tokenizer: {0}")]
    Tokenizer(#[from] starling_core::tokenizer::TokenizerError),
}

impl From<participation::StateFileError> for ParticipantError {
    fn from(e: participation::StateFileError) -> Self {
        ParticipantError::StateFile { path: e.path, why: e.why }
    }
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
    /// The app's own trainer, when the model lives in another framework: it trains and
    /// evaluates instead of the module `factory` builds (see [`Participant::training_with`]).
    trainer: Option<Arc<dyn Trainer>>,
    /// The device's text, when its examples are text (see [`Participant::with_text`]): each
    /// task's tokenizer makes `train_set` and `holdout` from it.
    text: Option<text::TextSource>,
}

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
            trainer: None,
            text: None,
        }
    }

    /// A participant for the coordinator at `url` whose model is trained and evaluated by the
    /// app's own `trainer` (its examples are the trainer's business); the run's plan names the
    /// model's tensors (`model.schema`).
    pub fn for_trainer(url: &str, population: &str, trainer: impl Trainer) -> Self {
        Participant::without_examples(url, population).training_with(trainer)
    }

    /// A participant whose examples are `text` (see [`Participant::with_text`]), training the
    /// plan's model on the CPU.
    pub fn for_text(url: &str, population: &str, text: DeviceText) -> Self {
        Participant::without_examples(url, population).with_text(text)
    }

    /// A participant with no examples of the SDK's kind (its trainer or its text brings them),
    /// on the CPU.
    fn without_examples(url: &str, population: &str) -> Self {
        let nothing = Examples::new(starling_core::model_spec::InputSpec::Features { size: 1 });
        Participant::new(url, population, nothing.clone(), nothing, Device::flex().autodiff())
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
            trainer: self.trainer,
            text: self.text,
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

    /// The same participant training and evaluating with the app's own `trainer` instead of a
    /// burn module: the rest of the participation is the SDK's, as for its own trainer.
    pub fn training_with(mut self, trainer: impl Trainer) -> Self {
        self.trainer = Some(Arc::new(trainer));
        self
    }

    /// The same participant training and evaluating on `text`, tokenized with the Hugging Face
    /// tokenizer each task's plan names (`model.tokenizer`, fetched once and checked against
    /// its hash) into windows of the model's input length, each labelled with the token after
    /// it; the examples given at construction are not used. A task whose plan names no
    /// tokenizer fails with [`ParticipantError::NoTokenizer`], uploading nothing.
    pub fn with_text(mut self, text: DeviceText) -> Self {
        self.text = Some(text::TextSource::new(text));
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

    /// Writes `state` to the state file, when there is one.
    fn persist_state(&self, state: &ParticipantState) -> Result<(), ParticipantError> {
        match &self.state_file {
            Some(path) => Ok(state.save(path)?),
            None => Ok(()),
        }
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
        self.fleet.set_enrolment(state.enrolment);
        self.state = state;
        self
    }

    /// The public half of this device's identity key: what the operator's enrolment authority
    /// certifies. Made (and kept in the state) on first call, so the device can have it
    /// certified before it enrolls; [`Participant::enroll`] then registers this same key.
    pub fn identity_key(&mut self) -> [u8; 32] {
        let identity = match self.state.identity {
            Some(secret) => DeviceIdentity::from_secret(secret),
            None => protocol::new_identity(),
        };
        self.state.identity = Some(identity.secret());
        self.fleet.set_identity(Some(identity.clone()));
        identity.public()
    }

    /// Pins the operator's enrolment authority (its public key, shipped with the app: never
    /// taken from the coordinator) and holds this device's certificate from it. In secure
    /// rounds the device then shows its certificate to its neighbours and joins only
    /// neighbours the authority certified. A certificate that is not the authority's for
    /// [`Participant::identity_key`] is refused.
    pub fn set_enrolment(&mut self, enrolment: Enrolment) -> Result<(), ParticipantError> {
        if let (Some(authority), Some(certificate)) = (enrolment.authority, enrolment.certificate) {
            let identity = self.identity_key();
            if !secagg::certificate_is_valid(&authority, &identity, &certificate) {
                return Err(ParticipantError::CertificateMismatch);
            }
        }
        self.state.enrolment = enrolment;
        self.fleet.set_enrolment(enrolment);
        Ok(())
    }

    /// The state to save.
    pub fn state(&self) -> &ParticipantState {
        &self.state
    }

    /// Enrolls with an operator-issued token.
    pub async fn enroll(&mut self, enrollment_token: &str) -> Result<DeviceId, ParticipantError> {
        // One identity for every attempt: the one registered is the one kept (the one already
        // made, and perhaps certified, if there is one).
        self.identity_key();
        let identity = self.fleet.identity().cloned().expect("made just now");
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
    /// checking in. The steps and their order are core's participation machine; this drives
    /// it over the fleet API, the trainer and the state file.
    pub async fn participate(
        &mut self,
        on_progress: ProgressCallback,
    ) -> Result<Outcome, ParticipantError> {
        // Shared with the training thread, which reports steps while this task waits.
        let progress = Arc::new(std::sync::Mutex::new(on_progress));
        let report =
            move |p: ParticipantProgress| (progress.lock().expect("progress callback panicked"))(p);
        // The machine works on a copy: a participation dropped midway leaves this state as it
        // was, but for a pending upload, which is in the state file while it is sent.
        let pending = self.state.pending_upload.take();
        let state = ParticipantState { pending_upload: pending, ..self.state.clone() };
        let settings = Settings { seed_key: self.seed_key, tamper: self.tamper.clone() };
        let mut machine = Participation::start(state, settings, entropy());
        // The error of the step that failed last: the participation's, if it ends on it.
        let mut failed: Option<ParticipantError> = None;
        loop {
            let action = machine.poll_action().expect("the machine acts until it finishes");
            let result = match action {
                Action::Progress(phase) => {
                    report(ParticipantProgress::Phase(phase));
                    continue;
                }
                Action::Notice(notice) => {
                    log_notice(machine.task(), &notice);
                    continue;
                }
                Action::Finish(outcome) => {
                    self.state = machine.into_state();
                    return outcome.map_err(|f| participant_error(f, failed.take()));
                }
                action => self.step(&machine, action, &report).await,
            };
            let event = result.unwrap_or_else(|e| {
                let refusal = refusal_of(&e);
                failed = Some(e);
                Event::Failed(refusal)
            });
            machine.handle(now_ms(), event);
        }
    }

    /// Does what the machine asked; the event says how it went.
    async fn step(
        &mut self,
        machine: &Participation,
        action: Action,
        report: &(impl Fn(ParticipantProgress) + Clone + Send + 'static),
    ) -> Result<Event, ParticipantError> {
        let task = machine.task();
        let ids = || task.map(|t| (t.run_id, t.round_idx)).expect("a step of a task");
        Ok(match action {
            Action::CheckIn => {
                let (population, attributes) = (self.population.clone(), self.attributes());
                let check_in = || self.fleet.check_in_with(&population, &attributes);
                Event::CheckedIn(Box::new(retrying(TRIES, check_in).await?))
            }
            Action::ReadConditions => Event::Conditions(self.attributes()),
            Action::FetchModel => {
                let task = task.expect("a task's model");
                if self.text.is_some() {
                    self.tokenize_text(task).await?;
                }
                Event::ModelReady(self.global_model(task).await?)
            }
            Action::Evaluate { model, on } if self.trainer.is_some() => {
                let task = task.expect("a task's model");
                let evaluation = self.evaluate_by_trainer(task, model).await?;
                if evaluation.is_none() && on == EvaluationSet::HeldOutOrTraining {
                    // An evaluation-only round needs an evaluation to report.
                    return Err(TrainError::NoExamples.into());
                }
                Event::Evaluated(evaluation)
            }
            Action::Evaluate { model, on } => {
                let task = task.expect("a task's model");
                let examples = match on {
                    _ if !self.holdout.is_empty() => self.holdout.clone(),
                    EvaluationSet::HeldOut => return Ok(Event::Evaluated(None)),
                    EvaluationSet::HeldOutOrTraining => self.train_set.clone(),
                };
                Event::Evaluated(Some(self.evaluate_on(task, &model, examples).await?))
            }
            Action::ReportEvaluation(evaluation) => {
                let (run, _) = ids();
                retrying(TRIES, || self.fleet.evaluate(run, &evaluation)).await?;
                Event::EvaluationReported
            }
            Action::Train(order) if self.trainer.is_some() => {
                self.train_by_trainer(task.expect("a task to train"), *order).await?
            }
            Action::Train(order) => {
                self.train(task.expect("a task to train"), *order, report).await?
            }
            Action::Persist => {
                self.persist_state(machine.state())?;
                Event::Persisted
            }
            Action::Upload { run_id, round_idx, to } => {
                let upload = machine.upload_request().expect("an upload to send");
                self.upload(run_id, round_idx, to.as_ref(), upload).await?;
                Event::Uploaded
            }
            Action::SecureSend(message) => {
                let (run, round) = ids();
                // A retried message whose first attempt landed is answered again, not counted
                // twice.
                retrying(secure::TRIES, || self.fleet.secagg_send(run, round, &message)).await?;
                Event::SecureSent
            }
            Action::SecurePoll => {
                let (run, round) = ids();
                let poll = || self.fleet.secagg_instruction(run, round);
                Event::Instruction(retrying(secure::TRIES, poll).await?)
            }
            Action::WaitUntil(at) => {
                let wait = u64::try_from(at.saturating_sub(now_ms())).unwrap_or(0);
                tokio::time::sleep(Duration::from_millis(wait)).await;
                Event::Woke
            }
            Action::Progress(_) | Action::Notice(_) | Action::Finish(_) => {
                unreachable!("handled by the participation loop")
            }
        })
    }

    /// Sends an upload (with retries) to the assigned aggregator, or else to the coordinator.
    async fn upload(
        &self,
        run_id: RunId,
        round_idx: RoundIdx,
        to: Option<&UploadTarget>,
        upload: &UploadRequest,
    ) -> Result<(), ParticipantError> {
        let send = || {
            retrying(TRIES, || async {
                match to {
                    Some(target) => {
                        self.fleet.upload_to_aggregator(target, run_id, round_idx, upload).await
                    }
                    None => self.fleet.upload(run_id, round_idx, upload).await,
                }
            })
        };
        // "Another upload from this device is in progress": the request of a process killed
        // mid-upload, which the coordinator is still finishing. Once it is done, this one
        // lands or is a duplicate.
        let mut backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(2));
        let mut sent = send().await;
        for _ in 1..TRIES {
            match &sent {
                Err(e) if e.code() == Some(ErrorCode::Conflict) => {
                    tokio::time::sleep(backoff.next_delay()).await;
                    sent = send().await;
                }
                _ => break,
            }
        }
        sent?;
        Ok(())
    }

    /// The app's trainer's evaluation of `model`, off the async threads.
    async fn evaluate_by_trainer(
        &self,
        task: &TaskAssignment,
        model: Arc<Vec<f32>>,
    ) -> Result<Option<Evaluation>, ParticipantError> {
        let trainer = self.trainer.clone().expect("an app trainer");
        let schema = task.schema.clone();
        tokio::task::spawn_blocking(move || {
            let tensors = ModelTensors { schema: &schema, values: &model };
            let evaluation = trainer.evaluate(tensors).map_err(TrainError::Trainer)?;
            Ok(evaluation.map(trainer::checked_evaluation).transpose()?)
        })
        .await
        .expect("the app's evaluation panicked")
    }

    /// Trains the task's model with the app's trainer, off the async threads, and prepares the
    /// update there once what it returned is checked.
    async fn train_by_trainer(
        &self,
        task: &TaskAssignment,
        order: TrainingOrder,
    ) -> Result<Event, ParticipantError> {
        let TrainingOrder { model, plan, deadline_ms, recipe, .. } = order;
        if past_deadline(deadline_ms) {
            return Ok(Event::TrainingAbandoned);
        }
        let trainer = self.trainer.clone().expect("an app trainer");
        let schema = task.schema.clone();
        let trained = tokio::task::spawn_blocking(move || {
            let tensors = ModelTensors { schema: &schema, values: &model };
            let output = trainer.train(tensors, &plan).map_err(TrainError::Trainer)?;
            let (loss, examples) = (output.loss, output.examples);
            let values = trainer::trained_model(&schema, &model, output).map_err(|e| match e {
                trainer::Unusable::Length(why) => ParticipantError::SchemaMismatch(why),
                trainer::Unusable::Values(e) => ParticipantError::Train(e),
            })?;
            let update = recipe.prepare(&values);
            Ok::<_, ParticipantError>(Trained { loss, examples, update })
        })
        .await
        .expect("the app's trainer panicked")?;
        // A trainer that overran the round's deadline trained for a round that is gone.
        if past_deadline(deadline_ms) {
            return Ok(Event::TrainingAbandoned);
        }
        Ok(Event::Trained(trained))
    }

    /// Trains the task's model as `order` says, off the async threads (in a simulated
    /// device's core slot), and prepares the update there too: it is model-sized work.
    async fn train(
        &self,
        task: &TaskAssignment,
        order: TrainingOrder,
        report: &(impl Fn(ParticipantProgress) + Clone + Send + 'static),
    ) -> Result<Event, ParticipantError> {
        let TrainingOrder { model: trained_from, trains, plan, deadline_ms, recipe } = order;
        let (train_set, device) = (self.train_set.clone(), self.device.clone());
        let (factory, spec, schema) =
            (self.factory.clone(), task.model_spec.clone(), task.schema.clone());
        let step = report.clone();
        #[cfg(feature = "tools")]
        let slot = match &self.training_slots {
            Some(slots) => Some(slots.take().await),
            None => None,
        };
        #[cfg(feature = "tools")]
        let pool = slot.as_ref().map(|s| s.pool.clone());
        // A round that closed while the device waited for its slot is not trained for.
        if past_deadline(deadline_ms) {
            return Ok(Event::TrainingAbandoned);
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
            let give_up = move || past_deadline(deadline_ms);
            let (model, report) =
                train_until(model, io, &train_set, &plan, &device, &mut on_step, &give_up)?;
            let update = recipe.prepare(&parameters_of(&model));
            Ok::<_, ParticipantError>(Trained {
                loss: report.loss,
                examples: report.examples,
                update,
            })
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
        let trained = match trained {
            Err(ParticipantError::Train(TrainError::Abandoned)) => {
                return Ok(Event::TrainingAbandoned);
            }
            trained => trained?,
        };
        #[cfg(feature = "tools")]
        drop(slot);
        if let Some(factor) = self.slowdown {
            tokio::time::sleep(training_started.elapsed().mul_f64(factor - 1.0)).await;
        }
        Ok(Event::Trained(trained))
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

    /// Makes `train_set` and `holdout` from the device's text with the task's tokenizer (kept
    /// from an earlier task when it is the same, else fetched once and kept beside the state
    /// file).
    async fn tokenize_text(&mut self, task: &TaskAssignment) -> Result<(), ParticipantError> {
        let source = self.text.as_ref().expect("a device with text");
        let tokenizer = match source.cached(task)? {
            text::Lookup::Ready(train, holdout) => {
                (self.train_set, self.holdout) = (train, holdout);
                return Ok(());
            }
            text::Lookup::Tokenize(tokenizer) => tokenizer,
            text::Lookup::Fetch(hash) => Arc::new(self.tokenizer(&hash).await?),
        };
        let source = self.text.as_mut().expect("a device with text");
        (self.train_set, self.holdout) = source.examples_for(task, tokenizer).await?;
        Ok(())
    }

    /// Tokenizer `hash`, from beside the state file or fetched (and kept there).
    async fn tokenizer(
        &self,
        hash: &str,
    ) -> Result<starling_core::tokenizer::TextTokenizer, ParticipantError> {
        let file = self.state_file.as_deref().map(|f| text::cache_file(f, hash));
        if let Some(kept) = file.as_deref().and_then(|f| text::read_cached(f, hash)) {
            return Ok(kept);
        }
        let bytes = retrying(TRIES, || self.fleet.tokenizer(hash)).await?;
        let tokenizer = starling_core::tokenizer::TextTokenizer::verified(&bytes, hash)?;
        if let Some(file) = &file {
            // A cache that cannot be written costs a download next time, nothing more.
            if let Err(e) = text::write_cache(file, &bytes) {
                tracing::warn!(file = %file.display(), error = %e, "tokenizer not kept");
            }
        }
        Ok(tokenizer)
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
            let values = base.with_trained(&task.schema, &parts_of(task)?, &trained)?;
            self.cached_model = Some((task.model_hash.clone(), values.clone()));
            return Ok(values);
        }
        let payload =
            retrying(TRIES, || self.fleet.model_in(&task.model_hash, task.model_download)).await?;
        let values = Arc::new(decode_model_in(&task.schema, payload, task.model_download)?);
        self.cached_model = Some((task.model_hash.clone(), values.clone()));
        Ok(values)
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
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // The attributes are replaced whole: a panic elsewhere cannot leave them half-written.
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
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

/// Which of the task's tensors the device uploads and keeps.
fn parts_of(task: &TaskAssignment) -> Result<starling_core::plan::ModelParts, ParticipantError> {
    participation::task_parts(task)
        .ok_or_else(|| ParticipantError::SchemaMismatch(participation::PARTS_MISMATCH.into()))
}

/// Now, by this device's clock, in ms since the epoch.
fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

/// Whether a task due at `deadline_ms` (the coordinator's clock, ms since the epoch) is past
/// saving now: its round has closed, or its buffer dropped it.
fn past_deadline(deadline_ms: i64) -> bool {
    participation::past_deadline(now_ms(), deadline_ms)
}

/// This participation's randomness (used by secure rounds), from the OS.
fn entropy() -> Entropy {
    let mut entropy = Entropy { keys: [0; 96], noise: [0; 32] };
    getrandom::fill(&mut entropy.keys).expect("the OS random source failed");
    getrandom::fill(&mut entropy.noise).expect("the OS random source failed");
    entropy
}

/// How a failed step's error reads to the machine.
fn refusal_of(e: &ParticipantError) -> Refusal {
    match e {
        ParticipantError::Protocol(e) => Refusal { code: e.code(), transient: e.is_transient() },
        _ => Refusal::LOCAL,
    }
}

/// The error a participation ends with: the machine's reason, or the failed step's error.
fn participant_error(failure: Failure, step: Option<ParticipantError>) -> ParticipantError {
    let step = || step.expect("a failed step's error is kept");
    match failure {
        Failure::NotEnrolled => ParticipantError::NotEnrolled,
        Failure::StepFailed => step(),
        Failure::SecureStepFailed => match step() {
            ParticipantError::Protocol(e) => {
                ParticipantError::SecureAggregation(SecureError::Protocol(e))
            }
            other => other,
        },
        Failure::SchemaMismatch(why) => ParticipantError::SchemaMismatch(why),
        Failure::TrainingConfig(why) => ParticipantError::Train(TrainError::Config(why)),
        Failure::Secure(failure) => ParticipantError::SecureAggregation(failure.into()),
        other => ParticipantError::Participation(other.to_string()),
    }
}

/// What the device's log says.
fn log_notice(task: Option<&TaskAssignment>, notice: &Notice) {
    let (run, round) = task.map_or((None, None), |t| (Some(t.run_id), Some(t.round_idx)));
    match notice {
        Notice::Excluded(why) => tracing::info!(?run, ?round, %why, "left out of the secure round"),
        Notice::Accused(accused) => tracing::warn!(
            ?run,
            ?round,
            ?accused,
            "sealed shares from these neighbours did not open"
        ),
        Notice::AggregatorUnreachable => {
            tracing::warn!(?run, ?round, "the assigned aggregator is unreachable; round missed")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use starling_core::participation::DEADLINE_SLACK_MS;

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
