//! Server optimizers end to end (issue 17): a run with FedAdam whose coordinator is SIGKILLed
//! between rounds commits, to the bit, the models of the uninterrupted sequence of optimizer
//! steps, because the optimizer's state is committed with each model and restored on start.

use std::path::Path;

use starling_client::protocol::{AdminClient, FleetClient};
use starling_core::fedavg::{FedAvgAccumulator, validate_parts};
use starling_core::strategy::{AdaptiveParams, ServerOptimizer};
use starling_core::tensor::{DType, TensorSchema, TensorSpec};
use starling_core::{RoundIdx, RunId};
use starling_tests::*;

const PARAMS: usize = 1_000;
const DEVICES: usize = 4;

/// Every device uploads its fixed delta for `round`; returns the hash of the model it makes.
async fn one_round(admin: &AdminClient, devices: &[FleetClient], run: RunId, round: i64) -> String {
    wait_round_open(admin, run, round).await.unwrap();
    let tasks = expect_tasks(devices).await.unwrap();
    for (i, (d, t)) in devices.iter().zip(&tasks).enumerate() {
        let request = upload_request(t, &delta(i, round, PARAMS), weight(i));
        d.upload(run, RoundIdx(round), &request).await.unwrap();
    }
    wait_model(admin, run, round + 1).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r17_a_restarted_fed_adam_run_commits_the_uninterrupted_models() {
    let optimizer =
        ServerOptimizer::FedAdam(AdaptiveParams { lr: 0.05, beta1: 0.9, beta2: 0.99, tau: 1e-3 });
    let (_dir, db) = sqlite_db();
    let bin = Path::new(env!("CARGO_BIN_EXE_coordinator_under_test"));
    let logs = tempfile::tempdir().unwrap();
    let log = logs.path().join("coordinator.log");
    let listen = free_addr();
    let mut child = ChildCoordinator::spawn(bin, &db, listen, &log).await.unwrap();
    let admin = AdminClient::new(&child.url, OPERATOR_TOKEN);
    let devices = enroll(&child.url, &admin, DEVICES).await.unwrap();
    let spec = PlanSpec {
        params: PARAMS as u64,
        cohort: DEVICES as u32,
        over_selection: 1.0,
        quorum: DEVICES as u32,
        selection_secs: 60.0,
        reporting_secs: 120.0,
        rounds: 3,
    };
    let mut plan = spec.json();
    plan["strategy"] = serde_json::json!({"optimizer": optimizer});
    let run = RunId(admin.create_run(&plan).await.unwrap().id);
    assert_eq!(admin.run(run).await.unwrap().plan["strategy"]["optimizer"]["kind"], "fed_adam");
    let initial = admin.models(run).await.unwrap()[0].content_hash.clone();
    let mut hashes = vec![];
    for round in 0..2 {
        hashes.push(one_round(&admin, &devices, run, round).await);
    }
    // SIGKILL with the third round open: the moments after model 2 are only in the store.
    wait_round_open(&admin, run, 2).await.unwrap();
    child.kill().unwrap();
    let child = ChildCoordinator::spawn(bin, &db, listen, &log).await.unwrap();
    hashes.push(one_round(&admin, &devices, run, 2).await);

    // The same steps, uninterrupted, on the same updates.
    let schema = TensorSchema {
        tensors: vec![TensorSpec {
            name: "w".into(),
            shape: vec![PARAMS as u64],
            dtype: DType::F32,
        }],
    };
    let mut model = model_values(&devices[0], &initial, &schema).await.unwrap();
    let mut state = optimizer.initial_state(PARAMS);
    for (round, hash) in hashes.iter().enumerate() {
        let mut acc = FedAvgAccumulator::new(PARAMS);
        for i in 0..DEVICES {
            let bytes = starling_core::tensor::f32_to_le_bytes(&delta(i, round as i64, PARAMS));
            let metrics = [("loss".to_owned(), 1.0 / weight(i) as f64)].into();
            acc.add(&validate_parts(&schema, bytes, weight(i), metrics).unwrap());
        }
        (model, state) = optimizer.step(&model, &acc.finish().unwrap(), &state, 1.0).unwrap();
        let got = model_values(&devices[0], hash, &schema).await.unwrap();
        assert!(got == model, "model version {} differs from the uninterrupted steps", round + 1);
    }
    // Not FedAvg in disguise: plain FedAvg on the same updates ends elsewhere.
    let fed_avg = ServerOptimizer::default();
    let mut plain = model_values(&devices[0], &initial, &schema).await.unwrap();
    for round in 0..3 {
        let mut acc = FedAvgAccumulator::new(PARAMS);
        for i in 0..DEVICES {
            let bytes = starling_core::tensor::f32_to_le_bytes(&delta(i, round, PARAMS));
            acc.add(&validate_parts(&schema, bytes, weight(i), Default::default()).unwrap());
        }
        plain = fed_avg.step(&plain, &acc.finish().unwrap(), &Default::default(), 1.0).unwrap().0;
    }
    assert!(plain != model);
    drop(child);
}
