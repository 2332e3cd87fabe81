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
use starling_core::wire::{CheckInResponse, TaskAssignment};
use starling_core::{DeviceId, ModelVersion, RoundIdx, RunId};

use super::*;
use crate::observe::Observer;
use crate::store::{SqlStore, StoreError};

const PARAMS: usize = 4;

/// The URL of the test's SQLite file in `dir`.
fn db_url(dir: &tempfile::TempDir) -> String {
    format!("sqlite://{}", dir.path().join("driver.db").display())
}

async fn store(dir: &tempfile::TempDir) -> SqlStore {
    SqlStore::connect(&db_url(dir), true).await.unwrap()
}

async fn started(store: &SqlStore) -> Started {
    let (driver, handle) = Driver::recover(store.clone(), Observer::new(), None).await.unwrap();
    Started { handle, task: tokio::spawn(driver.run()) }
}

/// A driver on its own task, used through its handle.
struct Started {
    handle: DriverHandle,
    task: tokio::task::JoinHandle<()>,
}

impl std::ops::Deref for Started {
    type Target = DriverHandle;
    fn deref(&self) -> &DriverHandle {
        &self.handle
    }
}

impl Started {
    /// Drops the last handle and waits for the driver, and the writes it had queued, to end:
    /// a driver started after this one never races its predecessor's writes.
    async fn stop(self) {
        drop(self.handle);
        tokio::time::timeout(Duration::from_secs(30), self.task)
            .await
            .expect("the driver ends within 30 s of its last handle")
            .expect("the driver does not panic");
    }
}

async fn enrolled(store: &SqlStore, n: usize) -> Vec<DeviceId> {
    store.create_enrollment_token("token", 0, None, None, None).await.unwrap();
    let mut devices = vec![];
    for i in 0..n {
        devices
            .push(store.enroll_device("token", &format!("credential-{i}"), None, 0).await.unwrap());
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
        .call(|reply| Event::Upload {
            device,
            run_id,
            round_idx,
            model_version,
            update,
            hold: None,
            reply,
        })
        .await
}

/// Checks both devices in and has them report round 0 (1.0 × 1 example and −0.5 × 3: the
/// mean is −0.125).
async fn both_report(handle: &DriverHandle, run: RunId, devices: &[DeviceId]) {
    for &d in devices {
        assert!(matches!(check_in(handle, d).await, CheckInResponse::Task(_)));
    }
    upload(handle, run, devices[0], update(1.0, 1)).await.unwrap();
    upload(handle, run, devices[1], update(-0.5, 3)).await.unwrap();
}

async fn committed_model(store: &SqlStore, run_id: RunId, version: i64) -> Vec<f32> {
    eventually(&format!("model version {version} committed"), async || {
        match store.model(run_id, ModelVersion(version)).await {
            Ok(Some(bytes)) => Some(model_values(&bytes)),
            // Not committed yet, or committed and its bytes on their way.
            Ok(None) | Err(StoreError::ModelPending { .. }) => None,
            Err(e) => panic!("reading model version {version}: {e}"),
        }
    })
    .await
}

/// How long a test waits for the driver to get somewhere before it fails.
const WAIT: Duration = Duration::from_secs(10);

/// What `probe` finds, asked again every 10 ms; fails the test when it finds nothing within
/// [`WAIT`]. The store and the model cache publish no events, so this polls them, bounded.
async fn eventually<T>(what: &str, mut probe: impl AsyncFnMut() -> Option<T>) -> T {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        if let Some(found) = probe().await {
            return found;
        }
        assert!(tokio::time::Instant::now() < deadline, "not within {WAIT:?}: {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// `device`'s task in round `round`, once the driver hands it out.
async fn task_in_round(handle: &DriverHandle, device: DeviceId, round: i64) -> TaskAssignment {
    eventually(&format!("a task in round {round}"), async || match check_in(handle, device).await {
        CheckInResponse::Task(task) if task.round_idx == RoundIdx(round) => Some(task),
        _ => None,
    })
    .await
}

fn model_values(encoded: &[u8]) -> Vec<f32> {
    let payload: TensorPayload = codec::decode(encoded).unwrap();
    starling_core::tensor::f32_from_le_bytes(&payload.data)
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
    handle.stop().await;

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

/// A committed model is in the model cache, in the run's download encoding, before
/// the next round hands out its hash: the cohort's first download waits for no store read
/// (the handler takes the loading lock, as this does, and finds it).
#[tokio::test]
async fn a_committed_model_is_cached_in_its_download_encoding_before_the_next_round() {
    let dir = tempfile::tempdir().unwrap();
    let store = store(&dir).await;
    let devices = enrolled(&store, 2).await;
    let handle = started(&store).await;
    let download = Compression::Int8 { block: 2 };
    let run = create_run_with(&handle, 2, serde_json::json!({"model_download": download})).await;
    both_report(&handle, run, &devices).await;
    let values = committed_model(&store, run, 1).await;
    let task = task_in_round(&handle, devices[0], 1).await;
    assert_eq!(task.model_version, ModelVersion(1));
    let models = handle.models();
    drop(models.loading().await);
    let stored = store.model(run, ModelVersion(1)).await.unwrap().unwrap();
    assert_eq!(models.get(&task.model_hash).as_deref(), Some(&stored[..]));
    let schema_id = codec::decode::<TensorPayload>(&stored).unwrap().schema_id;
    let key = crate::model_cache::model_download_id(&task.model_hash, download);
    let expected = crate::model_cache::download_payload(schema_id, &values, download).unwrap();
    assert_eq!(models.get(&key).as_deref(), Some(&expected[..]));
}

/// A connection of its own to the test's SQLite file, for what the store does not do: a
/// trigger that makes a write fail, a tampered row.
async fn raw_sql(dir: &tempfile::TempDir, statement: &str) -> sqlx::SqliteConnection {
    use sqlx::Connection;
    let mut sql = sqlx::SqliteConnection::connect(&db_url(dir)).await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(statement)).execute(&mut sql).await.unwrap();
    sql
}

/// Makes every write of a committed model's bytes fail, until dropped again.
const HOLD_MODEL_BYTES: &str = "CREATE TRIGGER hold_model_bytes BEFORE UPDATE OF data ON models
    BEGIN SELECT RAISE(ABORT, 'the test holds the model bytes back'); END";

/// A round committed by its model's hash whose bytes never reached the store: the first
/// coordinator's runtime (on which its driver and close tasks run) is dropped while a trigger
/// makes every write of the bytes fail, as if the process had been killed between the commit
/// and the write. Returns the run and the committed model's hash and bytes as the first
/// coordinator served them.
async fn commit_whose_model_bytes_were_lost(
    dir: &tempfile::TempDir,
    store: &SqlStore,
) -> (RunId, String, bytes::Bytes) {
    let mut sql = raw_sql(dir, HOLD_MODEL_BYTES).await;
    let url = db_url(dir);
    let devices = enrolled(store, 2).await;
    let first = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build();
    let first = first.unwrap();
    let handle = first
        .spawn(async move {
            let store = SqlStore::connect(&url, false).await.unwrap();
            let (driver, handle) = Driver::recover(store, Observer::new(), None).await.unwrap();
            tokio::spawn(driver.run());
            handle
        })
        .await
        .unwrap();
    let run = create_run(&handle, 2).await;
    both_report(&handle, run, &devices).await;
    let hash = committed_hash(store, run, 1).await;
    // Cached by the close task right after the commit, before the driver hears of it.
    let served = eventually("the model cached", async || handle.models().get(&hash)).await;
    assert!(matches!(
        store.model(run, ModelVersion(1)).await,
        Err(StoreError::ModelPending { version: 1, .. })
    ));
    first.shutdown_background();
    drop(handle);
    sqlx::query("DROP TRIGGER hold_model_bytes").execute(&mut sql).await.unwrap();
    (run, hash, served)
}

/// A model committed by its hash whose bytes a stop lost is rebuilt at the next
/// start from the round's kept updates, to the bit, and the run goes on from it.
#[tokio::test]
async fn a_committed_model_whose_bytes_a_stop_lost_is_rebuilt_from_its_round() {
    let dir = tempfile::tempdir().unwrap();
    let store = store(&dir).await;
    let (run, hash, served) = commit_whose_model_bytes_were_lost(&dir, &store).await;
    assert_eq!(store.for_each_update(run, RoundIdx(0), |_| Ok(())).await.unwrap(), 2, "kept");
    assert_eq!(store.release_closed_payloads().await.unwrap(), 0);

    let handle = started(&store).await;
    let rebuilt = store.model(run, ModelVersion(1)).await.unwrap().expect("rebuilt at start");
    assert_eq!(rebuilt, &served[..]);
    // (1·1 + 3·(−0.5)) / 4
    assert_eq!(model_values(&rebuilt), vec![-0.125; PARAMS]);
    assert_eq!(store.release_closed_payloads().await.unwrap(), 1);
    assert_eq!(store.for_each_update(run, RoundIdx(0), |_| Ok(())).await.unwrap(), 0);
    let device = store.devices().await.unwrap()[0].0;
    match check_in(&handle, device).await {
        CheckInResponse::Task(task) => {
            assert_eq!((task.model_version, task.model_hash), (ModelVersion(1), hash));
        }
        other => panic!("round 1 should take the device: {other:?}"),
    }
}

/// A rebuild that does not hash as the commit recorded (here the stored weight of the
/// round's updates was altered) is refused as corruption and writes nothing; its run stops
/// saying so, and the coordinator starts (it used to refuse to start at all).
#[tokio::test]
async fn a_rebuilt_model_that_differs_from_its_commit_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let store = store(&dir).await;
    let (run, hash, _) = commit_whose_model_bytes_were_lost(&dir, &store).await;
    raw_sql(&dir, "UPDATE update_groups SET total_weight = total_weight + 4").await;
    let started = Driver::recover(store.clone(), Observer::new(), None).await;
    assert!(started.is_ok(), "the coordinator starts: {:?}", started.err());
    let row = store.run(run).await.unwrap().unwrap();
    let reason = row.stop_reason.unwrap_or_default();
    assert_eq!(row.status, "stopped");
    assert!(reason.contains("cannot be rebuilt") && reason.contains(&hash), "{reason}");
    assert!(matches!(
        store.model(run, ModelVersion(1)).await,
        Err(StoreError::ModelPending { version: 1, .. })
    ));
}

/// An upload is folded as its write begins; when the write fails (here a trigger
/// refuses it), the device hears `Unavailable` and the round commits the mean of what is
/// durable only, read back from the store, to the bit.
#[tokio::test]
async fn an_update_folded_before_its_write_failed_is_not_in_the_committed_model() {
    let dir = tempfile::tempdir().unwrap();
    let store = store(&dir).await;
    raw_sql(
        &dir,
        "CREATE TRIGGER refuse_nine_examples BEFORE INSERT ON updates WHEN NEW.example_count = 9
         BEGIN SELECT RAISE(ABORT, 'the test refuses this write'); END",
    )
    .await;
    let devices = enrolled(&store, 2).await;
    let handle = started(&store).await;
    let run = create_run(&handle, 1).await;
    for &d in &devices {
        assert!(matches!(check_in(&handle, d).await, CheckInResponse::Task(_)));
    }
    let refused = upload(&handle, run, devices[0], update(5.0, 9)).await;
    assert_eq!(refused, Err(DriverError::Unavailable));
    upload(&handle, run, devices[0], update(1.0, 1)).await.unwrap();
    upload(&handle, run, devices[1], update(-0.5, 3)).await.unwrap();
    // (1·1 + 3·(−0.5)) / 4, with nothing of the refused 9 × 5.0
    assert_eq!(committed_model(&store, run, 1).await, vec![-0.125; PARAMS]);
}

/// A shutdown waits for the bytes of a model committed by its hash (a finished run's
/// last model must not wait for a restart); it says so when they do not land in time.
#[tokio::test]
async fn a_shutdown_waits_for_committed_models_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let store = store(&dir).await;
    let mut sql = raw_sql(&dir, HOLD_MODEL_BYTES).await;
    let devices = enrolled(&store, 2).await;
    let handle = started(&store).await;
    let run = create_run(&handle, 1).await;
    both_report(&handle, run, &devices).await;
    committed_hash(&store, run, 1).await;
    assert!(!handle.finish_model_writes(Duration::from_millis(300)).await, "held back");
    sqlx::query("DROP TRIGGER hold_model_bytes").execute(&mut sql).await.unwrap();
    assert!(handle.finish_model_writes(Duration::from_secs(10)).await);
    let written = store.model(run, ModelVersion(1)).await.unwrap().expect("written");
    assert_eq!(model_values(&written), vec![-0.125; PARAMS]);
}

/// Both devices take `round`'s task and report it (`a` × 1 example, `b` × 3); the task's model
/// hash.
async fn report_round(
    handle: &DriverHandle,
    run: RunId,
    devices: &[DeviceId],
    round: i64,
    (a, b): (f32, f32),
) -> String {
    let mut tasks = vec![];
    for &device in devices {
        tasks.push(task_in_round(handle, device, round).await);
    }
    for (task, (device, value, examples)) in tasks.iter().zip([(0, a, 1), (1, b, 3)]) {
        let (round_idx, model_version) = (task.round_idx, task.model_version);
        let (device, update) = (devices[device], update(value, examples));
        handle
            .call(|reply| Event::Upload {
                device,
                run_id: run,
                round_idx,
                model_version,
                update,
                hold: None,
                reply,
            })
            .await
            .unwrap();
    }
    tasks[0].model_hash.clone()
}

/// Waits until model `version` of `run` is committed; its hash.
async fn committed_hash(store: &SqlStore, run: RunId, version: i64) -> String {
    eventually(&format!("model version {version} committed"), async || {
        store.model_hash(run, ModelVersion(version)).await.unwrap()
    })
    .await
}

/// Updates still stored for `round` of `run`.
async fn kept_updates(store: &SqlStore, run: RunId, round: i64) -> u64 {
    store.for_each_update(run, RoundIdx(round), |_| Ok(())).await.unwrap()
}

/// A plan's `checkpoint_interval` writes every other model here. A version in
/// between is committed by its hash, served from the cache (downloads and exports) and its
/// round keeps its updates; the next written version gives it up (not kept, updates
/// released); the run's last model is written whatever the interval.
#[tokio::test]
async fn models_are_written_every_checkpoint_interval_versions() {
    let dir = tempfile::tempdir().unwrap();
    let store = store(&dir).await;
    let devices = enrolled(&store, 2).await;
    let handle = started(&store).await;
    let run = create_run_with(&handle, 3, serde_json::json!({"checkpoint_interval": 2})).await;
    report_round(&handle, run, &devices, 0, (1.0, -0.5)).await;
    let v1 = committed_hash(&store, run, 1).await;
    // Round 1's task hands out version 1, which only the cache has.
    let handed_out = report_round(&handle, run, &devices, 1, (2.0, 2.0)).await;
    assert_eq!(handed_out, v1);
    assert_eq!(committed_model(&store, run, 2).await, vec![-0.125 + 2.0; PARAMS]);
    // Version 2 is written: version 1 is given up, and both rounds' updates are released.
    assert!(matches!(
        store.model(run, ModelVersion(1)).await,
        Err(StoreError::ModelNotKept { .. })
    ));
    for round in 0..2 {
        let released = async || (kept_updates(&store, run, round).await == 0).then_some(());
        eventually(&format!("round {round}'s updates released"), released).await;
    }
    // Version 3 is the run's last: written though 3 is not a multiple of 2.
    report_round(&handle, run, &devices, 2, (4.0, 0.0)).await;
    assert_eq!(committed_model(&store, run, 3).await, vec![-0.125 + 2.0 + 1.0; PARAMS]);
    assert_eq!(store.pending_models().await.unwrap(), vec![]);
}

/// A coordinator stopped between written versions loses nothing: the next start
/// rebuilds every model since the last written one from the rounds' kept updates, in order and
/// to the bit of what the first coordinator served, and the run goes on from the newest.
#[tokio::test]
async fn a_restart_between_checkpoints_rebuilds_every_unwritten_model() {
    let dir = tempfile::tempdir().unwrap();
    let store = store(&dir).await;
    let devices = enrolled(&store, 2).await;
    let handle = started(&store).await;
    let run = create_run_with(&handle, 5, serde_json::json!({"checkpoint_interval": 3})).await;
    report_round(&handle, run, &devices, 0, (1.0, -0.5)).await;
    report_round(&handle, run, &devices, 1, (0.5, 0.25)).await;
    let v2 = committed_hash(&store, run, 2).await;
    let served: Vec<bytes::Bytes> = [committed_hash(&store, run, 1).await, v2.clone()]
        .iter()
        .map(|hash| handle.models().get(hash).expect("the cache holds the run's newest models"))
        .collect();
    assert_eq!(store.pending_models().await.unwrap().len(), 2);
    handle.stop().await; // versions 1 and 2 unwritten

    let handle = started(&store).await;
    assert_eq!(store.pending_models().await.unwrap(), vec![]);
    for (version, served) in [1, 2].into_iter().zip(&served) {
        let rebuilt = store.model(run, ModelVersion(version)).await.unwrap().expect("rebuilt");
        assert_eq!(rebuilt, &served[..], "version {version}");
    }
    // (1·1 + 3·(−0.5)) / 4, then (0.5·1 + 0.25·3) / 4
    assert_eq!(model_values(&served[1]), vec![-0.125 + 0.3125; PARAMS]);
    assert_eq!(store.release_closed_payloads().await.unwrap(), 2);
    let handed_out = report_round(&handle, run, &devices, 2, (1.0, 1.0)).await;
    assert_eq!(handed_out, v2);
    assert_eq!(committed_model(&store, run, 3).await, vec![-0.125 + 0.3125 + 1.0; PARAMS]);
}

/// A run stopped between written versions has its newest model written at once
/// (from the values the driver holds), so its last model can be exported without a restart.
#[tokio::test]
async fn a_run_stopped_between_checkpoints_writes_its_newest_model() {
    let dir = tempfile::tempdir().unwrap();
    let store = store(&dir).await;
    let devices = enrolled(&store, 2).await;
    let handle = started(&store).await;
    let run = create_run_with(&handle, 9, serde_json::json!({"checkpoint_interval": 5})).await;
    report_round(&handle, run, &devices, 0, (1.0, -0.5)).await;
    report_round(&handle, run, &devices, 1, (0.5, 0.25)).await;
    let v2 = committed_hash(&store, run, 2).await;
    let served = handle.models().get(&v2).expect("cached");
    handle.call(|reply| Event::StopRun { run_id: run, reply }).await.unwrap();
    assert_eq!(store.run(run).await.unwrap().unwrap().status, "stopped");
    let written = committed_model(&store, run, 2).await;
    assert_eq!(written, model_values(&served));
    assert!(matches!(
        store.model(run, ModelVersion(1)).await,
        Err(StoreError::ModelNotKept { .. })
    ));
    for round in 0..3 {
        let released = async || (kept_updates(&store, run, round).await == 0).then_some(());
        eventually(&format!("round {round}'s updates released"), released).await;
    }
    assert!(handle.finish_model_writes(Duration::from_secs(10)).await);
    assert_eq!(store.pending_models().await.unwrap(), vec![]);
}

/// A round whose aggregate is refused (here the server step overflows f32) fails, and is
/// stored and shown as `aggregate_rejected`: it used to be stored as the `commit` the machine
/// had asked for, so a failed round read "commit" in the run's rounds.
#[tokio::test]
async fn a_round_whose_aggregate_is_refused_is_stored_as_rejected_not_commit() {
    let dir = tempfile::tempdir().unwrap();
    let store = store(&dir).await;
    let devices = enrolled(&store, 2).await;
    let handle = started(&store).await;
    let run = create_run_with(&handle, 2, serde_json::json!({"server_learning_rate": 4.0})).await;
    for &d in &devices {
        assert!(matches!(check_in(&handle, d).await, CheckInResponse::Task(_)));
    }
    // Finite updates whose mean × 4 is past f32::MAX.
    upload(&handle, run, devices[0], update(1e38, 1)).await.unwrap();
    upload(&handle, run, devices[1], update(1e38, 3)).await.unwrap();
    let round = eventually("round 0 closed", async || {
        let rounds = store.rounds(run).await.unwrap();
        rounds.into_iter().find(|r| r.round_idx == 0 && r.state != "open")
    })
    .await;
    assert_eq!(round.state, "failed");
    assert_eq!(round.outcome_json.as_deref(), Some(r#"{"outcome":"aggregate_rejected"}"#));
    assert_eq!(store.model_hash(run, ModelVersion(1)).await.unwrap(), None, "nothing committed");
}

/// A running run whose stored plan a later coordinator refuses (here a Krum plan whose rounds
/// would need ~320 GB at close, which plans are now checked for) is stopped at start, with its
/// open round failed, instead of failing the same way at every close, or keeping the
/// coordinator (and every other run) from starting.
#[tokio::test]
async fn a_run_whose_stored_plan_is_now_refused_is_stopped_at_start() {
    use sqlx::Row;
    let dir = tempfile::tempdir().unwrap();
    let store = store(&dir).await;
    let devices = enrolled(&store, 2).await;
    let handle = started(&store).await;
    let refused = create_run(&handle, 3).await;
    let kept = create_run(&handle, 3).await;
    handle.stop().await;
    let mut sql = raw_sql(&dir, "SELECT 1").await;
    let row = sqlx::query("SELECT plan_json FROM runs WHERE id = ?")
        .bind(refused.0)
        .fetch_one(&mut sql)
        .await
        .unwrap();
    let mut plan: serde_json::Value = serde_json::from_str(row.get::<&str, _>(0)).unwrap();
    plan["cohort_size"] = 200_000.into();
    plan["min_quorum"] = 5.into();
    plan["strategy"]["aggregation"] = serde_json::json!({"kind": "krum", "byzantine": 1});
    sqlx::query("UPDATE runs SET plan_json = ? WHERE id = ?")
        .bind(plan.to_string())
        .bind(refused.0)
        .execute(&mut sql)
        .await
        .unwrap();

    let handle = started(&store).await;
    assert_eq!(store.run(refused).await.unwrap().unwrap().status, "stopped");
    let rounds = store.rounds(refused).await.unwrap();
    assert!(rounds.iter().all(|r| r.state != "open"), "{rounds:?}");
    // The other run goes on.
    assert_eq!(store.run(kept).await.unwrap().unwrap().status, "running");
    assert!(
        matches!(check_in(&handle, devices[0]).await, CheckInResponse::Task(t) if t.run_id == kept)
    );
}

/// Makes every write of round 1's row fail, until dropped again.
const HOLD_ROUND_1: &str = "CREATE TRIGGER hold_round_1 BEFORE INSERT ON rounds
    WHEN NEW.round_idx = 1 BEGIN SELECT RAISE(ABORT, 'the test holds round 1 back'); END";

/// In an asynchronous run, a device still training on buffer 0's model may upload as soon as
/// buffer 1 opens, before the writer has made that round durable: its update is written after
/// the round, and acknowledged then, instead of failing the round's foreign key and being
/// answered 503.
#[tokio::test]
async fn an_update_into_a_buffer_not_yet_durable_waits_for_its_round() {
    let dir = tempfile::tempdir().unwrap();
    let store = store(&dir).await;
    let devices = enrolled(&store, 2).await;
    let observer = Observer::new();
    let mut events = observer.subscribe();
    let (driver, handle) = Driver::recover(store.clone(), observer, None).await.unwrap();
    let handle = Started { handle, task: tokio::spawn(driver.run()) };
    let fedbuff = serde_json::json!({"concurrency": 2, "max_staleness": 2});
    let more = serde_json::json!({"cohort_size": 1, "min_quorum": 1, "asynchronous": fedbuff});
    let run = create_run_with(&handle, 3, more).await;
    for &d in &devices {
        assert!(
            matches!(check_in(&handle, d).await, CheckInResponse::Task(t) if t.round_idx == RoundIdx(0))
        );
    }
    let mut sql = raw_sql(&dir, HOLD_ROUND_1).await;
    upload(&handle, run, devices[0], update(1.0, 1)).await.unwrap();
    // Buffer 0 commits and buffer 1 opens in the driver; its row is held back.
    tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            match events.recv().await.expect("the driver publishes") {
                crate::observe::LiveEvent::Round { run_id, round_idx: 1, state, .. }
                    if run_id == run.0 && state == "open" =>
                {
                    break;
                }
                _ => {}
            }
        }
    })
    .await
    .expect("buffer 1 opens within 10 s");

    let carried = tokio::spawn({
        let handle = handle.handle.clone();
        let device = devices[1];
        async move { upload(&handle, run, device, update(3.0, 1)).await }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!carried.is_finished(), "answered before its round was durable: {carried:?}");
    sqlx::query("DROP TRIGGER hold_round_1").execute(&mut sql).await.unwrap();
    let ack = tokio::time::timeout(Duration::from_secs(10), carried)
        .await
        .expect("acknowledged within 10 s of the round landing")
        .unwrap()
        .expect("the carried update is taken");
    assert_eq!(ack.run_id, run);
    // Buffer 1 holds that update alone, one version stale: 1 + 3·(1 + 1)^−½.
    let expected = 1.0 + 3.0 / 2f32.sqrt();
    let v2 = committed_model(&store, run, 2).await;
    assert!(v2.iter().all(|v| (v - expected).abs() < 1e-6), "{v2:?}, not {expected}");
    handle.stop().await;
}

/// Devices whose updates ended in three refused rounds in a row are not selected again, and a
/// restarted coordinator counts their strikes again from the store: still not selected.
#[tokio::test]
async fn devices_in_three_refused_rounds_stay_quarantined_across_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let store = store(&dir).await;
    let devices = enrolled(&store, 3).await;
    let handle = started(&store).await;
    // First come: a device that checks in while there is room is selected unless quarantined.
    let more = serde_json::json!({"server_learning_rate": 4.0, "selection": "first_come"});
    let run = create_run_with(&handle, 5, more).await;
    let (bad, honest) = (&devices[..2], devices[2]);
    for round in 0..3 {
        until_round_opens(&store, run, round).await;
        for &d in bad {
            assert!(matches!(check_in(&handle, d).await, CheckInResponse::Task(_)));
        }
        // Finite updates whose mean × 4 is past f32::MAX: the aggregate is refused.
        for &d in bad {
            let (round_idx, model_version) = (RoundIdx(round), ModelVersion(0));
            let update = update(1e38, 1);
            let ack = handle
                .call(|reply| Event::Upload {
                    device: d,
                    run_id: run,
                    round_idx,
                    model_version,
                    update,
                    hold: None,
                    reply,
                })
                .await;
            ack.unwrap();
        }
    }
    until_round_opens(&store, run, 3).await;
    handle.stop().await;

    let handle = started(&store).await;
    for &d in bad {
        assert!(
            matches!(check_in(&handle, d).await, CheckInResponse::ComeBackLater { .. }),
            "quarantined"
        );
    }
    let answer = check_in(&handle, honest).await;
    assert!(matches!(answer, CheckInResponse::Task(ref t) if t.run_id == run), "{answer:?}");
    handle.stop().await;
}

/// Waits until round `round_idx` of `run` is open in the store.
async fn until_round_opens(store: &SqlStore, run: RunId, round_idx: i64) {
    eventually(&format!("round {round_idx} open"), async || {
        let open = store.open_round(run).await.unwrap();
        open.filter(|o| o.round.round_idx.0 == round_idx).map(|_| ())
    })
    .await;
}

/// Uploads that arrive together are written as groups of them (fewer writes than updates,
/// each update's row kept without its delta), every one acknowledged only once its group is
/// durable; a coordinator restarted mid-round replays the stored groups and commits exactly
/// the FedAvg of every acknowledged update.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_uploads_are_stored_as_groups_and_a_restart_replays_them_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let store = store(&dir).await;
    let devices = enrolled(&store, 24).await;
    let handle = started(&store).await;
    let more = serde_json::json!({"cohort_size": 24, "min_quorum": 24});
    let run = create_run_with(&handle, 1, more).await;
    for &d in &devices {
        assert!(matches!(check_in(&handle, d).await, CheckInResponse::Task(_)));
    }
    // All but the last upload at once; each answer comes once its group is durable.
    let uploads = devices[..23].iter().enumerate().map(|(k, &d)| {
        let handle = handle.clone();
        async move { upload(&handle, run, d, update(k as f32 * 0.25 - 2.0, 1 + k as u64)).await }
    });
    for acked in futures_util::future::join_all(uploads).await {
        acked.expect("acknowledged");
    }
    let mut sql = raw_sql(&dir, "SELECT 1").await;
    let (groups, grouped): (i64, i64) =
        sqlx::query_as("SELECT COUNT(*), COALESCE(SUM(n_updates), 0) FROM update_groups")
            .fetch_one(&mut sql)
            .await
            .unwrap();
    assert_eq!(grouped, 23, "every acknowledged update is in a stored group");
    assert!(groups < 23, "{groups} writes for 23 updates that arrived together");
    let (rows, deltas): (i64, i64) = sqlx::query_as("SELECT COUNT(*), COUNT(delta) FROM updates")
        .fetch_one(&mut sql)
        .await
        .unwrap();
    assert_eq!((rows, deltas), (23, 0), "a row per update, no delta");

    // A restart in the middle of the round: the stored groups are the round's sum.
    handle.stop().await;
    let handle = started(&store).await;
    upload(&handle, run, devices[23], update(3.0, 5)).await.unwrap();
    let model = committed_model(&store, run, 1).await;
    let contributions: Vec<(f64, u64)> = (0..23)
        .map(|k| (f64::from(k as f32 * 0.25 - 2.0), 1 + k as u64))
        .chain([(3.0, 5)])
        .collect();
    let total: u64 = contributions.iter().map(|(_, w)| w).sum();
    let mean = contributions.iter().map(|(v, w)| v * *w as f64).sum::<f64>() / total as f64;
    assert_eq!(model, vec![mean as f32; PARAMS]);
    handle.stop().await;
}
