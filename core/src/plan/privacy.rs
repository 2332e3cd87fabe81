//! The plan's `strategy.differential_privacy`: resolved into the accountant's sampling, noise
//! and the rounds its budget allows.

use crate::privacy::{Privacy, Sampling, Sizes};

use super::{Plan, PlanError, SelectionPolicy, field};

impl Plan {
    /// The run's privacy, for rounds that select `selected` devices through a protocol built
    /// for `protocol` and send updates of `n_params` values; `None` without DP.
    pub(super) fn resolve_privacy(
        &self,
        selected: u32,
        protocol: u32,
        n_params: usize,
    ) -> Result<Option<Privacy>, PlanError> {
        let Some(dp) = &self.strategy.differential_privacy else { return Ok(None) };
        let sampling = match self.selection {
            SelectionPolicy::Poisson => Sampling::Poisson,
            // first_come with DP is refused by the table of combinations.
            SelectionPolicy::Random | SelectionPolicy::FirstCome => Sampling::FixedSize,
        };
        let sizes = Sizes { selected, protocol, n_params };
        let privacy = dp.resolve(sizes, self.rounds, sampling).map_err(|(name, why)| {
            field("strategy.differential_privacy", format!("{name}: {why}"))
        })?;
        if privacy.distributed.is_some() && self.secure_aggregation.is_none() {
            return Err(field(
                "strategy.differential_privacy.noise",
                "distributed noise is added by each device before it masks its update: it needs secure_aggregation",
            ));
        }
        Ok(Some(privacy))
    }
}
