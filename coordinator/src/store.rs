//! The durable store: every round transition and every acknowledged update is a row here.
//!
//! Two backends: Postgres (production, several coordinators may share it) and SQLite (the
//! embedded zero-setup default).
//! They share one SQL text through sqlx's `Any` driver; what differs per backend (migrations,
//! durability settings, the leadership lock) is in [`Backend`]-specific code paths.
//! Both pass the same conformance suite (`coordinator/tests/store_conformance.rs`).
//!
//! One file per aggregate: `devices` (tokens, enrollment, revocation), `runs` (runs and their
//! models), `rounds` (transitions, the open round, commits), `updates` (updates and partials),
//! `secure` (secure rounds' records), `evaluations`, and `leadership` (the lock and the epoch
//! that fences every write of round state).
//!
//! # Behavior every method guarantees
//! * A method that returns `Ok` has made its writes durable (Postgres commit with
//!   `synchronous_commit = on`; SQLite WAL with `synchronous = FULL`).
//! * Multi-row transitions (enrollment, run creation, round commit) are one transaction.
//! * Errors are mapped once, in [`map_err`]: a unique violation is [`StoreError::Conflict`],
//!   everything else that is not the caller's fault is [`StoreError::Unavailable`].

use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use sqlx::any::AnyPoolOptions;
use sqlx::{AnyPool, Connection, Executor};

mod devices;
mod evaluations;
mod leadership;
mod rounds;
mod runs;
mod secure;
mod updates;

pub use evaluations::{
    AggregateEvaluationRow, CENTRAL_EVALUATION_PREFIX, EVALUATION_ROUND_PREFIX, EvaluationRow,
    SECURE_EVALUATION_SOURCE,
};
use leadership::Fence;
pub use leadership::{LEADER_APPLICATION_NAME, Leadership};
pub use rounds::{OpenRoundState, RoundCommit, RoundDeviceRow, RoundRow, Transition};
pub use runs::{ModelInfo, NewRun, RunRow};
pub use updates::StoredUpdate;

/// Which database a store runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    /// PostgreSQL (`postgres://`).
    Postgres,
    /// SQLite (`sqlite://`), the embedded default.
    Sqlite,
}

/// Store failures, as the rest of the coordinator sees them.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// The database could not be reached or failed; nothing was written.
    #[error("store unavailable: {0}")]
    Unavailable(#[source] sqlx::Error),
    /// A uniqueness constraint refused the write (a duplicate).
    #[error("conflicting row already exists")]
    Conflict,
    /// The enrollment token is unknown, expired or used up.
    #[error("enrollment token is invalid, expired or used up")]
    InvalidToken,
    /// The URL names no supported backend.
    #[error("unsupported database url {0:?}: use postgres:// or sqlite://")]
    UnsupportedUrl(String),
    /// Applying migrations failed.
    #[error("migration failed: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    /// A row holds data this version cannot read.
    #[error("corrupt row: {0}")]
    Corrupt(String),
    /// Another coordinator took the leadership since this one did: nothing was written, and
    /// this coordinator must stop driving runs.
    #[error("fenced: another coordinator leads now (leadership epoch {current}, ours {ours})")]
    Fenced {
        /// The epoch this store's leadership holds.
        ours: i64,
        /// The epoch in the store.
        current: i64,
    },
}

/// Result alias for store calls.
pub type StoreResult<T> = Result<T, StoreError>;

/// Maps a sqlx error: the one place where database error codes are interpreted.
fn map_err(e: sqlx::Error) -> StoreError {
    match &e {
        sqlx::Error::Database(db) if db.is_unique_violation() => StoreError::Conflict,
        _ => StoreError::Unavailable(e),
    }
}

/// `url` with its database name replaced by `database` (e.g. a per-test Postgres database).
pub fn with_database(url: &str, database: &str) -> String {
    let (without_query, query) = match url.split_once('?') {
        Some((u, q)) => (u, Some(q)),
        None => (url, None),
    };
    let scheme_end = without_query.find("://").map_or(0, |i| i + 3);
    let base = match without_query[scheme_end..].find('/') {
        Some(slash) => &without_query[..scheme_end + slash],
        None => without_query,
    };
    match query {
        Some(q) => format!("{base}/{database}?{q}"),
        None => format!("{base}/{database}"),
    }
}

/// The coordinator's store.
#[derive(Debug, Clone)]
pub struct SqlStore {
    pool: AnyPool,
    backend: Backend,
    url: String,
    fence: Arc<Fence>,
}

impl SqlStore {
    /// Connects, creating the SQLite file if needed, and (if `migrate`) applies migrations.
    pub async fn connect(url: &str, migrate: bool) -> StoreResult<Self> {
        sqlx::any::install_default_drivers();
        let backend = if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            Backend::Postgres
        } else if url.starts_with("sqlite:") {
            Backend::Sqlite
        } else {
            return Err(StoreError::UnsupportedUrl(redact(url)));
        };
        if backend == Backend::Sqlite {
            // Create the file (and set WAL, which is persistent) through the native driver.
            let opts = sqlx::sqlite::SqliteConnectOptions::from_str(url)
                .map_err(map_err)?
                .create_if_missing(true)
                .journal_mode(sqlx::sqlite::SqliteJournalMode::Wal);
            let conn = sqlx::SqliteConnection::connect_with(&opts).await.map_err(map_err)?;
            conn.close().await.map_err(map_err)?;
        }
        let options = AnyPoolOptions::new()
            .max_connections(if backend == Backend::Sqlite { 4 } else { 16 })
            .acquire_timeout(Duration::from_secs(10))
            .after_connect(move |conn, _| {
                Box::pin(async move {
                    if backend == Backend::Sqlite {
                        conn.execute("PRAGMA synchronous = FULL; PRAGMA foreign_keys = ON; PRAGMA busy_timeout = 10000;")
                            .await?;
                    }
                    Ok(())
                })
            });
        let pool = options.connect(url).await.map_err(map_err)?;
        let store = SqlStore { pool, backend, url: url.to_owned(), fence: Arc::default() };
        if migrate {
            store.migrate().await?;
        }
        Ok(store)
    }

    /// Applies pending migrations for this backend.
    pub async fn migrate(&self) -> StoreResult<()> {
        match self.backend {
            Backend::Postgres => {
                let mut conn = sqlx::PgConnection::connect(&self.url).await.map_err(map_err)?;
                sqlx::migrate!("../migrations/postgres").run(&mut conn).await?;
            }
            Backend::Sqlite => {
                let mut conn = sqlx::SqliteConnection::connect(&self.url).await.map_err(map_err)?;
                sqlx::migrate!("../migrations/sqlite").run(&mut conn).await?;
            }
        }
        Ok(())
    }

    /// The backend.
    pub fn backend(&self) -> Backend {
        self.backend
    }

    /// Checks that the database answers.
    pub async fn ping(&self) -> StoreResult<()> {
        sqlx::query("SELECT 1").execute(&self.pool).await.map_err(map_err)?;
        Ok(())
    }
}

/// A database URL with any password replaced, for logs and errors.
pub fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme_end), Some(at)) if at > scheme_end => {
            let userinfo = &url[scheme_end + 3..at];
            match userinfo.find(':') {
                Some(colon) => {
                    format!("{}{}:***{}", &url[..scheme_end + 3], &userinfo[..colon], &url[at..])
                }
                None => url.to_owned(),
            }
        }
        _ => url.to_owned(),
    }
}
