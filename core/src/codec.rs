//! The CBOR codec every body, stored record and sealed share goes through.
//!
//! Encoding writes into a caller's `Vec<u8>` and decoding reads a byte slice, so the codec is
//! pure and tested on byte literals. It depends on no message type: the messages (`wire`,
//! `secagg`, `tier`) depend on it, never the other way round.

use serde::Serialize;
use serde::de::DeserializeOwned;

/// Why a CBOR body could not be encoded or decoded.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CodecError {
    /// The bytes are not valid CBOR for the expected message.
    #[error("malformed cbor body: {0}")]
    Malformed(String),
    /// Serialization failed (only on a bug or an out-of-memory writer).
    #[error("cbor encoding failed: {0}")]
    Encode(String),
}

/// Appends the CBOR encoding of `value` to `out`.
pub fn encode<T: Serialize>(value: &T, out: &mut Vec<u8>) -> Result<(), CodecError> {
    ciborium::into_writer(value, out).map_err(|e| CodecError::Encode(e.to_string()))
}

/// Encodes `value` into a fresh buffer.
pub fn to_vec<T: Serialize>(value: &T) -> Result<Vec<u8>, CodecError> {
    let mut out = Vec::new();
    encode(value, &mut out)?;
    Ok(out)
}

/// Decodes one message, rejecting trailing bytes.
pub fn decode<T: DeserializeOwned>(mut bytes: &[u8]) -> Result<T, CodecError> {
    let value =
        ciborium::from_reader(&mut bytes).map_err(|e| CodecError::Malformed(e.to_string()))?;
    if !bytes.is_empty() {
        return Err(CodecError::Malformed(format!(
            "{} trailing bytes after the message",
            bytes.len()
        )));
    }
    Ok(value)
}
