//! Enrollment tokens and devices: enrollment, credential lookup, revocation.

use starling_core::{DeviceId, Millis};

use super::*;

impl SqlStore {
    /// Stores a new enrollment token (by hash).
    pub async fn create_enrollment_token(
        &self,
        token_hash: &str,
        now: Millis,
        expires_at: Option<Millis>,
        uses: Option<i64>,
    ) -> StoreResult<()> {
        on_pool!(self, |pool| {
            sqlx::query(
                "INSERT INTO enrollment_tokens (token_hash, created_at_ms, expires_at_ms, uses_left) VALUES ($1, $2, $3, $4)",
            )
            .bind(token_hash)
            .bind(now)
            .bind(expires_at)
            .bind(uses)
            .execute(pool)
            .await
            .map_err(map_err)?;
            Ok(())
        })
    }

    /// Spends one use of an enrollment token and registers a device with `credential_hash`.
    pub async fn enroll_device(
        &self,
        token_hash: &str,
        credential_hash: &str,
        now: Millis,
    ) -> StoreResult<DeviceId> {
        on_pool!(self, |pool| {
            let mut tx = pool.begin().await.map_err(map_err)?;
            let spent = sqlx::query(
                "UPDATE enrollment_tokens SET uses_left = uses_left - 1
                 WHERE token_hash = $1 AND (expires_at_ms IS NULL OR expires_at_ms > $2)
                   AND (uses_left IS NULL OR uses_left > 0)",
            )
            .bind(token_hash)
            .bind(now)
            .execute(&mut *tx)
            .await
            .map_err(map_err)?;
            if spent.rows_affected() != 1 {
                return Err(StoreError::InvalidToken);
            }
            let (id,): (i64,) = sqlx::query_as(
                "INSERT INTO devices (credential_hash, enrolled_at_ms, revoked) VALUES ($1, $2, FALSE) RETURNING id",
            )
            .bind(credential_hash)
            .bind(now)
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
        on_pool!(self, |pool| {
            let row: Option<(i64,)> = sqlx::query_as(
                "SELECT id FROM devices WHERE credential_hash = $1 AND revoked = FALSE",
            )
            .bind(credential_hash)
            .fetch_optional(pool)
            .await
            .map_err(map_err)?;
            Ok(row.map(|(id,)| DeviceId(id)))
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
