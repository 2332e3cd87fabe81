//! A run's frozen tensors from the pretrained model it started from: fetched once per device
//! (and kept on disk beside the state file, by content hash, for every run started from it),
//! so that each round downloads only the tensors the run trains.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use starling_core::codec;
use starling_core::plan::ModelParts;
use starling_core::tensor::{TensorPayload, TensorSchema};
use starling_core::wire::BaseModelDownload;

use super::ParticipantError;

/// An imported model's tensors and values.
#[derive(Debug)]
pub(super) struct BaseModel {
    schema: TensorSchema,
    values: Vec<f32>,
}

fn corrupt(why: impl std::fmt::Display) -> ParticipantError {
    super::global_model_error(format!("base model: {why}"))
}

impl BaseModel {
    /// The model a download holds, once its content hash is `hash` and its values are finite.
    pub(super) fn verified(
        download: BaseModelDownload,
        hash: &str,
    ) -> Result<Self, ParticipantError> {
        let BaseModelDownload { schema, payload } = download;
        if payload.schema_id != schema.schema_id() || payload.content_hash() != hash {
            return Err(corrupt(format!("what arrived is not model {hash}")));
        }
        let values = schema.decode_f32(&payload).map_err(corrupt)?;
        Ok(BaseModel { schema, values })
    }

    /// The file a device keeps model `hash` in, beside its state file.
    pub(super) fn cache_file(state_file: &Path, hash: &str) -> PathBuf {
        state_file.with_file_name(format!("base-model-{hash}.cbor"))
    }

    /// The model kept in `file`, if it is there and is model `hash`.
    pub(super) fn read_cached(file: &Path, hash: &str) -> Option<Self> {
        let bytes = std::fs::read(file).ok()?;
        BaseModel::verified(codec::decode(&bytes).ok()?, hash).ok()
    }

    /// Keeps a download in `file` (written aside and renamed, so a kill leaves no half file).
    pub(super) fn write_cache(file: &Path, download: &BaseModelDownload) -> std::io::Result<()> {
        let bytes = codec::to_vec(download).map_err(std::io::Error::other)?;
        let aside = file.with_extension("partial");
        std::fs::write(&aside, bytes)?;
        std::fs::rename(aside, file)
    }

    /// The whole model of `schema`: the tensors `parts` trains from `trained` (in model order),
    /// every other from this model by name.
    pub(super) fn with_trained(
        &self,
        schema: &TensorSchema,
        parts: &ModelParts,
        trained: &TensorPayload,
    ) -> Result<Arc<Vec<f32>>, ParticipantError> {
        let trained_schema = TensorSchema {
            tensors: schema.tensors.iter().filter(|t| parts.trains(t)).cloned().collect(),
        };
        let trained_values = trained_schema.decode_f32(trained).map_err(corrupt)?;
        let mut offsets = std::collections::HashMap::new();
        let mut at = 0usize;
        for t in &self.schema.tensors {
            offsets.insert(t.name.as_str(), (t, at));
            at += t.numel() as usize;
        }
        let mut out = Vec::with_capacity(schema.numel() as usize);
        let mut from_trained = 0usize;
        for t in &schema.tensors {
            let n = t.numel() as usize;
            if parts.trains(t) {
                out.extend_from_slice(&trained_values[from_trained..from_trained + n]);
                from_trained += n;
                continue;
            }
            match offsets.get(t.name.as_str()) {
                Some((b, at)) if b.shape == t.shape => {
                    out.extend_from_slice(&self.values[*at..*at + n])
                }
                _ => return Err(corrupt(format!("it has no tensor {} {:?}", t.name, t.shape))),
            }
        }
        Ok(Arc::new(out))
    }
}
