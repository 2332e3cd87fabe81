//! Request limits: rates per device and per client IP (token buckets, answered with 429 and
//! `Retry-After` before any work is done; the SDK treats 429 as transient and retries), and
//! how many fleet requests are handled at once ([`FleetAdmission`]).

use std::collections::HashMap;
use std::hash::Hash;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::{ConnectInfo, Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use tokio::sync::Semaphore;

use super::AppState;
use super::error::ApiError;

/// A sustained rate with a burst allowance.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RateLimit {
    /// Requests per second, sustained.
    pub per_sec: f64,
    /// Requests allowed at once after a quiet period.
    pub burst: f64,
}

/// Buckets kept before idle (full) ones are dropped: bounds memory under many keys.
const MAX_BUCKETS: usize = 100_000;

/// One token bucket per key.
#[derive(Debug)]
pub struct Limiter<K> {
    limit: RateLimit,
    buckets: Mutex<HashMap<K, (f64, Instant)>>,
}

impl<K: Hash + Eq> Limiter<K> {
    /// A limiter enforcing `limit` per key.
    pub fn new(limit: RateLimit) -> Self {
        Limiter { limit, buckets: Mutex::new(HashMap::new()) }
    }

    /// Takes a token for `key` at `now`, or says how long until one is there.
    pub fn check(&self, key: K, now: Instant) -> Result<(), Duration> {
        let RateLimit { per_sec, burst } = self.limit;
        let mut buckets = self.buckets.lock().expect("limiter lock");
        if buckets.len() >= MAX_BUCKETS {
            buckets.retain(|_, (tokens, at)| {
                *tokens + now.duration_since(*at).as_secs_f64() * per_sec < burst
            });
        }
        let (tokens, at) = buckets.entry(key).or_insert((burst, now));
        *tokens = (*tokens + now.duration_since(*at).as_secs_f64() * per_sec).min(burst);
        *at = now;
        if *tokens >= 1.0 {
            *tokens -= 1.0;
            Ok(())
        } else {
            Err(Duration::from_secs_f64((1.0 - *tokens) / per_sec))
        }
    }
}

/// Middleware: refuses a client IP over its rate (when a per-IP limit is configured).
pub async fn limit_ip(
    State(state): State<AppState>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    req: Request,
    next: Next,
) -> Response {
    let ip: IpAddr = peer.ip();
    if let Some(limiter) = state.ip_limiter()
        && let Err(wait) = limiter.check(ip, Instant::now())
    {
        return ApiError::rate_limited(wait, "this address").into_response();
    }
    next.run(req).await
}

/// Fleet requests of each [`FleetKind`] handled at once. A handler in progress holds its future
/// (a check-in's is about 7 KiB: the credential lookup, the driver call) while it waits on the
/// store, the driver or an upload permit; 10 000 devices arriving at once held 10 000 of them,
/// 70 MB. Past this many, a request waits before its handler exists, holding only its parsed
/// head, so memory is O(connections × a head), not O(connections × a handler). Decisions and
/// downloads are served by one driver and one model cache, far fewer at once than this; an
/// upload holds one of [`MAX_CONCURRENT_UPLOADS`](super::MAX_CONCURRENT_UPLOADS) permits while
/// its body is read, and a few times that many are let in to be checked meanwhile.
pub const FLEET_TURNS: [(FleetKind, usize); 3] =
    [(FleetKind::Decision, 512), (FleetKind::Download, 256), (FleetKind::Upload, 512)];

/// How long a fleet request waits for its turn before it is answered 503 with `Retry-After`
/// (the SDK retries; its own deadline for a request is 120 s): a coordinator that cannot get
/// to a request in this long is overloaded or stuck, and the device is better told so.
pub const FLEET_QUEUE_DEADLINE: Duration = Duration::from_secs(60);

/// Paths that do not wait behind the devices: the aggregator tier's, a few authenticated
/// callers whose group sums the round needs.
const UNQUEUED_PREFIX: &str = "/v1/aggregation/";

/// What a fleet request waits on once handled, so what it queues with: each kind has its own
/// turns, so that (say) a queue of uploads waiting for upload permits does not hold back the
/// check-ins and downloads that would keep the driver and the network busy meanwhile.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FleetKind {
    /// Enrolment, check-ins, evaluations: the store and the driver.
    Decision,
    /// Models, base models, tokenizers, secure-aggregation polls (every `GET`).
    Download,
    /// Updates and secure-aggregation messages: model-sized bodies.
    Upload,
}

impl FleetKind {
    fn of(req: &Request) -> FleetKind {
        let path = req.uri().path();
        match *req.method() {
            axum::http::Method::GET => FleetKind::Download,
            axum::http::Method::POST if path.ends_with("/updates") || path.ends_with("/secagg") => {
                FleetKind::Upload
            }
            _ => FleetKind::Decision,
        }
    }
}

/// Admits fleet requests to their handlers, at most so many of each kind at once, each kind
/// in arrival order.
#[derive(Clone)]
pub struct FleetAdmission {
    turns: Arc<[(FleetKind, Semaphore)]>,
    deadline: Duration,
    /// A decision's body is read whole (at most so many bytes, within so long) before it waits
    /// for a turn, so a client trickling one holds no turn: 512 connections trickling
    /// enrolment bodies would otherwise hold every decision's turn for the body deadline.
    /// (Uploads hold theirs while the body is read, but only once the driver admitted them,
    /// and their bodies are bounded by the upload permits; downloads read no body.)
    decision_body: (usize, Duration),
}

impl FleetAdmission {
    /// At most `turns` handlers of each kind at once (a kind not named is not held back); a
    /// request waits for its turn at most `deadline`; a decision's body is read first, within
    /// `decision_body`'s limit and deadline.
    pub fn new(
        turns: &[(FleetKind, usize)],
        deadline: Duration,
        decision_body: (usize, Duration),
    ) -> Self {
        let turns = turns.iter().map(|&(kind, n)| (kind, Semaphore::new(n.max(1)))).collect();
        FleetAdmission { turns, deadline, decision_body }
    }
}

/// Middleware: runs a fleet request's inner layers and handler once it has a turn of its
/// [`FleetKind`], held until the handler has answered (a response body is then sent from
/// memory the handler no longer owns); 503 `Retry-After` when the wait outlasts its deadline.
pub async fn admit_fleet_request(
    State(admission): State<FleetAdmission>,
    req: Request,
    next: Next,
) -> Response {
    let kind = FleetKind::of(&req);
    let turns = admission.turns.iter().find(|(k, _)| *k == kind).map(|(_, turns)| turns);
    let (Some(turns), false) = (turns, req.uri().path().starts_with(UNQUEUED_PREFIX)) else {
        return Box::pin(next.run(req)).await;
    };
    let req = match kind {
        FleetKind::Decision => match read_first(req, admission.decision_body).await {
            Ok(req) => req,
            Err(refused) => return render(refused),
        },
        FleetKind::Download | FleetKind::Upload => req,
    };
    let refused = match tokio::time::timeout(admission.deadline, turns.acquire()).await {
        // Boxed: the inner layers' and the handler's state is allocated once it is the
        // request's turn, not carried in every waiting request's future.
        Ok(turn) => {
            let _turn = turn.expect("fleet turns are never closed");
            return Box::pin(next.run(req)).await;
        }
        Err(_late) => ApiError::new(
            axum::http::StatusCode::SERVICE_UNAVAILABLE,
            starling_core::wire::ErrorCode::Unavailable,
            format!(
                "the coordinator had no turn for this request within {:?}; retry",
                admission.deadline
            ),
        )
        .retry_after(Duration::from_secs(1)),
    };
    render(refused)
}

/// `req` with its body read whole, within `limit` bytes (a larger declared length refused
/// before any is read) and `deadline`.
async fn read_first(
    req: Request,
    (limit, deadline): (usize, Duration),
) -> Result<Request, ApiError> {
    let (parts, body) = req.into_parts();
    super::refuse_declared_over(&parts.headers, limit)?;
    let bytes = super::read_body_within(body, limit, deadline).await?;
    Ok(Request::from_parts(parts, axum::body::Body::from(bytes)))
}

/// An answer from outside the layer that renders the fleet API's errors, so rendered here.
fn render(refused: ApiError) -> Response {
    super::error::render(super::error::ErrorFormat::Cbor, refused.into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bucket_allows_its_burst_then_its_rate() {
        let limiter = Limiter::new(RateLimit { per_sec: 2.0, burst: 3.0 });
        let t0 = Instant::now();
        for _ in 0..3 {
            limiter.check("a", t0).unwrap();
        }
        let wait = limiter.check("a", t0).unwrap_err();
        assert!((wait.as_secs_f64() - 0.5).abs() < 1e-9, "{wait:?}");
        // Another key has its own bucket.
        limiter.check("b", t0).unwrap();
        // Half a second later one token is back, and only one.
        let t1 = t0 + Duration::from_millis(500);
        limiter.check("a", t1).unwrap();
        assert!(limiter.check("a", t1).is_err());
    }

    const BODY: (usize, Duration) = (1024, Duration::from_secs(30));

    /// A router whose handlers say they started, then wait for a release each.
    fn held_routes(
        admission: FleetAdmission,
    ) -> (axum::Router, tokio::sync::mpsc::UnboundedReceiver<String>, Arc<Semaphore>) {
        let (started, entries) = tokio::sync::mpsc::unbounded_channel();
        let release = Arc::new(Semaphore::new(0));
        let handler = {
            let release = release.clone();
            move |uri: axum::http::Uri| {
                let (started, release) = (started.clone(), release.clone());
                async move {
                    started.send(uri.to_string()).expect("the test listens");
                    release.acquire().await.expect("never closed").forget();
                    "done"
                }
            }
        };
        use axum::routing::{get, post};
        // A stand-in for the fleet API, shaped as its paths are (not API routes themselves).
        let [check_in, model, tier] =
            ["/v1/check-in/{n}", "/v1/models/{n}", "/v1/aggregation/poll"];
        let app = axum::Router::new()
            .route(check_in, post(handler.clone()))
            .route(model, get(handler.clone()))
            .route(tier, post(handler))
            .layer(axum::middleware::from_fn_with_state(admission, admit_fleet_request));
        (app, entries, release)
    }

    fn send(app: &axum::Router, method: &str, path: &str) -> tokio::task::JoinHandle<Response> {
        let req = axum::http::Request::builder().method(method).uri(path);
        send_request(app, req.body(axum::body::Body::empty()).unwrap())
    }

    fn send_request(app: &axum::Router, req: Request) -> tokio::task::JoinHandle<Response> {
        use tower::Service;
        let answer = app.clone().call(req);
        tokio::spawn(async move { answer.await.expect("infallible") })
    }

    /// The CBOR error body of a fleet answer.
    async fn error_body(res: Response) -> starling_core::wire::ErrorBody {
        let body = axum::body::to_bytes(res.into_body(), 1 << 16).await.unwrap();
        starling_core::codec::decode(&body).unwrap()
    }

    async fn next_entry(entries: &mut tokio::sync::mpsc::UnboundedReceiver<String>) -> String {
        tokio::time::timeout(Duration::from_secs(10), entries.recv())
            .await
            .expect("a handler started within 10 s")
            .expect("the router is alive")
    }

    #[tokio::test]
    async fn past_its_kinds_turns_a_fleet_request_waits_before_its_handler_runs() {
        let turns = [(FleetKind::Decision, 2), (FleetKind::Download, 1)];
        let (app, mut entries, release) =
            held_routes(FleetAdmission::new(&turns, Duration::from_secs(60), BODY));
        let check_ins: Vec<_> =
            (0..3).map(|n| send(&app, "POST", &format!("/v1/check-in/{n}"))).collect();
        let mut first_two = vec![next_entry(&mut entries).await, next_entry(&mut entries).await];
        first_two.sort();
        assert_eq!(first_two, ["/v1/check-in/0", "/v1/check-in/1"]);
        // Both check-in turns are taken; a download has turns of its own, and the aggregator
        // tier's request does not queue behind devices.
        let others =
            [send(&app, "GET", "/v1/models/0"), send(&app, "POST", "/v1/aggregation/poll")];
        assert_eq!(next_entry(&mut entries).await, "/v1/models/0");
        assert_eq!(next_entry(&mut entries).await, "/v1/aggregation/poll");
        // The third check-in was polled before those (spawned first, on one thread) and is
        // still waiting: its handler has not started.
        assert!(entries.try_recv().is_err(), "a third check-in ran with two turns");
        release.add_permits(1);
        assert_eq!(next_entry(&mut entries).await, "/v1/check-in/2");
        release.add_permits(4);
        for answer in check_ins.into_iter().chain(others) {
            assert_eq!(answer.await.unwrap().status(), axum::http::StatusCode::OK);
        }
    }

    #[tokio::test]
    async fn a_fleet_request_without_a_turn_by_its_deadline_is_told_to_retry() {
        let turns = [(FleetKind::Decision, 1)];
        let (app, mut entries, release) =
            held_routes(FleetAdmission::new(&turns, Duration::from_millis(200), BODY));
        let holder = send(&app, "POST", "/v1/check-in/0");
        next_entry(&mut entries).await;
        let waited = tokio::time::Instant::now();
        let late = send(&app, "POST", "/v1/check-in/1");
        let late = tokio::time::timeout(Duration::from_secs(10), late)
            .await
            .expect("answered within 10 s")
            .unwrap();
        assert!(waited.elapsed() >= Duration::from_millis(200), "{:?}", waited.elapsed());
        assert_eq!(late.status(), axum::http::StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(late.headers().get(axum::http::header::RETRY_AFTER).unwrap(), "1");
        let error = error_body(late).await;
        assert_eq!(error.code, starling_core::wire::ErrorCode::Unavailable);
        assert!(error.message.contains("within 200ms; retry"), "{}", error.message);
        assert!(entries.try_recv().is_err(), "the late request's handler ran");
        release.add_permits(1);
        assert_eq!(holder.await.unwrap().status(), axum::http::StatusCode::OK);
    }

    #[tokio::test]
    async fn a_decision_trickling_its_body_holds_no_turn() {
        let turns = [(FleetKind::Decision, 1)];
        let (app, mut entries, release) =
            held_routes(FleetAdmission::new(&turns, Duration::from_secs(60), BODY));
        // A body that has not finished arriving.
        let (chunks, arriving) = tokio::sync::mpsc::unbounded_channel::<&'static [u8]>();
        let stream = futures_util::stream::unfold(arriving, |mut arriving| async move {
            let chunk = arriving.recv().await?;
            Some((Ok::<_, std::io::Error>(chunk), arriving))
        });
        chunks.send(b"part of a body").unwrap();
        let req = axum::http::Request::post("/v1/check-in/0");
        let trickled = send_request(&app, req.body(axum::body::Body::from_stream(stream)).unwrap());
        // The one turn goes to a request whose body is whole, while the other's still arrives.
        let whole = send(&app, "POST", "/v1/check-in/1");
        assert_eq!(next_entry(&mut entries).await, "/v1/check-in/1");
        drop(chunks);
        release.add_permits(1);
        assert_eq!(next_entry(&mut entries).await, "/v1/check-in/0");
        release.add_permits(1);
        for answer in [trickled, whole] {
            assert_eq!(answer.await.unwrap().status(), axum::http::StatusCode::OK);
        }
        // A declared length over the limit is refused before its turn, in the fleet's format.
        let req = axum::http::Request::post("/v1/check-in/2")
            .header(axum::http::header::CONTENT_LENGTH, BODY.0 + 1)
            .body(axum::body::Body::from(vec![0u8; BODY.0 + 1]))
            .unwrap();
        let too_large = send_request(&app, req).await.unwrap();
        assert_eq!(too_large.status(), axum::http::StatusCode::PAYLOAD_TOO_LARGE);
        assert_eq!(error_body(too_large).await.code, starling_core::wire::ErrorCode::BodyTooLarge);
    }

    #[test]
    fn fleet_requests_queue_by_what_they_wait_on() {
        let kind = |method: &str, path: &str| {
            let req = axum::http::Request::builder().method(method).uri(path);
            FleetKind::of(&req.body(axum::body::Body::empty()).unwrap())
        };
        assert_eq!(kind("POST", "/v1/check-in"), FleetKind::Decision);
        assert_eq!(kind("POST", "/v1/enroll"), FleetKind::Decision);
        assert_eq!(kind("POST", "/v1/runs/1/evaluations"), FleetKind::Decision);
        assert_eq!(kind("GET", "/v1/models/ab"), FleetKind::Download);
        assert_eq!(kind("GET", "/v1/runs/1/rounds/2/secagg"), FleetKind::Download);
        assert_eq!(kind("POST", "/v1/runs/1/rounds/2/updates"), FleetKind::Upload);
        assert_eq!(kind("POST", "/v1/runs/1/rounds/2/secagg"), FleetKind::Upload);
    }
}
