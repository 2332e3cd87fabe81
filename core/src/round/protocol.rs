//! The round machine's vocabulary: what the driver feeds it ([`Input`]), what it asks the
//! driver to do ([`Action`]), and the records both exchange (openings, closings, snapshots).

use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::secure::{self, Record, SecAggRejection};
use crate::fedavg::{ValidatedPartial, ValidatedUpdate};
use crate::ids::{AggregatorId, DeviceId, Millis, ModelVersion, RoundIdx, RunId};
use crate::plan::RoundConfig;
use crate::tier::{PartialReport, TierConfig};
use crate::wire::{SecAggInstruction, SecAggUpload, SecureAggregationTask};

/// Identifies one pending request between the driver and the machine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RequestId(pub u64);

/// Something that happened, fed to [`RunMachine::handle`].
#[derive(Debug, Clone, PartialEq)]
pub enum Input {
    /// An authenticated device of the run's population checked in.
    CheckIn {
        /// Request to answer.
        request: RequestId,
        /// The device.
        device: DeviceId,
        /// What it says about its conditions (the plan's eligibility is checked against it).
        attributes: crate::eligibility::DeviceAttributes,
        /// Devices heard from lately, an estimate of the population pace steering spreads.
        online: u32,
    },
    /// An authenticated device sent an update that passed validation.
    Upload {
        /// Request to answer.
        request: RequestId,
        /// The device.
        device: DeviceId,
        /// Round it uploads to.
        round_idx: RoundIdx,
        /// Model version the delta was computed on.
        model_version: ModelVersion,
        /// The update (its delta shared, not copied, on its way to the store and the sum).
        update: ValidatedUpdate,
    },
    /// The store finished (or failed) writing an update or a partial asked for by
    /// [`Action::PersistUpdate`] or [`Action::PersistPartial`].
    Persisted {
        /// The upload's (or partial's) request.
        request: RequestId,
        /// Whether the update is durable.
        ok: bool,
    },
    /// The driver durably recorded the outcome of [`Action::CloseRound`].
    RoundClosed {
        /// The round.
        round_idx: RoundIdx,
        /// Whether a new model version was committed; `false` for a failed round, and for a
        /// `Commit` the driver could not carry out (the aggregate was not finite).
        committed: bool,
        /// For a refused `Commit`: the devices whose updates the driver found caused it (far
        /// larger than the round's others); empty when it could not tell, and then every device
        /// of the round is struck ([`quarantine`](super::quarantine)).
        refused_by: Vec<DeviceId>,
    },
    /// A selected device's secure-aggregation message (secure runs only).
    SecAgg {
        /// Request to answer.
        request: RequestId,
        /// The device.
        device: DeviceId,
        /// Round it is for.
        round_idx: RoundIdx,
        /// The message.
        message: SecAggUpload,
    },
    /// A device asks what its secure round needs from it next.
    SecAggPoll {
        /// Request to answer.
        request: RequestId,
        /// The device.
        device: DeviceId,
        /// Round it asks about.
        round_idx: RoundIdx,
    },
    /// The run is to stop: asked by the operator (no reason), or by the coordinator, which
    /// says why (its privacy accounting or a round's close failed).
    Stop {
        /// Why the coordinator stopped it; `None` when the operator did.
        reason: Option<String>,
    },
    /// The set of live aggregators changed (or the tier's settings did).
    Aggregators {
        /// Aggregators that polled recently, in any order.
        live: Vec<AggregatorId>,
        /// When runs go through the tier.
        tier: TierConfig,
    },
    /// An aggregator reports the reduced updates of its (or its group's) devices; its sums
    /// passed validation against the round's schema.
    Partial {
        /// Request to answer.
        request: RequestId,
        /// Round it reports for.
        round_idx: RoundIdx,
        /// The report as received (model version, the aggregators and devices it speaks for;
        /// stored whole).
        report: Arc<PartialReport>,
        /// Its sums, validated against the round's schema.
        sums: Arc<ValidatedPartial>,
    },
}

/// What an accepted upload or partial brings to the round's sum, once it is durable.
#[derive(Clone, PartialEq)]
pub enum Contribution {
    /// A device's validated update.
    Update(ValidatedUpdate),
    /// An asynchronous run's update trained on a model `staleness` versions behind, folded
    /// scaled by `discount` ([`AsynchronousPlan::staleness_scale`](crate::plan::AsynchronousPlan::staleness_scale)).
    Stale {
        /// The update.
        update: ValidatedUpdate,
        /// Versions behind the round's model.
        staleness: u32,
        /// Its weight relative to a fresh update.
        discount: f64,
    },
    /// An aggregator's validated sums.
    Partial(Arc<ValidatedPartial>),
}

impl std::fmt::Debug for Contribution {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Contribution::Update(u) => write!(f, "Update({u:?})"),
            Contribution::Stale { update, staleness, discount } => {
                write!(f, "Stale({update:?}, staleness {staleness}, × {discount})")
            }
            Contribution::Partial(p) => write!(f, "Partial({p:?})"),
        }
    }
}

/// Something the driver must do, drained from [`RunMachine::poll_action`] in order.
///
/// Persist actions come before the replies that depend on them: the driver must make each
/// persist durable before sending any later reply.
#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    /// Persist a newly opened round.
    OpenRound(RoundOpened),
    /// Persist that `device` is selected for `round_idx`.
    PersistSelection {
        /// The round.
        round_idx: RoundIdx,
        /// The device.
        device: DeviceId,
        /// The aggregator it uploads to, when the round goes through the tier.
        aggregator: Option<AggregatorId>,
    },
    /// Answer a check-in.
    ReplyCheckIn {
        /// Request to answer.
        request: RequestId,
        /// The answer.
        decision: CheckInDecision,
    },
    /// Write an update to the store, then feed back [`Input::Persisted`].
    PersistUpdate {
        /// The upload's request.
        request: RequestId,
        /// The round.
        round_idx: RoundIdx,
        /// The device.
        device: DeviceId,
        /// Arrival order within the round; replay order after a restart.
        slot: i64,
        /// Versions behind the round's model it was trained on (0 but in asynchronous runs);
        /// a restart folds it with the same discount.
        staleness: u32,
        /// What to write.
        update: ValidatedUpdate,
    },
    /// Answer an upload.
    ReplyUpload {
        /// Request to answer.
        request: RequestId,
        /// Accepted, or why not.
        result: Result<(), UploadRejection>,
    },
    /// Write an aggregator's partial to the store, then feed back [`Input::Persisted`].
    PersistPartial {
        /// The partial's request.
        request: RequestId,
        /// The round.
        round_idx: RoundIdx,
        /// Arrival order within the round, shared with updates; replay order after a restart.
        slot: i64,
        /// What to write.
        report: Arc<PartialReport>,
    },
    /// Answer a partial report.
    ReplyPartial {
        /// Request to answer.
        request: RequestId,
        /// Accepted (durable), or why not.
        result: Result<(), UploadRejection>,
    },
    /// Fold an accepted update or partial into the round's sum, in slot order, as its write
    /// begins (the sum is only used once every write settled; see [`RoundSum`]).
    Fold(Contribution),
    /// Aggregate and commit, or record the failure; then feed back [`Input::RoundClosed`].
    CloseRound {
        /// What to record.
        closing: RoundClosing,
        /// Where the aggregate comes from.
        sum: RoundSum,
    },
    /// Persist a secure round's record (in the same batch as the transitions around it).
    PersistSecAgg {
        /// The round.
        round_idx: RoundIdx,
        /// Its position in the round's record log.
        seq: i64,
        /// The record.
        record: Record,
    },
    /// Answer a secure-aggregation message.
    ReplySecAgg {
        /// Request to answer.
        request: RequestId,
        /// Accepted, or why not.
        result: Result<(), SecAggRejection>,
    },
    /// Answer a secure-aggregation poll.
    ReplySecAggPoll {
        /// Request to answer.
        request: RequestId,
        /// What the device should do.
        result: Result<SecAggInstruction, SecAggRejection>,
    },
    /// Persist that the run committed all its rounds.
    FinishRun,
    /// Persist that the run was stopped; `open_round`, if any, is recorded as failed.
    StopRun {
        /// The round that was open.
        open_round: Option<RoundIdx>,
        /// Why the run stopped when the operator did not stop it.
        reason: Option<String>,
    },
}

/// A round as opened; persisted as the round's row.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RoundOpened {
    /// Round index within the run.
    pub round_idx: RoundIdx,
    /// Model version the round trains on.
    pub model_version: ModelVersion,
    /// When it opened.
    pub opened_at: Millis,
    /// End of selection.
    pub selection_deadline: Millis,
    /// Uploads after this are refused and the round closes.
    pub reporting_deadline: Millis,
}

/// The answer to a check-in.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum CheckInDecision {
    /// Train on `model_version` and upload to `round_idx` before `report_deadline`.
    Selected {
        /// The round.
        round_idx: RoundIdx,
        /// Model to train on.
        model_version: ModelVersion,
        /// Reporting deadline.
        report_deadline: Millis,
        /// The device's part in the round's secure aggregation, in secure runs.
        secure: Option<SecureAggregationTask>,
        /// The aggregator it uploads to, when the round goes through the tier.
        aggregator: Option<AggregatorId>,
    },
    /// Nothing now; try again after this long.
    ComeBackLater {
        /// Milliseconds to wait.
        after_ms: i64,
    },
}

/// Why an upload was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum UploadRejection {
    /// No such round (yet).
    UnknownRound,
    /// The round is closed or closing.
    RoundClosed,
    /// The device was not selected for the round.
    NotSelected,
    /// The device's update is already in (or on its way into) the round.
    Duplicate,
    /// The delta was computed on another model version.
    StaleModel {
        /// The round's model version.
        expected: ModelVersion,
    },
    /// The store could not make the update durable; nothing was acknowledged.
    Unavailable,
    /// The run aggregates securely: devices send masked inputs, never plain deltas.
    SecureRun,
    /// The device was assigned to an aggregator and must upload there.
    UseAggregator {
        /// Its aggregator.
        aggregator: AggregatorId,
    },
    /// A partial names a device that is not assigned to any of the aggregators it speaks for,
    /// or an aggregator with no devices in the round.
    NotAssigned,
}

/// Where a closing round's aggregate comes from.
#[derive(Debug, Clone, PartialEq)]
pub enum RoundSum {
    /// The folds: every contribution folded is durable.
    Folded,
    /// A contribution was folded as its write began and the write failed: the sum is rebuilt
    /// from the store's durable contributions, in slot order, as a restart would.
    Replayed,
    /// A secure round's checked unmasking. The driver unmasks it
    /// ([`SecureSum::finish`](super::secure::SecureSum::finish): the mean delta, no per-device
    /// metrics, and the survivors' pooled evaluation of the round's model version) off its
    /// task, since that is model-sized work.
    Secure(Box<super::secure::SecureSum>),
}

/// What [`Action::CloseRound`] asks the driver to record.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RoundClosing {
    /// The round.
    pub round_idx: RoundIdx,
    /// Model version it trained on.
    pub model_version: ModelVersion,
    /// Commit or fail.
    pub outcome: RoundOutcome,
    /// Devices selected.
    pub n_selected: u32,
    /// Durable updates, all folded.
    pub n_reported: u32,
    /// Selected devices that did not report.
    pub n_dropped: u32,
    /// When the round closed.
    pub closed_at: Millis,
}

/// How a round ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "outcome")]
pub enum RoundOutcome {
    /// Aggregate the folded updates and commit model version + 1.
    Commit,
    /// Too few devices checked in before the selection deadline.
    TooFewSelected {
        /// Devices selected.
        selected: u32,
        /// Quorum.
        quorum: u32,
    },
    /// A differentially private round drawing a fixed-size cohort measured fewer eligible
    /// devices in its selection window than the accountant's population: it selected no one
    /// and released nothing.
    PopulationTooSmall {
        /// Eligible devices that checked in during selection.
        measured: u32,
        /// The plan's population.
        minimum: u64,
    },
    /// Too few durable updates by the reporting deadline.
    TooFewReports {
        /// Durable updates.
        reported: u32,
        /// Quorum.
        quorum: u32,
    },
    /// Secure aggregation could not produce the sum (too few devices left at a stage, or
    /// inconsistent unmasking shares); nothing about any device's input was revealed.
    SecureAggregationFailed {
        /// The stage that failed.
        stage: secure::Stage,
        /// Masked inputs received.
        survivors: u32,
    },
    /// The round reached quorum but its aggregate was refused (a non-finite next model, an
    /// order statistic that could not be computed): nothing was committed.
    AggregateRejected,
}

impl RoundOutcome {
    /// A stable snake_case name, for metrics labels.
    pub fn label(&self) -> &'static str {
        match self {
            RoundOutcome::Commit => "committed",
            RoundOutcome::TooFewSelected { .. } => "too_few_selected",
            RoundOutcome::PopulationTooSmall { .. } => "population_too_small",
            RoundOutcome::TooFewReports { .. } => "too_few_reports",
            RoundOutcome::SecureAggregationFailed { .. } => "secure_aggregation_failed",
            RoundOutcome::AggregateRejected => "aggregate_rejected",
        }
    }
}

/// A run's durable state, from which a restarted coordinator rebuilds its machine.
#[derive(Debug, Clone, PartialEq)]
pub struct RunSnapshot {
    /// The run.
    pub run_id: RunId,
    /// Its pacing.
    pub config: RoundConfig,
    /// Latest committed model version.
    pub model_version: ModelVersion,
    /// Rounds committed so far.
    pub rounds_committed: u32,
    /// Index the next opened round gets.
    pub next_round_idx: RoundIdx,
    /// The round that was open, if any.
    pub open_round: Option<OpenRoundSnapshot>,
    /// Asynchronous runs: devices selected for an earlier round that have neither reported
    /// nor been selected again; those still within `max_staleness` and their deadline carry on.
    pub carried: Vec<CarriedTask>,
    /// Devices' strikes under the quarantine rule, from the run's closed rounds.
    pub strikes: super::quarantine::Strikes,
    /// Devices' selections, for a `blt_ftrl` run's participation rule (every round's,
    /// the open one's included); empty otherwise.
    pub participations: super::participation_rule::Participations,
}

/// An asynchronous run's device selected for a closed round and not heard from since, as the
/// store remembers it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CarriedTask {
    /// The device.
    pub device: DeviceId,
    /// The round that selected it.
    pub round_idx: RoundIdx,
    /// That round's model, which it trains on.
    pub model_version: ModelVersion,
    /// When it was selected.
    pub selected_at: Millis,
}

/// An open round's durable state.
#[derive(Debug, Clone, PartialEq)]
pub struct OpenRoundSnapshot {
    /// The round row.
    pub round: RoundOpened,
    /// Selected devices.
    pub selected: Vec<DeviceId>,
    /// Devices with a durable update, with their slots.
    pub reported: Vec<(DeviceId, i64)>,
    /// A secure round's records, in order (empty for plain runs).
    pub secure_records: Vec<Record>,
    /// Devices assigned to aggregators.
    pub assignments: Vec<(DeviceId, AggregatorId)>,
    /// Durable partials: slot, the aggregators and the devices each covers.
    pub partials: Vec<StoredPartial>,
}

/// A durable partial, as a restarted coordinator reads it back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredPartial {
    /// Its slot (shared with updates).
    pub slot: i64,
    /// The aggregators it speaks for.
    pub aggregators: Vec<AggregatorId>,
    /// The devices whose updates it sums.
    pub devices: Vec<DeviceId>,
}

/// An aggregator's view of its shard of an open round (see [`RunMachine::shard`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardView {
    /// The round.
    pub round: RoundOpened,
    /// Devices assigned to the aggregator.
    pub assigned: Vec<DeviceId>,
    /// Whether selection is over.
    pub selection_over: bool,
}

/// Where a run stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RunStatus {
    /// Rounds are being run.
    Running,
    /// A stop was asked while a round was committing; the run stops after it.
    Stopping,
    /// All rounds committed.
    Finished,
    /// Stopped by the operator.
    Stopped,
}
