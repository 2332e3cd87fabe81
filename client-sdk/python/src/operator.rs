//! `Operator`: the operator's side from Python, over the SDK's admin client: enrollment tokens,
//! runs from a plan dict, watching them, exporting and importing models, reporting an outside
//! evaluator's metrics. Views come back as the admin API's JSON, decoded into dicts.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use pyo3::prelude::*;
use pyo3::types::PyBytes;
use serde::Serialize;
use starling_client::protocol::{AdminClient, ClientError, TlsSettings};
use starling_core::RunId;
use starling_core::admin::{CentralEvaluation, RunView};

use crate::errors::{InvalidInput, client_error};
use crate::runtime;

/// The statuses after which a run changes no more.
const FINISHED: [&str; 2] = ["finished", "stopped"];

/// Whether a run watched until it commits `rounds` rounds (`None`: until it ends) is there.
pub(crate) fn reached(view: &RunView, rounds: Option<i64>) -> bool {
    FINISHED.contains(&view.status.as_str()) || rounds.is_some_and(|r| view.rounds_committed >= r)
}

/// The `TimeoutError` of a watch that gave up after `timeout_secs` with the run at `view`.
pub(crate) fn timed_out(view: &RunView, timeout_secs: f64) -> PyErr {
    pyo3::exceptions::PyTimeoutError::new_err(format!(
        "run {} is {} with {} rounds committed after {timeout_secs} s",
        view.id, view.status, view.rounds_committed
    ))
}

/// An operator of the coordinator at `url`, with its operator token.
#[pyclass(module = "starling_client._native", frozen)]
pub struct Operator {
    pub(crate) admin: AdminClient,
}

/// A view as the Python value its JSON decodes to (dicts, lists, numbers, strings).
pub(crate) fn to_python<'py>(
    py: Python<'py>,
    view: &impl Serialize,
) -> PyResult<Bound<'py, PyAny>> {
    let json = serde_json::to_string(view).map_err(|e| InvalidInput::new_err(e.to_string()))?;
    py.import("json")?.call_method1("loads", (json,))
}

impl Operator {
    /// Runs `call` on the module's runtime with the interpreter released.
    fn block<T: Send>(
        &self,
        py: Python<'_>,
        call: impl Future<Output = Result<T, ClientError>> + Send,
    ) -> PyResult<T> {
        py.detach(|| runtime().block_on(call)).map_err(|e| client_error(py, e))
    }
}

#[pymethods]
impl Operator {
    /// `ca_pem`: the CA certificate(s) an `https://` coordinator's must chain to.
    #[new]
    #[pyo3(signature = (url, token, *, ca_pem = None))]
    fn new(url: &str, token: &str, ca_pem: Option<String>) -> PyResult<Self> {
        if !starling_core::wire::is_http_url(url) {
            return Err(InvalidInput::new_err(format!("{url:?} is not an http(s) URL")));
        }
        let tls = TlsSettings { ca_pem: ca_pem.map(String::into_bytes), identity_pem: None };
        let admin = AdminClient::with_tls(url.trim_end_matches('/'), token, &tls)
            .map_err(|e| InvalidInput::new_err(e.to_string()))?;
        Ok(Operator { admin })
    }

    /// A new enrollment token that enrolls up to `uses` devices.
    #[pyo3(signature = (uses = 1))]
    fn enrollment_token(&self, py: Python<'_>, uses: i64) -> PyResult<String> {
        if uses < 1 {
            return Err(InvalidInput::new_err(format!("uses must be at least 1, not {uses}")));
        }
        self.block(py, self.admin.enrollment_token(uses))
    }

    /// Creates a run from `plan` (a dict, as the plan's JSON); its view. A plan the
    /// coordinator refuses raises `Refused` with the field it names.
    fn create_run<'py>(
        &self,
        py: Python<'py>,
        plan: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let json: String = py.import("json")?.call_method1("dumps", (plan,))?.extract()?;
        let plan: serde_json::Value =
            serde_json::from_str(&json).map_err(|e| InvalidInput::new_err(format!("plan: {e}")))?;
        let view = self.block(py, self.admin.create_run(&plan))?;
        to_python(py, &view)
    }

    /// The run's view (status, rounds committed, model version, ε when private, ...).
    fn run<'py>(&self, py: Python<'py>, run_id: i64) -> PyResult<Bound<'py, PyAny>> {
        let view = self.block(py, self.admin.run(RunId(run_id)))?;
        to_python(py, &view)
    }

    /// Every run's view.
    fn runs<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let views = self.block(py, self.admin.runs())?;
        to_python(py, &views)
    }

    /// The run's rounds: outcome, reports, metrics.
    fn rounds<'py>(&self, py: Python<'py>, run_id: i64) -> PyResult<Bound<'py, PyAny>> {
        let views = self.block(py, self.admin.rounds(RunId(run_id)))?;
        to_python(py, &views)
    }

    /// The run's committed models, each with its devices' and central evaluations.
    fn models<'py>(&self, py: Python<'py>, run_id: i64) -> PyResult<Bound<'py, PyAny>> {
        let views = self.block(py, self.admin.models(RunId(run_id)))?;
        to_python(py, &views)
    }

    /// Stops the run; its view.
    fn stop<'py>(&self, py: Python<'py>, run_id: i64) -> PyResult<Bound<'py, PyAny>> {
        let view = self.block(py, self.admin.stop(RunId(run_id)))?;
        to_python(py, &view)
    }

    /// Waits until the run has committed `rounds` rounds (all of its rounds when `None`) or
    /// has finished or stopped; its view then. Raises `TimeoutError` after `timeout_secs`.
    #[pyo3(signature = (run_id, *, rounds = None, timeout_secs = 600.0, poll_secs = 0.25))]
    fn wait<'py>(
        &self,
        py: Python<'py>,
        run_id: i64,
        rounds: Option<i64>,
        timeout_secs: f64,
        poll_secs: f64,
    ) -> PyResult<Bound<'py, PyAny>> {
        if [timeout_secs, poll_secs].iter().any(|s| s.is_nan() || *s <= 0.0) {
            return Err(InvalidInput::new_err("timeout_secs and poll_secs must be positive"));
        }
        let deadline = Instant::now() + Duration::from_secs_f64(timeout_secs);
        loop {
            let view = self.block(py, self.admin.run(RunId(run_id)))?;
            if reached(&view, rounds) {
                return to_python(py, &view);
            }
            if Instant::now() >= deadline {
                return Err(timed_out(&view, timeout_secs));
            }
            py.detach(|| std::thread::sleep(Duration::from_secs_f64(poll_secs)));
            // Ctrl-C reaches the caller between polls.
            py.check_signals()?;
        }
    }

    /// A committed model as a file: `safetensors` (default; a LoRA run also takes `merged`
    /// and `adapters` through `part`) or `payload`. `version`: the run's latest when `None`.
    #[pyo3(signature = (run_id, version = None, *, format = "safetensors"))]
    fn export_model<'py>(
        &self,
        py: Python<'py>,
        run_id: i64,
        version: Option<i64>,
        format: &str,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let version = match version {
            Some(v) => v,
            None => self.block(py, self.admin.run(RunId(run_id)))?.model_version,
        };
        let bytes = self.block(py, self.admin.model_file(RunId(run_id), version, format))?;
        Ok(PyBytes::new(py, &bytes))
    }

    /// Imports a pretrained model (`data`: a safetensors file of float32 tensors) under
    /// `name`; its view (a plan starts from it with `init` `{"kind": "base_model", "hash": ...}`).
    fn import_base_model<'py>(
        &self,
        py: Python<'py>,
        name: &str,
        data: Vec<u8>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let view = self.block(py, self.admin.import_base_model(name, data))?;
        to_python(py, &view)
    }

    /// Reports an outside evaluator's metrics (`accuracy`, `loss`, ...) of a committed model
    /// on `example_count` held-out examples: how a run whose model only its devices can run
    /// gets its central evaluation (the dashboard shows it beside the devices').
    fn report_evaluation(
        &self,
        py: Python<'_>,
        run_id: i64,
        version: i64,
        evaluator: String,
        example_count: u64,
        metrics: BTreeMap<String, f64>,
    ) -> PyResult<()> {
        let report = CentralEvaluation { evaluator, example_count, metrics };
        self.block(py, self.admin.report_central_evaluation(RunId(run_id), version, &report))
    }
}

/// A new enrolment authority for the operator: `(secret, public)`, each 64 hex digits. Keep the
/// secret where devices are provisioned, never on the coordinator; devices pin the public key.
#[pyfunction]
pub fn new_enrolment_authority() -> (String, String) {
    let authority = starling_client::protocol::new_enrolment_authority();
    (authority.secret_hex(), authority.public_hex())
}

/// The certificate (128 hex digits) of a device's identity key (`Participant.identity_key()`)
/// by the enrolment authority whose secret is `authority_secret`.
#[pyfunction]
pub fn certify_identity(authority_secret: &str, identity_key: &str) -> PyResult<String> {
    let authority = starling_core::secagg::EnrolmentAuthority::from_secret_hex(authority_secret)
        .map_err(InvalidInput::new_err)?;
    let identity = starling_core::secagg::parse_public_key(identity_key)
        .map_err(|why| InvalidInput::new_err(format!("identity key: {why}")))?;
    Ok(authority.certify(&identity).to_hex())
}
