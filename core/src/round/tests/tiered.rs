//! Tiered rounds: shards assigned to aggregators, their partials committed.

use super::*;

pub(super) fn tiered_trace() -> Trace {
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
    pub(super) fn partial(&mut self, aggregators: &[u32], devices: &[i64]) -> RequestId {
        let request = self.req();
        self.input(partial(request, aggregators, devices));
        request
    }

    pub(super) fn assigned_to(&self, aggregator: u32) -> Vec<i64> {
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
