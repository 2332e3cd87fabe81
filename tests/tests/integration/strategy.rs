//! Strategies end to end: a run with FedAdam whose coordinator is SIGKILLed between
//! rounds commits, to the bit, the models of the uninterrupted sequence of optimizer steps,
//! because the optimizer's state is committed with each model and restored on start; robust
//! aggregators, reading the round's updates back from the store tile by tile, commit exactly
//! their combination of the uploads and leave an attacker's update out. A run whose stored
//! server state cannot be read stops saying why, rather than keeping the coordinator down.

use std::path::Path;

use starling_client::protocol::{AdminClient, FleetClient};
use std::time::Duration;

use starling_core::compression::Compression;
use starling_core::fedavg::{FedAvgAccumulator, validate_parts};
use starling_core::robust::{Aggregation, KrumSelection, combine};
use starling_core::strategy::{AdaptiveParams, ServerOptimizer};
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

/// A FedAdam run of three rounds on a coordinator the test can kill, and its enrolled devices.
struct FedAdamRun {
    optimizer: ServerOptimizer,
    coordinator: RestartableCoordinator,
    admin: AdminClient,
    devices: Vec<FleetClient>,
    spec: PlanSpec,
    run: RunId,
}

async fn fed_adam_run(db: &str) -> FedAdamRun {
    let optimizer =
        ServerOptimizer::FedAdam(AdaptiveParams { lr: 0.05, beta1: 0.9, beta2: 0.99, tau: 1e-3 });
    let bin = Path::new(env!("CARGO_BIN_EXE_coordinator_under_test"));
    let coordinator = RestartableCoordinator::spawn(bin, db).await.unwrap();
    let admin = coordinator.admin.clone();
    let devices = enroll(coordinator.url(), &admin, DEVICES).await.unwrap();
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
    FedAdamRun { optimizer, coordinator, admin, devices, spec, run }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_fed_adam_run_commits_the_uninterrupted_models() {
    let (_dir, db) = sqlite_db();
    let FedAdamRun { optimizer, mut coordinator, admin, devices, spec, run } =
        fed_adam_run(&db).await;
    assert_eq!(admin.run(run).await.unwrap().plan["strategy"]["optimizer"]["kind"], "fed_adam");
    let initial = admin.models(run).await.unwrap()[0].content_hash.clone();
    let mut hashes = vec![];
    for round in 0..2 {
        hashes.push(one_round(&admin, &devices, run, round).await);
    }
    // SIGKILL with the third round open: the moments after model 2 are only in the store.
    wait_round_open(&admin, run, 2).await.unwrap();
    coordinator.kill().unwrap();
    coordinator.respawn().await.unwrap();
    hashes.push(one_round(&admin, &devices, run, 2).await);

    // The same steps, uninterrupted, on the same updates.
    let schema = spec.schema();
    let mut model = model_values(&devices[0], &initial, &schema).await.unwrap();
    let mut state = optimizer.initial_state(PARAMS);
    for (round, hash) in hashes.iter().enumerate() {
        let mut acc = FedAvgAccumulator::new(PARAMS);
        for i in 0..DEVICES {
            let bytes = starling_core::tensor::f32_to_le_bytes(&delta(i, round as i64, PARAMS));
            let metrics = [("loss".to_owned(), 1.0 / weight(i) as f64)].into();
            acc.add(&validate_parts(&schema, Compression::F32, bytes, weight(i), metrics).unwrap());
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
            acc.add(
                &validate_parts(&schema, Compression::F32, bytes, weight(i), Default::default())
                    .unwrap(),
            );
        }
        plain = fed_avg.step(&plain, &acc.finish().unwrap(), &Default::default(), 1.0).unwrap().0;
    }
    assert!(plain != model);
    drop(coordinator);
}

/// Five devices, the last one an attacker sending its delta sign-flipped and 100× larger; each
/// robust aggregator commits `global + combine(uploads)` to the bit, and stays within the
/// honest updates' range where the plain mean is dragged away.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn robust_aggregators_commit_their_combination_and_leave_the_attacker_out() {
    const N: usize = 5;
    let (_dir, db) = sqlite_db();
    let c = start_in_process(&db).await.unwrap();
    let devices = enroll(&c.url, &c.admin, N).await.unwrap();
    let spec = PlanSpec::all_of(N, PARAMS, 1);
    let schema = spec.schema();
    let honest: Vec<Vec<f32>> = (0..N - 1).map(|i| delta(i, 0, PARAMS)).collect();
    let attack: Vec<f32> = delta(N - 1, 0, PARAMS).iter().map(|v| -100.0 * v).collect();
    let honest_reach = honest.iter().flatten().fold(0.0f32, |m, v| m.max(v.abs()));
    for (aggregation, norm_bound) in [
        (Aggregation::CoordinateMedian {}, Some(20.0)),
        (Aggregation::TrimmedMean { trim_fraction: 0.2 }, None),
        (Aggregation::Krum { byzantine: 1, select: 2, selection: KrumSelection::Scores }, None),
        (Aggregation::GeometricMedian { iterations: 3, smoothing: 1e-6 }, None),
    ] {
        let mut plan = spec.json();
        plan["strategy"] =
            serde_json::json!({"aggregation": aggregation, "norm_bound": norm_bound});
        let run = RunId(c.admin.create_run(&plan).await.unwrap().id);
        let view = c.admin.run(run).await.unwrap();
        assert_eq!(view.plan["strategy"]["aggregation"]["kind"], aggregation.name());
        let initial = c.admin.models(run).await.unwrap()[0].content_hash.clone();
        let global = model_values(&devices[0], &initial, &schema).await.unwrap();
        wait_round_open(&c.admin, run, 0).await.unwrap();
        let tasks = expect_tasks(&devices).await.unwrap();
        // One at a time, so the slot order is the devices' order.
        let uploads: Vec<Vec<f32>> = honest.iter().cloned().chain([attack.clone()]).collect();
        for ((d, t), (i, u)) in devices.iter().zip(&tasks).zip(uploads.iter().enumerate()) {
            d.upload(run, RoundIdx(0), &upload_request(t, u, weight(i))).await.unwrap();
        }
        let hash = wait_model(&c.admin, run, 1).await.unwrap();
        let got = model_values(&devices[0], &hash, &schema).await.unwrap();
        let read = |start: usize, len: usize| {
            Ok::<_, std::convert::Infallible>(
                uploads.iter().map(|u| u[start..start + len].to_vec()).collect(),
            )
        };
        let combined = combine(&aggregation, N, PARAMS, 7, norm_bound, read).unwrap();
        let want: Vec<f32> =
            global.iter().zip(&combined.delta).map(|(&g, &d)| (f64::from(g) + d) as f32).collect();
        assert!(
            got == want,
            "{}: the committed model is not global + the combination",
            aggregation.name()
        );
        if let Some(selected) = &combined.selected {
            assert!(!selected.contains(&(N - 1)), "Krum chose the attacker: {selected:?}");
        }
        let moved = got.iter().zip(&global).fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(
            moved <= honest_reach + 1e-6,
            "{}: moved {moved}, honest reach {honest_reach}",
            aggregation.name()
        );
        wait_for("the run to finish", Duration::from_secs(30), || async {
            Ok((c.admin.run(run).await?.status == "finished").then_some(()))
        })
        .await
        .unwrap();
    }
    // The plain mean on the same uploads is dragged far outside the honest range.
    let contributions: Vec<(Vec<f32>, u64)> =
        honest.iter().cloned().chain([attack]).enumerate().map(|(i, u)| (u, weight(i))).collect();
    let mean = fedavg_expected(&vec![0.0; PARAMS], &contributions);
    assert!(mean.iter().any(|v| v.abs() > 10.0 * honest_reach));
    c.running.shutdown().await.unwrap();
}

/// A run whose stored server state this coordinator cannot read (corrupt, or written in an
/// older layout, as `blt_ftrl`'s buffers were) used to keep the whole coordinator from
/// starting. Now that run stops saying why, and the coordinator starts and the other run goes
/// on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_whose_server_state_cannot_be_read_stops_and_the_coordinator_starts() {
    let (_dir, db) = sqlite_db();
    let FedAdamRun { mut coordinator, admin, devices, spec, run: broken, .. } =
        fed_adam_run(&db).await;
    one_round(&admin, &devices, broken, 0).await;
    let mut other = spec.json();
    other["population"] = "elsewhere".into();
    let other = RunId(admin.create_run(&other).await.unwrap().id);
    wait_round_open(&admin, other, 0).await.unwrap();
    // The round's model and server state are written just after its commit: corrupt the state
    // only once it is there (killing before the write made this test fail now and then).
    let pool = sqlx::SqlitePool::connect(&db).await.unwrap();
    wait_for("the run's server state to be written", Duration::from_secs(30), || async {
        let (states,): (i64,) =
            sqlx::query_as("SELECT COUNT(*) FROM optimizer_states WHERE run_id = ?")
                .bind(broken.0)
                .fetch_one(&pool)
                .await?;
        Ok((states > 0).then_some(()))
    })
    .await
    .unwrap();
    coordinator.kill().unwrap();
    let changed = sqlx::query("UPDATE optimizer_states SET data = X'00' WHERE run_id = ?")
        .bind(broken.0)
        .execute(&pool)
        .await
        .unwrap()
        .rows_affected();
    assert!(changed > 0, "the run stored its server state");
    pool.close().await;

    coordinator.respawn().await.unwrap();
    let view = admin.run(broken).await.unwrap();
    assert_eq!(view.status, "stopped");
    let reason = view.stop_reason.unwrap_or_default();
    assert!(reason.contains("cannot be resumed") && reason.contains("optimizer state"), "{reason}");
    let resumed = admin.run(other).await.unwrap();
    assert_eq!(resumed.status, "running");
    wait_round_open(&admin, other, 0).await.unwrap();
    drop(coordinator);
}
