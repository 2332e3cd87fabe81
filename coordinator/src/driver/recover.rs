//! A starting coordinator rebuilds every running run from the store: latest model (writing the
//! bytes of one committed by its hash alone, from its round's kept updates), open round, its
//! selections and secure-aggregation records, and its stored updates and partials replayed
//! into a fresh accumulator in slot order, so the round commits what it would have without the
//! restart.

use std::collections::BTreeMap;
use std::sync::Arc;

use starling_core::codec;
use starling_core::fedavg::AggregateError;
use starling_core::plan::{Plan, PlanError, ValidatedPlan};
use starling_core::round::secure::Record;
use starling_core::round::{OpenRoundSnapshot, RunMachine, RunSnapshot};
use starling_core::strategy::OptimizerState;
use starling_core::tensor::TensorPayload;
use starling_core::{ModelVersion, RoundIdx, RunId};
use tokio::sync::mpsc;

use super::next_model::{EncodedModel, NextModel, encoded, next_model, replay_round};
use super::{Driver, DriverHandle, ModelWrites, RunEntry, entropy};
use crate::clock::now_ms;
use crate::model_cache::ModelCache;
use crate::observe::Observer;
use crate::store::{PendingModel, SqlStore, StoreError, Transition};
use crate::tier::{AggregatorRegistry, TierSettings};

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
            models: ModelCache::default(),
            model_writes: ModelWrites::default(),
        };
        let unrebuilt = rebuild_pending_models(&driver.store).await?;
        for row in driver.store.running_runs().await? {
            let run_id = RunId(row.id);
            if let Some(why) = unrebuilt.get(&run_id) {
                let reason = format!("a committed model cannot be rebuilt: {why}");
                stop_at_recovery(&driver.store, run_id, reason).await?;
                continue;
            }
            let plan = match stored_plan(run_id, &row.plan_json)? {
                Ok(plan) => plan,
                Err(refused) => {
                    let reason =
                        format!("this coordinator refuses the run's stored plan: {refused}");
                    stop_at_recovery(&driver.store, run_id, reason).await?;
                    continue;
                }
            };
            let version = ModelVersion(row.model_version);
            // A model or server state this version cannot read (corrupt, or stored in an older
            // layout) stops that run with the reason; the other runs and the process go on.
            let (payload, values, state) =
                match stored_model(&driver.store, &plan, run_id, version).await {
                    Ok(found) => found,
                    Err(e @ (StoreError::Corrupt(_) | StoreError::ModelPending { .. })) => {
                        let reason = format!("the run's latest model cannot be resumed: {e}");
                        stop_at_recovery(&driver.store, run_id, reason).await?;
                        continue;
                    }
                    Err(e) => return Err(e),
                };
            let open = driver.store.open_round(run_id).await?;
            let next_round_idx = driver
                .store
                .last_round_idx(run_id)
                .await?
                .map_or(RoundIdx(0), |r| RoundIdx(r.0 + 1));
            let mut acc = plan.accumulator(&state);
            if let Some(open) = &open {
                let replayed =
                    replay_round(&driver.store, &plan, run_id, open.round.round_idx, &mut acc)
                        .await?;
                tracing::info!(%run_id, round = %open.round.round_idx, replayed, selected = open.selected.len(), "resuming open round");
            }
            // An asynchronous run's devices still training on an earlier buffer's model.
            let carried = match plan.plan().asynchronous {
                None => vec![],
                Some(a) => {
                    let oldest = ModelVersion(version.0 - i64::from(a.max_staleness));
                    driver.store.carried_tasks(run_id, oldest).await?
                }
            };
            let strikes = driver.store.quarantine_strikes(run_id).await?;
            // A blt_ftrl run's rule counts every selection the store holds, this run's
            // earlier leaders' included.
            let participations = match plan.round_config().participation_rule {
                Some(_) => driver.store.participation_history(run_id).await?,
                None => Default::default(),
            };
            let snapshot = RunSnapshot {
                participations,
                carried,
                strikes,
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
            let mut entry = RunEntry::new(
                machine,
                Arc::new(plan),
                Arc::new(values),
                payload.content_hash(),
                state,
                acc,
                driver.writer_for(run_id),
            );
            entry.report_privacy(run_id, &driver.observer, now_ms());
            driver.runs.insert(run_id, entry);
        }
        let (models, model_writes) = (driver.models.clone(), driver.model_writes.clone());
        Ok((driver, DriverHandle { tx, models, model_writes }))
    }
}

/// A stored model version's payload and values, and the server's state after producing it
/// (optimizer moments, a DP run's clip norm) from which the run continues.
async fn stored_model(
    store: &SqlStore,
    plan: &ValidatedPlan,
    run_id: RunId,
    version: ModelVersion,
) -> Result<(TensorPayload, Vec<f32>, OptimizerState), StoreError> {
    let encoded = store
        .model(run_id, version)
        .await?
        .ok_or_else(|| StoreError::Corrupt(format!("run {run_id} lacks model {version}")))?;
    let payload: TensorPayload = codec::decode(&encoded)
        .map_err(|e| StoreError::Corrupt(format!("model of run {run_id}: {e}")))?;
    let values = plan
        .schema()
        .decode_f32(&payload)
        .map_err(|e| StoreError::Corrupt(format!("model of run {run_id}: {e}")))?;
    let strategy = &plan.plan().strategy;
    let state = match store.optimizer_state(run_id, version).await? {
        _ if !strategy.is_stateful() => strategy.initial_state(values.len()),
        Some(bytes) => OptimizerState::from_bytes(&bytes, strategy, values.len())
            .map_err(|e| StoreError::Corrupt(format!("run {run_id}: {e}")))?,
        None if version == ModelVersion(0) => strategy.initial_state(values.len()),
        None => {
            return Err(StoreError::Corrupt(format!(
                "run {run_id} lacks the optimizer state of model {version}"
            )));
        }
    };
    Ok((payload, values, state))
}

/// Writes the bytes of every model committed by its hash alone whose write a stop interrupted,
/// each run's oldest first (each is rebuilt from the one before), whatever the run's status.
/// A run whose model cannot be rebuilt (its plan refused, or the rebuild not hashing as the
/// commit: the store is corrupt) keeps it unwritten and is returned with the reason, and its
/// later models are not tried; the other runs' are rebuilt.
async fn rebuild_pending_models(store: &SqlStore) -> Result<BTreeMap<RunId, String>, StoreError> {
    let mut plans: BTreeMap<i64, Arc<ValidatedPlan>> = BTreeMap::new();
    let mut unrebuilt = BTreeMap::new();
    for pending in store.pending_models().await? {
        let run_id = RunId(pending.run_id);
        if unrebuilt.contains_key(&run_id) {
            continue;
        }
        let plan = match plans.get(&run_id.0) {
            Some(plan) => Ok(plan.clone()),
            None => {
                let row = store.run(run_id).await?.ok_or_else(|| {
                    StoreError::Corrupt(format!("a model of run {run_id}, no run"))
                })?;
                stored_plan(run_id, &row.plan_json)?.map(Arc::new).map_err(|refused| {
                    format!("this coordinator refuses the run's stored plan: {refused}")
                })
            }
        };
        let rebuilt = match plan {
            Ok(plan) => {
                plans.insert(run_id.0, plan.clone());
                match rebuild_model(store, &plan, run_id, pending).await {
                    Err(StoreError::Corrupt(what)) => Err(what),
                    rebuilt => Ok(rebuilt?),
                }
            }
            Err(refused) => Err(refused),
        };
        if let Err(why) = rebuilt {
            tracing::error!(%run_id, error = %why, "a model whose write a stop interrupted cannot be rebuilt");
            unrebuilt.insert(run_id, why);
        }
    }
    Ok(unrebuilt)
}

/// Stops a running run this version of the coordinator cannot resume, failing its open round,
/// with `reason`: a stored plan it refuses (a newer bound, such as the memory an order
/// statistic may take at close), or a latest model or server state it cannot read. Resuming
/// it could only fail the same way at every start (an order statistic that does not fit kills
/// the process at each close), and refusing to start would stop every other run.
async fn stop_at_recovery(
    store: &SqlStore,
    run_id: RunId,
    reason: String,
) -> Result<(), StoreError> {
    tracing::error!(%run_id, %reason, "stopping the run instead of resuming it");
    let open_round = store.open_round(run_id).await?.map(|o| o.round.round_idx);
    let transition = Transition::StopRun { open_round, reason: Some(reason) };
    store.apply_transitions(run_id, &[transition], now_ms()).await
}

/// A run's plan as stored, validated again: an error when it does not parse (corruption), and
/// within, the refusal of a plan this version does not accept (a bound added since).
fn stored_plan(
    run_id: RunId,
    plan_json: &str,
) -> Result<Result<ValidatedPlan, PlanError>, StoreError> {
    let plan: Plan = serde_json::from_str(plan_json)
        .map_err(|e| StoreError::Corrupt(format!("plan of run {run_id}: {e}")))?;
    Ok(plan.validate())
}

/// Writes the bytes of a model its round committed by hash alone when the coordinator stopped
/// before writing them: the previous model and server state, the round's updates (kept for
/// this) replayed in slot order, the same aggregation and server step. Refused, as corruption,
/// unless the result hashes as the commit recorded.
async fn rebuild_model(
    store: &SqlStore,
    plan: &Arc<ValidatedPlan>,
    run_id: RunId,
    pending: PendingModel,
) -> Result<(), StoreError> {
    let (version, round_idx) = (ModelVersion(pending.version), RoundIdx(pending.round_idx));
    let corrupt = move |what: String| {
        StoreError::Corrupt(format!("rebuilding model {version} of run {run_id}: {what}"))
    };
    let (_, previous, state) =
        stored_model(store, plan, run_id, ModelVersion(version.0 - 1)).await?;
    let mut acc = plan.accumulator(&state);
    let replayed = replay_round(store, plan, run_id, round_idx, &mut acc).await?;
    let aggregate = acc.finish().map_err(|e| corrupt(e.to_string()))?;
    let (reader, handle, plan) = (store.clone(), tokio::runtime::Handle::current(), plan.clone());
    let (encoded, hash, state_bytes) = tokio::task::spawn_blocking(move || {
        let ctx = NextModel { store: reader, handle, run_id, round_idx, plan: &plan };
        let (values, next, _released) = next_model(&ctx, &previous, aggregate, &state)?;
        let EncodedModel { payload, hash, state } = encoded(&plan, &values, &next);
        Ok::<_, AggregateError>((payload, hash, state))
    })
    .await
    .expect("rebuilding a model panicked")
    .map_err(|e| corrupt(e.to_string()))?;
    if hash != pending.content_hash {
        return Err(corrupt(format!(
            "{replayed} replayed updates make {hash}; round {round_idx} committed {}",
            pending.content_hash
        )));
    }
    store.write_model(run_id, version, &hash, &encoded, state_bytes.as_deref()).await?;
    tracing::info!(%run_id, %version, round = %round_idx, replayed, "committed model rebuilt from its round's updates");
    Ok(())
}
