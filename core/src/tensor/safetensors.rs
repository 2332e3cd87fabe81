//! Models as safetensors files, the format training frameworks load (`safetensors`, PyTorch,
//! burn, candle): an 8-byte little-endian header length, a JSON header naming each tensor's
//! dtype, shape and byte range, then the raw little-endian data.
//!
//! A Starling payload already is the tensors' little-endian bytes in schema order, so the file
//! is that payload behind a header built from the schema.

use std::collections::BTreeMap;

use super::{DType, TensorError, TensorSchema};

/// Why a safetensors file could not be read back.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum SafetensorsError {
    /// The header is missing, truncated or not the JSON it should be.
    #[error("not a safetensors file: {0}")]
    Malformed(String),
    /// A tensor of the schema is absent, or has another shape or dtype.
    #[error("tensor {0:?} is missing or does not have the schema's shape and dtype")]
    Mismatch(String),
    /// The values do not fit the schema.
    #[error(transparent)]
    Tensor(#[from] TensorError),
}

fn dtype_name(dtype: DType) -> &'static str {
    match dtype {
        DType::F32 => "F32",
    }
}

/// The safetensors file of a model laid out in `schema` (`data`: its little-endian bytes, as
/// in a payload), with `metadata` in the header's `__metadata__`.
///
/// # Panics
/// If `data` does not have the schema's length: callers hold a validated model.
pub fn to_safetensors(
    schema: &TensorSchema,
    data: &[u8],
    metadata: &BTreeMap<String, String>,
) -> Vec<u8> {
    assert_eq!(data.len() as u64, schema.byte_len(), "data does not match the schema");
    let mut header = serde_json::Map::new();
    if !metadata.is_empty() {
        header.insert("__metadata__".into(), serde_json::json!(metadata));
    }
    let mut offset = 0u64;
    for t in &schema.tensors {
        let len = t.numel() * t.dtype.size() as u64;
        header.insert(
            t.name.clone(),
            serde_json::json!({
                "dtype": dtype_name(t.dtype),
                "shape": t.shape,
                "data_offsets": [offset, offset + len],
            }),
        );
        offset += len;
    }
    let mut json = serde_json::to_vec(&header).expect("a JSON map serializes");
    // The data that follows starts 8-byte aligned, as the format recommends.
    json.resize(json.len().next_multiple_of(8), b' ');
    let mut out = Vec::with_capacity(8 + json.len() + data.len());
    out.extend_from_slice(&(json.len() as u64).to_le_bytes());
    out.extend_from_slice(&json);
    out.extend_from_slice(data);
    out
}

/// Reads a safetensors file back as `schema`'s little-endian bytes, in schema order, whatever
/// order the file stores them in; refuses a file that lacks a tensor of the schema, or holds one
/// of another shape or dtype, or non-finite values.
pub fn from_safetensors(schema: &TensorSchema, file: &[u8]) -> Result<Vec<u8>, SafetensorsError> {
    let malformed = |why: &str| SafetensorsError::Malformed(why.to_owned());
    let len_bytes: [u8; 8] = file
        .get(..8)
        .ok_or_else(|| malformed("shorter than 8 bytes"))?
        .try_into()
        .expect("8 bytes");
    let header_len = usize::try_from(u64::from_le_bytes(len_bytes))
        .map_err(|_| malformed("header length overflows"))?;
    let header = file
        .get(8..8usize.saturating_add(header_len))
        .ok_or_else(|| malformed("header longer than the file"))?;
    let data = &file[8 + header_len..];
    let header: BTreeMap<String, serde_json::Value> =
        serde_json::from_slice(header).map_err(|e| malformed(&e.to_string()))?;
    let mut out = Vec::with_capacity(schema.byte_len() as usize);
    for t in &schema.tensors {
        let mismatch = || SafetensorsError::Mismatch(t.name.clone());
        let entry = header.get(&t.name).ok_or_else(mismatch)?;
        let shape: Vec<u64> =
            serde_json::from_value(entry["shape"].clone()).map_err(|_| mismatch())?;
        if entry["dtype"] != dtype_name(t.dtype) || shape != t.shape {
            return Err(mismatch());
        }
        let [start, end]: [u64; 2] =
            serde_json::from_value(entry["data_offsets"].clone()).map_err(|_| mismatch())?;
        let bytes = usize::try_from(start)
            .ok()
            .zip(usize::try_from(end).ok())
            .filter(|(s, e)| s <= e && (*e - *s) as u64 == t.numel() * t.dtype.size() as u64)
            .and_then(|(s, e)| data.get(s..e))
            .ok_or_else(mismatch)?;
        out.extend_from_slice(bytes);
    }
    schema.check_f32_bytes(&out)?;
    Ok(out)
}

/// Reads a safetensors file whose schema is not known yet (an imported model): its tensors in
/// the order of their data, and their values laid out in that order. Only F32 tensors are
/// read; any other dtype is refused by name.
pub fn read_safetensors(file: &[u8]) -> Result<(TensorSchema, Vec<u8>), SafetensorsError> {
    let malformed = |why: String| SafetensorsError::Malformed(why);
    let header_len = file
        .get(..8)
        .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")))
        .ok_or_else(|| malformed("shorter than 8 bytes".into()))?;
    let header = usize::try_from(header_len)
        .ok()
        .and_then(|n| file.get(8..8usize.checked_add(n)?))
        .ok_or_else(|| malformed("header longer than the file".into()))?;
    let header: BTreeMap<String, serde_json::Value> =
        serde_json::from_slice(header).map_err(|e| malformed(e.to_string()))?;
    let mut tensors = vec![];
    for (name, entry) in header.iter().filter(|(name, _)| *name != "__metadata__") {
        let dtype = entry["dtype"].as_str().unwrap_or_default();
        if dtype != dtype_name(DType::F32) {
            return Err(malformed(format!("tensor {name} is {dtype:?}: only F32 is imported")));
        }
        let shape: Vec<u64> = serde_json::from_value(entry["shape"].clone())
            .map_err(|_| malformed(format!("tensor {name} has no valid shape")))?;
        let [start, _]: [u64; 2] = serde_json::from_value(entry["data_offsets"].clone())
            .map_err(|_| malformed(format!("tensor {name} has no valid data_offsets")))?;
        tensors.push((start, super::TensorSpec { name: name.clone(), shape, dtype: DType::F32 }));
    }
    tensors.sort_by_key(|(start, _)| *start);
    let schema = TensorSchema { tensors: tensors.into_iter().map(|(_, t)| t).collect() };
    schema.validate()?;
    let data = from_safetensors(&schema, file)?;
    Ok((schema, data))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::{TensorSpec, f32_to_le_bytes};

    fn schema() -> TensorSchema {
        TensorSchema {
            tensors: vec![
                TensorSpec { name: "w".into(), shape: vec![2, 3], dtype: DType::F32 },
                TensorSpec { name: "b".into(), shape: vec![3], dtype: DType::F32 },
            ],
        }
    }

    #[test]
    fn a_model_round_trips_and_its_header_names_every_tensor() {
        let values: Vec<f32> = (0..9).map(|i| i as f32 / 4.0 - 1.0).collect();
        let data = f32_to_le_bytes(&values);
        let meta = BTreeMap::from([("run".to_owned(), "3".to_owned())]);
        let file = to_safetensors(&schema(), &data, &meta);
        let header_len = u64::from_le_bytes(file[..8].try_into().unwrap()) as usize;
        assert_eq!(header_len % 8, 0, "data starts aligned");
        let header: serde_json::Value = serde_json::from_slice(&file[8..8 + header_len]).unwrap();
        assert_eq!(header["w"]["shape"], serde_json::json!([2, 3]));
        assert_eq!(header["b"]["data_offsets"], serde_json::json!([24, 36]));
        assert_eq!(header["__metadata__"]["run"], "3");
        assert_eq!(from_safetensors(&schema(), &file).unwrap(), data);
    }

    #[test]
    fn a_file_that_does_not_fit_the_schema_is_refused() {
        let data = f32_to_le_bytes(&[0.0; 9]);
        let file = to_safetensors(&schema(), &data, &BTreeMap::new());
        let mut other = schema();
        other.tensors[1].shape = vec![4];
        assert!(
            matches!(from_safetensors(&other, &file), Err(SafetensorsError::Mismatch(n)) if n == "b")
        );
        assert!(matches!(
            from_safetensors(&schema(), &file[..6]),
            Err(SafetensorsError::Malformed(_))
        ));
        assert!(matches!(
            from_safetensors(&schema(), &file[..file.len() - 4]),
            Err(SafetensorsError::Mismatch(_))
        ));
    }
}
