//! Devices that train with the app's own trainer (`trainer::Trainer`) against a real
//! coordinator: a run whose plan names only the model's tensors trains federated and improves;
//! what a trainer returns is checked before anything is sent; and a trainer's update survives a
//! kill between training and upload like the built-in trainer's.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use starling_client::data;
use starling_client::examples::Examples;
use starling_client::participant::{
    Outcome, Participant, ParticipantError, ParticipantProgress, ParticipantState, Phase,
};
use starling_client::train::{Evaluation, TrainError, TrainingPlan};
use starling_client::trainer::{ModelTensors, TrainedValues, Trainer, TrainerOutput};
use starling_core::RunId;
use starling_core::tensor::{DType, TensorSchema, TensorSpec};
use starling_tests::{
    ChildCoordinator, OPERATOR_TOKEN, free_addr, shared_data, signal_at, sqlite_db,
    start_in_process, wait_model,
};

const CLASSES: usize = 10;
const PIXELS: usize = 64;

/// Softmax regression on the 8×8 digits: the model an app might train in its own framework.
fn schema() -> TensorSchema {
    let tensor =
        |name: &str, shape: Vec<u64>| TensorSpec { name: name.into(), shape, dtype: DType::F32 };
    TensorSchema {
        tensors: vec![
            tensor("weight", vec![CLASSES as u64, PIXELS as u64]),
            tensor("bias", vec![CLASSES as u64]),
        ],
    }
}

/// The class scores of one example under `model` (weight then bias, flat).
fn logits(model: &[f32], x: &[f32]) -> [f32; CLASSES] {
    let (weight, bias) = model.split_at(CLASSES * PIXELS);
    std::array::from_fn(|c| {
        bias[c]
            + weight[c * PIXELS..(c + 1) * PIXELS].iter().zip(x).map(|(w, v)| w * v).sum::<f32>()
    })
}

fn softmax(z: [f32; CLASSES]) -> [f32; CLASSES] {
    let max = z.iter().copied().fold(f32::MIN, f32::max);
    let e = z.map(|v| (v - max).exp());
    let sum: f32 = e.iter().sum();
    e.map(|v| v / sum)
}

/// Accuracy and mean cross-entropy of `model` on `examples`.
fn score(model: &[f32], examples: &Examples) -> Evaluation {
    let (mut correct, mut loss) = (0usize, 0.0f64);
    for (x, &y) in examples.features().chunks(PIXELS).zip(examples.labels()) {
        let p = softmax(logits(model, x));
        let best = (0..CLASSES).max_by(|&a, &b| p[a].total_cmp(&p[b])).unwrap();
        correct += usize::from(best == y as usize);
        loss -= f64::from(p[y as usize].max(1e-12).ln());
    }
    let n = examples.len();
    Evaluation { loss: loss / n as f64, accuracy: correct as f64 / n as f64, examples: n as u64 }
}

/// An app's own trainer: plain-Rust SGD on softmax regression, its examples its own.
struct SoftmaxTrainer {
    train: Examples,
    holdout: Examples,
}

impl Trainer for SoftmaxTrainer {
    fn train(&self, model: ModelTensors<'_>, plan: &TrainingPlan) -> Result<TrainerOutput, String> {
        let mut w: Vec<f32> = model.values.to_vec();
        let lr = plan.lr as f32;
        let batch = plan.batch_size.max(1) as usize;
        let mut last_loss = 0.0;
        for _ in 0..plan.epochs {
            let mut loss = 0.0f64;
            let rows: Vec<_> =
                self.train.features().chunks(PIXELS).zip(self.train.labels()).collect();
            for chunk in rows.chunks(batch) {
                let mut grad = vec![0.0f32; w.len()];
                for &(x, &y) in chunk {
                    let p = softmax(logits(&w, x));
                    loss -= f64::from(p[y as usize].max(1e-12).ln());
                    for c in 0..CLASSES {
                        let g = p[c] - f32::from(u8::from(c == y as usize));
                        for (gw, v) in grad[c * PIXELS..(c + 1) * PIXELS].iter_mut().zip(x) {
                            *gw += g * v;
                        }
                        grad[CLASSES * PIXELS + c] += g;
                    }
                }
                for (wi, gi) in w.iter_mut().zip(&grad) {
                    *wi -= lr * gi / chunk.len() as f32;
                }
            }
            last_loss = loss / self.train.len() as f64;
        }
        Ok(TrainerOutput {
            trained: TrainedValues::Model(w),
            examples: self.train.len() as u64,
            loss: last_loss,
        })
    }

    fn evaluate(&self, model: ModelTensors<'_>) -> Result<Option<Evaluation>, String> {
        Ok((!self.holdout.is_empty()).then(|| score(model.values, &self.holdout)))
    }
}

fn plan(population: &str, cohort: u32, rounds: u32) -> serde_json::Value {
    serde_json::json!({
        "population": population,
        "model": {"schema": schema(), "init": {"kind": "zeros"}},
        "training": {"epochs": 2, "batch_size": 10, "lr": 0.5},
        "cohort_size": cohort, "min_quorum": cohort, "over_selection": 1.0,
        "selection_timeout_secs": 60.0, "reporting_timeout_secs": 120.0, "rounds": rounds,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_apps_own_trainer_trains_a_run_of_named_tensors_and_the_model_improves() {
    let (_dir, db) = sqlite_db();
    let c = start_in_process(&db).await.unwrap();
    let run = RunId(c.admin.create_run(&plan("default", 4, 3)).await.unwrap().id);
    let token = c.admin.enrollment_token(4).await.unwrap();
    let digits = data::digits(&shared_data().join("sklearn_digits")).unwrap();
    let (train_set, test_set) = digits.split_holdout(0.2, 2);
    let mut tasks = vec![];
    for k in 0..4 {
        let n = train_set.len() / 4;
        let shard = train_set.subset(&(k * n..(k + 1) * n).collect::<Vec<_>>());
        let (train, holdout) = shard.split_holdout(0.1, k as u64);
        let mut device =
            Participant::for_trainer(&c.url, "default", SoftmaxTrainer { train, holdout });
        device.enroll(&token).await.unwrap();
        tasks.push(tokio::spawn(async move {
            let mut uploaded = 0;
            while uploaded < 3 {
                match device.participate(Box::new(|_| {})).await.unwrap() {
                    Outcome::Uploaded { evaluation, .. } => {
                        assert!(evaluation.is_some(), "the app's trainer evaluated the model");
                        uploaded += 1;
                    }
                    Outcome::ComeBackLater(_) | Outcome::RoundMissed { .. } => {
                        tokio::time::sleep(Duration::from_millis(100)).await
                    }
                    other => panic!("a training run open to every device: {other:?}"),
                }
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let model = |version| {
        let admin = &c.admin;
        let url = c.url.clone();
        async move {
            let hash = wait_model(admin, run, version).await.unwrap();
            let mut observer = starling_client::protocol::FleetClient::new(&url);
            observer.enroll(&admin.enrollment_token(1).await.unwrap()).await.unwrap();
            let payload = observer.model(&hash).await.unwrap();
            starling_client::participant::decode_model(&schema(), &payload).unwrap()
        }
    };
    let first = score(&model(0).await, &test_set).accuracy;
    let last = score(&model(3).await, &test_set).accuracy;
    assert!(last >= 0.85 && last > first + 0.5, "test accuracy {first:.3} -> {last:.3}");
    c.running.shutdown().await.unwrap();
}

/// A trainer's report of `trained` on `examples`.
fn output(trained: TrainedValues, examples: u64) -> Result<TrainerOutput, String> {
    Ok(TrainerOutput { trained, examples, loss: 0.5 })
}

/// A trainer that returns what it is told to.
struct Returning(fn(&[f32]) -> Result<TrainerOutput, String>);

impl Trainer for Returning {
    fn train(
        &self,
        model: ModelTensors<'_>,
        _plan: &TrainingPlan,
    ) -> Result<TrainerOutput, String> {
        (self.0)(model.values)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_an_apps_trainer_returns_is_checked_and_nothing_unusable_is_sent() {
    let (_dir, db) = sqlite_db();
    let c = start_in_process(&db).await.unwrap();
    let cases: [(&str, Returning); 5] = [
        ("short", Returning(|m| output(TrainedValues::Model(m[1..].to_vec()), 10))),
        ("nan", Returning(|m| output(TrainedValues::Delta(vec![f32::NAN; m.len()]), 10))),
        ("no-examples", Returning(|m| output(TrainedValues::Model(m.to_vec()), 0))),
        ("raises", Returning(|_| Err("out of memory in the app's interpreter".into()))),
        ("good", Returning(|m| output(TrainedValues::Delta(vec![0.25; m.len()]), 10))),
    ];
    let populations: Vec<&str> = cases.iter().map(|(p, _)| *p).collect();
    let token = c.admin.enrollment_token_for(6, &populations).await.unwrap().token;
    for (population, trainer) in cases {
        let run = RunId(c.admin.create_run(&plan(population, 1, 1)).await.unwrap().id);
        let mut device = Participant::for_trainer(&c.url, population, trainer);
        device.enroll(&token).await.unwrap();
        // A run just created may not have opened its round yet: the device is told to come
        // back, as any device would be.
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        let outcome = loop {
            match device.participate(Box::new(|_| {})).await {
                Ok(Outcome::ComeBackLater(_)) if std::time::Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(100)).await
                }
                outcome => break outcome,
            }
        };
        let reported = c.admin.rounds(run).await.unwrap()[0].n_reported;
        match (population, outcome) {
            ("short", Err(ParticipantError::SchemaMismatch(why))) => {
                assert!(why.contains("649 values, the run's model has 650"), "{why}")
            }
            ("nan", Err(ParticipantError::Train(TrainError::Diverged)))
            | ("no-examples", Err(ParticipantError::Train(TrainError::NoExamples))) => {}
            ("raises", Err(ParticipantError::Train(TrainError::Trainer(why)))) => {
                assert_eq!(why, "out of memory in the app's interpreter")
            }
            ("good", Ok(Outcome::Uploaded { .. })) => {
                assert_eq!(reported, Some(1), "the usable update is in");
                // The delta it returned is the new model's change: FedAvg of one device.
                let hash = wait_model(&c.admin, run, 1).await.unwrap();
                let mut observer = starling_client::protocol::FleetClient::new(&c.url);
                observer.enroll(&token).await.unwrap();
                let model = observer.model(&hash).await.unwrap();
                let values = starling_client::participant::decode_model(&schema(), &model).unwrap();
                assert!(values.iter().all(|&v| v == 0.25), "zeros + 0.25 everywhere");
                continue;
            }
            (population, other) => panic!("{population}: {other:?}"),
        }
        assert_eq!(reported, Some(0), "{population}: nothing reached the coordinator");
        assert_eq!(device.state().pending_upload, None, "{population}: nothing kept to send");
    }
    c.running.shutdown().await.unwrap();
}

/// Like the built-in trainer's (`sdk.rs`): the coordinator is stopped when training starts,
/// the participation dropped mid-upload; restarted from its state file, the device sends the
/// update its app trained, without checking in or training again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_apps_trained_update_survives_a_kill_before_its_upload_is_answered() {
    let bin = Path::new(env!("CARGO_BIN_EXE_coordinator_under_test"));
    let (dir, db) = sqlite_db();
    let log = dir.path().join("coordinator.log");
    let coordinator = ChildCoordinator::spawn(bin, &db, free_addr(), &log).await.unwrap();
    let admin = starling_client::protocol::AdminClient::new(&coordinator.url, OPERATOR_TOKEN);
    let run = RunId(admin.create_run(&plan("default", 1, 1)).await.unwrap().id);
    let token = admin.enrollment_token(1).await.unwrap();
    let digits = data::digits(&shared_data().join("sklearn_digits")).unwrap();
    let (train, holdout) = digits.subset(&(0..300).collect::<Vec<_>>()).split_holdout(0.2, 1);
    let trainer = || SoftmaxTrainer { train: train.clone(), holdout: holdout.clone() };
    let state_file = dir.path().join("device.json");
    let mut first = Participant::for_trainer(&coordinator.url, "default", trainer())
        .keeping_state_in(&state_file);
    first.enroll(&token).await.unwrap();
    first.state().save(&state_file).unwrap();

    let stop_at_training = signal_at(coordinator.pid(), Phase::Training, "STOP");
    let participation = tokio::spawn(async move { first.participate(stop_at_training).await });
    let pending = starling_tests::wait_for_pending_upload(&state_file).await.unwrap();
    participation.abort();
    assert!(participation.await.unwrap_err().is_cancelled(), "the upload was still unanswered");
    coordinator.signal("CONT").unwrap();

    let saved = ParticipantState::load(&state_file).unwrap().unwrap();
    let mut restarted = Participant::for_trainer(&coordinator.url, "default", trainer())
        .keeping_state_in(&state_file)
        .restore(saved);
    let phases = Arc::new(std::sync::Mutex::new(vec![]));
    let sink = phases.clone();
    let outcome = restarted
        .participate(Box::new(move |p| {
            if let ParticipantProgress::Phase(phase) = p {
                sink.lock().unwrap().push(phase)
            }
        }))
        .await
        .unwrap();
    assert!(
        matches!(outcome, Outcome::Uploaded { train_loss, .. } if train_loss == pending.train_loss),
        "{outcome:?}"
    );
    assert_eq!(*phases.lock().unwrap(), [Phase::Uploading], "no check-in, no training");
    wait_model(&admin, run, 1).await.unwrap();
    let rounds = admin.rounds(run).await.unwrap();
    assert_eq!((rounds[0].state.as_str(), rounds[0].n_reported), ("committed", Some(1)));
}
