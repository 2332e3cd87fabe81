//! Lockstep rounds: a round selects until its target or its selection deadline, fails at
//! that deadline with fewer than the quorum selected, and closes when `cohort_size` updates
//! are durable, when every selected device reported after selection ended, or at the reporting
//! deadline (a plain Poisson round has no target and no early close at `cohort_size`) (waiting up to the tier's grace for partials still missing). A secure round closes
//! when its protocol ends, with its checked sum.

use std::collections::BTreeSet;

use crate::ids::{DeviceId, Millis};
use crate::plan::RoundConfig;

use super::super::{ActiveRound, Phase, RoundOutcome, RoundSum};

/// Whether a check-in at `now` could be selected into `r`.
pub(super) fn is_selecting(r: &ActiveRound, config: &RoundConfig, now: Millis) -> bool {
    r.phase == Phase::Open
        && (r.selected.len() < config.target_selected as usize || !caps_cohort(config))
        && now < r.opened.selection_deadline
}

/// Whether the round's cohort stops at the target: selection at `target_selected`, and the
/// round at `cohort_size` updates. Not for Poisson selection outside secure aggregation: every
/// device that wins its draw during the window is in, and every update that arrives in time
/// counts, since a cap would let one device's presence push another out, which its add/remove
/// accountant does not cover. (A secure round's cohort is capped by its protocol's size; the
/// plan sizes it so that the cap binds with negligible probability.)
fn caps_cohort(config: &RoundConfig) -> bool {
    config.poisson_rate.is_none() || config.secure.is_some()
}

/// Moves the open round `r` to `Closing` when one of the rules above says it is over.
pub(super) fn close_when_due(
    r: &mut ActiveRound,
    config: &RoundConfig,
    now: Millis,
    grace_ms: i64,
) {
    let (n_selected, n_reported) = (r.selected.len(), r.reported.len());
    let selection_over = (caps_cohort(config) && n_selected >= config.target_selected as usize)
        || now >= r.opened.selection_deadline;
    if now >= r.opened.selection_deadline && n_selected < config.min_quorum as usize {
        r.early_failure = Some(RoundOutcome::TooFewSelected {
            selected: n_selected as u32,
            quorum: config.min_quorum,
        });
        r.phase = Phase::Closing;
    } else if let Some(s) = r.secure.as_mut() {
        s.progress(now, r.selection_ended);
        // Devices left out of the sum at the end of MaskedInputCollection (a neighbour could not
        // open their shares) do not count as reported.
        let counted: BTreeSet<DeviceId> = s.masked_devices().collect();
        r.reported.retain(|d| counted.contains(d));
        match s.outcome() {
            None => {}
            Some(Ok(())) => {
                // The round's close unmasks it.
                if let Some(sum) = s.take_sum() {
                    r.sum = RoundSum::Secure(Box::new(sum));
                }
                r.phase = Phase::Closing;
            }
            Some(Err(failure)) => {
                r.early_failure = Some(RoundOutcome::SecureAggregationFailed {
                    stage: failure.stage,
                    survivors: failure.survivors,
                });
                r.phase = Phase::Closing;
            }
        }
    } else if (caps_cohort(config) && n_reported >= config.cohort_size as usize)
        || (selection_over && n_reported == n_selected)
        || (now >= r.opened.reporting_deadline
            && (!r.shards_pending() || now >= r.opened.reporting_deadline + grace_ms))
    {
        r.phase = Phase::Closing;
    }
}
