//! The participation machine's vocabulary: the events it takes, the actions it asks for, what
//! a participation ends with, and the training hand-off (an order in, a prepared update out).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::compression::{Compression, ErrorFeedback};
use crate::eligibility::DeviceAttributes;
use crate::plan::{ModelParts, TrainingPlan};
use crate::rng::SplitMix64;
use crate::secagg::SecAggError;
use crate::tensor::TensorSchema;
use crate::wire::{
    CheckInResponse, ErrorCode, EvaluationReport, SecAggInstruction, SecAggUpload, UploadTarget,
};
use crate::{Millis, RoundIdx, RunId};

use super::LocalPart;

/// Loss and accuracy on a set of examples.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Evaluation {
    /// Mean cross-entropy.
    pub loss: f64,
    /// Fraction classified correctly.
    pub accuracy: f64,
    /// Examples evaluated.
    pub examples: u64,
}

impl Evaluation {
    /// The metrics as reported to the coordinator: `accuracy` and `loss`.
    pub fn metrics(&self) -> BTreeMap<String, f64> {
        [("accuracy".to_owned(), self.accuracy), ("loss".to_owned(), self.loss)].into()
    }
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
    /// Training on local examples.
    Training,
    /// Sending the update.
    Uploading,
}

/// Why a participation failed; nothing of the device's data was sent in any case.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum Failure {
    /// The device has no credential.
    #[error("not enrolled: call enroll first")]
    NotEnrolled,
    /// The step that last failed ends the participation: the driver's error for it is the
    /// error.
    #[error("the last step failed")]
    StepFailed,
    /// A secure round's request that last failed ends the participation.
    #[error("the last secure-aggregation request failed")]
    SecureStepFailed,
    /// The task's tensors do not fit together (the coordinator's error).
    #[error("the model's parameters do not match the run's schema: {0}")]
    SchemaMismatch(String),
    /// The task's training configuration is not one this device can train with.
    #[error("training config: {0}")]
    TrainingConfig(String),
    /// The device cannot take part in the secure round.
    #[error(transparent)]
    Secure(#[from] SecureFailure),
    /// The driver gave an event the machine was not waiting for (a driver's bug).
    #[error("participation driver: {0}")]
    OutOfOrder(String),
}

/// Why a device's part in a secure round ended early, by its own doing or the coordinator's.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum SecureFailure {
    /// The coordinator's message does not fit the protocol (e.g. a neighbourhood that leaves
    /// too few neighbours); nothing secret was sent.
    #[error("secure aggregation: {0}")]
    Secagg(#[from] SecAggError),
    /// The device has no identity key to sign its keys with.
    #[error("this device has no identity key, which secure runs need: enroll it again")]
    NoIdentity,
    /// The coordinator asked for another stage than the one this device is in.
    #[error("the coordinator asked for {got} while the device waited for {want}")]
    OutOfStep {
        /// What the device waited for.
        want: &'static str,
        /// What it was asked.
        got: &'static str,
    },
}

/// How a step failed, as far as the machine needs to know.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Refusal {
    /// The coordinator's error code, when it answered with one.
    pub code: Option<ErrorCode>,
    /// Whether trying again later may succeed (a transport error, a 5xx, a 429).
    pub transient: bool,
}

impl Refusal {
    /// A failure on the device itself (a model that does not decode, a trainer's error).
    pub const LOCAL: Refusal = Refusal { code: None, transient: false };
}

/// What a trainer did with a [`TrainingOrder`].
#[derive(Debug, Clone, PartialEq)]
pub struct Trained {
    /// Mean local training loss.
    pub loss: f64,
    /// Examples trained on per epoch: the FedAvg weight.
    pub examples: u64,
    /// The update prepared from the trained model ([`UpdateRecipe::prepare`]).
    pub update: PreparedUpdate,
}

/// What happened; each with the time it happened, through [`Participation::handle`](super::Participation::handle).
#[derive(Debug, Clone)]
pub enum Event {
    /// The coordinator answered the check-in.
    CheckedIn(Box<CheckInResponse>),
    /// The device's conditions now (answers [`Action::ReadConditions`]).
    Conditions(DeviceAttributes),
    /// The task's global model, decoded (answers [`Action::FetchModel`]).
    ModelReady(Arc<Vec<f32>>),
    /// The evaluation asked for; `None` when the device holds no examples out.
    Evaluated(Option<Evaluation>),
    /// The coordinator took the evaluation report.
    EvaluationReported,
    /// The trainer finished.
    Trained(Trained),
    /// The trainer gave up: the task's deadline passed while it trained.
    TrainingAbandoned,
    /// The state was written.
    Persisted,
    /// The coordinator (or the assigned aggregator) acknowledged the upload.
    Uploaded,
    /// The coordinator took the secure-round message.
    SecureSent,
    /// The coordinator's instruction for this device in the secure round.
    Instruction(SecAggInstruction),
    /// The time asked for in [`Action::WaitUntil`] came.
    Woke,
    /// The step the machine asked for failed.
    Failed(Refusal),
}

/// Which examples an evaluation runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EvaluationSet {
    /// The held-out examples; none evaluated (and `Evaluated(None)`) without any.
    HeldOut,
    /// The held-out examples, or all local examples when none are held out (an
    /// evaluation-only round trains on nothing).
    HeldOutOrTraining,
}

/// What the device should do next.
#[derive(Debug)]
pub enum Action {
    /// Tell the app's progress callback.
    Progress(Phase),
    /// Check in with the coordinator, reporting the device's conditions.
    CheckIn,
    /// Read the device's conditions now; answer [`Event::Conditions`].
    ReadConditions,
    /// Fetch and decode [`Participation::task`](super::Participation::task)'s global model (from a cache when its hash
    /// matches); answer [`Event::ModelReady`].
    FetchModel,
    /// Evaluate this model of the task on local examples.
    Evaluate {
        /// The model's values (with the device's local tensors laid over).
        model: Arc<Vec<f32>>,
        /// On which examples.
        on: EvaluationSet,
    },
    /// Send this evaluation of the task's model version.
    ReportEvaluation(EvaluationReport),
    /// Train the task's model; answer [`Event::Trained`] or [`Event::TrainingAbandoned`].
    Train(Box<TrainingOrder>),
    /// Write [`Participation::state`](super::Participation::state) to the state file (when there is one).
    Persist,
    /// Send [`Participation::upload_request`](super::Participation::upload_request) for this run and round, to the assigned
    /// aggregator if any, else to the coordinator.
    Upload {
        /// Run.
        run_id: RunId,
        /// Round.
        round_idx: RoundIdx,
        /// The aggregator the task assigned.
        to: Option<UploadTarget>,
    },
    /// Send this secure-round message.
    SecureSend(SecAggUpload),
    /// Ask the coordinator for this device's next secure-round instruction.
    SecurePoll,
    /// Answer [`Event::Woke`] at this time.
    WaitUntil(Millis),
    /// Something the device's log should say.
    Notice(Notice),
    /// The participation ended.
    Finish(Result<Outcome, Failure>),
}

/// What a device's log says about its participation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Notice {
    /// The secure round goes on without this device.
    Excluded(String),
    /// These neighbours' sealed shares did not open; the masked input accuses them.
    Accused(Vec<crate::secagg::ClientIdx>),
    /// The aggregator the task assigned could not be reached: its round's shard is lost.
    AggregatorUnreachable,
}

/// What the trainer trains, and how its result becomes the update.
#[derive(Debug)]
pub struct TrainingOrder {
    /// The values training starts from (the global model with the device's local tensors).
    pub model: Arc<Vec<f32>>,
    /// One flag per tensor: whether it trains (in the update or local); `None`: all do.
    pub trains: Option<Vec<bool>>,
    /// The plan's training section, its seed this device's for this round.
    pub plan: TrainingPlan,
    /// The round's report deadline (the coordinator's clock): training past it (and
    /// [`DEADLINE_SLACK_MS`](super::DEADLINE_SLACK_MS)) is given up.
    pub deadline_ms: Millis,
    /// Turns the trained values into the update (on the trainer's thread: it is model-sized
    /// work).
    pub recipe: UpdateRecipe,
}

/// A change to a trained delta before upload: how the simulator makes a device misbehave.
pub type Tamper = Arc<dyn Fn(&mut [f32]) + Send + Sync>;

/// Turns a trained model into the update a device sends: the delta from the model it started
/// from, cut to the update's tensors, encoded as the task says (a secure round masks the f32
/// delta itself), with the local tensors split off to keep.
pub struct UpdateRecipe {
    pub(super) run_id: RunId,
    pub(super) schema: TensorSchema,
    pub(super) trained_from: Arc<Vec<f32>>,
    pub(super) parts: ModelParts,
    pub(super) local: Vec<String>,
    pub(super) tamper: Option<Tamper>,
    /// `None` in a secure round.
    pub(super) encoding: Option<(Compression, SplitMix64)>,
    pub(super) feedback: ErrorFeedback,
}

impl std::fmt::Debug for UpdateRecipe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UpdateRecipe")
            .field("encoding", &self.encoding.as_ref().map(|(c, _)| c))
            .finish_non_exhaustive()
    }
}

/// An update made from a trained model by [`UpdateRecipe::prepare`].
#[derive(Debug, Clone, PartialEq)]
pub struct PreparedUpdate {
    /// The f32 delta of the update's tensors.
    pub delta: Vec<f32>,
    /// The delta encoded for upload (plain rounds).
    pub encoded: Option<Vec<u8>>,
    /// Top-k's residual after this encoding.
    pub feedback: ErrorFeedback,
    /// The local tensors trained, to keep.
    pub local_part: Option<LocalPart>,
}

impl UpdateRecipe {
    /// The update from the trained model's values.
    pub fn prepare(self, trained: &[f32]) -> PreparedUpdate {
        let UpdateRecipe {
            run_id,
            schema,
            trained_from,
            parts,
            local,
            tamper,
            encoding,
            mut feedback,
        } = self;
        let local_part =
            (!local.is_empty()).then(|| LocalPart::of(run_id, &schema, trained, &local));
        let delta: Vec<f32> = trained.iter().zip(trained_from.iter()).map(|(t, g)| t - g).collect();
        // Only the update's tensors leave the device.
        let mut delta = parts.update_of(&delta);
        if let Some(tamper) = tamper {
            tamper(&mut delta);
        }
        let encoded = encoding.map(|(compression, mut rounding)| {
            compression.encode(&delta, &mut rounding, &mut feedback)
        });
        PreparedUpdate { delta, encoded, feedback, local_part }
    }
}

/// What the machine's driver may change about a device (the simulator's devices).
#[derive(Clone, Default)]
pub struct Settings {
    /// Derive training seeds from this key and the round alone, not from the device and run
    /// ids the coordinator gave (a simulation repeated with one seed trains the same batches).
    pub seed_key: Option<u64>,
    /// Change every trained delta with this before it is encoded (a poisoning device).
    pub tamper: Option<Tamper>,
}

impl std::fmt::Debug for Settings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Settings")
            .field("seed_key", &self.seed_key)
            .field("tamper", &self.tamper.is_some())
            .finish()
    }
}
