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

use std::future::Future;
use std::net::SocketAddr;

use tokio::net::TcpListener;
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
}

/// Why the coordinator could not start or stopped.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ServeError {
    /// The store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
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
}

/// A started coordinator.
pub struct RunningCoordinator {
    /// The bound address.
    pub addr: SocketAddr,
    shutdown: Option<oneshot::Sender<()>>,
    task: JoinHandle<Result<(), ServeError>>,
}

impl RunningCoordinator {
    /// `http://addr`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
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
}

/// Starts the coordinator and returns once it accepts requests.
pub async fn start(config: ServeConfig) -> Result<RunningCoordinator, ServeError> {
    let store = SqlStore::connect(&config.database_url, config.migrate).await?;
    tracing::info!(backend = ?store.backend(), "store connected");
    let leadership = store.acquire_leadership().await?;
    let observer = observe::Observer::new();
    let (driver, handle) = Driver::recover(store.clone(), observer.clone()).await?;
    tokio::spawn(driver.run());
    let state = http::AppState::new(handle, store, observer, &config.operator_token, config.limits);
    let app = http::router(state, config.dashboard_dir.as_deref())
        .layer(tower_http::trace::TraceLayer::new_for_http());
    let listener = TcpListener::bind(config.listen)
        .await
        .map_err(|source| ServeError::Listen { addr: config.listen, source })?;
    let addr = listener
        .local_addr()
        .map_err(|source| ServeError::Listen { addr: config.listen, source })?;
    tracing::info!(%addr, "coordinator listening");
    let (tx, rx) = oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        let res = serve_until(listener, app, async {
            let _ = rx.await;
        })
        .await;
        drop(leadership);
        res
    });
    Ok(RunningCoordinator { addr, shutdown: Some(tx), task })
}

async fn serve_until(
    listener: TcpListener,
    app: axum::Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    // Peer addresses feed the per-IP rate limit.
    let app = app.into_make_service_with_connect_info::<SocketAddr>();
    axum::serve(listener, app).with_graceful_shutdown(shutdown).await.map_err(ServeError::Serve)
}
