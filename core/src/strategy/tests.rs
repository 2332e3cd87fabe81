//! Each server optimizer against values worked out by hand (two steps on two parameters, all
//! state values exact in f32), the state's byte form, and a restart between steps.

use std::collections::BTreeMap;

use super::*;

const X0: [f32; 2] = [1.0, -2.0];
const D1: [f64; 2] = [0.5, -0.5];
const D2: [f64; 2] = [1.5, 0.5];
const ADAPTIVE: AdaptiveParams = AdaptiveParams { lr: 1.0, beta1: 0.5, beta2: 0.75, tau: 0.5 };

fn aggregate(delta: [f64; 2]) -> Aggregate {
    Aggregate {
        mean_delta: delta.to_vec(),
        total_weight: 10,
        n_updates: 2,
        n_within_bound: 2,
        metrics: BTreeMap::new(),
    }
}

/// Two steps, D1 then D2, from X0 and the initial state: both models and the final state.
fn two_steps(opt: ServerOptimizer) -> (Vec<f32>, Vec<f32>, OptimizerState) {
    let s0 = opt.initial_state(2);
    let (x1, s1) = opt.step(&X0, &aggregate(D1), &s0, 0.5).unwrap();
    let (x2, s2) = opt.step(&x1, &aggregate(D2), &s1, 0.5).unwrap();
    (x1, x2, s2)
}

fn strategy(optimizer: ServerOptimizer) -> Strategy {
    Strategy { optimizer, ..Strategy::default() }
}

/// `x + step`, in f64 and rounded once, as the optimizer does.
fn moved(x: f32, step: f64) -> f32 {
    (f64::from(x) + step) as f32
}

#[test]
fn fed_avg_uses_the_plans_rate_unless_it_has_its_own() {
    // x1 = x0 + 0.5·D1 = [1.25, -2.25]; x2 = x1 + 0.5·D2 = [2.0, -2.0].
    let (x1, x2, s) = two_steps(ServerOptimizer::FedAvg { lr: None });
    assert_eq!((x1, x2), (vec![1.25, -2.25], vec![2.0, -2.0]));
    assert_eq!(
        s,
        OptimizerState { steps: 2, m: vec![], v: vec![], clip_norm: None, blt: Default::default() }
    );
    let (x1, _, _) = two_steps(ServerOptimizer::FedAvg { lr: Some(1.0) });
    assert_eq!(x1, vec![1.5, -2.5]);
}

#[test]
fn fed_avg_m_accumulates_momentum() {
    // m1 = D1 = [0.5, -0.5], x1 = [1.25, -2.25];
    // m2 = 0.5·m1 + D2 = [1.75, 0.25], x2 = x1 + 0.5·m2 = [2.125, -2.125].
    let (x1, x2, s) = two_steps(ServerOptimizer::FedAvgM { lr: 0.5, momentum: 0.5 });
    assert_eq!((x1, x2), (vec![1.25, -2.25], vec![2.125, -2.125]));
    assert_eq!(s.m, vec![1.75, 0.25]);
}

#[test]
fn fed_adagrad_sums_squared_deltas() {
    // v starts at τ² = 0.25. Step 1: m = 0.5·D1 = [0.25, -0.25], v = 0.25 + 0.25 = [0.5, 0.5].
    // Step 2: m = 0.5·m + 0.5·D2 = [0.875, 0.125], v = [0.5 + 2.25, 0.5 + 0.25] = [2.75, 0.75].
    let (x1, x2, s) = two_steps(ServerOptimizer::FedAdagrad(ADAPTIVE));
    let r = 0.5f64.sqrt() + 0.5;
    assert_eq!(x1, vec![moved(1.0, 0.25 / r), moved(-2.0, -0.25 / r)]);
    assert_eq!(
        x2,
        vec![
            moved(x1[0], 0.875 / (2.75f64.sqrt() + 0.5)),
            moved(x1[1], 0.125 / (0.75f64.sqrt() + 0.5))
        ]
    );
    assert_eq!((s.m, s.v), (vec![0.875, 0.125], vec![2.75, 0.75]));
}

#[test]
fn fed_adam_decays_both_moments() {
    // Step 1: m = [0.25, -0.25], v = 0.75·0.25 + 0.25·0.25 = [0.25, 0.25]: x1 = x0 ± 0.25/1.
    // Step 2: m = [0.875, 0.125], v = [0.1875 + 0.5625, 0.1875 + 0.0625] = [0.75, 0.25].
    let (x1, x2, s) = two_steps(ServerOptimizer::FedAdam(ADAPTIVE));
    assert_eq!(x1, vec![1.25, -2.25]);
    assert_eq!(x2, vec![moved(1.25, 0.875 / (0.75f64.sqrt() + 0.5)), -2.125]);
    assert_eq!((s.m, s.v), (vec![0.875, 0.125], vec![0.75, 0.25]));
}

#[test]
fn fed_yogi_moves_v_by_the_sign_of_its_gap() {
    // Step 1: v = τ² = 0.25 = D1², the sign is 0: v stays 0.25 (x1 as Adam's).
    // Step 2: D2² = [2.25, 0.25]; v − D2² < 0 for the first, so v = 0.25 + 0.25·2.25 = 0.8125
    // (Adam: 0.75); the second's gap is 0 again.
    let (x1, x2, s) = two_steps(ServerOptimizer::FedYogi(ADAPTIVE));
    assert_eq!(x1, vec![1.25, -2.25]);
    assert_eq!(x2, vec![moved(1.25, 0.875 / (0.8125f64.sqrt() + 0.5)), -2.125]);
    assert_eq!(s.v, vec![0.8125, 0.25]);
    // v above Δ² shrinks: from v = 0.8125 a zero delta leaves Δ² = 0 and v unchanged (the
    // step is (1−β₂)·0); a delta of 0.5 (Δ² = 0.25 < v) takes 0.25·0.25 off.
    let opt = ServerOptimizer::FedYogi(ADAPTIVE);
    let (_, s3) = opt.step(&x2, &aggregate([0.5, 0.0]), &s, 1.0).unwrap();
    assert_eq!(s3.v, vec![0.8125 - 0.0625, 0.25]);
}

#[test]
fn a_restart_between_steps_gives_the_same_models() {
    for opt in [
        ServerOptimizer::FedAvgM { lr: 0.5, momentum: 0.9 },
        ServerOptimizer::FedAdam(AdaptiveParams { lr: 0.1, beta1: 0.9, beta2: 0.99, tau: 1e-3 }),
        ServerOptimizer::FedYogi(AdaptiveParams { lr: 0.1, beta1: 0.9, beta2: 0.99, tau: 1e-3 }),
    ] {
        let (_, straight, s2) = two_steps(opt);
        let (x1, s1) = opt.step(&X0, &aggregate(D1), &opt.initial_state(2), 1.0).unwrap();
        let restored = OptimizerState::from_bytes(&s1.to_bytes(), &strategy(opt), 2).unwrap();
        assert_eq!(restored, s1);
        let (resumed, s2b) = opt.step(&x1, &aggregate(D2), &restored, 1.0).unwrap();
        assert_eq!((resumed, s2b), (straight, s2), "{}", opt.name());
    }
}

#[test]
fn stored_state_of_another_shape_or_corrupt_is_refused() {
    let adam = strategy(ServerOptimizer::FedAdam(ADAPTIVE));
    let bytes = adam.initial_state(2).to_bytes();
    assert!(OptimizerState::from_bytes(&bytes, &adam, 3).is_err(), "another model size");
    let momentum = strategy(ServerOptimizer::FedAvgM { lr: 1.0, momentum: 0.5 });
    assert!(OptimizerState::from_bytes(&bytes, &momentum, 2).is_err(), "another optimizer");
    assert!(OptimizerState::from_bytes(&bytes[..bytes.len() - 1], &adam, 2).is_err());
    let mut trailing = bytes.clone();
    trailing.push(0);
    assert!(OptimizerState::from_bytes(&trailing, &adam, 2).is_err());
    let mut nan = adam.initial_state(2);
    nan.v[1] = f32::NAN;
    assert!(OptimizerState::from_bytes(&nan.to_bytes(), &adam, 2).is_err());
}

#[test]
fn hyper_parameters_are_checked_by_name() {
    let bad = [
        (ServerOptimizer::FedAvg { lr: Some(0.0) }, "lr"),
        (ServerOptimizer::FedAvgM { lr: 1.0, momentum: 1.0 }, "momentum"),
        (ServerOptimizer::FedAdam(AdaptiveParams { tau: 0.0, ..ADAPTIVE }), "tau"),
        (ServerOptimizer::FedYogi(AdaptiveParams { beta2: -0.1, ..ADAPTIVE }), "beta2"),
        (ServerOptimizer::FedAdagrad(AdaptiveParams { lr: f64::NAN, ..ADAPTIVE }), "lr"),
    ];
    for (opt, name) in bad {
        let err = opt.check().unwrap_err();
        assert!(err.starts_with(name), "{opt:?}: {err}");
    }
    assert!(ServerOptimizer::FedAdam(ADAPTIVE).check().is_ok());
    let parsed: ServerOptimizer =
        serde_json::from_str(r#"{"kind": "fed_yogi", "lr": 0.01}"#).unwrap();
    assert_eq!(
        parsed,
        ServerOptimizer::FedYogi(AdaptiveParams { lr: 0.01, beta1: 0.9, beta2: 0.99, tau: 1e-3 })
    );
    assert!(
        serde_json::from_str::<ServerOptimizer>(r#"{"kind": "fed_adam", "lr": 1, "eps": 1}"#)
            .is_err()
    );
}

#[test]
fn a_dp_runs_clip_norm_travels_with_the_state() {
    let dp = crate::privacy::DifferentialPrivacy {
        noise_multiplier: 1.0,
        clip_norm: 0.75,
        population: 100,
        delta: 1e-5,
        epsilon_budget: None,
        adaptive_clipping: Some(crate::privacy::AdaptiveClipping {
            target_quantile: 0.5,
            learning_rate: 0.2,
            count_stddev: None,
        }),
        noise: Default::default(),
        min_survivors: None,
        metrics: Default::default(),
        mechanism: Default::default(),
        min_separation: None,
        max_participations: None,
    };
    let with_dp =
        Strategy { differential_privacy: Some(dp), ..strategy(ServerOptimizer::FedAdam(ADAPTIVE)) };
    assert!(with_dp.is_stateful() && with_dp.needs_each_update());
    let mut state = with_dp.initial_state(2);
    assert_eq!(state.clip_norm, Some(0.75));
    state.clip_norm = Some(0.6125);
    let bytes = state.to_bytes();
    assert_eq!(OptimizerState::from_bytes(&bytes, &with_dp, 2).unwrap(), state);
    // The same bytes read for a run without DP have 8 bytes too many; a stored state of a run
    // without DP lacks the clip norm.
    let adam = strategy(ServerOptimizer::FedAdam(ADAPTIVE));
    assert!(OptimizerState::from_bytes(&bytes, &adam, 2).is_err());
    assert!(OptimizerState::from_bytes(&adam.initial_state(2).to_bytes(), &with_dp, 2).is_err());
    let mut bad = state.clone();
    bad.clip_norm = Some(-1.0);
    assert!(OptimizerState::from_bytes(&bad.to_bytes(), &with_dp, 2).is_err());
    // Plain FedAvg with fixed clipping keeps no state; the clip norm comes from the plan.
    let fixed = Strategy {
        differential_privacy: Some(crate::privacy::DifferentialPrivacy {
            adaptive_clipping: None,
            noise: Default::default(),
            min_survivors: None,
            ..dp
        }),
        ..Strategy::default()
    };
    assert!(!fixed.is_stateful());
    assert_eq!(
        fixed.accumulator_bound(&fixed.initial_state(2)),
        Some(NormBound { max_norm: 0.75, unweighted: true })
    );
    let bounded = Strategy { norm_bound: Some(3.0), ..Strategy::default() };
    assert_eq!(
        bounded.accumulator_bound(&bounded.initial_state(2)),
        Some(NormBound { max_norm: 3.0, unweighted: false })
    );
    let median = Strategy {
        norm_bound: Some(3.0),
        aggregation: Aggregation::CoordinateMedian {},
        ..Strategy::default()
    };
    assert_eq!(median.accumulator_bound(&median.initial_state(2)), None);
}

/// The server step as first written, deciding the optimizer per parameter: the reference the
/// loop per optimizer must match bit for bit.
fn step_reference(
    opt: &ServerOptimizer,
    global: &[f32],
    delta: &[f64],
    state: &OptimizerState,
    fallback_lr: f64,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let (mut m_next, mut v_next) = (state.m.clone(), state.v.clone());
    let mut model = vec![];
    for (i, (&x, &d)) in global.iter().zip(delta).enumerate() {
        let x = f64::from(x);
        let new = match *opt {
            ServerOptimizer::FedAvg { lr } => x + lr.unwrap_or(fallback_lr) * d,
            ServerOptimizer::FedAvgM { lr, momentum } => {
                let m = momentum * f64::from(state.m[i]) + d;
                m_next[i] = m as f32;
                x + lr * m
            }
            ServerOptimizer::FedAdagrad(p)
            | ServerOptimizer::FedAdam(p)
            | ServerOptimizer::FedYogi(p) => {
                let m = p.beta1 * f64::from(state.m[i]) + (1.0 - p.beta1) * d;
                let (v0, d2) = (f64::from(state.v[i]), d * d);
                let v = match opt {
                    ServerOptimizer::FedAdagrad(_) => v0 + d2,
                    ServerOptimizer::FedAdam(_) => p.beta2 * v0 + (1.0 - p.beta2) * d2,
                    _ => {
                        let sign = match v0.partial_cmp(&d2) {
                            Some(std::cmp::Ordering::Greater) => 1.0,
                            Some(std::cmp::Ordering::Less) => -1.0,
                            _ => 0.0,
                        };
                        v0 - (1.0 - p.beta2) * d2 * sign
                    }
                };
                m_next[i] = m as f32;
                v_next[i] = v as f32;
                x + p.lr * m / (v.sqrt() + p.tau)
            }
        };
        model.push(new as f32);
    }
    (model, m_next, v_next)
}

/// The step runs one loop per optimizer (deciding per parameter kept a 1M-parameter
/// FedAvg step at 5 ms); every optimizer's model and moments are the same bits as before, over
/// three steps of values of every magnitude.
#[test]
fn the_step_per_optimizer_matches_the_step_per_parameter_bit_for_bit() {
    let n: usize = 1_000;
    let mut rng = crate::rng::SplitMix64(11);
    let mut draw = |scale: f64| (rng.unit() - 0.5) * scale;
    let global: Vec<f32> = (0..n).map(|i| draw(10f64.powi(i as i32 % 7 - 3)) as f32).collect();
    let deltas: Vec<Vec<f64>> =
        (0..3).map(|_| (0..n).map(|i| draw(10f64.powi(i as i32 % 5 - 4))).collect()).collect();
    for opt in [
        ServerOptimizer::FedAvg { lr: None },
        ServerOptimizer::FedAvg { lr: Some(0.7) },
        ServerOptimizer::FedAvgM { lr: 0.3, momentum: 0.9 },
        ServerOptimizer::FedAdagrad(AdaptiveParams {
            lr: 0.01,
            beta1: 0.9,
            beta2: 0.99,
            tau: 1e-3,
        }),
        ServerOptimizer::FedAdam(AdaptiveParams { lr: 0.01, beta1: 0.9, beta2: 0.99, tau: 1e-3 }),
        ServerOptimizer::FedYogi(AdaptiveParams { lr: 0.01, beta1: 0.9, beta2: 0.99, tau: 1e-3 }),
    ] {
        let (mut x, mut state) = (global.clone(), opt.initial_state(n));
        for delta in &deltas {
            let (model, m, v) = step_reference(&opt, &x, delta, &state, 0.5);
            let mut agg = aggregate([0.0, 0.0]);
            agg.mean_delta = delta.clone();
            let (next_x, next_state) = opt.step(&x, &agg, &state, 0.5).unwrap();
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&next_x), bits(&model), "{opt:?}");
            assert_eq!((bits(&next_state.m), bits(&next_state.v)), (bits(&m), bits(&v)), "{opt:?}");
            assert_eq!(next_state.steps, state.steps + 1);
            (x, state) = (next_x, next_state);
        }
    }
}

/// A round's end through the pipeline: the mean passes the folded aggregate to the optimizer
/// and reads no tile; a coordinate median reads the updates back and replaces the mean with
/// their median (by hand: the middle of 1, 4, -2 and of 0, 2, 6), then the optimizer steps.
#[test]
fn a_rounds_end_combines_then_steps_and_reads_tiles_only_for_order_statistics() {
    let updates = [[1.0f32, 0.0], [4.0, 2.0], [-2.0, 6.0]];
    let read = |start: usize, len: usize| -> Result<Vec<Vec<f32>>, String> {
        Ok(updates.iter().map(|u| u[start..start + len].to_vec()).collect())
    };
    let mut mean_agg = aggregate(D1);
    mean_agg.n_updates = 3;
    let state = ServerOptimizer::FedAvg { lr: None }.initial_state(2);
    let end = |aggregate| RoundEnd {
        privacy: None,
        server_learning_rate: 1.0,
        global: &X0,
        aggregate,
        state: &state,
    };
    let mean = Strategy::default();
    let no_tiles = |_: usize, _: usize| -> Result<Vec<Vec<f32>>, String> {
        panic!("the mean streams: no tile is read")
    };
    let next = mean.next_model(end(mean_agg.clone()), no_tiles, || [0; 32]).unwrap();
    assert_eq!(next.values, vec![1.5, -2.5]);
    assert!(next.combined.is_none());
    let median = Strategy { aggregation: Aggregation::CoordinateMedian {}, ..Strategy::default() };
    let next = median.next_model(end(mean_agg), read, || [0; 32]).unwrap();
    assert_eq!(next.values, vec![2.0, 0.0], "X0 + (1, 2)");
    assert!(next.combined.is_some());
}

/// A `blt_ftrl` run's round end: the mean is encoded with the earlier rounds', released once
/// with exact noise and decoded; both buffers advance and travel with the state (refused when
/// they are of another model), and the sum is divided by the plan's cohort, not by the updates
/// that came.
#[test]
fn a_blt_round_encodes_releases_decodes_and_its_buffers_travel_with_the_state() {
    use crate::privacy::{DifferentialPrivacy, Gaussian, Mechanism, Sampling, Sizes};
    let dp = DifferentialPrivacy {
        noise_multiplier: 2.0,
        clip_norm: 1.0,
        population: 0,
        delta: 1e-5,
        epsilon_budget: None,
        adaptive_clipping: None,
        noise: Default::default(),
        min_survivors: None,
        metrics: Default::default(),
        mechanism: Mechanism::BltFtrl,
        min_separation: Some(1),
        max_participations: Some(4),
    };
    let privacy = dp.resolve(Sizes::of(4, 2), 4, Sampling::FixedSize).unwrap();
    let blt = privacy.blt.unwrap().strategy;
    let strategy = Strategy { differential_privacy: Some(dp), ..Strategy::default() };
    let mut state = strategy.initial_state(2);
    assert_eq!(state.blt, crate::privacy::blt::Buffers::zeros(2));
    let mut global = X0.to_vec();
    let (mut inputs, mut released) = ([0f64; 2], [0f64; 2]);
    let mean = [0.25, -0.5];
    for round in 0..3u8 {
        let end = RoundEnd {
            privacy: Some(&privacy),
            server_learning_rate: 1.0,
            global: &global,
            aggregate: aggregate(mean),
            state: &state,
        };
        let next = strategy
            .next_model(
                end,
                |_: usize, _: usize| -> Result<Vec<Vec<f32>>, String> { unreachable!() },
                || [round; 32],
            )
            .unwrap();
        // The same release, by hand: the mean encoded (x + ω·inputs), one exact Gaussian
        // release of the sum's noise N(0, (z·C)²) over the cohort of 4, then decoded
        // (y − ω·released).
        let mut draws = Gaussian::new([round; 32]);
        for j in 0..2 {
            // Two updates came, the cohort is 4.
            let x = mean[j] * 2.0 / 4.0;
            let y = draws.noised(x + blt.omega * inputs[j], 2.0 / 4.0).unwrap();
            let out = y - blt.omega * released[j];
            inputs[j] = blt.lambda * inputs[j] + x;
            released[j] = blt.lambda * released[j] + out;
            let want = f64::from(global[j]) + out;
            assert!((f64::from(next.values[j]) - want).abs() < 1e-5, "round {round}, {j}");
            assert_eq!(next.state.blt.inputs[j], inputs[j]);
            assert!((f64::from(next.state.blt.releases[j]) - released[j]).abs() < 1e-5);
        }
        let bytes = next.state.to_bytes();
        assert_eq!(OptimizerState::from_bytes(&bytes, &strategy, 2).unwrap(), next.state);
        assert!(OptimizerState::from_bytes(&bytes, &strategy, 3).is_err(), "another model");
        global = next.values;
        state = next.state;
    }
}
