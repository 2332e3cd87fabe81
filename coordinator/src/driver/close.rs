//! Closing a round, off the driver task: aggregate (or unmask a secure round's sum, on a
//! blocking thread), apply the strategy and encode the new model, or say why the round fails;
//! then hand the round's end to the run's writer, which records it.

use std::collections::BTreeMap;
use std::sync::Arc;

use bytes::Bytes;
use starling_core::codec;
use starling_core::fedavg::{Aggregate, AggregateError, PooledEvaluation};
use starling_core::plan::ValidatedPlan;
use starling_core::round::secure::{Record, SecureSum};
use starling_core::round::{RoundClosing, RoundOutcome};
use starling_core::strategy::OptimizerState;
use starling_core::{DeviceId, Millis, RoundIdx, RunId};
use tokio::sync::oneshot;

use super::CommittedModel;
use super::next_model::{EncodedModel, NextModel, encoded, next_model, replay_round};
use super::writer::{EndOutcome, NewModel, RoundEnd, RoundEnds, until_done};
use crate::store::{SqlStore, StoreError, StoredContribution};

/// Aggregates a closed round and hands its end to the run's writer.
pub(super) struct CloseTask {
    pub(super) store: SqlStore,
    pub(super) opened_at: Millis,
    pub(super) run_id: RunId,
    pub(super) closing: RoundClosing,
    pub(super) finish: Finish,
    pub(super) global: Arc<Vec<f32>>,
    /// The server optimizer's state after producing `global`.
    pub(super) optimizer_state: Arc<OptimizerState>,
    pub(super) plan: Arc<ValidatedPlan>,
    /// The run's writer, which records the end in round order.
    pub(super) ends: RoundEnds,
}

impl CloseTask {
    pub(super) async fn run(self) {
        let CloseTask {
            store,
            opened_at,
            run_id,
            closing,
            finish,
            global,
            optimizer_state,
            plan,
            ends,
        } = self;
        let round_idx = closing.round_idx;
        let closing_started = std::time::Instant::now();
        let commits = matches!(closing.outcome, RoundOutcome::Commit);
        // The next model is determined by durable inputs unless a secure round's unmasking
        // (whose records the commit deletes) or a DP run's fresh noise went into it.
        let secure = matches!(finish, Finish::Unmask(_));
        let replayable = !secure && plan.privacy().is_none();
        let (aggregate, evaluation) =
            finish.aggregate(commits, &store, run_id, round_idx, (&plan, &optimizer_state)).await;
        // What a round asked to commit records: the devices' reports pooled, or the next model.
        let made = async {
            let aggregate = aggregate?;
            if plan.plan().evaluation_only {
                // The model stays as it is.
                return Ok::<_, AggregateError>(EndOutcome::Evaluated(PooledEvaluation {
                    n_devices: aggregate.n_updates,
                    example_count: aggregate.total_weight,
                    metrics: aggregate.metrics,
                }));
            }
            // A DP run releases only what was noised: its model, and its metrics when the plan
            // says so.
            let in_clear = plan.releases_device_metrics();
            let (reader, handle) = (store.clone(), tokio::runtime::Handle::current());
            let on_thread = plan.clone();
            let (model, payload, (metrics, evaluation), state_bytes) =
                tokio::task::spawn_blocking(move || {
                    let plan = &on_thread;
                    let clear_metrics = in_clear.then(|| aggregate.metrics.clone());
                    let (values, state, noised) = next_model(
                        &NextModel { store: reader, handle, run_id, round_idx, plan },
                        &global,
                        aggregate,
                        &optimizer_state,
                    )?;
                    let released = match clear_metrics {
                        Some(metrics) => (metrics, evaluation),
                        None => (noised.metrics, noised.evaluation.map(PooledEvaluation::from)),
                    };
                    let EncodedModel { payload, hash, state: state_bytes } =
                        encoded(plan, &values, &state);
                    let model = CommittedModel {
                        values: Arc::new(values),
                        hash,
                        optimizer_state: Arc::new(state),
                    };
                    Ok::<_, AggregateError>((model, payload, released, state_bytes))
                })
                .await
                .map_err(|panicked| AggregateError::Broken(panic_message(panicked)))??;
            Ok(EndOutcome::Committed(Box::new(NewModel {
                model,
                payload: Bytes::from(payload),
                state_bytes,
                metrics,
                evaluation,
                replayable,
                plan: plan.clone(),
            })))
        };
        let (closing, outcome) = match closing.outcome {
            RoundOutcome::Commit => match made.await {
                Ok(outcome) => (closing, outcome),
                Err(e) => {
                    tracing::error!(%run_id, round = %round_idx, error = %e, "aggregate rejected");
                    // Stored as what happened, not as the commit the machine asked for. A close
                    // that broke outright would break the same way every round: the run stops.
                    let stop_run =
                        matches!(e, AggregateError::Broken(_) | AggregateError::Noise(_))
                            .then(|| format!("round {round_idx}: {e}"));
                    // A model pushed out of bounds is traced to the updates that did it, when
                    // the round's updates are stored one by one (not masked, not partials).
                    let traceable = matches!(
                        e,
                        AggregateError::NonFinite(_) | AggregateError::ModelNormGrowth { .. }
                    ) && !secure;
                    let refused_by = match traceable {
                        true => culprits(&store, &plan, run_id, round_idx).await,
                        false => vec![],
                    };
                    if !refused_by.is_empty() {
                        tracing::warn!(%run_id, round = %round_idx, devices = ?refused_by, "the refusal is these devices' updates, far larger than the round's others");
                    }
                    let outcome = EndOutcome::Failed { stop_run, refused_by };
                    (RoundClosing { outcome: RoundOutcome::AggregateRejected, ..closing }, outcome)
                }
            },
            _ => (closing, EndOutcome::Failed { stop_run: None, refused_by: vec![] }),
        };
        ends.send(RoundEnd { closing, outcome, opened_at, closing_started }).await;
    }
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
                let replayed = until_done("read the round's updates back", run_id, || async {
                    let mut acc = plan.accumulator(state);
                    let replayed = replay_round(store, plan, run_id, round_idx, &mut acc).await?;
                    Ok((replayed, acc))
                })
                .await;
                match replayed {
                    Ok((replayed, acc)) => {
                        tracing::warn!(%run_id, round = %round_idx, replayed, "an update folded as its write began was not persisted; the round's sum was read back from the store");
                        (acc.finish(), None)
                    }
                    // Reads are never fenced off.
                    Err(_) => (Err(AggregateError::Empty), None),
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
                    Err(panicked) => (Err(AggregateError::Broken(panic_message(panicked))), None),
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

/// What a panicked task said, for a run's stop reason.
fn panic_message(panicked: tokio::task::JoinError) -> String {
    match panicked.try_into_panic() {
        Ok(payload) => super::panic_text(payload.as_ref()),
        Err(cancelled) => cancelled.to_string(),
    }
}

/// An update is traced as the cause of a refusal when its L2 norm is over this many times the
/// median of its round's.
const CULPRIT_FACTOR: f64 = 10.0;

/// The devices of a refused round whose stored updates are far larger than the round's others
/// ([`CULPRIT_FACTOR`] times the median norm); empty when none stands out (or the updates
/// cannot be read), and then every device of the round is struck.
async fn culprits(
    store: &SqlStore,
    plan: &ValidatedPlan,
    run_id: RunId,
    round_idx: RoundIdx,
) -> Vec<DeviceId> {
    let (schema, compression) = (plan.update_schema().clone(), plan.compression());
    let mut norms: Vec<(DeviceId, f64)> = vec![];
    let read = store
        .for_each_update(run_id, round_idx, |stored| {
            let StoredContribution::Update(u) = stored else { return Ok(()) };
            let decoded = starling_core::fedavg::validate_parts(
                &schema,
                compression,
                u.delta,
                1,
                Default::default(),
            );
            if let Ok(update) = decoded {
                norms.push((DeviceId(u.device_id), update.norm()));
            }
            Ok(())
        })
        .await;
    // An update stored in a group kept its norm beside its row.
    let grouped = store.grouped_update_norms(run_id, round_idx).await;
    let read = read.and(grouped).map(|grouped| norms.extend(grouped));
    if read.is_err() || norms.len() < 2 {
        return vec![];
    }
    let mut sorted: Vec<f64> = norms.iter().map(|(_, n)| *n).collect();
    sorted.sort_by(f64::total_cmp);
    let median = sorted[sorted.len() / 2];
    norms.into_iter().filter(|&(_, n)| n > CULPRIT_FACTOR * median).map(|(d, _)| d).collect()
}
