//! A round's end as pure code: from the round's folded aggregate to the next model and server
//! state. An order statistic replaces the streamed mean (reading the round's updates back a
//! tile at a time through the caller's reader), a DP run's noise goes on the mean of its
//! clipped updates, its clip norm moves and its metrics are noised (when it releases them),
//! then the server optimizer steps.
//!
//! The coordinator supplies the IO: a tile reader over its store and a noise seed from the OS.
//! A new robust aggregator or server optimizer changes this directory and `robust.rs` only.

use crate::fedavg::{Aggregate, AggregateError};
use crate::privacy::metrics::Released;
use crate::privacy::{Gaussian, Privacy};
use crate::robust::{Combined, TileReader, combine, tile_len};

use super::{OptimizerState, Strategy};

/// What a round's end starts from.
#[derive(Debug)]
pub struct RoundEnd<'a> {
    /// The run's differential privacy, resolved from its plan; `None` without.
    pub privacy: Option<&'a Privacy>,
    /// The plan's server learning rate (the optimizer's default).
    pub server_learning_rate: f64,
    /// The model the round trained.
    pub global: &'a [f32],
    /// The round's folded aggregate.
    pub aggregate: Aggregate,
    /// The server state the round started from.
    pub state: &'a OptimizerState,
}

/// The next model and server state, and what an order statistic did (for logs).
#[derive(Debug)]
pub struct NextModel {
    /// The next model's values.
    pub values: Vec<f32>,
    /// The next server state.
    pub state: OptimizerState,
    /// The order statistic's result, when the strategy has one (its delta moved into the
    /// aggregate).
    pub combined: Option<Combined>,
    /// What a DP round releases beside the model (its noised metrics, if the plan says so);
    /// empty without DP, whose metrics are the aggregate's.
    pub released: Released,
}

impl Strategy {
    /// The next model from `end`. `tiles` gives the round's stored updates' values
    /// `start..start + len`, one row per update in slot order (read only by an order
    /// statistic); `noise_seed` is called once, for a DP run's noise, and must be secret
    /// randomness.
    pub fn next_model<R: TileReader<Error: std::fmt::Display>>(
        &self,
        end: RoundEnd<'_>,
        tiles: R,
        noise_seed: impl FnOnce() -> [u8; 32],
    ) -> Result<NextModel, AggregateError> {
        let RoundEnd { privacy, server_learning_rate, global, mut aggregate, state } = end;
        let mut combined = None;
        if self.aggregation.is_order_statistic() {
            let n = aggregate.n_updates as usize;
            // Memory O(cohort × tile), bounded by the plan's check (`robust::MAX_CLOSE_BYTES`).
            let mut result =
                combine(&self.aggregation, n, global.len(), tile_len(n), self.norm_bound, tiles)
                    .map_err(|e| AggregateError::Robust(e.to_string()))?;
            aggregate.mean_delta = std::mem::take(&mut result.delta);
            combined = Some(result);
        }
        let mut clip_norm = state.clip_norm;
        let mut released = Released::default();
        let mut blt = state.blt.clone();
        if let (Some(privacy), Some(clip)) = (privacy, state.clip_norm) {
            let mut noise = Gaussian::new(noise_seed());
            let (mean, n) = (&mut aggregate.mean_delta, aggregate.n_updates);
            let noising =
                |e: crate::privacy::exact_normal::NoiseError| AggregateError::Noise(e.to_string());
            privacy.noise_mean(mean, n, clip, &mut noise, &mut blt).map_err(noising)?;
            let (within, n) = (aggregate.n_within_bound, aggregate.n_updates);
            clip_norm = Some(privacy.next_clip_norm(clip, within, n, &mut noise).map_err(noising)?);
            released =
                privacy.release_metrics(&aggregate.metrics, n, &mut noise).map_err(noising)?;
        }
        let (values, mut next) =
            self.optimizer.step(global, &aggregate, state, server_learning_rate)?;
        next.clip_norm = clip_norm;
        next.blt = blt;
        Ok(NextModel { values, state: next, combined, released })
    }
}
