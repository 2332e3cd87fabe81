//! What a DP round may release beside its noised model when its plan says `metrics: noised`:
//! the cohort's training loss and pooled evaluation, clipped per device and noised inside the
//! run's one accounted Gaussian mechanism.
//!
//! **Mechanism.** Each device's report becomes a block of [`ENTRIES`] values in `[0, 1]`: its
//! training loss over the plan's `loss_bound` (clipped), whether it evaluated the round's model,
//! its accuracy if it did, and its evaluation loss over `loss_bound` if it did (0 otherwise).
//! The coordinator (or, in a secure round, the masked sum) adds the blocks up with every device
//! weighing 1, and adds `N(0, σ_m²)` to each of the four sums. One device moves the block sum
//! by at most `√ENTRIES = 2` in L2 (under add/remove; replacing a device moves it by at most
//! 2 as well, within the `2×` the replace-one accountant allows for every part), so the block
//! is a Gaussian mechanism of noise multiplier `σ_m / 2`. Released with the update sum (`z_Δ`)
//! and, with adaptive clipping, the clip count (`2σ_b`), the three are one Gaussian mechanism
//! of multiplier `z = (z_Δ⁻² + (2σ_b)⁻² + (σ_m/2)⁻²)^(-1/2)` (Andrew et al. 2021, Theorem 1,
//! with one more part): the plan's `noise_multiplier` is `z`, and the update noise gives up
//! what the metrics take. Everything shown afterwards (means, ratios, clamping) is
//! post-processing of the noisy sums.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::Gaussian;
use super::exact_normal::NoiseError;

/// Values one device contributes to the metrics block.
pub const ENTRIES: usize = 4;

/// L2 bound of one device's block: `√ENTRIES`.
pub const BLOCK_SENSITIVITY: f64 = 2.0;

/// Block entry: training loss over the loss bound.
pub const TRAIN_LOSS: &str = "dp_train_loss";
/// Block entry: 1 when the device evaluated the round's model.
pub const EVALUATED: &str = "dp_evaluated";
/// Block entry: evaluation accuracy (0 without an evaluation).
pub const ACCURACY: &str = "dp_accuracy";
/// Block entry: evaluation loss over the loss bound (0 without an evaluation).
pub const EVAL_LOSS: &str = "dp_eval_loss";

/// Metric names a device sends in a plain round's upload when its evaluation rides with it.
pub const UPLOAD_EVAL_ACCURACY: &str = "eval_accuracy";
/// See [`UPLOAD_EVAL_ACCURACY`].
pub const UPLOAD_EVAL_LOSS: &str = "eval_loss";

/// The plan's `differential_privacy.metrics`.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MetricsRelease {
    /// Devices send no metrics and no evaluation; the run releases only its noised model.
    #[default]
    Withheld,
    /// The cohort's training loss and pooled evaluation are clipped per device and noised in
    /// the run's accounting (the update noise gives up what they take).
    Noised(NoisedMetrics),
}

/// Settings of noised metrics.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NoisedMetrics {
    /// Noise σ_m on each of the block's sums (in units of one device's accuracy); default:
    /// devices selected per round / 10, which puts about ±0.1 of noise on a released accuracy.
    #[serde(default)]
    pub stddev: Option<f64>,
    /// Losses are clipped to `[0, loss_bound]` per device before they are added up.
    #[serde(default = "default_loss_bound")]
    pub loss_bound: f64,
}

fn default_loss_bound() -> f64 {
    10.0
}

impl MetricsRelease {
    /// The noised metrics' settings; `None` when they are withheld.
    pub fn noised(self) -> Option<NoisedMetrics> {
        match self {
            MetricsRelease::Withheld => None,
            MetricsRelease::Noised(m) => Some(m),
        }
    }
}

/// One device's block, each entry in `[0, 1]`: its training loss and its evaluation
/// (accuracy, loss) if it made one. Non-finite values count as the worst case. (A secure
/// round's block, which carries no training loss, comes from its masked evaluation sums.)
pub fn block(
    train_loss: f64,
    evaluation: Option<(f64, f64)>,
    loss_bound: f64,
) -> BTreeMap<String, f64> {
    let unit = |x: f64, worst: f64| if x.is_finite() { x.clamp(0.0, 1.0) } else { worst };
    let mut block = BTreeMap::new();
    block.insert(TRAIN_LOSS.to_owned(), unit(train_loss / loss_bound, 1.0));
    let (evaluated, accuracy, loss) = match evaluation {
        Some((accuracy, loss)) => (1.0, unit(accuracy, 0.0), unit(loss / loss_bound, 1.0)),
        None => (0.0, 0.0, 0.0),
    };
    block.insert(EVALUATED.to_owned(), evaluated);
    block.insert(ACCURACY.to_owned(), accuracy);
    block.insert(EVAL_LOSS.to_owned(), loss);
    block
}

/// A plain round's upload metrics turned into the device's block: `loss`, and its evaluation
/// when it carries both [`UPLOAD_EVAL_ACCURACY`] and [`UPLOAD_EVAL_LOSS`]. Other names are
/// dropped (nothing un-noised is kept).
pub fn block_of_upload(metrics: &BTreeMap<String, f64>, loss_bound: f64) -> BTreeMap<String, f64> {
    let train_loss = metrics.get("loss").copied().unwrap_or(f64::INFINITY);
    let evaluation = match (metrics.get(UPLOAD_EVAL_ACCURACY), metrics.get(UPLOAD_EVAL_LOSS)) {
        (Some(&accuracy), Some(&loss)) => Some((accuracy, loss)),
        _ => None,
    };
    block(train_loss, evaluation, loss_bound)
}

/// What a DP round releases beside its model.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Released {
    /// Round metrics: the cohort's noised mean training loss (`loss`), when the round's
    /// blocks carry training losses.
    pub metrics: BTreeMap<String, f64>,
    /// The cohort's noised pooled evaluation, when the noisy count of evaluating devices is at
    /// least one.
    pub evaluation: Option<NoisedEvaluation>,
}

/// A cohort's pooled evaluation as a DP round releases it.
#[derive(Debug, Clone, PartialEq)]
pub struct NoisedEvaluation {
    /// The noisy count of devices that evaluated, rounded (every device weighs 1).
    pub n_devices: u64,
    /// `accuracy` and `loss`: ratios of the noisy sums, clamped to their ranges.
    pub metrics: BTreeMap<String, f64>,
}

/// Noises a round's block sums and turns them into what is released. `means` holds each
/// entry's mean over `n_updates` devices (so `mean · n_updates` is the sum); `denominator` is
/// what the round's noisy sums are divided by (the cohort, or with Poisson sampling the
/// expected cohort).
pub fn release(
    means: &BTreeMap<String, f64>,
    n_updates: u64,
    denominator: f64,
    settings: &NoisedMetrics,
    stddev: f64,
    noise: &mut Gaussian,
) -> Result<Released, NoiseError> {
    let n = n_updates as f64;
    let mut noisy =
        |name: &str| means.get(name).map(|mean| noise.noised(mean * n, stddev)).transpose();
    let bound = settings.loss_bound;
    let train_loss = noisy(TRAIN_LOSS)?;
    let (evaluated, accuracy, eval_loss) = (noisy(EVALUATED)?, noisy(ACCURACY)?, noisy(EVAL_LOSS)?);
    let mut released = Released::default();
    if let Some(sum) = train_loss {
        let loss = (bound * sum / denominator.max(1.0)).clamp(0.0, bound);
        released.metrics.insert("loss".to_owned(), loss);
    }
    if let (Some(count), Some(accuracy), Some(loss)) = (evaluated, accuracy, eval_loss)
        && count >= 1.0
    {
        let devices = count.round() as u64;
        released.evaluation = Some(NoisedEvaluation {
            n_devices: devices,
            metrics: [
                ("accuracy".to_owned(), (accuracy / count).clamp(0.0, 1.0)),
                ("loss".to_owned(), (bound * loss / count).clamp(0.0, bound)),
            ]
            .into(),
        });
    }
    Ok(released)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings() -> NoisedMetrics {
        NoisedMetrics { stddev: None, loss_bound: 5.0 }
    }

    #[test]
    fn a_device_block_is_clipped_into_the_unit_cube_and_bounded_by_its_sensitivity() {
        let worst = [
            block(1e9, Some((7.0, 1e9)), 5.0),
            block(f64::NAN, Some((f64::NAN, f64::INFINITY)), 5.0),
            block(-3.0, Some((-1.0, -2.0)), 5.0),
            block_of_upload(&[("loss".to_owned(), 2.5), ("other".to_owned(), 9.0)].into(), 5.0),
        ];
        for b in &worst {
            assert!(b.values().all(|v| (0.0..=1.0).contains(v)), "{b:?}");
            let norm = b.values().map(|v| v * v).sum::<f64>().sqrt();
            assert!(norm <= BLOCK_SENSITIVITY + 1e-12, "{b:?}");
            assert!(b.keys().all(|k| k.starts_with("dp_")), "only block entries are kept: {b:?}");
        }
        assert_eq!(worst[0][TRAIN_LOSS], 1.0);
        assert_eq!(worst[1][ACCURACY], 0.0, "a NaN accuracy counts as none right");
        assert_eq!(worst[3][TRAIN_LOSS], 0.5);
        assert_eq!(worst[3][EVALUATED], 0.0, "an upload without both evaluation metrics");
        let evaluated = block_of_upload(
            &[
                ("loss".to_owned(), 1.0),
                (UPLOAD_EVAL_ACCURACY.to_owned(), 0.8),
                (UPLOAD_EVAL_LOSS.to_owned(), 2.0),
            ]
            .into(),
            5.0,
        );
        assert_eq!(
            evaluated.values().copied().collect::<Vec<_>>(),
            // Sorted by name: accuracy, eval loss, evaluated, train loss.
            vec![0.8, 0.4, 1.0, 0.2]
        );
    }

    #[test]
    fn released_metrics_are_unbiased_with_the_stated_noise() {
        // 40 devices, 30 of which evaluated at accuracy 0.75 and loss 1.0, all with training
        // loss 2.0: sums 16 (2/5 · 40), 30, 22.5, 6 (1/5 · 30).
        let n = 40u64;
        let means: BTreeMap<String, f64> = [
            (TRAIN_LOSS.to_owned(), 0.4),
            (EVALUATED.to_owned(), 0.75),
            (ACCURACY.to_owned(), 0.5625),
            (EVAL_LOSS.to_owned(), 0.15),
        ]
        .into();
        let stddev = 4.0;
        let mut noise = Gaussian::new([7; 32]);
        let draws = 20_000;
        let (mut loss, mut loss2, mut acc, mut devices) = (0.0, 0.0, 0.0, 0.0);
        for _ in 0..draws {
            let r = release(&means, n, n as f64, &settings(), stddev, &mut noise).unwrap();
            let l = r.metrics["loss"];
            loss += l;
            loss2 += l * l;
            let e = r.evaluation.expect("30 evaluated, noise 4: the count stays above 1");
            acc += e.metrics["accuracy"];
            devices += e.n_devices as f64;
        }
        let d = f64::from(draws);
        let (mean, var) = (loss / d, loss2 / d - (loss / d).powi(2));
        // The loss's noise is 5 · 4 / 40 = 0.5: its mean within 4 standard errors.
        assert!((mean - 2.0).abs() < 4.0 * 0.5 / d.sqrt(), "{mean}");
        assert!((var.sqrt() - 0.5).abs() < 0.02, "stddev {}", var.sqrt());
        // A ratio of noisy sums: close to 0.75 (its bias is second order, ~1e-3 here).
        assert!((acc / d - 0.75).abs() < 0.01, "{}", acc / d);
        assert!((devices / d - 30.0).abs() < 0.2, "{}", devices / d);
    }

    #[test]
    fn nobody_evaluating_releases_no_evaluation_and_a_secure_block_no_loss() {
        let means: BTreeMap<String, f64> =
            [(EVALUATED.to_owned(), 0.0), (ACCURACY.to_owned(), 0.0), (EVAL_LOSS.to_owned(), 0.0)]
                .into();
        let mut noise = Gaussian::new([1; 32]);
        let r = release(&means, 50, 50.0, &settings(), 1e-9, &mut noise).unwrap();
        assert_eq!(r, Released::default());
    }
}
