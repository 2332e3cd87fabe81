//! The fleet API: what devices call, in CBOR.
//!
//! Every body is bounded before it is read, decoded off the async threads when it can be large,
//! and validated before the driver or the store sees it.

use axum::body::Body;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::de::DeserializeOwned;
use starling_core::codec;
use starling_core::compression::Compression;
use starling_core::fedavg::{MAX_EXAMPLE_COUNT, validate_metrics, validate_update};
use starling_core::plan::ModelParts;
use starling_core::tensor::{TensorPayload, f32_from_le_bytes};
use starling_core::wire::{
    CBOR_MEDIA_TYPE, CheckInRequest, CheckInResponse, EnrollRequest, EnrollResponse, ErrorBody,
    ErrorCode, EvaluationReport, SecAggInstruction, SecAggUpload, UploadAck, UploadRequest,
};
use starling_core::{DeviceId, ModelVersion, RoundIdx, RunId};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::{ApiError, AppState, Cbor, DeviceAuth, FleetConnection, random_secret, sha256};
use crate::clock::now_ms;
use crate::driver::{DriverError, Event, Hold};
use crate::model_cache::model_download_id;
use crate::store::DeviceAccess;
use starling_core::round::UploadRejection;

/// Limit for the small fleet messages (everything but uploads).
pub(crate) const SMALL_BODY_LIMIT: usize = 64 * 1024;
/// Room for an upload's envelope (metrics, ids) beyond the tensor bytes.
const UPLOAD_ENVELOPE_LIMIT: usize = 64 * 1024;
/// Room for a secure-aggregation message beyond the masked vector: sealed shares for every
/// neighbour (under 1 KiB each) or unmasking shares.
const SECAGG_ENVELOPE_LIMIT: usize = 256 * 1024;

/// The fleet routes, each with its OpenAPI operation.
pub fn routes() -> OpenApiRouter<AppState> {
    let uploads = OpenApiRouter::new()
        .routes(routes!(upload))
        .layer(axum::middleware::map_response(close_after_upload));
    OpenApiRouter::new()
        .routes(routes!(enroll))
        .routes(routes!(check_in))
        .routes(routes!(model))
        .routes(routes!(base_model))
        .routes(routes!(tokenizer))
        .routes(routes!(trained_part))
        .merge(uploads)
        .routes(routes!(secagg_message, secagg_instruction))
        .routes(routes!(evaluation))
}

/// Ends the connection after an upload. Reading a model-sized body grows the connection's read
/// buffer to about the model's size, and an idle keep-alive connection keeps it: with a fleet of
/// connected devices that would make memory grow with the number of devices, not the model.
/// Reconnecting costs far less than the upload itself.
async fn close_after_upload(mut res: Response) -> Response {
    res.headers_mut().insert(header::CONNECTION, HeaderValue::from_static("close"));
    res
}

/// A round index from a path: rounds count from 0, so a negative one names no round (404, not
/// the 409 "round closed" an earlier round gets).
fn round_path(round_idx: i64) -> Result<RoundIdx, ApiError> {
    if round_idx < 0 {
        return Err(ApiError::not_found(format!("no round {round_idx}: rounds count from 0")));
    }
    Ok(RoundIdx(round_idx))
}

pub(super) async fn decode_small<T: DeserializeOwned>(
    state: &AppState,
    headers: &HeaderMap,
    body: Body,
) -> Result<T, ApiError> {
    check_content_type(headers)?;
    crate::http::refuse_declared_over(headers, SMALL_BODY_LIMIT)?;
    let bytes = state.read_body(body, SMALL_BODY_LIMIT).await?;
    codec::decode(&bytes).map_err(|e| ApiError::malformed(e.to_string()))
}

/// 403 `population_not_allowed` unless the device's enrollment token admits `population`.
fn may_join(access: &DeviceAccess, population: &str) -> Result<(), ApiError> {
    if access.may_join(population) {
        return Ok(());
    }
    Err(ApiError::new(
        StatusCode::FORBIDDEN,
        ErrorCode::PopulationNotAllowed,
        format!("this device's enrollment token does not admit population {population:?}"),
    ))
}

pub(super) fn check_content_type(headers: &HeaderMap) -> Result<(), ApiError> {
    match headers.get(header::CONTENT_TYPE).map(|v| v.to_str().unwrap_or("")) {
        None => Ok(()),
        Some(v) if v.starts_with(CBOR_MEDIA_TYPE) => Ok(()),
        Some(v) => Err(ApiError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            ErrorCode::MalformedBody,
            format!("content-type {v:?} is not {CBOR_MEDIA_TYPE}"),
        )),
    }
}

#[utoipa::path(post, path = "/v1/enroll", tag = "fleet",
    request_body(content = EnrollRequest, content_type = "application/cbor"),
    responses(
        (status = 200, description = "enrolled; keep the credential", body = EnrollResponse, content_type = "application/cbor"),
        (status = 400, description = "malformed body", body = ErrorBody, content_type = "application/cbor"),
        (status = 401, description = "missing, unknown or revoked credential", body = ErrorBody, content_type = "application/cbor"),
        (status = 403, description = "the identity key carries no certificate from the enrolment authority this coordinator requires", body = ErrorBody, content_type = "application/cbor"),
        (status = 408, description = "the body arrived too slowly", body = ErrorBody, content_type = "application/cbor"),
        (status = 413, description = "body over the limit", body = ErrorBody, content_type = "application/cbor"),
        (status = 429, description = "rate limited; see Retry-After", body = ErrorBody, content_type = "application/cbor"),
        (status = 503, description = "store unavailable, or no turn for the request within 60 s; retry (Retry-After)", body = ErrorBody, content_type = "application/cbor")
    ))]
async fn enroll(
    State(state): State<AppState>,
    _connection: FleetConnection,
    headers: HeaderMap,
    body: Body,
) -> Result<Cbor<EnrollResponse>, ApiError> {
    let req: EnrollRequest = decode_small(&state, &headers, body).await?;
    if let Some(authority) = &state.inner.enrolment_authority {
        let certified = match (&req.identity_key, &req.identity_certificate) {
            (Some(key), Some(certificate)) => {
                starling_core::secagg::certificate_is_valid(authority, key, certificate)
            }
            _ => false,
        };
        if !certified {
            return Err(ApiError::new(
                StatusCode::FORBIDDEN,
                ErrorCode::IdentityNotCertified,
                "this coordinator enrolls only identity keys certified by the operator's enrolment authority: send identity_key with its identity_certificate",
            ));
        }
    }
    let credential = random_secret("stdev");
    let device = state
        .store()
        .enroll_device(
            &hex::encode(sha256(req.enrollment_token.as_bytes())),
            &hex::encode(sha256(credential.as_bytes())),
            req.identity_key,
            now_ms(),
        )
        .await?;
    tracing::info!(%device, "device enrolled");
    Ok(Cbor(EnrollResponse { device_id: device, credential }))
}

#[utoipa::path(post, path = "/v1/check-in", tag = "fleet", security(("device" = [])),
    request_body(content = CheckInRequest, content_type = "application/cbor"),
    responses(
        (status = 200, description = "a task, or when to come back", body = CheckInResponse, content_type = "application/cbor"),
        (status = 400, description = "malformed body", body = ErrorBody, content_type = "application/cbor"),
        (status = 401, description = "missing, unknown or revoked credential", body = ErrorBody, content_type = "application/cbor"),
        (status = 403, description = "the device's enrollment token does not admit this population", body = ErrorBody, content_type = "application/cbor"),
        (status = 408, description = "the body arrived too slowly", body = ErrorBody, content_type = "application/cbor"),
        (status = 429, description = "rate limited; see Retry-After", body = ErrorBody, content_type = "application/cbor"),
        (status = 503, description = "store unavailable, or no turn for the request within 60 s; retry (Retry-After)", body = ErrorBody, content_type = "application/cbor")
    ))]
async fn check_in(
    State(state): State<AppState>,
    DeviceAuth(device): DeviceAuth,
    axum::Extension(access): axum::Extension<DeviceAccess>,
    headers: HeaderMap,
    body: Body,
) -> Result<Cbor<CheckInResponse>, ApiError> {
    let req: CheckInRequest = decode_small(&state, &headers, body).await?;
    may_join(&access, &req.population)?;
    let res = state
        .driver()
        .call(|reply| Event::CheckIn {
            device,
            population: req.population,
            attributes: req.attributes,
            reply,
        })
        .await?;
    Ok(Cbor(res))
}

/// The model download's query: the encoding a task's `model_download` names.
#[derive(Debug, serde::Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
struct ModelQuery {
    /// `f16`, `bf16` or `int8:BLOCK` (the task's `model_download`); absent: f32.
    compression: Option<String>,
}

/// Content-addressed model download: immutable, so cacheable forever, with `ETag` revalidation.
/// `?compression=` serves it in a task's download encoding (deterministic, so as immutable).
#[utoipa::path(get, path = "/v1/models/{hash}", tag = "fleet", security(("device" = [])),
    params(("hash" = String, Path, description = "the model's content hash, 64 hex digits"), ModelQuery),
    responses(
        (status = 200, description = "the encoded model (cacheable forever)", body = TensorPayload, content_type = "application/cbor"),
        (status = 304, description = "unchanged (If-None-Match)"),
        (status = 401, description = "missing, unknown or revoked credential", body = ErrorBody, content_type = "application/cbor"),
        (status = 404, description = "no such resource", body = ErrorBody, content_type = "application/cbor"),
        (status = 410, description = "not kept: its run's checkpoint interval gave this version up (model_not_kept); the task is over", body = ErrorBody, content_type = "application/cbor"),
        (status = 422, description = "not a model download encoding", body = ErrorBody, content_type = "application/cbor"),
        (status = 429, description = "rate limited; see Retry-After", body = ErrorBody, content_type = "application/cbor"),
        (status = 503, description = "store unavailable, or no turn for the request within 60 s; retry (Retry-After)", body = ErrorBody, content_type = "application/cbor")
    ))]
async fn model(
    State(state): State<AppState>,
    _device: DeviceAuth,
    Path(hash): Path<String>,
    Query(query): Query<ModelQuery>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    if hash.len() != 64 || !hash.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(ApiError::not_found("model hashes are 64 hex digits"));
    }
    let compression = match &query.compression {
        None => Compression::F32,
        Some(text) => text
            .parse::<Compression>()
            .and_then(|c| c.check_model().map(|()| c))
            .map_err(|e| ApiError::invalid(format!("compression: {e}")))?,
    };
    let etag = format!("\"{}\"", model_download_id(&hash, compression));
    let matches = headers
        .get(header::IF_NONE_MATCH)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.split(',').any(|t| t.trim() == etag || t.trim() == "*"));
    let cache = [
        (header::ETAG, HeaderValue::from_str(&etag).expect("hex is a valid header")),
        (header::CACHE_CONTROL, HeaderValue::from_static("public, max-age=31536000, immutable")),
    ];
    // Looked up first even for a conditional request: "not modified" is only true of a model
    // that exists.
    let bytes = state
        .model_bytes_in(&hash, compression)
        .await?
        .ok_or_else(|| ApiError::not_found("no model with this hash"))?;
    if matches {
        return Ok((StatusCode::NOT_MODIFIED, cache).into_response());
    }
    Ok((cache, [(header::CONTENT_TYPE, HeaderValue::from_static(CBOR_MEDIA_TYPE))], bytes)
        .into_response())
}

/// A CBOR body addressed by content, which never changes: cacheable forever.
fn immutable_cbor(body: impl Into<axum::body::Bytes>) -> Response {
    let headers = [
        (header::CACHE_CONTROL, HeaderValue::from_static("public, max-age=31536000, immutable")),
        (header::CONTENT_TYPE, HeaderValue::from_static(CBOR_MEDIA_TYPE)),
    ];
    (headers, body.into()).into_response()
}

/// An imported pretrained model, for devices of runs that never train its tensors (their
/// tasks name it): fetched once, the same for every run started from it.
#[utoipa::path(get, path = "/v1/base-models/{hash}", tag = "fleet", security(("device" = [])),
    params(("hash" = String, Path, description = "the imported model's content hash, 64 hex digits")),
    responses(
        (status = 200, description = "the model and its tensors (cacheable forever)", body = starling_core::wire::BaseModelDownload, content_type = "application/cbor"),
        (status = 401, description = "missing, unknown or revoked credential", body = ErrorBody, content_type = "application/cbor"),
        (status = 404, description = "no such resource", body = ErrorBody, content_type = "application/cbor"),
        (status = 503, description = "store unavailable, or no turn for the request within 60 s; retry (Retry-After)", body = ErrorBody, content_type = "application/cbor")
    ))]
async fn base_model(
    State(state): State<AppState>,
    _device: DeviceAuth,
    Path(hash): Path<String>,
) -> Result<Response, ApiError> {
    let (info, data) = state
        .store()
        .base_model(&hash)
        .await?
        .ok_or_else(|| ApiError::not_found("no imported model with this hash"))?;
    let schema = info.schema()?;
    let body = tokio::task::spawn_blocking(move || {
        let payload = TensorPayload { schema_id: schema.schema_id(), data };
        codec::to_vec(&starling_core::wire::BaseModelDownload { schema, payload })
            .map_err(|e| ApiError::internal(&e))
    })
    .await
    .map_err(|e| ApiError::internal(&e))??;
    Ok(immutable_cbor(body))
}

/// An imported tokenizer's `tokenizer.json`, for devices whose tasks name it: fetched once,
/// the same for every run that names it; the device checks its SHA-256 against the name.
#[utoipa::path(get, path = "/v1/tokenizers/{hash}", tag = "fleet", security(("device" = [])),
    params(("hash" = String, Path, description = "the tokenizer's content hash, 64 hex digits")),
    responses(
        (status = 200, description = "the tokenizer.json file (cacheable forever)", body = Vec<u8>, content_type = "application/json"),
        (status = 401, description = "missing, unknown or revoked credential", body = ErrorBody, content_type = "application/cbor"),
        (status = 404, description = "no such resource", body = ErrorBody, content_type = "application/cbor"),
        (status = 503, description = "store unavailable, or no turn for the request within 60 s; retry (Retry-After)", body = ErrorBody, content_type = "application/cbor")
    ))]
async fn tokenizer(
    State(state): State<AppState>,
    _device: DeviceAuth,
    Path(hash): Path<String>,
) -> Result<Response, ApiError> {
    let file = state
        .store()
        .tokenizer_file(&hash)
        .await?
        .ok_or_else(|| ApiError::not_found("no imported tokenizer with this hash"))?;
    let headers = [
        (header::CACHE_CONTROL, HeaderValue::from_static("public, max-age=31536000, immutable")),
        (header::CONTENT_TYPE, HeaderValue::from_static("application/json")),
    ];
    Ok((headers, file).into_response())
}

/// The tensors a run trains of one of its models (the update's and the local ones, in f32):
/// what a device whose task names a base model downloads each round instead of the whole model.
#[utoipa::path(get, path = "/v1/runs/{run_id}/models/{hash}/trained", tag = "fleet", security(("device" = [])),
    params(("run_id" = i64, Path, description = "run"), ("hash" = String, Path, description = "the model's content hash")),
    responses(
        (status = 200, description = "the trained tensors' values (cacheable forever)", body = TensorPayload, content_type = "application/cbor"),
        (status = 401, description = "missing, unknown or revoked credential", body = ErrorBody, content_type = "application/cbor"),
        (status = 404, description = "no such resource", body = ErrorBody, content_type = "application/cbor"),
        (status = 410, description = "not kept (model_not_kept); the task is over", body = ErrorBody, content_type = "application/cbor"),
        (status = 503, description = "store unavailable, or no turn for the request within 60 s; retry (Retry-After)", body = ErrorBody, content_type = "application/cbor")
    ))]
async fn trained_part(
    State(state): State<AppState>,
    _device: DeviceAuth,
    axum::Extension(access): axum::Extension<DeviceAccess>,
    Path((run_id, hash)): Path<(i64, String)>,
) -> Result<Response, ApiError> {
    let plan = state.plan(RunId(run_id)).await?;
    // Only to devices that may train this run: its population's.
    may_join(&access, &plan.plan().population)?;
    // Sliced once per run and model, then served from the model cache: decoding the whole
    // model per request once cost ~95 MB of transient memory for a 92-byte answer.
    let (cache, key) = (state.driver().models(), format!("{hash}/trained/{run_id}"));
    if let Some(cached) = cache.get(&key) {
        return Ok(immutable_cbor(cached));
    }
    // The whole model first (it takes the cache's loading lock itself), then the slicing under
    // that lock, so that a cohort asking at once slices it once.
    let bytes = state
        .model_bytes_in(&hash, Compression::F32)
        .await?
        .ok_or_else(|| ApiError::not_found("no model with this hash"))?;
    let _loading = cache.loading().await;
    if let Some(cached) = cache.get(&key) {
        return Ok(immutable_cbor(cached));
    }
    let body = tokio::task::spawn_blocking(move || {
        let payload: TensorPayload = codec::decode(&bytes).map_err(|e| ApiError::internal(&e))?;
        if payload.schema_id != plan.schema().schema_id() {
            return Err(ApiError::not_found("no model of this run has this hash"));
        }
        let trained = plan.trained_schema();
        let parts = ModelParts::of_update(plan.schema(), trained.clone(), vec![])
            .expect("the trained tensors are the model's, in its order");
        let values = parts.update_of(&f32_from_le_bytes(&payload.data));
        codec::to_vec(&trained.encode_f32(&values)).map_err(|e| ApiError::internal(&e))
    })
    .await
    .map_err(|e| ApiError::internal(&e))??;
    Ok(immutable_cbor(cache.insert(&key, body.into())))
}

#[utoipa::path(post, path = "/v1/runs/{run_id}/rounds/{round_idx}/updates", tag = "fleet", security(("device" = [])),
    params(("run_id" = i64, Path, description = "run"), ("round_idx" = i64, Path, description = "round")),
    request_body(content = UploadRequest, content_type = "application/cbor", description = "at most the delta's size in the run's encoding (f32: the model's size) plus 64 KiB"),
    responses(
        (status = 200, description = "acknowledged: durably stored, never lost", body = UploadAck, content_type = "application/cbor"),
        (status = 400, description = "malformed body", body = ErrorBody, content_type = "application/cbor"),
        (status = 401, description = "missing, unknown or revoked credential", body = ErrorBody, content_type = "application/cbor"),
        (status = 403, description = "the device was not selected for this round (refused before the body is read)", body = ErrorBody, content_type = "application/cbor"),
        (status = 404, description = "no such resource", body = ErrorBody, content_type = "application/cbor"),
        (status = 408, description = "the body arrived too slowly", body = ErrorBody, content_type = "application/cbor"),
        (status = 409, description = "conflict (duplicate, another upload of the device in progress, stale model, closed round)", body = ErrorBody, content_type = "application/cbor"),
        (status = 413, description = "body, or its declared Content-Length, over the limit", body = ErrorBody, content_type = "application/cbor"),
        (status = 422, description = "invalid field, schema or value", body = ErrorBody, content_type = "application/cbor"),
        (status = 429, description = "rate limited; see Retry-After", body = ErrorBody, content_type = "application/cbor"),
        (status = 503, description = "store unavailable, or no turn for the request within 60 s; retry (Retry-After)", body = ErrorBody, content_type = "application/cbor")
    ))]
async fn upload(
    State(state): State<AppState>,
    DeviceAuth(device): DeviceAuth,
    Path((run_id, round_idx)): Path<(i64, i64)>,
    headers: HeaderMap,
    body: Body,
) -> Result<Cbor<UploadAck>, ApiError> {
    let (run_id, round_idx) = (RunId(run_id), round_path(round_idx)?);
    let accepted = match accept_upload(&state, device, run_id, round_idx, &headers, body).await {
        Err(e) if e.code() == ErrorCode::RoundClosed => {
            Err(duplicate_if_durable(&state, device, run_id, round_idx, e).await)
        }
        accepted => accepted,
    };
    match accepted {
        Ok((ack, bytes)) => {
            state.observer().upload_accepted(run_id, round_idx, bytes);
            Ok(Cbor(ack))
        }
        Err(e) => {
            state.observer().upload_rejected(run_id, round_idx, e.code().as_str());
            Err(e)
        }
    }
}

/// A refusal because the round (or the run) has closed, turned into `duplicate_upload` when the
/// device's update to that round is durable: its first answer was lost and the round closed
/// before the retry, and a device told `round_closed` would think its values were never
/// counted (top-k's error feedback would send them again).
async fn duplicate_if_durable(
    state: &AppState,
    device: DeviceId,
    run_id: RunId,
    round_idx: RoundIdx,
    closed: ApiError,
) -> ApiError {
    match state.store().has_update(run_id, round_idx, device).await {
        Ok(true) => DriverError::Upload(UploadRejection::Duplicate).into(),
        Ok(false) => closed,
        Err(e) => e.into(),
    }
}

/// Reads, validates and hands an upload to the driver; the acknowledgement and body size.
async fn accept_upload(
    state: &AppState,
    device: DeviceId,
    run_id: RunId,
    round_idx: RoundIdx,
    headers: &HeaderMap,
    body: Body,
) -> Result<(UploadAck, u64), ApiError> {
    check_content_type(headers)?;
    let plan = state.plan(run_id).await?;
    let update_schema = plan.update_schema();
    let limit = plan.max_delta_bytes() as usize + UPLOAD_ENVELOPE_LIMIT;
    let slot = state.admit_upload(headers, limit, (device, run_id, round_idx), false).await?;
    let started = std::time::Instant::now();
    let bytes = state.read_body(body, limit).await?;
    let body_len = bytes.len() as u64;
    let read_ms = started.elapsed().as_secs_f64() * 1e3;
    // Decoding and the finiteness scan are O(model): keep them off the async threads.
    let validated = tokio::task::spawn_blocking(move || {
        let req: UploadRequest =
            codec::decode_large(&bytes).map_err(|e| ApiError::malformed(e.to_string()))?;
        let model_version = req.model_version;
        // A DP run keeps only the clipped metrics block it may noise, or nothing.
        let update = validate_update(&update_schema, plan.compression(), req)?
            .capped(plan.max_examples())
            .map_metrics(|m| plan.metrics_to_fold(m));
        // One device's finite but huge update once took a plain run's model to 2.7e38: it is
        // refused here, alone, before it reaches any sum.
        if let Some(bound) = plan.max_update_norm() {
            let norm = update.norm();
            if norm.is_nan() || norm > bound {
                return Err(ApiError::invalid(format!(
                    "the update's L2 norm {norm:.4e} is over the run's max_update_norm {bound:.4e}"
                )));
            }
        }
        Ok::<_, ApiError>((model_version, update))
    })
    .await
    .map_err(|e| ApiError::internal(&e))?;
    let (model_version, update) = validated.inspect_err(|e| {
        tracing::info!(%run_id, %round_idx, %device, status = %e.status_code(), "upload rejected");
    })?;
    let validated_ms = started.elapsed().as_secs_f64() * 1e3;
    let ack = state
        .driver()
        .call(|reply| {
            // Let go of once the update is folded, where the run stores updates in groups;
            // else with the answer.
            let hold = Hold(Box::new(slot));
            Event::Upload {
                device,
                run_id,
                round_idx,
                model_version,
                update,
                hold: Some(hold),
                reply,
            }
        })
        .await?;
    tracing::debug!(%run_id, %round_idx, %device, read_ms, validated_ms, acked_ms = started.elapsed().as_secs_f64() * 1e3, "upload acknowledged");
    Ok((ack, body_len))
}

/// A stage message of a secure round (SecAgg+); answered once it is durable.
#[utoipa::path(post, path = "/v1/runs/{run_id}/rounds/{round_idx}/secagg", tag = "fleet", security(("device" = [])),
    params(("run_id" = i64, Path, description = "run"), ("round_idx" = i64, Path, description = "round")),
    request_body(content = Vec<u8>, content_type = "application/cbor", description = "a SecAggUpload: advertise_keys, share_keys, masked_input, sign_survivors or unmask"),
    responses(
        (status = 204, description = "accepted and durable"),
        (status = 400, description = "malformed body", body = ErrorBody, content_type = "application/cbor"),
        (status = 401, description = "missing, unknown or revoked credential", body = ErrorBody, content_type = "application/cbor"),
        (status = 403, description = "the device was not selected for this round", body = ErrorBody, content_type = "application/cbor"),
        (status = 404, description = "no such resource", body = ErrorBody, content_type = "application/cbor"),
        (status = 408, description = "the body arrived too slowly", body = ErrorBody, content_type = "application/cbor"),
        (status = 409, description = "another stage is running, or the round is closed", body = ErrorBody, content_type = "application/cbor"),
        (status = 413, description = "body over the limit", body = ErrorBody, content_type = "application/cbor"),
        (status = 422, description = "inconsistent message; the device is excluded from the round", body = ErrorBody, content_type = "application/cbor"),
        (status = 429, description = "rate limited; see Retry-After", body = ErrorBody, content_type = "application/cbor"),
        (status = 503, description = "store unavailable, or no turn for the request within 60 s; retry (Retry-After)", body = ErrorBody, content_type = "application/cbor")
    ))]
async fn secagg_message(
    State(state): State<AppState>,
    DeviceAuth(device): DeviceAuth,
    axum::Extension(access): axum::Extension<DeviceAccess>,
    Path((run_id, round_idx)): Path<(i64, i64)>,
    headers: HeaderMap,
    body: Body,
) -> Result<StatusCode, ApiError> {
    let (run_id, round_idx) = (RunId(run_id), round_path(round_idx)?);
    check_content_type(&headers)?;
    let plan = state.plan(run_id).await?;
    let limit = plan.schema().byte_len() as usize + 4 + SECAGG_ENVELOPE_LIMIT;
    let _slot = state.admit_upload(&headers, limit, (device, run_id, round_idx), true).await?;
    let bytes = state.read_body(body, limit).await?;
    let message = tokio::task::spawn_blocking(move || codec::decode::<SecAggUpload>(&bytes))
        .await
        .map_err(|e| ApiError::internal(&e))?
        .map_err(|e| ApiError::malformed(e.to_string()))?;
    if let SecAggUpload::AdvertiseKeys(keys) = &message {
        // The identity that signs the keys must be the one the device enrolled with: that is
        // what lets its neighbours trust the signature, and not a key of the sender's choosing.
        match access.identity_key {
            None => {
                return Err(ApiError::invalid(
                    "this device enrolled without an identity key, which secure runs need: enroll it again",
                ));
            }
            Some(enrolled) if enrolled != keys.identity => {
                return Err(ApiError::invalid(
                    "the keys are signed by another identity than the one this device enrolled with",
                ));
            }
            Some(_) => {}
        }
    }
    state
        .driver()
        .call(|reply| Event::SecAgg { device, run_id, round_idx, message, reply })
        .await
        .inspect_err(|e| tracing::info!(%run_id, %round_idx, %device, error = %e, "secure-aggregation message refused"))?;
    Ok(StatusCode::NO_CONTENT)
}

/// What the device's secure round needs from it next.
#[utoipa::path(get, path = "/v1/runs/{run_id}/rounds/{round_idx}/secagg", tag = "fleet", security(("device" = [])),
    params(("run_id" = i64, Path, description = "run"), ("round_idx" = i64, Path, description = "round")),
    responses(
        (status = 200, description = "a SecAggInstruction: wait, share_keys, masked_input, sign_survivors, unmask, done or excluded", body = Vec<u8>, content_type = "application/cbor"),
        (status = 401, description = "missing, unknown or revoked credential", body = ErrorBody, content_type = "application/cbor"),
        (status = 403, description = "the device was not selected for this round", body = ErrorBody, content_type = "application/cbor"),
        (status = 404, description = "no such resource", body = ErrorBody, content_type = "application/cbor"),
        (status = 409, description = "the run is not running", body = ErrorBody, content_type = "application/cbor"),
        (status = 422, description = "the run does not aggregate securely", body = ErrorBody, content_type = "application/cbor"),
        (status = 429, description = "rate limited; see Retry-After", body = ErrorBody, content_type = "application/cbor"),
        (status = 503, description = "store unavailable, or no turn for the request within 60 s; retry (Retry-After)", body = ErrorBody, content_type = "application/cbor")
    ))]
async fn secagg_instruction(
    State(state): State<AppState>,
    DeviceAuth(device): DeviceAuth,
    Path((run_id, round_idx)): Path<(i64, i64)>,
) -> Result<Cbor<SecAggInstruction>, ApiError> {
    let (run_id, round_idx) = (RunId(run_id), round_path(round_idx)?);
    let instruction =
        state.driver().call(|reply| Event::SecAggPoll { device, run_id, round_idx, reply }).await?;
    Ok(Cbor(instruction))
}

#[utoipa::path(post, path = "/v1/runs/{run_id}/evaluations", tag = "fleet", security(("device" = [])),
    params(("run_id" = i64, Path, description = "run")),
    request_body(content = EvaluationReport, content_type = "application/cbor"),
    responses(
        (status = 204, description = "stored"),
        (status = 400, description = "malformed body", body = ErrorBody, content_type = "application/cbor"),
        (status = 401, description = "missing, unknown or revoked credential", body = ErrorBody, content_type = "application/cbor"),
        (status = 403, description = "the device was not selected for a round on this model version", body = ErrorBody, content_type = "application/cbor"),
        (status = 404, description = "no such resource", body = ErrorBody, content_type = "application/cbor"),
        (status = 408, description = "the body arrived too slowly", body = ErrorBody, content_type = "application/cbor"),
        (status = 409, description = "conflict (duplicate, stale model, closed round)", body = ErrorBody, content_type = "application/cbor"),
        (status = 422, description = "invalid field, schema or value; or a secure run (its evaluations travel in the masked input)", body = ErrorBody, content_type = "application/cbor"),
        (status = 429, description = "rate limited; see Retry-After", body = ErrorBody, content_type = "application/cbor"),
        (status = 503, description = "store unavailable, or no turn for the request within 60 s; retry (Retry-After)", body = ErrorBody, content_type = "application/cbor")
    ))]
async fn evaluation(
    State(state): State<AppState>,
    DeviceAuth(device): DeviceAuth,
    Path(run_id): Path<i64>,
    headers: HeaderMap,
    body: Body,
) -> Result<StatusCode, ApiError> {
    let run_id = RunId(run_id);
    let report: EvaluationReport = decode_small(&state, &headers, body).await?;
    if report.example_count == 0 || report.example_count > MAX_EXAMPLE_COUNT {
        return Err(ApiError::invalid(format!(
            "example_count {} is outside 1..={MAX_EXAMPLE_COUNT}",
            report.example_count
        )));
    }
    validate_metrics(&report.metrics)?;
    let plan = state.plan(run_id).await?;
    if plan.round_config().secure.is_some() {
        return Err(ApiError::invalid(
            "the run aggregates securely: a device's evaluation travels inside its masked input, never in clear",
        ));
    }
    if !plan.releases_device_metrics() {
        return Err(ApiError::invalid(
            "the run is differentially private: a device's evaluation is not taken on its own (it would be released outside the run's epsilon); with metrics: noised it rides in the update and only the cohort's noised evaluation is released",
        ));
    }
    let ModelVersion(version) = report.model_version;
    if state.store().model_hash(run_id, report.model_version).await?.is_none() {
        return Err(ApiError::not_found(format!("run {run_id} has no model version {version}")));
    }
    if !state.store().selected_for_version(run_id, device, report.model_version).await? {
        return Err(ApiError::new(
            StatusCode::FORBIDDEN,
            ErrorCode::NotSelected,
            format!(
                "the device was not selected for a round of run {run_id} on model version {version}"
            ),
        ));
    }
    let metrics = serde_json::to_string(&report.metrics).map_err(|e| ApiError::internal(&e))?;
    state
        .store()
        .insert_evaluation(
            run_id,
            device,
            report.model_version,
            // Self-reported, like an update's count: it weighs at most the run's cap.
            report.example_count.min(plan.max_examples()),
            &metrics,
            now_ms(),
        )
        .await
        .map_err(|e| match e {
            crate::store::StoreError::Conflict => ApiError::new(
                StatusCode::CONFLICT,
                ErrorCode::DuplicateUpload,
                "device already reported an evaluation of this model version",
            ),
            e => e.into(),
        })?;
    state.observer().evaluation(run_id, version);
    Ok(StatusCode::NO_CONTENT)
}
