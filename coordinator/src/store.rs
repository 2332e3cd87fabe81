//! The durable store: every round transition and every acknowledged update is a row here.
//!
//! Two backends: Postgres (production, several coordinators may share it) and SQLite (the
//! embedded zero-setup default).
//! They share one SQL text through sqlx's `Any` driver; what differs per backend (migrations,
//! durability settings, the leadership lock) is in [`Backend`]-specific code below.
//! Both pass the same conformance suite (`coordinator/tests/store_conformance.rs`).
//!
//! # Behavior every method guarantees
//! * A method that returns `Ok` has made its writes durable (Postgres commit with
//!   `synchronous_commit = on`; SQLite WAL with `synchronous = FULL`).
//! * Multi-row transitions (enrollment, run creation, round commit) are one transaction.
//! * Errors are mapped once, in [`map_err`]: a unique violation is [`StoreError::Conflict`],
//!   everything else that is not the caller's fault is [`StoreError::Unavailable`].

use starling_core::codec;
use std::collections::BTreeMap;
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::time::Duration;

use futures_util::TryStreamExt;
use serde::{Deserialize, Serialize};
use sqlx::any::AnyPoolOptions;
use sqlx::{AnyPool, Connection, Executor, FromRow};
use starling_core::round::{RoundClosing, RoundOpened, StoredPartial};
use starling_core::tier::PartialReport;
use starling_core::{AggregatorId, DeviceId, Millis, ModelVersion, RoundIdx, RunId};

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

/// A run as stored.
#[derive(Debug, Clone, FromRow)]
pub struct RunRow {
    /// Run id.
    pub id: i64,
    /// Display name.
    pub name: Option<String>,
    /// Population.
    pub population: String,
    /// The submitted plan, JSON.
    pub plan_json: String,
    /// `running`, `finished` or `stopped`.
    pub status: String,
    /// Latest committed model version.
    pub model_version: i64,
    /// Rounds committed.
    pub rounds_committed: i64,
    /// Creation time.
    pub created_at_ms: i64,
    /// Last transition time.
    pub updated_at_ms: i64,
}

/// A round as stored.
#[derive(Debug, Clone, FromRow, Serialize)]
pub struct RoundRow {
    /// Run id.
    pub run_id: i64,
    /// Round index.
    pub round_idx: i64,
    /// Model version trained on.
    pub model_version: i64,
    /// `open`, `committed` or `failed`.
    pub state: String,
    /// Opening time.
    pub opened_at_ms: i64,
    /// End of selection.
    pub selection_deadline_ms: i64,
    /// Reporting deadline.
    pub reporting_deadline_ms: i64,
    /// Closing time, once closed.
    pub closed_at_ms: Option<i64>,
    /// Devices selected (live count while open).
    pub n_selected: Option<i64>,
    /// Durable updates (live count while open).
    pub n_reported: Option<i64>,
    /// Selected devices that did not report.
    pub n_dropped: Option<i64>,
    /// The closing outcome, JSON.
    pub outcome_json: Option<String>,
    /// Weighted mean of the clients' training metrics, JSON.
    pub metrics_json: Option<String>,
}

/// A model version as stored, without its bytes.
#[derive(Debug, Clone, FromRow, Serialize)]
pub struct ModelInfo {
    /// Model version.
    pub version: i64,
    /// Content hash (download path).
    pub content_hash: String,
    /// Round that produced it (`None` for version 0).
    pub round_idx: Option<i64>,
    /// Commit time.
    pub created_at_ms: i64,
}

/// An update read back for replay.
#[derive(Debug, Clone, FromRow)]
pub struct StoredUpdate {
    /// Device that sent it.
    pub device_id: i64,
    /// Arrival slot.
    pub slot: i64,
    /// FedAvg weight.
    pub example_count: i64,
    /// Local metrics, JSON.
    pub metrics_json: String,
    /// Little-endian f32 delta.
    pub delta: Vec<u8>,
}

/// A device selected for a round, as [`SqlStore::round_devices`] reads it back.
#[derive(Debug, Clone, PartialEq, Eq, FromRow)]
pub struct RoundDeviceRow {
    /// Device id.
    pub device_id: i64,
    /// When it was selected.
    pub selected_at_ms: i64,
    /// Its aggregator, in a tiered round.
    pub aggregator_id: Option<i64>,
    /// `update` or `partial` once its contribution is durable; `None` otherwise.
    pub reported: Option<String>,
    /// Its upload's example count, for `update`.
    pub example_count: Option<i64>,
}

/// An evaluation report as stored.
#[derive(Debug, Clone, FromRow)]
pub struct EvaluationRow {
    /// Model version evaluated.
    pub model_version: i64,
    /// Held-out examples.
    pub example_count: i64,
    /// Metrics, JSON.
    pub metrics_json: String,
}

/// A new run with its initial model.
#[derive(Debug, Clone)]
pub struct NewRun<'a> {
    /// Display name.
    pub name: Option<&'a str>,
    /// Population.
    pub population: &'a str,
    /// Plan JSON.
    pub plan_json: &'a str,
    /// Model version 0, encoded.
    pub initial_model: &'a [u8],
    /// Its content hash.
    pub initial_model_hash: &'a str,
}

/// The `source` of a secure round's pooled evaluation in `aggregate_evaluations`.
pub const SECURE_EVALUATION_SOURCE: &str = "secure_cohort";

/// A pooled evaluation as stored.
#[derive(Debug, Clone, FromRow)]
pub struct AggregateEvaluationRow {
    /// Model version evaluated.
    pub model_version: i64,
    /// Where it comes from (e.g. [`SECURE_EVALUATION_SOURCE`]).
    pub source: String,
    /// Devices pooled.
    pub n_devices: i64,
    /// Their held-out examples.
    pub example_count: i64,
    /// Example-weighted means, JSON.
    pub metrics_json: String,
}

/// A committed round's new model and aggregated metrics.
#[derive(Debug, Clone)]
pub struct RoundCommit<'a> {
    /// The close record.
    pub closing: RoundClosing,
    /// The new model, encoded.
    pub model: &'a [u8],
    /// Its content hash.
    pub model_hash: &'a str,
    /// Aggregated training metrics.
    pub metrics: &'a BTreeMap<String, f64>,
    /// A secure round's pooled evaluation of the model it trained on, if any.
    pub evaluation: Option<&'a starling_core::fedavg::PooledEvaluation>,
}

/// The columns of a [`RoundRow`], with live selected/reported counts for an open round
/// (a macro so that queries built on it stay `&'static str`).
macro_rules! round_select {
    () => {
        "SELECT r.run_id, r.round_idx, r.model_version, r.state, r.opened_at_ms, r.selection_deadline_ms,
                    r.reporting_deadline_ms, r.closed_at_ms,
                    COALESCE(r.n_selected, (SELECT COUNT(*) FROM selections s WHERE s.run_id = r.run_id AND s.round_idx = r.round_idx)) AS n_selected,
                    COALESCE(r.n_reported, (SELECT COUNT(*) FROM updates u WHERE u.run_id = r.run_id AND u.round_idx = r.round_idx)
                             + (SELECT CAST(COALESCE(SUM(p.n_devices), 0) AS BIGINT) FROM partials p WHERE p.run_id = r.run_id AND p.round_idx = r.round_idx)) AS n_reported,
                    r.n_dropped, r.outcome_json, r.metrics_json
         FROM rounds r"
    };
}

/// The state of an open round as stored.
#[derive(Debug, Clone, PartialEq)]
pub struct OpenRoundState {
    /// The round row.
    pub round: RoundOpened,
    /// Selected devices.
    pub selected: Vec<DeviceId>,
    /// Devices with a stored update, and their slots, in slot order.
    pub reported: Vec<(DeviceId, i64)>,
    /// A secure round's records (CBOR), in seq order.
    pub secure_records: Vec<Vec<u8>>,
    /// Devices that upload through an aggregator.
    pub assignments: Vec<(DeviceId, AggregatorId)>,
    /// Durable partials (without their sums), in slot order.
    pub partials: Vec<StoredPartial>,
}

/// A small durable transition, batched by [`SqlStore::apply_transitions`].
#[derive(Debug, Clone, PartialEq)]
pub enum Transition {
    /// A round opened.
    OpenRound(RoundOpened),
    /// A device was selected.
    Select {
        /// Round.
        round_idx: RoundIdx,
        /// Device.
        device: DeviceId,
        /// The aggregator it uploads to, if the round goes through the tier.
        aggregator: Option<AggregatorId>,
    },
    /// A secure round's protocol record (CBOR), at position `seq` of the round's log.
    SecAggRecord {
        /// Round.
        round_idx: RoundIdx,
        /// Position.
        seq: i64,
        /// The encoded record.
        record: Vec<u8>,
    },
    /// The run committed all its rounds.
    FinishRun,
    /// The operator stopped the run.
    StopRun {
        /// Round that was open, recorded as failed.
        open_round: Option<RoundIdx>,
    },
}

async fn set_run_status(
    tx: &mut sqlx::Transaction<'_, sqlx::Any>,
    run_id: RunId,
    status: &str,
    now: Millis,
) -> StoreResult<()> {
    sqlx::query("UPDATE runs SET status = $2, updated_at_ms = $3 WHERE id = $1")
        .bind(run_id.0)
        .bind(status)
        .bind(now)
        .execute(&mut **tx)
        .await
        .map_err(map_err)?;
    Ok(())
}

/// A closed round's protocol records are of no further use (the sum is committed or the
/// round failed): drop them, masked inputs included.
async fn delete_secagg_records(
    tx: &mut sqlx::Transaction<'_, sqlx::Any>,
    run_id: RunId,
    round_idx: RoundIdx,
) -> StoreResult<()> {
    sqlx::query("DELETE FROM secagg_records WHERE run_id = $1 AND round_idx = $2")
        .bind(run_id.0)
        .bind(round_idx.0)
        .execute(&mut **tx)
        .await
        .map_err(map_err)?;
    Ok(())
}

/// Drops a closed round's update deltas and partial sums (the rows stay, as the record of who
/// took part).
async fn release_payloads(
    tx: &mut sqlx::Transaction<'_, sqlx::Any>,
    run_id: RunId,
    round_idx: RoundIdx,
) -> StoreResult<()> {
    for sql in [
        "UPDATE updates SET delta = NULL WHERE run_id = $1 AND round_idx = $2",
        "UPDATE partials SET report = NULL WHERE run_id = $1 AND round_idx = $2",
    ] {
        sqlx::query(sql)
            .bind(run_id.0)
            .bind(round_idx.0)
            .execute(&mut **tx)
            .await
            .map_err(map_err)?;
    }
    Ok(())
}

async fn close_round_row(
    tx: &mut sqlx::Transaction<'_, sqlx::Any>,
    run_id: RunId,
    c: &RoundClosing,
    state: &str,
    metrics: Option<&BTreeMap<String, f64>>,
) -> StoreResult<()> {
    let outcome_json = serde_json::to_string(&c.outcome).expect("outcome serializes");
    let metrics_json = metrics.map(|m| serde_json::to_string(m).expect("metrics serialize"));
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
    .execute(&mut **tx)
    .await
    .map_err(map_err)?;
    if res.rows_affected() != 1 {
        // Closing a round twice (or one that never opened) is a driver bug; refuse loudly.
        return Err(StoreError::Corrupt(format!(
            "round {} of run {run_id} is not open",
            c.round_idx
        )));
    }
    Ok(())
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

/// The leadership epoch this store writes under, shared by its clones.
///
/// Postgres only: [`SqlStore::acquire_leadership`] increments the stored epoch and keeps it
/// here; every write of round state then reads the stored epoch `FOR SHARE` in its own
/// transaction and refuses to commit when it changed. A successor's increment waits for the
/// writes in flight and every later write of the deposed leader fails, so no write of it lands
/// after its successor took over. SQLite has one process per file and no epoch.
#[derive(Debug, Default)]
struct Fence {
    /// 0 until this store leads.
    epoch: AtomicI64,
    /// Set once a write found a newer epoch.
    deposed: AtomicBool,
    wake: tokio::sync::Notify,
}

/// Postgres advisory-lock key held by the coordinator that drives runs ("STAR").
const LEADER_LOCK_KEY: i64 = 0x5354_4152;

/// Holds the leadership lock; dropping it releases the lock.
#[derive(Debug)]
pub struct Leadership {
    conn: Option<sqlx::PgConnection>,
    fence: Arc<Fence>,
}

/// The Postgres `application_name` of the connection that holds the leadership lock.
pub const LEADER_APPLICATION_NAME: &str = "starling-leader";

impl Leadership {
    /// Resolves when the lock is lost: the connection holding it stopped answering (the
    /// server restarted, an operator terminated it, the network broke). Postgres releases an
    /// advisory lock with its session, so from then on another coordinator may drive the runs;
    /// this one must stop. Also resolves as soon as a write of this store was fenced (a
    /// successor took over). Never resolves for SQLite (one process owns the file).
    pub async fn lost(&mut self) {
        let fence = self.fence.clone();
        let Some(conn) = self.conn.as_mut() else { return std::future::pending().await };
        let deposed = async {
            loop {
                let woken = fence.wake.notified();
                if fence.deposed.load(Ordering::SeqCst) {
                    return;
                }
                woken.await;
            }
        };
        let dead = async {
            loop {
                tokio::time::sleep(std::time::Duration::from_secs(1)).await;
                let alive = tokio::time::timeout(
                    std::time::Duration::from_secs(5),
                    sqlx::query("SELECT 1").execute(&mut *conn),
                )
                .await;
                if !matches!(alive, Ok(Ok(_))) {
                    return;
                }
            }
        };
        tokio::select! {
            () = deposed => {}
            () = dead => {}
        }
    }

    /// The leadership epoch this coordinator writes under (0 on SQLite).
    pub fn epoch(&self) -> i64 {
        self.fence.epoch.load(Ordering::SeqCst)
    }
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

    /// Waits until this process may drive runs.
    ///
    /// On Postgres several coordinators may share one database: a session-level advisory lock
    /// elects one driver, and a standby takes over as soon as the holder's session ends (a
    /// killed process's connection closes). Taking the lock increments the leadership epoch
    /// that fences every later write (see [`Fence`]). SQLite is single-process by design.
    pub async fn acquire_leadership(&self) -> StoreResult<Leadership> {
        match self.lock_leadership(true).await? {
            Some(leadership) => Ok(leadership),
            None => unreachable!("a blocking lock attempt returns only once it holds the lock"),
        }
    }

    /// Takes the leadership if no other coordinator holds it now; `None` if one does.
    pub async fn try_acquire_leadership(&self) -> StoreResult<Option<Leadership>> {
        self.lock_leadership(false).await
    }

    async fn lock_leadership(&self, wait: bool) -> StoreResult<Option<Leadership>> {
        let fence = self.fence.clone();
        match self.backend {
            Backend::Sqlite => Ok(Some(Leadership { conn: None, fence })),
            Backend::Postgres => {
                let options: sqlx::postgres::PgConnectOptions =
                    self.url.parse().map_err(map_err)?;
                let mut conn = sqlx::PgConnection::connect_with(
                    &options.application_name(LEADER_APPLICATION_NAME),
                )
                .await
                .map_err(map_err)?;
                if wait {
                    sqlx::query("SELECT pg_advisory_lock($1)")
                        .bind(LEADER_LOCK_KEY)
                        .execute(&mut conn)
                        .await
                        .map_err(map_err)?;
                } else {
                    let (locked,): (bool,) = sqlx::query_as("SELECT pg_try_advisory_lock($1)")
                        .bind(LEADER_LOCK_KEY)
                        .fetch_one(&mut conn)
                        .await
                        .map_err(map_err)?;
                    if !locked {
                        return Ok(None);
                    }
                }
                // Waits for the deposed leader's writes in flight (they hold the row FOR SHARE);
                // every later one of them sees the new epoch and fails.
                let (epoch,): (i64,) = sqlx::query_as(
                    "UPDATE leadership SET epoch = epoch + 1, holder = $1, acquired_at_ms = $2
                     WHERE id = 1 RETURNING epoch",
                )
                .bind(format!("pid {}", std::process::id()))
                .bind(crate::clock::now_ms())
                .fetch_one(&mut conn)
                .await
                .map_err(map_err)?;
                fence.epoch.store(epoch, Ordering::SeqCst);
                fence.deposed.store(false, Ordering::SeqCst);
                Ok(Some(Leadership { conn: Some(conn), fence }))
            }
        }
    }

    /// Inside a write transaction of round state: refuses to go on when another coordinator
    /// took the leadership since this store did (see [`Fence`]).
    async fn check_fence(&self, tx: &mut sqlx::Transaction<'_, sqlx::Any>) -> StoreResult<()> {
        let ours = self.fence.epoch.load(Ordering::SeqCst);
        if self.backend != Backend::Postgres || ours == 0 {
            return Ok(());
        }
        let (current,): (i64,) =
            sqlx::query_as("SELECT epoch FROM leadership WHERE id = 1 FOR SHARE")
                .fetch_one(&mut **tx)
                .await
                .map_err(map_err)?;
        if current == ours {
            return Ok(());
        }
        if !self.fence.deposed.swap(true, Ordering::SeqCst) {
            tracing::error!(
                ours,
                current,
                "another coordinator took the leadership; refusing to write"
            );
        }
        self.fence.wake.notify_waiters();
        Err(StoreError::Fenced { ours, current })
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

    /// Stores a new enrollment token (by hash).
    pub async fn create_enrollment_token(
        &self,
        token_hash: &str,
        now: Millis,
        expires_at: Option<Millis>,
        uses: Option<i64>,
    ) -> StoreResult<()> {
        sqlx::query(
            "INSERT INTO enrollment_tokens (token_hash, created_at_ms, expires_at_ms, uses_left) VALUES ($1, $2, $3, $4)",
        )
        .bind(token_hash)
        .bind(now)
        .bind(expires_at)
        .bind(uses)
        .execute(&self.pool)
        .await
        .map_err(map_err)?;
        Ok(())
    }

    /// Spends one use of an enrollment token and registers a device with `credential_hash`.
    pub async fn enroll_device(
        &self,
        token_hash: &str,
        credential_hash: &str,
        now: Millis,
    ) -> StoreResult<DeviceId> {
        let mut tx = self.pool.begin().await.map_err(map_err)?;
        let spent = sqlx::query(
            "UPDATE enrollment_tokens SET uses_left = uses_left - 1
             WHERE token_hash = $1 AND (expires_at_ms IS NULL OR expires_at_ms > $2)
               AND (uses_left IS NULL OR uses_left > 0)",
        )
        .bind(token_hash)
        .bind(now)
        .execute(&mut *tx)
        .await
        .map_err(map_err)?;
        if spent.rows_affected() != 1 {
            return Err(StoreError::InvalidToken);
        }
        let (id,): (i64,) = sqlx::query_as(
            "INSERT INTO devices (credential_hash, enrolled_at_ms, revoked) VALUES ($1, $2, FALSE) RETURNING id",
        )
        .bind(credential_hash)
        .bind(now)
        .fetch_one(&mut *tx)
        .await
        .map_err(map_err)?;
        tx.commit().await.map_err(map_err)?;
        Ok(DeviceId(id))
    }

    /// The device holding this credential, unless unknown or revoked.
    pub async fn device_by_credential(
        &self,
        credential_hash: &str,
    ) -> StoreResult<Option<DeviceId>> {
        let row: Option<(i64,)> =
            sqlx::query_as("SELECT id FROM devices WHERE credential_hash = $1 AND revoked = FALSE")
                .bind(credential_hash)
                .fetch_optional(&self.pool)
                .await
                .map_err(map_err)?;
        Ok(row.map(|(id,)| DeviceId(id)))
    }

    /// Revokes a device's credential for good; when it enrolled, or `None` when no such
    /// device exists. Revoking twice is not an error.
    pub async fn revoke_device(&self, device: DeviceId) -> StoreResult<Option<Millis>> {
        let row: Option<(i64,)> = sqlx::query_as(
            "UPDATE devices SET revoked = TRUE WHERE id = $1 RETURNING enrolled_at_ms",
        )
        .bind(device.0)
        .fetch_optional(&self.pool)
        .await
        .map_err(map_err)?;
        Ok(row.map(|(enrolled_at,)| enrolled_at))
    }

    /// Every enrolled device, by id: (id, enrolled at, revoked).
    pub async fn devices(&self) -> StoreResult<Vec<(DeviceId, Millis, bool)>> {
        // The flag as an integer: the Any driver decodes booleans differently per database.
        let rows: Vec<(i64, i64, i64)> = sqlx::query_as(
            "SELECT id, enrolled_at_ms, CAST(CASE WHEN revoked THEN 1 ELSE 0 END AS BIGINT) FROM devices ORDER BY id",
        )
                .fetch_all(&self.pool)
                .await
                .map_err(map_err)?;
        Ok(rows.into_iter().map(|(id, at, revoked)| (DeviceId(id), at, revoked != 0)).collect())
    }

    /// Creates a run and its model version 0 in one transaction.
    pub async fn create_run(&self, run: NewRun<'_>, now: Millis) -> StoreResult<RunId> {
        let mut tx = self.pool.begin().await.map_err(map_err)?;
        self.check_fence(&mut tx).await?;
        let (id,): (i64,) = sqlx::query_as(
            "INSERT INTO runs (name, population, plan_json, status, model_version, rounds_committed, created_at_ms, updated_at_ms)
             VALUES ($1, $2, $3, 'running', 0, 0, $4, $4) RETURNING id",
        )
        .bind(run.name)
        .bind(run.population)
        .bind(run.plan_json)
        .bind(now)
        .fetch_one(&mut *tx)
        .await
        .map_err(map_err)?;
        sqlx::query(
            "INSERT INTO models (run_id, version, content_hash, data, round_idx, created_at_ms) VALUES ($1, 0, $2, $3, NULL, $4)",
        )
        .bind(id)
        .bind(run.initial_model_hash)
        .bind(run.initial_model)
        .bind(now)
        .execute(&mut *tx)
        .await
        .map_err(map_err)?;
        tx.commit().await.map_err(map_err)?;
        Ok(RunId(id))
    }

    /// One run.
    pub async fn run(&self, run_id: RunId) -> StoreResult<Option<RunRow>> {
        sqlx::query_as("SELECT * FROM runs WHERE id = $1")
            .bind(run_id.0)
            .fetch_optional(&self.pool)
            .await
            .map_err(map_err)
    }

    /// All runs, newest first.
    pub async fn runs(&self) -> StoreResult<Vec<RunRow>> {
        sqlx::query_as("SELECT * FROM runs ORDER BY id DESC")
            .fetch_all(&self.pool)
            .await
            .map_err(map_err)
    }

    /// Runs still being driven.
    pub async fn running_runs(&self) -> StoreResult<Vec<RunRow>> {
        sqlx::query_as("SELECT * FROM runs WHERE status = 'running' ORDER BY id")
            .fetch_all(&self.pool)
            .await
            .map_err(map_err)
    }

    /// A model's bytes by version.
    pub async fn model(
        &self,
        run_id: RunId,
        version: ModelVersion,
    ) -> StoreResult<Option<Vec<u8>>> {
        let row: Option<(Vec<u8>,)> =
            sqlx::query_as("SELECT data FROM models WHERE run_id = $1 AND version = $2")
                .bind(run_id.0)
                .bind(version.0)
                .fetch_optional(&self.pool)
                .await
                .map_err(map_err)?;
        Ok(row.map(|(d,)| d))
    }

    /// A model's bytes by content hash.
    pub async fn model_by_hash(&self, content_hash: &str) -> StoreResult<Option<Vec<u8>>> {
        let row: Option<(Vec<u8>,)> =
            sqlx::query_as("SELECT data FROM models WHERE content_hash = $1 LIMIT 1")
                .bind(content_hash)
                .fetch_optional(&self.pool)
                .await
                .map_err(map_err)?;
        Ok(row.map(|(d,)| d))
    }

    /// Every model version of a run, oldest first.
    pub async fn models(&self, run_id: RunId) -> StoreResult<Vec<ModelInfo>> {
        sqlx::query_as(
            "SELECT version, content_hash, round_idx, created_at_ms FROM models WHERE run_id = $1 ORDER BY version",
        )
        .bind(run_id.0)
        .fetch_all(&self.pool)
        .await
        .map_err(map_err)
    }

    /// Content hash of one model version.
    pub async fn model_hash(
        &self,
        run_id: RunId,
        version: ModelVersion,
    ) -> StoreResult<Option<String>> {
        let row: Option<(String,)> =
            sqlx::query_as("SELECT content_hash FROM models WHERE run_id = $1 AND version = $2")
                .bind(run_id.0)
                .bind(version.0)
                .fetch_optional(&self.pool)
                .await
                .map_err(map_err)?;
        Ok(row.map(|(h,)| h))
    }

    /// Executes a batch of small transitions (round openings, selections, run status) in one
    /// transaction, in order.
    pub async fn apply_transitions(
        &self,
        run_id: RunId,
        batch: &[Transition],
        now: Millis,
    ) -> StoreResult<()> {
        if batch.is_empty() {
            return Ok(());
        }
        let mut tx = self.pool.begin().await.map_err(map_err)?;
        self.check_fence(&mut tx).await?;
        for t in batch {
            match t {
                Transition::OpenRound(r) => {
                    sqlx::query(
                        "INSERT INTO rounds (run_id, round_idx, model_version, state, opened_at_ms, selection_deadline_ms, reporting_deadline_ms)
                         VALUES ($1, $2, $3, 'open', $4, $5, $6) ON CONFLICT DO NOTHING",
                    )
                    .bind(run_id.0)
                    .bind(r.round_idx.0)
                    .bind(r.model_version.0)
                    .bind(r.opened_at)
                    .bind(r.selection_deadline)
                    .bind(r.reporting_deadline)
                    .execute(&mut *tx)
                    .await
                    .map_err(map_err)?;
                }
                Transition::Select { round_idx, device, aggregator } => {
                    sqlx::query(
                        // Idempotent, like the round insert: a retry after a commit whose
                        // answer was lost must not fail on its own earlier write.
                        "INSERT INTO selections (run_id, round_idx, device_id, selected_at_ms, aggregator_id) VALUES ($1, $2, $3, $4, $5)
                         ON CONFLICT DO NOTHING",
                    )
                    .bind(run_id.0)
                    .bind(round_idx.0)
                    .bind(device.0)
                    .bind(now)
                    .bind(aggregator.map(|a| i64::from(a.0)))
                    .execute(&mut *tx)
                    .await
                    .map_err(map_err)?;
                }
                Transition::SecAggRecord { round_idx, seq, record } => {
                    sqlx::query(
                        "INSERT INTO secagg_records (run_id, round_idx, seq, record, created_at_ms) VALUES ($1, $2, $3, $4, $5)
                         ON CONFLICT DO NOTHING",
                    )
                    .bind(run_id.0)
                    .bind(round_idx.0)
                    .bind(*seq)
                    .bind(record.as_slice())
                    .bind(now)
                    .execute(&mut *tx)
                    .await
                    .map_err(map_err)?;
                }
                Transition::FinishRun => {
                    set_run_status(&mut tx, run_id, "finished", now).await?;
                }
                Transition::StopRun { open_round } => {
                    if let Some(round_idx) = open_round {
                        sqlx::query(
                            "UPDATE rounds SET state = 'failed', closed_at_ms = $3, outcome_json = $4
                             WHERE run_id = $1 AND round_idx = $2 AND state = 'open'",
                        )
                        .bind(run_id.0)
                        .bind(round_idx.0)
                        .bind(now)
                        .bind(r#"{"outcome":"stopped"}"#)
                        .execute(&mut *tx)
                        .await
                        .map_err(map_err)?;
                        delete_secagg_records(&mut tx, run_id, *round_idx).await?;
                        release_payloads(&mut tx, run_id, *round_idx).await?;
                    }
                    set_run_status(&mut tx, run_id, "stopped", now).await?;
                }
            }
        }
        tx.commit().await.map_err(map_err)
    }

    /// Writes one update; `Ok` means it is durable and may be acknowledged.
    #[allow(clippy::too_many_arguments)] // One row's columns; a struct would only rename them.
    pub async fn insert_update(
        &self,
        run_id: RunId,
        round_idx: RoundIdx,
        device: DeviceId,
        slot: i64,
        example_count: u64,
        metrics_json: &str,
        delta: &[u8],
        now: Millis,
    ) -> StoreResult<()> {
        let mut tx = self.pool.begin().await.map_err(map_err)?;
        self.check_fence(&mut tx).await?;
        sqlx::query(
            "INSERT INTO updates (run_id, round_idx, device_id, slot, example_count, metrics_json, delta, received_at_ms)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
        )
        .bind(run_id.0)
        .bind(round_idx.0)
        .bind(device.0)
        .bind(slot)
        .bind(example_count as i64)
        .bind(metrics_json)
        .bind(delta)
        .bind(now)
        .execute(&mut *tx)
        .await
        .map_err(map_err)?;
        tx.commit().await.map_err(map_err)
    }

    /// Writes one aggregator's partial; `Ok` means it is durable and may be acknowledged.
    pub async fn insert_partial(
        &self,
        run_id: RunId,
        round_idx: RoundIdx,
        slot: i64,
        report: &PartialReport,
        now: Millis,
    ) -> StoreResult<()> {
        let encoded = codec::to_vec(report).map_err(|e| StoreError::Corrupt(e.to_string()))?;
        let ids = |v: Vec<i64>| serde_json::to_string(&v).expect("ids serialize");
        let mut tx = self.pool.begin().await.map_err(map_err)?;
        self.check_fence(&mut tx).await?;
        sqlx::query(
            "INSERT INTO partials (run_id, round_idx, slot, aggregators_json, devices_json, n_devices, total_weight, report, received_at_ms)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)",
        )
        .bind(run_id.0)
        .bind(round_idx.0)
        .bind(slot)
        .bind(ids(report.aggregators.iter().map(|a| i64::from(a.0)).collect()))
        .bind(ids(report.devices.iter().map(|d| d.0).collect()))
        .bind(report.devices.len() as i64)
        .bind(report.total_weight as i64)
        .bind(encoded)
        .bind(now)
        .execute(&mut *tx)
        .await
        .map_err(map_err)?;
        tx.commit().await.map_err(map_err)
    }

    /// A round's stored partial reports (CBOR), by slot; closed rounds hold none.
    pub async fn partial_reports(
        &self,
        run_id: RunId,
        round_idx: RoundIdx,
    ) -> StoreResult<Vec<(i64, Vec<u8>)>> {
        sqlx::query_as(
            "SELECT slot, report FROM partials WHERE run_id = $1 AND round_idx = $2 AND report IS NOT NULL ORDER BY slot",
        )
        .bind(run_id.0)
        .bind(round_idx.0)
        .fetch_all(&self.pool)
        .await
        .map_err(map_err)
    }

    /// The open round of a run, its selections and its durable updates' (device, slot).
    pub async fn open_round(&self, run_id: RunId) -> StoreResult<Option<OpenRoundState>> {
        let round: Option<RoundRow> = sqlx::query_as(
            "SELECT * FROM rounds WHERE run_id = $1 AND state = 'open' ORDER BY round_idx DESC LIMIT 1",
        )
        .bind(run_id.0)
        .fetch_optional(&self.pool)
        .await
        .map_err(map_err)?;
        let Some(round) = round else { return Ok(None) };
        let selected: Vec<(i64,)> =
            sqlx::query_as("SELECT device_id FROM selections WHERE run_id = $1 AND round_idx = $2 ORDER BY device_id")
                .bind(run_id.0)
                .bind(round.round_idx)
                .fetch_all(&self.pool)
                .await
                .map_err(map_err)?;
        let reported: Vec<(i64, i64)> = sqlx::query_as(
            "SELECT device_id, slot FROM updates WHERE run_id = $1 AND round_idx = $2 ORDER BY slot",
        )
        .bind(run_id.0)
        .bind(round.round_idx)
        .fetch_all(&self.pool)
        .await
        .map_err(map_err)?;
        let assignments: Vec<(i64, i64)> = sqlx::query_as(
            "SELECT device_id, aggregator_id FROM selections
             WHERE run_id = $1 AND round_idx = $2 AND aggregator_id IS NOT NULL ORDER BY device_id",
        )
        .bind(run_id.0)
        .bind(round.round_idx)
        .fetch_all(&self.pool)
        .await
        .map_err(map_err)?;
        let partials: Vec<(i64, String, String)> = sqlx::query_as(
            "SELECT slot, aggregators_json, devices_json FROM partials WHERE run_id = $1 AND round_idx = $2 ORDER BY slot",
        )
        .bind(run_id.0)
        .bind(round.round_idx)
        .fetch_all(&self.pool)
        .await
        .map_err(map_err)?;
        let ids = |json: &str| -> StoreResult<Vec<i64>> {
            serde_json::from_str(json)
                .map_err(|e| StoreError::Corrupt(format!("partial id list of run {run_id}: {e}")))
        };
        let partials = partials
            .iter()
            .map(|(slot, aggregators, devices)| {
                Ok(StoredPartial {
                    slot: *slot,
                    aggregators: ids(aggregators)?
                        .into_iter()
                        .map(|a| AggregatorId(a as u32))
                        .collect(),
                    devices: ids(devices)?.into_iter().map(DeviceId).collect(),
                })
            })
            .collect::<StoreResult<Vec<_>>>()?;
        let secure_records: Vec<(Vec<u8>,)> = sqlx::query_as(
            "SELECT record FROM secagg_records WHERE run_id = $1 AND round_idx = $2 ORDER BY seq",
        )
        .bind(run_id.0)
        .bind(round.round_idx)
        .fetch_all(&self.pool)
        .await
        .map_err(map_err)?;
        Ok(Some(OpenRoundState {
            round: RoundOpened {
                round_idx: RoundIdx(round.round_idx),
                model_version: ModelVersion(round.model_version),
                opened_at: round.opened_at_ms,
                selection_deadline: round.selection_deadline_ms,
                reporting_deadline: round.reporting_deadline_ms,
            },
            selected: selected.into_iter().map(|(d,)| DeviceId(d)).collect(),
            reported: reported.into_iter().map(|(d, s)| (DeviceId(d), s)).collect(),
            secure_records: secure_records.into_iter().map(|(r,)| r).collect(),
            assignments: assignments
                .into_iter()
                .map(|(d, a)| (DeviceId(d), AggregatorId(a as u32)))
                .collect(),
            partials,
        }))
    }

    /// Every device selected for a round, by id, with how its contribution reached the round.
    pub async fn round_devices(
        &self,
        run_id: RunId,
        round_idx: RoundIdx,
    ) -> StoreResult<Vec<RoundDeviceRow>> {
        let mut rows: Vec<RoundDeviceRow> = sqlx::query_as(
            "SELECT s.device_id, s.selected_at_ms, s.aggregator_id,
                    CASE WHEN u.device_id IS NULL THEN NULL ELSE 'update' END AS reported,
                    u.example_count
             FROM selections s LEFT JOIN updates u
               ON u.run_id = s.run_id AND u.round_idx = s.round_idx AND u.device_id = s.device_id
             WHERE s.run_id = $1 AND s.round_idx = $2 ORDER BY s.device_id",
        )
        .bind(run_id.0)
        .bind(round_idx.0)
        .fetch_all(&self.pool)
        .await
        .map_err(map_err)?;
        let partials: Vec<(String,)> = sqlx::query_as(
            "SELECT devices_json FROM partials WHERE run_id = $1 AND round_idx = $2",
        )
        .bind(run_id.0)
        .bind(round_idx.0)
        .fetch_all(&self.pool)
        .await
        .map_err(map_err)?;
        for (json,) in partials {
            let devices: Vec<i64> = serde_json::from_str(&json).map_err(|e| {
                StoreError::Corrupt(format!("partial device list of run {run_id}: {e}"))
            })?;
            for row in rows.iter_mut().filter(|r| devices.contains(&r.device_id)) {
                row.reported = Some("partial".to_owned());
            }
        }
        Ok(rows)
    }

    /// How many secure-aggregation records a run holds (closed rounds hold none).
    pub async fn secagg_record_count(&self, run_id: RunId) -> StoreResult<usize> {
        let (n,): (i64,) = sqlx::query_as("SELECT COUNT(*) FROM secagg_records WHERE run_id = $1")
            .bind(run_id.0)
            .fetch_one(&self.pool)
            .await
            .map_err(map_err)?;
        Ok(n as usize)
    }

    /// Every stored secure-aggregation record of a run's open round and every stored update
    /// payload of the run: what an audit of "the server never holds an unmasked update" reads.
    pub async fn stored_payloads(&self, run_id: RunId) -> StoreResult<Vec<Vec<u8>>> {
        let mut out: Vec<(Vec<u8>,)> =
            sqlx::query_as("SELECT record FROM secagg_records WHERE run_id = $1")
                .bind(run_id.0)
                .fetch_all(&self.pool)
                .await
                .map_err(map_err)?;
        let updates: Vec<(Vec<u8>,)> =
            sqlx::query_as("SELECT delta FROM updates WHERE run_id = $1 AND delta IS NOT NULL")
                .bind(run_id.0)
                .fetch_all(&self.pool)
                .await
                .map_err(map_err)?;
        out.extend(updates);
        Ok(out.into_iter().map(|(b,)| b).collect())
    }

    /// Highest round index ever opened for a run.
    pub async fn last_round_idx(&self, run_id: RunId) -> StoreResult<Option<RoundIdx>> {
        let row: Option<(i64,)> = sqlx::query_as(
            "SELECT round_idx FROM rounds WHERE run_id = $1 ORDER BY round_idx DESC LIMIT 1",
        )
        .bind(run_id.0)
        .fetch_optional(&self.pool)
        .await
        .map_err(map_err)?;
        Ok(row.map(|(r,)| RoundIdx(r)))
    }

    /// Streams a round's stored updates in slot order to `each`, one at a time, so replay
    /// needs memory for one update, not the cohort.
    pub async fn for_each_update(
        &self,
        run_id: RunId,
        round_idx: RoundIdx,
        mut each: impl FnMut(StoredUpdate) -> StoreResult<()>,
    ) -> StoreResult<u64> {
        let mut rows = sqlx::query_as::<_, StoredUpdate>(
            "SELECT device_id, slot, example_count, metrics_json, delta FROM updates
             WHERE run_id = $1 AND round_idx = $2 AND delta IS NOT NULL ORDER BY slot",
        )
        .bind(run_id.0)
        .bind(round_idx.0)
        .fetch(&self.pool);
        let mut n = 0;
        while let Some(row) = rows.try_next().await.map_err(map_err)? {
            each(row)?;
            n += 1;
        }
        Ok(n)
    }

    /// Commits a round: new model version, round row, run progress, and the round's update
    /// payloads released (they now live on in the model), in one transaction.
    pub async fn commit_round(
        &self,
        run_id: RunId,
        commit: RoundCommit<'_>,
        now: Millis,
    ) -> StoreResult<()> {
        let c = commit.closing;
        let new_version = c.model_version.0 + 1;
        let mut tx = self.pool.begin().await.map_err(map_err)?;
        self.check_fence(&mut tx).await?;
        sqlx::query(
            "INSERT INTO models (run_id, version, content_hash, data, round_idx, created_at_ms) VALUES ($1, $2, $3, $4, $5, $6)",
        )
        .bind(run_id.0)
        .bind(new_version)
        .bind(commit.model_hash)
        .bind(commit.model)
        .bind(c.round_idx.0)
        .bind(now)
        .execute(&mut *tx)
        .await
        .map_err(map_err)?;
        close_round_row(&mut tx, run_id, &c, "committed", Some(commit.metrics)).await?;
        sqlx::query(
            "UPDATE runs SET model_version = $2, rounds_committed = rounds_committed + 1, updated_at_ms = $3 WHERE id = $1",
        )
        .bind(run_id.0)
        .bind(new_version)
        .bind(now)
        .execute(&mut *tx)
        .await
        .map_err(map_err)?;
        release_payloads(&mut tx, run_id, c.round_idx).await?;
        delete_secagg_records(&mut tx, run_id, c.round_idx).await?;
        if let Some(e) = commit.evaluation {
            let metrics = serde_json::to_string(&e.metrics).expect("metrics serialize");
            sqlx::query(
                "INSERT INTO aggregate_evaluations (run_id, model_version, source, n_devices, example_count, metrics_json, received_at_ms)
                 VALUES ($1, $2, $3, $4, $5, $6, $7)",
            )
            .bind(run_id.0)
            .bind(c.model_version.0)
            .bind(SECURE_EVALUATION_SOURCE)
            .bind(e.n_devices as i64)
            .bind(e.example_count as i64)
            .bind(metrics)
            .bind(now)
            .execute(&mut *tx)
            .await
            .map_err(map_err)?;
        }
        tx.commit().await.map_err(map_err)
    }

    /// Records a failed round. Its updates stay stored but are never folded: a retry is a new
    /// round with new uploads.
    pub async fn fail_round(&self, run_id: RunId, closing: RoundClosing) -> StoreResult<()> {
        let mut tx = self.pool.begin().await.map_err(map_err)?;
        self.check_fence(&mut tx).await?;
        close_round_row(&mut tx, run_id, &closing, "failed", None).await?;
        release_payloads(&mut tx, run_id, closing.round_idx).await?;
        delete_secagg_records(&mut tx, run_id, closing.round_idx).await?;
        tx.commit().await.map_err(map_err)
    }

    /// A run's rounds, oldest first, with live counts for the open one.
    pub async fn rounds(&self, run_id: RunId) -> StoreResult<Vec<RoundRow>> {
        sqlx::query_as(concat!(round_select!(), " WHERE r.run_id = $1 ORDER BY r.round_idx"))
            .bind(run_id.0)
            .fetch_all(&self.pool)
            .await
            .map_err(map_err)
    }

    /// One round, with live counts if it is open.
    pub async fn round(&self, run_id: RunId, round_idx: RoundIdx) -> StoreResult<Option<RoundRow>> {
        sqlx::query_as(concat!(round_select!(), " WHERE r.run_id = $1 AND r.round_idx = $2"))
            .bind(run_id.0)
            .bind(round_idx.0)
            .fetch_optional(&self.pool)
            .await
            .map_err(map_err)
    }

    /// Stores an evaluation report; a second report of one device on one model is a conflict.
    pub async fn insert_evaluation(
        &self,
        run_id: RunId,
        device: DeviceId,
        model_version: ModelVersion,
        example_count: u64,
        metrics_json: &str,
        now: Millis,
    ) -> StoreResult<()> {
        sqlx::query(
            "INSERT INTO evaluations (run_id, model_version, device_id, example_count, metrics_json, received_at_ms)
             VALUES ($1, $2, $3, $4, $5, $6)",
        )
        .bind(run_id.0)
        .bind(model_version.0)
        .bind(device.0)
        .bind(example_count as i64)
        .bind(metrics_json)
        .bind(now)
        .execute(&self.pool)
        .await
        .map_err(map_err)?;
        Ok(())
    }

    /// A run's pooled evaluations (a secure round's cohort), by model version.
    pub async fn aggregate_evaluations(
        &self,
        run_id: RunId,
    ) -> StoreResult<Vec<AggregateEvaluationRow>> {
        sqlx::query_as(
            "SELECT model_version, source, n_devices, example_count, metrics_json FROM aggregate_evaluations
             WHERE run_id = $1 ORDER BY model_version, source",
        )
        .bind(run_id.0)
        .fetch_all(&self.pool)
        .await
        .map_err(map_err)
    }

    /// Whether `device` was selected for a round of `run_id` that trained `version`: the
    /// devices whose evaluation of that version the run accepts.
    pub async fn selected_for_version(
        &self,
        run_id: RunId,
        device: DeviceId,
        version: ModelVersion,
    ) -> StoreResult<bool> {
        let row: Option<(i64,)> = sqlx::query_as(
            "SELECT s.round_idx FROM selections s JOIN rounds r ON r.run_id = s.run_id AND r.round_idx = s.round_idx
             WHERE s.run_id = $1 AND s.device_id = $2 AND r.model_version = $3 LIMIT 1",
        )
        .bind(run_id.0)
        .bind(device.0)
        .bind(version.0)
        .fetch_optional(&self.pool)
        .await
        .map_err(map_err)?;
        Ok(row.is_some())
    }

    /// All evaluation reports of a run.
    pub async fn evaluations(&self, run_id: RunId) -> StoreResult<Vec<EvaluationRow>> {
        sqlx::query_as(
            "SELECT model_version, example_count, metrics_json FROM evaluations WHERE run_id = $1 ORDER BY model_version",
        )
        .bind(run_id.0)
        .fetch_all(&self.pool)
        .await
        .map_err(map_err)
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
