//! Starling's coordinator: fleet and admin APIs over a durable store, with one driver task
//! running every run's round state machine.
//!
//! [`start`] is the whole service: connect the store (migrating it), take the leadership lock,
//! rebuild runs from the store, spawn the driver, and serve HTTP.
//! The binary (`starling-coordinator`, `src/bin/`) owns the command line and calls [`start`]; tests start the same service in-process
//! or as a child process.

pub mod clock;
pub mod driver;
pub mod http;
pub mod model_cache;
pub mod observe;
pub mod relay;
pub mod store;
pub mod tier;
pub mod tls;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum_server::tls_rustls::{RustlsAcceptor, RustlsConfig};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::driver::{Driver, DriverHandle};
use crate::http::connections::{ConnectionLimits, GuardedAcceptor};
use crate::store::{SqlStore, StoreError};

/// Everything [`start`] needs, validated.
#[derive(Debug, Clone)]
pub struct ServeConfig {
    /// Address to listen on; port 0 picks a free one.
    pub listen: SocketAddr,
    /// The listening socket's accept queue ([`DEFAULT_LISTEN_BACKLOG`] unless configured).
    pub listen_backlog: u32,
    /// `postgres://...` or `sqlite://...`.
    pub database_url: String,
    /// The operator credential for the admin API.
    pub operator_token: String,
    /// Apply migrations at start.
    pub migrate: bool,
    /// The built dashboard to serve at `/dashboard/`, if any.
    pub dashboard_dir: Option<std::path::PathBuf>,
    /// Request rate limits.
    pub limits: http::Limits,
    /// Deadlines for slow clients.
    pub timeouts: http::Timeouts,
    /// Open connections at most; `None`: all but an eighth of the process's file descriptors
    /// (after raising its soft limit to the hard one), see [`http::connections`].
    pub max_connections: Option<usize>,
    /// Open connections from one IP address at most; `None`: half of `max_connections` (at
    /// least 16); `Some(0)`: no per-address cap (behind a proxy or load balancer).
    pub max_connections_per_ip: Option<usize>,
    /// TLS for the listener; `None` serves plain HTTP (the demo, or behind a TLS proxy).
    pub tls: Option<tls::TlsConfig>,
    /// The aggregator tier; `None` runs every round on the coordinator alone.
    pub tier: Option<tier::TierSettings>,
    /// The operator's enrolment authority (its public key): when set, a device enrolls only
    /// with an identity key the authority certified. Devices that pin it check the same
    /// certificates themselves; this only turns uncertified devices away early.
    pub enrolment_authority: Option<[u8; 32]>,
}

impl ServeConfig {
    /// The deadlines and the connection cap every served connection is held to.
    fn connection_limits(&self) -> (http::Timeouts, ConnectionLimits) {
        let max_connections = self.max_connections.unwrap_or_else(|| {
            let nofile = rlimit::getrlimit(rlimit::Resource::NOFILE).map_or(1024, |(soft, _)| soft);
            ConnectionLimits::max_connections_for(nofile)
        });
        let max_per_ip = self
            .max_connections_per_ip
            .unwrap_or_else(|| ConnectionLimits::max_per_ip_for(max_connections));
        let limits = ConnectionLimits {
            max_connections,
            first_byte: self.timeouts.header,
            idle: self.timeouts.idle,
            max_per_ip,
        };
        (self.timeouts, limits)
    }
}

/// The listening socket's accept queue unless configured. Rust's standard listener asks for
/// 128, and an enrollment burst of thousands of devices then overflows it: the kernel drops
/// SYNs and clients wait out 1, 3, 7 s retransmissions. (The kernel caps it at
/// net.core.somaxconn, 4096 on current Linux.)
pub const DEFAULT_LISTEN_BACKLOG: u32 = 4096;

/// How long in-flight requests get to finish at shutdown before their connections are closed
/// (open event streams never finish by themselves).
const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

/// Why the coordinator could not start or stopped.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ServeError {
    /// The store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The TLS material is unusable.
    #[error(transparent)]
    Tls(#[from] tls::TlsError),
    /// The listener failed.
    #[error("cannot listen on {addr}: {source}")]
    Listen {
        /// Address.
        addr: SocketAddr,
        /// Cause.
        source: std::io::Error,
    },
    /// Serving failed.
    #[error("http server failed: {0}")]
    Serve(#[source] std::io::Error),
    /// The connection holding the leadership lock died: another coordinator may now drive
    /// the runs, so this one stopped (restart it to wait for the lock again).
    #[error("lost the leadership lock (its database connection ended); stopped serving")]
    LeadershipLost,
}

/// A started coordinator.
pub struct RunningCoordinator {
    /// The bound address.
    pub addr: SocketAddr,
    tls: bool,
    shutdown: Option<watch::Sender<bool>>,
    task: JoinHandle<Result<(), ServeError>>,
}

impl RunningCoordinator {
    /// `https://addr`, or `http://addr` without TLS.
    pub fn url(&self) -> String {
        format!("{}://{}", if self.tls { "https" } else { "http" }, self.addr)
    }

    /// Stops accepting requests, finishes in-flight ones, and waits for the server to end.
    pub async fn shutdown(mut self) -> Result<(), ServeError> {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(true);
        }
        self.task.await.unwrap_or(Ok(()))
    }

    /// Waits until the server ends by itself (it only does on error).
    pub async fn wait(self) -> Result<(), ServeError> {
        self.task.await.unwrap_or(Ok(()))
    }

    /// Serves until `signal` resolves, then shuts down gracefully; or returns the error that
    /// ended the server first (e.g. [`ServeError::LeadershipLost`]).
    pub async fn serve_until(
        mut self,
        signal: impl std::future::Future<Output = ()>,
    ) -> Result<(), ServeError> {
        tokio::select! {
            res = &mut self.task => return res.unwrap_or(Ok(())),
            () = signal => {}
        }
        self.shutdown().await
    }
}

/// Starts the coordinator and returns once it accepts requests.
///
/// When another coordinator holds the leadership lock (several share one Postgres), this one
/// starts as a replica: it listens at once and serves devices, relaying round decisions to the
/// leader through the store ([`relay`]; the admin API answers 503 there), and takes over as
/// soon as the lock is released — recovering every run from the store, then serving on the
/// same socket.
pub async fn start(config: ServeConfig) -> Result<RunningCoordinator, ServeError> {
    // Bad TLS material fails the start before anything else is touched.
    let server_tls = config.tls.as_ref().map(tls::server_config).transpose()?;
    if config.max_connections.is_none() {
        let nofile = http::connections::raise_descriptor_limit();
        tracing::info!(
            ?nofile,
            max_connections = config.connection_limits().1.max_connections,
            "open-file limit"
        );
    }
    let store = SqlStore::connect(&config.database_url, config.migrate).await?;
    tracing::info!(backend = ?store.backend(), "store connected");
    let listen_error = |source| ServeError::Listen { addr: config.listen, source };
    let listener = bind(config.listen, config.listen_backlog).map_err(listen_error)?;
    let addr = listener.local_addr().map_err(listen_error)?;
    let tls = server_tls.is_some();
    let (stop, stopped) = watch::channel(false);
    let task = match store.try_acquire_leadership().await? {
        Some(leadership) => {
            let leading = lead(store, &config, leadership.epoch()).await?;
            tracing::info!(%addr, tls, "coordinator listening");
            tokio::spawn(serve_as_leader(
                listener, leading, leadership, server_tls, config, stopped,
            ))
        }
        None => {
            tracing::info!(%addr, tls, "another coordinator holds the leadership lock: serving devices as a replica until it is released");
            tokio::spawn(stand_by(listener, store, server_tls, config, stopped))
        }
    };
    Ok(RunningCoordinator { addr, tls, shutdown: Some(stop), task })
}

/// What a leader serves: the application, the driver's handle (for the shutdown), and the
/// task answering what replicas relay (aborted when the leader stops serving).
struct Leading {
    app: axum::Router,
    driver: DriverHandle,
    relay: Option<AbortOnDrop>,
}

/// Aborts its task when dropped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The application state both a leader and a replica serve from, as `config` says.
fn app_state(
    driver: DriverHandle,
    store: SqlStore,
    observer: observe::Observer,
    config: &ServeConfig,
) -> http::AppState {
    http::AppState::new(
        driver,
        store,
        observer,
        &config.operator_token,
        config.limits,
        config.timeouts,
    )
    .requiring_client_certificates(config.tls.as_ref().is_some_and(|t| t.client_ca.is_some()))
    .serving_tls(config.tls.is_some())
    .requiring_enrolment_certificates(config.enrolment_authority)
    .with_aggregator_secret(config.tier.as_ref().map(|t| t.secret.as_str()))
}

/// Recovers every run from the store and starts the driver, and the task that answers what
/// replicas relay.
async fn lead(store: SqlStore, config: &ServeConfig, epoch: i64) -> Result<Leading, ServeError> {
    let observer = observe::Observer::new();
    let (driver, handle) =
        Driver::recover(store.clone(), observer.clone(), config.tier.clone()).await?;
    tracing::info!(epoch, "leading: runs recovered, driver started");
    let driver_task = tokio::spawn(driver.run());
    // The driver ends only when every handle is gone (a shutdown); ending otherwise (a panic)
    // leaves no round moving: said loudly here, and `/readyz` answers 503 from then on.
    tokio::spawn(async move {
        if let Err(e) = driver_task.await {
            tracing::error!(error = %e, "the driver task died: no run makes progress; /readyz answers 503; restart the coordinator");
        }
    });
    // Payloads of rounds committed just before a stop were not released yet.
    let sweeper = store.clone();
    tokio::spawn(async move {
        match sweeper.release_closed_payloads().await {
            Ok(0) => {}
            Ok(n) => tracing::info!(rounds = n, "released closed rounds' payloads"),
            Err(e) => tracing::warn!(error = %e, "releasing closed rounds' payloads failed"),
        }
    });
    let state = app_state(handle.clone(), store, observer, config);
    // Only Postgres is shared by several coordinators; an SQLite store has no replicas.
    let relay = (state.store().backend() == store::Backend::Postgres)
        .then(|| AbortOnDrop(tokio::spawn(relay::serve_relayed(state.clone()))));
    let app = traced(http::router(state, config.dashboard_dir.as_deref()));
    Ok(Leading { app, driver: handle, relay })
}

/// `app` with its requests traced: failures logged, as errors unless they are expected.
fn traced(app: axum::Router) -> axum::Router {
    app.layer(tower_http::trace::TraceLayer::new_for_http().on_failure(
        |class: tower_http::classify::ServerErrorsFailureClass,
         latency: Duration,
         _span: &tracing::Span| {
            if failure_is_expected(&class) {
                tracing::debug!(classification = %class, ?latency, "answered: retry later");
            } else {
                tracing::error!(classification = %class, ?latency, "response failed");
            }
        },
    ))
}

/// Whether a failed answer is one a client is expected to retry (503 with `Retry-After`: a
/// FedBuff buffer committing, a model's bytes still being written, the store briefly away),
/// logged at debug; tower-http's default logged each as an ERROR (62 of 240 uploads in a FedBuff
/// probe). Other failures (500: its cause is logged where it arose) stay errors.
fn failure_is_expected(class: &tower_http::classify::ServerErrorsFailureClass) -> bool {
    matches!(class, tower_http::classify::ServerErrorsFailureClass::StatusCode(s)
        if *s == axum::http::StatusCode::SERVICE_UNAVAILABLE)
}

/// Serves `app` until shutdown is asked, or until the leadership is lost (then with
/// [`ServeError::LeadershipLost`], so another coordinator can take over).
async fn serve_as_leader(
    listener: std::net::TcpListener,
    Leading { app, driver, relay }: Leading,
    mut leadership: store::Leadership,
    tls: Option<rustls::ServerConfig>,
    config: ServeConfig,
    mut stopped: watch::Receiver<bool>,
) -> Result<(), ServeError> {
    let server = axum_server::Handle::<SocketAddr>::new();
    tokio::spawn({
        let server = server.clone();
        async move {
            stop_asked(&mut stopped).await;
            server.graceful_shutdown(Some(SHUTDOWN_GRACE));
        }
    });
    let serving = serve(listener, app, tls, config.connection_limits(), server.clone());
    tokio::pin!(serving);
    let res = tokio::select! {
        res = &mut serving => res,
        () = leadership.lost() => {
            tracing::error!("lost the leadership lock; stopping so another coordinator can take over");
            server.shutdown();
            let _ = serving.await;
            Err(ServeError::LeadershipLost)
        }
    };
    drop(relay);
    // The bytes of models committed by their hash (none left once fenced off: those stop).
    if !driver.finish_model_writes(SHUTDOWN_GRACE).await {
        tracing::warn!(
            "committed models' bytes were still being written at shutdown; the next start rebuilds them"
        );
    }
    res
}

/// A replica: serves devices, relaying round decisions to the leader ([`relay`]), while it
/// waits for the leadership lock; then recovers the runs and leads on the same socket.
async fn stand_by(
    listener: std::net::TcpListener,
    store: SqlStore,
    tls: Option<rustls::ServerConfig>,
    config: ServeConfig,
    mut stopped: watch::Receiver<bool>,
) -> Result<(), ServeError> {
    let listen_error = |source| ServeError::Listen { addr: config.listen, source };
    let standby = axum_server::Handle::<SocketAddr>::new();
    let standby_listener = listener.try_clone().map_err(listen_error)?;
    let relayed = relay::replica_handle(store.clone());
    let state =
        app_state(relayed, store.clone(), observe::Observer::new(), &config).serving_as_replica();
    let probes = tokio::spawn(serve(
        standby_listener,
        traced(http::replica_router(state)),
        tls.clone(),
        config.connection_limits(),
        standby.clone(),
    ));
    let leadership = tokio::select! {
        leadership = store.wait_for_leadership() => leadership,
        () = stop_asked(&mut stopped) => {
            standby.graceful_shutdown(Some(SHUTDOWN_GRACE));
            return probes.await.unwrap_or(Ok(()));
        }
    };
    tracing::info!(epoch = leadership.epoch(), "took over the leadership lock");
    // Requests in flight on the replica get a moment (a relayed one not answered by then is
    // answered by this leader once it runs: the device's retry finds it); new connections
    // wait in the socket's queue for the leader's server.
    standby.graceful_shutdown(Some(Duration::from_secs(1)));
    let _ = probes.await;
    let leading = lead(store, &config, leadership.epoch()).await?;
    serve_as_leader(listener, leading, leadership, tls, config, stopped).await
}

/// Resolves when shutdown is asked (or its handle is dropped).
async fn stop_asked(stopped: &mut watch::Receiver<bool>) {
    let _ = stopped.wait_for(|stop| *stop).await;
}

/// A non-blocking listening socket on `addr` with an accept queue of `backlog`.
fn bind(addr: SocketAddr, backlog: u32) -> std::io::Result<std::net::TcpListener> {
    let socket = match addr {
        SocketAddr::V4(_) => tokio::net::TcpSocket::new_v4()?,
        SocketAddr::V6(_) => tokio::net::TcpSocket::new_v6()?,
    };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(backlog)?.into_std()
}

/// Serves `app` on `listener` until `handle` shuts it down, with or without TLS, with the
/// slow-client deadlines of `timeouts` on every connection.
async fn serve(
    listener: std::net::TcpListener,
    app: axum::Router,
    tls: Option<rustls::ServerConfig>,
    (timeouts, limits): (http::Timeouts, ConnectionLimits),
    handle: axum_server::Handle<SocketAddr>,
) -> Result<(), ServeError> {
    // Peer addresses feed the per-IP rate limit.
    let app = app.into_make_service_with_connect_info::<SocketAddr>();
    let server = axum_server::from_tcp(listener).map_err(ServeError::Serve)?.handle(handle);
    let slow_headers = |builder: &mut hyper_util::server::conn::auto::Builder<_>| {
        builder
            .http1()
            .timer(hyper_util::rt::TokioTimer::new())
            .header_read_timeout(timeouts.header)
            .max_buf_size(http::CONNECTION_READ_BUFFER);
    };
    match tls {
        None => {
            let acceptor = GuardedAcceptor::new(axum_server::accept::DefaultAcceptor, limits);
            let mut server = server.acceptor(acceptor);
            slow_headers(server.http_builder());
            server.serve(app).await
        }
        Some(config) => {
            let acceptor = tls::ClientCertAcceptor::new(
                RustlsAcceptor::new(RustlsConfig::from_config(Arc::new(config)))
                    .handshake_timeout(timeouts.header),
            );
            let mut server = server.acceptor(GuardedAcceptor::new(acceptor, limits));
            slow_headers(server.http_builder());
            server.serve(app).await
        }
    }
    .map_err(ServeError::Serve)
}

#[cfg(test)]
mod tests {
    use tower_http::classify::ServerErrorsFailureClass as Class;

    /// A FedBuff run's uploads that meet a committing buffer are answered 503 and retried; they
    /// were logged as ERROR. Only a 503 is expected; a 500 or a broken connection is not.
    #[test]
    fn only_a_503_is_an_expected_failure() {
        use axum::http::StatusCode;
        assert!(super::failure_is_expected(&Class::StatusCode(StatusCode::SERVICE_UNAVAILABLE)));
        assert!(!super::failure_is_expected(&Class::StatusCode(StatusCode::INTERNAL_SERVER_ERROR)));
        assert!(!super::failure_is_expected(&Class::Error("connection reset".into())));
    }
}
