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

/// A message that carries one large byte string (a model or a delta), decoded by
/// [`decode_large`].
pub trait WithLargeBytes: DeserializeOwned {
    /// The map keys from the top of the message down to the byte string.
    const LARGE_BYTES_AT: &'static [&'static str];
    /// Puts the byte string in its field, which the message decoded empty.
    fn put_large_bytes(&mut self, bytes: Vec<u8>);
}

/// [`decode`] for a message with a large byte string: the string is copied out once, into a
/// buffer of its size, and the rest of the message decodes without it. ciborium copies a byte
/// string through a 4 KiB scratch into a vector it grows by doubling, which was most of the
/// coordinator's copying at 10 000 uploads of 100k f32 values (and the load generator's, on
/// the same bytes' way down). A message that does not hold the string where expected (absent,
/// tagged, of indefinite length) or does not decode gets exactly what [`decode`] gives it.
pub fn decode_large<T: WithLargeBytes>(bytes: &[u8]) -> Result<T, CodecError> {
    let Some(at) = find_byte_string(bytes, T::LARGE_BYTES_AT) else { return decode(bytes) };
    let mut envelope = Vec::with_capacity(bytes.len() - at.payload.len() + 1);
    envelope.extend_from_slice(&bytes[..at.head]);
    envelope.push(EMPTY_BYTE_STRING);
    envelope.extend_from_slice(&bytes[at.payload.end..]);
    match decode::<T>(&envelope) {
        Ok(mut value) => {
            value.put_large_bytes(bytes[at.payload].to_vec());
            Ok(value)
        }
        // The error, with its offsets, of the message as it came.
        Err(_) => decode(bytes),
    }
}

/// The CBOR head of a byte string of length 0.
const EMPTY_BYTE_STRING: u8 = 0x40;

/// Where a definite-length byte string sits in a message: its head and its bytes.
struct ByteStringAt {
    head: usize,
    payload: std::ops::Range<usize>,
}

/// The byte string at `path` (text keys of nested maps), if it is there, untagged and of
/// definite length; `None` for anything else, malformed CBOR included.
fn find_byte_string(bytes: &[u8], path: &[&str]) -> Option<ByteStringAt> {
    let mut cbor = Walk { bytes, at: 0 };
    for (depth, key) in path.iter().enumerate() {
        let (major, info, len) = cbor.head()?;
        if major != MAP {
            return None;
        }
        let mut entries = (info != INDEFINITE).then_some(len);
        loop {
            match &mut entries {
                Some(0) => return None,
                Some(left) => *left -= 1,
                None if cbor.peek()? == BREAK => return None,
                None => {}
            }
            if cbor.text_key_is(key)? {
                break;
            }
            cbor.skip(0)?;
        }
        if depth + 1 == path.len() {
            let head = cbor.at;
            let (major, info, len) = cbor.head()?;
            if major != BYTES || info == INDEFINITE {
                return None;
            }
            let start = cbor.at;
            cbor.take(len)?;
            return Some(ByteStringAt { head, payload: start..cbor.at });
        }
    }
    None
}

const BYTES: u8 = 2;
const TEXT: u8 = 3;
const ARRAY: u8 = 4;
const MAP: u8 = 5;
const TAG: u8 = 6;
const INDEFINITE: u8 = 31;
const BREAK: u8 = 0xff;
/// ciborium's own nesting limit.
const MAX_DEPTH: usize = 256;

/// A read position in CBOR bytes (RFC 8949), skipping items without decoding them.
struct Walk<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl Walk<'_> {
    fn peek(&self) -> Option<u8> {
        self.bytes.get(self.at).copied()
    }

    fn take(&mut self, n: u64) -> Option<&[u8]> {
        let end = self.at.checked_add(usize::try_from(n).ok()?)?;
        let taken = self.bytes.get(self.at..end)?;
        self.at = end;
        Some(taken)
    }

    /// An item's head: major type, additional information, and its argument (a value, a
    /// length, or 0 for an indefinite length).
    fn head(&mut self) -> Option<(u8, u8, u64)> {
        let initial = self.peek()?;
        self.at += 1;
        let (major, info) = (initial >> 5, initial & 0x1f);
        let width = match info {
            0..=23 => return Some((major, info, u64::from(info))),
            24 => 1,
            25 => 2,
            26 => 4,
            27 => 8,
            INDEFINITE if matches!(major, BYTES..=MAP) => return Some((major, info, 0)),
            _ => return None,
        };
        let argument = self.take(width)?.iter().fold(0u64, |n, &b| n << 8 | u64::from(b));
        Some((major, info, argument))
    }

    /// Whether the next item, a map key, is the text `key`; the key is read either way.
    fn text_key_is(&mut self, key: &str) -> Option<bool> {
        let start = self.at;
        let (major, info, len) = self.head()?;
        if major == TEXT && info != INDEFINITE {
            return Some(self.take(len)? == key.as_bytes());
        }
        self.at = start;
        self.skip(0)?;
        Some(false)
    }

    /// Steps over one whole item.
    fn skip(&mut self, depth: usize) -> Option<()> {
        if depth > MAX_DEPTH {
            return None;
        }
        let (major, info, len) = self.head()?;
        let items_per_entry = match major {
            BYTES | TEXT if info == INDEFINITE => loop {
                if self.peek()? == BREAK {
                    self.at += 1;
                    return Some(());
                }
                let (chunk, chunk_info, chunk_len) = self.head()?;
                if chunk != major || chunk_info == INDEFINITE {
                    return None;
                }
                self.take(chunk_len)?;
            },
            BYTES | TEXT => return self.take(len).map(|_| ()),
            ARRAY => 1,
            MAP => 2,
            TAG => return self.skip(depth + 1),
            // Integers, simple values and floats: the head was the whole item.
            _ => return Some(()),
        };
        if info == INDEFINITE {
            while self.peek()? != BREAK {
                self.skip(depth + 1)?;
            }
            self.at += 1;
        } else {
            for _ in 0..len {
                for _ in 0..items_per_entry {
                    self.skip(depth + 1)?;
                }
            }
        }
        Some(())
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use ciborium::Value;
    use proptest::prelude::*;

    use super::*;
    use crate::ModelVersion;
    use crate::tensor::{SchemaId, TensorPayload};
    use crate::wire::UploadRequest;

    fn upload(data: Vec<u8>) -> UploadRequest {
        UploadRequest {
            model_version: ModelVersion(7),
            example_count: 12,
            metrics: BTreeMap::from([("loss".to_owned(), 0.25)]),
            delta: TensorPayload { schema_id: SchemaId([9; 32]), data },
        }
    }

    /// Both decoders on the same bytes: the same message, or both an error (the same one).
    fn agree<T: WithLargeBytes + PartialEq + std::fmt::Debug>(bytes: &[u8]) {
        match (decode::<T>(bytes), decode_large::<T>(bytes)) {
            (Ok(plain), Ok(large)) => assert_eq!(plain, large),
            (Err(plain), Err(large)) => assert_eq!(plain.to_string(), large.to_string()),
            (plain, large) => panic!("decode gave {plain:?}, decode_large {large:?}"),
        }
    }

    #[test]
    fn a_large_byte_string_decodes_as_the_plain_decoder_decodes_it() {
        for len in [0, 1, 23, 24, 255, 256, 65_535, 65_536, 400_000] {
            let sent = upload((0..len).map(|i| (i * 31 % 251) as u8).collect());
            let bytes = to_vec(&sent).unwrap();
            assert!(find_byte_string(&bytes, UploadRequest::LARGE_BYTES_AT).is_some());
            assert_eq!(decode_large::<UploadRequest>(&bytes).unwrap(), sent);
            let payload = to_vec(&sent.delta).unwrap();
            assert_eq!(decode_large::<TensorPayload>(&payload).unwrap(), sent.delta);
        }
    }

    /// Keys in another order, an unknown field holding a byte string of its own, the string
    /// tagged, of indefinite length, or a map of indefinite length: what another CBOR encoder may
    /// send, decoded as the plain decoder decodes it.
    #[test]
    fn other_encodings_of_the_message_decode_as_the_plain_decoder_decodes_them() {
        let data = Value::Bytes(vec![5; 5000]);
        let schema = Value::Bytes(vec![9; 32]);
        let text = |s: &str| Value::Text(s.to_owned());
        let delta = |data: Value| {
            Value::Map(vec![(text("data"), data), (text("schema_id"), schema.clone())])
        };
        let message = |delta: Value, extra: Option<(Value, Value)>| {
            let mut entries = vec![
                (text("metrics"), Value::Map(vec![(text("loss"), Value::Float(0.5))])),
                (text("delta"), delta),
                (text("example_count"), Value::Integer(3.into())),
                (text("model_version"), Value::Integer(1.into())),
            ];
            entries.extend(extra);
            let mut bytes = Vec::new();
            ciborium::into_writer(&Value::Map(entries), &mut bytes).unwrap();
            bytes
        };
        let reordered = message(delta(data.clone()), None);
        assert_eq!(decode_large::<UploadRequest>(&reordered).unwrap().delta.data, vec![5; 5000]);
        agree::<UploadRequest>(&reordered);
        agree::<UploadRequest>(&message(
            delta(data.clone()),
            Some((text("padding"), Value::Bytes(vec![1; 70_000]))),
        ));
        agree::<UploadRequest>(&message(delta(Value::Tag(24, Box::new(data.clone()))), None));
        agree::<UploadRequest>(&message(delta(Value::Bytes(Vec::new())), None));
        agree::<UploadRequest>(&message(delta(text("not bytes")), None));
        // A second `delta`: refused as the plain decoder refuses it.
        agree::<UploadRequest>(&message(
            delta(data.clone()),
            Some((text("delta"), delta(data.clone()))),
        ));
        // `data` in two chunks of indefinite length (0x5f ... 0xff).
        let mut chunked = message(delta(Value::Bytes(vec![5; 100])), None);
        let head = chunked.windows(2).position(|w| w == [0x58, 100]).unwrap();
        chunked.splice(head..head + 2, [0x5f, 0x58, 50]);
        let middle = head + 3 + 50;
        chunked.splice(middle..middle, [0x58, 50]);
        chunked.insert(middle + 2 + 50, BREAK);
        assert_eq!(decode::<UploadRequest>(&chunked).unwrap().delta.data, vec![5; 100]);
        agree::<UploadRequest>(&chunked);
    }

    proptest! {
        /// Cut short, a byte changed, or bytes appended anywhere: both decoders agree, on the
        /// message or on the error.
        #[test]
        fn a_damaged_message_decodes_or_fails_as_the_plain_decoder_says(
            len in 0usize..3000,
            cut in any::<prop::sample::Index>(),
            flip in any::<prop::sample::Index>(),
            to in any::<u8>(),
            tail in prop::collection::vec(any::<u8>(), 0..4),
        ) {
            let bytes = to_vec(&upload(vec![3; len])).unwrap();
            agree::<UploadRequest>(&bytes[..cut.index(bytes.len())]);
            let mut changed = bytes.clone();
            changed[flip.index(bytes.len())] = to;
            agree::<UploadRequest>(&changed);
            let mut longer = bytes.clone();
            longer.extend(&tail);
            agree::<UploadRequest>(&longer);
        }
    }
}
