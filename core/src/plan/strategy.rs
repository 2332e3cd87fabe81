//! The plan's `strategy` section and the bounds on what one update may weigh: how updates
//! become the next model (server optimizer, aggregation, norm bound) and what the coordinator
//! refuses on the way.

use super::{Plan, PlanError, field};

impl Plan {
    /// The norms an update and a next model may have.
    pub(super) fn check_update_limits(&self) -> Result<(), PlanError> {
        if self.max_update_norm.is_some_and(|n| !(n.is_finite() && n > 0.0 && n <= 1e12)) {
            return Err(field("max_update_norm", "must be in (0, 1e12]"));
        }
        if self.max_model_norm_growth.is_some_and(|g| !(g.is_finite() && (1.0..=1e12).contains(&g)))
        {
            return Err(field("max_model_norm_growth", "must be in [1, 1e12]"));
        }
        Ok(())
    }

    /// The server learning rate, optimizer, aggregation (for rounds of `quorum` reports) and
    /// norm bound.
    pub(super) fn check_strategy(&self, quorum: u32) -> Result<(), PlanError> {
        if !(self.server_learning_rate.is_finite() && self.server_learning_rate > 0.0) {
            return Err(field("server_learning_rate", "must be positive and finite"));
        }
        let strategy = &self.strategy;
        strategy.optimizer.check().map_err(|why| field("strategy.optimizer", why))?;
        if strategy.optimizer.is_stateful() && self.server_learning_rate != 1.0 {
            return Err(field(
                "server_learning_rate",
                "applies to FedAvg only; set the optimizer's own strategy.optimizer.lr",
            ));
        }
        strategy.aggregation.check(quorum).map_err(|why| field("strategy.aggregation", why))?;
        if let Some(bound) = strategy.norm_bound
            && !(bound.is_finite() && bound > 0.0 && bound <= 1e9)
        {
            return Err(field("strategy.norm_bound", "must be in (0, 1e9]"));
        }
        Ok(())
    }

    /// A plain run's cap on one device's example count.
    pub(super) fn check_max_examples(&self) -> Result<(), PlanError> {
        if let Some(max) = self.max_examples
            && (max == 0 || max > crate::fedavg::MAX_EXAMPLE_COUNT)
        {
            return Err(field(
                "max_examples",
                format!("must be in 1..={}", crate::fedavg::MAX_EXAMPLE_COUNT),
            ));
        }
        Ok(())
    }

    /// An order statistic holds every update of a round at close: the largest round must fit
    /// (a 200 000-device Krum plan would have needed ~320 GB).
    pub(super) fn check_aggregation_memory(&self, target_selected: u32) -> Result<(), PlanError> {
        self.strategy
            .aggregation
            .check_memory(target_selected)
            .map_err(|why| field("strategy.aggregation", why))
    }
}
