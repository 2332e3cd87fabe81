//! Hugging Face tokenizers an operator imported, by content hash: what a plan's
//! `model.tokenizer` names, and what devices fetch once to tokenize their text.

use sqlx::FromRow;
use starling_core::Millis;

use super::*;

/// An imported tokenizer, without its file.
#[derive(Debug, Clone, PartialEq, FromRow)]
pub struct TokenizerInfo {
    /// Content hash: SHA-256 of the file.
    pub content_hash: String,
    /// The name it was imported under.
    pub name: String,
    /// One more than its largest token id.
    pub vocab_size: i64,
    /// The file's bytes.
    pub bytes: i64,
    /// Import time.
    pub created_at_ms: i64,
}

impl SqlStore {
    /// Stores an imported tokenizer file under its content hash and answers with what is
    /// stored: importing the same file again keeps the first import (its name included) and is
    /// not an error.
    pub async fn put_tokenizer(
        &self,
        content_hash: &str,
        name: &str,
        vocab_size: u64,
        data: &[u8],
        now: Millis,
    ) -> StoreResult<TokenizerInfo> {
        let vocab_size =
            i64::try_from(vocab_size).map_err(|e| StoreError::Corrupt(e.to_string()))?;
        on_pool!(self, |pool| {
            sqlx::query(
                "INSERT INTO tokenizers (content_hash, name, vocab_size, data, created_at_ms)
                 VALUES ($1, $2, $3, $4, $5) ON CONFLICT (content_hash) DO NOTHING",
            )
            .bind(content_hash)
            .bind(name)
            .bind(vocab_size)
            .bind(data)
            .bind(now)
            .execute(pool)
            .await
            .map(drop)
            .map_err(map_err)
        })?;
        self.tokenizer_info(content_hash).await?.ok_or_else(|| {
            StoreError::Corrupt("an imported tokenizer is not there after its import".into())
        })
    }

    /// Every imported tokenizer, oldest first.
    pub async fn tokenizers(&self) -> StoreResult<Vec<TokenizerInfo>> {
        on_pool!(self, |pool| {
            sqlx::query_as(
                "SELECT content_hash, name, vocab_size, CAST(LENGTH(data) AS BIGINT) AS bytes, created_at_ms
                 FROM tokenizers ORDER BY created_at_ms, content_hash",
            )
            .fetch_all(pool)
            .await
            .map_err(map_err)
        })
    }

    /// An imported tokenizer, without its file (what a plan naming it is checked against).
    pub async fn tokenizer_info(&self, content_hash: &str) -> StoreResult<Option<TokenizerInfo>> {
        on_pool!(self, |pool| {
            sqlx::query_as(
                "SELECT content_hash, name, vocab_size, CAST(LENGTH(data) AS BIGINT) AS bytes, created_at_ms
                 FROM tokenizers WHERE content_hash = $1",
            )
            .bind(content_hash)
            .fetch_optional(pool)
            .await
            .map_err(map_err)
        })
    }

    /// An imported tokenizer's file, by content hash.
    pub async fn tokenizer_file(&self, content_hash: &str) -> StoreResult<Option<Vec<u8>>> {
        on_pool!(self, |pool| {
            let row: Option<(Vec<u8>,)> =
                sqlx::query_as("SELECT data FROM tokenizers WHERE content_hash = $1")
                    .bind(content_hash)
                    .fetch_optional(pool)
                    .await
                    .map_err(map_err)?;
            Ok(row.map(|(data,)| data))
        })
    }
}
