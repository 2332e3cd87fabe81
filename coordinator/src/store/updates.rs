//! Updates and aggregators' partials: written before they are acknowledged (updates one by
//! one, or a group of them as its sums beside a row per update), read back in slot order when a
//! restarted coordinator replays an open round.

use futures_util::TryStreamExt;
use sqlx::FromRow;
use starling_core::codec;
use starling_core::fedavg::{FoldedGroup, PartialSums, f64s_from_le, f64s_to_le};
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

/// One update of a group, as its row keeps it (no delta: the group's sums hold it).
#[derive(Debug, Clone)]
pub struct GroupMember {
    /// The device.
    pub device: DeviceId,
    /// Its arrival slot.
    pub slot: i64,
    /// Versions behind the round's model it was trained on.
    pub staleness: u32,
    /// Its FedAvg weight.
    pub example_count: u64,
    /// Its local metrics, JSON.
    pub metrics_json: String,
    /// Its delta's L2 norm.
    pub norm: f64,
}

/// A stored group of updates read back for replay.
#[derive(Debug, Clone)]
pub struct StoredGroup {
    /// The slot of its last update.
    pub slot: i64,
    /// Its sums (not yet validated against the run's schema), and how many were in the bound.
    pub group: FoldedGroup,
}

/// What a round's replay reads, in slot order.
#[derive(Debug, Clone)]
pub enum StoredContribution {
    /// An update stored one by one.
    Update(StoredUpdate),
    /// A group of updates stored as its sums.
    Group(StoredGroup),
}

/// A row of either kind, as [`SqlStore::for_each_update`]'s one query reads them.
#[derive(FromRow)]
struct StoredRow {
    slot: i64,
    device_id: Option<i64>,
    example_count: i64,
    metrics_json: String,
    delta: Vec<u8>,
    staleness: i64,
    sum_lo: Option<Vec<u8>>,
    n_updates: Option<i64>,
    n_within_bound: Option<i64>,
}

impl StoredRow {
    fn into_contribution(self) -> StoreResult<StoredContribution> {
        let StoredRow { slot, device_id, example_count, metrics_json, delta, staleness, .. } = self;
        let (Some(lo), Some(n_updates), Some(n_within_bound)) =
            (self.sum_lo, self.n_updates, self.n_within_bound)
        else {
            let device_id = device_id
                .ok_or_else(|| StoreError::Corrupt("an update without a device".into()))?;
            let update =
                StoredUpdate { device_id, slot, example_count, metrics_json, delta, staleness };
            return Ok(StoredContribution::Update(update));
        };
        let corrupt =
            |what: String| StoreError::Corrupt(format!("the group at slot {slot}: {what}"));
        let f64s = |bytes: &[u8]| {
            f64s_from_le(bytes).ok_or_else(|| corrupt(format!("{} bytes of sums", bytes.len())))
        };
        let metrics = serde_json::from_str(&metrics_json).map_err(|e| corrupt(e.to_string()))?;
        let hi = f64s(&delta)?;
        // No bytes: every low part is zero.
        let lo = if lo.is_empty() { vec![0.0; hi.len()] } else { f64s(&lo)? };
        let sums = PartialSums {
            hi,
            lo,
            total_weight: u64::try_from(example_count).map_err(|e| corrupt(e.to_string()))?,
            n_updates: u64::try_from(n_updates).map_err(|e| corrupt(e.to_string()))?,
            metrics,
        };
        let n_within_bound = u64::try_from(n_within_bound).map_err(|e| corrupt(e.to_string()))?;
        Ok(StoredContribution::Group(StoredGroup {
            slot,
            group: FoldedGroup { sums, n_within_bound },
        }))
    }
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

    /// Writes a group of updates as its sums and a row per update without its delta, in one
    /// transaction; `Ok` means every one of them is durable and may be acknowledged. The
    /// group takes the slot of its last update.
    pub async fn insert_update_group(
        &self,
        run_id: RunId,
        round_idx: RoundIdx,
        members: &[GroupMember],
        group: &FoldedGroup,
        now: Millis,
    ) -> StoreResult<()> {
        let Some(last) = members.last() else {
            return Err(StoreError::Corrupt("a group of no updates".into()));
        };
        if members.len() as u64 != group.sums.n_updates {
            return Err(StoreError::Corrupt(format!(
                "a group of {} updates holds the sums of {}",
                members.len(),
                group.sums.n_updates
            )));
        }
        // Low parts that are all zero (sums exact in f64: f32 values times modest weights) are
        // stored as no bytes, halving what the store writes for most groups.
        let lo = match group.sums.lo.iter().all(|&v| v.to_bits() == 0) {
            true => vec![],
            false => f64s_to_le(&group.sums.lo),
        };
        let hi = f64s_to_le(&group.sums.hi);
        let metrics = serde_json::to_string(&group.sums.metrics).expect("metrics serialize");
        on_pool!(self, |pool| {
            let mut tx = pool.begin().await.map_err(map_err)?;
            tx.check_fence(&self.fence).await?;
            // Chunked under every backend's limit on bound values (SQLite's 32 766).
            for chunk in members.chunks(1_000) {
                let mut insert = sqlx::QueryBuilder::new(
                    "INSERT INTO updates (run_id, round_idx, device_id, slot, staleness, example_count, metrics_json, norm, received_at_ms) ",
                );
                insert.push_values(chunk, |mut row, m| {
                    row.push_bind(run_id.0)
                        .push_bind(round_idx.0)
                        .push_bind(m.device.0)
                        .push_bind(m.slot)
                        .push_bind(i64::from(m.staleness))
                        .push_bind(m.example_count as i64)
                        .push_bind(&m.metrics_json)
                        .push_bind(m.norm)
                        .push_bind(now);
                });
                insert.build().execute(&mut *tx).await.map_err(map_err)?;
            }
            sqlx::query(
                "INSERT INTO update_groups (run_id, round_idx, slot, n_updates, n_within_bound, total_weight, metrics_json, sum_hi, sum_lo, received_at_ms)
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)",
            )
            .bind(run_id.0)
            .bind(round_idx.0)
            .bind(last.slot)
            .bind(group.sums.n_updates as i64)
            .bind(group.n_within_bound as i64)
            .bind(group.sums.total_weight as i64)
            .bind(metrics)
            .bind(hi)
            .bind(lo)
            .bind(now)
            .execute(&mut *tx)
            .await
            .map_err(map_err)?;
            tx.commit().await.map_err(map_err)
        })
    }

    /// Streams a round's stored updates and groups of updates in slot order to `each`, one at
    /// a time, so replay needs memory for one update (or group), not the cohort.
    pub async fn for_each_update(
        &self,
        run_id: RunId,
        round_idx: RoundIdx,
        mut each: impl FnMut(StoredContribution) -> StoreResult<()>,
    ) -> StoreResult<u64> {
        on_pool!(self, |pool| {
            let mut rows = sqlx::query_as::<_, StoredRow>(
                "SELECT slot, device_id, example_count, metrics_json, delta, staleness,
                        NULL AS sum_lo, NULL AS n_updates, NULL AS n_within_bound
                 FROM updates WHERE run_id = $1 AND round_idx = $2 AND delta IS NOT NULL
                 UNION ALL
                 SELECT slot, NULL, total_weight, metrics_json, sum_hi, 0, sum_lo, n_updates, n_within_bound
                 FROM update_groups WHERE run_id = $1 AND round_idx = $2 AND sum_hi IS NOT NULL
                 ORDER BY slot",
            )
            .bind(run_id.0)
            .bind(round_idx.0)
            .fetch(pool);
            let mut n = 0;
            while let Some(row) = rows.try_next().await.map_err(map_err)? {
                let stored = row.into_contribution()?;
                n += match &stored {
                    StoredContribution::Update(_) => 1,
                    StoredContribution::Group(g) => g.group.sums.n_updates,
                };
                each(stored)?;
            }
            Ok(n)
        })
    }

    /// The L2 norms a round's updates stored in groups were recorded with, by device.
    pub async fn grouped_update_norms(
        &self,
        run_id: RunId,
        round_idx: RoundIdx,
    ) -> StoreResult<Vec<(DeviceId, f64)>> {
        let rows: Vec<(i64, f64)> = on_pool!(self, |pool| {
            sqlx::query_as(
                "SELECT device_id, norm FROM updates
                 WHERE run_id = $1 AND round_idx = $2 AND norm IS NOT NULL ORDER BY slot",
            )
            .bind(run_id.0)
            .bind(round_idx.0)
            .fetch_all(pool)
            .await
            .map_err(map_err)
        })?;
        Ok(rows.into_iter().map(|(d, n)| (DeviceId(d), n)).collect())
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
