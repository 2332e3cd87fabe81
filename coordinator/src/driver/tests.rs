//! The driver against a real (SQLite) store, through its handle as the HTTP edge uses it: what
//! is acknowledged is durable and in the sum, refusals change nothing, a restart replays, and
//! every waiting request is answered when its run ends.

use std::collections::BTreeMap;

use starling_core::codec;
use starling_core::compression::Compression;
use starling_core::fedavg::{ValidatedUpdate, validate_parts};
use starling_core::plan::Plan;
use starling_core::round::UploadRejection;
use starling_core::tensor::TensorPayload;
use starling_core::wire::CheckInResponse;
use starling_core::{DeviceId, ModelVersion, RoundIdx, RunId};

use super::*;
use crate::observe::Observer;
use crate::store::SqlStore;

const PARAMS: usize = 4;

async fn store(dir: &tempfile::TempDir) -> SqlStore {
    let url = format!("sqlite://{}", dir.path().join("driver.db").display());
    SqlStore::connect(&url, true).await.unwrap()
}

async fn started(store: &SqlStore) -> DriverHandle {
    let (driver, handle) = Driver::recover(store.clone(), Observer::new(), None).await.unwrap();
    tokio::spawn(driver.run());
    handle
}

async fn enrolled(store: &SqlStore, n: usize) -> Vec<DeviceId> {
    store.create_enrollment_token("token", 0, None, None).await.unwrap();
    let mut devices = vec![];
    for i in 0..n {
        devices.push(store.enroll_device("token", &format!("credential-{i}"), 0).await.unwrap());
    }
    devices
}

/// Two devices per round, both needed, zeros to start.
async fn create_run(handle: &DriverHandle, rounds: u32) -> RunId {
    create_run_with(handle, rounds, serde_json::json!({})).await
}

/// [`create_run`]'s plan with the fields of `more` added.
async fn create_run_with(handle: &DriverHandle, rounds: u32, more: serde_json::Value) -> RunId {
    let mut plan = serde_json::json!({
        "model": {
            "schema": {"tensors": [{"name": "w", "shape": [PARAMS], "dtype": "f32"}]},
            "init": {"kind": "zeros"}
        },
        "cohort_size": 2, "min_quorum": 2, "over_selection": 1.0, "rounds": rounds,
        "selection_timeout_secs": 60.0, "reporting_timeout_secs": 120.0,
    });
    for (field, value) in more.as_object().expect("plan fields") {
        plan[field] = value.clone();
    }
    let plan: Plan = serde_json::from_value(plan).unwrap();
    let plan = plan.validate().unwrap();
    let initial = InitialModel::new(plan.schema(), vec![0.0; PARAMS]);
    handle.call(|reply| Event::CreateRun { plan: Box::new(plan), initial, reply }).await.unwrap()
}

fn update(value: f32, examples: u64) -> ValidatedUpdate {
    let schema = starling_core::tensor::TensorSchema {
        tensors: vec![starling_core::tensor::TensorSpec {
            name: "w".into(),
            shape: vec![PARAMS as u64],
            dtype: starling_core::tensor::DType::F32,
        }],
    };
    let bytes = starling_core::tensor::f32_to_le_bytes(&[value; PARAMS]);
    validate_parts(&schema, Compression::F32, bytes, examples, BTreeMap::new()).unwrap()
}

async fn check_in(handle: &DriverHandle, device: DeviceId) -> CheckInResponse {
    let population = "default".to_owned();
    handle
        .call(|reply| Event::CheckIn { device, population, attributes: Default::default(), reply })
        .await
        .unwrap()
}

async fn upload(
    handle: &DriverHandle,
    run_id: RunId,
    device: DeviceId,
    update: ValidatedUpdate,
) -> Result<UploadAck, DriverError> {
    let (round_idx, model_version) = (RoundIdx(0), ModelVersion(0));
    handle
        .call(|reply| Event::Upload { device, run_id, round_idx, model_version, update, reply })
        .await
}

async fn committed_model(store: &SqlStore, run_id: RunId, version: i64) -> Vec<f32> {
    for _ in 0..400 {
        if let Some(bytes) = store.model(run_id, ModelVersion(version)).await.unwrap() {
            let payload: TensorPayload = codec::decode(&bytes).unwrap();
            return starling_core::tensor::f32_from_le_bytes(&payload.data);
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("model version {version} was never committed");
}

#[tokio::test]
async fn acknowledged_updates_are_durable_and_make_the_exact_mean() {
    let dir = tempfile::tempdir().unwrap();
    let store = store(&dir).await;
    let devices = enrolled(&store, 3).await;
    let handle = started(&store).await;
    let run = create_run(&handle, 1).await;
    for &d in &devices[..2] {
        assert!(matches!(check_in(&handle, d).await, CheckInResponse::Task(_)));
    }
    // The third is past the target: paced, and its upload is refused without a trace.
    assert!(matches!(check_in(&handle, devices[2]).await, CheckInResponse::ComeBackLater { .. }));
    let refused = upload(&handle, run, devices[2], update(9.0, 1)).await;
    assert_eq!(refused, Err(DriverError::Upload(UploadRejection::NotSelected)));
    let ack = upload(&handle, run, devices[0], update(1.0, 1)).await.unwrap();
    assert_eq!((ack.run_id, ack.round_idx), (run, RoundIdx(0)));
    // Durable before it was acknowledged.
    let open = store.open_round(run).await.unwrap().unwrap();
    assert_eq!(open.reported, vec![(devices[0], 0)]);
    upload(&handle, run, devices[1], update(-0.5, 3)).await.unwrap();
    // (1·1 + 3·(−0.5)) / 4
    assert_eq!(committed_model(&store, run, 1).await, vec![-0.125; PARAMS]);
    let devices_in_round = store.round_devices(run, RoundIdx(0)).await.unwrap();
    assert_eq!(devices_in_round.iter().filter(|d| d.reported.is_some()).count(), 2);
}

#[tokio::test]
async fn a_restarted_driver_replays_what_was_acknowledged() {
    let dir = tempfile::tempdir().unwrap();
    let store = store(&dir).await;
    let devices = enrolled(&store, 2).await;
    let handle = started(&store).await;
    let run = create_run(&handle, 1).await;
    for &d in &devices {
        check_in(&handle, d).await;
    }
    upload(&handle, run, devices[0], update(2.0, 1)).await.unwrap();
    drop(handle); // the driver stops with its last handle

    let handle = started(&store).await;
    let again = upload(&handle, run, devices[0], update(5.0, 1)).await;
    assert_eq!(again, Err(DriverError::Upload(UploadRejection::Duplicate)), "replayed, not lost");
    upload(&handle, run, devices[1], update(4.0, 1)).await.unwrap();
    assert_eq!(committed_model(&store, run, 1).await, vec![3.0; PARAMS]);
}

#[tokio::test]
async fn stopping_a_run_answers_and_ends_it() {
    let dir = tempfile::tempdir().unwrap();
    let store = store(&dir).await;
    let devices = enrolled(&store, 2).await;
    let handle = started(&store).await;
    let run = create_run(&handle, 3).await;
    check_in(&handle, devices[0]).await;
    handle.call(|reply| Event::StopRun { run_id: run, reply }).await.unwrap();
    assert_eq!(store.run(run).await.unwrap().unwrap().status, "stopped");
    let late = upload(&handle, run, devices[0], update(1.0, 1)).await;
    assert_eq!(late, Err(DriverError::RunNotRunning(run)));
    assert!(matches!(check_in(&handle, devices[1]).await, CheckInResponse::ComeBackLater { .. }));
}

/// Issue 18: a committed model is in the model cache, in the run's download encoding, before
/// the next round hands out its hash: the cohort's first download waits for no store read
/// (the handler takes the loading lock, as this does, and finds it).
#[tokio::test]
async fn r18_a_committed_model_is_cached_in_its_download_encoding_before_the_next_round() {
    let dir = tempfile::tempdir().unwrap();
    let store = store(&dir).await;
    let devices = enrolled(&store, 2).await;
    let handle = started(&store).await;
    let download = Compression::Int8 { block: 2 };
    let run = create_run_with(&handle, 2, serde_json::json!({"model_download": download})).await;
    for &d in &devices {
        assert!(matches!(check_in(&handle, d).await, CheckInResponse::Task(_)));
    }
    upload(&handle, run, devices[0], update(1.0, 1)).await.unwrap();
    upload(&handle, run, devices[1], update(-0.5, 3)).await.unwrap();
    let values = committed_model(&store, run, 1).await;
    let task = loop {
        match check_in(&handle, devices[0]).await {
            CheckInResponse::Task(task) if task.model_version == ModelVersion(1) => break task,
            _ => tokio::time::sleep(Duration::from_millis(10)).await,
        }
    };
    let models = handle.models();
    drop(models.loading().await);
    let stored = store.model(run, ModelVersion(1)).await.unwrap().unwrap();
    assert_eq!(models.get(&task.model_hash).as_deref(), Some(&stored[..]));
    let schema_id = codec::decode::<TensorPayload>(&stored).unwrap().schema_id;
    let key = crate::model_cache::model_download_id(&task.model_hash, download);
    let expected = crate::model_cache::download_payload(schema_id, &values, download).unwrap();
    assert_eq!(models.get(&key).as_deref(), Some(&expected[..]));
}
