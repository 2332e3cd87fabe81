//! Compressed updates end to end (issue 18): the coordinator stores a device's delta in the
//! encoding it arrived in, replays it after a SIGKILL and commits, to the bit, the mean of the
//! decoded deltas; a delta in another encoding than the run's is refused by name; and real SDK
//! devices training with int8 or top-k (with error feedback) reach the accuracy of f32.

use std::path::Path;

use starling_core::compression::{Compression, ErrorFeedback};
use starling_core::fedavg::{FedAvgAccumulator, validate_parts};
use starling_core::rng::SplitMix64;
use starling_core::strategy::ServerOptimizer;
use starling_core::tensor::TensorPayload;
use starling_core::wire::{ErrorCode, UploadRequest};
use starling_core::{RoundIdx, RunId};
use starling_tests::*;

const PARAMS: usize = 1_000;
const DEVICES: usize = 3;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r18_compressed_updates_survive_a_restart_and_commit_their_decoded_mean() {
    for compression in [Compression::Int8 { block: 64 }, Compression::TopK { fraction: 0.05 }] {
        let (_dir, db) = sqlite_db();
        let bin = Path::new(env!("CARGO_BIN_EXE_coordinator_under_test"));
        let mut coordinator = RestartableCoordinator::spawn(bin, &db).await.unwrap();
        let admin = coordinator.admin.clone();
        let devices = enroll(coordinator.url(), &admin, DEVICES).await.unwrap();
        let spec = PlanSpec::all_of(DEVICES, PARAMS, 1);
        let schema = spec.schema();
        let mut plan = spec.json();
        plan["compression"] = serde_json::to_value(compression).unwrap();
        let run = RunId(admin.create_run(&plan).await.unwrap().id);
        assert_eq!(admin.run(run).await.unwrap().plan["compression"]["kind"], compression.name());
        let initial = admin.models(run).await.unwrap()[0].content_hash.clone();
        wait_round_open(&admin, run, 0).await.unwrap();
        let tasks = expect_tasks(&devices).await.unwrap();
        assert!(tasks.iter().all(|t| t.compression == compression), "the task names the encoding");

        // An f32 delta to a compressed run is refused, and nothing is stored for it.
        let f32_upload = upload_request(&tasks[0], &delta(0, 0, PARAMS), weight(0));
        let refused = devices[0].upload(run, RoundIdx(0), &f32_upload).await;
        assert_eq!(api_code(refused), Some(ErrorCode::ShapeMismatch));

        let encoded: Vec<Vec<u8>> = (0..DEVICES)
            .map(|i| {
                let mut feedback = ErrorFeedback::default();
                compression.encode(&delta(i, 0, PARAMS), &mut SplitMix64(i as u64), &mut feedback)
            })
            .collect();
        assert!(encoded.iter().all(|e| e.len() < PARAMS * 4 / 3), "compressed below f32");
        let upload = |i: usize| UploadRequest {
            model_version: tasks[i].model_version,
            example_count: weight(i),
            metrics: Default::default(),
            delta: TensorPayload { schema_id: schema.schema_id(), data: encoded[i].clone() },
        };
        for (i, device) in devices.iter().enumerate().take(DEVICES - 1) {
            device.upload(run, RoundIdx(0), &upload(i)).await.unwrap();
        }
        // SIGKILL with two acknowledged compressed updates stored and the round open.
        coordinator.kill().unwrap();
        coordinator.respawn().await.unwrap();
        devices[DEVICES - 1].upload(run, RoundIdx(0), &upload(DEVICES - 1)).await.unwrap();
        let committed = wait_model(&admin, run, 1).await.unwrap();

        let global = model_values(&devices[0], &initial, &schema).await.unwrap();
        let mut acc = FedAvgAccumulator::new(PARAMS);
        for (i, bytes) in encoded.iter().enumerate() {
            let update =
                validate_parts(&schema, compression, bytes.clone(), weight(i), Default::default());
            acc.add(&update.unwrap());
        }
        let fed_avg = ServerOptimizer::default();
        let (want, _) =
            fed_avg.step(&global, &acc.finish().unwrap(), &Default::default(), 1.0).unwrap();
        let got = model_values(&devices[0], &committed, &schema).await.unwrap();
        assert!(got == want, "{compression:?}: the committed model is not the decoded mean");
    }
}

/// Real SDK devices on the digits: int8 and top-k 10 % (whose devices keep what they did not
/// send and add it to the next round) train as well as f32 does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r18_devices_train_through_compressed_uploads() {
    use starling_client::simulate::{SimulationConfig, simulate};
    let (_dir, db) = sqlite_db();
    let c = start_in_process(&db).await.unwrap();
    for compression in [Compression::Int8 { block: 256 }, Compression::TopK { fraction: 0.1 }] {
        let config = SimulationConfig { compression, ..digits_simulation(&c.url, 8, 6, 5, 13) };
        let accuracy: Vec<f64> = simulate(config, |r| {
            eprintln!("{compression:?} model {}: test accuracy {:.3}", r.version, r.test_accuracy)
        })
        .await
        .unwrap()
        .rounds
        .iter()
        .map(|r| r.test_accuracy)
        .collect();
        assert_eq!(accuracy.len(), 5);
        assert!(accuracy[4] >= 0.85, "{compression:?}: accuracy curve {accuracy:?}");
    }
    c.running.shutdown().await.unwrap();
}
