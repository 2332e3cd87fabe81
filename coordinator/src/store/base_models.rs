//! Pretrained models an operator imported, by content hash: what a plan's `init` names to
//! start a run from, and what devices fetch once for the tensors a run never trains.

use sqlx::FromRow;
use starling_core::Millis;
use starling_core::tensor::TensorSchema;

use super::*;

/// An imported model, without its values.
#[derive(Debug, Clone, PartialEq, FromRow)]
pub struct BaseModelInfo {
    /// Content hash: SHA-256 of the schema id and the values, as a run's models are addressed.
    pub content_hash: String,
    /// The name it was imported under.
    pub name: String,
    /// Its tensors (names, shapes, dtypes), JSON.
    pub tensors_json: String,
    /// Bytes of values.
    pub bytes: i64,
    /// Import time.
    pub created_at_ms: i64,
}

impl BaseModelInfo {
    /// Its tensors; a row the store wrote always parses.
    pub fn schema(&self) -> StoreResult<TensorSchema> {
        serde_json::from_str(&self.tensors_json).map_err(|e| StoreError::Corrupt(e.to_string()))
    }
}

impl SqlStore {
    /// Stores an imported model under its content hash and answers with what is stored:
    /// importing the same model again keeps the first import (its name included) and is not an
    /// error.
    pub async fn put_base_model(
        &self,
        content_hash: &str,
        name: &str,
        schema: &TensorSchema,
        data: &[u8],
        now: Millis,
    ) -> StoreResult<BaseModelInfo> {
        let tensors_json = serde_json::to_string(schema).expect("a schema serializes");
        on_pool!(self, |pool| {
            sqlx::query(
                "INSERT INTO base_models (content_hash, name, tensors_json, data, created_at_ms)
                 VALUES ($1, $2, $3, $4, $5) ON CONFLICT (content_hash) DO NOTHING",
            )
            .bind(content_hash)
            .bind(name)
            .bind(&tensors_json)
            .bind(data)
            .bind(now)
            .execute(pool)
            .await
            .map_err(map_err)?;
            // Without the values: the caller has them.
            sqlx::query_as(
                "SELECT content_hash, name, tensors_json, CAST(LENGTH(data) AS BIGINT) AS bytes, created_at_ms
                 FROM base_models WHERE content_hash = $1",
            )
            .bind(content_hash)
            .fetch_one(pool)
            .await
            .map_err(map_err)
        })
    }

    /// Every imported model, oldest first.
    pub async fn base_models(&self) -> StoreResult<Vec<BaseModelInfo>> {
        on_pool!(self, |pool| {
            sqlx::query_as(
                "SELECT content_hash, name, tensors_json, CAST(LENGTH(data) AS BIGINT) AS bytes, created_at_ms
                 FROM base_models ORDER BY created_at_ms, content_hash",
            )
            .fetch_all(pool)
            .await
            .map_err(map_err)
        })
    }

    /// An imported model and its values, by content hash.
    pub async fn base_model(
        &self,
        content_hash: &str,
    ) -> StoreResult<Option<(BaseModelInfo, Vec<u8>)>> {
        on_pool!(self, |pool| {
            let row: Option<(String, String, String, i64, i64, Vec<u8>)> = sqlx::query_as(
                "SELECT content_hash, name, tensors_json, CAST(LENGTH(data) AS BIGINT), created_at_ms, data
                 FROM base_models WHERE content_hash = $1",
            )
            .bind(content_hash)
            .fetch_optional(pool)
            .await
            .map_err(map_err)?;
            Ok(row.map(|(content_hash, name, tensors_json, bytes, created_at_ms, data)| {
                (BaseModelInfo { content_hash, name, tensors_json, bytes, created_at_ms }, data)
            }))
        })
    }
}
