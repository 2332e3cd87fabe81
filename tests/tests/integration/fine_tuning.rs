//! Training part of a model: frozen tensors that keep their values and never travel, and
//! local tensors (personalization) that each device trains and keeps, checked at the
//! coordinator's store and with real SDK devices.

use std::time::Duration;

use starling_client::Device;
use starling_client::data;
use starling_client::participant::{Outcome, Participant};
use starling_core::tensor::{TensorSchema, f32_from_le_bytes};
use starling_core::wire::{ErrorCode, UploadRequest};
use starling_core::{RoundIdx, RunId};
use starling_tests::*;

/// A frozen tensor, a shared one and a local head, as names in a plan.
fn three_part_plan() -> serde_json::Value {
    serde_json::json!({
        "model": {
            "schema": {"tensors": [
                {"name": "frozen.w", "shape": [4], "dtype": "f32"},
                {"name": "shared.w", "shape": [3], "dtype": "f32"},
                {"name": "head.w", "shape": [2], "dtype": "f32"}
            ]},
            "init": {"kind": "seeded", "seed": 3},
            "trainable": ["shared.*", "head.*"],
            "local": ["head.*"]
        },
        "cohort_size": 2, "min_quorum": 2, "over_selection": 1.0,
        "selection_timeout_secs": 30.0, "reporting_timeout_secs": 60.0, "rounds": 1,
    })
}

/// The coordinator asks for the shared tensor alone, refuses an upload carrying the frozen or
/// the local tensor, stores only the shared tensor's values, and moves only them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_update_tensors_are_uploaded_stored_and_aggregated() {
    let (_dir, db) = sqlite_db();
    let c = start_in_process(&db).await.unwrap();
    let run = RunId(c.admin.create_run(&three_part_plan()).await.unwrap().id);
    let devices = enroll(&c.url, &c.admin, 2).await.unwrap();
    let tasks = expect_tasks(&devices).await.unwrap();
    let update_schema = tasks[0].update_schema.clone().expect("a run training part of its model");
    let names = |s: &TensorSchema| s.tensors.iter().map(|t| t.name.clone()).collect::<Vec<_>>();
    assert_eq!(names(&update_schema), ["shared.w"]);
    assert_eq!(tasks[0].local_tensors, ["head.w"]);

    let upload = |schema: &TensorSchema, delta: &[f32], examples: u64| UploadRequest {
        model_version: tasks[0].model_version,
        example_count: examples,
        metrics: Default::default(),
        delta: schema.encode_f32(delta),
    };
    // The whole model's delta (frozen and local tensors in it), and the shared tensor with the
    // local head: both refused, nothing stored.
    let with_head = TensorSchema { tensors: tasks[0].schema.tensors[1..].to_vec() };
    for (schema, n) in [(&tasks[0].schema, 9), (&with_head, 5)] {
        let refused = devices[0].upload(run, RoundIdx(0), &upload(schema, &vec![0.5; n], 10)).await;
        assert_eq!(api_code(refused), Some(ErrorCode::SchemaMismatch), "{:?}", names(schema));
    }
    let contributions = [(vec![0.25, -0.5, 1.0], 10), (vec![-1.0, 0.75, 0.5], 30)];
    devices[0]
        .upload(run, RoundIdx(0), &upload(&update_schema, &contributions[0].0, 10))
        .await
        .unwrap();
    // What the store holds for the device: the shared tensor's three values, nothing else.
    let store = starling_coordinator::store::SqlStore::connect(&db, false).await.unwrap();
    let mut stored = vec![];
    store
        .for_each_update(run, RoundIdx(0), |u| {
            stored.push(u.delta);
            Ok(())
        })
        .await
        .unwrap();
    assert_eq!(stored.len(), 1);
    assert_eq!(f32_from_le_bytes(&stored[0]), contributions[0].0);
    devices[1]
        .upload(run, RoundIdx(0), &upload(&update_schema, &contributions[1].0, 30))
        .await
        .unwrap();

    let schema = &tasks[0].schema;
    let initial = model_values(&devices[0], &tasks[0].model_hash, schema).await.unwrap();
    let next = model_values(&devices[0], &wait_model(&c.admin, run, 1).await.unwrap(), schema)
        .await
        .unwrap();
    assert_eq!(next[..4], initial[..4], "the frozen tensor keeps its initial values");
    assert_eq!(next[7..], initial[7..], "the local head is not the coordinator's to move");
    assert_eq!(next[4..7], fedavg_expected(&initial[4..7], &contributions));
    c.running.shutdown().await.unwrap();
}

/// SDK devices train the digits MLP with its first layer frozen and its output layer local:
/// the coordinator's models keep the frozen and the local layer's initial values through every
/// round, while the hidden layer trains; each device keeps a head of its own, trained, which
/// it evaluates with.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sdk_devices_freeze_what_the_plan_freezes_and_keep_their_heads() {
    let (_dir, db) = sqlite_db();
    let c = start_in_process(&db).await.unwrap();
    let digits = data::digits(&shared_data().join("sklearn_digits")).unwrap();
    let mut plan = mlp_plan(digits.input(), 2, 3);
    // flatten, linear (1), relu, linear (3), relu, linear (5)
    plan["model"]["trainable"] = serde_json::json!(["layers.3.*", "layers.5.*"]);
    plan["model"]["local"] = serde_json::json!(["layers.5.*"]);
    let run = RunId(c.admin.create_run(&plan).await.unwrap().id);
    let token = c.admin.enrollment_token(2).await.unwrap();
    let mut devices = vec![];
    for k in 0..2 {
        let shard = digits.subset(&(k * 400..(k + 1) * 400).collect::<Vec<_>>());
        let (train, hold) = shard.split_holdout(0.2, k as u64);
        let mut p = Participant::new(&c.url, "default", train, hold, Device::flex().autodiff());
        p.enroll(&token).await.unwrap();
        devices.push(tokio::spawn(async move {
            let mut uploaded = 0;
            while uploaded < 3 {
                match p.participate(Box::new(|_| {})).await.unwrap() {
                    Outcome::Uploaded { .. } => uploaded += 1,
                    Outcome::ComeBackLater(_) | Outcome::RoundMissed { .. } => {
                        tokio::time::sleep(Duration::from_millis(100)).await
                    }
                    other => panic!("a training run open to every device: {other:?}"),
                }
            }
            p
        }));
    }
    let mut participants = vec![];
    for d in devices {
        participants.push(d.await.unwrap());
    }
    let schema = plan_schema(&plan);
    let observer = enroll(&c.url, &c.admin, 1).await.unwrap().remove(0);
    let initial = model_values(&observer, &wait_model(&c.admin, run, 0).await.unwrap(), &schema)
        .await
        .unwrap();
    let last = model_values(&observer, &wait_model(&c.admin, run, 3).await.unwrap(), &schema)
        .await
        .unwrap();
    let range = |prefix| layer_range(&schema, prefix);
    let (frozen, hidden, head) = (range("layers.1."), range("layers.3."), range("layers.5."));
    assert_eq!(last[frozen.clone()], initial[frozen], "the frozen layer keeps its values");
    assert_eq!(last[head.clone()], initial[head.clone()], "no device sent its head");
    assert_ne!(last[hidden.clone()], initial[hidden], "the hidden layer trains");

    let heads: Vec<Vec<f32>> = participants
        .iter()
        .map(|p| {
            let part = p.state().local_parts.iter().find(|l| l.run_id == run).expect("a head kept");
            part.tensors.iter().flat_map(|t| f32_from_le_bytes(&t.values)).collect()
        })
        .collect();
    assert_eq!(heads[0].len(), head.len());
    assert_ne!(heads[0], initial[head.clone()], "a device trains its head");
    assert_ne!(heads[0], heads[1], "each device has its own head");
    c.running.shutdown().await.unwrap();
}

/// Where the tensors named `prefix...` (adjacent in the schema) lie in a flat model.
fn layer_range(schema: &TensorSchema, prefix: &str) -> std::ops::Range<usize> {
    let (mut start, mut end) = (None, 0);
    let mut offset = 0;
    for t in &schema.tensors {
        let n = t.numel() as usize;
        if t.name.starts_with(prefix) {
            start.get_or_insert(offset);
            end = offset + n;
        }
        offset += n;
    }
    start.expect("the prefix names a layer")..end
}

/// The schema a plan's spec gives.
fn plan_schema(plan: &serde_json::Value) -> TensorSchema {
    let spec: starling_core::model_spec::ModelSpec =
        serde_json::from_value(plan["model"]["spec"].clone()).unwrap();
    spec.schema().unwrap()
}
