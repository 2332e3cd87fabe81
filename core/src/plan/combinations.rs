//! Which plan features refuse which others, as one table: each row names the field that must
//! go and why. `Plan::validate` checks each feature's own values first, then the first row
//! whose two features the plan both turns on. A new feature adds a `Feature` and its rows.

/// Something a plan turns on that another feature may refuse.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Feature {
    /// `secure_aggregation`.
    SecureAggregation,
    /// `secure_aggregation.max_examples` above 1 (updates weighed by their examples).
    SecureWeightedExamples,
    /// A robust order statistic in `strategy.aggregation`.
    OrderStatistic,
    /// `strategy.norm_bound`.
    NormBound,
    /// `strategy.differential_privacy`.
    DifferentialPrivacy,
    /// `strategy.differential_privacy.adaptive_clipping`.
    AdaptiveClipping,
    /// Anything in `strategy` beyond plain FedAvg's mean: a bound, an order statistic, DP or
    /// a stateful server optimizer.
    ServerTraining,
    /// A strategy that weighs each update its own way (bound, order statistic, DP).
    EachUpdateWeighed,
    /// A `compression` other than f32.
    Compression,
    /// A `model_download` other than f32.
    ModelDownload,
    /// `asynchronous` (FedBuff).
    Asynchronous,
    /// `checkpoint_interval` above 1.
    Checkpoints,
    /// `evaluation_only`.
    EvaluationOnly,
    /// A plain run's own `max_examples`.
    MaxExamples,
    /// `selection: first_come`.
    FirstComeSelection,
    /// `model.trainable` or `model.local`: devices train or send part of the model.
    PartialModel,
}

/// `field` (of `feature`) is refused when the plan also has `with`, because `why`.
pub(super) struct Refusal {
    feature: Feature,
    with: Feature,
    pub(super) field: &'static str,
    pub(super) why: &'static str,
}

impl Refusal {
    /// Whether a plan that has the features `has` says it has falls under this row.
    pub(super) fn applies(&self, has: &dyn Fn(Feature) -> bool) -> bool {
        has(self.feature) && has(self.with)
    }
}

use Feature::*;

use super::{Plan, PlanError, SelectionPolicy, field};

/// The first row of the table the plan falls under, as its refusal.
pub(super) fn check(plan: &Plan) -> Result<(), PlanError> {
    match REFUSED.iter().find(|r| r.applies(&|f| plan.has(f))) {
        Some(refused) => Err(field(refused.field, refused.why)),
        None => Ok(()),
    }
}

impl Plan {
    /// Whether the plan turns `feature` on (for the table of refused combinations).
    fn has(&self, feature: Feature) -> bool {
        let strategy = &self.strategy;
        let dp = strategy.differential_privacy.as_ref();
        match feature {
            Feature::SecureAggregation => self.secure_aggregation.is_some(),
            Feature::SecureWeightedExamples => {
                self.secure_aggregation.as_ref().is_some_and(|s| s.max_examples != 1)
            }
            Feature::OrderStatistic => strategy.aggregation.is_order_statistic(),
            Feature::NormBound => strategy.norm_bound.is_some(),
            Feature::DifferentialPrivacy => dp.is_some(),
            Feature::AdaptiveClipping => dp.is_some_and(|dp| dp.adaptive_clipping.is_some()),
            Feature::ServerTraining => {
                strategy.needs_each_update() || strategy.optimizer.is_stateful()
            }
            Feature::EachUpdateWeighed => strategy.needs_each_update(),
            Feature::Compression => !self.compression.is_f32(),
            Feature::ModelDownload => !self.model_download.is_f32(),
            Feature::Asynchronous => self.asynchronous.is_some(),
            Feature::Checkpoints => self.checkpoint_interval > 1,
            Feature::EvaluationOnly => self.evaluation_only,
            Feature::MaxExamples => self.max_examples.is_some(),
            Feature::FirstComeSelection => self.selection == SelectionPolicy::FirstCome,
            Feature::PartialModel => {
                self.model.trainable.is_some()
                    || !self.model.local.is_empty()
                    || self.model.spec.as_ref().is_some_and(|s| s.lora.is_some())
            }
        }
    }
}

const fn row(feature: Feature, with: Feature, field: &'static str, why: &'static str) -> Refusal {
    Refusal { feature, with, field, why }
}

/// Every refused combination, in the order they are reported.
pub(super) const REFUSED: &[Refusal] = &[
    row(
        ServerTraining,
        EvaluationOnly,
        "strategy",
        "an evaluation-only run trains nothing: it takes no optimizer, aggregation, norm bound or privacy",
    ),
    row(
        OrderStatistic,
        SecureAggregation,
        "strategy.aggregation",
        "order statistics need each device's update, and secure aggregation reveals only the sum; use the mean or drop secure_aggregation",
    ),
    row(
        NormBound,
        SecureAggregation,
        "strategy.norm_bound",
        "the coordinator cannot bound a masked update; with secure aggregation use differential_privacy.clip_norm, which devices apply before masking",
    ),
    row(
        DifferentialPrivacy,
        OrderStatistic,
        "strategy.differential_privacy",
        "DP-FedAvg clips each update to clip_norm and takes the mean; it does not combine with a robust aggregation or a separate norm_bound",
    ),
    row(
        DifferentialPrivacy,
        NormBound,
        "strategy.differential_privacy",
        "DP-FedAvg clips each update to clip_norm and takes the mean; it does not combine with a robust aggregation or a separate norm_bound",
    ),
    row(
        FirstComeSelection,
        DifferentialPrivacy,
        "selection",
        "must be random with differential privacy: the accountant's ε assumes each round's cohort is sampled from the population, and first_come takes whoever checks in first",
    ),
    row(
        SecureWeightedExamples,
        DifferentialPrivacy,
        "secure_aggregation.max_examples",
        "must be 1 with differential privacy: every update weighs the same, so one device moves the sum by at most clip_norm",
    ),
    row(
        AdaptiveClipping,
        SecureAggregation,
        "strategy.differential_privacy.adaptive_clipping",
        "needs each device's clipping outcome, which secure aggregation hides; use a fixed clip_norm",
    ),
    row(
        Compression,
        SecureAggregation,
        "compression",
        "must be f32 here: secure aggregation masks f32 values quantized to its own ring",
    ),
    row(
        Compression,
        OrderStatistic,
        "compression",
        "must be f32 here: order statistics read the stored updates back as f32 tiles",
    ),
    row(
        Compression,
        EvaluationOnly,
        "compression",
        "must be f32 here: an evaluation-only run uploads no delta",
    ),
    row(
        ModelDownload,
        EvaluationOnly,
        "model_download",
        "must be f32 in an evaluation-only run: it evaluates the model itself",
    ),
    row(
        Asynchronous,
        SecureAggregation,
        "asynchronous",
        "not with this plan: secure aggregation sums one round's cohort",
    ),
    row(
        Asynchronous,
        EvaluationOnly,
        "asynchronous",
        "not with this plan: an evaluation-only run commits no model versions to be stale against",
    ),
    row(
        Asynchronous,
        EachUpdateWeighed,
        "asynchronous",
        "not with this plan: norm bounds, robust aggregation and DP-FedAvg weigh each update their own way",
    ),
    row(
        Checkpoints,
        SecureAggregation,
        "checkpoint_interval",
        "must be 1 here: a secure round's records are deleted at its commit, so its model cannot be rebuilt and is written every version",
    ),
    row(
        Checkpoints,
        DifferentialPrivacy,
        "checkpoint_interval",
        "must be 1 here: a DP round's noise is drawn afresh, so its model cannot be rebuilt and is written every version",
    ),
    row(
        Checkpoints,
        EvaluationOnly,
        "checkpoint_interval",
        "must be 1 here: an evaluation-only run commits no models",
    ),
    row(
        EvaluationOnly,
        SecureAggregation,
        "evaluation_only",
        "a secure run pools its evaluations inside the masked sum of training rounds; evaluation-only rounds are plain",
    ),
    row(
        MaxExamples,
        SecureAggregation,
        "max_examples",
        "a secure run takes its cap in secure_aggregation.max_examples",
    ),
    row(
        PartialModel,
        EvaluationOnly,
        "model.trainable",
        "an evaluation-only run trains nothing: trainable and local tensors select nothing in it",
    ),
];
