//! The admin API: what operators (and the dashboard) call, in JSON, with the operator credential.

use std::collections::BTreeMap;

use axum::extract::rejection::JsonRejection;
use axum::extract::{FromRequest, Path, Query, State};
use axum::http::StatusCode;
use base64::Engine;
use serde::{Deserialize, Serialize};
use starling_core::fedavg::MetricsAccumulator;
use starling_core::plan::Plan;
use starling_core::wire::{ErrorBody, ErrorCode};
use starling_core::{ModelVersion, RunId};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::{ApiError, AppState, Operator, random_secret, sha256};
use crate::clock::now_ms;
use crate::driver::{Event, InitialModel};
use crate::observe::RoundCounters;
use crate::store::{CENTRAL_EVALUATION_PREFIX, ModelInfo, RoundRow, RunRow};
use starling_core::DeviceId;
use starling_core::admin::{
    BaseModelView, CentralEvaluation, DeviceSpread, DeviceView, EnrollmentToken,
    EnrollmentTokenView, ModelView, NewEnrollmentToken, PrivacyView, RoundDeviceView, RoundView,
    RunView, TokenizerView,
};
use starling_core::codec;
use starling_core::tensor::{TensorPayload, f32_from_le_bytes, f32_to_le_bytes, safetensors};
use starling_core::wire;

/// The admin routes, each with its OpenAPI operation.
pub fn routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(create_enrollment_token, list_enrollment_tokens))
        .routes(routes!(create_run, list_runs))
        .routes(routes!(get_run))
        .routes(routes!(get_model_spec))
        .routes(routes!(list_rounds))
        .routes(routes!(get_round))
        .routes(routes!(list_round_devices))
        .routes(routes!(list_models))
        .routes(routes!(export_model))
        .routes(routes!(import_base_model, list_base_models))
        .routes(routes!(import_tokenizer, list_tokenizers))
        .routes(routes!(report_central_evaluation))
        .routes(routes!(stop_run))
        .routes(routes!(list_devices))
        .routes(routes!(revoke_device))
}

/// `Json` whose rejections use our error body.
#[derive(FromRequest)]
#[from_request(via(axum::Json), rejection(ApiError))]
pub struct AppJson<T>(pub T);

impl<T: Serialize> axum::response::IntoResponse for AppJson<T> {
    fn into_response(self) -> axum::response::Response {
        axum::Json(self.0).into_response()
    }
}

impl From<JsonRejection> for ApiError {
    fn from(rejection: JsonRejection) -> Self {
        ApiError::new(rejection.status(), ErrorCode::MalformedBody, rejection.body_text())
    }
}

#[utoipa::path(post, path = "/v1/admin/enrollment-tokens", tag = "admin", security(("operator" = [])),
    request_body = NewEnrollmentToken,
    responses((status = 201, description = "the token, shown once", body = EnrollmentToken), (status = 400, description = "malformed body", body = ErrorBody),
        (status = 401, description = "missing, unknown or revoked credential", body = ErrorBody),
        (status = 422, description = "invalid field, schema or value", body = ErrorBody),
        (status = 503, description = "store unavailable; retry", body = ErrorBody)))]
async fn create_enrollment_token(
    State(state): State<AppState>,
    _op: Operator,
    AppJson(req): AppJson<NewEnrollmentToken>,
) -> Result<(StatusCode, AppJson<EnrollmentToken>), ApiError> {
    let (uses, populations) = req.checked().map_err(ApiError::invalid)?;
    let token = random_secret("stenr");
    let now = now_ms();
    let expires_at_ms = req.ttl_secs.map(|t| now.saturating_add(t.saturating_mul(1000)));
    state
        .store()
        .create_enrollment_token(
            &hex::encode(sha256(token.as_bytes())),
            now,
            expires_at_ms,
            Some(uses),
            Some(&populations),
        )
        .await?;
    Ok((StatusCode::CREATED, AppJson(EnrollmentToken { token, expires_at_ms })))
}

/// Every enrollment token (newest first) with the devices it may still enroll and the
/// populations it admits; the tokens themselves are never shown again.
#[utoipa::path(get, path = "/v1/admin/enrollment-tokens", tag = "admin", security(("operator" = [])),
    responses((status = 200, description = "the tokens, newest first", body = Vec<EnrollmentTokenView>),
        (status = 401, description = "missing, unknown or revoked credential", body = ErrorBody),
        (status = 503, description = "store unavailable; retry", body = ErrorBody)))]
async fn list_enrollment_tokens(
    State(state): State<AppState>,
    _op: Operator,
) -> Result<AppJson<Vec<EnrollmentTokenView>>, ApiError> {
    let rows = state.store().enrollment_tokens().await?;
    let views = rows
        .into_iter()
        .map(|t| EnrollmentTokenView {
            id: t.id,
            created_at_ms: t.created_at_ms,
            expires_at_ms: t.expires_at_ms,
            uses_left: t.uses_left,
            populations: t.populations,
        })
        .collect();
    Ok(AppJson(views))
}

async fn run_view(state: &AppState, row: RunRow) -> Result<RunView, ApiError> {
    let plan: serde_json::Value =
        serde_json::from_str(&row.plan_json).map_err(|e| ApiError::internal(&e))?;
    // Rounds the run may commit, and its privacy so far, follow from the validated plan (a
    // DP budget may allow fewer rounds than planned).
    let validated =
        serde_json::from_value::<Plan>(plan.clone()).ok().and_then(|p| p.validate().ok());
    let total_rounds = match &validated {
        Some(v) => v.round_config().total_rounds,
        None => plan.get("rounds").and_then(|v| v.as_u64()).unwrap_or(0) as u32,
    };
    let privacy = validated.as_ref().and_then(|v| {
        let secure = v.plan().secure_aggregation.is_some();
        v.privacy().map(|p| PrivacyView::new(p, row.rounds_committed.max(0) as u64, secure))
    });
    let model_hash =
        state.store().model_hash(RunId(row.id), ModelVersion(row.model_version)).await?;
    // Only the latest version's reports: a run's list must not read every report it ever had.
    let latest = state.store().latest_accuracy_reports(RunId(row.id)).await?;
    let latest_spread = device_accuracies(&latest)
        .into_iter()
        .find_map(|(version, accuracies)| DeviceSpread::of(&accuracies).map(|s| (version, s)));
    Ok(RunView {
        id: row.id,
        name: row.name,
        population: row.population,
        status: row.status,
        stop_reason: row.stop_reason,
        model_version: row.model_version,
        model_hash,
        rounds_committed: row.rounds_committed,
        total_rounds,
        created_at_ms: row.created_at_ms,
        updated_at_ms: row.updated_at_ms,
        plan,
        device_accuracy: latest_spread.map(|(_, s)| s),
        device_accuracy_version: latest_spread.map(|(v, _)| v),
        privacy,
    })
}

/// Each model version's device accuracies, one per device report that has one.
fn device_accuracies(evaluations: &[crate::store::EvaluationRow]) -> BTreeMap<i64, Vec<f64>> {
    let mut out: BTreeMap<i64, Vec<f64>> = BTreeMap::new();
    for e in evaluations {
        let metrics: BTreeMap<String, f64> =
            serde_json::from_str(&e.metrics_json).unwrap_or_default();
        if let Some(&accuracy) = metrics.get("accuracy") {
            out.entry(e.model_version).or_default().push(accuracy);
        }
    }
    out
}

#[utoipa::path(post, path = "/v1/admin/runs", tag = "admin", security(("operator" = [])),
    request_body = Plan,
    responses((status = 201, description = "created; round 0 opens", body = RunView), (status = 400, description = "malformed body", body = ErrorBody),
        (status = 401, description = "missing, unknown or revoked credential", body = ErrorBody),
        (status = 422, description = "invalid field, schema or value", body = ErrorBody),
        (status = 503, description = "store unavailable; retry", body = ErrorBody)))]
async fn create_run(
    State(state): State<AppState>,
    _op: Operator,
    AppJson(plan): AppJson<Plan>,
) -> Result<(StatusCode, AppJson<RunView>), ApiError> {
    let plan = plan.validate().map_err(|e| {
        ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, ErrorCode::InvalidPlan, e.to_string())
    })?;
    let (bytes, limit) = (plan.schema().byte_len(), state.inner.max_model_bytes);
    if bytes > limit {
        return Err(ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            ErrorCode::InvalidPlan,
            format!(
                "the model is {bytes} bytes, more than this coordinator's limit of {limit} (--max-model-bytes)"
            ),
        ));
    }
    // An imported base model is read before anything else is done with it.
    let base = match plan.base_model_hash() {
        Some(hash) => state.store().base_model(hash).await?,
        None => None,
    };
    let base = match base {
        Some((info, data)) => Some((info.schema()?, f32_from_le_bytes(&data))),
        None => None,
    };
    if let Some(hash) = plan.tokenizer() {
        check_tokenizer(&state, &plan, hash).await?;
    }
    // Initialization and encoding are O(model): keep them off the async threads.
    let (plan, initial) = tokio::task::spawn_blocking(move || {
        let decode = |s: &str| base64::engine::general_purpose::STANDARD.decode(s).ok();
        let base = base.as_ref().map(|(schema, values)| (schema, values.as_slice()));
        let values = plan.initial_parameters_from(decode, base)?;
        let initial = InitialModel::new(plan.schema(), values);
        Ok::<_, starling_core::plan::PlanError>((plan, initial))
    })
    .await
    .map_err(|e| ApiError::internal(&e))?
    .map_err(|e| {
        ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, ErrorCode::InvalidPlan, e.to_string())
    })?;
    let run_id = state
        .driver()
        .call(|reply| Event::CreateRun { plan: Box::new(plan), initial, reply })
        .await?;
    let row = state
        .store()
        .run(run_id)
        .await?
        .ok_or_else(|| ApiError::internal(&"created run vanished"))?;
    Ok((StatusCode::CREATED, AppJson(run_view(&state, row).await?)))
}

#[utoipa::path(get, path = "/v1/admin/runs", tag = "admin", security(("operator" = [])),
    responses((status = 200, description = "every run", body = Vec<RunView>), (status = 401, description = "missing, unknown or revoked credential", body = ErrorBody),
        (status = 503, description = "store unavailable; retry", body = ErrorBody)))]
async fn list_runs(
    State(state): State<AppState>,
    _op: Operator,
) -> Result<AppJson<Vec<RunView>>, ApiError> {
    let mut out = vec![];
    for row in state.store().runs().await? {
        out.push(run_view(&state, row).await?);
    }
    Ok(AppJson(out))
}

#[utoipa::path(get, path = "/v1/admin/runs/{run_id}", tag = "admin", security(("operator" = [])), params(("run_id" = i64, Path, description = "run")),
    responses((status = 200, description = "the run", body = RunView), (status = 401, description = "missing, unknown or revoked credential", body = ErrorBody),
        (status = 404, description = "no such resource", body = ErrorBody),
        (status = 503, description = "store unavailable; retry", body = ErrorBody)))]
async fn get_run(
    State(state): State<AppState>,
    _op: Operator,
    Path(run_id): Path<i64>,
) -> Result<AppJson<RunView>, ApiError> {
    let row = stored_run(&state, RunId(run_id)).await?;
    Ok(AppJson(run_view(&state, row).await?))
}

/// The model spec a central evaluator builds the run's models from. A run of kind `tensors`
/// has none (its devices' own framework runs the model): 422, saying how to evaluate it instead.
#[utoipa::path(get, path = "/v1/admin/runs/{run_id}/model-spec", tag = "admin", security(("operator" = [])), params(("run_id" = i64, Path, description = "run")),
    responses((status = 200, description = "the run's model spec", body = Object), (status = 401, description = "missing, unknown or revoked credential", body = ErrorBody),
        (status = 404, description = "no such resource", body = ErrorBody),
        (status = 422, description = "the run's model is of kind tensors: no forward pass here", body = ErrorBody),
        (status = 503, description = "store unavailable; retry", body = ErrorBody)))]
async fn get_model_spec(
    State(state): State<AppState>,
    _op: Operator,
    Path(run_id): Path<i64>,
) -> Result<AppJson<serde_json::Value>, ApiError> {
    let row = stored_run(&state, RunId(run_id)).await?;
    let plan: Plan = serde_json::from_str(&row.plan_json).map_err(|e| ApiError::internal(&e))?;
    match plan.model.spec {
        Some(spec) => Ok(AppJson(serde_json::to_value(spec).map_err(|e| ApiError::internal(&e))?)),
        None => Err(ApiError::invalid(format!(
            "run {run_id}'s model is of kind tensors: its devices' trainers run it and the \
             coordinator has no forward pass to evaluate it with; evaluate its exported models \
             (GET /v1/admin/runs/{run_id}/models/{{version}}) in their framework and report the \
             metrics to POST /v1/admin/runs/{run_id}/models/{{version}}/evaluations \
             (docs/operating.md, \"Evaluating a run of kind tensors\")"
        ))),
    }
}

/// What a run's views may show of its rounds' cohorts.
#[derive(Debug, Clone, Copy)]
struct Disclosure {
    /// Each device's example count: not in a differentially private run.
    example_counts: bool,
    /// Cohort sizes and who was drawn: not in a differentially private run with Poisson
    /// selection, whose ε assumes the draw stays secret, nor in a `blt_ftrl` run, whose ε
    /// covers a device's presence in a round.
    cohorts: bool,
}

impl Disclosure {
    /// What the run with the stored plan `plan_json` shows; the least, for a plan that does not
    /// read.
    fn of(plan_json: &str) -> Self {
        match serde_json::from_str::<starling_core::plan::Plan>(plan_json) {
            Ok(plan) => {
                let dp = plan.strategy.differential_privacy;
                let poisson = plan.selection == starling_core::plan::SelectionPolicy::Poisson;
                // DP-FTRL's adjacency adds or removes a device from the rounds it took part in:
                // a round's cohort size would say whether it did.
                let blt =
                    dp.is_some_and(|dp| dp.mechanism == starling_core::privacy::Mechanism::BltFtrl);
                Disclosure {
                    example_counts: dp.is_none(),
                    cohorts: !(dp.is_some() && (poisson || blt)),
                }
            }
            Err(_) => Disclosure { example_counts: false, cohorts: false },
        }
    }
}

/// The stored run `run_id`, or 404.
async fn stored_run(state: &AppState, run_id: RunId) -> Result<RunRow, ApiError> {
    state.store().run(run_id).await?.ok_or_else(|| ApiError::not_found(format!("no run {run_id}")))
}

/// The run `run_id` and what its views show, or 404.
async fn disclosed_run(state: &AppState, run_id: i64) -> Result<(RunId, Disclosure), ApiError> {
    let run = stored_run(state, RunId(run_id)).await?;
    Ok((RunId(run.id), Disclosure::of(&run.plan_json)))
}

fn round_view(r: RoundRow, counters: Option<&RoundCounters>, shown: Disclosure) -> RoundView {
    let counters = counters.filter(|_| shown.cohorts);
    let count = |n: Option<i64>| n.filter(|_| shown.cohorts);
    RoundView {
        n_rejected: counters.map(|c| c.rejected),
        upload_bytes: counters.map(|c| c.upload_bytes),
        round_idx: r.round_idx,
        model_version: r.model_version,
        state: r.state,
        opened_at_ms: r.opened_at_ms,
        selection_deadline_ms: r.selection_deadline_ms,
        reporting_deadline_ms: r.reporting_deadline_ms,
        closed_at_ms: r.closed_at_ms,
        n_selected: count(Some(r.n_selected.unwrap_or(0))),
        n_reported: count(Some(r.n_reported.unwrap_or(0))),
        n_dropped: count(r.n_dropped),
        n_stale: r.n_stale,
        outcome: r.outcome_json.and_then(|j| serde_json::from_str(&j).ok()),
        metrics: r.metrics_json.and_then(|j| serde_json::from_str(&j).ok()),
    }
}

async fn existing_run(state: &AppState, run_id: i64) -> Result<RunId, ApiError> {
    stored_run(state, RunId(run_id)).await.map(|run| RunId(run.id))
}

#[utoipa::path(get, path = "/v1/admin/runs/{run_id}/rounds", tag = "admin", security(("operator" = [])), params(("run_id" = i64, Path, description = "run")),
    responses((status = 200, description = "the run's rounds", body = Vec<RoundView>), (status = 401, description = "missing, unknown or revoked credential", body = ErrorBody),
        (status = 404, description = "no such resource", body = ErrorBody),
        (status = 503, description = "store unavailable; retry", body = ErrorBody)))]
async fn list_rounds(
    State(state): State<AppState>,
    _op: Operator,
    Path(run_id): Path<i64>,
) -> Result<AppJson<Vec<RoundView>>, ApiError> {
    let (run_id, shown) = disclosed_run(&state, run_id).await?;
    let counters = state.observer().run_round_counters(run_id);
    let rounds = state.store().rounds(run_id).await?;
    Ok(AppJson(
        rounds
            .into_iter()
            .map(|r| {
                let c = counters.get(&r.round_idx);
                round_view(r, c, shown)
            })
            .collect(),
    ))
}

#[utoipa::path(get, path = "/v1/admin/runs/{run_id}/rounds/{round_idx}", tag = "admin", security(("operator" = [])),
    params(("run_id" = i64, Path, description = "run"), ("round_idx" = i64, Path, description = "round")),
    responses((status = 200, description = "the round", body = RoundView), (status = 401, description = "missing, unknown or revoked credential", body = ErrorBody),
        (status = 404, description = "no such resource", body = ErrorBody),
        (status = 503, description = "store unavailable; retry", body = ErrorBody)))]
async fn get_round(
    State(state): State<AppState>,
    _op: Operator,
    Path((run_id, round_idx)): Path<(i64, i64)>,
) -> Result<AppJson<RoundView>, ApiError> {
    let (run_id, shown) = disclosed_run(&state, run_id).await?;
    let round = state.store().round(run_id, starling_core::RoundIdx(round_idx)).await?;
    let round = round
        .ok_or_else(|| ApiError::not_found(format!("run {run_id} has no round {round_idx}")))?;
    let counters = state.observer().run_round_counters(run_id);
    let c = counters.get(&round.round_idx);
    Ok(AppJson(round_view(round, c, shown)))
}

/// Who was selected for a round and whose contribution reached it: an operator can check that
/// every update came from the devices meant to train the run.
#[utoipa::path(get, path = "/v1/admin/runs/{run_id}/rounds/{round_idx}/devices", tag = "admin", security(("operator" = [])),
    params(("run_id" = i64, Path, description = "run"), ("round_idx" = i64, Path, description = "round")),
    responses((status = 200, description = "the round's selected devices, by id", body = Vec<RoundDeviceView>), (status = 401, description = "missing, unknown or revoked credential", body = ErrorBody),
        (status = 404, description = "no such resource", body = ErrorBody),
        (status = 503, description = "store unavailable; retry", body = ErrorBody)))]
async fn list_round_devices(
    State(state): State<AppState>,
    _op: Operator,
    Path((run_id, round_idx)): Path<(i64, i64)>,
) -> Result<AppJson<Vec<RoundDeviceView>>, ApiError> {
    let (run_id, shown) = disclosed_run(&state, run_id).await?;
    // Who was drawn is the cohort (and its size): a DP run with Poisson selection shows
    // neither.
    if !shown.cohorts {
        return Err(ApiError::invalid(format!(
            "run {run_id} is differentially private with poisson selection or blt_ftrl: its cohorts are not shown"
        )));
    }
    let round_idx = starling_core::RoundIdx(round_idx);
    if state.store().round(run_id, round_idx).await?.is_none() {
        return Err(ApiError::not_found(format!("run {run_id} has no round {round_idx}")));
    }
    let rows = state.store().round_devices(run_id, round_idx).await?;
    Ok(AppJson(
        rows.into_iter()
            .map(|r| RoundDeviceView {
                device_id: r.device_id,
                selected_at_ms: r.selected_at_ms,
                aggregator_id: r.aggregator_id,
                reported: r.reported,
                // A device's example count is a fact about its data: a DP run does not show it
                // (its updates weigh one each, so the count plays no part in the release).
                example_count: r.example_count.filter(|_| shown.example_counts),
            })
            .collect(),
    ))
}

#[utoipa::path(get, path = "/v1/admin/runs/{run_id}/models", tag = "admin", security(("operator" = [])), params(("run_id" = i64, Path, description = "run")),
    responses((status = 200, description = "the run's model versions", body = Vec<ModelView>), (status = 401, description = "missing, unknown or revoked credential", body = ErrorBody),
        (status = 404, description = "no such resource", body = ErrorBody),
        (status = 503, description = "store unavailable; retry", body = ErrorBody)))]
async fn list_models(
    State(state): State<AppState>,
    _op: Operator,
    Path(run_id): Path<i64>,
) -> Result<AppJson<Vec<ModelView>>, ApiError> {
    let run_id = existing_run(&state, run_id).await?;
    let mut evals: BTreeMap<i64, (u64, MetricsAccumulator)> = BTreeMap::new();
    let evaluations = state.store().evaluations(run_id).await?;
    let device_accuracies = device_accuracies(&evaluations);
    for e in evaluations {
        let metrics: BTreeMap<String, f64> =
            serde_json::from_str(&e.metrics_json).unwrap_or_default();
        let entry = evals.entry(e.model_version).or_default();
        entry.0 += 1;
        entry.1.add(e.example_count as u64, &metrics);
    }
    let mut central: BTreeMap<i64, Vec<CentralEvaluation>> = BTreeMap::new();
    for e in state.store().aggregate_evaluations(run_id).await? {
        let metrics: BTreeMap<String, f64> =
            serde_json::from_str(&e.metrics_json).unwrap_or_default();
        match e.source.strip_prefix(CENTRAL_EVALUATION_PREFIX) {
            Some(evaluator) => {
                central.entry(e.model_version).or_default().push(CentralEvaluation {
                    evaluator: evaluator.to_owned(),
                    example_count: e.example_count as u64,
                    metrics,
                })
            }
            // A secure cohort's evaluation arrives pooled: it counts as its devices' reports.
            None => {
                let entry = evals.entry(e.model_version).or_default();
                entry.0 += e.n_devices as u64;
                entry.1.add(e.example_count as u64, &metrics);
            }
        }
    }
    let views = state
        .store()
        .models(run_id)
        .await?
        .into_iter()
        .map(|m: ModelInfo| {
            let (n, acc) = evals.remove(&m.version).unwrap_or_default();
            ModelView {
                version: m.version,
                content_hash: m.content_hash,
                round_idx: m.round_idx,
                created_at_ms: m.created_at_ms,
                given_up: m.given_up,
                n_evaluations: n,
                evaluation: acc.finish(),
                central: central.remove(&m.version).unwrap_or_default(),
                device_accuracy: device_accuracies
                    .get(&m.version)
                    .and_then(|a| DeviceSpread::of(a)),
            }
        })
        .collect();
    Ok(AppJson(views))
}

/// How `GET /v1/admin/runs/{run}/models/{version}` answers.
#[derive(Debug, Default, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
struct ExportQuery {
    /// `safetensors` (the default; tensors named and shaped as the run's schema, f32) or
    /// `payload` (the model as devices download it: CBOR, the schema id and the raw bytes).
    format: Option<String>,
    /// For safetensors: `all` (the default; the model as trained), or for a LoRA run `merged`
    /// (its base model with the adapters merged in) or `adapters` (the adapters alone).
    part: Option<String>,
}

/// A committed model, for the operator: as a safetensors file to load anywhere, or as the raw
/// payload devices download.
#[utoipa::path(get, path = "/v1/admin/runs/{run_id}/models/{version}", tag = "admin", security(("operator" = [])),
    params(("run_id" = i64, Path, description = "run"), ("version" = i64, Path, description = "model version"), ExportQuery),
    responses((status = 200, description = "the model: application/octet-stream (safetensors) or application/cbor (payload)", body = Vec<u8>),
        (status = 401, description = "missing, unknown or revoked credential", body = ErrorBody),
        (status = 404, description = "no such resource", body = ErrorBody),
        (status = 410, description = "not kept: the run's checkpoint interval gave this version up (model_not_kept)", body = ErrorBody),
        (status = 422, description = "unknown format or part, or a LoRA part of a run without adapters", body = ErrorBody),
        (status = 503, description = "store unavailable; retry", body = ErrorBody)))]
async fn export_model(
    State(state): State<AppState>,
    _op: Operator,
    Path((run_id, version)): Path<(i64, i64)>,
    Query(query): Query<ExportQuery>,
) -> Result<axum::response::Response, ApiError> {
    use axum::http::{HeaderValue, header};
    use axum::response::IntoResponse;
    let run_id = existing_run(&state, run_id).await?;
    let format = query.format.as_deref().unwrap_or("safetensors");
    if !matches!(format, "safetensors" | "payload") {
        return Err(ApiError::invalid(format!("format {format:?}: use safetensors or payload")));
    }
    let encoded = state.committed_model(run_id, ModelVersion(version)).await?.ok_or_else(|| {
        ApiError::not_found(format!("run {run_id} has no model version {version}"))
    })?;
    let attachment = |extension: &str| {
        HeaderValue::from_str(&format!(
            "attachment; filename=\"run-{run_id}-model-{version}.{extension}\""
        ))
        .expect("a plain header value")
    };
    let part = query.part.unwrap_or_else(|| "all".to_owned());
    if format == "payload" {
        if part != "all" {
            return Err(ApiError::invalid(format!(
                "part {part:?}: a payload is the whole model as devices download it"
            )));
        }
        let headers = [
            (header::CONTENT_TYPE, HeaderValue::from_static(wire::CBOR_MEDIA_TYPE)),
            (header::CONTENT_DISPOSITION, attachment("cbor")),
        ];
        return Ok((headers, encoded).into_response());
    }
    let plan = state.plan(run_id).await?;
    // Decoding, checking and laying out the file are O(model): off the async threads.
    let file = tokio::task::spawn_blocking(move || {
        let payload: TensorPayload = codec::decode(&encoded).map_err(|e| ApiError::internal(&e))?;
        let schema = plan.schema();
        if payload.schema_id != schema.schema_id() {
            return Err(ApiError::internal(&"a stored model does not match its run's schema"));
        }
        let metadata = BTreeMap::from([
            ("format".to_owned(), "pt".to_owned()),
            ("starling.run".to_owned(), run_id.to_string()),
            ("starling.model_version".to_owned(), version.to_string()),
            ("starling.content_hash".to_owned(), payload.content_hash()),
            ("starling.part".to_owned(), part.clone()),
        ]);
        if part == "all" {
            return Ok(safetensors::to_safetensors(schema, &payload.data, &metadata));
        }
        let values = f32_from_le_bytes(&payload.data);
        let (schema, values) =
            plan.export_part(&part, &values).map_err(|e| ApiError::invalid(e.to_string()))?;
        Ok(safetensors::to_safetensors(&schema, &f32_to_le_bytes(&values), &metadata))
    })
    .await
    .map_err(|e| ApiError::internal(&e))??;
    let headers = [
        (header::CONTENT_TYPE, HeaderValue::from_static("application/octet-stream")),
        (header::CONTENT_DISPOSITION, attachment("safetensors")),
    ];
    Ok((headers, file).into_response())
}

/// How `POST /v1/admin/base-models` and `POST /v1/admin/tokenizers` name what they import.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
struct ImportQuery {
    /// A name for people (1..=128 bytes); the import is addressed by its content hash.
    name: String,
}

impl ImportQuery {
    /// The name, once it is 1..=128 bytes.
    fn name(&self) -> Result<&str, ApiError> {
        if self.name.is_empty() || self.name.len() > 128 {
            return Err(ApiError::invalid("name must be 1..=128 bytes"));
        }
        Ok(&self.name)
    }
}

/// Imports a pretrained model (a safetensors file of F32 tensors, as the body) for plans to
/// start from (`init`: `{"kind": "base_model", "hash": ...}`); answers with its content hash.
/// Importing the same model again answers with the first import.
#[utoipa::path(post, path = "/v1/admin/base-models", tag = "admin", security(("operator" = [])),
    params(ImportQuery),
    request_body(content = Vec<u8>, content_type = "application/octet-stream", description = "a safetensors file of F32 tensors"),
    responses((status = 201, description = "imported (or imported before)", body = BaseModelView),
        (status = 401, description = "missing, unknown or revoked credential", body = ErrorBody),
        (status = 413, description = "larger than this coordinator's --max-model-bytes", body = ErrorBody),
        (status = 422, description = "not a safetensors file of finite F32 tensors, or a bad name", body = ErrorBody),
        (status = 503, description = "store unavailable; retry", body = ErrorBody)))]
async fn import_base_model(
    State(state): State<AppState>,
    _op: Operator,
    Query(query): Query<ImportQuery>,
    body: axum::body::Body,
) -> Result<(StatusCode, AppJson<BaseModelView>), ApiError> {
    let name = query.name()?;
    let file = state.read_body(body, state.base_model_body_limit()).await?;
    let (schema, data, hash) = tokio::task::spawn_blocking(move || {
        let (schema, data) =
            safetensors::read_safetensors(&file).map_err(|e| ApiError::invalid(e.to_string()))?;
        schema.check_f32_bytes(&data).map_err(|e| ApiError::invalid(e.to_string()))?;
        // Addressed as a run's models are: a run started from it and its v0 share the hash.
        let payload = TensorPayload { schema_id: schema.schema_id(), data };
        let hash = payload.content_hash();
        Ok::<_, ApiError>((schema, payload.data, hash))
    })
    .await
    .map_err(|e| ApiError::internal(&e))??;
    let info = state.store().put_base_model(&hash, name, &schema, &data, now_ms()).await?;
    Ok((StatusCode::CREATED, AppJson(base_model_view(&info)?)))
}

/// The tokenizer a plan names is imported, and its ids fit the spec's token input.
async fn check_tokenizer(
    state: &AppState,
    plan: &starling_core::plan::ValidatedPlan,
    hash: &str,
) -> Result<(), ApiError> {
    let invalid = |why: String| {
        ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            ErrorCode::InvalidPlan,
            format!("model.tokenizer: {why}"),
        )
    };
    let info = state
        .store()
        .tokenizer_info(hash)
        .await?
        .ok_or_else(|| invalid(format!("no imported tokenizer has content hash {hash}")))?;
    let vocab = match plan.model_spec().map(|s| s.input) {
        Some(starling_core::model_spec::InputSpec::Tokens { vocab, .. }) => vocab,
        // Plan validation refuses a tokenizer without a token input.
        _ => return Err(invalid("needs a model spec whose input is tokens".into())),
    };
    if info.vocab_size as u64 > vocab {
        return Err(invalid(format!(
            "tokenizer {} has ids up to {}, more than the model's input vocabulary of {vocab}",
            info.name,
            info.vocab_size - 1
        )));
    }
    Ok(())
}

/// Imports a Hugging Face tokenizer (a `tokenizer.json` file, as the body) for plans to name
/// (`model.tokenizer`); answers with its content hash, the SHA-256 of the file. Importing the
/// same file again answers with the first import.
#[utoipa::path(post, path = "/v1/admin/tokenizers", tag = "admin", security(("operator" = [])),
    params(ImportQuery),
    request_body(content = Vec<u8>, content_type = "application/json", description = "a Hugging Face tokenizer.json"),
    responses((status = 201, description = "imported (or imported before)", body = TokenizerView),
        (status = 401, description = "missing, unknown or revoked credential", body = ErrorBody),
        (status = 413, description = "larger than the tokenizer file limit", body = ErrorBody),
        (status = 422, description = "not a tokenizer.json the tokenizers library loads, or a bad name", body = ErrorBody),
        (status = 503, description = "store unavailable; retry", body = ErrorBody)))]
async fn import_tokenizer(
    State(state): State<AppState>,
    _op: Operator,
    Query(query): Query<ImportQuery>,
    body: axum::body::Body,
) -> Result<(StatusCode, AppJson<TokenizerView>), ApiError> {
    use starling_core::tokenizer::{TextTokenizer, content_hash};
    let name = query.name()?;
    let file = state.read_body(body, super::TOKENIZER_BODY_LIMIT).await?;
    // Loaded here as devices will load it, so that a file they could not use is refused now.
    let (file, vocab_size) = tokio::task::spawn_blocking(move || {
        let tokenizer =
            TextTokenizer::parse(&file).map_err(|e| ApiError::invalid(e.to_string()))?;
        Ok::<_, ApiError>((file, tokenizer.vocab_bound()))
    })
    .await
    .map_err(|e| ApiError::internal(&e))??;
    let hash = content_hash(&file);
    let info = state.store().put_tokenizer(&hash, name, vocab_size, &file, now_ms()).await?;
    Ok((StatusCode::CREATED, AppJson(tokenizer_view(info))))
}

/// Every imported tokenizer, oldest first.
#[utoipa::path(get, path = "/v1/admin/tokenizers", tag = "admin", security(("operator" = [])),
    responses((status = 200, description = "the imported tokenizers", body = Vec<TokenizerView>),
        (status = 401, description = "missing, unknown or revoked credential", body = ErrorBody),
        (status = 503, description = "store unavailable; retry", body = ErrorBody)))]
async fn list_tokenizers(
    State(state): State<AppState>,
    _op: Operator,
) -> Result<AppJson<Vec<TokenizerView>>, ApiError> {
    Ok(AppJson(state.store().tokenizers().await?.into_iter().map(tokenizer_view).collect()))
}

fn tokenizer_view(info: crate::store::TokenizerInfo) -> TokenizerView {
    TokenizerView {
        content_hash: info.content_hash,
        name: info.name,
        vocab_size: info.vocab_size as u64,
        bytes: info.bytes as u64,
        created_at_ms: info.created_at_ms,
    }
}

/// Every imported pretrained model, oldest first.
#[utoipa::path(get, path = "/v1/admin/base-models", tag = "admin", security(("operator" = [])),
    responses((status = 200, description = "the imported models", body = Vec<BaseModelView>),
        (status = 401, description = "missing, unknown or revoked credential", body = ErrorBody),
        (status = 503, description = "store unavailable; retry", body = ErrorBody)))]
async fn list_base_models(
    State(state): State<AppState>,
    _op: Operator,
) -> Result<AppJson<Vec<BaseModelView>>, ApiError> {
    let rows = state.store().base_models().await?;
    Ok(AppJson(rows.iter().map(base_model_view).collect::<Result<_, _>>()?))
}

fn base_model_view(info: &crate::store::BaseModelInfo) -> Result<BaseModelView, ApiError> {
    Ok(BaseModelView {
        content_hash: info.content_hash.clone(),
        name: info.name.clone(),
        schema: info.schema()?,
        bytes: info.bytes as u64,
        created_at_ms: info.created_at_ms,
    })
}

/// A central evaluator reports its evaluation of a committed model on its held-out set
/// (`starling-client evaluate`); a second report of the same evaluator replaces the first.
#[utoipa::path(post, path = "/v1/admin/runs/{run_id}/models/{version}/evaluations", tag = "admin", security(("operator" = [])),
    params(("run_id" = i64, Path, description = "run"), ("version" = i64, Path, description = "model version")),
    request_body = CentralEvaluation,
    responses((status = 204, description = "stored"),
        (status = 400, description = "malformed body", body = ErrorBody),
        (status = 401, description = "missing, unknown or revoked credential", body = ErrorBody),
        (status = 404, description = "no such resource", body = ErrorBody),
        (status = 422, description = "invalid field, schema or value", body = ErrorBody),
        (status = 503, description = "store unavailable; retry", body = ErrorBody)))]
async fn report_central_evaluation(
    State(state): State<AppState>,
    _op: Operator,
    Path((run_id, version)): Path<(i64, i64)>,
    AppJson(report): AppJson<CentralEvaluation>,
) -> Result<StatusCode, ApiError> {
    let run_id = existing_run(&state, run_id).await?;
    let name_ok = (1..=64).contains(&report.evaluator.len())
        && report.evaluator.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b));
    if !name_ok {
        return Err(ApiError::invalid("evaluator: 1..=64 of A-Z a-z 0-9 . _ -"));
    }
    if report.example_count == 0 || report.example_count > starling_core::fedavg::MAX_EXAMPLE_COUNT
    {
        return Err(ApiError::invalid("example_count is outside 1..=2^29"));
    }
    starling_core::fedavg::validate_metrics(&report.metrics)?;
    if state.store().model_hash(run_id, ModelVersion(version)).await?.is_none() {
        return Err(ApiError::not_found(format!("run {run_id} has no model version {version}")));
    }
    let metrics = serde_json::to_string(&report.metrics).map_err(|e| ApiError::internal(&e))?;
    state
        .store()
        .put_central_evaluation(
            run_id,
            ModelVersion(version),
            &report.evaluator,
            report.example_count,
            &metrics,
            now_ms(),
        )
        .await?;
    state.observer().evaluation(run_id, version);
    Ok(StatusCode::NO_CONTENT)
}

#[utoipa::path(post, path = "/v1/admin/runs/{run_id}/stop", tag = "admin", security(("operator" = [])), params(("run_id" = i64, Path, description = "run")),
    responses((status = 200, description = "stopped", body = RunView), (status = 401, description = "missing, unknown or revoked credential", body = ErrorBody),
        (status = 404, description = "no such resource", body = ErrorBody),
        (status = 409, description = "conflict (duplicate, stale model, closed round)", body = ErrorBody),
        (status = 503, description = "store unavailable; retry", body = ErrorBody)))]
async fn stop_run(
    State(state): State<AppState>,
    _op: Operator,
    Path(run_id): Path<i64>,
) -> Result<AppJson<RunView>, ApiError> {
    let run_id = existing_run(&state, run_id).await?;
    state.driver().call(|reply| Event::StopRun { run_id, reply }).await?;
    let row = stored_run(&state, run_id).await?;
    Ok(AppJson(run_view(&state, row).await?))
}

#[utoipa::path(get, path = "/v1/admin/devices", tag = "admin", security(("operator" = [])),
    responses((status = 200, description = "every enrolled device", body = Vec<DeviceView>), (status = 401, description = "missing, unknown or revoked credential", body = ErrorBody),
        (status = 503, description = "store unavailable; retry", body = ErrorBody)))]
async fn list_devices(
    State(state): State<AppState>,
    _op: Operator,
) -> Result<AppJson<Vec<DeviceView>>, ApiError> {
    let devices = state.store().devices().await?;
    Ok(AppJson(
        devices
            .into_iter()
            .map(|(DeviceId(device_id), enrolled_at_ms, revoked)| DeviceView {
                device_id,
                enrolled_at_ms,
                revoked,
            })
            .collect(),
    ))
}

/// Revokes a device's credential: from the next request on, the device is refused everywhere
/// (an update it already had acknowledged stays in its round).
#[utoipa::path(post, path = "/v1/admin/devices/{device_id}/revoke", tag = "admin", security(("operator" = [])),
    params(("device_id" = i64, Path, description = "device")),
    responses((status = 200, description = "revoked", body = DeviceView), (status = 401, description = "missing, unknown or revoked credential", body = ErrorBody),
        (status = 404, description = "no such resource", body = ErrorBody),
        (status = 503, description = "store unavailable; retry", body = ErrorBody)))]
async fn revoke_device(
    State(state): State<AppState>,
    _op: Operator,
    Path(device_id): Path<i64>,
) -> Result<AppJson<DeviceView>, ApiError> {
    let enrolled_at_ms = state
        .store()
        .revoke_device(DeviceId(device_id))
        .await?
        .ok_or_else(|| ApiError::not_found(format!("no device {device_id}")))?;
    state.forget_credentials_of(DeviceId(device_id));
    tracing::info!(device = device_id, "device credential revoked");
    Ok(AppJson(DeviceView { device_id, enrolled_at_ms, revoked: true }))
}
