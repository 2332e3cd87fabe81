//! How a round's contributions become the next model, for closing a round and for rebuilding
//! one at start alike: the stored updates, groups of updates and partials replayed in slot order, and core's
//! strategy pipeline from the aggregate, with the store as its tile reader.

use std::time::Duration;

use starling_core::backoff::Backoff;
use starling_core::codec;
use starling_core::fedavg::{
    Aggregate, AggregateError, FedAvgAccumulator, validate_partial, validate_parts,
};
use starling_core::plan::ValidatedPlan;
use starling_core::privacy::metrics::Released;
use starling_core::robust::TileReader;
use starling_core::strategy::{OptimizerState, RoundEnd};
use starling_core::tier::PartialReport;
use starling_core::{RoundIdx, RunId};

use crate::store::{SqlStore, StoreError, StoredContribution};

/// Folds a round's stored updates and partials into `acc` in slot order, as the run's
/// accumulator folded them when they were acknowledged; returns how many updates it read.
pub(super) async fn replay_round(
    store: &SqlStore,
    plan: &ValidatedPlan,
    run_id: RunId,
    round_idx: RoundIdx,
    acc: &mut FedAvgAccumulator,
) -> Result<u64, StoreError> {
    let (schema, update_schema) = (plan.schema(), plan.update_schema());
    // Partials and updates share the slot order: merge each partial before the first update
    // with a later slot.
    let mut partials = store
        .partial_reports(run_id, round_idx)
        .await?
        .into_iter()
        .filter_map(|(slot, bytes)| {
            match codec::decode::<PartialReport>(&bytes)
                .map_err(|e| e.to_string())
                .and_then(|r| r.validate(schema).map_err(|e| e.to_string()))
            {
                Ok(sums) => Some((slot, sums)),
                Err(e) => {
                    tracing::error!(%run_id, slot, error = %e, "stored partial fails validation; not merged");
                    None
                }
            }
        })
        .peekable();
    let replayed = store
        .for_each_update(run_id, round_idx, |stored| {
            let slot = match &stored {
                StoredContribution::Update(u) => u.slot,
                StoredContribution::Group(g) => g.slot,
            };
            while let Some((_, sums)) = partials.next_if(|(partial, _)| *partial < slot) {
                acc.merge(&sums);
            }
            let u = match stored {
                StoredContribution::Update(u) => u,
                // Merged as the live sum merged it when it was sealed.
                StoredContribution::Group(g) => {
                    match validate_partial(&update_schema, g.group.sums) {
                        Ok(sums) => acc.merge_group(sums.sums(), g.group.n_within_bound),
                        Err(e) => tracing::error!(%run_id, slot, error = %e, "stored group fails validation; not merged"),
                    }
                    return Ok(());
                }
            };
            let metrics = serde_json::from_str(&u.metrics_json).unwrap_or_default();
            let example_count = u.example_count as u64;
            match validate_parts(&update_schema, plan.compression(), u.delta, example_count, metrics) {
                // An asynchronous run's stale update, with the discount it was folded with
                // before the restart.
                Ok(update) => match plan.plan().asynchronous {
                    Some(a) if u.staleness > 0 => {
                        acc.add_scaled(&update, a.staleness_scale(u.staleness as u32))
                    }
                    _ => acc.add(&update),
                },
                // Validated before it was stored: only corruption gets here.
                Err(e) => tracing::error!(%run_id, slot = u.slot, error = %e, "stored update fails validation; not folded"),
            }
            Ok(())
        })
        .await?;
    for (_, sums) in partials {
        acc.merge(&sums);
    }
    Ok(replayed)
}

/// What [`next_model`] reads besides the round's aggregate.
pub(super) struct NextModel<'a> {
    pub(super) store: SqlStore,
    pub(super) handle: tokio::runtime::Handle,
    pub(super) run_id: RunId,
    pub(super) round_idx: RoundIdx,
    pub(super) plan: &'a ValidatedPlan,
}

/// The next model and server state from a round's aggregate, on a blocking thread: core's
/// [`Strategy::next_model`](starling_core::strategy::Strategy::next_model), with the round's
/// updates read back from the store and a DP run's noise seeded from the OS. Also what a DP
/// round releases beside the model.
pub(super) fn next_model(
    ctx: &NextModel<'_>,
    global: &[f32],
    aggregate: Aggregate,
    state: &OptimizerState,
) -> Result<(Vec<f32>, OptimizerState, Released), AggregateError> {
    let plan = ctx.plan.plan();
    // The strategy steps the update's tensors alone; frozen and local ones keep their values.
    let parts = ctx.plan.model_parts();
    let trained_part = (!parts.is_whole()).then(|| parts.update_of(global));
    let end = RoundEnd {
        privacy: ctx.plan.privacy(),
        server_learning_rate: plan.server_learning_rate,
        global: trained_part.as_deref().unwrap_or(global),
        aggregate,
        state,
    };
    let round_idx = ctx.round_idx;
    let next = plan.strategy.next_model(end, StoreTiles(ctx), super::entropy)?;
    if let Some(combined) = &next.combined {
        tracing::info!(run_id = %ctx.run_id, round = %round_idx, aggregation = plan.strategy.aggregation.name(), scaled = combined.n_scaled, selected = ?combined.selected, "updates combined");
    }
    let values = match trained_part {
        Some(_) => parts.with_update(global.to_vec(), &next.values),
        None => next.values,
    };
    let norm = |v: &[f32]| v.iter().map(|&x| f64::from(x) * f64::from(x)).sum::<f64>().sqrt();
    let bound = ctx.plan.max_next_model_norm(norm(global));
    let next_norm = norm(&values);
    if next_norm.is_nan() || next_norm > bound {
        return Err(AggregateError::ModelNormGrowth { next: next_norm, bound });
    }
    Ok((values, next.state, next.released))
}

/// The round's stored updates, read back tile by tile for an order statistic.
struct StoreTiles<'a, 'b>(&'a NextModel<'b>);

impl TileReader for StoreTiles<'_, '_> {
    type Error = StoreError;

    /// One tile of the round's stored updates; a store error is retried a few times before the
    /// round gives up (its updates stay stored, and are released with the failed round).
    fn read_tile(&mut self, start: usize, len: usize) -> Result<Vec<Vec<f32>>, StoreError> {
        let ctx = self.0;
        let mut backoff = Backoff::new(Duration::from_millis(50), Duration::from_secs(2));
        for attempt in 1.. {
            let read = ctx.store.update_tile(ctx.run_id, ctx.round_idx, start, len);
            match ctx.handle.block_on(read) {
                Ok(rows) => return Ok(rows),
                Err(e) if attempt < 6 => {
                    let delay = backoff.next_delay();
                    tracing::warn!(run_id = %ctx.run_id, error = %e, ?delay, "reading a tile failed; retrying");
                    std::thread::sleep(delay);
                }
                Err(e) => return Err(e),
            }
        }
        unreachable!("the loop returns")
    }
}

/// A model as the store keeps it: the payload's bytes and content hash, and the server state's
/// bytes when the strategy keeps state between rounds.
pub(super) struct EncodedModel {
    pub(super) payload: Vec<u8>,
    pub(super) hash: String,
    pub(super) state: Option<Vec<u8>>,
}

/// Encodes `values` and `state` as the store keeps them, for a commit, a late write or a
/// rebuild alike.
pub(super) fn encoded(
    plan: &ValidatedPlan,
    values: &[f32],
    state: &OptimizerState,
) -> EncodedModel {
    let (payload, hash) = super::encode_model(plan.schema(), values);
    let state = plan.plan().strategy.is_stateful().then(|| state.to_bytes());
    EncodedModel { payload, hash, state }
}
