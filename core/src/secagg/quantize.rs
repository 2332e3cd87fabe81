//! Fixed-point quantization into the 2^32 ring, and what travels in a secure vector: the
//! example-weighted delta, its weight, and the device's evaluation.

/// Maps reals in `[-clip, clip]` to `bits`-bit integers, so that the sum of `n` of them cannot
/// wrap the 2^32 ring: `bits = 32 − ⌈log2 n⌉`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Quantizer {
    /// Clipping range.
    pub clip: f64,
    /// Levels are `0..=2^bits − 1`.
    pub bits: u32,
}

impl Quantizer {
    /// A quantizer for sums of at most `n` vectors clipped to `clip`.
    pub fn for_cohort(clip: f64, n: u32) -> Self {
        let headroom = (n.max(1) as f64).log2().ceil() as u32;
        Quantizer { clip, bits: 32 - headroom.min(31) }
    }

    fn levels(&self) -> f64 {
        ((1u64 << self.bits) - 1) as f64
    }

    /// One value, clipped, rounded to the nearest level.
    pub fn quantize(&self, x: f64) -> u32 {
        let x = if x.is_finite() { x.clamp(-self.clip, self.clip) } else { 0.0 };
        ((x + self.clip) / (2.0 * self.clip) * self.levels()).round() as u32
    }

    /// The sum of `count` quantized values, back to reals.
    pub fn dequantize_sum(&self, sum: u32, count: u32) -> f64 {
        sum as f64 / self.levels() * 2.0 * self.clip - count as f64 * self.clip
    }

    /// The most `count` values inside the quantization range add up to in the ring (each is
    /// at most the top level): an unmasked sum above it holds a value from outside the range.
    pub fn max_sum(&self, count: u32) -> u64 {
        u64::from(count) * ((1u64 << self.bits) - 1)
    }

    /// The largest error per summed value.
    pub fn step(&self) -> f64 {
        2.0 * self.clip / self.levels()
    }
}

/// Example-weighted FedAvg through the masked sum: the vector carries `w·x` for each value and
/// `w·clip` last, with `w = examples / max_examples` in [0, 1] (scaled so that any clipping
/// range carries the weight exactly). The server divides the two sums.
pub fn encode_weighted(q: &Quantizer, delta: &[f32], examples: u64, max_examples: u64) -> Vec<u32> {
    let w = examples.min(max_examples) as f64 / max_examples.max(1) as f64;
    let mut v: Vec<u32> = delta.iter().map(|&x| q.quantize(w * f64::from(x))).collect();
    v.push(q.quantize(w * q.clip));
    v
}

/// The weighted mean from the unmasked sum of `count` [`encode_weighted`] vectors.
pub fn decode_weighted_mean(q: &Quantizer, sum: &[u32], count: u32) -> Option<Vec<f64>> {
    let (weight, values) = sum.split_last()?;
    let total = q.dequantize_sum(*weight, count) / q.clip;
    if total <= 0.0 {
        return None;
    }
    Some(values.iter().map(|&s| q.dequantize_sum(s, count) / total).collect())
}

/// A device's evaluation of the global model on its held-out examples, as it travels inside
/// its secure vector: the server learns only the cohort's pooled evaluation, never one device's.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EvaluationInput {
    /// Held-out examples evaluated (its weight; capped at `max_examples` like the update's).
    pub examples: u64,
    /// Accuracy, in [0, 1].
    pub accuracy: f64,
    /// Mean loss (capped at the round's loss cap, [`SECURE_LOSS_CAP`] unless a DP plan's
    /// noised metrics set another).
    pub loss: f64,
}

/// Ring elements a secure vector carries after the weighted delta and its weight when it also
/// carries the device's evaluation: the evaluation's weight, weighted accuracy and weighted
/// (scaled) loss.
pub const EVALUATION_ENTRIES: usize = 3;

/// Losses above this count as this in a secure evaluation (the quantizer needs a range),
/// unless the round's settings give another cap.
pub const SECURE_LOSS_CAP: f64 = 100.0;

/// Appends a device's evaluation to its [`encode_weighted`] vector (zero weight when it has
/// none, e.g. no held-out examples): `e·clip`, `e·accuracy·clip` and `e·(loss/loss_cap)·clip`
/// with `e = examples / max_examples` in [0, 1], so every entry stays inside the clipping range.
pub fn append_evaluation(
    q: &Quantizer,
    vector: &mut Vec<u32>,
    evaluation: Option<EvaluationInput>,
    max_examples: u64,
    loss_cap: f64,
) {
    let (e, accuracy, loss) = match evaluation {
        Some(ev) => (
            ev.examples.min(max_examples) as f64 / max_examples.max(1) as f64,
            if ev.accuracy.is_finite() { ev.accuracy.clamp(0.0, 1.0) } else { 0.0 },
            if ev.loss.is_finite() { ev.loss.clamp(0.0, loss_cap) } else { loss_cap },
        ),
        None => (0.0, 0.0, 0.0),
    };
    vector.push(q.quantize(e * q.clip));
    vector.push(q.quantize(e * accuracy * q.clip));
    vector.push(q.quantize(e * loss / loss_cap * q.clip));
}

/// The unmasked sums of `count` vectors' evaluation entries (the last [`EVALUATION_ENTRIES`]),
/// in units of one device: `Σe`, `Σe·accuracy` and `Σe·loss/loss_cap`, each in `[0, count]`
/// (a DP round noises these as its metrics block).
pub fn evaluation_sums(q: &Quantizer, entries: &[u32], count: u32) -> Option<[f64; 3]> {
    let [weight, accuracy, loss] = entries else { return None };
    let unit = |s: u32| (q.dequantize_sum(s, count) / q.clip).clamp(0.0, f64::from(count));
    Some([unit(*weight), unit(*accuracy), unit(*loss)])
}

/// The cohort's pooled evaluation from the unmasked sum of `count` vectors' evaluation entries
/// (the last [`EVALUATION_ENTRIES`]): total weight in examples, and the example-weighted mean
/// accuracy and loss. `None` when no device evaluated (a total weight below half an example).
pub fn decode_evaluation(
    q: &Quantizer,
    entries: &[u32],
    count: u32,
    max_examples: u64,
    loss_cap: f64,
) -> Option<(f64, f64, f64)> {
    let [weight, accuracy, loss] = entries else { return None };
    let total = q.dequantize_sum(*weight, count) / q.clip;
    let examples = total * max_examples as f64;
    if examples < 0.5 {
        return None;
    }
    let accuracy = (q.dequantize_sum(*accuracy, count) / q.clip / total).clamp(0.0, 1.0);
    let loss = (q.dequantize_sum(*loss, count) / q.clip / total * loss_cap).clamp(0.0, loss_cap);
    Some((examples, accuracy, loss))
}
