//! The plan's `secure_aggregation` section: SecAgg+'s neighbourhood, threshold, clipping and
//! stage timeouts for the cohort the plan selects, with the DP run's clip and noise folded in.

use crate::privacy::Privacy;

use super::{Plan, PlanError, SecureAggregationPlan, SecureRoundConfig, field};

impl Plan {
    /// The secure round's configuration for a protocol of `protocol_size` devices and updates
    /// of `n_params` values; `None` in a plain run.
    pub(super) fn resolve_secure(
        &self,
        protocol_size: u32,
        n_params: usize,
        privacy: Option<Privacy>,
    ) -> Result<Option<SecureRoundConfig>, PlanError> {
        let Some(s) = &self.secure_aggregation else { return Ok(None) };
        let resolved = s.resolve(protocol_size, n_params)?;
        let distributed = privacy.and_then(|p| p.distributed);
        Ok(Some(SecureRoundConfig {
            clip_norm: self.strategy.differential_privacy.map(|dp| dp.clip_norm),
            // The devices' noisy, rotated integers and nothing else: no weight (each weighs
            // one) and no evaluation (a DP run releases none).
            vector_len: distributed.map_or(resolved.vector_len, |d| d.padded_len()),
            distributed,
            evaluation_loss_cap: privacy
                .and_then(|p| p.plan.metrics.noised())
                .map(|m| m.loss_bound),
            ..resolved
        }))
    }
}

/// The most devices a secure round with Poisson selection holds when it expects `expected`: a
/// secure round's protocol has a fixed size, so the draw through it is capped, at the expected
/// cohort plus eight standard deviations and eight, which the binomial draw from the stated
/// population exceeds with probability below 1e-12. (A plain Poisson round has no cap.)
pub fn secure_poisson_cap(expected: u32) -> u32 {
    expected + (8.0 * f64::from(expected).sqrt()).ceil() as u32 + 8
}

/// Largest secure cohort: beyond it the quantizer keeps too few bits (and such cohorts belong
/// to the aggregator tier).
pub const MAX_SECURE_COHORT: u32 = 1 << 16;

impl SecureAggregationPlan {
    fn resolve(
        &self,
        target_selected: u32,
        n_params: usize,
    ) -> Result<SecureRoundConfig, PlanError> {
        let n = target_selected;
        if !(3..=MAX_SECURE_COHORT).contains(&n) {
            return Err(field(
                "secure_aggregation",
                format!(
                    "needs 3..={MAX_SECURE_COHORT} selected devices per round, the plan selects {n}"
                ),
            ));
        }
        if !(self.clip.is_finite() && self.clip > 0.0 && self.clip <= 1e6) {
            return Err(field("secure_aggregation.clip", "must be in (0, 1e6]"));
        }
        if self.max_examples == 0 || self.max_examples > crate::fedavg::MAX_EXAMPLE_COUNT {
            return Err(field(
                "secure_aggregation.max_examples",
                format!("must be in 1..={}", crate::fedavg::MAX_EXAMPLE_COUNT),
            ));
        }
        if !(self.stage_timeout_secs.is_finite()
            && (0.05..=86_400.0).contains(&self.stage_timeout_secs))
        {
            return Err(field("secure_aggregation.stage_timeout_secs", "must be in 0.05..=86400"));
        }
        let vector_len = n_params + 1 + crate::secagg::EVALUATION_ENTRIES;
        let mut config = crate::secagg::Config::with_defaults([0; 16], n, vector_len);
        if let Some(k) = self.neighbours {
            if k < 2 || k % 2 == 1 {
                return Err(field("secure_aggregation.neighbours", "must be even and at least 2"));
            }
            config.k = k.min(n - 1);
            config.t = config.k / 2 + 1;
        }
        config.validate().map_err(|e| field("secure_aggregation", e.to_string()))?;
        Ok(SecureRoundConfig {
            clip: self.clip,
            max_examples: self.max_examples,
            k: config.k,
            t: config.t,
            n_params,
            vector_len,
            stage_timeout_ms: (self.stage_timeout_secs * 1000.0).round() as i64,
            clip_norm: None,
            distributed: None,
            evaluation_loss_cap: None,
        })
    }
}
