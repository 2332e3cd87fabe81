//! One ordered writer per run, off the driver task: everything the run puts in the store goes
//! through it, under one retry-and-fence policy ([`until_done`]).
//!
//! * **Transitions** (round opened, devices selected, a secure round's records with their
//!   model-sized masked inputs, run finished or stopped) are made durable in order, in one
//!   transaction per group of queued batches (group commit), before any of their batch's
//!   replies is sent and before its payloads and closings start.
//! * **Payloads** (updates, groups of them, partials) are written concurrently, each started
//!   once the round row it refers to is durable ([`RunWriter::payload`]); they are not retried
//!   here: a device whose payload did not land is told to retry.
//! * **Round ends** (a commit with its model, an evaluation round, a failure), which close tasks
//!   compute and hand back ([`Job::EndRound`]), in round order, each after the bytes of the
//!   model before it; then the cache hears of the model and the driver of the end.
//! * **Model bytes** of a model committed by its hash alone are written after its commit, off
//!   the round's path (the next round's commit waits for them), and a stopped run's newest
//!   model's bytes at its end ([`Job::LastModel`]).
//! * **Releases** of committed rounds' payloads, once a model that includes them is written.
//!
//! A fenced write stops the writer and tells the driver that another coordinator leads.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use starling_core::backoff::Backoff;
use starling_core::fedavg::PooledEvaluation;
use starling_core::plan::ValidatedPlan;
use starling_core::round::{RoundClosing, RoundOutcome};
use starling_core::strategy::OptimizerState;
use starling_core::{Millis, ModelVersion, RunId};
use tokio::sync::{OwnedRwLockReadGuard, mpsc};
use tokio::task::JoinHandle;

use super::next_model::{EncodedModel, encoded};
use super::{Closed, CommittedModel, Internal, ModelWrites};
use crate::clock::now_ms;
use crate::model_cache::ModelCache;
use crate::observe::Observer;
use crate::store::{ModelBytes, RoundCommit, SqlStore, StoreError, Transition};

/// A reply held back until the batch's transitions are durable.
pub(super) type Deferred = Box<dyn FnOnce() + Send>;

/// Work started once the batch's transitions are durable: a payload write, a round's closing.
pub(super) type AfterDurable = std::pin::Pin<Box<dyn Future<Output = ()> + Send>>;

/// What one batch of a run's actions adds up to: transitions to persist together, then (once
/// they and every earlier batch's are durable) payloads to write, replies to send and rounds
/// to close.
#[derive(Default)]
pub(super) struct Batch {
    pub(super) transitions: Vec<Transition>,
    pub(super) writes: Vec<AfterDurable>,
    pub(super) replies: Vec<Deferred>,
    pub(super) closings: Vec<AfterDurable>,
}

impl Batch {
    pub(super) fn is_empty(&self) -> bool {
        self.transitions.is_empty()
            && self.writes.is_empty()
            && self.replies.is_empty()
            && self.closings.is_empty()
    }
}

/// What a run's writer is handed, in order.
pub(super) enum Job {
    /// A batch of the machine's actions, numbered.
    Batch(Batch, Millis, u64),
    /// A closed round's end, computed by its close task.
    EndRound(RoundEnd),
    /// A stopped run's newest model, committed by its hash alone.
    LastModel(LastModel),
}

/// How a closed round ends, as its close task computed it; the writer records it.
pub(super) struct RoundEnd {
    pub(super) closing: RoundClosing,
    pub(super) outcome: EndOutcome,
    /// When the round opened and when its closing started, for the round's metrics.
    pub(super) opened_at: Millis,
    pub(super) closing_started: std::time::Instant,
}

/// What a round's end writes.
pub(super) enum EndOutcome {
    /// A new model version, committed with the round's row.
    Committed(Box<NewModel>),
    /// An evaluation-only round's pooled reports.
    Evaluated(PooledEvaluation),
    /// A failure (`closing.outcome` says which), recorded as such; with why the run must stop
    /// when its close broke outright.
    Failed {
        /// The run's stop reason.
        stop_run: Option<String>,
        /// The devices whose updates caused a refused commit, when traced (else empty).
        refused_by: Vec<starling_core::DeviceId>,
    },
}

/// A committed round's new model, encoded.
pub(super) struct NewModel {
    pub(super) model: CommittedModel,
    pub(super) payload: Bytes,
    pub(super) state_bytes: Option<Vec<u8>>,
    pub(super) metrics: std::collections::BTreeMap<String, f64>,
    /// A secure round's pooled evaluation, committed with it.
    pub(super) evaluation: Option<PooledEvaluation>,
    /// Whether the model follows from durable inputs alone (no secure unmasking, no DP noise):
    /// then it is committed by its hash and its bytes written later, as the plan's
    /// `checkpoint_interval` says.
    pub(super) replayable: bool,
    pub(super) plan: Arc<ValidatedPlan>,
}

/// A stopped run's newest model: the values the driver holds, and the hash it committed.
pub(super) struct LastModel {
    pub(super) plan: Arc<ValidatedPlan>,
    pub(super) version: ModelVersion,
    pub(super) hash: String,
    pub(super) values: Arc<Vec<f32>>,
    pub(super) optimizer_state: Arc<OptimizerState>,
    /// Held until written: a shutdown waits for it.
    pub(super) in_flight: OwnedRwLockReadGuard<()>,
}

/// Batches a run's writer may hold before the driver waits for it (backpressure when the
/// store falls behind, instead of unbounded memory of queued masked inputs).
const QUEUED_BATCHES: usize = 64;

/// A run's writer: the driver's handle on its task.
pub(super) struct RunWriter {
    tx: mpsc::Sender<Job>,
    task: JoinHandle<()>,
    /// Batches queued so far; the next one is numbered one more.
    queued: u64,
    /// The number of the last batch whose transitions are durable (or that had none).
    durable: Arc<AtomicU64>,
    /// The batch that opened the run's newest round.
    round_opened_in: u64,
    parts: WriterParts,
}

/// What the writer writes with, and whom it tells.
#[derive(Clone)]
pub(super) struct WriterParts {
    pub(super) run_id: RunId,
    pub(super) store: SqlStore,
    pub(super) observer: Observer,
    pub(super) internal: mpsc::UnboundedSender<Internal>,
    pub(super) models: ModelCache,
    /// Every run's model writes, which a shutdown waits for.
    pub(super) writes_in_flight: ModelWrites,
}

impl RunWriter {
    /// Starts the writer of a run; it ends when its handle and every close task's sender are
    /// dropped and its queue is written, or when a write is fenced off (then it tells the
    /// driver).
    pub(super) fn spawn(parts: WriterParts) -> Self {
        let (tx, rx) = mpsc::channel::<Job>(QUEUED_BATCHES);
        let durable = Arc::new(AtomicU64::new(0));
        let task = Writer { parts: parts.clone(), durable: durable.clone(), model_write: None };
        let task = tokio::spawn(task.run(rx));
        RunWriter { tx, task, queued: 0, durable, round_opened_in: 0, parts }
    }

    /// The batch being built opens a round: payloads for it wait until that batch is durable.
    pub(super) fn opens_round(&mut self) {
        self.round_opened_in = self.queued + 1;
    }

    /// Starts a payload write now if the newest round's row is durable, else with `batch`,
    /// once the transitions before it are. It reports back as [`Internal::Persisted`].
    pub(super) fn payload(
        &self,
        request: starling_core::round::RequestId,
        batch: &mut Batch,
        what: &'static str,
        write: impl Future<Output = Result<(), StoreError>> + Send + 'static,
    ) {
        self.start_payload(vec![request], false, batch, what, write);
    }

    /// [`payload`](Self::payload) for a sealed group of updates, reported back for all of
    /// `requests` at once.
    pub(super) fn group_payload(
        &self,
        requests: Vec<starling_core::round::RequestId>,
        batch: &mut Batch,
        write: impl Future<Output = Result<(), StoreError>> + Send + 'static,
    ) {
        self.start_payload(requests, true, batch, "insert_update_group", write);
    }

    fn start_payload(
        &self,
        requests: Vec<starling_core::round::RequestId>,
        group: bool,
        batch: &mut Batch,
        what: &'static str,
        write: impl Future<Output = Result<(), StoreError>> + Send + 'static,
    ) {
        let run_id = self.parts.run_id;
        let (observer, internal) = (self.parts.observer.clone(), self.parts.internal.clone());
        let write = Box::pin(async move {
            let started = std::time::Instant::now();
            let res = write.await;
            observer.store_latency(what, started.elapsed().as_secs_f64());
            if matches!(res, Err(StoreError::Fenced { .. })) {
                let _ = internal.send(Internal::Deposed);
            }
            let _ = internal.send(Internal::Persisted { run_id, requests, group, ok: res.is_ok() });
        });
        if self.durable.load(Ordering::Acquire) >= self.round_opened_in {
            tokio::spawn(write);
        } else {
            batch.writes.push(write);
        }
    }

    /// Where a close task hands its round's end.
    pub(super) fn round_ends(&self) -> RoundEnds {
        RoundEnds(self.tx.clone())
    }

    /// Ends the writer once what it was handed is written (or fenced off), so that a driver
    /// that stops leaves no write behind it for a successor to race.
    pub(super) async fn finish(self) {
        drop(self.tx);
        let _ = self.task.await;
    }

    /// Queues `batch`, waiting only when the writer is [`QUEUED_BATCHES`] behind.
    pub(super) async fn write(&mut self, batch: Batch, now: Millis) {
        self.queued += 1;
        // The writer only stops after a fence, and then the driver stops too.
        let _ = self.tx.send(Job::Batch(batch, now, self.queued)).await;
    }

    /// Queues the write of a stopped run's newest model, after everything before it.
    pub(super) fn write_last_model(&self, last: LastModel) {
        let tx = self.tx.clone();
        tokio::spawn(async move {
            let _ = tx.send(Job::LastModel(last)).await;
        });
    }
}

/// A close task's way back to its run's writer.
pub(super) struct RoundEnds(mpsc::Sender<Job>);

impl RoundEnds {
    pub(super) async fn send(self, end: RoundEnd) {
        let _ = self.0.send(Job::EndRound(end)).await;
    }
}

/// Another coordinator leads: a write was fenced off.
#[derive(Debug)]
pub(super) struct Deposed;

/// The writer task's state.
struct Writer {
    parts: WriterParts,
    durable: Arc<AtomicU64>,
    /// The bytes of the last committed model, being written; the next commit waits for them.
    model_write: Option<JoinHandle<Result<(), Deposed>>>,
}

impl Writer {
    async fn run(mut self, mut rx: mpsc::Receiver<Job>) {
        let mut next = rx.recv().await;
        while let Some(job) = next.take() {
            let done = match job {
                Job::Batch(batch, now, seq) => {
                    // Batches that queued while the last write was in flight join this one:
                    // one transaction, one flush, for a cohort checking in at once.
                    let mut batches = vec![(batch, now, seq)];
                    loop {
                        match rx.try_recv() {
                            Ok(Job::Batch(batch, now, seq)) => batches.push((batch, now, seq)),
                            Ok(other) => {
                                next = Some(other);
                                break;
                            }
                            Err(_) => break,
                        }
                    }
                    self.batches(batches).await
                }
                Job::EndRound(end) => self.end_round(end).await,
                Job::LastModel(last) => self.last_model(last).await,
            };
            if done.is_err() {
                // A successor leads: nothing later is written, nobody hears of it, and the
                // driver stops.
                let _ = self.parts.internal.send(Internal::Deposed);
                return;
            }
            if next.is_none() {
                next = rx.recv().await;
            }
        }
        if let Some(write) = self.model_write.take() {
            // A fenced write has told the driver itself.
            let _ = write.await;
        }
    }

    /// Makes the batches' transitions durable in one transaction, then starts their payload
    /// writes and closings and sends their replies.
    async fn batches(&mut self, batches: Vec<(Batch, Millis, u64)>) -> Result<(), Deposed> {
        let WriterParts { run_id, store, observer, .. } = &self.parts;
        let transitions: Vec<(&[Transition], Millis)> = batches
            .iter()
            .filter(|(batch, ..)| !batch.transitions.is_empty())
            .map(|(batch, now, _)| (batch.transitions.as_slice(), *now))
            .collect();
        if !transitions.is_empty() {
            let started = std::time::Instant::now();
            until_done("persist round transitions", *run_id, || {
                store.apply_transition_batches(*run_id, &transitions)
            })
            .await?;
            observer.store_latency("transitions", started.elapsed().as_secs_f64());
        }
        let last = batches.last().map_or(0, |(.., seq)| *seq);
        self.durable.store(last, Ordering::Release);
        for (batch, ..) in batches {
            // Concurrent with each other and with later batches' transitions: only the round
            // row they refer to had to come first.
            for write in batch.writes {
                tokio::spawn(write);
            }
            for closing in batch.closings {
                tokio::spawn(closing);
            }
            for reply in batch.replies {
                reply();
            }
        }
        Ok(())
    }

    /// Records a round's end after the previous model's bytes, publishes its model, tells the
    /// driver, and starts the new model's bytes write when it was committed by its hash.
    async fn end_round(&mut self, end: RoundEnd) -> Result<(), Deposed> {
        self.previous_model_written().await?;
        let RoundEnd { closing, outcome, opened_at, closing_started } = end;
        let WriterParts { run_id, store, observer, models, .. } = &self.parts;
        let (run_id, round_idx) = (*run_id, closing.round_idx);
        let mut deferred = None;
        let (label, committed) = match outcome {
            EndOutcome::Evaluated(pooled) => {
                until_done_or_landed("commit evaluation round", run_id, || {
                    store.commit_evaluation_round(run_id, closing, &pooled, now_ms())
                })
                .await?;
                tracing::info!(%run_id, round = %round_idx, reported = closing.n_reported, metrics = ?pooled.metrics, "evaluation round committed");
                ("evaluated", Closed::Evaluated)
            }
            EndOutcome::Committed(new) => {
                let NewModel { model, payload, state_bytes, metrics, evaluation, replayable, plan } =
                    *new;
                let bytes = match replayable {
                    true => ModelBytes::Later,
                    false => ModelBytes::Written {
                        model: &payload,
                        optimizer_state: state_bytes.as_deref(),
                    },
                };
                let commit = RoundCommit {
                    closing,
                    model_hash: &model.hash,
                    bytes,
                    metrics: &metrics,
                    evaluation: evaluation.as_ref(),
                };
                let started = std::time::Instant::now();
                until_done_or_landed("commit round", run_id, || {
                    store.commit_round(run_id, commit.clone(), now_ms())
                })
                .await?;
                observer.store_latency("commit_round", started.elapsed().as_secs_f64());
                tracing::info!(%run_id, round = %round_idx, reported = closing.n_reported, dropped = closing.n_dropped, ?metrics, "round committed");
                let version = ModelVersion(closing.model_version.0 + 1);
                if !replayable {
                    // Written in the commit: this round's payloads live on in it.
                    self.parts.release_payloads(version..=version);
                } else {
                    // Until its bytes are in the store (with the run's next checkpoint, if not
                    // now), only the cache can serve it.
                    models.hold_unwritten(run_id, &model.hash, payload.clone());
                    if plan.writes_model(version) {
                        let made_from = plan.versions_written_by(version);
                        deferred = Some((
                            version,
                            model.hash.clone(),
                            payload.clone(),
                            state_bytes,
                            made_from,
                        ));
                    }
                }
                // In the cache before the driver hears of it, so before the next round hands
                // out its hash (and while its bytes may still be on their way to the store).
                let (schema_id, download) = (plan.schema().schema_id(), plan.model_download());
                models
                    .publish(&model.hash, schema_id, payload, model.values.clone(), download)
                    .await;
                ("committed", Closed::Committed(model))
            }
            EndOutcome::Failed { stop_run, refused_by } => {
                let outcome = closing.outcome;
                if outcome == RoundOutcome::AggregateRejected {
                    tracing::error!(%run_id, round = %round_idx, "aggregate rejected; round fails");
                } else {
                    tracing::warn!(%run_id, round = %round_idx, ?outcome, "round failed");
                }
                until_done_or_landed("fail round", run_id, || {
                    store.fail_round(run_id, closing, &refused_by)
                })
                .await?;
                (outcome.label(), Closed::Failed { stop_run, refused_by })
            }
        };
        // Aggregation time is recorded for the rounds that produced something.
        let aggregation_ms = (!matches!(committed, Closed::Failed { .. }))
            .then(|| closing_started.elapsed().as_secs_f64() * 1e3);
        let open_ms = closing.closed_at - opened_at;
        observer.round_closed(run_id, round_idx, label, closing.n_dropped, open_ms, aggregation_ms);
        // Registered before the driver hears of the commit: a shutdown from then on waits for
        // the write.
        let in_flight = match deferred {
            Some(_) => Some(self.parts.writes_in_flight.0.clone().read_owned().await),
            None => None,
        };
        let _ = self.parts.internal.send(Internal::RoundClosed { run_id, round_idx, committed });
        // The next round is open; its commit waits for this write.
        if let Some((version, hash, model, state, made_from)) = deferred {
            let writer = self.parts.clone();
            self.model_write = Some(tokio::spawn(async move {
                let written =
                    writer.write_model(version, &hash, &model, state.as_deref(), made_from).await;
                drop(in_flight);
                if written.is_err() {
                    let _ = writer.internal.send(Internal::Deposed);
                }
                written
            }));
        }
        Ok(())
    }

    /// Writes a stopped run's newest model's bytes, unless they are in the store already.
    async fn last_model(&mut self, last: LastModel) -> Result<(), Deposed> {
        self.previous_model_written().await?;
        let LastModel { plan, version, hash, values, optimizer_state, in_flight } = last;
        let WriterParts { run_id, store, .. } = &self.parts;
        let run_id = *run_id;
        match store.model_still_to_be_written(run_id, version).await {
            Ok(false) => return Ok(()),
            Ok(true) => {}
            Err(e) => {
                tracing::warn!(%run_id, %version, error = %e, "checking a stopped run's last model failed; the next start writes it if need be");
                return Ok(());
            }
        }
        let on_thread = plan.clone();
        let EncodedModel { payload, hash: encoded_hash, state } =
            tokio::task::spawn_blocking(move || encoded(&on_thread, &values, &optimizer_state))
                .await
                .expect("encoding a model panicked");
        if encoded_hash != hash {
            // A bug: the driver's values are not the model it committed. The next start
            // rebuilds that one from the store instead.
            tracing::error!(%run_id, %version, committed = %hash, held = %encoded_hash, "a stopped run's model does not hash as committed; not written");
            return Ok(());
        }
        let made_from = plan.versions_written_by(version);
        self.parts.write_model(version, &hash, &payload, state.as_deref(), made_from).await?;
        tracing::info!(%run_id, %version, "a stopped run's last model written");
        drop(in_flight);
        Ok(())
    }

    /// Waits for the bytes of the model committed before, which every later write follows.
    async fn previous_model_written(&mut self) -> Result<(), Deposed> {
        match self.model_write.take() {
            Some(write) => write.await.expect("a model write panicked"),
            None => Ok(()),
        }
    }
}

impl WriterParts {
    /// Writes model `version`'s bytes (and the server's state after it); then the rounds that
    /// committed the versions `made_from` ([`ValidatedPlan::versions_written_by`]) release
    /// their payloads.
    async fn write_model(
        &self,
        version: ModelVersion,
        hash: &str,
        model: &[u8],
        optimizer_state: Option<&[u8]>,
        made_from: std::ops::RangeInclusive<ModelVersion>,
    ) -> Result<(), Deposed> {
        let WriterParts { run_id, store, observer, models, .. } = self;
        let started = std::time::Instant::now();
        until_done_or_landed("write committed model", *run_id, || {
            store.write_model(*run_id, version, hash, model, optimizer_state)
        })
        .await?;
        observer.store_latency("write_model", started.elapsed().as_secs_f64());
        models.written(*run_id, hash);
        self.release_payloads(made_from);
        Ok(())
    }

    /// Drops the payloads of the rounds that committed `versions` (whose bytes, or a later
    /// version's, are durable) off the round's path: the next round does not wait for the
    /// cohort's deltas to be dropped (the next start's sweep releases them if this does not
    /// land).
    fn release_payloads(&self, versions: std::ops::RangeInclusive<ModelVersion>) {
        let WriterParts { run_id, store, observer, .. } = self.clone();
        tokio::spawn(async move {
            let started = std::time::Instant::now();
            let (first, last) = versions.into_inner();
            match store.release_payloads_of_versions(run_id, first, last).await {
                Ok(_) => {
                    observer.store_latency("release_payloads", started.elapsed().as_secs_f64())
                }
                Err(e) => {
                    tracing::warn!(%run_id, version = %last, error = %e, "releasing committed rounds' payloads failed; the next start releases them")
                }
            }
        });
    }
}

/// The run's one retry-and-fence policy: `op` is retried with [`Backoff`] until it succeeds;
/// `Err` only when it was fenced off (another coordinator leads, and recovers the run itself).
pub(super) async fn until_done<T, F, Fut>(
    what: &str,
    run_id: RunId,
    mut op: F,
) -> Result<T, Deposed>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, StoreError>>,
{
    let mut backoff = Backoff::new(Duration::from_millis(50), Duration::from_secs(2));
    loop {
        match op().await {
            Ok(value) => return Ok(value),
            Err(e @ StoreError::Fenced { .. }) => {
                tracing::error!(%run_id, error = %e, "{what} fenced off; left to the new leader");
                return Err(Deposed);
            }
            Err(e) => {
                let delay = backoff.next_delay();
                tracing::error!(%run_id, error = %e, ?delay, "{what} failed; retrying");
                tokio::time::sleep(delay).await;
            }
        }
    }
}

/// [`until_done`] for a write that records something once: a conflict means an earlier attempt
/// whose answer was lost landed.
async fn until_done_or_landed<F, Fut>(what: &str, run_id: RunId, mut op: F) -> Result<(), Deposed>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<(), StoreError>>,
{
    until_done(what, run_id, || {
        let attempt = op();
        async move {
            match attempt.await {
                Err(StoreError::Conflict) => Ok(()),
                res => res,
            }
        }
    })
    .await
}
