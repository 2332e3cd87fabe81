//! Selecting cohorts: eligibility, random, Poisson and fixed-size DP draws.

use super::*;

/// Check-ins of `devices` (each with `attributes`) at `now`, with `online` devices heard from
/// lately: the come-back times of those not selected, and who was selected.
pub(super) fn check_ins(
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
    let capped = RoundConfig { secure: super::secure_rounds::secure_config().secure, ..poisson };
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
