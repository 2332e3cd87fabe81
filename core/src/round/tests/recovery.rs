//! Recovery: a restored machine resumes its open round where it was.

use super::tiered::tiered_trace;
use super::*;

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
        participations: Default::default(),
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
        participations: Default::default(),
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
