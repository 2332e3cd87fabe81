//! Compressed updates end to end: the coordinator stores a device's delta in the
//! encoding it arrived in, replays it after a SIGKILL and commits, to the bit, the mean of the
//! decoded deltas; a delta in another encoding than the run's is refused by name; a model
//! downloaded compressed is the model's values encoded for every device alike, while the commit
//! keeps full precision; and real SDK devices training with int8 or top-k (with error
//! feedback), or int8 both ways, reach the accuracy of f32.

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
async fn compressed_updates_survive_a_restart_and_commit_their_decoded_mean() {
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
/// send and add it to the next round) train as well as f32 does, and so does int8 both ways
/// (the model downloaded in int8 too).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn devices_train_through_compressed_uploads() {
    use starling_client::simulate::{SimulationConfig, simulate};
    let (_dir, db) = sqlite_db();
    let c = start_in_process(&db).await.unwrap();
    let int8 = Compression::Int8 { block: 256 };
    for (compression, model_download) in [
        (int8, Compression::F32),
        (Compression::TopK { fraction: 0.1 }, Compression::F32),
        (int8, int8),
    ] {
        let config = SimulationConfig {
            compression,
            model_download,
            ..digits_simulation(&c.url, 8, 6, 5, 13)
        };
        let accuracy: Vec<f64> = simulate(config, |r| {
            eprintln!(
                "{compression} / {model_download} model {}: {:.3}",
                r.version, r.test_accuracy
            )
        })
        .await
        .unwrap()
        .rounds
        .iter()
        .map(|r| r.test_accuracy)
        .collect();
        assert_eq!(accuracy.len(), 5);
        assert!(accuracy[4] >= 0.85, "{compression} / {model_download}: accuracy {accuracy:?}");
    }
    c.running.shutdown().await.unwrap();
}

/// A model downloaded compressed: the task names the encoding; the coordinator serves the
/// model's values encoded the same way to every device, under an `ETag` of their own, and
/// refuses top-k; the commit is the full-precision model plus the mean delta, never the
/// rounded model the devices started from.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_downloads_compressed_and_the_commit_keeps_full_precision() {
    let (_dir, db) = sqlite_db();
    let c = start_in_process(&db).await.unwrap();
    let devices = enroll(&c.url, &c.admin, 2).await.unwrap();
    let spec = PlanSpec::all_of(2, PARAMS, 2);
    let schema = spec.schema();
    let mut plan = spec.json();
    let int8 = Compression::Int8 { block: 64 };
    plan["model_download"] = serde_json::to_value(int8).unwrap();
    let run = RunId(c.admin.create_run(&plan).await.unwrap().id);
    let contributions: Vec<(Vec<f32>, u64)> =
        (0..2).map(|i| (delta(i, 0, PARAMS), weight(i))).collect();
    // Round 0 moves the model off its all-zero start, which int8 would carry exactly.
    for (i, d) in devices.iter().enumerate() {
        let task = expect_task(d).await.unwrap();
        let (values, examples) = &contributions[i];
        d.upload(run, RoundIdx(0), &upload_request(&task, values, *examples)).await.unwrap();
    }
    wait_model(&c.admin, run, 1).await.unwrap();
    let tasks = [expect_task(&devices[0]).await.unwrap(), expect_task(&devices[1]).await.unwrap()];
    assert!(tasks.iter().all(|t| t.round_idx == RoundIdx(1)));
    assert!(tasks.iter().all(|t| t.model_download == int8 && t.compression == Compression::F32));
    let global = model_values(&devices[0], &tasks[0].model_hash, &schema).await.unwrap();
    let payload = devices[0].model_in(&tasks[0].model_hash, int8).await.unwrap();
    assert_eq!(payload.schema_id, schema.schema_id());
    assert_eq!(payload.data, int8.encode_model(&global), "the model's values, int8 to nearest");
    assert_eq!(devices[1].model_in(&tasks[0].model_hash, int8).await.unwrap(), payload);
    let decoded =
        starling_client::participant::decode_model_in(&schema, payload.clone(), int8).unwrap();
    assert!(decoded != global, "int8 rounds the model");

    let url = format!("{}/v1/models/{}", c.url, tasks[0].model_hash);
    let get = |query: &str, etag: Option<String>| {
        let mut req = http_client()
            .get(format!("{url}{query}"))
            .bearer_auth(devices[0].credential().unwrap().to_owned());
        if let Some(etag) = etag {
            req = req.header("If-None-Match", etag);
        }
        req.send()
    };
    let res = get("?compression=int8:64", None).await.unwrap();
    let etag = res.headers()["etag"].to_str().unwrap().to_owned();
    assert_eq!(etag, format!("\"{}.int8:64\"", tasks[0].model_hash));
    assert_eq!(res.bytes().await.unwrap(), starling_core::codec::to_vec(&payload).unwrap());
    let res = get("?compression=int8:64", Some(etag)).await.unwrap();
    assert_eq!(res.status(), reqwest::StatusCode::NOT_MODIFIED);
    let res = get("", Some(format!("\"{}.int8:64\"", tasks[0].model_hash))).await.unwrap();
    assert_eq!(res.status(), reqwest::StatusCode::OK, "the f32 model is another entity");
    for bad in ["?compression=top_k:0.1", "?compression=int4", "?compression=int8:0"] {
        let res = get(bad, None).await.unwrap();
        assert_eq!(res.status(), reqwest::StatusCode::UNPROCESSABLE_ENTITY, "{bad}");
        let body: starling_core::wire::ErrorBody =
            starling_core::codec::decode(&res.bytes().await.unwrap()).unwrap();
        assert!(body.message.contains("compression"), "{bad}: {}", body.message);
    }

    let contributions: Vec<(Vec<f32>, u64)> =
        (0..2).map(|i| (delta(i, 1, PARAMS), weight(i))).collect();
    for (i, (d, t)) in devices.iter().zip(&tasks).enumerate() {
        let (values, examples) = &contributions[i];
        d.upload(run, RoundIdx(1), &upload_request(t, values, *examples)).await.unwrap();
    }
    let committed = wait_model(&c.admin, run, 2).await.unwrap();
    let got = model_values(&devices[0], &committed, &schema).await.unwrap();
    assert!(got == fedavg_expected(&global, &contributions), "not the full model plus the mean");
    c.running.shutdown().await.unwrap();
}
