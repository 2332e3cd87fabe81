//! The aggregation API: what aggregator nodes call, in CBOR, with the cluster secret as their
//! bearer credential. Polls (liveness + shard assignments), partial reports, and the
//! rendezvous of aggregator groups (where members find their leader, and the NCCL unique id).

use axum::body::Body;
use axum::extract::{FromRequestParts, Path, State};
use axum::http::request::Parts;
use axum::http::{HeaderMap, StatusCode};
use starling_core::codec;
use starling_core::tier::{
    AggregatorHello, AggregatorWork, GroupRendezvous, PartialReport, validate_group_name,
};
use starling_core::wire::{self, ErrorBody};
use starling_core::{RoundIdx, RunId};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::fleet::{check_content_type, decode_small};
use super::{ApiError, AppState, Cbor, bearer, sha256};
use crate::driver::Event;

/// Room in a partial beyond its sums: the device and aggregator lists and metrics.
const PARTIAL_ENVELOPE_LIMIT: usize = 4 * 1024 * 1024;
/// Aggregator groups the coordinator keeps rendezvous documents for.
const MAX_GROUPS: usize = 4096;

/// The aggregation routes, each with its OpenAPI operation.
pub fn routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(poll))
        .routes(routes!(partial))
        .routes(routes!(put_group, get_group))
}

/// An aggregator node, authenticated by the cluster secret.
pub struct AggregatorAuth;

impl FromRequestParts<AppState> for AggregatorAuth {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, ApiError> {
        let secret =
            bearer(parts).ok_or_else(|| ApiError::unauthorized("missing aggregator credential"))?;
        let Some(expected) = state.inner.aggregator_secret_hash else {
            return Err(crate::driver::DriverError::TierOff.into());
        };
        // Digests compare in time independent of where the strings differ.
        if sha256(secret.as_bytes()) == expected {
            Ok(AggregatorAuth)
        } else {
            Err(ApiError::unauthorized("wrong aggregator credential"))
        }
    }
}

/// An aggregator says it is alive and where devices reach it; the answer lists its shards of
/// open rounds. Missing polls for the liveness period counts it as lost.
#[utoipa::path(post, path = "/v1/aggregation/poll", tag = "aggregation", security(("aggregator" = [])),
    request_body(content = AggregatorHello, content_type = "application/cbor"),
    responses((status = 200, description = "its shards", body = AggregatorWork, content_type = "application/cbor"),
        (status = 401, description = "wrong cluster secret", body = ErrorBody, content_type = "application/cbor"),
        (status = 404, description = "no aggregator tier configured", body = ErrorBody, content_type = "application/cbor")))]
async fn poll(
    State(state): State<AppState>,
    _auth: AggregatorAuth,
    headers: HeaderMap,
    body: Body,
) -> Result<Cbor<AggregatorWork>, ApiError> {
    let hello: AggregatorHello = decode_small(&state, &headers, body).await?;
    if hello.url.len() > 2048 || !wire::is_http_url(&hello.url) {
        return Err(ApiError::invalid("url must be an http(s) URL of at most 2048 bytes"));
    }
    state.check_tls_url(&hello.url)?;
    Ok(Cbor(state.driver().call(|reply| Event::AggregatorPoll { hello, reply }).await?))
}

/// An aggregator's partial aggregate of its devices' updates for one round; answered once it
/// is durable.
#[utoipa::path(post, path = "/v1/aggregation/runs/{run_id}/rounds/{round_idx}/partial", tag = "aggregation", security(("aggregator" = [])),
    params(("run_id" = i64, Path, description = "run"), ("round_idx" = i64, Path, description = "round")),
    request_body(content = PartialReport, content_type = "application/cbor"),
    responses((status = 204, description = "durable; the devices count as reported"),
        (status = 400, description = "malformed body", body = ErrorBody, content_type = "application/cbor"),
        (status = 401, description = "wrong cluster secret", body = ErrorBody, content_type = "application/cbor"),
        (status = 409, description = "round closed, already reported, or stale model", body = ErrorBody, content_type = "application/cbor"),
        (status = 413, description = "body too large", body = ErrorBody, content_type = "application/cbor"),
        (status = 422, description = "sums or lists fail validation", body = ErrorBody, content_type = "application/cbor"),
        (status = 503, description = "store unavailable; retry", body = ErrorBody, content_type = "application/cbor")))]
async fn partial(
    State(state): State<AppState>,
    _auth: AggregatorAuth,
    Path((run_id, round_idx)): Path<(i64, i64)>,
    headers: HeaderMap,
    body: Body,
) -> Result<StatusCode, ApiError> {
    let (run_id, round_idx) = (RunId(run_id), RoundIdx(round_idx));
    check_content_type(&headers)?;
    let plan = state.plan(run_id).await?;
    let limit = plan.schema().numel() as usize * 16 + PARTIAL_ENVELOPE_LIMIT;
    let _permit = state.upload_permit().await;
    let bytes = state.read_body(body, limit).await?;
    let (report, sums) = tokio::task::spawn_blocking(move || {
        let report: PartialReport =
            codec::decode(&bytes).map_err(|e| ApiError::malformed(e.to_string()))?;
        let sums = report.validate(plan.schema()).map_err(|e| ApiError::invalid(e.to_string()))?;
        let cap = (report.devices.len() as u64).saturating_mul(plan.max_examples());
        if report.total_weight > cap {
            return Err(ApiError::invalid(format!(
                "total weight {} is more than {} devices can weigh under the run's cap of {} examples",
                report.total_weight,
                report.devices.len(),
                plan.max_examples()
            )));
        }
        Ok::<_, ApiError>((report, sums))
    })
    .await
    .map_err(|e| ApiError::internal(&e))??;
    let (report, sums) = (std::sync::Arc::new(report), std::sync::Arc::new(sums));
    state.driver().call(|reply| Event::Partial { run_id, round_idx, report, sums, reply }).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// The leader of an aggregator group publishes where members find it (and the group's NCCL
/// unique id on GPUs); a restarted leader publishes again, replacing it. Held in memory: a
/// leader republishes periodically, so a restarted coordinator learns it again.
#[utoipa::path(put, path = "/v1/aggregation/groups/{group}", tag = "aggregation", security(("aggregator" = [])),
    params(("group" = String, Path, description = "group name: 1-64 of A-Z a-z 0-9 . _ -")),
    request_body(content = GroupRendezvous, content_type = "application/cbor"),
    responses((status = 204, description = "stored"),
        (status = 400, description = "malformed body or bad group name", body = ErrorBody, content_type = "application/cbor"),
        (status = 401, description = "wrong cluster secret", body = ErrorBody, content_type = "application/cbor"),
        (status = 422, description = "the document fails validation", body = ErrorBody, content_type = "application/cbor")))]
async fn put_group(
    State(state): State<AppState>,
    _auth: AggregatorAuth,
    Path(group): Path<String>,
    headers: HeaderMap,
    body: Body,
) -> Result<StatusCode, ApiError> {
    validate_group_name(&group).map_err(|e| ApiError::malformed(e.to_string()))?;
    let rendezvous: GroupRendezvous = decode_small(&state, &headers, body).await?;
    rendezvous.validate().map_err(|e| ApiError::invalid(e.to_string()))?;
    state.check_tls_url(&rendezvous.leader_url)?;
    let mut groups = state.inner.groups.lock().expect("groups poisoned");
    if groups.len() >= MAX_GROUPS && !groups.contains_key(&group) {
        return Err(ApiError::invalid(format!("at most {MAX_GROUPS} aggregator groups")));
    }
    groups.insert(group, rendezvous);
    Ok(StatusCode::NO_CONTENT)
}

/// Group members look up their leader (404 until it has published).
#[utoipa::path(get, path = "/v1/aggregation/groups/{group}", tag = "aggregation", security(("aggregator" = [])),
    params(("group" = String, Path, description = "group name")),
    responses((status = 200, description = "the leader's document", body = GroupRendezvous, content_type = "application/cbor"),
        (status = 400, description = "bad group name", body = ErrorBody, content_type = "application/cbor"),
        (status = 401, description = "wrong cluster secret", body = ErrorBody, content_type = "application/cbor"),
        (status = 404, description = "not published yet", body = ErrorBody, content_type = "application/cbor")))]
async fn get_group(
    State(state): State<AppState>,
    _auth: AggregatorAuth,
    Path(group): Path<String>,
) -> Result<Cbor<GroupRendezvous>, ApiError> {
    validate_group_name(&group).map_err(|e| ApiError::malformed(e.to_string()))?;
    let groups = state.inner.groups.lock().expect("groups poisoned");
    let found = groups.get(&group).cloned();
    found
        .map(Cbor)
        .ok_or_else(|| ApiError::not_found(format!("group {group:?} has no leader published yet")))
}
