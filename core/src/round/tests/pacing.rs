//! Pacing: pace steering of the devices not selected, and FedBuff's buffered rounds.

use super::selection::check_ins;
use super::*;

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
