//! The aggregator service: devices upload to it (their ticket from the coordinator is their
//! credential), it reduces each round's shard on a thread of its own, and a poll loop keeps
//! it registered with the coordinator, learns its shards, and reports each shard's partial at
//! the round's deadline (or as soon as every assigned device has uploaded).
//!
//! In an aggregator group ([`crate::group`]) members hand their finished shards to the
//! group's leader, which reports one partial for all of them.
//!
//! An accepted upload is in the reduction, not on disk: an aggregator that dies loses its
//! shard, and the coordinator counts those devices as dropped (the round commits without them
//! if quorum holds). The partial is durable once the coordinator answers 204.

use starling_core::codec;
use starling_core::compression::Compression;
use std::collections::{BTreeSet, HashMap};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use starling_core::fedavg::{PartialSums, ValidatedUpdate, validate_update};
use starling_core::tier::{AggregatorHello, AggregatorWork, PartialReport, ShardTask, TicketKey};
use starling_core::wire::path;
use starling_core::wire::{
    CBOR_MEDIA_TYPE, ErrorBody, ErrorCode, TICKET_HEADER, UploadAck, UploadRequest,
};
use starling_core::{AggregatorId, DeviceId, ModelVersion, RoundIdx, RunId};
use tokio::sync::{Notify, mpsc, oneshot};

use crate::engine::Engine;
use crate::group::{CollectiveOffer, CollectiveTurn, GroupState, HandoffRefusal};
use crate::report::{Link, send_partial};
use crate::shard::ShardAccumulator;

/// Room for an upload's envelope (metrics, ids) beyond the tensor bytes.
const UPLOAD_ENVELOPE_LIMIT: usize = 64 * 1024;
/// Updates queued for a shard's reduction thread before uploads wait (bounds memory).
const QUEUE_DEPTH: usize = 16;
/// How long an upload for a shard this node has not heard of yet waits for the next poll.
const UNKNOWN_SHARD_WAIT: Duration = Duration::from_secs(3);

/// How an aggregator node is set up.
#[derive(Debug, Clone)]
pub struct AggregatorConfig {
    /// Its id (stable across restarts; the coordinator hashes devices onto ids).
    pub id: AggregatorId,
    /// Address to listen on.
    pub listen: SocketAddr,
    /// The URL devices reach it at; default `http://{the bound address}`.
    pub public_url: Option<String>,
    /// The coordinator's base URL.
    pub coordinator_url: String,
    /// The secret shared with the coordinator.
    pub secret: String,
    /// What reduces.
    pub engine: Engine,
    /// The aggregator group this node belongs to, if any: members hand their shards to the
    /// group's leader, which reports one partial for all of them.
    pub group: Option<crate::group::GroupConfig>,
    /// How the node speaks to devices, its coordinator and its group.
    pub tls: TransportSecurity,
}

/// How an aggregator's traffic is protected. Devices send it updates and tickets, and it sends
/// the cluster secret to its coordinator and group leader: TLS unless told otherwise.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TransportSecurity {
    /// Serve TLS with this certificate and key (PEM), and speak only `https://` to the
    /// coordinator and the group leader, verified against `ca` (PEM; `None`: the platform's
    /// trust store).
    Tls {
        /// Certificate chain, leaf first.
        cert: std::path::PathBuf,
        /// Its private key.
        key: std::path::PathBuf,
        /// CA certificates the coordinator's and other aggregators' certificates chain to.
        ca: Option<std::path::PathBuf>,
    },
    /// Plain HTTP everywhere: tests, or a private network whose proxies terminate TLS.
    InsecureHttp,
}

/// Why the service could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ServiceError {
    /// The listen address is unavailable.
    #[error("cannot listen on {addr}: {source}")]
    Listen {
        /// The address.
        addr: SocketAddr,
        /// Why.
        source: std::io::Error,
    },
    /// The HTTP client could not be built.
    #[error("http client: {0}")]
    Client(String),
    /// The TLS certificate, key or CA could not be loaded.
    #[error("tls: {0}")]
    Tls(String),
}

/// A running aggregator.
pub struct RunningAggregator {
    /// The bound address.
    pub addr: SocketAddr,
    /// The URL it registered with.
    pub url: String,
    shutdown: Arc<Notify>,
    task: tokio::task::JoinHandle<()>,
}

impl RunningAggregator {
    /// Stops serving and polling.
    pub async fn shutdown(self) {
        self.shutdown.notify_waiters();
        let _ = self.task.await;
    }

    /// Runs until the service stops.
    pub async fn wait(self) {
        let _ = self.task.await;
    }
}

pub(crate) struct Inner {
    pub(crate) config: AggregatorConfig,
    pub(crate) url: String,
    key: TicketKey,
    /// To the coordinator (and, in a group, the leader).
    pub(crate) link: Link,
    pub(crate) shards: Mutex<HashMap<(RunId, RoundIdx), Shard>>,
    poll_now: Notify,
    pub(crate) group: Option<crate::group::GroupState>,
}

/// The body, or 413 past `limit` bytes.
pub(crate) async fn read_body(body: Body, limit: usize) -> Result<bytes::Bytes, Refusal> {
    axum::body::to_bytes(body, limit).await.map_err(|_| {
        Refusal(
            StatusCode::PAYLOAD_TOO_LARGE,
            ErrorCode::BodyTooLarge,
            format!("body exceeds {limit} bytes"),
        )
    })
}

/// CBOR that does not decode: 400.
fn malformed(e: impl std::fmt::Display) -> Refusal {
    Refusal(StatusCode::BAD_REQUEST, ErrorCode::MalformedBody, e.to_string())
}

/// Decodes a CBOR body and runs `then` (its checks) on it, both off the async runtime: 400
/// for what does not decode, 500 if that work panicked.
pub(crate) async fn decode_then<T, U>(
    bytes: bytes::Bytes,
    then: impl FnOnce(T) -> Result<U, Refusal> + Send + 'static,
) -> Result<U, Refusal>
where
    T: serde::de::DeserializeOwned + 'static,
    U: Send + 'static,
{
    decode_with_then(bytes, codec::decode, then).await
}

/// [`decode_then`] with the decoder given (an update's: [`codec::decode_large`]).
pub(crate) async fn decode_with_then<T, U>(
    bytes: bytes::Bytes,
    decode: fn(&[u8]) -> Result<T, codec::CodecError>,
    then: impl FnOnce(T) -> Result<U, Refusal> + Send + 'static,
) -> Result<U, Refusal>
where
    T: 'static,
    U: Send + 'static,
{
    tokio::task::spawn_blocking(move || then(decode(&bytes).map_err(malformed)?)).await.map_err(
        |e| Refusal(StatusCode::INTERNAL_SERVER_ERROR, ErrorCode::Internal, e.to_string()),
    )?
}

/// Work computed on another model version than the round's: 409.
pub(crate) fn stale_model(current: ModelVersion) -> Refusal {
    Refusal(
        StatusCode::CONFLICT,
        ErrorCode::StaleModel,
        format!("the round trains model version {current}"),
    )
}

/// What a shard's reduction thread hands back: the devices in it and their sums.
type Reduced = Result<(Vec<DeviceId>, PartialSums), String>;

pub(crate) struct Shard {
    pub(crate) task: ShardTask,
    pub(crate) deadline: Instant,
    assigned: BTreeSet<DeviceId>,
    received: BTreeSet<DeviceId>,
    queue: Option<mpsc::Sender<(DeviceId, ValidatedUpdate)>>,
    finished: Option<oneshot::Receiver<Reduced>>,
}

/// Starts the service: binds, then serves uploads and polls the coordinator until shut down.
pub async fn start(config: AggregatorConfig) -> Result<RunningAggregator, ServiceError> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let listen_error = |source| ServiceError::Listen { addr: config.listen, source };
    let listener = std::net::TcpListener::bind(config.listen).map_err(listen_error)?;
    listener.set_nonblocking(true).map_err(listen_error)?;
    let addr = listener.local_addr().map_err(listen_error)?;
    let (scheme, server_tls) = match &config.tls {
        TransportSecurity::Tls { cert, key, .. } => {
            let tls = axum_server::tls_rustls::RustlsConfig::from_pem_file(cert, key)
                .await
                .map_err(|e| ServiceError::Tls(format!("{}: {e}", cert.display())))?;
            ("https", Some(tls))
        }
        TransportSecurity::InsecureHttp => ("http", None),
    };
    let url = config.public_url.clone().unwrap_or_else(|| format!("{scheme}://{addr}"));
    let mut http = reqwest::Client::builder().timeout(Duration::from_secs(120));
    if let TransportSecurity::Tls { ca, .. } = &config.tls {
        if !url.starts_with("https://") {
            return Err(ServiceError::Tls(format!(
                "the public URL {url} is not https:// while this node serves TLS"
            )));
        }
        // The cluster secret never travels in clear: to the coordinator and the group leader.
        http = http.https_only(true);
        if let Some(ca) = ca {
            let pem = std::fs::read(ca)
                .map_err(|e| ServiceError::Tls(format!("{}: {e}", ca.display())))?;
            let certs = reqwest::Certificate::from_pem_bundle(&pem)
                .map_err(|e| ServiceError::Tls(format!("{}: {e}", ca.display())))?;
            http = http.tls_certs_only(certs);
        }
    }
    let link = Link {
        http: http.build().map_err(|e| ServiceError::Client(e.to_string()))?,
        coordinator_url: config.coordinator_url.clone(),
        secret: config.secret.clone(),
    };
    let group = config.group.clone().map(|g| {
        GroupState::new(g, &config.engine, (config.id, url.clone(), addr.ip()), link.clone())
    });
    let inner = Arc::new(Inner {
        group,
        key: TicketKey::derive(config.secret.as_bytes()),
        config,
        url: url.clone(),
        link,
        shards: Mutex::new(HashMap::new()),
        poll_now: Notify::new(),
    });
    let app = Router::new()
        .route(path::UPLOAD, post(upload))
        .route(path::GROUP_HANDOFF, post(handoff))
        .route(path::GROUP_COLLECTIVE, post(collective))
        .route(path::LIVEZ, get(|| async { "ok" }))
        .with_state(inner.clone());
    let shutdown = Arc::new(Notify::new());
    tracing::info!(aggregator = %inner.config.id, %addr, %url, engine = inner.config.engine.name(), "aggregator listening");
    let serving = async move {
        let server = axum_server::from_tcp(listener)?;
        match server_tls {
            Some(tls) => {
                server
                    .acceptor(axum_server::tls_rustls::RustlsAcceptor::new(tls))
                    .serve(app.into_make_service())
                    .await
            }
            None => server.serve(app.into_make_service()).await,
        }
    };
    let task = tokio::spawn({
        let shutdown = shutdown.clone();
        async move {
            let stopped = shutdown.notified();
            tokio::pin!(stopped);
            tokio::select! {
                res = serving => {
                    if let Err(e) = res { tracing::error!(error = %e, "http server failed"); }
                }
                () = poll_loop(inner) => {}
                () = &mut stopped => {}
            }
        }
    });
    Ok(RunningAggregator { addr, url, shutdown, task })
}

/// Polls the coordinator, tracks shards, reports the ones that are done.
async fn poll_loop(inner: Arc<Inner>) {
    let hello = AggregatorHello {
        id: inner.config.id,
        url: inner.url.clone(),
        engine: inner.config.engine.name().to_owned(),
    };
    let mut wait = Duration::from_millis(250);
    loop {
        match poll_once(&inner, &hello).await {
            Ok(work) => {
                wait = Duration::from_millis(u64::from(work.poll_after_ms.max(20)));
                track(&inner, work.shards);
            }
            Err(e) => tracing::warn!(error = %e, "polling the coordinator failed; retrying"),
        }
        if let Some(group) = &inner.group {
            group.keep_rendezvous().await;
        }
        for (key, finished, task, deadline) in due_shards(&inner) {
            let inner = inner.clone();
            tokio::spawn(async move { report(&inner, key, task, finished, deadline).await });
        }
        tokio::select! {
            () = tokio::time::sleep(wait) => {}
            () = inner.poll_now.notified() => {}
        }
    }
}

async fn poll_once(inner: &Inner, hello: &AggregatorHello) -> Result<AggregatorWork, String> {
    let body = codec::to_vec(hello).map_err(|e| e.to_string())?;
    let res = inner
        .link
        .cbor_request(reqwest::Method::POST, &inner.link.coordinator(path::AGGREGATOR_POLL))
        .body(body)
        .send()
        .await
        .map_err(|e| e.to_string())?;
    let status = res.status();
    let bytes = res.bytes().await.map_err(|e| e.to_string())?;
    if !status.is_success() {
        let why = codec::decode::<ErrorBody>(&bytes).map_or_else(|_| String::new(), |b| b.message);
        return Err(format!("{status}: {why}"));
    }
    codec::decode(&bytes).map_err(|e| e.to_string())
}

/// Starts shards the coordinator lists for the first time and refreshes the others.
fn track(inner: &Inner, tasks: Vec<ShardTask>) {
    let mut shards = inner.shards.lock().expect("shards poisoned");
    for task in tasks {
        let key = (task.run_id, task.round_idx);
        let assigned: BTreeSet<DeviceId> = task.assigned.iter().copied().collect();
        match shards.get_mut(&key) {
            Some(shard) => {
                shard.assigned = assigned;
                shard.task.selection_over = task.selection_over;
            }
            None => {
                let n_params = task.schema.numel() as usize;
                let reducer = match inner.config.engine.reducer(n_params) {
                    Ok(r) => r,
                    Err(e) => {
                        tracing::error!(run = %task.run_id, round = %task.round_idx, error = %e, "cannot start a reduction; this shard's devices will drop out");
                        continue;
                    }
                };
                let (tx, rx) = mpsc::channel(QUEUE_DEPTH);
                let (done_tx, done_rx) = oneshot::channel();
                std::thread::Builder::new()
                    .name(format!("reduce-{}-{}", task.run_id, task.round_idx))
                    .spawn(move || reduce_thread(ShardAccumulator::new(reducer), rx, done_tx))
                    .expect("spawning a reduction thread");
                tracing::info!(run = %task.run_id, round = %task.round_idx, assigned = assigned.len(), params = n_params, "shard started");
                shards.insert(
                    key,
                    Shard {
                        deadline: Instant::now()
                            + Duration::from_millis(task.reporting_in_ms.max(0) as u64),
                        task,
                        assigned,
                        received: BTreeSet::new(),
                        queue: Some(tx),
                        finished: Some(done_rx),
                    },
                );
            }
        }
    }
}

/// The reduction thread of one shard: folds queued updates until the queue closes.
fn reduce_thread(
    mut acc: ShardAccumulator,
    mut rx: mpsc::Receiver<(DeviceId, ValidatedUpdate)>,
    done: oneshot::Sender<Reduced>,
) {
    let mut failure = None;
    while let Some((device, update)) = rx.blocking_recv() {
        if failure.is_none()
            && let Err(e) = acc.add(device, &update)
        {
            failure = Some(e.to_string());
        }
    }
    let res = match failure {
        Some(e) => Err(e),
        None => acc.finish().map_err(|e| e.to_string()),
    };
    let _ = done.send(res);
}

/// A shard to report: its round, its reduction's result, its task and its deadline.
type Due = ((RunId, RoundIdx), oneshot::Receiver<Reduced>, ShardTask, Instant);

/// Shards whose deadline passed, or whose assigned devices have all uploaded: their queues
/// are closed, so their reduction threads finish.
fn due_shards(inner: &Inner) -> Vec<Due> {
    let now = Instant::now();
    let mut shards = inner.shards.lock().expect("shards poisoned");
    let mut due = vec![];
    for (key, shard) in shards.iter_mut() {
        let complete = shard.task.selection_over
            && !shard.assigned.is_empty()
            && shard.assigned.is_subset(&shard.received);
        if shard.queue.is_some() && (now >= shard.deadline || complete) {
            shard.queue = None;
            if let Some(finished) = shard.finished.take() {
                due.push((*key, finished, shard.task.clone(), shard.deadline));
            }
        }
    }
    // Forget shards long past their deadline (their reports are done or abandoned).
    shards.retain(|_, s| s.queue.is_some() || now < s.deadline + Duration::from_secs(600));
    if let Some(group) = &inner.group {
        group.forget_rounds_but(&shards.keys().copied().collect());
    }
    due
}

/// Waits for a shard's reduction, then reports it: to the coordinator, or in a group through
/// its leader.
async fn report(
    inner: &Inner,
    (run_id, round_idx): (RunId, RoundIdx),
    task: ShardTask,
    finished: oneshot::Receiver<Reduced>,
    deadline: Instant,
) {
    let own = match finished.await {
        Ok(Ok((devices, sums))) if !devices.is_empty() => Some(PartialReport::new(
            task.model_version,
            task.schema.schema_id(),
            vec![inner.config.id],
            devices,
            sums,
        )),
        Ok(Ok(_)) | Err(_) => None,
        Ok(Err(e)) => {
            tracing::error!(run = %run_id, round = %round_idx, error = %e, "reduction failed; this shard's devices drop out");
            None
        }
    };
    let key = (run_id, round_idx);
    match (&inner.group, own) {
        (Some(group), own) if group.is_leader() => group.lead(key, &task, own, deadline).await,
        (_, None) => {
            tracing::info!(run = %run_id, round = %round_idx, "no device uploaded; nothing to report");
        }
        (Some(group), Some(own)) => {
            if let Some(own) = group.hand_to_leader(key, own, deadline).await {
                send_partial(&inner.link, key, own).await;
            }
        }
        (None, Some(own)) => {
            send_partial(&inner.link, key, own).await;
        }
    }
}

/// An error answer in the fleet API's shape, so the SDK reads it like the coordinator's.
pub(crate) struct Refusal(pub(crate) StatusCode, pub(crate) ErrorCode, pub(crate) String);

impl IntoResponse for Refusal {
    fn into_response(self) -> Response {
        let body = ErrorBody { code: self.1, message: self.2 };
        let bytes = codec::to_vec(&body).unwrap_or_default();
        (self.0, [(header::CONTENT_TYPE, HeaderValue::from_static(CBOR_MEDIA_TYPE))], bytes)
            .into_response()
    }
}

/// A device's update: ticket, shard, validation (core's, as on the coordinator), reduction.
async fn upload(
    State(inner): State<Arc<Inner>>,
    Path((run_id, round_idx)): Path<(i64, i64)>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, Refusal> {
    let (run_id, round_idx) = (RunId(run_id), RoundIdx(round_idx));
    let ticket = headers
        .get(TICKET_HEADER)
        .and_then(|v| v.to_str().ok())
        .ok_or_else(|| {
            Refusal(
                StatusCode::UNAUTHORIZED,
                ErrorCode::Unauthorized,
                format!("missing {TICKET_HEADER}"),
            )
        })?
        .to_owned();
    let ShardRules { schema, model_version, max_examples, compression } =
        shard_for(&inner, run_id, round_idx).await?;
    let device = inner
        .key
        .verify(&ticket, run_id, round_idx, model_version, inner.config.id)
        .ok_or_else(|| {
            Refusal(
                StatusCode::UNAUTHORIZED,
                ErrorCode::Unauthorized,
                "the upload ticket is not valid for this round and aggregator".into(),
            )
        })?;
    let limit =
        compression.max_encoded_len(schema.numel() as usize) as usize + UPLOAD_ENVELOPE_LIMIT;
    let bytes = read_body(body, limit).await?;
    let update = decode_with_then(bytes, codec::decode_large, move |req: UploadRequest| {
        if req.model_version != model_version {
            return Err(stale_model(model_version));
        }
        // Validated in the run's encoding, as the coordinator would; the shard reduces the
        // decoded values.
        validate_update(&schema, compression, req)
            .map(|u| u.capped(max_examples))
            .map_err(|e| Refusal(StatusCode::UNPROCESSABLE_ENTITY, e.code(), e.to_string()))
    })
    .await?;
    let queue = {
        let mut shards = inner.shards.lock().expect("shards poisoned");
        let shard = shards.get_mut(&(run_id, round_idx)).ok_or_else(closed)?;
        let queue =
            shard.queue.clone().filter(|_| Instant::now() < shard.deadline).ok_or_else(closed)?;
        if !shard.received.insert(device) {
            return Err(Refusal(
                StatusCode::CONFLICT,
                ErrorCode::DuplicateUpload,
                "device already uploaded in this round".into(),
            ));
        }
        queue
    };
    if queue.send((device, update)).await.is_err() {
        return Err(closed());
    }
    inner.poll_now.notify_one();
    let ack = codec::to_vec(&UploadAck { run_id, round_idx }).unwrap_or_default();
    Ok(([(header::CONTENT_TYPE, HeaderValue::from_static(CBOR_MEDIA_TYPE))], ack).into_response())
}

/// Room in a handed-off shard beyond its sums (16 bytes a parameter).
const HANDOFF_ENVELOPE_LIMIT: usize = 4 * 1024 * 1024;

/// A member hands its finished shard to this node, its group's leader: 202 once taken (the
/// leader now reports it), 409 when the leader already reported the round or has no shard of
/// it (the member then reports alone).
async fn handoff(
    State(inner): State<Arc<Inner>>,
    Path((run_id, round_idx)): Path<(i64, i64)>,
    headers: HeaderMap,
    body: Body,
) -> Result<StatusCode, Refusal> {
    let key = (RunId(run_id), RoundIdx(round_idx));
    let (group, ShardRules { schema, model_version, .. }) =
        as_leader(&inner, &headers, key).await?;
    let limit = schema.numel() as usize * 16 + HANDOFF_ENVELOPE_LIMIT;
    let bytes = read_body(body, limit).await?;
    let report = decode_then(bytes, move |r: PartialReport| {
        check_report(&r, model_version, |r| r.validate(&schema).map(drop))?;
        Ok(r)
    })
    .await?;
    group.take_shard(key, report).map_err(handoff_refusal)?;
    Ok(StatusCode::ACCEPTED)
}

/// A member on this leader's NCCL communicator offers its shard's metadata; the answer waits
/// until every member is in (or the leader's wait is over): 200 with the member's
/// [`CollectiveTurn`] (all-reduce now), or 409 (hand the sums over HTTP, or report alone).
async fn collective(
    State(inner): State<Arc<Inner>>,
    Path((run_id, round_idx)): Path<(i64, i64)>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, Refusal> {
    let key = (RunId(run_id), RoundIdx(round_idx));
    let (group, ShardRules { schema, model_version, .. }) =
        as_leader(&inner, &headers, key).await?;
    let bytes = read_body(body, HANDOFF_ENVELOPE_LIMIT).await?;
    let offer = decode_then(bytes, move |o: CollectiveOffer| {
        check_report(&o.report, model_version, |r| r.validate_metadata(&schema))?;
        Ok(o)
    })
    .await?;
    let deadline = inner
        .shards
        .lock()
        .expect("shards poisoned")
        .get(&key)
        .map_or_else(Instant::now, |s| s.deadline);
    let seq = group.take_offer(key, offer, deadline).await.map_err(handoff_refusal)?;
    let body = codec::to_vec(&CollectiveTurn { seq }).unwrap_or_default();
    Ok(([(header::CONTENT_TYPE, HeaderValue::from_static(CBOR_MEDIA_TYPE))], body).into_response())
}

/// What both hand-off endpoints check first: this node leads a group, the caller holds the
/// cluster secret, and the round's shard is here. The group, and what the shard's updates are
/// checked against.
async fn as_leader<'a>(
    inner: &'a Inner,
    headers: &HeaderMap,
    (run_id, round_idx): (RunId, RoundIdx),
) -> Result<(&'a GroupState, ShardRules), Refusal> {
    let Some(group) = inner.group.as_ref().filter(|g| g.is_leader()) else {
        return Err(handoff_refusal(HandoffRefusal::NotLeader));
    };
    let presented = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or("");
    if !same_secret(presented.as_bytes(), inner.config.secret.as_bytes()) {
        return Err(Refusal(
            StatusCode::UNAUTHORIZED,
            ErrorCode::Unauthorized,
            "missing or wrong cluster secret".into(),
        ));
    }
    let rules = shard_for(inner, run_id, round_idx).await.map_err(|_| {
        Refusal(
            StatusCode::CONFLICT,
            ErrorCode::RoundClosed,
            format!("the leader has no shard of run {run_id} round {round_idx}; report alone"),
        )
    })?;
    Ok((group, rules))
}

/// The model version and the report's own checks, as the hand-offs answer them.
fn check_report(
    report: &PartialReport,
    model_version: ModelVersion,
    check: impl FnOnce(&PartialReport) -> Result<(), starling_core::tier::PartialReportError>,
) -> Result<(), Refusal> {
    if report.model_version != model_version {
        return Err(stale_model(model_version));
    }
    check(report).map_err(|e| {
        Refusal(StatusCode::UNPROCESSABLE_ENTITY, ErrorCode::InvalidField, e.to_string())
    })
}

fn handoff_refusal(why: HandoffRefusal) -> Refusal {
    let (status, code) = match why {
        HandoffRefusal::NotLeader => (StatusCode::NOT_FOUND, ErrorCode::NotFound),
        HandoffRefusal::Closed => (StatusCode::CONFLICT, ErrorCode::RoundClosed),
        HandoffRefusal::Duplicate => (StatusCode::CONFLICT, ErrorCode::DuplicateUpload),
        HandoffRefusal::NotOnCommunicator | HandoffRefusal::NotByCollective => {
            (StatusCode::CONFLICT, ErrorCode::Conflict)
        }
    };
    Refusal(status, code, why.to_string())
}

/// Compares secrets in time that does not depend on where they differ.
fn same_secret(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn closed() -> Refusal {
    Refusal(
        StatusCode::CONFLICT,
        ErrorCode::RoundClosed,
        "the round no longer accepts uploads here".into(),
    )
}

/// What every update of a shard is checked against.
pub(crate) struct ShardRules {
    /// The round's schema.
    pub schema: starling_core::tensor::TensorSchema,
    /// The model version updates must be computed on.
    pub model_version: ModelVersion,
    /// The run's cap on one device's example count.
    pub max_examples: u64,
    /// The encoding the run's devices upload in.
    pub compression: Compression,
}

/// The schema and model version of a shard; waits briefly for the next poll when the shard is
/// not known yet (a device can check in and upload between two polls).
pub(crate) async fn shard_for(
    inner: &Inner,
    run_id: RunId,
    round_idx: RoundIdx,
) -> Result<ShardRules, Refusal> {
    let started = Instant::now();
    loop {
        if let Some(s) = inner.shards.lock().expect("shards poisoned").get(&(run_id, round_idx)) {
            return Ok(ShardRules {
                schema: s.task.schema.clone(),
                model_version: s.task.model_version,
                max_examples: s.task.max_examples,
                compression: s.task.compression,
            });
        }
        if started.elapsed() > UNKNOWN_SHARD_WAIT {
            return Err(Refusal(
                StatusCode::NOT_FOUND,
                ErrorCode::NotFound,
                format!("this aggregator has no shard of run {run_id} round {round_idx}"),
            ));
        }
        inner.poll_now.notify_one();
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_compare_whole() {
        assert!(same_secret(b"abcdefgh", b"abcdefgh"));
        assert!(!same_secret(b"abcdefgh", b"abcdefgx"));
        assert!(!same_secret(b"abcdefgh", b"abcdefg"));
        assert!(!same_secret(b"", b"x"));
    }
}
