//! The operator's run plan: what to train, on whom, and how rounds are paced.
//!
//! Read in two phases: [`Plan`] is the raw serde form the admin API accepts;
//! [`Plan::validate`] turns it into a [`ValidatedPlan`], the only form the rest of the system
//! takes, with defaults filled in and every bound checked.

use std::collections::BTreeMap;
use std::ops::RangeInclusive;

use serde::{Deserialize, Serialize};

use crate::ModelVersion;
use crate::compression::Compression;
use crate::eligibility::Eligibility;
use crate::model_spec::{ModelSpec, SpecError, is_lora_adapter};
use crate::privacy::Privacy;
use crate::rng::SplitMix64;
pub use crate::strategy::Strategy;
pub use crate::tensor::name_matches;
pub use model::is_content_hash;
pub use parts::ModelParts;
pub use secure::{MAX_SECURE_COHORT, secure_poisson_cap};
pub use training::{LocalOptimizer, TrainingPlan};

// Each section of the plan checks itself in its own module; `combinations` holds the table of
// features that refuse each other.
mod combinations;
mod compression;
mod model;
mod pacing;
mod parts;
mod privacy;
mod secure;
mod selection;
mod strategy;
mod training;

use crate::tensor::{TensorError, TensorSchema, f32_from_le_bytes};

/// A run plan as submitted by an operator.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Plan {
    /// Display name.
    #[serde(default)]
    pub name: Option<String>,
    /// Device population the run trains on.
    #[serde(default = "default_population")]
    pub population: String,
    /// The run trains its population alone: creating it is refused while another run is
    /// running there, and no other run starts there while it runs (a store constraint, so two
    /// simulations cannot both take one population).
    #[serde(default)]
    pub exclusive_population: bool,
    /// Model schema and initial parameters.
    pub model: ModelPlan,
    /// How devices train locally; checked here, sent to devices with each task.
    #[serde(default, deserialize_with = "training::null_as_default")]
    pub training: TrainingPlan,
    /// Reports wanted per round; the round closes as soon as this many arrived.
    #[cfg_attr(feature = "openapi", schema(minimum = 1, maximum = 1_000_000))]
    pub cohort_size: u32,
    /// Devices selected per round = `ceil(cohort_size * over_selection)`.
    #[serde(default = "default_over_selection")]
    #[cfg_attr(feature = "openapi", schema(minimum = 1.0, maximum = 10.0))]
    pub over_selection: f64,
    /// Longest time a round spends selecting devices.
    #[serde(default = "default_selection_timeout")]
    #[cfg_attr(feature = "openapi", schema(minimum = 0.05, maximum = 604_800.0))]
    pub selection_timeout_secs: f64,
    /// Longest time a round spends, from its opening, before it closes with what it has.
    #[serde(default = "default_reporting_timeout")]
    #[cfg_attr(feature = "openapi", schema(minimum = 0.05, maximum = 604_800.0))]
    pub reporting_timeout_secs: f64,
    /// Fewest reports a round may commit with; defaults to `cohort_size`.
    #[serde(default)]
    pub min_quorum: Option<u32>,
    /// Number of rounds to commit before the run completes.
    #[cfg_attr(feature = "openapi", schema(minimum = 1))]
    pub rounds: u32,
    /// Server learning rate applied to the mean delta (1.0 is plain FedAvg).
    #[serde(default = "default_server_lr")]
    pub server_learning_rate: f64,
    /// Example counts above this weigh as much as this, in the FedAvg mean and in evaluation
    /// means: devices report their own counts, and one claiming a huge dataset must not
    /// dominate. Default [`DEFAULT_MAX_EXAMPLES`]. Secure runs set theirs in
    /// `secure_aggregation.max_examples` instead.
    #[serde(default)]
    #[cfg_attr(feature = "openapi", schema(minimum = 1, maximum = 536_870_912))]
    pub max_examples: Option<u64>,
    /// Secure aggregation (SecAgg+): the coordinator learns only the cohort's weighted sum.
    /// Absent: plain FedAvg, devices upload their deltas.
    #[serde(default)]
    pub secure_aggregation: Option<SecureAggregationPlan>,
    /// Conditions a device must report at check-in to be selected (charging, unmetered
    /// network, idle, app version, free storage); others are told to come back later.
    #[serde(default, skip_serializing_if = "Eligibility::is_open")]
    pub eligibility: Eligibility,
    /// Evaluation-only rounds: selected devices evaluate the model on their own held-out data
    /// and report metrics, without training; a round closes on its quorum of reports and
    /// records their example-weighted mean, and no new model version is committed. With
    /// `model.init` set to a trained model's parameters, this measures it on the fleet.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub evaluation_only: bool,
    /// How contributions become the next model; absent: FedAvg with `server_learning_rate`.
    #[serde(default)]
    pub strategy: Strategy,
    /// How each round's cohort is drawn from the devices checking in: `random` (default),
    /// `first_come` or `poisson` (with differential privacy).
    #[serde(default)]
    pub selection: SelectionPolicy,
    /// How devices encode their deltas for upload: `f32` (default), `f16`, `bf16`, `int8`
    /// (per-block scale, stochastic rounding) or `top_k` (with error feedback on the device).
    #[serde(default, skip_serializing_if = "Compression::is_f32")]
    pub compression: Compression,
    /// The encoding devices download the model in: `f32` (default), `f16`, `bf16` or `int8`
    /// (per-block scale, rounded to nearest). Devices train from the model as decoded and
    /// send their deltas against it; the coordinator keeps and updates the model in full
    /// precision, so the rounding never accumulates. Devices' evaluations are of the model as
    /// they received it.
    #[serde(default, skip_serializing_if = "Compression::is_f32")]
    pub model_download: Compression,
    /// Asynchronous buffered aggregation (FedBuff, Nguyen et al. 2022) instead of synchronous
    /// rounds: up to `concurrency` devices train at once, each on the model current when it
    /// was selected; the coordinator accepts an update up to `max_staleness` versions behind,
    /// scales it by `(1 + staleness)^-staleness_exponent`, and commits every `cohort_size`
    /// updates. Absent: synchronous rounds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub asynchronous: Option<AsynchronousPlan>,
    /// Write a committed model's bytes to the store every this many versions (`1`, the
    /// default: every version). The versions in between are committed by their content hash:
    /// the current one is served from memory, a restart rebuilds them from their rounds'
    /// updates (kept until the next written version), and once a later version is written
    /// they are no longer kept (downloading or exporting one is a 410 `model_not_kept`). Fewer model writes per round, for
    /// updates kept a few rounds longer and up to `checkpoint_interval - 1` rounds replayed
    /// after a crash. A run's last model is always written; must be 1 in secure and
    /// differentially private runs, whose models cannot be rebuilt from stored updates.
    #[serde(default = "default_checkpoint_interval", skip_serializing_if = "is_one")]
    pub checkpoint_interval: u32,
    /// Rounds failed in a row after which the coordinator stops the run, with the reason in
    /// its view (a run whose every round fails, such as one whose devices are all quarantined,
    /// would otherwise show `running` forever); default [`DEFAULT_MAX_FAILED_ROUNDS`], `0`:
    /// never.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_failed_rounds: Option<u32>,
    /// The largest L2 norm of one device's update; a larger one is refused at upload (422),
    /// alone, before it reaches any sum. Default [`DEFAULT_MAX_UPDATE_NORM`] (at least a DP
    /// run's clip norm). Not checked in secure runs, whose updates the coordinator cannot see
    /// (their devices clip to `secure_aggregation.clip`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_update_norm: Option<f64>,
    /// A round's next model is refused (the round fails `aggregate_rejected`) when its L2 norm
    /// is over this many times the previous model's (at least 1); default
    /// [`DEFAULT_MAX_MODEL_NORM_GROWTH`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_model_norm_growth: Option<f64>,
}

/// Rounds failed in a row after which a run stops, when its plan names no `max_failed_rounds`.
pub const DEFAULT_MAX_FAILED_ROUNDS: u32 = 20;
/// A device update's largest L2 norm when the plan names no `max_update_norm`: far above an
/// honest round of local SGD, far below what overflows a model (a finite update of norm 1e38
/// once set a model's values to 2.7e38).
pub const DEFAULT_MAX_UPDATE_NORM: f64 = 1e4;
/// The next model's largest L2 norm, as a multiple of the previous model's (at least 1), when
/// the plan names no `max_model_norm_growth`.
pub const DEFAULT_MAX_MODEL_NORM_GROWTH: f64 = 100.0;

/// The plan's asynchronous (FedBuff) settings.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AsynchronousPlan {
    /// Devices training at once (selected, not yet reported or expired).
    pub concurrency: u32,
    /// Versions an update may be behind the current model and still count.
    pub max_staleness: u32,
    /// `a` in the staleness weight `(1 + s)^-a`; 0.5 (FedBuff's choice) by default.
    #[serde(default = "default_staleness_exponent")]
    pub staleness_exponent: f64,
}

fn default_staleness_exponent() -> f64 {
    0.5
}

impl AsynchronousPlan {
    /// The weight of an update `staleness` versions behind, relative to a fresh one.
    pub fn staleness_scale(&self, staleness: u32) -> f64 {
        libm::pow(1.0 + f64::from(staleness), -self.staleness_exponent)
    }
}

/// The plan's secure-aggregation switch and parameters.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SecureAggregationPlan {
    /// Each delta value (times its weight) is clipped to `[-clip, clip]` and quantized into
    /// `32 − ⌈log2 n⌉` bits, so the cohort's sum cannot wrap the 2^32 ring.
    pub clip: f64,
    /// Example counts above this weigh as much as this (weights travel inside the masked sum).
    pub max_examples: u64,
    /// Neighbours per device in the SecAgg+ graph; default ~3·log2(n) (the complete graph, i.e.
    /// SecAgg, when ≥ n − 1).
    #[serde(default)]
    pub neighbours: Option<u32>,
    /// Deadline of each of the short stages (AdvertiseKeys, ShareKeys, Unmasking); masked
    /// inputs are due by the round's reporting deadline.
    #[serde(default = "default_stage_timeout")]
    pub stage_timeout_secs: f64,
}

/// Model schema and initial parameters: a `schema`, a `spec`, or both (then they must agree);
/// a plan with neither is refused.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[cfg_attr(feature = "openapi", schema(min_properties = 2))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelPlan {
    /// `tensors`: a model its devices define and train in their own framework (the
    /// coordinator knows only its tensors: `schema` required, no `spec`); `layers`: a model
    /// built from `spec` by the SDK's trainer. Absent: `layers` when `spec` is given, else
    /// `tensors`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<ModelKind>,
    /// Tensor names, shapes, dtypes; derived from `spec` when absent.
    #[serde(default)]
    pub schema: Option<TensorSchema>,
    /// A declarative model the client SDK builds at run time (optional for runs whose clients
    /// bring their own model).
    #[cfg_attr(feature = "openapi", schema(value_type = Option<Object>))]
    #[serde(default)]
    pub spec: Option<ModelSpec>,
    /// How version 0 is made; absent: `seeded` with seed 0.
    #[serde(default = "default_init")]
    pub init: InitSpec,
    /// Name patterns (`*` matches any run of characters) of the tensors devices train; absent:
    /// all, or a LoRA spec's adapters (`*.lora_a`, `*.lora_b`). The rest are frozen at their
    /// initial values and never travel.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trainable: Option<Vec<String>>,
    /// Name patterns of trainable tensors each device keeps (personalization): trained on the
    /// device and never uploaded, aggregated or stored by the coordinator.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub local: Vec<String>,
    /// The Hugging Face tokenizer (a `tokenizer.json` imported with `starling models
    /// import-tokenizer`, by the content hash that printed) devices turn their text into the
    /// spec's token windows with: each window of `length` tokens labelled with the token after
    /// it. Needs a spec whose input is tokens, with a vocabulary at least the tokenizer's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokenizer: Option<String>,
}

/// Who defines a plan's model.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ModelKind {
    /// Only the named tensors: the devices' own trainers (PyTorch, TensorFlow Lite, Core ML)
    /// run the model; the coordinator aggregates, optimizes, compresses, masks and exports it
    /// as any other, and has no forward pass to evaluate it with.
    Tensors,
    /// A declarative layer list (`spec`) the SDK builds and trains.
    Layers,
}

/// How the initial model is made.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind", deny_unknown_fields)]
pub enum InitSpec {
    /// Every parameter zero. (A struct variant, so that unknown fields are refused: serde
    /// lets them through on unit variants of an internally tagged enum.)
    Zeros {},
    /// With a `spec`: the spec's initialization (see [`ModelSpec::initial_parameters`]).
    /// Without: Glorot-uniform weights for tensors of rank ≥ 2, zero for rank-1 tensors
    /// (biases). Either way from a deterministic generator seeded with `seed`.
    Seeded {
        /// Generator seed.
        seed: u64,
    },
    /// Explicit values: little-endian f32 in schema order, base64 (standard alphabet).
    Parameters {
        /// The encoded values.
        data_base64: String,
    },
    /// A pretrained model the operator imported (`starling models import`), by content hash:
    /// each tensor of the run's model takes the base's tensor of its name, which must have its
    /// shape. The base must hold every tensor of the model but LoRA adapters, which start as
    /// `seeded` with `seed` does; it may hold more (a model's head replaced, say), which are
    /// left out.
    BaseModel {
        /// The imported model's content hash.
        hash: String,
        /// Seed of the adapters' initialization.
        #[serde(default)]
        seed: u64,
    },
}

/// A plan that passed validation, with defaults resolved.
#[derive(Debug, Clone, PartialEq)]
pub struct ValidatedPlan {
    plan: Plan,
    schema: TensorSchema,
    parts: ModelParts,
    rounds: RoundConfig,
    privacy: Option<Privacy>,
}

/// Round pacing derived from a plan; everything the round state machine needs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RoundConfig {
    /// Reports wanted per round.
    pub cohort_size: u32,
    /// Devices selected per round (cohort × over-selection).
    pub target_selected: u32,
    /// Fewest reports a round may commit with.
    pub min_quorum: u32,
    /// Selection phase length.
    pub selection_timeout_ms: i64,
    /// Time from round opening to the reporting deadline.
    pub reporting_timeout_ms: i64,
    /// Rounds to commit.
    pub total_rounds: u32,
    /// Secure aggregation, when the plan turns it on.
    #[serde(default)]
    pub secure: Option<SecureRoundConfig>,
    /// What a device must report to be selected.
    #[serde(default)]
    pub eligibility: Eligibility,
    /// Rounds evaluate the current model and commit none (see [`Plan::evaluation_only`]).
    #[serde(default)]
    pub evaluation_only: bool,
    /// Updates come to the coordinator one by one, never through the aggregator tier (the
    /// strategy bounds, clips or order-ranks each one).
    #[serde(default)]
    pub each_update_direct: bool,
    /// How the cohort is drawn from the devices that check in.
    #[serde(default = "SelectionPolicy::first_come")]
    pub selection: SelectionPolicy,
    /// With Poisson selection, each device's chance of being drawn in a round.
    #[serde(default)]
    pub poisson_rate: Option<f64>,
    /// Random selection with differential privacy: the round waits out its selection window,
    /// then draws its cohort uniformly from the eligible devices that checked in, and selects
    /// no one if they were fewer than this (the accountant's population).
    #[serde(default)]
    pub min_population: Option<u64>,
    /// FedBuff: a "round" is one buffer of `cohort_size` updates, `target_selected` is the
    /// concurrency, and devices selected in earlier rounds may still report.
    #[serde(default)]
    pub asynchronous: Option<AsynchronousPlan>,
    /// Rounds failed in a row after which the run stops with the reason (0: never).
    #[serde(default)]
    pub max_failed_rounds: u32,
    /// A `blt_ftrl` run's participation rule, which selection enforces.
    #[serde(default)]
    pub participation_rule: Option<ParticipationRule>,
}

/// A `blt_ftrl` run's participation rule (`round::participation_rule` enforces it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ParticipationRule {
    /// Committed rounds between two selections of one device, at least.
    pub min_separation: u64,
    /// Selections of one device in the run, at most.
    pub max_participations: u64,
}

/// How a round's cohort is drawn from the devices that check in during selection.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SelectionPolicy {
    /// Uniformly at random (selection sampling over the devices online), so that fast or
    /// always-connected devices are not favoured; the default. With differential privacy, the
    /// draw is exact: the round waits out its selection window and draws its cohort uniformly
    /// without replacement from the eligible devices that checked in (at least the plan's
    /// `population`, or it selects no one).
    #[default]
    Random,
    /// The first devices to check in, until the target: fastest, but it favours the devices
    /// that check in first.
    FirstCome,
    /// Poisson sampling, for differential privacy: each eligible device checking in during
    /// selection is drawn once per round, independently, with the DP accountant's sampling
    /// rate q, and the cohort is however many are drawn (up to the plan's selected count: a
    /// device arriving after that is not drawn, which only lowers its chance). No fill late
    /// in the window, so q is the chance of every device, whatever the population.
    Poisson,
}

impl SelectionPolicy {
    /// For configurations stored before the policy existed: they selected first come.
    fn first_come() -> Self {
        SelectionPolicy::FirstCome
    }
}

/// Secure-aggregation parameters of a run, resolved.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct SecureRoundConfig {
    /// Clipping range of the quantizer.
    pub clip: f64,
    /// Example counts are capped here for weighting.
    pub max_examples: u64,
    /// Neighbours per device.
    pub k: u32,
    /// Shamir threshold.
    pub t: u32,
    /// The model's parameters: the first entries of a masked vector.
    #[serde(default)]
    pub n_params: usize,
    /// Masked vector length: the model's parameters, the weight, and the device's evaluation
    /// ([`secagg::EVALUATION_ENTRIES`](crate::secagg::EVALUATION_ENTRIES)).
    pub vector_len: usize,
    /// Deadline of each short stage.
    pub stage_timeout_ms: i64,
    /// With differential privacy: the L2 norm devices clip their delta to before masking.
    #[serde(default)]
    pub clip_norm: Option<f64>,
    /// With distributed DP: the noise each device adds before masking, and how the coordinator
    /// decodes the sum (the vectors are then the rotated, padded model and nothing else).
    #[serde(default)]
    pub distributed: Option<crate::privacy::DistributedNoise>,
    /// Evaluation losses are capped here in the masked vector; absent:
    /// [`secagg::SECURE_LOSS_CAP`](crate::secagg::SECURE_LOSS_CAP). A DP plan's noised metrics
    /// use their `loss_bound`, so the noise on the released loss scales with it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub evaluation_loss_cap: Option<f64>,
}

impl SecureRoundConfig {
    /// The cap on evaluation losses in the masked vector.
    pub fn evaluation_loss_cap(&self) -> f64 {
        self.evaluation_loss_cap.unwrap_or(crate::secagg::SECURE_LOSS_CAP)
    }

    /// Whether masked vectors of `len` entries carry the devices' evaluation after the weighted
    /// delta and its weight (a round begun before evaluations went through the sum does not).
    pub fn carries_evaluation(&self, len: usize) -> bool {
        self.distributed.is_none() && len == self.n_params + 1 + crate::secagg::EVALUATION_ENTRIES
    }
}

/// Why a plan was rejected.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum PlanError {
    /// The model schema is invalid.
    #[error("model schema: {0}")]
    Schema(#[from] TensorError),
    /// The model spec is invalid.
    #[error("model spec: {0}")]
    Spec(#[from] SpecError),
    /// A field is out of range.
    #[error("{field}: {why}")]
    Field {
        /// Field name.
        field: &'static str,
        /// What is wrong.
        why: String,
    },
}

/// The longest run name, in bytes.
pub const MAX_RUN_NAME: usize = 256;

fn field(field: &'static str, why: impl Into<String>) -> PlanError {
    PlanError::Field { field, why: why.into() }
}

/// The cap on one device's example count (its FedAvg and evaluation weight) when a plain
/// run's plan names none: ten times a typical device's data (the FedAvg paper's MNIST clients
/// hold 600), so an honest device is weighed by what it has while one claiming more than any
/// phone holds weighs at most as much as a handful of honest ones. It was 100 000, at which one
/// device claiming it outweighed two honest ones 83 : 1. Plans with larger devices set
/// `max_examples`.
pub const DEFAULT_MAX_EXAMPLES: u64 = 10_000;

/// Upper bound on cohort size; larger cohorts belong to the aggregator tier.
pub const MAX_COHORT: u32 = 1_000_000;

/// The most versions between written models: a crash replays at most one fewer rounds.
pub const MAX_CHECKPOINT_INTERVAL: u32 = 100;

impl Plan {
    /// Checks the plan section by section and resolves defaults: each section's own values
    /// first, in this order, then the table of refused combinations, then what depends on
    /// several sections (the refusal a plan gets is the first of these it fails).
    pub fn validate(self) -> Result<ValidatedPlan, PlanError> {
        self.training.validate()?;
        let (schema, parts) = self.model.resolve()?;
        self.check_name_and_population()?;
        self.check_max_failed_rounds()?;
        self.check_update_limits()?;
        let quorum = self.check_selection()?;
        self.check_strategy(quorum)?;
        self.check_compression()?;
        self.check_pacing()?;
        combinations::check(&self)?;
        self.check_max_examples()?;
        self.model.check_init_length(&schema)?;
        let target_selected = self.target_selected();
        self.check_aggregation_memory(target_selected)?;
        // Secure aggregation and DP see the update, not the frozen or local tensors.
        let n_params = parts.update_schema().numel() as usize;
        let protocol_size = self.protocol_size(target_selected);
        let privacy = self.resolve_privacy(target_selected, protocol_size, n_params)?;
        let secure = self.resolve_secure(protocol_size, n_params, privacy)?;
        let rounds = self.round_config(quorum, protocol_size, privacy, secure, &parts)?;
        Ok(ValidatedPlan { plan: self, schema, parts, rounds, privacy })
    }
}

impl ValidatedPlan {
    /// The plan as submitted (with defaults filled in by serde).
    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// The run's differential privacy, resolved (sampling rate, noise, rounds the ε budget
    /// allows); `None` without.
    pub fn privacy(&self) -> Option<&Privacy> {
        self.privacy.as_ref()
    }

    /// Whether the coordinator may store a round's updates as the sums of groups of them
    /// ([`FoldedGroup`](crate::fedavg::FoldedGroup)) rather than one by one: every run that
    /// uploads a delta, but a secure one (its updates arrive masked, and go to its records)
    /// and one combined by an order statistic (which reads each update back at close).
    pub fn stores_update_sums(&self) -> bool {
        self.update_len() > 0
            && self.plan.secure_aggregation.is_none()
            && !self.plan.strategy.aggregation.is_order_statistic()
    }

    /// The largest L2 norm an upload's update may have (see [`Plan::max_update_norm`]); `None`
    /// in secure runs, whose updates the coordinator never sees.
    pub fn max_update_norm(&self) -> Option<f64> {
        if self.plan.secure_aggregation.is_some() {
            return None;
        }
        let clip = self.privacy.as_ref().map_or(0.0, |p| p.plan.clip_norm);
        Some(self.plan.max_update_norm.unwrap_or(DEFAULT_MAX_UPDATE_NORM.max(clip)))
    }

    /// The bound on a next model's L2 norm given the previous one's (see
    /// [`Plan::max_model_norm_growth`]).
    pub fn max_next_model_norm(&self, previous_norm: f64) -> f64 {
        let growth = self.plan.max_model_norm_growth.unwrap_or(DEFAULT_MAX_MODEL_NORM_GROWTH);
        growth * previous_norm.max(1.0)
    }

    /// Whether the run releases what devices report as they report it: training metrics (a
    /// round's example-weighted loss), their federated evaluations and a secure round's pooled
    /// evaluation. A DP run does not: what it releases beside its noised model is either
    /// nothing (`metrics: withheld`, its devices told to send none,
    /// [`TaskAssignment::withhold_metrics`](crate::wire::TaskAssignment::withhold_metrics)) or
    /// the cohort's metrics clipped and noised in its accounting (`metrics: noised`,
    /// [`Self::noises_device_metrics`]); devices' own evaluation reports are refused either way.
    pub fn releases_device_metrics(&self) -> bool {
        self.privacy.is_none()
    }

    /// Whether the run is DP and releases its cohort's metrics noised
    /// ([`crate::privacy::metrics`]).
    pub fn noises_device_metrics(&self) -> bool {
        self.privacy.is_some_and(|p| p.plan.metrics.noised().is_some())
    }

    /// The metrics of a device's plain upload as the round folds and stores them: as sent
    /// without DP; in a DP run, the device's clipped metrics block when the plan noises metrics
    /// and nothing when it withholds them.
    pub fn metrics_to_fold(&self, metrics: BTreeMap<String, f64>) -> BTreeMap<String, f64> {
        match self.privacy.map(|p| p.plan.metrics.noised()) {
            None => metrics,
            Some(None) => BTreeMap::new(),
            Some(Some(m)) => crate::privacy::metrics::block_of_upload(&metrics, m.loss_bound),
        }
    }

    /// A round's empty accumulator: folding updates of [`Self::update_len`] values, bounding
    /// each as the strategy says (with `state`'s clip norm for DP).
    pub fn accumulator(
        &self,
        state: &crate::strategy::OptimizerState,
    ) -> crate::fedavg::FedAvgAccumulator {
        crate::fedavg::FedAvgAccumulator::new(self.update_len())
            .bounded(self.plan.strategy.accumulator_bound(state))
    }

    /// The model schema.
    pub fn schema(&self) -> &TensorSchema {
        &self.schema
    }

    /// The schema a device's upload must match: the model's trainable tensors that are not
    /// local (the whole model without `trainable` and `local`), or none at all in an
    /// evaluation-only run (its uploads carry metrics and an example count, no delta).
    pub fn update_schema(&self) -> TensorSchema {
        if self.plan.evaluation_only {
            TensorSchema { tensors: vec![] }
        } else {
            self.parts.update_schema().clone()
        }
    }

    /// Values in a device's upload: the update's parameters, or none in an evaluation-only run.
    pub fn update_len(&self) -> usize {
        if self.plan.evaluation_only { 0 } else { self.parts.update_schema().numel() as usize }
    }

    /// Which tensors devices train, send and keep.
    pub fn model_parts(&self) -> &ModelParts {
        &self.parts
    }

    /// The encoding devices upload their deltas in.
    pub fn compression(&self) -> Compression {
        self.plan.compression
    }

    /// The encoding devices download the model in (the plan's `model_download`).
    pub fn model_download(&self) -> Compression {
        self.plan.model_download
    }

    /// Whether a committed model `version`'s bytes are written to the store (the plan's
    /// `checkpoint_interval`): every version of a secure or DP run, whose models cannot be
    /// rebuilt, and otherwise every `checkpoint_interval`-th and the run's last.
    pub fn writes_model(&self, version: ModelVersion) -> bool {
        let interval = u64::from(self.plan.checkpoint_interval.max(1));
        let last = u64::from(self.rounds.total_rounds);
        let version = version.0.max(0) as u64;
        version.is_multiple_of(interval) || version >= last
    }

    /// The versions a write of model `version` makes durable: itself, and those committed
    /// since the previous version [`writes_model`](Self::writes_model) writes, which it gives
    /// up (just `version` when every version is written). Their rounds' updates are no longer
    /// needed once its bytes are in the store.
    pub fn versions_written_by(&self, version: ModelVersion) -> RangeInclusive<ModelVersion> {
        let interval = i64::from(self.plan.checkpoint_interval.max(1));
        let previous = (version.0 - 1).max(0) / interval * interval;
        ModelVersion(previous + 1)..=version
    }

    /// The most bytes a device's delta may take in the run's encoding (top-k of a large share
    /// takes more than f32: an index beside each value): what the upload's body limit allows.
    pub fn max_delta_bytes(&self) -> u64 {
        let update_len = self.update_len();
        self.update_schema().byte_len().max(self.compression().max_encoded_len(update_len))
    }

    /// What an export of a model with `values` (laid out in [`Self::schema`]) holds for `part`:
    /// the model as trained (`all`), or for a LoRA run its base model with the adapters merged
    /// in (`merged`, `W + (alpha / rank)·A·B`) or the adapters alone (`adapters`). The schema
    /// and the values laid out in it.
    pub fn export_part(
        &self,
        part: &str,
        values: &[f32],
    ) -> Result<(TensorSchema, Vec<f32>), PlanError> {
        let lora_spec = || {
            self.model_spec().filter(|s| s.lora.is_some()).ok_or_else(|| {
                field("part", format!("{part}: the run's model has no LoRA adapters"))
            })
        };
        match part {
            "all" => Ok((self.schema.clone(), values.to_vec())),
            "merged" => {
                let spec = lora_spec()?;
                Ok((spec.without_lora().schema()?, spec.merge_lora(values)?))
            }
            "adapters" => {
                lora_spec()?;
                let adapters = TensorSchema {
                    tensors: (self.schema.tensors.iter())
                        .filter(|t| is_lora_adapter(&t.name))
                        .cloned()
                        .collect(),
                };
                let parts = ModelParts::of_update(&self.schema, adapters.clone(), vec![])
                    .expect("the adapters are tensors of the schema, in its order");
                Ok((adapters, parts.update_of(values)))
            }
            other => Err(field("part", format!("{other:?}: use all, merged or adapters"))),
        }
    }

    /// The model spec, if the plan has one.
    pub fn model_spec(&self) -> Option<&ModelSpec> {
        self.plan.model.spec.as_ref()
    }

    /// Round pacing.
    pub fn round_config(&self) -> RoundConfig {
        self.rounds.clone()
    }

    /// The most examples one device's update or evaluation weighs.
    pub fn max_examples(&self) -> u64 {
        match &self.plan.secure_aggregation {
            Some(s) => s.max_examples,
            None => self.plan.max_examples.unwrap_or(DEFAULT_MAX_EXAMPLES),
        }
    }

    /// The training configuration as JSON text, as clients receive it.
    pub fn training_config_json(&self) -> String {
        serde_json::to_string(&self.plan.training).expect("a training plan serializes")
    }

    /// The imported model `init` names, if it names one: what [`Self::initial_parameters`]
    /// needs looked up.
    pub fn base_model_hash(&self) -> Option<&str> {
        match &self.plan.model.init {
            InitSpec::BaseModel { hash, .. } => Some(hash),
            _ => None,
        }
    }

    /// The imported tokenizer devices tokenize their text with, by content hash (see
    /// [`ModelPlan::tokenizer`]): what the coordinator looks up at run creation.
    pub fn tokenizer(&self) -> Option<&str> {
        self.plan.model.tokenizer.as_deref()
    }

    /// The imported model devices may take every untrained tensor from: `init`'s, when the run
    /// freezes tensors and none of them is a LoRA adapter (the one kind `init` does not take
    /// from it). Devices then fetch it once and download only the trained tensors each round.
    pub fn frozen_from_base(&self) -> Option<&str> {
        let hash = self.base_model_hash()?;
        let mut frozen = self.schema.tensors.iter().filter(|t| !self.parts.trains(t)).peekable();
        frozen.peek()?;
        frozen.all(|t| !is_lora_adapter(&t.name)).then_some(hash)
    }

    /// The tensors devices train (the update's and the local ones), in model order: what
    /// `GET /v1/runs/{run}/models/{hash}/trained` serves.
    pub fn trained_schema(&self) -> TensorSchema {
        TensorSchema {
            tensors: self.schema.tensors.iter().filter(|t| self.parts.trains(t)).cloned().collect(),
        }
    }

    /// Builds model version 0.
    ///
    /// `decode_base64` is passed in because the core has no base64 dependency of its own;
    /// it returns `None` on malformed input. `base` is the imported model `init` names (its
    /// tensors and values), looked up by the caller; `None` when it names none or it is not
    /// imported.
    pub fn initial_parameters_from(
        &self,
        decode_base64: impl FnOnce(&str) -> Option<Vec<u8>>,
        base: Option<(&TensorSchema, &[f32])>,
    ) -> Result<Vec<f32>, PlanError> {
        let schema = self.schema();
        if let InitSpec::BaseModel { hash, seed } = &self.plan.model.init {
            let (base_schema, base_values) = base.ok_or_else(|| {
                field("model.init.hash", format!("no imported model has content hash {hash}"))
            })?;
            let adapters = match self.model_spec() {
                Some(spec) => spec.initial_parameters(*seed)?,
                None => seeded_init(schema, *seed),
            };
            return parts::from_base(schema, base_schema, base_values, &adapters);
        }
        self.initial_parameters(decode_base64)
    }

    /// Builds model version 0 from anything but an imported model (see
    /// [`Self::initial_parameters_from`]).
    pub fn initial_parameters(
        &self,
        decode_base64: impl FnOnce(&str) -> Option<Vec<u8>>,
    ) -> Result<Vec<f32>, PlanError> {
        let schema = self.schema();
        match &self.plan.model.init {
            InitSpec::BaseModel { hash, .. } => Err(field(
                "model.init.hash",
                format!("model {hash} is imported: its values come from the store"),
            )),
            InitSpec::Zeros {} => Ok(vec![0.0; schema.numel() as usize]),
            InitSpec::Seeded { seed } => match self.model_spec() {
                Some(spec) => Ok(spec.initial_parameters(*seed)?),
                None => Ok(seeded_init(schema, *seed)),
            },
            InitSpec::Parameters { data_base64 } => {
                let bytes = decode_base64(data_base64)
                    .ok_or_else(|| field("model.init.data_base64", "not valid base64"))?;
                if bytes.len() as u64 != schema.byte_len() {
                    return Err(field(
                        "model.init.data_base64",
                        "length does not match the schema",
                    ));
                }
                let values = f32_from_le_bytes(&bytes);
                if values.iter().any(|v| !v.is_finite()) {
                    return Err(field("model.init.data_base64", "holds a non-finite value"));
                }
                Ok(values)
            }
        }
    }
}

/// Glorot-uniform initialization with a SplitMix64 stream: deterministic on every platform.
///
/// A statistical generator is right here: initial weights are public and need no secrecy.
pub fn seeded_init(schema: &TensorSchema, seed: u64) -> Vec<f32> {
    let mut rng = SplitMix64(seed);
    let mut next_unit = move || rng.unit();
    let mut out = Vec::with_capacity(schema.numel() as usize);
    for t in &schema.tensors {
        let n = t.numel() as usize;
        if t.shape.len() < 2 {
            out.extend(std::iter::repeat_n(0.0, n));
            continue;
        }
        // fan_out is the first dimension; fan_in the product of the rest (burn's Linear and
        // Conv layouts put the output dimension first or last; Glorot is symmetric in both).
        let fan_out = t.shape[0] as f64;
        let fan_in = t.shape[1..].iter().product::<u64>() as f64;
        let bound = (6.0 / (fan_in + fan_out)).sqrt();
        out.extend((0..n).map(|_| ((next_unit() * 2.0 - 1.0) * bound) as f32));
    }
    out
}

fn default_checkpoint_interval() -> u32 {
    1
}

fn is_one(n: &u32) -> bool {
    *n == 1
}

fn default_population() -> String {
    "default".to_owned()
}
fn default_over_selection() -> f64 {
    1.3
}
fn default_selection_timeout() -> f64 {
    30.0
}
fn default_reporting_timeout() -> f64 {
    120.0
}
fn default_server_lr() -> f64 {
    1.0
}
fn default_init() -> InitSpec {
    InitSpec::Seeded { seed: 0 }
}
fn default_stage_timeout() -> f64 {
    30.0
}

#[cfg(test)]
mod tests;
