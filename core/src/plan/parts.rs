//! Which of a model's tensors devices train, send and keep: the plan's `model.trainable` and
//! `model.local` name patterns, resolved against the schema when the run is created.
//!
//! A frozen tensor (not trainable) keeps the run's initial values everywhere: devices do not
//! train it, and it is never uploaded, aggregated or stored per update. A local tensor
//! (personalization, FedPer style) is trained and kept on each device: never uploaded either.
//! What devices upload, and what the round aggregates, is the update: trainable tensors that
//! are not local, in schema order. The coordinator's server optimizer, robust aggregation and
//! DP all work on the update alone, and the next model is the previous one with its update
//! tensors replaced.

use std::ops::Range;

use crate::model_spec::is_lora_adapter;
use crate::tensor::{TensorSchema, TensorSpec, name_matches};

use super::{PlanError, field};

/// A model's tensors split into the update (trained and sent), local (trained and kept) and
/// frozen (neither).
#[derive(Debug, Clone, PartialEq)]
pub struct ModelParts {
    update: TensorSchema,
    /// Element ranges of the update's tensors in the whole model, in schema order.
    update_ranges: Vec<Range<usize>>,
    local: Vec<String>,
    whole: bool,
}

/// Most patterns a plan's `trainable` or `local` may list.
const MAX_PATTERNS: usize = 256;

impl ModelParts {
    /// Resolves a plan's patterns against `schema`: `trainable` (absent: every tensor) and
    /// `local`. Every pattern must match a tensor, a local tensor must be trainable, and the
    /// update must keep at least one tensor.
    pub fn resolve(
        schema: &TensorSchema,
        trainable: Option<&[String]>,
        local: &[String],
    ) -> Result<Self, PlanError> {
        let check = |patterns: &[String], what: &'static str| {
            if patterns.len() > MAX_PATTERNS {
                return Err(field(what, format!("at most {MAX_PATTERNS} patterns")));
            }
            match patterns.iter().find(|p| !schema.tensors.iter().any(|t| name_matches(p, &t.name)))
            {
                Some(p) => {
                    Err(field(what, format!("pattern {p:?} matches no tensor of the model")))
                }
                None => Ok(()),
            }
        };
        if let Some(trainable) = trainable {
            if trainable.is_empty() {
                return Err(field("model.trainable", "must list at least one pattern"));
            }
            check(trainable, "model.trainable")?;
        }
        check(local, "model.local")?;
        let is_trainable =
            |t: &TensorSpec| trainable.is_none_or(|ps| ps.iter().any(|p| name_matches(p, &t.name)));
        let is_local = |t: &TensorSpec| local.iter().any(|p| name_matches(p, &t.name));
        if let Some(t) = schema.tensors.iter().find(|t| is_local(t) && !is_trainable(t)) {
            return Err(field(
                "model.local",
                format!(
                    "{} is local but not trainable: a frozen tensor has nothing to keep",
                    t.name
                ),
            ));
        }
        let update: Vec<TensorSpec> =
            schema.tensors.iter().filter(|t| is_trainable(t) && !is_local(t)).cloned().collect();
        if update.is_empty() {
            return Err(field(
                "model.local",
                "every trainable tensor is local: the run would have nothing to aggregate",
            ));
        }
        let local = schema.tensors.iter().filter(|t| is_local(t)).map(|t| t.name.clone()).collect();
        Ok(ModelParts::of_update(schema, TensorSchema { tensors: update }, local)
            .expect("the update is a subsequence of the schema's tensors"))
    }

    /// The parts of a model of `schema` whose update is `update` (a subsequence of its tensors,
    /// as a task gives it) and whose local tensors are `local`; `None` when `update` is not one.
    pub fn of_update(
        schema: &TensorSchema,
        update: TensorSchema,
        local: Vec<String>,
    ) -> Option<Self> {
        let mut ranges = Vec::with_capacity(update.tensors.len());
        let (mut offset, mut wanted) = (0usize, update.tensors.iter().peekable());
        for tensor in &schema.tensors {
            let n = tensor.numel() as usize;
            if wanted.next_if(|w| *w == tensor).is_some() {
                ranges.push(offset..offset + n);
            }
            offset += n;
        }
        if wanted.next().is_some() {
            return None;
        }
        let whole = update.tensors.len() == schema.tensors.len();
        Some(ModelParts { update, update_ranges: ranges, local, whole })
    }

    /// The tensors devices upload and the round aggregates.
    pub fn update_schema(&self) -> &TensorSchema {
        &self.update
    }

    /// Names of the tensors each device trains and keeps.
    pub fn local(&self) -> &[String] {
        &self.local
    }

    /// Whether devices train `tensor`: it is in the update or local (not frozen).
    pub fn trains(&self, tensor: &TensorSpec) -> bool {
        self.update.tensors.contains(tensor) || self.local.contains(&tensor.name)
    }

    /// Whether the update is the whole model (nothing frozen, nothing local).
    pub fn is_whole(&self) -> bool {
        self.whole
    }

    /// The update's values out of a whole model's.
    pub fn update_of(&self, model: &[f32]) -> Vec<f32> {
        if self.whole {
            return model.to_vec();
        }
        let mut out = Vec::with_capacity(self.update.numel() as usize);
        for r in &self.update_ranges {
            out.extend_from_slice(&model[r.clone()]);
        }
        out
    }

    /// `model` with its update tensors replaced by `update`'s values.
    ///
    /// # Panics
    /// If `update` does not have the update's length: a caller bug.
    pub fn with_update(&self, mut model: Vec<f32>, update: &[f32]) -> Vec<f32> {
        assert_eq!(update.len() as u64, self.update.numel(), "update does not match its schema");
        let mut offset = 0;
        for r in &self.update_ranges {
            model[r.clone()].copy_from_slice(&update[offset..offset + r.len()]);
            offset += r.len();
        }
        model
    }
}

/// A model of `schema` whose tensors are the base's tensors of the same names (`base_values`,
/// laid out in `base_schema`), and whose LoRA adapters, which no base has, are `adapters`'
/// (a whole model's initialization, laid out in `schema`). A tensor of the model that the base
/// lacks, or has in another shape, is refused by name.
pub(super) fn from_base(
    schema: &TensorSchema,
    base_schema: &TensorSchema,
    base_values: &[f32],
    adapters: &[f32],
) -> Result<Vec<f32>, PlanError> {
    let mut in_base = std::collections::HashMap::new();
    let mut offset = 0usize;
    for t in &base_schema.tensors {
        let n = t.numel() as usize;
        in_base.insert(t.name.as_str(), (t, offset..offset + n));
        offset += n;
    }
    let mut out = Vec::with_capacity(schema.numel() as usize);
    let mut at = 0usize;
    for t in &schema.tensors {
        let n = t.numel() as usize;
        match in_base.get(t.name.as_str()) {
            Some((b, range)) if b.shape == t.shape => {
                out.extend_from_slice(&base_values[range.clone()])
            }
            Some((b, _)) => {
                return Err(field(
                    "model.init.hash",
                    format!(
                        "the base model's {} is {:?}, the run's model needs {:?}",
                        t.name, b.shape, t.shape
                    ),
                ));
            }
            None if is_lora_adapter(&t.name) => out.extend_from_slice(&adapters[at..at + n]),
            None => {
                return Err(field(
                    "model.init.hash",
                    format!("the base model has no tensor {} of the run's model", t.name),
                ));
            }
        }
        at += n;
    }
    Ok(out)
}
