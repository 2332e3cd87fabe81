//! The quarantine rule: a device whose updates keep ending in rounds whose aggregate is refused
//! is not selected again in that run, so one device cannot stall a run round after round.
//!
//! The rule, exactly: each round the machine asked to commit whose aggregate was then refused
//! (a non-finite next model, an order statistic that could not be computed) gives every device
//! whose update (or partial) it held a strike; a committed round clears the strikes of every
//! device in it. A device with [`QUARANTINE_AFTER`] strikes is not selected in the run any more
//! (it is asked to come back later, like an ineligible device). Rounds that fail for other
//! reasons (too few devices, a secure round's dropouts) count neither way. An honest device
//! is quarantined only when it shared that many refused rounds in a row with no committed one
//! between; with random selection from a fleet that takes either a run that fails for every
//! cohort or a very small population.

use std::collections::BTreeMap;

use crate::ids::DeviceId;

/// Refused rounds in a row after which a device is not selected again in the run.
pub const QUARANTINE_AFTER: u32 = 3;

/// A run's strikes per device, as the rule above counts them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Strikes(BTreeMap<DeviceId, u32>);

impl Strikes {
    /// A round that held `devices`' updates ended: committed, or its aggregate refused.
    pub fn round_ended(&mut self, devices: impl IntoIterator<Item = DeviceId>, committed: bool) {
        for device in devices {
            if committed {
                self.0.remove(&device);
            } else {
                *self.0.entry(device).or_default() += 1;
            }
        }
    }

    /// A round that held `held`'s updates ended: committed, or its aggregate refused. A refusal
    /// traced to some of them (`refused_by`: updates far larger than the round's others)
    /// strikes those devices alone; one not traced (none of `refused_by` in the round) strikes
    /// every device of the round.
    pub fn round_ended_traced(
        &mut self,
        held: impl IntoIterator<Item = DeviceId>,
        committed: bool,
        refused_by: &[DeviceId],
    ) {
        let held: Vec<DeviceId> = held.into_iter().collect();
        let culprits: Vec<DeviceId> =
            held.iter().copied().filter(|d| refused_by.contains(d)).collect();
        match committed || culprits.is_empty() {
            true => self.round_ended(held, committed),
            false => self.round_ended(culprits, false),
        }
    }

    /// Whether `device` is quarantined.
    pub fn quarantines(&self, device: DeviceId) -> bool {
        self.0.get(&device).is_some_and(|&n| n >= QUARANTINE_AFTER)
    }

    /// Devices quarantined now.
    pub fn quarantined(&self) -> impl Iterator<Item = DeviceId> + '_ {
        self.0.iter().filter(|&(_, &n)| n >= QUARANTINE_AFTER).map(|(&d, _)| d)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refused_rounds_in_a_row_quarantine_and_a_commit_clears() {
        let (bad, honest) = (DeviceId(1), DeviceId(2));
        let mut s = Strikes::default();
        s.round_ended([bad, honest], false);
        s.round_ended([bad], false);
        // The honest device's next round commits: its strike is gone.
        s.round_ended([honest], true);
        assert!(!s.quarantines(bad));
        s.round_ended([bad, honest], false);
        assert!(s.quarantines(bad), "three refused rounds in a row");
        assert!(!s.quarantines(honest), "one refused round since its commit");
        assert_eq!(s.quarantined().collect::<Vec<_>>(), vec![bad]);
        // Quarantined for the run: not selected, so no commit clears it (but one would).
        s.round_ended([bad], true);
        assert!(!s.quarantines(bad));
    }
}
