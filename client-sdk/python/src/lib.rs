//! `starling_client._native`: the client SDK as a Python extension module (PyO3, abi3), so a
//! Python program takes part in federated training with its own trainer (PyTorch or anything
//! else), runs the operator's side, and simulates a fleet, with the SDK doing what it does for
//! every device: check-in, eligibility, resumable uploads, compression, DP clipping, SecAgg+.
//!
//! The pure-Python half of the package (`python/starling_client/`) adds the PyTorch adapter
//! and the typed stubs; everything that talks to a coordinator is here.

mod errors;
mod operator;
mod participant;
mod simulate;
mod trainer;

use std::sync::OnceLock;

use pyo3::prelude::*;

/// The one runtime every call of the module blocks on (with the interpreter released).
fn runtime() -> &'static tokio::runtime::Runtime {
    static RUNTIME: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RUNTIME.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("starling")
            .enable_all()
            .build()
            .expect("a tokio runtime starts")
    })
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    starling_client::protocol::install_tls_provider();
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    errors::register(m)?;
    m.add_class::<trainer::GlobalModel>()?;
    m.add_class::<trainer::TrainingSettings>()?;
    m.add_class::<trainer::Trained>()?;
    m.add_class::<trainer::Evaluation>()?;
    m.add_class::<participant::Participant>()?;
    m.add_class::<participant::Outcome>()?;
    m.add_class::<operator::Operator>()?;
    m.add_function(wrap_pyfunction!(simulate::simulate, m)?)?;
    m.add_function(wrap_pyfunction!(operator::new_enrolment_authority, m)?)?;
    m.add_function(wrap_pyfunction!(operator::certify_identity, m)?)?;
    Ok(())
}
