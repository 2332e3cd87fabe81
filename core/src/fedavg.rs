//! Update validation and the streaming, example-weighted FedAvg accumulator.
//!
//! The accumulator only accepts a [`ValidatedUpdate`], which only [`validate_update`] makes:
//! a delta that reached the sum has the round's schema, the right length, finite values and a
//! sane weight.
//! Memory is O(model): each update is folded in and dropped.
//! Partial sums from the aggregator tier merge into the same accumulator ([`validate_partial`],
//! [`FedAvgAccumulator::merge`]).
//! Sums are double-double (f64 plus an error term from TwoSum), so the result is the exact
//! weighted mean rounded once, whatever the number of clients, and in practice independent of
//! the order in which updates arrive.

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::compression::{CompressedDelta, Compression, CompressionError, Run, int8_value};
use crate::tensor::{TensorError, TensorSchema};
use crate::wire::UploadRequest;

/// Largest example count one update may claim.
///
/// Bounded so that `weight × f32` is exact in f64 (24 + 29 < 53 bits): the weighted terms
/// carry no rounding error at all.
pub const MAX_EXAMPLE_COUNT: u64 = 1 << 29;

/// Most metrics one update may carry.
pub const MAX_METRICS: usize = 64;

/// Why an update was rejected.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum UpdateError {
    /// The delta does not fit the round's schema.
    #[error(transparent)]
    Tensor(#[from] TensorError),
    /// The delta is not a valid encoding in the run's compression.
    #[error(transparent)]
    Compression(#[from] CompressionError),
    /// The example count is zero or above [`MAX_EXAMPLE_COUNT`].
    #[error("example_count {0} is outside 1..={MAX_EXAMPLE_COUNT}")]
    ExampleCount(u64),
    /// A metric is non-finite, badly named, or there are too many.
    #[error("metric {name:?} is invalid: {why}")]
    Metric {
        /// Metric name.
        name: String,
        /// What is wrong with it.
        why: &'static str,
    },
}

impl UpdateError {
    /// The API's code for this refusal: one mapping for the coordinator and the aggregators,
    /// so a device hears the same code for the same delta wherever it uploads.
    pub fn code(&self) -> crate::wire::ErrorCode {
        use crate::wire::ErrorCode;
        match self {
            UpdateError::Tensor(TensorError::SchemaMismatch { .. }) => ErrorCode::SchemaMismatch,
            UpdateError::Tensor(TensorError::ShapeMismatch { .. })
            | UpdateError::Compression(CompressionError::Length { .. }) => ErrorCode::ShapeMismatch,
            UpdateError::Tensor(TensorError::NonFinite { .. })
            | UpdateError::Compression(CompressionError::NonFinite { .. }) => {
                ErrorCode::NonFiniteValue
            }
            _ => ErrorCode::InvalidField,
        }
    }
}

/// An update that passed validation; the only thing [`FedAvgAccumulator::add`] takes.
///
/// It keeps the delta as the validated bytes in the run's encoding (little-endian f32 unless
/// the plan compresses), shared, so the same buffer is written to the store and folded into the
/// sum without another copy.
#[derive(Clone)]
pub struct ValidatedUpdate {
    delta: CompressedDelta,
    example_count: u64,
    metrics: BTreeMap<String, f64>,
    /// The delta's L2 norm, computed once, by whichever of the upload's checks, the norm
    /// bound's scale and the stored row's norm asks first.
    norm: std::sync::OnceLock<f64>,
}

/// The same update whether or not its norm was computed yet.
impl PartialEq for ValidatedUpdate {
    fn eq(&self, other: &Self) -> bool {
        (&self.delta, self.example_count, &self.metrics)
            == (&other.delta, other.example_count, &other.metrics)
    }
}

/// Sizes and weights, not the values: updates travel inside traces and logs.
impl std::fmt::Debug for ValidatedUpdate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} examples, {} bytes", self.example_count, self.delta.bytes().len())?;
        match self.delta.compression() {
            Compression::F32 => Ok(()),
            other => write!(f, " of {}", other.name()),
        }
    }
}

impl ValidatedUpdate {
    /// The parameter delta's bytes in the run's encoding (flat little-endian f32 in schema
    /// order when uncompressed): what the store keeps, and what the aggregator tier reduces when
    /// uncompressed.
    pub fn delta_bytes(&self) -> &Arc<Vec<u8>> {
        self.delta.bytes()
    }

    /// The parameter delta, validated.
    pub fn delta(&self) -> &CompressedDelta {
        &self.delta
    }

    /// The delta's L2 norm (computed on first use, then kept).
    pub fn norm(&self) -> f64 {
        *self.norm.get_or_init(|| self.delta.norm_squared().sqrt())
    }

    /// The FedAvg weight.
    pub fn example_count(&self) -> u64 {
        self.example_count
    }

    /// The same update weighing at most `max_examples` (a run's cap on self-reported example
    /// counts, so that no device dominates the mean by claiming a huge dataset).
    pub fn capped(mut self, max_examples: u64) -> Self {
        self.example_count = self.example_count.min(max_examples.max(1));
        self
    }

    /// The same update with its metrics replaced by `f` of them (a DP run's metrics block,
    /// [`ValidatedPlan::metrics_to_fold`](crate::plan::ValidatedPlan::metrics_to_fold)).
    pub fn map_metrics(
        mut self,
        f: impl FnOnce(BTreeMap<String, f64>) -> BTreeMap<String, f64>,
    ) -> Self {
        self.metrics = f(std::mem::take(&mut self.metrics));
        self
    }

    /// Local metrics.
    pub fn metrics(&self) -> &BTreeMap<String, f64> {
        &self.metrics
    }
}

/// Checks an upload against the round's schema and the run's compression (the encoding the
/// task told the device to upload in).
pub fn validate_update(
    schema: &TensorSchema,
    compression: Compression,
    upload: UploadRequest,
) -> Result<ValidatedUpdate, UpdateError> {
    let expected = schema.schema_id();
    if upload.delta.schema_id != expected {
        return Err(TensorError::SchemaMismatch { expected, got: upload.delta.schema_id }.into());
    }
    validate_parts(schema, compression, upload.delta.data, upload.example_count, upload.metrics)
}

/// Checks an update given as its parts; used for uploads and for replaying stored updates.
pub fn validate_parts(
    schema: &TensorSchema,
    compression: Compression,
    delta: Vec<u8>,
    example_count: u64,
    metrics: BTreeMap<String, f64>,
) -> Result<ValidatedUpdate, UpdateError> {
    if example_count == 0 || example_count > MAX_EXAMPLE_COUNT {
        return Err(UpdateError::ExampleCount(example_count));
    }
    validate_metrics(&metrics)?;
    let delta = match compression {
        // The schema's own check names the tensor that holds a bad value.
        Compression::F32 => {
            schema.check_f32_bytes(&delta)?;
            CompressedDelta::checked_f32(delta)
        }
        other => other.validate(schema.numel() as usize, delta)?,
    };
    Ok(ValidatedUpdate { delta, example_count, metrics, norm: std::sync::OnceLock::new() })
}

/// Largest magnitude of any reported metric: enough for any honest loss or count, small enough
/// that one report cannot drown a weighted mean.
pub const MAX_METRIC_MAGNITUDE: f64 = 1e12;

/// Checks a metrics map: at most [`MAX_METRICS`] entries, short names, finite values of at most
/// [`MAX_METRIC_MAGNITUDE`]; an `accuracy` must be in [0, 1] and a `loss` must not be negative.
pub fn validate_metrics(metrics: &BTreeMap<String, f64>) -> Result<(), UpdateError> {
    if metrics.len() > MAX_METRICS {
        return Err(UpdateError::Metric { name: String::new(), why: "too many metrics" });
    }
    for (name, value) in metrics {
        if name.is_empty() || name.len() > 64 {
            return Err(UpdateError::Metric {
                name: name.clone(),
                why: "name must be 1..=64 bytes",
            });
        }
        if !value.is_finite() {
            return Err(UpdateError::Metric { name: name.clone(), why: "value is not finite" });
        }
        if value.abs() > MAX_METRIC_MAGNITUDE {
            return Err(UpdateError::Metric { name: name.clone(), why: "value exceeds 1e12" });
        }
        let why = match name.as_str() {
            "accuracy" if !(0.0..=1.0).contains(value) => "an accuracy must be in [0, 1]",
            "loss" if *value < 0.0 => "a loss cannot be negative",
            _ => continue,
        };
        return Err(UpdateError::Metric { name: name.clone(), why });
    }
    Ok(())
}

/// Streaming weighted sum of validated updates.
#[derive(Debug, Clone)]
pub struct FedAvgAccumulator {
    hi: Vec<f64>,
    lo: Vec<f64>,
    total_weight: u64,
    n_updates: u64,
    metrics: MetricsAccumulator,
    bound: Option<NormBound>,
    n_within_bound: u64,
}

/// Each update scaled to L2 norm ≤ `max_norm` before it is folded (norm bounding, DP
/// clipping); `unweighted` updates count once each instead of by their example counts.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct NormBound {
    /// The bound.
    pub max_norm: f64,
    /// Whether every update weighs 1 (DP: one device moves the sum by at most the bound).
    pub unweighted: bool,
}

/// The weighted mean of a round's updates.
#[derive(Debug, Clone, PartialEq)]
pub struct Aggregate {
    /// Example-weighted mean delta, in f64 until it is applied.
    pub mean_delta: Vec<f64>,
    /// Sum of example counts.
    pub total_weight: u64,
    /// Number of updates folded in.
    pub n_updates: u64,
    /// Updates whose norm was within the accumulator's bound (all of them without one).
    pub n_within_bound: u64,
    /// Example-weighted means of the local metrics (unweighted in a DP run, whose updates count
    /// once each).
    pub metrics: BTreeMap<String, f64>,
}

/// Evaluation reports pooled over several devices: how many, their examples, and the
/// example-weighted means of their metrics (e.g. a secure round's cohort, which the server only
/// ever sees pooled).
#[derive(Debug, Clone, PartialEq)]
pub struct PooledEvaluation {
    /// Devices that evaluated.
    pub n_devices: u64,
    /// Their held-out examples, in all.
    pub example_count: u64,
    /// Example-weighted means.
    pub metrics: BTreeMap<String, f64>,
}

impl From<crate::privacy::metrics::NoisedEvaluation> for PooledEvaluation {
    /// A DP round's noised evaluation: every device weighs 1, so its example count is its
    /// noisy device count.
    fn from(e: crate::privacy::metrics::NoisedEvaluation) -> Self {
        PooledEvaluation { n_devices: e.n_devices, example_count: e.n_devices, metrics: e.metrics }
    }
}

/// Why an aggregate could not be applied.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum AggregateError {
    /// No update was folded in.
    #[error("no updates to aggregate")]
    Empty,
    /// The new model would hold a non-finite value (the deltas overflowed f32).
    #[error("the aggregated model is not finite at flat index {0}")]
    NonFinite(usize),
    /// A robust aggregator could not combine the round's updates.
    #[error("robust aggregation: {0}")]
    Robust(String),
    /// A secure round's sum could not be unmasked.
    #[error("secure aggregation: {0}")]
    Secure(String),
    /// A secure round's unmasked sum weighs nothing, so it has no mean.
    #[error("the secure sum's total weight is zero")]
    ZeroWeight,
    /// The next model would leave the plan's bound on its growth
    /// (`max_model_norm_growth`): one update, finite but huge, could otherwise set values near
    /// f32's limit and refuse every later round.
    #[error(
        "the next model's L2 norm {next:.4e} is over {bound:.4e} (the plan's max_model_norm_growth times the previous model's norm, at least 1)"
    )]
    ModelNormGrowth {
        /// The next model's L2 norm.
        next: f64,
        /// The bound it left.
        bound: f64,
    },
    /// The round's DP noise could not be added exactly (a standard deviation or value out of
    /// the exact sampler's range): every later round would fail the same way.
    #[error("differential privacy noise: {0}")]
    Noise(String),
    /// Computing the round's end failed outright (a panic in aggregation, the strategy or the
    /// privacy mechanism): the run is stopped with this reason rather than retried.
    #[error("closing the round failed: {0}")]
    Broken(String),
}

/// Parameters per tile of [`FedAvgAccumulator::add_all`]: 128 KiB of sums, which stay in a
/// core's L2 cache while a batch of updates is folded into them.
const FOLD_TILE: usize = 8 * 1024;

impl FedAvgAccumulator {
    /// An empty accumulator for `n_params` parameters.
    pub fn new(n_params: usize) -> Self {
        FedAvgAccumulator {
            hi: vec![0.0; n_params],
            lo: vec![0.0; n_params],
            total_weight: 0,
            n_updates: 0,
            metrics: MetricsAccumulator::default(),
            bound: None,
            n_within_bound: 0,
        }
    }

    /// The same accumulator scaling each update to norm ≤ `bound.max_norm` as it folds it.
    pub fn bounded(mut self, bound: Option<NormBound>) -> Self {
        self.bound = bound;
        self
    }

    /// Folds one update in.
    ///
    /// # Panics
    /// If the update has another length than the accumulator: validation against the same
    /// schema makes that a bug.
    pub fn add(&mut self, update: &ValidatedUpdate) {
        self.add_scaled(update, 1.0);
    }

    /// Folds one update in with its delta scaled by `discount` (an asynchronous run's staleness
    /// weight, in (0, 1]), its weight in the mean's denominator not: the mean becomes
    /// `Σ nᵢ·sᵢ·Δᵢ / Σ nᵢ`, FedBuff's `1/K Σ s(τᵢ)·Δᵢ` weighted by examples. A `discount`
    /// of 1 folds exactly like [`add`](Self::add).
    ///
    /// # Panics
    /// As [`add`](Self::add).
    pub fn add_scaled(&mut self, update: &ValidatedUpdate, discount: f64) {
        self.add_all([(update, discount)]);
    }

    /// Folds several updates in, in order, each with its `discount` (1 for
    /// [`add`](Self::add)): the same sums, to the bit, as adding them one by one, since every
    /// parameter sees the same operations in the same order. The fold goes tile by tile, each
    /// tile of the sums taking every update before the next tile: the sums (16 bytes a
    /// parameter) cross memory once for the lot instead of once per update, which made a
    /// single int8 fold of a large model wait on memory rather than compute.
    ///
    /// # Panics
    /// As [`add`](Self::add).
    pub fn add_all<'a>(&mut self, updates: impl IntoIterator<Item = (&'a ValidatedUpdate, f64)>) {
        let updates: Vec<(&ValidatedUpdate, f64)> = updates
            .into_iter()
            .map(|(update, discount)| {
                // A DP run's updates count once each, and so do their metrics (the noised
                // metrics block's sums are its means times the count).
                let unweighted = self.bound.is_some_and(|b| b.unweighted);
                let weight = if unweighted { 1 } else { update.example_count };
                self.metrics.add(weight, &update.metrics);
                (update, self.factor(update, discount))
            })
            .collect();
        for start in (0..self.hi.len()).step_by(FOLD_TILE) {
            let (hi, lo) = (&mut self.hi[start..], &mut self.lo[start..]);
            for (update, factor) in &updates {
                // A loop per run of the encoding (a dense stretch, an int8 block, a top-k
                // value), so each encoding's fold vectorizes instead of decoding value by value.
                update.delta.runs_in(start..start + FOLD_TILE, |first, run| {
                    fold_run(&mut hi[first - start..], &mut lo[first - start..], *factor, run);
                });
            }
        }
    }

    /// What `update`'s values are multiplied by as they are folded (its weight, norm-bounding
    /// scale and `discount`), its weight counted in the total.
    fn factor(&mut self, update: &ValidatedUpdate, discount: f64) -> f64 {
        assert_eq!(update.delta.len(), self.hi.len(), "update validated against another schema");
        let (weight, scale) = match self.bound {
            None => (update.example_count, 1.0),
            Some(NormBound { max_norm, unweighted }) => {
                let norm = update.norm();
                let weight = if unweighted { 1 } else { update.example_count };
                (weight, crate::robust::norm_scale(norm, max_norm))
            }
        };
        self.n_within_bound += u64::from(scale == 1.0);
        self.total_weight += weight;
        self.n_updates += 1;
        // With no bound and no discount this is exact: w × d needs no rounding (see
        // MAX_EXAMPLE_COUNT); × 1.0 changes no bits.
        weight as f64 * scale * discount
    }

    /// Folds in another accumulator's sums (an aggregator's partial aggregate).
    ///
    /// # Panics
    /// If the partial has another length: validation against the same schema makes that a bug.
    pub fn merge(&mut self, partial: &ValidatedPartial) {
        let p = &partial.0;
        assert_eq!(p.hi.len(), self.hi.len(), "partial validated against another schema");
        assert!(self.bound.is_none(), "a bounded run's updates never go through the tier");
        merge_sums(&mut self.hi, &mut self.lo, &p.hi, &p.lo);
        self.total_weight += p.total_weight;
        self.n_updates += p.n_updates;
        self.n_within_bound += p.n_updates;
        self.metrics.merge(&p.metrics);
    }

    /// An empty accumulator of the same length and bound.
    pub fn empty_like(&self) -> Self {
        FedAvgAccumulator::new(self.hi.len()).bounded(self.bound)
    }

    /// The sums folded so far as a [`FoldedGroup`], leaving this accumulator empty; `None`
    /// when nothing was folded.
    pub fn take_group(&mut self) -> Option<FoldedGroup> {
        if self.n_updates == 0 {
            return None;
        }
        let fresh = self.empty_like();
        let n_within_bound = self.n_within_bound;
        let sums = std::mem::replace(self, fresh).into_partial();
        Some(FoldedGroup { sums, n_within_bound })
    }

    /// Folds in a group of the same run's updates summed apart by an accumulator with the same
    /// bound ([`take_group`](Self::take_group)), or such a group read back from the store:
    /// the sums, weights, counts (the bound's too) and metrics, with the same operations
    /// whichever of the two it is, so a replay merges exactly what the live sum merged.
    ///
    /// # Panics
    /// If the group has another length: validation against the same schema makes that a bug.
    pub fn merge_group(&mut self, sums: &PartialSums, n_within_bound: u64) {
        assert_eq!(sums.hi.len(), self.hi.len(), "group of another schema");
        merge_sums(&mut self.hi, &mut self.lo, &sums.hi, &sums.lo);
        self.total_weight += sums.total_weight;
        self.n_updates += sums.n_updates;
        self.n_within_bound += n_within_bound.min(sums.n_updates);
        self.metrics.merge(&sums.metrics);
    }

    /// The running sums as a partial aggregate (what an aggregator reports).
    pub fn into_partial(self) -> PartialSums {
        PartialSums {
            hi: self.hi,
            lo: self.lo,
            total_weight: self.total_weight,
            n_updates: self.n_updates,
            metrics: self.metrics.sums,
        }
    }

    /// An accumulator that continues from `partial`'s sums.
    pub fn from_partial(partial: ValidatedPartial) -> Self {
        let p = partial.0;
        FedAvgAccumulator {
            hi: p.hi,
            lo: p.lo,
            total_weight: p.total_weight,
            n_within_bound: p.n_updates,
            n_updates: p.n_updates,
            metrics: MetricsAccumulator { sums: p.metrics },
            bound: None,
        }
    }

    /// Number of updates folded in so far.
    pub fn n_updates(&self) -> u64 {
        self.n_updates
    }

    /// The weighted mean, or [`AggregateError::Empty`].
    pub fn finish(self) -> Result<Aggregate, AggregateError> {
        if self.n_updates == 0 {
            return Err(AggregateError::Empty);
        }
        let w = self.total_weight as f64;
        // In place: a fresh model-sized f64 vector cost as much in page faults as the division.
        let mut mean_delta = self.hi;
        for (mean, lo) in mean_delta.iter_mut().zip(&self.lo) {
            *mean = (*mean + lo) / w;
        }
        Ok(Aggregate {
            mean_delta,
            total_weight: self.total_weight,
            n_updates: self.n_updates,
            n_within_bound: self.n_within_bound,
            metrics: self.metrics.finish(),
        })
    }
}

/// Adds `weight × delta` (little-endian f32 bytes) into the double-double sums `hi + lo`.
///
/// Every tier folds with this one loop (the coordinator's accumulator, the aggregators' CPU
/// reducer chunk by chunk, and the GPU kernel computes the same operations in the same order),
/// so a sum does not depend on where it was computed.
///
/// # Panics
/// If the lengths disagree.
pub fn fold_weighted(hi: &mut [f64], lo: &mut [f64], weight: u64, delta_le: &[u8]) {
    // w * d is exact (see MAX_EXAMPLE_COUNT), so this is the scaled fold with no rounding.
    fold_scaled(hi, lo, weight as f64, delta_le);
}

/// Adds `scale × delta` into `hi + lo` like [`fold_weighted`]; the products are rounded once
/// (a norm-bounding scale is not an integer), the additions stay exact.
///
/// # Panics
/// If the lengths disagree.
pub fn fold_scaled(hi: &mut [f64], lo: &mut [f64], scale: f64, delta_le: &[u8]) {
    assert!(hi.len() == lo.len() && delta_le.len() == hi.len() * 4, "length mismatch");
    for ((hi, lo), d) in hi.iter_mut().zip(lo.iter_mut()).zip(delta_le.chunks_exact(4)) {
        two_sum_into(hi, lo, scale * f64::from(f32::from_le_bytes([d[0], d[1], d[2], d[3]])));
    }
}

/// Adds `factor ×` a run of an encoded delta into the sums starting at the run's first index,
/// with the same operations [`fold_scaled`] does for f32 (a decoded value is an f32, the
/// product rounded once, the addition exact); a loop per encoding, so each one vectorizes.
fn fold_run(hi: &mut [f64], lo: &mut [f64], factor: f64, run: Run<'_>) {
    match run {
        Run::Dense(Compression::F32, bytes) => {
            let len = bytes.len() / 4;
            fold_scaled(&mut hi[..len], &mut lo[..len], factor, bytes);
        }
        Run::Dense(kind, bytes) => {
            let width = kind.dense_width();
            for ((hi, lo), c) in hi.iter_mut().zip(lo.iter_mut()).zip(bytes.chunks_exact(width)) {
                two_sum_into(hi, lo, factor * f64::from(kind.dense_value(c)));
            }
        }
        Run::Int8 { scale, values } => {
            for ((hi, lo), &q) in hi.iter_mut().zip(lo.iter_mut()).zip(values) {
                two_sum_into(hi, lo, factor * f64::from(int8_value(q, scale)));
            }
        }
        Run::One(v) => two_sum_into(&mut hi[0], &mut lo[0], factor * f64::from(v)),
    }
}

/// Adds `x` into the double-double `hi + lo` (TwoSum: the rounding error of `hi + x` goes
/// into `lo`).
#[inline]
fn two_sum_into(hi: &mut f64, lo: &mut f64, x: f64) {
    let s = *hi + x;
    let bp = s - *hi;
    let err = (*hi - (s - bp)) + (x - bp);
    *hi = s;
    *lo += err;
}

/// Adds the double-double sums `other_hi + other_lo` into `hi + lo` (TwoSum on the high parts).
///
/// # Panics
/// If the lengths disagree.
pub fn merge_sums(hi: &mut [f64], lo: &mut [f64], other_hi: &[f64], other_lo: &[f64]) {
    assert!(
        hi.len() == lo.len() && other_hi.len() == hi.len() && other_lo.len() == hi.len(),
        "length mismatch"
    );
    for i in 0..hi.len() {
        let (a, b) = (hi[i], other_hi[i]);
        let s = a + b;
        let bp = s - a;
        let err = (a - (s - bp)) + (b - bp);
        hi[i] = s;
        lo[i] += err + other_lo[i];
    }
}

/// `values` as little-endian bytes: how sums travel (an aggregator's partial) and are stored
/// (a group of updates).
pub fn f64s_to_le(values: &[f64]) -> Vec<u8> {
    values.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// [`f64s_to_le`]'s inverse; `None` when the length is not a multiple of 8.
pub fn f64s_from_le(bytes: &[u8]) -> Option<Vec<f64>> {
    bytes.len().is_multiple_of(8).then(|| {
        bytes.chunks_exact(8).map(|c| f64::from_le_bytes(c.try_into().expect("8 bytes"))).collect()
    })
}

/// The running sums of a (partial) FedAvg: what an aggregator reports for its shard.
#[derive(Debug, Clone, PartialEq)]
pub struct PartialSums {
    /// High parts of the example-weighted sums, in schema order.
    pub hi: Vec<f64>,
    /// Low parts (accumulated rounding errors).
    pub lo: Vec<f64>,
    /// Sum of example counts.
    pub total_weight: u64,
    /// Updates folded in.
    pub n_updates: u64,
    /// Per metric: example-weighted sum and the weight behind it.
    pub metrics: BTreeMap<String, (f64, u64)>,
}

/// A group of a run's updates summed by the coordinator itself before it stores them: what
/// it writes for the group instead of each update (a model's sums for any number of updates),
/// merged back on replay with [`FedAvgAccumulator::merge_group`].
#[derive(Debug, Clone, PartialEq)]
pub struct FoldedGroup {
    /// The group's sums, weights and metrics, as an accumulator of the run's bound made them.
    pub sums: PartialSums,
    /// How many of its updates were within that bound (all of them without one).
    pub n_within_bound: u64,
}

/// Partial sums that passed [`validate_partial`]; the only thing [`FedAvgAccumulator::merge`]
/// takes.
#[derive(Clone, PartialEq)]
pub struct ValidatedPartial(PartialSums);

/// Sizes and weights, not the values: these travel inside traces and logs.
impl std::fmt::Debug for ValidatedPartial {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let p = &self.0;
        write!(f, "{} updates, weight {}, {} parameters", p.n_updates, p.total_weight, p.hi.len())
    }
}

impl ValidatedPartial {
    /// The sums.
    pub fn sums(&self) -> &PartialSums {
        &self.0
    }
}

/// Why a partial aggregate was rejected.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum PartialError {
    /// The sums have another length than the schema's parameter count.
    #[error("partial sums hold {got} values, the schema {expected}")]
    Length {
        /// Parameters in the schema.
        expected: usize,
        /// Values sent.
        got: usize,
    },
    /// A sum is NaN or infinite.
    #[error("partial sum is not finite at flat index {0}")]
    NonFinite(usize),
    /// The counts cannot be right (no updates, or more weight than the updates can carry).
    #[error("partial counts are inconsistent: {0}")]
    Counts(&'static str),
    /// A metric is invalid.
    #[error(transparent)]
    Metric(#[from] UpdateError),
}

/// Checks partial sums against the round's schema: lengths, finite values, and counts that
/// updates validated by [`validate_update`] could have produced.
pub fn validate_partial(
    schema: &TensorSchema,
    partial: PartialSums,
) -> Result<ValidatedPartial, PartialError> {
    let expected = schema.numel() as usize;
    for got in [partial.hi.len(), partial.lo.len()] {
        if got != expected {
            return Err(PartialError::Length { expected, got });
        }
    }
    if let Some(i) =
        partial.hi.iter().zip(&partial.lo).position(|(h, l)| !(h.is_finite() && l.is_finite()))
    {
        return Err(PartialError::NonFinite(i));
    }
    check_counts_and_metrics(partial.total_weight, partial.n_updates, &partial.metrics)?;
    Ok(ValidatedPartial(partial))
}

/// The counts and metrics of a partial: what updates validated by [`validate_update`] could
/// have produced. Shared with reports whose sums travel apart from them (an aggregator group
/// that sums on its GPUs).
pub(crate) fn check_counts_and_metrics(
    total_weight: u64,
    n_updates: u64,
    metrics: &BTreeMap<String, (f64, u64)>,
) -> Result<(), PartialError> {
    if n_updates == 0 {
        return Err(PartialError::Counts("no updates"));
    }
    if total_weight < n_updates || total_weight > n_updates.saturating_mul(MAX_EXAMPLE_COUNT) {
        return Err(PartialError::Counts("total weight outside n_updates..=n_updates × max"));
    }
    if metrics.len() > MAX_METRICS {
        return Err(UpdateError::Metric { name: String::new(), why: "too many metrics" }.into());
    }
    for (name, (sum, weight)) in metrics {
        if name.is_empty() || name.len() > 64 {
            return Err(UpdateError::Metric {
                name: name.clone(),
                why: "name must be 1..=64 bytes",
            }
            .into());
        }
        if !sum.is_finite() || *weight > total_weight {
            return Err(UpdateError::Metric {
                name: name.clone(),
                why: "sum or weight out of range",
            }
            .into());
        }
    }
    Ok(())
}

impl Aggregate {
    /// Server optimizer step (FedAvg with a server learning rate):
    /// `new = global + lr * mean_delta`, computed in f64 and rounded once to f32.
    pub fn apply(&self, global: &[f32], server_lr: f64) -> Result<Vec<f32>, AggregateError> {
        assert_eq!(global.len(), self.mean_delta.len(), "aggregate of another schema");
        let new: Vec<f32> = global
            .iter()
            .zip(&self.mean_delta)
            .map(|(&g, &d)| (f64::from(g) + server_lr * d) as f32)
            .collect();
        match new.iter().position(|v| !v.is_finite()) {
            Some(i) => Err(AggregateError::NonFinite(i)),
            None => Ok(new),
        }
    }
}

/// Example-weighted means of named metrics; a metric missing from an update is not counted.
#[derive(Debug, Clone, Default)]
pub struct MetricsAccumulator {
    sums: BTreeMap<String, (f64, u64)>,
}

impl MetricsAccumulator {
    /// Adds one report's metrics with weight `example_count`.
    pub fn add(&mut self, example_count: u64, metrics: &BTreeMap<String, f64>) {
        for (name, value) in metrics {
            let entry = self.sums.entry(name.clone()).or_insert((0.0, 0));
            entry.0 += value * example_count as f64;
            entry.1 += example_count;
        }
    }

    /// Adds another accumulator's sums (name → weighted sum, weight).
    pub fn merge(&mut self, sums: &BTreeMap<String, (f64, u64)>) {
        for (name, (sum, weight)) in sums {
            let entry = self.sums.entry(name.clone()).or_insert((0.0, 0));
            entry.0 += sum;
            entry.1 += weight;
        }
    }

    /// The sums so far: name → (weighted sum, weight).
    pub fn into_sums(self) -> BTreeMap<String, (f64, u64)> {
        self.sums
    }

    /// The weighted means.
    pub fn finish(self) -> BTreeMap<String, f64> {
        self.sums
            .into_iter()
            .filter(|(_, (_, w))| *w > 0)
            .map(|(name, (sum, w))| (name, sum / w as f64))
            .collect()
    }
}

#[cfg(test)]
mod tests;
