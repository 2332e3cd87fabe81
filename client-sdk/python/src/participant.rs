//! `Participant`: one device whose model a Python trainer trains. The SDK's participant does the
//! rest; its durable state (credential, an update not yet acknowledged) lives in a state file
//! when one is named, so a process killed mid-upload sends that update on its next start.

use std::path::PathBuf;
use std::sync::Mutex;

use pyo3::prelude::*;
use starling_client::participant::{Outcome as SdkOutcome, Participant as SdkParticipant};
use starling_client::protocol::TlsSettings;
use starling_core::participation::{Enrolment, ParticipantState};
use starling_core::secagg;

use crate::errors::{InvalidInput, StorageError, participant_error};
use crate::runtime;
use crate::trainer::{Evaluation, PyTrainer};

/// One device of `population` at the coordinator `url`, trained by Python code.
#[pyclass(module = "starling_client._native", frozen)]
pub struct Participant {
    url: String,
    population: String,
    state_file: Option<PathBuf>,
    tls: TlsSettings,
    state: Mutex<ParticipantState>,
}

/// What one participation did.
#[pyclass(module = "starling_client._native", frozen, get_all)]
#[derive(Debug, Clone)]
pub struct Outcome {
    /// `uploaded`, `evaluated`, `come_back_later`, `round_missed` or `conditions_not_met`.
    pub kind: String,
    /// The run it took part in, if any.
    pub run_id: Option<i64>,
    /// The round it took part in, if any.
    pub round_idx: Option<i64>,
    /// The mean training loss the trainer reported (`uploaded`).
    pub train_loss: Option<f64>,
    /// The evaluator's evaluation of the global model, when it ran one.
    pub evaluation: Option<Evaluation>,
    /// When to check in again (`come_back_later`).
    pub after_secs: Option<f64>,
    /// The conditions the device stopped meeting (`conditions_not_met`).
    pub unmet: Vec<String>,
}

#[pymethods]
impl Outcome {
    fn __repr__(&self) -> String {
        format!("{self:?}")
    }
}

impl Outcome {
    pub(crate) fn of(outcome: SdkOutcome) -> Self {
        let mut out = Outcome {
            kind: String::new(),
            run_id: None,
            round_idx: None,
            train_loss: None,
            evaluation: None,
            after_secs: None,
            unmet: vec![],
        };
        match outcome {
            SdkOutcome::ComeBackLater(after) => {
                out.kind = "come_back_later".into();
                out.after_secs = Some(after.as_secs_f64());
            }
            SdkOutcome::Uploaded { run_id, round_idx, train_loss, evaluation } => {
                out.kind = "uploaded".into();
                (out.run_id, out.round_idx) = (Some(run_id.0), Some(round_idx.0));
                out.train_loss = Some(train_loss);
                out.evaluation = evaluation.map(Into::into);
            }
            SdkOutcome::Evaluated { run_id, round_idx, evaluation } => {
                out.kind = "evaluated".into();
                (out.run_id, out.round_idx) = (Some(run_id.0), Some(round_idx.0));
                out.evaluation = Some(evaluation.into());
            }
            SdkOutcome::RoundMissed { run_id, round_idx } => {
                out.kind = "round_missed".into();
                (out.run_id, out.round_idx) = (Some(run_id.0), Some(round_idx.0));
            }
            SdkOutcome::ConditionsNotMet { run_id, round_idx, unmet } => {
                out.kind = "conditions_not_met".into();
                (out.run_id, out.round_idx) = (Some(run_id.0), Some(round_idx.0));
                out.unmet = unmet.into_iter().map(str::to_owned).collect();
            }
        }
        out
    }
}

#[pymethods]
impl Participant {
    /// A device at `url` in `population`. `state_file`: where its credential and any update
    /// not yet acknowledged are kept (read now if it exists); `credential`: one enrolled
    /// elsewhere; `ca_pem`: the CA certificate(s) an `https://` coordinator's must chain to.
    #[new]
    #[pyo3(signature = (url, population, *, state_file = None, credential = None, ca_pem = None))]
    fn new(
        url: &str,
        population: &str,
        state_file: Option<PathBuf>,
        credential: Option<String>,
        ca_pem: Option<String>,
    ) -> PyResult<Self> {
        if !starling_core::wire::is_http_url(url) {
            return Err(InvalidInput::new_err(format!("{url:?} is not an http(s) URL")));
        }
        if population.is_empty() {
            return Err(InvalidInput::new_err("the population is empty"));
        }
        let tls = TlsSettings { ca_pem: ca_pem.map(String::into_bytes), identity_pem: None };
        starling_client::protocol::FleetClient::with_tls(url, &tls)
            .map_err(|e| InvalidInput::new_err(e.to_string()))?;
        let mut state = match &state_file {
            Some(path) => ParticipantState::load(path)
                .map_err(|e| StorageError::new_err(e.to_string()))?
                .unwrap_or_default(),
            None => ParticipantState::default(),
        };
        if credential.is_some() {
            state.credential = credential;
        }
        Ok(Participant {
            url: url.trim_end_matches('/').to_owned(),
            population: population.to_owned(),
            state_file,
            tls,
            state: Mutex::new(state),
        })
    }

    /// Trades an operator-issued enrollment token for a credential (kept); the device id.
    fn enroll(&self, py: Python<'_>, enrollment_token: &str) -> PyResult<i64> {
        // Enrolment trains nothing: the trainer is never called.
        let state = self.lock().clone();
        let mut participant = self.participant(PyTrainer::new(py.None(), None))?.restore(state);
        let enrolled = py
            .detach(|| runtime().block_on(participant.enroll(enrollment_token)))
            .map_err(|e| participant_error(py, e, None))?;
        let mut state = self.lock();
        *state = participant.state().clone();
        self.save(&state)?;
        Ok(enrolled.0)
    }

    /// This device's identity key, 64 hex digits: what the operator's enrolment authority
    /// certifies. Made (and kept in the state file) on first call, before enrolling; `enroll`
    /// then registers this same key.
    fn identity_key(&self, py: Python<'_>) -> PyResult<String> {
        let mut state = self.lock();
        let mut participant =
            self.participant(PyTrainer::new(py.None(), None))?.restore(state.clone());
        let key = participant.identity_key();
        *state = participant.state().clone();
        self.save(&state)?;
        Ok(secagg::key_hex(&key))
    }

    /// Pins the operator's enrolment `authority` (its public key in hex, shipped with the
    /// device: never taken from the coordinator) and holds this device's `certificate` from it
    /// (hex, from `certify_identity` or `starling enrolment certify`). In secure rounds the
    /// device then shares only with neighbours the authority certified. Unreadable hex or a
    /// certificate of another key raises `InvalidInput` and changes nothing.
    #[pyo3(signature = (authority, certificate = None))]
    fn set_enrolment(
        &self,
        py: Python<'_>,
        authority: &str,
        certificate: Option<&str>,
    ) -> PyResult<()> {
        let enrolment =
            Enrolment::from_hex(authority, certificate).map_err(InvalidInput::new_err)?;
        let mut state = self.lock();
        let mut participant =
            self.participant(PyTrainer::new(py.None(), None))?.restore(state.clone());
        participant.set_enrolment(enrolment).map_err(|e| InvalidInput::new_err(e.to_string()))?;
        *state = participant.state().clone();
        self.save(&state)
    }

    /// Whether the participant holds a credential.
    #[getter]
    fn enrolled(&self) -> bool {
        self.lock().credential.is_some()
    }

    /// The device id, once enrolled.
    #[getter]
    fn device_id(&self) -> Option<i64> {
        self.lock().device_id.map(|d| d.0)
    }

    /// Whether an update trained earlier waits to be sent (the next `participate` sends it).
    #[getter]
    fn has_pending_upload(&self) -> bool {
        self.lock().pending_upload.is_some()
    }

    /// One participation: check in and, when selected, let `evaluate(model)` (optional)
    /// evaluate the global model and `train(model, settings)` train it, then upload the
    /// update (compressed, clipped, masked as the run's plan says). Blocks until done; the
    /// trainer runs on a thread of the SDK's, with the interpreter's lock held only while it
    /// does.
    #[pyo3(signature = (train, evaluate = None))]
    fn participate(
        &self,
        py: Python<'_>,
        train: Py<PyAny>,
        evaluate: Option<Py<PyAny>>,
    ) -> PyResult<Outcome> {
        // A participant with no credential is refused by the participation machine itself,
        // before anything is sent (`NotEnrolled`).
        let state = self.lock().clone();
        let trainer = PyTrainer::new(train, evaluate);
        let raised = trainer.raised();
        let mut participant = self.participant(trainer)?.restore(state);
        let outcome = py.detach(|| runtime().block_on(participant.participate(Box::new(|_| {}))));
        // The state advances (a pending upload, the last model) even when the participation failed.
        {
            let mut state = self.lock();
            *state = participant.state().clone();
            self.save(&state)?;
        }
        let raised = raised.lock().unwrap_or_else(|p| p.into_inner()).take();
        outcome.map(Outcome::of).map_err(|e| participant_error(py, e, raised))
    }

    fn __repr__(&self) -> String {
        let state = self.lock();
        format!(
            "Participant(url={:?}, population={:?}, device_id={:?})",
            self.url,
            self.population,
            state.device_id.map(|d| d.0)
        )
    }
}

impl Participant {
    fn lock(&self) -> std::sync::MutexGuard<'_, ParticipantState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn save(&self, state: &ParticipantState) -> PyResult<()> {
        match &self.state_file {
            Some(path) => state.save(path).map_err(|e| StorageError::new_err(e.to_string())),
            None => Ok(()),
        }
    }

    fn participant(&self, trainer: PyTrainer) -> PyResult<SdkParticipant> {
        let participant = SdkParticipant::for_trainer(&self.url, &self.population, trainer)
            .with_tls(&self.tls)
            .map_err(|e| InvalidInput::new_err(e.to_string()))?;
        Ok(match &self.state_file {
            // A trained update is on disk before it is sent.
            Some(path) => participant.keeping_state_in(path),
            None => participant,
        })
    }
}
