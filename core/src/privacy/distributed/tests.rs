//! The discrete Gaussian sampler against its pmf, the rotation, a cohort's noisy sum against
//! the noise it promises, and the accountant's limits. (The accountant is checked against an
//! independent implementation of the paper's formulas by the integration suite.)

use super::*;

/// P(x) ∝ e^{−x²/2σ²} over the integers, normalized over |x| ≤ 40σ + 40.
fn pmf(sigma: f64) -> impl Fn(i64) -> f64 {
    let reach = (40.0 * sigma) as i64 + 40;
    let weight = move |x: i64| (-(x as f64).powi(2) / (2.0 * sigma * sigma)).exp();
    let total: f64 = (-reach..=reach).map(weight).sum();
    move |x| weight(x) / total
}

/// Pearson's χ² of `draws` samples against the pmf, tails pooled so every bin expects at least
/// 20; the statistic and its degrees of freedom.
fn chi_square(sigma: f64, draws: usize, seed: u8) -> (f64, usize) {
    let mut source = NoiseSource::new([seed; 32]);
    let p = pmf(sigma);
    let mut cut = 0i64;
    while p(cut + 1) * draws as f64 >= 20.0 {
        cut += 1;
    }
    // Bins: −cut..=cut, then the two tails.
    let mut counts = vec![0usize; 2 * cut as usize + 3];
    for _ in 0..draws {
        let x = source.discrete_gaussian(sigma);
        let bin = if x < -cut {
            counts.len() - 2
        } else if x > cut {
            counts.len() - 1
        } else {
            (x + cut) as usize
        };
        counts[bin] += 1;
    }
    let tail: f64 = 0.5 * (1.0 - (-cut..=cut).map(&p).sum::<f64>());
    let mut stat = 0.0;
    for (bin, &observed) in counts.iter().enumerate() {
        let prob = if bin + 2 >= counts.len() { tail } else { p(bin as i64 - cut) };
        let expected = prob * draws as f64;
        stat += (observed as f64 - expected).powi(2) / expected;
    }
    (stat, counts.len() - 1)
}

/// The sampler's histogram fits the discrete Gaussian's pmf (χ² below its 1e-6 quantile, well
/// within reach of a fair sampler) at narrow and wide scales. A rounded continuous Gaussian,
/// the usual shortcut, fails at σ = 0.5 by a χ² in the thousands.
#[test]
fn the_discrete_gaussian_sampler_follows_its_pmf() {
    for (sigma, seed) in [(0.5, 1), (1.7, 2), (6.0, 3), (25.0, 4)] {
        let (stat, df) = chi_square(sigma, 200_000, seed);
        // The 1 − 1e-6 quantile of χ²(df) is below df + 7·√(2·df) + 25 for these df.
        let limit = df as f64 + 7.0 * (2.0 * df as f64).sqrt() + 25.0;
        assert!(stat < limit, "σ = {sigma}: χ² = {stat:.1} over {df} degrees of freedom");
    }
    // The shortcut the test must catch: P(0) of the rounded continuous Gaussian at σ = 0.5.
    let rounded_zero = libm::erf(0.5 / (0.5 * std::f64::consts::SQRT_2));
    assert!((pmf(0.5)(0) - rounded_zero).abs() > 0.1);
}

/// At the wide scales devices use (10⁶ and more on the grid), the draws have mean 0 and
/// variance σ² to within their sampling error.
#[test]
fn wide_discrete_gaussians_have_the_stated_variance() {
    let sigma = 3.0e6;
    let n = 100_000;
    let mut source = NoiseSource::new([9; 32]);
    let draws: Vec<f64> = (0..n).map(|_| source.discrete_gaussian(sigma) as f64).collect();
    let mean = draws.iter().sum::<f64>() / n as f64;
    let var = draws.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n as f64;
    assert!(mean.abs() < 5.0 * sigma / (n as f64).sqrt(), "mean {mean}");
    // The variance's standard error is σ²·√(2/n) ≈ 0.45 %.
    assert!((var / (sigma * sigma) - 1.0).abs() < 0.025, "variance ratio {}", var / sigma / sigma);
}

#[test]
fn the_rotation_keeps_norms_and_is_undone() {
    let seed = rotation_seed(&[4; 16]);
    let x: Vec<f64> = (0..1024).map(|i| ((i * 37 % 101) as f64 - 50.0) / 7.0).collect();
    let mut y = x.clone();
    rotate(&mut y, &seed);
    let norm = |v: &[f64]| v.iter().map(|a| a * a).sum::<f64>().sqrt();
    assert!((norm(&x) - norm(&y)).abs() < 1e-9 * norm(&x));
    assert!(y.iter().zip(&x).any(|(a, b)| (a - b).abs() > 1e-3), "it moved");
    unrotate(&mut y, &seed);
    for (a, b) in x.iter().zip(&y) {
        assert!((a - b).abs() < 1e-12, "{a} vs {b}");
    }
}

fn delta(device: u32, n_params: usize) -> Vec<f32> {
    // Norms from 0.5 to 2.5: some are clipped to C = 1.
    let scale = 0.5 + f64::from(device % 5) * 0.5;
    let raw: Vec<f64> = (0..n_params)
        .map(|j| (((j as u32 * 7919 + device * 104_729) % 2000) as f64) - 999.5)
        .collect();
    let norm = raw.iter().map(|v| v * v).sum::<f64>().sqrt();
    raw.iter().map(|v| (v / norm * scale) as f32).collect()
}

/// Twenty devices encode; their ring sum decodes to the sum of their clipped updates plus noise
/// whose variance per coordinate is the promised z²C² (the noise of `min_survivors` devices
/// adds up to the central mechanism's), within its sampling error. The sum passes the
/// plausibility check; a device masking values far outside its range fails it.
#[test]
fn a_cohort_sum_decodes_to_the_clipped_sum_plus_the_promised_noise() {
    let (n, n_params, z) = (20u32, 3000usize, 0.8);
    let noise = DistributedNoise::for_plan(z, 1.0, n_params, n, n).unwrap();
    assert_eq!(noise.padded_len(), 4096);
    let rotation = rotation_seed(&[7; 16]);
    let mut sum = vec![0u32; noise.padded_len()];
    let mut clipped_sum = vec![0f64; n_params];
    for device in 0..n {
        let mut source = NoiseSource::new([device as u8 + 1; 32]);
        let d = delta(device, n_params);
        let norm = d.iter().map(|&v| f64::from(v).powi(2)).sum::<f64>().sqrt();
        for (s, &v) in clipped_sum.iter_mut().zip(&d) {
            *s += f64::from(v) * (1.0 / norm).min(1.0);
        }
        for (s, v) in sum.iter_mut().zip(noise.encode(&d, &rotation, &mut source)) {
            *s = s.wrapping_add(v);
        }
    }
    noise.check_sum(&sum, n).unwrap();
    let decoded = noise.decode_sum(&sum, &rotation);
    assert_eq!(decoded.len(), n_params);
    let residual: Vec<f64> = decoded.iter().zip(&clipped_sum).map(|(a, b)| a - b).collect();
    let mean = residual.iter().sum::<f64>() / n_params as f64;
    let var = residual.iter().map(|r| (r - mean).powi(2)).sum::<f64>() / n_params as f64;
    let want = z * z;
    // Standard error of the variance over 3000 coordinates: √(2/3000) ≈ 2.6 %.
    assert!((var / want - 1.0).abs() < 0.12, "noise variance {var}, promised {want}");
    assert!(mean.abs() < 5.0 * z / (n_params as f64).sqrt(), "noise mean {mean}");

    // A device that masks a quarter of the ring in every coordinate instead of its input.
    let poisoned: Vec<u32> = sum.iter().map(|s| s.wrapping_add(1 << 30)).collect();
    assert!(noise.check_sum(&poisoned, n).is_err());
}

/// With the wide noise devices add, τ vanishes and the rounding's inflation is negligible: one
/// round is the Gaussian mechanism of noise multiplier z (add/remove) or z/2 (replace-one).
#[test]
fn with_wide_noise_one_round_is_the_gaussian_mechanism() {
    let z = 1.3;
    let noise = DistributedNoise::for_plan(z, 0.7, 100_000, 100, 80).unwrap();
    assert_eq!(noise.tau(), 0.0);
    for alpha in [2.0, 9.0, 64.0] {
        let gaussian = alpha / (2.0 * z * z);
        let add_remove = noise.rdp(alpha, false);
        assert!((add_remove / gaussian - 1.0).abs() < 1e-5, "{add_remove} vs {gaussian}");
        let replace_one = noise.rdp(alpha, true);
        assert!((replace_one / (4.0 * gaussian) - 1.0).abs() < 1e-5);
    }
    // Unsampled, the accountant is its rounds' sum.
    let one = noise.epsilon(Sampling::Poisson, 1.0, 1, 1e-5);
    let ten = noise.epsilon(Sampling::Poisson, 1.0, 10, 1e-5);
    assert!(ten > one && one > 0.0);
}

/// Narrow noise on the grid costs τ, sampling amplifies, and more rounds spend more.
#[test]
fn narrow_noise_costs_tau_and_sampling_amplifies() {
    let wide = DistributedNoise::for_plan(1.0, 1.0, 1000, 50, 50).unwrap();
    // The same noise on a grid where each device's share is σ = 0.6 steps wide.
    let narrow = DistributedNoise { gamma: wide.local_stddev / 0.6, ..wide };
    assert!(narrow.tau() > 1e-3);
    assert!(narrow.rdp(8.0, false) > wide.rdp(8.0, false));
    for sampling in [Sampling::Poisson, Sampling::FixedSize] {
        let sampled = wide.epsilon(sampling, 0.05, 30, 1e-5);
        let full = wide.epsilon(sampling, 1.0, 30, 1e-5);
        assert!(sampled < full, "{sampling:?}: {sampled} vs {full}");
        assert!(wide.epsilon(sampling, 0.05, 60, 1e-5) > sampled);
    }
}

#[test]
fn a_plan_that_cannot_count_on_its_survivors_is_refused() {
    assert!(DistributedNoise::for_plan(1.0, 1.0, 10, 20, 0).is_err());
    assert!(DistributedNoise::for_plan(1.0, 1.0, 10, 20, 21).is_err());
}
