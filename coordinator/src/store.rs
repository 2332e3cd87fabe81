//! The durable store: every round transition and every acknowledged update is a row here.
//!
//! Two backends: Postgres (production, several coordinators may share it) and SQLite (the
//! embedded zero-setup default).
//! They share one SQL text, run through each backend's native sqlx driver (not `Any`, which
//! copies every blob twice on bind and again on read): [`on_pool!`] expands a method's body
//! once per backend, and [`WriteTx`] gives both backends' transactions the shared steps of a
//! write. What differs per backend (migrations, durability settings, the leadership lock) is
//! in [`Backend`]-specific code paths.
//! Both pass the same conformance suite (`coordinator/tests/store_conformance.rs`).
//!
//! One file per aggregate: `devices` (tokens, enrollment, revocation), `runs` (runs and their
//! models), `rounds` (transitions, the open round, commits), `updates` (updates, groups of them and partials),
//! `secure` (secure rounds' records), `evaluations`, `relay` (fleet requests replicas relay to
//! the leader), and `leadership` (the lock and the epoch
//! that fences every write of round state).
//!
//! # Behavior every method guarantees
//! * A method that returns `Ok` has made its writes durable (Postgres commit with
//!   `synchronous_commit = on`; SQLite WAL with `synchronous = FULL`).
//! * Multi-row transitions (enrollment, run creation, round commit) are one transaction.
//! * Errors are mapped once, in [`map_err`]: a unique violation is [`StoreError::Conflict`],
//!   everything else that is not the caller's fault is [`StoreError::Unavailable`].

use std::collections::BTreeMap;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};
use sqlx::{PgPool, SqlitePool};

/// SQL condition on a `models` row `m`: committed by its hash alone and still to be written,
/// because no later version of its run has been written since. Once one has, the versions
/// between were never to be written (the plan's `checkpoint_interval`) and are given up: their
/// rounds' updates go and they read as [`StoreError::ModelNotKept`].
macro_rules! still_to_be_written {
    () => {
        "m.data IS NULL AND NOT EXISTS (SELECT 1 FROM models w WHERE w.run_id = m.run_id AND w.version > m.version AND w.data IS NOT NULL)"
    };
}

mod base_models;
mod devices;
mod evaluations;
mod leadership;
mod relay;
mod rounds;
mod runs;
mod secure;
mod tokenizers;
mod updates;

pub use base_models::BaseModelInfo;
pub use devices::{DeviceAccess, EnrollmentTokenRow};
pub use evaluations::{
    AggregateEvaluationRow, CENTRAL_EVALUATION_PREFIX, EVALUATION_ROUND_PREFIX, EvaluationRow,
    SECURE_EVALUATION_SOURCE,
};
use leadership::Fence;
pub use leadership::{
    LEADER_APPLICATION_NAME, LEASE, Leadership, RENEW_EVERY, RENEW_GIVE_UP, RENEW_TIMEOUT,
    STANDBY_POLL,
};
pub use relay::RelayedRequestRow;
pub use rounds::{
    ModelBytes, OpenRoundState, PendingModel, RoundCommit, RoundDeviceRow, RoundRow, Transition,
};
pub use runs::{ModelInfo, NewRun, RunRow};
use starling_core::round::RoundClosing;
use starling_core::{Millis, RoundIdx, RunId};
pub use tokenizers::TokenizerInfo;
pub use updates::{GroupMember, StoredContribution, StoredGroup, StoredUpdate};

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
    /// A run may not start in this population: a running run holds it for itself
    /// (`exclusive_population`), or the new run asks for it alone and another runs there.
    #[error("population {population:?} is busy: run {run} trains it{}", if *.exclusive { " alone" } else { "" })]
    PopulationBusy {
        /// The population.
        population: String,
        /// The running run in the way.
        run: i64,
        /// Whether that run holds the population for itself.
        exclusive: bool,
    },
    /// The URL names no supported backend.
    #[error("unsupported database url {0:?}: use postgres:// or sqlite://")]
    UnsupportedUrl(String),
    /// Applying migrations failed.
    #[error("migration failed: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    /// A row holds data this version cannot read.
    #[error("corrupt row: {0}")]
    Corrupt(String),
    /// The model was committed by its hash and its bytes are still to be written (see
    /// [`ModelBytes::Later`]): they land within moments, or with the run's next checkpoint
    /// (the plan's `checkpoint_interval`), or a restart rebuilds them.
    #[error(
        "model version {version} of run {run_id} is committed; its bytes are still to be written"
    )]
    ModelPending {
        /// The run.
        run_id: i64,
        /// The model version.
        version: i64,
    },
    /// The model was committed by its hash, and a later version of its run was written before
    /// it: its bytes were never to be written (the plan's `checkpoint_interval`) and the
    /// updates it was made of are released, so it cannot be read.
    #[error(
        "model version {version} of run {run_id} was not kept: the run writes its models every checkpoint_interval versions and a later one is written"
    )]
    ModelNotKept {
        /// The run.
        run_id: i64,
        /// The model version.
        version: i64,
    },
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

/// A connection pool of the store's backend, through its native driver.
#[derive(Debug, Clone)]
enum Pool {
    Postgres(PgPool),
    Sqlite(SqlitePool),
}

/// Runs `$body` with `$pool` bound to the store's native pool: the body is expanded once per
/// backend, so its queries bind and decode through that backend's own types.
macro_rules! on_pool {
    ($store:expr, |$pool:ident| $body:expr) => {
        match &$store.pool {
            $crate::store::Pool::Postgres($pool) => $body,
            $crate::store::Pool::Sqlite($pool) => $body,
        }
    };
}
use on_pool;

/// The coordinator's store.
#[derive(Debug, Clone)]
pub struct SqlStore {
    pool: Pool,
    backend: Backend,
    fence: Arc<Fence>,
}

impl SqlStore {
    /// Connects, creating the SQLite file if needed, and (if `migrate`) applies migrations.
    pub async fn connect(url: &str, migrate: bool) -> StoreResult<Self> {
        let pool = if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            let options = PgConnectOptions::from_str(url)
                .map_err(map_err)?
                .options(leadership::SESSION_SETTINGS);
            Pool::Postgres(
                PgPoolOptions::new()
                    .max_connections(16)
                    .acquire_timeout(Duration::from_secs(10))
                    .connect_with(options)
                    .await
                    .map_err(map_err)?,
            )
        } else if url.starts_with("sqlite:") {
            let options = SqliteConnectOptions::from_str(url)
                .map_err(map_err)?
                .create_if_missing(true)
                .journal_mode(SqliteJournalMode::Wal)
                .synchronous(SqliteSynchronous::Full)
                .foreign_keys(true)
                .busy_timeout(Duration::from_secs(10));
            Pool::Sqlite(
                SqlitePoolOptions::new()
                    .max_connections(4)
                    .acquire_timeout(Duration::from_secs(10))
                    .connect_with(options)
                    .await
                    .map_err(map_err)?,
            )
        } else {
            return Err(StoreError::UnsupportedUrl(redact(url)));
        };
        let backend = match pool {
            Pool::Postgres(_) => Backend::Postgres,
            Pool::Sqlite(_) => Backend::Sqlite,
        };
        let store = SqlStore { pool, backend, fence: Arc::default() };
        if migrate {
            store.migrate().await?;
        }
        Ok(store)
    }

    /// Applies pending migrations for this backend.
    pub async fn migrate(&self) -> StoreResult<()> {
        match &self.pool {
            Pool::Postgres(pool) => sqlx::migrate!("../migrations/postgres").run(pool).await?,
            Pool::Sqlite(pool) => sqlx::migrate!("../migrations/sqlite").run(pool).await?,
        }
        Ok(())
    }

    /// The backend.
    pub fn backend(&self) -> Backend {
        self.backend
    }

    /// Checks that the database answers.
    pub async fn ping(&self) -> StoreResult<()> {
        on_pool!(self, |pool| sqlx::query("SELECT 1")
            .execute(pool)
            .await
            .map(drop)
            .map_err(map_err))
    }
}

/// The steps several write transactions share, on either backend's transaction.
trait WriteTx {
    /// Refuses to go on when another coordinator took the leadership since this store did
    /// (see [`Fence`]); Postgres only.
    async fn check_fence(&mut self, fence: &Fence) -> StoreResult<()>;
    /// Sets a run's status.
    async fn set_run_status(&mut self, run_id: RunId, status: &str, now: Millis)
    -> StoreResult<()>;
    /// Drops a closed round's update deltas and partial sums (the rows stay, as the record of
    /// who took part); does nothing to a round that is open.
    async fn release_payloads(&mut self, run_id: RunId, round_idx: RoundIdx) -> StoreResult<()>;
    /// Drops a closed round's protocol records, masked inputs included: the sum is committed
    /// or the round failed, so they are of no further use.
    async fn delete_secagg_records(
        &mut self,
        run_id: RunId,
        round_idx: RoundIdx,
    ) -> StoreResult<()>;
    /// Stores a stateful server optimizer's state as the one after model `version`, in place
    /// of the run's previous one.
    async fn replace_optimizer_state(
        &mut self,
        run_id: RunId,
        version: i64,
        state: &[u8],
    ) -> StoreResult<()>;
    /// Closes the open round's row as `state`; a round that is not open is refused.
    async fn close_round_row(
        &mut self,
        run_id: RunId,
        closing: &RoundClosing,
        state: &str,
        metrics: Option<&BTreeMap<String, f64>>,
    ) -> StoreResult<()>;
}

/// [`WriteTx`] for one backend's transaction, from one text.
macro_rules! impl_write_tx {
    ($database:ty, $fence:item) => {
        impl WriteTx for sqlx::Transaction<'_, $database> {
            $fence

            async fn set_run_status(
                &mut self,
                run_id: RunId,
                status: &str,
                now: Millis,
            ) -> StoreResult<()> {
                sqlx::query("UPDATE runs SET status = $2, updated_at_ms = $3 WHERE id = $1")
                    .bind(run_id.0)
                    .bind(status)
                    .bind(now)
                    .execute(&mut **self)
                    .await
                    .map_err(map_err)?;
                Ok(())
            }

            async fn release_payloads(
                &mut self,
                run_id: RunId,
                round_idx: RoundIdx,
            ) -> StoreResult<()> {
                // Guarded: an open round's payloads are never dropped.
                for sql in [
                    "UPDATE updates SET delta = NULL WHERE run_id = $1 AND round_idx = $2 AND delta IS NOT NULL
                       AND EXISTS (SELECT 1 FROM rounds r WHERE r.run_id = $1 AND r.round_idx = $2 AND r.state <> 'open')",
                    "UPDATE partials SET report = NULL WHERE run_id = $1 AND round_idx = $2 AND report IS NOT NULL
                       AND EXISTS (SELECT 1 FROM rounds r WHERE r.run_id = $1 AND r.round_idx = $2 AND r.state <> 'open')",
                    "UPDATE update_groups SET sum_hi = NULL, sum_lo = NULL WHERE run_id = $1 AND round_idx = $2 AND sum_hi IS NOT NULL
                       AND EXISTS (SELECT 1 FROM rounds r WHERE r.run_id = $1 AND r.round_idx = $2 AND r.state <> 'open')",
                ] {
                    sqlx::query(sql)
                        .bind(run_id.0)
                        .bind(round_idx.0)
                        .execute(&mut **self)
                        .await
                        .map_err(map_err)?;
                }
                Ok(())
            }

            async fn delete_secagg_records(
                &mut self,
                run_id: RunId,
                round_idx: RoundIdx,
            ) -> StoreResult<()> {
                sqlx::query("DELETE FROM secagg_records WHERE run_id = $1 AND round_idx = $2")
                    .bind(run_id.0)
                    .bind(round_idx.0)
                    .execute(&mut **self)
                    .await
                    .map_err(map_err)?;
                Ok(())
            }

            async fn replace_optimizer_state(
                &mut self,
                run_id: RunId,
                version: i64,
                state: &[u8],
            ) -> StoreResult<()> {
                sqlx::query("DELETE FROM optimizer_states WHERE run_id = $1")
                    .bind(run_id.0)
                    .execute(&mut **self)
                    .await
                    .map_err(map_err)?;
                sqlx::query(
                    "INSERT INTO optimizer_states (run_id, model_version, data) VALUES ($1, $2, $3)",
                )
                .bind(run_id.0)
                .bind(version)
                .bind(state)
                .execute(&mut **self)
                .await
                .map_err(map_err)?;
                Ok(())
            }

            async fn close_round_row(
                &mut self,
                run_id: RunId,
                c: &RoundClosing,
                state: &str,
                metrics: Option<&BTreeMap<String, f64>>,
            ) -> StoreResult<()> {
                let outcome_json = serde_json::to_string(&c.outcome).expect("outcome serializes");
                let metrics_json =
                    metrics.map(|m| serde_json::to_string(m).expect("metrics serialize"));
                let res = sqlx::query(
                    "UPDATE rounds SET state = $3, closed_at_ms = $4, n_selected = $5, n_reported = $6, n_dropped = $7,
                            outcome_json = $8, metrics_json = $9
                     WHERE run_id = $1 AND round_idx = $2 AND state = 'open'",
                )
                .bind(run_id.0)
                .bind(c.round_idx.0)
                .bind(state)
                .bind(c.closed_at)
                .bind(i64::from(c.n_selected))
                .bind(i64::from(c.n_reported))
                .bind(i64::from(c.n_dropped))
                .bind(outcome_json)
                .bind(metrics_json)
                .execute(&mut **self)
                .await
                .map_err(map_err)?;
                if res.rows_affected() != 1 {
                    // Closing a round twice (or one that never opened) is a driver bug; refuse
                    // loudly.
                    return Err(StoreError::Corrupt(format!(
                        "round {} of run {run_id} is not open",
                        c.round_idx
                    )));
                }
                Ok(())
            }
        }
    };
}

impl_write_tx!(
    sqlx::Postgres,
    async fn check_fence(&mut self, fence: &Fence) -> StoreResult<()> {
        fence.check(self).await
    }
);
impl_write_tx!(
    sqlx::Sqlite,
    async fn check_fence(&mut self, _fence: &Fence) -> StoreResult<()> {
        // One process owns a SQLite file: there is no other leader to fence out.
        Ok(())
    }
);

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
