//! The operator's tools against a live coordinator: the `starling` command line (runs, models,
//! tokens, devices), `starling-client evaluate` (central evaluation), and a model exported as
//! safetensors read back by Python's `safetensors`.

use std::path::Path;
use std::process::Output;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use starling_client::data;
use starling_client::participant::{Outcome, Participant, ParticipantProgress, Phase};
use starling_client::{Device, examples::Examples};
use starling_core::RunId;
use starling_core::secagg;
use starling_core::tensor::safetensors;
use starling_tests::{OPERATOR_TOKEN, mlp_plan, python_with, shared_data, sqlite_db};

fn operator_bin() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_operator_under_test"))
}

/// `starling ARGS` against `url` with the operator token in the environment, as an operator
/// runs it.
pub(crate) async fn starling(url: &str, args: &[&str]) -> Output {
    tokio::process::Command::new(operator_bin())
        .args(args)
        .env("STARLING_URL", url)
        .env("STARLING_OPERATOR_TOKEN", OPERATOR_TOKEN)
        .output()
        .await
        .expect("running starling")
}

/// `starling-client evaluate` of `run` on the digits' held-out set as the evaluator
/// "ops-holdout", following the run to its end (`--once`: what is committed now).
fn central_evaluator(url: &str, run: &str) -> tokio::process::Command {
    let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_client_under_test"));
    command
        .args(["evaluate", "--url", url, "--run", run, "--dataset", "digits"])
        .args(["--backend", "cpu", "--name", "ops-holdout"])
        .arg("--data-dir")
        .arg(shared_data())
        .env("STARLING_OPERATOR_TOKEN", OPERATOR_TOKEN);
    command
}

pub(crate) fn stdout(out: &Output) -> String {
    assert!(
        out.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Devices training the digits in `population` until `stop`: each its own 150 examples.
fn devices(
    url: &str,
    population: &str,
    token: &str,
    digits: &Examples,
    n: usize,
    stop: &Arc<AtomicBool>,
) -> Vec<tokio::task::JoinHandle<()>> {
    (0..n)
        .map(|k| {
            let (train, hold) =
                digits.subset(&(k * 150..k * 150 + 150).collect::<Vec<_>>()).split_holdout(0.2, 1);
            let mut p = Participant::new(url, population, train, hold, Device::flex().autodiff());
            let (token, stop) = (token.to_owned(), stop.clone());
            tokio::spawn(async move {
                p.enroll(&token).await.unwrap();
                while !stop.load(Ordering::Relaxed) {
                    match p.participate(Box::new(|_| {})).await {
                        Ok(Outcome::Uploaded { .. }) => {}
                        Ok(_) | Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
                    }
                }
            })
        })
        .collect()
}

/// An operator creates a run from a TOML plan, issues a token for its devices, watches it to
/// the end while a central evaluator follows it, lists and exports its models (the safetensors
/// file holds exactly the committed values, as Python's `safetensors` reads them), stops
/// another run, and revokes a device; a missing token and a bad plan get clear errors.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_drives_a_run_from_the_command_line() {
    let (dir, db) = sqlite_db();
    let c = starling_tests::start_in_process(&db).await.unwrap();
    let url = c.url.as_str();
    let digits = data::digits(&shared_data().join("sklearn_digits")).unwrap();

    // Without the operator token the command says where it goes.
    let out = tokio::process::Command::new(operator_bin())
        .args(["runs", "list", "--url", url])
        .env_remove("STARLING_OPERATOR_TOKEN")
        .output()
        .await
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("STARLING_OPERATOR_TOKEN"), "{out:?}");

    // A plan file in TOML, as an operator writes one; a broken one is refused with its name.
    let mut plan = mlp_plan(digits.input(), 2, 3);
    plan["name"] = "operated".into();
    plan["population"] = "operated".into();
    let plan_file = dir.path().join("plan.toml");
    std::fs::write(&plan_file, toml::to_string(&plan).unwrap()).unwrap();
    let bad_file = dir.path().join("bad.json");
    std::fs::write(&bad_file, "{\"cohort_size\": ").unwrap();
    let bad = starling(url, &["runs", "create", bad_file.to_str().unwrap()]).await;
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("bad.json is not JSON"), "{bad:?}");
    let run: i64 = stdout(&starling(url, &["runs", "create", plan_file.to_str().unwrap()]).await)
        .trim()
        .parse()
        .unwrap();
    let run_arg = run.to_string();
    let view = c.admin.run(RunId(run)).await.unwrap();
    assert_eq!((view.name.as_deref(), view.population.as_str()), (Some("operated"), "operated"));
    assert_eq!(view.total_rounds, 3);
    let token = stdout(
        &starling(url, &["tokens", "issue", "--uses", "2", "--population", "operated"]).await,
    );

    // The run trains while `watch` and a central evaluator follow it to its end.
    let watch_args = ["runs", "watch", &run_arg, "--interval-secs", "0.2"];
    let watch = starling(url, &watch_args);
    let evaluate = central_evaluator(url, &run_arg).output();
    let stop = Arc::new(AtomicBool::new(false));
    let fleet = devices(url, "operated", token.trim(), &digits, 2, &stop);
    let (watch, evaluate) = tokio::join!(watch, evaluate);
    stop.store(true, Ordering::Relaxed);
    for d in fleet {
        d.await.unwrap();
    }
    let watched = stdout(&watch);
    assert!(watched.contains("finished: 3/3 rounds, model 3"), "{watched}");
    let evaluated = stdout(&evaluate.unwrap());
    assert!(evaluated.contains("4 models evaluated"), "{evaluated}");

    // Every model carries the central evaluation beside the federated one.
    let models: Vec<starling_core::admin::ModelView> = serde_json::from_str(&stdout(
        &starling(url, &["models", "list", &run_arg, "--json"]).await,
    ))
    .unwrap();
    assert_eq!(models.len(), 4);
    let held_out = digits.split_holdout(0.2, 1).1.len() as u64;
    for m in &models {
        let central: Vec<_> = m.central.iter().filter(|e| e.evaluator == "ops-holdout").collect();
        assert_eq!(central.len(), 1, "model {}: {:?}", m.version, m.central);
        let accuracy = central[0].metrics["accuracy"];
        assert!((0.0..=1.0).contains(&accuracy));
        assert_eq!(central[0].example_count, held_out, "the digits' 20 % test split");
    }
    let last = &models[3].central[0].metrics["accuracy"];
    let first = &models[0].central[0].metrics["accuracy"];
    assert!(last > first, "central accuracy {first} -> {last}");
    let table = stdout(&starling(url, &["models", "list", &run_arg]).await);
    assert!(table.contains("central acc") && table.lines().count() == 5, "{table}");

    // The latest model as safetensors holds exactly the committed values.
    let file = dir.path().join("model.safetensors");
    let exported = stdout(
        &starling(url, &["models", "export", &run_arg, "--out", file.to_str().unwrap()]).await,
    );
    assert!(exported.contains("model 3"), "{exported}");
    let payload = c.admin.model_payload(RunId(run), 3).await.unwrap();
    let spec: starling_core::model_spec::ModelSpec =
        serde_json::from_value(plan["model"]["spec"].clone()).unwrap();
    let schema = spec.schema().unwrap();
    let values = schema.decode_f32(&payload).unwrap();
    let bytes = std::fs::read(&file).unwrap();
    assert_eq!(safetensors::from_safetensors(&schema, &bytes).unwrap(), payload.data);
    if let Some(python) = python_with(&["safetensors", "numpy"]) {
        let script = "import json, sys\n\
            from safetensors.numpy import load_file\n\
            tensors = load_file(sys.argv[1])\n\
            print(json.dumps({k: [list(v.shape), str(v.dtype), v.astype('float64').ravel().tolist()] for k, v in tensors.items()}))";
        let out = std::process::Command::new(python).args(["-c", script]).arg(&file).output();
        let loaded: serde_json::Value =
            serde_json::from_str(&stdout(&out.unwrap())).expect("the script prints JSON");
        let mut offset = 0;
        for t in &schema.tensors {
            let [shape, dtype, data] = loaded[&t.name].as_array().unwrap().as_slice() else {
                panic!("{} is not in the file: {loaded}", t.name)
            };
            assert_eq!(shape, &serde_json::json!(t.shape), "{}", t.name);
            assert_eq!(dtype, "float32");
            let n = t.numel() as usize;
            let read: Vec<f32> =
                data.as_array().unwrap().iter().map(|v| v.as_f64().unwrap() as f32).collect();
            assert_eq!(read, values[offset..offset + n], "{}", t.name);
            offset += n;
        }
        assert_eq!(offset, values.len());
    }
    let raw = dir.path().join("model.cbor");
    let version_1 = ["models", "export", &run_arg, "--version", "1", "--format", "payload"];
    stdout(&starling(url, &[&version_1[..], &["--out", raw.to_str().unwrap()]].concat()).await);
    let payload_1: starling_core::tensor::TensorPayload =
        starling_core::codec::decode(&std::fs::read(&raw).unwrap()).unwrap();
    assert_eq!(payload_1.content_hash(), models[1].content_hash);
    let missing = starling(url, &["models", "export", &run_arg, "--version", "9"]).await;
    assert!(!missing.status.success());

    // Lists, stop and revoke.
    let runs = stdout(&starling(url, &["runs", "list"]).await);
    assert!(runs.lines().any(|l| l.contains("operated") && l.contains("finished")), "{runs}");
    let other = c.admin.create_run(&mlp_plan(digits.input(), 1, 5)).await.unwrap().id;
    let stopped = stdout(&starling(url, &["runs", "stop", &other.to_string()]).await);
    assert!(stopped.contains(&format!("run {other} stopped")), "{stopped}");
    assert_eq!(c.admin.run(RunId(other)).await.unwrap().status, "stopped");
    let devices: Vec<starling_core::admin::DeviceView> =
        serde_json::from_str(&stdout(&starling(url, &["devices", "list", "--json"]).await))
            .unwrap();
    assert_eq!(devices.len(), 2);
    let victim = devices[0].device_id;
    stdout(&starling(url, &["devices", "revoke", &victim.to_string()]).await);
    let after = c.admin.devices().await.unwrap();
    assert!(after.iter().any(|d| d.device_id == victim && d.revoked));
    let table = stdout(&starling(url, &["devices", "list"]).await);
    assert_eq!(table.lines().filter(|l| l.trim_end().ends_with("true")).count(), 1, "{table}");
    let unknown = starling(url, &["devices", "revoke", "999999"]).await;
    assert!(!unknown.status.success());
    c.running.shutdown().await.unwrap();
}

/// The export and central-evaluation endpoints refuse what they cannot serve or store: an
/// unknown format, a model that does not exist, an evaluation out of bounds or under a bad
/// name, and any credential but the operator's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn model_export_and_central_evaluations_refuse_bad_requests() {
    use starling_core::admin::CentralEvaluation;
    use starling_core::wire::ErrorCode;
    let (_dir, db) = sqlite_db();
    let c = starling_tests::start_in_process(&db).await.unwrap();
    let digits = data::digits(&shared_data().join("sklearn_digits")).unwrap();
    let run = RunId(c.admin.create_run(&mlp_plan(digits.input(), 1, 1)).await.unwrap().id);
    use starling_tests::api_code as code;
    assert_eq!(code(c.admin.model_file(run, 0, "onnx").await), Some(ErrorCode::InvalidField));
    assert_eq!(code(c.admin.model_file(run, 1, "safetensors").await), Some(ErrorCode::NotFound));
    assert_eq!(code(c.admin.model_file(RunId(77), 0, "payload").await), Some(ErrorCode::NotFound));
    let good = CentralEvaluation {
        evaluator: "holdout-1".into(),
        example_count: 100,
        metrics: [("accuracy".to_owned(), 0.5)].into(),
    };
    let bad = [
        CentralEvaluation { evaluator: "".into(), ..good.clone() },
        CentralEvaluation { evaluator: "a b".into(), ..good.clone() },
        CentralEvaluation { example_count: 0, ..good.clone() },
        CentralEvaluation { metrics: [("accuracy".to_owned(), 1.5)].into(), ..good.clone() },
        CentralEvaluation { metrics: [("loss".to_owned(), -1.0)].into(), ..good.clone() },
    ];
    for report in &bad {
        let res = c.admin.report_central_evaluation(run, 0, report).await;
        assert_eq!(code(res), Some(ErrorCode::InvalidField), "{report:?}");
    }
    let res = c.admin.report_central_evaluation(run, 1, &good).await;
    assert_eq!(code(res), Some(ErrorCode::NotFound));
    let device = starling_client::protocol::AdminClient::new(&c.url, "not-the-operator-token");
    let res = device.report_central_evaluation(run, 0, &good).await;
    assert_eq!(code(res), Some(ErrorCode::Unauthorized));
    // A second report under one name replaces the first.
    c.admin.report_central_evaluation(run, 0, &good).await.unwrap();
    let better = CentralEvaluation { metrics: [("accuracy".to_owned(), 0.75)].into(), ..good };
    c.admin.report_central_evaluation(run, 0, &better).await.unwrap();
    let models = c.admin.models(run).await.unwrap();
    assert_eq!(models[0].central, vec![better]);
    assert_eq!(models[0].n_evaluations, 0, "central evaluations are not devices' reports");
    c.running.shutdown().await.unwrap();
}

/// A plan that requires charging devices with half a battery on an unmetered network, over
/// real HTTP: a device that says nothing, or is on battery, is told to come back later while
/// the round selects. One that qualifies is selected, and when it is unplugged while the model
/// downloads it leaves the round before training (the SDK checks the conditions of the moment,
/// not only those of its check-in). Plugged in again, it trains.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plan_selects_only_devices_that_qualify_and_they_train_only_while_they_do() {
    use starling_core::eligibility::DeviceAttributes;
    let (_dir, db) = sqlite_db();
    let c = starling_tests::start_in_process(&db).await.unwrap();
    let digits = data::digits(&shared_data().join("sklearn_digits")).unwrap();
    let mut plan = mlp_plan(digits.input(), 1, 1);
    plan["cohort_size"] = 1.into();
    plan["min_quorum"] = 1.into();
    plan["eligibility"] =
        serde_json::json!({"charging": true, "unmetered_network": true, "min_battery_percent": 50});
    let run = RunId(c.admin.create_run(&plan).await.unwrap().id);
    assert_eq!(c.admin.run(run).await.unwrap().plan["eligibility"]["charging"], true);
    let token = c.admin.enrollment_token(1).await.unwrap();
    let (train, hold) = digits.subset(&(0..200).collect::<Vec<_>>()).split_holdout(0.2, 1);
    let conditions = Arc::new(std::sync::Mutex::new(DeviceAttributes::default()));
    let mut device = Participant::new(&c.url, "default", train, hold, Device::flex().autodiff())
        .with_shared_attributes(conditions.clone());
    device.enroll(&token).await.unwrap();
    let qualified = DeviceAttributes {
        charging: Some(true),
        battery_percent: Some(80),
        unmetered_network: Some(true),
        idle: Some(false),
        app_version: Some("1.0".into()),
        free_storage_bytes: Some(1 << 30),
    };
    let on_battery = DeviceAttributes { charging: Some(false), ..qualified.clone() };
    let nearly_empty = DeviceAttributes { battery_percent: Some(49), ..qualified.clone() };
    for attributes in [DeviceAttributes::default(), on_battery.clone(), nearly_empty] {
        device.set_attributes(attributes.clone());
        let outcome = device.participate(Box::new(|_| {})).await.unwrap();
        assert!(matches!(outcome, Outcome::ComeBackLater(_)), "{attributes:?}: {outcome:?}");
    }
    let rounds = c.admin.rounds(run).await.unwrap();
    assert_eq!(rounds[0].n_selected.unwrap(), 0, "nobody qualified yet");

    // Selected while qualified; unplugged while the model downloads.
    device.set_attributes(qualified.clone());
    let phases = Arc::new(std::sync::Mutex::new(vec![]));
    let (seen, shared) = (phases.clone(), conditions.clone());
    let outcome = device
        .participate(Box::new(move |p| {
            if let ParticipantProgress::Phase(phase) = p {
                seen.lock().unwrap().push(phase);
                if phase == Phase::Downloading {
                    *shared.lock().unwrap() = on_battery.clone();
                }
            }
        }))
        .await
        .unwrap();
    assert!(
        matches!(&outcome, Outcome::ConditionsNotMet { unmet, .. } if unmet == &["charging"]),
        "{outcome:?}"
    );
    assert_eq!(*phases.lock().unwrap(), [Phase::CheckingIn, Phase::Downloading], "nothing trained");
    let rounds = c.admin.rounds(run).await.unwrap();
    assert_eq!((rounds[0].n_selected.unwrap(), rounds[0].n_reported.unwrap()), (1, 0));

    device.set_attributes(qualified);
    let outcome = device.participate(Box::new(|_| {})).await.unwrap();
    assert!(matches!(outcome, Outcome::Uploaded { .. }), "{outcome:?}");
    starling_tests::wait_model(&c.admin, run, 1).await.unwrap();
    c.running.shutdown().await.unwrap();
}

/// Evaluation-only rounds: an operator starts a run from another run's trained model
/// (`starling runs create --init-from RUN:VERSION`) with `evaluation_only`; devices of another
/// population evaluate that very model (same content hash) on their own data and train
/// nothing. Each round records its devices' pooled evaluation ("evaluated"), no model version
/// is ever added, and the pooled accuracy beats the untrained model's. An upload carrying a
/// delta is refused, and a malformed `--init-from` is named.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn evaluation_only_rounds_measure_a_trained_model_on_the_fleet() {
    let (dir, db) = sqlite_db();
    let c = starling_tests::start_in_process(&db).await.unwrap();
    let url = c.url.as_str();
    let digits = data::digits(&shared_data().join("sklearn_digits")).unwrap();
    let token = c.admin.enrollment_token_for(100, &["trainers", "fleet"]).await.unwrap().token;

    // A run trains two rounds on one population.
    let mut train_plan = mlp_plan(digits.input(), 2, 2);
    train_plan["population"] = "trainers".into();
    let trained = RunId(c.admin.create_run(&train_plan).await.unwrap().id);
    let stop = Arc::new(AtomicBool::new(false));
    let trainers = devices(url, "trainers", &token, &digits, 2, &stop);
    let trained_hash = starling_tests::wait_model(&c.admin, trained, 2).await.unwrap();

    // The fleet of another population evaluates its version 2, twice over.
    let mut plan = mlp_plan(digits.input(), 1, 2);
    plan["population"] = "fleet".into();
    plan["evaluation_only"] = true.into();
    // The intruder below must be selected the moment it checks in; a random draw over the
    // devices online (the trainers count too) might send it away.
    plan["selection"] = "first_come".into();
    let plan_file = dir.path().join("evaluate.json");
    std::fs::write(&plan_file, plan.to_string()).unwrap();
    let plan_arg = plan_file.to_str().unwrap();
    let bad = starling(url, &["runs", "create", plan_arg, "--init-from", "2"]).await;
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("expected RUN:VERSION"), "{bad:?}");
    let from = format!("{trained}:2");
    let run: i64 =
        stdout(&starling(url, &["runs", "create", plan_arg, "--init-from", &from]).await)
            .trim()
            .parse()
            .unwrap();
    let run = RunId(run);
    // A device of the fleet is told to evaluate, gets the model's schema for it, and is refused
    // when it sends a delta; its metrics with an empty delta are its report.
    let intruder = &starling_tests::enroll_in(url, &c.admin, 1, &["fleet"]).await.unwrap()[0];
    let task = match intruder.check_in("fleet").await.unwrap() {
        starling_core::wire::CheckInResponse::Task(task) => task,
        other => panic!("expected a task: {other:?}"),
    };
    assert!(task.evaluate_only);
    let delta = starling_tests::upload_request(&task, &vec![0.0; task.schema.numel() as usize], 10);
    let refused = intruder.upload(run, task.round_idx, &delta).await;
    assert_eq!(
        starling_tests::api_code(refused),
        Some(starling_core::wire::ErrorCode::SchemaMismatch)
    );
    let report = starling_core::wire::UploadRequest {
        metrics: [("accuracy".to_owned(), 0.5)].into(),
        delta: starling_core::tensor::TensorSchema { tensors: vec![] }.encode_f32(&[]),
        ..delta
    };
    intruder.upload(run, task.round_idx, &report).await.unwrap();
    let unseen = digits.subset(&(900..1500).collect::<Vec<_>>());
    let evaluators = devices(url, "fleet", &token, &unseen, 2, &stop);

    starling_tests::wait_for("the evaluation run to finish", Duration::from_secs(120), || async {
        Ok((c.admin.run(run).await?.status == "finished").then_some(()))
    })
    .await
    .unwrap();
    stop.store(true, Ordering::Relaxed);
    for d in trainers.into_iter().chain(evaluators) {
        d.await.unwrap();
    }
    let rounds = c.admin.rounds(run).await.unwrap();
    assert_eq!(rounds.len(), 2, "{rounds:?}");
    for r in &rounds {
        assert_eq!(
            (r.state.as_str(), r.n_reported.unwrap(), r.model_version),
            ("evaluated", 2, 0),
            "{r:?}"
        );
        let accuracy = r.metrics.as_ref().unwrap()["accuracy"];
        assert!((0.0..=1.0).contains(&accuracy), "{r:?}");
    }
    let view = c.admin.run(run).await.unwrap();
    assert_eq!((view.rounds_committed, view.model_version), (2, 0));
    let models = c.admin.models(run).await.unwrap();
    assert_eq!(models.len(), 1, "an evaluation run commits no model");
    assert_eq!(models[0].content_hash, trained_hash, "the fleet evaluated the trained model");
    assert_eq!(models[0].n_evaluations, 4, "two devices in each of two rounds");
    let fleet_accuracy = models[0].evaluation["accuracy"];
    let untrained = c.admin.models(trained).await.unwrap()[0].evaluation["accuracy"];
    assert!(fleet_accuracy > untrained, "trained {fleet_accuracy} vs untrained {untrained}");
    c.running.shutdown().await.unwrap();
}

/// A run of `rounds` rounds of two devices, both needed, on 100 parameters.
fn two_devices_100_params(rounds: u32) -> starling_tests::PlanSpec {
    starling_tests::PlanSpec {
        params: 100,
        cohort: 2,
        over_selection: 1.0,
        quorum: 2,
        selection_secs: 20.0,
        reporting_secs: 60.0,
        rounds,
    }
}

/// A round commits its model by content hash and the bytes follow. Asked for in
/// between, the export is served from the coordinator's memory (the model cache holds each
/// run's newest model until its bytes are written), not a missing model nor a wait. A trigger
/// on the SQLite file holds the bytes back to make "in between" last.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_export_right_after_a_commit_is_served_before_the_models_bytes_are_written() {
    use sqlx::Connection;
    use starling_tests::{enroll, expect_tasks, upload_request, wait_model};
    let (_dir, db) = sqlite_db();
    let c = starling_tests::start_in_process(&db).await.unwrap();
    let mut sql = sqlx::SqliteConnection::connect(&db).await.unwrap();
    sqlx::query(
        "CREATE TRIGGER hold_model_bytes BEFORE UPDATE OF data ON models
         BEGIN SELECT RAISE(ABORT, 'the test holds the model bytes back'); END",
    )
    .execute(&mut sql)
    .await
    .unwrap();
    let devices = enroll(&c.url, &c.admin, 2).await.unwrap();
    let spec = two_devices_100_params(1);
    let run = RunId(c.admin.create_run(&spec.json()).await.unwrap().id);
    let tasks = expect_tasks(&devices).await.unwrap();
    for (d, t) in devices.iter().zip(&tasks) {
        d.upload(run, t.round_idx, &upload_request(t, &[0.25; 100], 3)).await.unwrap();
    }
    let hash = wait_model(&c.admin, run, 1).await.unwrap();
    let payload = c.admin.model_payload(run, 1).await.expect("served from memory");
    assert_eq!(payload.content_hash(), hash);
    let unwritten: (i64,) = sqlx::query_as("SELECT COUNT(*) FROM models WHERE data IS NULL")
        .fetch_one(&mut sql)
        .await
        .unwrap();
    assert_eq!(unwritten, (1,), "the bytes are still held back");
    sqlx::query("DROP TRIGGER hold_model_bytes").execute(&mut sql).await.unwrap();
    c.running.shutdown().await.unwrap();
    let written: (i64,) = sqlx::query_as("SELECT COUNT(*) FROM models WHERE data IS NULL")
        .fetch_one(&mut sql)
        .await
        .unwrap();
    assert_eq!(written, (0,), "written before the shutdown finished");
}

/// With a plan's `checkpoint_interval`, the newest model exports from memory until
/// its run's next written version, and a version given up then is a 410 that says why (and
/// the models list marks it); the run's last model is written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_between_checkpoints_exports_while_newest_then_is_not_kept() {
    use starling_tests::{enroll, expect_tasks, upload_request, wait_model};
    let (_dir, db) = sqlite_db();
    let c = starling_tests::start_in_process(&db).await.unwrap();
    let devices = enroll(&c.url, &c.admin, 2).await.unwrap();
    let spec = two_devices_100_params(3);
    let mut plan = spec.json();
    plan["checkpoint_interval"] = 2.into();
    let run = RunId(c.admin.create_run(&plan).await.unwrap().id);
    let mut hashes = vec![];
    for version in 1..=3 {
        let tasks = loop {
            let tasks = expect_tasks(&devices).await.unwrap();
            if tasks.iter().all(|t| starling_tests::version(t) == version - 1) {
                break tasks;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        for (d, t) in devices.iter().zip(&tasks) {
            d.upload(run, t.round_idx, &upload_request(t, &[0.25; 100], 3)).await.unwrap();
        }
        hashes.push(wait_model(&c.admin, run, version).await.unwrap());
        if version == 1 {
            let newest = c.admin.model_payload(run, 1).await.expect("served from memory");
            assert_eq!(newest.content_hash(), hashes[0]);
        }
    }
    let url = format!("{}{}", c.url, starling_core::wire::path::admin_model(run, 1));
    let gone = reqwest::Client::new().get(&url).bearer_auth(OPERATOR_TOKEN).send().await.unwrap();
    assert_eq!(gone.status(), reqwest::StatusCode::GONE);
    let why: starling_core::wire::ErrorBody = gone.json().await.unwrap();
    assert_eq!(why.code, starling_core::wire::ErrorCode::ModelNotKept);
    assert!(
        why.message.contains("not kept") && why.message.contains("checkpoint_interval"),
        "{why:?}"
    );
    let given_up: Vec<bool> =
        c.admin.models(run).await.unwrap().iter().map(|m| m.given_up).collect();
    assert_eq!(given_up, [false, true, false, false]);
    for version in [2, 3] {
        let payload = c.admin.model_payload(run, version).await.unwrap();
        assert_eq!(payload.content_hash(), hashes[version as usize - 1]);
    }
    c.running.shutdown().await.unwrap();
}

/// Regression: a central evaluator following a run with a `checkpoint_interval`
/// failed on the first version given up before it got to it (a 404), and with it the
/// simulator's run. Such versions are now marked in the models list (and the operator's
/// table), answer 410 `model_not_kept`, and the evaluator passes over them and evaluates the
/// rest.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_central_evaluator_passes_over_versions_given_up_between_checkpoints() {
    let (_dir, db) = sqlite_db();
    let c = starling_tests::start_in_process(&db).await.unwrap();
    let url = c.url.as_str();
    let digits = data::digits(&shared_data().join("sklearn_digits")).unwrap();
    let mut plan = mlp_plan(digits.input(), 1, 3);
    plan["population"] = "checkpointed".into();
    plan["checkpoint_interval"] = 2.into();
    let run = RunId(c.admin.create_run(&plan).await.unwrap().id);
    let token = c.admin.enrollment_token_for(2, &["checkpointed"]).await.unwrap().token;
    let stop = Arc::new(AtomicBool::new(false));
    let fleet = devices(url, "checkpointed", &token, &digits, 2, &stop);
    starling_tests::wait_for("the run to finish", Duration::from_secs(120), || async {
        Ok((c.admin.run(run).await?.status == "finished").then_some(()))
    })
    .await
    .unwrap();
    stop.store(true, Ordering::Relaxed);
    for d in fleet {
        d.await.unwrap();
    }
    // Version 2 is written and the run's last, 3; version 1 is given up once 2 is (its write
    // follows the commit).
    let given_up = || async {
        let models = c.admin.models(run).await?;
        let given_up: Vec<bool> = models.iter().map(|m| m.given_up).collect();
        Ok((given_up == [false, true, false, false]).then_some(()))
    };
    starling_tests::wait_for("version 1 given up", Duration::from_secs(30), given_up)
        .await
        .unwrap();

    let run_arg = run.0.to_string();
    let evaluate = central_evaluator(url, &run_arg).arg("--once").output().await.unwrap();
    let evaluated = stdout(&evaluate);
    assert!(evaluated.contains("3 models evaluated"), "{evaluated}");
    let central: Vec<usize> =
        c.admin.models(run).await.unwrap().iter().map(|m| m.central.len()).collect();
    assert_eq!(central, [1, 0, 1, 1], "every kept version, and only those");
    // The operator's list says which version is not kept.
    let table = stdout(&starling(url, &["models", "list", &run_arg]).await);
    let not_kept: Vec<&str> = table
        .lines()
        .filter(|l| l.ends_with("not kept"))
        .map(|l| l.split_whitespace().next().unwrap())
        .collect();
    assert_eq!(not_kept, ["1"], "{table}");
    c.running.shutdown().await.unwrap();
}

/// The operator's command line imports a pretrained model and a tokenizer (printing the hashes
/// a plan names), lists them, and exports a LoRA run's model merged into its base and its adapters alone; a part
/// of a payload export is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_command_line_imports_a_base_and_a_tokenizer_and_exports_a_lora_runs_parts() {
    use crate::fine_tuning::{char_transformer, char_transformer_file};
    let (_db_dir, db) = sqlite_db();
    let c = starling_tests::start_in_process(&db).await.unwrap();
    let url = &c.url;
    let dir = tempfile::tempdir().unwrap();
    let (file, pretrained) = char_transformer_file();
    let base_file = dir.path().join("base.safetensors");
    std::fs::write(&base_file, file).unwrap();
    let imported = stdout(
        &starling(url, &["models", "import", base_file.to_str().unwrap(), "--name", "chars"]).await,
    );
    let hash = imported.split_whitespace().next().unwrap().to_owned();
    assert!(hash.len() == 64 && imported.contains("(chars: 22 tensors"), "{imported}");
    let bases = stdout(&starling(url, &["models", "bases"]).await);
    assert!(bases.lines().any(|l| l.starts_with(&hash) && l.ends_with("chars")), "{bases}");
    let words = crate::tokenizers::word_tokenizer("to be or not to be", 3);
    let words_hash = starling_core::tokenizer::content_hash(&words);
    let words_file = dir.path().join("tokenizer.json");
    std::fs::write(&words_file, words).unwrap();
    let args = ["models", "import-tokenizer", words_file.to_str().unwrap(), "--name", "words"];
    let imported = stdout(&starling(url, &args).await);
    assert!(imported.starts_with(&format!("{words_hash} (words: ids below 4")), "{imported}");
    let listed = stdout(&starling(url, &["models", "tokenizers"]).await);
    assert!(listed.lines().any(|l| l.starts_with(&words_hash) && l.ends_with("words")), "{listed}");

    let (base, lora) = (char_transformer(false), char_transformer(true));
    let plan = serde_json::json!({
        "model": {"spec": lora, "init": {"kind": "base_model", "hash": hash}},
        "cohort_size": 1, "rounds": 1,
    });
    let run = c.admin.create_run(&plan).await.unwrap().id.to_string();
    let export = |part: &'static str| {
        let out = dir.path().join(format!("{part}.safetensors"));
        let args = ["models", "export", &run, "--version", "0", "--part", part, "--out"];
        let args: Vec<String> =
            args.iter().map(|a| a.to_string()).chain([out.display().to_string()]).collect();
        (args, out)
    };
    let (args, merged_file) = export("merged");
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    stdout(&starling(url, &args).await);
    // Version 0's adapters are B = 0: merged, it is the imported model.
    let merged = safetensors::from_safetensors(
        &base.schema().unwrap(),
        &std::fs::read(&merged_file).unwrap(),
    )
    .unwrap();
    assert_eq!(starling_core::tensor::f32_from_le_bytes(&merged), pretrained);
    let (args, adapters_file) = export("adapters");
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    stdout(&starling(url, &args).await);
    let (adapters, _) =
        safetensors::read_safetensors(&std::fs::read(&adapters_file).unwrap()).unwrap();
    assert!(adapters.tensors.iter().all(|t| t.name.contains(".lora_")), "{adapters:?}");
    assert_eq!(adapters.tensors.len(), 6);
    let refused = starling(
        url,
        &["models", "export", &run, "--part", "merged", "--format", "payload", "--out", "x"],
    )
    .await;
    assert!(!refused.status.success());
    assert!(
        String::from_utf8_lossy(&refused.stderr)
            .contains("--part merged needs --format safetensors")
    );
    c.running.shutdown().await.unwrap();
}

/// `starling runs watch N | head -1` exited 101 with a "Broken pipe" panic once `head` had its
/// line; a reader that goes away now ends the command quietly with success, as command-line
/// tools do. A run that stopped says why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watching_into_a_closed_pipe_exits_quietly_and_a_stopped_run_says_why() {
    use std::io::Read;
    use std::process::Stdio;
    let (_dir, db) = sqlite_db();
    let c = starling_tests::start_in_process(&db).await.unwrap();
    let mut idle = starling_tests::PlanSpec {
        selection_secs: 0.5,
        reporting_secs: 1.0,
        ..starling_tests::PlanSpec::all_of(2, 8, 3)
    }
    .json();
    idle["population"] = "nobody".into();
    idle["max_failed_rounds"] = 3.into();
    let run = c.admin.create_run(&idle).await.unwrap().id.to_string();
    let url = c.url.clone();
    let mut watch = std::process::Command::new(operator_bin())
        .args(["runs", "watch", &run, "--interval-secs", "0.05"])
        .env("STARLING_URL", &url)
        .env("STARLING_OPERATOR_TOKEN", OPERATOR_TOKEN)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Read one line, then close the pipe, as `head -1` does.
    let mut stdout = watch.stdout.take().unwrap();
    let first = tokio::task::spawn_blocking(move || {
        let mut line = Vec::new();
        let mut byte = [0u8; 1];
        while stdout.read(&mut byte).unwrap() == 1 && byte[0] != b'\n' {
            line.push(byte[0]);
        }
        String::from_utf8(line).unwrap()
    })
    .await
    .unwrap();
    assert!(first.starts_with(&format!("run {run} ")), "{first}");
    let status =
        tokio::task::spawn_blocking(move || watch.wait_with_output().unwrap()).await.unwrap();
    let stderr = String::from_utf8_lossy(&status.stderr);
    assert!(status.status.success(), "{:?}: {stderr}", status.status);
    assert!(!stderr.contains("panicked"), "{stderr}");

    // Watched to its end, the stopped run's reason is the one line of the failure.
    let watched = starling(&url, &["runs", "watch", &run, "--interval-secs", "0.05"]).await;
    let stderr = String::from_utf8_lossy(&watched.stderr);
    assert!(!watched.status.success());
    assert!(
        stderr.contains("ended stopped") && stderr.contains("rounds in a row failed"),
        "{stderr}"
    );
    c.running.shutdown().await.unwrap();
}

/// A central evaluator builds a run's models from the spec the coordinator gives it; a run of
/// kind `tensors` has none, and is refused with a 422 that says how to evaluate it instead,
/// while its outside evaluators' reports are still taken.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn central_evaluation_of_a_tensors_run_is_refused_with_the_way_to_evaluate_it() {
    use starling_client::evaluate::{CentralEvaluator, EvaluateError};
    use starling_core::admin::CentralEvaluation;
    use starling_core::wire::ErrorCode;
    let (_dir, db) = sqlite_db();
    let c = starling_tests::start_in_process(&db).await.unwrap();
    let digits = data::digits(&shared_data().join("sklearn_digits")).unwrap();
    let layers_plan = mlp_plan(digits.input(), 1, 1);
    let layers = RunId(c.admin.create_run(&layers_plan).await.unwrap().id);
    assert_eq!(c.admin.model_spec(layers).await.unwrap(), layers_plan["model"]["spec"]);
    CentralEvaluator::spec_of_run(&c.admin, layers).await.unwrap();

    let mut tensors_plan = layers_plan.clone();
    let schema = serde_json::to_value(
        serde_json::from_value::<starling_core::model_spec::ModelSpec>(
            layers_plan["model"]["spec"].clone(),
        )
        .unwrap()
        .schema()
        .unwrap(),
    )
    .unwrap();
    tensors_plan["model"] = serde_json::json!({"kind": "tensors", "schema": schema});
    let tensors = RunId(c.admin.create_run(&tensors_plan).await.unwrap().id);
    let refused = c.admin.model_spec(tensors).await.unwrap_err();
    assert_eq!(refused.status().map(|s| s.as_u16()), Some(422));
    assert_eq!(refused.code(), Some(ErrorCode::InvalidField));
    let why = refused.to_string();
    assert!(why.contains("kind tensors") && why.contains("/evaluations"), "{why}");
    match CentralEvaluator::spec_of_run(&c.admin, tensors).await {
        Err(EvaluateError::Protocol(e)) => assert_eq!(e.status().map(|s| s.as_u16()), Some(422)),
        other => panic!("the evaluator must surface the 422, got {other:?}"),
    }
    // The way it names: an outside evaluator's figures are taken for the run's models.
    let report = CentralEvaluation {
        evaluator: "torch-holdout".into(),
        example_count: 50,
        metrics: [("accuracy".to_owned(), 0.9)].into(),
    };
    c.admin.report_central_evaluation(tensors, 0, &report).await.unwrap();
    assert_eq!(c.admin.models(tensors).await.unwrap()[0].central, vec![report]);
    c.running.shutdown().await.unwrap();
}

/// `starling enrolment new-authority` writes the authority's secret for its owner only, prints
/// the public key, and never overwrites an existing secret; `starling enrolment certify` prints
/// the certificate devices and the coordinator check, and refuses what is not an identity key.
/// Neither needs a coordinator or the operator token.
#[tokio::test]
async fn the_command_line_makes_an_enrolment_authority_and_certifies_identity_keys() {
    let dir = tempfile::tempdir().unwrap();
    let secret = dir.path().join("authority.key");
    let offline = |args: Vec<String>| {
        tokio::process::Command::new(operator_bin())
            .args(args)
            .env_remove("STARLING_OPERATOR_TOKEN")
            .output()
    };
    let new = || {
        offline(vec![
            "enrolment".into(),
            "new-authority".into(),
            "--out".into(),
            secret.display().to_string(),
        ])
    };
    let public = stdout(&new().await.unwrap()).trim().to_owned();
    let authority = secagg::parse_public_key(&public).unwrap();
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&secret).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600, "{mode:o}");
    }
    let again = new().await.unwrap();
    assert!(!again.status.success());
    assert!(String::from_utf8_lossy(&again.stderr).contains("an existing file is kept"));

    let identity = secagg::DeviceIdentity::from_secret([5; 32]).public();
    let certify = |key: String| {
        offline(vec![
            "enrolment".into(),
            "certify".into(),
            "--authority".into(),
            secret.display().to_string(),
            key,
        ])
    };
    let printed = stdout(&certify(secagg::key_hex(&identity)).await.unwrap());
    let certificate = secagg::Signature::from_hex(&printed).unwrap();
    assert!(secagg::certificate_is_valid(&authority, &identity, &certificate));
    let other = secagg::DeviceIdentity::from_secret([6; 32]).public();
    assert!(!secagg::certificate_is_valid(&authority, &other, &certificate));
    let refused = certify("00ff".into()).await.unwrap();
    assert!(!refused.status.success());
    assert!(String::from_utf8_lossy(&refused.stderr).contains("the identity key"), "{refused:?}");
}
