//! The client SDK against a real coordinator: one that disappears mid-round, a device killed
//! between training and upload, and a run whose model is the app's own burn module rather
//! than a spec.

use std::path::Path;

use starling_client::burn;
use starling_client::burn::module::Module;
use starling_client::burn::nn::{Linear, LinearConfig};
use starling_client::burn::tensor::Tensor;
use starling_client::burn::tensor::activation::relu;
use starling_client::data;
use starling_client::model::{Batch, Classifier, ModelIo, schema_of};
use starling_client::participant::{
    Outcome, OwnModule, Participant, ParticipantError, ParticipantProgress, ParticipantState,
    Phase, ProgressCallback,
};
use starling_client::train::evaluate;
use starling_client::{Device, examples::Examples};
use starling_core::model_spec::InputSpec;
use starling_core::{RoundIdx, RunId};
use starling_tests::{
    ChildCoordinator, OPERATOR_TOKEN, RestartableCoordinator, free_addr, mlp_plan, shared_data,
    signal_at, sqlite_db, start_in_process, wait_model,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn participant_survives_a_coordinator_that_disappears_mid_round() {
    let bin = Path::new(env!("CARGO_BIN_EXE_coordinator_under_test"));
    let (dir, db) = sqlite_db();
    let log = dir.path().join("coordinator.log");
    let listen = free_addr();
    let mut child = ChildCoordinator::spawn(bin, &db, listen, &log).await.unwrap();
    let admin = starling_client::protocol::AdminClient::new(&child.url, OPERATOR_TOKEN);
    let digits = data::digits(&shared_data().join("sklearn_digits")).unwrap();
    let run = RunId(admin.create_run(&mlp_plan(digits.input(), 1, 1)).await.unwrap().id);
    let token = admin.enrollment_token(2).await.unwrap();
    let device = || Device::flex().autodiff();
    let half = |k: usize| {
        digits.subset(&(k * 100..k * 100 + 100).collect::<Vec<_>>()).split_holdout(0.2, 1)
    };
    let (a_train, a_hold) = half(0);
    let (b_train, b_hold) = half(1);
    let mut a = Participant::new(&child.url, "default", a_train, a_hold, device());
    let mut b = Participant::new(&child.url, "default", b_train.clone(), b_hold.clone(), device());
    a.enroll(&token).await.unwrap();
    b.enroll(&token).await.unwrap();
    let saved = b.state().clone();

    let events = std::sync::Arc::new(std::sync::Mutex::new(vec![]));
    let sink = events.clone();
    let outcome = a.participate(Box::new(move |p| sink.lock().unwrap().push(p))).await.unwrap();
    assert!(matches!(outcome, Outcome::Uploaded { evaluation: Some(_), .. }), "{outcome:?}");
    let events = events.lock().unwrap().clone();
    let phases: Vec<Phase> = events
        .iter()
        .filter_map(|e| if let ParticipantProgress::Phase(p) = e { Some(*p) } else { None })
        .collect();
    assert_eq!(
        phases,
        [
            Phase::CheckingIn,
            Phase::Downloading,
            Phase::Evaluating,
            Phase::Training,
            Phase::Uploading
        ]
    );
    let steps: Vec<_> = events
        .iter()
        .filter_map(|e| if let ParticipantProgress::Step(s) = e { Some(*s) } else { None })
        .collect();
    assert_eq!(steps.len(), 8, "80 local examples in batches of 10, one epoch");
    assert!(steps.iter().all(|s| s.loss.is_finite() && s.batches == 8));

    // The coordinator vanishes with the round half reported: the device gets an error, not a panic.
    child.kill().unwrap();
    let err = b.participate(Box::new(|_| {})).await.unwrap_err();
    assert!(matches!(err, ParticipantError::Protocol(ref e) if e.is_transient()), "{err}");
    drop(b);

    // The coordinator comes back; the device, restarted from its saved state, completes the round.
    let child = ChildCoordinator::spawn(bin, &db, listen, &log).await.unwrap();
    let mut b = Participant::new(&child.url, "default", b_train, b_hold, device()).restore(saved);
    let outcome = b.participate(Box::new(|_| {})).await.unwrap();
    assert!(matches!(outcome, Outcome::Uploaded { .. }), "{outcome:?}");
    wait_model(&admin, run, 1).await.unwrap();
    let rounds = admin.rounds(run).await.unwrap();
    assert_eq!((rounds[0].state.as_str(), rounds[0].n_reported.unwrap()), ("committed", 2));
}

/// An app's own module: the SDK trains it exactly like a spec-built one.
#[derive(Module, Debug)]
struct DigitsNet {
    hidden: Linear,
    out: Linear,
}

impl DigitsNet {
    fn new(hidden: usize, device: &Device) -> Self {
        DigitsNet {
            hidden: LinearConfig::new(64, hidden).init(device),
            out: LinearConfig::new(hidden, 10).init(device),
        }
    }
}

impl Classifier for DigitsNet {
    fn forward(&self, input: Batch) -> Tensor<2> {
        let Batch::Image(images) = input else { panic!("digits are 1x8x8 images") };
        self.out.forward(relu(self.hidden.forward(images.flatten(1, 3))))
    }
}

const DIGITS_IO: ModelIo =
    ModelIo { input: InputSpec::Image { channels: 1, height: 8, width: 8 }, classes: 10 };

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_apps_own_burn_module_trains_federated_and_a_mismatched_one_is_refused() {
    let (_dir, db) = sqlite_db();
    let c = start_in_process(&db).await.unwrap();
    let flex = Device::flex();
    // The run names the module's schema (burn's parameter paths); there is no spec to build.
    let schema = schema_of(&DigitsNet::new(32, &flex));
    assert_eq!(
        schema.tensors.iter().map(|t| t.name.as_str()).collect::<Vec<_>>(),
        ["hidden.weight", "hidden.bias", "out.weight", "out.bias"]
    );
    let plan = serde_json::json!({
        "model": {"schema": schema, "init": {"kind": "seeded", "seed": 5}},
        "training": {"epochs": 3, "batch_size": 10, "lr": 0.1},
        "cohort_size": 4, "min_quorum": 4, "over_selection": 1.0,
        "selection_timeout_secs": 60.0, "reporting_timeout_secs": 120.0, "rounds": 4,
    });
    let run = RunId(c.admin.create_run(&plan).await.unwrap().id);
    let token = c.admin.enrollment_token_for(5, &["default", "side"]).await.unwrap().token;
    let digits = data::digits(&shared_data().join("sklearn_digits")).unwrap();
    let (train_set, test_set) = digits.split_holdout(0.2, 2);
    let shard = |k: usize| {
        let n = train_set.len() / 4;
        train_set.subset(&(k * n..(k + 1) * n).collect::<Vec<_>>()).split_holdout(0.1, k as u64)
    };

    // A module whose shapes differ from the run's is refused before anything is trained or sent
    // (in a run of its own population, so the main run's cohort is not kept waiting for it).
    let mut side_plan = plan.clone();
    side_plan["population"] = "side".into();
    side_plan["cohort_size"] = 1.into();
    side_plan["min_quorum"] = 1.into();
    c.admin.create_run(&side_plan).await.unwrap();
    let (wrong_train, wrong_hold) = shard(0);
    let mut wrong =
        Participant::new(&c.url, "side", wrong_train, wrong_hold, flex.clone().autodiff())
            .with_model(OwnModule::new(|d: &Device| DigitsNet::new(16, d), DIGITS_IO));
    wrong.enroll(&token).await.unwrap();
    let err = wrong.participate(Box::new(|_| {})).await.unwrap_err();
    assert!(
        matches!(&err, ParticipantError::SchemaMismatch(m) if m.contains("hidden.weight[64, 16]")),
        "{err}"
    );

    let mut tasks = vec![];
    for k in 0..4 {
        let (local_train, local_hold) = shard(k);
        let mut p =
            Participant::new(&c.url, "default", local_train, local_hold, flex.clone().autodiff())
                .with_model(OwnModule::new(|d: &Device| DigitsNet::new(32, d), DIGITS_IO));
        p.enroll(&token).await.unwrap();
        tasks.push(tokio::spawn(async move {
            let mut uploaded = 0;
            while uploaded < 4 {
                match p.participate(Box::new(|_| {})).await.unwrap() {
                    Outcome::Uploaded { .. } => uploaded += 1,
                    Outcome::ComeBackLater(_) | Outcome::RoundMissed { .. } => {
                        tokio::time::sleep(std::time::Duration::from_millis(100)).await
                    }
                    other @ (Outcome::Evaluated { .. } | Outcome::ConditionsNotMet { .. }) => {
                        panic!("a training run open to every device: {other:?}")
                    }
                }
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let first = accuracy(&c.url, &c.admin, run, 0, &test_set).await;
    let last = accuracy(&c.url, &c.admin, run, 4, &test_set).await;
    assert!(last >= 0.8 && last > first + 0.3, "test accuracy {first:.3} -> {last:.3}");
    c.running.shutdown().await.unwrap();
}

/// Test-set accuracy of the run's model `version`, loaded into the app's module.
async fn accuracy(
    url: &str,
    admin: &starling_client::protocol::AdminClient,
    run: RunId,
    version: i64,
    test_set: &Examples,
) -> f64 {
    let hash = wait_model(admin, run, version).await.unwrap();
    let mut observer = starling_client::protocol::FleetClient::new(url);
    observer.enroll(&admin.enrollment_token(1).await.unwrap()).await.unwrap();
    let device = Device::flex();
    let module = DigitsNet::new(32, &device);
    let payload = observer.model(&hash).await.unwrap();
    let values = starling_client::participant::decode_model(&schema_of(&module), &payload).unwrap();
    let module = starling_client::model::load_parameters(module, &values).unwrap();
    evaluate(&module, DIGITS_IO, test_set, &device).unwrap().accuracy
}

/// The phases a participation reported, from its progress events.
fn phases_of(events: &[ParticipantProgress]) -> Vec<Phase> {
    events
        .iter()
        .filter_map(|e| if let ParticipantProgress::Phase(p) = e { Some(*p) } else { None })
        .collect()
}

/// A participation that records its progress events in the returned list.
fn recording() -> (std::sync::Arc<std::sync::Mutex<Vec<ParticipantProgress>>>, ProgressCallback) {
    let events = std::sync::Arc::new(std::sync::Mutex::new(vec![]));
    let sink = events.clone();
    (events, Box::new(move |p| sink.lock().unwrap().push(p)))
}

/// A run that takes one device a round, and what that device trains on: an enrollment token
/// for it, and 240 digits to train on with 60 held out.
async fn one_device_run(
    admin: &starling_client::protocol::AdminClient,
) -> (RunId, String, Examples, Examples) {
    let digits = data::digits(&shared_data().join("sklearn_digits")).unwrap();
    let mut plan = mlp_plan(digits.input(), 1, 1);
    plan["cohort_size"] = 1.into();
    plan["min_quorum"] = 1.into();
    let run = RunId(admin.create_run(&plan).await.unwrap().id);
    let token = admin.enrollment_token(1).await.unwrap();
    let (train, hold) = digits.subset(&(0..300).collect::<Vec<_>>()).split_holdout(0.2, 1);
    (run, token, train, hold)
}

/// A device is not always on. This one trains, and its process dies before its upload is
/// answered (the coordinator is stopped when training starts, so the upload hangs; then the
/// participation is dropped mid-request). What it left on disk is the state file: restarted
/// from that file alone, it sends the update it trained, without checking in or training
/// again, and the round takes it once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_device_killed_between_training_and_upload_sends_that_update_on_restart() {
    let bin = Path::new(env!("CARGO_BIN_EXE_coordinator_under_test"));
    let (dir, db) = sqlite_db();
    let log = dir.path().join("coordinator.log");
    let coordinator = ChildCoordinator::spawn(bin, &db, free_addr(), &log).await.unwrap();
    let admin = starling_client::protocol::AdminClient::new(&coordinator.url, OPERATOR_TOKEN);
    let (run, token, train, hold) = one_device_run(&admin).await;
    let state_file = dir.path().join("device.json");
    let device = Device::flex().autodiff();
    let mut first =
        Participant::new(&coordinator.url, "default", train.clone(), hold.clone(), device.clone())
            .keeping_state_in(&state_file);
    first.enroll(&token).await.unwrap();
    first.state().save(&state_file).unwrap();

    let stop_coordinator = signal_at(coordinator.pid(), Phase::Training, "STOP");
    let participation = tokio::spawn(async move { first.participate(stop_coordinator).await });
    let pending = starling_tests::wait_for_pending_upload(&state_file).await.unwrap();
    assert_eq!((pending.run_id, pending.round_idx), (run, RoundIdx(0)));
    participation.abort();
    assert!(participation.await.unwrap_err().is_cancelled(), "the upload was still unanswered");
    coordinator.signal("CONT").unwrap();

    let saved = ParticipantState::load(&state_file).unwrap().unwrap();
    let mut restarted = Participant::new(&coordinator.url, "default", train, hold, device)
        .keeping_state_in(&state_file)
        .restore(saved);
    let (events, progress) = recording();
    let outcome = restarted.participate(progress).await.unwrap();
    assert!(
        matches!(outcome, Outcome::Uploaded { train_loss, .. } if train_loss == pending.train_loss),
        "{outcome:?}"
    );
    assert_eq!(phases_of(&events.lock().unwrap()), [Phase::Uploading], "no check-in, no training");
    assert_eq!(ParticipantState::load(&state_file).unwrap().unwrap().pending_upload, None);
    wait_model(&admin, run, 1).await.unwrap();
    let rounds = admin.rounds(run).await.unwrap();
    assert_eq!((rounds[0].state.as_str(), rounds[0].n_reported.unwrap()), ("committed", 1));
}

/// A device killed after its upload landed but before it cleared the update from its state
/// sends it again on restart: the coordinator answers that it already has it, the device
/// counts it as delivered and clears it, and the round holds one update from it, not two.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_update_resent_after_a_restart_is_taken_once() {
    let (dir, db) = sqlite_db();
    let c = start_in_process(&db).await.unwrap();
    let digits = data::digits(&shared_data().join("sklearn_digits")).unwrap();
    let run = RunId(c.admin.create_run(&mlp_plan(digits.input(), 1, 1)).await.unwrap().id);
    let token = c.admin.enrollment_token(2).await.unwrap();
    let half = |k: usize| {
        digits.subset(&(k * 150..k * 150 + 150).collect::<Vec<_>>()).split_holdout(0.2, 1)
    };
    let device = || Device::flex().autodiff();
    let state_file = dir.path().join("device-a.json");
    let snapshot = dir.path().join("device-a-before-the-ack.json");
    let (a_train, a_hold) = half(0);
    let mut a = Participant::new(&c.url, "default", a_train.clone(), a_hold.clone(), device())
        .keeping_state_in(&state_file);
    a.enroll(&token).await.unwrap();
    // The state file as a kill right after the upload was sent would leave it.
    let (from, to) = (state_file.clone(), snapshot.clone());
    let outcome = a
        .participate(Box::new(move |p| {
            if p == ParticipantProgress::Phase(Phase::Uploading) {
                std::fs::copy(&from, &to).unwrap();
            }
        }))
        .await
        .unwrap();
    assert!(matches!(outcome, Outcome::Uploaded { .. }), "{outcome:?}");
    assert_eq!(ParticipantState::load(&state_file).unwrap().unwrap().pending_upload, None);

    let saved = ParticipantState::load(&snapshot).unwrap().unwrap();
    assert!(saved.pending_upload.is_some(), "the update is on disk before it is sent");
    let mut restarted = Participant::new(&c.url, "default", a_train, a_hold, device())
        .keeping_state_in(&snapshot)
        .restore(saved);
    let (events, progress) = recording();
    let outcome = restarted.participate(progress).await.unwrap();
    assert!(matches!(outcome, Outcome::Uploaded { .. }), "{outcome:?}");
    assert_eq!(phases_of(&events.lock().unwrap()), [Phase::Uploading]);
    assert_eq!(ParticipantState::load(&snapshot).unwrap().unwrap().pending_upload, None);
    let rounds = c.admin.rounds(run).await.unwrap();
    assert_eq!(
        (rounds[0].n_selected.unwrap(), rounds[0].n_reported.unwrap()),
        (1, 1),
        "one update from the device"
    );
    // Checking in again in the same round gets no second task.
    let outcome = restarted.participate(Box::new(|_| {})).await.unwrap();
    assert!(matches!(outcome, Outcome::ComeBackLater(_)), "{outcome:?}");

    let (b_train, b_hold) = half(1);
    let mut b = Participant::new(&c.url, "default", b_train, b_hold, device());
    b.enroll(&token).await.unwrap();
    assert!(matches!(b.participate(Box::new(|_| {})).await.unwrap(), Outcome::Uploaded { .. }));
    wait_model(&c.admin, run, 1).await.unwrap();
    let rounds = c.admin.rounds(run).await.unwrap();
    assert_eq!((rounds[0].state.as_str(), rounds[0].n_reported.unwrap()), ("committed", 2));
    c.running.shutdown().await.unwrap();
}

/// An upload that fails for a while (the coordinator is gone when the device sends it) keeps
/// the trained update, in memory and in the state file: once the coordinator is back, the next
/// participation sends it without training again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upload_that_fails_for_a_while_is_kept_and_sent_later() {
    let bin = Path::new(env!("CARGO_BIN_EXE_coordinator_under_test"));
    let (dir, db) = sqlite_db();
    let mut coordinator = RestartableCoordinator::spawn(bin, &db).await.unwrap();
    let (run, token, train, hold) = one_device_run(&coordinator.admin).await;
    let state_file = dir.path().join("device.json");
    let mut device =
        Participant::new(coordinator.url(), "default", train, hold, Device::flex().autodiff())
            .keeping_state_in(&state_file);
    device.enroll(&token).await.unwrap();

    // The coordinator is killed as the upload starts.
    let kill_coordinator = signal_at(coordinator.pid(), Phase::Uploading, "KILL");
    let err = device.participate(kill_coordinator).await.unwrap_err();
    assert!(matches!(err, ParticipantError::Protocol(ref e) if e.is_transient()), "{err}");
    let kept = device.state().pending_upload.clone().expect("the update is kept");
    assert_eq!((kept.run_id, kept.round_idx), (run, RoundIdx(0)));
    let on_disk = ParticipantState::load(&state_file).unwrap().unwrap().pending_upload;
    assert_eq!(on_disk.as_ref(), Some(&kept));

    coordinator.respawn().await.unwrap();
    let (events, progress) = recording();
    let outcome = device.participate(progress).await.unwrap();
    assert!(
        matches!(outcome, Outcome::Uploaded { train_loss, .. } if train_loss == kept.train_loss),
        "{outcome:?}"
    );
    assert_eq!(phases_of(&events.lock().unwrap()), [Phase::Uploading], "no training again");
    assert_eq!(device.state().pending_upload, None);
    assert_eq!(ParticipantState::load(&state_file).unwrap().unwrap().pending_upload, None);
    wait_model(&coordinator.admin, run, 1).await.unwrap();
    let rounds = coordinator.admin.rounds(run).await.unwrap();
    assert_eq!((rounds[0].state.as_str(), rounds[0].n_reported.unwrap()), ("committed", 1));
}
