//! Uploads that do not land at once: a transient failure keeps the update for the next
//! participation, which sends it before checking in; what can never land is dropped.

use super::*;

/// A participation trained up to its upload, which `failure` answers.
fn upload_answered(failure: Event, task: TaskAssignment) -> Trace {
    let mut t = Trace::start(enrolled());
    t.task(task).conditions().model(&[1.0, 2.0, 3.0]).conditions();
    t.event(Event::Evaluated(None)).conditions().train(&[1.5, 2.0, 2.0]);
    // From here on: the check-in, download and training read as in `plain.rs`.
    t.lines = vec!["(checked in, trained and wrote the update aside)".into()];
    t.event(Event::Persisted).event(failure);
    t
}

#[test]
fn an_update_refused_transiently_is_kept_and_sent_first_next_time() {
    let mut t = upload_answered(unreachable(), task());
    let state = t.finish(expect![[r#"
        (checked in, trained and wrote the update aside)
        t=1000 Persisted
          Progress(Uploading)
          Upload { run: 1, round: 0, to: None, version: 0, examples: 10, metrics: {"loss": 0.25}, delta: 12 bytes }
        t=1000 Failed(Refusal { code: None, transient: true })
          Finish(Err(StepFailed))"#]]);
    let pending = state.pending_upload.clone().expect("the update is kept");
    assert_eq!(pending.delta.len(), 12, "kept whole: three f32 values");
    assert_eq!(pending.metrics.get("loss"), Some(&0.25), "its metrics are kept with it");

    // The next participation: the same update, without checking in or training again.
    let mut t = Trace::start(state);
    t.event(Event::Uploaded).event(Event::Persisted);
    let state = t.finish(expect![[r#"
        t=1000 start (pending upload: Some((1, 0)))
          Progress(Uploading)
          Upload { run: 1, round: 0, to: None, version: 0, examples: 10, metrics: {"loss": 0.25}, delta: 12 bytes }
        t=1000 Uploaded
          Persist { pending: None, error_feedback: None, local: [], last_evaluated: None }
        t=1000 Persisted
          Finish(Ok(Uploaded { run_id: RunId(1), round_idx: RoundIdx(0), train_loss: 0.25, evaluation: None }))"#]]);
    assert_eq!(state.pending_upload, None);
}

#[test]
fn an_update_resent_after_its_first_attempt_landed_counts_as_delivered() {
    let mut t = upload_answered(refused(ErrorCode::DuplicateUpload, false), task());
    t.event(Event::Persisted);
    t.finish(expect![[r#"
        (checked in, trained and wrote the update aside)
        t=1000 Persisted
          Progress(Uploading)
          Upload { run: 1, round: 0, to: None, version: 0, examples: 10, metrics: {"loss": 0.25}, delta: 12 bytes }
        t=1000 Failed(Refusal { code: Some(DuplicateUpload), transient: false })
          Persist { pending: None, error_feedback: None, local: [], last_evaluated: None }
        t=1000 Persisted
          Finish(Ok(Uploaded { run_id: RunId(1), round_idx: RoundIdx(0), train_loss: 0.25, evaluation: None }))"#]]);
}

#[test]
fn an_update_for_a_closed_round_is_dropped_as_a_missed_round() {
    let mut t = upload_answered(refused(ErrorCode::RoundClosed, false), task());
    t.event(Event::Persisted);
    let state = t.finish(expect![[r#"
        (checked in, trained and wrote the update aside)
        t=1000 Persisted
          Progress(Uploading)
          Upload { run: 1, round: 0, to: None, version: 0, examples: 10, metrics: {"loss": 0.25}, delta: 12 bytes }
        t=1000 Failed(Refusal { code: Some(RoundClosed), transient: false })
          Persist { pending: None, error_feedback: None, local: [], last_evaluated: None }
        t=1000 Persisted
          Finish(Ok(RoundMissed { run_id: RunId(1), round_idx: RoundIdx(0) }))"#]]);
    assert_eq!(state.pending_upload, None);
}

#[test]
fn an_unreachable_aggregator_loses_the_round_not_the_device() {
    let target = UploadTarget {
        aggregator: crate::ids::AggregatorId(2),
        url: "http://aggregator".into(),
        ticket: "ticket".into(),
    };
    let mut t =
        upload_answered(unreachable(), TaskAssignment { upload_to: Some(target), ..task() });
    t.event(Event::Persisted);
    let state = t.finish(expect![[r#"
        (checked in, trained and wrote the update aside)
        t=1000 Persisted
          Progress(Uploading)
          Upload { run: 1, round: 0, to: Some("http://aggregator"), version: 0, examples: 10, metrics: {"loss": 0.25}, delta: 12 bytes }
        t=1000 Failed(Refusal { code: None, transient: true })
          Notice(AggregatorUnreachable)
          Persist { pending: None, error_feedback: None, local: [], last_evaluated: None }
        t=1000 Persisted
          Finish(Ok(RoundMissed { run_id: RunId(1), round_idx: RoundIdx(0) }))"#]]);
    assert_eq!(state.pending_upload, None, "no other aggregator takes the shard's update");
}

#[test]
fn an_update_refused_for_good_is_dropped_with_the_error() {
    let mut t = upload_answered(refused(ErrorCode::Unauthorized, false), task());
    t.event(Event::Persisted);
    let state = t.finish(expect![[r#"
        (checked in, trained and wrote the update aside)
        t=1000 Persisted
          Progress(Uploading)
          Upload { run: 1, round: 0, to: None, version: 0, examples: 10, metrics: {"loss": 0.25}, delta: 12 bytes }
        t=1000 Failed(Refusal { code: Some(Unauthorized), transient: false })
          Persist { pending: None, error_feedback: None, local: [], last_evaluated: None }
        t=1000 Persisted
          Finish(Err(StepFailed))"#]]);
    assert_eq!(state.pending_upload, None);
}
