//! Tensor schemas and the flat little-endian payload every tier exchanges.
//!
//! A model or an update is one flat buffer: the tensors of the schema, in schema order,
//! concatenated as raw little-endian values.
//! On the wire it is one CBOR byte string (never an array of floats), tagged with the
//! `schema_id` of the schema it was encoded for, so a mismatch is caught before any value is read.

use std::collections::BTreeSet;
use std::fmt;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// Element type of a tensor.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum DType {
    /// IEEE 754 binary32, little-endian.
    F32,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
        }
    }

    fn tag(self) -> u8 {
        match self {
            DType::F32 => 1,
        }
    }
}

/// One named tensor of a model.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorSpec {
    /// Parameter name, e.g. `layers.0.weight`; unique within a schema.
    pub name: String,
    /// Dimensions, outermost first; every dimension is at least 1.
    pub shape: Vec<u64>,
    /// Element type.
    pub dtype: DType,
}

impl TensorSpec {
    /// Number of elements; `u64::MAX` for a shape whose product does not fit (only an
    /// unvalidated schema has one: [`TensorSchema::validate`] refuses it).
    pub fn numel(&self) -> u64 {
        self.shape.iter().try_fold(1u64, |acc, &d| acc.checked_mul(d)).unwrap_or(u64::MAX)
    }
}

/// The ordered list of tensors that make up a model.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorSchema {
    /// Tensors in payload order.
    pub tensors: Vec<TensorSpec>,
}

/// A stable 256-bit digest of a [`TensorSchema`]: names, shapes and dtypes, in order.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
#[cfg_attr(feature = "openapi", schema(value_type = String, format = Binary))]
pub struct SchemaId(#[serde(with = "serde_bytes")] pub [u8; 32]);

impl fmt::Debug for SchemaId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SchemaId({self})")
    }
}

impl fmt::Display for SchemaId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&hex::encode(&self.0[..8]))
    }
}

/// Largest model a schema may describe, in elements (2^31, i.e. 8 GiB of f32).
pub const MAX_SCHEMA_ELEMENTS: u64 = 1 << 31;

/// The longest tensor name, in bytes (Hugging Face's longest are under 100).
pub const MAX_TENSOR_NAME: usize = 256;

/// Why a schema or a payload was rejected.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum TensorError {
    /// The schema lists no tensors.
    #[error("schema has no tensors")]
    EmptySchema,
    /// A tensor name is empty or repeated.
    #[error("tensor name {name:?} is empty or repeated")]
    BadName {
        /// The offending name.
        name: String,
    },
    /// A tensor name is longer than [`MAX_TENSOR_NAME`] bytes.
    #[error("a tensor name of {len} bytes is over the limit of {MAX_TENSOR_NAME}")]
    NameTooLong {
        /// Its length in bytes.
        len: usize,
    },
    /// A tensor has no dimensions or a zero dimension.
    #[error("tensor {name:?} has an empty or zero-sized shape {shape:?}")]
    BadShape {
        /// Tensor name.
        name: String,
        /// Its shape.
        shape: Vec<u64>,
    },
    /// The schema describes more than [`MAX_SCHEMA_ELEMENTS`] elements.
    #[error("schema has {elements} elements, more than the limit of {MAX_SCHEMA_ELEMENTS}")]
    TooLarge {
        /// Total element count.
        elements: u64,
    },
    /// The payload was encoded for another schema.
    #[error("payload schema_id {got} does not match the run's schema_id {expected}")]
    SchemaMismatch {
        /// The run's schema id.
        expected: SchemaId,
        /// The payload's schema id.
        got: SchemaId,
    },
    /// The payload has the wrong number of bytes for the schema.
    #[error("payload has {got} bytes, the schema needs {expected}")]
    ShapeMismatch {
        /// Bytes the schema needs.
        expected: u64,
        /// Bytes received.
        got: u64,
    },
    /// A value is NaN or infinite.
    #[error("value at flat index {index} (tensor {tensor:?}) is not finite")]
    NonFinite {
        /// Flat index into the payload.
        index: u64,
        /// Tensor that holds it.
        tensor: String,
    },
}

impl TensorSchema {
    /// Checks names, shapes and size; every schema from outside goes through here.
    pub fn validate(&self) -> Result<(), TensorError> {
        if self.tensors.is_empty() {
            return Err(TensorError::EmptySchema);
        }
        let mut names = BTreeSet::new();
        let mut total: u64 = 0;
        for t in &self.tensors {
            if t.name.len() > MAX_TENSOR_NAME {
                return Err(TensorError::NameTooLong { len: t.name.len() });
            }
            if t.name.is_empty() || !names.insert(t.name.as_str()) {
                return Err(TensorError::BadName { name: t.name.clone() });
            }
            if t.shape.is_empty() || t.shape.contains(&0) {
                return Err(TensorError::BadShape { name: t.name.clone(), shape: t.shape.clone() });
            }
            let numel = t
                .shape
                .iter()
                .try_fold(1u64, |acc, &d| acc.checked_mul(d))
                .filter(|&n| n <= MAX_SCHEMA_ELEMENTS)
                .ok_or(TensorError::TooLarge { elements: u64::MAX })?;
            total = total.saturating_add(numel);
        }
        if total > MAX_SCHEMA_ELEMENTS {
            return Err(TensorError::TooLarge { elements: total });
        }
        Ok(())
    }

    /// Total number of elements across all tensors.
    pub fn numel(&self) -> u64 {
        self.tensors.iter().fold(0u64, |acc, t| acc.saturating_add(t.numel()))
    }

    /// Each tensor with the range of its elements in a flat model of this schema.
    pub fn ranges(&self) -> impl Iterator<Item = (&TensorSpec, std::ops::Range<usize>)> {
        self.tensors.iter().scan(0usize, |offset, t| {
            let start = *offset;
            *offset += t.numel() as usize;
            Some((t, start..*offset))
        })
    }

    /// Bytes of a payload in this schema (saturating, like [`TensorSpec::numel`]).
    pub fn byte_len(&self) -> u64 {
        self.tensors.iter().fold(0u64, |acc, t| {
            acc.saturating_add(t.numel().saturating_mul(t.dtype.size() as u64))
        })
    }

    /// The schema's stable digest.
    ///
    /// The preimage is a fixed binary layout (not serde output), so the id never changes with
    /// a serializer version: a domain tag, then per tensor the name length and bytes, the dtype
    /// tag, the rank and each dimension, all little-endian.
    pub fn schema_id(&self) -> SchemaId {
        let mut h = Sha256::new();
        h.update(b"starling.schema.v1\0");
        h.update((self.tensors.len() as u64).to_le_bytes());
        for t in &self.tensors {
            h.update((t.name.len() as u64).to_le_bytes());
            h.update(t.name.as_bytes());
            h.update([t.dtype.tag()]);
            h.update((t.shape.len() as u64).to_le_bytes());
            for d in &t.shape {
                h.update(d.to_le_bytes());
            }
        }
        SchemaId(h.finalize().into())
    }

    /// The tensor that holds flat element `index`.
    pub fn tensor_at(&self, mut index: u64) -> Option<&TensorSpec> {
        for t in &self.tensors {
            if index < t.numel() {
                return Some(t);
            }
            index -= t.numel();
        }
        None
    }

    /// Decodes an f32 payload for this schema, rejecting wrong ids, lengths and non-finite values.
    pub fn decode_f32(&self, payload: &TensorPayload) -> Result<Vec<f32>, TensorError> {
        let expected = self.schema_id();
        if payload.schema_id != expected {
            return Err(TensorError::SchemaMismatch { expected, got: payload.schema_id });
        }
        self.decode_f32_bytes(&payload.data)
    }

    /// Decodes raw little-endian f32 bytes laid out in this schema (no schema id check).
    pub fn decode_f32_bytes(&self, bytes: &[u8]) -> Result<Vec<f32>, TensorError> {
        self.check_f32_bytes(bytes)?;
        Ok(f32_from_le_bytes(bytes))
    }

    /// Checks that raw little-endian f32 bytes fit this schema and hold only finite values.
    pub fn check_f32_bytes(&self, bytes: &[u8]) -> Result<(), TensorError> {
        if bytes.len() as u64 != self.byte_len() {
            return Err(TensorError::ShapeMismatch {
                expected: self.byte_len(),
                got: bytes.len() as u64,
            });
        }
        // An f32 is finite iff its exponent bits are not all ones.
        let non_finite =
            bytes.chunks_exact(4).position(|c| (c[3] & 0x7f) == 0x7f && (c[2] & 0x80) != 0);
        if let Some(index) = non_finite {
            let tensor = self.tensor_at(index as u64).map(|t| t.name.clone()).unwrap_or_default();
            return Err(TensorError::NonFinite { index: index as u64, tensor });
        }
        Ok(())
    }

    /// Encodes values laid out in this schema as a tagged payload.
    ///
    /// # Panics
    /// If `values` does not have [`TensorSchema::numel`] elements: a caller bug.
    pub fn encode_f32(&self, values: &[f32]) -> TensorPayload {
        assert_eq!(values.len() as u64, self.numel(), "values do not match the schema");
        TensorPayload { schema_id: self.schema_id(), data: f32_to_le_bytes(values) }
    }
}

/// A flat tensor buffer tagged with the schema it was encoded for.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Clone, PartialEq, Serialize, Deserialize)]
pub struct TensorPayload {
    /// Digest of the schema the data is laid out in.
    pub schema_id: SchemaId,
    /// Raw little-endian values, tensors concatenated in schema order.
    #[serde(with = "serde_bytes")]
    #[cfg_attr(feature = "openapi", schema(value_type = String, format = Binary))]
    pub data: Vec<u8>,
}

impl fmt::Debug for TensorPayload {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TensorPayload")
            .field("schema_id", &self.schema_id)
            .field("bytes", &self.data.len())
            .finish()
    }
}

impl crate::codec::WithLargeBytes for TensorPayload {
    const LARGE_BYTES_AT: &'static [&'static str] = &["data"];

    fn put_large_bytes(&mut self, bytes: Vec<u8>) {
        self.data = bytes;
    }
}

impl TensorPayload {
    /// Content address of the payload: SHA-256 over the schema id and the data, hex-encoded.
    ///
    /// Used as the model's download path and HTTP `ETag`.
    pub fn content_hash(&self) -> String {
        let mut h = Sha256::new();
        h.update(self.schema_id.0);
        h.update(&self.data);
        hex::encode(h.finalize())
    }
}

/// Whether `name` matches `pattern`, where `*` matches any run of characters (dots included)
/// and everything else matches itself.
pub fn name_matches(pattern: &str, name: &str) -> bool {
    let mut parts = pattern.split('*');
    let first = parts.next().unwrap_or_default();
    let Some(mut rest) = name.strip_prefix(first) else { return false };
    let parts: Vec<&str> = parts.collect();
    let Some((last, middle)) = parts.split_last() else { return rest.is_empty() };
    for part in middle {
        match rest.find(part) {
            Some(at) => rest = &rest[at + part.len()..],
            None => return false,
        }
    }
    rest.len() >= last.len() && rest.ends_with(last)
}

/// Little-endian bytes of `values`.
pub fn f32_to_le_bytes(values: &[f32]) -> Vec<u8> {
    let mut out = vec![0; values.len() * 4];
    f32_into_le_bytes(values, &mut out);
    out
}

/// Writes `values` into `out` (four bytes each) as little-endian f32, for a caller that owns
/// the buffer already (a Python `bytes` being filled).
pub fn f32_into_le_bytes(values: &[f32], out: &mut [u8]) {
    // Into a buffer of the final length, a fixed-size copy per value: this compiles to a
    // plain copy, where growing the vector value by value did not.
    for (bytes, v) in out.chunks_exact_mut(4).zip(values) {
        bytes.copy_from_slice(&v.to_le_bytes());
    }
}

/// Values from little-endian bytes; a trailing partial value is ignored (callers check lengths).
pub fn f32_from_le_bytes(bytes: &[u8]) -> Vec<f32> {
    bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

pub mod safetensors;

#[cfg(test)]
mod tests;
