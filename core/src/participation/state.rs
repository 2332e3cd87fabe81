//! What a device keeps between participations (credential, identity, pending upload, error
//! feedback, local tensors): one serializable record that every driver of the participation
//! machine saves the same way, so that an app killed at any point resumes where it was.

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::compression::ErrorFeedback;
use crate::tensor::{SchemaId, TensorSchema, f32_from_le_bytes, f32_to_le_bytes};
use crate::wire::UploadTarget;
use crate::{DeviceId, ModelVersion, RoundIdx, RunId};

use super::Evaluation;

/// How many runs' local parts a device keeps; the oldest run's goes first.
pub const MAX_RUNS_KEPT: usize = 8;

/// What survives an app restart.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ParticipantState {
    /// The device id, once enrolled.
    pub device_id: Option<DeviceId>,
    /// The device credential, once enrolled.
    pub credential: Option<String>,
    /// The secret of the identity key registered at enrollment, which signs the device's keys
    /// in secure rounds; `None` for a device enrolled before identities (plain runs only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub identity: Option<[u8; 32]>,
    /// The enrolment authority the device pins and its identity's certificate from it.
    #[serde(default, skip_serializing_if = "Enrolment::is_unset")]
    pub enrolment: Enrolment,
    /// The last model version evaluated, so it is reported once.
    pub last_evaluated: Option<(RunId, ModelVersion)>,
    /// What top-k compression has not sent yet, for the run it was computed in: added to
    /// that run's next delta (error feedback), dropped when another run's task comes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error_feedback: Option<(RunId, ErrorFeedback)>,
    /// A trained update not yet acknowledged: written before it is sent, cleared once it is
    /// acknowledged or can no longer be, so that a device killed in between sends this same
    /// update on its next participation instead of checking in and training again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pending_upload: Option<PendingUpload>,
    /// The local tensors (personalization) of the runs this device trained most recently:
    /// laid over each model of that run it downloads, never uploaded.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub local_parts: Vec<LocalPart>,
}

/// The operator's enrolment authority as a device knows it: the public key the app pins (set by
/// the operator's app, never taken from the coordinator), and this device's identity
/// certificate from it. A device that pins an authority joins a secure round only with
/// neighbours the authority certified; one that holds a certificate shows it to its neighbours.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Enrolment {
    /// The authority's public key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub authority: Option<[u8; 32]>,
    /// The authority's certificate of this device's identity key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub certificate: Option<crate::secagg::Signature>,
}

impl Enrolment {
    /// The enrolment an app configures as text: the authority's public key (64 hex digits) and
    /// this device's certificate from it, if it has one yet (128 hex digits). The message names
    /// the one that does not read.
    pub fn from_hex(authority: &str, certificate: Option<&str>) -> Result<Self, String> {
        use crate::secagg::{Signature, parse_public_key};
        Ok(Enrolment {
            authority: Some(
                parse_public_key(authority).map_err(|why| format!("authority: {why}"))?,
            ),
            certificate: certificate
                .map(Signature::from_hex)
                .transpose()
                .map_err(|why| format!("certificate: {why}"))?,
        })
    }

    fn is_unset(&self) -> bool {
        *self == Enrolment::default()
    }
}

/// An update trained for a task and not yet acknowledged (see
/// [`ParticipantState::pending_upload`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PendingUpload {
    /// Run.
    pub run_id: RunId,
    /// Round.
    pub round_idx: RoundIdx,
    /// The aggregator the task sent the update to, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub upload_to: Option<UploadTarget>,
    /// The model version trained from.
    pub model_version: ModelVersion,
    /// Examples trained on.
    pub example_count: u64,
    /// The metrics sent with the update.
    pub metrics: BTreeMap<String, f64>,
    /// The schema the delta is encoded in.
    pub schema_id: SchemaId,
    /// The encoded delta, as sent (base64 in the state file).
    #[serde(with = "base64_bytes")]
    pub delta: Vec<u8>,
    /// Mean local training loss.
    pub train_loss: f64,
    /// The global model's evaluation on held-out data, when it was evaluated.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub evaluation: Option<Evaluation>,
    /// Top-k's residual once this update is in (error feedback); kept only then.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error_feedback: Option<ErrorFeedback>,
}

/// A state file that could not be read or written.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("state file {path}: {why}")]
pub struct StateFileError {
    /// The file.
    pub path: String,
    /// What went wrong.
    pub why: String,
}

impl ParticipantState {
    /// Reads a state file written by [`ParticipantState::save`]; `None` when there is none yet.
    pub fn load(path: &Path) -> Result<Option<Self>, StateFileError> {
        let fail = |why: String| StateFileError { path: path.display().to_string(), why };
        match std::fs::read(path) {
            Ok(bytes) => serde_json::from_slice(&bytes)
                .map(Some)
                .map_err(|e| fail(format!("not a Starling device state file: {e}"))),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(fail(e.to_string())),
        }
    }

    /// Writes the state to `path`: aside first, then renamed, so a crash never leaves half a
    /// credential behind. (The one file the sans-IO participation has: kept beside its type so
    /// that every driver writes it the same way.)
    pub fn save(&self, path: &Path) -> Result<(), StateFileError> {
        let fail = |e: std::io::Error| StateFileError {
            path: path.display().to_string(),
            why: e.to_string(),
        };
        let json = serde_json::to_vec_pretty(self).expect("the state serializes");
        let tmp = path.with_extension("tmp");
        std::fs::write(&tmp, json).map_err(fail)?;
        std::fs::rename(&tmp, path).map_err(fail)
    }
}

/// One run's local tensors (personalization), as the device last trained them: laid over
/// every model of that run the device downloads, so that it evaluates and trains from its own
/// head, say, and the coordinator never sees one.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LocalPart {
    /// The run they belong to.
    pub run_id: RunId,
    /// The tensors, in model order.
    pub tensors: Vec<LocalTensor>,
}

/// One local tensor's name, shape and values.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LocalTensor {
    /// Its name in the model's schema.
    pub name: String,
    /// Its shape.
    pub shape: Vec<u64>,
    /// Little-endian f32 values (base64 in the state file).
    #[serde(with = "base64_bytes")]
    pub values: Vec<u8>,
}

impl LocalPart {
    /// The tensors of `model` (laid out in `schema`) that `names` lists.
    pub fn of(run_id: RunId, schema: &TensorSchema, model: &[f32], names: &[String]) -> Self {
        let tensors = schema
            .ranges()
            .filter(|(t, _)| names.contains(&t.name))
            .map(|(t, r)| LocalTensor {
                name: t.name.clone(),
                shape: t.shape.clone(),
                values: f32_to_le_bytes(&model[r]),
            })
            .collect();
        LocalPart { run_id, tensors }
    }

    /// `model` (laid out in `schema`) with this part's values over the tensors `names` lists
    /// (the task's local tensors) whose name and shape it has; the rest as they are.
    pub fn laid_over(
        &self,
        schema: &TensorSchema,
        mut model: Vec<f32>,
        names: &[String],
    ) -> Vec<f32> {
        for (t, r) in schema.ranges().filter(|(t, _)| names.contains(&t.name)) {
            let kept = self.tensors.iter().find(|k| k.name == t.name && k.shape == t.shape);
            if let Some(kept) = kept.filter(|k| k.values.len() == r.len() * 4) {
                model[r].copy_from_slice(&f32_from_le_bytes(&kept.values));
            }
        }
        model
    }
}

/// `parts` with `part` in place of its run's previous one, at most [`MAX_RUNS_KEPT`] runs.
pub(super) fn keep(parts: &mut Vec<LocalPart>, part: LocalPart) {
    parts.retain(|p| p.run_id != part.run_id);
    parts.push(part);
    if parts.len() > MAX_RUNS_KEPT {
        parts.remove(0);
    }
}

/// Bytes as base64 text: a pending delta in the JSON state file takes 4/3 of its size, not the
/// 3–4 characters a byte takes as a JSON array.
mod base64_bytes {
    use base64::Engine;
    use base64::engine::general_purpose::STANDARD;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(bytes: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&STANDARD.encode(bytes))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        let text = String::deserialize(d)?;
        STANDARD.decode(text).map_err(serde::de::Error::custom)
    }
}
