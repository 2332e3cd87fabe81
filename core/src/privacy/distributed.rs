//! Distributed differential privacy for secure rounds: the distributed discrete Gaussian
//! mechanism (DDGauss; Kairouz, Liu and Steinke, "The Distributed Discrete Gaussian Mechanism
//! for Federated Learning with Secure Aggregation", ICML 2021). Each device clips its update,
//! rotates it (a randomized Hadamard transform from the round's session), scales it to the
//! integer grid, rounds it randomly (again, until its norm is within the bound the accountant
//! uses), adds discrete Gaussian noise and masks the integers in SecAgg's ring. The coordinator
//! unmasks a sum that is already noisy: it never holds an un-noised aggregate, not even for a
//! moment, whatever it does.
//!
//! Accounting (the paper's Proposition 14 with Theorem 1's τ, over integer Rényi orders): the
//! noise in a sum of `n` devices' is close to one discrete Gaussian of `n` times the variance,
//! at a cost τ that vanishes when each device's noise is wide on the grid; the sensitivity is
//! the clip norm inflated by the rounding. The plan states the fewest survivors `n` the
//! guarantee counts on, and a round with fewer fails before anything is unmasked (more
//! survivors only add independent noise). The round's sampling amplifies it with the general
//! bounds: Zhu and Wang (2019), Theorem 5, for Poisson sampling; Wang, Balle and
//! Kasiviswanathan (2019), Theorem 9, for the fixed-size draw (replace-one adjacency, so the
//! sensitivities double). The ring is sized so that the noisy sum wraps with probability about
//! 1e-12 per coordinate; a wrap is post-processing (no privacy cost) and, being far outside any
//! honest sum, fails the round's plausibility check.

use chacha20::cipher::{KeyIvInit, StreamCipher};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::{RdpAccountant, Sampling, log_a_without_replacement, log_add, log_comb};

/// Bits of the ring the masked sum lives in (SecAgg's Z/2^32).
const RING_BITS: i32 = 32;
/// Standard deviations of each coordinate of the noisy sum kept inside the ring (the paper's
/// k): at 7 a coordinate wraps with probability about 1e-12.
const RING_STDDEVS: f64 = 7.0;
/// The conditional rounding's β: a rounding is drawn again while its norm exceeds a bound that
/// holds with probability 1 − β (the paper's experiments: e^{−1/2}).
pub const BETA: f64 = 0.606_530_659_712_633_4;
/// Conditional roundings tried before rounding toward zero, which always meets the bound.
const ROUNDING_TRIES: u32 = 1000;

/// A secure DP round's distributed noise, resolved from the plan: what every device applies
/// and what the coordinator decodes and accounts.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct DistributedNoise {
    /// The L2 norm each device clips its update to, C.
    pub clip_norm: f64,
    /// Each device's noise standard deviation, in the update's units: `z·C/√min_survivors`.
    pub local_stddev: f64,
    /// The integer grid's step, γ (the update's units per integer).
    pub gamma: f64,
    /// The model's parameters.
    pub n_params: usize,
    /// The fewest survivors the guarantee counts on: a round with fewer fails unreleased.
    pub min_survivors: u32,
    /// The devices selected per round: the ring is sized for their sum.
    pub cohort: u32,
}

impl DistributedNoise {
    /// The noise for noise multiplier `z` (noise of the sum of `min_survivors` devices over `C`)
    /// and clip norm `clip_norm`, on a model of `n_params` parameters, with the ring sized for
    /// a sum of `cohort` devices.
    pub fn for_plan(
        z: f64,
        clip_norm: f64,
        n_params: usize,
        cohort: u32,
        min_survivors: u32,
    ) -> Result<Self, String> {
        if min_survivors == 0 || min_survivors > cohort {
            return Err(format!("min_survivors must be in 1..={cohort}, the devices selected"));
        }
        let local_stddev = z * clip_norm / f64::from(min_survivors).sqrt();
        // The paper's Eq. 61 (its `heuristic_scale_factor`, ρ = 1): k standard deviations of
        // each coordinate of the sum — signal n·C/√d at worst, noise √n·σ, rounding √n·γ/2 —
        // within the ring's half-width.
        let (n, k, d) = (f64::from(cohort), RING_STDDEVS, padded(n_params) as f64);
        let room = 2f64.powi(2 * RING_BITS) - n * k * k;
        let spread = (clip_norm * clip_norm * n * n / d + n * local_stddev * local_stddev).sqrt();
        let gamma = 2.0 * k * spread / room.sqrt();
        if !(gamma.is_finite() && gamma > 0.0) {
            return Err(format!("no integer grid fits a sum of {cohort} devices in the ring"));
        }
        Ok(DistributedNoise { clip_norm, local_stddev, gamma, n_params, min_survivors, cohort })
    }

    /// The smallest noise multiplier (to 0.1 %) with which this noise, sampled by `sampling` at
    /// rate `q` for `rounds` rounds, spends at most `epsilon` at `delta`: how an operator (or a
    /// benchmark) sizes z for a budget, as [`super::noise_multiplier_for`] does for central
    /// noise.
    pub fn noise_multiplier_for(
        &self,
        sampling: Sampling,
        q: f64,
        rounds: u64,
        delta: f64,
        epsilon: f64,
    ) -> Option<f64> {
        let spends = |z: f64| {
            Self::for_plan(z, self.clip_norm, self.n_params, self.cohort, self.min_survivors)
                .map_or(f64::INFINITY, |noise| noise.epsilon(sampling, q, rounds, delta))
        };
        super::smallest_noise(spends, epsilon)
    }

    /// ε after `rounds` rounds sampled by `sampling` at rate `q`, at `delta`.
    pub fn epsilon(&self, sampling: Sampling, q: f64, rounds: u64, delta: f64) -> f64 {
        self.accountant(sampling, q).epsilon(rounds, delta)
    }

    /// ε at `delta` after a device took part in `participations` rounds, with no amplification
    /// by sampling: what holds against the coordinator, which draws the cohort and so knows who
    /// is in it. Each participation is the noisy sum of Proposition 14 with the device's
    /// contribution added or removed, composed `participations` times.
    pub fn epsilon_unamplified(&self, participations: u64, delta: f64) -> f64 {
        let orders = integer_orders();
        let per_step = orders.iter().map(|&alpha| self.rdp(alpha, false)).collect();
        RdpAccountant { orders, per_step }.epsilon(participations, delta)
    }

    /// The rotation's dimension: the parameters, padded to a power of two (what each device
    /// masks).
    pub fn padded_len(&self) -> usize {
        padded(self.n_params)
    }

    /// Each device's noise standard deviation on the integer grid.
    fn grid_stddev(&self) -> f64 {
        self.local_stddev / self.gamma
    }

    /// The L2 bound of a device's rounded vector on the grid: the clip norm scaled, inflated
    /// by the rounding (the paper's Theorem 1 / its `rounded_l2_norm_bound`).
    pub fn rounded_l2_bound(&self) -> f64 {
        let c = self.clip_norm / self.gamma;
        let d = self.padded_len() as f64;
        let loose = c + d.sqrt();
        let tight =
            (c * c + d / 4.0 + (2.0 * (1.0 / BETA).ln()).sqrt() * (c + d.sqrt() / 2.0)).sqrt();
        loose.min(tight)
    }

    /// τ of Theorem 1: what summing `min_survivors` discrete Gaussians costs against one of the
    /// summed variance.
    fn tau(&self) -> f64 {
        let s = self.grid_stddev();
        let two_pi2_s2 = 2.0 * std::f64::consts::PI.powi(2) * s * s;
        let mut tau = 0.0;
        for k in 1..self.min_survivors {
            let k = f64::from(k);
            let term = (-two_pi2_s2 * k / (k + 1.0)).exp();
            if term == 0.0 {
                break;
            }
            tau += term;
        }
        10.0 * tau
    }

    /// Rényi DP at integer order `alpha` of one round's noisy sum, before sampling (the paper's
    /// Proposition 14): add/remove adjacency, or replace-one (sensitivities doubled).
    pub fn rdp(&self, alpha: f64, replace_one: bool) -> f64 {
        let d = self.padded_len() as f64;
        let l2 = self.rounded_l2_bound();
        // In the grid, where coordinates are integers, L1 ≤ min(√d·L2, L2²).
        let l1 = l2 * d.sqrt().min(l2);
        let factor = if replace_one { 2.0 } else { 1.0 };
        let total = (f64::from(self.min_survivors)).sqrt() * self.grid_stddev();
        let (l2, l1) = (factor * l2 / total, factor * l1 / total);
        let tau = self.tau();
        let half = alpha / 2.0;
        let a = half * l2 * l2 + tau * d;
        let b = half * (l2 * l2 + 2.0 * l1 * tau + tau * tau * d);
        let c = half * (l2 + d.sqrt() * tau).powi(2);
        a.min(b).min(c)
    }

    /// The accountant of one round sampled by `sampling` at rate `q`.
    pub fn accountant(&self, sampling: Sampling, q: f64) -> RdpAccountant {
        let orders = integer_orders();
        let replace_one = sampling == Sampling::FixedSize;
        let base = |alpha: f64| self.rdp(alpha, replace_one);
        let per_step = orders
            .iter()
            .map(|&alpha| {
                let sampled = match sampling {
                    Sampling::Poisson => poisson_subsampled(q, alpha as u64, &base),
                    Sampling::FixedSize => sampled_without_replacement(q, alpha as u64, &base),
                };
                sampled.min(base(alpha))
            })
            .collect();
        RdpAccountant { orders, per_step }
    }

    /// A device's contribution: `delta` clipped to C, rotated, scaled to the grid, rounded
    /// (conditionally), noised with a discrete Gaussian per coordinate, as ring elements.
    /// `rotation` is the round's ([`rotation_seed`]); `noise` must be secret randomness.
    pub fn encode(&self, delta: &[f32], rotation: &[u8; 32], noise: &mut NoiseSource) -> Vec<u32> {
        let norm = delta.iter().map(|&x| f64::from(x) * f64::from(x)).sum::<f64>().sqrt();
        let shrink = if norm > self.clip_norm { self.clip_norm / norm } else { 1.0 };
        let mut x: Vec<f64> = delta.iter().map(|&v| f64::from(v) * shrink).collect();
        x.resize(self.padded_len(), 0.0);
        rotate(&mut x, rotation);
        for v in x.iter_mut() {
            *v /= self.gamma;
        }
        let bound = self.rounded_l2_bound();
        let rounded = (0..ROUNDING_TRIES)
            .map(|_| {
                x.iter()
                    .map(|&v| {
                        let floor = v.floor();
                        floor as i64 + i64::from(noise.bernoulli(v - floor))
                    })
                    .collect::<Vec<i64>>()
            })
            .find(|r| r.iter().map(|&v| (v as f64) * (v as f64)).sum::<f64>().sqrt() <= bound)
            // Toward zero never grows the norm, which the clip keeps within the bound.
            .unwrap_or_else(|| x.iter().map(|&v| v.trunc() as i64).collect());
        let s = self.grid_stddev();
        rounded.into_iter().map(|v| (v + noise.discrete_gaussian(s)) as u32).collect()
    }

    /// The sum of `count` survivors' contributions back in the update's units (their noisy sum
    /// of clipped updates, the first `n_params` values).
    pub fn decode_sum(&self, sum: &[u32], rotation: &[u8; 32]) -> Vec<f64> {
        // Centered: the ring's upper half are the negatives.
        let mut x: Vec<f64> = sum.iter().map(|&s| f64::from(s as i32) * self.gamma).collect();
        unrotate(&mut x, rotation);
        x.truncate(self.n_params);
        x
    }

    /// Refuses an unmasked sum that `count` honest contributions cannot make: its norm on the
    /// grid is at most `count` rounded inputs plus the noise's norm with ten standard
    /// deviations of slack. A device that masked ring elements of its own choosing, or a sum
    /// that wrapped the ring, fails the round here.
    pub fn check_sum(&self, sum: &[u32], count: u32) -> Result<(), String> {
        let d = self.padded_len() as f64;
        let n = f64::from(count);
        let norm = sum.iter().map(|&s| f64::from(s as i32).powi(2)).sum::<f64>().sqrt();
        let noise = self.grid_stddev() * (n * d).sqrt() * (1.0 + 10.0 / (2.0 * d).sqrt());
        let most = n * self.rounded_l2_bound() + noise;
        if norm > most {
            return Err(format!(
                "the unmasked sum's norm on the grid is {norm:.4e}, more than {count} clipped, noised inputs make ({most:.4e}): a device masked values outside its range"
            ));
        }
        Ok(())
    }
}

/// `n_params` padded to a power of two, as the Walsh–Hadamard rotation needs.
fn padded(n_params: usize) -> usize {
    n_params.max(1).next_power_of_two()
}

/// The Rényi orders of the discrete Gaussian's accountant: integers, as its bounds need (the
/// paper's `RDP_ORDERS`).
pub fn integer_orders() -> Vec<f64> {
    (2..=128).chain([256]).map(f64::from).collect()
}

/// Zhu and Wang (2019), Theorem 5: RDP at integer order `alpha` of a mechanism with RDP
/// `base`, Poisson-subsampled at rate `q` (add/remove adjacency).
fn poisson_subsampled(q: f64, alpha: u64, base: &dyn Fn(f64) -> f64) -> f64 {
    if q >= 1.0 {
        return base(alpha as f64);
    }
    let a = alpha as f64;
    let log1mq = (-q).ln_1p();
    let mut log_sum = (a - 1.0) * log1mq + (a * q - q + 1.0).ln();
    log_sum = log_add(log_sum, log_comb(a, 2.0) + 2.0 * q.ln() + (a - 2.0) * log1mq + base(2.0));
    for l in 3..=alpha {
        let l = l as f64;
        let term = 3f64.ln() + log_comb(a, l) + (a - l) * log1mq + l * q.ln() + (l - 1.0) * base(l);
        log_sum = log_add(log_sum, term);
    }
    log_sum / (a - 1.0)
}

/// Wang, Balle and Kasiviswanathan (2019), Theorem 9: RDP at integer order `alpha` of a
/// mechanism with replace-one RDP `base` on a sample drawn without replacement at rate `q`.
fn sampled_without_replacement(q: f64, alpha: u64, base: &dyn Fn(f64) -> f64) -> f64 {
    if q >= 1.0 {
        return base(alpha as f64);
    }
    log_a_without_replacement(q, alpha, base, None) / (alpha as f64 - 1.0)
}

/// The round's rotation seed, from its session: public, the same for every device and the
/// coordinator (the rotation spreads each update over the coordinates; it hides nothing).
pub fn rotation_seed(session: &[u8; 16]) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update(b"starling distributed dp rotation v1");
    h.update(session);
    h.finalize().into()
}

/// `x` (a power-of-two length) ← H·D·x: random signs from `seed`, then the normalized
/// Walsh–Hadamard transform. Orthogonal, so norms are kept.
pub fn rotate(x: &mut [f64], seed: &[u8; 32]) {
    let n = x.len();
    for (v, negative) in x.iter_mut().zip(signs(seed, n)) {
        if negative {
            *v = -*v;
        }
    }
    walsh_hadamard(x);
}

/// The inverse of [`rotate`]: D·H·x (H is its own inverse, normalized).
pub fn unrotate(x: &mut [f64], seed: &[u8; 32]) {
    walsh_hadamard(x);
    let n = x.len();
    for (v, negative) in x.iter_mut().zip(signs(seed, n)) {
        if negative {
            *v = -*v;
        }
    }
}

fn signs(seed: &[u8; 32], n: usize) -> impl Iterator<Item = bool> {
    let mut bytes = vec![0u8; n.div_ceil(8)];
    chacha20::ChaCha20::new(seed.into(), &[1u8; 12].into()).apply_keystream(&mut bytes);
    (0..n).map(move |i| bytes[i / 8] >> (i % 8) & 1 == 1)
}

/// The fast Walsh–Hadamard transform, scaled by 1/√n (so it is orthogonal and self-inverse).
fn walsh_hadamard(x: &mut [f64]) {
    let n = x.len();
    assert!(n.is_power_of_two(), "the rotation needs a power-of-two length, not {n}");
    let mut h = 1;
    while h < n {
        for block in x.chunks_mut(2 * h) {
            let (lo, hi) = block.split_at_mut(h);
            for (a, b) in lo.iter_mut().zip(hi.iter_mut()) {
                let (s, t) = (*a + *b, *a - *b);
                (*a, *b) = (s, t);
            }
        }
        h *= 2;
    }
    let scale = 1.0 / (n as f64).sqrt();
    for v in x {
        *v *= scale;
    }
}

/// A device's secret randomness for the rounding and the noise: the ChaCha20 keystream under a
/// 32-byte seed from the OS.
pub struct NoiseSource {
    stream: chacha20::ChaCha20,
    /// Keystream drawn ahead, 64 words at a time; `next` is the first unused word.
    buffer: [u64; 64],
    next: usize,
}

impl NoiseSource {
    /// A source under `seed` (fresh OS randomness on a device).
    pub fn new(seed: [u8; 32]) -> Self {
        NoiseSource {
            stream: chacha20::ChaCha20::new(&seed.into(), &[0u8; 12].into()),
            buffer: [0; 64],
            next: 64,
        }
    }

    pub(crate) fn next_u64(&mut self) -> u64 {
        if self.next == self.buffer.len() {
            let mut bytes = [0u8; 512];
            self.stream.apply_keystream(&mut bytes);
            for (word, chunk) in self.buffer.iter_mut().zip(bytes.chunks_exact(8)) {
                *word = u64::from_le_bytes(chunk.try_into().expect("8 bytes"));
            }
            self.next = 0;
        }
        self.next += 1;
        self.buffer[self.next - 1]
    }

    /// A uniform draw from [0, 1), on the 2^−53 grid.
    fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// True with probability `p`.
    fn bernoulli(&mut self, p: f64) -> bool {
        self.unit() < p
    }

    /// Uniform in 0..n (rejection, no modulo bias).
    pub(crate) fn below(&mut self, n: u64) -> u64 {
        let zone = u64::MAX - u64::MAX % n;
        loop {
            let v = self.next_u64();
            if v < zone {
                return v % n;
            }
        }
    }

    /// True with probability e^{−g}, g ≥ 0 (Canonne, Kamath and Steinke 2020, Algorithm 1:
    /// only Bernoulli trials of rational-looking rates, no exponential evaluated).
    fn bernoulli_exp(&mut self, g: f64) -> bool {
        let mut g = g;
        while g > 1.0 {
            if !self.bernoulli_exp_at_most_one(1.0) {
                return false;
            }
            g -= 1.0;
        }
        self.bernoulli_exp_at_most_one(g)
    }

    fn bernoulli_exp_at_most_one(&mut self, g: f64) -> bool {
        let mut k = 1.0;
        while self.bernoulli(g / k) {
            k += 1.0;
        }
        k % 2.0 == 1.0
    }

    /// The discrete Laplace distribution of scale `t` (P(x) ∝ e^{−|x|/t}; CKS20 Algorithm 2).
    fn discrete_laplace(&mut self, t: u64) -> i64 {
        loop {
            let u = self.below(t);
            if !self.bernoulli_exp(u as f64 / t as f64) {
                continue;
            }
            let mut v = 0u64;
            while self.bernoulli_exp(1.0) {
                v += 1;
            }
            let x = u + t * v;
            let negative = self.bernoulli(0.5);
            if negative && x == 0 {
                continue;
            }
            return if negative { -(x as i64) } else { x as i64 };
        }
    }

    /// The discrete Gaussian of scale `sigma` (P(x) ∝ e^{−x²/2σ²} over the integers; CKS20
    /// Algorithm 3: a discrete Laplace proposal, accepted with the exact ratio). Its Bernoulli
    /// trials use 53-bit uniforms, so it is exact up to that grid.
    pub fn discrete_gaussian(&mut self, sigma: f64) -> i64 {
        if sigma <= 0.0 {
            return 0;
        }
        let t = sigma.floor() as u64 + 1;
        let sigma2 = sigma * sigma;
        loop {
            let y = self.discrete_laplace(t);
            let gap = (y.unsigned_abs() as f64) - sigma2 / t as f64;
            if self.bernoulli_exp(gap * gap / (2.0 * sigma2)) {
                return y;
            }
        }
    }
}

#[cfg(test)]
mod tests;
