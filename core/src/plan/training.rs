//! The plan's `training` section: how devices train locally. Typed and checked when the run is
//! created, so a typo (`fedprox_muu`) or a bad value (`"lr": "x"`) is a 422 naming the field at
//! `POST /v1/admin/runs` instead of an error on every device of every round.

use serde::{Deserialize, Deserializer, Serialize};

use super::{PlanError, field};

/// The local optimizer devices train with.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LocalOptimizer {
    /// Plain stochastic gradient descent.
    #[default]
    Sgd,
    /// Adam.
    Adam,
}

impl LocalOptimizer {
    /// Its name in a plan (`sgd`, `adam`): what an app's own trainer is told.
    pub fn name(self) -> &'static str {
        match self {
            LocalOptimizer::Sgd => "sgd",
            LocalOptimizer::Adam => "adam",
        }
    }
}

/// A plan's local training configuration, as devices receive it with their task.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainingPlan {
    /// Passes over the local examples (1 to 1 000; default 1).
    #[serde(default = "one")]
    pub epochs: u32,
    /// Examples per step (1 to 65 536; default 32).
    #[serde(default = "thirty_two")]
    pub batch_size: u32,
    /// Learning rate, in (0, 100) (default 0.05).
    #[serde(default = "default_lr")]
    pub lr: f64,
    /// The local optimizer (default `sgd`).
    #[serde(default)]
    pub optimizer: LocalOptimizer,
    /// FedProx's proximal coefficient μ, finite and ≥ 0 (0, the default, is plain FedAvg).
    #[serde(default)]
    pub fedprox_mu: f64,
    /// Shuffling seed, mixed with the device, run and round (default 0).
    #[serde(default)]
    pub seed: u64,
}

fn one() -> u32 {
    1
}
fn thirty_two() -> u32 {
    32
}
fn default_lr() -> f64 {
    0.05
}

impl Default for TrainingPlan {
    fn default() -> Self {
        TrainingPlan {
            epochs: 1,
            batch_size: 32,
            lr: default_lr(),
            optimizer: LocalOptimizer::Sgd,
            fedprox_mu: 0.0,
            seed: 0,
        }
    }
}

impl TrainingPlan {
    /// Checks the values' ranges (the fields and their types serde has checked).
    pub fn validate(&self) -> Result<(), PlanError> {
        if !(1..=1000).contains(&self.epochs) {
            return Err(field("training.epochs", "must be in 1..=1000"));
        }
        if !(1..=65_536).contains(&self.batch_size) {
            return Err(field("training.batch_size", "must be in 1..=65536"));
        }
        if !(self.lr.is_finite() && self.lr > 0.0 && self.lr < 100.0) {
            return Err(field("training.lr", "must be in (0, 100)"));
        }
        if !(self.fedprox_mu.is_finite() && self.fedprox_mu >= 0.0) {
            return Err(field("training.fedprox_mu", "must be finite and non-negative"));
        }
        Ok(())
    }

    /// The configuration in a task's `training_config` JSON, checked as at plan time; `null`
    /// (what plans without a `training` section were sent) gives the defaults.
    pub fn from_json(json: &str) -> Result<Self, PlanError> {
        let value: serde_json::Value =
            serde_json::from_str(json).map_err(|e| field("training", e.to_string()))?;
        let plan = match value {
            serde_json::Value::Null => TrainingPlan::default(),
            value => serde_json::from_value(value).map_err(|e| field("training", e.to_string()))?,
        };
        plan.validate()?;
        Ok(plan)
    }
}

/// `training` in a plan: absent or `null` are the defaults.
pub(super) fn null_as_default<'de, D: Deserializer<'de>>(d: D) -> Result<TrainingPlan, D::Error> {
    Ok(Option::<TrainingPlan>::deserialize(d)?.unwrap_or_default())
}
