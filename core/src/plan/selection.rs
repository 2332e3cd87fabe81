//! The plan's selection section: whom a run trains on (population, cohort, over-selection,
//! quorum, eligibility) and how long a round waits for them.

use super::{
    MAX_COHORT, MAX_RUN_NAME, Plan, PlanError, SelectionPolicy, field, secure_poisson_cap,
};

impl Plan {
    /// The run's name and population: bounded, so that no view or index holds a megabyte.
    pub(super) fn check_name_and_population(&self) -> Result<(), PlanError> {
        if self.population.is_empty() || self.population.len() > 128 {
            return Err(field("population", "must be 1..=128 bytes"));
        }
        if let Some(name) = self.name.as_ref().filter(|n| n.len() > MAX_RUN_NAME) {
            return Err(field(
                "name",
                format!("{} bytes is over the limit of {MAX_RUN_NAME}", name.len()),
            ));
        }
        Ok(())
    }

    /// Cohort, over-selection, quorum, timeouts, rounds and eligibility; the round's quorum.
    pub(super) fn check_selection(&self) -> Result<u32, PlanError> {
        if self.cohort_size == 0 || self.cohort_size > MAX_COHORT {
            return Err(field("cohort_size", format!("must be in 1..={MAX_COHORT}")));
        }
        if !(self.over_selection.is_finite() && (1.0..=10.0).contains(&self.over_selection)) {
            return Err(field("over_selection", "must be in 1.0..=10.0"));
        }
        let quorum = self.min_quorum.unwrap_or(self.cohort_size);
        if quorum == 0 || quorum > self.cohort_size {
            return Err(field("min_quorum", "must be in 1..=cohort_size"));
        }
        let secs_ok = |s: f64| s.is_finite() && (0.05..=86_400.0 * 7.0).contains(&s);
        if !secs_ok(self.selection_timeout_secs) {
            return Err(field("selection_timeout_secs", "must be in 0.05..=604800"));
        }
        if !secs_ok(self.reporting_timeout_secs)
            || self.reporting_timeout_secs < self.selection_timeout_secs
        {
            return Err(field(
                "reporting_timeout_secs",
                "must be in 0.05..=604800 and at least selection_timeout_secs",
            ));
        }
        if self.rounds == 0 {
            return Err(field("rounds", "must be at least 1"));
        }
        self.eligibility.check().map_err(|why| field("eligibility", why))?;
        Ok(quorum)
    }

    /// Devices a round selects: the over-selected cohort, or an asynchronous run's concurrency.
    pub(super) fn target_selected(&self) -> u32 {
        match &self.asynchronous {
            Some(a) => a.concurrency,
            None => ((f64::from(self.cohort_size) * self.over_selection).ceil() as u32)
                .max(self.cohort_size),
        }
    }

    /// The size a round's protocol is built for: the target, or a secure Poisson round's cap
    /// on its draw (the accountant's rate stays the expected cohort's).
    pub(super) fn protocol_size(&self, target_selected: u32) -> u32 {
        match (self.selection, &self.secure_aggregation) {
            (SelectionPolicy::Poisson, Some(_)) => secure_poisson_cap(target_selected),
            _ => target_selected,
        }
    }
}
