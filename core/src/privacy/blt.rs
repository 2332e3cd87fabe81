//! DP-FTRL with Buffered Linear Toeplitz noise (McMahan, Xu and Zhang, "A Hassle-free
//! Algorithm for Private Learning in Practice: Don't Use Tree Aggregation, Use BLTs", 2024):
//! differential privacy that assumes nothing about how cohorts are drawn.
//!
//! **Mechanism.** The rounds' clipped sums `x_t` are released as `x_t + n_t`, where the noise
//! is correlated across rounds: `n = C⁻¹ z` for i.i.d. `z_t ~ N(0, (zσ·clip)²)` per coordinate
//! and a lower-triangular Toeplitz strategy `C`. The server's plain SGD step makes the model a
//! prefix sum of the releases, whose noise is `A C⁻¹ z`: negative correlation cancels much of
//! it, where DP-SGD without sampling would let it grow as √t. `C` is a one-buffer BLT,
//! `c_0 = 1, c_i = ω·λ^{i−1}` (i ≥ 1, 0 ≤ ω ≤ 1, 0 < λ ≤ 1), so its columns are non-negative
//! and non-increasing, and the noise is generated round by round from one model-sized buffer
//! `a` by forward substitution: `n_t = z_t − ω·a_t`, `a_{t+1} = λ·a_t + n_t` (the buffer lives
//! in the run's server state, committed with each model).
//!
//! **Participation and sensitivity.** The coordinator lets a device take part at most
//! `max_participations` (k) times, at least `min_separation` (b) committed rounds apart. For a
//! Toeplitz `C` with non-negative, non-increasing columns the largest change one device can
//! make to `C x`, over every pattern the rule allows, is that of the earliest pattern
//! `0, b, …, (k−1)b` (McMahan et al. 2024, after Choquette-Choo et al. 2023): `sens(C)·clip`.
//!
//! **Accounting.** `C x + z` is one Gaussian mechanism of sensitivity `sens(C)` over noise
//! multiplier `zσ`: μ-GDP with `μ = sens(C)/zσ` under add/remove adjacency (adaptive inputs
//! included: Denisov et al. 2022), so zCDP with `ρ = μ²/2`, and ε at δ is the Gaussian
//! mechanism's exact one (Balle and Wang 2018): the smallest ε with
//! `Φ(−ε/μ + μ/2) − e^ε·Φ(−ε/μ − μ/2) ≤ δ`. No sampling, no population: the whole run's
//! guarantee is known when the plan is read.
//!
//! **Choosing `C`.** (ω, λ) minimize the root-mean-square noise of the `n` prefix sums times
//! the sensitivity, over a grid refined twice: the model's noise at the plan's z for the plan's
//! `n`, b and k.

use serde::{Deserialize, Serialize};

/// One-buffer BLT strategy parameters, `c_i = ω·λ^{i−1}` for i ≥ 1.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Blt {
    /// ω, the weight of past noise (0: independent noise, DP-SGD without sampling).
    pub omega: f64,
    /// λ, its decay per round.
    pub lambda: f64,
}

/// The participation rule the sensitivity assumes, and the run's length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Schema {
    /// Rounds that commit, n.
    pub rounds: u64,
    /// Committed rounds between two participations of one device, at least, b.
    pub min_separation: u64,
    /// Participations of one device, at most, k.
    pub max_participations: u64,
}

impl Schema {
    /// The participations the rule lets fit into the run: min(k, ⌈n/b⌉).
    pub fn effective_participations(&self) -> u64 {
        self.max_participations.min(self.rounds.div_ceil(self.min_separation.max(1)))
    }
}

impl Blt {
    /// Independent noise each round (C = I).
    pub const INDEPENDENT: Blt = Blt { omega: 0.0, lambda: 1.0 };

    /// Checks the parameters keep `C`'s columns non-negative and non-increasing.
    pub fn check(&self) -> Result<(), String> {
        let lambda_in = self.lambda > 0.0 && self.lambda <= 1.0;
        if !((0.0..=1.0).contains(&self.omega) && lambda_in) {
            return Err(format!(
                "BLT parameters ω = {}, λ = {} outside 0 ≤ ω ≤ 1, 0 < λ ≤ 1",
                self.omega, self.lambda
            ));
        }
        Ok(())
    }

    /// `C`'s first `n` coefficients: `c_0 = 1`, `c_i = ω·λ^{i−1}`.
    pub fn strategy(&self, n: usize) -> Vec<f64> {
        let mut c = Vec::with_capacity(n);
        let mut power = 1.0;
        for i in 0..n {
            c.push(if i == 0 { 1.0 } else { self.omega * power });
            if i > 0 {
                power *= self.lambda;
            }
        }
        c
    }

    /// `C⁻¹`'s first `n` coefficients (the noise's correlation): with θ = λ − ω, `1` then
    /// `−ω·θ^{i−1}` (the inverse of `(1 − (λ−ω)x)⁻¹(1 − λx)`'s reciprocal series).
    pub fn inverse(&self, n: usize) -> Vec<f64> {
        let theta = self.lambda - self.omega;
        let mut out = Vec::with_capacity(n);
        let mut power = 1.0;
        for i in 0..n {
            out.push(if i == 0 { 1.0 } else { -self.omega * power });
            if i > 0 {
                power *= theta;
            }
        }
        out
    }

    /// `sens(C)` under `schema`: the L2 norm of the sum of `C`'s columns at the earliest
    /// pattern the rule allows, `0, b, …, (k−1)b` (the largest over every allowed pattern, for
    /// `C`'s non-negative, non-increasing columns).
    pub fn sensitivity(&self, schema: &Schema) -> f64 {
        // Row t of the column sum is [t in the pattern] + ω·w_t, where w_t = Σ λ^{t−s−1} over
        // the pattern's s < t, so w_{t+1} = λ·w_t + [t in the pattern]: O(rounds), whatever k,
        // which keeps choosing the strategy cheap at plan time.
        let n = schema.rounds;
        let b = schema.min_separation.max(1);
        let k = schema.effective_participations();
        let in_pattern = |t: u64| t.is_multiple_of(b) && t / b < k;
        let (mut w, mut norm2) = (0.0f64, 0.0f64);
        for t in 0..n {
            let here = if in_pattern(t) { 1.0 } else { 0.0 };
            let v = here + self.omega * w;
            norm2 += v * v;
            w = self.lambda * w + here;
        }
        norm2.sqrt()
    }

    /// The root-mean-square noise of the `n` prefix sums per unit of z, over `n` rounds:
    /// `√(Σ_i (n − i)·β_i² / n)` with `β_i` the prefix sums of `C⁻¹`'s coefficients.
    pub fn prefix_rmse(&self, n: usize) -> f64 {
        let mut prefix = 0.0;
        let mut total = 0.0;
        for (i, c) in self.inverse(n).into_iter().enumerate() {
            prefix += c;
            total += (n - i) as f64 * prefix * prefix;
        }
        (total / n as f64).sqrt()
    }

    /// What the choice minimizes: the prefix sums' noise at the sensitivity's noise multiplier.
    pub fn loss(&self, schema: &Schema) -> f64 {
        self.sensitivity(schema) * self.prefix_rmse(schema.rounds as usize)
    }

    /// The parameters that minimize [`Blt::loss`] for `schema`: a 41 × 41 grid over (ω, λ),
    /// then two finer grids around the best point; never worse than independent noise.
    pub fn optimized(schema: &Schema) -> Blt {
        let mut best = (Blt::INDEPENDENT.loss(schema), Blt::INDEPENDENT);
        let (mut omega_range, mut lambda_range) = ((0.0, 1.0), (0.0, 1.0));
        for _ in 0..3 {
            let steps = 40;
            for i in 0..=steps {
                for j in 0..=steps {
                    let omega =
                        omega_range.0 + (omega_range.1 - omega_range.0) * i as f64 / steps as f64;
                    let lambda = lambda_range.0
                        + (lambda_range.1 - lambda_range.0) * j as f64 / steps as f64;
                    let candidate = Blt { omega, lambda };
                    if candidate.check().is_err() {
                        continue;
                    }
                    let loss = candidate.loss(schema);
                    if loss < best.0 {
                        best = (loss, candidate);
                    }
                }
            }
            let (w, l) =
                ((omega_range.1 - omega_range.0) / 10.0, (lambda_range.1 - lambda_range.0) / 10.0);
            omega_range = ((best.1.omega - w).max(0.0), (best.1.omega + w).min(1.0));
            lambda_range = ((best.1.lambda - l).max(1e-6), (best.1.lambda + l).min(1.0));
        }
        best.1
    }

    /// μ of the μ-GDP guarantee at noise multiplier `z`: `sens(C)/z`.
    pub fn mu(&self, schema: &Schema, z: f64) -> f64 {
        self.sensitivity(schema) / z
    }

    /// One coordinate's round: `x` (this round's clipped mean) goes in as `(Cx)_t = x + ω·s`,
    /// where `s = input` holds the earlier rounds' means decayed; `noised` makes that one
    /// exact Gaussian release `ŷ_t`; what comes out is `(C⁻¹ŷ)_t = ŷ_t − ω·r`, where
    /// `r = released` holds the earlier outputs decayed: `x` plus `C⁻¹`-correlated noise. Both
    /// buffers advance (`s ← λs + x`, `r ← λr + out`). Only `ŷ` is drawn; the output and `r`
    /// are post-processing of the releases, so no floating-point step touches the noise
    /// before the release.
    pub fn release<E>(
        &self,
        x: f64,
        input: &mut f64,
        released: &mut f32,
        noised: impl FnOnce(f64) -> Result<f64, E>,
    ) -> Result<f64, E> {
        let y = noised(x + self.omega * *input)?;
        let out = y - self.omega * f64::from(*released);
        *input = self.lambda * *input + x;
        *released = (self.lambda * f64::from(*released) + out) as f32;
        Ok(out)
    }
}

/// A `blt_ftrl` run's buffers, one value per parameter each, zero before the first round
/// ([`Blt::release`]), kept in the run's server state with each model.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Buffers {
    /// The earlier rounds' clipped means, decayed: the encoder's (in f64: its rounding is the
    /// release's input, and the sensitivity counts on it).
    pub inputs: Vec<f64>,
    /// The earlier rounds' outputs, decayed: the decoder's (post-processing of the releases).
    pub releases: Vec<f32>,
}

impl Buffers {
    /// Zeroed buffers for `n` parameters.
    pub fn zeros(n: usize) -> Self {
        Buffers { inputs: vec![0.0; n], releases: vec![0.0; n] }
    }
}

/// The noise multiplier with which the strategy a plan chooses for `schema` spends `epsilon` at
/// `delta` over the whole run (to 1e-9): how an operator, or a benchmark, sizes z for a
/// budget. μ = sens(C)/z, and ε grows with μ.
pub fn noise_multiplier_for(schema: &Schema, delta: f64, epsilon: f64) -> f64 {
    let sens = Blt::optimized(schema).sensitivity(schema);
    let (mut lo, mut hi) = (1e-6, 1e3);
    while hi - lo > 1e-9 * hi {
        let mu = 0.5 * (lo + hi);
        if epsilon_of_gdp(mu, delta) > epsilon { hi = mu } else { lo = mu }
    }
    sens / lo
}

/// ε at `delta` of a μ-GDP mechanism (the Gaussian mechanism's exact curve, Balle and Wang
/// 2018): the smallest ε ≥ 0 with `Φ(−ε/μ + μ/2) − e^ε·Φ(−ε/μ − μ/2) ≤ δ`, to 1e-12.
pub fn epsilon_of_gdp(mu: f64, delta: f64) -> f64 {
    let delta_at = |eps: f64| {
        let a = super::log_phi(-eps / mu + mu / 2.0);
        let b = eps + super::log_phi(-eps / mu - mu / 2.0);
        a.exp() - b.exp()
    };
    if delta_at(0.0) <= delta {
        return 0.0;
    }
    let mut hi = 1.0;
    while delta_at(hi) > delta {
        hi *= 2.0;
        if hi > 1e6 {
            return f64::INFINITY;
        }
    }
    let mut lo = 0.0;
    while hi - lo > 1e-12 * hi.max(1.0) {
        let mid = 0.5 * (lo + hi);
        if delta_at(mid) > delta { lo = mid } else { hi = mid }
    }
    hi
}

#[cfg(test)]
mod tests {
    use super::*;

    fn schema(rounds: u64, b: u64, k: u64) -> Schema {
        Schema { rounds, min_separation: b, max_participations: k }
    }

    /// Brute force over every pattern of at most k participations b apart in n rounds.
    fn brute_sensitivity(blt: &Blt, s: &Schema) -> f64 {
        let n = s.rounds as usize;
        let c = blt.strategy(n);
        fn walk(
            c: &[f64],
            n: usize,
            b: usize,
            left: usize,
            next: usize,
            chosen: &mut Vec<usize>,
            best: &mut f64,
        ) {
            let norm2: f64 = (0..n)
                .map(|t| chosen.iter().filter(|&&s| s <= t).map(|&s| c[t - s]).sum::<f64>().powi(2))
                .sum();
            *best = best.max(norm2);
            if left == 0 {
                return;
            }
            for s in next..n {
                chosen.push(s);
                walk(c, n, b, left - 1, s + b, chosen, best);
                chosen.pop();
            }
        }
        let mut best = 0.0;
        walk(
            &c,
            n,
            s.min_separation as usize,
            s.max_participations as usize,
            0,
            &mut vec![],
            &mut best,
        );
        best.sqrt()
    }

    #[test]
    fn the_earliest_pattern_is_the_worst_one_the_rule_allows() {
        for blt in
            [Blt { omega: 0.6, lambda: 0.9 }, Blt { omega: 1.0, lambda: 1.0 }, Blt::INDEPENDENT]
        {
            for (n, b, k) in [(12, 3, 3), (10, 2, 5), (9, 4, 2), (8, 1, 8)] {
                let s = schema(n, b, k);
                let (fast, brute) = (blt.sensitivity(&s), brute_sensitivity(&blt, &s));
                assert!((fast - brute).abs() < 1e-12, "{blt:?} {s:?}: {fast} vs {brute}");
            }
        }
        // The longest plan and the laxest rule choose their strategy in well under a second.
        let longest = schema(u64::from(crate::privacy::MAX_BLT_ROUNDS), 1, 2_000);
        let started = std::time::Instant::now();
        Blt::optimized(&longest);
        assert!(started.elapsed().as_secs_f64() < 1.0, "{:?}", started.elapsed());
        // Independent noise: √k, as DP-SGD without sampling.
        assert!((Blt::INDEPENDENT.sensitivity(&schema(100, 10, 4)) - 2.0).abs() < 1e-12);
    }

    #[test]
    fn the_inverse_and_the_buffer_are_the_strategys_inverse() {
        let blt = Blt { omega: 0.7, lambda: 0.95 };
        let (c, inv) = (blt.strategy(30), blt.inverse(30));
        for t in 0..30 {
            let product: f64 = (0..=t).map(|s| c[s] * inv[t - s]).sum();
            assert!((product - if t == 0 { 1.0 } else { 0.0 }).abs() < 1e-12, "{t}: {product}");
        }
        // The decoder applied to a unit impulse of noise gives C⁻¹'s coefficients ...
        let (mut input, mut released) = (0f64, 0f32);
        for (t, want) in inv.iter().enumerate() {
            let impulse = if t == 0 { 1.0 } else { 0.0 };
            let out =
                blt.release(0.0, &mut input, &mut released, |y| Ok::<_, ()>(y + impulse)).unwrap();
            assert!((out - want).abs() < 1e-6, "{t}: {out} vs {want}");
        }
        // ... and without noise the encoder and decoder give the means back: C⁻¹Cx = x.
        let (mut input, mut released) = (0f64, 0f32);
        for t in 0..30 {
            let x = (f64::from(t) * 0.37).sin();
            let out = blt.release(x, &mut input, &mut released, Ok::<_, ()>).unwrap();
            assert!((out - x).abs() < 1e-5, "{t}: {out} vs {x}");
        }
    }

    #[test]
    fn the_chosen_strategy_beats_independent_noise_and_the_gaussian_curve_holds() {
        let s = schema(100, 10, 10);
        let blt = Blt::optimized(&s);
        blt.check().unwrap();
        assert!(blt.loss(&s) < 0.6 * Blt::INDEPENDENT.loss(&s), "{blt:?}: {}", blt.loss(&s));
        let z = noise_multiplier_for(&s, 1e-5, 4.0);
        let spent = epsilon_of_gdp(blt.sensitivity(&s) / z, 1e-5);
        assert!((spent - 4.0).abs() < 1e-6 && spent <= 4.0, "{z}: {spent}");
        // μ = 1 at δ = 1e-5: the Gaussian mechanism's exact ε, 4.37718 (by the same formula
        // in Python, math.erfc and bisection).
        let eps = epsilon_of_gdp(1.0, 1e-5);
        assert!((eps - 4.377_178_095_681).abs() < 1e-9, "{eps}");
    }
}
