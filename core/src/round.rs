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
//! ([`Input::Persisted`]).
//! Accepted updates are folded into the accumulator in slot order ([`Action::Fold`]) as their
//! writes begin, so that little is left to fold once the last one is durable; slot order is
//! also the order a restarted coordinator replays the stored ones in, so the committed model
//! does not depend on whether the coordinator restarted. If a folded update's write fails
//! (its device is told to retry), the round's sum is rebuilt from the store at closing
//! ([`RoundSum::Replayed`]): only durable updates ever reach a committed model.
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
//!
//! **Evaluation-only runs** go through the same states: their uploads carry metrics and an
//! example count but no delta (the driver validates them against an empty schema), and a
//! committed round records the pooled metrics without a new model version.
//!
//! **Pacing.** Where lockstep rounds and FedBuff's buffers differ (whom a round may still
//! select, when it closes, what an upload trained on an earlier model is worth, what carries
//! over a commit), the machine asks the run's [`pacing`]: each mode's rules are in their own
//! module. A secure round's checked sum travels in its [`Action::CloseRound`]
//! ([`RoundSum::Secure`]).

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use crate::fedavg::ValidatedUpdate;
use crate::ids::{AggregatorId, DeviceId, Millis, ModelVersion, RoundIdx, RunId};
use crate::plan::RoundConfig;
use crate::tier::TierConfig;
use crate::wire::{SecAggInstruction, SecAggUpload};

mod pacing;
pub mod participation_rule;
pub mod protocol;
pub mod quarantine;
pub mod secure;
mod tiered;

use pacing::Pacing;
pub use protocol::*;
use secure::{Record, SecAggRejection, SecureRound};

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
    /// Lockstep rounds or FedBuff's buffers, with what each keeps across rounds.
    pacing: Pacing,
    /// Strikes of devices whose updates ended in refused rounds ([`quarantine`]).
    strikes: quarantine::Strikes,
    /// Devices' selections, for a `blt_ftrl` run's rule ([`participation_rule`]).
    participations: participation_rule::Participations,
    /// Why the run is stopping, when the coordinator (not the operator) stopped it.
    stop_reason: Option<String>,
    /// Rounds failed since the last commit (counted from this machine's start).
    failed_in_a_row: u32,
    actions: VecDeque<Action>,
}

#[derive(Debug)]
struct ActiveRound {
    opened: RoundOpened,
    phase: Phase,
    selected: BTreeSet<DeviceId>,
    reported: BTreeSet<DeviceId>,
    /// Uploads and partials by slot whose write has not settled.
    in_flight: BTreeMap<i64, InFlight>,
    /// Whether the folds still make the round's sum (no folded contribution's write failed).
    sum: RoundSum,
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
    /// Devices the selection lottery has considered this round.
    considered: BTreeSet<DeviceId>,
    /// The lottery's draws (seeded from the driver's entropy and the round).
    lottery: crate::rng::SplitMix64,
    /// When each device was selected (an asynchronous run's task deadlines run from there).
    selected_at: BTreeMap<DeviceId, Millis>,
    /// A fixed-size DP draw: whether the cohort was drawn from `considered` yet.
    drawn: bool,
}

/// The selection lottery's generator for one round.
fn lottery_for(entropy: &[u8; 32], round_idx: RoundIdx) -> crate::rng::SplitMix64 {
    let seed = u64::from_le_bytes(entropy[..8].try_into().expect("8 bytes"));
    let mut rng = crate::rng::SplitMix64(seed ^ round_idx.0 as u64);
    rng.next_u64();
    rng
}

impl ActiveRound {
    /// Whether an eligible, unselected `device` checking in during selection is selected.
    ///
    /// `first_come` selects everyone until the target. `random` is selection sampling (Knuth's
    /// Algorithm S): with `online` devices around and `remaining` places, a device not yet
    /// considered is selected with probability `remaining / (online − considered)`, which draws
    /// a uniformly random cohort from the devices that check in, in whatever order they come
    /// (exactly so when each checks in once and `online` is right). In the second half of the
    /// selection window, and once every online device was considered, the cohort is filled
    /// with whoever checks in, so an overestimated `online` delays a round, never stalls it.
    /// `poisson` draws each device once per round, with the accountant's sampling rate. With
    /// `min_population` (random selection with DP) no device wins on arrival: see
    /// [`RunMachine::draw_cohort`].
    fn wins_draw(
        &mut self,
        device: DeviceId,
        online: u32,
        (config, pacing): (&RoundConfig, &Pacing),
        now: Millis,
    ) -> bool {
        // A buffered run selects whoever comes while there is room.
        if config.selection == crate::plan::SelectionPolicy::FirstCome
            || pacing.selects_whoever_comes()
        {
            return true;
        }
        if config.min_population.is_some() {
            // A fixed-size draw: every eligible device joins the measured population, and the
            // cohort is drawn from it when the selection window ends.
            self.considered.insert(device);
            return false;
        }
        if let Some(rate) = config.poisson_rate {
            // One independent draw per device and round, at the accountant's rate; no fill.
            return self.considered.insert(device) && self.lottery.unit() < rate;
        }
        let remaining = config.target_selected.saturating_sub(self.selected.len() as u32);
        let late = now - self.opened.opened_at >= config.selection_timeout_ms / 2;
        self.considered.insert(device);
        // This device and those not considered yet; never fewer than the places left.
        let unseen = online.saturating_sub(self.considered.len() as u32 - 1).max(remaining);
        late || self.lottery.unit() * f64::from(unseen) < f64::from(remaining)
    }
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
    /// An aggregator's partial, not a device's upload.
    partial: bool,
}

impl InFlight {
    /// The answer to its sender.
    fn reply(&self, result: Result<(), UploadRejection>) -> Action {
        let request = self.request;
        match self.partial {
            true => Action::ReplyPartial { request, result },
            false => Action::ReplyUpload { request, result },
        }
    }
}

/// How long a device that cannot be selected is asked to wait, at most and at least.
const MAX_BACKOFF_MS: i64 = 60_000;
const MIN_BACKOFF_MS: i64 = 1_000;

/// Pace steering: when a device that was not selected should come back.
#[derive(Debug, Clone, Copy)]
struct PaceSteering {
    target_selected: u32,
    selection_timeout_ms: i64,
    /// Devices heard from lately.
    online: u32,
    /// A DP run's selection is the accountant's only if every device of the population gets
    /// its chance each round (a fixed-size draw measures them all, Poisson sampling draws each
    /// one): every device comes back within the next window.
    everyone_each_window: bool,
}

impl PaceSteering {
    /// `base_ms` is the earliest the device could be useful (the next round's opening); on top
    /// of it each device gets its own jitter, spread over a window sized so that about twice
    /// the selection target of the online population returns per selection window. A large
    /// population is spread thin (and comes back less often), a small one returns soon, and
    /// devices that checked in together do not come back together. The jitter comes from
    /// `seed` (the device, run and time): reproducible, as everything of the machine.
    fn come_back_after(self, base_ms: i64, seed: u64) -> i64 {
        let per_window = match self.everyone_each_window {
            true => i64::from(self.online.max(1)),
            false => 2 * i64::from(self.target_selected.max(1)),
        };
        let spread = (i64::from(self.online) * self.selection_timeout_ms / per_window)
            .clamp(MIN_BACKOFF_MS, MAX_BACKOFF_MS);
        let jitter = (crate::rng::SplitMix64(seed).next_u64() % spread as u64) as i64;
        (base_ms.max(MIN_BACKOFF_MS) + jitter).min(MAX_BACKOFF_MS)
    }
}

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
                carried: vec![],
                strikes: Default::default(),
                participations: Default::default(),
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
        let pacing = Pacing::new(&snapshot.config, snapshot.carried, now, snapshot.model_version);
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
            pacing,
            strikes: snapshot.strikes,
            participations: snapshot.participations,
            stop_reason: None,
            failed_in_a_row: 0,
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
                // Selection times are not stored: a restart gives the open round's tasks a full
                // reporting timeout from now.
                let selected_at = open.selected.iter().map(|&d| (d, now)).collect();
                // A fixed-size DP draw's population is not stored: a round restored before its
                // draw measures again in what is left of its window (and most likely fails,
                // releasing nothing); one restored after it keeps its cohort.
                let drawn = !open.selected.is_empty();
                let mut round = ActiveRound {
                    opened: open.round,
                    phase: Phase::Open,
                    selected: open.selected.into_iter().collect(),
                    reported,
                    in_flight: BTreeMap::new(),
                    sum: RoundSum::Folded,
                    next_slot,
                    early_failure: None,
                    outcome: None,
                    selection_ended: None,
                    secure: None,
                    secure_seq: 0,
                    assigned: open.assignments.into_iter().collect(),
                    shards_reported,
                    considered: BTreeSet::new(),
                    lottery: lottery_for(&m.entropy, open.round.round_idx),
                    selected_at,
                    drawn,
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
            Some(Record::Begin { config }) => {
                round.secure_seq = 1;
                SecureRound::begin(
                    settings,
                    config,
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

    /// Devices this run no longer selects, by the [`quarantine`] rule.
    pub fn quarantined(&self) -> impl Iterator<Item = DeviceId> + '_ {
        self.strikes.quarantined()
    }

    /// The currently active round, if any.
    pub fn current_round(&self) -> Option<RoundOpened> {
        self.round.as_ref().map(|r| r.opened)
    }

    /// Whether a check-in at `now` could be selected (the driver uses this to pick among runs).
    pub fn is_selecting(&self, now: Millis) -> bool {
        self.pacing.is_selecting(self.round.as_ref(), &self.config, now)
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
            Input::CheckIn { request, device, attributes, online } => {
                self.on_check_in(request, device, &attributes, online)
            }
            Input::Upload { request, device, round_idx, model_version, update } => {
                self.on_upload(request, device, round_idx, model_version, update)
            }
            Input::Persisted { request, ok } => self.on_persisted(request, ok),
            Input::RoundClosed { round_idx, committed, refused_by } => {
                self.on_round_closed(round_idx, committed, refused_by)
            }
            Input::SecAgg { request, device, round_idx, message } => {
                self.on_secagg(request, device, round_idx, message)
            }
            Input::SecAggPoll { request, device, round_idx } => {
                self.on_secagg_poll(request, device, round_idx)
            }
            Input::Stop { reason } => self.on_stop(reason),
            Input::Aggregators { mut live, tier } => {
                live.sort();
                live.dedup();
                self.live_aggregators = live;
                self.tier = Some(tier);
            }
            Input::Partial { request, round_idx, report, sums } => {
                self.on_partial(request, round_idx, report, sums)
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

    /// The next action to execute.
    pub fn poll_action(&mut self) -> Option<Action> {
        self.actions.pop_front()
    }

    fn open_round(&mut self) {
        let now = self.now;
        let reporting_deadline = now + self.config.reporting_timeout_ms;
        let opened = RoundOpened {
            round_idx: self.next_round_idx,
            model_version: self.model_version,
            opened_at: now,
            selection_deadline: self.pacing.selection_deadline(&self.config, now),
            reporting_deadline,
        };
        self.next_round_idx = RoundIdx(self.next_round_idx.0 + 1);
        let mut round = ActiveRound {
            lottery: lottery_for(&self.entropy, opened.round_idx),
            considered: BTreeSet::new(),
            opened,
            phase: Phase::Open,
            selected: BTreeSet::new(),
            reported: BTreeSet::new(),
            in_flight: BTreeMap::new(),
            sum: RoundSum::Folded,
            next_slot: 0,
            early_failure: None,
            outcome: None,
            selection_ended: None,
            secure: None,
            secure_seq: 0,
            assigned: BTreeMap::new(),
            shards_reported: BTreeSet::new(),
            selected_at: BTreeMap::new(),
            drawn: false,
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

    fn on_check_in(
        &mut self,
        request: RequestId,
        device: DeviceId,
        attributes: &crate::eligibility::DeviceAttributes,
        online: u32,
    ) {
        let now = self.now;
        // A buffered run's task is due a reporting timeout after its own selection.
        let task_ms = self.pacing.task_ms();
        self.pacing.on_check_in(device, self.round.as_ref());
        let selecting = self.is_selecting(now);
        let eligible = self.config.eligibility.admits(attributes)
            && !self.strikes.quarantines(device)
            && self
                .config
                .participation_rule
                .is_none_or(|rule| self.participations.admits(&rule, device, self.model_version));
        let aggregator = self.aggregator_for(device);
        let steering = PaceSteering {
            target_selected: self.config.target_selected,
            selection_timeout_ms: self.config.selection_timeout_ms,
            online,
            everyone_each_window: self.config.min_population.is_some()
                || self.config.poisson_rate.is_some(),
        };
        let seed = (device.0 as u64).rotate_left(32) ^ (self.run_id.0 as u64) ^ now as u64;
        let pace = |base_ms: i64| steering.come_back_after(base_ms, seed);
        // The lottery draws only for an eligible device that could be selected now.
        let rules = (&self.config, &self.pacing);
        let wins_draw = match self.round.as_mut() {
            Some(r) if selecting && eligible && !r.has_task_for(device) => {
                r.selected.contains(&device) || r.wins_draw(device, online, rules, now)
            }
            _ => true,
        };
        let decision = match self.round.as_mut() {
            Some(r) if r.has_task_for(device) => r.selected_decision(device, task_ms),
            // Its conditions may change (it starts charging, reaches Wi-Fi): about one
            // selection window later.
            _ if !eligible => {
                CheckInDecision::ComeBackLater { after_ms: pace(steering.selection_timeout_ms) }
            }
            // A fixed-size DP draw: come back just after the window, to hear whether drawn.
            Some(r) if selecting && self.config.min_population.is_some() => {
                let jitter =
                    (crate::rng::SplitMix64(seed).next_u64() % MIN_BACKOFF_MS as u64) as i64;
                CheckInDecision::ComeBackLater {
                    after_ms: r.opened.selection_deadline - now + jitter,
                }
            }
            // Random selection: a device that loses the draw comes back for a later round (or
            // for the fill, late in the window).
            Some(r) if selecting && !r.selected.contains(&device) && !wins_draw => {
                CheckInDecision::ComeBackLater { after_ms: pace(steering.selection_timeout_ms / 2) }
            }
            // One update per device and round: in an asynchronous run a device that reported
            // into this buffer from an earlier one waits for the next.
            Some(r)
                if selecting
                    && !r.selected.contains(&device)
                    && !r.reported.contains(&device)
                    && !r.in_flight_for(device) =>
            {
                self.actions.push_back(r.select(device, aggregator, now));
                self.participations.selected(device, self.model_version);
                r.selected_decision(device, task_ms)
            }
            // Come back within one selection window (the next round may open as soon as this
            // one has its cohort), or at the deadline if that is sooner.
            Some(r) if r.phase == Phase::Open => CheckInDecision::ComeBackLater {
                after_ms: pace(
                    (r.opened.reporting_deadline - now).min(self.config.selection_timeout_ms),
                ),
            },
            Some(_) => CheckInDecision::ComeBackLater { after_ms: pace(MIN_BACKOFF_MS) },
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
        if let Some(verdict) = self.pacing.admits_payload(r, device, round_idx, now) {
            return verdict;
        }
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
        update: ValidatedUpdate,
    ) {
        let now = self.now;
        let admitted = self.admits_payload(device, round_idx, now, false);
        // A buffered run's device carried from an earlier round trained on that round's
        // model; it is folded into the open round, discounted by how far behind it is.
        let carried_on = self.pacing.trained_on(device, round_idx);
        let verdict = match admitted.map(|()| self.round.as_mut().expect("an admitting round")) {
            Err(rejection) => Err(rejection),
            Ok(r) if model_version != carried_on.unwrap_or(r.opened.model_version) => {
                let expected = carried_on.unwrap_or(r.opened.model_version);
                Err(UploadRejection::StaleModel { expected })
            }
            Ok(r) => {
                let slot = r.next_slot;
                r.next_slot += 1;
                let staleness = (r.opened.model_version.0 - model_version.0) as u32;
                let contribution = self.pacing.contribution(update.clone(), staleness);
                r.in_flight
                    .insert(slot, InFlight { request, devices: vec![device], partial: false });
                let round_idx = r.opened.round_idx;
                let persist =
                    Action::PersistUpdate { request, round_idx, device, slot, staleness, update };
                Ok((persist, contribution))
            }
        };
        match verdict {
            Ok((persist, contribution)) => self.persist_and_fold(persist, contribution),
            Err(rejection) => {
                self.actions.push_back(Action::ReplyUpload { request, result: Err(rejection) });
            }
        }
    }

    /// Queues an accepted contribution's write and, right behind it, its fold: folded while
    /// its write is under way, the fold of the cohort's last upload is all that is left when
    /// that is durable (a failed write makes the round replay its sum; see `on_persisted`).
    fn persist_and_fold(&mut self, persist: Action, contribution: Contribution) {
        self.actions.push_back(persist);
        self.actions.push_back(Action::Fold(contribution));
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
        let f = r.in_flight.remove(&slot).expect("slot just found");
        if ok {
            r.reported.extend(f.devices.iter().copied());
            self.pacing.reported(&f.devices);
            self.actions.push_back(f.reply(Ok(())));
        } else {
            // Folded already, and not durable: the round's sum comes from the store instead.
            r.sum = RoundSum::Replayed;
            if f.partial {
                // The aggregator may report again.
                for d in &f.devices {
                    if let Some(a) = r.assigned.get(d) {
                        r.shards_reported.remove(a);
                    }
                }
            }
            self.actions.push_back(f.reply(Err(UploadRejection::Unavailable)));
        }
    }

    fn on_round_closed(&mut self, round_idx: RoundIdx, committed: bool, refused_by: Vec<DeviceId>) {
        let Some(r) = self.round.as_ref() else { return };
        if r.phase != Phase::Committing || r.opened.round_idx != round_idx {
            return;
        }
        debug_assert!(!committed || r.outcome == Some(RoundOutcome::Commit));
        let asked_to_commit = r.outcome == Some(RoundOutcome::Commit);
        let committed = committed && asked_to_commit;
        if asked_to_commit {
            // Committed, or its aggregate refused: the quarantine rule counts both. A refusal
            // the driver traced to some updates strikes their devices alone.
            self.strikes.round_ended_traced(r.reported.iter().copied(), committed, &refused_by);
        }
        let Some(r) = self.round.take() else { return };
        if committed {
            // An evaluation-only round records its devices' metrics; the model stays.
            if !self.config.evaluation_only {
                self.model_version = ModelVersion(self.model_version.0 + 1);
            }
            self.rounds_committed += 1;
            self.failed_in_a_row = 0;
        } else {
            self.failed_in_a_row += 1;
        }
        // Devices still training on this round's model carry over to the next buffers.
        self.pacing.round_ended(&r, self.now, self.model_version);
        let limit = self.config.max_failed_rounds;
        let running = self.status == RunStatus::Running;
        if running && !committed && limit > 0 && self.failed_in_a_row >= limit {
            // A run that cannot progress stops, saying why, rather than fail rounds forever.
            let last = match r.outcome {
                Some(RoundOutcome::Commit) => RoundOutcome::AggregateRejected.label(),
                Some(outcome) => outcome.label(),
                None => "failed",
            };
            self.status = RunStatus::Stopped;
            let reason = format!(
                "{} rounds in a row failed (the last: {last}); the plan's max_failed_rounds is {limit}",
                self.failed_in_a_row
            );
            self.actions.push_back(Action::StopRun { open_round: None, reason: Some(reason) });
            return;
        }
        if self.status == RunStatus::Stopping {
            self.status = RunStatus::Stopped;
            let reason = self.stop_reason.take();
            self.actions.push_back(Action::StopRun { open_round: None, reason });
        } else if self.rounds_committed >= self.config.total_rounds {
            self.status = RunStatus::Finished;
            self.actions.push_back(Action::FinishRun);
        } else {
            self.open_round();
        }
    }

    fn on_stop(&mut self, reason: Option<String>) {
        match self.status {
            RunStatus::Finished | RunStatus::Stopped | RunStatus::Stopping => return,
            RunStatus::Running => {}
        }
        if self.round.as_ref().is_some_and(|r| r.phase == Phase::Committing) {
            self.status = RunStatus::Stopping;
            self.stop_reason = reason;
            return;
        }
        self.status = RunStatus::Stopped;
        let round = self.round.take();
        if let Some(r) = &round {
            for f in r.in_flight.values() {
                self.actions.push_back(f.reply(Err(UploadRejection::RoundClosed)));
            }
        }
        let open_round = round.map(|r| r.opened.round_idx);
        self.actions.push_back(Action::StopRun { open_round, reason });
    }

    fn check_progress(&mut self) {
        let now = self.now;
        let min_quorum = self.config.min_quorum;
        let grace_ms = self.report_grace_ms();
        self.draw_cohort();
        let Some(r) = self.round.as_mut() else { return };
        if r.phase == Phase::Open {
            let selection_over = r.selected.len() >= self.config.target_selected as usize
                || now >= r.opened.selection_deadline;
            if selection_over && r.selection_ended.is_none() {
                r.selection_ended = Some(now.min(r.opened.selection_deadline));
            }
            self.pacing.close_when_due(r, &self.config, now, grace_ms);
        }
        self.flush_secure();
        let Some(r) = self.round.as_mut() else { return };
        if r.phase == Phase::Closing && r.in_flight.is_empty() {
            r.phase = Phase::Committing;
            let n_selected = r.selected.len() as u32;
            let n_reported = r.reported.len() as u32;
            let outcome = match r.early_failure {
                Some(failure) => failure,
                None if n_reported >= min_quorum => RoundOutcome::Commit,
                None => RoundOutcome::TooFewReports { reported: n_reported, quorum: min_quorum },
            };
            r.outcome = Some(outcome);
            let closing = RoundClosing {
                round_idx: r.opened.round_idx,
                model_version: r.opened.model_version,
                outcome,
                n_selected,
                n_reported,
                // In a buffered run, devices of earlier rounds report too, and a device still
                // within its task's deadline is carried into the next buffer, not dropped.
                n_dropped: r
                    .selected
                    .iter()
                    .filter(|d| !r.reported.contains(d))
                    .filter(|&&d| self.pacing.dropped(r, d, now))
                    .count() as u32,
                closed_at: now,
            };
            let sum = std::mem::replace(&mut r.sum, RoundSum::Folded);
            self.actions.push_back(Action::CloseRound { closing, sum });
        }
    }
}

impl RunMachine {
    /// A fixed-size DP draw, once the selection window is over: the eligible devices that
    /// checked in during it are the round's measured population `N`; if `N` is at least the
    /// plan's population, `min(target, N)` of them are drawn uniformly without replacement
    /// (a partial Fisher–Yates shuffle over the round's lottery), otherwise no one is selected
    /// and the round fails, releasing nothing. The drawn devices were told to come back just
    /// after the window and find their task then.
    fn draw_cohort(&mut self) {
        let now = self.now;
        let Some(minimum) = self.config.min_population else { return };
        let target = self.config.target_selected as usize;
        let Some(r) = self.round.as_mut() else { return };
        if r.drawn || r.phase != Phase::Open || now < r.opened.selection_deadline {
            return;
        }
        r.drawn = true;
        let mut pool: Vec<DeviceId> = r.considered.iter().copied().collect();
        let measured = pool.len() as u32;
        if (pool.len() as u64) < minimum {
            r.early_failure = Some(RoundOutcome::PopulationTooSmall { measured, minimum });
            r.phase = Phase::Closing;
            return;
        }
        r.lottery.choose(&mut pool, target);
        // Fewer than the quorum can never commit (a blt_ftrl run, which needs no population,
        // may draw from fewer devices than that): the round fails now, not at its deadline.
        if (pool.len() as u32) < self.config.min_quorum {
            r.early_failure = Some(RoundOutcome::TooFewSelected {
                selected: pool.len() as u32,
                quorum: self.config.min_quorum,
            });
            r.phase = Phase::Closing;
            return;
        }
        let at = r.opened.selection_deadline;
        for device in pool {
            let aggregator = self.aggregator_for(device);
            let r = self.round.as_mut().expect("the round is open");
            let persist = r.select(device, aggregator, at);
            self.actions.push_back(persist);
            self.participations.selected(device, self.model_version);
        }
    }
}

impl ActiveRound {
    /// Selects `device` (through `aggregator`, if the tier takes its update); returns the
    /// action that persists the selection.
    fn select(
        &mut self,
        device: DeviceId,
        aggregator: Option<AggregatorId>,
        now: Millis,
    ) -> Action {
        self.selected.insert(device);
        self.selected_at.insert(device, now);
        if let Some(s) = self.secure.as_mut() {
            s.select(device);
        }
        if let Some(a) = aggregator {
            self.assigned.insert(device, a);
        }
        Action::PersistSelection { round_idx: self.opened.round_idx, device, aggregator }
    }

    /// The task `device` holds. With `task_ms` (an asynchronous run's reporting timeout) its
    /// deadline runs from its own selection, not the round's opening.
    fn selected_decision(&self, device: DeviceId, task_ms: Option<i64>) -> CheckInDecision {
        let report_deadline = match (task_ms, self.selected_at.get(&device)) {
            (Some(timeout), Some(&at)) => at + timeout,
            _ => self.opened.reporting_deadline,
        };
        CheckInDecision::Selected {
            round_idx: self.opened.round_idx,
            model_version: self.opened.model_version,
            report_deadline,
            secure: self.secure.as_ref().and_then(|s| s.task(device)),
            aggregator: self.assigned.get(&device).copied(),
        }
    }

    /// Whether an update or partial carrying `device` is on its way into the store.
    fn in_flight_for(&self, device: DeviceId) -> bool {
        self.in_flight.values().any(|f| f.devices.contains(&device))
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

    /// Whether `device` was selected here and has no update durable or in flight (whatever
    /// the phase).
    fn has_open_task(&self, device: DeviceId) -> bool {
        self.selected.contains(&device)
            && !self.reported.contains(&device)
            && !self.in_flight_for(device)
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
