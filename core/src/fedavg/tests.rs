//! Validation gates and the accumulator's exactness, including property tests.

use std::collections::BTreeMap;

use proptest::prelude::*;

use super::*;
use crate::tensor::{DType, TensorSpec};

fn schema(n: u64) -> TensorSchema {
    TensorSchema {
        tensors: vec![TensorSpec { name: "p".into(), shape: vec![n], dtype: DType::F32 }],
    }
}

fn update(values: &[f32], count: u64) -> ValidatedUpdate {
    let s = schema(values.len() as u64);
    let bytes = crate::tensor::f32_to_le_bytes(values);
    validate_parts(&s, Compression::F32, bytes, count, BTreeMap::from([("loss".to_owned(), 1.0)]))
        .unwrap()
}

#[test]
fn validation_rejects_each_bad_field() {
    let s = schema(2);
    let ok = crate::tensor::f32_to_le_bytes(&[1.0, 2.0]);
    let no_metrics = BTreeMap::new();
    assert_eq!(
        validate_parts(&s, Compression::F32, ok.clone(), 0, no_metrics.clone()),
        Err(UpdateError::ExampleCount(0))
    );
    assert!(matches!(
        validate_parts(
            &s,
            Compression::F32,
            ok.clone(),
            1,
            BTreeMap::from([("loss".to_owned(), f64::INFINITY)])
        ),
        Err(UpdateError::Metric { why: "value is not finite", .. })
    ));
    assert!(matches!(
        validate_parts(&s, Compression::F32, ok[..4].to_vec(), 1, no_metrics.clone()),
        Err(UpdateError::Tensor(TensorError::ShapeMismatch { .. }))
    ));
    let mut inf = ok.clone();
    inf[4..].copy_from_slice(&f32::NEG_INFINITY.to_le_bytes());
    assert!(matches!(
        validate_parts(&s, Compression::F32, inf, 1, no_metrics.clone()),
        Err(UpdateError::Tensor(TensorError::NonFinite { index: 1, .. }))
    ));
    assert!(validate_parts(&s, Compression::F32, ok, 1, no_metrics).is_ok());
}

#[test]
fn weighted_mean_is_exact_on_representable_values() {
    let mut acc = FedAvgAccumulator::new(3);
    acc.add(&update(&[1.0, -4.0, 0.5], 1));
    acc.add(&update(&[3.0, 4.0, 0.25], 3));
    let agg = acc.finish().unwrap();
    assert_eq!(agg.mean_delta, vec![2.5, 2.0, 0.3125]);
    assert_eq!(agg.total_weight, 4);
    assert_eq!(agg.metrics["loss"], 1.0);
    assert_eq!(agg.apply(&[1.0, 1.0, 1.0], 1.0).unwrap(), vec![3.5, 3.0, 1.3125]);
    assert_eq!(agg.apply(&[0.0, 0.0, 0.0], 0.5).unwrap(), vec![1.25, 1.0, 0.15625]);
}

#[test]
fn cancellation_does_not_lose_small_terms() {
    // A naive f64 sum returns 0 here; the compensated sum keeps the 1.0.
    let mut acc = FedAvgAccumulator::new(1);
    acc.add(&update(&[1.0e30], 1));
    acc.add(&update(&[1.0], 1));
    acc.add(&update(&[-1.0e30], 1));
    assert_eq!(acc.finish().unwrap().mean_delta, vec![1.0 / 3.0]);
}

#[test]
fn empty_and_overflowing_aggregates_are_errors() {
    assert_eq!(FedAvgAccumulator::new(1).finish(), Err(AggregateError::Empty));
    let mut acc = FedAvgAccumulator::new(1);
    acc.add(&update(&[3.0e38], 1));
    assert_eq!(acc.finish().unwrap().apply(&[3.0e38], 1.0), Err(AggregateError::NonFinite(0)));
}

proptest! {
    /// The mean matches an exact rational computation, and does not depend on arrival order.
    #[test]
    fn mean_is_exact_and_order_independent(
        rows in prop::collection::vec((prop::collection::vec(-1000i32..1000, 4), 1u64..10_000), 1..40)
    ) {
        // Values k/64 are exact in f32; integer sums are exact in i128.
        let updates: Vec<_> = rows.iter()
            .map(|(vals, w)| (vals.iter().map(|&k| k as f32 / 64.0).collect::<Vec<_>>(), *w))
            .collect();
        let mut forward = FedAvgAccumulator::new(4);
        let mut backward = FedAvgAccumulator::new(4);
        for (v, w) in &updates { forward.add(&update(v, *w)); }
        for (v, w) in updates.iter().rev() { backward.add(&update(v, *w)); }
        let (f, b) = (forward.finish().unwrap(), backward.finish().unwrap());
        prop_assert_eq!(&f.mean_delta, &b.mean_delta);
        let total: u64 = rows.iter().map(|(_, w)| w).sum();
        for j in 0..4 {
            let num: i128 = rows.iter().map(|(v, w)| i128::from(v[j]) * i128::from(*w)).sum();
            let exact = num as f64 / 64.0 / total as f64;
            prop_assert!((f.mean_delta[j] - exact).abs() <= exact.abs() * 1e-15);
        }
    }
}

/// Metrics were only checked to be finite, so one report of accuracy −1e300 could
/// drown every mean it entered; example counts were uncapped, so one device claiming 2^29
/// examples outweighed a cohort.
#[test]
fn metrics_are_bounded_and_weights_capped() {
    let s = schema(1);
    let ok = crate::tensor::f32_to_le_bytes(&[1.0]);
    for (name, value) in
        [("accuracy", -1e300), ("accuracy", 1.5), ("loss", -0.1), ("anything", 2e12)]
    {
        let metrics = BTreeMap::from([(name.to_owned(), value)]);
        assert!(
            matches!(
                validate_parts(&s, Compression::F32, ok.clone(), 1, metrics),
                Err(UpdateError::Metric { .. })
            ),
            "{name} = {value}"
        );
    }
    let fine = BTreeMap::from([("accuracy".to_owned(), 0.5), ("loss".to_owned(), 3.0)]);
    assert!(validate_parts(&s, Compression::F32, ok.clone(), 1, fine).is_ok());
    let mut acc = FedAvgAccumulator::new(1);
    acc.add(&update(&[1.0], MAX_EXAMPLE_COUNT).capped(100));
    acc.add(&update(&[-1.0], 100).capped(100));
    let agg = acc.finish().unwrap();
    assert_eq!((agg.mean_delta[0], agg.total_weight), (0.0, 200));
    assert_eq!(update(&[1.0], 7).capped(100).example_count(), 7, "below the cap nothing changes");
}

/// Metrics and partial sums are stored and exchanged as JSON; a device's reported accuracy must
/// read back as the same f64. serde_json's default float parser may be one ULP off
/// (0.22562674094707522 read back as 0.2256267409470752), which showed as a central
/// evaluation differing from what the simulator reported.
#[test]
fn metrics_survive_json_bit_for_bit() {
    let metrics = BTreeMap::from([("accuracy".to_owned(), 0.225_626_740_947_075_22_f64)]);
    let text = serde_json::to_string(&metrics).unwrap();
    let back: BTreeMap<String, f64> = serde_json::from_str(&text).unwrap();
    assert_eq!(back["accuracy"].to_bits(), metrics["accuracy"].to_bits(), "{text}");
}

proptest! {
    #[test]
    fn any_finite_metric_survives_json(bits in any::<u64>()) {
        let value = f64::from_bits(bits);
        prop_assume!(value.is_finite());
        let back: f64 = serde_json::from_str(&serde_json::to_string(&value).unwrap()).unwrap();
        prop_assert_eq!(back.to_bits(), value.to_bits());
    }
}

/// A compressed update folds exactly like the f32 update of its decoded values, so
/// compression changes what a device sends, never how the sum is made.
#[test]
fn compressed_updates_fold_as_their_decoded_values() {
    let n = 300;
    let s = schema(n as u64);
    let values: Vec<f32> = (0..n).map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0).collect();
    for compression in [
        Compression::F16,
        Compression::Bf16,
        Compression::Int8 { block: 64 },
        Compression::TopK { fraction: 0.1 },
    ] {
        let bytes = compression.encode(
            &values,
            &mut crate::rng::SplitMix64(3),
            &mut crate::compression::ErrorFeedback::default(),
        );
        let compressed = validate_parts(&s, compression, bytes, 5, BTreeMap::new()).unwrap();
        let decoded = compressed.delta().to_f32();
        let plain = update(&decoded, 5);
        for bound in [None, Some(NormBound { max_norm: 10.0, unweighted: false })] {
            let (mut a, mut b) = (
                FedAvgAccumulator::new(n).bounded(bound),
                FedAvgAccumulator::new(n).bounded(bound),
            );
            a.add(&compressed);
            a.add(&update(&values, 2));
            b.add(&plain);
            b.add(&update(&values, 2));
            let (a, b) = (a.finish().unwrap(), b.finish().unwrap());
            assert_eq!(a.mean_delta, b.mean_delta, "{compression:?} {bound:?}");
            assert_eq!(a.n_within_bound, b.n_within_bound);
        }
        // The wrong encoding for the run is refused by length, not misread.
        let f32_bytes = crate::tensor::f32_to_le_bytes(&values);
        let err = validate_parts(&s, compression, f32_bytes, 5, BTreeMap::new()).unwrap_err();
        assert!(matches!(err, UpdateError::Compression(_)), "{compression:?}: {err}");
    }
}

/// The fold loops over an encoding's runs (dense stretches, int8 blocks, top-k
/// values); the sums are the same, bit for bit, as adding each decoded value in turn, for every
/// encoding, with discounts and a norm bound, with a block that does not divide the model.
#[test]
fn the_fold_by_runs_adds_each_decoded_value_bit_for_bit() {
    let n = 20_777;
    let s = schema(n as u64);
    let encodings = [
        Compression::F32,
        Compression::F16,
        Compression::Bf16,
        Compression::Int8 { block: 100 },
        Compression::TopK { fraction: 0.01 },
    ];
    let updates: Vec<ValidatedUpdate> = encodings
        .iter()
        .enumerate()
        .map(|(k, &c)| {
            let values: Vec<f32> =
                (0..n).map(|i| ((i * (31 + k) % 997) as f32 - 498.0) * 1e-3).collect();
            let bytes = c.encode(
                &values,
                &mut crate::rng::SplitMix64(k as u64),
                &mut crate::compression::ErrorFeedback::default(),
            );
            validate_parts(&s, c, bytes, 3 + k as u64, BTreeMap::from([("loss".into(), 0.5)]))
                .unwrap()
        })
        .collect();
    let discounts = [1.0, 0.5, 1.0, 0.3, 0.9];
    for bound in [None, Some(NormBound { max_norm: 2.0, unweighted: false })] {
        let mut by_runs = FedAvgAccumulator::new(n).bounded(bound);
        for (update, discount) in updates.iter().zip(discounts) {
            by_runs.add_scaled(update, discount);
        }
        // The reference: each update decoded and added value by value, in order.
        let mut reference = FedAvgAccumulator::new(n).bounded(bound);
        for (update, discount) in updates.iter().zip(discounts) {
            let factor = reference.factor(update, discount);
            let (hi, lo) = (&mut reference.hi, &mut reference.lo);
            update
                .delta()
                .for_each(|i, v| two_sum_into(&mut hi[i], &mut lo[i], factor * f64::from(v)));
            reference.metrics.add(update.example_count(), update.metrics());
        }
        let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&by_runs.hi), bits(&reference.hi), "{bound:?}");
        assert_eq!(bits(&by_runs.lo), bits(&reference.lo), "{bound:?}");
        assert_eq!(by_runs.finish().unwrap(), reference.finish().unwrap());
    }
}

/// Folding a batch of updates tile by tile (what the accumulator thread does with
/// the uploads that queued while it folded) gives the sums of folding them one by one, bit for
/// bit: every encoding, int8 blocks and top-k values cut at tile edges, discounts, a norm
/// bound, and a partial merged between two batches.
#[test]
fn a_batch_folds_to_the_same_bits_as_one_by_one() {
    // Over two tiles, and not a multiple of the tile or of the int8 block.
    let n = 2 * FOLD_TILE + 1_234;
    let s = schema(n as u64);
    let encodings = [
        Compression::F32,
        Compression::Int8 { block: 100 },
        Compression::F16,
        Compression::TopK { fraction: 0.01 },
        Compression::Bf16,
        Compression::Int8 { block: 100 },
    ];
    let batch: Vec<(ValidatedUpdate, f64)> = encodings
        .iter()
        .enumerate()
        .map(|(k, &c)| {
            let values: Vec<f32> =
                (0..n).map(|i| ((i * (17 + k) % 991) as f32 - 495.0) * 1e-3).collect();
            let bytes = c.encode(
                &values,
                &mut crate::rng::SplitMix64(k as u64),
                &mut crate::compression::ErrorFeedback::default(),
            );
            let metrics = BTreeMap::from([("loss".into(), 0.1 * k as f64)]);
            let update = validate_parts(&s, c, bytes, 2 + k as u64, metrics).unwrap();
            (update, [1.0, 0.5, 0.25][k % 3])
        })
        .collect();
    let partial = {
        let mut acc = FedAvgAccumulator::new(n);
        acc.add(&batch[0].0);
        let sums = acc.into_partial();
        validate_partial(&s, sums).unwrap()
    };
    for bound in [None, Some(NormBound { max_norm: 3.0, unweighted: false })] {
        let (mut together, mut one_by_one) =
            (FedAvgAccumulator::new(n).bounded(bound), FedAvgAccumulator::new(n).bounded(bound));
        let (first, second) = batch.split_at(4);
        together.add_all(first.iter().map(|(u, d)| (u, *d)));
        for (update, discount) in first {
            one_by_one.add_scaled(update, *discount);
        }
        if bound.is_none() {
            together.merge(&partial);
            one_by_one.merge(&partial);
        }
        together.add_all(second.iter().map(|(u, d)| (u, *d)));
        for (update, discount) in second {
            one_by_one.add_scaled(update, *discount);
        }
        let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&together.hi), bits(&one_by_one.hi), "{bound:?}");
        assert_eq!(bits(&together.lo), bits(&one_by_one.lo), "{bound:?}");
        assert_eq!(together.finish().unwrap(), one_by_one.finish().unwrap());
    }
}

/// A round's updates summed in groups (as the coordinator stores them) and the groups merged
/// give the mean, weights, counts within the bound and metrics of the updates folded one by
/// one; and a group read back merges to the very bits the live merge made.
#[test]
fn groups_of_updates_merge_to_the_mean_of_their_updates() {
    let n = 1_000;
    let updates: Vec<ValidatedUpdate> = (0..23u64)
        .map(|k| {
            let values: Vec<f32> = (0..n)
                .map(|i| ((i as u64 * (7 + k) % 613) as f32 - 300.0) * (1.0 + k as f32) * 1e-4)
                .collect();
            update(&values, 1 + k * 3)
        })
        .collect();
    for bound in [None, Some(NormBound { max_norm: 0.5, unweighted: true })] {
        let mut one_by_one = FedAvgAccumulator::new(n).bounded(bound);
        for u in &updates {
            one_by_one.add(u);
        }
        let mut round = FedAvgAccumulator::new(n).bounded(bound);
        let mut group = round.empty_like();
        let mut stored = vec![];
        for chunk in updates.chunks(5) {
            group.add_all(chunk.iter().map(|u| (u, 1.0)));
            let sealed = group.take_group().expect("a group with updates");
            round.merge_group(&sealed.sums, sealed.n_within_bound);
            stored.push(sealed);
        }
        assert!(group.take_group().is_none(), "sealing leaves the group empty");
        let mut replayed = FedAvgAccumulator::new(n).bounded(bound);
        for sealed in &stored {
            let validated = validate_partial(&schema(n as u64), sealed.sums.clone()).unwrap();
            replayed.merge_group(validated.sums(), sealed.n_within_bound);
        }
        let (direct, grouped) = (one_by_one.finish().unwrap(), round.finish().unwrap());
        assert_eq!(replayed.finish().unwrap(), grouped, "a replay merges to the same bits");
        let as_f32 = |a: &Aggregate| a.mean_delta.iter().map(|&v| v as f32).collect::<Vec<_>>();
        assert_eq!(as_f32(&grouped), as_f32(&direct));
        assert_eq!(
            (grouped.total_weight, grouped.n_updates, grouped.n_within_bound),
            (direct.total_weight, direct.n_updates, direct.n_within_bound)
        );
        assert!(bound.is_none() || direct.n_within_bound < direct.n_updates, "the bound bit");
        assert!((grouped.metrics["loss"] - direct.metrics["loss"]).abs() < 1e-12);
    }
}
