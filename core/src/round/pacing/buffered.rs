//! FedBuff's pacing: a round is one buffer. It selects whoever checks in while fewer than
//! `concurrency` devices train (its own unreported devices plus the *carried* ones), closes at
//! `cohort_size` durable updates or at its deadline, and when it closes its unreported devices
//! are carried into the next buffers with the model they train on. A carried device's upload
//! (naming its own round) is folded into the open buffer discounted by its staleness, while it
//! is at most `max_staleness` versions behind and its task's deadline has not passed; during a
//! commit it is told to retry (`Unavailable`). A restarted coordinator carries them again from
//! the store ([`RunSnapshot::carried`](super::super::RunSnapshot::carried)).

use std::collections::BTreeMap;

use crate::fedavg::ValidatedUpdate;
use crate::ids::{DeviceId, Millis, ModelVersion, RoundIdx};
use crate::plan::{AsynchronousPlan, RoundConfig};

use super::super::{ActiveRound, CarriedTask, Contribution, Phase, UploadRejection};

/// A buffered run's settings and the devices it carries.
#[derive(Debug)]
pub(in crate::round) struct Buffered {
    settings: AsynchronousPlan,
    /// Each task's reporting timeout, from its own selection.
    task_ms: i64,
    /// Devices still training on an earlier round's model, which may report into the open
    /// buffer while at most `max_staleness` versions behind.
    carried: BTreeMap<DeviceId, Carried>,
}

/// A device training on an earlier round's model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Carried {
    /// The round that selected it (its upload names this round).
    round_idx: RoundIdx,
    /// The model it trains on.
    model_version: ModelVersion,
    /// Its task's reporting deadline.
    deadline: Millis,
}

impl Buffered {
    /// The pacing of a run restored at `now` on `model_version`, carrying the stored tasks
    /// still live.
    pub(super) fn restore(
        settings: AsynchronousPlan,
        task_ms: i64,
        carried: Vec<CarriedTask>,
        now: Millis,
        model_version: ModelVersion,
    ) -> Self {
        let mut b = Buffered { settings, task_ms, carried: BTreeMap::new() };
        for t in carried {
            let c = Carried {
                round_idx: t.round_idx,
                model_version: t.model_version,
                deadline: t.selected_at + task_ms,
            };
            if b.live(&c, now, model_version) {
                b.carried.insert(t.device, c);
            }
        }
        b
    }

    /// Whether a carried task may still report at `now` into a buffer on `model_version`.
    fn live(&self, c: &Carried, now: Millis, model_version: ModelVersion) -> bool {
        let staleness = model_version.0 - c.model_version.0;
        now < c.deadline && (0..=i64::from(self.settings.max_staleness)).contains(&staleness)
    }

    pub(super) fn task_ms(&self) -> i64 {
        self.task_ms
    }

    /// Whether a check-in at `now` could be selected: the buffer is open and fewer than
    /// `concurrency` devices train.
    pub(super) fn is_selecting(&self, r: &ActiveRound, now: Millis) -> bool {
        r.phase == Phase::Open
            && now < r.opened.reporting_deadline
            && self.training(r, now) < self.settings.concurrency as usize
    }

    /// Devices training now: selected in the open buffer or carried from an earlier one, task
    /// not expired, no update durable or in flight.
    fn training(&self, r: &ActiveRound, now: Millis) -> usize {
        let fresh =
            r.selected.iter().filter(|d| !r.reported.contains(d) && !r.in_flight_for(**d)).count();
        let carried = self
            .carried
            .iter()
            .filter(|(d, c)| now < c.deadline && !r.reported.contains(d) && !r.in_flight_for(**d))
            .count();
        fresh + carried
    }

    /// A carried device checking in again gave up its task (or lost it): it may take a fresh
    /// one on the current model, and its old one no longer counts.
    pub(super) fn on_check_in(&mut self, device: DeviceId, round: Option<&ActiveRound>) {
        if !round.is_some_and(|r| r.in_flight_for(device)) {
            self.carried.remove(&device);
        }
    }

    /// A carried device's payload, and payloads that meet a commit; `None` for the rest.
    pub(super) fn admits_payload(
        &self,
        r: &ActiveRound,
        device: DeviceId,
        round_idx: RoundIdx,
        now: Millis,
    ) -> Option<Result<(), UploadRejection>> {
        if let Some(c) = self.carried.get(&device).filter(|c| c.round_idx == round_idx) {
            return Some(if now >= c.deadline {
                Err(UploadRejection::RoundClosed)
            } else if r.phase != Phase::Open {
                // The next buffer opens as soon as this one is committed.
                Err(UploadRejection::Unavailable)
            } else if r.reported.contains(&device) || r.in_flight_for(device) {
                Err(UploadRejection::Duplicate)
            } else {
                Ok(())
            });
        }
        if round_idx < r.opened.round_idx
            && (r.reported.contains(&device) || r.in_flight_for(device))
        {
            // A carried device's update is in (its answer may have been lost).
            return Some(Err(UploadRejection::Duplicate));
        }
        if round_idx == r.opened.round_idx && r.phase != Phase::Open && r.has_open_task(device) {
            // Its task carries over into the next buffer, which opens after this commit.
            return Some(Err(UploadRejection::Unavailable));
        }
        None
    }

    /// The model a carried device's upload to `round_idx` trained on.
    pub(super) fn trained_on(&self, device: DeviceId, round_idx: RoundIdx) -> Option<ModelVersion> {
        self.carried.get(&device).filter(|c| c.round_idx == round_idx).map(|c| c.model_version)
    }

    /// An update trained `staleness` versions behind, discounted by FedBuff's staleness weight.
    pub(super) fn stale(&self, update: ValidatedUpdate, staleness: u32) -> Contribution {
        let discount = self.settings.staleness_scale(staleness);
        Contribution::Stale { update, staleness, discount }
    }

    /// Durable updates end their devices' carried tasks.
    pub(super) fn reported(&mut self, devices: &[DeviceId]) {
        for d in devices {
            self.carried.remove(d);
        }
    }

    /// Whether selected `device`, silent when `r` closes at `now`, is dropped: only once its
    /// task's deadline passed (until then it is carried).
    pub(super) fn dropped(&self, r: &ActiveRound, device: DeviceId, now: Millis) -> bool {
        r.selected_at.get(&device).is_none_or(|at| at + self.task_ms <= now)
    }

    /// Carries `r`'s devices still training into the next buffers, then keeps the carried
    /// tasks that may still report into a buffer on `model_version`.
    pub(super) fn round_ended(
        &mut self,
        r: &ActiveRound,
        now: Millis,
        model_version: ModelVersion,
    ) {
        for &d in r.selected.iter().filter(|d| !r.reported.contains(d)) {
            let selected_at = r.selected_at.get(&d).copied().unwrap_or(r.opened.opened_at);
            let c = Carried {
                round_idx: r.opened.round_idx,
                model_version: r.opened.model_version,
                deadline: selected_at + self.task_ms,
            };
            self.carried.insert(d, c);
        }
        let carried = std::mem::take(&mut self.carried);
        self.carried =
            carried.into_iter().filter(|(_, c)| self.live(c, now, model_version)).collect();
    }
}

/// One buffer: it commits at `cohort_size` durable updates, or at its deadline with what it
/// has (at least the quorum).
pub(super) fn close_when_due(r: &mut ActiveRound, config: &RoundConfig, now: Millis) {
    if r.reported.len() >= config.cohort_size as usize || now >= r.opened.reporting_deadline {
        r.phase = Phase::Closing;
    }
}
