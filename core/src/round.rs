//! The round state machine of one run: selection, reporting, closing, commit, next round.
//!
//! Sans-IO in quinn-proto's shape: the driver feeds [`Input`]s with the current time, calls
//! [`RunMachine::handle_timeout`] when [`RunMachine::poll_timeout`] says so, and executes the
//! [`Action`]s it drains from [`RunMachine::poll_action`].
//! The machine never waits on anything; the driver never decides anything.
//!
//! ```text
//!            open (persist round row)
//!   ┌──────────────────────────────────────────────────────────────┐
//!   ▼                                                              │
//! Open ── cohort reported / all selected reported / deadline ──▶ Closing
//!   │        (check-ins select until target or selection deadline)   │ in-flight persists settle
//!   │                                                                ▼
//!   └─ selection deadline with fewer than quorum selected ──▶ Closing ──▶ Committing
//!                                                                     │ RoundClosed
//!                                    next round, or FinishRun ◀───────┘
//! ```
//!
//! **Open.** Check-ins are selected while fewer than `target_selected` devices are and the
//! selection deadline has not passed; each selection is persisted before the device hears of
//! it.
//! A selected device that checks in again gets the same task (its answer may have been lost).
//! Uploads from selected devices are accepted from the moment of selection.
//!
//! **Uploads.** An accepted upload gets a *slot* (its arrival order) and an
//! [`Action::PersistUpdate`]; the device is answered only when the store confirms
//! ([`Input::UploadPersisted`]).
//! Persisted updates are folded into the accumulator in slot order ([`Action::FoldUpdate`]),
//! which is also the order a restarted coordinator replays them in, so the committed model does
//! not depend on whether the coordinator restarted.
//!
//! **Aggregator tier.** When the driver reports live aggregators ([`Input::Aggregators`]) and
//! a plain run selects more devices than the tier's threshold, each newly selected device is
//! assigned an aggregator ([`tier::assign`]) and must upload there. An aggregator's partial
//! ([`Input::Partial`]) takes a slot like an update and counts all its devices as reported.
//! At the reporting deadline the round waits up to the tier's grace for partials still
//! missing; an aggregator that never reports loses only its devices (they count as dropped).
//!
//! **Closing.** The round stops accepting uploads when `cohort_size` updates are durable, when
//! every selected device reported after selection ended, or at the reporting deadline.
//! It then waits for in-flight persists to settle and emits one [`Action::CloseRound`]:
//! commit if at least `min_quorum` updates are durable, else fail.
//!
//! **Committing.** The driver aggregates and commits (or records the failure) and answers
//! [`Input::RoundClosed`]; the machine then opens the next round, or finishes the run once
//! `total_rounds` rounds have committed. A failed round is simply followed by a fresh one on the
//! same model version: nothing ever waits on a dead client longer than the deadlines.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use serde::{Deserialize, Serialize};

use crate::fedavg::{Aggregate, PooledEvaluation};
use crate::ids::{AggregatorId, DeviceId, Millis, ModelVersion, RoundIdx, RunId};
use crate::plan::RoundConfig;
use crate::tier::{self, TierConfig};
use crate::wire::{SecAggInstruction, SecAggUpload, SecureAggregationTask};

pub mod secure;

use secure::{Record, SecAggRejection, SecureRound};

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
    },
    /// The store finished (or failed) writing an update or a partial asked for by
    /// [`Action::PersistUpdate`] or [`Action::PersistPartial`].
    UploadPersisted {
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
    /// The operator stopped the run.
    Stop,
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
        /// Model version its updates were computed on.
        model_version: ModelVersion,
        /// The aggregators it speaks for.
        aggregators: Vec<AggregatorId>,
        /// The devices whose updates are in the sums.
        devices: Vec<DeviceId>,
    },
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
    /// Write an update to the store, then feed back [`Input::UploadPersisted`].
    PersistUpdate {
        /// The upload's request (the driver holds its payload under this id).
        request: RequestId,
        /// The round.
        round_idx: RoundIdx,
        /// The device.
        device: DeviceId,
        /// Arrival order within the round; replay order after a restart.
        slot: i64,
    },
    /// Answer an upload.
    ReplyUpload {
        /// Request to answer.
        request: RequestId,
        /// Accepted, or why not.
        result: Result<(), UploadRejection>,
    },
    /// Write an aggregator's partial to the store, then feed back [`Input::UploadPersisted`].
    PersistPartial {
        /// The partial's request (the driver holds its sums under this id).
        request: RequestId,
        /// The round.
        round_idx: RoundIdx,
        /// Arrival order within the round, shared with updates; replay order after a restart.
        slot: i64,
    },
    /// Answer a partial report.
    ReplyPartial {
        /// Request to answer.
        request: RequestId,
        /// Accepted (durable), or why not.
        result: Result<(), UploadRejection>,
    },
    /// Fold the (persisted) update or partial of `request` into the round's accumulator, and
    /// drop its payload.
    FoldUpdate {
        /// The upload's request.
        request: RequestId,
    },
    /// Drop the payload of `request` without folding it.
    DropPayload {
        /// The upload's request.
        request: RequestId,
    },
    /// Aggregate and commit, or record the failure; then feed back [`Input::RoundClosed`].
    CloseRound(RoundClosing),
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
    /// The unmasked weighted mean of a secure round; the `CloseRound` that follows commits it.
    SecureAggregate {
        /// The round.
        round_idx: RoundIdx,
        /// The mean delta (no per-device metrics: they would leak individual information).
        aggregate: Aggregate,
        /// The survivors' pooled evaluation of the round's model version, decoded from the
        /// same sum (none when nobody evaluated); commit it with the round.
        evaluation: Option<PooledEvaluation>,
    },
    /// Persist that the run committed all its rounds.
    FinishRun,
    /// Persist that the run was stopped; `open_round`, if any, is recorded as failed.
    StopRun {
        /// The round that was open.
        open_round: Option<RoundIdx>,
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
}

impl RoundOutcome {
    /// A stable snake_case name, for metrics labels.
    pub fn label(&self) -> &'static str {
        match self {
            RoundOutcome::Commit => "committed",
            RoundOutcome::TooFewSelected { .. } => "too_few_selected",
            RoundOutcome::TooFewReports { .. } => "too_few_reports",
            RoundOutcome::SecureAggregationFailed { .. } => "secure_aggregation_failed",
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

/// The round state machine of one run.
#[derive(Debug)]
pub struct RunMachine {
    run_id: RunId,
    config: RoundConfig,
    model_version: ModelVersion,
    rounds_committed: u32,
    next_round_idx: RoundIdx,
    round: Option<ActiveRound>,
    status: RunStatus,
    now: Millis,
    /// Secret randomness from the driver; secure rounds derive their graph seeds from it.
    entropy: [u8; 32],
    /// The aggregator tier's settings, once the driver has told us of it.
    tier: Option<TierConfig>,
    /// Aggregators alive now, sorted.
    live_aggregators: Vec<AggregatorId>,
    actions: VecDeque<Action>,
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

#[derive(Debug)]
struct ActiveRound {
    opened: RoundOpened,
    phase: Phase,
    selected: BTreeSet<DeviceId>,
    reported: BTreeSet<DeviceId>,
    /// Uploads by slot that are not folded yet: persisting, or persisted behind an earlier slot.
    in_flight: BTreeMap<i64, InFlight>,
    next_slot: i64,
    early_failure: Option<RoundOutcome>,
    /// Set when the round enters `Committing`.
    outcome: Option<RoundOutcome>,
    /// When selection ended (target reached or deadline), once it has.
    selection_ended: Option<Millis>,
    /// The secure-aggregation protocol, in secure runs.
    secure: Option<SecureRound>,
    /// Records of `secure` persisted or queued so far.
    secure_seq: i64,
    /// Selected devices that upload through an aggregator.
    assigned: BTreeMap<DeviceId, AggregatorId>,
    /// Aggregators whose partial is durable or on its way.
    shards_reported: BTreeSet<AggregatorId>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Open,
    Closing,
    Committing,
}

#[derive(Debug)]
struct InFlight {
    request: RequestId,
    /// The devices whose update(s) it carries: one for an upload, a shard's for a partial.
    devices: Vec<DeviceId>,
    /// An aggregator's partial rather than a device's upload.
    partial: bool,
    persisted: bool,
}

/// How long a device that cannot be selected is asked to wait, at most and at least.
const MAX_BACKOFF_MS: i64 = 60_000;
const MIN_BACKOFF_MS: i64 = 1_000;

impl RunMachine {
    /// A fresh run at model version 0; opens its first round at `now`. `entropy` is 32 bytes
    /// from the OS, from which secure rounds draw their neighbour graphs.
    pub fn start(run_id: RunId, config: RoundConfig, now: Millis, entropy: [u8; 32]) -> Self {
        Self::restore(
            RunSnapshot {
                run_id,
                config,
                model_version: ModelVersion(0),
                rounds_committed: 0,
                next_round_idx: RoundIdx(0),
                open_round: None,
            },
            now,
            entropy,
        )
    }

    /// Rebuilds a run from its durable state; opens a round if none was open.
    ///
    /// The driver replays the stored updates of `open_round` into a fresh accumulator in slot
    /// order before handling new input; a secure round replays its records here.
    pub fn restore(snapshot: RunSnapshot, now: Millis, entropy: [u8; 32]) -> Self {
        let mut m = RunMachine {
            run_id: snapshot.run_id,
            config: snapshot.config,
            model_version: snapshot.model_version,
            rounds_committed: snapshot.rounds_committed,
            next_round_idx: snapshot.next_round_idx,
            round: None,
            status: RunStatus::Running,
            now,
            entropy,
            tier: None,
            live_aggregators: vec![],
            actions: VecDeque::new(),
        };
        if m.rounds_committed >= m.config.total_rounds {
            m.status = RunStatus::Finished;
            return m;
        }
        match snapshot.open_round {
            Some(open) => {
                let next_slot = open
                    .reported
                    .iter()
                    .map(|(_, s)| s + 1)
                    .chain(open.partials.iter().map(|p| p.slot + 1))
                    .max()
                    .unwrap_or(0);
                let mut reported: BTreeSet<DeviceId> =
                    open.reported.into_iter().map(|(d, _)| d).collect();
                let mut shards_reported = BTreeSet::new();
                for p in open.partials {
                    reported.extend(p.devices);
                    shards_reported.extend(p.aggregators);
                }
                let mut round = ActiveRound {
                    opened: open.round,
                    phase: Phase::Open,
                    selected: open.selected.into_iter().collect(),
                    reported,
                    in_flight: BTreeMap::new(),
                    next_slot,
                    early_failure: None,
                    outcome: None,
                    selection_ended: None,
                    secure: None,
                    secure_seq: 0,
                    assigned: open.assignments.into_iter().collect(),
                    shards_reported,
                };
                m.next_round_idx = RoundIdx(open.round.round_idx.0 + 1);
                m.restore_secure(&mut round, open.secure_records);
                m.round = Some(round);
                m.check_progress();
            }
            None => m.open_round(),
        }
        m
    }

    /// Rebuilds a secure round from its records (or begins it, if none were stored).
    fn restore_secure(&mut self, round: &mut ActiveRound, records: Vec<Record>) {
        let Some(settings) = self.config.secure else { return };
        let mut records = records.into_iter();
        let secure = match records.next() {
            Some(Record::Begin { config, graph_seed }) => {
                round.secure_seq = 1;
                SecureRound::begin(
                    settings,
                    config,
                    graph_seed,
                    self.config.min_quorum,
                    round.opened.model_version,
                    round.opened.reporting_deadline,
                )
                .map(|mut s| {
                    s.take_records();
                    s
                })
            }
            _ => self.begin_secure(&round.opened),
        };
        let Ok(mut secure) = secure else {
            // A stored config that no longer validates: the round fails rather than guessing.
            round.early_failure = Some(RoundOutcome::SecureAggregationFailed {
                stage: secure::Stage::AdvertiseKeys,
                survivors: 0,
            });
            round.phase = Phase::Closing;
            return;
        };
        for record in records {
            round.secure_seq += 1;
            secure.replay(record);
        }
        round.reported.extend(secure.masked_devices());
        round.secure = Some(secure);
    }

    fn begin_secure(
        &self,
        opened: &RoundOpened,
    ) -> Result<SecureRound, crate::secagg::SecAggError> {
        let settings = self.config.secure.expect("secure run");
        let session = secure::session_id(self.run_id, opened.round_idx, opened.model_version);
        let config = SecureRound::config_for(&settings, session, self.config.target_selected);
        SecureRound::begin(
            settings,
            config,
            secure::graph_seed(&self.entropy, self.run_id, opened.round_idx),
            self.config.min_quorum,
            opened.model_version,
            opened.reporting_deadline,
        )
    }

    /// The run.
    pub fn run_id(&self) -> RunId {
        self.run_id
    }

    /// Where the run stands.
    pub fn status(&self) -> RunStatus {
        self.status
    }

    /// Latest committed model version.
    pub fn model_version(&self) -> ModelVersion {
        self.model_version
    }

    /// Rounds committed.
    pub fn rounds_committed(&self) -> u32 {
        self.rounds_committed
    }

    /// The currently active round, if any.
    pub fn current_round(&self) -> Option<RoundOpened> {
        self.round.as_ref().map(|r| r.opened)
    }

    /// Whether a check-in at `now` could be selected (the driver uses this to pick among runs).
    pub fn is_selecting(&self, now: Millis) -> bool {
        self.round.as_ref().is_some_and(|r| {
            r.phase == Phase::Open
                && r.selected.len() < self.config.target_selected as usize
                && now < r.opened.selection_deadline
        })
    }

    /// Devices holding an unfinished task in the open round (selected, no update yet).
    pub fn participating(&self) -> usize {
        self.round.as_ref().map_or(0, |r| {
            if r.phase != Phase::Open {
                return 0;
            }
            r.selected.iter().filter(|d| !r.reported.contains(d) && !r.in_flight_for(**d)).count()
        })
    }

    /// Whether `device` holds an unfinished task in the open round: selected, and no update
    /// durable or in flight. A repeated check-in gets that task again (its answer may have been
    /// lost); a device that already reported is paced like any other.
    pub fn has_task_for(&self, device: DeviceId) -> bool {
        self.round.as_ref().is_some_and(|r| r.has_task_for(device))
    }

    /// Feeds one input.
    pub fn handle(&mut self, now: Millis, input: Input) {
        self.now = self.now.max(now);
        match input {
            Input::CheckIn { request, device } => self.on_check_in(request, device),
            Input::Upload { request, device, round_idx, model_version } => {
                self.on_upload(request, device, round_idx, model_version)
            }
            Input::UploadPersisted { request, ok } => self.on_persisted(request, ok),
            Input::RoundClosed { round_idx, committed } => {
                self.on_round_closed(round_idx, committed)
            }
            Input::SecAgg { request, device, round_idx, message } => {
                self.on_secagg(request, device, round_idx, message)
            }
            Input::SecAggPoll { request, device, round_idx } => {
                self.on_secagg_poll(request, device, round_idx)
            }
            Input::Stop => self.on_stop(),
            Input::Aggregators { mut live, tier } => {
                live.sort();
                live.dedup();
                self.live_aggregators = live;
                self.tier = Some(tier);
            }
            Input::Partial { request, round_idx, model_version, aggregators, devices } => {
                self.on_partial(request, round_idx, model_version, aggregators, devices)
            }
        }
        self.check_progress();
    }

    /// Advances time; call when [`RunMachine::poll_timeout`] has passed.
    pub fn handle_timeout(&mut self, now: Millis) {
        self.now = self.now.max(now);
        self.check_progress();
    }

    /// The next instant at which [`RunMachine::handle_timeout`] must be called.
    pub fn poll_timeout(&self) -> Option<Millis> {
        let r = self.round.as_ref()?;
        if r.phase != Phase::Open {
            return None;
        }
        let selection_pending = r.selected.len() < self.config.target_selected as usize;
        if selection_pending && self.now < r.opened.selection_deadline {
            Some(r.opened.selection_deadline)
        } else if let Some(s) = &r.secure {
            s.deadline()
        } else if self.now >= r.opened.reporting_deadline {
            // Only partials still pending keep the round open past its deadline.
            Some(r.opened.reporting_deadline + self.report_grace_ms())
        } else {
            Some(r.opened.reporting_deadline)
        }
    }

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

    fn report_grace_ms(&self) -> i64 {
        self.tier.map_or(0, |t| t.report_grace_ms)
    }

    /// The aggregator a newly selected device should upload to, if the run goes through the
    /// tier and an aggregator lives.
    fn aggregator_for(&self, device: DeviceId) -> Option<AggregatorId> {
        let tier = self.tier?;
        if self.config.secure.is_some() || self.config.target_selected <= tier.cohort_threshold {
            return None;
        }
        tier::assign(device, &self.live_aggregators)
    }

    /// The next action to execute.
    pub fn poll_action(&mut self) -> Option<Action> {
        self.actions.pop_front()
    }

    fn open_round(&mut self) {
        let now = self.now;
        let opened = RoundOpened {
            round_idx: self.next_round_idx,
            model_version: self.model_version,
            opened_at: now,
            selection_deadline: now + self.config.selection_timeout_ms,
            reporting_deadline: now + self.config.reporting_timeout_ms,
        };
        self.next_round_idx = RoundIdx(self.next_round_idx.0 + 1);
        let mut round = ActiveRound {
            opened,
            phase: Phase::Open,
            selected: BTreeSet::new(),
            reported: BTreeSet::new(),
            in_flight: BTreeMap::new(),
            next_slot: 0,
            early_failure: None,
            outcome: None,
            selection_ended: None,
            secure: None,
            secure_seq: 0,
            assigned: BTreeMap::new(),
            shards_reported: BTreeSet::new(),
        };
        self.actions.push_back(Action::OpenRound(opened));
        if self.config.secure.is_some() {
            // The plan validated this config; a failure here is a bug, and fails the round.
            match self.begin_secure(&opened) {
                Ok(s) => round.secure = Some(s),
                Err(_) => {
                    round.early_failure = Some(RoundOutcome::SecureAggregationFailed {
                        stage: secure::Stage::AdvertiseKeys,
                        survivors: 0,
                    });
                    round.phase = Phase::Closing;
                }
            }
        }
        self.round = Some(round);
        self.flush_secure();
    }

    /// Queues a persist action for each new record of the secure round.
    fn flush_secure(&mut self) {
        let Some(r) = self.round.as_mut() else { return };
        let Some(s) = r.secure.as_mut() else { return };
        for record in s.take_records() {
            self.actions.push_back(Action::PersistSecAgg {
                round_idx: r.opened.round_idx,
                seq: r.secure_seq,
                record,
            });
            r.secure_seq += 1;
        }
    }

    fn on_check_in(&mut self, request: RequestId, device: DeviceId) {
        let now = self.now;
        let selecting = self.is_selecting(now);
        let aggregator = self.aggregator_for(device);
        let decision = match self.round.as_mut() {
            Some(r) if r.has_task_for(device) => r.selected_decision(device),
            Some(r) if selecting && !r.selected.contains(&device) => {
                r.selected.insert(device);
                if let Some(s) = r.secure.as_mut() {
                    s.select(device);
                }
                if let Some(a) = aggregator {
                    r.assigned.insert(device, a);
                }
                let round_idx = r.opened.round_idx;
                self.actions.push_back(Action::PersistSelection { round_idx, device, aggregator });
                r.selected_decision(device)
            }
            // Come back within one selection window (the next round may open as soon as this
            // one has its cohort), or at the deadline if that is sooner.
            Some(r) if r.phase == Phase::Open => CheckInDecision::ComeBackLater {
                after_ms: (r.opened.reporting_deadline - now)
                    .min(self.config.selection_timeout_ms)
                    .clamp(MIN_BACKOFF_MS, MAX_BACKOFF_MS),
            },
            Some(_) => CheckInDecision::ComeBackLater { after_ms: MIN_BACKOFF_MS },
            None => CheckInDecision::ComeBackLater { after_ms: MAX_BACKOFF_MS },
        };
        self.actions.push_back(Action::ReplyCheckIn { request, decision });
    }

    /// Whether `device` may send a model-sized payload to `round_idx` at `now`: a plain upload,
    /// or with `secure` a secure round's message. The coordinator asks before it reads the
    /// body, so that a device that was not selected, or already reported, cannot hold one of
    /// the few upload slots while it trickles a body in. An upload is checked again when it
    /// arrives (the round may have moved on meanwhile).
    pub fn admits_payload(
        &self,
        device: DeviceId,
        round_idx: RoundIdx,
        now: Millis,
        secure: bool,
    ) -> Result<(), UploadRejection> {
        let r = match self.round.as_ref() {
            None if round_idx < self.next_round_idx => return Err(UploadRejection::RoundClosed),
            None => return Err(UploadRejection::UnknownRound),
            Some(r) => r,
        };
        // A secure round's later stages run past the reporting deadline.
        r.admits(device, round_idx, (!secure).then_some(now))?;
        if secure {
            Ok(())
        } else if r.secure.is_some() {
            Err(UploadRejection::SecureRun)
        } else if r.reported.contains(&device) || r.in_flight_for(device) {
            Err(UploadRejection::Duplicate)
        } else if let Some(&aggregator) = r.assigned.get(&device) {
            Err(UploadRejection::UseAggregator { aggregator })
        } else {
            Ok(())
        }
    }

    fn on_upload(
        &mut self,
        request: RequestId,
        device: DeviceId,
        round_idx: RoundIdx,
        model_version: ModelVersion,
    ) {
        let now = self.now;
        let admitted = self.admits_payload(device, round_idx, now, false);
        let verdict = match admitted.map(|()| self.round.as_mut().expect("an admitting round")) {
            Err(rejection) => Err(rejection),
            Ok(r) if model_version != r.opened.model_version => {
                Err(UploadRejection::StaleModel { expected: r.opened.model_version })
            }
            Ok(r) => {
                let slot = r.next_slot;
                r.next_slot += 1;
                r.in_flight.insert(
                    slot,
                    InFlight { request, devices: vec![device], partial: false, persisted: false },
                );
                Ok(Action::PersistUpdate { request, round_idx, device, slot })
            }
        };
        match verdict {
            Ok(persist) => self.actions.push_back(persist),
            Err(rejection) => {
                self.actions.push_back(Action::ReplyUpload { request, result: Err(rejection) });
                self.actions.push_back(Action::DropPayload { request });
            }
        }
    }

    fn on_partial(
        &mut self,
        request: RequestId,
        round_idx: RoundIdx,
        model_version: ModelVersion,
        aggregators: Vec<AggregatorId>,
        devices: Vec<DeviceId>,
    ) {
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
                r.in_flight
                    .insert(slot, InFlight { request, devices, partial: true, persisted: false });
                Ok(Action::PersistPartial { request, round_idx, slot })
            }
        };
        match verdict {
            Ok(persist) => self.actions.push_back(persist),
            Err(rejection) => {
                self.actions.push_back(Action::ReplyPartial { request, result: Err(rejection) });
                self.actions.push_back(Action::DropPayload { request });
            }
        }
    }

    fn on_secagg(
        &mut self,
        request: RequestId,
        device: DeviceId,
        round_idx: RoundIdx,
        message: SecAggUpload,
    ) {
        let result = match self.selected_round(device, round_idx) {
            Err(rejection) => Err(SecAggRejection::Round(rejection)),
            Ok(r) => match r.secure.as_mut() {
                None => {
                    Err(SecAggRejection::Invalid("the run does not use secure aggregation".into()))
                }
                Some(s) => {
                    let masked = matches!(message, SecAggUpload::MaskedInput { .. });
                    let res = s.receive(device, message);
                    if res.is_ok() && masked {
                        r.reported.insert(device);
                    }
                    res
                }
            },
        };
        self.actions.push_back(Action::ReplySecAgg { request, result });
    }

    fn on_secagg_poll(&mut self, request: RequestId, device: DeviceId, round_idx: RoundIdx) {
        let now = self.now;
        let result = match self.selected_round(device, round_idx) {
            Err(UploadRejection::RoundClosed) => {
                Ok(SecAggInstruction::Excluded { reason: format!("round {round_idx} is over") })
            }
            Err(rejection) => Err(SecAggRejection::Round(rejection)),
            Ok(r) => match r.secure.as_ref() {
                None => {
                    Err(SecAggRejection::Invalid("the run does not use secure aggregation".into()))
                }
                Some(s) => Ok(s.instruction(device, now)),
            },
        };
        self.actions.push_back(Action::ReplySecAggPoll { request, result });
    }

    /// The open round `round_idx` names, if `device` was selected for it; why not otherwise.
    /// A secure round's stages run past the reporting deadline, so it does not close the round
    /// here.
    fn selected_round(
        &mut self,
        device: DeviceId,
        round_idx: RoundIdx,
    ) -> Result<&mut ActiveRound, UploadRejection> {
        let next_round_idx = self.next_round_idx;
        match self.round.as_mut() {
            None if round_idx < next_round_idx => Err(UploadRejection::RoundClosed),
            None => Err(UploadRejection::UnknownRound),
            Some(r) => {
                r.admits(device, round_idx, None)?;
                Ok(r)
            }
        }
    }

    fn on_persisted(&mut self, request: RequestId, ok: bool) {
        let Some(r) = self.round.as_mut() else { return };
        let Some((&slot, _)) = r.in_flight.iter().find(|(_, f)| f.request == request) else {
            return;
        };
        let is_partial = r.in_flight[&slot].partial;
        let reply = |result| match is_partial {
            true => Action::ReplyPartial { request, result },
            false => Action::ReplyUpload { request, result },
        };
        if ok {
            let f = r.in_flight.get_mut(&slot).expect("slot just found");
            f.persisted = true;
            r.reported.extend(f.devices.iter().copied());
            self.actions.push_back(reply(Ok(())));
        } else {
            let f = r.in_flight.remove(&slot).expect("slot just found");
            if is_partial {
                // Not durable: the aggregator may report again.
                for d in &f.devices {
                    if let Some(a) = r.assigned.get(d) {
                        r.shards_reported.remove(a);
                    }
                }
            }
            self.actions.push_back(reply(Err(UploadRejection::Unavailable)));
            self.actions.push_back(Action::DropPayload { request });
        }
        // Fold in slot order: a persisted update waits behind any earlier one still in flight.
        while let Some(entry) = r.in_flight.first_entry() {
            if !entry.get().persisted {
                break;
            }
            let f = entry.remove();
            self.actions.push_back(Action::FoldUpdate { request: f.request });
        }
    }

    fn on_round_closed(&mut self, round_idx: RoundIdx, committed: bool) {
        let Some(r) = self.round.as_ref() else { return };
        if r.phase != Phase::Committing || r.opened.round_idx != round_idx {
            return;
        }
        debug_assert!(!committed || r.outcome == Some(RoundOutcome::Commit));
        let committed = committed && r.outcome == Some(RoundOutcome::Commit);
        self.round = None;
        if committed {
            self.model_version = ModelVersion(self.model_version.0 + 1);
            self.rounds_committed += 1;
        }
        if self.status == RunStatus::Stopping {
            self.status = RunStatus::Stopped;
            self.actions.push_back(Action::StopRun { open_round: None });
        } else if self.rounds_committed >= self.config.total_rounds {
            self.status = RunStatus::Finished;
            self.actions.push_back(Action::FinishRun);
        } else {
            self.open_round();
        }
    }

    fn on_stop(&mut self) {
        match self.status {
            RunStatus::Finished | RunStatus::Stopped | RunStatus::Stopping => return,
            RunStatus::Running => {}
        }
        if self.round.as_ref().is_some_and(|r| r.phase == Phase::Committing) {
            self.status = RunStatus::Stopping;
            return;
        }
        self.status = RunStatus::Stopped;
        let round = self.round.take();
        if let Some(r) = &round {
            for f in r.in_flight.values() {
                let result = Err(UploadRejection::RoundClosed);
                self.actions.push_back(match f.partial {
                    true => Action::ReplyPartial { request: f.request, result },
                    false => Action::ReplyUpload { request: f.request, result },
                });
                self.actions.push_back(Action::DropPayload { request: f.request });
            }
        }
        self.actions.push_back(Action::StopRun { open_round: round.map(|r| r.opened.round_idx) });
    }

    fn check_progress(&mut self) {
        let now = self.now;
        let cfg = self.config;
        let grace_ms = self.report_grace_ms();
        let Some(r) = self.round.as_mut() else { return };
        if r.phase == Phase::Open {
            let n_selected = r.selected.len();
            let n_reported = r.reported.len();
            let selection_over =
                n_selected >= cfg.target_selected as usize || now >= r.opened.selection_deadline;
            if selection_over && r.selection_ended.is_none() {
                r.selection_ended = Some(now.min(r.opened.selection_deadline));
            }
            if now >= r.opened.selection_deadline && n_selected < cfg.min_quorum as usize {
                r.early_failure = Some(RoundOutcome::TooFewSelected {
                    selected: n_selected as u32,
                    quorum: cfg.min_quorum,
                });
                r.phase = Phase::Closing;
            } else if let Some(s) = r.secure.as_mut() {
                s.progress(now, r.selection_ended);
                // Devices left out of the sum at the end of MaskedInputCollection (a neighbour
                // could not open their shares) do not count as reported.
                let counted: BTreeSet<DeviceId> = s.masked_devices().collect();
                r.reported.retain(|d| counted.contains(d));
                match s.outcome() {
                    None => {}
                    Some(Ok(aggregate)) => {
                        self.actions.push_back(Action::SecureAggregate {
                            round_idx: r.opened.round_idx,
                            aggregate: aggregate.clone(),
                            evaluation: s.evaluation().cloned(),
                        });
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
            } else if n_reported >= cfg.cohort_size as usize
                || (selection_over && n_reported == n_selected)
                || (now >= r.opened.reporting_deadline
                    && (!r.shards_pending() || now >= r.opened.reporting_deadline + grace_ms))
            {
                r.phase = Phase::Closing;
            }
        }
        self.flush_secure();
        let Some(r) = self.round.as_mut() else { return };
        if r.phase == Phase::Closing && r.in_flight.is_empty() {
            r.phase = Phase::Committing;
            let n_selected = r.selected.len() as u32;
            let n_reported = r.reported.len() as u32;
            let outcome = match r.early_failure {
                Some(failure) => failure,
                None if n_reported >= cfg.min_quorum => RoundOutcome::Commit,
                None => {
                    RoundOutcome::TooFewReports { reported: n_reported, quorum: cfg.min_quorum }
                }
            };
            r.outcome = Some(outcome);
            self.actions.push_back(Action::CloseRound(RoundClosing {
                round_idx: r.opened.round_idx,
                model_version: r.opened.model_version,
                outcome,
                n_selected,
                n_reported,
                n_dropped: n_selected - n_reported,
                closed_at: now,
            }));
        }
    }
}

impl ActiveRound {
    fn selected_decision(&self, device: DeviceId) -> CheckInDecision {
        CheckInDecision::Selected {
            round_idx: self.opened.round_idx,
            model_version: self.opened.model_version,
            report_deadline: self.opened.reporting_deadline,
            secure: self.secure.as_ref().and_then(|s| s.task(device)),
            aggregator: self.assigned.get(&device).copied(),
        }
    }

    /// Whether an update or partial carrying `device` is on its way into the store.
    fn in_flight_for(&self, device: DeviceId) -> bool {
        self.in_flight.values().any(|f| f.devices.contains(&device))
    }

    /// Whether an aggregator with devices in this round has not reported its partial yet.
    fn shards_pending(&self) -> bool {
        self.assigned.values().any(|a| !self.shards_reported.contains(a))
    }

    /// Which round `round_idx` names, relative to this one; `Ok` if it is this open round and
    /// `device` was selected for it. With `upload_time` (plain uploads), the round also counts
    /// as closed from its reporting deadline on.
    fn admits(
        &self,
        device: DeviceId,
        round_idx: RoundIdx,
        upload_time: Option<Millis>,
    ) -> Result<(), UploadRejection> {
        if round_idx < self.opened.round_idx {
            Err(UploadRejection::RoundClosed)
        } else if round_idx > self.opened.round_idx {
            Err(UploadRejection::UnknownRound)
        } else if self.phase != Phase::Open
            || upload_time.is_some_and(|now| now >= self.opened.reporting_deadline)
        {
            Err(UploadRejection::RoundClosed)
        } else if !self.selected.contains(&device) {
            Err(UploadRejection::NotSelected)
        } else {
            Ok(())
        }
    }

    fn has_task_for(&self, device: DeviceId) -> bool {
        self.phase == Phase::Open
            && self.selected.contains(&device)
            && !self.reported.contains(&device)
            && !self.in_flight_for(device)
    }
}

#[cfg(test)]
mod tests;
