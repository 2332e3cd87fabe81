//! The aggregator tier inside the run machine: which aggregator a selected device uploads to,
//! an aggregator's view of its shard, and partial aggregates taking their slot in the round.

use std::sync::Arc;

use super::*;
use crate::fedavg::ValidatedPartial;
use crate::tier::{self, PartialReport};

impl RunMachine {
    /// The open round's shard assigned to `aggregator`, if it has devices in it and has not
    /// reported yet.
    pub fn shard(&self, aggregator: AggregatorId) -> Option<ShardView> {
        let r = self.round.as_ref()?;
        if r.phase != Phase::Open || r.shards_reported.contains(&aggregator) {
            return None;
        }
        let assigned: Vec<DeviceId> =
            r.assigned.iter().filter(|(_, a)| **a == aggregator).map(|(d, _)| *d).collect();
        if assigned.is_empty() {
            return None;
        }
        Some(ShardView { round: r.opened, assigned, selection_over: r.selection_ended.is_some() })
    }

    pub(super) fn report_grace_ms(&self) -> i64 {
        self.tier.map_or(0, |t| t.report_grace_ms)
    }

    /// The aggregator a newly selected device should upload to, if the run goes through the
    /// tier and an aggregator lives.
    pub(super) fn aggregator_for(&self, device: DeviceId) -> Option<AggregatorId> {
        let tier = self.tier?;
        // Secure rounds sum masked vectors, evaluation-only rounds no deltas, and a strategy
        // that bounds or ranks each update needs them one by one: none is for the tier.
        if self.config.secure.is_some()
            || self.config.evaluation_only
            || self.config.each_update_direct
            || self.config.target_selected <= tier.cohort_threshold
        {
            return None;
        }
        tier::assign(device, &self.live_aggregators)
    }

    pub(super) fn on_partial(
        &mut self,
        request: RequestId,
        round_idx: RoundIdx,
        report: Arc<PartialReport>,
        sums: Arc<ValidatedPartial>,
    ) {
        let (model_version, aggregators) = (report.model_version, &report.aggregators);
        let devices = &report.devices;
        let next_round_idx = self.next_round_idx;
        let verdict = match self.round.as_mut() {
            None if round_idx < next_round_idx => Err(UploadRejection::RoundClosed),
            None => Err(UploadRejection::UnknownRound),
            Some(r) if round_idx < r.opened.round_idx => Err(UploadRejection::RoundClosed),
            Some(r) if round_idx > r.opened.round_idx => Err(UploadRejection::UnknownRound),
            // Partials are welcome past the reporting deadline (within the grace): only the
            // phase closes the round to them.
            Some(r) if r.phase != Phase::Open => Err(UploadRejection::RoundClosed),
            Some(r) if model_version != r.opened.model_version => {
                Err(UploadRejection::StaleModel { expected: r.opened.model_version })
            }
            Some(r) if aggregators.iter().any(|a| r.shards_reported.contains(a)) => {
                Err(UploadRejection::Duplicate)
            }
            Some(r)
                if devices.iter().any(|d| {
                    !r.assigned.get(d).is_some_and(|a| aggregators.contains(a))
                        || r.reported.contains(d)
                }) || aggregators.iter().any(|a| !r.assigned.values().any(|x| x == a)) =>
            {
                Err(UploadRejection::NotAssigned)
            }
            Some(r) => {
                let slot = r.next_slot;
                r.next_slot += 1;
                r.shards_reported.extend(aggregators.iter().copied());
                let flight = InFlight { request, devices: devices.clone(), partial: true };
                r.in_flight.insert(slot, flight);
                let persist =
                    Action::PersistPartial { request, round_idx, slot, report: report.clone() };
                Ok((persist, Contribution::Partial(sums)))
            }
        };
        match verdict {
            Ok((persist, contribution)) => self.persist_and_fold(persist, contribution),
            Err(rejection) => {
                self.actions.push_back(Action::ReplyPartial { request, result: Err(rejection) });
            }
        }
    }
}

impl ActiveRound {
    /// Whether an aggregator with devices in this round has not reported its partial yet.
    pub(super) fn shards_pending(&self) -> bool {
        self.assigned.values().any(|a| !self.shards_reported.contains(a))
    }
}
