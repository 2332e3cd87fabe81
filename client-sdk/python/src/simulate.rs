//! `simulate`: N Python trainers as N enrolled devices of one population, participating
//! concurrently against a real coordinator until a run finishes: the SDK's participants run on
//! the module's runtime, each trainer is called on a thread of its own (PyTorch releases the
//! interpreter's lock while it computes, so the devices train side by side).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pyo3::prelude::*;
use pyo3::types::PyDict;
use starling_client::participant::{
    Outcome as SdkOutcome, Participant as SdkParticipant, ParticipantError,
};
use starling_core::RunId;

use crate::errors::{InvalidInput, participant_error};
use crate::operator::{Operator, reached, timed_out, to_python};
use crate::runtime;
use crate::trainer::PyTrainer;

/// How long a simulated device waits before checking in again when told to come back later
/// (a real device waits as long as it is told; a simulation has no reason to).
const RECHECK: Duration = Duration::from_millis(100);

/// How long devices still in a participation get to finish it once the run is done.
const DRAIN: Duration = Duration::from_secs(30);

/// What one simulated device did.
#[derive(Debug, Default, Clone)]
struct DeviceTally {
    uploads: u64,
    evaluations: u64,
    missed: u64,
    retries: u64,
}

/// Runs `len(trainers)` devices against the coordinator at `url` until run `run_id` has
/// committed `rounds` rounds (all of them when `None`) or finished: device `i` trains with
/// `trainers[i]` and evaluates with `evaluators[i]` when given. Each device is enrolled with
/// `enrollment_token` (it must allow that many uses). Returns the run's final view and what
/// each device did. A trainer that raises stops the simulation with `TrainerFailed`.
#[pyfunction]
#[pyo3(signature = (url, population, enrollment_token, trainers, *, operator, run_id, evaluators = None, rounds = None, timeout_secs = 600.0))]
#[allow(clippy::too_many_arguments)]
pub fn simulate<'py>(
    py: Python<'py>,
    url: &str,
    population: &str,
    enrollment_token: &str,
    trainers: Vec<Py<PyAny>>,
    operator: &Operator,
    run_id: i64,
    evaluators: Option<Vec<Py<PyAny>>>,
    rounds: Option<i64>,
    timeout_secs: f64,
) -> PyResult<Bound<'py, PyDict>> {
    if trainers.is_empty() {
        return Err(InvalidInput::new_err("simulate needs at least one trainer"));
    }
    if evaluators.as_ref().is_some_and(|e| e.len() != trainers.len()) {
        return Err(InvalidInput::new_err("evaluators must be as many as trainers"));
    }
    if timeout_secs.is_nan() || timeout_secs <= 0.0 {
        return Err(InvalidInput::new_err("timeout_secs must be positive"));
    }
    let n = trainers.len();
    let mut evaluators = evaluators.into_iter().flatten();
    let mut devices = Vec::with_capacity(n);
    for train in trainers {
        let trainer = PyTrainer::new(train, evaluators.next());
        let raised = trainer.raised();
        devices.push((SdkParticipant::for_trainer(url, population, trainer), raised));
    }
    let admin = operator.admin.clone();
    let deadline = Instant::now() + Duration::from_secs_f64(timeout_secs);
    let result = py.detach(|| {
        runtime().block_on(async move {
            for (participant, _) in &mut devices {
                participant.enroll(enrollment_token).await.map_err(|e| Box::new((e, None)))?;
            }
            let done = Arc::new(AtomicBool::new(false));
            let tallies = Arc::new(Mutex::new(vec![DeviceTally::default(); n]));
            let mut tasks = tokio::task::JoinSet::new();
            for (i, (mut participant, raised)) in devices.into_iter().enumerate() {
                let done = done.clone();
                let tallies = tallies.clone();
                tasks.spawn(async move {
                    while !done.load(Ordering::Relaxed) {
                        let outcome = participant.participate(Box::new(|_| {})).await;
                        let wait = {
                            let mut all = tallies.lock().unwrap_or_else(|p| p.into_inner());
                            let tally = &mut all[i];
                            match outcome {
                                Ok(SdkOutcome::Uploaded { evaluation, .. }) => {
                                    tally.uploads += 1;
                                    tally.evaluations += u64::from(evaluation.is_some());
                                    false
                                }
                                Ok(SdkOutcome::Evaluated { .. }) => {
                                    tally.evaluations += 1;
                                    false
                                }
                                Ok(SdkOutcome::RoundMissed { .. }) => {
                                    tally.missed += 1;
                                    false
                                }
                                Ok(_) => true,
                                Err(ParticipantError::Protocol(e)) if e.is_transient() => {
                                    tally.retries += 1;
                                    true
                                }
                                Err(e) => {
                                    let raised =
                                        raised.lock().unwrap_or_else(|p| p.into_inner()).take();
                                    return Err(Box::new((e, raised)));
                                }
                            }
                        };
                        if wait {
                            tokio::time::sleep(RECHECK).await;
                        }
                    }
                    Ok(())
                });
            }
            // The operator's view decides when the devices stop.
            let view = loop {
                let view = admin
                    .run(RunId(run_id))
                    .await
                    .map_err(|e| Box::new((ParticipantError::from(e), None)))?;
                if reached(&view, rounds) || Instant::now() >= deadline {
                    break view;
                }
                // A device that failed ends the simulation with its error.
                if let Some(Ok(Err(failed))) = tasks.try_join_next() {
                    return Err(failed);
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            };
            done.store(true, Ordering::Relaxed);
            // Devices finish the participation they are in; one held in a round that will
            // never close (its run ended) is dropped after a grace period.
            let drain = async {
                while let Some(joined) = tasks.join_next().await {
                    if let Ok(Err(failed)) = joined {
                        return Err(failed);
                    }
                }
                Ok(())
            };
            if let Ok(drained) = tokio::time::timeout(DRAIN, drain).await {
                drained?;
            }
            let tallies = tallies.lock().unwrap_or_else(|p| p.into_inner()).clone();
            Ok((view, tallies))
        })
    });
    let (view, tallies) = result.map_err(|failed| {
        let (e, raised) = *failed;
        participant_error(py, e, raised)
    })?;
    if !reached(&view, rounds) {
        return Err(timed_out(&view, timeout_secs));
    }
    let report = PyDict::new(py);
    report.set_item("run", to_python(py, &view)?)?;
    let per_device = tallies
        .iter()
        .map(|t| {
            let d = PyDict::new(py);
            d.set_item("uploads", t.uploads)?;
            d.set_item("evaluations", t.evaluations)?;
            d.set_item("rounds_missed", t.missed)?;
            d.set_item("retries", t.retries)?;
            Ok(d)
        })
        .collect::<PyResult<Vec<_>>>()?;
    report.set_item("devices", per_device)?;
    Ok(report)
}
