//! Round state machine: snapshot traces of the actions for each scenario, plus a simulation
//! of many devices against a simulated clock.

use expect_test::{Expect, expect};

use std::sync::Arc;

use super::*;
use crate::compression::Compression;
use crate::fedavg::{Aggregate, AggregateError, ValidatedPartial, ValidatedUpdate, validate_parts};
use crate::tensor::{DType, TensorSchema, TensorSpec};
use crate::tier::PartialReport;

fn one_parameter() -> TensorSchema {
    TensorSchema {
        tensors: vec![TensorSpec { name: "w".into(), shape: vec![1], dtype: DType::F32 }],
    }
}

/// A one-parameter update weighing `examples`.
fn update(examples: u64) -> ValidatedUpdate {
    validate_parts(&one_parameter(), Compression::F32, vec![0; 4], examples, Default::default())
        .unwrap()
}

/// An aggregator's partial for one-parameter updates of `devices`, weighing 100 examples each
/// per the first aggregator's id (so traces tell partials apart).
fn partial(request: RequestId, aggregators: &[u32], devices: &[i64]) -> Input {
    let report = PartialReport {
        model_version: ModelVersion(0),
        schema_id: one_parameter().schema_id(),
        aggregators: aggregators.iter().copied().map(AggregatorId).collect(),
        devices: devices.iter().copied().map(DeviceId).collect(),
        total_weight: devices.len() as u64 * 100 * u64::from(aggregators[0]),
        sum_hi: vec![0; 8],
        sum_lo: vec![0; 8],
        metrics: Default::default(),
    };
    let sums: ValidatedPartial = report.validate(&one_parameter()).unwrap();
    Input::Partial {
        request,
        round_idx: RoundIdx(0),
        report: Arc::new(report),
        sums: Arc::new(sums),
    }
}

fn config() -> RoundConfig {
    RoundConfig {
        cohort_size: 2,
        target_selected: 3,
        min_quorum: 2,
        selection_timeout_ms: 1_000,
        reporting_timeout_ms: 5_000,
        total_rounds: 2,
        eligibility: Default::default(),
        secure: None,
        evaluation_only: false,
        each_update_direct: false,
        poisson_rate: None,
        min_population: None,
        selection: crate::plan::SelectionPolicy::FirstCome,
        asynchronous: None,
        max_failed_rounds: 0,
    }
}

/// Drives a machine and records every action as one line.
struct Trace {
    m: RunMachine,
    now: Millis,
    next_request: u64,
    lines: Vec<String>,
}

/// An input as a trace line: its `Debug`, but a check-in's device conditions only when it
/// reports any (most traces are about rounds, not eligibility).
fn describe(input: &Input) -> String {
    match input {
        Input::CheckIn { request, device, attributes, online }
            if *attributes == crate::eligibility::DeviceAttributes::default() =>
        {
            format!("CheckIn {{ request: {request:?}, device: {device:?}, online: {online} }}")
        }
        // Most rounds' refusals name no culprits: their lines stay as they were.
        Input::RoundClosed { round_idx, committed, refused_by } if refused_by.is_empty() => {
            format!("RoundClosed {{ round_idx: {round_idx:?}, committed: {committed} }}")
        }
        other => format!("{other:?}"),
    }
}

impl Trace {
    fn new() -> Self {
        Self::with(config())
    }

    fn with(config: RoundConfig) -> Self {
        let m = RunMachine::start(RunId(1), config, 0, [0; 32]);
        let mut t = Trace { m, now: 0, next_request: 0, lines: vec![] };
        t.drain();
        t
    }

    fn drain(&mut self) {
        while let Some(a) = self.m.poll_action() {
            self.lines.push(format!("  {a:?}"));
        }
    }

    fn input(&mut self, input: Input) -> RequestId {
        self.lines.push(format!("t={} {}", self.now, describe(&input)));
        self.m.handle(self.now, input);
        self.drain();
        RequestId(self.next_request)
    }

    fn req(&mut self) -> RequestId {
        self.next_request += 1;
        RequestId(self.next_request)
    }

    fn check_in(&mut self, device: i64) {
        let request = self.req();
        self.input(Input::CheckIn {
            request,
            device: DeviceId(device),
            attributes: Default::default(),
            online: 10,
        });
    }

    /// An upload weighing as many examples as the device's id, so traces show whose update a
    /// fold carries.
    fn upload(&mut self, device: i64, round: i64) -> RequestId {
        let request = self.req();
        let model_version = self.m.model_version();
        self.input(Input::Upload {
            request,
            device: DeviceId(device),
            round_idx: RoundIdx(round),
            model_version,
            update: update(device as u64),
        });
        request
    }

    /// An upload trained on `model_version` (a late device's in an asynchronous run, or a
    /// stale one).
    fn upload_trained_on(&mut self, device: i64, round: i64, model_version: i64) -> RequestId {
        let request = self.req();
        self.input(Input::Upload {
            request,
            device: DeviceId(device),
            round_idx: RoundIdx(round),
            model_version: ModelVersion(model_version),
            update: update(device as u64),
        });
        request
    }

    /// An evaluation-only run's upload: metrics and an example count, no delta.
    fn upload_evaluation(&mut self, device: i64, round: i64) -> RequestId {
        let request = self.req();
        let metrics = [("accuracy".to_owned(), 0.5)].into();
        self.input(Input::Upload {
            request,
            device: DeviceId(device),
            round_idx: RoundIdx(round),
            model_version: self.m.model_version(),
            update: validate_parts(
                &TensorSchema { tensors: vec![] },
                Compression::F32,
                vec![],
                7,
                metrics,
            )
            .unwrap(),
        });
        request
    }

    fn persisted(&mut self, request: RequestId, ok: bool) {
        self.input(Input::Persisted { request, ok });
    }

    fn closed(&mut self, round: i64, committed: bool) {
        self.input(Input::RoundClosed {
            round_idx: RoundIdx(round),
            committed,
            refused_by: vec![],
        });
    }

    fn advance_to(&mut self, now: Millis) {
        self.now = now;
        self.lines.push(format!("t={now} timeout (poll_timeout was {:?})", self.m.poll_timeout()));
        self.m.handle_timeout(now);
        self.drain();
    }

    fn check(self, expect: Expect) {
        expect.assert_eq(&(self.lines.join("\n") + "\n"));
    }
}

#[test]
fn round_commits_once_cohort_reports_and_late_upload_is_refused() {
    let mut t = Trace::new();
    t.check_in(10);
    t.check_in(11);
    t.check_in(12);
    t.check_in(13); // over the target: pace-steered
    let a = t.upload(10, 0);
    let b = t.upload(11, 0);
    t.persisted(b, true); // slot 1 persists first; both were folded in slot order already
    t.persisted(a, true);
    t.upload(12, 0); // cohort reached: round is committing
    t.closed(0, true);
    t.check(expect![[r#"
          OpenRound(RoundOpened { round_idx: RoundIdx(0), model_version: ModelVersion(0), opened_at: 0, selection_deadline: 1000, reporting_deadline: 5000 })
        t=0 CheckIn { request: RequestId(1), device: DeviceId(10), online: 10 }
          PersistSelection { round_idx: RoundIdx(0), device: DeviceId(10), aggregator: None }
          ReplyCheckIn { request: RequestId(1), decision: Selected { round_idx: RoundIdx(0), model_version: ModelVersion(0), report_deadline: 5000, secure: None, aggregator: None } }
        t=0 CheckIn { request: RequestId(2), device: DeviceId(11), online: 10 }
          PersistSelection { round_idx: RoundIdx(0), device: DeviceId(11), aggregator: None }
          ReplyCheckIn { request: RequestId(2), decision: Selected { round_idx: RoundIdx(0), model_version: ModelVersion(0), report_deadline: 5000, secure: None, aggregator: None } }
        t=0 CheckIn { request: RequestId(3), device: DeviceId(12), online: 10 }
          PersistSelection { round_idx: RoundIdx(0), device: DeviceId(12), aggregator: None }
          ReplyCheckIn { request: RequestId(3), decision: Selected { round_idx: RoundIdx(0), model_version: ModelVersion(0), report_deadline: 5000, secure: None, aggregator: None } }
        t=0 CheckIn { request: RequestId(4), device: DeviceId(13), online: 10 }
          ReplyCheckIn { request: RequestId(4), decision: ComeBackLater { after_ms: 1470 } }
        t=0 Upload { request: RequestId(5), device: DeviceId(10), round_idx: RoundIdx(0), model_version: ModelVersion(0), update: 10 examples, 4 bytes }
          PersistUpdate { request: RequestId(5), round_idx: RoundIdx(0), device: DeviceId(10), slot: 0, staleness: 0, update: 10 examples, 4 bytes }
          Fold(Update(10 examples, 4 bytes))
        t=0 Upload { request: RequestId(6), device: DeviceId(11), round_idx: RoundIdx(0), model_version: ModelVersion(0), update: 11 examples, 4 bytes }
          PersistUpdate { request: RequestId(6), round_idx: RoundIdx(0), device: DeviceId(11), slot: 1, staleness: 0, update: 11 examples, 4 bytes }
          Fold(Update(11 examples, 4 bytes))
        t=0 Persisted { request: RequestId(6), ok: true }
          ReplyUpload { request: RequestId(6), result: Ok(()) }
        t=0 Persisted { request: RequestId(5), ok: true }
          ReplyUpload { request: RequestId(5), result: Ok(()) }
          CloseRound { closing: RoundClosing { round_idx: RoundIdx(0), model_version: ModelVersion(0), outcome: Commit, n_selected: 3, n_reported: 2, n_dropped: 1, closed_at: 0 }, sum: Folded }
        t=0 Upload { request: RequestId(7), device: DeviceId(12), round_idx: RoundIdx(0), model_version: ModelVersion(0), update: 12 examples, 4 bytes }
          ReplyUpload { request: RequestId(7), result: Err(RoundClosed) }
        t=0 RoundClosed { round_idx: RoundIdx(0), committed: true }
          OpenRound(RoundOpened { round_idx: RoundIdx(1), model_version: ModelVersion(1), opened_at: 0, selection_deadline: 1000, reporting_deadline: 5000 })
    "#]]);
}

#[test]
fn bad_uploads_are_refused_without_state_change() {
    let mut t = Trace::new();
    t.check_in(10);
    t.upload(99, 0); // never selected
    t.upload(10, 7); // future round
    let a = t.upload(10, 0);
    t.upload(10, 0); // duplicate while persisting
    t.persisted(a, true);
    t.upload(10, 0); // duplicate after
    t.check_in(10); // already reported: paced, not handed the task again
    t.check_in(11);
    t.check_in(11); // repeated check-in before uploading: same task, nothing persisted again
    t.upload_trained_on(10, 0, 3);
    t.check(expect![[r#"
          OpenRound(RoundOpened { round_idx: RoundIdx(0), model_version: ModelVersion(0), opened_at: 0, selection_deadline: 1000, reporting_deadline: 5000 })
        t=0 CheckIn { request: RequestId(1), device: DeviceId(10), online: 10 }
          PersistSelection { round_idx: RoundIdx(0), device: DeviceId(10), aggregator: None }
          ReplyCheckIn { request: RequestId(1), decision: Selected { round_idx: RoundIdx(0), model_version: ModelVersion(0), report_deadline: 5000, secure: None, aggregator: None } }
        t=0 Upload { request: RequestId(2), device: DeviceId(99), round_idx: RoundIdx(0), model_version: ModelVersion(0), update: 99 examples, 4 bytes }
          ReplyUpload { request: RequestId(2), result: Err(NotSelected) }
        t=0 Upload { request: RequestId(3), device: DeviceId(10), round_idx: RoundIdx(7), model_version: ModelVersion(0), update: 10 examples, 4 bytes }
          ReplyUpload { request: RequestId(3), result: Err(UnknownRound) }
        t=0 Upload { request: RequestId(4), device: DeviceId(10), round_idx: RoundIdx(0), model_version: ModelVersion(0), update: 10 examples, 4 bytes }
          PersistUpdate { request: RequestId(4), round_idx: RoundIdx(0), device: DeviceId(10), slot: 0, staleness: 0, update: 10 examples, 4 bytes }
          Fold(Update(10 examples, 4 bytes))
        t=0 Upload { request: RequestId(5), device: DeviceId(10), round_idx: RoundIdx(0), model_version: ModelVersion(0), update: 10 examples, 4 bytes }
          ReplyUpload { request: RequestId(5), result: Err(Duplicate) }
        t=0 Persisted { request: RequestId(4), ok: true }
          ReplyUpload { request: RequestId(4), result: Ok(()) }
        t=0 Upload { request: RequestId(6), device: DeviceId(10), round_idx: RoundIdx(0), model_version: ModelVersion(0), update: 10 examples, 4 bytes }
          ReplyUpload { request: RequestId(6), result: Err(Duplicate) }
        t=0 CheckIn { request: RequestId(7), device: DeviceId(10), online: 10 }
          ReplyCheckIn { request: RequestId(7), decision: ComeBackLater { after_ms: 1971 } }
        t=0 CheckIn { request: RequestId(8), device: DeviceId(11), online: 10 }
          PersistSelection { round_idx: RoundIdx(0), device: DeviceId(11), aggregator: None }
          ReplyCheckIn { request: RequestId(8), decision: Selected { round_idx: RoundIdx(0), model_version: ModelVersion(0), report_deadline: 5000, secure: None, aggregator: None } }
        t=0 CheckIn { request: RequestId(9), device: DeviceId(11), online: 10 }
          ReplyCheckIn { request: RequestId(9), decision: Selected { round_idx: RoundIdx(0), model_version: ModelVersion(0), report_deadline: 5000, secure: None, aggregator: None } }
        t=0 Upload { request: RequestId(10), device: DeviceId(10), round_idx: RoundIdx(0), model_version: ModelVersion(3), update: 10 examples, 4 bytes }
          ReplyUpload { request: RequestId(10), result: Err(Duplicate) }
    "#]]);
}

/// Uploads are folded as their writes begin; when one's write fails, its device is
/// told to retry and the round closes on a sum the driver rebuilds from the store
/// (`sum: Replayed`), which holds only what is durable.
#[test]
fn a_folded_update_whose_write_failed_makes_the_round_replay_its_sum() {
    let mut t = Trace::new();
    t.check_in(10);
    t.check_in(11);
    let a = t.upload(10, 0);
    let b = t.upload(11, 0);
    t.persisted(a, false);
    let c = t.upload(10, 0); // the device retries
    t.persisted(b, true);
    t.persisted(c, true);
    t.check(expect![[r#"
          OpenRound(RoundOpened { round_idx: RoundIdx(0), model_version: ModelVersion(0), opened_at: 0, selection_deadline: 1000, reporting_deadline: 5000 })
        t=0 CheckIn { request: RequestId(1), device: DeviceId(10), online: 10 }
          PersistSelection { round_idx: RoundIdx(0), device: DeviceId(10), aggregator: None }
          ReplyCheckIn { request: RequestId(1), decision: Selected { round_idx: RoundIdx(0), model_version: ModelVersion(0), report_deadline: 5000, secure: None, aggregator: None } }
        t=0 CheckIn { request: RequestId(2), device: DeviceId(11), online: 10 }
          PersistSelection { round_idx: RoundIdx(0), device: DeviceId(11), aggregator: None }
          ReplyCheckIn { request: RequestId(2), decision: Selected { round_idx: RoundIdx(0), model_version: ModelVersion(0), report_deadline: 5000, secure: None, aggregator: None } }
        t=0 Upload { request: RequestId(3), device: DeviceId(10), round_idx: RoundIdx(0), model_version: ModelVersion(0), update: 10 examples, 4 bytes }
          PersistUpdate { request: RequestId(3), round_idx: RoundIdx(0), device: DeviceId(10), slot: 0, staleness: 0, update: 10 examples, 4 bytes }
          Fold(Update(10 examples, 4 bytes))
        t=0 Upload { request: RequestId(4), device: DeviceId(11), round_idx: RoundIdx(0), model_version: ModelVersion(0), update: 11 examples, 4 bytes }
          PersistUpdate { request: RequestId(4), round_idx: RoundIdx(0), device: DeviceId(11), slot: 1, staleness: 0, update: 11 examples, 4 bytes }
          Fold(Update(11 examples, 4 bytes))
        t=0 Persisted { request: RequestId(3), ok: false }
          ReplyUpload { request: RequestId(3), result: Err(Unavailable) }
        t=0 Upload { request: RequestId(5), device: DeviceId(10), round_idx: RoundIdx(0), model_version: ModelVersion(0), update: 10 examples, 4 bytes }
          PersistUpdate { request: RequestId(5), round_idx: RoundIdx(0), device: DeviceId(10), slot: 2, staleness: 0, update: 10 examples, 4 bytes }
          Fold(Update(10 examples, 4 bytes))
        t=0 Persisted { request: RequestId(4), ok: true }
          ReplyUpload { request: RequestId(4), result: Ok(()) }
        t=0 Persisted { request: RequestId(5), ok: true }
          ReplyUpload { request: RequestId(5), result: Ok(()) }
          CloseRound { closing: RoundClosing { round_idx: RoundIdx(0), model_version: ModelVersion(0), outcome: Commit, n_selected: 2, n_reported: 2, n_dropped: 0, closed_at: 0 }, sum: Replayed }
    "#]]);
}

#[test]
fn failed_persist_is_not_acknowledged_and_device_may_retry() {
    let mut t = Trace::new();
    t.check_in(10);
    let a = t.upload(10, 0);
    t.persisted(a, false);
    let b = t.upload(10, 0);
    t.persisted(b, true);
    t.check(expect![[r#"
          OpenRound(RoundOpened { round_idx: RoundIdx(0), model_version: ModelVersion(0), opened_at: 0, selection_deadline: 1000, reporting_deadline: 5000 })
        t=0 CheckIn { request: RequestId(1), device: DeviceId(10), online: 10 }
          PersistSelection { round_idx: RoundIdx(0), device: DeviceId(10), aggregator: None }
          ReplyCheckIn { request: RequestId(1), decision: Selected { round_idx: RoundIdx(0), model_version: ModelVersion(0), report_deadline: 5000, secure: None, aggregator: None } }
        t=0 Upload { request: RequestId(2), device: DeviceId(10), round_idx: RoundIdx(0), model_version: ModelVersion(0), update: 10 examples, 4 bytes }
          PersistUpdate { request: RequestId(2), round_idx: RoundIdx(0), device: DeviceId(10), slot: 0, staleness: 0, update: 10 examples, 4 bytes }
          Fold(Update(10 examples, 4 bytes))
        t=0 Persisted { request: RequestId(2), ok: false }
          ReplyUpload { request: RequestId(2), result: Err(Unavailable) }
        t=0 Upload { request: RequestId(3), device: DeviceId(10), round_idx: RoundIdx(0), model_version: ModelVersion(0), update: 10 examples, 4 bytes }
          PersistUpdate { request: RequestId(3), round_idx: RoundIdx(0), device: DeviceId(10), slot: 1, staleness: 0, update: 10 examples, 4 bytes }
          Fold(Update(10 examples, 4 bytes))
        t=0 Persisted { request: RequestId(3), ok: true }
          ReplyUpload { request: RequestId(3), result: Ok(()) }
    "#]]);
}

#[test]
fn too_few_selected_fails_at_selection_deadline_then_retries() {
    let mut t = Trace::new();
    t.check_in(10);
    t.advance_to(1_000);
    t.closed(0, false);
    t.check(expect![[r#"
          OpenRound(RoundOpened { round_idx: RoundIdx(0), model_version: ModelVersion(0), opened_at: 0, selection_deadline: 1000, reporting_deadline: 5000 })
        t=0 CheckIn { request: RequestId(1), device: DeviceId(10), online: 10 }
          PersistSelection { round_idx: RoundIdx(0), device: DeviceId(10), aggregator: None }
          ReplyCheckIn { request: RequestId(1), decision: Selected { round_idx: RoundIdx(0), model_version: ModelVersion(0), report_deadline: 5000, secure: None, aggregator: None } }
        t=1000 timeout (poll_timeout was Some(1000))
          CloseRound { closing: RoundClosing { round_idx: RoundIdx(0), model_version: ModelVersion(0), outcome: TooFewSelected { selected: 1, quorum: 2 }, n_selected: 1, n_reported: 0, n_dropped: 1, closed_at: 1000 }, sum: Folded }
        t=1000 RoundClosed { round_idx: RoundIdx(0), committed: false }
          OpenRound(RoundOpened { round_idx: RoundIdx(1), model_version: ModelVersion(0), opened_at: 1000, selection_deadline: 2000, reporting_deadline: 6000 })
    "#]]);
}

#[test]
fn reporting_deadline_waits_for_in_flight_persist_then_fails_without_quorum() {
    let mut t = Trace::new();
    t.check_in(10);
    t.check_in(11);
    let a = t.upload(10, 0);
    t.advance_to(5_000);
    t.persisted(a, true);
    t.closed(0, false);
    t.check(expect![[r#"
          OpenRound(RoundOpened { round_idx: RoundIdx(0), model_version: ModelVersion(0), opened_at: 0, selection_deadline: 1000, reporting_deadline: 5000 })
        t=0 CheckIn { request: RequestId(1), device: DeviceId(10), online: 10 }
          PersistSelection { round_idx: RoundIdx(0), device: DeviceId(10), aggregator: None }
          ReplyCheckIn { request: RequestId(1), decision: Selected { round_idx: RoundIdx(0), model_version: ModelVersion(0), report_deadline: 5000, secure: None, aggregator: None } }
        t=0 CheckIn { request: RequestId(2), device: DeviceId(11), online: 10 }
          PersistSelection { round_idx: RoundIdx(0), device: DeviceId(11), aggregator: None }
          ReplyCheckIn { request: RequestId(2), decision: Selected { round_idx: RoundIdx(0), model_version: ModelVersion(0), report_deadline: 5000, secure: None, aggregator: None } }
        t=0 Upload { request: RequestId(3), device: DeviceId(10), round_idx: RoundIdx(0), model_version: ModelVersion(0), update: 10 examples, 4 bytes }
          PersistUpdate { request: RequestId(3), round_idx: RoundIdx(0), device: DeviceId(10), slot: 0, staleness: 0, update: 10 examples, 4 bytes }
          Fold(Update(10 examples, 4 bytes))
        t=5000 timeout (poll_timeout was Some(1000))
        t=5000 Persisted { request: RequestId(3), ok: true }
          ReplyUpload { request: RequestId(3), result: Ok(()) }
          CloseRound { closing: RoundClosing { round_idx: RoundIdx(0), model_version: ModelVersion(0), outcome: TooFewReports { reported: 1, quorum: 2 }, n_selected: 2, n_reported: 1, n_dropped: 1, closed_at: 5000 }, sum: Folded }
        t=5000 RoundClosed { round_idx: RoundIdx(0), committed: false }
          OpenRound(RoundOpened { round_idx: RoundIdx(1), model_version: ModelVersion(0), opened_at: 5000, selection_deadline: 6000, reporting_deadline: 10000 })
    "#]]);
}

#[test]
fn stop_refuses_in_flight_and_stop_during_commit_waits() {
    let mut t = Trace::new();
    t.check_in(10);
    t.upload(10, 0);
    t.input(Input::Stop { reason: None });
    t.check(expect![[r#"
          OpenRound(RoundOpened { round_idx: RoundIdx(0), model_version: ModelVersion(0), opened_at: 0, selection_deadline: 1000, reporting_deadline: 5000 })
        t=0 CheckIn { request: RequestId(1), device: DeviceId(10), online: 10 }
          PersistSelection { round_idx: RoundIdx(0), device: DeviceId(10), aggregator: None }
          ReplyCheckIn { request: RequestId(1), decision: Selected { round_idx: RoundIdx(0), model_version: ModelVersion(0), report_deadline: 5000, secure: None, aggregator: None } }
        t=0 Upload { request: RequestId(2), device: DeviceId(10), round_idx: RoundIdx(0), model_version: ModelVersion(0), update: 10 examples, 4 bytes }
          PersistUpdate { request: RequestId(2), round_idx: RoundIdx(0), device: DeviceId(10), slot: 0, staleness: 0, update: 10 examples, 4 bytes }
          Fold(Update(10 examples, 4 bytes))
        t=0 Stop { reason: None }
          ReplyUpload { request: RequestId(2), result: Err(RoundClosed) }
          StopRun { open_round: Some(RoundIdx(0)), reason: None }
    "#]]);

    let mut t = Trace::new();
    for d in [10, 11] {
        t.check_in(d);
        let r = t.upload(d, 0);
        t.persisted(r, true);
    }
    t.lines.clear();
    t.input(Input::Stop { reason: None });
    t.closed(0, true);
    assert_eq!(t.m.status(), RunStatus::Stopped);
    assert_eq!(t.m.model_version(), ModelVersion(1), "the committing round still commits");
    t.check(expect![[r#"
        t=0 Stop { reason: None }
        t=0 RoundClosed { round_idx: RoundIdx(0), committed: true }
          StopRun { open_round: None, reason: None }
    "#]]);
}

#[test]
fn restore_resumes_open_round_and_continues_slots() {
    let snapshot = RunSnapshot {
        run_id: RunId(1),
        config: config(),
        model_version: ModelVersion(0),
        rounds_committed: 0,
        next_round_idx: RoundIdx(1),
        carried: vec![],
        strikes: Default::default(),
        open_round: Some(OpenRoundSnapshot {
            round: RoundOpened {
                round_idx: RoundIdx(0),
                model_version: ModelVersion(0),
                opened_at: 0,
                selection_deadline: 1_000,
                reporting_deadline: 5_000,
            },
            selected: vec![DeviceId(10), DeviceId(11), DeviceId(12)],
            reported: vec![(DeviceId(10), 0)],
            secure_records: vec![],
            assignments: vec![],
            partials: vec![],
        }),
    };
    let mut m = RunMachine::restore(snapshot, 2_000, [0; 32]);
    assert_eq!(m.poll_action(), None, "restoring persists nothing");
    m.handle(
        2_000,
        Input::Upload {
            request: RequestId(1),
            device: DeviceId(10),
            round_idx: RoundIdx(0),
            model_version: ModelVersion(0),
            update: update(10),
        },
    );
    assert_eq!(
        m.poll_action(),
        Some(Action::ReplyUpload {
            request: RequestId(1),
            result: Err(UploadRejection::Duplicate)
        })
    );
    m.handle(
        2_000,
        Input::Upload {
            request: RequestId(2),
            device: DeviceId(11),
            round_idx: RoundIdx(0),
            model_version: ModelVersion(0),
            update: update(10),
        },
    );
    assert!(matches!(
        m.poll_action(),
        Some(Action::PersistUpdate {
            request: RequestId(2),
            round_idx: RoundIdx(0),
            device: DeviceId(11),
            slot: 1,
            ..
        })
    ));
}

/// Many devices, random-ish latencies and dropouts, a simulated clock: every round ends, and the
/// run commits exactly `total_rounds` rounds.
/// Check-ins of `devices` (each with `attributes`) at `now`, with `online` devices heard from
/// lately: the come-back times of those not selected, and who was selected.
fn check_ins(
    m: &mut RunMachine,
    now: Millis,
    devices: std::ops::Range<i64>,
    attributes: &crate::eligibility::DeviceAttributes,
    online: u32,
) -> (Vec<i64>, Vec<i64>) {
    let (mut waits, mut selected) = (vec![], vec![]);
    for d in devices {
        let input = Input::CheckIn {
            request: RequestId(d as u64),
            device: DeviceId(d),
            attributes: attributes.clone(),
            online,
        };
        m.handle(now, input);
        while let Some(a) = m.poll_action() {
            if let Action::ReplyCheckIn { decision, .. } = a {
                match decision {
                    CheckInDecision::ComeBackLater { after_ms } => waits.push(after_ms),
                    CheckInDecision::Selected { .. } => selected.push(d),
                }
            }
        }
    }
    (waits, selected)
}

/// Pace steering spreads the devices that were not selected: no two of a burst come back
/// together, none earlier than the round could use them, and a larger population is spread
/// over a longer window (about twice the selection target per selection window).
#[test]
fn pace_steering_spreads_returns_by_population_with_jitter() {
    let spread_of = |online: u32| {
        let mut m = RunMachine::start(RunId(1), config(), 0, [0; 32]);
        let (waits, selected) = check_ins(&mut m, 10, 0..200, &Default::default(), online);
        assert_eq!(selected.len(), 3, "the target is selected first");
        let distinct: std::collections::BTreeSet<_> = waits.iter().collect();
        assert!(distinct.len() > 150, "{} distinct waits of {}", distinct.len(), waits.len());
        // Selection is over: the earliest use is the selection window (1 s) away.
        assert!(waits.iter().all(|w| (1_000..=60_000).contains(w)), "{waits:?}");
        let (min, max) = (waits.iter().min().unwrap(), waits.iter().max().unwrap());
        max - min
    };
    // 200 online, target 3, 1 s windows: spread 200 × 1 s / 6 ≈ 33 s; 2,000: capped at 60 s.
    let small = spread_of(20);
    let medium = spread_of(200);
    let large = spread_of(2_000);
    assert!(small < 4_000, "20 devices come back within a few seconds: {small}");
    assert!((25_000..34_000).contains(&medium), "{medium}");
    assert!(large > medium && large <= 60_000, "{large}");
    // A DP run's sampling needs every device each round: 2,000 online still come back within
    // the next window, not over a minute.
    let poisson = RoundConfig {
        target_selected: 1_000,
        selection: crate::plan::SelectionPolicy::Poisson,
        poisson_rate: Some(0.3),
        ..config()
    };
    let mut m = RunMachine::start(RunId(1), poisson, 0, [0; 32]);
    let (waits, selected) = check_ins(&mut m, 10, 0..2_000, &Default::default(), 2_000);
    assert!((450..=750).contains(&selected.len()), "{} of 2 000 drawn at 0.3", selected.len());
    assert!(waits.iter().all(|w| (1_000..=2_000).contains(w)), "{waits:?}");
}

/// Poisson selection has no cap outside secure aggregation: every device that wins its draw
/// in the window is in, however many that is, since a cap would let one device's presence push
/// another out (a replacement its add/remove accountant does not cover). A secure round's
/// protocol size caps it.
#[test]
fn a_plain_poisson_round_takes_every_device_that_wins_its_draw() {
    let poisson = RoundConfig {
        cohort_size: 50,
        target_selected: 50,
        min_quorum: 1,
        selection: crate::plan::SelectionPolicy::Poisson,
        poisson_rate: Some(0.3),
        ..config()
    };
    let mut m = RunMachine::start(RunId(1), poisson.clone(), 0, [0; 32]);
    let (_, selected) = check_ins(&mut m, 10, 0..1_000, &Default::default(), 1_000);
    assert!(
        selected.len() > 200,
        "{} of 1 000 drawn at 0.3, beyond the target of 50",
        selected.len()
    );
    assert!(m.is_selecting(20), "the window is still open");
    let capped = RoundConfig { secure: secure_rounds::secure_config().secure, ..poisson };
    let mut m = RunMachine::start(RunId(1), capped, 0, [0; 32]);
    let (_, selected) = check_ins(&mut m, 10, 0..1_000, &Default::default(), 1_000);
    assert_eq!(selected.len(), 50, "a secure round's protocol size caps the draw");
}

/// A plan's eligibility: a device that does not report what the plan requires is told to come
/// back later, even while the round selects; one that does is selected.
#[test]
fn devices_that_do_not_qualify_come_back_later() {
    use crate::eligibility::{DeviceAttributes, Eligibility};
    let mut cfg = config();
    cfg.eligibility =
        Eligibility { charging: true, min_app_version: Some("2.1".into()), ..Default::default() };
    let mut m = RunMachine::start(RunId(1), cfg, 0, [0; 32]);
    let on_battery = DeviceAttributes {
        charging: Some(false),
        app_version: Some("3.0".into()),
        ..Default::default()
    };
    let old_app = DeviceAttributes {
        charging: Some(true),
        app_version: Some("2.0.9".into()),
        ..Default::default()
    };
    let qualified = DeviceAttributes {
        charging: Some(true),
        app_version: Some("2.1.0".into()),
        ..Default::default()
    };
    for refused in [DeviceAttributes::default(), on_battery, old_app] {
        let (waits, selected) = check_ins(&mut m, 10, 0..5, &refused, 10);
        assert!(selected.is_empty(), "{refused:?}");
        assert!(waits.iter().all(|w| *w >= 1_000), "{waits:?}");
        assert!(m.is_selecting(10), "nobody was selected");
    }
    let (_, selected) = check_ins(&mut m, 10, 0..5, &qualified, 10);
    assert_eq!(selected, vec![0, 1, 2]);
}

#[test]
fn simulation_never_hangs() {
    let config = RoundConfig {
        cohort_size: 20,
        target_selected: 26,
        min_quorum: 15,
        selection_timeout_ms: 2_000,
        reporting_timeout_ms: 10_000,
        total_rounds: 5,
        eligibility: Default::default(),
        evaluation_only: false,
        each_update_direct: false,
        poisson_rate: None,
        min_population: None,
        selection: crate::plan::SelectionPolicy::FirstCome,
        asynchronous: None,
        max_failed_rounds: 0,
        secure: None,
    };
    let mut m = RunMachine::start(RunId(1), config.clone(), 0, [0; 32]);
    let mut now = 0;
    let mut seed = 1u64;
    let mut rand = move || {
        seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        seed >> 33
    };
    let mut next_request = 0u64;
    let mut persisting: Vec<RequestId> = vec![];
    let mut closes = vec![];
    let mut steps = 0;
    while m.status() == RunStatus::Running {
        steps += 1;
        assert!(steps < 100_000, "simulation did not finish");
        // 40 devices check in at random; selected ones upload unless they drop (1 in 4).
        let device = DeviceId((rand() % 40) as i64);
        next_request += 1;
        m.handle(
            now,
            Input::CheckIn {
                request: RequestId(next_request),
                device,
                attributes: Default::default(),
                online: 40,
            },
        );
        let mut uploads = vec![];
        while let Some(a) = m.poll_action() {
            match a {
                Action::ReplyCheckIn {
                    decision: CheckInDecision::Selected { round_idx, model_version, .. },
                    ..
                } if rand() % 4 != 0 => uploads.push((round_idx, model_version)),
                Action::PersistUpdate { request, .. } => persisting.push(request),
                Action::CloseRound { closing: c, .. } => closes.push(c),
                _ => {}
            }
        }
        for (round_idx, model_version) in uploads {
            next_request += 1;
            m.handle(
                now,
                Input::Upload {
                    request: RequestId(next_request),
                    device,
                    round_idx,
                    model_version,
                    update: update(1),
                },
            );
        }
        if rand() % 3 == 0 {
            for request in persisting.drain(..) {
                m.handle(now, Input::Persisted { request, ok: rand() % 10 != 0 });
            }
        }
        while let Some(a) = m.poll_action() {
            match a {
                Action::PersistUpdate { request, .. } => persisting.push(request),
                Action::CloseRound { closing: c, .. } => closes.push(c),
                _ => {}
            }
        }
        for c in closes.drain(..) {
            assert!(c.n_reported + c.n_dropped == c.n_selected);
            if c.outcome == RoundOutcome::Commit {
                assert!(c.n_reported >= config.min_quorum);
            }
            m.handle(
                now,
                Input::RoundClosed {
                    round_idx: c.round_idx,
                    committed: c.outcome == RoundOutcome::Commit,
                    refused_by: vec![],
                },
            );
        }
        now += (rand() % 200) as i64;
        if m.poll_timeout().is_some_and(|t| t <= now) {
            m.handle_timeout(now);
        }
    }
    assert_eq!(m.status(), RunStatus::Finished);
    assert_eq!(m.rounds_committed(), 5);
    assert_eq!(m.model_version(), ModelVersion(5));
}

// ---------------------------------------------------------------------------------------------
// Secure rounds: the machine driven by real SecAgg+ clients.

mod secure_rounds {
    use std::collections::BTreeMap;

    use super::*;
    use crate::plan::SecureRoundConfig;
    use crate::secagg::{self, Client};
    use crate::wire::SecAggInstruction;

    const LEN: usize = 20;

    pub(super) fn secure_config() -> RoundConfig {
        RoundConfig {
            cohort_size: 10,
            target_selected: 10,
            min_quorum: 5,
            selection_timeout_ms: 1_000,
            reporting_timeout_ms: 5_000,
            total_rounds: 1,
            eligibility: Default::default(),
            evaluation_only: false,
            each_update_direct: false,
            poisson_rate: None,
            min_population: None,
            selection: crate::plan::SelectionPolicy::FirstCome,
            asynchronous: None,
            max_failed_rounds: 0,
            secure: Some(SecureRoundConfig {
                clip_norm: None,
                distributed: None,
                evaluation_loss_cap: None,
                clip: 1.0,
                max_examples: 100,
                // Each device loses at most 3 of its 8 neighbours below: 5 shares remain.
                k: 8,
                t: 5,
                // The layout before evaluations travelled in the vector: no evaluation entries.
                n_params: LEN,
                vector_len: LEN + 1,
                stage_timeout_ms: 1_000,
            }),
        }
    }

    /// Devices 1..=10 and their secrets; the records the machine asked to persist.
    /// What a poisoning device masks instead of its encoded update, given the fleet.
    pub(super) type Poison = fn(&Fleet, Vec<u32>) -> Vec<u32>;

    pub(super) struct Fleet {
        m: RunMachine,
        now: Millis,
        next_request: u64,
        clients: BTreeMap<i64, Client>,
        pub(super) task: Option<crate::wire::SecureAggregationTask>,
        records: Vec<Record>,
        replies: BTreeMap<RequestId, Action>,
        pub(super) aggregate: Option<Aggregate>,
        /// The unmasking the machine handed over, as it was handed over.
        sum: Option<secure::SecureSum>,
        closing: Option<RoundClosing>,
        /// A device that seals a share that does not open to its first neighbour.
        garble: Option<i64>,
        /// A device that masks ring elements of its own choosing instead of its encoded update
        /// (made from what the honest survivors encode).
        pub(super) poison: Option<(i64, Poison)>,
        /// Why the driver could not finish the handed-over sum, when it could not.
        pub(super) refused: Option<AggregateError>,
    }

    fn delta(device: i64) -> Vec<f32> {
        (0..LEN).map(|i| ((device * 7 + i as i64) % 11) as f32 / 40.0 - 0.12).collect()
    }

    fn examples(device: i64) -> u64 {
        10 + device as u64 * 3
    }

    impl Fleet {
        pub(super) fn new() -> Self {
            let m = RunMachine::start(RunId(7), secure_config(), 0, [9; 32]);
            let mut f = Fleet {
                m,
                now: 0,
                next_request: 0,
                clients: BTreeMap::new(),
                task: None,
                records: vec![],
                replies: BTreeMap::new(),
                aggregate: None,
                sum: None,
                closing: None,
                garble: None,
                poison: None,
                refused: None,
            };
            f.drain();
            f
        }

        fn drain(&mut self) {
            while let Some(a) = self.m.poll_action() {
                match a {
                    Action::PersistSecAgg { seq, record, .. } => {
                        assert_eq!(
                            seq as usize,
                            self.records.len(),
                            "records are numbered in order"
                        );
                        self.records.push(record);
                    }
                    Action::ReplyCheckIn { request, .. }
                    | Action::ReplySecAgg { request, .. }
                    | Action::ReplySecAggPoll { request, .. } => {
                        self.replies.insert(request, a);
                    }
                    Action::CloseRound { closing: c, sum } => {
                        if let RoundSum::Secure(sum) = sum {
                            // The coordinator reads a withdrawn device's vector from the records.
                            let withdrawn = self
                                .records
                                .iter()
                                .filter_map(|r| sum.withdrawn_input(r))
                                .collect();
                            match sum.finish(&withdrawn) {
                                Ok((aggregate, _)) => self.aggregate = Some(aggregate),
                                Err(e) => self.refused = Some(e),
                            }
                            self.sum = Some(*sum);
                        }
                        self.closing = Some(c);
                    }
                    _ => {}
                }
            }
        }

        fn input(&mut self, make: impl FnOnce(RequestId) -> Input) -> Action {
            self.next_request += 1;
            let request = RequestId(self.next_request);
            self.m.handle(self.now, make(request));
            self.drain();
            self.replies.remove(&request).expect("every request is answered")
        }

        fn advance(&mut self, to: Millis) {
            self.now = to;
            self.m.handle_timeout(to);
            self.drain();
        }

        fn join(&mut self, device: i64) {
            let Action::ReplyCheckIn { decision: CheckInDecision::Selected { secure, .. }, .. } =
                self.input(|request| Input::CheckIn {
                    request,
                    device: DeviceId(device),
                    attributes: Default::default(),
                    online: 10,
                })
            else {
                panic!("device {device} not selected");
            };
            let task = secure.expect("a secure run hands out a secure task");
            let mut randomness = [0u8; 96];
            for (i, part) in randomness.chunks_mut(32).enumerate() {
                use sha2::Digest;
                part.copy_from_slice(&sha2::Sha256::digest([device as u8, i as u8]));
            }
            let identity = secagg::DeviceIdentity::from_secret([device as u8; 32]);
            let (client, keys) =
                Client::new(task.index, task.config, identity, randomness).unwrap();
            self.clients.insert(device, client);
            self.task = Some(task);
            self.send(device, SecAggUpload::AdvertiseKeys(keys)).unwrap();
        }

        fn send(&mut self, device: i64, message: SecAggUpload) -> Result<(), SecAggRejection> {
            let Action::ReplySecAgg { result, .. } = self.input(|request| Input::SecAgg {
                request,
                device: DeviceId(device),
                round_idx: RoundIdx(0),
                message,
            }) else {
                panic!("wrong reply")
            };
            result
        }

        fn poll(&mut self, device: i64) -> SecAggInstruction {
            let Action::ReplySecAggPoll { result, .. } = self.input(|request| Input::SecAggPoll {
                request,
                device: DeviceId(device),
                round_idx: RoundIdx(0),
            }) else {
                panic!("wrong reply")
            };
            result.unwrap()
        }

        /// Each device's next step, whatever the stage asks.
        fn step(&mut self, device: i64) {
            let message = match self.poll(device) {
                SecAggInstruction::ShareKeys(n) => {
                    let mut sealed = self.clients.get_mut(&device).unwrap().share_keys(n).unwrap();
                    if self.garble == Some(device) {
                        sealed[0].ciphertext[0] ^= 0xff;
                    }
                    SecAggUpload::ShareKeys(sealed)
                }
                SecAggInstruction::MaskedInput(r) => {
                    let mut input = self.encoded(device);
                    if let Some((attacker, poison)) = self.poison
                        && attacker == device
                    {
                        input = poison(self, input);
                    }
                    let client = self.clients.get_mut(&device).unwrap();
                    let y = client.masked_input(r, &input).unwrap();
                    SecAggUpload::MaskedInput {
                        model_version: ModelVersion(0),
                        masked: y.iter().flat_map(|v| v.to_le_bytes()).collect(),
                        accusations: client.accusations(),
                    }
                }
                SecAggInstruction::SignSurvivors(r) => SecAggUpload::SignSurvivors(
                    self.clients.get_mut(&device).unwrap().sign_survivors(r).unwrap(),
                ),
                SecAggInstruction::Unmask(r) => {
                    SecAggUpload::Unmask(self.clients.get_mut(&device).unwrap().unmask(r).unwrap())
                }
                other => panic!("device {device}: unexpected {other:?}"),
            };
            self.send(device, message).unwrap();
        }

        /// What an honest `device` masks: its delta and weight, quantized.
        pub(super) fn encoded(&self, device: i64) -> Vec<u32> {
            let task = self.task.unwrap();
            secagg::encode_weighted(
                &task.quantizer(),
                &delta(device),
                examples(device),
                task.max_examples,
            )
        }

        fn restored(&self, now: Millis) -> RunMachine {
            let selected = (1..=10).map(DeviceId).collect();
            let snapshot = RunSnapshot {
                run_id: RunId(7),
                config: secure_config(),
                model_version: ModelVersion(0),
                rounds_committed: 0,
                next_round_idx: RoundIdx(1),
                carried: vec![],
                strikes: Default::default(),
                open_round: Some(OpenRoundSnapshot {
                    round: self.m.current_round().unwrap(),
                    selected,
                    reported: vec![],
                    secure_records: self.records.clone(),
                    assignments: vec![],
                    partials: vec![],
                }),
            };
            RunMachine::restore(snapshot, now, [1; 32])
        }
    }

    fn expected_mean(survivors: &[i64]) -> Vec<f64> {
        let total: f64 = survivors.iter().map(|&d| examples(d) as f64).sum();
        (0..LEN)
            .map(|i| {
                survivors.iter().map(|&d| examples(d) as f64 * f64::from(delta(d)[i])).sum::<f64>()
                    / total
            })
            .collect()
    }

    pub(super) fn run(restart_after_share: bool) -> (Aggregate, RoundClosing) {
        let mut f = run_fleet(restart_after_share);
        let closing = f.closing.expect("the round closed");
        (f.aggregate.take().unwrap_or_else(|| panic!("no aggregate: {closing:?}")), closing)
    }

    /// Ten devices; two drop while training, one before unmasking.
    fn run_fleet(restart_after_share: bool) -> Fleet {
        run_fleet_with(restart_after_share, Fleet::new())
    }

    pub(super) fn run_fleet_with(restart_after_share: bool, mut f: Fleet) -> Fleet {
        for d in 1..=10 {
            f.join(d);
        }
        // A plain upload is refused in a secure run, and a retried message is answered again.
        let keys = match &f.records[2] {
            Record::Message { message, .. } => message.clone(),
            other => panic!("{other:?}"),
        };
        assert_eq!(f.send(1, keys.clone()), Ok(()));
        // Selection reached its target and every device advertised: ShareKeys is open.
        for d in 1..=10 {
            f.step(d);
        }
        if restart_after_share {
            let records = f.records.len();
            f.m = f.restored(f.now);
            f.drain();
            assert_eq!(f.records.len(), records, "replay persists nothing new");
        }
        // Devices 9 and 10 drop out while training; the others mask.
        for d in 1..=8 {
            f.step(d);
        }
        assert!(matches!(f.poll(9), SecAggInstruction::MaskedInput(_)));
        assert!(matches!(f.poll(1), SecAggInstruction::Wait { .. }));
        f.advance(5_000);
        // Device 8 drops before the consistency check; the rest sign the survivor set.
        for d in 1..=7 {
            f.step(d);
        }
        assert!(matches!(f.poll(9), SecAggInstruction::Excluded { .. }));
        assert!(f.aggregate.is_none());
        // The signing deadline passes without 8; every signer unmasks.
        f.advance(6_000);
        for d in 1..=7 {
            f.step(d);
        }
        f.advance(7_000);
        f
    }

    /// The machine rebuilds the sum's secrets and stops there. The model-sized work
    /// of unmasking (n vectors added, a keystream expanded per mask, the mean decoded) is a
    /// `SecureSum` the driver finishes on a blocking thread, so no run waits for it; finishing
    /// it there gives the same bits as anywhere.
    #[test]
    fn the_machine_hands_unmasking_to_the_driver_to_finish_elsewhere() {
        let mut f = run_fleet(false);
        let sum = f.sum.take().expect("the machine handed over the unmasking");
        assert_eq!(sum.survivors(), 8);
        let none = BTreeMap::new();
        let here = sum.finish(&none).expect("the sum decodes");
        let elsewhere = std::thread::spawn(move || sum.finish(&BTreeMap::new()));
        let elsewhere = elsewhere.join().expect("no panic");
        assert_eq!(elsewhere, Ok(here));
    }

    #[test]
    fn secure_round_commits_the_survivors_weighted_mean() {
        let (aggregate, closing) = run(false);
        assert_eq!(closing.outcome, RoundOutcome::Commit);
        assert_eq!((closing.n_selected, closing.n_reported, closing.n_dropped), (10, 8, 2));
        // Device 8 sent its masked input before dropping: it is in the sum.
        let want = expected_mean(&[1, 2, 3, 4, 5, 6, 7, 8]);
        for (got, want) in aggregate.mean_delta.iter().zip(&want) {
            assert!((got - want).abs() < 1e-6, "{got} vs {want}");
        }
        assert_eq!(aggregate.n_updates, 8);
    }

    #[test]
    fn a_restart_between_stages_replays_to_the_same_result() {
        let (plain, _) = run(false);
        let (restarted, closing) = run(true);
        assert_eq!(closing.outcome, RoundOutcome::Commit);
        assert_eq!(plain.mean_delta, restarted.mean_delta);
    }

    /// A device that seals a share that does not open to a neighbour is left out
    /// by the machine too: the round commits the other nine's exact mean, counts nine
    /// reports, and tells the sender it is excluded.
    #[test]
    fn a_device_sealing_a_bad_share_is_left_out_of_the_commit() {
        let mut f = Fleet::new();
        f.garble = Some(3);
        for d in 1..=10 {
            f.join(d);
        }
        for _share_then_mask in 0..2 {
            for d in 1..=10 {
                f.step(d);
            }
        }
        // Consistency check: the sender is told why it is out; the others sign, then unmask.
        let told = f.poll(3);
        assert!(
            matches!(&told, SecAggInstruction::Excluded { reason } if reason.contains("could not open")),
            "{told:?}"
        );
        for _sign_then_unmask in 0..2 {
            for d in (1..=10).filter(|&d| d != 3) {
                f.step(d);
            }
        }
        f.advance(6_000);
        let closing = f.closing.expect("the round closed");
        assert_eq!(closing.outcome, RoundOutcome::Commit);
        assert_eq!((closing.n_reported, closing.n_dropped), (9, 1));
        let aggregate = f.aggregate.take().expect("a sum");
        let want = expected_mean(&[1, 2, 4, 5, 6, 7, 8, 9, 10]);
        for (got, want) in aggregate.mean_delta.iter().zip(&want) {
            assert!((got - want).abs() < 1e-6, "{got} vs {want}");
        }
    }

    #[test]
    fn too_few_masked_inputs_fail_the_round() {
        let mut f = Fleet::new();
        for d in 1..=10 {
            f.join(d);
        }
        for d in 1..=10 {
            f.step(d);
        }
        for d in 1..=4 {
            f.step(d);
        }
        f.advance(5_000);
        let closing = f.closing.expect("closed");
        assert_eq!(
            closing.outcome,
            RoundOutcome::SecureAggregationFailed {
                stage: secure::Stage::MaskedInput,
                survivors: 4
            }
        );
        assert!(f.aggregate.is_none());
        assert!(matches!(f.poll(1), SecAggInstruction::Excluded { .. }));
    }
}

fn tiered_trace() -> Trace {
    let config = RoundConfig { cohort_size: 6, target_selected: 6, min_quorum: 2, ..config() };
    let m = RunMachine::start(RunId(1), config, 0, [0; 32]);
    let mut t = Trace { m, now: 0, next_request: 0, lines: vec![] };
    t.drain();
    t.input(Input::Aggregators {
        live: vec![AggregatorId(2), AggregatorId(1)],
        tier: TierConfig { cohort_threshold: 4, report_grace_ms: 2_000 },
    });
    t
}

impl Trace {
    fn partial(&mut self, aggregators: &[u32], devices: &[i64]) -> RequestId {
        let request = self.req();
        self.input(partial(request, aggregators, devices));
        request
    }

    fn assigned_to(&self, aggregator: u32) -> Vec<i64> {
        self.m
            .shard(AggregatorId(aggregator))
            .map_or(vec![], |s| s.assigned.iter().map(|d| d.0).collect())
    }
}

#[test]
fn a_tiered_round_commits_the_partials_and_drops_a_silent_aggregator() {
    let mut t = tiered_trace();
    for d in 10..16 {
        t.check_in(d);
    }
    let (one, two) = (t.assigned_to(1), t.assigned_to(2));
    assert_eq!(one.len() + two.len(), 6);
    assert!(!one.is_empty() && !two.is_empty(), "rendezvous hashing split {one:?} / {two:?}");
    assert!(t.m.shard(AggregatorId(1)).unwrap().selection_over);
    // A device of the tier cannot upload to the coordinator.
    t.upload(one[0], 0);
    // A partial naming another aggregator's device, or an aggregator without devices: refused.
    t.partial(&[1], &[two[0]]);
    t.partial(&[3], &[one[0]]);
    let p = t.partial(&[1], &one);
    t.partial(&[1], &one); // in flight already: a duplicate
    t.persisted(p, true);
    assert!(t.m.shard(AggregatorId(1)).is_none(), "a reported shard is no longer work");
    // Aggregator 2 never reports: the deadline waits out the grace, then commits without it.
    t.advance_to(5_000);
    t.advance_to(7_000);
    t.closed(0, true);
    let text = t.lines.join("\n");
    assert!(text.contains("UseAggregator"), "{text}");
    assert_eq!(text.matches("NotAssigned").count(), 2, "{text}");
    assert!(text.contains("Duplicate"), "{text}");
    assert!(text.contains("poll_timeout was Some(7000)"), "{text}");
    let closing = format!(
        "CloseRound {{ closing: RoundClosing {{ round_idx: RoundIdx(0), model_version: ModelVersion(0), outcome: Commit, n_selected: 6, n_reported: {}, n_dropped: {}, closed_at: 7000 }}, sum: Folded }}",
        one.len(),
        two.len()
    );
    assert!(text.contains(&closing), "{text}");
}

#[test]
fn a_tiered_round_closes_as_soon_as_every_shard_reported() {
    let mut t = tiered_trace();
    for d in 10..16 {
        t.check_in(d);
    }
    let (one, two) = (t.assigned_to(1), t.assigned_to(2));
    let p1 = t.partial(&[1], &one);
    let p2 = t.partial(&[2], &two);
    t.persisted(p2, true);
    t.persisted(p1, true);
    let text = t.lines.join("\n");
    assert!(
        text.contains("outcome: Commit, n_selected: 6, n_reported: 6, n_dropped: 0, closed_at: 0"),
        "{text}"
    );
    // Folded in slot order as their writes began: aggregator 1's partial first, although 2's
    // was durable first.
    let fold = |aggregator: u64, n: usize| {
        let weight = n as u64 * 100 * aggregator;
        text.find(&format!("Fold(Partial({n} updates, weight {weight},")).unwrap()
    };
    assert!(fold(1, one.len()) < fold(2, two.len()), "{text}");
}

#[test]
fn a_restored_tiered_round_keeps_its_assignments_and_partials() {
    let mut t = tiered_trace();
    for d in 10..16 {
        t.check_in(d);
    }
    let (one, two) = (t.assigned_to(1), t.assigned_to(2));
    let assignments: Vec<(DeviceId, AggregatorId)> = one
        .iter()
        .map(|d| (DeviceId(*d), AggregatorId(1)))
        .chain(two.iter().map(|d| (DeviceId(*d), AggregatorId(2))))
        .collect();
    let snapshot = RunSnapshot {
        run_id: RunId(1),
        config: RoundConfig { cohort_size: 6, target_selected: 6, min_quorum: 2, ..config() },
        model_version: ModelVersion(0),
        rounds_committed: 0,
        next_round_idx: RoundIdx(1),
        carried: vec![],
        strikes: Default::default(),
        open_round: Some(OpenRoundSnapshot {
            round: t.m.current_round().unwrap(),
            selected: (10..16).map(DeviceId).collect(),
            reported: vec![],
            secure_records: vec![],
            assignments,
            partials: vec![StoredPartial {
                slot: 0,
                aggregators: vec![AggregatorId(1)],
                devices: one.iter().copied().map(DeviceId).collect(),
            }],
        }),
    };
    let mut m = RunMachine::restore(snapshot, 100, [0; 32]);
    assert!(m.shard(AggregatorId(1)).is_none());
    assert_eq!(m.shard(AggregatorId(2)).unwrap().assigned.len(), two.len());
    m.handle(100, partial(RequestId(1), &[2], &two));
    assert!(matches!(
        m.poll_action(),
        Some(Action::PersistPartial { request: RequestId(1), round_idx: RoundIdx(0), slot: 1, .. })
    ));
}

#[test]
fn small_and_secure_runs_stay_off_the_tier() {
    let mut t = Trace::new(); // target 3
    t.input(Input::Aggregators {
        live: vec![AggregatorId(1)],
        tier: TierConfig { cohort_threshold: 3, report_grace_ms: 0 },
    });
    t.check_in(10);
    assert!(t.lines.join("\n").contains("aggregator: None"));
    assert!(t.m.shard(AggregatorId(1)).is_none());
}

/// An evaluation-only run: devices report metrics with no delta; a round commits its quorum of
/// reports without moving the model version, counts towards the run's rounds, and the run
/// finishes on the same version it started with. The tier is never used, even for a cohort
/// above its threshold.
#[test]
fn evaluation_only_rounds_commit_reports_and_keep_the_model() {
    let mut t = Trace::with(RoundConfig { evaluation_only: true, ..config() });
    t.input(Input::Aggregators {
        live: vec![AggregatorId(1)],
        tier: TierConfig { cohort_threshold: 1, report_grace_ms: 0 },
    });
    for round in 0..2 {
        t.check_in(10);
        t.check_in(11);
        let a = t.upload_evaluation(10, round);
        t.persisted(a, true);
        let b = t.upload_evaluation(11, round);
        t.persisted(b, true);
        t.closed(round, true);
    }
    assert_eq!((t.m.model_version(), t.m.rounds_committed()), (ModelVersion(0), 2));
    assert_eq!(t.m.status(), RunStatus::Finished);
    t.check(expect![[r#"
          OpenRound(RoundOpened { round_idx: RoundIdx(0), model_version: ModelVersion(0), opened_at: 0, selection_deadline: 1000, reporting_deadline: 5000 })
        t=0 Aggregators { live: [AggregatorId(1)], tier: TierConfig { cohort_threshold: 1, report_grace_ms: 0 } }
        t=0 CheckIn { request: RequestId(1), device: DeviceId(10), online: 10 }
          PersistSelection { round_idx: RoundIdx(0), device: DeviceId(10), aggregator: None }
          ReplyCheckIn { request: RequestId(1), decision: Selected { round_idx: RoundIdx(0), model_version: ModelVersion(0), report_deadline: 5000, secure: None, aggregator: None } }
        t=0 CheckIn { request: RequestId(2), device: DeviceId(11), online: 10 }
          PersistSelection { round_idx: RoundIdx(0), device: DeviceId(11), aggregator: None }
          ReplyCheckIn { request: RequestId(2), decision: Selected { round_idx: RoundIdx(0), model_version: ModelVersion(0), report_deadline: 5000, secure: None, aggregator: None } }
        t=0 Upload { request: RequestId(3), device: DeviceId(10), round_idx: RoundIdx(0), model_version: ModelVersion(0), update: 7 examples, 0 bytes }
          PersistUpdate { request: RequestId(3), round_idx: RoundIdx(0), device: DeviceId(10), slot: 0, staleness: 0, update: 7 examples, 0 bytes }
          Fold(Update(7 examples, 0 bytes))
        t=0 Persisted { request: RequestId(3), ok: true }
          ReplyUpload { request: RequestId(3), result: Ok(()) }
        t=0 Upload { request: RequestId(4), device: DeviceId(11), round_idx: RoundIdx(0), model_version: ModelVersion(0), update: 7 examples, 0 bytes }
          PersistUpdate { request: RequestId(4), round_idx: RoundIdx(0), device: DeviceId(11), slot: 1, staleness: 0, update: 7 examples, 0 bytes }
          Fold(Update(7 examples, 0 bytes))
        t=0 Persisted { request: RequestId(4), ok: true }
          ReplyUpload { request: RequestId(4), result: Ok(()) }
          CloseRound { closing: RoundClosing { round_idx: RoundIdx(0), model_version: ModelVersion(0), outcome: Commit, n_selected: 2, n_reported: 2, n_dropped: 0, closed_at: 0 }, sum: Folded }
        t=0 RoundClosed { round_idx: RoundIdx(0), committed: true }
          OpenRound(RoundOpened { round_idx: RoundIdx(1), model_version: ModelVersion(0), opened_at: 0, selection_deadline: 1000, reporting_deadline: 5000 })
        t=0 CheckIn { request: RequestId(5), device: DeviceId(10), online: 10 }
          PersistSelection { round_idx: RoundIdx(1), device: DeviceId(10), aggregator: None }
          ReplyCheckIn { request: RequestId(5), decision: Selected { round_idx: RoundIdx(1), model_version: ModelVersion(0), report_deadline: 5000, secure: None, aggregator: None } }
        t=0 CheckIn { request: RequestId(6), device: DeviceId(11), online: 10 }
          PersistSelection { round_idx: RoundIdx(1), device: DeviceId(11), aggregator: None }
          ReplyCheckIn { request: RequestId(6), decision: Selected { round_idx: RoundIdx(1), model_version: ModelVersion(0), report_deadline: 5000, secure: None, aggregator: None } }
        t=0 Upload { request: RequestId(7), device: DeviceId(10), round_idx: RoundIdx(1), model_version: ModelVersion(0), update: 7 examples, 0 bytes }
          PersistUpdate { request: RequestId(7), round_idx: RoundIdx(1), device: DeviceId(10), slot: 0, staleness: 0, update: 7 examples, 0 bytes }
          Fold(Update(7 examples, 0 bytes))
        t=0 Persisted { request: RequestId(7), ok: true }
          ReplyUpload { request: RequestId(7), result: Ok(()) }
        t=0 Upload { request: RequestId(8), device: DeviceId(11), round_idx: RoundIdx(1), model_version: ModelVersion(0), update: 7 examples, 0 bytes }
          PersistUpdate { request: RequestId(8), round_idx: RoundIdx(1), device: DeviceId(11), slot: 1, staleness: 0, update: 7 examples, 0 bytes }
          Fold(Update(7 examples, 0 bytes))
        t=0 Persisted { request: RequestId(8), ok: true }
          ReplyUpload { request: RequestId(8), result: Ok(()) }
          CloseRound { closing: RoundClosing { round_idx: RoundIdx(1), model_version: ModelVersion(0), outcome: Commit, n_selected: 2, n_reported: 2, n_dropped: 0, closed_at: 0 }, sum: Folded }
        t=0 RoundClosed { round_idx: RoundIdx(1), committed: true }
          FinishRun
    "#]]);
}

/// A machine whose rounds select 3 devices under `policy`, past its first round's opening.
fn lottery_machine(entropy: [u8; 32], policy: crate::plan::SelectionPolicy) -> RunMachine {
    let config = RoundConfig { target_selected: 3, selection: policy, ..config() };
    let mut m = RunMachine::start(RunId(1), config, 0, entropy);
    while m.poll_action().is_some() {}
    m
}

/// Device `d` checks in at `at` with `online` devices around; whether it was selected.
fn lottery_check_in(m: &mut RunMachine, d: i64, at: Millis, online: u32) -> bool {
    let input = Input::CheckIn {
        request: RequestId(d as u64),
        device: DeviceId(d),
        attributes: Default::default(),
        online,
    };
    m.handle(at, input);
    let mut selected = false;
    while let Some(action) = m.poll_action() {
        selected |= matches!(
            action,
            Action::ReplyCheckIn { decision: CheckInDecision::Selected { .. }, .. }
        );
    }
    selected
}

/// The devices `1..=online` check in once each, in order, within the first half of the
/// selection window; returns those selected.
fn selected_by_lottery(
    entropy: [u8; 32],
    online: u32,
    policy: crate::plan::SelectionPolicy,
) -> Vec<i64> {
    let mut m = lottery_machine(entropy, policy);
    (1..=i64::from(online)).filter(|&d| lottery_check_in(&mut m, d, 10, online)).collect()
}

#[test]
fn random_selection_draws_a_uniform_cohort_whatever_the_arrival_order() {
    use crate::plan::SelectionPolicy;
    // First come: the first three to check in.
    assert_eq!(selected_by_lottery([0; 32], 10, SelectionPolicy::FirstCome), vec![1, 2, 3]);
    // Random: always exactly three of the ten (selection sampling fills its places), and each
    // device equally likely whatever its place in the arrival order: 3/10 of 4 000 draws is
    // 1 200 ± 4σ (σ ≈ 29).
    let mut counts = [0u32; 11];
    for trial in 0..4_000u32 {
        let mut entropy = [0u8; 32];
        entropy[..4].copy_from_slice(&trial.to_le_bytes());
        let cohort = selected_by_lottery(entropy, 10, SelectionPolicy::Random);
        assert_eq!(cohort.len(), 3, "trial {trial}: {cohort:?}");
        for d in cohort {
            counts[d as usize] += 1;
        }
    }
    for (d, &n) in counts.iter().enumerate().skip(1) {
        assert!((1_084..=1_316).contains(&n), "device {d} selected {n} times of 4 000");
    }
    // An overestimated population leaves places open in the first half of the window; late in
    // the window whoever checks in fills them.
    let mut m = lottery_machine([9; 32], SelectionPolicy::Random);
    let check_in = |m: &mut RunMachine, d: i64, at: Millis| lottery_check_in(m, d, at, 1_000_000);
    let early = (1..=3).filter(|&d| check_in(&mut m, d, 10)).count();
    assert!(early < 3, "three of a million drawn early");
    let late: Vec<bool> = (4..=6).map(|d| check_in(&mut m, d, 600)).collect();
    assert_eq!(late.iter().filter(|s| **s).count(), 3 - early);
}

/// Poisson selection draws each device once per round at the accountant's rate, whatever the
/// population and the arrival order, and never fills late: q is every device's chance, which
/// is what the DP accountant assumes.
#[test]
fn poisson_selection_draws_each_device_once_at_the_rate_with_no_fill() {
    use crate::plan::SelectionPolicy;
    let machine = |entropy: [u8; 32]| {
        let config = RoundConfig {
            target_selected: 1_000,
            selection: SelectionPolicy::Poisson,
            poisson_rate: Some(0.3),
            ..config()
        };
        let mut m = RunMachine::start(RunId(1), config, 0, entropy);
        while m.poll_action().is_some() {}
        m
    };
    // 1 000 devices check in early, then again late in the window: the second check-in of a
    // device that lost its draw never selects it, and nothing fills the cohort.
    let mut counts = [0u32; 21];
    for trial in 0..200u32 {
        let mut entropy = [0u8; 32];
        entropy[..4].copy_from_slice(&trial.to_le_bytes());
        let mut m = machine(entropy);
        let first: Vec<i64> =
            (1..=1_000).filter(|&d| lottery_check_in(&mut m, d, 10, 10)).collect();
        let again = (1..=1_000).filter(|d| !first.contains(d));
        let late: Vec<i64> = again.filter(|&d| lottery_check_in(&mut m, d, 900, 10)).collect();
        assert!(late.is_empty(), "trial {trial}: {} drawn again late", late.len());
        // 0.3 of 1 000 is 300 ± 4σ (σ ≈ 14.5).
        assert!((242..=358).contains(&first.len()), "trial {trial}: {} drawn", first.len());
        for d in first.into_iter().filter(|&d| d <= 20) {
            counts[d as usize] += 1;
        }
    }
    // Each of the first twenty devices: 0.3 of 200 rounds is 60 ± 4σ (σ ≈ 6.5).
    for (d, &n) in counts.iter().enumerate().skip(1) {
        assert!((34..=86).contains(&n), "device {d} drawn {n} times in 200 rounds");
    }
}

/// FedBuff. Three devices train at once; a buffer commits every two durable
/// updates; an update one version behind is folded discounted by (1 + 1)^-0.5, one two
/// versions behind (over `max_staleness`) is refused; a device whose task outlives its
/// buffer is told to retry while the buffer commits, then carried into the next.
#[test]
fn fedbuff_commits_every_k_updates_and_weighs_staleness() {
    let config = RoundConfig {
        cohort_size: 2,
        target_selected: 3,
        min_quorum: 1,
        total_rounds: 4,
        asynchronous: Some(crate::plan::AsynchronousPlan {
            concurrency: 3,
            max_staleness: 1,
            staleness_exponent: 0.5,
        }),
        ..config()
    };
    let mut t = Trace::with(config);
    // Buffer 0 (model 0): three train at once, a fourth waits.
    for d in [10, 11, 12, 15] {
        t.check_in(d);
    }
    let (a, b) = (t.upload(10, 0), t.upload(11, 0));
    t.persisted(a, true);
    t.persisted(b, true);
    t.upload(12, 0); // the buffer is committing: retry
    t.closed(0, true);
    // Buffer 1 (model 1): device 12 still trains on model 0; two places are free.
    for d in [13, 14, 15] {
        t.check_in(d);
    }
    let request = t.upload_trained_on(12, 0, 0);
    t.persisted(request, true);
    let c = t.upload(13, 1);
    t.persisted(c, true);
    t.closed(1, true);
    // Buffer 2 (model 2): device 14 (model 1) is one version behind, and then two.
    for d in [15, 16] {
        t.check_in(d);
    }
    let (d, e) = (t.upload(15, 2), t.upload(16, 2));
    t.persisted(d, true);
    t.persisted(e, true);
    t.closed(2, true);
    t.upload_trained_on(14, 1, 1);
    t.check(expect![[r#"
          OpenRound(RoundOpened { round_idx: RoundIdx(0), model_version: ModelVersion(0), opened_at: 0, selection_deadline: 5000, reporting_deadline: 5000 })
        t=0 CheckIn { request: RequestId(1), device: DeviceId(10), online: 10 }
          PersistSelection { round_idx: RoundIdx(0), device: DeviceId(10), aggregator: None }
          ReplyCheckIn { request: RequestId(1), decision: Selected { round_idx: RoundIdx(0), model_version: ModelVersion(0), report_deadline: 5000, secure: None, aggregator: None } }
        t=0 CheckIn { request: RequestId(2), device: DeviceId(11), online: 10 }
          PersistSelection { round_idx: RoundIdx(0), device: DeviceId(11), aggregator: None }
          ReplyCheckIn { request: RequestId(2), decision: Selected { round_idx: RoundIdx(0), model_version: ModelVersion(0), report_deadline: 5000, secure: None, aggregator: None } }
        t=0 CheckIn { request: RequestId(3), device: DeviceId(12), online: 10 }
          PersistSelection { round_idx: RoundIdx(0), device: DeviceId(12), aggregator: None }
          ReplyCheckIn { request: RequestId(3), decision: Selected { round_idx: RoundIdx(0), model_version: ModelVersion(0), report_deadline: 5000, secure: None, aggregator: None } }
        t=0 CheckIn { request: RequestId(4), device: DeviceId(15), online: 10 }
          ReplyCheckIn { request: RequestId(4), decision: ComeBackLater { after_ms: 1183 } }
        t=0 Upload { request: RequestId(5), device: DeviceId(10), round_idx: RoundIdx(0), model_version: ModelVersion(0), update: 10 examples, 4 bytes }
          PersistUpdate { request: RequestId(5), round_idx: RoundIdx(0), device: DeviceId(10), slot: 0, staleness: 0, update: 10 examples, 4 bytes }
          Fold(Update(10 examples, 4 bytes))
        t=0 Upload { request: RequestId(6), device: DeviceId(11), round_idx: RoundIdx(0), model_version: ModelVersion(0), update: 11 examples, 4 bytes }
          PersistUpdate { request: RequestId(6), round_idx: RoundIdx(0), device: DeviceId(11), slot: 1, staleness: 0, update: 11 examples, 4 bytes }
          Fold(Update(11 examples, 4 bytes))
        t=0 Persisted { request: RequestId(5), ok: true }
          ReplyUpload { request: RequestId(5), result: Ok(()) }
        t=0 Persisted { request: RequestId(6), ok: true }
          ReplyUpload { request: RequestId(6), result: Ok(()) }
          CloseRound { closing: RoundClosing { round_idx: RoundIdx(0), model_version: ModelVersion(0), outcome: Commit, n_selected: 3, n_reported: 2, n_dropped: 0, closed_at: 0 }, sum: Folded }
        t=0 Upload { request: RequestId(7), device: DeviceId(12), round_idx: RoundIdx(0), model_version: ModelVersion(0), update: 12 examples, 4 bytes }
          ReplyUpload { request: RequestId(7), result: Err(Unavailable) }
        t=0 RoundClosed { round_idx: RoundIdx(0), committed: true }
          OpenRound(RoundOpened { round_idx: RoundIdx(1), model_version: ModelVersion(1), opened_at: 0, selection_deadline: 5000, reporting_deadline: 5000 })
        t=0 CheckIn { request: RequestId(8), device: DeviceId(13), online: 10 }
          PersistSelection { round_idx: RoundIdx(1), device: DeviceId(13), aggregator: None }
          ReplyCheckIn { request: RequestId(8), decision: Selected { round_idx: RoundIdx(1), model_version: ModelVersion(1), report_deadline: 5000, secure: None, aggregator: None } }
        t=0 CheckIn { request: RequestId(9), device: DeviceId(14), online: 10 }
          PersistSelection { round_idx: RoundIdx(1), device: DeviceId(14), aggregator: None }
          ReplyCheckIn { request: RequestId(9), decision: Selected { round_idx: RoundIdx(1), model_version: ModelVersion(1), report_deadline: 5000, secure: None, aggregator: None } }
        t=0 CheckIn { request: RequestId(10), device: DeviceId(15), online: 10 }
          ReplyCheckIn { request: RequestId(10), decision: ComeBackLater { after_ms: 1183 } }
        t=0 Upload { request: RequestId(11), device: DeviceId(12), round_idx: RoundIdx(0), model_version: ModelVersion(0), update: 12 examples, 4 bytes }
          PersistUpdate { request: RequestId(11), round_idx: RoundIdx(1), device: DeviceId(12), slot: 0, staleness: 1, update: 12 examples, 4 bytes }
          Fold(Stale(12 examples, 4 bytes, staleness 1, × 0.7071067811865475))
        t=0 Persisted { request: RequestId(11), ok: true }
          ReplyUpload { request: RequestId(11), result: Ok(()) }
        t=0 Upload { request: RequestId(12), device: DeviceId(13), round_idx: RoundIdx(1), model_version: ModelVersion(1), update: 13 examples, 4 bytes }
          PersistUpdate { request: RequestId(12), round_idx: RoundIdx(1), device: DeviceId(13), slot: 1, staleness: 0, update: 13 examples, 4 bytes }
          Fold(Update(13 examples, 4 bytes))
        t=0 Persisted { request: RequestId(12), ok: true }
          ReplyUpload { request: RequestId(12), result: Ok(()) }
          CloseRound { closing: RoundClosing { round_idx: RoundIdx(1), model_version: ModelVersion(1), outcome: Commit, n_selected: 2, n_reported: 2, n_dropped: 0, closed_at: 0 }, sum: Folded }
        t=0 RoundClosed { round_idx: RoundIdx(1), committed: true }
          OpenRound(RoundOpened { round_idx: RoundIdx(2), model_version: ModelVersion(2), opened_at: 0, selection_deadline: 5000, reporting_deadline: 5000 })
        t=0 CheckIn { request: RequestId(13), device: DeviceId(15), online: 10 }
          PersistSelection { round_idx: RoundIdx(2), device: DeviceId(15), aggregator: None }
          ReplyCheckIn { request: RequestId(13), decision: Selected { round_idx: RoundIdx(2), model_version: ModelVersion(2), report_deadline: 5000, secure: None, aggregator: None } }
        t=0 CheckIn { request: RequestId(14), device: DeviceId(16), online: 10 }
          PersistSelection { round_idx: RoundIdx(2), device: DeviceId(16), aggregator: None }
          ReplyCheckIn { request: RequestId(14), decision: Selected { round_idx: RoundIdx(2), model_version: ModelVersion(2), report_deadline: 5000, secure: None, aggregator: None } }
        t=0 Upload { request: RequestId(15), device: DeviceId(15), round_idx: RoundIdx(2), model_version: ModelVersion(2), update: 15 examples, 4 bytes }
          PersistUpdate { request: RequestId(15), round_idx: RoundIdx(2), device: DeviceId(15), slot: 0, staleness: 0, update: 15 examples, 4 bytes }
          Fold(Update(15 examples, 4 bytes))
        t=0 Upload { request: RequestId(16), device: DeviceId(16), round_idx: RoundIdx(2), model_version: ModelVersion(2), update: 16 examples, 4 bytes }
          PersistUpdate { request: RequestId(16), round_idx: RoundIdx(2), device: DeviceId(16), slot: 1, staleness: 0, update: 16 examples, 4 bytes }
          Fold(Update(16 examples, 4 bytes))
        t=0 Persisted { request: RequestId(15), ok: true }
          ReplyUpload { request: RequestId(15), result: Ok(()) }
        t=0 Persisted { request: RequestId(16), ok: true }
          ReplyUpload { request: RequestId(16), result: Ok(()) }
          CloseRound { closing: RoundClosing { round_idx: RoundIdx(2), model_version: ModelVersion(2), outcome: Commit, n_selected: 2, n_reported: 2, n_dropped: 0, closed_at: 0 }, sum: Folded }
        t=0 RoundClosed { round_idx: RoundIdx(2), committed: true }
          OpenRound(RoundOpened { round_idx: RoundIdx(3), model_version: ModelVersion(3), opened_at: 0, selection_deadline: 5000, reporting_deadline: 5000 })
        t=0 Upload { request: RequestId(17), device: DeviceId(14), round_idx: RoundIdx(1), model_version: ModelVersion(1), update: 14 examples, 4 bytes }
          ReplyUpload { request: RequestId(17), result: Err(RoundClosed) }
    "#]]);
}

/// Found in CI: a device whose update reached a buffer from an earlier one was
/// selected again in the same buffer, and its next upload was refused as a duplicate (which
/// the SDK takes as delivered: a trained update lost). It now waits for the next buffer.
#[test]
fn a_device_that_reported_late_waits_for_the_next_buffer() {
    let config = RoundConfig {
        cohort_size: 2,
        target_selected: 3,
        min_quorum: 1,
        asynchronous: Some(crate::plan::AsynchronousPlan {
            concurrency: 3,
            max_staleness: 2,
            staleness_exponent: 0.5,
        }),
        ..config()
    };
    let mut t = Trace::with(config);
    for d in [10, 11, 12] {
        t.check_in(d);
    }
    let (a, b) = (t.upload(10, 0), t.upload(11, 0));
    t.persisted(a, true);
    t.persisted(b, true);
    t.closed(0, true);
    let request = t.upload_trained_on(12, 0, 0);
    t.persisted(request, true);
    t.check_in(12);
    let answer = t.lines.last().unwrap();
    assert!(answer.contains("ComeBackLater"), "{answer}");
    assert!(
        !t.lines
            .iter()
            .any(|l| l.contains("PersistSelection { round_idx: RoundIdx(1), device: DeviceId(12)"))
    );
    // A task's deadline runs from its own selection: a second into the buffer, a second later.
    t.now = 1_000;
    t.check_in(13);
    let task = t.lines.last().unwrap();
    assert!(
        task.contains("round_idx: RoundIdx(1)") && task.contains("report_deadline: 6000"),
        "{task}"
    );
}

/// The quarantine rule in the machine: device 10 reports into three rounds in a row whose
/// aggregate is refused (with a different partner each time), and the run selects it no more;
/// the partners, with one refused round each, are still selected.
#[test]
fn a_device_in_three_refused_rounds_in_a_row_is_not_selected_again() {
    let config = RoundConfig { target_selected: 2, ..config() };
    let mut t = Trace::with(config);
    for (round, partner) in [(0, 20), (1, 21), (2, 22)] {
        t.check_in(10);
        t.check_in(partner);
        let a = t.upload(10, round);
        let b = t.upload(partner, round);
        t.persisted(a, true);
        t.persisted(b, true);
        t.closed(round, false);
    }
    assert_eq!(t.m.quarantined().collect::<Vec<_>>(), vec![DeviceId(10)]);
    t.lines.clear();
    t.check_in(10);
    t.check_in(21);
    let decisions: Vec<&String> = t.lines.iter().filter(|l| l.contains("ReplyCheckIn")).collect();
    assert!(decisions[0].contains("ComeBackLater"), "{decisions:?}");
    assert!(decisions[1].contains("Selected"), "{decisions:?}");
}

/// A refusal the driver traced to one device's update strikes that device alone: with the
/// same partner every round, the honest partner is never quarantined (every device of a
/// refused round used to be struck, so one device took its honest partners down with it).
#[test]
fn a_refusal_traced_to_one_update_strikes_only_its_device() {
    let config = RoundConfig { target_selected: 2, total_rounds: 5, ..config() };
    let mut t = Trace::with(config);
    for round in 0..3 {
        t.check_in(10);
        t.check_in(20);
        let a = t.upload(10, round);
        let b = t.upload(20, round);
        t.persisted(a, true);
        t.persisted(b, true);
        t.input(Input::RoundClosed {
            round_idx: RoundIdx(round),
            committed: false,
            refused_by: vec![DeviceId(10)],
        });
    }
    assert_eq!(t.m.quarantined().collect::<Vec<_>>(), vec![DeviceId(10)], "not device 20");
}

/// A device masks what it likes: the ring elements are its own. One that wrapped the weights'
/// sum to just above nothing made the decoded mean of honest updates about 0.01 explode, and it
/// committed. The unmasked sum is now checked against what the survivors' inputs inside the
/// quantization range can add up to, and such a round fails, never commits.
mod poisoned_secure_sums {
    use super::secure_rounds::{Fleet, Poison, run_fleet_with};
    use super::*;

    /// The survivors of `run_fleet` (9 and 10 drop while training).
    const SURVIVORS: std::ops::RangeInclusive<i64> = 1..=8;

    fn refused(poison: Poison) -> AggregateError {
        let mut f = Fleet::new();
        f.poison = Some((3, poison));
        let f = run_fleet_with(false, f);
        assert!(f.aggregate.is_none(), "a poisoned sum was decoded: {:?}", f.aggregate);
        f.refused.expect("the driver refuses the sum")
    }

    #[test]
    fn a_weight_wrapped_to_shrink_the_divisor_fails_the_round() {
        let err = refused(|f, mut input| {
            // The weights' sum lands just above zero weight: the mean is divided by ~0.002.
            let task = f.task.unwrap();
            let q = task.quantizer();
            let others: u64 = SURVIVORS
                .filter(|&d| d != 3)
                .map(|d| u64::from(*f.encoded(d).last().unwrap()))
                .sum();
            let target = q.max_sum(8) / 2 + q.max_sum(8) / 4000;
            *input.last_mut().unwrap() = (target.wrapping_sub(others)) as u32;
            input
        });
        assert!(err.to_string().contains("weights add up to less"), "{err}");
    }

    #[test]
    fn a_value_outside_the_quantization_range_fails_the_round() {
        let err = refused(|_, mut input| {
            // Eight top levels in one entry: the sum lands above what eight inputs can make.
            input[4] = 1 << 31;
            input
        });
        assert!(err.to_string().contains("outside"), "{err}");
    }

    #[test]
    fn honest_sums_pass_the_check() {
        let (aggregate, closing) = super::secure_rounds::run(false);
        assert_eq!(closing.outcome, RoundOutcome::Commit);
        assert_eq!(aggregate.n_updates, 8);
    }
}

/// Random selection with DP draws exactly the target, uniformly without replacement, from the
/// eligible devices that checked in during the window (the measured population), once the
/// window is over: each device checking in is told to come back just after it, and the drawn
/// ones find their task then. A window that measured fewer than the plan's population selects
/// no one and fails the round: nothing is released.
#[test]
fn a_fixed_size_dp_draw_is_uniform_over_the_measured_population_or_fails() {
    const POOL: i64 = 20;
    let machine = |entropy: [u8; 32], min_population: u64| {
        let config = RoundConfig {
            cohort_size: 5,
            target_selected: 5,
            selection: crate::plan::SelectionPolicy::Random,
            min_population: Some(min_population),
            ..config()
        };
        let mut m = RunMachine::start(RunId(1), config, 0, entropy);
        while m.poll_action().is_some() {}
        m
    };
    let mut counts = [0u32; POOL as usize + 1];
    for trial in 0..400u32 {
        let mut entropy = [0u8; 32];
        entropy[..4].copy_from_slice(&trial.to_le_bytes());
        let mut m = machine(entropy, POOL as u64);
        // Twice each: a device counts once.
        for base in [10, 500] {
            for d in 1..=POOL {
                let at = base + d;
                m.handle(
                    at,
                    Input::CheckIn {
                        request: RequestId(d as u64),
                        device: DeviceId(d),
                        attributes: Default::default(),
                        online: POOL as u32,
                    },
                );
                let reply = std::iter::from_fn(|| m.poll_action()).last();
                let Some(Action::ReplyCheckIn {
                    decision: CheckInDecision::ComeBackLater { after_ms },
                    ..
                }) = reply
                else {
                    panic!("trial {trial}: device {d} got {reply:?} before the draw");
                };
                assert!(at + after_ms >= 1_000, "device {d} comes back before the draw");
            }
        }
        assert_eq!(m.poll_timeout(), Some(1_000), "the machine wakes at the window's end");
        m.handle_timeout(1_000);
        let drawn: Vec<i64> = std::iter::from_fn(|| m.poll_action())
            .filter_map(|a| match a {
                Action::PersistSelection { device, .. } => Some(device.0),
                _ => None,
            })
            .collect();
        assert_eq!(drawn.len(), 5, "trial {trial}: exactly the target is drawn");
        for d in 1..=POOL {
            assert!(m.has_task_for(DeviceId(d)) == drawn.contains(&d), "trial {trial}: {d}");
            if trial == 0 {
                let selected = lottery_check_in(&mut m, d, 1_100, POOL as u32);
                assert_eq!(selected, drawn.contains(&d), "device {d} coming back after the draw");
            }
        }
        for d in drawn {
            counts[d as usize] += 1;
        }
    }
    // Each device: 5/20 of 400 rounds is 100 ± 4σ (σ ≈ 8.7).
    for (d, &n) in counts.iter().enumerate().skip(1) {
        assert!((65..=135).contains(&n), "device {d} drawn {n} times in 400 rounds");
    }

    // Nineteen of a stated twenty: no one is selected and the round fails, saying what it
    // measured.
    let mut m = machine([3; 32], POOL as u64);
    for d in 1..POOL {
        lottery_check_in(&mut m, d, 10 + d, POOL as u32);
    }
    m.handle_timeout(1_000);
    let actions: Vec<Action> = std::iter::from_fn(|| m.poll_action()).collect();
    assert!(!actions.iter().any(|a| matches!(a, Action::PersistSelection { .. })), "{actions:?}");
    let closing = actions.iter().find_map(|a| match a {
        Action::CloseRound { closing, .. } => Some(closing.outcome),
        _ => None,
    });
    assert_eq!(
        closing,
        Some(RoundOutcome::PopulationTooSmall { measured: 19, minimum: 20 }),
        "{actions:?}"
    );
}

/// A run whose every round fails (once: all its devices quarantined, `too_few_selected`
/// forever, shown `running`) stops after the plan's `max_failed_rounds` in a row, saying why;
/// a commit in between starts the count again.
#[test]
fn a_run_stops_with_its_reason_after_max_failed_rounds_in_a_row() {
    let mut t = Trace::with(RoundConfig { max_failed_rounds: 2, total_rounds: 5, ..config() });
    // Round 0 fails; round 1 commits; rounds 2 and 3 fail: the run stops.
    t.advance_to(5_000);
    t.closed(0, false);
    for d in [10, 11] {
        t.check_in(d);
        let r = t.upload(d, 1);
        t.persisted(r, true);
    }
    t.closed(1, true);
    t.lines.clear();
    t.advance_to(10_000);
    t.closed(2, false);
    assert_eq!(t.m.status(), RunStatus::Running, "one failure since the commit");
    t.advance_to(15_000);
    t.closed(3, false);
    assert_eq!(t.m.status(), RunStatus::Stopped);
    t.check(expect![[r#"
        t=10000 timeout (poll_timeout was Some(6000))
          CloseRound { closing: RoundClosing { round_idx: RoundIdx(2), model_version: ModelVersion(1), outcome: TooFewSelected { selected: 0, quorum: 2 }, n_selected: 0, n_reported: 0, n_dropped: 0, closed_at: 10000 }, sum: Folded }
        t=10000 RoundClosed { round_idx: RoundIdx(2), committed: false }
          OpenRound(RoundOpened { round_idx: RoundIdx(3), model_version: ModelVersion(1), opened_at: 10000, selection_deadline: 11000, reporting_deadline: 15000 })
        t=15000 timeout (poll_timeout was Some(11000))
          CloseRound { closing: RoundClosing { round_idx: RoundIdx(3), model_version: ModelVersion(1), outcome: TooFewSelected { selected: 0, quorum: 2 }, n_selected: 0, n_reported: 0, n_dropped: 0, closed_at: 15000 }, sum: Folded }
        t=15000 RoundClosed { round_idx: RoundIdx(3), committed: false }
          StopRun { open_round: None, reason: Some("2 rounds in a row failed (the last: too_few_selected); the plan's max_failed_rounds is 2") }
    "#]]);
}
