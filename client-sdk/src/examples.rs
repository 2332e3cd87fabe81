//! The example store: what the app adds, kept on the device, never uploaded.
//!
//! Every example is checked on the way in (width, finite values, token ids in range), so
//! nothing malformed ever reaches burn, which panics on misuse.

use burn::tensor::{Device, Int, Tensor, TensorData};
use starling_core::model_spec::InputSpec;
use starling_core::rng::SplitMix64;

use crate::model::Batch;

/// Why an example was refused.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum ExampleError {
    /// The features have the wrong length for the input.
    #[error("example has {got} values, the input {input:?} needs {expected}")]
    Width {
        /// The store's input.
        input: InputSpec,
        /// Values it needs.
        expected: usize,
        /// Values given.
        got: usize,
    },
    /// A value is NaN or infinite.
    #[error("feature {0} is not finite")]
    NonFinite(usize),
    /// A token id is not a whole number below the vocabulary size.
    #[error("token {value} at position {position} is not an id below the vocabulary of {vocab}")]
    Token {
        /// Position in the sequence.
        position: usize,
        /// The value.
        value: f32,
        /// Vocabulary size.
        vocab: u64,
    },
}

/// Examples of one input shape, with integer class labels.
#[derive(Debug, Clone, PartialEq)]
pub struct Examples {
    input: InputSpec,
    features: Vec<f32>,
    labels: Vec<u32>,
}

impl Examples {
    /// An empty store for `input`.
    pub fn new(input: InputSpec) -> Self {
        Examples { input, features: vec![], labels: vec![] }
    }

    /// Values per example.
    pub fn width(input: InputSpec) -> usize {
        match input {
            InputSpec::Image { channels, height, width } => (channels * height * width) as usize,
            InputSpec::Features { size } => size as usize,
            InputSpec::Tokens { length, .. } => length as usize,
        }
    }

    /// Adds one example (token sequences as ids in `features`).
    pub fn push(&mut self, features: &[f32], label: u32) -> Result<(), ExampleError> {
        let expected = Self::width(self.input);
        if features.len() != expected {
            return Err(ExampleError::Width { input: self.input, expected, got: features.len() });
        }
        if let Some(i) = features.iter().position(|v| !v.is_finite()) {
            return Err(ExampleError::NonFinite(i));
        }
        if let InputSpec::Tokens { vocab, .. } = self.input
            && let Some(position) =
                features.iter().position(|&v| v < 0.0 || v.fract() != 0.0 || v as u64 >= vocab)
        {
            return Err(ExampleError::Token { position, value: features[position], vocab });
        }
        self.features.extend_from_slice(features);
        self.labels.push(label);
        Ok(())
    }

    /// The input shape.
    pub fn input(&self) -> InputSpec {
        self.input
    }

    /// Number of examples.
    pub fn len(&self) -> usize {
        self.labels.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }

    /// The labels, in order.
    pub fn labels(&self) -> &[u32] {
        &self.labels
    }

    /// The features, example after example (`Examples::width(input)` values each).
    pub fn features(&self) -> &[f32] {
        &self.features
    }

    /// Appends every example of `other` (same input shape).
    ///
    /// # Panics
    /// If the input shapes differ: a caller bug.
    pub fn extend(&mut self, other: &Examples) {
        assert_eq!(self.input, other.input, "examples of another input shape");
        self.features.extend_from_slice(&other.features);
        self.labels.extend_from_slice(&other.labels);
    }

    /// The examples at `idx`, in that order.
    pub fn subset(&self, idx: &[usize]) -> Examples {
        let w = Self::width(self.input);
        let mut out = Examples::new(self.input);
        for &i in idx {
            out.features.extend_from_slice(&self.features[i * w..(i + 1) * w]);
            out.labels.push(self.labels[i]);
        }
        out
    }

    /// A deterministic split into (train, held-out) with `fraction` held out.
    pub fn split_holdout(&self, fraction: f64, seed: u64) -> (Examples, Examples) {
        let mut idx: Vec<usize> = (0..self.len()).collect();
        SplitMix64(seed).shuffle(&mut idx);
        let held = ((self.len() as f64) * fraction.clamp(0.0, 1.0)).round() as usize;
        (self.subset(&idx[held..]), self.subset(&idx[..held]))
    }

    pub(crate) fn batch(&self, idx: &[usize], device: &Device) -> (Batch, Tensor<1, Int>) {
        batch_tensors(self.input, &self.features, &self.labels, idx, device)
    }
}

/// Builds `[batch, ...]` tensors for the examples at `idx`.
fn batch_tensors(
    input: InputSpec,
    features: &[f32],
    labels: &[u32],
    idx: &[usize],
    device: &Device,
) -> (Batch, Tensor<1, Int>) {
    let width = features.len() / labels.len();
    let mut x = Vec::with_capacity(idx.len() * width);
    for &i in idx {
        x.extend_from_slice(&features[i * width..(i + 1) * width]);
    }
    let b = idx.len();
    let batch = match input {
        InputSpec::Image { channels, height, width } => Batch::Image(Tensor::from_data(
            TensorData::new(x, [b, channels as usize, height as usize, width as usize]),
            device,
        )),
        InputSpec::Features { size } => {
            Batch::Flat(Tensor::from_data(TensorData::new(x, [b, size as usize]), device))
        }
        InputSpec::Tokens { length, .. } => {
            let ids: Vec<i64> = x.into_iter().map(|v| v as i64).collect();
            Batch::Tokens(Tensor::from_data(TensorData::new(ids, [b, length as usize]), device))
        }
    };
    let y: Vec<i64> = idx.iter().map(|&i| i64::from(labels[i])).collect();
    (batch, Tensor::from_data(TensorData::new(y, [b]), device))
}
