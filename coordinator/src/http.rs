//! The HTTP edge: router, shared state, and the extractors every route uses.
//!
//! * [`fleet`]: the device API, CBOR bodies, device credentials.
//! * [`admin`]: the operator API, JSON bodies, the operator credential.
//! * [`aggregation`]: the aggregator tier's API, CBOR bodies, the cluster secret.
//! * [`error`]: the one [`ApiError`] and its rendering.
//!
//! Handlers authenticate, bound and decode input, then either read the store (queries) or ask
//! the driver (anything that changes round state).

pub mod admin;
pub mod aggregation;
pub mod connections;
pub mod credentials;
pub mod error;
pub mod fleet;
pub mod limits;
pub mod live;
pub mod openapi;

use starling_core::codec;
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{FromRequestParts, State};
use axum::http::request::Parts;
use axum::http::{HeaderValue, header};
use axum::middleware;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use serde::Serialize;
use sha2::{Digest, Sha256};
use starling_core::compression::Compression;
use starling_core::plan::{Plan, ValidatedPlan};
use starling_core::tensor::TensorPayload;
use starling_core::wire::{self, CBOR_MEDIA_TYPE};
use starling_core::{DeviceId, ModelVersion, RunId};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

pub use error::ApiError;
use error::{ErrorFormat, render_errors};

use crate::driver::DriverHandle;
use crate::model_cache::{download_payload, model_download_id};
use crate::observe::Observer;
use crate::store::{SqlStore, StoreError};
use limits::{FleetAdmission, Limiter, RateLimit};

/// State shared by every handler.
#[derive(Clone)]
pub struct AppState {
    inner: Arc<Inner>,
}

struct Inner {
    driver: DriverHandle,
    store: SqlStore,
    observer: Observer,
    operator_token_hash: [u8; 32],
    plans: Mutex<HashMap<RunId, Arc<ValidatedPlan>>>,
    uploads: Arc<Semaphore>,
    /// Turns for fleet requests' handlers.
    fleet_admission: FleetAdmission,
    /// Devices with an upload in progress, by run: one at a time to each run, so no device
    /// holds more than one permit per run it was selected in (and a device taking part in two
    /// runs can upload to both at once).
    uploading: Mutex<HashSet<(DeviceId, RunId)>>,
    device_limiter: Option<Limiter<DeviceId>>,
    /// Device credentials the store confirmed lately.
    credentials: credentials::CredentialCache,
    /// A replica, relaying round decisions to the leader.
    replica: bool,
    ip_limiter: Option<Limiter<std::net::IpAddr>>,
    timeouts: Timeouts,
    max_model_bytes: u64,
    require_client_certificate: bool,
    /// The enrolment authority whose certificate an enrolling identity key must carry.
    enrolment_authority: Option<[u8; 32]>,
    /// The coordinator serves TLS: the aggregators it sends devices to must too.
    serves_tls: bool,
    /// SHA-256 of the cluster secret, when the aggregator tier is on.
    aggregator_secret_hash: Option<[u8; 32]>,
    /// Rendezvous documents published by aggregator group leaders, by group name.
    groups: Mutex<HashMap<String, starling_core::tier::GroupRendezvous>>,
}

/// Deadlines that keep slow or stalled clients from holding connections and upload permits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timeouts {
    /// A connection must complete its TLS handshake, and each request its headers, within this.
    pub header: Duration,
    /// Every request body gets this long, plus one second per [`Timeouts::body_min_rate`] bytes of
    /// its size limit (so a model-sized upload on a slow link still fits).
    pub body_grace: Duration,
    /// The slowest body transfer, in bytes per second, that the deadline allows for.
    pub body_min_rate: u64,
    /// A connection with no bytes either way for this long is closed (HTTP/1 keep-alive and
    /// HTTP/2 connections between requests included); see [`connections`].
    pub idle: Duration,
}

impl Default for Timeouts {
    /// 10 s for headers; bodies 30 s plus what 16 KiB/s needs for the size limit; 60 s idle.
    fn default() -> Self {
        Timeouts {
            header: Duration::from_secs(10),
            body_grace: Duration::from_secs(30),
            body_min_rate: 16 * 1024,
            idle: Duration::from_secs(60),
        }
    }
}

impl Timeouts {
    /// The deadline for reading a body of at most `limit` bytes.
    pub fn body_deadline(&self, limit: usize) -> Duration {
        self.body_grace + Duration::from_secs_f64(limit as f64 / self.body_min_rate.max(1) as f64)
    }
}

/// Limits on what clients may ask of the coordinator: request rates (`None` turns one off) and
/// model size.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Limits {
    /// Per authenticated device, on every fleet call.
    pub device: Option<RateLimit>,
    /// Per client IP address, on every fleet call (enrollment included). Fleets behind
    /// carrier-grade NAT share addresses: size it for the largest such group.
    pub ip: Option<RateLimit>,
    /// The largest model a run may have, in bytes of f32 parameters. The coordinator holds a
    /// few copies of the model per run (global model, sums, an encoded commit), so this bounds
    /// what one plan can make it allocate.
    pub max_model_bytes: u64,
}

/// [`Limits::max_model_bytes`] unless configured: 1 GiB, a 268M-parameter model.
pub const DEFAULT_MAX_MODEL_BYTES: u64 = 1 << 30;

impl Default for Limits {
    /// A device makes a handful of calls per round: 10/s with bursts of 30 never touches a
    /// well-behaved one. No per-IP limit unless configured. Models up to 1 GiB.
    fn default() -> Self {
        Limits {
            device: Some(RateLimit { per_sec: 10.0, burst: 30.0 }),
            ip: None,
            max_model_bytes: DEFAULT_MAX_MODEL_BYTES,
        }
    }
}

/// An admitted upload's hold on a permit and on its device's one upload at a time; both are
/// released when it drops.
pub(crate) struct UploadSlot {
    _permit: OwnedSemaphorePermit,
    _device: DeviceUpload,
}

struct DeviceUpload {
    state: AppState,
    device: (DeviceId, RunId),
}

impl Drop for DeviceUpload {
    fn drop(&mut self) {
        self.state.inner.uploading.lock().expect("upload set poisoned").remove(&self.device);
    }
}

/// Uploads processed at once (body, decoded copy and store write each hold a model's worth of
/// memory); further uploads wait for a permit before their body is read, so the coordinator's
/// memory is bounded by this, not by the number of devices.
pub const MAX_CONCURRENT_UPLOADS: usize = 16;

/// The most an HTTP/1 connection's read buffer grows to (hyper's least; its default is about
/// 400 kB). hyper keeps a connection's buffer at the size its reads grew to while it waits for
/// the next request, so every connection that had sent an update kept up to that much: at
/// 2 000 devices × 100k parameters the cap took the (dev-built) coordinator's peak from 132
/// to 108 MiB (with responses already written vectored), the uploads' time unchanged within
/// noise.
pub const CONNECTION_READ_BUFFER: usize = 8 * 1024;

impl AppState {
    /// State over a running driver and its store.
    pub fn new(
        driver: DriverHandle,
        store: SqlStore,
        observer: Observer,
        operator_token: &str,
        limits: Limits,
        timeouts: Timeouts,
    ) -> Self {
        AppState {
            inner: Arc::new(Inner {
                driver,
                store,
                observer,
                operator_token_hash: sha256(operator_token.as_bytes()),
                plans: Mutex::new(HashMap::new()),
                uploads: Arc::new(Semaphore::new(MAX_CONCURRENT_UPLOADS)),
                fleet_admission: FleetAdmission::new(
                    &limits::FLEET_TURNS,
                    limits::FLEET_QUEUE_DEADLINE,
                    (fleet::SMALL_BODY_LIMIT, timeouts.body_deadline(fleet::SMALL_BODY_LIMIT)),
                ),
                uploading: Mutex::new(HashSet::new()),
                device_limiter: limits.device.map(Limiter::new),
                credentials: credentials::CredentialCache::default(),
                replica: false,
                ip_limiter: limits.ip.map(Limiter::new),
                timeouts,
                max_model_bytes: limits.max_model_bytes,
                require_client_certificate: false,
                enrolment_authority: None,
                serves_tls: false,
                aggregator_secret_hash: None,
                groups: Mutex::new(HashMap::new()),
            }),
        }
    }

    /// Under mutual TLS: fleet requests (enrollment included) must come over a connection
    /// that presented a device certificate chaining to the configured CA.
    pub fn requiring_client_certificates(mut self, required: bool) -> Self {
        Arc::get_mut(&mut self.inner)
            .expect("configured before the state is shared")
            .require_client_certificate = required;
        self
    }

    /// Enrollment requires an identity key certified by `authority` (see
    /// [`ServeConfig::enrolment_authority`](crate::ServeConfig::enrolment_authority)).
    pub fn requiring_enrolment_certificates(mut self, authority: Option<[u8; 32]>) -> Self {
        Arc::get_mut(&mut self.inner)
            .expect("configured before the state is shared")
            .enrolment_authority = authority;
        self
    }

    /// A replica's state ([`crate::relay`]): `/leaderz` answers 503, and every device
    /// credential is read from the store, none kept, since revocations go through the leader's
    /// admin API, which forgets only its own copies.
    pub fn serving_as_replica(mut self) -> Self {
        let inner = Arc::get_mut(&mut self.inner).expect("configured before the state is shared");
        inner.credentials = credentials::CredentialCache::keeping_none();
        inner.replica = true;
        self
    }

    /// Whether this is a replica's state.
    fn is_replica(&self) -> bool {
        self.inner.replica
    }

    /// The coordinator serves TLS (so devices' updates must not leave it for plain HTTP).
    pub fn serving_tls(mut self, tls: bool) -> Self {
        Arc::get_mut(&mut self.inner).expect("configured before the state is shared").serves_tls =
            tls;
        self
    }

    /// Refuses an aggregator (or group leader) URL that would downgrade a TLS coordinator's
    /// traffic to plain HTTP: devices would send it their updates in clear.
    fn check_tls_url(&self, url: &str) -> Result<(), ApiError> {
        if self.inner.serves_tls && !url.starts_with("https://") {
            return Err(ApiError::invalid(format!(
                "{url}: this coordinator serves TLS, so its aggregators must too (start them with --tls-cert)"
            )));
        }
        Ok(())
    }

    /// Turns the aggregation API on, authenticating aggregators by `secret`.
    pub fn with_aggregator_secret(mut self, secret: Option<&str>) -> Self {
        Arc::get_mut(&mut self.inner)
            .expect("configured before the state is shared")
            .aggregator_secret_hash = secret.map(|s| sha256(s.as_bytes()));
        self
    }

    /// Refuses a fleet request without a verified device certificate when mutual TLS is on.
    fn check_client_certificate(&self, parts: &Parts) -> Result<(), ApiError> {
        if !self.inner.require_client_certificate {
            return Ok(());
        }
        match parts.extensions.get::<crate::tls::ClientCertificate>() {
            Some(c) if c.verified => Ok(()),
            _ => Err(ApiError::unauthorized(
                "this coordinator requires a device certificate (mutual TLS)",
            )),
        }
    }

    pub(crate) fn store(&self) -> &SqlStore {
        &self.inner.store
    }

    fn ip_limiter(&self) -> Option<&Limiter<std::net::IpAddr>> {
        self.inner.ip_limiter.as_ref()
    }

    fn observer(&self) -> &Observer {
        &self.inner.observer
    }

    pub(crate) fn driver(&self) -> &DriverHandle {
        &self.inner.driver
    }

    /// Admits a model-sized body from `device` to `run_id`'s round `round_idx` before any of it
    /// is read: the declared length fits `limit` (413 at once otherwise), the driver says the
    /// device may send it now (selected, not reported yet), and the device has no other upload
    /// in progress to this run (409). Then it waits for one of the [`MAX_CONCURRENT_UPLOADS`] permits.
    /// Without these checks, a few devices that were never selected could hold every permit
    /// with trickled bodies and starve the cohort's uploads.
    async fn admit_upload(
        &self,
        headers: &axum::http::HeaderMap,
        limit: usize,
        (device, run_id, round_idx): (DeviceId, RunId, starling_core::RoundIdx),
        secure: bool,
    ) -> Result<UploadSlot, ApiError> {
        refuse_declared_over(headers, limit)?;
        self.driver()
            .call(|reply| crate::driver::Event::AdmitPayload {
                device,
                run_id,
                round_idx,
                secure,
                reply,
            })
            .await?;
        if !self.inner.uploading.lock().expect("upload set poisoned").insert((device, run_id)) {
            return Err(ApiError::new(
                axum::http::StatusCode::CONFLICT,
                starling_core::wire::ErrorCode::Conflict,
                "another upload from this device to this run is in progress",
            ));
        }
        let device_slot = DeviceUpload { state: self.clone(), device: (device, run_id) };
        Ok(UploadSlot { _permit: self.upload_permit().await, _device: device_slot })
    }

    /// Forgets a revoked device's checked credentials, so its next request asks the store.
    pub fn forget_credentials_of(&self, device: DeviceId) {
        self.inner.credentials.forget(device);
    }

    /// Waits for one of the [`MAX_CONCURRENT_UPLOADS`] upload permits.
    async fn upload_permit(&self) -> OwnedSemaphorePermit {
        self.inner
            .uploads
            .clone()
            .acquire_owned()
            .await
            .expect("the upload semaphore is never closed")
    }

    /// The model with content hash `hash` as devices download it: the stored payload for f32;
    /// for another `compression` (the plan's `model_download`) a payload of the same schema
    /// whose data is the model's values encoded by [`Compression::encode_model`]. Content-
    /// addressed bytes never change and the encoding is deterministic, so a cached copy is
    /// always right; the cache spares the store the cohort's repeated reads (and a model the
    /// driver just committed is there already, in its run's download encoding).
    async fn model_bytes_in(
        &self,
        hash: &str,
        compression: Compression,
    ) -> Result<Option<Bytes>, ApiError> {
        let (cache, key) = (self.inner.driver.models(), model_download_id(hash, compression));
        if let Some(cached) = cache.get(&key) {
            return Ok(Some(cached));
        }
        let _loading = cache.loading().await;
        if let Some(cached) = cache.get(&key) {
            return Ok(Some(cached));
        }
        let model = match cache.get(hash) {
            Some(model) => model,
            None => {
                let Some(bytes) = self.store().model_by_hash(hash).await? else {
                    return Ok(None);
                };
                cache.insert(hash, Bytes::from(bytes))
            }
        };
        if compression.is_f32() {
            return Ok(Some(model));
        }
        // Only the encoding a plan downloads this model in: any other would let a device make
        // the coordinator encode (and cache, evicting what devices need) a model per request.
        let mut offered = vec![];
        for run in self.store().runs_with_model(hash).await? {
            offered.push(self.plan(run).await?.model_download());
        }
        if !offered.contains(&compression) {
            let offered: Vec<String> =
                offered.iter().filter(|c| !c.is_f32()).map(|c| c.to_string()).collect();
            return Err(ApiError::invalid(format!(
                "compression: this model is downloaded as f32{}{}, not {compression}",
                if offered.is_empty() { "" } else { " or " },
                offered.join(" or ")
            )));
        }
        let encoded = tokio::task::spawn_blocking(move || {
            let payload: TensorPayload = codec::decode_large(&model)?;
            let values = starling_core::tensor::f32_from_le_bytes(&payload.data);
            download_payload(payload.schema_id, &values, compression)
        })
        .await
        .expect("model encoding panicked")
        .map_err(|e| ApiError::internal(&e))?;
        Ok(Some(cache.insert(&key, Bytes::from(encoded))))
    }

    /// A committed model version's payload: from the store, or, for one whose bytes are not
    /// there yet (moments after its commit, or until its run's next checkpoint), from the
    /// model cache, which holds each run's newest.
    async fn committed_model(
        &self,
        run_id: RunId,
        version: ModelVersion,
    ) -> Result<Option<Bytes>, ApiError> {
        match self.store().model(run_id, version).await {
            Ok(stored) => Ok(stored.map(Bytes::from)),
            Err(pending @ StoreError::ModelPending { .. }) => {
                let hash = self.store().model_hash(run_id, version).await?;
                let cached = hash.and_then(|hash| self.inner.driver.models().get(&hash));
                cached.map(Some).ok_or_else(|| pending.into())
            }
            Err(e) => Err(e.into()),
        }
    }

    /// A run's validated plan; plans never change, so they are cached after the first read.
    pub(crate) async fn plan(&self, run_id: RunId) -> Result<Arc<ValidatedPlan>, ApiError> {
        if let Some(plan) = self.inner.plans.lock().expect("plan cache poisoned").get(&run_id) {
            return Ok(plan.clone());
        }
        let row = self
            .store()
            .run(run_id)
            .await?
            .ok_or_else(|| ApiError::not_found(format!("no run {run_id}")))?;
        let plan: Plan =
            serde_json::from_str(&row.plan_json).map_err(|e| ApiError::internal(&e))?;
        let plan = Arc::new(plan.validate().map_err(|e| ApiError::internal(&e))?);
        self.inner.plans.lock().expect("plan cache poisoned").insert(run_id, plan.clone());
        Ok(plan)
    }
}

/// The whole application: the fleet API (CBOR errors, per-IP limit), the admin, observability
/// and health routes (JSON errors), `/openapi.json`, and the dashboard's files.
pub fn router(state: AppState, dashboard_dir: Option<&std::path::Path>) -> Router {
    let [fleet, admin, live] = openapi::api_routes();
    let fleet = fleet_layers(Router::from(fleet), &state);
    let document = Arc::new(openapi::document());
    let admin = Router::from(admin.merge(live))
        .merge(live::dashboard(dashboard_dir))
        .route("/openapi.json", get(move || async move { axum::Json(document.as_ref().clone()) }))
        .fallback(|| async { ApiError::not_found("no such route") })
        // `admin_body` bounds every admin body in size and time; axum's own 2 MB default would
        // refuse a plan carrying a model's initial parameters.
        .layer(axum::extract::DefaultBodyLimit::disable())
        .layer(middleware::from_fn_with_state(state.clone(), admin_body))
        .layer(middleware::from_fn(|req, next| render_errors(ErrorFormat::Json, req, next)));
    fleet.merge(admin).with_state(state)
}

/// The fleet API's layers, outermost first: a turn to be handled
/// ([`limits::admit_fleet_request`]; outermost, so a request waiting for its turn holds no
/// other layer's state), errors rendered as CBOR, the per-IP rate limit.
fn fleet_layers(fleet: Router<AppState>, state: &AppState) -> Router<AppState> {
    let admission = state.inner.fleet_admission.clone();
    fleet
        .layer(middleware::from_fn_with_state(state.clone(), limits::limit_ip))
        .layer(middleware::from_fn(|req, next| render_errors(ErrorFormat::Cbor, req, next)))
        .layer(middleware::from_fn_with_state(admission, limits::admit_fleet_request))
}

/// The largest admin request body, except a new run's plan ([`AppState::plan_body_limit`])
/// a base model's file ([`AppState::base_model_body_limit`]) and a tokenizer's
/// ([`TOKENIZER_BODY_LIMIT`]).
pub const ADMIN_BODY_LIMIT: usize = 2 << 20;

/// The largest tokenizer file an operator may import: Hugging Face's large-vocabulary
/// `tokenizer.json` files are 2–20 MB (Llama 3's, 128k tokens, is 9 MB).
pub const TOKENIZER_BODY_LIMIT: usize = 64 << 20;

/// 413 at once for a body whose declared `Content-Length` is over `limit`: nothing of it is
/// read, and the client is not left sending (or holding) a body that could never be taken.
pub(crate) fn refuse_declared_over(
    headers: &axum::http::HeaderMap,
    limit: usize,
) -> Result<(), ApiError> {
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    match declared.filter(|&n| n > limit as u64) {
        Some(declared) => Err(ApiError::new(
            axum::http::StatusCode::PAYLOAD_TOO_LARGE,
            starling_core::wire::ErrorCode::BodyTooLarge,
            format!("a body of {declared} bytes exceeds the limit of {limit} bytes"),
        )),
        None => Ok(()),
    }
}

/// Reads an admin request's body whole, within its size limit and the body deadline, after
/// checking the operator credential (so nobody else can make the coordinator buffer a large
/// body): a plan may carry a model's initial parameters (`--max-model-bytes`, base64), every
/// other admin body is small. Bodiless requests (GET, the live event stream) pass untouched.
async fn admin_body(
    State(state): State<AppState>,
    req: axum::extract::Request,
    next: middleware::Next,
) -> Result<Response, ApiError> {
    use axum::http::Method;
    if matches!(*req.method(), Method::GET | Method::HEAD | Method::OPTIONS) {
        return Ok(next.run(req).await);
    }
    let (mut parts, body) = req.into_parts();
    Operator::from_request_parts(&mut parts, &state).await?;
    let limit = match (parts.method == Method::POST, parts.uri.path()) {
        (true, wire::path::ADMIN_RUNS) => state.plan_body_limit(),
        (true, wire::path::ADMIN_BASE_MODELS) => state.base_model_body_limit(),
        (true, wire::path::ADMIN_TOKENIZERS) => TOKENIZER_BODY_LIMIT,
        _ => ADMIN_BODY_LIMIT,
    };
    refuse_declared_over(&parts.headers, limit)?;
    let bytes = state.read_body(body, limit).await?;
    Ok(next.run(axum::extract::Request::from_parts(parts, Body::from(bytes))).await)
}

/// What a replica serves while another coordinator leads: the fleet API, whose round decisions
/// it relays to the leader ([`crate::relay`]), and the probes (ready while the store answers);
/// 503 `Retry-After` with the reason for everything else (the admin API, the live stream, the
/// dashboard), which the leader serves.
pub fn replica_router(state: AppState) -> Router {
    let [fleet, _admin, _live] = openapi::api_routes();
    let fleet = fleet_layers(Router::from(fleet), &state);
    let probes = Router::from(health_routes())
        .fallback(|| async { ApiError::not_leader() })
        .layer(middleware::from_fn(|req, next| render_errors(ErrorFormat::Json, req, next)));
    fleet.merge(probes).with_state(state)
}

/// The probes.
fn health_routes() -> utoipa_axum::router::OpenApiRouter<AppState> {
    use utoipa_axum::routes;
    utoipa_axum::router::OpenApiRouter::new()
        .routes(routes!(readyz))
        .routes(routes!(leaderz))
        .routes(routes!(healthz))
        .routes(routes!(livez))
}

/// Readiness for devices: 200 when the store answers and the driver runs (on a replica, the
/// relay to the leader), 503 otherwise.
#[utoipa::path(get, path = "/readyz", tag = "health",
    responses((status = 200, description = "ready for devices", body = String),
        (status = 503, description = "the store does not answer, or the driver is not running", body = wire::ErrorBody)))]
async fn readyz(State(state): State<AppState>) -> Result<&'static str, ApiError> {
    if !state.driver().is_running() {
        return Err(ApiError::new(
            axum::http::StatusCode::SERVICE_UNAVAILABLE,
            starling_core::wire::ErrorCode::Unavailable,
            "the coordinator's driver is not running: no round makes progress; restart it",
        ));
    }
    state.store().ping().await?;
    Ok("ok")
}

/// Whether this coordinator leads and is ready: what routes the admin API (and, to keep every
/// request on the leader, all traffic) to it. Replicas answer 503, the leader as `/readyz`.
#[utoipa::path(get, path = "/leaderz", tag = "health",
    responses((status = 200, description = "this coordinator leads, and is ready", body = String),
        (status = 503, description = "a replica; or the store does not answer, or the driver is not running", body = wire::ErrorBody)))]
async fn leaderz(state: State<AppState>) -> Result<&'static str, ApiError> {
    if state.is_replica() {
        return Err(ApiError::not_leader());
    }
    readyz(state).await
}

/// The container's health check: the same as `/readyz`.
#[utoipa::path(get, path = "/healthz", tag = "health",
    responses((status = 200, description = "ready", body = String),
        (status = 503, description = "the store does not answer, or the driver is not running", body = wire::ErrorBody)))]
async fn healthz(state: State<AppState>) -> Result<&'static str, ApiError> {
    readyz(state).await
}

/// Liveness: answers whenever the process serves HTTP.
#[utoipa::path(get, path = "/livez", tag = "health",
    responses((status = 200, description = "alive", body = String)))]
async fn livez() -> &'static str {
    "ok"
}

/// A CBOR response body.
pub struct Cbor<T>(pub T);

impl<T: Serialize> IntoResponse for Cbor<T> {
    fn into_response(self) -> Response {
        match codec::to_vec(&self.0) {
            Ok(bytes) => {
                ([(header::CONTENT_TYPE, HeaderValue::from_static(CBOR_MEDIA_TYPE))], bytes)
                    .into_response()
            }
            Err(e) => ApiError::internal(&e).into_response(),
        }
    }
}

impl AppState {
    /// The body limit of a new run's plan: its initial parameters in base64 at the model
    /// limit, plus the rest of a plan.
    pub fn plan_body_limit(&self) -> usize {
        let base64 = self.inner.max_model_bytes.div_ceil(3).saturating_mul(4);
        usize::try_from(base64).unwrap_or(usize::MAX).saturating_add(ADMIN_BODY_LIMIT)
    }

    /// The body limit of a base model's import: its values at the model limit, plus the
    /// safetensors header (at most a few hundred bytes a tensor).
    pub fn base_model_body_limit(&self) -> usize {
        usize::try_from(self.inner.max_model_bytes).unwrap_or(usize::MAX).saturating_add(1 << 20)
    }

    /// Reads a whole body, refusing more than `limit` bytes with 413 and a body that has not
    /// arrived by the deadline [`Timeouts::body_deadline`] gives `limit` with 408.
    pub async fn read_body(&self, body: Body, limit: usize) -> Result<Bytes, ApiError> {
        read_body_within(body, limit, self.inner.timeouts.body_deadline(limit)).await
    }
}

/// Reads a whole body of at most `limit` bytes (413 past it) within `deadline` (408 past it).
pub(crate) async fn read_body_within(
    body: Body,
    limit: usize,
    deadline: Duration,
) -> Result<Bytes, ApiError> {
    match tokio::time::timeout(deadline, axum::body::to_bytes(body, limit)).await {
        Ok(Ok(bytes)) => Ok(bytes),
        Ok(Err(_)) => Err(ApiError::new(
            axum::http::StatusCode::PAYLOAD_TOO_LARGE,
            starling_core::wire::ErrorCode::BodyTooLarge,
            format!("body exceeds the limit of {limit} bytes"),
        )),
        Err(_) => Err(ApiError::new(
            axum::http::StatusCode::REQUEST_TIMEOUT,
            starling_core::wire::ErrorCode::Timeout,
            format!("the body did not arrive within {:.0} s", deadline.as_secs_f64()),
        )),
    }
}

/// A connection allowed to call the fleet API: under mutual TLS, one that presented a verified
/// device certificate (enrollment needs it before any credential exists).
pub struct FleetConnection;

impl FromRequestParts<AppState> for FleetConnection {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, ApiError> {
        state.check_client_certificate(parts).map(|()| FleetConnection)
    }
}

/// An authenticated device (`Authorization: Bearer <credential>`), over a connection
/// [`FleetConnection`] admits.
pub struct DeviceAuth(pub DeviceId);

impl FromRequestParts<AppState> for DeviceAuth {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, ApiError> {
        state.check_client_certificate(parts)?;
        let credential =
            bearer(parts).ok_or_else(|| ApiError::unauthorized("missing bearer credential"))?;
        let digest = sha256(credential.as_bytes());
        let began = state.inner.credentials.read_began();
        let access = match state.inner.credentials.get(&digest, std::time::Instant::now()) {
            Some(access) => access,
            None => match state.store().device_access(&hex::encode(digest)).await? {
                Some(access) => {
                    let now = std::time::Instant::now();
                    state.inner.credentials.insert(digest, access.clone(), began, now);
                    access
                }
                None => return Err(ApiError::unauthorized("unknown or revoked device credential")),
            },
        };
        let device = access.device;
        // For the handlers that need more than the id (check-in: where it may join).
        parts.extensions.insert(access);
        if let Some(limiter) = &state.inner.device_limiter
            && let Err(wait) = limiter.check(device, std::time::Instant::now())
        {
            return Err(ApiError::rate_limited(wait, "this device"));
        }
        Ok(DeviceAuth(device))
    }
}

/// The operator (`Authorization: Bearer <operator token>`).
pub struct Operator;

impl FromRequestParts<AppState> for Operator {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, ApiError> {
        let token =
            bearer(parts).ok_or_else(|| ApiError::unauthorized("missing operator credential"))?;
        // Comparing digests keeps the comparison time independent of where the strings differ.
        if sha256(token.as_bytes()) == state.inner.operator_token_hash {
            Ok(Operator)
        } else {
            Err(ApiError::unauthorized("wrong operator credential"))
        }
    }
}

fn bearer(parts: &Parts) -> Option<&str> {
    let value = parts.headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    let token = value.strip_prefix("Bearer ")?.trim();
    (!token.is_empty()).then_some(token)
}

/// SHA-256 of `bytes`.
pub fn sha256(bytes: &[u8]) -> [u8; 32] {
    Sha256::digest(bytes).into()
}

/// A fresh random secret, hex-encoded, with a prefix naming its kind.
pub fn random_secret(prefix: &str) -> String {
    let mut bytes = [0u8; 32];
    getrandom::fill(&mut bytes).expect("the OS random source failed");
    format!("{prefix}_{}", hex::encode(bytes))
}
