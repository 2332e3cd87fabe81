//! Closing rounds: commits, refusals, failed writes, deadlines, stops, evaluation-only rounds,
//! quarantine and runs that stop after failing; and a simulated fleet whose every round ends.

use super::*;

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

/// Many devices, random-ish latencies and dropouts, a simulated clock: every round ends, and the
/// run commits exactly `total_rounds` rounds.
#[test]
fn simulation_never_hangs() {
    let config = RoundConfig {
        cohort_size: 20,
        target_selected: 26,
        min_quorum: 15,
        selection_timeout_ms: 2_000,
        reporting_timeout_ms: 10_000,
        total_rounds: 5,
        ..config()
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
