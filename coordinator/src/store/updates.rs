//! Updates and aggregators' partials: written one by one before they are acknowledged, read
//! back in slot order when a restarted coordinator replays an open round.

use futures_util::TryStreamExt;
use sqlx::FromRow;
use starling_core::codec;
use starling_core::tier::PartialReport;
use starling_core::{DeviceId, Millis, RoundIdx, RunId};

use super::*;

/// An update read back for replay.
#[derive(Debug, Clone, FromRow)]
pub struct StoredUpdate {
    /// Device that sent it.
    pub device_id: i64,
    /// Arrival slot.
    pub slot: i64,
    /// FedAvg weight.
    pub example_count: i64,
    /// Local metrics, JSON.
    pub metrics_json: String,
    /// The delta, as the device encoded it.
    pub delta: Vec<u8>,
    /// Versions behind its round's model it was trained on (asynchronous runs).
    pub staleness: i64,
}

impl SqlStore {
    /// Writes one update; `Ok` means it is durable and may be acknowledged.
    #[allow(clippy::too_many_arguments)] // One row's columns; a struct would only rename them.
    pub async fn insert_update(
        &self,
        run_id: RunId,
        round_idx: RoundIdx,
        device: DeviceId,
        slot: i64,
        staleness: u32,
        example_count: u64,
        metrics_json: &str,
        delta: &[u8],
        now: Millis,
    ) -> StoreResult<()> {
        on_pool!(self, |pool| {
            let mut tx = pool.begin().await.map_err(map_err)?;
            tx.check_fence(&self.fence).await?;
            sqlx::query(
                "INSERT INTO updates (run_id, round_idx, device_id, slot, staleness, example_count, metrics_json, delta, received_at_ms)
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)",
            )
            .bind(run_id.0)
            .bind(round_idx.0)
            .bind(device.0)
            .bind(slot)
            .bind(i64::from(staleness))
            .bind(example_count as i64)
            .bind(metrics_json)
            .bind(delta)
            .bind(now)
            .execute(&mut *tx)
            .await
            .map_err(map_err)?;
            tx.commit().await.map_err(map_err)
        })
    }

    /// Writes one aggregator's partial; `Ok` means it is durable and may be acknowledged.
    pub async fn insert_partial(
        &self,
        run_id: RunId,
        round_idx: RoundIdx,
        slot: i64,
        report: &PartialReport,
        now: Millis,
    ) -> StoreResult<()> {
        on_pool!(self, |pool| {
            let encoded = codec::to_vec(report).map_err(|e| StoreError::Corrupt(e.to_string()))?;
            let ids = |v: Vec<i64>| serde_json::to_string(&v).expect("ids serialize");
            let mut tx = pool.begin().await.map_err(map_err)?;
            tx.check_fence(&self.fence).await?;
            sqlx::query(
                "INSERT INTO partials (run_id, round_idx, slot, aggregators_json, devices_json, n_devices, total_weight, report, received_at_ms)
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)",
            )
            .bind(run_id.0)
            .bind(round_idx.0)
            .bind(slot)
            .bind(ids(report.aggregators.iter().map(|a| i64::from(a.0)).collect()))
            .bind(ids(report.devices.iter().map(|d| d.0).collect()))
            .bind(report.devices.len() as i64)
            .bind(report.total_weight as i64)
            .bind(encoded)
            .bind(now)
            .execute(&mut *tx)
            .await
            .map_err(map_err)?;
            tx.commit().await.map_err(map_err)
        })
    }

    /// A round's stored partial reports (CBOR), by slot; closed rounds hold none.
    pub async fn partial_reports(
        &self,
        run_id: RunId,
        round_idx: RoundIdx,
    ) -> StoreResult<Vec<(i64, Vec<u8>)>> {
        on_pool!(self, |pool| {
            sqlx::query_as(
                "SELECT slot, report FROM partials WHERE run_id = $1 AND round_idx = $2 AND report IS NOT NULL ORDER BY slot",
            )
            .bind(run_id.0)
            .bind(round_idx.0)
            .fetch_all(pool)
            .await
            .map_err(map_err)
        })
    }

    /// Streams a round's stored updates in slot order to `each`, one at a time, so replay
    /// needs memory for one update, not the cohort.
    pub async fn for_each_update(
        &self,
        run_id: RunId,
        round_idx: RoundIdx,
        mut each: impl FnMut(StoredUpdate) -> StoreResult<()>,
    ) -> StoreResult<u64> {
        on_pool!(self, |pool| {
            let mut rows = sqlx::query_as::<_, StoredUpdate>(
                "SELECT device_id, slot, example_count, metrics_json, delta, staleness FROM updates
                 WHERE run_id = $1 AND round_idx = $2 AND delta IS NOT NULL ORDER BY slot",
            )
            .bind(run_id.0)
            .bind(round_idx.0)
            .fetch(pool);
            let mut n = 0;
            while let Some(row) = rows.try_next().await.map_err(map_err)? {
                each(row)?;
                n += 1;
            }
            Ok(n)
        })
    }

    /// Values `start..start + len` of every stored update of a round, one row per update in slot
    /// order: what robust aggregation reads at close, one tile at a time, so the coordinator
    /// never holds the cohort's full updates.
    pub async fn update_tile(
        &self,
        run_id: RunId,
        round_idx: RoundIdx,
        start: usize,
        len: usize,
    ) -> StoreResult<Vec<Vec<f32>>> {
        on_pool!(self, |pool| {
            let (from, bytes) = (start * 4 + 1, len * 4);
            let (Ok(from), Ok(bytes)) = (i32::try_from(from), i32::try_from(bytes)) else {
                return Err(StoreError::Corrupt(format!("tile {start}+{len} is beyond 2 GiB")));
            };
            let rows: Vec<(Vec<u8>,)> = sqlx::query_as(
                "SELECT substr(delta, CAST($3 AS INTEGER), CAST($4 AS INTEGER)) FROM updates
                 WHERE run_id = $1 AND round_idx = $2 AND delta IS NOT NULL ORDER BY slot",
            )
            .bind(run_id.0)
            .bind(round_idx.0)
            .bind(from)
            .bind(bytes)
            .fetch_all(pool)
            .await
            .map_err(map_err)?;
            rows.into_iter()
                .map(|(tile,)| {
                    if tile.len() != len * 4 {
                        return Err(StoreError::Corrupt(format!(
                            "an update of round {round_idx} holds {} bytes at {start}, expected {}",
                            tile.len(),
                            len * 4
                        )));
                    }
                    Ok(tile
                        .chunks_exact(4)
                        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                        .collect())
                })
                .collect()
        })
    }
}
