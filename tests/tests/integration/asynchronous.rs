//! Asynchronous buffered aggregation (FedBuff) end to end: a device still training
//! on an older model across a SIGKILL reports into a later buffer, its acknowledged update
//! survives another, and the buffer commits, to the bit, the staleness-weighted mean; real SDK
//! devices, a fifth of them five times slower, train a model through buffers.

use std::path::Path;

use starling_core::fedavg::FedAvgAccumulator;
use starling_core::plan::AsynchronousPlan;
use starling_core::strategy::ServerOptimizer;
use starling_core::wire::{CheckInResponse, ErrorCode};
use starling_core::{RoundIdx, RunId};
use starling_tests::*;

const PARAMS: usize = 1_000;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_update_survives_a_restart_and_commits_discounted() {
    let (_dir, db) = sqlite_db();
    let bin = Path::new(env!("CARGO_BIN_EXE_coordinator_under_test"));
    let mut coordinator = RestartableCoordinator::spawn(bin, &db).await.unwrap();
    let admin = coordinator.admin.clone();
    let devices = enroll(coordinator.url(), &admin, 4).await.unwrap();
    let spec = PlanSpec { cohort: 2, quorum: 1, ..PlanSpec::all_of(2, PARAMS, 2) };
    let schema = spec.schema();
    let mut plan = spec.json();
    let fedbuff = AsynchronousPlan { concurrency: 3, max_staleness: 2, staleness_exponent: 0.5 };
    plan["asynchronous"] = serde_json::to_value(fedbuff).unwrap();
    let run = RunId(admin.create_run(&plan).await.unwrap().id);
    wait_round_open(&admin, run, 0).await.unwrap();

    // Buffer 0: three devices train at once; a fourth is turned away while they do.
    let tasks = expect_tasks(&devices[..3]).await.unwrap();
    assert!(matches!(
        devices[3].check_in("default").await.unwrap(),
        CheckInResponse::ComeBackLater { .. }
    ));
    for i in 0..2 {
        let upload = upload_request(&tasks[i], &delta(i, 0, PARAMS), weight(i));
        devices[i].upload(run, RoundIdx(0), &upload).await.unwrap();
    }
    let v1 = wait_model(&admin, run, 1).await.unwrap();
    wait_round_open(&admin, run, 1).await.unwrap();

    // Buffer 1 (model 1): device 3 gets a place; device 2 reports its model-0 update.
    let fresh = expect_task(&devices[3]).await.unwrap();
    assert_eq!((fresh.round_idx, fresh.model_version.0), (RoundIdx(1), 1));
    // SIGKILL while device 2 still trains on model 0: the restarted coordinator finds it in
    // the store and carries it again.
    coordinator.kill().unwrap();
    coordinator.respawn().await.unwrap();
    let stale = upload_request(&tasks[2], &delta(2, 0, PARAMS), weight(2));
    devices[2].upload(run, RoundIdx(0), &stale).await.unwrap();
    let again = devices[2].upload(run, RoundIdx(0), &stale).await;
    assert_eq!(api_code(again), Some(ErrorCode::DuplicateUpload));

    // SIGKILL with the stale update acknowledged and the buffer open.
    coordinator.kill().unwrap();
    coordinator.respawn().await.unwrap();
    let upload = upload_request(&fresh, &delta(3, 1, PARAMS), weight(3));
    devices[3].upload(run, RoundIdx(1), &upload).await.unwrap();
    let v2 = wait_model(&admin, run, 2).await.unwrap();
    // Its answer lost, device 2 resends to its task's round once buffer 1 committed: the
    // update was counted (in buffer 1), so a duplicate, not `round_closed` (top-k's error
    // feedback would send those values again).
    let resent = devices[2].upload(run, RoundIdx(0), &stale).await;
    assert_eq!(api_code(resent), Some(ErrorCode::DuplicateUpload));

    let global = model_values(&devices[0], &v1, &schema).await.unwrap();
    let mut acc = FedAvgAccumulator::new(PARAMS);
    let update = |i: usize, round: i64| {
        let request = upload_request(&tasks[0], &delta(i, round, PARAMS), weight(i));
        starling_core::fedavg::validate_parts(
            &schema,
            Default::default(),
            request.delta.data,
            weight(i),
            request.metrics,
        )
        .unwrap()
    };
    acc.add_scaled(&update(2, 0), fedbuff.staleness_scale(1));
    acc.add(&update(3, 1));
    let fed_avg = ServerOptimizer::default();
    let (want, _) =
        fed_avg.step(&global, &acc.finish().unwrap(), &Default::default(), 1.0).unwrap();
    let got = model_values(&devices[0], &v2, &schema).await.unwrap();
    assert!(got == want, "the committed model is not the staleness-weighted mean");
    let rounds = admin.rounds(run).await.unwrap();
    assert_eq!(
        (rounds[1].n_selected.unwrap(), rounds[1].n_reported.unwrap()),
        (1, 2),
        "one report came from buffer 0"
    );
    assert_eq!((rounds[0].n_stale, rounds[1].n_stale), (0, 1));
}

/// Real SDK devices on the digits, a fifth of them five times slower: the fast ones keep the
/// buffers filling, the slow ones' updates arrive a version or more late and still count, and
/// the model learns.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn devices_train_through_fedbuff_with_slow_devices() {
    use starling_client::simulate::{SimulationConfig, Slowdown, simulate};
    let (_dir, db) = sqlite_db();
    let c = start_in_process(&db).await.unwrap();
    let config = SimulationConfig {
        asynchronous: Some(AsynchronousPlan {
            concurrency: 6,
            max_staleness: 4,
            staleness_exponent: 0.5,
        }),
        slowdown: Some(Slowdown { fraction: 0.2, factor: 5.0 }),
        ..digits_simulation(&c.url, 10, 4, 8, 17)
    };
    let report = simulate(config, |r| {
        eprintln!(
            "model {}: test accuracy {:.3}, {:?} updates",
            r.version, r.test_accuracy, r.reported
        )
    })
    .await
    .unwrap();
    let accuracy: Vec<f64> = report.rounds.iter().map(|r| r.test_accuracy).collect();
    assert_eq!(accuracy.len(), 8);
    assert!(accuracy[7] >= 0.85, "accuracy curve {accuracy:?}");
    // Some buffer took an update from a device selected for an earlier one, and no upload
    // was refused as a duplicate (a late reporter is not selected again in the same buffer).
    let rounds = c.admin.rounds(report.run_id).await.unwrap();
    let stale: i64 = rounds.iter().map(|r| r.n_stale).sum();
    assert!(stale > 0, "no update crossed a buffer: {rounds:?}");
    let metrics = http_client().get(format!("{}/metrics", c.url)).bearer_auth(OPERATOR_TOKEN);
    let metrics = metrics.send().await.unwrap().text().await.unwrap();
    assert!(!metrics.contains("reason=\"duplicate_upload\""), "{metrics}");
    c.running.shutdown().await.unwrap();
}

/// A FedBuff device can hold a task on a version for a while. When its run's
/// `checkpoint_interval` gave that version up meanwhile (a later one written) and the model
/// cache no longer has it, its download is a 410 `model_not_kept` (the SDK's participant gives
/// such a task up as a missed round), not a 404; the versions that were written still download.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_on_a_version_given_up_meanwhile_downloads_as_not_kept() {
    const VERSIONS: i64 = 12;
    let (_dir, db) = sqlite_db();
    let c = start_in_process(&db).await.unwrap();
    let devices = enroll(&c.url, &c.admin, 2).await.unwrap();
    let (waiting, busy) = (&devices[0], &devices[1]);
    // Every update commits a buffer; every second version is written.
    let spec = PlanSpec::all_of(1, PARAMS, VERSIONS as u32);
    let mut plan = spec.json();
    let fedbuff = AsynchronousPlan { concurrency: 2, max_staleness: 100, staleness_exponent: 0.5 };
    plan["asynchronous"] = serde_json::to_value(fedbuff).unwrap();
    plan["checkpoint_interval"] = 2.into();
    let run = RunId(c.admin.create_run(&plan).await.unwrap().id);
    let admin = &c.admin;
    let report = |version: i64| async move {
        let task = expect_task(busy).await.unwrap();
        assert_eq!(task.model_version.0, version);
        let upload = upload_request(&task, &delta(1, version, PARAMS), weight(1));
        busy.upload(run, task.round_idx, &upload).await.unwrap();
        let hash = wait_model(admin, run, version + 1).await.unwrap();
        if version + 1 < VERSIONS {
            wait_round_open(admin, run, version + 1).await.unwrap();
        }
        hash
    };
    wait_round_open(&c.admin, run, 0).await.unwrap();
    let mut hashes = vec![report(0).await];
    let task = expect_task(waiting).await.unwrap();
    assert_eq!(task.model_version.0, 1);
    // The other device moves the run on by enough versions that the cache lets version 1 go.
    for version in 1..VERSIONS - 1 {
        hashes.push(report(version).await);
    }
    let gone = waiting.model_in(&task.model_hash, task.model_download).await;
    assert_eq!(api_code(gone), Some(ErrorCode::ModelNotKept));
    let written = waiting.model(&hashes[1]).await.unwrap();
    assert_eq!(written.content_hash(), hashes[1], "version 2 was written");
}
