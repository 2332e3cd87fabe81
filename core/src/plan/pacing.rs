//! How a run's rounds are paced and when it stops: synchronous rounds or FedBuff's buffers,
//! checkpoints, the failed rounds it tolerates, and the `RoundConfig` the round machine runs.

use crate::privacy::{Privacy, Sampling};

use super::{
    DEFAULT_MAX_FAILED_ROUNDS, MAX_CHECKPOINT_INTERVAL, MAX_COHORT, ModelParts, Plan, PlanError,
    RoundConfig, SecureRoundConfig, SelectionPolicy, field,
};

impl Plan {
    /// The failed rounds in a row a run tolerates before it stops.
    pub(super) fn check_max_failed_rounds(&self) -> Result<(), PlanError> {
        if self.max_failed_rounds.is_some_and(|n| n > 1_000_000) {
            return Err(field("max_failed_rounds", "must be in 0..=1000000 (0: never stop)"));
        }
        Ok(())
    }

    /// FedBuff's concurrency and staleness, and the checkpoint interval.
    pub(super) fn check_pacing(&self) -> Result<(), PlanError> {
        if let Some(a) = &self.asynchronous {
            if a.concurrency < self.cohort_size || a.concurrency > MAX_COHORT * 10 {
                return Err(field(
                    "asynchronous.concurrency",
                    format!("must be in cohort_size..={}", MAX_COHORT * 10),
                ));
            }
            if a.max_staleness > 1000 {
                return Err(field("asynchronous.max_staleness", "must be at most 1000"));
            }
            if !(a.staleness_exponent.is_finite() && (0.0..=4.0).contains(&a.staleness_exponent)) {
                return Err(field("asynchronous.staleness_exponent", "must be in 0..=4"));
            }
        }
        if self.checkpoint_interval == 0 || self.checkpoint_interval > MAX_CHECKPOINT_INTERVAL {
            return Err(field(
                "checkpoint_interval",
                format!("must be in 1..={MAX_CHECKPOINT_INTERVAL}"),
            ));
        }
        Ok(())
    }

    /// What the round machine runs: the checked sections put together.
    pub(super) fn round_config(
        &self,
        quorum: u32,
        protocol_size: u32,
        privacy: Option<Privacy>,
        secure: Option<SecureRoundConfig>,
        parts: &ModelParts,
    ) -> Result<RoundConfig, PlanError> {
        let distributed = privacy.and_then(|p| p.distributed);
        let poisson_rate = match self.selection {
            SelectionPolicy::Poisson => Some(privacy.map(|p| p.sampling_rate).ok_or_else(|| {
                field(
                    "selection",
                    "poisson draws each device with differential_privacy's sampling rate: it needs differential_privacy",
                )
            })?),
            _ => None,
        };
        Ok(RoundConfig {
            cohort_size: self.cohort_size,
            target_selected: protocol_size,
            // With distributed noise a round needs the survivors whose noise it counts on.
            min_quorum: distributed.map_or(quorum, |d| quorum.max(d.min_survivors)),
            selection_timeout_ms: (self.selection_timeout_secs * 1000.0).round() as i64,
            reporting_timeout_ms: (self.reporting_timeout_secs * 1000.0).round() as i64,
            total_rounds: privacy.map_or(self.rounds, |p| p.rounds_allowed),
            secure,
            eligibility: self.eligibility.clone(),
            evaluation_only: self.evaluation_only,
            // FedBuff weighs each update by its staleness.
            // The aggregator tier folds whole models.
            each_update_direct: self.strategy.needs_each_update()
                || !parts.is_whole()
                || self.asynchronous.is_some(),
            selection: self.selection,
            poisson_rate,
            // A blt_ftrl run draws uniformly too, from whoever checked in: it needs no
            // population.
            min_population: privacy
                .filter(|p| p.sampling == Sampling::FixedSize)
                .map(|p| p.plan.population),
            asynchronous: self.asynchronous,
            max_failed_rounds: self.max_failed_rounds.unwrap_or(DEFAULT_MAX_FAILED_ROUNDS),
            participation_rule: privacy.and_then(|p| p.blt).map(|b| super::ParticipationRule {
                min_separation: b.schema.min_separation,
                max_participations: b.schema.max_participations,
            }),
        })
    }
}
