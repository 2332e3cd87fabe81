//! Models as devices download them, kept in memory: a round's whole cohort downloads the same
//! one. The close task puts each model it commits in, with the run's download encoding, before
//! the next round opens, so a cohort never waits for the store to read back what was just
//! written.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use starling_core::RunId;
use starling_core::codec;
use starling_core::compression::Compression;
use starling_core::tensor::{SchemaId, TensorPayload};

/// Encoded models kept (f32 payloads and download encodings).
const ENTRIES: usize = 8;

/// The cache, shared by the driver's close tasks and the download handler.
#[derive(Clone, Default)]
pub struct ModelCache {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for ModelCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let entries = self.inner.entries.lock().expect("model cache poisoned");
        f.debug_list().entries(entries.iter().map(|(key, bytes)| (key, bytes.len()))).finish()
    }
}

#[derive(Default)]
struct Inner {
    entries: Mutex<VecDeque<(String, Bytes)>>,
    /// Each run's newest committed model while its bytes are not in the store (hash, f32
    /// payload), whatever `entries` evicts: the store cannot serve it until its run's next
    /// written version (the plan's `checkpoint_interval`), and the run's devices need it.
    unwritten: Mutex<HashMap<RunId, (String, Bytes)>>,
    /// Held while a model missing from `entries` is read or encoded: a cohort asking at once
    /// waits for one read and one encoding instead of each doing its own.
    loading: Arc<tokio::sync::Mutex<()>>,
}

/// What names a model as served in `compression`: its content hash for f32, else the hash and
/// the encoding (`HASH.int8:256`). The cache's key, and the download's `ETag` quoted.
pub(crate) fn model_download_id(hash: &str, compression: Compression) -> String {
    if compression.is_f32() { hash.to_owned() } else { format!("{hash}.{compression}") }
}

/// The download payload of a model's `values` in `compression` (a model encoding): the same
/// schema, its data [`Compression::encode_model`] of the values.
pub(crate) fn download_payload(
    schema_id: SchemaId,
    values: &[f32],
    compression: Compression,
) -> Result<Vec<u8>, codec::CodecError> {
    codec::to_vec(&TensorPayload { schema_id, data: compression.encode_model(values) })
}

impl ModelCache {
    /// The bytes cached under `key` ([`model_download_id`]).
    pub(crate) fn get(&self, key: &str) -> Option<Bytes> {
        let entries = self.inner.entries.lock().expect("model cache poisoned");
        if let Some((_, bytes)) = entries.iter().find(|(k, _)| k == key) {
            return Some(bytes.clone());
        }
        drop(entries);
        let unwritten = self.inner.unwritten.lock().expect("model cache poisoned");
        unwritten.values().find(|(hash, _)| hash == key).map(|(_, payload)| payload.clone())
    }

    /// Keeps `run_id`'s newest committed model, whose bytes the store does not have yet, until
    /// [`ModelCache::written`] (in place of the run's previous one, which a later version
    /// supersedes).
    pub(crate) fn hold_unwritten(&self, run_id: RunId, hash: &str, payload: Bytes) {
        let mut unwritten = self.inner.unwritten.lock().expect("model cache poisoned");
        unwritten.insert(run_id, (hash.to_owned(), payload));
    }

    /// `run_id`'s model `hash` is in the store now: no longer held outside the eviction order.
    pub(crate) fn written(&self, run_id: RunId, hash: &str) {
        let mut unwritten = self.inner.unwritten.lock().expect("model cache poisoned");
        if unwritten.get(&run_id).is_some_and(|(held, _)| held == hash) {
            unwritten.remove(&run_id);
        }
    }

    /// Caches `bytes` under `key` (the oldest entry goes when full); the bytes cached there.
    pub(crate) fn insert(&self, key: &str, bytes: Bytes) -> Bytes {
        let mut entries = self.inner.entries.lock().expect("model cache poisoned");
        if let Some((_, cached)) = entries.iter().find(|(k, _)| k == key) {
            return cached.clone();
        }
        if entries.len() == ENTRIES {
            entries.pop_front();
        }
        entries.push_back((key.to_owned(), bytes.clone()));
        bytes
    }

    /// The loading lock: whoever reads or encodes a missing model holds it.
    pub(crate) async fn loading(&self) -> tokio::sync::OwnedMutexGuard<()> {
        self.inner.loading.clone().lock_owned().await
    }

    /// A model just committed: caches its stored `payload` at once, and its `values` in the
    /// run's `download` encoding on a blocking thread, holding the loading lock from now until
    /// that is cached, so a device that asks first waits for this encoding instead of making
    /// its own. Called before the driver hears of the commit (and so before the next round
    /// opens and hands out the hash).
    pub(crate) async fn publish(
        &self,
        hash: &str,
        schema_id: SchemaId,
        payload: Bytes,
        values: Arc<Vec<f32>>,
        download: Compression,
    ) {
        self.insert(hash, payload);
        if download.is_f32() {
            return;
        }
        let (cache, key) = (self.clone(), model_download_id(hash, download));
        let loading = self.loading().await;
        tokio::task::spawn_blocking(move || {
            match download_payload(schema_id, &values, download) {
                Ok(bytes) => {
                    cache.insert(&key, Bytes::from(bytes));
                }
                // The download handler encodes it on first request instead.
                Err(e) => {
                    tracing::warn!(%key, error = %e, "encoding a committed model for download failed")
                }
            }
            drop(loading);
        });
    }
}
