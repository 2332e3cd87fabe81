//! Participation machine tests: snapshot traces of whole participations, grouped by behaviour
//! in the modules below; this file is their shared harness (a two-tensor model, a task, an
//! enrolled device's state, and `Trace`, which feeds a machine events and records each action
//! it takes as one line).

use expect_test::{Expect, expect};

use super::*;
use crate::tensor::{DType, TensorSpec};
use crate::wire::UploadTarget;

mod plain;
mod resume;
mod secure_round;

/// A model of a two-value body `w` and a one-value `head`.
fn schema() -> TensorSchema {
    let tensor =
        |name: &str, n| TensorSpec { name: name.into(), shape: vec![n], dtype: DType::F32 };
    TensorSchema { tensors: vec![tensor("w", 2), tensor("head", 1)] }
}

/// Round 0 of run 1, model version 0, f32, due at t = 60 s.
fn task() -> TaskAssignment {
    TaskAssignment {
        run_id: RunId(1),
        round_idx: RoundIdx(0),
        model_version: crate::ModelVersion(0),
        model_hash: "m0".into(),
        schema: schema(),
        update_schema: None,
        local_tensors: vec![],
        base_model: None,
        tokenizer: None,
        model_spec: None,
        training_config: "null".into(),
        report_deadline_ms: 60_000,
        secure_aggregation: None,
        evaluate_only: false,
        upload_to: None,
        compression: Compression::F32,
        model_download: Compression::F32,
        withhold_metrics: false,
        evaluation_in_update: false,
        eligibility: Default::default(),
    }
}

/// An enrolled device with an identity key.
fn enrolled() -> ParticipantState {
    ParticipantState {
        device_id: Some(DeviceId(7)),
        credential: Some("credential".into()),
        identity: Some([7; 32]),
        ..Default::default()
    }
}

fn entropy() -> Entropy {
    Entropy { keys: [3; 96], noise: [5; 32] }
}

fn evaluation() -> Evaluation {
    Evaluation { loss: 0.5, accuracy: 0.75, examples: 4 }
}

fn refused(code: ErrorCode, transient: bool) -> Event {
    Event::Failed(Refusal { code: Some(code), transient })
}

/// A transport failure (after the driver's retries).
fn unreachable() -> Event {
    Event::Failed(Refusal { code: None, transient: true })
}

/// Drives a machine and records every event and action as one line.
struct Trace {
    m: Participation,
    now: Millis,
    lines: Vec<String>,
    /// The last training order, for [`Trace::train`].
    order: Option<TrainingOrder>,
    /// The last secure-round message, for the test's coordinator.
    sent: Option<SecAggUpload>,
}

impl Trace {
    fn start(state: ParticipantState) -> Self {
        Self::with(state, Settings::default())
    }

    fn with(state: ParticipantState, settings: Settings) -> Self {
        let pending = state.pending_upload.as_ref().map(|p| (p.run_id.0, p.round_idx.0));
        let m = Participation::start(state, settings, entropy());
        let mut t = Trace { m, now: 1_000, lines: vec![], order: None, sent: None };
        t.lines.push(format!("t={} start (pending upload: {pending:?})", t.now));
        t.drain();
        t
    }

    fn at(&mut self, now: Millis) -> &mut Self {
        self.now = now;
        self
    }

    fn drain(&mut self) {
        while let Some(action) = self.m.poll_action() {
            let line = self.describe(&action);
            self.lines.push(format!("  {line}"));
            match action {
                Action::Train(order) => self.order = Some(*order),
                Action::SecureSend(message) => self.sent = Some(message),
                _ => {}
            }
        }
    }

    fn event(&mut self, event: Event) -> &mut Self {
        self.lines.push(format!("t={} {}", self.now, describe_event(&event)));
        self.m.handle(self.now, event);
        self.drain();
        self
    }

    fn task(&mut self, task: TaskAssignment) -> &mut Self {
        self.event(Event::CheckedIn(Box::new(CheckInResponse::Task(task))))
    }

    fn conditions(&mut self) -> &mut Self {
        self.event(Event::Conditions(DeviceAttributes::default()))
    }

    fn model(&mut self, values: &[f32]) -> &mut Self {
        self.event(Event::ModelReady(Arc::new(values.to_vec())))
    }

    /// The trainer's result: the last order's model trained to `values`.
    fn train(&mut self, values: &[f32]) -> &mut Self {
        let order = self.order.take().expect("asked to train");
        let update = order.recipe.prepare(values);
        self.event(Event::Trained(Trained { loss: 0.25, examples: 10, update }))
    }

    fn finish(&mut self, expected: Expect) -> ParticipantState {
        expected.assert_eq(&self.lines.join("\n"));
        assert!(self.m.finished(), "the participation has not finished");
        std::mem::replace(
            &mut self.m,
            Participation::start(enrolled(), Settings::default(), entropy()),
        )
        .into_state()
    }

    fn describe(&self, action: &Action) -> String {
        match action {
            Action::FetchModel => {
                format!("FetchModel({})", self.m.task().expect("a task").model_hash)
            }
            Action::Evaluate { model, on } => {
                format!("Evaluate {{ on: {on:?}, model: {model:?} }}")
            }
            Action::Train(order) => format!(
                "Train {{ from: {:?}, trains: {:?}, deadline: {}, encoding: {:?} }}",
                order.model,
                order.trains,
                order.deadline_ms,
                order.recipe.encoding.as_ref().map(|(c, _)| c)
            ),
            Action::Persist => format!("Persist {}", describe_state(self.m.state())),
            Action::Upload { run_id, round_idx, to } => {
                let r = self.m.upload_request().expect("an upload");
                format!(
                    "Upload {{ run: {}, round: {}, to: {:?}, version: {}, examples: {}, metrics: {:?}, delta: {} bytes }}",
                    run_id.0,
                    round_idx.0,
                    to.as_ref().map(|t| &t.url),
                    r.model_version.0,
                    r.example_count,
                    r.metrics,
                    r.delta.data.len()
                )
            }
            Action::SecureSend(message) => format!("SecureSend({})", describe_message(message)),
            Action::Finish(Ok(outcome)) => format!("Finish(Ok({outcome:?}))"),
            other => format!("{other:?}"),
        }
    }
}

/// What the state holds that a participation changes.
fn describe_state(state: &ParticipantState) -> String {
    let pending = state
        .pending_upload
        .as_ref()
        .map(|p| format!("run {} round {}, {} bytes", p.run_id.0, p.round_idx.0, p.delta.len()));
    let feedback = state.error_feedback.as_ref().map(|(run, f)| (run.0, f.residual.clone()));
    let local: Vec<_> = state
        .local_parts
        .iter()
        .map(|p| {
            let values: Vec<_> =
                p.tensors.iter().map(|t| crate::tensor::f32_from_le_bytes(&t.values)).collect();
            (p.run_id.0, values)
        })
        .collect();
    format!(
        "{{ pending: {pending:?}, error_feedback: {feedback:?}, local: {local:?}, last_evaluated: {:?} }}",
        state.last_evaluated.map(|(run, version)| (run.0, version.0))
    )
}

fn describe_message(message: &SecAggUpload) -> String {
    match message {
        SecAggUpload::AdvertiseKeys(_) => "AdvertiseKeys".into(),
        SecAggUpload::ShareKeys(sealed) => {
            let to: Vec<_> = sealed.iter().map(|s| s.to).collect();
            format!("ShareKeys to {to:?}")
        }
        SecAggUpload::MaskedInput { model_version, masked, accusations } => format!(
            "MaskedInput {{ version: {}, {} entries, {} accused }}",
            model_version.0,
            masked.len() / 4,
            accusations.len()
        ),
        SecAggUpload::SignSurvivors(_) => "SignSurvivors".into(),
        SecAggUpload::Unmask(_) => "Unmask".into(),
    }
}

fn describe_event(event: &Event) -> String {
    match event {
        Event::CheckedIn(response) => match &**response {
            CheckInResponse::Task(t) => format!(
                "CheckedIn(Task {{ run: {}, round: {}, version: {}, secure: {}, compression: {:?}, local: {:?} }})",
                t.run_id.0,
                t.round_idx.0,
                t.model_version.0,
                t.secure_aggregation.is_some(),
                t.compression,
                t.local_tensors
            ),
            other => format!("CheckedIn({other:?})"),
        },
        Event::Conditions(a) if *a == DeviceAttributes::default() => {
            "Conditions(as reported)".into()
        }
        Event::Conditions(a) => format!("Conditions(charging: {:?})", a.charging),
        Event::Instruction(i) => format!("Instruction({})", stage_name(i)),
        Event::Trained(t) => format!(
            "Trained {{ loss: {}, examples: {}, delta: {:?}, encoded: {:?} }}",
            t.loss,
            t.examples,
            t.update.delta,
            t.update.encoded.as_ref().map(Vec::len)
        ),
        other => format!("{other:?}"),
    }
}
