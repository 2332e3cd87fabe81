//! End to end: a real coordinator on loopback, real devices over HTTP, a real store.
//!
//! Every scenario runs twice: on Postgres (a fresh database per test via `#[sqlx::test]`) and
//! on the embedded SQLite store.

use starling_core::codec;
use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use futures_util::future::join_all;
use reqwest::StatusCode;
use starling_client::protocol::{AdminClient, ClientError, FleetClient};
use starling_core::tensor::{DType, TensorSpec};
use starling_core::wire::{self, CheckInResponse, ErrorBody, ErrorCode, UploadRequest};
use starling_core::{RoundIdx, RunId};
use starling_tests::*;

macro_rules! on_both_stores {
    ($($scenario:ident),* $(,)?) => {$(
        mod $scenario {
            #[sqlx::test(migrations = false)]
            async fn postgres(_pool: sqlx::postgres::PgPoolOptions, opts: sqlx::postgres::PgConnectOptions) {
                super::$scenario(&starling_tests::pg_url(&opts)).await.unwrap();
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn sqlite() {
                let (_dir, url) = starling_tests::sqlite_db();
                super::$scenario(&url).await.unwrap();
            }
        }
    )*};
}

on_both_stores!(
    concurrent_rounds_commit_the_exact_weighted_mean,
    deadlines_quorum_retries_and_dropouts,
    bad_input_is_refused_and_changes_nothing,
    sigkill_mid_round_loses_no_acknowledged_update,
);

/// 24 devices upload concurrently for three rounds; each committed model is, to the bit, the
/// example-weighted mean of exactly the acknowledged updates.
async fn concurrent_rounds_commit_the_exact_weighted_mean(db: &str) -> anyhow::Result<()> {
    let c = start_in_process(db).await?;
    let devices = enroll(&c.url, &c.admin, 24).await?;
    let spec = PlanSpec {
        params: 1000,
        cohort: 20,
        over_selection: 1.2,
        quorum: 20,
        selection_secs: 20.0,
        reporting_secs: 60.0,
        rounds: 3,
    };
    let run = RunId(c.admin.create_run(&spec.json()).await?.id);
    for round in 0..3 {
        wait_round_open(&c.admin, run, round).await?;
        let tasks = expect_tasks(&devices).await?;
        assert!(tasks.iter().all(|t| t.round_idx == RoundIdx(round) && version(t) == round));
        let global = model_values(&devices[0], &tasks[0].model_hash, &tasks[0].schema).await?;
        let uploads = devices.iter().zip(&tasks).enumerate().map(|(i, (d, t))| async move {
            let res = d
                .upload(run, t.round_idx, &upload_request(t, &delta(i, round, 1000), weight(i)))
                .await;
            (i, res)
        });
        let mut acked = vec![];
        for (i, res) in join_all(uploads).await {
            match res {
                Ok(ack) => {
                    assert_eq!((ack.run_id, ack.round_idx), (run, RoundIdx(round)));
                    acked.push(i);
                }
                // The round closes at 20 reports; later uploads are refused, never lost silently.
                Err(e) => assert_eq!(e.status(), Some(StatusCode::CONFLICT), "device {i}: {e}"),
            }
        }
        assert!(acked.len() >= 20, "only {} acknowledged", acked.len());
        let hash = wait_model(&c.admin, run, round + 1).await?;
        let committed = model_values(&devices[0], &hash, &tasks[0].schema).await?;
        let contributions: Vec<_> =
            acked.iter().map(|&i| (delta(i, round, 1000), weight(i))).collect();
        assert!(
            committed == fedavg_expected(&global, &contributions),
            "round {round}: model differs from the exact mean"
        );
        let r = &c.admin.rounds(run).await?[round as usize];
        assert_eq!(
            (r.state.as_str(), r.n_selected.unwrap(), r.n_reported.unwrap()),
            ("committed", 24, acked.len() as i64)
        );
        assert_eq!(r.n_dropped, Some(24 - acked.len() as i64));
        let loss = r
            .metrics
            .as_ref()
            .and_then(|m| m.get("loss"))
            .copied()
            .expect("training metrics aggregated");
        // Each device reports loss = 1/examples, so the weighted mean is n / Σ examples.
        let expected_loss =
            acked.len() as f64 / acked.iter().map(|&i| weight(i) as f64).sum::<f64>();
        assert!((loss - expected_loss).abs() < 1e-12);
    }
    // The run finishes once the driver hears of the last commit, a moment after it.
    let view = wait_for("the run to finish", Duration::from_secs(30), || async {
        let view = c.admin.run(run).await?;
        Ok((view.status != "running").then_some(view))
    })
    .await?;
    assert_eq!(
        (view.status.as_str(), view.model_version, view.rounds_committed),
        ("finished", 3, 3)
    );
    // A finished run hands out no more tasks.
    assert!(matches!(devices[0].check_in("default").await?, CheckInResponse::ComeBackLater { .. }));
    // The committed rounds' deltas are dropped after their commits, off the rounds' path.
    let store = starling_coordinator::store::SqlStore::connect(db, false).await?;
    let released = || async { Ok(store.stored_payloads(run).await?.is_empty().then_some(())) };
    wait_for("the committed rounds' deltas to be released", Duration::from_secs(10), released)
        .await?;
    c.running.shutdown().await?;
    Ok(())
}

/// Too few check-ins fail a round at its selection deadline and it is retried; dropouts are
/// counted and the round commits at its reporting deadline with the quorum; too few reports fail
/// it; nothing waits for a dead device.
async fn deadlines_quorum_retries_and_dropouts(db: &str) -> anyhow::Result<()> {
    let c = start_in_process(db).await?;
    let devices = enroll(&c.url, &c.admin, 6).await?;
    let spec = PlanSpec {
        params: 16,
        cohort: 4,
        over_selection: 1.5,
        quorum: 3,
        selection_secs: 1.0,
        reporting_secs: 2.5,
        rounds: 2,
    };
    let run = RunId(c.admin.create_run(&spec.json()).await?.id);

    // Round 0: two check-ins, quorum 3: fails at the selection deadline; round 1 opens by itself.
    wait_round_open(&c.admin, run, 0).await?;
    let early = [expect_task(&devices[0]).await?, expect_task(&devices[1]).await?];
    wait_round_open(&c.admin, run, 1).await?;
    let late = devices[0]
        .upload(run, early[0].round_idx, &upload_request(&early[0], &delta(0, 0, 16), 10))
        .await;
    assert_eq!(api_code(late), Some(ErrorCode::RoundClosed));

    // Round 1: six selected, three report, three drop out: commits at the reporting deadline.
    let tasks = expect_tasks(&devices).await?;
    assert!(tasks.iter().all(|t| t.round_idx == RoundIdx(1)));
    let global = model_values(&devices[0], &tasks[0].model_hash, &tasks[0].schema).await?;
    for i in 0..3 {
        devices[i]
            .upload(run, RoundIdx(1), &upload_request(&tasks[i], &delta(i, 1, 16), weight(i)))
            .await?;
    }
    let hash = wait_model(&c.admin, run, 1).await?;
    let committed = model_values(&devices[0], &hash, &tasks[0].schema).await?;
    let contributions: Vec<_> = (0..3).map(|i| (delta(i, 1, 16), weight(i))).collect();
    assert!(committed == fedavg_expected(&global, &contributions));

    // Round 2: six selected, two report: fails with too few reports, and round 3 retries.
    wait_round_open(&c.admin, run, 2).await?;
    let tasks = expect_tasks(&devices).await?;
    for i in 0..2 {
        devices[i]
            .upload(run, RoundIdx(2), &upload_request(&tasks[i], &delta(i, 2, 16), weight(i)))
            .await?;
    }
    wait_round_open(&c.admin, run, 3).await?;
    let late =
        devices[5].upload(run, RoundIdx(2), &upload_request(&tasks[5], &delta(5, 2, 16), 10)).await;
    assert_eq!(api_code(late), Some(ErrorCode::RoundClosed));

    let rounds = c.admin.rounds(run).await?;
    let summary: Vec<_> = rounds
        .iter()
        .take(3)
        .map(|r| {
            (
                r.state.as_str(),
                r.n_selected.unwrap(),
                r.n_reported.unwrap(),
                r.n_dropped,
                r.outcome.clone(),
            )
        })
        .collect();
    assert_eq!(
        summary,
        vec![
            (
                "failed",
                2,
                0,
                Some(2),
                Some(
                    serde_json::json!({"outcome": "too_few_selected", "selected": 2, "quorum": 3})
                )
            ),
            ("committed", 6, 3, Some(3), Some(serde_json::json!({"outcome": "commit"}))),
            (
                "failed",
                6,
                2,
                Some(4),
                Some(serde_json::json!({"outcome": "too_few_reports", "reported": 2, "quorum": 3}))
            ),
        ]
    );
    // One round can be read alone; an unknown one is a 404.
    let one = c.admin.round(run, 1).await?;
    assert_eq!((one.round_idx, one.state.as_str(), one.n_reported.unwrap()), (1, "committed", 3));
    assert_eq!(api_code(c.admin.round(run, 99).await), Some(ErrorCode::NotFound));
    // Stopping the run ends it; the open round is recorded as failed.
    let stopped = c.admin.stop(run).await?;
    assert_eq!((stopped.status.as_str(), stopped.model_version), ("stopped", 1));
    assert_eq!(c.admin.rounds(run).await?[3].state, "failed");
    c.running.shutdown().await?;
    Ok(())
}

/// Every kind of bad input gets a 4xx whose body names the problem, stores nothing, and leaves
/// the round able to take the device's good update afterwards.
async fn bad_input_is_refused_and_changes_nothing(db: &str) -> anyhow::Result<()> {
    let c = start_in_process(db).await?;
    let devices = enroll(&c.url, &c.admin, 3).await?;
    let spec = PlanSpec {
        params: 64,
        cohort: 2,
        over_selection: 1.0,
        quorum: 2,
        selection_secs: 30.0,
        reporting_secs: 60.0,
        rounds: 1,
    };
    let run = RunId(c.admin.create_run(&spec.json()).await?.id);
    wait_round_open(&c.admin, run, 0).await?;
    let task = expect_task(&devices[0]).await?;
    let d = &devices[0];
    let path = format!("/v1/runs/{run}/rounds/0/updates");
    let good = upload_request(&task, &delta(0, 0, 64), 10);
    let encode = |u: &UploadRequest| codec::to_vec(u).unwrap();

    let mut cases: Vec<(&str, StatusCode, ErrorCode, Vec<u8>)> = vec![];
    cases.push((
        "garbage",
        StatusCode::BAD_REQUEST,
        ErrorCode::MalformedBody,
        vec![0xff, 0x13, 0x37],
    ));
    cases.push(("empty body", StatusCode::BAD_REQUEST, ErrorCode::MalformedBody, vec![]));
    cases.push((
        "wrong message",
        StatusCode::BAD_REQUEST,
        ErrorCode::MalformedBody,
        codec::to_vec(&task).unwrap(),
    ));
    let mut truncated = encode(&good);
    truncated.truncate(truncated.len() / 2);
    cases.push(("truncated", StatusCode::BAD_REQUEST, ErrorCode::MalformedBody, truncated));
    let mut other_schema = task.schema.clone();
    other_schema.tensors.push(TensorSpec {
        name: "extra".into(),
        shape: vec![1],
        dtype: DType::F32,
    });
    let mut u = good.clone();
    u.delta = other_schema.encode_f32(&[0.0; 65]);
    cases.push((
        "foreign schema",
        StatusCode::UNPROCESSABLE_ENTITY,
        ErrorCode::SchemaMismatch,
        encode(&u),
    ));
    let mut u = good.clone();
    u.delta.data.truncate(60 * 4);
    cases.push((
        "short tensor",
        StatusCode::UNPROCESSABLE_ENTITY,
        ErrorCode::ShapeMismatch,
        encode(&u),
    ));
    for (name, v) in [("nan", f32::NAN), ("inf", f32::INFINITY), ("-inf", f32::NEG_INFINITY)] {
        let mut u = good.clone();
        u.delta.data[40..44].copy_from_slice(&v.to_le_bytes());
        cases.push((name, StatusCode::UNPROCESSABLE_ENTITY, ErrorCode::NonFiniteValue, encode(&u)));
    }
    let mut u = good.clone();
    u.example_count = 0;
    cases.push((
        "zero examples",
        StatusCode::UNPROCESSABLE_ENTITY,
        ErrorCode::InvalidField,
        encode(&u),
    ));
    let mut u = good.clone();
    u.metrics = BTreeMap::from([("loss".to_owned(), f64::NAN)]);
    cases.push((
        "nan metric",
        StatusCode::UNPROCESSABLE_ENTITY,
        ErrorCode::InvalidField,
        encode(&u),
    ));
    cases.push((
        "oversized",
        StatusCode::PAYLOAD_TOO_LARGE,
        ErrorCode::BodyTooLarge,
        vec![0u8; 64 * 4 + 65 * 1024],
    ));
    let mut u = good.clone();
    u.model_version = starling_core::ModelVersion(7);
    cases.push(("stale model", StatusCode::CONFLICT, ErrorCode::StaleModel, encode(&u)));

    for (name, status, code, body) in cases {
        let (got_status, bytes) = d.post_raw(&path, body, wire::CBOR_MEDIA_TYPE).await?;
        let body: ErrorBody = codec::decode(&bytes)
            .map_err(|e| anyhow::anyhow!("{name}: error body is not cbor: {e}"))?;
        assert_eq!((got_status, body.code), (status, code), "{name}: {}", body.message);
        assert!(!body.message.is_empty());
    }

    // Wrong round, wrong run, wrong media type, unselected device.
    let cases = [
        (
            "future round",
            format!("/v1/runs/{run}/rounds/5/updates"),
            StatusCode::NOT_FOUND,
            ErrorCode::NotFound,
            wire::CBOR_MEDIA_TYPE,
        ),
        (
            "unknown run",
            "/v1/runs/999/rounds/0/updates".to_owned(),
            StatusCode::NOT_FOUND,
            ErrorCode::NotFound,
            wire::CBOR_MEDIA_TYPE,
        ),
        (
            "json body",
            path.clone(),
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            ErrorCode::MalformedBody,
            "application/json",
        ),
    ];
    for (name, p, status, code, media) in cases {
        let (got, bytes) = d.post_raw(&p, encode(&good), media).await?;
        let body: ErrorBody = codec::decode(&bytes)?;
        assert_eq!((got, body.code), (status, code), "{name}: {}", body.message);
    }
    let res = devices[2].upload(run, RoundIdx(0), &good).await;
    assert_eq!(api_code(res), Some(ErrorCode::NotSelected));

    // Credentials: none, unknown, forged; bad enrollment token; admin without or with a wrong token.
    for credential in [None, Some("stdev_0000"), Some("not-even-the-format")] {
        let client = match credential {
            Some(credential) => FleetClient::with_credential(&c.url, credential),
            None => FleetClient::new(&c.url),
        };
        assert_eq!(
            api_code(client.upload(run, RoundIdx(0), &good).await),
            Some(ErrorCode::Unauthorized)
        );
        assert_eq!(api_code(client.check_in("default").await), Some(ErrorCode::Unauthorized));
    }
    let mut stranger = FleetClient::new(&c.url);
    assert_eq!(api_code(stranger.enroll("stenr_forged").await), Some(ErrorCode::Unauthorized));
    for token in ["", "wrong-operator-token-123456"] {
        let res = AdminClient::new(&c.url, token).run(run).await;
        assert_eq!(api_code(res), Some(ErrorCode::Unauthorized));
    }
    let res = AdminClient::new(&c.url, OPERATOR_TOKEN)
        .create_run(&serde_json::json!({"cohort_size": 0}))
        .await;
    assert_eq!(api_code(res), Some(ErrorCode::MalformedBody));
    let mut bad_plan = spec.json();
    bad_plan["cohort_size"] = serde_json::json!(0);
    let res = c.admin.create_run(&bad_plan).await;
    assert!(
        matches!(&res, Err(ClientError::Api { status: StatusCode::UNPROCESSABLE_ENTITY, body }) if body.message.contains("cohort_size"))
    );
    assert_eq!(api_code(c.admin.run(RunId(404)).await), Some(ErrorCode::NotFound));

    // Nothing was stored, and the device's good update is still accepted, once.
    let r = &c.admin.rounds(run).await?[0];
    assert_eq!((r.n_selected.unwrap(), r.n_reported.unwrap()), (1, 0));
    d.upload(run, RoundIdx(0), &good).await?;
    assert_eq!(api_code(d.upload(run, RoundIdx(0), &good).await), Some(ErrorCode::DuplicateUpload));
    assert_eq!(c.admin.rounds(run).await?[0].n_reported.unwrap(), 1);
    // Evaluation reports are validated too.
    let eval = starling_core::wire::EvaluationReport {
        model_version: starling_core::ModelVersion(9),
        example_count: 5,
        metrics: BTreeMap::from([("accuracy".to_owned(), 0.5)]),
    };
    assert_eq!(api_code(d.evaluate(run, &eval).await), Some(ErrorCode::NotFound));
    c.running.shutdown().await?;
    Ok(())
}

/// The coordinator process is SIGKILLed while uploads are in flight. After a restart every
/// acknowledged update is still in the round, unacknowledged ones can be resent, and the
/// committed models equal, to the bit, those of an uninterrupted run fed the same updates.
async fn sigkill_mid_round_loses_no_acknowledged_update(db: &str) -> anyhow::Result<()> {
    const PARAMS: usize = 100_000;
    let bin = Path::new(env!("CARGO_BIN_EXE_coordinator_under_test"));
    let mut coordinator = RestartableCoordinator::spawn(bin, db).await?;
    let admin = coordinator.admin.clone();
    let devices = enroll(coordinator.url(), &admin, 24).await?;
    let spec = PlanSpec {
        params: PARAMS as u64,
        cohort: 20,
        over_selection: 1.2,
        quorum: 20,
        selection_secs: 60.0,
        reporting_secs: 120.0,
        rounds: 3,
    };
    let run = RunId(admin.create_run(&spec.json()).await?.id);
    wait_round_open(&admin, run, 0).await?;
    let tasks = expect_tasks(&devices).await?;
    let initial_hash = tasks[0].model_hash.clone();

    // Twelve concurrent uploads; SIGKILL as soon as three are acknowledged.
    let (ack_tx, mut ack_rx) = tokio::sync::mpsc::unbounded_channel();
    let mut in_flight = vec![];
    for i in 0..12 {
        let (d, t, tx) = (devices[i].clone(), tasks[i].clone(), ack_tx.clone());
        in_flight.push(tokio::spawn(async move {
            let res = d
                .upload(run, RoundIdx(0), &upload_request(&t, &delta(i, 0, PARAMS), weight(i)))
                .await;
            let _ = tx.send(res.is_ok());
            (i, res)
        }));
    }
    let mut n_acked = 0;
    while n_acked < 3 {
        if ack_rx.recv().await.expect("senders alive") {
            n_acked += 1;
        }
    }
    coordinator.kill()?;
    let mut acked = vec![];
    let mut unacked = vec![];
    for h in in_flight {
        let (i, res) = h.await?;
        if res.is_ok() { acked.push(i) } else { unacked.push(i) }
    }
    eprintln!(
        "killed with {} acknowledged and {} unacknowledged uploads",
        acked.len(),
        unacked.len()
    );

    coordinator.respawn().await?;
    // Acknowledged updates survived: resending one is a duplicate.
    for &i in &acked {
        let res = devices[i]
            .upload(run, RoundIdx(0), &upload_request(&tasks[i], &delta(i, 0, PARAMS), weight(i)))
            .await;
        assert_eq!(
            api_code(res),
            Some(ErrorCode::DuplicateUpload),
            "acknowledged update of device {i} was lost"
        );
    }
    // Unacknowledged ones may or may not have been stored; resending settles it either way.
    for &i in &unacked {
        match devices[i]
            .upload(run, RoundIdx(0), &upload_request(&tasks[i], &delta(i, 0, PARAMS), weight(i)))
            .await
        {
            Ok(_) => {}
            Err(e) if e.status() == Some(StatusCode::CONFLICT) => {}
            Err(e) => return Err(e.into()),
        }
    }
    // The selections survived too: eight more devices complete the cohort.
    for i in 12..20 {
        devices[i]
            .upload(run, RoundIdx(0), &upload_request(&tasks[i], &delta(i, 0, PARAMS), weight(i)))
            .await?;
    }
    let mut hashes = vec![wait_model(&admin, run, 1).await?];
    for round in 1..3 {
        wait_round_open(&admin, run, round).await?;
        let tasks = expect_tasks(&devices).await?;
        for i in 0..20 {
            devices[i]
                .upload(
                    run,
                    RoundIdx(round),
                    &upload_request(&tasks[i], &delta(i, round, PARAMS), weight(i)),
                )
                .await?;
        }
        hashes.push(wait_model(&admin, run, round + 1).await?);
    }
    let schema = starling_core::tensor::TensorSchema {
        tensors: vec![TensorSpec {
            name: "w".into(),
            shape: vec![PARAMS as u64],
            dtype: DType::F32,
        }],
    };
    let mut expected = model_values(&devices[0], &initial_hash, &schema).await?;
    for (round, hash) in hashes.iter().enumerate() {
        let contributions: Vec<_> =
            (0..20).map(|i| (delta(i, round as i64, PARAMS), weight(i))).collect();
        expected = fedavg_expected(&expected, &contributions);
        let got = model_values(&devices[0], hash, &schema).await?;
        assert!(got == expected, "model version {} differs from the exact mean", round + 1);
    }
    drop(coordinator);

    // An uninterrupted run, on a fresh embedded store, fed the same updates, commits the same models.
    let (_dir, fresh) = sqlite_db();
    let reference = start_in_process(&fresh).await?;
    let ref_devices = enroll(&reference.url, &reference.admin, 24).await?;
    let ref_run = RunId(reference.admin.create_run(&spec.json()).await?.id);
    let mut ref_hashes = vec![];
    for round in 0..3 {
        wait_round_open(&reference.admin, ref_run, round).await?;
        let tasks = expect_tasks(&ref_devices).await?;
        for i in 0..20 {
            ref_devices[i]
                .upload(
                    ref_run,
                    RoundIdx(round),
                    &upload_request(&tasks[i], &delta(i, round, PARAMS), weight(i)),
                )
                .await?;
        }
        ref_hashes.push(wait_model(&reference.admin, ref_run, round + 1).await?);
    }
    assert_eq!(hashes, ref_hashes, "a killed-and-restarted run committed different models");
    reference.running.shutdown().await?;
    Ok(())
}

/// Federated training end to end on real data: a coordinator, 20 SDK participants each with
/// its own slice of the digits, burn training on every one; the committed global model reaches
/// 90% accuracy on the held-out test set.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn federated_digits_reach_ninety_percent() {
    use starling_client::simulate::simulate;
    let (_dir, db) = sqlite_db();
    let c = start_in_process(&db).await.unwrap();
    let config = digits_simulation(&c.url, 20, 10, 15, 7);
    let results = simulate(config, |r| {
        eprintln!("model {}: test accuracy {:.3}", r.version, r.test_accuracy)
    })
    .await
    .unwrap()
    .rounds;
    assert_eq!(results.len(), 15);
    let best_late = results[10..].iter().map(|r| r.test_accuracy).fold(0.0, f64::max);
    assert!(
        best_late >= 0.90,
        "accuracy curve: {:?}",
        results.iter().map(|r| r.test_accuracy).collect::<Vec<_>>()
    );
    assert!(results[0].test_accuracy < 0.6, "the first round should still be far from trained");
    // Federated evaluation reports from the devices reached the coordinator too.
    let run = c.admin.models(RunId(1)).await.unwrap();
    assert!(run.iter().filter(|m| m.n_evaluations > 0).count() >= 10);
    c.running.shutdown().await.unwrap();
}

/// Shakespeare's natural partition: each client is one speaking role, training an LSTM to
/// predict the next character; two rounds already beat chance (1/80) several times over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn federated_shakespeare_roles_learn_next_characters() {
    use starling_client::data::Dataset;
    use starling_client::simulate::{SimulationConfig, simulate};
    let (_dir, db) = sqlite_db();
    let c = start_in_process(&db).await.unwrap();
    let config = SimulationConfig {
        dataset: Dataset::Shakespeare,
        training: serde_json::json!({"epochs": 1, "batch_size": 10, "lr": 1.0}),
        seed: 3,
        ..digits_simulation(&c.url, 4, 2, 2, 3)
    };
    let results = simulate(config, |r| {
        eprintln!("model {}: next-char accuracy {:.3}", r.version, r.test_accuracy)
    })
    .await
    .unwrap()
    .rounds;
    assert_eq!(results.len(), 2);
    assert!(
        results[1].test_accuracy > 0.08,
        "accuracy {:?}",
        results.iter().map(|r| r.test_accuracy).collect::<Vec<_>>()
    );
    c.running.shutdown().await.unwrap();
}

/// A seeded simulation repeats itself: the simulator draws each round's cohort from the seed
/// (exactly the cohort, every one reporting) and each client's training seed from the seed, its
/// index and the round, so two runs on one coordinator commit the same models and score the
/// same curve, bit for bit; another seed does not. The curve also carries each round's time
/// and bytes, and scoring every second model on a sample of the test set scores those only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_seeded_simulation_repeats_bit_for_bit() {
    use starling_client::simulate::{Scoring, SimulationConfig, simulate};
    let (_dir, db) = sqlite_db();
    let c = start_in_process(&db).await.unwrap();
    let config = SimulationConfig {
        seeded_cohorts: true,
        training: serde_json::json!({"epochs": 1, "batch_size": 10, "lr": 0.1}),
        ..digits_simulation(&c.url, 8, 3, 3, 7)
    };
    let first = simulate(config.clone(), |_| {}).await.unwrap();
    let second = simulate(config.clone(), |_| {}).await.unwrap();
    let other = simulate(SimulationConfig { seed: 8, ..config.clone() }, |_| {}).await.unwrap();
    assert_eq!(first.rounds.len(), 3);
    let curve = |r: &starling_client::simulate::SimulationReport| -> Vec<(String, u64, u64)> {
        r.rounds
            .iter()
            .map(|r| (r.content_hash.clone(), r.test_accuracy.to_bits(), r.test_loss.to_bits()))
            .collect()
    };
    assert_eq!(curve(&first), curve(&second), "the same seed, the same models and scores");
    assert_ne!(curve(&first), curve(&other), "another seed, another run");
    for report in [&first, &second] {
        for (a, b) in report.rounds.iter().zip(&first.rounds) {
            // The training loss is a mean over the round's reports in arrival order: equal to
            // the last bits of its sum.
            let (a, b) = (a.train_loss.unwrap(), b.train_loss.unwrap());
            assert!((a - b).abs() <= 1e-12 * b.abs(), "{a} vs {b}");
        }
        for r in c.admin.rounds(report.run_id).await.unwrap() {
            assert_eq!(
                (r.n_selected.unwrap(), r.n_reported.unwrap()),
                (3, 3),
                "round {}: exactly the cohort",
                r.round_idx
            );
        }
    }
    let row = &first.rounds[1];
    assert!(row.round_secs.is_some_and(|s| s > 0.0) && row.upload_bytes.is_some_and(|b| b > 0));
    assert!(row.elapsed_secs > first.rounds[0].elapsed_secs);
    assert_eq!(row.epsilon, None, "no DP, no ε");

    // Scoring every second model on 100 test examples: versions 2 and 3 (the last) only.
    let scoring = Scoring { every: 2, examples: Some(100), initial: false };
    let sparse = simulate(SimulationConfig { scoring, ..config }, |_| {}).await.unwrap();
    let versions: Vec<i64> = sparse.rounds.iter().map(|r| r.version).collect();
    assert_eq!(versions, [2, 3]);
    assert_eq!(sparse.rounds[0].content_hash, first.rounds[1].content_hash, "the same model");
    c.running.shutdown().await.unwrap();
}

/// Two simulations at once on one coordinator, one IID and one pathologically
/// non-IID, each train only their own run. Every device the admin API records in a round of a
/// run is one of that simulation's devices (before, both used the population `default` and each
/// run took updates from the other's devices); the pacing flags reach the plan; and a simulation
/// told to use a population another run trains is refused before it enrolls anyone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_simulations_train_only_their_own_runs() {
    use starling_client::data::Partition;
    use starling_client::simulate::{Pacing, SimulationConfig, SimulationError, simulate};
    let (_dir, db) = sqlite_db();
    let c = start_in_process(&db).await.unwrap();
    let iid = SimulationConfig {
        training: serde_json::json!({"epochs": 1, "batch_size": 10, "lr": 0.1}),
        ..digits_simulation(&c.url, 6, 3, 3, 5)
    };
    let skewed = SimulationConfig {
        partition: Partition::Shards(2),
        pacing: Pacing { reporting_timeout_secs: 300.0, min_quorum: Some(3), ..Pacing::default() },
        ..iid.clone()
    };
    let (a, b) = tokio::join!(simulate(iid, |_| {}), simulate(skewed, |_| {}));
    let (a, b) = (a.unwrap(), b.unwrap());
    assert_ne!(a.population, b.population);
    for report in [&a, &b] {
        assert_eq!(report.devices.len(), 6);
        assert_eq!(report.rounds.len(), 3);
        assert_eq!(c.admin.run(report.run_id).await.unwrap().population, report.population);
        for round in c.admin.rounds(report.run_id).await.unwrap() {
            let record = c.admin.round_devices(report.run_id, round.round_idx).await.unwrap();
            let strangers: Vec<i64> = record
                .iter()
                .map(|d| d.device_id)
                .filter(|d| !report.devices.contains(&starling_core::DeviceId(*d)))
                .collect();
            assert!(strangers.is_empty(), "run {} took devices {strangers:?}", report.run_id);
            if round.state == "committed" {
                let reported = record.iter().filter(|d| d.reported.is_some()).count();
                assert_eq!(reported as i64, round.n_reported.unwrap(), "{record:?}");
            }
        }
        // The simulator's test-set scores are the run's central evaluations.
        for (model, result) in
            c.admin.models(report.run_id).await.unwrap().iter().skip(1).zip(&report.rounds)
        {
            let central = &model.central;
            assert_eq!(central.len(), 1, "{central:?}");
            assert_eq!(central[0].evaluator, starling_client::simulate::SIMULATOR_EVALUATOR);
            assert_eq!(central[0].metrics["accuracy"], result.test_accuracy);
        }
    }
    let plan = c.admin.run(b.run_id).await.unwrap().plan;
    assert_eq!(
        (plan["reporting_timeout_secs"].as_f64(), plan["min_quorum"].as_u64()),
        (Some(300.0), Some(3))
    );

    // A population that a running run trains is refused by name.
    let digits = starling_client::data::digits(&shared_data().join("sklearn_digits")).unwrap();
    let mut busy = mlp_plan(digits.input(), 1, 5);
    busy["population"] = "shared".into();
    let busy = c.admin.create_run(&busy).await.unwrap();
    let devices_before = c.admin.devices().await.unwrap().len();
    let refused = simulate(
        SimulationConfig {
            population: Some("shared".into()),
            ..digits_simulation(&c.url, 2, 1, 1, 5)
        },
        |_| {},
    )
    .await;
    match refused {
        Err(e @ SimulationError::PopulationBusy { .. }) => {
            assert!(e.to_string().contains(&format!("run {}", busy.id)), "{e}")
        }
        other => panic!("expected PopulationBusy, got {other:?}"),
    }
    assert_eq!(c.admin.devices().await.unwrap().len(), devices_before);
    c.running.shutdown().await.unwrap();
}

/// `/metrics`, scraped during a run and after it, counts exactly the rounds, selections,
/// acknowledged and refused uploads and dropouts the admin API reports; the per-round counters
/// of the admin API agree with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_the_rounds_that_happened() {
    let (_dir, db) = sqlite_db();
    let c = start_in_process(&db).await.unwrap();
    let http = http_client();
    let scrape = || async {
        let res = http
            .get(format!("{}/metrics", c.url))
            .bearer_auth(OPERATOR_TOKEN)
            .send()
            .await
            .unwrap();
        assert_eq!(res.status(), StatusCode::OK);
        res.text().await.unwrap()
    };
    let unauthenticated = http.get(format!("{}/metrics", c.url)).send().await.unwrap();
    assert_eq!(unauthenticated.status(), StatusCode::UNAUTHORIZED);

    let devices = enroll(&c.url, &c.admin, 8).await.unwrap();
    let spec = PlanSpec {
        params: 100,
        cohort: 6,
        over_selection: 1.34,
        quorum: 6,
        selection_secs: 20.0,
        reporting_secs: 60.0,
        rounds: 2,
    };
    let run = RunId(c.admin.create_run(&spec.json()).await.unwrap().id);
    for round in 0..2 {
        wait_round_open(&c.admin, run, round).await.unwrap();
        let tasks = expect_tasks(&devices).await.unwrap();
        // One malformed upload first: refused, and counted by its reason.
        let mut bad = upload_request(&tasks[0], &delta(0, round, 100), 1);
        bad.delta = tasks[0].schema.encode_f32(&[f32::NAN; 100]);
        assert!(devices[0].upload(run, RoundIdx(round), &bad).await.is_err());
        let uploads = devices.iter().zip(&tasks).enumerate().map(|(i, (d, t))| async move {
            d.upload(run, t.round_idx, &upload_request(t, &delta(i, round, 100), weight(i))).await
        });
        join_all(uploads).await;
        wait_model(&c.admin, run, round + 1).await.unwrap();
        if round == 0 {
            // Mid-run: one round so far.
            let text = scrape().await;
            assert_eq!(
                metric(&text, "starling_rounds_total{outcome=\"committed\"}"),
                1.0,
                "{text}"
            );
        }
    }
    let rounds = c.admin.rounds(run).await.unwrap();
    let sum = |f: &dyn Fn(&starling_core::admin::RoundView) -> i64| {
        rounds.iter().map(f).sum::<i64>() as f64
    };
    let text = scrape().await;
    assert_eq!(metric(&text, "starling_rounds_total{outcome=\"committed\"}"), 2.0, "{text}");
    assert_eq!(
        metric(&text, "starling_participants_selected_total"),
        sum(&|r| r.n_selected.unwrap())
    );
    assert_eq!(metric(&text, "starling_updates_accepted_total"), sum(&|r| r.n_reported.unwrap()));
    assert_eq!(metric(&text, "starling_dropouts_total"), sum(&|r| r.n_dropped.unwrap_or(0)));
    assert_eq!(metric(&text, "starling_uploads_rejected_total{reason=\"non_finite_value\"}"), 2.0);
    let refused_late = 16.0 - sum(&|r| r.n_reported.unwrap());
    if refused_late > 0.0 {
        assert_eq!(
            metric(&text, "starling_uploads_rejected_total{reason=\"round_closed\"}"),
            refused_late
        );
    }
    assert!(
        metric(&text, "starling_upload_bytes_total") >= sum(&|r| r.n_reported.unwrap()) * 400.0
    );
    assert!(metric(&text, "starling_aggregation_seconds_count") == 2.0);
    // Updates are written in groups: at least one write a round, at most one an update.
    let group_writes = metric(&text, "starling_store_seconds_count{op=\"insert_update_group\"}");
    assert!(
        group_writes >= rounds.len() as f64 && group_writes <= sum(&|r| r.n_reported.unwrap()),
        "{group_writes} group writes"
    );
    for r in &rounds {
        assert_eq!(
            r.n_rejected,
            Some(8 - r.n_reported.unwrap() as u64 + 1),
            "round {}",
            r.round_idx
        );
        assert!(r.upload_bytes.unwrap() >= r.n_reported.unwrap() as u64 * 400);
    }
    c.running.shutdown().await.unwrap();
}

/// The value of the sample named exactly `series` (name and labels) in an OpenMetrics text.
fn metric(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.trim().parse().ok())
        .unwrap_or_else(|| panic!("no sample {series} in:\n{text}"))
}

/// Per-device and per-IP rate limits: over the limit a call gets 429 with `Retry-After` and a
/// `rate_limited` code, nothing else is done, other devices are unaffected, and after waiting
/// the device is served again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rate_limits_answer_429_and_recover() {
    use starling_coordinator::http::Limits;
    use starling_coordinator::http::limits::RateLimit;
    let (_dir, db) = sqlite_db();
    let limits = Limits {
        device: Some(RateLimit { per_sec: 2.0, burst: 3.0 }),
        ip: None,
        ..Limits::default()
    };
    let c = start_in_process_with(&db, limits).await.unwrap();
    let http = http_client();
    let token = c.admin.enrollment_token(2).await.unwrap();
    let enroll = || async {
        let body = codec::to_vec(&wire::EnrollRequest {
            enrollment_token: token.clone(),
            identity_key: None,
            identity_certificate: None,
        })
        .unwrap();
        let res = http
            .post(format!("{}/v1/enroll", c.url))
            .header("content-type", wire::CBOR_MEDIA_TYPE)
            .body(body)
            .send()
            .await
            .unwrap();
        assert_eq!(res.status(), StatusCode::OK);
        codec::decode::<wire::EnrollResponse>(&res.bytes().await.unwrap()).unwrap().credential
    };
    let (a, b) = (enroll().await, enroll().await);
    let check_in = |credential: String| {
        let http = http.clone();
        let url = format!("{}/v1/check-in", c.url);
        async move {
            let body = codec::to_vec(&wire::CheckInRequest {
                population: "default".into(),
                attributes: Default::default(),
            })
            .unwrap();
            http.post(url)
                .bearer_auth(credential)
                .header("content-type", wire::CBOR_MEDIA_TYPE)
                .body(body)
                .send()
                .await
                .unwrap()
        }
    };
    for _ in 0..3 {
        assert_eq!(check_in(a.clone()).await.status(), StatusCode::OK);
    }
    let limited = check_in(a.clone()).await;
    assert_eq!(limited.status(), StatusCode::TOO_MANY_REQUESTS);
    let retry_after: u64 = limited.headers()["retry-after"].to_str().unwrap().parse().unwrap();
    assert!((1..=2).contains(&retry_after), "Retry-After {retry_after}");
    let body: ErrorBody = codec::decode(&limited.bytes().await.unwrap()).unwrap();
    assert_eq!(body.code, ErrorCode::RateLimited);
    // Another device has its own allowance.
    assert_eq!(check_in(b.clone()).await.status(), StatusCode::OK);
    tokio::time::sleep(std::time::Duration::from_secs(retry_after)).await;
    assert_eq!(check_in(a.clone()).await.status(), StatusCode::OK);
    c.running.shutdown().await.unwrap();

    // Per IP: every fleet call from this address counts, enrollment attempts included.
    let (_dir2, db2) = sqlite_db();
    let limits = Limits {
        device: None,
        ip: Some(RateLimit { per_sec: 0.5, burst: 4.0 }),
        ..Limits::default()
    };
    let c = start_in_process_with(&db2, limits).await.unwrap();
    let bad_enroll = || {
        let body = codec::to_vec(&wire::EnrollRequest {
            enrollment_token: "nope".into(),
            identity_key: None,
            identity_certificate: None,
        })
        .unwrap();
        http.post(format!("{}/v1/enroll", c.url))
            .header("content-type", wire::CBOR_MEDIA_TYPE)
            .body(body)
            .send()
    };
    for _ in 0..4 {
        assert_eq!(bad_enroll().await.unwrap().status(), StatusCode::UNAUTHORIZED);
    }
    let limited = bad_enroll().await.unwrap();
    assert_eq!(limited.status(), StatusCode::TOO_MANY_REQUESTS);
    assert!(limited.headers().contains_key("retry-after"));
    // The operator's API is not throttled by the fleet's limit.
    assert!(c.admin.enrollment_token(1).await.is_ok());
    c.running.shutdown().await.unwrap();
}
