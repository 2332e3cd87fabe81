//! Central Gaussian noise with no floating-point side channel. A release computed as
//! `x + σ·z` in floating point with a float sampler leaks `x` through the result's low bits:
//! which results the sampler can produce depends on `x` (Mironov 2012 for Laplace; Jin et al.,
//! "Are we there yet? Timing and floating-point attacks on differential privacy systems",
//! 2022, for Gaussian samplers). Here `z` is Karney's exact normal ("Sampling exactly from
//! the normal distribution", ACM TOMS 2016): an integer part and a uniform fraction whose bits
//! are drawn only as comparisons need them, decided with random bits and integer arithmetic
//! alone. The release is `x + σz` rounded *exactly* to a power-of-two grid of about σ·2⁻²⁰
//! (as many of `z`'s bits are drawn as that rounding takes), so it is a function of the ideal
//! Gaussian mechanism's output: post-processing, and the continuous Gaussian's accounting
//! holds for it as it stands. Nothing of `x` below the grid survives, and the grid's rounding
//! adds a variance under 10⁻¹² σ².

use super::distributed::NoiseSource;

/// The grid is the power of two at or just below `σ·2^−GRID_BITS`.
const GRID_BITS: i32 = 20;
/// Bits kept below the grid in the exact rounding: with `GRID_BITS + FRACTION_BITS = 52`, σ
/// in those units is exactly its 53-bit significand.
const FRACTION_BITS: i32 = 52 - GRID_BITS;
/// The largest `|x| / σ` the exact rounding represents (its i128 arithmetic): far beyond any
/// clipped sum against its noise.
const MAX_STANDARD_DEVIATIONS: f64 = (1u128 << 68) as f64;

/// Noise that cannot be added exactly.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum NoiseError {
    /// A value or standard deviation outside what the exact rounding represents.
    #[error(
        "cannot noise {value:e} with standard deviation {stddev:e} exactly (the standard deviation must be finite and within [2^-1000, 2^52], the value within 2^68 of them)"
    )]
    OutOfRange {
        /// The value to noise.
        value: f64,
        /// The noise's standard deviation.
        stddev: f64,
    },
}

/// A uniform real in [0, 1) whose base-2⁶⁴ digits are drawn only when a comparison needs them.
#[derive(Debug, Default)]
struct LazyUniform {
    digits: Vec<u64>,
}

impl LazyUniform {
    /// Forgets every digit: a fresh uniform.
    fn reset(&mut self) {
        self.digits.clear();
    }

    /// Digit `i` (the `i + 1`-th after the point), drawn if it was not yet.
    fn digit(&mut self, i: usize, bits: &mut NoiseSource) -> u64 {
        while self.digits.len() <= i {
            self.digits.push(bits.next_u64());
        }
        self.digits[i]
    }

    /// Whether `self < other`, drawing the digits of both until they differ.
    fn less_than(&mut self, other: &mut LazyUniform, bits: &mut NoiseSource) -> bool {
        (0..)
            .map(|i| (self.digit(i, bits), other.digit(i, bits)))
            .find(|(a, b)| a != b)
            .is_some_and(|(a, b)| a < b)
    }
}

/// Karney's exact sampler, with the lazy uniforms its comparisons reuse.
#[derive(Debug, Default)]
pub struct ExactNormal {
    /// The fraction of the sample being drawn.
    fraction: LazyUniform,
    /// The last two links of a von Neumann chain.
    p: LazyUniform,
    q: LazyUniform,
    /// The tie-break of a fractional acceptance test.
    v: LazyUniform,
}

impl ExactNormal {
    /// `value + stddev·Z` for an exact `Z ~ N(0, 1)`, rounded to the nearest multiple of the
    /// grid step (the power of two at or below `stddev·2⁻²⁰`). A zero standard deviation adds
    /// nothing.
    pub fn noised(
        &mut self,
        value: f64,
        stddev: f64,
        bits: &mut NoiseSource,
    ) -> Result<f64, NoiseError> {
        if stddev == 0.0 && value.is_finite() {
            return Ok(value);
        }
        if !(value.is_finite()
            && stddev.is_finite()
            && (2f64.powi(-1000)..=2f64.powi(52)).contains(&stddev)
            && value.abs() / stddev < MAX_STANDARD_DEVIATIONS)
        {
            return Err(NoiseError::OutOfRange { value, stddev });
        }
        // stddev = significand · 2^(exponent − 52), exactly.
        let exponent = ((stddev.to_bits() >> 52) & 0x7ff) as i32 - 1023;
        let significand = i128::from((stddev.to_bits() & ((1u64 << 52) - 1)) | (1u64 << 52));
        // The grid step is 2^grid; in units of 2^(grid − FRACTION_BITS) the value is `scaled`
        // and the standard deviation is the significand.
        let grid = exponent - GRID_BITS;
        let scaled = times_power_of_two(value, FRACTION_BITS - grid);
        let whole = scaled.floor();
        // Exact: a float minus its floor, both scaled by powers of two.
        let fraction = scaled - whole;
        let (negative, k) = self.draw(bits);
        // Z = j + u with u uniform in [0, 1): u is the drawn fraction, or for a negative
        // sample −(k + x) = −(k + 1) + (1 − x), whose digits are x's complemented.
        let j = if negative { -i128::from(k) - 1 } else { i128::from(k) };
        let one = 1i128 << FRACTION_BITS;
        // round(t) = ⌊t + ½⌋ on the grid.
        let base = whole as i128 + significand * j + one / 2;
        let (above, below) = (base.div_euclid(one), base.rem_euclid(one));
        let digit = |i: usize| {
            let d = self.fraction.digit(i, bits);
            if negative { !d } else { d }
        };
        let cell =
            floor_of_scaled_uniform(below, fraction, significand, FRACTION_BITS as u32, digit);
        let index = above + cell;
        Ok(times_power_of_two(index as f64, grid))
    }

    /// An exact standard normal: its sign and integer part `k`; its fraction is left drawn
    /// lazily in `self.fraction`.
    fn draw(&mut self, bits: &mut NoiseSource) -> (bool, u64) {
        loop {
            // k with probability e^(−k/2)(1 − e^(−1/2)) ...
            let mut k = 0u64;
            while self.bernoulli_exp_half(bits) {
                k += 1;
            }
            // ... accepted with probability e^(−k(k−1)/2), so k's weight is e^(−k²/2) ...
            if !(0..k * k.saturating_sub(1)).all(|_| self.bernoulli_exp_half(bits)) {
                continue;
            }
            // ... and a fraction x accepted with probability e^(−x(x+2k)/2), so k + x has
            // density ∝ e^(−(k+x)²/2): k + 1 trials of e^(−x(x+2k)/(2k+2)).
            self.fraction.reset();
            if (0..=k).all(|_| self.bernoulli_exp_fraction(k, bits)) {
                return (bits.next_u64() & 1 == 1, k);
            }
        }
    }

    /// True with probability e^(−1/2), by von Neumann's chain: the longest run
    /// ½ > U₁ > U₂ > … > Uₙ of fresh uniforms has even length.
    fn bernoulli_exp_half(&mut self, bits: &mut NoiseSource) -> bool {
        self.p.reset();
        if self.p.digit(0, bits) >> 63 == 1 {
            return true;
        }
        loop {
            self.q.reset();
            if !self.q.less_than(&mut self.p, bits) {
                return false;
            }
            self.p.reset();
            if !self.p.less_than(&mut self.q, bits) {
                return true;
            }
        }
    }

    /// True with probability e^(−x(x+2k)/(2k+2)) for the fraction x being drawn: the longest
    /// run x > U₁ > … > Uₙ whose every step also passes V < (x + 2k)/(2k + 2) has even length
    /// (the run reaches n with probability (x(x+2k)/(2k+2))ⁿ/n!).
    fn bernoulli_exp_fraction(&mut self, k: u64, bits: &mut NoiseSource) -> bool {
        let mut odd = false;
        let mut first = true;
        loop {
            self.q.reset();
            let descends = if first {
                self.q.less_than(&mut self.fraction, bits)
            } else {
                self.q.less_than(&mut self.p, bits)
            };
            // V < (x + 2k)/(2k + 2): surely with probability 2k/(2k+2), never with 1/(2k+2),
            // and V < x with the remaining 1/(2k+2).
            let passes = descends && {
                let choice = bits.below(2 * k + 2);
                choice < 2 * k
                    || (choice == 2 * k && {
                        self.v.reset();
                        self.v.less_than(&mut self.fraction, bits)
                    })
            };
            if !passes {
                return !odd;
            }
            odd = !odd;
            first = false;
            std::mem::swap(&mut self.p, &mut self.q);
        }
    }
}

/// ⌊(below + fraction + s·u) / 2^f⌋ exactly, for integers `0 ≤ below < 2^f` and `s < 2^53`,
/// `fraction` in [0, 1) and u a uniform in [0, 1) given by its base-2⁶⁴ digits: the first
/// digit almost always decides; otherwise u is compared with the one boundary left, a
/// rational of denominator `s`, digit by digit.
fn floor_of_scaled_uniform(
    below: i128,
    fraction: f64,
    s: i128,
    f: u32,
    mut digit: impl FnMut(usize) -> u64,
) -> i128 {
    const DIGIT: f64 = 18_446_744_073_709_551_616.0; // 2^64
    let first = i128::from(digit(0));
    // Times 2^64, the value lies in [low, low + s) shifted up by fraction·2^64 (below 2^64);
    // a cell is 2^(64 + f) of these.
    let low = (below << 64) + s * first;
    let cell = low >> (64 + f);
    let high = (low + (1i128 << 64) + s - 1) >> (64 + f);
    if cell == high {
        return cell;
    }
    // The boundary (cell + 1)·2^f: the value is below it iff u' < n / s, where u' is u after
    // its first digit and n = ((cell + 1)·2^f − below)·2^64 − s·first − fraction·2^64, kept
    // exactly as an integer minus a fraction φ in [0, 1) (φ holds the fraction's bits below
    // 2^−64: scaling by 2^64 and taking the floor off are exact in floating point).
    let scaled = fraction * DIGIT;
    let mut whole = ((((cell + 1) << f) - below) << 64) - s * first - scaled.floor() as i128;
    let mut phi = scaled - scaled.floor();
    for i in 1.. {
        // n ≤ 0: u' < n/s is impossible.
        if whole <= 0 {
            return cell + 1;
        }
        // n ≥ s: u' < 1 ≤ n/s.
        if whole >= s + i128::from(phi > 0.0) {
            return cell;
        }
        // u' = (d + u'')/2^64: u' < n/s iff u'' < (n·2^64 − d·s)/s.
        let d = i128::from(digit(i));
        let shifted = phi * DIGIT;
        whole = (whole << 64) - shifted.floor() as i128 - d * s;
        phi = shifted - shifted.floor();
    }
    unreachable!("the loop returns")
}

/// `x · 2^n`, in steps whose powers of two are representable (exact unless it overflows or
/// lands among the subnormals).
fn times_power_of_two(mut x: f64, mut n: i32) -> f64 {
    while n != 0 {
        let step = n.clamp(-1000, 1000);
        x *= 2f64.powi(step);
        n -= step;
    }
    x
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The 64-bit digits of 2/3 and 1/6 in base 2^64 repeat 0xAAAA…
    const TWO_THIRDS: u64 = 0xAAAA_AAAA_AAAA_AAAA;

    #[test]
    fn the_first_digit_decides_away_from_a_boundary() {
        // ⌊(0 + 0 + 3u)/2⌋ with u ≈ 0.1 and u ≈ 0.9.
        assert_eq!(floor_of_scaled_uniform(0, 0.0, 3, 1, |_| u64::MAX / 10), 0);
        assert_eq!(floor_of_scaled_uniform(0, 0.0, 3, 1, |_| u64::MAX / 10 * 9), 1);
    }

    #[test]
    fn a_boundary_inside_the_first_digit_is_decided_by_the_later_ones() {
        // ⌊3u/2⌋ changes at u = 2/3 = 0.AAAA… (base 2^64): two digits on it, the third decides.
        let digits = |last: u64| move |i: usize| if i < 2 { TWO_THIRDS } else { last };
        assert_eq!(floor_of_scaled_uniform(0, 0.0, 3, 1, digits(TWO_THIRDS + 1)), 1);
        assert_eq!(floor_of_scaled_uniform(0, 0.0, 3, 1, digits(TWO_THIRDS - 1)), 0);
        // ⌊(0.5 + 3u)/2⌋ changes at u = 1/2: 0x7FFF… then anything is below, 0x8000… is not.
        assert_eq!(floor_of_scaled_uniform(0, 0.5, 3, 1, |i| [u64::MAX >> 1, u64::MAX][i]), 0);
        assert_eq!(floor_of_scaled_uniform(0, 0.5, 3, 1, |_| 1 << 63), 1);
        // ⌊(1.5 + 3u)/2⌋ changes at u = 1/6 = 0.2AAA…AAAA… .
        let sixth = |last: u64| move |i: usize| [0x2AAA_AAAA_AAAA_AAAA, TWO_THIRDS, last][i];
        assert_eq!(floor_of_scaled_uniform(1, 0.5, 3, 1, sixth(TWO_THIRDS + 1)), 1);
        assert_eq!(floor_of_scaled_uniform(1, 0.5, 3, 1, sixth(TWO_THIRDS - 1)), 0);
        // A fraction's bits below 2^−64 count: ⌊2^−70 + u⌋ is 1 iff u ≥ 1 − 2^−70, i.e. after
        // a first digit of all ones, iff the second is at least 2^64 − 2^58.
        let phi = 2f64.powi(-70);
        let tail = |second: u64| move |i: usize| [u64::MAX, second][i];
        assert_eq!(floor_of_scaled_uniform(0, phi, 1, 0, tail(u64::MAX - (1 << 58))), 0);
        assert_eq!(floor_of_scaled_uniform(0, phi, 1, 0, tail(u64::MAX - (1 << 58) + 1)), 1);
    }

    #[test]
    fn the_exact_rounding_is_unbiased_where_the_first_digit_cannot_decide() {
        // With s = 1 and f = 0 the first digit leaves ⌊fraction + u⌋ open whenever the fraction
        // could carry it over, so most draws go through the later digits: P(1) = fraction.
        let mut bits = NoiseSource::new([5; 32]);
        let draws = 200_000;
        for fraction in [0.3, 0.7 + 2f64.powi(-60), 0.123_456_789] {
            let ones = (0..draws)
                .filter(|_| {
                    let mut u = LazyUniform::default();
                    floor_of_scaled_uniform(0, fraction, 1, 0, |i| u.digit(i, &mut bits)) == 1
                })
                .count();
            let (share, sd) = (ones as f64 / draws as f64, (0.25 / draws as f64).sqrt());
            assert!((share - fraction).abs() < 5.0 * sd, "fraction {fraction}: {share}");
        }
    }

    /// Pearson's χ² of `draws` releases of `value + stddev·Z` against the normal's mass on
    /// bins of width stddev/4 over ±4 stddev (the tails pooled); the releases all lie on the
    /// grid.
    fn chi_square(value: f64, stddev: f64, draws: usize, seed: u8) -> f64 {
        let mut sampler = ExactNormal::default();
        let mut bits = NoiseSource::new([seed; 32]);
        let edges: Vec<f64> = (-16..=16).map(|i| f64::from(i) / 4.0).collect();
        let mut counts = vec![0usize; edges.len() + 1];
        let grid = 2f64.powi(((stddev.to_bits() >> 52) & 0x7ff) as i32 - 1023 - GRID_BITS);
        for _ in 0..draws {
            let release = sampler.noised(value, stddev, &mut bits).unwrap();
            assert_eq!((release / grid).fract(), 0.0, "{release} is off the grid {grid}");
            let z = (release - value) / stddev;
            counts[edges.partition_point(|&e| e <= z)] += 1;
        }
        let cdf = |z: f64| 0.5 * libm::erfc(-z / std::f64::consts::SQRT_2);
        let mut bounds = vec![f64::NEG_INFINITY];
        bounds.extend(&edges);
        bounds.push(f64::INFINITY);
        bounds
            .windows(2)
            .zip(&counts)
            .map(|(w, &c)| {
                let expected = draws as f64 * (cdf(w[1]) - cdf(w[0]));
                (c as f64 - expected).powi(2) / expected
            })
            .sum()
    }

    #[test]
    fn releases_fit_the_normal_distribution_and_lie_on_the_grid() {
        // 34 bins, 33 degrees of freedom: the 1 − 1e-6 quantile is about 81.
        for (value, stddev, seed) in
            [(0.0, 1.0, 1), (0.3 + 2f64.powi(-40), 0.7, 2), (-5e3, 3e-3, 3)]
        {
            let stat = chi_square(value, stddev, 200_000, seed);
            assert!(stat < 81.0, "x = {value}, σ = {stddev}: χ² = {stat:.1}");
        }
    }

    #[test]
    fn the_release_keeps_nothing_of_the_value_below_the_grid() {
        // Two values 2^−40 apart (far below the grid of 2^−20 at σ = 1) give the same releases
        // from the same randomness, except where the ideal value's rounding differs — about
        // one draw in 2^20 — while a float sampler's `x + σz` differs in nearly every draw.
        let (a, b) = (0.25, 0.25 + 2f64.powi(-40));
        let mut first = (ExactNormal::default(), NoiseSource::new([9; 32]));
        let mut second = (ExactNormal::default(), NoiseSource::new([9; 32]));
        let differing = (0..100_000)
            .filter(|_| {
                first.0.noised(a, 1.0, &mut first.1).unwrap()
                    != second.0.noised(b, 1.0, &mut second.1).unwrap()
            })
            .count();
        assert!(differing <= 2, "{differing} of 100 000 releases differ");
        let float = (1..=100_000)
            .filter(|&i| {
                let z = f64::from(i) * 1e-5 - 0.5;
                a + z != b + z
            })
            .count();
        assert!(float > 99_000, "a float sampler's releases differ {float} times");
    }

    #[test]
    fn values_and_deviations_it_cannot_round_exactly_are_refused() {
        let mut sampler = ExactNormal::default();
        let mut bits = NoiseSource::new([1; 32]);
        for (value, stddev) in
            [(f64::NAN, 1.0), (1.0, f64::INFINITY), (1.0, -1.0), (1e30, 1e-3), (1.0, 1e300)]
        {
            assert!(sampler.noised(value, stddev, &mut bits).is_err(), "{value} ± {stddev}");
        }
        assert_eq!(sampler.noised(1.5, 0.0, &mut bits), Ok(1.5));
    }
}
