//! Update compression: how a device encodes its delta for upload, and how the coordinator
//! checks and folds what arrives without first expanding it to a full f32 copy.
//!
//! | `kind`   | bytes for n values                    | lossy how                                        |
//! |----------|---------------------------------------|--------------------------------------------------|
//! | `f32`    | 4n                                    | not                                              |
//! | `f16`    | 2n                                    | rounded to nearest (IEEE binary16; ±65504 max)   |
//! | `bf16`   | 2n                                    | rounded to nearest (f32's range, 8-bit mantissa) |
//! | `int8`   | n + 4⌈n/block⌉ (scales first)         | per-block scale max\|x\|/127, stochastic rounding |
//! | `top_k`  | 4 + 8k (k, indices, values)           | only the k largest magnitudes; error feedback    |
//!
//! Int8's stochastic rounding is unbiased (E[decoded] = x), so a cohort's mean carries no
//! systematic quantization error. Top-k keeps what it drops on the device
//! ([`ErrorFeedback`]) and adds it to the next round's delta (Stich et al. 2018, Karimireddy
//! et al. 2019), so nothing a device learned is lost, only delayed.
//!
//! Every encoded delta from outside goes through [`Compression::validate`] (exact length,
//! finite values and scales, top-k indices strictly increasing and in range), which makes the
//! only [`CompressedDelta`]; the fold ([`CompressedDelta::for_each`]) then cannot fail.

use serde::{Deserialize, Serialize};

use crate::rng::SplitMix64;

/// The plan's `compression`: the encoding devices upload their deltas in.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
// Read through `CompressionFields`: serde's internally tagged unit variants ignore every other
// field, so `{"kind": "f16", "fraction": 0.1}` was taken silently as f16.
#[serde(rename_all = "snake_case", tag = "kind", try_from = "CompressionFields")]
pub enum Compression {
    /// Uncompressed little-endian f32 (the default).
    #[default]
    F32,
    /// IEEE half precision.
    F16,
    /// bfloat16.
    Bf16,
    /// 8-bit integers with one f32 scale per block of `block` values, stochastically rounded.
    Int8 {
        /// Values per scale.
        #[serde(default = "default_block")]
        block: u32,
    },
    /// The `fraction` of values with the largest magnitudes, with client-side error feedback.
    TopK {
        /// Share of the values kept, in (0, 1].
        fraction: f64,
    },
}

fn default_block() -> u32 {
    256
}

/// Every field any encoding has, as the plan and the download query write them; each kind
/// takes its own and refuses the others' (and unknown fields are refused outright).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CompressionFields {
    kind: String,
    block: Option<u32>,
    fraction: Option<f64>,
}

impl TryFrom<CompressionFields> for Compression {
    type Error = CompressionError;
    fn try_from(fields: CompressionFields) -> Result<Self, CompressionError> {
        let CompressionFields { kind, block, fraction } = fields;
        let not_for =
            |field: &str| CompressionError::Setting(format!("{kind} takes no {field:?} field"));
        let parsed = match kind.as_str() {
            "f32" | "f16" | "bf16" | "int8" if fraction.is_some() => {
                return Err(not_for("fraction"));
            }
            "f32" | "f16" | "bf16" | "top_k" if block.is_some() => return Err(not_for("block")),
            "f32" => Compression::F32,
            "f16" => Compression::F16,
            "bf16" => Compression::Bf16,
            "int8" => Compression::Int8 { block: block.unwrap_or_else(default_block) },
            "top_k" => Compression::TopK {
                fraction: fraction.ok_or_else(|| {
                    CompressionError::Setting("top_k needs a \"fraction\"".into())
                })?,
            },
            other => {
                return Err(CompressionError::Setting(format!(
                    "unknown kind {other:?}: expected f32, f16, bf16, int8 or top_k"
                )));
            }
        };
        Ok(parsed)
    }
}

/// Largest int8 block: one scale per 2^20 values is already no overhead.
pub const MAX_INT8_BLOCK: u32 = 1 << 20;

/// The largest int8 scale a delta may carry: 127 × it is still finite in f32, so every decoded
/// value is (and so is a delta's norm, summed in f64). `f32::MAX / 127` rounds up, past that:
/// one step below it.
pub const MAX_INT8_SCALE: f32 = f32::from_bits((f32::MAX / 127.0).to_bits() - 1);

/// Why a compression setting or an encoded delta was refused.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum CompressionError {
    /// The plan's setting is out of range.
    #[error("compression: {0}")]
    Setting(String),
    /// The encoded delta has the wrong length for the model.
    #[error("{kind} delta has {got} bytes, {expected} expected for {n} values")]
    Length {
        /// The encoding.
        kind: &'static str,
        /// Bytes expected.
        expected: u64,
        /// Bytes received.
        got: u64,
        /// Values in the model.
        n: u64,
    },
    /// A value or scale is NaN or infinite.
    #[error("{kind} delta: value {index} is not finite")]
    NonFinite {
        /// The encoding.
        kind: &'static str,
        /// Index of the value (of the scale, for an int8 scale).
        index: u64,
    },
    /// A top-k index is out of range or not after the one before it.
    #[error("top_k delta: index {index} at position {position} is out of order or range")]
    BadIndex {
        /// Position in the index list.
        position: u64,
        /// The index.
        index: u32,
    },
    /// An int8 scale so large that 127 × scale overflows f32: its values would decode to
    /// infinities (and the round's norms and sums with them).
    #[error("int8 delta: scale {index} is {scale:e}; 127 × scale overflows f32 (at most {max:e})")]
    ScaleOverflow {
        /// Index of the scale.
        index: u64,
        /// The scale.
        scale: f32,
        /// The largest scale accepted.
        max: f32,
    },
    /// An int8 value is −128 (the codes are symmetric, −127..=127).
    #[error("int8 delta: value {index} is -128, outside -127..=127")]
    Int8Range {
        /// Index of the value.
        index: u64,
    },
}

/// The command-line form: `f32`, `f16`, `bf16`, `int8[:BLOCK]` or `top_k:FRACTION`.
impl std::str::FromStr for Compression {
    type Err = CompressionError;
    fn from_str(s: &str) -> Result<Self, CompressionError> {
        let bad = |why: String| CompressionError::Setting(format!("{s:?}: {why}"));
        let parsed = match s.split_once(':') {
            None if s == "f32" => Compression::F32,
            None if s == "f16" => Compression::F16,
            None if s == "bf16" => Compression::Bf16,
            None if s == "int8" => Compression::Int8 { block: default_block() },
            Some(("int8", block)) => {
                Compression::Int8 { block: block.parse().map_err(|e| bad(format!("block: {e}")))? }
            }
            Some(("top_k", fraction)) => Compression::TopK {
                fraction: fraction.parse().map_err(|e| bad(format!("fraction: {e}")))?,
            },
            _ => return Err(bad("expected f32, f16, bf16, int8[:BLOCK] or top_k:FRACTION".into())),
        };
        parsed.check()?;
        Ok(parsed)
    }
}

/// The command-line form [`FromStr`](std::str::FromStr) reads, also the model download's
/// `compression` query parameter.
impl std::fmt::Display for Compression {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Compression::Int8 { block } => write!(f, "int8:{block}"),
            Compression::TopK { fraction } => write!(f, "top_k:{fraction}"),
            other => f.write_str(other.name()),
        }
    }
}

/// An encoded delta that passed [`Compression::validate`] for a model of `n` values.
#[derive(Clone, PartialEq)]
pub struct CompressedDelta {
    compression: Compression,
    n: usize,
    bytes: std::sync::Arc<Vec<u8>>,
}

/// A contiguous stretch of a [`CompressedDelta`]'s values, as its encoding holds them.
pub(crate) enum Run<'a> {
    /// Values of a dense float encoding (f32, f16, bf16), little-endian.
    Dense(Compression, &'a [u8]),
    /// Int8 values within one block, and the block's scale.
    Int8 {
        /// The block's scale.
        scale: f32,
        /// The quantized values.
        values: &'a [u8],
    },
    /// One value top-k kept.
    One(f32),
}

/// An int8 value decoded: the quantized step times its block's scale, in f32.
#[inline]
pub(crate) fn int8_value(q: u8, scale: f32) -> f32 {
    f32::from(q as i8) * scale
}

impl std::fmt::Debug for CompressedDelta {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} delta of {} values, {} bytes",
            self.compression.name(),
            self.n,
            self.bytes.len()
        )
    }
}

impl Compression {
    /// A stable snake_case name, for views, logs and errors.
    pub fn name(&self) -> &'static str {
        match self {
            Compression::F32 => "f32",
            Compression::F16 => "f16",
            Compression::Bf16 => "bf16",
            Compression::Int8 { .. } => "int8",
            Compression::TopK { .. } => "top_k",
        }
    }

    /// Whether this is the default, uncompressed f32.
    pub fn is_f32(&self) -> bool {
        matches!(self, Compression::F32)
    }

    /// Checks the setting; the message names the bad field.
    pub fn check(&self) -> Result<(), CompressionError> {
        match *self {
            Compression::Int8 { block } if block == 0 || block > MAX_INT8_BLOCK => Err(
                CompressionError::Setting(format!("int8 block must be in 1..={MAX_INT8_BLOCK}")),
            ),
            Compression::TopK { fraction } if !(fraction > 0.0 && fraction <= 1.0) => {
                Err(CompressionError::Setting("top_k fraction must be in (0, 1]".into()))
            }
            _ => Ok(()),
        }
    }

    /// Values a top-k delta of a model of `n` values keeps (at least one).
    pub fn top_k_count(fraction: f64, n: usize) -> usize {
        ((fraction * n as f64).ceil() as usize).clamp(1.min(n), n)
    }

    /// The exact byte length of an encoded delta of `n` values, for the fixed-size encodings,
    /// and the largest one for top-k: what an upload's body limit must allow.
    pub fn max_encoded_len(&self, n: usize) -> u64 {
        let n = n as u64;
        match *self {
            Compression::F32 => 4 * n,
            Compression::F16 | Compression::Bf16 => 2 * n,
            Compression::Int8 { block } => n + 4 * n.div_ceil(u64::from(block.max(1))),
            Compression::TopK { fraction } => {
                4 + 8 * Self::top_k_count(fraction, n as usize) as u64
            }
        }
    }

    /// Encodes `delta`. Int8 draws its stochastic rounding from `rng`; top-k adds the
    /// device's `feedback` residual first and keeps what it drops there (other encodings
    /// leave `feedback` alone).
    pub fn encode(
        &self,
        delta: &[f32],
        rng: &mut SplitMix64,
        feedback: &mut ErrorFeedback,
    ) -> Vec<u8> {
        match *self {
            Compression::F32 => crate::tensor::f32_to_le_bytes(delta),
            // Saturated: a value beyond f16's range would otherwise become an infinity that
            // validation refuses.
            Compression::F16 => delta
                .iter()
                .flat_map(|&v| {
                    let v = v.clamp(-half::f16::MAX.to_f32(), half::f16::MAX.to_f32());
                    half::f16::from_f32(v).to_le_bytes()
                })
                .collect(),
            Compression::Bf16 => {
                delta.iter().flat_map(|&v| half::bf16::from_f32(v).to_le_bytes()).collect()
            }
            Compression::Int8 { block } => encode_int8(delta, block as usize, || rng.unit()),
            Compression::TopK { fraction } => {
                encode_top_k(delta, Self::top_k_count(fraction, delta.len()), feedback)
            }
        }
    }

    /// Checks the setting as the encoding a model is downloaded in (the plan's
    /// `model_download`): a model is sent whole, so top-k is refused.
    pub fn check_model(&self) -> Result<(), CompressionError> {
        if let Compression::TopK { .. } = self {
            return Err(CompressionError::Setting(
                "a model is downloaded whole: f32, f16, bf16 or int8, not top_k".into(),
            ));
        }
        self.check()
    }

    /// Encodes a model's values for download. Deterministic, so that every device gets the
    /// same bytes under one content hash: int8 rounds to nearest (half stochastic rounding's
    /// worst-case error; a model is not averaged over a cohort, so unbiasedness buys nothing).
    /// Call only with a setting [`Compression::check_model`] accepts.
    pub fn encode_model(&self, values: &[f32]) -> Vec<u8> {
        match *self {
            Compression::Int8 { block } => encode_int8(values, block as usize, || 0.5),
            _ => self.encode(values, &mut SplitMix64(0), &mut ErrorFeedback::default()),
        }
    }

    /// Checks an encoded delta of a model of `n` values: exact length, finite values and
    /// scales, top-k indices strictly increasing below `n`.
    pub fn validate(&self, n: usize, bytes: Vec<u8>) -> Result<CompressedDelta, CompressionError> {
        // A setting that never went through a plan (an int8 block of 0) is refused, not divided by.
        self.check()?;
        let kind = self.name();
        let length = |expected: u64| {
            if bytes.len() as u64 == expected {
                Ok(())
            } else {
                Err(CompressionError::Length {
                    kind,
                    expected,
                    got: bytes.len() as u64,
                    n: n as u64,
                })
            }
        };
        let non_finite = |index: usize| CompressionError::NonFinite { kind, index: index as u64 };
        match *self {
            Compression::F32 | Compression::F16 | Compression::Bf16 => {
                length(self.max_encoded_len(n))?;
                let width = self.dense_width();
                // Non-finite iff the exponent bits are all ones: checked on the bits, with no
                // early exit so the scan vectorizes (decoding each f16 took 4 ms per 1M).
                let exponent = match self {
                    Compression::F32 => 0x7F80_0000,
                    Compression::F16 => 0x7C00,
                    _ => 0x7F80,
                };
                let bits =
                    |c: &[u8]| c.iter().rev().fold(0u32, |bits, &b| bits << 8 | u32::from(b));
                let bad = |c: &[u8]| bits(c) & exponent == exponent;
                if bytes.chunks_exact(width).fold(false, |any, c| any | bad(c)) {
                    let i = bytes.chunks_exact(width).position(bad).unwrap_or_default();
                    return Err(non_finite(i));
                }
            }
            Compression::Int8 { block } => {
                length(self.max_encoded_len(n))?;
                let (scales, values) = bytes.split_at(4 * n.div_ceil(block as usize));
                if let Some(i) = f32s(scales).position(|s| !(s.is_finite() && s >= 0.0)) {
                    return Err(non_finite(i));
                }
                // Every code times its scale must be finite, so the largest code's must be.
                if let Some(i) = f32s(scales).position(|s| s > MAX_INT8_SCALE) {
                    let scale = f32s(scales).nth(i).unwrap_or_default();
                    return Err(CompressionError::ScaleOverflow {
                        index: i as u64,
                        scale,
                        max: MAX_INT8_SCALE,
                    });
                }
                // `contains` is a memchr: the common case (none) scans a 1 MB delta in
                // microseconds; only a refusal looks for where.
                if values.contains(&0x80) {
                    let i = values.iter().position(|&b| b == 0x80).unwrap_or_default();
                    return Err(CompressionError::Int8Range { index: i as u64 });
                }
            }
            Compression::TopK { fraction } => {
                let k = bytes
                    .get(..4)
                    .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize)
                    .ok_or(CompressionError::Length {
                        kind,
                        expected: 4,
                        got: bytes.len() as u64,
                        n: n as u64,
                    })?;
                if k > Self::top_k_count(fraction, n) {
                    return Err(CompressionError::Length {
                        kind,
                        expected: self.max_encoded_len(n),
                        got: 4 + 8 * k as u64,
                        n: n as u64,
                    });
                }
                length(4 + 8 * k as u64)?;
                let (indices, values) = bytes[4..].split_at(4 * k);
                let mut next = 0u64;
                for (position, index) in u32s(indices).enumerate() {
                    if u64::from(index) < next || index as usize >= n {
                        return Err(CompressionError::BadIndex {
                            position: position as u64,
                            index,
                        });
                    }
                    next = u64::from(index) + 1;
                }
                if let Some(i) = f32s(values).position(|v| !v.is_finite()) {
                    return Err(non_finite(i));
                }
            }
        }
        Ok(CompressedDelta { compression: *self, n, bytes: std::sync::Arc::new(bytes) })
    }
}

impl CompressedDelta {
    /// An f32 delta whose bytes the caller already checked (length and finite values) against
    /// the schema, which names the tensor of a bad value ([`TensorSchema::check_f32_bytes`]).
    ///
    /// [`TensorSchema::check_f32_bytes`]: crate::tensor::TensorSchema::check_f32_bytes
    pub(crate) fn checked_f32(bytes: Vec<u8>) -> Self {
        debug_assert_eq!(bytes.len() % 4, 0);
        CompressedDelta {
            compression: Compression::F32,
            n: bytes.len() / 4,
            bytes: std::sync::Arc::new(bytes),
        }
    }

    /// The encoding.
    pub fn compression(&self) -> Compression {
        self.compression
    }

    /// Values in the model.
    pub fn len(&self) -> usize {
        self.n
    }

    /// Whether the model has no values.
    pub fn is_empty(&self) -> bool {
        self.n == 0
    }

    /// The encoded bytes, as validated (what the store keeps).
    pub fn bytes(&self) -> &std::sync::Arc<Vec<u8>> {
        &self.bytes
    }

    /// Calls `f(index, value)` for every value the encoding carries, in index order: all `n`
    /// for the dense encodings, the kept ones for top-k (the rest are zero). Decoding one
    /// value at a time, so a fold never holds an f32 copy of the delta.
    pub fn for_each(&self, mut f: impl FnMut(usize, f32)) {
        self.runs(|start, run| match run {
            Run::Dense(kind, bytes) => {
                let width = kind.dense_width();
                for (i, c) in (start..).zip(bytes.chunks_exact(width)) {
                    f(i, kind.dense_value(c));
                }
            }
            Run::Int8 { scale, values } => {
                for (i, &q) in (start..).zip(values) {
                    f(i, int8_value(q, scale));
                }
            }
            Run::One(v) => f(start, v),
        });
    }

    /// The encoding's values as contiguous runs, in index order: `f(first index, run)`. What a
    /// fold loops over without decoding value by value.
    pub(crate) fn runs(&self, f: impl FnMut(usize, Run<'_>)) {
        self.runs_in(0..self.n, f);
    }

    /// [`runs`](Self::runs) cut to the values whose indices are in `range` (a run that
    /// straddles its ends is cut there): what a fold over one tile of the sums loops over.
    pub(crate) fn runs_in(&self, range: std::ops::Range<usize>, mut f: impl FnMut(usize, Run<'_>)) {
        let (start, end) = (range.start, range.end.min(self.n));
        if start >= end {
            return;
        }
        let bytes = &self.bytes[..];
        match self.compression {
            kind @ (Compression::F32 | Compression::F16 | Compression::Bf16) => {
                let width = kind.dense_width();
                f(start, Run::Dense(kind, &bytes[start * width..end * width]));
            }
            Compression::Int8 { block } => {
                let block = block as usize;
                let (scales, values) = bytes.split_at(4 * self.n.div_ceil(block));
                let scales = f32s(&scales[4 * (start / block)..]);
                for (b, scale) in (start / block..end.div_ceil(block)).zip(scales) {
                    let first = (b * block).max(start);
                    let last = ((b + 1) * block).min(end);
                    f(first, Run::Int8 { scale, values: &values[first..last] });
                }
            }
            Compression::TopK { .. } => {
                let k = u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]) as usize;
                let (indices, values) = bytes[4..].split_at(4 * k);
                // Validation made the indices strictly increasing: the range is found by
                // bisection.
                let index = |j: usize| {
                    u32::from_le_bytes([
                        indices[4 * j],
                        indices[4 * j + 1],
                        indices[4 * j + 2],
                        indices[4 * j + 3],
                    ]) as usize
                };
                let below = |bound: usize| partition_point(k, |j| index(j) < bound);
                let (from, to) = (below(start), below(end));
                let kept = u32s(&indices[4 * from..4 * to]).zip(f32s(&values[4 * from..4 * to]));
                for (i, v) in kept {
                    f(i as usize, Run::One(v));
                }
            }
        }
    }

    /// The delta as f32 values (zeros where top-k dropped a value).
    pub fn to_f32(&self) -> Vec<f32> {
        let mut out = vec![0.0; self.n];
        self.for_each(|i, v| out[i] = v);
        out
    }

    /// The delta's squared L2 norm, in f64. Eight values at a time into eight running sums,
    /// added at the end: one sum of one value at a time was a chain of dependent adds, 12 % of
    /// the coordinator's CPU samples in an f32 round of 4 000 devices (every upload's norm is
    /// checked against the plan's `max_update_norm`); this is about five times faster on 100k
    /// f32 values.
    pub fn norm_squared(&self) -> f64 {
        const LANES: usize = 8;
        let mut sums = [0.0f64; LANES];
        let mut add_eight = |values: [f32; LANES]| {
            for (sum, v) in sums.iter_mut().zip(values) {
                *sum += f64::from(v) * f64::from(v);
            }
        };
        let mut rest = 0.0;
        self.runs(|_, run| match run {
            // f32 on its own: decoded by the generic loop below, value by value through the
            // encoding's match, the norm was a fifth of the coordinator's CPU in an f32 round.
            Run::Dense(Compression::F32, bytes) => {
                let eights = bytes.chunks_exact(4 * LANES);
                for c in eights.remainder().chunks_exact(4) {
                    rest += f64::from(f32::from_le_bytes([c[0], c[1], c[2], c[3]])).powi(2);
                }
                for eight in eights {
                    add_eight(std::array::from_fn(|j| {
                        let c = &eight[4 * j..4 * j + 4];
                        f32::from_le_bytes([c[0], c[1], c[2], c[3]])
                    }));
                }
            }
            Run::Dense(kind, bytes) => {
                let width = kind.dense_width();
                let eights = bytes.chunks_exact(width * LANES);
                for c in eights.remainder().chunks_exact(width) {
                    rest += f64::from(kind.dense_value(c)).powi(2);
                }
                for eight in eights {
                    add_eight(std::array::from_fn(|j| {
                        kind.dense_value(&eight[j * width..(j + 1) * width])
                    }));
                }
            }
            Run::Int8 { scale, values } => {
                let eights = values.chunks_exact(LANES);
                for &q in eights.remainder() {
                    rest += f64::from(int8_value(q, scale)).powi(2);
                }
                for eight in eights {
                    add_eight(std::array::from_fn(|j| int8_value(eight[j], scale)));
                }
            }
            Run::One(v) => rest += f64::from(v).powi(2),
        });
        sums.iter().sum::<f64>() + rest
    }
}

/// What top-k compression has not yet sent, kept on the device between rounds (O(model)); it
/// starts empty and takes the model's length on first use.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ErrorFeedback {
    /// Residual per parameter.
    pub residual: Vec<f32>,
}

impl Compression {
    /// Bytes per value of a dense float encoding (f32, f16, bf16).
    pub(crate) fn dense_width(self) -> usize {
        if self.is_f32() { 4 } else { 2 }
    }

    /// One value of a dense float encoding from its `dense_width` little-endian bytes.
    #[inline]
    pub(crate) fn dense_value(self, c: &[u8]) -> f32 {
        match self {
            Compression::F32 => f32::from_le_bytes([c[0], c[1], c[2], c[3]]),
            Compression::F16 => half::f16::from_le_bytes([c[0], c[1]]).to_f32(),
            Compression::Bf16 => half::bf16::from_le_bytes([c[0], c[1]]).to_f32(),
            Compression::Int8 { .. } | Compression::TopK { .. } => {
                unreachable!("only the dense float encodings decode value by value")
            }
        }
    }
}

/// Int8 with `offset()` added before flooring: uniform in [0, 1) rounds stochastically, 0.5
/// to nearest.
fn encode_int8(delta: &[f32], block: usize, mut offset: impl FnMut() -> f64) -> Vec<u8> {
    let blocks = delta.len().div_ceil(block.max(1));
    let mut out = Vec::with_capacity(4 * blocks + delta.len());
    let scales: Vec<f32> = delta
        .chunks(block.max(1))
        // At most MAX_INT8_SCALE, so that a block holding ±f32::MAX still decodes finite.
        .map(|c| (c.iter().fold(0.0f32, |m, v| m.max(v.abs())) / 127.0).min(MAX_INT8_SCALE))
        .collect();
    scales.iter().for_each(|s| out.extend_from_slice(&s.to_le_bytes()));
    out.resize(out.len() + delta.len(), 0);
    let quantized = out[4 * blocks..].chunks_mut(block.max(1));
    for ((chunk, &scale), out) in delta.chunks(block.max(1)).zip(&scales).zip(quantized) {
        if scale > 0.0 {
            let scale = f64::from(scale);
            for (&v, q) in chunk.iter().zip(out) {
                // floor(x/s + u), u uniform in [0, 1): rounds up with probability frac(x/s).
                let q_f = floor_within_i32(f64::from(v) / scale + offset()).clamp(-127.0, 127.0);
                *q = q_f as i8 as u8;
            }
        }
    }
    out
}

/// `x.floor()` wherever the result is within i32 (a saturated bound beyond it, NaN to 0):
/// the same once clamped to the int8 range. `f64::floor` is a call into libm on the x86-64
/// baseline (no SSE4.1), which made it most of a model's int8 encoding.
#[inline]
fn floor_within_i32(x: f64) -> f64 {
    let truncated = f64::from(x as i32);
    if truncated > x { truncated - 1.0 } else { truncated }
}

fn encode_top_k(delta: &[f32], k: usize, feedback: &mut ErrorFeedback) -> Vec<u8> {
    if feedback.residual.len() != delta.len() {
        feedback.residual = vec![0.0; delta.len()];
    }
    // The residual becomes this round's corrected delta; what is sent leaves it below.
    let corrected = &mut feedback.residual;
    corrected.iter_mut().zip(delta).for_each(|(e, d)| *e += d);
    let mut order: Vec<u32> = (0..delta.len() as u32).collect();
    if k < order.len() {
        order.select_nth_unstable_by(k, |&a, &b| {
            corrected[b as usize].abs().total_cmp(&corrected[a as usize].abs())
        });
        order.truncate(k);
    }
    order.sort_unstable();
    let mut out = Vec::with_capacity(4 + 8 * order.len());
    out.extend_from_slice(&(order.len() as u32).to_le_bytes());
    order.iter().for_each(|i| out.extend_from_slice(&i.to_le_bytes()));
    for &i in &order {
        out.extend_from_slice(&corrected[i as usize].to_le_bytes());
        corrected[i as usize] = 0.0;
    }
    out
}

/// The first `j` in `0..len` for which `pred(j)` is false (`pred` true then false over it).
fn partition_point(len: usize, pred: impl Fn(usize) -> bool) -> usize {
    let (mut lo, mut hi) = (0, len);
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if pred(mid) { lo = mid + 1 } else { hi = mid }
    }
    lo
}

fn f32s(bytes: &[u8]) -> impl Iterator<Item = f32> + '_ {
    bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
}

fn u32s(bytes: &[u8]) -> impl Iterator<Item = u32> + '_ {
    bytes.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
}

#[cfg(test)]
mod tests;
