//! Closing a round, off the driver task: aggregate (or take a secure round's unmasked sum),
//! apply it, encode the new model and commit it with the round's row and pooled evaluation in
//! one transaction; or record the failure. Store failures are retried until the write lands or
//! is fenced off.

use std::sync::Arc;
use std::time::Duration;

use starling_core::fedavg::{Aggregate, AggregateError, PooledEvaluation};
use starling_core::plan::ValidatedPlan;
use starling_core::round::{RoundClosing, RoundOutcome};
use starling_core::strategy::OptimizerState;
use starling_core::{Millis, RunId};
use tokio::sync::{mpsc, oneshot};

use super::{Closed, CommittedModel, Internal, encode_model};
use crate::clock::now_ms;
use crate::observe::Observer;
use crate::store::{RoundCommit, SqlStore, StoreError};

/// Aggregates and commits a closed round, retrying the store until it succeeds.
pub(super) struct CloseTask {
    pub(super) store: SqlStore,
    pub(super) observer: Observer,
    pub(super) opened_at: Millis,
    pub(super) run_id: RunId,
    pub(super) closing: RoundClosing,
    pub(super) finish: oneshot::Receiver<Result<Aggregate, AggregateError>>,
    /// A secure round's pooled evaluation, committed with the round.
    pub(super) evaluation: Option<PooledEvaluation>,
    pub(super) global: Arc<Vec<f32>>,
    /// The server optimizer's state after producing `global`.
    pub(super) optimizer_state: Arc<OptimizerState>,
    pub(super) plan: Arc<ValidatedPlan>,
    pub(super) internal: mpsc::UnboundedSender<Internal>,
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
            evaluation,
            global,
            optimizer_state,
            plan,
            internal,
        } = self;
        let round_idx = closing.round_idx;
        let closing_started = std::time::Instant::now();
        let open_ms = closing.closed_at - opened_at;
        let aggregate = finish.await.unwrap_or(Err(AggregateError::Empty));
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
                let prepared = tokio::task::spawn_blocking(move || {
                    let p = plan.plan();
                    let optimizer = p.strategy.optimizer;
                    let (values, state) = optimizer.step(
                        &global,
                        &aggregate,
                        &optimizer_state,
                        p.server_learning_rate,
                    )?;
                    let (encoded, hash) = encode_model(plan.schema(), &values);
                    let state_bytes = optimizer.is_stateful().then(|| state.to_bytes());
                    Ok::<_, AggregateError>((
                        values,
                        encoded,
                        hash,
                        aggregate.metrics,
                        state,
                        state_bytes,
                    ))
                })
                .await
                .expect("aggregation task panicked");
                match prepared {
                    Ok((values, encoded, hash, metrics, state, state_bytes)) => {
                        let commit = RoundCommit {
                            closing,
                            model: &encoded,
                            model_hash: &hash,
                            metrics: &metrics,
                            evaluation: evaluation.as_ref(),
                            optimizer_state: state_bytes.as_deref(),
                        };
                        let commit_started = std::time::Instant::now();
                        let written = retry_store("commit round", run_id, || {
                            store.commit_round(run_id, commit.clone(), now_ms())
                        })
                        .await;
                        if written.is_ok() {
                            let seconds = commit_started.elapsed().as_secs_f64();
                            observer.store_latency("commit_round", seconds);
                            tracing::info!(%run_id, round = %round_idx, reported = closing.n_reported, dropped = closing.n_dropped, ?metrics, "round committed");
                        }
                        let model = CommittedModel {
                            values: Arc::new(values),
                            hash,
                            optimizer_state: Arc::new(state),
                        };
                        (written, "committed", Closed::Committed(model))
                    }
                    Err(e) => {
                        tracing::error!(%run_id, round = %round_idx, error = %e, "aggregate rejected; round fails");
                        let written =
                            retry_store("fail round", run_id, || store.fail_round(run_id, closing))
                                .await;
                        (written, "aggregate_rejected", Closed::Failed)
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
