//! Runs and their committed models.

use serde::Serialize;
use sqlx::FromRow;
use starling_core::{Millis, ModelVersion, RunId};

use super::*;

/// A run as stored.
#[derive(Debug, Clone, FromRow)]
pub struct RunRow {
    /// Run id.
    pub id: i64,
    /// Display name.
    pub name: Option<String>,
    /// Population.
    pub population: String,
    /// The submitted plan, JSON.
    pub plan_json: String,
    /// `running`, `finished` or `stopped`.
    pub status: String,
    /// Latest committed model version.
    pub model_version: i64,
    /// Rounds committed.
    pub rounds_committed: i64,
    /// Creation time.
    pub created_at_ms: i64,
    /// Last transition time.
    pub updated_at_ms: i64,
    /// Why the coordinator stopped the run; `None` when the operator stopped it, or it runs.
    pub stop_reason: Option<String>,
}

/// A model version as stored, without its bytes.
#[derive(Debug, Clone, FromRow, Serialize)]
pub struct ModelInfo {
    /// Model version.
    pub version: i64,
    /// Content hash (download path).
    pub content_hash: String,
    /// Round that produced it (`None` for version 0).
    pub round_idx: Option<i64>,
    /// Commit time.
    pub created_at_ms: i64,
    /// Bytes given up because a later version of the run was written (the plan's
    /// `checkpoint_interval`).
    pub given_up: bool,
}

/// A new run with its initial model.
#[derive(Debug, Clone)]
pub struct NewRun<'a> {
    /// Display name.
    pub name: Option<&'a str>,
    /// Population.
    pub population: &'a str,
    /// Plan JSON.
    pub plan_json: &'a str,
    /// Model version 0, encoded.
    pub initial_model: &'a [u8],
    /// Its content hash.
    pub initial_model_hash: &'a str,
    /// The run trains its population alone: refused while another run is running there, and
    /// no other run starts there while it runs (the plan's `exclusive_population`).
    pub exclusive_population: bool,
}

impl SqlStore {
    /// Creates a run and its model version 0 in one transaction.
    pub async fn create_run(&self, run: NewRun<'_>, now: Millis) -> StoreResult<RunId> {
        on_pool!(self, |pool| {
            let mut tx = pool.begin().await.map_err(map_err)?;
            tx.check_fence(&self.fence).await?;
            // A claim whose run no longer runs is stale; a live one keeps every other run out.
            sqlx::query(
                "DELETE FROM population_claims WHERE population = $1
                   AND run_id NOT IN (SELECT id FROM runs WHERE status = 'running')",
            )
            .bind(run.population)
            .execute(&mut *tx)
            .await
            .map_err(map_err)?;
            let busy = |run_id: i64, exclusive: bool| StoreError::PopulationBusy {
                population: run.population.to_owned(),
                run: run_id,
                exclusive,
            };
            let claimed: Option<(i64,)> =
                sqlx::query_as("SELECT run_id FROM population_claims WHERE population = $1")
                    .bind(run.population)
                    .fetch_optional(&mut *tx)
                    .await
                    .map_err(map_err)?;
            if let Some((holder,)) = claimed {
                return Err(busy(holder, true));
            }
            if run.exclusive_population {
                let running: Option<(i64,)> = sqlx::query_as(
                    "SELECT id FROM runs WHERE population = $1 AND status = 'running' LIMIT 1",
                )
                .bind(run.population)
                .fetch_optional(&mut *tx)
                .await
                .map_err(map_err)?;
                if let Some((other,)) = running {
                    return Err(busy(other, false));
                }
            }
            let (id,): (i64,) = sqlx::query_as(
                "INSERT INTO runs (name, population, plan_json, status, model_version, rounds_committed, created_at_ms, updated_at_ms)
                 VALUES ($1, $2, $3, 'running', 0, 0, $4, $4) RETURNING id",
            )
            .bind(run.name)
            .bind(run.population)
            .bind(run.plan_json)
            .bind(now)
            .fetch_one(&mut *tx)
            .await
            .map_err(map_err)?;
            sqlx::query(
                "INSERT INTO models (run_id, version, content_hash, data, round_idx, created_at_ms) VALUES ($1, 0, $2, $3, NULL, $4)",
            )
            .bind(id)
            .bind(run.initial_model_hash)
            .bind(run.initial_model)
            .bind(now)
            .execute(&mut *tx)
            .await
            .map_err(map_err)?;
            if run.exclusive_population {
                // The primary key is the constraint: of two claims racing, the second's insert
                // fails (on Postgres once the first commits).
                let claim = sqlx::query(
                    "INSERT INTO population_claims (population, run_id) VALUES ($1, $2)",
                )
                .bind(run.population)
                .bind(id)
                .execute(&mut *tx)
                .await
                .map_err(map_err);
                if let Err(StoreError::Conflict) = claim {
                    // Another claim won the race (this transaction rolls back): name its run.
                    drop(tx);
                    let (holder,): (i64,) = sqlx::query_as(
                        "SELECT run_id FROM population_claims WHERE population = $1",
                    )
                    .bind(run.population)
                    .fetch_optional(pool)
                    .await
                    .map_err(map_err)?
                    .unwrap_or((0,));
                    return Err(busy(holder, true));
                }
                claim?;
            }
            tx.commit().await.map_err(map_err)?;
            Ok(RunId(id))
        })
    }

    /// One run.
    pub async fn run(&self, run_id: RunId) -> StoreResult<Option<RunRow>> {
        on_pool!(self, |pool| {
            sqlx::query_as("SELECT * FROM runs WHERE id = $1")
                .bind(run_id.0)
                .fetch_optional(pool)
                .await
                .map_err(map_err)
        })
    }

    /// All runs, newest first.
    pub async fn runs(&self) -> StoreResult<Vec<RunRow>> {
        on_pool!(self, |pool| {
            sqlx::query_as("SELECT * FROM runs ORDER BY id DESC")
                .fetch_all(pool)
                .await
                .map_err(map_err)
        })
    }

    /// Runs still being driven.
    pub async fn running_runs(&self) -> StoreResult<Vec<RunRow>> {
        on_pool!(self, |pool| {
            sqlx::query_as("SELECT * FROM runs WHERE status = 'running' ORDER BY id")
                .fetch_all(pool)
                .await
                .map_err(map_err)
        })
    }

    /// A model's bytes by version; [`StoreError::ModelPending`] for one committed whose bytes
    /// are still to be written, [`StoreError::ModelNotKept`] for one given up since.
    pub async fn model(
        &self,
        run_id: RunId,
        version: ModelVersion,
    ) -> StoreResult<Option<Vec<u8>>> {
        let row: Option<ModelRow> = on_pool!(self, |pool| {
            sqlx::query_as(concat!(
                "SELECT m.run_id, m.version, m.data, ",
                still_to_be_written!(),
                " AS pending FROM models m WHERE m.run_id = $1 AND m.version = $2"
            ))
            .bind(run_id.0)
            .bind(version.0)
            .fetch_optional(pool)
            .await
            .map_err(map_err)
        })?;
        model_bytes(row)
    }

    /// A model's bytes by content hash (from any run that stored them);
    /// [`StoreError::ModelPending`] or [`StoreError::ModelNotKept`] when the only models with
    /// that hash have none.
    pub async fn model_by_hash(&self, content_hash: &str) -> StoreResult<Option<Vec<u8>>> {
        let row: Option<ModelRow> = on_pool!(self, |pool| {
            sqlx::query_as(concat!(
                "SELECT m.run_id, m.version, m.data, ",
                still_to_be_written!(),
                " AS pending FROM models m WHERE m.content_hash = $1 ORDER BY m.data IS NULL LIMIT 1"
            ))
            .bind(content_hash)
            .fetch_optional(pool)
            .await
            .map_err(map_err)
        })?;
        model_bytes(row)
    }

    /// The runs that have a model with this content hash (one, but for identical models).
    pub async fn runs_with_model(&self, content_hash: &str) -> StoreResult<Vec<RunId>> {
        let rows: Vec<(i64,)> = on_pool!(self, |pool| {
            sqlx::query_as("SELECT DISTINCT run_id FROM models WHERE content_hash = $1")
                .bind(content_hash)
                .fetch_all(pool)
                .await
                .map_err(map_err)
        })?;
        Ok(rows.into_iter().map(|(id,)| RunId(id)).collect())
    }

    /// Whether model `version` of `run_id` is committed with its bytes still to be written:
    /// unwritten, and no later version of the run written since (which would give it up).
    pub async fn model_still_to_be_written(
        &self,
        run_id: RunId,
        version: ModelVersion,
    ) -> StoreResult<bool> {
        let (pending,): (i64,) = on_pool!(self, |pool| {
            sqlx::query_as(concat!(
                "SELECT COUNT(*) FROM models m WHERE m.run_id = $1 AND m.version = $2 AND ",
                still_to_be_written!()
            ))
            .bind(run_id.0)
            .bind(version.0)
            .fetch_one(pool)
            .await
            .map_err(map_err)
        })?;
        Ok(pending > 0)
    }

    /// Every model version of a run, oldest first.
    pub async fn models(&self, run_id: RunId) -> StoreResult<Vec<ModelInfo>> {
        on_pool!(self, |pool| {
            sqlx::query_as(concat!(
                "SELECT m.version, m.content_hash, m.round_idx, m.created_at_ms, ",
                "m.data IS NULL AND NOT (",
                still_to_be_written!(),
                ") AS given_up FROM models m WHERE m.run_id = $1 ORDER BY m.version"
            ))
            .bind(run_id.0)
            .fetch_all(pool)
            .await
            .map_err(map_err)
        })
    }

    /// The server optimizer's state stored with model `version` (see
    /// [`RoundCommit::optimizer_state`](super::RoundCommit)), if any.
    pub async fn optimizer_state(
        &self,
        run_id: RunId,
        version: ModelVersion,
    ) -> StoreResult<Option<Vec<u8>>> {
        on_pool!(self, |pool| {
            let row: Option<(Vec<u8>,)> = sqlx::query_as(
                "SELECT data FROM optimizer_states WHERE run_id = $1 AND model_version = $2",
            )
            .bind(run_id.0)
            .bind(version.0)
            .fetch_optional(pool)
            .await
            .map_err(map_err)?;
            Ok(row.map(|(d,)| d))
        })
    }

    /// Content hash of one model version.
    pub async fn model_hash(
        &self,
        run_id: RunId,
        version: ModelVersion,
    ) -> StoreResult<Option<String>> {
        on_pool!(self, |pool| {
            let row: Option<(String,)> = sqlx::query_as(
                "SELECT content_hash FROM models WHERE run_id = $1 AND version = $2",
            )
            .bind(run_id.0)
            .bind(version.0)
            .fetch_optional(pool)
            .await
            .map_err(map_err)?;
            Ok(row.map(|(h,)| h))
        })
    }
}

/// A models row as a read of its bytes sees it: run, version, bytes, and whether bytes it lacks
/// are still to be written, decided in the same statement as the bytes were read (two queries
/// could see the write land between them and call a version just written given up).
type ModelRow = (i64, i64, Option<Vec<u8>>, bool);

/// A models row's bytes; for a row without, whether they are still to be written or were
/// given up because a later version of the run was written (see the plan's
/// `checkpoint_interval`).
fn model_bytes(row: Option<ModelRow>) -> StoreResult<Option<Vec<u8>>> {
    match row {
        None => Ok(None),
        Some((_, _, Some(data), _)) => Ok(Some(data)),
        Some((run_id, version, None, true)) => Err(StoreError::ModelPending { run_id, version }),
        Some((run_id, version, None, false)) => Err(StoreError::ModelNotKept { run_id, version }),
    }
}
