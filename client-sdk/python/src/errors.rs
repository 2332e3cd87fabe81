//! The module's exceptions: one base class, `StarlingError`, and a subclass per way a call can
//! fail, each carrying the reason (the coordinator's own words when it refused).

use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;
use starling_client::participant::ParticipantError;
use starling_client::protocol::ClientError;
use starling_client::train::TrainError;

create_exception!(starling_client, StarlingError, PyException, "Any failure of the Starling SDK.");
create_exception!(
    starling_client,
    InvalidInput,
    StarlingError,
    "An argument is unusable (a URL, a plan that is not JSON, a negative count)."
);
create_exception!(
    starling_client,
    NotEnrolled,
    StarlingError,
    "The participant has no credential: call enroll first."
);
create_exception!(
    starling_client,
    Unreachable,
    StarlingError,
    "The coordinator could not be reached or is busy (503, 429): try again later."
);
create_exception!(
    starling_client,
    Refused,
    StarlingError,
    "The coordinator refused the request; `status` is the HTTP status, `code` the API's error \
     code, and the message its reason."
);
create_exception!(
    starling_client,
    TrainerFailed,
    StarlingError,
    "The trainer raised: nothing was uploaded. The trainer's exception is the __cause__."
);
create_exception!(
    starling_client,
    RejectedUpdate,
    StarlingError,
    "What the trainer returned cannot be sent (a tensor missing or of the wrong shape or \
     dtype, a value that is not finite, no examples): nothing was uploaded."
);
create_exception!(
    starling_client,
    ModelError,
    StarlingError,
    "The run's model could not be decoded or does not fit what the participant holds."
);
create_exception!(
    starling_client,
    StorageError,
    StarlingError,
    "The participant's state file could not be read or written."
);

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("StarlingError", py.get_type::<StarlingError>())?;
    m.add("InvalidInput", py.get_type::<InvalidInput>())?;
    m.add("NotEnrolled", py.get_type::<NotEnrolled>())?;
    m.add("Unreachable", py.get_type::<Unreachable>())?;
    m.add("Refused", py.get_type::<Refused>())?;
    m.add("TrainerFailed", py.get_type::<TrainerFailed>())?;
    m.add("RejectedUpdate", py.get_type::<RejectedUpdate>())?;
    m.add("ModelError", py.get_type::<ModelError>())?;
    m.add("StorageError", py.get_type::<StorageError>())?;
    Ok(())
}

/// A failed call to the coordinator as the exception a Python caller catches.
pub(crate) fn client_error(py: Python<'_>, e: ClientError) -> PyErr {
    if e.is_transient() {
        return Unreachable::new_err(e.to_string());
    }
    let reason = match &e {
        ClientError::Api { body, .. } => body.message.clone(),
        other => other.to_string(),
    };
    let err = Refused::new_err(reason);
    let value = err.value(py);
    // Attributes on the instance: `except Refused as e: e.status, e.code`.
    let status = e.status().map(|s| s.as_u16());
    let code = e.code().and_then(|c| serde_json::to_value(c).ok()).and_then(|v| match v {
        serde_json::Value::String(s) => Some(s),
        _ => None,
    });
    let _ = value.setattr("status", status);
    let _ = value.setattr("code", code);
    err
}

/// A failed participation as the exception a Python caller catches; `raised` is the trainer's
/// own exception when it raised (it becomes the `__cause__`).
pub(crate) fn participant_error(
    py: Python<'_>,
    e: ParticipantError,
    raised: Option<PyErr>,
) -> PyErr {
    match e {
        ParticipantError::Protocol(c) => client_error(py, c),
        ParticipantError::NotEnrolled => NotEnrolled::new_err("not enrolled: call enroll first"),
        // The trainer raised: its exception is the cause.
        ParticipantError::Train(TrainError::Trainer(why)) if raised.is_some() => {
            let err = TrainerFailed::new_err(why);
            err.set_cause(py, raised);
            err
        }
        // It returned, but not what can be sent (read in `trainer.rs`).
        ParticipantError::Train(TrainError::Trainer(why)) => RejectedUpdate::new_err(why),
        e @ (ParticipantError::SchemaMismatch(_) | ParticipantError::Train(_)) => {
            RejectedUpdate::new_err(e.to_string())
        }
        e @ ParticipantError::StateFile { .. } => StorageError::new_err(e.to_string()),
        e => ModelError::new_err(e.to_string()),
    }
}
