//! Rounds: the small transitions a batch writes together, the open round a restart resumes,
//! and the commit or failure that closes a round.

use std::collections::BTreeMap;

use serde::Serialize;
use sqlx::FromRow;
use starling_core::round::participation_rule::{History, Participations};
use starling_core::round::quarantine::Strikes;
use starling_core::round::{CarriedTask, RoundClosing, RoundOpened, RoundOutcome, StoredPartial};
use starling_core::{AggregatorId, DeviceId, Millis, ModelVersion, RoundIdx, RunId};

use super::*;

/// A round as stored.
#[derive(Debug, Clone, FromRow, Serialize)]
pub struct RoundRow {
    /// Run id.
    pub run_id: i64,
    /// Round index.
    pub round_idx: i64,
    /// Model version trained on.
    pub model_version: i64,
    /// `open`, `committed` or `failed`.
    pub state: String,
    /// Opening time.
    pub opened_at_ms: i64,
    /// End of selection.
    pub selection_deadline_ms: i64,
    /// Reporting deadline.
    pub reporting_deadline_ms: i64,
    /// Closing time, once closed.
    pub closed_at_ms: Option<i64>,
    /// Devices selected (live count while open).
    pub n_selected: Option<i64>,
    /// Durable updates (live count while open).
    pub n_reported: Option<i64>,
    /// Selected devices that did not report.
    pub n_dropped: Option<i64>,
    /// Updates trained on an earlier model (asynchronous runs).
    pub n_stale: i64,
    /// The closing outcome, JSON.
    pub outcome_json: Option<String>,
    /// Weighted mean of the clients' training metrics, JSON.
    pub metrics_json: Option<String>,
}

/// A device selected for a round, as [`SqlStore::round_devices`] reads it back.
#[derive(Debug, Clone, PartialEq, Eq, FromRow)]
pub struct RoundDeviceRow {
    /// Device id.
    pub device_id: i64,
    /// When it was selected.
    pub selected_at_ms: i64,
    /// Its aggregator, in a tiered round.
    pub aggregator_id: Option<i64>,
    /// `update` or `partial` once its contribution is durable; `None` otherwise.
    pub reported: Option<String>,
    /// Its upload's example count, for `update`.
    pub example_count: Option<i64>,
}

/// A committed round's new model and aggregated metrics.
#[derive(Debug, Clone)]
pub struct RoundCommit<'a> {
    /// The close record.
    pub closing: RoundClosing,
    /// The new model's content hash.
    pub model_hash: &'a str,
    /// The new model's bytes, now or after the commit.
    pub bytes: ModelBytes<'a>,
    /// Aggregated training metrics.
    pub metrics: &'a BTreeMap<String, f64>,
    /// A secure round's pooled evaluation of the model it trained on, if any.
    pub evaluation: Option<&'a starling_core::fedavg::PooledEvaluation>,
}

/// What a commit writes of its new model besides the content hash.
#[derive(Debug, Clone, Copy)]
pub enum ModelBytes<'a> {
    /// The model, encoded, and a stateful server optimizer's state after producing it.
    Written {
        /// The new model, encoded.
        model: &'a [u8],
        /// The server optimizer's state, if it keeps one.
        optimizer_state: Option<&'a [u8]>,
    },
    /// Nothing yet: the model is determined by what is durable already (the previous model and
    /// server state, the round's stored updates), so the commit records its hash and
    /// [`SqlStore::write_model`] writes both after it, off the round's path. Until then the
    /// model reads as [`StoreError::ModelPending`] and the round's payloads are kept, so a
    /// restart can rebuild it.
    Later,
}

/// A committed model whose bytes are still to be written (see [`ModelBytes::Later`]).
#[derive(Debug, Clone, PartialEq, Eq, FromRow)]
pub struct PendingModel {
    /// Its run.
    pub run_id: i64,
    /// Its version.
    pub version: i64,
    /// The content hash its commit recorded.
    pub content_hash: String,
    /// The round that committed it.
    pub round_idx: i64,
}

/// Selections one insert writes at most (five parameters each: well under either backend's
/// limit on a statement's parameters).
const SELECTIONS_PER_INSERT: usize = 1_000;

/// A batch's transitions as written: consecutive selections together, the rest one by one.
enum Step<'a> {
    One(&'a Transition, Millis),
    Selections(Vec<(RoundIdx, DeviceId, Option<AggregatorId>, Millis)>),
}

fn steps<'a>(stamped: &[(&'a Transition, Millis)]) -> Vec<Step<'a>> {
    let mut steps: Vec<Step<'a>> = vec![];
    for &(t, now) in stamped {
        match (t, steps.last_mut()) {
            (&Transition::Select { round_idx, device, aggregator }, Some(Step::Selections(s))) => {
                s.push((round_idx, device, aggregator, now));
            }
            (&Transition::Select { round_idx, device, aggregator }, _) => {
                steps.push(Step::Selections(vec![(round_idx, device, aggregator, now)]));
            }
            _ => steps.push(Step::One(t, now)),
        }
    }
    steps
}

/// The columns of a [`RoundRow`], with live selected/reported counts for an open round
/// (a macro so that queries built on it stay `&'static str`).
macro_rules! round_select {
    () => {
        "SELECT r.run_id, r.round_idx, r.model_version, r.state, r.opened_at_ms, r.selection_deadline_ms,
                    r.reporting_deadline_ms, r.closed_at_ms,
                    COALESCE(r.n_selected, (SELECT COUNT(*) FROM selections s WHERE s.run_id = r.run_id AND s.round_idx = r.round_idx)) AS n_selected,
                    COALESCE(r.n_reported, (SELECT COUNT(*) FROM updates u WHERE u.run_id = r.run_id AND u.round_idx = r.round_idx)
                             + (SELECT CAST(COALESCE(SUM(p.n_devices), 0) AS BIGINT) FROM partials p WHERE p.run_id = r.run_id AND p.round_idx = r.round_idx)) AS n_reported,
                    r.n_dropped,
                    (SELECT COUNT(*) FROM updates u WHERE u.run_id = r.run_id AND u.round_idx = r.round_idx AND u.staleness > 0) AS n_stale,
                    r.outcome_json, r.metrics_json
         FROM rounds r"
    };
}

/// The state of an open round as stored.
#[derive(Debug, Clone, PartialEq)]
pub struct OpenRoundState {
    /// The round row.
    pub round: RoundOpened,
    /// Selected devices.
    pub selected: Vec<DeviceId>,
    /// Devices with a stored update, and their slots, in slot order.
    pub reported: Vec<(DeviceId, i64)>,
    /// A secure round's records (CBOR), in seq order.
    pub secure_records: Vec<Vec<u8>>,
    /// Devices that upload through an aggregator.
    pub assignments: Vec<(DeviceId, AggregatorId)>,
    /// Durable partials (without their sums), in slot order.
    pub partials: Vec<StoredPartial>,
}

/// A small durable transition, batched by [`SqlStore::apply_transitions`].
#[derive(Debug, Clone, PartialEq)]
pub enum Transition {
    /// A round opened.
    OpenRound(RoundOpened),
    /// A device was selected.
    Select {
        /// Round.
        round_idx: RoundIdx,
        /// Device.
        device: DeviceId,
        /// The aggregator it uploads to, if the round goes through the tier.
        aggregator: Option<AggregatorId>,
    },
    /// A secure round's protocol record (CBOR), at position `seq` of the round's log.
    SecAggRecord {
        /// Round.
        round_idx: RoundIdx,
        /// Position.
        seq: i64,
        /// The encoded record.
        record: Vec<u8>,
    },
    /// The run committed all its rounds.
    FinishRun,
    /// The run stopped: the operator stopped it, or the coordinator, which says why.
    StopRun {
        /// Round that was open, recorded as failed.
        open_round: Option<RoundIdx>,
        /// Why the coordinator stopped it; `None` when the operator did.
        reason: Option<String>,
    },
}

impl SqlStore {
    /// Executes a batch of small transitions (round openings, selections, run status) in one
    /// transaction, in order.
    pub async fn apply_transitions(
        &self,
        run_id: RunId,
        batch: &[Transition],
        now: Millis,
    ) -> StoreResult<()> {
        self.apply_transition_batches(run_id, &[(batch, now)]).await
    }

    /// Executes several batches of transitions, each stamped with its own `now`, in one
    /// transaction, in order: a run's writer makes the batches that queued while it was
    /// writing durable with one commit (one flush) instead of one each.
    pub async fn apply_transition_batches(
        &self,
        run_id: RunId,
        batches: &[(&[Transition], Millis)],
    ) -> StoreResult<()> {
        // Collected first: an iterator adapter held across the awaits below is not `Send`.
        let stamped: Vec<(&Transition, Millis)> =
            batches.iter().flat_map(|&(batch, now)| batch.iter().map(move |t| (t, now))).collect();
        on_pool!(self, |pool| {
            if stamped.is_empty() {
                return Ok(());
            }
            let mut tx = pool.begin().await.map_err(map_err)?;
            tx.check_fence(&self.fence).await?;
            for step in steps(&stamped) {
                let (t, now) = match step {
                    Step::One(t, now) => (t, now),
                    Step::Selections(selections) => {
                        // One statement for a cohort checking in at once, not one a device.
                        for chunk in selections.chunks(SELECTIONS_PER_INSERT) {
                            let mut insert = sqlx::QueryBuilder::new(
                                "INSERT INTO selections (run_id, round_idx, device_id, selected_at_ms, aggregator_id) ",
                            );
                            insert.push_values(
                                chunk,
                                |mut row, &(round_idx, device, aggregator, now)| {
                                    row.push_bind(run_id.0)
                                        .push_bind(round_idx.0)
                                        .push_bind(device.0)
                                        .push_bind(now)
                                        .push_bind(aggregator.map(|a| i64::from(a.0)));
                                },
                            );
                            // Idempotent, like the round insert: a retry after a commit whose
                            // answer was lost must not fail on its own earlier write.
                            insert.push(" ON CONFLICT DO NOTHING");
                            insert.build().execute(&mut *tx).await.map_err(map_err)?;
                        }
                        continue;
                    }
                };
                match t {
                    Transition::OpenRound(r) => {
                        sqlx::query(
                            "INSERT INTO rounds (run_id, round_idx, model_version, state, opened_at_ms, selection_deadline_ms, reporting_deadline_ms)
                             VALUES ($1, $2, $3, 'open', $4, $5, $6) ON CONFLICT DO NOTHING",
                        )
                        .bind(run_id.0)
                        .bind(r.round_idx.0)
                        .bind(r.model_version.0)
                        .bind(r.opened_at)
                        .bind(r.selection_deadline)
                        .bind(r.reporting_deadline)
                        .execute(&mut *tx)
                        .await
                        .map_err(map_err)?;
                    }
                    Transition::Select { .. } => unreachable!("selections are written in steps"),
                    Transition::SecAggRecord { round_idx, seq, record } => {
                        sqlx::query(
                            "INSERT INTO secagg_records (run_id, round_idx, seq, record, created_at_ms) VALUES ($1, $2, $3, $4, $5)
                             ON CONFLICT DO NOTHING",
                        )
                        .bind(run_id.0)
                        .bind(round_idx.0)
                        .bind(*seq)
                        .bind(record.as_slice())
                        .bind(now)
                        .execute(&mut *tx)
                        .await
                        .map_err(map_err)?;
                    }
                    Transition::FinishRun => {
                        tx.set_run_status(run_id, "finished", now).await?;
                    }
                    Transition::StopRun { open_round, reason } => {
                        if let Some(round_idx) = open_round {
                            sqlx::query(
                                "UPDATE rounds SET state = 'failed', closed_at_ms = $3, outcome_json = $4
                                 WHERE run_id = $1 AND round_idx = $2 AND state = 'open'",
                            )
                            .bind(run_id.0)
                            .bind(round_idx.0)
                            .bind(now)
                            .bind(r#"{"outcome":"stopped"}"#)
                            .execute(&mut *tx)
                            .await
                            .map_err(map_err)?;
                            tx.delete_secagg_records(run_id, *round_idx).await?;
                            tx.release_payloads(run_id, *round_idx).await?;
                        }
                        tx.set_run_status(run_id, "stopped", now).await?;
                        if let Some(reason) = reason {
                            sqlx::query("UPDATE runs SET stop_reason = $2 WHERE id = $1")
                                .bind(run_id.0)
                                .bind(reason.as_str())
                                .execute(&mut *tx)
                                .await
                                .map_err(map_err)?;
                        }
                    }
                }
            }
            tx.commit().await.map_err(map_err)
        })
    }

    /// The open round of a run, its selections and its durable updates' (device, slot).
    pub async fn open_round(&self, run_id: RunId) -> StoreResult<Option<OpenRoundState>> {
        on_pool!(self, |pool| {
            let round: Option<RoundRow> = sqlx::query_as(concat!(
                round_select!(),
                " WHERE r.run_id = $1 AND r.state = 'open' ORDER BY r.round_idx DESC LIMIT 1"
            ))
            .bind(run_id.0)
            .fetch_optional(pool)
            .await
            .map_err(map_err)?;
            let Some(round) = round else { return Ok(None) };
            let selected: Vec<(i64,)> =
                sqlx::query_as("SELECT device_id FROM selections WHERE run_id = $1 AND round_idx = $2 ORDER BY device_id")
                    .bind(run_id.0)
                    .bind(round.round_idx)
                    .fetch_all(pool)
                    .await
                    .map_err(map_err)?;
            let reported: Vec<(i64, i64)> = sqlx::query_as(
                "SELECT device_id, slot FROM updates WHERE run_id = $1 AND round_idx = $2 ORDER BY slot",
            )
            .bind(run_id.0)
            .bind(round.round_idx)
            .fetch_all(pool)
            .await
            .map_err(map_err)?;
            let assignments: Vec<(i64, i64)> = sqlx::query_as(
                "SELECT device_id, aggregator_id FROM selections
                 WHERE run_id = $1 AND round_idx = $2 AND aggregator_id IS NOT NULL ORDER BY device_id",
            )
            .bind(run_id.0)
            .bind(round.round_idx)
            .fetch_all(pool)
            .await
            .map_err(map_err)?;
            let partials: Vec<(i64, String, String)> = sqlx::query_as(
                "SELECT slot, aggregators_json, devices_json FROM partials WHERE run_id = $1 AND round_idx = $2 ORDER BY slot",
            )
            .bind(run_id.0)
            .bind(round.round_idx)
            .fetch_all(pool)
            .await
            .map_err(map_err)?;
            let ids = |json: &str| partial_ids(run_id, json);
            let partials = partials
                .iter()
                .map(|(slot, aggregators, devices)| {
                    Ok(StoredPartial {
                        slot: *slot,
                        aggregators: ids(aggregators)?
                            .into_iter()
                            .map(|a| AggregatorId(a as u32))
                            .collect(),
                        devices: ids(devices)?.into_iter().map(DeviceId).collect(),
                    })
                })
                .collect::<StoreResult<Vec<_>>>()?;
            let secure_records: Vec<(Vec<u8>,)> = sqlx::query_as(
                "SELECT record FROM secagg_records WHERE run_id = $1 AND round_idx = $2 ORDER BY seq",
            )
            .bind(run_id.0)
            .bind(round.round_idx)
            .fetch_all(pool)
            .await
            .map_err(map_err)?;
            Ok(Some(OpenRoundState {
                round: RoundOpened {
                    round_idx: RoundIdx(round.round_idx),
                    model_version: ModelVersion(round.model_version),
                    opened_at: round.opened_at_ms,
                    selection_deadline: round.selection_deadline_ms,
                    reporting_deadline: round.reporting_deadline_ms,
                },
                selected: selected.into_iter().map(|(d,)| DeviceId(d)).collect(),
                reported: reported.into_iter().map(|(d, s)| (DeviceId(d), s)).collect(),
                secure_records: secure_records.into_iter().map(|(r,)| r).collect(),
                assignments: assignments
                    .into_iter()
                    .map(|(d, a)| (DeviceId(d), AggregatorId(a as u32)))
                    .collect(),
                partials,
            }))
        })
    }

    /// Whether `device`'s update for its task of round `round_idx` is durable (its bytes may
    /// since have been released): what tells a retried upload whose answer was lost from a
    /// late one. A buffered run folds a late update into a later buffer, so the update may be
    /// stored under a later round that did not select the device again (as
    /// [`SqlStore::carried_tasks`] reads it). Counted, not `SELECT 1`: that is a 32-bit integer
    /// on Postgres and a 64-bit one on SQLite.
    pub async fn has_update(
        &self,
        run_id: RunId,
        round_idx: RoundIdx,
        device: DeviceId,
    ) -> StoreResult<bool> {
        on_pool!(self, |pool| {
            let (found,): (i64,) = sqlx::query_as(
                "SELECT COUNT(*) FROM updates u
                 WHERE u.run_id = $1 AND u.device_id = $3 AND u.round_idx >= $2
                   AND NOT EXISTS (SELECT 1 FROM selections later WHERE later.run_id = u.run_id
                                   AND later.device_id = u.device_id
                                   AND later.round_idx > $2 AND later.round_idx <= u.round_idx)",
            )
            .bind(run_id.0)
            .bind(round_idx.0)
            .bind(device.0)
            .fetch_one(pool)
            .await
            .map_err(map_err)?;
            Ok(found > 0)
        })
    }

    /// Every device selected for a round, by id, with how its contribution reached the round.
    pub async fn round_devices(
        &self,
        run_id: RunId,
        round_idx: RoundIdx,
    ) -> StoreResult<Vec<RoundDeviceRow>> {
        on_pool!(self, |pool| {
            let mut rows: Vec<RoundDeviceRow> = sqlx::query_as(
                "SELECT s.device_id, s.selected_at_ms, s.aggregator_id,
                        CASE WHEN u.device_id IS NULL THEN NULL ELSE 'update' END AS reported,
                        u.example_count
                 FROM selections s LEFT JOIN updates u
                   ON u.run_id = s.run_id AND u.round_idx = s.round_idx AND u.device_id = s.device_id
                 WHERE s.run_id = $1 AND s.round_idx = $2 ORDER BY s.device_id",
            )
            .bind(run_id.0)
            .bind(round_idx.0)
            .fetch_all(pool)
            .await
            .map_err(map_err)?;
            let partials: Vec<(String,)> = sqlx::query_as(
                "SELECT devices_json FROM partials WHERE run_id = $1 AND round_idx = $2",
            )
            .bind(run_id.0)
            .bind(round_idx.0)
            .fetch_all(pool)
            .await
            .map_err(map_err)?;
            for (json,) in partials {
                let devices = partial_ids(run_id, &json)?;
                for row in rows.iter_mut().filter(|r| devices.contains(&r.device_id)) {
                    row.reported = Some("partial".to_owned());
                }
            }
            Ok(rows)
        })
    }

    /// Highest round index ever opened for a run.
    pub async fn last_round_idx(&self, run_id: RunId) -> StoreResult<Option<RoundIdx>> {
        on_pool!(self, |pool| {
            let row: Option<(i64,)> = sqlx::query_as(
                "SELECT round_idx FROM rounds WHERE run_id = $1 ORDER BY round_idx DESC LIMIT 1",
            )
            .bind(run_id.0)
            .fetch_optional(pool)
            .await
            .map_err(map_err)?;
            Ok(row.map(|(r,)| RoundIdx(r)))
        })
    }

    /// Commits a round: new model version, round row and run progress, in one transaction.
    /// The round's update payloads are left for [`SqlStore::release_payloads`] after it: they
    /// live on in the model, and dropping a large cohort's deltas (a TOAST chunk per 2 KB on
    /// Postgres) took most of the commit's transaction.
    pub async fn commit_round(
        &self,
        run_id: RunId,
        commit: RoundCommit<'_>,
        now: Millis,
    ) -> StoreResult<()> {
        on_pool!(self, |pool| {
            let c = commit.closing;
            let new_version = c.model_version.0 + 1;
            let (model, optimizer_state) = match commit.bytes {
                ModelBytes::Written { model, optimizer_state } => (Some(model), optimizer_state),
                ModelBytes::Later => (None, None),
            };
            let mut tx = pool.begin().await.map_err(map_err)?;
            tx.check_fence(&self.fence).await?;
            sqlx::query(
                "INSERT INTO models (run_id, version, content_hash, data, round_idx, created_at_ms) VALUES ($1, $2, $3, $4, $5, $6)",
            )
            .bind(run_id.0)
            .bind(new_version)
            .bind(commit.model_hash)
            .bind(model)
            .bind(c.round_idx.0)
            .bind(now)
            .execute(&mut *tx)
            .await
            .map_err(map_err)?;
            tx.close_round_row(run_id, &c, "committed", Some(commit.metrics)).await?;
            sqlx::query(
                "UPDATE runs SET model_version = $2, rounds_committed = rounds_committed + 1, updated_at_ms = $3 WHERE id = $1",
            )
            .bind(run_id.0)
            .bind(new_version)
            .bind(now)
            .execute(&mut *tx)
            .await
            .map_err(map_err)?;
            tx.delete_secagg_records(run_id, c.round_idx).await?;
            if let Some(state) = optimizer_state {
                tx.replace_optimizer_state(run_id, new_version, state).await?;
            }
            if let Some(e) = commit.evaluation {
                let metrics = serde_json::to_string(&e.metrics).expect("metrics serialize");
                sqlx::query(
                    "INSERT INTO aggregate_evaluations (run_id, model_version, source, n_devices, example_count, metrics_json, received_at_ms)
                     VALUES ($1, $2, $3, $4, $5, $6, $7)",
                )
                .bind(run_id.0)
                .bind(c.model_version.0)
                .bind(SECURE_EVALUATION_SOURCE)
                .bind(e.n_devices as i64)
                .bind(e.example_count as i64)
                .bind(metrics)
                .bind(now)
                .execute(&mut *tx)
                .await
                .map_err(map_err)?;
            }
            tx.commit().await.map_err(map_err)
        })
    }

    /// Writes the bytes of a model committed by its hash alone ([`ModelBytes::Later`]) and the
    /// server optimizer's state after producing it. Refuses bytes for another hash or a version
    /// never committed; writing them twice is not an error (a retry whose answer was lost).
    pub async fn write_model(
        &self,
        run_id: RunId,
        version: ModelVersion,
        model_hash: &str,
        model: &[u8],
        optimizer_state: Option<&[u8]>,
    ) -> StoreResult<()> {
        on_pool!(self, |pool| {
            let mut tx = pool.begin().await.map_err(map_err)?;
            tx.check_fence(&self.fence).await?;
            // The write first (see `release_payloads`), then what a refusal needs to know.
            let written = sqlx::query(
                "UPDATE models SET data = $4 WHERE run_id = $1 AND version = $2 AND content_hash = $3 AND data IS NULL",
            )
            .bind(run_id.0)
            .bind(version.0)
            .bind(model_hash)
            .bind(model)
            .execute(&mut *tx)
            .await
            .map_err(map_err)?
            .rows_affected();
            if written == 0 {
                let stored: Option<(String,)> = sqlx::query_as(
                    "SELECT content_hash FROM models WHERE run_id = $1 AND version = $2",
                )
                .bind(run_id.0)
                .bind(version.0)
                .fetch_optional(&mut *tx)
                .await
                .map_err(map_err)?;
                return match stored {
                    Some((hash,)) if hash == model_hash => Ok(()),
                    Some((hash,)) => Err(StoreError::Corrupt(format!(
                        "model version {version} of run {run_id} was committed as {hash}, not {model_hash}"
                    ))),
                    None => Err(StoreError::Corrupt(format!(
                        "run {run_id} never committed model version {version}"
                    ))),
                };
            }
            if let Some(state) = optimizer_state {
                tx.replace_optimizer_state(run_id, version.0, state).await?;
            }
            tx.commit().await.map_err(map_err)
        })
    }

    /// Every run's committed models whose bytes are still to be written, by run and version:
    /// those after the run's last written one (a coordinator stopped between a
    /// [`ModelBytes::Later`] commit and its [`SqlStore::write_model`], or before the run's next
    /// checkpoint; a run's last round may have finished it since).
    pub async fn pending_models(&self) -> StoreResult<Vec<PendingModel>> {
        on_pool!(self, |pool| {
            sqlx::query_as(concat!(
                "SELECT m.run_id, m.version, m.content_hash, COALESCE(m.round_idx, -1) AS round_idx FROM models m WHERE ",
                still_to_be_written!(),
                " ORDER BY m.run_id, m.version"
            ))
            .fetch_all(pool)
            .await
            .map_err(map_err)
        })
    }

    /// Drops a closed round's update deltas and partial sums (the rows stay, as the record of
    /// who took part): after [`SqlStore::commit_round`], off the round's path. Refuses a round
    /// that is still open, or whose model is still to be written (its updates are what a
    /// restart would rebuild it from) and not given up for a later written one; releasing
    /// twice is not an error.
    pub async fn release_payloads(&self, run_id: RunId, round_idx: RoundIdx) -> StoreResult<()> {
        on_pool!(self, |pool| {
            // The write first: on SQLite a transaction that reads and then writes fails at
            // once (not after the busy timeout) when another write landed in between.
            let mut tx = pool.begin().await.map_err(map_err)?;
            tx.release_payloads(run_id, round_idx).await?;
            let state: Option<(String,)> =
                sqlx::query_as("SELECT state FROM rounds WHERE run_id = $1 AND round_idx = $2")
                    .bind(run_id.0)
                    .bind(round_idx.0)
                    .fetch_optional(&mut *tx)
                    .await
                    .map_err(map_err)?;
            match state {
                None => {
                    return Err(StoreError::Corrupt(format!(
                        "run {run_id} has no round {round_idx}"
                    )));
                }
                Some((state,)) if state == "open" => {
                    return Err(StoreError::Corrupt(format!(
                        "round {round_idx} of run {run_id} is open: its payloads are not released"
                    )));
                }
                Some(_) => {}
            }
            let pending: Option<(i64,)> = sqlx::query_as(concat!(
                "SELECT m.version FROM models m WHERE m.run_id = $1 AND m.round_idx = $2 AND ",
                still_to_be_written!()
            ))
            .bind(run_id.0)
            .bind(round_idx.0)
            .fetch_optional(&mut *tx)
            .await
            .map_err(map_err)?;
            if let Some((version,)) = pending {
                return Err(StoreError::Corrupt(format!(
                    "model version {version} of run {run_id} is still to be written: round {round_idx}'s payloads are what rebuilds it"
                )));
            }
            tx.commit().await.map_err(map_err)
        })
    }

    /// Releases the payloads every closed round still holds (those a coordinator committed but
    /// stopped before releasing), except a round whose model is still to be written; returns
    /// how many rounds it released. Run at start, after recovery rebuilt any such model.
    pub async fn release_closed_payloads(&self) -> StoreResult<usize> {
        let rounds: Vec<(i64, i64)> = on_pool!(self, |pool| {
            sqlx::query_as(concat!(
                "SELECT r.run_id, r.round_idx FROM rounds r WHERE r.state <> 'open'
                   AND NOT EXISTS (SELECT 1 FROM models m WHERE m.run_id = r.run_id AND m.round_idx = r.round_idx AND ",
                still_to_be_written!(),
                ")
                   AND (EXISTS (SELECT 1 FROM updates u WHERE u.run_id = r.run_id AND u.round_idx = r.round_idx AND u.delta IS NOT NULL)
                        OR EXISTS (SELECT 1 FROM partials p WHERE p.run_id = r.run_id AND p.round_idx = r.round_idx AND p.report IS NOT NULL)
                        OR EXISTS (SELECT 1 FROM update_groups g WHERE g.run_id = r.run_id AND g.round_idx = r.round_idx AND g.sum_hi IS NOT NULL))
                 ORDER BY r.run_id, r.round_idx"
            ))
            .fetch_all(pool)
            .await
            .map_err(map_err)
        })?;
        for &(run_id, round_idx) in &rounds {
            self.release_payloads(RunId(run_id), RoundIdx(round_idx)).await?;
        }
        Ok(rounds.len())
    }

    /// Releases the payloads of the rounds that committed `run_id`'s model versions `first`
    /// to `last`, as [`SqlStore::release_payloads`] does each: once version `last` is written,
    /// the rounds it was made from (its own, and those of the versions since the run's last
    /// written one, which are given up: see the plan's `checkpoint_interval`). Returns how
    /// many rounds it looked at.
    pub async fn release_payloads_of_versions(
        &self,
        run_id: RunId,
        first: ModelVersion,
        last: ModelVersion,
    ) -> StoreResult<usize> {
        let rounds: Vec<(i64,)> = on_pool!(self, |pool| {
            sqlx::query_as(
                "SELECT round_idx FROM models WHERE run_id = $1 AND version >= $2 AND version <= $3 AND round_idx IS NOT NULL ORDER BY version",
            )
            .bind(run_id.0)
            .bind(first.0)
            .bind(last.0)
            .fetch_all(pool)
            .await
            .map_err(map_err)
        })?;
        for &(round_idx,) in &rounds {
            self.release_payloads(run_id, RoundIdx(round_idx)).await?;
        }
        Ok(rounds.len())
    }

    /// Commits a round of an evaluation-only run: the round row (state `evaluated`, the pooled
    /// metrics), run progress without a new model version, and the pooled evaluation of the
    /// run's model under the source `evaluation_round:<round>`, in one transaction.
    pub async fn commit_evaluation_round(
        &self,
        run_id: RunId,
        closing: RoundClosing,
        pooled: &starling_core::fedavg::PooledEvaluation,
        now: Millis,
    ) -> StoreResult<()> {
        on_pool!(self, |pool| {
            let mut tx = pool.begin().await.map_err(map_err)?;
            tx.check_fence(&self.fence).await?;
            // First, so that a retry of a commit whose answer was lost is a conflict (as a model
            // version is for `commit_round`), not a round that is no longer open.
            sqlx::query(
                "INSERT INTO aggregate_evaluations (run_id, model_version, source, n_devices, example_count, metrics_json, received_at_ms)
                 VALUES ($1, $2, $3, $4, $5, $6, $7)",
            )
            .bind(run_id.0)
            .bind(closing.model_version.0)
            .bind(format!("{EVALUATION_ROUND_PREFIX}{}", closing.round_idx.0))
            .bind(pooled.n_devices as i64)
            .bind(pooled.example_count as i64)
            .bind(serde_json::to_string(&pooled.metrics).expect("metrics serialize"))
            .bind(now)
            .execute(&mut *tx)
            .await
            .map_err(map_err)?;
            tx.close_round_row(run_id, &closing, "evaluated", Some(&pooled.metrics)).await?;
            sqlx::query(
                "UPDATE runs SET rounds_committed = rounds_committed + 1, updated_at_ms = $2 WHERE id = $1",
            )
            .bind(run_id.0)
            .bind(now)
            .execute(&mut *tx)
            .await
            .map_err(map_err)?;
            tx.release_payloads(run_id, closing.round_idx).await?;
            tx.commit().await.map_err(map_err)
        })
    }

    /// Records a failed round. Its updates stay stored but are never folded: a retry is a new
    /// round with new uploads.
    pub async fn fail_round(
        &self,
        run_id: RunId,
        closing: RoundClosing,
        refused_by: &[DeviceId],
    ) -> StoreResult<()> {
        on_pool!(self, |pool| {
            let mut tx = pool.begin().await.map_err(map_err)?;
            tx.check_fence(&self.fence).await?;
            tx.close_round_row(run_id, &closing, "failed", None).await?;
            if !refused_by.is_empty() {
                // Kept with the outcome: the quarantine recount after a restart strikes them
                // alone (`culprits`), as the machine did.
                let mut outcome =
                    serde_json::to_value(closing.outcome).expect("outcome serializes");
                let ids: Vec<i64> = refused_by.iter().map(|d| d.0).collect();
                outcome["culprits"] = serde_json::json!(ids);
                sqlx::query(
                    "UPDATE rounds SET outcome_json = $3 WHERE run_id = $1 AND round_idx = $2",
                )
                .bind(run_id.0)
                .bind(closing.round_idx.0)
                .bind(outcome.to_string())
                .execute(&mut *tx)
                .await
                .map_err(map_err)?;
            }
            tx.release_payloads(run_id, closing.round_idx).await?;
            tx.delete_secagg_records(run_id, closing.round_idx).await?;
            tx.commit().await.map_err(map_err)
        })
    }

    /// A run's rounds, oldest first, with live counts for the open one.
    pub async fn rounds(&self, run_id: RunId) -> StoreResult<Vec<RoundRow>> {
        on_pool!(self, |pool| {
            sqlx::query_as(concat!(round_select!(), " WHERE r.run_id = $1 ORDER BY r.round_idx"))
                .bind(run_id.0)
                .fetch_all(pool)
                .await
                .map_err(map_err)
        })
    }

    /// An asynchronous run's devices selected for a closed round on model `oldest` or later
    /// that have neither reported (in that round or a later one) nor been selected again: what
    /// a restarted coordinator carries into the open buffer (the machine drops those past their
    /// deadline).
    pub async fn carried_tasks(
        &self,
        run_id: RunId,
        oldest: ModelVersion,
    ) -> StoreResult<Vec<CarriedTask>> {
        on_pool!(self, |pool| {
            let rows: Vec<(i64, i64, i64, i64)> = sqlx::query_as(
                "SELECT s.device_id, s.round_idx, r.model_version, s.selected_at_ms
                 FROM selections s JOIN rounds r ON r.run_id = s.run_id AND r.round_idx = s.round_idx
                 WHERE s.run_id = $1 AND r.state <> 'open' AND r.model_version >= $2
                   AND NOT EXISTS (SELECT 1 FROM updates u WHERE u.run_id = s.run_id
                                   AND u.device_id = s.device_id AND u.round_idx >= s.round_idx)
                   AND NOT EXISTS (SELECT 1 FROM selections later WHERE later.run_id = s.run_id
                                   AND later.device_id = s.device_id AND later.round_idx > s.round_idx)
                 ORDER BY s.round_idx, s.device_id",
            )
            .bind(run_id.0)
            .bind(oldest.0)
            .fetch_all(pool)
            .await
            .map_err(map_err)?;
            Ok(rows
                .into_iter()
                .map(|(device, round_idx, model_version, selected_at)| CarriedTask {
                    device: DeviceId(device),
                    round_idx: RoundIdx(round_idx),
                    model_version: ModelVersion(model_version),
                    selected_at,
                })
                .collect())
        })
    }

    /// A run's selections per device under a `blt_ftrl` participation rule
    /// (`starling_core::round::participation_rule`): how often each device was selected, in
    /// any round (open, failed or committed), and the latest model version it was selected on.
    pub async fn participation_history(&self, run_id: RunId) -> StoreResult<Participations> {
        on_pool!(self, |pool| {
            let rows: Vec<(i64, i64, i64)> = sqlx::query_as(
                "SELECT s.device_id, COUNT(*), MAX(r.model_version) FROM selections s
                 JOIN rounds r ON r.run_id = s.run_id AND r.round_idx = s.round_idx
                 WHERE s.run_id = $1 GROUP BY s.device_id",
            )
            .bind(run_id.0)
            .fetch_all(pool)
            .await
            .map_err(map_err)?;
            Ok(Participations::from_history(rows.into_iter().map(|(device, count, last)| {
                (DeviceId(device), History { count: count as u64, last: ModelVersion(last) })
            })))
        })
    }

    /// A run's strikes under the quarantine rule (`starling_core::round::quarantine`), counted
    /// again from its closed rounds in order: the devices of each round that committed or whose
    /// aggregate was refused, by their updates and partials.
    pub async fn quarantine_strikes(&self, run_id: RunId) -> StoreResult<Strikes> {
        on_pool!(self, |pool| {
            let rounds: Vec<(i64, String, Option<String>)> = sqlx::query_as(
                "SELECT round_idx, state, outcome_json FROM rounds
                 WHERE run_id = $1 AND state <> 'open' ORDER BY round_idx",
            )
            .bind(run_id.0)
            .fetch_all(pool)
            .await
            .map_err(map_err)?;
            let updates: Vec<(i64, i64)> =
                sqlx::query_as("SELECT round_idx, device_id FROM updates WHERE run_id = $1")
                    .bind(run_id.0)
                    .fetch_all(pool)
                    .await
                    .map_err(map_err)?;
            let partials: Vec<(i64, String)> =
                sqlx::query_as("SELECT round_idx, devices_json FROM partials WHERE run_id = $1")
                    .bind(run_id.0)
                    .fetch_all(pool)
                    .await
                    .map_err(map_err)?;
            let mut devices: BTreeMap<i64, Vec<DeviceId>> = BTreeMap::new();
            for (round_idx, device) in updates {
                devices.entry(round_idx).or_default().push(DeviceId(device));
            }
            for (round_idx, json) in partials {
                let ids = partial_ids(run_id, &json)?;
                devices.entry(round_idx).or_default().extend(ids.into_iter().map(DeviceId));
            }
            let mut strikes = Strikes::default();
            for (round_idx, state, outcome) in rounds {
                let outcome: Option<serde_json::Value> =
                    outcome.as_deref().and_then(|json| serde_json::from_str(json).ok());
                let refused = outcome.as_ref().is_some_and(|o| {
                    matches!(serde_json::from_value(o.clone()), Ok(RoundOutcome::AggregateRejected))
                });
                if state == "committed" || refused {
                    let held = devices.remove(&round_idx).unwrap_or_default();
                    // A refusal traced to some updates strikes their devices alone.
                    let culprits: Vec<DeviceId> = outcome
                        .as_ref()
                        .and_then(|o| o.get("culprits")?.as_array().cloned())
                        .unwrap_or_default()
                        .iter()
                        .filter_map(|id| id.as_i64().map(DeviceId))
                        .collect();
                    strikes.round_ended_traced(held, state == "committed", &culprits);
                }
            }
            Ok(strikes)
        })
    }

    /// One round, with live counts if it is open.
    pub async fn round(&self, run_id: RunId, round_idx: RoundIdx) -> StoreResult<Option<RoundRow>> {
        on_pool!(self, |pool| {
            sqlx::query_as(concat!(round_select!(), " WHERE r.run_id = $1 AND r.round_idx = $2"))
                .bind(run_id.0)
                .bind(round_idx.0)
                .fetch_optional(pool)
                .await
                .map_err(map_err)
        })
    }
}

/// A stored partial's aggregator or device ids (its `aggregators_json`, `devices_json`).
fn partial_ids(run_id: RunId, json: &str) -> StoreResult<Vec<i64>> {
    serde_json::from_str(json)
        .map_err(|e| StoreError::Corrupt(format!("partial id list of run {run_id}: {e}")))
}
