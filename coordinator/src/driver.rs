//! The one task that drives every run: it feeds events to the runs' state machines and executes
//! their actions.
//!
//! HTTP handlers never touch round state: they validate what they can alone (auth, CBOR,
//! schema, finiteness) and send an [`Event`] with a reply channel.
//! The driver owns the [`RunMachine`]s, and executes their actions with these rules:
//!
//! * Small transitions (round opened, device selected, run finished/stopped) produced while
//!   handling one batch of events go to the store in one transaction, before any reply of that
//!   batch is sent. A store failure is retried with backoff; replies wait (handlers time out
//!   with 503), so memory never runs ahead of the store in what devices are told.
//! * Update payloads are written by spawned tasks, concurrently, and come back as
//!   [`Internal::UpdatePersisted`]; only then is the device acknowledged.
//! * Folding happens on a per-run accumulator thread, fed in the machine's slot order.
//! * Closing a round (aggregate, apply, encode, commit) runs in a spawned task and comes back
//!   as [`Internal::RoundClosed`].
//!
//! On start, [`Driver::recover`] rebuilds every running run from the store: latest model,
//! open round, its selections, and its stored updates replayed in slot order.

use starling_core::codec;
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use starling_core::fedavg::{
    Aggregate, AggregateError, FedAvgAccumulator, PooledEvaluation, ValidatedPartial,
    ValidatedUpdate, validate_parts,
};
use starling_core::plan::{Plan, ValidatedPlan};
use starling_core::round::secure::{Record, SecAggRejection};
use starling_core::round::{
    Action, CheckInDecision, Input, OpenRoundSnapshot, RequestId, RoundClosing, RoundOutcome,
    RunMachine, RunSnapshot, RunStatus, UploadRejection,
};
use starling_core::tensor::{TensorPayload, TensorSchema};
use starling_core::tier::{AggregatorHello, AggregatorWork, PartialReport, ShardTask};
use starling_core::wire::{
    CheckInResponse, SecAggInstruction, SecAggUpload, TaskAssignment, UploadAck,
};
use starling_core::{DeviceId, Millis, ModelVersion, RoundIdx, RunId};
use tokio::sync::{mpsc, oneshot};

use crate::clock::now_ms;
use crate::observe::{Observer, POPULATION_SAMPLE_MS};
use crate::store::{NewRun, RoundCommit, SqlStore, StoreError, Transition};
use crate::tier::{AggregatorRegistry, TierSettings};

/// Why the driver refused a request; the HTTP edge maps each to a status and error code.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum DriverError {
    /// The run does not exist or is no longer driven.
    #[error("run {0} is not running")]
    RunNotRunning(RunId),
    /// The machine refused the upload.
    #[error("upload refused: {0:?}")]
    Upload(UploadRejection),
    /// The machine refused a secure-aggregation message or poll.
    #[error("secure aggregation refused: {0:?}")]
    SecAgg(SecAggRejection),
    /// The store failed; nothing was acknowledged.
    #[error("store unavailable")]
    Unavailable,
    /// The driver has shut down.
    #[error("coordinator is shutting down")]
    ShuttingDown,
    /// The aggregator tier is not configured on this coordinator.
    #[error("the aggregator tier is not configured")]
    TierOff,
}

impl From<UploadRejection> for DriverError {
    /// A store that could not make an update or partial durable is `Unavailable` (retry);
    /// every other refusal is the machine's.
    fn from(r: UploadRejection) -> Self {
        match r {
            UploadRejection::Unavailable => DriverError::Unavailable,
            r => DriverError::Upload(r),
        }
    }
}

/// A request from the HTTP edge.
#[derive(Debug)]
pub enum Event {
    /// A device checks in.
    CheckIn {
        /// The authenticated device.
        device: DeviceId,
        /// Its population.
        population: String,
        /// Where the answer goes.
        reply: oneshot::Sender<Result<CheckInResponse, DriverError>>,
    },
    /// Before reading a model-sized body: may this device send it (see
    /// [`RunMachine::admits_payload`])? Answered at once; changes nothing.
    AdmitPayload {
        /// The authenticated device.
        device: DeviceId,
        /// Run from the path.
        run_id: RunId,
        /// Round from the path.
        round_idx: RoundIdx,
        /// A secure round's message rather than a plain upload.
        secure: bool,
        /// Where the answer goes.
        reply: oneshot::Sender<Result<(), DriverError>>,
    },
    /// A device uploads a validated update.
    Upload {
        /// The authenticated device.
        device: DeviceId,
        /// Run from the path.
        run_id: RunId,
        /// Round from the path.
        round_idx: RoundIdx,
        /// Model version the delta was computed on.
        model_version: ModelVersion,
        /// The validated update.
        update: ValidatedUpdate,
        /// Where the answer goes.
        reply: oneshot::Sender<Result<UploadAck, DriverError>>,
    },
    /// A device's secure-aggregation message (size-checked and decoded).
    SecAgg {
        /// The authenticated device.
        device: DeviceId,
        /// Run from the path.
        run_id: RunId,
        /// Round from the path.
        round_idx: RoundIdx,
        /// The message.
        message: SecAggUpload,
        /// Where the answer goes (after the message is durable).
        reply: oneshot::Sender<Result<(), DriverError>>,
    },
    /// A device asks what its secure round needs next.
    SecAggPoll {
        /// The authenticated device.
        device: DeviceId,
        /// Run from the path.
        run_id: RunId,
        /// Round from the path.
        round_idx: RoundIdx,
        /// Where the answer goes.
        reply: oneshot::Sender<Result<SecAggInstruction, DriverError>>,
    },
    /// An aggregator polls: it is alive, and asks for its shards.
    AggregatorPoll {
        /// Who it is and where devices reach it.
        hello: AggregatorHello,
        /// Where the answer goes.
        reply: oneshot::Sender<Result<AggregatorWork, DriverError>>,
    },
    /// An aggregator reports a partial aggregate (validated against the round's schema).
    Partial {
        /// Run from the path.
        run_id: RunId,
        /// Round from the path.
        round_idx: RoundIdx,
        /// The report, as received (stored whole).
        report: Box<PartialReport>,
        /// Its sums, validated.
        sums: ValidatedPartial,
        /// Where the answer goes (after the partial is durable).
        reply: oneshot::Sender<Result<(), DriverError>>,
    },
    /// The operator creates a run.
    CreateRun {
        /// The plan.
        plan: Box<ValidatedPlan>,
        /// Model version 0.
        initial: InitialModel,
        /// Where the answer goes.
        reply: oneshot::Sender<Result<RunId, DriverError>>,
    },
    /// The operator stops a run.
    StopRun {
        /// The run.
        run_id: RunId,
        /// Where the answer goes.
        reply: oneshot::Sender<Result<(), DriverError>>,
    },
}

/// Model version 0, prepared off the driver task.
#[derive(Debug)]
pub struct InitialModel {
    /// Values in schema order.
    pub values: Vec<f32>,
    /// CBOR-encoded [`TensorPayload`], as stored and served.
    pub encoded: Vec<u8>,
    /// Content hash.
    pub hash: String,
}

impl InitialModel {
    /// Encodes `values` for `schema`.
    pub fn new(schema: &TensorSchema, values: Vec<f32>) -> Self {
        let (encoded, hash) = encode_model(schema, &values);
        InitialModel { values, encoded, hash }
    }
}

/// Results of work the driver spawned.
#[derive(Debug)]
enum Internal {
    UpdatePersisted {
        run_id: RunId,
        request: RequestId,
        ok: bool,
    },
    RoundClosed {
        run_id: RunId,
        round_idx: RoundIdx,
        committed: Option<CommittedModel>,
    },
    /// A spawned write was fenced off: another coordinator leads.
    Deposed,
}

#[derive(Debug)]
struct CommittedModel {
    values: Arc<Vec<f32>>,
    hash: String,
}

/// The handle HTTP handlers hold.
#[derive(Debug, Clone)]
pub struct DriverHandle {
    tx: mpsc::Sender<Event>,
}

impl DriverHandle {
    /// Sends an event and waits for its answer.
    pub async fn call<T>(
        &self,
        make: impl FnOnce(oneshot::Sender<Result<T, DriverError>>) -> Event,
    ) -> Result<T, DriverError> {
        let (reply, rx) = oneshot::channel();
        self.tx.send(make(reply)).await.map_err(|_| DriverError::ShuttingDown)?;
        match tokio::time::timeout(REPLY_TIMEOUT, rx).await {
            Ok(Ok(res)) => res,
            Ok(Err(_)) => Err(DriverError::ShuttingDown),
            Err(_) => Err(DriverError::Unavailable),
        }
    }
}

/// How long a handler waits for the driver (a stalled store makes it answer 503).
const REPLY_TIMEOUT: Duration = Duration::from_secs(60);
/// How many events the driver handles before it executes actions.
const MAX_BATCH: usize = 512;

/// The driver task's state.
pub struct Driver {
    store: SqlStore,
    observer: Observer,
    runs: BTreeMap<RunId, RunEntry>,
    /// The aggregator tier, when configured.
    tier: Option<AggregatorRegistry>,
    rx: mpsc::Receiver<Event>,
    internal_tx: mpsc::UnboundedSender<Internal>,
    internal_rx: mpsc::UnboundedReceiver<Internal>,
    next_request: u64,
    /// A write was fenced off: another coordinator leads, and this driver must stop.
    deposed: bool,
}

struct RunEntry {
    machine: RunMachine,
    plan: Arc<ValidatedPlan>,
    global: Arc<Vec<f32>>,
    model_hash: String,
    training_config: String,
    accumulator: AccumulatorWorker,
    /// Pending check-ins, with the device asking.
    check_ins:
        HashMap<RequestId, (DeviceId, oneshot::Sender<Result<CheckInResponse, DriverError>>)>,
    uploads: HashMap<RequestId, PendingUpload>,
    partials: HashMap<RequestId, PendingPartial>,
    secagg_messages: HashMap<RequestId, oneshot::Sender<Result<(), DriverError>>>,
    secagg_polls: HashMap<RequestId, oneshot::Sender<Result<SecAggInstruction, DriverError>>>,
    /// A secure round's unmasked mean and pooled evaluation, waiting for its `CloseRound`.
    secure_aggregate: Option<(Aggregate, Option<PooledEvaluation>)>,
    stops: Vec<oneshot::Sender<Result<(), DriverError>>>,
}

struct PendingPartial {
    reply: Option<oneshot::Sender<Result<(), DriverError>>>,
    report: Option<Box<PartialReport>>,
    sums: Option<ValidatedPartial>,
}

struct PendingUpload {
    round_idx: RoundIdx,
    reply: Option<oneshot::Sender<Result<UploadAck, DriverError>>>,
    update: Option<ValidatedUpdate>,
}

/// A deferred reply, sent after the batch's transitions are durable.
enum Reply {
    CheckIn(
        oneshot::Sender<Result<CheckInResponse, DriverError>>,
        Box<Result<CheckInResponse, DriverError>>,
    ),
    Upload(oneshot::Sender<Result<UploadAck, DriverError>>, Result<UploadAck, DriverError>),
    SecAgg(oneshot::Sender<Result<(), DriverError>>, Result<(), DriverError>),
    Partial(oneshot::Sender<Result<(), DriverError>>, Result<(), DriverError>),
    SecAggPoll(
        oneshot::Sender<Result<SecAggInstruction, DriverError>>,
        Result<SecAggInstruction, DriverError>,
    ),
}

impl Driver {
    /// Rebuilds every running run from the store and returns the driver and its handle.
    pub async fn recover(
        store: SqlStore,
        observer: Observer,
        tier: Option<TierSettings>,
    ) -> Result<(Driver, DriverHandle), StoreError> {
        let (tx, rx) = mpsc::channel(4096);
        let (internal_tx, internal_rx) = mpsc::unbounded_channel();
        let mut driver = Driver {
            store,
            observer,
            runs: BTreeMap::new(),
            tier: tier.map(AggregatorRegistry::new),
            rx,
            internal_tx,
            internal_rx,
            next_request: 0,
            deposed: false,
        };
        for row in driver.store.running_runs().await? {
            let run_id = RunId(row.id);
            let plan: Plan = serde_json::from_str(&row.plan_json)
                .map_err(|e| StoreError::Corrupt(format!("plan of run {run_id}: {e}")))?;
            let plan = plan
                .validate()
                .map_err(|e| StoreError::Corrupt(format!("plan of run {run_id}: {e}")))?;
            let version = ModelVersion(row.model_version);
            let encoded = driver.store.model(run_id, version).await?.ok_or_else(|| {
                StoreError::Corrupt(format!("run {run_id} lacks model {version}"))
            })?;
            let payload: TensorPayload = codec::decode(&encoded)
                .map_err(|e| StoreError::Corrupt(format!("model of run {run_id}: {e}")))?;
            let values = plan
                .schema()
                .decode_f32(&payload)
                .map_err(|e| StoreError::Corrupt(format!("model of run {run_id}: {e}")))?;
            let open = driver.store.open_round(run_id).await?;
            let next_round_idx = driver
                .store
                .last_round_idx(run_id)
                .await?
                .map_or(RoundIdx(0), |r| RoundIdx(r.0 + 1));
            let mut acc = FedAvgAccumulator::new(values.len());
            if let Some(open) = &open {
                let schema = plan.schema();
                // Partials and updates share the slot order: merge each partial before the
                // first update with a later slot.
                let mut partials = driver.store.partial_reports(run_id, open.round.round_idx).await?.into_iter().filter_map(|(slot, bytes)| {
                    match codec::decode::<PartialReport>(&bytes).map_err(|e| e.to_string()).and_then(|r| r.validate(schema).map_err(|e| e.to_string())) {
                        Ok(sums) => Some((slot, sums)),
                        Err(e) => {
                            tracing::error!(%run_id, slot, error = %e, "stored partial fails validation; not merged");
                            None
                        }
                    }
                }).peekable();
                let replayed = driver
                    .store
                    .for_each_update(run_id, open.round.round_idx, |u| {
                        while let Some((_, sums)) = partials.next_if(|(slot, _)| *slot < u.slot) {
                            acc.merge(&sums);
                        }
                        let metrics = serde_json::from_str(&u.metrics_json).unwrap_or_default();
                        match validate_parts(schema, u.delta, u.example_count as u64, metrics) {
                            Ok(update) => acc.add(&update),
                            // Validated before it was stored: only corruption gets here.
                            Err(e) => tracing::error!(%run_id, slot = u.slot, error = %e, "stored update fails validation; not folded"),
                        }
                        Ok(())
                    })
                    .await?;
                for (_, sums) in partials {
                    acc.merge(&sums);
                }
                tracing::info!(%run_id, round = %open.round.round_idx, replayed, selected = open.selected.len(), "resuming open round");
            }
            let snapshot = RunSnapshot {
                run_id,
                config: plan.round_config(),
                model_version: version,
                rounds_committed: row.rounds_committed as u32,
                next_round_idx,
                open_round: match open {
                    None => None,
                    Some(o) => Some(OpenRoundSnapshot {
                        round: o.round,
                        selected: o.selected,
                        reported: o.reported,
                        secure_records: o
                            .secure_records
                            .iter()
                            .map(|r| codec::decode::<Record>(r))
                            .collect::<Result<_, _>>()
                            .map_err(|e| {
                                StoreError::Corrupt(format!(
                                    "secure-aggregation record of run {run_id}: {e}"
                                ))
                            })?,
                        assignments: o.assignments,
                        partials: o.partials,
                    }),
                },
            };
            let mut machine = RunMachine::restore(snapshot, now_ms(), entropy());
            if let Some(input) = driver.tier_input() {
                machine.handle(now_ms(), input);
            }
            let entry = RunEntry::new(
                machine,
                Arc::new(plan),
                Arc::new(values),
                payload.content_hash(),
                acc,
            );
            driver.runs.insert(run_id, entry);
        }
        Ok((driver, DriverHandle { tx }))
    }

    /// Runs until every [`DriverHandle`] is dropped.
    pub async fn run(mut self) {
        // Recovered machines may already hold actions (e.g. a round whose deadline passed).
        self.execute_actions().await;
        let mut sample_population =
            tokio::time::interval(Duration::from_millis(POPULATION_SAMPLE_MS as u64));
        let mut expire_aggregators = tokio::time::interval(Duration::from_millis(500));
        loop {
            let sleep = match self.next_timeout() {
                Some(at) => Duration::from_millis((at - now_ms()).max(0) as u64),
                None => Duration::from_secs(3600),
            };
            tokio::select! {
                ev = self.rx.recv() => match ev {
                    Some(ev) => self.on_event(ev).await,
                    None => break,
                },
                Some(internal) = self.internal_rx.recv() => self.on_internal(internal),
                _ = sample_population.tick() => {
                    let participating =
                        self.runs.values().map(|e| e.machine.participating() as u64).sum();
                    self.observer.sample_population(now_ms(), participating);
                }
                _ = expire_aggregators.tick(), if self.tier.is_some() => self.expire_aggregators(),
                _ = tokio::time::sleep(sleep) => {}
            }
            for _ in 0..MAX_BATCH {
                if let Ok(internal) = self.internal_rx.try_recv() {
                    self.on_internal(internal);
                } else if let Ok(ev) = self.rx.try_recv() {
                    self.on_event(ev).await;
                } else {
                    break;
                }
            }
            let now = now_ms();
            for entry in self.runs.values_mut() {
                if entry.machine.poll_timeout().is_some_and(|t| t <= now) {
                    entry.machine.handle_timeout(now);
                }
            }
            self.execute_actions().await;
            if self.deposed {
                // Pending requests are answered 503 as their channels close.
                tracing::error!("another coordinator leads; the driver stops");
                break;
            }
        }
        tracing::info!("driver stopped");
    }

    /// What the run machines must hear about the tier now; `None` without a tier.
    fn tier_input(&self) -> Option<Input> {
        let tier = self.tier.as_ref()?;
        Some(Input::Aggregators { live: tier.live(), tier: tier.settings().config() })
    }

    fn announce_aggregators(&mut self) {
        let Some(input) = self.tier_input() else { return };
        let now = now_ms();
        for entry in self.runs.values_mut() {
            entry.machine.handle(now, input.clone());
        }
    }

    fn expire_aggregators(&mut self) {
        if self.tier.as_mut().is_some_and(|t| t.expire(std::time::Instant::now())) {
            self.announce_aggregators();
        }
    }

    fn aggregator_poll(&mut self, hello: AggregatorHello) -> Result<AggregatorWork, DriverError> {
        let tier = self.tier.as_mut().ok_or(DriverError::TierOff)?;
        let poll_after_ms = (tier.settings().liveness.as_millis() as u32 / 4).clamp(50, 1_000);
        if tier.seen(&hello, std::time::Instant::now()) {
            self.announce_aggregators();
        }
        let now = now_ms();
        let shards = self
            .runs
            .iter()
            .filter_map(|(&run_id, entry)| {
                let view = entry.machine.shard(hello.id)?;
                Some(ShardTask {
                    run_id,
                    round_idx: view.round.round_idx,
                    model_version: view.round.model_version,
                    schema: entry.plan.schema().clone(),
                    assigned: view.assigned,
                    selection_over: view.selection_over,
                    reporting_in_ms: view.round.reporting_deadline - now,
                    max_examples: entry.plan.max_examples(),
                })
            })
            .collect();
        Ok(AggregatorWork { shards, poll_after_ms })
    }

    fn next_timeout(&self) -> Option<Millis> {
        self.runs.values().filter_map(|e| e.machine.poll_timeout()).min()
    }

    fn request_id(&mut self) -> RequestId {
        self.next_request += 1;
        RequestId(self.next_request)
    }

    async fn on_event(&mut self, ev: Event) {
        let now = now_ms();
        match ev {
            Event::CheckIn { device, population, reply } => {
                let request = self.request_id();
                let candidates: Vec<RunId> = self
                    .runs
                    .iter()
                    .filter(|(_, e)| {
                        e.plan.plan().population == population
                            && e.machine.status() == RunStatus::Running
                    })
                    .map(|(id, _)| *id)
                    .collect();
                self.observer.device_seen(device.0, now, !candidates.is_empty());
                let chosen = candidates
                    .iter()
                    .find(|id| self.runs[id].machine.has_task_for(device))
                    .or_else(|| {
                        candidates.iter().find(|id| self.runs[id].machine.is_selecting(now))
                    })
                    .or(candidates.first());
                match chosen {
                    Some(run_id) => {
                        let entry = self.runs.get_mut(run_id).expect("candidate exists");
                        entry.check_ins.insert(request, (device, reply));
                        entry.machine.handle(now, Input::CheckIn { request, device });
                    }
                    None => {
                        let _ =
                            reply.send(Ok(CheckInResponse::ComeBackLater { retry_after_secs: 60 }));
                    }
                }
            }
            Event::AdmitPayload { device, run_id, round_idx, secure, reply } => {
                let res = match self.runs.get(&run_id) {
                    Some(entry) => entry
                        .machine
                        .admits_payload(device, round_idx, now, secure)
                        .map_err(DriverError::from),
                    None => Err(DriverError::RunNotRunning(run_id)),
                };
                let _ = reply.send(res);
            }
            Event::Upload { device, run_id, round_idx, model_version, update, reply } => {
                let request = self.request_id();
                self.observer.device_seen(device.0, now, true);
                let Some(entry) = self.runs.get_mut(&run_id) else {
                    let _ = reply.send(Err(DriverError::RunNotRunning(run_id)));
                    return;
                };
                entry.uploads.insert(
                    request,
                    PendingUpload { round_idx, reply: Some(reply), update: Some(update) },
                );
                entry
                    .machine
                    .handle(now, Input::Upload { request, device, round_idx, model_version });
            }
            Event::SecAgg { device, run_id, round_idx, message, reply } => {
                let request = self.request_id();
                self.observer.device_seen(device.0, now, true);
                let Some(entry) = self.runs.get_mut(&run_id) else {
                    let _ = reply.send(Err(DriverError::RunNotRunning(run_id)));
                    return;
                };
                entry.secagg_messages.insert(request, reply);
                entry.machine.handle(now, Input::SecAgg { request, device, round_idx, message });
            }
            Event::SecAggPoll { device, run_id, round_idx, reply } => {
                let request = self.request_id();
                let Some(entry) = self.runs.get_mut(&run_id) else {
                    let _ = reply.send(Err(DriverError::RunNotRunning(run_id)));
                    return;
                };
                entry.secagg_polls.insert(request, reply);
                entry.machine.handle(now, Input::SecAggPoll { request, device, round_idx });
            }
            Event::AggregatorPoll { hello, reply } => {
                let _ = reply.send(self.aggregator_poll(hello));
            }
            Event::Partial { run_id, round_idx, report, sums, reply } => {
                let request = self.request_id();
                let Some(entry) = self.runs.get_mut(&run_id) else {
                    let _ = reply.send(Err(DriverError::RunNotRunning(run_id)));
                    return;
                };
                let input = Input::Partial {
                    request,
                    round_idx,
                    model_version: report.model_version,
                    aggregators: report.aggregators.clone(),
                    devices: report.devices.clone(),
                };
                entry.partials.insert(
                    request,
                    PendingPartial { reply: Some(reply), report: Some(report), sums: Some(sums) },
                );
                entry.machine.handle(now, input);
            }
            Event::CreateRun { plan, initial, reply } => {
                let res = self.create_run(*plan, initial, now).await;
                let _ = reply.send(res);
            }
            Event::StopRun { run_id, reply } => match self.runs.get_mut(&run_id) {
                Some(entry) => {
                    entry.stops.push(reply);
                    entry.machine.handle(now, Input::Stop);
                }
                None => {
                    let _ = reply.send(Err(DriverError::RunNotRunning(run_id)));
                }
            },
        }
    }

    async fn create_run(
        &mut self,
        plan: ValidatedPlan,
        initial: InitialModel,
        now: Millis,
    ) -> Result<RunId, DriverError> {
        let plan_json = serde_json::to_string(plan.plan()).expect("plan serializes");
        let run_id = self
            .store
            .create_run(
                NewRun {
                    name: plan.plan().name.as_deref(),
                    population: &plan.plan().population,
                    plan_json: &plan_json,
                    initial_model: &initial.encoded,
                    initial_model_hash: &initial.hash,
                },
                now,
            )
            .await
            .map_err(|e| {
                tracing::error!(error = %e, "creating run failed");
                DriverError::Unavailable
            })?;
        let mut machine = RunMachine::start(run_id, plan.round_config(), now, entropy());
        if let Some(input) = self.tier_input() {
            machine.handle(now, input);
        }
        let acc = FedAvgAccumulator::new(initial.values.len());
        let entry =
            RunEntry::new(machine, Arc::new(plan), Arc::new(initial.values), initial.hash, acc);
        self.runs.insert(run_id, entry);
        self.observer.run_state(run_id, "running");
        tracing::info!(%run_id, "run created");
        Ok(run_id)
    }

    fn on_internal(&mut self, internal: Internal) {
        let now = now_ms();
        match internal {
            Internal::Deposed => self.deposed = true,
            Internal::UpdatePersisted { run_id, request, ok } => {
                if let Some(entry) = self.runs.get_mut(&run_id) {
                    entry.machine.handle(now, Input::UploadPersisted { request, ok });
                }
            }
            Internal::RoundClosed { run_id, round_idx, committed } => {
                if let Some(entry) = self.runs.get_mut(&run_id) {
                    let was_committed = committed.is_some();
                    if let Some(model) = committed {
                        entry.global = model.values;
                        entry.model_hash = model.hash;
                    }
                    entry
                        .machine
                        .handle(now, Input::RoundClosed { round_idx, committed: was_committed });
                }
            }
        }
    }

    /// Drains every machine's actions and executes them (see the module doc for the rules).
    async fn execute_actions(&mut self) {
        let now = now_ms();
        let mut finished = vec![];
        for (&run_id, entry) in self.runs.iter_mut() {
            let mut transitions = vec![];
            let mut replies = vec![];
            let mut close_tasks = vec![];
            while let Some(action) = entry.machine.poll_action() {
                match action {
                    Action::OpenRound(opened) => {
                        tracing::info!(%run_id, round = %opened.round_idx, model_version = %opened.model_version, "round opened");
                        entry.accumulator.reset(entry.global.len());
                        self.observer.round_opened(run_id, opened.round_idx);
                        transitions.push(Transition::OpenRound(opened));
                    }
                    Action::PersistSelection { round_idx, device, aggregator } => {
                        self.observer.selected();
                        transitions.push(Transition::Select { round_idx, device, aggregator });
                    }
                    Action::PersistPartial { request, round_idx, slot } => {
                        let Some(report) =
                            entry.partials.get_mut(&request).and_then(|p| p.report.take())
                        else {
                            continue;
                        };
                        let store = self.store.clone();
                        let (aggregators, devices) =
                            (report.aggregators.clone(), report.devices.len());
                        persist_in_background(
                            &self.internal_tx,
                            &self.observer,
                            (run_id, request),
                            "insert_partial",
                            async move {
                                store
                                    .insert_partial(run_id, round_idx, slot, &report, now_ms())
                                    .await
                            },
                            move |res, _| match res {
                                Ok(()) => {
                                    tracing::info!(%run_id, round = %round_idx, ?aggregators, devices, "partial persisted")
                                }
                                Err(e) => {
                                    tracing::warn!(%run_id, round = %round_idx, error = %e, "partial not persisted")
                                }
                            },
                        );
                    }
                    Action::ReplyPartial { request, result } => {
                        let Some(p) = entry.partials.get_mut(&request) else { continue };
                        if let Some(tx) = p.reply.take() {
                            replies.push(Reply::Partial(tx, result.map_err(DriverError::from)));
                        }
                        entry.forget_if_done(request);
                    }
                    Action::PersistSecAgg { round_idx, seq, record } => {
                        let record = codec::to_vec(&record).expect("records encode");
                        transitions.push(Transition::SecAggRecord { round_idx, seq, record });
                    }
                    Action::ReplySecAgg { request, result } => {
                        if let Some(tx) = entry.secagg_messages.remove(&request) {
                            replies.push(Reply::SecAgg(tx, result.map_err(DriverError::SecAgg)));
                        }
                    }
                    Action::ReplySecAggPoll { request, result } => {
                        if let Some(tx) = entry.secagg_polls.remove(&request) {
                            let res = result.map_err(DriverError::SecAgg);
                            replies.push(Reply::SecAggPoll(tx, res));
                        }
                    }
                    Action::SecureAggregate { round_idx, aggregate, evaluation } => {
                        tracing::info!(%run_id, round = %round_idx, survivors = aggregate.n_updates, evaluated = evaluation.is_some(), "secure aggregation unmasked the cohort's sum");
                        entry.secure_aggregate = Some((aggregate, evaluation));
                    }
                    Action::FinishRun => {
                        tracing::info!(%run_id, "run finished");
                        self.observer.run_state(run_id, "finished");
                        transitions.push(Transition::FinishRun);
                    }
                    Action::StopRun { open_round } => {
                        tracing::info!(%run_id, "run stopped");
                        if let Some(round_idx) = open_round {
                            self.observer.round_stopped(run_id, round_idx);
                        }
                        self.observer.run_state(run_id, "stopped");
                        transitions.push(Transition::StopRun { open_round });
                    }
                    Action::ReplyCheckIn { request, decision } => {
                        if let Some((device, tx)) = entry.check_ins.remove(&request) {
                            let tier = self.tier.as_ref();
                            let res = entry.check_in_response(run_id, device, decision, tier);
                            replies.push(Reply::CheckIn(tx, Box::new(Ok(res))));
                        }
                    }
                    Action::ReplyUpload { request, result } => {
                        let Some(p) = entry.uploads.get_mut(&request) else { continue };
                        if let Some(tx) = p.reply.take() {
                            let res = result
                                .map(|()| UploadAck { run_id, round_idx: p.round_idx })
                                .map_err(DriverError::from);
                            replies.push(Reply::Upload(tx, res));
                        }
                        entry.forget_if_done(request);
                    }
                    Action::PersistUpdate { request, round_idx, device, slot } => {
                        let Some(update) =
                            entry.uploads.get(&request).and_then(|p| p.update.clone())
                        else {
                            continue;
                        };
                        let store = self.store.clone();
                        persist_in_background(
                            &self.internal_tx,
                            &self.observer,
                            (run_id, request),
                            "insert_update",
                            async move {
                                let metrics = serde_json::to_string(update.metrics())
                                    .expect("metrics serialize");
                                store
                                    .insert_update(
                                        run_id,
                                        round_idx,
                                        device,
                                        slot,
                                        update.example_count(),
                                        &metrics,
                                        update.delta_le_bytes(),
                                        now_ms(),
                                    )
                                    .await
                            },
                            move |res, store_ms| match res {
                                Ok(()) => {
                                    tracing::debug!(%run_id, %device, store_ms, "update persisted")
                                }
                                Err(e) => {
                                    tracing::warn!(%run_id, %device, store_ms, error = %e, "update not persisted")
                                }
                            },
                        );
                    }
                    Action::FoldUpdate { request } => {
                        if let Some(update) =
                            entry.uploads.get_mut(&request).and_then(|p| p.update.take())
                        {
                            entry.accumulator.fold(update);
                        }
                        if let Some(sums) =
                            entry.partials.get_mut(&request).and_then(|p| p.sums.take())
                        {
                            entry.accumulator.merge(sums);
                        }
                        entry.forget_if_done(request);
                    }
                    Action::DropPayload { request } => {
                        if let Some(p) = entry.uploads.get_mut(&request) {
                            p.update = None;
                        }
                        if let Some(p) = entry.partials.get_mut(&request) {
                            p.report = None;
                            p.sums = None;
                        }
                        entry.forget_if_done(request);
                    }
                    Action::CloseRound(closing) => {
                        let task = CloseTask {
                            store: self.store.clone(),
                            observer: self.observer.clone(),
                            opened_at: entry
                                .machine
                                .current_round()
                                .map_or(closing.closed_at, |r| r.opened_at),
                            run_id,
                            closing,
                            evaluation: entry
                                .secure_aggregate
                                .as_mut()
                                .and_then(|(_, evaluation)| evaluation.take()),
                            finish: match entry.secure_aggregate.take() {
                                Some((aggregate, _)) => {
                                    let (tx, rx) = oneshot::channel();
                                    let _ = tx.send(Ok(aggregate));
                                    rx
                                }
                                None => entry.accumulator.finish(),
                            },
                            global: entry.global.clone(),
                            plan: entry.plan.clone(),
                            internal: self.internal_tx.clone(),
                        };
                        // Spawned once this batch's transitions are durable: the commit then
                        // follows the round's last records, which it deletes.
                        close_tasks.push(task);
                    }
                }
            }
            if !transitions.is_empty() {
                let mut backoff = Duration::from_millis(50);
                let started = std::time::Instant::now();
                loop {
                    match self.store.apply_transitions(run_id, &transitions, now).await {
                        Ok(()) => break,
                        Err(e @ StoreError::Fenced { .. }) => {
                            // A successor leads: nothing of this batch is durable, so nobody
                            // hears of it; the driver stops (see `run`).
                            tracing::error!(%run_id, error = %e, "transitions fenced off; this coordinator no longer leads");
                            self.deposed = true;
                            return;
                        }
                        Err(e) => {
                            tracing::error!(%run_id, error = %e, ?backoff, "persisting round transitions failed; retrying");
                            tokio::time::sleep(backoff).await;
                            backoff = (backoff * 2).min(Duration::from_secs(2));
                        }
                    }
                }
                self.observer.store_latency("transitions", started.elapsed().as_secs_f64());
            }
            for task in close_tasks {
                tokio::spawn(task.run());
            }
            for reply in replies {
                match reply {
                    Reply::CheckIn(tx, res) => drop(tx.send(*res)),
                    Reply::Upload(tx, res) => drop(tx.send(res)),
                    Reply::SecAgg(tx, res) => drop(tx.send(res)),
                    Reply::Partial(tx, res) => drop(tx.send(res)),
                    Reply::SecAggPoll(tx, res) => drop(tx.send(res)),
                }
            }
            if matches!(entry.machine.status(), RunStatus::Stopped | RunStatus::Finished) {
                finished.push(run_id);
            }
            if entry.machine.status() != RunStatus::Running {
                for tx in entry.stops.drain(..) {
                    let _ = tx.send(Ok(()));
                }
            }
        }
        for run_id in finished {
            if let Some(mut entry) = self.runs.remove(&run_id) {
                for (_, p) in entry.uploads.drain() {
                    if let Some(tx) = p.reply {
                        let _ = tx.send(Err(DriverError::Upload(UploadRejection::RoundClosed)));
                    }
                }
                for (_, (_, tx)) in entry.check_ins.drain() {
                    let _ = tx.send(Ok(CheckInResponse::ComeBackLater { retry_after_secs: 60 }));
                }
                for (_, p) in entry.partials.drain() {
                    if let Some(tx) = p.reply {
                        let _ = tx.send(Err(DriverError::Upload(UploadRejection::RoundClosed)));
                    }
                }
                for (_, tx) in entry.secagg_messages.drain() {
                    let _ = tx.send(Err(DriverError::RunNotRunning(run_id)));
                }
                for (_, tx) in entry.secagg_polls.drain() {
                    let _ = tx.send(Err(DriverError::RunNotRunning(run_id)));
                }
            }
        }
    }
}

impl RunEntry {
    fn new(
        machine: RunMachine,
        plan: Arc<ValidatedPlan>,
        global: Arc<Vec<f32>>,
        model_hash: String,
        acc: FedAvgAccumulator,
    ) -> Self {
        let training_config = plan.training_config_json();
        RunEntry {
            machine,
            plan,
            global,
            model_hash,
            training_config,
            accumulator: AccumulatorWorker::spawn(acc),
            check_ins: HashMap::new(),
            uploads: HashMap::new(),
            partials: HashMap::new(),
            secagg_messages: HashMap::new(),
            secagg_polls: HashMap::new(),
            secure_aggregate: None,
            stops: vec![],
        }
    }

    fn check_in_response(
        &self,
        run_id: RunId,
        device: DeviceId,
        decision: CheckInDecision,
        tier: Option<&AggregatorRegistry>,
    ) -> CheckInResponse {
        match decision {
            CheckInDecision::Selected {
                round_idx,
                model_version,
                report_deadline,
                secure,
                aggregator,
            } => CheckInResponse::Task(TaskAssignment {
                run_id,
                round_idx,
                model_version,
                model_hash: self.model_hash.clone(),
                schema: self.plan.schema().clone(),
                model_spec: self.plan.model_spec().cloned(),
                training_config: self.training_config.clone(),
                report_deadline_ms: report_deadline,
                secure_aggregation: secure,
                upload_to: aggregator
                    .and_then(|a| tier?.target(run_id, round_idx, model_version, device, a)),
            }),
            CheckInDecision::ComeBackLater { after_ms } => CheckInResponse::ComeBackLater {
                retry_after_secs: ((after_ms + 999) / 1000).clamp(1, 3600) as u32,
            },
        }
    }

    fn forget_if_done(&mut self, request: RequestId) {
        if self.uploads.get(&request).is_some_and(|p| p.reply.is_none() && p.update.is_none()) {
            self.uploads.remove(&request);
        }
        if self
            .partials
            .get(&request)
            .is_some_and(|p| p.reply.is_none() && p.report.is_none() && p.sums.is_none())
        {
            self.partials.remove(&request);
        }
    }
}

/// Runs one durable write of a request's payload (an update, a partial) off the driver loop:
/// records its latency under `what`, logs the outcome with `log` (given the milliseconds it
/// took), and tells the loop whether the payload is durable.
fn persist_in_background(
    internal: &mpsc::UnboundedSender<Internal>,
    observer: &Observer,
    (run_id, request): (RunId, RequestId),
    what: &'static str,
    write: impl Future<Output = Result<(), StoreError>> + Send + 'static,
    log: impl FnOnce(&Result<(), StoreError>, f64) + Send + 'static,
) {
    let internal = internal.clone();
    let observer = observer.clone();
    tokio::spawn(async move {
        let started = std::time::Instant::now();
        let res = write.await;
        let secs = started.elapsed().as_secs_f64();
        observer.store_latency(what, secs);
        log(&res, secs * 1e3);
        if matches!(res, Err(StoreError::Fenced { .. })) {
            let _ = internal.send(Internal::Deposed);
        }
        let _ = internal.send(Internal::UpdatePersisted { run_id, request, ok: res.is_ok() });
    });
}

/// Aggregates and commits a closed round, retrying the store until it succeeds.
struct CloseTask {
    store: SqlStore,
    observer: Observer,
    opened_at: Millis,
    run_id: RunId,
    closing: RoundClosing,
    finish: oneshot::Receiver<Result<Aggregate, AggregateError>>,
    /// A secure round's pooled evaluation, committed with the round.
    evaluation: Option<PooledEvaluation>,
    global: Arc<Vec<f32>>,
    plan: Arc<ValidatedPlan>,
    internal: mpsc::UnboundedSender<Internal>,
}

impl CloseTask {
    async fn run(self) {
        let CloseTask {
            store,
            observer,
            opened_at,
            run_id,
            closing,
            finish,
            evaluation,
            global,
            plan,
            internal,
        } = self;
        let round_idx = closing.round_idx;
        let closing_started = std::time::Instant::now();
        let open_ms = closing.closed_at - opened_at;
        let aggregate = finish.await.unwrap_or(Err(AggregateError::Empty));
        let committed = match (closing.outcome, aggregate) {
            (RoundOutcome::Commit, Ok(aggregate)) => {
                let server_lr = plan.plan().server_learning_rate;
                let prepared = tokio::task::spawn_blocking(move || {
                    let values = aggregate.apply(&global, server_lr)?;
                    let (encoded, hash) = encode_model(plan.schema(), &values);
                    Ok::<_, AggregateError>((values, encoded, hash, aggregate.metrics))
                })
                .await
                .expect("aggregation task panicked");
                match prepared {
                    Ok((values, encoded, hash, metrics)) => {
                        let commit = RoundCommit {
                            closing,
                            model: &encoded,
                            model_hash: &hash,
                            metrics: &metrics,
                            evaluation: evaluation.as_ref(),
                        };
                        let commit_started = std::time::Instant::now();
                        if retry_store("commit round", run_id, || {
                            store.commit_round(run_id, commit.clone(), now_ms())
                        })
                        .await
                        .is_err()
                        {
                            let _ = internal.send(Internal::Deposed);
                            return;
                        }
                        observer
                            .store_latency("commit_round", commit_started.elapsed().as_secs_f64());
                        observer.round_closed(
                            run_id,
                            round_idx,
                            "committed",
                            closing.n_dropped,
                            open_ms,
                            Some(closing_started.elapsed().as_secs_f64() * 1e3),
                        );
                        tracing::info!(%run_id, round = %round_idx, reported = closing.n_reported, dropped = closing.n_dropped, ?metrics, "round committed");
                        Some(CommittedModel { values: Arc::new(values), hash })
                    }
                    Err(e) => {
                        tracing::error!(%run_id, round = %round_idx, error = %e, "aggregate rejected; round fails");
                        if retry_store("fail round", run_id, || store.fail_round(run_id, closing))
                            .await
                            .is_err()
                        {
                            let _ = internal.send(Internal::Deposed);
                            return;
                        }
                        observer.round_closed(
                            run_id,
                            round_idx,
                            "aggregate_rejected",
                            closing.n_dropped,
                            open_ms,
                            None,
                        );
                        None
                    }
                }
            }
            (outcome, _) => {
                tracing::warn!(%run_id, round = %round_idx, ?outcome, "round failed");
                if retry_store("fail round", run_id, || store.fail_round(run_id, closing))
                    .await
                    .is_err()
                {
                    let _ = internal.send(Internal::Deposed);
                    return;
                }
                observer.round_closed(
                    run_id,
                    round_idx,
                    outcome.label(),
                    closing.n_dropped,
                    open_ms,
                    None,
                );
                None
            }
        };
        let _ = internal.send(Internal::RoundClosed { run_id, round_idx, committed });
    }
}

/// Another coordinator leads: a write was fenced off.
#[derive(Debug)]
struct Deposed;

/// Retries a store write until it succeeds; a conflict means an earlier attempt whose answer
/// was lost already succeeded. Fails only when the write was fenced off.
async fn retry_store<F, Fut>(what: &str, run_id: RunId, mut op: F) -> Result<(), Deposed>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<(), StoreError>>,
{
    let mut backoff = Duration::from_millis(50);
    loop {
        match op().await {
            Ok(()) | Err(StoreError::Conflict) => return Ok(()),
            Err(e @ StoreError::Fenced { .. }) => {
                // The successor recovers the round from the store and closes it itself.
                tracing::error!(%run_id, error = %e, "{what} fenced off; left to the new leader");
                return Err(Deposed);
            }
            Err(e) => {
                tracing::error!(%run_id, error = %e, ?backoff, "{what} failed; retrying");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(2));
            }
        }
    }
}

/// 32 bytes from the OS for a run machine (secure rounds draw their neighbour graphs from it).
fn entropy() -> [u8; 32] {
    let mut bytes = [0u8; 32];
    getrandom::fill(&mut bytes).expect("the OS random source failed");
    bytes
}

/// CBOR-encodes model values and returns the bytes and their content hash.
pub fn encode_model(schema: &TensorSchema, values: &[f32]) -> (Vec<u8>, String) {
    let payload = schema.encode_f32(values);
    let hash = payload.content_hash();
    (codec::to_vec(&payload).expect("payload encodes"), hash)
}

/// A thread that owns one run's accumulator, so folding never blocks the async driver.
///
/// Messages are handled in order, which is what keeps the fold order equal to the slot order.
struct AccumulatorWorker {
    tx: std::sync::mpsc::Sender<AccMsg>,
}

enum AccMsg {
    Reset(usize),
    Fold(ValidatedUpdate),
    Merge(ValidatedPartial),
    Finish(oneshot::Sender<Result<Aggregate, AggregateError>>),
}

impl AccumulatorWorker {
    fn spawn(initial: FedAvgAccumulator) -> Self {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::Builder::new()
            .name("fedavg-accumulator".into())
            .spawn(move || {
                let mut acc = Some(initial);
                while let Ok(msg) = rx.recv() {
                    match msg {
                        AccMsg::Reset(n) => acc = Some(FedAvgAccumulator::new(n)),
                        AccMsg::Fold(update) => {
                            if let Some(acc) = acc.as_mut() {
                                acc.add(&update);
                            }
                        }
                        AccMsg::Merge(partial) => {
                            if let Some(acc) = acc.as_mut() {
                                acc.merge(&partial);
                            }
                        }
                        AccMsg::Finish(reply) => {
                            let res = acc
                                .take()
                                .map_or(Err(AggregateError::Empty), FedAvgAccumulator::finish);
                            let _ = reply.send(res);
                        }
                    }
                }
            })
            .expect("spawning the accumulator thread");
        AccumulatorWorker { tx }
    }

    fn reset(&self, n_params: usize) {
        let _ = self.tx.send(AccMsg::Reset(n_params));
    }

    fn fold(&self, update: ValidatedUpdate) {
        let _ = self.tx.send(AccMsg::Fold(update));
    }

    fn merge(&self, partial: ValidatedPartial) {
        let _ = self.tx.send(AccMsg::Merge(partial));
    }

    fn finish(&self) -> oneshot::Receiver<Result<Aggregate, AggregateError>> {
        let (tx, rx) = oneshot::channel();
        let _ = self.tx.send(AccMsg::Finish(tx));
        rx
    }
}
