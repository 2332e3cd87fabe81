//! Each aggregator against values worked by hand, and the tiling against one big tile.

use super::*;

/// A reader over in-memory updates that counts its reads.
fn reader(
    updates: &[Vec<f32>],
) -> impl FnMut(usize, usize) -> Result<Vec<Vec<f32>>, std::convert::Infallible> + '_ {
    move |start, len| Ok(updates.iter().map(|u| u[start..start + len].to_vec()).collect())
}

fn run(
    aggregation: Aggregation,
    updates: &[Vec<f32>],
    tile: usize,
    bound: Option<f64>,
) -> Combined {
    combine(&aggregation, updates.len(), updates[0].len(), tile, bound, reader(updates)).unwrap()
}

#[test]
fn the_median_takes_the_middle_or_the_mean_of_the_two_middles() {
    assert_eq!(median(&mut [3.0, -1.0, 7.0]), 3.0);
    assert_eq!(median(&mut [4.0, 1.0, 100.0, 2.0]), 3.0);
    assert_eq!(median(&mut [5.0]), 5.0);
}

#[test]
fn coordinate_median_ignores_an_outlier_per_coordinate() {
    let updates = vec![
        vec![1.0, 10.0, -2.0],
        vec![2.0, 20.0, -1.0],
        vec![1000.0, -1000.0, 0.0], // attacker
        vec![3.0, 30.0, 1.0],
    ];
    // Columns sorted: [1,2,3,1000] → 2.5; [-1000,10,20,30] → 15; [-2,-1,0,1] → -0.5.
    let c = run(Aggregation::CoordinateMedian {}, &updates, 2, None);
    assert_eq!(c.delta, vec![2.5, 15.0, -0.5]);
    assert_eq!(c.n_scaled, 0);
    assert_eq!(c.selected, None);
}

#[test]
fn trimmed_mean_drops_the_extremes_of_each_coordinate() {
    let updates: Vec<Vec<f32>> =
        vec![vec![1.0, 0.0], vec![2.0, 0.0], vec![3.0, 9.0], vec![4.0, 0.0], vec![-50.0, 3.0]];
    // trim ⌊0.2·5⌋ = 1 each side: [-50,1,2,3,4] → mean(1,2,3) = 2; [0,0,0,3,9] → 1.
    let c = run(Aggregation::TrimmedMean { trim_fraction: 0.2 }, &updates, 1, None);
    assert_eq!(c.delta, vec![2.0, 1.0]);
    // trim ⌊0.1·5⌋ = 0: the plain mean.
    let c = run(Aggregation::TrimmedMean { trim_fraction: 0.1 }, &updates, 5, None);
    assert_eq!(c.delta, vec![-8.0, 2.4]);
}

#[test]
fn krum_picks_the_update_closest_to_its_neighbours() {
    // Five updates on a line; f = 1 → each scored by its n − f − 2 = 2 nearest.
    let updates: Vec<Vec<f32>> =
        vec![vec![0.0, 0.0], vec![1.0, 0.0], vec![2.0, 0.0], vec![3.0, 0.0], vec![100.0, 0.0]];
    // Squared distances from 0: 1,4,9 → 5; from 1: 1,1 → 2; from 2: 1,1 → 2; from 3: 1,4 → 5;
    // from 100: 97²+98² → huge. Lowest: 1 and 2 (tie, earlier slot first).
    let mut d = PairwiseDistances::new(5);
    d.add_tile(
        &updates.iter().map(|u| u.iter().map(|&v| f64::from(v)).collect()).collect::<Vec<_>>(),
    );
    assert_eq!(d.krum_scores(1), vec![5.0, 2.0, 2.0, 5.0, 97.0 * 97.0 + 98.0 * 98.0]);
    let c = run(
        Aggregation::Krum { byzantine: 1, select: 1, selection: KrumSelection::Scores },
        &updates,
        1,
        None,
    );
    assert_eq!(c.selected, Some(vec![1]));
    assert_eq!(c.delta, vec![1.0, 0.0]);
    // Multi-Krum with m = 3 averages 1, 2 and then 0 (score 5, earlier than 3).
    let c = run(
        Aggregation::Krum { byzantine: 1, select: 3, selection: KrumSelection::Scores },
        &updates,
        2,
        None,
    );
    assert_eq!(c.selected, Some(vec![0, 1, 2]));
    assert_eq!(c.delta, vec![1.0, 0.0]);
}

#[test]
fn krum_refuses_a_round_too_small_for_its_byzantine_count() {
    let updates = vec![vec![0.0f32]; 4];
    let err = combine(
        &Aggregation::Krum { byzantine: 1, select: 1, selection: KrumSelection::Scores },
        4,
        1,
        8,
        None,
        reader(&updates),
    )
    .unwrap_err();
    assert!(err.to_string().contains("needs 5 updates"), "{err}");
    assert!(
        Aggregation::Krum { byzantine: 1, select: 1, selection: KrumSelection::Scores }
            .check(4)
            .unwrap_err()
            .contains("min_quorum to 5")
    );
    assert!(
        Aggregation::Krum { byzantine: 1, select: 5, selection: KrumSelection::Scores }
            .check(5)
            .is_err()
    );
    assert!(
        Aggregation::Krum { byzantine: 1, select: 4, selection: KrumSelection::Scores }
            .check(5)
            .is_ok()
    );
    assert!(Aggregation::TrimmedMean { trim_fraction: 0.5 }.check(5).is_err());
}

#[test]
fn norm_bounding_scales_long_updates_before_the_order_statistic() {
    // Norms: 5 (3,4) → scaled by 1/5 to (0.6, 0.8) with bound 1; (0.6, 0) and (0, 0.5) within.
    let updates: Vec<Vec<f32>> = vec![vec![3.0, 4.0], vec![0.6, 0.0], vec![0.0, 0.5]];
    let c = run(Aggregation::CoordinateMedian {}, &updates, 1, Some(1.0));
    assert_eq!(c.n_scaled, 1);
    let expected = [0.6, 0.5];
    for (got, want) in c.delta.iter().zip(expected) {
        assert!((got - want).abs() < 1e-7, "{got} vs {want}");
    }
    assert_eq!(norm_scale(5.0, 1.0), 0.2);
    assert_eq!(norm_scale(0.5, 1.0), 1.0);
}

#[test]
fn tiles_of_any_length_give_the_same_result() {
    let mut rng = crate::rng::SplitMix64(7);
    let updates: Vec<Vec<f32>> =
        (0..9).map(|_| (0..37).map(|_| rng.unit() as f32 * 2.0 - 1.0).collect()).collect();
    for aggregation in [
        Aggregation::CoordinateMedian {},
        Aggregation::TrimmedMean { trim_fraction: 0.25 },
        Aggregation::Krum { byzantine: 2, select: 3, selection: KrumSelection::Scores },
        Aggregation::GeometricMedian { iterations: 3, smoothing: 1e-6 },
    ] {
        let whole = run(aggregation, &updates, 37, Some(1.5));
        for tile in [1, 5, 36, 100] {
            let tiled = run(aggregation, &updates, tile, Some(1.5));
            assert_eq!(tiled.selected, whole.selected, "{aggregation:?} tile {tile}");
            for (a, b) in tiled.delta.iter().zip(&whole.delta) {
                assert!((a - b).abs() <= 1e-12 * b.abs().max(1.0), "{aggregation:?} tile {tile}");
            }
        }
    }
}

#[test]
fn a_reader_returning_the_wrong_shape_is_an_error_not_a_panic() {
    let err = combine(&Aggregation::CoordinateMedian {}, 2, 4, 2, None, |_, _| {
        Ok::<_, std::convert::Infallible>(vec![vec![0.0f32; 2]])
    })
    .unwrap_err();
    assert!(matches!(err, RobustError::Tile { start: 0, .. }), "{err}");
}

/// Multi-Krum's two selections on one round where they differ: the two updates at 12 have the
/// best one-shot scores (each the other's nearest), but once one is chosen the other has lost
/// its neighbour and the iterated selection takes the pair at 1–2 instead.
#[test]
fn multi_krum_iterated_selection_rescores_after_each_pick() {
    let updates: Vec<Vec<f32>> = [2.0, 9.0, 12.0, 12.0, 1.0].iter().map(|&v| vec![v]).collect();
    let krum = |selection| Aggregation::Krum { byzantine: 1, select: 2, selection };
    let once = run(krum(KrumSelection::Scores), &updates, 1, None);
    assert_eq!(once.selected, Some(vec![2, 3]));
    assert_eq!(once.delta, vec![12.0]);
    // Iterated: 2 first (score 9, earlier than 3); among {0, 1, 3, 4} with one nearest each,
    // 0 and 4 score 1 (the earlier, 0, is taken).
    let iterated = run(krum(KrumSelection::Iterative), &updates, 1, None);
    assert_eq!(iterated.selected, Some(vec![0, 2]));
    assert_eq!(iterated.delta, vec![7.0]);
    // Krum itself (m = 1) is the same either way.
    for selection in [KrumSelection::Scores, KrumSelection::Iterative] {
        let one = Aggregation::Krum { byzantine: 1, select: 1, selection };
        assert_eq!(run(one, &updates, 1, None).selected, Some(vec![2]));
    }
    let plan: Aggregation = serde_json::from_str(
        r#"{"kind": "krum", "byzantine": 1, "select": 2, "selection": "iterative"}"#,
    )
    .unwrap();
    assert_eq!(plan, krum(KrumSelection::Iterative));
}

/// An order statistic's memory at close is bounded: Krum's n × n distances for a 200 000-device
/// round (~320 GB) and a median's tiles past the tile floor are refused with the figure and the
/// largest round that fits, which itself fits.
#[test]
fn order_statistics_whose_round_would_not_fit_in_memory_are_refused() {
    let krum = Aggregation::Krum { byzantine: 1, select: 1, selection: KrumSelection::Scores };
    let err = krum.check_memory(200_000).unwrap_err();
    let mib = krum.close_memory_bytes(200_000).div_ceil(1 << 20);
    assert!(mib > 300_000 && err.contains(&format!("{mib} MiB")), "{err}");
    let fits: u32 =
        err.split("at most ").nth(1).unwrap().split(' ').next().unwrap().parse().unwrap();
    assert!(krum.check_memory(fits).is_ok() && krum.check_memory(fits + 1).is_err(), "{fits}");
    assert!((4_000..6_000).contains(&fits), "{fits}");
    let median = Aggregation::CoordinateMedian {};
    assert!(median.check_memory(4_096).is_ok());
    assert!(median.close_memory_bytes(4_096) <= (TILE_BYTES as u64));
    assert!(median.check_memory(1_000_000).unwrap_err().contains("coordinate_median"));
    assert_eq!(Aggregation::Mean {}.close_memory_bytes(1_000_000), 0);
}

/// Σ‖x − z‖ over the updates: what the geometric median minimizes.
fn summed_distance(updates: &[Vec<f32>], z: &[f64]) -> f64 {
    updates
        .iter()
        .map(|u| u.iter().zip(z).map(|(&v, z)| (f64::from(v) - z).powi(2)).sum::<f64>().sqrt())
        .sum()
}

/// The geometric median of 2-D points by shrinking grid search on the convex objective: a
/// reference that shares nothing with Weiszfeld's iteration.
fn grid_search_median(points: &[Vec<f32>]) -> [f64; 2] {
    let (mut centre, mut half) = ([0.0f64, 0.0], 20.0f64);
    for _ in 0..40 {
        let mut best = (f64::INFINITY, centre);
        for i in -10..=10 {
            for j in -10..=10 {
                let z = [
                    centre[0] + half * f64::from(i) / 10.0,
                    centre[1] + half * f64::from(j) / 10.0,
                ];
                let f = summed_distance(points, &z);
                if f < best.0 {
                    best = (f, z);
                }
            }
        }
        centre = best.1;
        half /= 4.0;
    }
    centre
}

#[test]
fn geometric_median_matches_a_grid_search_of_its_objective() {
    let points =
        vec![vec![0.0, 0.0], vec![4.0, 0.0], vec![0.0, 3.0], vec![5.0, 6.0], vec![-2.0, 1.0]];
    let reference = grid_search_median(&points);
    let rfa =
        run(Aggregation::GeometricMedian { iterations: 100, smoothing: 1e-9 }, &points, 1, None);
    for (got, want) in rfa.delta.iter().zip(reference) {
        assert!((got - want).abs() < 1e-4, "Weiszfeld {:?}, grid search {reference:?}", rfa.delta);
    }
    // RFA's default three steps already take most of the way from the mean.
    let mean =
        run(Aggregation::GeometricMedian { iterations: 1, smoothing: 1e-6 }, &points, 2, None);
    let three =
        run(Aggregation::GeometricMedian { iterations: 3, smoothing: 1e-6 }, &points, 2, None);
    let optimum = summed_distance(&points, &reference);
    assert!(summed_distance(&points, &three.delta) - optimum < 0.01 * optimum);
    assert!(summed_distance(&points, &three.delta) <= summed_distance(&points, &mean.delta));
}

#[test]
fn geometric_median_stays_with_the_honest_majority() {
    let mut rng = crate::rng::SplitMix64(11);
    let mut updates: Vec<Vec<f32>> =
        (0..7).map(|_| (0..6).map(|_| 1.0 + 0.1 * (rng.unit() as f32 - 0.5)).collect()).collect();
    // Three attackers (under half) send the same huge update.
    updates.extend((0..3).map(|_| vec![1000.0f32; 6]));
    let c =
        run(Aggregation::GeometricMedian { iterations: 10, smoothing: 1e-6 }, &updates, 4, None);
    for v in &c.delta {
        assert!((v - 1.0).abs() < 0.2, "pulled to {v} by the attackers");
    }
    // The mean would be about 300.
    assert_eq!(c.selected, None);
}

#[test]
fn geometric_median_parameters_are_checked_and_defaulted() {
    let parsed: Aggregation = serde_json::from_str(r#"{"kind": "geometric_median"}"#).unwrap();
    assert_eq!(parsed, Aggregation::GeometricMedian { iterations: 3, smoothing: 1e-6 });
    assert_eq!(parsed.name(), "geometric_median");
    assert!(parsed.check(1).is_ok());
    let refused =
        |iterations, smoothing| Aggregation::GeometricMedian { iterations, smoothing }.check(3);
    assert_eq!(refused(0, 1e-6).unwrap_err(), "iterations must be in 1..=100");
    assert_eq!(refused(101, 1e-6).unwrap_err(), "iterations must be in 1..=100");
    assert_eq!(refused(3, 0.0).unwrap_err(), "smoothing must be a positive number");
    assert_eq!(refused(3, f64::NAN).unwrap_err(), "smoothing must be a positive number");
}
