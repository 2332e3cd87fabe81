//! Assignment stability, ticket checks, and partial sums that merge to the single-node result.

use std::collections::BTreeMap;

use super::*;
use crate::compression::Compression;
use crate::fedavg::{FedAvgAccumulator, validate_parts};
use crate::rng::SplitMix64;
use crate::tensor::{DType, TensorSpec};

fn schema(n: u64) -> TensorSchema {
    TensorSchema {
        tensors: vec![TensorSpec { name: "w".into(), shape: vec![n], dtype: DType::F32 }],
    }
}

#[test]
fn losing_an_aggregator_moves_only_its_devices() {
    let all: Vec<AggregatorId> = (1..=4).map(AggregatorId).collect();
    let without_2: Vec<AggregatorId> = all.iter().copied().filter(|a| a.0 != 2).collect();
    let mut per_aggregator = BTreeMap::new();
    for d in 0..4000 {
        let device = DeviceId(d);
        let before = assign(device, &all).unwrap();
        *per_aggregator.entry(before).or_insert(0) += 1;
        let after = assign(device, &without_2).unwrap();
        if before.0 != 2 {
            assert_eq!(before, after, "device {d} moved although its aggregator lives");
        }
        assert_ne!(after.0, 2);
    }
    // Roughly even: each of 4 gets 1000 ± 15 %.
    for (a, n) in per_aggregator {
        assert!((850..=1150).contains(&n), "aggregator {a} got {n} of 4000 devices");
    }
    assert_eq!(assign(DeviceId(1), &[]), None);
}

#[test]
fn a_ticket_is_good_for_its_grant_only() {
    let key = TicketKey::derive(b"cluster secret");
    let grant = UploadGrant {
        run_id: RunId(1),
        round_idx: RoundIdx(2),
        model_version: ModelVersion(3),
        device: DeviceId(44),
        aggregator: AggregatorId(5),
    };
    let ticket = key.ticket(&grant);
    let check = |header: &str, round: i64, version: i64, agg: u32| {
        key.verify(header, RunId(1), RoundIdx(round), ModelVersion(version), AggregatorId(agg))
    };
    assert_eq!(check(&ticket, 2, 3, 5), Some(DeviceId(44)));
    assert_eq!(check(&ticket, 3, 3, 5), None, "another round");
    assert_eq!(check(&ticket, 2, 4, 5), None, "another model version");
    assert_eq!(check(&ticket, 2, 3, 6), None, "another aggregator");
    let forged = ticket.replacen("44:", "45:", 1);
    assert_eq!(check(&forged, 2, 3, 5), None, "another device");
    assert_eq!(check("44:zz", 2, 3, 5), None);
    assert_eq!(check("garbage", 2, 3, 5), None);
    let other_key = TicketKey::derive(b"another secret");
    assert_eq!(
        other_key.verify(&ticket, RunId(1), RoundIdx(2), ModelVersion(3), AggregatorId(5)),
        None
    );
}

#[test]
fn partials_merge_to_the_single_node_result_bit_for_bit() {
    let n = 5000;
    let schema = schema(n);
    let mut rng = SplitMix64(7);
    let updates: Vec<_> = (0..60)
        .map(|i| {
            let delta: Vec<f32> = (0..n).map(|_| (rng.unit() as f32 - 0.5) * 1e-2).collect();
            let mut metrics = BTreeMap::new();
            metrics.insert("loss".to_string(), rng.unit());
            validate_parts(
                &schema,
                Compression::F32,
                crate::tensor::f32_to_le_bytes(&delta),
                1 + (i * 37 % 500) as u64,
                metrics,
            )
            .unwrap()
        })
        .collect();
    let mut single = FedAvgAccumulator::new(n as usize);
    updates.iter().for_each(|u| single.add(u));

    // Three shards, reported over the wire, merged into a coordinator that also took direct
    // uploads.
    let mut coordinator = FedAvgAccumulator::new(n as usize);
    let mut shards = vec![FedAvgAccumulator::new(n as usize); 3];
    for (i, u) in updates.iter().enumerate() {
        match i % 4 {
            3 => coordinator.add(u),
            s => shards[s].add(u),
        }
    }
    for (s, shard) in shards.into_iter().enumerate() {
        let devices: Vec<DeviceId> =
            (0..60i64).filter(|i| *i as usize % 4 == s).map(DeviceId).collect();
        let report = PartialReport::new(
            ModelVersion(0),
            schema.schema_id(),
            vec![AggregatorId(s as u32)],
            devices,
            shard.into_partial(),
        );
        let report: PartialReport =
            crate::codec::decode(&crate::codec::to_vec(&report).unwrap()).unwrap();
        coordinator.merge(&report.validate(&schema).unwrap());
    }
    let global = vec![0.25f32; n as usize];
    let a = single.finish().unwrap();
    let b = coordinator.finish().unwrap();
    assert_eq!(a.total_weight, b.total_weight);
    assert_eq!(a.n_updates, b.n_updates);
    assert_eq!(a.apply(&global, 1.0).unwrap(), b.apply(&global, 1.0).unwrap());
    let (la, lb) = (a.metrics["loss"], b.metrics["loss"]);
    assert!((la - lb).abs() < 1e-12, "{la} vs {lb}");
}

#[test]
fn bad_partials_are_refused_with_the_reason() {
    let schema = schema(4);
    let mut acc = FedAvgAccumulator::new(4);
    acc.add(&validate_parts(&schema, Compression::F32, vec![0; 16], 3, BTreeMap::new()).unwrap());
    let good = PartialReport::new(
        ModelVersion(0),
        schema.schema_id(),
        vec![AggregatorId(1)],
        vec![DeviceId(9)],
        acc.into_partial(),
    );
    assert!(good.validate(&schema).is_ok());
    let bad = |f: &dyn Fn(&mut PartialReport)| {
        let mut p = good.clone();
        f(&mut p);
        p.validate(&schema).unwrap_err()
    };
    assert_eq!(
        bad(&|p| p.schema_id = self::schema(5).schema_id()),
        PartialReportError::SchemaMismatch
    );
    assert_eq!(bad(&|p| p.devices = vec![]), PartialReportError::BadList("device"));
    assert_eq!(
        bad(&|p| p.devices = vec![DeviceId(1), DeviceId(1)]),
        PartialReportError::BadList("device")
    );
    assert_eq!(bad(&|p| p.aggregators = vec![]), PartialReportError::BadList("aggregator"));
    assert_eq!(bad(&|p| p.sum_hi.pop().map(drop).unwrap_or(())), PartialReportError::Ragged);
    assert!(matches!(
        bad(&|p| p.sum_hi.truncate(24)),
        PartialReportError::Sums(PartialError::Length { expected: 4, got: 3 })
    ));
    assert!(matches!(
        bad(&|p| p.sum_lo[8..16].copy_from_slice(&f64::NAN.to_le_bytes())),
        PartialReportError::Sums(PartialError::NonFinite(1))
    ));
    assert!(matches!(
        bad(&|p| p.total_weight = 0),
        PartialReportError::Sums(PartialError::Counts(_))
    ));
    assert!(matches!(
        bad(&|p| {
            p.metrics.insert("loss".into(), (f64::INFINITY, 1));
        }),
        PartialReportError::Sums(PartialError::Metric(_))
    ));
}

/// Three shards' reports, for the merge tests: (schema, single-node accumulator, reports).
fn three_shard_reports() -> (TensorSchema, FedAvgAccumulator, Vec<PartialReport>) {
    let n = 3000;
    let schema = schema(n);
    let mut rng = SplitMix64(11);
    let mut single = FedAvgAccumulator::new(n as usize);
    let mut shards = vec![FedAvgAccumulator::new(n as usize); 3];
    for i in 0..45 {
        let delta: Vec<f32> = (0..n).map(|_| (rng.unit() as f32 - 0.5) * 1e-2).collect();
        let metrics = BTreeMap::from([("loss".to_string(), rng.unit())]);
        let bytes = crate::tensor::f32_to_le_bytes(&delta);
        let u =
            validate_parts(&schema, Compression::F32, bytes, 1 + (i * 53 % 400) as u64, metrics)
                .unwrap();
        single.add(&u);
        shards[i % 3].add(&u);
    }
    let reports = shards
        .into_iter()
        .enumerate()
        .map(|(s, shard)| {
            let devices = (0..45i64).filter(|i| *i as usize % 3 == s).map(DeviceId).collect();
            let aggregator = vec![AggregatorId(s as u32 + 1)];
            PartialReport::new(
                ModelVersion(4),
                schema.schema_id(),
                aggregator,
                devices,
                shard.into_partial(),
            )
        })
        .collect();
    (schema, single, reports)
}

#[test]
fn a_groups_merged_report_commits_the_single_node_model() {
    let (schema, single, mut reports) = three_shard_reports();
    // Arrival order does not matter: the leader merges in aggregator order.
    reports.swap(0, 2);
    let merged = merge_reports(&schema, &reports).unwrap();
    reports.swap(0, 1);
    assert_eq!(merge_reports(&schema, &reports).unwrap(), merged);
    assert_eq!(merged.aggregators, vec![AggregatorId(1), AggregatorId(2), AggregatorId(3)]);
    assert_eq!(merged.devices.len(), 45);

    let mut coordinator = FedAvgAccumulator::new(3000);
    coordinator.merge(&merged.validate(&schema).unwrap());
    let global = vec![-0.5f32; 3000];
    let (a, b) = (single.finish().unwrap(), coordinator.finish().unwrap());
    assert_eq!(a.total_weight, b.total_weight);
    assert_eq!(a.apply(&global, 1.0).unwrap(), b.apply(&global, 1.0).unwrap());
}

#[test]
fn a_group_merge_refuses_what_it_cannot_speak_for() {
    let (schema, _, reports) = three_shard_reports();
    assert_eq!(merge_reports(&schema, &[]), Err(PartialReportError::BadList("aggregator")));
    let mut stale = reports.clone();
    stale[1].model_version = ModelVersion(3);
    assert_eq!(merge_reports(&schema, &stale), Err(PartialReportError::ModelVersion));
    let mut twice = reports.clone();
    twice[2].devices[0] = twice[0].devices[0];
    assert_eq!(merge_reports(&schema, &twice), Err(PartialReportError::BadList("device")));
    let mut same_node = reports.clone();
    same_node[2].aggregators = same_node[0].aggregators.clone();
    assert_eq!(merge_reports(&schema, &same_node), Err(PartialReportError::BadList("aggregator")));
    let mut other_schema = reports;
    other_schema[1].schema_id = self::schema(7).schema_id();
    assert_eq!(merge_reports(&schema, &other_schema), Err(PartialReportError::SchemaMismatch));
}

/// What an NCCL all-reduce of the members' sums computes: high and low parts summed apart.
fn summed_apart(reports: &[PartialReport]) -> (Vec<f64>, Vec<f64>) {
    let (mut hi, mut lo) = reports[0].sums().unwrap();
    for r in &reports[1..] {
        let (h, l) = r.sums().unwrap();
        hi.iter_mut().zip(&h).for_each(|(a, b)| *a += b);
        lo.iter_mut().zip(&l).for_each(|(a, b)| *a += b);
    }
    (hi, lo)
}

#[test]
fn a_collective_groups_report_speaks_for_every_member() {
    let (schema, single, reports) = three_shard_reports();
    let exact = merge_reports(&schema, &reports).unwrap();
    let metadata: Vec<PartialReport> =
        reports.iter().rev().map(PartialReport::without_sums).collect();
    for m in &metadata {
        assert_eq!(m.validate_metadata(&schema), Ok(()));
        assert!(m.sum_hi.is_empty() && m.sum_lo.is_empty());
    }
    let (hi, lo) = summed_apart(&reports);
    let merged = merge_collective(&schema, &metadata, hi, lo).unwrap();
    // Everything but the sums is what the exact merge says, arrival order notwithstanding.
    assert_eq!(merged.aggregators, exact.aggregators);
    assert_eq!(merged.devices, exact.devices);
    assert_eq!(merged.total_weight, exact.total_weight);
    assert_eq!(merged.metrics, exact.metrics);
    // The sums agree to within the rounding of adding three high parts in f64.
    let (a, b) = (merged.sums().unwrap(), exact.sums().unwrap());
    let largest =
        reports.iter().flat_map(|r| r.sums().unwrap().0).fold(0f64, |m, x| m.max(x.abs()));
    for i in 0..a.0.len() {
        let diff = ((a.0[i] + a.1[i]) - (b.0[i] + b.1[i])).abs();
        assert!(diff <= 2.0 * f64::EPSILON * largest, "parameter {i}: {diff}");
    }
    // And the model the coordinator commits from it is the single node's, to f32 resolution.
    let mut coordinator = FedAvgAccumulator::new(3000);
    coordinator.merge(&merged.validate(&schema).unwrap());
    let global = vec![-0.5f32; 3000];
    let single = single.finish().unwrap().apply(&global, 1.0).unwrap();
    let grouped = coordinator.finish().unwrap().apply(&global, 1.0).unwrap();
    for (x, y) in single.iter().zip(&grouped) {
        assert!((x - y).abs() <= x.abs() * f32::EPSILON, "{x} vs {y}");
    }
}

#[test]
fn a_collective_merge_refuses_what_it_cannot_speak_for() {
    let (schema, _, reports) = three_shard_reports();
    let metadata: Vec<PartialReport> = reports.iter().map(PartialReport::without_sums).collect();
    let (hi, lo) = summed_apart(&reports);
    // Sums that came along anyway, a repeated device, a short collective result.
    assert_eq!(reports[0].validate_metadata(&schema), Err(PartialReportError::Ragged));
    let mut twice = metadata.clone();
    let repeated = twice[0].devices[0];
    twice[1].devices.push(repeated);
    assert_eq!(
        merge_collective(&schema, &twice, hi.clone(), lo.clone()),
        Err(PartialReportError::BadList("device"))
    );
    let mut heavy = metadata.clone();
    heavy[2].total_weight = 0;
    assert!(matches!(
        merge_collective(&schema, &heavy, hi.clone(), lo.clone()),
        Err(PartialReportError::Sums(PartialError::Counts(_)))
    ));
    assert!(matches!(
        merge_collective(&schema, &metadata, hi[1..].to_vec(), lo.clone()),
        Err(PartialReportError::Sums(PartialError::Length { .. }))
    ));
    let mut stale = metadata;
    stale[0].model_version = ModelVersion(1);
    assert_eq!(merge_collective(&schema, &stale, hi, lo), Err(PartialReportError::ModelVersion));
}

#[test]
fn group_names_and_rendezvous_documents_are_checked() {
    for good in ["gpu-rack-7", "a", "A.b_c-9"] {
        assert_eq!(validate_group_name(good), Ok(()), "{good}");
    }
    for bad in ["", "with space", "slash/y", "ü", &"x".repeat(MAX_GROUP_NAME + 1)] {
        assert_eq!(validate_group_name(bad), Err(GroupError::BadName), "{bad:?}");
    }
    let good = GroupRendezvous {
        leader: AggregatorId(1),
        leader_url: "http://10.0.0.1:9090".into(),
        world_size: 4,
        nccl_id: Some(vec![7; 128]),
    };
    assert_eq!(good.validate(), Ok(()));
    let round_trip: GroupRendezvous =
        crate::codec::decode(&crate::codec::to_vec(&good).unwrap()).unwrap();
    assert_eq!(round_trip, good);
    let with = |f: &dyn Fn(&mut GroupRendezvous)| {
        let mut r = good.clone();
        f(&mut r);
        r.validate()
    };
    assert_eq!(with(&|r| r.world_size = 1), Err(GroupError::BadWorldSize(1)));
    assert_eq!(with(&|r| r.leader_url = "ftp://x".into()), Err(GroupError::BadLeaderUrl));
    assert_eq!(with(&|r| r.nccl_id = Some(vec![0; 12])), Err(GroupError::BadNcclId(12)));
    assert_eq!(with(&|r| r.nccl_id = None), Ok(()));
}
