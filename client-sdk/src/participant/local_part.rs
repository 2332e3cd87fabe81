//! A device's own part of a run's model (personalization): the `local` tensors it trains and
//! keeps. They are saved with the participant's state after each round's training and laid
//! over every model of that run the device downloads, so that it evaluates and trains from its
//! own head, say, and the coordinator never sees one.

use serde::{Deserialize, Serialize};
use starling_core::RunId;
use starling_core::tensor::{TensorSchema, TensorSpec, f32_from_le_bytes, f32_to_le_bytes};

use super::base64_bytes;

/// How many runs' local parts a device keeps; the oldest run's goes first.
pub(super) const MAX_RUNS_KEPT: usize = 8;

/// One run's local tensors, as the device last trained them.
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

/// Each tensor of `schema` with its element range in a flat model.
fn ranges(schema: &TensorSchema) -> impl Iterator<Item = (&TensorSpec, std::ops::Range<usize>)> {
    schema.tensors.iter().scan(0usize, |offset, t| {
        let start = *offset;
        *offset += t.numel() as usize;
        Some((t, start..*offset))
    })
}

impl LocalPart {
    /// The tensors of `model` (laid out in `schema`) that `names` lists.
    pub fn of(run_id: RunId, schema: &TensorSchema, model: &[f32], names: &[String]) -> Self {
        let tensors = ranges(schema)
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
        for (t, r) in ranges(schema).filter(|(t, _)| names.contains(&t.name)) {
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
