//! Enrollment tokens and devices: enrollment, credential lookup, revocation.

use starling_core::{DeviceId, Millis};

use super::*;

/// An authenticated device and where it may check in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceAccess {
    /// The device.
    pub device: DeviceId,
    /// The populations its enrollment token named; `None` for a device enrolled before tokens
    /// named populations (it may join any).
    pub populations: Option<Vec<String>>,
    /// The Ed25519 public key it enrolled with, which signs its secure-aggregation keys; `None`
    /// for a device enrolled without one (it may not join secure runs).
    pub identity_key: Option<[u8; 32]>,
}

/// An enrollment token as the store keeps it, for the admin list (never the token).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EnrollmentTokenRow {
    /// The first 12 hex digits of its hash.
    pub id: String,
    /// When it was issued.
    pub created_at_ms: Millis,
    /// Expiry, if any.
    pub expires_at_ms: Option<Millis>,
    /// Devices it may still enroll; `None`: unlimited (tokens from before limits were required).
    pub uses_left: Option<i64>,
    /// The populations it admits; `None`: any (tokens from before tokens named populations).
    pub populations: Option<Vec<String>>,
}

/// An `enrollment_tokens` row as read for the list.
#[derive(sqlx::FromRow)]
struct TokenColumns {
    id: String,
    created_at_ms: i64,
    expires_at_ms: Option<i64>,
    uses_left: Option<i64>,
    populations_json: Option<String>,
}

/// A `populations_json` column (of a token or a device) as names; `owner` names the row in the
/// error.
fn populations(
    json: Option<String>,
    owner: impl FnOnce() -> String,
) -> StoreResult<Option<Vec<String>>> {
    json.map(|json| serde_json::from_str(&json))
        .transpose()
        .map_err(|e| StoreError::Corrupt(format!("{}'s populations: {e}", owner())))
}

impl DeviceAccess {
    /// Whether the device may check in to `population`.
    pub fn may_join(&self, population: &str) -> bool {
        self.populations.as_ref().is_none_or(|allowed| allowed.iter().any(|p| p == population))
    }
}

impl SqlStore {
    /// Stores a new enrollment token (by hash) that enrolls at most `uses` devices (unlimited
    /// if `None`), each allowed to check in to `populations` only (any if `None`).
    pub async fn create_enrollment_token(
        &self,
        token_hash: &str,
        now: Millis,
        expires_at: Option<Millis>,
        uses: Option<i64>,
        populations: Option<&[String]>,
    ) -> StoreResult<()> {
        let populations = populations.map(|p| serde_json::to_string(p).expect("names serialize"));
        on_pool!(self, |pool| {
            sqlx::query(
                "INSERT INTO enrollment_tokens (token_hash, created_at_ms, expires_at_ms, uses_left, populations_json)
                 VALUES ($1, $2, $3, $4, $5)",
            )
            .bind(token_hash)
            .bind(now)
            .bind(expires_at)
            .bind(uses)
            .bind(populations.as_deref())
            .execute(pool)
            .await
            .map_err(map_err)?;
            Ok(())
        })
    }

    /// Every enrollment token, newest first.
    pub async fn enrollment_tokens(&self) -> StoreResult<Vec<EnrollmentTokenRow>> {
        let rows: Vec<TokenColumns> = on_pool!(self, |pool| {
            sqlx::query_as(
                "SELECT substr(token_hash, 1, 12) AS id, created_at_ms, expires_at_ms, uses_left, populations_json
                 FROM enrollment_tokens ORDER BY created_at_ms DESC, token_hash",
            )
            .fetch_all(pool)
            .await
            .map_err(map_err)
        })?;
        rows.into_iter()
            .map(|t| {
                let populations = populations(t.populations_json, || format!("token {}", t.id))?;
                Ok(EnrollmentTokenRow {
                    id: t.id,
                    created_at_ms: t.created_at_ms,
                    expires_at_ms: t.expires_at_ms,
                    uses_left: t.uses_left,
                    populations,
                })
            })
            .collect()
    }

    /// Spends one use of an enrollment token and registers a device with `credential_hash` and
    /// the identity key it signs with, if it sent one.
    pub async fn enroll_device(
        &self,
        token_hash: &str,
        credential_hash: &str,
        identity_key: Option<[u8; 32]>,
        now: Millis,
    ) -> StoreResult<DeviceId> {
        on_pool!(self, |pool| {
            let mut tx = pool.begin().await.map_err(map_err)?;
            let spent: Option<(Option<String>,)> = sqlx::query_as(
                "UPDATE enrollment_tokens SET uses_left = uses_left - 1
                 WHERE token_hash = $1 AND (expires_at_ms IS NULL OR expires_at_ms > $2)
                   AND (uses_left IS NULL OR uses_left > 0)
                 RETURNING populations_json",
            )
            .bind(token_hash)
            .bind(now)
            .fetch_optional(&mut *tx)
            .await
            .map_err(map_err)?;
            let Some((populations,)) = spent else { return Err(StoreError::InvalidToken) };
            let (id,): (i64,) = sqlx::query_as(
                "INSERT INTO devices (credential_hash, enrolled_at_ms, revoked, populations_json, identity_key)
                 VALUES ($1, $2, FALSE, $3, $4) RETURNING id",
            )
            .bind(credential_hash)
            .bind(now)
            .bind(populations)
            .bind(identity_key.map(hex::encode))
            .fetch_one(&mut *tx)
            .await
            .map_err(map_err)?;
            tx.commit().await.map_err(map_err)?;
            Ok(DeviceId(id))
        })
    }

    /// The device holding this credential, unless unknown or revoked.
    pub async fn device_by_credential(
        &self,
        credential_hash: &str,
    ) -> StoreResult<Option<DeviceId>> {
        Ok(self.device_access(credential_hash).await?.map(|access| access.device))
    }

    /// The device holding this credential and the populations it may join, unless unknown or
    /// revoked: one read per authenticated request.
    pub async fn device_access(&self, credential_hash: &str) -> StoreResult<Option<DeviceAccess>> {
        on_pool!(self, |pool| {
            let row: Option<(i64, Option<String>, Option<String>)> = sqlx::query_as(
                "SELECT id, populations_json, identity_key FROM devices
                 WHERE credential_hash = $1 AND revoked = FALSE",
            )
            .bind(credential_hash)
            .fetch_optional(pool)
            .await
            .map_err(map_err)?;
            row.map(|(id, json, identity)| {
                let populations = populations(json, || format!("device {id}"))?;
                let identity_key = identity
                    .map(|hex| {
                        let mut key = [0u8; 32];
                        hex::decode_to_slice(&hex, &mut key).map(|()| key).map_err(|e| {
                            StoreError::Corrupt(format!("device {id}'s identity key: {e}"))
                        })
                    })
                    .transpose()?;
                Ok(DeviceAccess { device: DeviceId(id), populations, identity_key })
            })
            .transpose()
        })
    }

    /// Revokes a device's credential for good; when it enrolled, or `None` when no such
    /// device exists. Revoking twice is not an error.
    pub async fn revoke_device(&self, device: DeviceId) -> StoreResult<Option<Millis>> {
        on_pool!(self, |pool| {
            let row: Option<(i64,)> = sqlx::query_as(
                "UPDATE devices SET revoked = TRUE WHERE id = $1 RETURNING enrolled_at_ms",
            )
            .bind(device.0)
            .fetch_optional(pool)
            .await
            .map_err(map_err)?;
            Ok(row.map(|(enrolled_at,)| enrolled_at))
        })
    }

    /// Every enrolled device, by id: (id, enrolled at, revoked).
    pub async fn devices(&self) -> StoreResult<Vec<(DeviceId, Millis, bool)>> {
        on_pool!(self, |pool| {
            let rows: Vec<(i64, i64, bool)> =
                sqlx::query_as("SELECT id, enrolled_at_ms, revoked FROM devices ORDER BY id")
                    .fetch_all(pool)
                    .await
                    .map_err(map_err)?;
            Ok(rows.into_iter().map(|(id, at, revoked)| (DeviceId(id), at, revoked)).collect())
        })
    }
}
