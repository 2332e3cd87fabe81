//! The participation rule of a `blt_ftrl` run (`privacy::blt`): a device is selected at most
//! `max_participations` times in the run, and only once `min_separation` committed rounds have
//! passed since it was last selected. The ε such a run shows counts on it, with no sampling
//! assumed, so the coordinator enforces it, not the devices.
//!
//! Counted at selection, conservatively: a device selected in a round that then fails (or that
//! drops out) has used a participation, though nothing of it was released. Separation is in
//! committed rounds, the noise's steps: a round trains model version `v` and, if it commits,
//! is step `v` of the mechanism, so a device last selected on version `v` may be selected again
//! on `v + min_separation` or later. The selections are durable before a device hears of them
//! (`Action::PersistSelection`), and a restarted or new leader counts them again from the
//! store, so the rule holds across restarts and takeovers.

use std::collections::BTreeMap;

use crate::ids::{DeviceId, ModelVersion};
pub use crate::plan::ParticipationRule;

/// What the rule remembers of one device: how often it was selected and on which model
/// version last.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct History {
    /// Selections so far.
    pub count: u64,
    /// The model version the last one trained on.
    pub last: ModelVersion,
}

/// A run's selections per device, as the rule counts them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Participations(BTreeMap<DeviceId, History>);

impl Participations {
    /// The history of a run whose devices were selected as `selections` says: each device with
    /// its selection count and the latest model version it was selected on.
    pub fn from_history(selections: impl IntoIterator<Item = (DeviceId, History)>) -> Self {
        Participations(selections.into_iter().collect())
    }

    /// `device` was selected for a round on model `version`.
    pub fn selected(&mut self, device: DeviceId, version: ModelVersion) {
        let h = self.0.entry(device).or_insert(History { count: 0, last: version });
        h.count += 1;
        h.last = h.last.max(version);
    }

    /// Whether `rule` lets `device` be selected for a round on model `version`.
    pub fn admits(
        &self,
        rule: &ParticipationRule,
        device: DeviceId,
        version: ModelVersion,
    ) -> bool {
        match self.0.get(&device) {
            None => rule.max_participations > 0,
            Some(h) => {
                h.count < rule.max_participations
                    && version.0 - h.last.0 >= rule.min_separation as i64
            }
        }
    }

    /// `device`'s history, if it was ever selected.
    pub fn history(&self, device: DeviceId) -> Option<History> {
        self.0.get(&device).copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_device_waits_out_the_separation_and_stops_at_its_last_participation() {
        let rule = ParticipationRule { min_separation: 3, max_participations: 2 };
        let (d, mut p) = (DeviceId(7), Participations::default());
        assert!(p.admits(&rule, d, ModelVersion(0)));
        p.selected(d, ModelVersion(0));
        for v in 0..3 {
            assert!(!p.admits(&rule, d, ModelVersion(v)), "version {v}: too soon");
        }
        assert!(p.admits(&rule, d, ModelVersion(3)));
        p.selected(d, ModelVersion(4));
        assert!(!p.admits(&rule, d, ModelVersion(100)), "two participations used");
        assert!(p.admits(&rule, DeviceId(8), ModelVersion(1)), "another device");
        let restored = Participations::from_history([(d, p.history(d).unwrap())]);
        assert_eq!(restored, p);
    }
}
