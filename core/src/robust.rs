//! Robust aggregation: combining a round's updates so that a few broken or malicious devices
//! cannot steer the model — L2 norm bounding, coordinate-wise median and trimmed mean, Krum and
//! Multi-Krum (Blanchard et al. 2017; Yin et al. 2018; Sun et al. 2019 for norm bounding), with
//! Multi-Krum's selection named ([`KrumSelection`]: one-shot scores, or iterated as in
//! El Mhamdi et al. 2018), and the geometric median by smoothed Weiszfeld iterations (RFA,
//! Pillutla, Kakade and Harchaoui 2022).
//!
//! Norm bounding alone streams: each update is scaled to norm ≤ B as it is folded
//! ([`crate::fedavg::FedAvgAccumulator::bounded`]). Order statistics need every update at once,
//! coordinate by coordinate, so [`combine`] reads them back one *tile* (a range of coordinates of
//! every update) at a time through a caller-supplied reader — the coordinator reads tiles from
//! its store — and memory stays O(cohort × tile), never O(cohort × model).
//!
//! These aggregators are unweighted, as in the papers: each update counts once, whatever its
//! example count (a device cannot buy influence by claiming a large dataset).

use serde::{Deserialize, Serialize};

/// The plan's `strategy.aggregation`: how a round's updates become one delta.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind", deny_unknown_fields)]
pub enum Aggregation {
    /// The example-weighted mean (FedAvg). Streams; works with SecAgg and the aggregator tier.
    Mean {},
    /// The median of each coordinate (the mean of the two middle values for an even count).
    CoordinateMedian {},
    /// Each coordinate's mean after dropping its `⌊trim_fraction · n⌋` largest and smallest
    /// values.
    TrimmedMean {
        /// Fraction trimmed from each end, in [0, 0.5).
        trim_fraction: f64,
    },
    /// Krum (`select` = 1) or Multi-Krum: score each update by the summed squared distances to
    /// its `n − byzantine − 2` nearest others, and average the `select` chosen ones (how they
    /// are chosen: [`KrumSelection`]).
    Krum {
        /// Malicious updates tolerated, f; rounds need at least 2f + 3 reports.
        byzantine: u32,
        /// Updates averaged (m); default 1 (Krum).
        #[serde(default = "one")]
        select: u32,
        /// How Multi-Krum picks its `select` updates; the same for Krum (`select` = 1).
        #[serde(default)]
        selection: KrumSelection,
    },
    /// The geometric median (the point with the least summed L2 distance to the updates),
    /// approximated by `iterations` smoothed Weiszfeld steps from the mean, each weighting an
    /// update by `1 / max(smoothing, distance)`: RFA (Pillutla et al. 2022), unweighted. Unlike
    /// the coordinate-wise statistics it is rotation invariant, and it tolerates up to half
    /// the updates being arbitrary.
    GeometricMedian {
        /// Weiszfeld steps; RFA's experiments use 3 (the default), at most 100.
        #[serde(default = "three")]
        iterations: u32,
        /// ν: distances below it count as ν, so an update at the current estimate cannot
        /// divide by zero; default 1e-6.
        #[serde(default = "default_smoothing")]
        smoothing: f64,
    },
}

/// How Multi-Krum chooses its m updates. Both are in use under the one name, so the plan says
/// which.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KrumSelection {
    /// Score every update once and take the m best scores: Multi-Krum as Blanchard et al.
    /// (NeurIPS 2017, §4) define it, and as most libraries ship it.
    #[default]
    Scores,
    /// Krum applied m times: take the best-scored update, remove it, score the rest again
    /// among themselves (with n − 1 updates), and so on: the iterated selection of El Mhamdi
    /// et al. (ICML 2018, Bulyan's first stage). Costlier (m scorings), and a chosen outlier
    /// no longer counts as a near neighbour of the later picks.
    Iterative,
}

/// Tiles of robust aggregation hold about this many bytes (12 per value per update: the f32
/// read and its scaled f64) while the cohort is small enough...
pub const TILE_BYTES: usize = 48 << 20;
/// ...and at least this many coordinates, so that a large cohort still reads its updates in a
/// bounded number of passes: past `TILE_BYTES / 12 / MIN_TILE_LEN` (4 096) updates a tile
/// grows with the cohort.
pub const MIN_TILE_LEN: usize = 1024;
/// The most memory a round's order statistic may take at close: a plan whose largest round
/// would need more is refused ([`Aggregation::close_memory_bytes`]).
pub const MAX_CLOSE_BYTES: u64 = 256 << 20;

/// Where [`combine`] reads a round's updates from, one tile at a time: the coordinator reads
/// them from its store, tests and the simulator from memory (any `FnMut(start, len)` returning
/// the rows is one).
pub trait TileReader {
    /// Why a read failed.
    type Error;
    /// Every update's values at coordinates `start..start + len`, one row per update, always
    /// in the same order.
    fn read_tile(&mut self, start: usize, len: usize) -> Result<Vec<Vec<f32>>, Self::Error>;
}

impl<E, F: FnMut(usize, usize) -> Result<Vec<Vec<f32>>, E>> TileReader for F {
    type Error = E;
    fn read_tile(&mut self, start: usize, len: usize) -> Result<Vec<Vec<f32>>, E> {
        self(start, len)
    }
}

/// Coordinates per tile when combining `n_updates` updates.
pub fn tile_len(n_updates: usize) -> usize {
    (TILE_BYTES / 12 / n_updates.max(1)).max(MIN_TILE_LEN)
}

impl Default for Aggregation {
    fn default() -> Self {
        Aggregation::Mean {}
    }
}

fn one() -> u32 {
    1
}

fn three() -> u32 {
    3
}

fn default_smoothing() -> f64 {
    1e-6
}

/// Why robust aggregation failed: the reader's error, or rows that do not fit together.
#[derive(Debug, thiserror::Error)]
pub enum RobustError<E> {
    /// Reading a tile failed.
    #[error("reading updates: {0}")]
    Read(E),
    /// A tile had another shape than asked for (the updates changed under the reader).
    #[error("tile at {start}: {why}")]
    Tile {
        /// First coordinate of the tile.
        start: usize,
        /// What was wrong.
        why: String,
    },
    /// Too few updates for the aggregator.
    #[error("{0}")]
    TooFew(String),
}

/// What [`combine`] produced.
#[derive(Debug, Clone, PartialEq)]
pub struct Combined {
    /// The combined delta, in f64.
    pub delta: Vec<f64>,
    /// Updates whose norm was above the bound (and were scaled down).
    pub n_scaled: u64,
    /// For Krum: the updates averaged, by position in slot order.
    pub selected: Option<Vec<usize>>,
}

impl Aggregation {
    /// A stable snake_case name, for views and logs.
    pub fn name(&self) -> &'static str {
        match self {
            Aggregation::Mean {} => "mean",
            Aggregation::CoordinateMedian {} => "coordinate_median",
            Aggregation::TrimmedMean { .. } => "trimmed_mean",
            Aggregation::Krum { .. } => "krum",
            Aggregation::GeometricMedian { .. } => "geometric_median",
        }
    }

    /// Whether this is the default weighted mean.
    pub fn is_mean(&self) -> bool {
        matches!(self, Aggregation::Mean {})
    }

    /// Whether the aggregator needs every update at close (an order statistic), rather than a
    /// running sum.
    pub fn is_order_statistic(&self) -> bool {
        !self.is_mean()
    }

    /// Bytes [`combine`] holds at once for a round of `n_updates` updates: one tile of every
    /// update (f32 and f64), for Krum the n × n distances and a row of scores, for the
    /// geometric median a distance and a weight per update (its estimate is the result's
    /// model-sized vector, which every aggregator holds).
    pub fn close_memory_bytes(&self, n_updates: u64) -> u64 {
        let tile = 12 * n_updates * tile_len(n_updates as usize) as u64;
        match self {
            Aggregation::Mean {} => 0,
            Aggregation::CoordinateMedian {} | Aggregation::TrimmedMean { .. } => tile,
            Aggregation::Krum { .. } => tile + 8 * n_updates * n_updates + 16 * n_updates,
            Aggregation::GeometricMedian { .. } => tile + 16 * n_updates,
        }
    }

    /// Checks that a round of up to `max_updates` updates fits in [`MAX_CLOSE_BYTES`] at
    /// close; the message gives the figure and the largest round that fits.
    pub fn check_memory(&self, max_updates: u32) -> Result<(), String> {
        let needed = self.close_memory_bytes(u64::from(max_updates));
        if needed <= MAX_CLOSE_BYTES {
            return Ok(());
        }
        // The cost grows with n: bisect for the largest round that fits.
        let (mut lo, mut hi) = (0u64, u64::from(max_updates));
        while lo < hi {
            let mid = (lo + hi).div_ceil(2);
            if self.close_memory_bytes(mid) <= MAX_CLOSE_BYTES { lo = mid } else { hi = mid - 1 }
        }
        Err(format!(
            "{} over rounds of up to {max_updates} updates (cohort × over-selection) needs {} MiB \
             at close, more than the {} MiB allowed; at most {lo} updates per round fit",
            self.name(),
            needed.div_ceil(1 << 20),
            MAX_CLOSE_BYTES >> 20
        ))
    }

    /// Checks the parameters against the fewest reports a round may close with.
    pub fn check(&self, min_quorum: u32) -> Result<(), String> {
        match *self {
            Aggregation::Mean {} | Aggregation::CoordinateMedian {} => Ok(()),
            Aggregation::TrimmedMean { trim_fraction } => {
                if (0.0..0.5).contains(&trim_fraction) {
                    Ok(())
                } else {
                    Err("trim_fraction must be in [0, 0.5)".into())
                }
            }
            Aggregation::Krum { byzantine, select, .. } => {
                let needed = 2 * u64::from(byzantine) + 3;
                if u64::from(min_quorum) < needed {
                    return Err(format!(
                        "Krum tolerating {byzantine} byzantine updates needs rounds of at least \
                         {needed} reports; raise min_quorum to {needed}"
                    ));
                }
                if select == 0 || u64::from(select) > u64::from(min_quorum - byzantine) {
                    return Err(format!(
                        "select must be in 1..={} (min_quorum − byzantine)",
                        min_quorum - byzantine
                    ));
                }
                Ok(())
            }
            Aggregation::GeometricMedian { iterations, smoothing } => {
                if !(1..=100).contains(&iterations) {
                    Err("iterations must be in 1..=100".into())
                } else if !(smoothing.is_finite() && smoothing > 0.0) {
                    Err("smoothing must be a positive number".into())
                } else {
                    Ok(())
                }
            }
        }
    }
}

/// The factor that brings an update of L2 norm `norm` within `bound`: 1 if it already is.
pub fn norm_scale(norm: f64, bound: f64) -> f64 {
    if norm > bound { bound / norm } else { 1.0 }
}

/// `values` scaled to L2 norm ≤ `bound` (unchanged when within): what a device does to its
/// delta before masking it in a differentially private secure round.
pub fn clip_to_norm(values: &[f32], bound: f64) -> Vec<f32> {
    let norm = values.iter().map(|&v| f64::from(v) * f64::from(v)).sum::<f64>().sqrt();
    let scale = norm_scale(norm, bound);
    values.iter().map(|&v| (f64::from(v) * scale) as f32).collect()
}

/// Combines `n_updates` updates of `n_params` values with an order-statistic `aggregation`,
/// each first scaled to L2 norm ≤ `norm_bound` when given.
///
/// `tiles` gives every update's values at coordinates `start..start + len`, one row per
/// update, always in the same order. Tiles are `tile_len` coordinates long; the updates are
/// read once for the norms (with a bound), once for the combination, and once more for Krum's
/// average.
pub fn combine<R: TileReader>(
    aggregation: &Aggregation,
    n_updates: usize,
    n_params: usize,
    tile_len: usize,
    norm_bound: Option<f64>,
    mut tiles: R,
) -> Result<Combined, RobustError<R::Error>> {
    type E<R> = <R as TileReader>::Error;
    assert!(aggregation.is_order_statistic(), "the mean streams through the accumulator");
    if n_updates == 0 {
        return Err(RobustError::TooFew("no updates".into()));
    }
    let tile_len = tile_len.max(1);
    let mut read = |start: usize, len: usize| -> Result<Vec<Vec<f32>>, RobustError<E<R>>> {
        let rows = tiles.read_tile(start, len).map_err(RobustError::Read)?;
        if rows.len() != n_updates || rows.iter().any(|r| r.len() != len) {
            return Err(RobustError::Tile {
                start,
                why: format!("expected {n_updates} rows of {len} values"),
            });
        }
        Ok(rows)
    };
    let tiles = (0..n_params).step_by(tile_len).map(|s| (s, tile_len.min(n_params - s)));

    // Pass 1 (with a bound): each update's norm, from its squared values tile by tile.
    let mut scales = vec![1.0; n_updates];
    let mut n_scaled = 0;
    if let Some(bound) = norm_bound {
        let mut squares = vec![0.0f64; n_updates];
        for (start, len) in tiles.clone() {
            for (sq, row) in squares.iter_mut().zip(read(start, len)?) {
                *sq += row.iter().map(|&v| f64::from(v) * f64::from(v)).sum::<f64>();
            }
        }
        for (scale, sq) in scales.iter_mut().zip(squares) {
            *scale = norm_scale(sq.sqrt(), bound);
            n_scaled += u64::from(*scale < 1.0);
        }
    }
    let scaled = |rows: Vec<Vec<f32>>| -> Vec<Vec<f64>> {
        rows.into_iter()
            .zip(&scales)
            .map(|(row, &s)| row.into_iter().map(|v| f64::from(v) * s).collect())
            .collect()
    };

    let mut delta = Vec::with_capacity(n_params);
    let selected = match *aggregation {
        Aggregation::Mean {} => unreachable!("checked above"),
        Aggregation::CoordinateMedian {} | Aggregation::TrimmedMean { .. } => {
            let trim = match *aggregation {
                Aggregation::TrimmedMean { trim_fraction } => {
                    (trim_fraction * n_updates as f64).floor() as usize
                }
                _ => 0,
            };
            let mut column = vec![0.0f64; n_updates];
            for (start, len) in tiles {
                let rows = scaled(read(start, len)?);
                for j in 0..len {
                    for (c, row) in column.iter_mut().zip(&rows) {
                        *c = row[j];
                    }
                    delta.push(match aggregation {
                        Aggregation::CoordinateMedian {} => median(&mut column),
                        _ => trimmed_mean(&mut column, trim),
                    });
                }
            }
            None
        }
        Aggregation::Krum { byzantine, select, selection } => {
            let f = byzantine as usize;
            if n_updates < 2 * f + 3 {
                return Err(RobustError::TooFew(format!(
                    "Krum with {f} byzantine needs {} updates, the round has {n_updates}",
                    2 * f + 3
                )));
            }
            let mut distances = PairwiseDistances::new(n_updates);
            for (start, len) in tiles.clone() {
                distances.add_tile(&scaled(read(start, len)?));
            }
            let m = (select as usize).min(n_updates - f);
            let chosen = match selection {
                KrumSelection::Scores => distances.krum(f, m),
                KrumSelection::Iterative => distances.krum_iterative(f, m),
            };
            // Pass 3: the unweighted mean of the chosen updates.
            for (start, len) in tiles {
                let rows = scaled(read(start, len)?);
                let mut sums = vec![0.0f64; len];
                for &i in &chosen {
                    for (sum, v) in sums.iter_mut().zip(&rows[i]) {
                        *sum += v;
                    }
                }
                delta.extend(sums.into_iter().map(|sum| sum / chosen.len() as f64));
            }
            Some(chosen)
        }
        Aggregation::GeometricMedian { iterations, smoothing } => {
            // The estimate starts at the unweighted mean.
            for (start, len) in tiles.clone() {
                let rows = scaled(read(start, len)?);
                delta.extend(
                    (0..len).map(|j| rows.iter().map(|row| row[j]).sum::<f64>() / n_updates as f64),
                );
            }
            for _ in 0..iterations {
                // One pass for each update's distance to the estimate...
                let mut squares = vec![0.0f64; n_updates];
                for (start, len) in tiles.clone() {
                    let estimate = &delta[start..start + len];
                    for (sq, row) in squares.iter_mut().zip(scaled(read(start, len)?)) {
                        *sq +=
                            row.iter().zip(estimate).map(|(v, z)| (v - z) * (v - z)).sum::<f64>();
                    }
                }
                let weights: Vec<f64> =
                    squares.into_iter().map(|sq| 1.0 / sq.sqrt().max(smoothing)).collect();
                let total: f64 = weights.iter().sum();
                // ...and one for the weighted mean, which replaces it tile by tile (the
                // weights no longer need it).
                for (start, len) in tiles.clone() {
                    let rows = scaled(read(start, len)?);
                    for (j, z) in delta[start..start + len].iter_mut().enumerate() {
                        *z = rows.iter().zip(&weights).map(|(row, w)| w * row[j]).sum::<f64>()
                            / total;
                    }
                }
            }
            None
        }
    };
    Ok(Combined { delta, n_scaled, selected })
}

/// The median of `values` (reordered in place): the middle one, or the mean of the two middle
/// ones.
pub fn median(values: &mut [f64]) -> f64 {
    let n = values.len();
    assert!(n > 0, "median of nothing");
    let (_, &mut upper, _) = values.select_nth_unstable_by(n / 2, f64::total_cmp);
    if n % 2 == 1 {
        upper
    } else {
        // The largest of the lower half.
        let lower = values[..n / 2].iter().copied().fold(f64::NEG_INFINITY, f64::max);
        (lower + upper) / 2.0
    }
}

/// The mean of `values` (sorted in place) without its `trim` smallest and `trim` largest.
pub fn trimmed_mean(values: &mut [f64], trim: usize) -> f64 {
    assert!(2 * trim < values.len(), "trimming everything");
    values.sort_unstable_by(f64::total_cmp);
    let kept = &values[trim..values.len() - trim];
    kept.iter().sum::<f64>() / kept.len() as f64
}

/// Squared L2 distances between every pair of updates, summed tile by tile: O(n²) memory.
#[derive(Debug, Clone)]
pub struct PairwiseDistances {
    n: usize,
    d2: Vec<f64>,
}

impl PairwiseDistances {
    /// No coordinates seen yet.
    pub fn new(n: usize) -> Self {
        PairwiseDistances { n, d2: vec![0.0; n * n] }
    }

    /// Adds one tile's contribution (`rows[i]`: update i over the tile).
    pub fn add_tile(&mut self, rows: &[Vec<f64>]) {
        assert_eq!(rows.len(), self.n, "a tile has one row per update");
        for i in 0..self.n {
            for j in i + 1..self.n {
                let d: f64 = rows[i].iter().zip(&rows[j]).map(|(a, b)| (a - b) * (a - b)).sum();
                self.d2[i * self.n + j] += d;
                self.d2[j * self.n + i] += d;
            }
        }
    }

    /// The squared distance between updates `i` and `j`.
    pub fn get(&self, i: usize, j: usize) -> f64 {
        self.d2[i * self.n + j]
    }

    /// Krum's scores: for each update, the sum of its `n − f − 2` smallest squared distances to
    /// the others.
    pub fn krum_scores(&self, f: usize) -> Vec<f64> {
        self.krum_scores_among(f, &(0..self.n).collect::<Vec<_>>())
    }

    /// Krum's scores among the updates in `among` only (`n` = its length): for each, the
    /// sum of its `n − f − 2` smallest squared distances to the others in `among`.
    fn krum_scores_among(&self, f: usize, among: &[usize]) -> Vec<f64> {
        let nearest = among.len().saturating_sub(f + 2).max(1);
        among
            .iter()
            .map(|&i| {
                let mut row: Vec<f64> =
                    among.iter().filter(|&&j| j != i).map(|&j| self.get(i, j)).collect();
                row.sort_unstable_by(f64::total_cmp);
                row.iter().take(nearest).sum()
            })
            .collect()
    }

    /// [`KrumSelection::Iterative`]: Krum `m` times, each over the updates not yet chosen
    /// (ties: the earlier slot); in slot order.
    pub fn krum_iterative(&self, f: usize, m: usize) -> Vec<usize> {
        let mut left: Vec<usize> = (0..self.n).collect();
        let mut chosen = Vec::with_capacity(m);
        while chosen.len() < m.max(1) && !left.is_empty() {
            let scores = self.krum_scores_among(f, &left);
            let best = (0..left.len())
                .min_by(|&a, &b| scores[a].total_cmp(&scores[b]).then(left[a].cmp(&left[b])))
                .expect("left is not empty");
            chosen.push(left.remove(best));
        }
        chosen.sort_unstable();
        chosen
    }

    /// The `m` updates with the lowest Krum scores (ties: the earlier slot), in slot order.
    pub fn krum(&self, f: usize, m: usize) -> Vec<usize> {
        let scores = self.krum_scores(f);
        let mut order: Vec<usize> = (0..self.n).collect();
        order.sort_by(|&a, &b| scores[a].total_cmp(&scores[b]).then(a.cmp(&b)));
        let mut chosen: Vec<usize> = order.into_iter().take(m.max(1)).collect();
        chosen.sort_unstable();
        chosen
    }
}

#[cfg(test)]
mod tests;
