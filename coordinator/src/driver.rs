//! The one task that drives every run: it feeds events to the runs' state machines and executes
//! their actions.
//!
//! HTTP handlers never touch round state: they validate what they can alone (auth, CBOR,
//! schema, finiteness) and send an [`Event`] with a reply channel.
//! The driver owns the [`RunMachine`]s, and executes their actions with these rules:
//!
//! * Everything a run puts in the store goes through its one ordered writer (`writer`), a task
//!   with one retry-and-fence policy. Transitions (round opened, device selected, a secure
//!   round's records, run finished/stopped) produced while handling one batch of events are
//!   put in the store in one transaction before any reply of that batch is sent. A store
//!   failure is retried with backoff; replies wait (handlers time out with 503), so memory
//!   never runs ahead of the store in what devices are told, and a run's slow write (a masked
//!   input is model-sized) holds up that run's answers only.
//! * Payloads (updates, partials) travel inside the machine's inputs and actions, shared, never
//!   parked here: the writer starts their writes, concurrently, once their round's row is
//!   durable, and they come back as [`Internal::Persisted`]; only then is the sender
//!   acknowledged. Where the plan allows, updates are written as the sums of groups of them
//!   (`groups`): an update's bytes go into its group's sum, and its answer waits for the
//!   group's write.
//! * Folding happens on a per-run accumulator thread, fed in the machine's slot order.
//! * Closing a round (aggregate, apply, encode) runs in a spawned task, which hands the round's
//!   end to the writer; the writer commits it, in round order and after the previous model's
//!   bytes, and the driver hears of it as [`Internal::RoundClosed`].
//!
//! The one piece of bookkeeping is who waits for an answer: a [`Responder`] per request.
//!
//! * `recover`: on start, every running run rebuilt from the store (latest model, open round,
//!   its selections, its stored updates and partials replayed in slot order);
//! * `execute`: the machines' actions carried out;
//! * `close`: a closed round aggregated and its next model computed, off the driver task;
//! * `writer`: a run's ordered writer;
//! * `groups`: a run's updates written as the sums of groups of them;
//! * `accumulator`: the per-run thread that folds the sums.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use starling_core::codec;
use starling_core::eligibility::DeviceAttributes;

mod accumulator;
mod close;
use accumulator::AccumulatorWorker;
pub use accumulator::Hold;
mod execute;
mod groups;
mod next_model;
mod recover;
#[cfg(test)]
mod tests;
mod writer;
use writer::RunWriter;

use starling_core::fedavg::{FedAvgAccumulator, ValidatedPartial, ValidatedUpdate};
use starling_core::plan::ValidatedPlan;
use starling_core::round::secure::SecAggRejection;
use starling_core::round::{
    CheckInDecision, Input, RequestId, RunMachine, RunStatus, UploadRejection,
};
use starling_core::strategy::OptimizerState;
use starling_core::tensor::TensorSchema;
use starling_core::tier::{AggregatorHello, AggregatorWork, PartialReport, ShardTask};
use starling_core::wire::{
    CheckInResponse, SecAggInstruction, SecAggUpload, TaskAssignment, UploadAck,
};
use starling_core::{DeviceId, Millis, ModelVersion, RoundIdx, RunId};
use tokio::sync::{mpsc, oneshot};

use crate::clock::now_ms;
use crate::model_cache::ModelCache;
use crate::observe::{Observer, POPULATION_SAMPLE_MS};
use crate::store::{NewRun, SqlStore, StoreError};
use crate::tier::AggregatorRegistry;

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
    /// The run's population is held by another run, or the run asks for it alone and another
    /// runs there (the store's message says which).
    #[error("{0}")]
    PopulationBusy(String),
    /// The leader refused a request this replica relayed to it, with the answer the leader's
    /// HTTP edge would have given.
    #[error("the leader refused: {message}")]
    Refused {
        /// HTTP status.
        status: u16,
        /// Error code.
        code: starling_core::wire::ErrorCode,
        /// The leader's message.
        message: String,
        /// The leader's `Retry-After`, in whole seconds.
        retry_after_secs: Option<u64>,
    },
    /// Only the leading coordinator does this (a replica relays fleet requests, nothing else).
    #[error("only the leading coordinator serves this")]
    NotLeader,
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
        /// What it says about its conditions.
        attributes: DeviceAttributes,
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
        /// What the HTTP edge holds while the update's bytes are in memory (its upload permit),
        /// let go once they are folded into a group, or with the answer.
        hold: Option<Hold>,
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
        report: Arc<PartialReport>,
        /// Its sums, validated.
        sums: Arc<ValidatedPartial>,
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
    /// An update, a group of updates or a partial is durable (or failed to be).
    Persisted {
        run_id: RunId,
        /// The upload's (or partial's) request; a group's, one per update.
        requests: Vec<RequestId>,
        /// Whether they were a group's ([`groups`]).
        group: bool,
        ok: bool,
    },
    RoundClosed {
        run_id: RunId,
        round_idx: RoundIdx,
        committed: Closed,
    },
    /// A spawned write was fenced off: another coordinator leads.
    Deposed,
}

/// How a closed round ended, as its close task reports it.
#[derive(Debug)]
enum Closed {
    /// A new model version.
    Committed(CommittedModel),
    /// An evaluation-only round's reports were recorded; the model is unchanged.
    Evaluated,
    /// Recorded as failed; with why the run must stop when its close broke outright.
    Failed {
        /// The run's stop reason.
        stop_run: Option<String>,
        /// The devices whose updates caused a refused commit, when traced (else empty).
        refused_by: Vec<DeviceId>,
    },
}

#[derive(Debug)]
struct CommittedModel {
    values: Arc<Vec<f32>>,
    hash: String,
    optimizer_state: Arc<OptimizerState>,
}

/// The handle HTTP handlers hold.
#[derive(Debug, Clone)]
pub struct DriverHandle {
    tx: mpsc::Sender<Event>,
    models: ModelCache,
    model_writes: ModelWrites,
}

/// Committed models whose bytes are still being written, across runs: each close task that
/// commits a model by its hash holds the read side until the bytes land, and
/// [`DriverHandle::finish_model_writes`] takes the write side to wait for them all.
#[derive(Debug, Clone, Default)]
struct ModelWrites(Arc<tokio::sync::RwLock<()>>);

impl DriverHandle {
    /// A handle whose events go to the returned receiver instead of a driver: a replica's
    /// relay reads them (`crate::relay`).
    pub(crate) fn relaying() -> (DriverHandle, mpsc::Receiver<Event>) {
        let (tx, rx) = mpsc::channel(4096);
        let handle = DriverHandle {
            tx,
            models: ModelCache::default(),
            model_writes: ModelWrites::default(),
        };
        (handle, rx)
    }

    /// The models cache the driver's commits fill, which the download handler serves from.
    pub fn models(&self) -> &ModelCache {
        &self.models
    }

    /// Waits up to `within` for the bytes of every model committed by its hash to be written
    /// (at shutdown: a stopped coordinator's next start would rebuild them, but a finished
    /// run's last model should not wait for one); whether they all landed.
    pub async fn finish_model_writes(&self, within: Duration) -> bool {
        tokio::time::timeout(within, self.model_writes.0.write()).await.is_ok()
    }

    /// Whether the driver task is still running (it ends at shutdown, or if it panicked).
    pub fn is_running(&self) -> bool {
        !self.tx.is_closed()
    }

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
    /// Committed models go in here, for the cohort's downloads.
    models: ModelCache,
    /// Model bytes being written after their commit.
    model_writes: ModelWrites,
}

struct RunEntry {
    machine: RunMachine,
    plan: Arc<ValidatedPlan>,
    global: Arc<Vec<f32>>,
    model_hash: String,
    /// The server optimizer's state after producing `global`.
    optimizer_state: Arc<OptimizerState>,
    training_config: String,
    accumulator: AccumulatorWorker,
    /// The open group of a run whose updates are stored in groups.
    groups: Option<groups::UpdateGroups>,
    /// Writes the run's batches in order, off the driver task.
    writer: RunWriter,
    /// Who waits for the answer to each request the machine has not answered yet.
    responders: HashMap<RequestId, Responder>,
    stops: Vec<oneshot::Sender<Result<(), DriverError>>>,
}

/// Who waits for the machine's answer to a request, and how it is answered.
enum Responder {
    CheckIn {
        device: DeviceId,
        reply: oneshot::Sender<Result<CheckInResponse, DriverError>>,
    },
    Upload {
        round_idx: RoundIdx,
        reply: oneshot::Sender<Result<UploadAck, DriverError>>,
        hold: Option<Hold>,
    },
    Partial(oneshot::Sender<Result<(), DriverError>>),
    SecAgg(oneshot::Sender<Result<(), DriverError>>),
    SecAggPoll(oneshot::Sender<Result<SecAggInstruction, DriverError>>),
}

impl Responder {
    /// The answer when the run ends before the machine answered.
    fn run_ended(self, run_id: RunId) {
        let closed = || DriverError::Upload(UploadRejection::RoundClosed);
        match self {
            Responder::CheckIn { reply, .. } => {
                let _ = reply.send(Ok(CheckInResponse::ComeBackLater { retry_after_secs: 60 }));
            }
            Responder::Upload { reply, .. } => drop(reply.send(Err(closed()))),
            Responder::Partial(reply) => drop(reply.send(Err(closed()))),
            Responder::SecAgg(reply) => drop(reply.send(Err(DriverError::RunNotRunning(run_id)))),
            Responder::SecAggPoll(reply) => {
                let _ = reply.send(Err(DriverError::RunNotRunning(run_id)));
            }
        }
    }
}

impl Driver {
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
        for (_, entry) in std::mem::take(&mut self.runs) {
            entry.writer.finish().await;
        }
        tracing::info!("driver stopped");
    }

    /// A writer task for `run_id`'s batches.
    fn writer_for(&self, run_id: RunId) -> RunWriter {
        RunWriter::spawn(writer::WriterParts {
            run_id,
            store: self.store.clone(),
            observer: self.observer.clone(),
            internal: self.internal_tx.clone(),
            models: self.models.clone(),
            writes_in_flight: self.model_writes.clone(),
        })
    }

    /// What the run machines must hear about the tier now; `None` without a tier.
    fn tier_input(&self) -> Option<Input> {
        let tier = self.tier.as_ref()?;
        Some(Input::Aggregators { live: tier.live(), tier: tier.settings().config() })
    }

    fn announce_aggregators(&mut self) {
        if let Some(tier) = &self.tier {
            self.observer.aggregators_live(tier.live().len());
        }
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
                    compression: entry.plan.compression(),
                })
            })
            .collect();
        Ok(AggregatorWork { shards, poll_after_ms })
    }

    fn next_timeout(&self) -> Option<Millis> {
        let groups = self.runs.values().filter_map(|e| e.groups.as_ref()?.deadline());
        self.runs.values().filter_map(|e| e.machine.poll_timeout()).chain(groups).min()
    }

    fn request_id(&mut self) -> RequestId {
        self.next_request += 1;
        RequestId(self.next_request)
    }

    async fn on_event(&mut self, ev: Event) {
        let now = now_ms();
        match ev {
            Event::CheckIn { device, population, attributes, reply } => {
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
                let admits = |id: &RunId| self.runs[id].plan.plan().eligibility.admits(&attributes);
                let wanted = candidates.iter().any(admits);
                let online = self.observer.device_seen(device.0, now, wanted);
                let chosen = candidates
                    .iter()
                    .find(|id| self.runs[id].machine.has_task_for(device))
                    .or_else(|| {
                        candidates
                            .iter()
                            .find(|id| admits(id) && self.runs[id].machine.is_selecting(now))
                    })
                    .or_else(|| candidates.iter().find(|id| admits(id)))
                    .or(candidates.first());
                match chosen {
                    Some(run_id) => {
                        let entry = self.runs.get_mut(run_id).expect("candidate exists");
                        entry.responders.insert(request, Responder::CheckIn { device, reply });
                        let input = Input::CheckIn { request, device, attributes, online };
                        entry.machine.handle(now, input);
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
            Event::Upload { device, run_id, round_idx, model_version, update, hold, reply } => {
                let request = self.request_id();
                self.observer.device_seen(device.0, now, true);
                let Some(entry) = self.runs.get_mut(&run_id) else {
                    let _ = reply.send(Err(DriverError::RunNotRunning(run_id)));
                    return;
                };
                entry.responders.insert(request, Responder::Upload { round_idx, reply, hold });
                let input = Input::Upload { request, device, round_idx, model_version, update };
                entry.machine.handle(now, input);
            }
            Event::SecAgg { device, run_id, round_idx, message, reply } => {
                let request = self.request_id();
                self.observer.device_seen(device.0, now, true);
                let Some(entry) = self.runs.get_mut(&run_id) else {
                    let _ = reply.send(Err(DriverError::RunNotRunning(run_id)));
                    return;
                };
                entry.responders.insert(request, Responder::SecAgg(reply));
                entry.machine.handle(now, Input::SecAgg { request, device, round_idx, message });
            }
            Event::SecAggPoll { device, run_id, round_idx, reply } => {
                let request = self.request_id();
                let Some(entry) = self.runs.get_mut(&run_id) else {
                    let _ = reply.send(Err(DriverError::RunNotRunning(run_id)));
                    return;
                };
                entry.responders.insert(request, Responder::SecAggPoll(reply));
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
                entry.responders.insert(request, Responder::Partial(reply));
                entry.machine.handle(now, Input::Partial { request, round_idx, report, sums });
            }
            Event::CreateRun { plan, initial, reply } => {
                let res = self.create_run(*plan, initial, now).await;
                let _ = reply.send(res);
            }
            Event::StopRun { run_id, reply } => match self.runs.get_mut(&run_id) {
                Some(entry) => {
                    entry.stops.push(reply);
                    entry.machine.handle(now, Input::Stop { reason: None });
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
                    exclusive_population: plan.plan().exclusive_population,
                },
                now,
            )
            .await
            .map_err(|e| match e {
                e @ StoreError::PopulationBusy { .. } => DriverError::PopulationBusy(e.to_string()),
                e => {
                    tracing::error!(error = %e, "creating run failed");
                    DriverError::Unavailable
                }
            })?;
        let mut machine = RunMachine::start(run_id, plan.round_config(), now, entropy());
        if let Some(input) = self.tier_input() {
            machine.handle(now, input);
        }
        let state = plan.plan().strategy.initial_state(initial.values.len());
        let acc = plan.accumulator(&state);
        let values = Arc::new(initial.values);
        let writer = self.writer_for(run_id);
        let mut entry =
            RunEntry::new(machine, Arc::new(plan), values, initial.hash, state, acc, writer);
        entry.report_privacy(run_id, &self.observer, now);
        self.runs.insert(run_id, entry);
        self.observer.run_state(run_id, "running");
        tracing::info!(%run_id, "run created");
        Ok(run_id)
    }

    fn on_internal(&mut self, internal: Internal) {
        let now = now_ms();
        match internal {
            Internal::Deposed => self.deposed = true,
            Internal::Persisted { run_id, requests, group, ok } => {
                if let Some(entry) = self.runs.get_mut(&run_id) {
                    for request in requests {
                        entry.machine.handle(now, Input::Persisted { request, ok });
                    }
                    if group && let Some(groups) = entry.groups.as_mut() {
                        groups.written();
                    }
                }
            }
            Internal::RoundClosed { run_id, round_idx, committed } => {
                if let Some(entry) = self.runs.get_mut(&run_id) {
                    let was_committed = !matches!(committed, Closed::Failed { .. });
                    let (mut stop_run, mut refused_by) = (None, vec![]);
                    match committed {
                        Closed::Committed(model) => {
                            entry.global = model.values;
                            entry.model_hash = model.hash;
                            entry.optimizer_state = model.optimizer_state;
                        }
                        Closed::Failed { stop_run: reason, refused_by: culprits } => {
                            (stop_run, refused_by) = (reason, culprits);
                        }
                        Closed::Evaluated => {}
                    }
                    let before: Vec<_> = entry.machine.quarantined().collect();
                    entry.machine.handle(
                        now,
                        Input::RoundClosed { round_idx, committed: was_committed, refused_by },
                    );
                    let newly: Vec<_> =
                        entry.machine.quarantined().filter(|d| !before.contains(d)).collect();
                    if !newly.is_empty() {
                        tracing::warn!(%run_id, round = %round_idx, devices = ?newly, "devices quarantined: their updates were in three refused rounds in a row; this run selects them no more");
                    }
                    if let Some(reason) = stop_run {
                        entry.machine.handle(now, Input::Stop { reason: Some(reason) });
                    }
                    entry.report_privacy(run_id, &self.observer, now);
                }
            }
        }
    }
}

impl RunEntry {
    /// Publishes the ε a DP run has spent over its committed rounds. An accountant that fails
    /// (it panicked on a plan it could not represent, once killing this task and so every run)
    /// stops this run with the reason; the others go on.
    fn report_privacy(&mut self, run_id: RunId, observer: &Observer, now: Millis) {
        let Some(privacy) = self.plan.privacy() else { return };
        let rounds = u64::from(self.machine.rounds_committed());
        let spent = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            privacy.epsilon_after(rounds)
        }));
        match spent {
            Ok(epsilon) => observer.privacy_spent(run_id, epsilon),
            Err(panicked) => {
                let why = panic_text(panicked.as_ref());
                let reason = format!("privacy accounting failed after {rounds} rounds: {why}");
                tracing::error!(%run_id, %reason, "stopping the run");
                self.machine.handle(now, Input::Stop { reason: Some(reason) });
            }
        }
    }

    fn new(
        machine: RunMachine,
        plan: Arc<ValidatedPlan>,
        global: Arc<Vec<f32>>,
        model_hash: String,
        optimizer_state: OptimizerState,
        acc: FedAvgAccumulator,
        writer: RunWriter,
    ) -> Self {
        let training_config = plan.training_config_json();
        let grouped = plan.stores_update_sums();
        RunEntry {
            machine,
            plan,
            global,
            model_hash,
            optimizer_state: Arc::new(optimizer_state),
            training_config,
            accumulator: AccumulatorWorker::spawn(acc, grouped),
            groups: grouped.then(groups::UpdateGroups::default),
            writer,
            responders: HashMap::new(),
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
        let parts = self.plan.model_parts();
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
                update_schema: (!parts.is_whole()).then(|| parts.update_schema().clone()),
                local_tensors: parts.local().to_vec(),
                base_model: self.plan.frozen_from_base().map(str::to_owned),
                tokenizer: self.plan.tokenizer().map(str::to_owned),
                model_spec: self.plan.model_spec().cloned(),
                training_config: self.training_config.clone(),
                report_deadline_ms: report_deadline,
                secure_aggregation: secure,
                evaluate_only: self.plan.plan().evaluation_only,
                withhold_metrics: !self.plan.releases_device_metrics()
                    && !self.plan.noises_device_metrics(),
                evaluation_in_update: self.plan.noises_device_metrics(),
                upload_to: aggregator
                    .and_then(|a| tier?.target(run_id, round_idx, model_version, device, a)),
                compression: self.plan.compression(),
                model_download: self.plan.model_download(),
                eligibility: self.plan.plan().eligibility.clone(),
            }),
            CheckInDecision::ComeBackLater { after_ms } => CheckInResponse::ComeBackLater {
                retry_after_secs: ((after_ms + 999) / 1000).clamp(1, 3600) as u32,
            },
        }
    }
}

/// What a panic said (its `&str` or `String` payload), for a run's stop reason.
fn panic_text(payload: &(dyn std::any::Any + Send)) -> String {
    match (payload.downcast_ref::<&str>(), payload.downcast_ref::<String>()) {
        (Some(s), _) => format!("it panicked: {s}"),
        (_, Some(s)) => format!("it panicked: {s}"),
        _ => "it panicked".to_owned(),
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
