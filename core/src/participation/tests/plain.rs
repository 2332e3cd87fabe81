//! Plain rounds: the whole participation, compressed and DP uploads, local tensors, and the
//! ways a device leaves a round before it trains.

use super::*;

#[test]
fn a_plain_participation_evaluates_once_trains_persists_then_uploads() {
    let mut t = Trace::start(enrolled());
    t.task(task()).conditions().model(&[1.0, 2.0, 3.0]).conditions();
    t.event(Event::Evaluated(Some(evaluation()))).event(Event::EvaluationReported).conditions();
    t.train(&[1.5, 2.0, 2.0])
        .event(Event::Persisted)
        .event(Event::Uploaded)
        .event(Event::Persisted);
    let state = t.finish(expect![[r#"
        t=1000 start (pending upload: None)
          Progress(CheckingIn)
          CheckIn
        t=1000 CheckedIn(Task { run: 1, round: 0, version: 0, secure: false, compression: F32, local: [] })
          ReadConditions
        t=1000 Conditions(as reported)
          Progress(Downloading)
          FetchModel(m0)
        t=1000 ModelReady([1.0, 2.0, 3.0])
          ReadConditions
        t=1000 Conditions(as reported)
          Progress(Evaluating)
          Evaluate { on: HeldOut, model: [1.0, 2.0, 3.0] }
        t=1000 Evaluated(Some(Evaluation { loss: 0.5, accuracy: 0.75, examples: 4 }))
          ReportEvaluation(EvaluationReport { model_version: ModelVersion(0), example_count: 4, metrics: {"accuracy": 0.75, "loss": 0.5} })
        t=1000 EvaluationReported
          ReadConditions
        t=1000 Conditions(as reported)
          Progress(Training)
          Train { from: [1.0, 2.0, 3.0], trains: None, deadline: 60000, encoding: Some(F32) }
        t=1000 Trained { loss: 0.25, examples: 10, delta: [0.5, 0.0, -1.0], encoded: Some(12) }
          Persist { pending: Some("run 1 round 0, 12 bytes"), error_feedback: None, local: [], last_evaluated: Some((1, 0)) }
        t=1000 Persisted
          Progress(Uploading)
          Upload { run: 1, round: 0, to: None, version: 0, examples: 10, metrics: {"loss": 0.25}, delta: 12 bytes }
        t=1000 Uploaded
          Persist { pending: None, error_feedback: None, local: [], last_evaluated: Some((1, 0)) }
        t=1000 Persisted
          Finish(Ok(Uploaded { run_id: RunId(1), round_idx: RoundIdx(0), train_loss: 0.25, evaluation: Some(Evaluation { loss: 0.5, accuracy: 0.75, examples: 4 }) }))"#]]);
    assert_eq!(state.pending_upload, None, "an acknowledged update is not kept");
    assert_eq!(state.last_evaluated, Some((RunId(1), crate::ModelVersion(0))));
}

#[test]
fn a_version_evaluated_before_is_not_evaluated_again() {
    let evaluated = Some((RunId(1), crate::ModelVersion(0)));
    let state = ParticipantState { last_evaluated: evaluated, ..enrolled() };
    let mut t = Trace::start(state);
    t.task(task()).conditions().model(&[1.0, 2.0, 3.0]).conditions();
    t.conditions().event(Event::TrainingAbandoned);
    t.finish(expect![[r#"
        t=1000 start (pending upload: None)
          Progress(CheckingIn)
          CheckIn
        t=1000 CheckedIn(Task { run: 1, round: 0, version: 0, secure: false, compression: F32, local: [] })
          ReadConditions
        t=1000 Conditions(as reported)
          Progress(Downloading)
          FetchModel(m0)
        t=1000 ModelReady([1.0, 2.0, 3.0])
          ReadConditions
        t=1000 Conditions(as reported)
          Progress(Evaluating)
          ReadConditions
        t=1000 Conditions(as reported)
          Progress(Training)
          Train { from: [1.0, 2.0, 3.0], trains: None, deadline: 60000, encoding: Some(F32) }
        t=1000 TrainingAbandoned
          Finish(Ok(RoundMissed { run_id: RunId(1), round_idx: RoundIdx(0) }))"#]]);
}

#[test]
fn a_top_k_upload_keeps_its_residual_only_once_acknowledged() {
    let mut t = Trace::start(enrolled());
    t.task(TaskAssignment { compression: Compression::TopK { fraction: 0.34 }, ..task() });
    t.conditions().model(&[0.0, 0.0, 0.0]).conditions().event(Event::Evaluated(None)).conditions();
    t.train(&[0.5, -2.0, 0.25])
        .event(Event::Persisted)
        .event(Event::Uploaded)
        .event(Event::Persisted);
    let state = t.finish(expect![[r#"
        t=1000 start (pending upload: None)
          Progress(CheckingIn)
          CheckIn
        t=1000 CheckedIn(Task { run: 1, round: 0, version: 0, secure: false, compression: TopK { fraction: 0.34 }, local: [] })
          ReadConditions
        t=1000 Conditions(as reported)
          Progress(Downloading)
          FetchModel(m0)
        t=1000 ModelReady([0.0, 0.0, 0.0])
          ReadConditions
        t=1000 Conditions(as reported)
          Progress(Evaluating)
          Evaluate { on: HeldOut, model: [0.0, 0.0, 0.0] }
        t=1000 Evaluated(None)
          ReadConditions
        t=1000 Conditions(as reported)
          Progress(Training)
          Train { from: [0.0, 0.0, 0.0], trains: None, deadline: 60000, encoding: Some(TopK { fraction: 0.34 }) }
        t=1000 Trained { loss: 0.25, examples: 10, delta: [0.5, -2.0, 0.25], encoded: Some(20) }
          Persist { pending: Some("run 1 round 0, 20 bytes"), error_feedback: None, local: [], last_evaluated: None }
        t=1000 Persisted
          Progress(Uploading)
          Upload { run: 1, round: 0, to: None, version: 0, examples: 10, metrics: {"loss": 0.25}, delta: 20 bytes }
        t=1000 Uploaded
          Persist { pending: None, error_feedback: Some((1, [0.0, 0.0, 0.25])), local: [], last_evaluated: None }
        t=1000 Persisted
          Finish(Ok(Uploaded { run_id: RunId(1), round_idx: RoundIdx(0), train_loss: 0.25, evaluation: None }))"#]]);
    let (_, feedback) = state.error_feedback.expect("the residual is kept");
    assert_eq!(feedback.residual, vec![0.0, 0.0, 0.25], "what top-k (two of three) did not send");
}

#[test]
fn a_dp_run_that_withholds_metrics_reports_no_evaluation_and_uploads_none() {
    let mut t = Trace::start(enrolled());
    t.task(TaskAssignment { withhold_metrics: true, ..task() }).conditions();
    t.model(&[1.0, 2.0, 3.0]).conditions().event(Event::Evaluated(Some(evaluation())));
    t.conditions().train(&[1.5, 2.0, 2.0]).event(Event::Persisted).event(Event::Uploaded);
    t.event(Event::Persisted);
    t.finish(expect![[r#"
        t=1000 start (pending upload: None)
          Progress(CheckingIn)
          CheckIn
        t=1000 CheckedIn(Task { run: 1, round: 0, version: 0, secure: false, compression: F32, local: [] })
          ReadConditions
        t=1000 Conditions(as reported)
          Progress(Downloading)
          FetchModel(m0)
        t=1000 ModelReady([1.0, 2.0, 3.0])
          ReadConditions
        t=1000 Conditions(as reported)
          Progress(Evaluating)
          Evaluate { on: HeldOut, model: [1.0, 2.0, 3.0] }
        t=1000 Evaluated(Some(Evaluation { loss: 0.5, accuracy: 0.75, examples: 4 }))
          ReadConditions
        t=1000 Conditions(as reported)
          Progress(Training)
          Train { from: [1.0, 2.0, 3.0], trains: None, deadline: 60000, encoding: Some(F32) }
        t=1000 Trained { loss: 0.25, examples: 10, delta: [0.5, 0.0, -1.0], encoded: Some(12) }
          Persist { pending: Some("run 1 round 0, 12 bytes"), error_feedback: None, local: [], last_evaluated: None }
        t=1000 Persisted
          Progress(Uploading)
          Upload { run: 1, round: 0, to: None, version: 0, examples: 10, metrics: {}, delta: 12 bytes }
        t=1000 Uploaded
          Persist { pending: None, error_feedback: None, local: [], last_evaluated: None }
        t=1000 Persisted
          Finish(Ok(Uploaded { run_id: RunId(1), round_idx: RoundIdx(0), train_loss: 0.25, evaluation: Some(Evaluation { loss: 0.5, accuracy: 0.75, examples: 4 }) }))"#]]);
}

#[test]
fn a_dp_run_that_noises_metrics_sends_the_evaluation_with_the_update() {
    let mut t = Trace::start(enrolled());
    t.task(TaskAssignment { evaluation_in_update: true, ..task() }).conditions();
    t.model(&[1.0, 2.0, 3.0]).conditions().event(Event::Evaluated(Some(evaluation())));
    t.conditions().train(&[1.5, 2.0, 2.0]).event(Event::Persisted).event(Event::Uploaded);
    t.event(Event::Persisted);
    t.finish(expect![[r#"
        t=1000 start (pending upload: None)
          Progress(CheckingIn)
          CheckIn
        t=1000 CheckedIn(Task { run: 1, round: 0, version: 0, secure: false, compression: F32, local: [] })
          ReadConditions
        t=1000 Conditions(as reported)
          Progress(Downloading)
          FetchModel(m0)
        t=1000 ModelReady([1.0, 2.0, 3.0])
          ReadConditions
        t=1000 Conditions(as reported)
          Progress(Evaluating)
          Evaluate { on: HeldOut, model: [1.0, 2.0, 3.0] }
        t=1000 Evaluated(Some(Evaluation { loss: 0.5, accuracy: 0.75, examples: 4 }))
          ReadConditions
        t=1000 Conditions(as reported)
          Progress(Training)
          Train { from: [1.0, 2.0, 3.0], trains: None, deadline: 60000, encoding: Some(F32) }
        t=1000 Trained { loss: 0.25, examples: 10, delta: [0.5, 0.0, -1.0], encoded: Some(12) }
          Persist { pending: Some("run 1 round 0, 12 bytes"), error_feedback: None, local: [], last_evaluated: None }
        t=1000 Persisted
          Progress(Uploading)
          Upload { run: 1, round: 0, to: None, version: 0, examples: 10, metrics: {"eval_accuracy": 0.75, "eval_loss": 0.5, "loss": 0.25}, delta: 12 bytes }
        t=1000 Uploaded
          Persist { pending: None, error_feedback: None, local: [], last_evaluated: None }
        t=1000 Persisted
          Finish(Ok(Uploaded { run_id: RunId(1), round_idx: RoundIdx(0), train_loss: 0.25, evaluation: Some(Evaluation { loss: 0.5, accuracy: 0.75, examples: 4 }) }))"#]]);
}

#[test]
fn a_personalized_run_trains_from_the_kept_head_and_uploads_only_the_body() {
    let personalized = TaskAssignment {
        update_schema: Some(TensorSchema { tensors: schema().tensors[..1].to_vec() }),
        local_tensors: vec!["head".into()],
        ..task()
    };
    let kept = LocalPart::of(RunId(1), &schema(), &[0.0, 0.0, 9.0], &["head".to_owned()]);
    let mut t = Trace::start(ParticipantState { local_parts: vec![kept], ..enrolled() });
    t.task(personalized).conditions().model(&[1.0, 2.0, 3.0]).conditions();
    t.event(Event::Evaluated(None)).conditions().train(&[1.5, 2.0, 8.0]);
    t.event(Event::Persisted).event(Event::Uploaded).event(Event::Persisted);
    t.finish(expect![[r#"
        t=1000 start (pending upload: None)
          Progress(CheckingIn)
          CheckIn
        t=1000 CheckedIn(Task { run: 1, round: 0, version: 0, secure: false, compression: F32, local: ["head"] })
          ReadConditions
        t=1000 Conditions(as reported)
          Progress(Downloading)
          FetchModel(m0)
        t=1000 ModelReady([1.0, 2.0, 3.0])
          ReadConditions
        t=1000 Conditions(as reported)
          Progress(Evaluating)
          Evaluate { on: HeldOut, model: [1.0, 2.0, 9.0] }
        t=1000 Evaluated(None)
          ReadConditions
        t=1000 Conditions(as reported)
          Progress(Training)
          Train { from: [1.0, 2.0, 9.0], trains: Some([true, true]), deadline: 60000, encoding: Some(F32) }
        t=1000 Trained { loss: 0.25, examples: 10, delta: [0.5, 0.0], encoded: Some(8) }
          Persist { pending: Some("run 1 round 0, 8 bytes"), error_feedback: None, local: [(1, [[8.0]])], last_evaluated: None }
        t=1000 Persisted
          Progress(Uploading)
          Upload { run: 1, round: 0, to: None, version: 0, examples: 10, metrics: {"loss": 0.25}, delta: 8 bytes }
        t=1000 Uploaded
          Persist { pending: None, error_feedback: None, local: [(1, [[8.0]])], last_evaluated: None }
        t=1000 Persisted
          Finish(Ok(Uploaded { run_id: RunId(1), round_idx: RoundIdx(0), train_loss: 0.25, evaluation: None }))"#]]);
}

#[test]
fn a_device_unplugged_while_the_model_downloads_leaves_before_evaluating() {
    let charging = crate::eligibility::Eligibility { charging: true, ..Default::default() };
    let mut t = Trace::start(enrolled());
    t.task(TaskAssignment { eligibility: charging, ..task() });
    t.event(Event::Conditions(DeviceAttributes { charging: Some(true), ..Default::default() }));
    t.model(&[1.0, 2.0, 3.0]);
    t.event(Event::Conditions(DeviceAttributes { charging: Some(false), ..Default::default() }));
    t.finish(expect![[r#"
        t=1000 start (pending upload: None)
          Progress(CheckingIn)
          CheckIn
        t=1000 CheckedIn(Task { run: 1, round: 0, version: 0, secure: false, compression: F32, local: [] })
          ReadConditions
        t=1000 Conditions(charging: Some(true))
          Progress(Downloading)
          FetchModel(m0)
        t=1000 ModelReady([1.0, 2.0, 3.0])
          ReadConditions
        t=1000 Conditions(charging: Some(false))
          Finish(Ok(ConditionsNotMet { run_id: RunId(1), round_idx: RoundIdx(0), unmet: ["charging"] }))"#]]);
}

#[test]
fn an_evaluation_only_round_uploads_its_evaluation_and_trains_nothing() {
    let mut t = Trace::start(enrolled());
    t.task(TaskAssignment { evaluate_only: true, ..task() }).conditions();
    t.model(&[1.0, 2.0, 3.0]).conditions().event(Event::Evaluated(Some(evaluation())));
    t.event(Event::Uploaded);
    t.finish(expect![[r#"
        t=1000 start (pending upload: None)
          Progress(CheckingIn)
          CheckIn
        t=1000 CheckedIn(Task { run: 1, round: 0, version: 0, secure: false, compression: F32, local: [] })
          ReadConditions
        t=1000 Conditions(as reported)
          Progress(Downloading)
          FetchModel(m0)
        t=1000 ModelReady([1.0, 2.0, 3.0])
          ReadConditions
        t=1000 Conditions(as reported)
          Progress(Evaluating)
          Evaluate { on: HeldOutOrTraining, model: [1.0, 2.0, 3.0] }
        t=1000 Evaluated(Some(Evaluation { loss: 0.5, accuracy: 0.75, examples: 4 }))
          Upload { run: 1, round: 0, to: None, version: 0, examples: 4, metrics: {"accuracy": 0.75, "loss": 0.5}, delta: 0 bytes }
        t=1000 Uploaded
          Finish(Ok(Evaluated { run_id: RunId(1), round_idx: RoundIdx(0), evaluation: Evaluation { loss: 0.5, accuracy: 0.75, examples: 4 } }))"#]]);
}

#[test]
fn a_round_past_its_deadline_before_training_is_given_up() {
    let mut t = Trace::start(enrolled());
    t.task(task()).conditions().model(&[1.0, 2.0, 3.0]).conditions();
    t.event(Event::Evaluated(None)).at(70_001).conditions();
    t.finish(expect![[r#"
        t=1000 start (pending upload: None)
          Progress(CheckingIn)
          CheckIn
        t=1000 CheckedIn(Task { run: 1, round: 0, version: 0, secure: false, compression: F32, local: [] })
          ReadConditions
        t=1000 Conditions(as reported)
          Progress(Downloading)
          FetchModel(m0)
        t=1000 ModelReady([1.0, 2.0, 3.0])
          ReadConditions
        t=1000 Conditions(as reported)
          Progress(Evaluating)
          Evaluate { on: HeldOut, model: [1.0, 2.0, 3.0] }
        t=1000 Evaluated(None)
          ReadConditions
        t=70001 Conditions(as reported)
          Progress(Training)
          Finish(Ok(RoundMissed { run_id: RunId(1), round_idx: RoundIdx(0) }))"#]]);
}

#[test]
fn a_model_given_up_by_a_later_checkpoint_is_a_missed_round() {
    let mut t = Trace::start(enrolled());
    t.task(task()).conditions().event(refused(ErrorCode::ModelNotKept, false));
    t.finish(expect![[r#"
        t=1000 start (pending upload: None)
          Progress(CheckingIn)
          CheckIn
        t=1000 CheckedIn(Task { run: 1, round: 0, version: 0, secure: false, compression: F32, local: [] })
          ReadConditions
        t=1000 Conditions(as reported)
          Progress(Downloading)
          FetchModel(m0)
        t=1000 Failed(Refusal { code: Some(ModelNotKept), transient: false })
          Finish(Ok(RoundMissed { run_id: RunId(1), round_idx: RoundIdx(0) }))"#]]);
}

#[test]
fn nothing_happens_before_enrolment_and_nothing_is_lost() {
    let mut t = Trace::start(ParticipantState::default());
    let state = t.finish(expect![[r#"
        t=1000 start (pending upload: None)
          Finish(Err(NotEnrolled))"#]]);
    assert_eq!(state, ParticipantState::default());
}

#[test]
fn come_back_later_ends_the_participation() {
    let mut t = Trace::start(enrolled());
    t.event(Event::CheckedIn(Box::new(CheckInResponse::ComeBackLater { retry_after_secs: 30 })));
    t.finish(expect![[r#"
        t=1000 start (pending upload: None)
          Progress(CheckingIn)
          CheckIn
        t=1000 CheckedIn(ComeBackLater { retry_after_secs: 30 })
          Finish(Ok(ComeBackLater(30s)))"#]]);
}
