//! Starling's coordinator: fleet and admin APIs over a durable store, with one driver task
//! running every run's round state machine.
//!
//! [`start`] is the whole service: connect the store (migrating it), take the leadership lock,
//! rebuild runs from the store, spawn the driver, and serve HTTP.
//! The binary (`starling-coordinator`) is [`cli::main`]; tests start the same service in-process
//! or as a child process.

pub mod cli;
pub mod clock;
pub mod driver;
pub mod http;
pub mod observe;
pub mod store;
pub mod tier;
pub mod tls;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum_server::tls_rustls::{RustlsAcceptor, RustlsConfig};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::driver::Driver;
use crate::store::{SqlStore, StoreError};

/// Everything [`start`] needs, validated.
#[derive(Debug, Clone)]
pub struct ServeConfig {
    /// Address to listen on; port 0 picks a free one.
    pub listen: SocketAddr,
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
    /// TLS for the listener; `None` serves plain HTTP (the demo, or behind a TLS proxy).
    pub tls: Option<tls::TlsConfig>,
    /// The aggregator tier; `None` runs every round on the coordinator alone.
    pub tier: Option<tier::TierSettings>,
}

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
    shutdown: Option<oneshot::Sender<()>>,
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
            let _ = tx.send(());
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
pub async fn start(config: ServeConfig) -> Result<RunningCoordinator, ServeError> {
    // Bad TLS material fails the start before anything else is touched.
    let server_tls = config.tls.as_ref().map(tls::server_config).transpose()?;
    let store = SqlStore::connect(&config.database_url, config.migrate).await?;
    tracing::info!(backend = ?store.backend(), "store connected");
    let mut leadership = store.acquire_leadership().await?;
    let observer = observe::Observer::new();
    let (driver, handle) =
        Driver::recover(store.clone(), observer.clone(), config.tier.clone()).await?;
    tokio::spawn(driver.run());
    let state = http::AppState::new(
        handle,
        store,
        observer,
        &config.operator_token,
        config.limits,
        config.timeouts,
    )
    .requiring_client_certificates(config.tls.as_ref().is_some_and(|t| t.client_ca.is_some()))
    .with_aggregator_secret(config.tier.as_ref().map(|t| t.secret.as_str()));
    let app = http::router(state, config.dashboard_dir.as_deref())
        .layer(tower_http::trace::TraceLayer::new_for_http());
    let listen_error = |source| ServeError::Listen { addr: config.listen, source };
    let listener = std::net::TcpListener::bind(config.listen).map_err(listen_error)?;
    listener.set_nonblocking(true).map_err(listen_error)?;
    let addr = listener.local_addr().map_err(listen_error)?;
    let tls = server_tls.is_some();
    tracing::info!(%addr, tls, "coordinator listening");
    let server = axum_server::Handle::<SocketAddr>::new();
    let (tx, rx) = oneshot::channel::<()>();
    tokio::spawn({
        let server = server.clone();
        async move {
            let _ = rx.await;
            server.graceful_shutdown(Some(SHUTDOWN_GRACE));
        }
    });
    let task = tokio::spawn(async move {
        let serving = serve(listener, app, server_tls, config.timeouts, server.clone());
        tokio::pin!(serving);
        tokio::select! {
            res = &mut serving => res,
            () = leadership.lost() => {
                tracing::error!("lost the leadership lock; stopping so another coordinator can take over");
                server.shutdown();
                let _ = serving.await;
                Err(ServeError::LeadershipLost)
            }
        }
    });
    Ok(RunningCoordinator { addr, tls, shutdown: Some(tx), task })
}

/// Serves `app` on `listener` until `handle` shuts it down, with or without TLS, with the
/// slow-client deadlines of `timeouts` on every connection.
async fn serve(
    listener: std::net::TcpListener,
    app: axum::Router,
    tls: Option<rustls::ServerConfig>,
    timeouts: http::Timeouts,
    handle: axum_server::Handle<SocketAddr>,
) -> Result<(), ServeError> {
    // Peer addresses feed the per-IP rate limit.
    let app = app.into_make_service_with_connect_info::<SocketAddr>();
    let server = axum_server::from_tcp(listener).map_err(ServeError::Serve)?.handle(handle);
    let slow_headers = |builder: &mut hyper_util::server::conn::auto::Builder<_>| {
        builder
            .http1()
            .timer(hyper_util::rt::TokioTimer::new())
            .header_read_timeout(timeouts.header);
    };
    match tls {
        None => {
            let mut server = server;
            slow_headers(server.http_builder());
            server.serve(app).await
        }
        Some(config) => {
            let acceptor = tls::ClientCertAcceptor::new(
                RustlsAcceptor::new(RustlsConfig::from_config(Arc::new(config)))
                    .handshake_timeout(timeouts.header),
            );
            let mut server = server.acceptor(acceptor);
            slow_headers(server.http_builder());
            server.serve(app).await
        }
    }
    .map_err(ServeError::Serve)
}
