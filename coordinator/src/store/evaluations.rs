//! Evaluations of committed models: devices' own reports, and evaluations pooled over several
//! devices (a secure cohort's).

use sqlx::FromRow;
use starling_core::{DeviceId, Millis, ModelVersion, RunId};

use super::*;

/// An evaluation report as stored.
#[derive(Debug, Clone, FromRow)]
pub struct EvaluationRow {
    /// Model version evaluated.
    pub model_version: i64,
    /// Held-out examples.
    pub example_count: i64,
    /// Metrics, JSON.
    pub metrics_json: String,
}

/// The `source` of a secure round's pooled evaluation in `aggregate_evaluations`.
pub const SECURE_EVALUATION_SOURCE: &str = "secure_cohort";

/// The prefix of an evaluation-only round's pooled evaluation's `source`
/// (`evaluation_round:<round>`).
pub const EVALUATION_ROUND_PREFIX: &str = "evaluation_round:";

/// The prefix of a central evaluator's `source` (`central:<its name>`).
pub const CENTRAL_EVALUATION_PREFIX: &str = "central:";

/// A pooled evaluation as stored.
#[derive(Debug, Clone, FromRow)]
pub struct AggregateEvaluationRow {
    /// Model version evaluated.
    pub model_version: i64,
    /// Where it comes from (e.g. [`SECURE_EVALUATION_SOURCE`]).
    pub source: String,
    /// Devices pooled.
    pub n_devices: i64,
    /// Their held-out examples.
    pub example_count: i64,
    /// Example-weighted means, JSON.
    pub metrics_json: String,
}

impl SqlStore {
    /// Stores (or replaces) a central evaluator's evaluation of a model version: the server
    /// side's held-out set, not devices'.
    pub async fn put_central_evaluation(
        &self,
        run_id: RunId,
        model_version: ModelVersion,
        evaluator: &str,
        example_count: u64,
        metrics_json: &str,
        now: Millis,
    ) -> StoreResult<()> {
        on_pool!(self, |pool| {
            sqlx::query(
                "INSERT INTO aggregate_evaluations (run_id, model_version, source, n_devices, example_count, metrics_json, received_at_ms)
                 VALUES ($1, $2, $3, 0, $4, $5, $6)
                 ON CONFLICT (run_id, model_version, source)
                 DO UPDATE SET example_count = excluded.example_count, metrics_json = excluded.metrics_json,
                               received_at_ms = excluded.received_at_ms",
            )
            .bind(run_id.0)
            .bind(model_version.0)
            .bind(format!("{CENTRAL_EVALUATION_PREFIX}{evaluator}"))
            .bind(example_count as i64)
            .bind(metrics_json)
            .bind(now)
            .execute(pool)
            .await
            .map_err(map_err)?;
            Ok(())
        })
    }

    /// Stores an evaluation report; a second report of one device on one model is a conflict.
    pub async fn insert_evaluation(
        &self,
        run_id: RunId,
        device: DeviceId,
        model_version: ModelVersion,
        example_count: u64,
        metrics_json: &str,
        now: Millis,
    ) -> StoreResult<()> {
        on_pool!(self, |pool| {
            sqlx::query(
                "INSERT INTO evaluations (run_id, model_version, device_id, example_count, metrics_json, received_at_ms)
                 VALUES ($1, $2, $3, $4, $5, $6)",
            )
            .bind(run_id.0)
            .bind(model_version.0)
            .bind(device.0)
            .bind(example_count as i64)
            .bind(metrics_json)
            .bind(now)
            .execute(pool)
            .await
            .map_err(map_err)?;
            Ok(())
        })
    }

    /// A run's pooled evaluations (a secure round's cohort), by model version.
    pub async fn aggregate_evaluations(
        &self,
        run_id: RunId,
    ) -> StoreResult<Vec<AggregateEvaluationRow>> {
        on_pool!(self, |pool| {
            sqlx::query_as(
                "SELECT model_version, source, n_devices, example_count, metrics_json FROM aggregate_evaluations
                 WHERE run_id = $1 ORDER BY model_version, source",
            )
            .bind(run_id.0)
            .fetch_all(pool)
            .await
            .map_err(map_err)
        })
    }

    /// Whether `device` was selected for a round of `run_id` that trained `version`: the
    /// devices whose evaluation of that version the run accepts.
    pub async fn selected_for_version(
        &self,
        run_id: RunId,
        device: DeviceId,
        version: ModelVersion,
    ) -> StoreResult<bool> {
        on_pool!(self, |pool| {
            let row: Option<(i64,)> = sqlx::query_as(
                "SELECT s.round_idx FROM selections s JOIN rounds r ON r.run_id = s.run_id AND r.round_idx = s.round_idx
                 WHERE s.run_id = $1 AND s.device_id = $2 AND r.model_version = $3 LIMIT 1",
            )
            .bind(run_id.0)
            .bind(device.0)
            .bind(version.0)
            .fetch_optional(pool)
            .await
            .map_err(map_err)?;
            Ok(row.is_some())
        })
    }

    /// The device reports of the latest model version of a run that two or more devices
    /// reported an accuracy for (what the run's view summarizes), without reading its others.
    /// Metrics are stored as serde_json writes a map, so a report with an accuracy holds the
    /// text `"accuracy":`.
    pub async fn latest_accuracy_reports(&self, run_id: RunId) -> StoreResult<Vec<EvaluationRow>> {
        on_pool!(self, |pool| {
            sqlx::query_as(
                r#"SELECT model_version, example_count, metrics_json FROM evaluations
                 WHERE run_id = $1 AND model_version = (
                     SELECT model_version FROM evaluations
                     WHERE run_id = $1 AND metrics_json LIKE '%"accuracy":%'
                     GROUP BY model_version HAVING COUNT(*) >= 2
                     ORDER BY model_version DESC LIMIT 1)
                 ORDER BY device_id"#,
            )
            .bind(run_id.0)
            .fetch_all(pool)
            .await
            .map_err(map_err)
        })
    }

    /// All evaluation reports of a run.
    pub async fn evaluations(&self, run_id: RunId) -> StoreResult<Vec<EvaluationRow>> {
        on_pool!(self, |pool| {
            sqlx::query_as(
                "SELECT model_version, example_count, metrics_json FROM evaluations WHERE run_id = $1 ORDER BY model_version",
            )
            .bind(run_id.0)
            .fetch_all(pool)
            .await
            .map_err(map_err)
        })
    }
}
