//! One round's shard on an aggregator: which devices uploaded, with what weight and metrics,
//! and the engine their deltas stream into. What it finishes into is exactly what the
//! coordinator's accumulator would hold for the same updates ([`PartialSums`]).

use std::collections::BTreeSet;
use std::sync::Arc;

use starling_core::DeviceId;
use starling_core::fedavg::{MetricsAccumulator, PartialSums, ValidatedUpdate};

use crate::error::ReduceError;
use crate::reduce::Reducer;

/// Why a device's update was not taken into the shard.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ShardError {
    /// The device's update is already in.
    #[error("device {0} already uploaded in this round")]
    Duplicate(DeviceId),
    /// The engine failed.
    #[error(transparent)]
    Reduce(#[from] ReduceError),
}

/// An update's delta as little-endian f32 bytes, what the engines reduce: an f32 delta's own
/// bytes (shared, not copied); a compressed one's decoded values, the values the coordinator's
/// accumulator folds for the same bytes.
fn f32_bytes(update: &ValidatedUpdate) -> Arc<Vec<u8>> {
    let delta = update.delta();
    if delta.compression().is_f32() {
        return update.delta_bytes().clone();
    }
    // Decoded straight into the bytes (zeros where top-k sent nothing): one model-sized
    // buffer per upload, not an f32 vector and then its bytes.
    let mut bytes = vec![0u8; 4 * delta.len()];
    delta.for_each(|i, v| bytes[4 * i..4 * i + 4].copy_from_slice(&v.to_le_bytes()));
    Arc::new(bytes)
}

/// A shard being reduced.
pub struct ShardAccumulator {
    reducer: Box<dyn Reducer>,
    devices: BTreeSet<DeviceId>,
    total_weight: u64,
    metrics: MetricsAccumulator,
}

impl ShardAccumulator {
    /// An empty shard reducing with `reducer`.
    pub fn new(reducer: Box<dyn Reducer>) -> Self {
        ShardAccumulator {
            reducer,
            devices: BTreeSet::new(),
            total_weight: 0,
            metrics: MetricsAccumulator::default(),
        }
    }

    /// Whether `device`'s update is in.
    pub fn contains(&self, device: DeviceId) -> bool {
        self.devices.contains(&device)
    }

    /// Devices in so far.
    pub fn len(&self) -> usize {
        self.devices.len()
    }

    /// Whether no update is in.
    pub fn is_empty(&self) -> bool {
        self.devices.is_empty()
    }

    /// Takes one validated update in.
    pub fn add(&mut self, device: DeviceId, update: &ValidatedUpdate) -> Result<(), ShardError> {
        if self.devices.contains(&device) {
            return Err(ShardError::Duplicate(device));
        }
        self.reducer.push(update.example_count(), f32_bytes(update))?;
        self.devices.insert(device);
        self.total_weight += update.example_count();
        self.metrics.add(update.example_count(), update.metrics());
        Ok(())
    }

    /// The shard's sums and the devices behind them (in id order).
    pub fn finish(mut self) -> Result<(Vec<DeviceId>, PartialSums), ShardError> {
        let (hi, lo) = self.reducer.finish()?;
        let n_updates = self.devices.len() as u64;
        Ok((
            self.devices.into_iter().collect(),
            PartialSums {
                hi,
                lo,
                total_weight: self.total_weight,
                n_updates,
                metrics: self.metrics.into_sums(),
            },
        ))
    }
}
