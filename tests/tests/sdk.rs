//! The client SDK against a real coordinator process that disappears mid-round.

use std::path::Path;

use starling_client::Device;
use starling_client::data;
use starling_client::participant::{
    Outcome, Participant, ParticipantError, ParticipantProgress, Phase,
};
use starling_client::simulate::{ModelKind, model_spec};
use starling_core::RunId;
use starling_tests::{
    ChildCoordinator, OPERATOR_TOKEN, free_addr, shared_data, sqlite_db, wait_model,
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
    let spec = model_spec(ModelKind::Mlp, digits.input());
    let plan = serde_json::json!({
        "model": {"spec": spec, "init": {"kind": "seeded", "seed": 1}},
        "training": {"epochs": 1, "batch_size": 10, "lr": 0.1},
        "cohort_size": 2, "min_quorum": 2, "over_selection": 1.0,
        "selection_timeout_secs": 60.0, "reporting_timeout_secs": 120.0, "rounds": 1,
    });
    let run = RunId(admin.create_run(&plan).await.unwrap().id);
    let token = admin.enrollment_token(Some(2)).await.unwrap();
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
    assert_eq!((rounds[0].state.as_str(), rounds[0].n_reported), ("committed", 2));
}
