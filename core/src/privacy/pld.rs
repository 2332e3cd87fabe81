//! The privacy loss distribution (PLD) accountant for rounds of the Poisson-subsampled Gaussian
//! mechanism under add/remove adjacency: tighter than Rényi DP, as in Google's `dp-accounting`
//! `PLDAccountant` (Meiser and Mohammadi 2018; Koskela, Jälkö and Honkela 2020; Doroshenko
//! et al. 2022).
//!
//! One round's privacy loss is discretized on a grid of width `interval` by pessimistic
//! Connect-the-Dots (the grid distribution whose hockey-stick curve interpolates the round's
//! exact one at the grid points, which dominates it), rounds compose by convolution (FFT, square and multiply,
//! dropping at most `TAIL_MASS` of each tail after every product, pessimistically again), and ε
//! at δ is read off the composed distribution: δ(ε) = p(∞) + Σ_ℓ p(ℓ)·(1 − e^{ε−ℓ}). Both
//! directions of the adjacency (removing and adding a device) are composed, and the larger δ
//! holds. Every step only raises the loss, so the ε it gives is an upper bound.

use std::f64::consts::SQRT_2;

/// Mass each tail may drop per discretization or product (moved where it can only raise ε).
const TAIL_MASS: f64 = 1e-15;

/// The most grid points a distribution, or a product's convolution, may take (32 MiB of f64;
/// the FFT's complex buffers are four times that). A (q, z, rounds) past it is not represented:
/// the accountant answers `None` and the Rényi DP bound, always representable, stands alone.
/// With q = 1 the loss of adding a device is unbounded below (ln(1 − q) = −∞), and a tiny z
/// makes one round's grid billions of points wide: both once made a run's close panic with a
/// capacity overflow, which killed the coordinator's driver.
pub const MAX_POINTS: usize = 1 << 22;

/// A privacy loss distribution on the grid `interval·k`: `probs[i]` is the mass at loss
/// `(lowest + i)·interval`, `infinity` the mass of an infinite loss.
#[derive(Debug, Clone)]
struct Pmf {
    interval: f64,
    lowest: i64,
    probs: Vec<f64>,
    infinity: f64,
}

/// The grid width the run view's ε uses (`dp-accounting`'s default).
pub const INTERVAL: f64 = 1e-4;

/// [`epsilon`] at [`INTERVAL`], remembered: a run's view asks for the same figure at every
/// request, and composing thousands of rounds takes a good part of a second.
pub fn epsilon_remembered(q: f64, z: f64, rounds: u64, delta: f64) -> Option<f64> {
    use std::collections::HashMap;
    use std::sync::{Mutex, OnceLock};
    type Key = (u64, u64, u64, u64);
    static SEEN: OnceLock<Mutex<HashMap<Key, Option<f64>>>> = OnceLock::new();
    let key = (q.to_bits(), z.to_bits(), rounds, delta.to_bits());
    let seen = SEEN.get_or_init(Mutex::default);
    if let Some(&eps) = seen.lock().unwrap_or_else(|p| p.into_inner()).get(&key) {
        return eps;
    }
    let eps = epsilon(q, z, rounds, delta, INTERVAL);
    let mut seen = seen.lock().unwrap_or_else(|p| p.into_inner());
    if seen.len() >= 4096 {
        seen.clear();
    }
    seen.insert(key, eps);
    eps
}

/// ε at `delta` after `rounds` Poisson-subsampled Gaussian rounds at rate `q` with noise
/// multiplier `z`, by the PLD with grid width `interval` (`dp-accounting`'s default is 1e-4);
/// `None` when the distributions would not fit [`MAX_POINTS`] (see [`representable`]).
pub fn epsilon(q: f64, z: f64, rounds: u64, delta: f64, interval: f64) -> Option<f64> {
    if rounds == 0 || q == 0.0 {
        return Some(0.0);
    }
    representable(q, z, interval).ok()?;
    let mut eps: f64 = 0.0;
    for d in [Direction::Remove, Direction::Add] {
        eps = eps.max(one_round(q, z, d, interval).self_compose(rounds)?.epsilon(delta));
    }
    Some(eps)
}

/// Whether one round at rate `q` and noise multiplier `z` fits the grid of width `interval`
/// ([`MAX_POINTS`]); the error says which parameter does not (a plan is refused naming it).
pub fn representable(q: f64, z: f64, interval: f64) -> Result<(), RepresentError> {
    if !(q > 0.0 && q < 1.0) {
        return Err(RepresentError::SamplingRate);
    }
    if !(z.is_finite() && z > 0.0 && interval.is_finite() && interval > 0.0) {
        return Err(RepresentError::NoiseMultiplier);
    }
    let width = [Direction::Remove, Direction::Add]
        .into_iter()
        .map(|d| {
            let (lo, hi) = grid_range(q, z, d, interval);
            hi - lo + 1.0
        })
        .fold(0.0, f64::max);
    if width.is_finite() && width <= MAX_POINTS as f64 {
        Ok(())
    } else {
        Err(RepresentError::NoiseMultiplier)
    }
}

/// Which parameter puts a round past what the accountant represents.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RepresentError {
    /// The sampling rate is not in (0, 1): q = 1 is no sampling at all.
    SamplingRate,
    /// The noise multiplier is so small that one round's loss spans more than [`MAX_POINTS`].
    NoiseMultiplier,
}

/// One round's grid indices, lowest and highest, as floats (they may not fit an integer).
fn grid_range(q: f64, z: f64, direction: Direction, interval: f64) -> (f64, f64) {
    let s2 = z * z;
    let loss = |x: f64| (q * ((2.0 * x - 1.0) / (2.0 * s2)).exp_m1()).ln_1p();
    let floor = (-q).ln_1p();
    let reach = z * 8.3;
    let (x_lo, x_hi) = (-reach, 1.0 + reach);
    match direction {
        Direction::Remove => ((loss(x_lo) / interval).floor(), (loss(x_hi) / interval).ceil()),
        Direction::Add => ((-loss(x_hi) / interval).floor(), (-floor / interval).ceil()),
    }
}

#[derive(Debug, Clone, Copy)]
enum Direction {
    /// The pair ((1 − q)·N(0, z²) + q·N(1, z²), N(0, z²)).
    Remove,
    /// The pair (N(0, z²), (1 − q)·N(0, z²) + q·N(1, z²)).
    Add,
}

/// P(X > x) for X ~ N(mean, sd²), accurate in the upper tail.
fn upper_tail(x: f64, mean: f64, sd: f64) -> f64 {
    0.5 * libm::erfc((x - mean) / (sd * SQRT_2))
}

/// One round's loss distribution on the grid, by pessimistic Connect-the-Dots (Doroshenko et
/// al. 2022, Algorithm 1, as `dp-accounting` discretizes): from the round's exact hockey-stick
/// divergences δ(kΔ) at the grid points, the distribution on the grid whose δ(ε) interpolates
/// them, which dominates the round's.
fn one_round(q: f64, z: f64, direction: Direction, interval: f64) -> Pmf {
    let s2 = z * z;
    // The inverse of the loss of the mixture against N(0, z²) at x (for losses above
    // ln(1 − q)); `grid_range` reads the grid off the loss at ±8.3 z, beyond which both
    // distributions hold less than TAIL_MASS.
    let at = |l: f64| s2 * (l.exp_m1() / q).ln_1p() + 0.5;
    let floor = (-q).ln_1p();
    // The hockey-stick divergence δ(ε) = P(L > ε) − e^ε·Q(L > ε) of the round's pair.
    let delta = |eps: f64| -> f64 {
        let d = match direction {
            // L > ε ⇔ x > at(ε), for P the mixture and Q = N(0, z²).
            Direction::Remove if eps <= floor => -eps.exp_m1(),
            Direction::Remove => {
                let x = at(eps);
                (1.0 - q) * upper_tail(x, 0.0, z) + q * upper_tail(x, 1.0, z)
                    - eps.exp() * upper_tail(x, 0.0, z)
            }
            // L = −loss(x) > ε ⇔ x < at(−ε), for P = N(0, z²) and Q the mixture.
            Direction::Add if -eps <= floor => 0.0,
            Direction::Add => {
                let x = -at(-eps);
                let below = |mean: f64| upper_tail(x, -mean, z);
                below(0.0) - eps.exp() * ((1.0 - q) * below(0.0) + q * below(1.0))
            }
        };
        d.clamp(0.0, 1.0)
    };
    // `representable` checked that the range is finite and within MAX_POINTS.
    let (k_lo, k_hi) = grid_range(q, z, direction, interval);
    let (k_lo, k_hi) = (k_lo as i64, k_hi as i64);
    let deltas: Vec<f64> = (k_lo..=k_hi).map(|k| delta(k as f64 * interval)).collect();
    let n = deltas.len();
    let e = interval.exp_m1();
    let mut probs = vec![0.0; n];
    // The masses of the distribution whose δ interpolates these (fixed-gap form).
    probs[0] = (1.0 - deltas[0]) + (deltas[1] - deltas[0]) / e;
    for i in 1..n - 1 {
        probs[i] = ((deltas[i + 1] - deltas[i]) - (e + 1.0) * (deltas[i] - deltas[i - 1])) / e;
    }
    probs[n - 1] = (deltas[n - 1] - deltas[n - 2]) / (-interval).exp_m1();
    for p in &mut probs {
        *p = p.max(0.0);
    }
    Pmf { interval, lowest: k_lo, probs, infinity: deltas[n - 1] }
}

impl Pmf {
    /// The distribution of the sum of two independent losses, its tails trimmed; `None` when
    /// the product would take more than [`MAX_POINTS`].
    fn compose(&self, other: &Pmf) -> Option<Pmf> {
        if self.probs.len() + other.probs.len() - 1 > MAX_POINTS {
            return None;
        }
        let probs = convolve(&self.probs, &other.probs);
        let infinity = 1.0 - (1.0 - self.infinity) * (1.0 - other.infinity);
        let pmf =
            Pmf { interval: self.interval, lowest: self.lowest + other.lowest, probs, infinity };
        Some(pmf.trimmed())
    }

    /// `n` ≥ 1 independent copies composed (square and multiply); `None` past [`MAX_POINTS`].
    fn self_compose(&self, mut n: u64) -> Option<Pmf> {
        let mut result: Option<Pmf> = None;
        let mut square = self.clone();
        loop {
            if n & 1 == 1 {
                result = Some(match result {
                    None => square.clone(),
                    Some(r) => r.compose(&square)?,
                });
            }
            n >>= 1;
            if n == 0 {
                return result;
            }
            square = square.compose(&square)?;
        }
    }

    /// Drops up to `TAIL_MASS` from each end: the low end's mass joins the first bucket kept,
    /// the high end's becomes an infinite loss; both only raise ε.
    fn trimmed(mut self) -> Pmf {
        for p in &mut self.probs {
            *p = p.max(0.0);
        }
        let (mut low, mut dropped_low) = (0, 0.0);
        while low + 1 < self.probs.len() && dropped_low + self.probs[low] <= TAIL_MASS {
            dropped_low += self.probs[low];
            low += 1;
        }
        let (mut high, mut dropped_high) = (self.probs.len(), 0.0);
        while high > low + 1 && dropped_high + self.probs[high - 1] <= TAIL_MASS {
            dropped_high += self.probs[high - 1];
            high -= 1;
        }
        let mut probs = self.probs[low..high].to_vec();
        probs[0] += dropped_low;
        Pmf {
            interval: self.interval,
            lowest: self.lowest + low as i64,
            probs,
            infinity: self.infinity + dropped_high,
        }
    }

    /// δ(ε) = p(∞) + Σ p(ℓ)·(1 − e^{ε−ℓ}) over the losses above ε.
    fn delta(&self, epsilon: f64) -> f64 {
        let tail: f64 = self
            .probs
            .iter()
            .enumerate()
            .map(|(i, &p)| (p, (self.lowest + i as i64) as f64 * self.interval))
            .filter(|&(_, l)| l > epsilon)
            .map(|(p, l)| -p * (epsilon - l).exp_m1())
            .sum();
        self.infinity + tail
    }

    /// The smallest ε ≥ 0 with δ(ε) ≤ `delta` (∞ when the infinite loss alone is more).
    fn epsilon(&self, delta: f64) -> f64 {
        if self.infinity > delta {
            return f64::INFINITY;
        }
        if self.delta(0.0) <= delta {
            return 0.0;
        }
        let top = (self.lowest + self.probs.len() as i64) as f64 * self.interval;
        let (mut lo, mut hi) = (0.0, top.max(0.0));
        for _ in 0..100 {
            let mid = 0.5 * (lo + hi);
            if self.delta(mid) <= delta { hi = mid } else { lo = mid }
        }
        hi
    }
}

/// The linear convolution of `a` and `b`, by FFT.
fn convolve(a: &[f64], b: &[f64]) -> Vec<f64> {
    let len = a.len() + b.len() - 1;
    let n = len.next_power_of_two();
    let mut fa: Vec<(f64, f64)> = a.iter().map(|&x| (x, 0.0)).collect();
    let mut fb: Vec<(f64, f64)> = b.iter().map(|&x| (x, 0.0)).collect();
    fa.resize(n, (0.0, 0.0));
    fb.resize(n, (0.0, 0.0));
    fft(&mut fa, false);
    fft(&mut fb, false);
    for (x, y) in fa.iter_mut().zip(&fb) {
        *x = (x.0 * y.0 - x.1 * y.1, x.0 * y.1 + x.1 * y.0);
    }
    fft(&mut fa, true);
    fa.truncate(len);
    fa.into_iter().map(|(re, _)| re / n as f64).collect()
}

/// In-place iterative radix-2 FFT (`inverse` without the 1/n).
fn fft(data: &mut [(f64, f64)], inverse: bool) {
    let n = data.len();
    let mut j = 0;
    for i in 1..n {
        let mut bit = n >> 1;
        while j & bit != 0 {
            j ^= bit;
            bit >>= 1;
        }
        j |= bit;
        if i < j {
            data.swap(i, j);
        }
    }
    let sign = if inverse { 1.0 } else { -1.0 };
    // e^{±2πik/n}, each computed directly (no recurrence to drift).
    let twiddles: Vec<(f64, f64)> = (0..n / 2)
        .map(|k| {
            let (s, c) = (sign * 2.0 * std::f64::consts::PI * k as f64 / n as f64).sin_cos();
            (c, s)
        })
        .collect();
    let mut size = 2;
    while size <= n {
        let half = size / 2;
        let stride = n / size;
        for start in (0..n).step_by(size) {
            for k in 0..half {
                let (c, s) = twiddles[k * stride];
                let (a, b) = (data[start + k], data[start + k + half]);
                let t = (b.0 * c - b.1 * s, b.0 * s + b.1 * c);
                data[start + k] = (a.0 + t.0, a.1 + t.1);
                data[start + k + half] = (a.0 - t.0, a.1 - t.1);
            }
        }
        size *= 2;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fft_convolves_exactly_enough() {
        let a = [0.5, 0.25, 0.25];
        let b = [0.1, 0.2, 0.3, 0.4];
        let want = [0.05, 0.125, 0.225, 0.325, 0.175, 0.1];
        for (g, w) in convolve(&a, &b).iter().zip(want) {
            assert!((g - w).abs() < 1e-15, "{g} vs {w}");
        }
    }

    #[test]
    fn one_round_without_sampling_is_the_gaussian_mechanism() {
        // q = 1: the loss is N(1/(2z²), 1/z²); δ(ε) of the Gaussian mechanism has a closed
        // form (Balle and Wang 2018): Φ(1/(2z) − εz) − e^ε·Φ(−1/(2z) − εz).
        let z: f64 = 1.3;
        let phi = |x: f64| 0.5 * libm::erfc(-x / SQRT_2);
        for eps in [0.5, 1.0, 2.0] {
            let want = phi(0.5 / z - eps * z) - eps.exp() * phi(-0.5 / z - eps * z);
            let got = one_round(1.0 - 1e-12, z, Direction::Remove, 1e-4).delta(eps);
            assert!((got - want).abs() <= 2e-4 * want, "ε {eps}: δ {got} vs {want}");
            assert!(got >= want * (1.0 - 1e-9), "pessimistic: {got} < {want}");
        }
    }

    #[test]
    fn each_round_has_all_its_mass_and_epsilon_grows_with_rounds() {
        for d in [Direction::Remove, Direction::Add] {
            let p = one_round(0.1, 1.0, d, 1e-3);
            let total: f64 = p.probs.iter().sum::<f64>() + p.infinity;
            assert!((total - 1.0).abs() < 1e-9, "{d:?}: {total}");
        }
        let eps: Vec<f64> =
            [1, 10, 100].iter().map(|&t| epsilon(0.1, 1.0, t, 1e-5, 1e-3).unwrap()).collect();
        assert!(eps.windows(2).all(|w| w[0] < w[1]), "{eps:?}");
    }

    /// q = 1 once sized one round's grid from ln(1 − q) = −∞ and panicked allocating it; a
    /// tiny z spans billions of points. Both are not represented, and say which parameter.
    #[test]
    fn rounds_past_the_grid_are_not_represented_and_say_why() {
        assert_eq!(representable(1.0, 1.0, INTERVAL), Err(RepresentError::SamplingRate));
        assert_eq!(epsilon(1.0, 1.0, 3, 1e-5, INTERVAL), None);
        assert_eq!(representable(0.1, 1e-4, INTERVAL), Err(RepresentError::NoiseMultiplier));
        assert_eq!(epsilon(0.1, 1e-4, 3, 1e-5, INTERVAL), None);
        assert_eq!(representable(0.999_999, 1.0, INTERVAL), Ok(()));
        assert!(epsilon(0.999_999, 1.0, 3, 1e-5, INTERVAL).unwrap().is_finite());
    }
}
