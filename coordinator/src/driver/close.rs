//! Closing a round, off the driver task: aggregate (or unmask a secure round's sum, on a
//! blocking thread), apply it, encode the new model and commit it with the round's row and
//! pooled evaluation in one transaction; or record the failure. Store failures are retried
//! until the write lands or is fenced off.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use starling_core::codec;
use starling_core::fedavg::{Aggregate, AggregateError, PooledEvaluation};
use starling_core::plan::ValidatedPlan;
use starling_core::round::secure::{Record, SecureSum};
use starling_core::round::{RoundClosing, RoundOutcome};
use starling_core::strategy::OptimizerState;
use starling_core::{DeviceId, Millis, ModelVersion, RoundIdx, RunId};
use tokio::sync::{mpsc, oneshot};

use super::next_model::{EncodedModel, NextModel, encoded, next_model, replay_round};
use super::{Closed, CommittedModel, Internal, ModelWrites};
use crate::clock::now_ms;
use crate::model_cache::ModelCache;
use crate::observe::Observer;
use crate::store::{ModelBytes, RoundCommit, SqlStore, StoreError};

/// Aggregates and commits a closed round, retrying the store until it succeeds.
pub(super) struct CloseTask {
    pub(super) store: SqlStore,
    pub(super) observer: Observer,
    pub(super) opened_at: Millis,
    pub(super) run_id: RunId,
    pub(super) closing: RoundClosing,
    pub(super) finish: Finish,
    pub(super) global: Arc<Vec<f32>>,
    /// The server optimizer's state after producing `global`.
    pub(super) optimizer_state: Arc<OptimizerState>,
    pub(super) plan: Arc<ValidatedPlan>,
    pub(super) internal: mpsc::UnboundedSender<Internal>,
    /// Where a committed model goes for the next round's downloads.
    pub(super) models: ModelCache,
    /// Held from a round's closing until its model's bytes are written (or, for a version the
    /// plan's `checkpoint_interval` does not write, until it is committed), so that a run's
    /// models are written in order and a crash leaves at most `checkpoint_interval` of them to
    /// rebuild (the next round's commit waits for it).
    pub(super) model_writes: Arc<tokio::sync::Mutex<()>>,
    /// Every run's model writes, which a shutdown waits for.
    pub(super) writes_in_flight: ModelWrites,
}

/// A model committed by its hash ([`ModelBytes::Later`]), to be written after the driver
/// hears of the commit.
struct DeferredWrite {
    version: ModelVersion,
    hash: String,
    model: Bytes,
    optimizer_state: Option<Vec<u8>>,
}

impl CloseTask {
    pub(super) async fn run(self) {
        let CloseTask {
            store,
            observer,
            opened_at,
            run_id,
            closing,
            finish,
            global,
            optimizer_state,
            plan,
            internal,
            models,
            model_writes,
            writes_in_flight,
        } = self;
        let writing = model_writes.lock_owned().await;
        let round_idx = closing.round_idx;
        let closing_started = std::time::Instant::now();
        let open_ms = closing.closed_at - opened_at;
        let commits = matches!(closing.outcome, RoundOutcome::Commit);
        // The next model is determined by durable inputs unless a secure round's unmasking
        // (whose records the commit deletes) or a DP run's fresh noise went into it.
        let replayable = !matches!(finish, Finish::Unmask(_)) && plan.privacy().is_none();
        let mut deferred = None;
        let (aggregate, evaluation) =
            finish.aggregate(commits, &store, run_id, round_idx, (&plan, &optimizer_state)).await;
        // Each arm writes the round's end (retried until it lands or is fenced off) and says
        // how it ended; what follows the write is the same for all.
        let (written, label, committed) = match (closing.outcome, aggregate) {
            (RoundOutcome::Commit, Ok(aggregate)) if plan.plan().evaluation_only => {
                // The devices' reports pooled; the model stays as it is.
                let pooled = PooledEvaluation {
                    n_devices: aggregate.n_updates,
                    example_count: aggregate.total_weight,
                    metrics: aggregate.metrics,
                };
                let written = retry_store("commit evaluation round", run_id, || {
                    store.commit_evaluation_round(run_id, closing, &pooled, now_ms())
                })
                .await;
                if written.is_ok() {
                    tracing::info!(%run_id, round = %round_idx, reported = closing.n_reported, metrics = ?pooled.metrics, "evaluation round committed");
                }
                (written, "evaluated", Closed::Evaluated)
            }
            (RoundOutcome::Commit, Ok(aggregate)) => {
                let (reader, handle) = (store.clone(), tokio::runtime::Handle::current());
                let (schema_id, download) = (plan.schema().schema_id(), plan.model_download());
                let on_thread = plan.clone();
                let prepared = tokio::task::spawn_blocking(move || {
                    let plan = &on_thread;
                    let metrics = aggregate.metrics.clone();
                    let (values, state) = next_model(
                        &NextModel { store: reader, handle, run_id, round_idx, plan },
                        &global,
                        aggregate,
                        &optimizer_state,
                    )?;
                    let EncodedModel { payload: encoded, hash, state: state_bytes } =
                        encoded(plan, &values, &state);
                    Ok::<_, AggregateError>((values, encoded, hash, metrics, state, state_bytes))
                })
                .await
                .expect("aggregation task panicked");
                match prepared {
                    Ok((values, encoded, hash, metrics, state, state_bytes)) => {
                        let payload = Bytes::from(encoded);
                        let bytes = match replayable {
                            true => ModelBytes::Later,
                            false => ModelBytes::Written {
                                model: &payload,
                                optimizer_state: state_bytes.as_deref(),
                            },
                        };
                        let commit = RoundCommit {
                            closing,
                            model_hash: &hash,
                            bytes,
                            metrics: &metrics,
                            evaluation: evaluation.as_ref(),
                        };
                        let commit_started = std::time::Instant::now();
                        let written = retry_store("commit round", run_id, || {
                            store.commit_round(run_id, commit.clone(), now_ms())
                        })
                        .await;
                        let values = Arc::new(values);
                        if written.is_ok() {
                            let seconds = commit_started.elapsed().as_secs_f64();
                            observer.store_latency("commit_round", seconds);
                            tracing::info!(%run_id, round = %round_idx, reported = closing.n_reported, dropped = closing.n_dropped, ?metrics, "round committed");
                            let version = ModelVersion(closing.model_version.0 + 1);
                            if !replayable {
                                // Written in the commit: this round's payloads live on in it.
                                release_payloads(&store, &observer, run_id, version..=version);
                            } else {
                                // Until its bytes are in the store (with the run's next
                                // checkpoint, if not now), only the cache can serve it.
                                models.hold_unwritten(run_id, &hash, payload.clone());
                                if plan.writes_model(version) {
                                    deferred = Some(DeferredWrite {
                                        version,
                                        hash: hash.clone(),
                                        model: payload.clone(),
                                        optimizer_state: state_bytes,
                                    });
                                }
                            }
                            // In the cache before the driver hears of it, so before the next
                            // round hands out its hash (and while its bytes may still be
                            // on their way to the store).
                            models
                                .publish(&hash, schema_id, payload, values.clone(), download)
                                .await;
                        }
                        let model =
                            CommittedModel { values, hash, optimizer_state: Arc::new(state) };
                        (written, "committed", Closed::Committed(model))
                    }
                    Err(e) => {
                        tracing::error!(%run_id, round = %round_idx, error = %e, "aggregate rejected; round fails");
                        // Stored as what happened, not as the commit the machine asked for.
                        let closing =
                            RoundClosing { outcome: RoundOutcome::AggregateRejected, ..closing };
                        let written =
                            retry_store("fail round", run_id, || store.fail_round(run_id, closing))
                                .await;
                        (written, RoundOutcome::AggregateRejected.label(), Closed::Failed)
                    }
                }
            }
            (outcome, _) => {
                tracing::warn!(%run_id, round = %round_idx, ?outcome, "round failed");
                let written =
                    retry_store("fail round", run_id, || store.fail_round(run_id, closing)).await;
                (written, outcome.label(), Closed::Failed)
            }
        };
        if written.is_err() {
            let _ = internal.send(Internal::Deposed);
            return;
        }
        // Aggregation time is recorded for the rounds that produced something.
        let aggregation_ms = (!matches!(committed, Closed::Failed))
            .then(|| closing_started.elapsed().as_secs_f64() * 1e3);
        observer.round_closed(run_id, round_idx, label, closing.n_dropped, open_ms, aggregation_ms);
        // Registered before the driver hears of the commit: a shutdown from then on waits for
        // the write.
        let in_flight = match deferred {
            Some(_) => Some(writes_in_flight.0.clone().read_owned().await),
            None => None,
        };
        let _ = internal.send(Internal::RoundClosed { run_id, round_idx, committed });
        // The next round is open; its commit waits for this write (`writing`).
        if let Some(write) = deferred {
            let DeferredWrite { version, hash, model, optimizer_state } = write;
            let state = optimizer_state.as_deref();
            let write = ModelWrite { store: &store, observer: &observer, models: &models, run_id };
            let made_from = plan.versions_written_by(version);
            let written = write.write(version, &hash, &model, state, made_from).await;
            drop((writing, in_flight));
            if written.is_err() {
                let _ = internal.send(Internal::Deposed);
            }
        }
    }
}

/// Writing a committed model's bytes after its commit, and what follows once they are in.
pub(super) struct ModelWrite<'a> {
    pub(super) store: &'a SqlStore,
    pub(super) observer: &'a Observer,
    pub(super) models: &'a ModelCache,
    pub(super) run_id: RunId,
}

impl ModelWrite<'_> {
    /// Writes model `version`'s bytes (and the server's state after it), retrying until they
    /// land; then the rounds that committed the versions `made_from`
    /// ([`ValidatedPlan::versions_written_by`]) release their payloads, off the round's path.
    /// `Err` only when the write was fenced off.
    pub(super) async fn write(
        &self,
        version: ModelVersion,
        hash: &str,
        model: &[u8],
        optimizer_state: Option<&[u8]>,
        made_from: std::ops::RangeInclusive<ModelVersion>,
    ) -> Result<(), Deposed> {
        let ModelWrite { store, observer, models, run_id } = *self;
        let started = std::time::Instant::now();
        retry_store("write committed model", run_id, || {
            store.write_model(run_id, version, hash, model, optimizer_state)
        })
        .await?;
        observer.store_latency("write_model", started.elapsed().as_secs_f64());
        models.written(run_id, hash);
        release_payloads(store, observer, run_id, made_from);
        Ok(())
    }
}

/// Drops the payloads of the rounds that committed `versions` (whose bytes, or a later
/// version's, are durable) off the round's path: the next round does not wait for the
/// cohort's deltas to be dropped (the next start's sweep releases them if this does not land).
fn release_payloads(
    store: &SqlStore,
    observer: &Observer,
    run_id: RunId,
    versions: std::ops::RangeInclusive<ModelVersion>,
) {
    let (store, observer) = (store.clone(), observer.clone());
    tokio::spawn(async move {
        let started = std::time::Instant::now();
        let (first, last) = versions.into_inner();
        match store.release_payloads_of_versions(run_id, first, last).await {
            Ok(_) => observer.store_latency("release_payloads", started.elapsed().as_secs_f64()),
            Err(e) => {
                tracing::warn!(%run_id, version = %last, error = %e, "releasing committed rounds' payloads failed; the next start releases them")
            }
        }
    });
}

/// Where a closed round's aggregate comes from.
pub(super) enum Finish {
    /// The run's accumulator thread, folding the round's updates.
    Accumulated(oneshot::Receiver<Result<Aggregate, AggregateError>>),
    /// A secure round's checked unmasking.
    Unmask(SecureSum),
    /// The round's durable updates and partials, read back from the store and folded in slot
    /// order (an update the accumulator folded was not persisted).
    Replayed,
}

impl Finish {
    /// The round's aggregate, and a secure round's pooled evaluation (committed with it). A
    /// secure sum is unmasked on a blocking thread (model-sized work: withdrawn devices'
    /// vectors taken out, a keystream expanded per mask), and only when the round commits.
    async fn aggregate(
        self,
        commits: bool,
        store: &SqlStore,
        run_id: RunId,
        round_idx: RoundIdx,
        (plan, state): (&ValidatedPlan, &OptimizerState),
    ) -> (Result<Aggregate, AggregateError>, Option<PooledEvaluation>) {
        match self {
            Finish::Accumulated(rx) => (rx.await.unwrap_or(Err(AggregateError::Empty)), None),
            Finish::Replayed if !commits => (Err(AggregateError::Empty), None),
            Finish::Replayed => {
                let mut backoff = Duration::from_millis(50);
                loop {
                    let mut acc = plan.accumulator(state);
                    match replay_round(store, plan, run_id, round_idx, &mut acc).await {
                        Ok(replayed) => {
                            tracing::warn!(%run_id, round = %round_idx, replayed, "an update folded as its write began was not persisted; the round's sum was read back from the store");
                            return (acc.finish(), None);
                        }
                        Err(e) => {
                            tracing::error!(%run_id, round = %round_idx, error = %e, ?backoff, "reading the round's updates back failed; retrying");
                            tokio::time::sleep(backoff).await;
                            backoff = (backoff * 2).min(Duration::from_secs(2));
                        }
                    }
                }
            }
            Finish::Unmask(_) if !commits => (Err(AggregateError::Empty), None),
            Finish::Unmask(sum) => {
                let withdrawn = match withdrawn_inputs(&sum, store, run_id, round_idx).await {
                    Ok(w) => w,
                    Err(e) => return (Err(AggregateError::Secure(e.to_string())), None),
                };
                match tokio::task::spawn_blocking(move || sum.finish(&withdrawn)).await {
                    Ok(Ok((aggregate, evaluation))) => (Ok(aggregate), evaluation),
                    Ok(Err(e)) => (Err(e), None),
                    Err(panicked) => std::panic::resume_unwind(panicked.into_panic()),
                }
            }
        }
    }
}

/// The masked vectors a secure round must take back out of its running sum (devices a
/// neighbour could not open shares from), read from the round's records; none in an honest
/// round, which reads nothing.
async fn withdrawn_inputs(
    sum: &SecureSum,
    store: &SqlStore,
    run_id: RunId,
    round_idx: RoundIdx,
) -> Result<BTreeMap<DeviceId, Vec<u32>>, StoreError> {
    let mut withdrawn = BTreeMap::new();
    if sum.withdrawn_devices().next().is_none() {
        return Ok(withdrawn);
    }
    store
        .for_each_secagg_record(run_id, round_idx, |bytes| match codec::decode::<Record>(&bytes) {
            Ok(record) => withdrawn.extend(sum.withdrawn_input(&record)),
            Err(e) => {
                tracing::error!(%run_id, round = %round_idx, error = %e, "a stored secure-aggregation record does not decode")
            }
        })
        .await?;
    Ok(withdrawn)
}

/// Another coordinator leads: a write was fenced off.
#[derive(Debug)]
pub(super) struct Deposed;

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

/// A run that ended (stopped by its operator) with its newest model committed by its hash
/// alone, between two written versions of the plan's `checkpoint_interval`: its bytes are
/// written now, from the values the driver holds, so the run's last model can be exported
/// without a restart rebuilding it. (A finished run's last version is written by its commit.)
pub(super) struct LastModelWrite {
    pub(super) store: SqlStore,
    pub(super) observer: Observer,
    pub(super) models: ModelCache,
    pub(super) run_id: RunId,
    pub(super) plan: Arc<ValidatedPlan>,
    pub(super) version: ModelVersion,
    pub(super) hash: String,
    pub(super) values: Arc<Vec<f32>>,
    pub(super) optimizer_state: Arc<OptimizerState>,
    /// The run's model-write lock: taken first, so any close task's write lands before.
    pub(super) model_writes: Arc<tokio::sync::Mutex<()>>,
}

impl LastModelWrite {
    pub(super) async fn run(self) {
        let LastModelWrite { store, observer, models, run_id, plan, version, hash, .. } = &self;
        let _writing = self.model_writes.clone().lock_owned().await;
        match store.model_still_to_be_written(*run_id, *version).await {
            Ok(false) => return,
            Ok(true) => {}
            Err(e) => {
                tracing::warn!(%run_id, %version, error = %e, "checking a stopped run's last model failed; the next start writes it if need be");
                return;
            }
        }
        let (on_thread, values, state) =
            (plan.clone(), self.values.clone(), self.optimizer_state.clone());
        let (encoded, encoded_hash, state_bytes) = tokio::task::spawn_blocking(move || {
            let EncodedModel { payload, hash, state } = encoded(&on_thread, &values, &state);
            (payload, hash, state)
        })
        .await
        .expect("encoding a model panicked");
        if encoded_hash != *hash {
            // A bug: the driver's values are not the model it committed. The next start
            // rebuilds that one from the store instead.
            tracing::error!(%run_id, %version, committed = %hash, held = %encoded_hash, "a stopped run's model does not hash as committed; not written");
            return;
        }
        let write = ModelWrite { store, observer, models, run_id: *run_id };
        let made_from = plan.versions_written_by(*version);
        if write.write(*version, hash, &encoded, state_bytes.as_deref(), made_from).await.is_ok() {
            tracing::info!(%run_id, %version, "a stopped run's last model written");
        }
    }
}
