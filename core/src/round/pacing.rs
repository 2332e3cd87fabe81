//! How a run paces its rounds: in lockstep ([`rounds`]) or as FedBuff's buffers
//! ([`buffered`]). The round machine does what both share (selection, uploads, persists,
//! commits) and asks its [`Pacing`] wherever the two differ: whom a round may still select,
//! when an open round closes, what an upload trained on an earlier model is worth, which
//! devices count as dropped and what carries over a commit.

mod buffered;
mod rounds;

use crate::fedavg::ValidatedUpdate;
use crate::ids::{DeviceId, Millis, ModelVersion, RoundIdx};
use crate::plan::RoundConfig;

use super::{ActiveRound, CarriedTask, Contribution, UploadRejection};
use buffered::Buffered;

/// A run's pacing, from its plan.
#[derive(Debug)]
pub(super) enum Pacing {
    /// Synchronous rounds: a cohort is selected, reports, and the round closes.
    Rounds,
    /// FedBuff: each round is one buffer of updates from devices training concurrently.
    Buffered(Buffered),
}

impl Pacing {
    /// The pacing `config` asks for; a buffered run takes back the devices still training on
    /// an earlier model (`carried`, from the store) whose tasks are live at `now`.
    pub(super) fn new(
        config: &RoundConfig,
        carried: Vec<CarriedTask>,
        now: Millis,
        model_version: ModelVersion,
    ) -> Self {
        match config.asynchronous {
            None => Pacing::Rounds,
            Some(settings) => Pacing::Buffered(Buffered::restore(
                settings,
                config.reporting_timeout_ms,
                carried,
                now,
                model_version,
            )),
        }
    }

    /// When selection of a round opened at `now` ends.
    pub(super) fn selection_deadline(&self, config: &RoundConfig, now: Millis) -> Millis {
        match self {
            Pacing::Rounds => now + config.selection_timeout_ms,
            // A buffer selects for as long as it is open.
            Pacing::Buffered(_) => now + config.reporting_timeout_ms,
        }
    }

    /// A task's reporting timeout from its own selection, where tasks do not all end with the
    /// round (a buffered run's).
    pub(super) fn task_ms(&self) -> Option<i64> {
        match self {
            Pacing::Rounds => None,
            Pacing::Buffered(b) => Some(b.task_ms()),
        }
    }

    /// Whether every eligible device that comes while there is room is selected (no lottery).
    pub(super) fn selects_whoever_comes(&self) -> bool {
        matches!(self, Pacing::Buffered(_))
    }

    /// Whether a check-in at `now` could be selected into `round`.
    pub(super) fn is_selecting(
        &self,
        round: Option<&ActiveRound>,
        config: &RoundConfig,
        now: Millis,
    ) -> bool {
        match self {
            Pacing::Rounds => round.is_some_and(|r| rounds::is_selecting(r, config, now)),
            Pacing::Buffered(b) => round.is_some_and(|r| b.is_selecting(r, now)),
        }
    }

    /// `device` checks in: a buffered run's device carried from an earlier round gives up
    /// that task unless its update is on its way.
    pub(super) fn on_check_in(&mut self, device: DeviceId, round: Option<&ActiveRound>) {
        if let Pacing::Buffered(b) = self {
            b.on_check_in(device, round);
        }
    }

    /// Decides on a payload for `round_idx` where the pacing has its own rule (a buffered
    /// run's carried devices and commits); `None` leaves it to the round.
    pub(super) fn admits_payload(
        &self,
        r: &ActiveRound,
        device: DeviceId,
        round_idx: RoundIdx,
        now: Millis,
    ) -> Option<Result<(), UploadRejection>> {
        match self {
            Pacing::Rounds => None,
            Pacing::Buffered(b) => b.admits_payload(r, device, round_idx, now),
        }
    }

    /// The model `device`'s upload to `round_idx` must have trained on, when that is not the
    /// open round's (a buffered run's carried device).
    pub(super) fn trained_on(&self, device: DeviceId, round_idx: RoundIdx) -> Option<ModelVersion> {
        match self {
            Pacing::Rounds => None,
            Pacing::Buffered(b) => b.trained_on(device, round_idx),
        }
    }

    /// What an accepted update `staleness` versions behind the open round brings to its sum.
    pub(super) fn contribution(&self, update: ValidatedUpdate, staleness: u32) -> Contribution {
        match self {
            Pacing::Buffered(b) if staleness > 0 => b.stale(update, staleness),
            _ => Contribution::Update(update),
        }
    }

    /// `devices`' updates are durable.
    pub(super) fn reported(&mut self, devices: &[DeviceId]) {
        if let Pacing::Buffered(b) = self {
            b.reported(devices);
        }
    }

    /// Moves an open round to `Closing` when its pacing says it is over at `now`.
    pub(super) fn close_when_due(
        &self,
        r: &mut ActiveRound,
        config: &RoundConfig,
        now: Millis,
        grace_ms: i64,
    ) {
        match self {
            Pacing::Rounds => rounds::close_when_due(r, config, now, grace_ms),
            Pacing::Buffered(_) => buffered::close_when_due(r, config, now),
        }
    }

    /// Whether a selected `device` that did not report counts as dropped when `r` closes at
    /// `now` (a buffered run's device within its task's deadline is carried, not dropped).
    pub(super) fn dropped(&self, r: &ActiveRound, device: DeviceId, now: Millis) -> bool {
        match self {
            Pacing::Rounds => true,
            Pacing::Buffered(b) => b.dropped(r, device, now),
        }
    }

    /// `r` ended, and the run's model is now `model_version`: a buffered run carries the
    /// round's devices still training into the next buffers.
    pub(super) fn round_ended(
        &mut self,
        r: &ActiveRound,
        now: Millis,
        model_version: ModelVersion,
    ) {
        if let Pacing::Buffered(b) = self {
            b.round_ended(r, now, model_version);
        }
    }
}
