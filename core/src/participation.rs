//! One device's participation as a sans-IO state machine, beside the round machine: check in,
//! join a secure round's key stages, download, evaluate, train, persist and upload (or resume
//! a pending upload), leaving whenever the device's conditions stop meeting the run's.
//!
//! The machine takes [`Event`]s (a check-in's answer, a model ready, a trainer's result, a
//! SecAgg+ instruction, the device's conditions, a step that failed) with the time they
//! happened, and queues [`Action`]s (send this request, train on this model, persist the state,
//! wait until). It owns the device's [`ParticipantState`] for the participation and gives it
//! back at the end. A driver does the IO: the SDK's `Participant` over reqwest and the burn
//! trainer, and through it the mobile bindings; the trace tests in `participation/tests/`
//! drive it with scripted events, so a device's behaviour reads as text.
//!
//! A step that fails (a request refused after its retries, a model that does not decode, a
//! trainer's error) is reported as [`Event::Failed`] with what the machine needs to decide
//! (the API's code, whether it is transient); when the participation then ends with that
//! error, the machine says [`Failure::StepFailed`] and the driver returns the error it kept.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use crate::compression::{Compression, ErrorFeedback};
use crate::eligibility::DeviceAttributes;
use crate::plan::{ModelParts, TrainingPlan};
use crate::rng::SplitMix64;
use crate::secagg::{DeviceIdentity, EvaluationInput};
use crate::tensor::{TensorPayload, TensorSchema};
use crate::wire::{
    CheckInResponse, ErrorCode, EvaluationReport, SecAggInstruction, SecAggUpload, TaskAssignment,
    UploadRequest,
};
use crate::{DeviceId, Millis, RoundIdx, RunId};

pub use protocol::{
    Action, Evaluation, EvaluationSet, Event, Failure, Notice, Outcome, Phase, PreparedUpdate,
    Refusal, SecureFailure, Settings, Tamper, Trained, TrainingOrder, UpdateRecipe,
};
pub use secure::{Entropy, SecureParticipation, stage_name};
pub use state::{
    Enrolment, LocalPart, LocalTensor, MAX_RUNS_KEPT, ParticipantState, PendingUpload,
    StateFileError,
};

mod protocol;
mod secure;
mod state;
#[cfg(test)]
mod tests;

/// How long past its round's report deadline (by this device's clock) a task is still trained:
/// room for a device clock a little ahead of the coordinator's, and for the round's grace.
pub const DEADLINE_SLACK_MS: i64 = 10_000;

/// Whether a task due at `deadline_ms` (the coordinator's clock) is past saving at `now`: its
/// round has closed, or its buffer dropped it.
pub fn past_deadline(now: Millis, deadline_ms: Millis) -> bool {
    now > deadline_ms.saturating_add(DEADLINE_SLACK_MS)
}

/// The shuffling seed of one device's training in one round: the plan's seed mixed with the
/// device, run and round, so that no two devices and no two rounds repeat a batch order, and a
/// simulation stays reproducible.
pub fn round_seed(plan_seed: u64, device: Option<DeviceId>, run: RunId, round: RoundIdx) -> u64 {
    let mut rng = SplitMix64(plan_seed);
    for part in [device.map_or(u64::MAX, |d| d.0 as u64), run.0 as u64, round.0 as u64] {
        // Each part goes through the full mixing function, not just the additive state.
        rng.0 = rng.next_u64() ^ part;
    }
    rng.next_u64()
}

/// Which of the task's tensors the device uploads and keeps; `None` when the update schema is
/// not part of the task's model (the coordinator's error, refused before anything trains).
pub fn task_parts(task: &TaskAssignment) -> Option<ModelParts> {
    let update = task.update_schema.clone().unwrap_or_else(|| task.schema.clone());
    ModelParts::of_update(&task.schema, update, task.local_tensors.clone())
}

/// What [`task_parts`]'s `None` means.
pub const PARTS_MISMATCH: &str = "the task's update schema is not a part of its model's schema";

/// The metrics a plain round's upload carries: the training loss, and this version's
/// evaluation when the run noises it with the cohort's; none when a DP run withholds them
/// (they would leave it un-noised).
pub fn upload_metrics(
    task: &TaskAssignment,
    train_loss: f64,
    evaluation: Option<&Evaluation>,
) -> BTreeMap<String, f64> {
    if task.withhold_metrics {
        return BTreeMap::new();
    }
    let mut metrics = BTreeMap::from([("loss".to_owned(), train_loss)]);
    if let (true, Some(e)) = (task.evaluation_in_update, evaluation) {
        use crate::privacy::metrics::{UPLOAD_EVAL_ACCURACY, UPLOAD_EVAL_LOSS};
        metrics.insert(UPLOAD_EVAL_ACCURACY.to_owned(), e.accuracy);
        metrics.insert(UPLOAD_EVAL_LOSS.to_owned(), e.loss);
    }
    metrics
}

/// The points at which the device's conditions are read again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Checkpoint {
    /// Selected, before anything is downloaded (or a secure round joined).
    Selected,
    /// The model downloaded, before it is evaluated.
    Downloaded,
    /// Evaluated, before training.
    Evaluated,
}

/// A secure round's stages, in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    Advertise,
    ShareKeys,
    MaskedInput,
    SignSurvivors,
    Unmask,
}

impl Stage {
    fn name(self) -> &'static str {
        match self {
            Stage::Advertise => "AdvertiseKeys",
            Stage::ShareKeys => "ShareKeys",
            Stage::MaskedInput => "MaskedInput",
            Stage::SignSurvivors => "SignSurvivors",
            Stage::Unmask => "Unmask",
        }
    }
}

/// What the machine waits for.
#[derive(Debug, Clone, PartialEq)]
enum Step {
    CheckingIn,
    Conditions(Checkpoint),
    SecureSending(Stage),
    SecurePolling(Stage),
    SecureWaiting(Stage),
    Downloading,
    /// `report`: a plain round's evaluation, reported once per version.
    Evaluating {
        report: bool,
    },
    EvaluatingRound,
    ReportingEvaluation(Evaluation),
    Training,
    /// The pending upload is on disk: send it.
    PersistingPending,
    /// The upload's end is on disk: finish with this.
    PersistingEnd(Result<Outcome, Failure>),
    UploadingUpdate,
    UploadingEvaluation(Evaluation),
    Finished,
}

/// A secure round's trained update, kept for the masked input.
#[derive(Debug)]
struct SecureUpdate {
    delta: Vec<f32>,
    examples: u64,
    loss: f64,
}

/// One participation of one device.
#[derive(Debug)]
pub struct Participation {
    state: ParticipantState,
    settings: Settings,
    entropy: Entropy,
    step: Step,
    actions: VecDeque<Action>,
    task: Option<TaskAssignment>,
    parts: Option<ModelParts>,
    global: Option<Arc<Vec<f32>>>,
    evaluation: Option<Evaluation>,
    secure: Option<SecureParticipation>,
    secure_update: Option<SecureUpdate>,
    /// What [`Action::Upload`] sends: a trained update's request, or an evaluation-only
    /// round's report.
    upload: Option<UploadRequest>,
    /// The trained update being sent; its metrics and delta moved into `upload`.
    sending: Option<PendingUpload>,
}

impl Participation {
    /// A participation of the device whose state is `state`, with this participation's
    /// `entropy`: it checks in, or first sends the update it holds pending.
    pub fn start(state: ParticipantState, settings: Settings, entropy: Entropy) -> Self {
        let mut m = Participation {
            state,
            settings,
            entropy,
            step: Step::CheckingIn,
            actions: VecDeque::new(),
            task: None,
            parts: None,
            global: None,
            evaluation: None,
            secure: None,
            secure_update: None,
            upload: None,
            sending: None,
        };
        if m.state.credential.is_none() {
            m.finish(Err(Failure::NotEnrolled));
        } else if let Some(pending) = m.state.pending_upload.take() {
            m.send_pending(pending);
        } else {
            m.actions.push_back(Action::Progress(Phase::CheckingIn));
            m.actions.push_back(Action::CheckIn);
        }
        m
    }

    /// The next action, if any is queued.
    pub fn poll_action(&mut self) -> Option<Action> {
        self.actions.pop_front()
    }

    /// The device's state (what [`Action::Persist`] writes).
    pub fn state(&self) -> &ParticipantState {
        &self.state
    }

    /// The device's state, given back at the end.
    pub fn into_state(self) -> ParticipantState {
        self.state
    }

    /// The task the device was given, once checked in.
    pub fn task(&self) -> Option<&TaskAssignment> {
        self.task.as_ref()
    }

    /// The request [`Action::Upload`] sends.
    pub fn upload_request(&self) -> Option<&UploadRequest> {
        self.upload.as_ref()
    }

    /// Whether the participation has ended.
    pub fn finished(&self) -> bool {
        self.step == Step::Finished
    }

    /// Takes `event`, which happened at `now` (ms since the epoch, the device's clock).
    pub fn handle(&mut self, now: Millis, event: Event) {
        let step = std::mem::replace(&mut self.step, Step::Finished);
        match (step, event) {
            (Step::Finished, _) => {}
            (Step::CheckingIn, Event::CheckedIn(response)) => self.checked_in(*response),
            (Step::Conditions(at), Event::Conditions(attributes)) => {
                self.conditions(now, at, &attributes)
            }
            (Step::SecureSending(stage), Event::SecureSent) => self.secure_sent(stage),
            (Step::SecurePolling(stage), Event::Instruction(i)) => self.instruction(now, stage, i),
            (Step::SecureWaiting(stage), Event::Woke) => self.secure_poll(stage),
            (Step::SecureSending(_) | Step::SecurePolling(_), Event::Failed(refusal)) => {
                self.secure_refused(refusal)
            }
            (Step::Downloading, Event::ModelReady(global)) => {
                self.global = Some(global);
                self.read_conditions(Checkpoint::Downloaded);
            }
            // The task's version was given up by a later checkpoint (an asynchronous run moved
            // on while this device waited): like a round closed under it.
            (Step::Downloading, Event::Failed(r)) if r.code == Some(ErrorCode::ModelNotKept) => {
                self.round_missed()
            }
            (Step::Evaluating { report }, Event::Evaluated(evaluation)) => {
                self.evaluated(report, evaluation)
            }
            (Step::EvaluatingRound, Event::Evaluated(evaluation)) => {
                self.evaluated_round(evaluation)
            }
            (Step::ReportingEvaluation(e), Event::EvaluationReported) => self.reported(e),
            (Step::ReportingEvaluation(e), Event::Failed(r))
                if r.code == Some(ErrorCode::DuplicateUpload) =>
            {
                self.reported(e)
            }
            (Step::Training, Event::Trained(trained)) => self.trained(trained),
            (Step::Training, Event::TrainingAbandoned) => self.round_missed(),
            (Step::PersistingPending, Event::Persisted) => {
                let pending = self.state.pending_upload.take().expect("just persisted");
                self.send_pending(pending);
            }
            (Step::PersistingEnd(outcome), Event::Persisted) => self.finish(outcome),
            (Step::UploadingUpdate, Event::Uploaded) => self.delivered(),
            (Step::UploadingUpdate, Event::Failed(refusal)) => self.upload_refused(refusal),
            (Step::UploadingEvaluation(e), Event::Uploaded) => self.evaluation_delivered(e),
            (Step::UploadingEvaluation(e), Event::Failed(r)) => match r.code {
                Some(ErrorCode::DuplicateUpload) => self.evaluation_delivered(e),
                _ if closed(r) => self.round_missed(),
                _ => self.finish(Err(Failure::StepFailed)),
            },
            (_, Event::Failed(_)) => self.finish(Err(Failure::StepFailed)),
            (step, event) => self.finish(Err(Failure::OutOfOrder(format!(
                "{} while waiting in {step:?}",
                event_name(&event)
            )))),
        }
    }
}

/// A refusal that says the round is over for this update.
fn closed(r: Refusal) -> bool {
    matches!(r.code, Some(ErrorCode::RoundClosed | ErrorCode::StaleModel))
}

fn event_name(event: &Event) -> &'static str {
    match event {
        Event::CheckedIn(_) => "CheckedIn",
        Event::Conditions(_) => "Conditions",
        Event::ModelReady(_) => "ModelReady",
        Event::Evaluated(_) => "Evaluated",
        Event::EvaluationReported => "EvaluationReported",
        Event::Trained(_) => "Trained",
        Event::TrainingAbandoned => "TrainingAbandoned",
        Event::Persisted => "Persisted",
        Event::Uploaded => "Uploaded",
        Event::SecureSent => "SecureSent",
        Event::Instruction(_) => "Instruction",
        Event::Woke => "Woke",
        Event::Failed(_) => "Failed",
    }
}

impl Participation {
    fn task_ref(&self) -> &TaskAssignment {
        self.task.as_ref().expect("a step after check-in")
    }

    fn ids(&self) -> (RunId, RoundIdx) {
        let task = self.task_ref();
        (task.run_id, task.round_idx)
    }

    fn finish(&mut self, outcome: Result<Outcome, Failure>) {
        self.step = Step::Finished;
        self.actions.push_back(Action::Finish(outcome));
    }

    fn round_missed(&mut self) {
        let (run_id, round_idx) = self.ids();
        self.finish(Ok(Outcome::RoundMissed { run_id, round_idx }));
    }

    fn read_conditions(&mut self, at: Checkpoint) {
        self.step = Step::Conditions(at);
        self.actions.push_back(Action::ReadConditions);
    }

    fn checked_in(&mut self, response: CheckInResponse) {
        match response {
            CheckInResponse::ComeBackLater { retry_after_secs } => self.finish(Ok(
                Outcome::ComeBackLater(Duration::from_secs(u64::from(retry_after_secs))),
            )),
            CheckInResponse::Task(task) => {
                self.task = Some(task);
                self.read_conditions(Checkpoint::Selected);
            }
        }
    }

    /// The device's conditions at a checkpoint: it leaves the round when they no longer meet
    /// the task's requirements, and goes on otherwise.
    fn conditions(&mut self, now: Millis, at: Checkpoint, attributes: &DeviceAttributes) {
        let task = self.task_ref();
        let unmet = task.eligibility.unmet(attributes);
        if !unmet.is_empty() {
            let (run_id, round_idx) = self.ids();
            return self.finish(Ok(Outcome::ConditionsNotMet { run_id, round_idx, unmet }));
        }
        match at {
            // A secure round's short key stages come before training; the masked input after.
            Checkpoint::Selected if task.secure_aggregation.is_some() => self.join_secure(),
            Checkpoint::Selected => self.download(),
            Checkpoint::Downloaded => self.evaluate(),
            Checkpoint::Evaluated => self.train(now),
        }
    }

    fn download(&mut self) {
        self.step = Step::Downloading;
        self.actions.push_back(Action::Progress(Phase::Downloading));
        self.actions.push_back(Action::FetchModel);
    }

    /// AdvertiseKeys, with this participation's entropy and the enrolled identity.
    fn join_secure(&mut self) {
        let task = self.task_ref().secure_aggregation.expect("a secure task");
        let Some(identity) = self.state.identity.map(DeviceIdentity::from_secret) else {
            return self.finish(Err(SecureFailure::NoIdentity.into()));
        };
        let (run_id, round_idx) = self.ids();
        let round = (run_id, round_idx, self.task_ref().model_version);
        let enrolment = self.state.enrolment;
        match SecureParticipation::advertise(round, task, identity, enrolment, self.entropy) {
            Ok((session, keys)) => {
                self.secure = Some(session);
                self.secure_send(Stage::Advertise, keys);
            }
            Err(e) => self.finish(Err(SecureFailure::Secagg(e).into())),
        }
    }

    fn secure_send(&mut self, stage: Stage, message: SecAggUpload) {
        self.step = Step::SecureSending(stage);
        self.actions.push_back(Action::SecureSend(message));
    }

    fn secure_poll(&mut self, stage: Stage) {
        self.step = Step::SecurePolling(stage);
        self.actions.push_back(Action::SecurePoll);
    }

    fn secure_sent(&mut self, stage: Stage) {
        match stage {
            Stage::Advertise => self.secure_poll(Stage::ShareKeys),
            Stage::ShareKeys => self.download(),
            Stage::MaskedInput => self.secure_poll(Stage::SignSurvivors),
            Stage::SignSurvivors => self.secure_poll(Stage::Unmask),
            Stage::Unmask => {
                let (run_id, round_idx) = self.ids();
                let update = self.secure_update.take().expect("trained before masking");
                self.finish(Ok(Outcome::Uploaded {
                    run_id,
                    round_idx,
                    train_loss: update.loss,
                    evaluation: self.evaluation,
                }));
            }
        }
    }

    /// The coordinator's instruction while the device waits for `stage`'s.
    fn instruction(&mut self, now: Millis, stage: Stage, instruction: SecAggInstruction) {
        let session = self.secure.as_mut().expect("a secure round");
        let message = match (stage, instruction) {
            (_, SecAggInstruction::Wait { retry_after_ms }) => {
                self.step = Step::SecureWaiting(stage);
                let after = i64::from(retry_after_ms.max(10));
                self.actions.push_back(Action::WaitUntil(now.saturating_add(after)));
                return;
            }
            (_, SecAggInstruction::Excluded { reason }) => {
                self.actions.push_back(Action::Notice(Notice::Excluded(reason)));
                return self.round_missed();
            }
            (Stage::ShareKeys, SecAggInstruction::ShareKeys(n)) => session.share_keys(n),
            (Stage::MaskedInput, SecAggInstruction::MaskedInput(request)) => {
                let update = self.secure_update.as_ref().expect("trained before masking");
                let pooled = self.evaluation.map(|e| EvaluationInput {
                    examples: e.examples,
                    accuracy: e.accuracy,
                    loss: e.loss,
                });
                let version = self.task.as_ref().expect("a task").model_version;
                session.masked_input(request, version, &update.delta, update.examples, pooled).map(
                    |(message, accused)| {
                        if !accused.is_empty() {
                            self.actions.push_back(Action::Notice(Notice::Accused(accused)));
                        }
                        message
                    },
                )
            }
            (Stage::SignSurvivors, SecAggInstruction::SignSurvivors(r)) => {
                session.sign_survivors(r)
            }
            (Stage::Unmask, SecAggInstruction::Unmask(r)) => session.unmask(r),
            (_, other) => {
                let got = stage_name(&other);
                return self
                    .finish(Err(SecureFailure::OutOfStep { want: stage.name(), got }.into()));
            }
        };
        match message {
            Ok(message) => self.secure_send(stage, message),
            Err(e) => self.finish(Err(SecureFailure::Secagg(e).into())),
        }
    }

    /// A secure round this device could not finish: missing it is an outcome, anything else an
    /// error.
    fn secure_refused(&mut self, refusal: Refusal) {
        match refusal.code {
            Some(ErrorCode::RoundClosed | ErrorCode::Conflict) => self.round_missed(),
            _ => self.finish(Err(Failure::SecureStepFailed)),
        }
    }

    /// The model is in: lay the device's local tensors over it and evaluate it.
    fn evaluate(&mut self) {
        let task = self.task_ref();
        let Some(parts) = task_parts(task) else {
            return self.finish(Err(Failure::SchemaMismatch(PARTS_MISMATCH.into())));
        };
        self.parts = Some(parts);
        let downloaded = self.global.take().expect("downloaded");
        let global = self.with_local_part(downloaded);
        self.global = Some(global.clone());
        self.actions.push_back(Action::Progress(Phase::Evaluating));
        let task = self.task_ref();
        let (on, step) = if task.evaluate_only {
            (EvaluationSet::HeldOutOrTraining, Step::EvaluatingRound)
        } else if task.secure_aggregation.is_some() {
            // A secure round's evaluation rides in the masked input (only the cohort's pooled
            // evaluation is revealed); a plain round's is reported once per model version.
            (EvaluationSet::HeldOut, Step::Evaluating { report: false })
        } else if self.state.last_evaluated == Some((task.run_id, task.model_version)) {
            return self.read_conditions(Checkpoint::Evaluated);
        } else {
            (EvaluationSet::HeldOut, Step::Evaluating { report: true })
        };
        self.step = step;
        self.actions.push_back(Action::Evaluate { model: global, on });
    }

    /// `global` with this device's local part of the task's run laid over it, when the run has
    /// local tensors and the device has trained them before.
    fn with_local_part(&self, global: Arc<Vec<f32>>) -> Arc<Vec<f32>> {
        let task = self.task_ref();
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

    fn evaluated(&mut self, report: bool, evaluation: Option<Evaluation>) {
        let task = self.task_ref();
        match evaluation {
            // A DP run takes no evaluation on its own: it withholds it, or it rides with the
            // update to be noised with the cohort's.
            Some(e) if report && !task.withhold_metrics && !task.evaluation_in_update => {
                let report = EvaluationReport {
                    model_version: task.model_version,
                    example_count: e.examples,
                    metrics: e.metrics(),
                };
                self.step = Step::ReportingEvaluation(e);
                self.actions.push_back(Action::ReportEvaluation(report));
            }
            evaluation => {
                self.evaluation = evaluation;
                self.read_conditions(Checkpoint::Evaluated);
            }
        }
    }

    fn reported(&mut self, evaluation: Evaluation) {
        let task = self.task_ref();
        self.state.last_evaluated = Some((task.run_id, task.model_version));
        self.evaluation = Some(evaluation);
        self.read_conditions(Checkpoint::Evaluated);
    }

    /// An evaluation-only round: the metrics go up, with an empty delta, as the round's report.
    fn evaluated_round(&mut self, evaluation: Option<Evaluation>) {
        let Some(evaluation) = evaluation else {
            return self.finish(Err(Failure::OutOfOrder(
                "an evaluation-only round's evaluation came back empty".into(),
            )));
        };
        let task = self.task_ref();
        let (run_id, round_idx) = (task.run_id, task.round_idx);
        let request = UploadRequest {
            model_version: task.model_version,
            example_count: evaluation.examples,
            metrics: evaluation.metrics(),
            delta: TensorSchema { tensors: vec![] }.encode_f32(&[]),
        };
        self.upload = Some(request);
        self.step = Step::UploadingEvaluation(evaluation);
        self.actions.push_back(Action::Upload { run_id, round_idx, to: None });
    }

    fn evaluation_delivered(&mut self, evaluation: Evaluation) {
        self.upload = None;
        let (run_id, round_idx) = self.ids();
        self.finish(Ok(Outcome::Evaluated { run_id, round_idx, evaluation }));
    }

    /// Conditions still met after the evaluation: train, unless the round is past saving.
    fn train(&mut self, now: Millis) {
        self.actions.push_back(Action::Progress(Phase::Training));
        let task = self.task_ref();
        let (run_id, round_idx) = (task.run_id, task.round_idx);
        let mut plan = match TrainingPlan::from_json(&task.training_config) {
            Ok(plan) => plan,
            Err(e) => return self.finish(Err(Failure::TrainingConfig(e.to_string()))),
        };
        // The plan's seed is the run's; each device shuffles differently in every round.
        plan.seed = match self.settings.seed_key {
            Some(key) => round_seed(plan.seed, Some(DeviceId(key as i64)), RunId(0), round_idx),
            None => round_seed(plan.seed, self.state.device_id, run_id, round_idx),
        };
        // A task whose round closed while the device waited is given up rather than trained
        // for a round that can only refuse it.
        if past_deadline(now, task.report_deadline_ms) {
            return self.round_missed();
        }
        let parts = self.parts.clone().expect("parts before training");
        let feedback = match &self.state.error_feedback {
            Some((run, feedback)) if *run == run_id => feedback.clone(),
            _ => ErrorFeedback::default(),
        };
        // A secure round masks the f32 delta itself: nothing to encode. Int8's stochastic
        // rounding draws from the round's own seed, so a device never repeats its pattern.
        let encoding = task
            .secure_aggregation
            .is_none()
            .then_some((task.compression, SplitMix64(plan.seed ^ 0x5eed_c0de_d0e1_7a5e)));
        let model = self.global.clone().expect("downloaded");
        let trains = (!parts.is_whole())
            .then(|| task.schema.tensors.iter().map(|t| parts.trains(t)).collect());
        let recipe = UpdateRecipe {
            run_id,
            schema: task.schema.clone(),
            trained_from: model.clone(),
            parts,
            local: task.local_tensors.clone(),
            tamper: self.settings.tamper.clone(),
            encoding,
            feedback,
        };
        let order =
            TrainingOrder { model, trains, plan, deadline_ms: task.report_deadline_ms, recipe };
        self.step = Step::Training;
        self.actions.push_back(Action::Train(Box::new(order)));
    }

    fn trained(&mut self, trained: Trained) {
        let Trained { loss, examples, update } = trained;
        // Kept whatever becomes of the upload: the device trained it, and it never travels.
        if let Some(part) = update.local_part {
            state::keep(&mut self.state.local_parts, part);
        }
        let task = self.task_ref();
        if task.secure_aggregation.is_some() {
            // A secure round's update is masked for keys that live only in this participation:
            // it cannot be sent after a restart, so it is not kept.
            self.secure_update = Some(SecureUpdate { delta: update.delta, examples, loss });
            self.actions.push_back(Action::Progress(Phase::Uploading));
            return self.secure_poll(Stage::MaskedInput);
        }
        let Some(encoded) = update.encoded else {
            return self
                .finish(Err(Failure::OutOfOrder("a plain round's update unencoded".into())));
        };
        let parts = self.parts.as_ref().expect("parts before training");
        let pending = PendingUpload {
            run_id: task.run_id,
            round_idx: task.round_idx,
            upload_to: task.upload_to.clone(),
            model_version: task.model_version,
            example_count: examples,
            metrics: upload_metrics(task, loss, self.evaluation.as_ref()),
            schema_id: parts.update_schema().schema_id(),
            delta: encoded,
            train_loss: loss,
            evaluation: self.evaluation,
            // Only what reached the coordinator leaves the residual.
            error_feedback: matches!(task.compression, Compression::TopK { .. })
                .then_some(update.feedback),
        };
        // On disk before it is sent; it leaves the state once it is in.
        self.state.pending_upload = Some(pending);
        self.step = Step::PersistingPending;
        self.actions.push_back(Action::Persist);
    }

    /// Sends a trained update (taken out of the state, still in the state file). The
    /// model-sized delta moves into the request and back, never copied.
    fn send_pending(&mut self, mut pending: PendingUpload) {
        self.actions.push_back(Action::Progress(Phase::Uploading));
        let request = UploadRequest {
            model_version: pending.model_version,
            example_count: pending.example_count,
            metrics: std::mem::take(&mut pending.metrics),
            delta: TensorPayload {
                schema_id: pending.schema_id,
                data: std::mem::take(&mut pending.delta),
            },
        };
        let (run_id, round_idx, to) =
            (pending.run_id, pending.round_idx, pending.upload_to.clone());
        self.upload = Some(request);
        self.sending = Some(pending);
        self.step = Step::UploadingUpdate;
        self.actions.push_back(Action::Upload { run_id, round_idx, to });
    }

    /// The update is in: its residual becomes the run's error feedback, and the state without
    /// the pending upload goes to disk.
    fn delivered(&mut self) {
        self.upload = None;
        let pending = self.sending.take().expect("an upload in flight");
        let (run_id, round_idx) = (pending.run_id, pending.round_idx);
        if let Some(feedback) = pending.error_feedback {
            self.state.error_feedback = Some((run_id, feedback));
        }
        let outcome = Outcome::Uploaded {
            run_id,
            round_idx,
            train_loss: pending.train_loss,
            evaluation: pending.evaluation,
        };
        self.persist_then(Ok(outcome));
    }

    fn upload_refused(&mut self, refusal: Refusal) {
        // A resent update whose first attempt landed is a duplicate: it is in.
        if refusal.code == Some(ErrorCode::DuplicateUpload) {
            return self.delivered();
        }
        let request = self.upload.take().expect("an upload in flight");
        let mut pending = self.sending.take().expect("an upload in flight");
        let (run_id, round_idx) = (pending.run_id, pending.round_idx);
        let missed = Ok(Outcome::RoundMissed { run_id, round_idx });
        match refusal {
            r if closed(r) => self.persist_then(missed),
            // An aggregator that is gone takes its round's shard with it: like a round closed
            // under the device, not an error of the device's.
            Refusal { transient: true, .. } if pending.upload_to.is_some() => {
                self.actions.push_back(Action::Notice(Notice::AggregatorUnreachable));
                self.persist_then(missed)
            }
            // Kept for the next participation: the coordinator may take it yet.
            Refusal { transient: true, .. } => {
                pending.metrics = request.metrics;
                pending.delta = request.delta.data;
                self.state.pending_upload = Some(pending);
                self.finish(Err(Failure::StepFailed));
            }
            // Refused for good (a revoked credential, an update it will never take): sending
            // it again cannot help, so it is dropped and the device checks in afresh next time.
            _ => self.persist_then(Err(Failure::StepFailed)),
        }
    }

    fn persist_then(&mut self, end: Result<Outcome, Failure>) {
        self.step = Step::PersistingEnd(end);
        self.actions.push_back(Action::Persist);
    }
}
