//! Who drives the runs: the Postgres advisory lock that elects one coordinator among those
//! sharing a database, the lease that keeps a hung or cut-off leader from holding it, and the
//! leadership epoch that fences a deposed leader's writes.
//!
//! The lock alone is held by a *session*: a leader that is paused (SIGSTOP, a long GC-like
//! stall, a frozen VM) or cut off from the database keeps its session open as far as Postgres
//! knows, for as long as TCP keepalives take (two hours with the defaults), and no standby can
//! lead meanwhile. So the leader also holds a lease in the `leadership_lease` row, renewed every
//! [`RENEW_EVERY`] on the lock's own connection and timed by the database's clock (no clock
//! skew between coordinators). A standby that finds the lease lapsed for [`LEASE`] terminates
//! the backend that holds the lock (`pg_terminate_backend`, which the coordinators' role needs
//! the right to do), takes the lock and moves the epoch on. Whatever a deposed leader still
//! tries to write after its successor took over is refused by the epoch fence, so two leaders
//! never both write.
//!
//! Load cannot starve the renewal: the lease is a row of its own, which no write locks (the
//! fence reads the `leadership` row's epoch `FOR SHARE` in every write, and a renewal of a lease
//! kept there once queued behind a thousand devices' uploads until the lone leader deposed
//! itself). A renewal that is slow anyway is waited for: until the lease has lapsed no standby
//! may break it, and after that one that does terminates this session, which fails the
//! renewal at once. Only a renewal still unanswered [`RENEW_GIVE_UP`] after the last one (the
//! database unreachable: cut off, no FIN, no RST) makes the leader stop by itself.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::time::Duration;

use sqlx::Connection;

use super::*;

/// The leadership epoch this store writes under, shared by its clones.
///
/// Postgres only: [`SqlStore::acquire_leadership`] increments the stored epoch and keeps it
/// here; every write of round state then reads the stored epoch `FOR SHARE` in its own
/// transaction and refuses to commit when it changed. A successor's increment waits for the
/// writes in flight and every later write of the deposed leader fails, so no write of it lands
/// after its successor took over. SQLite has one process per file and no epoch.
#[derive(Debug, Default)]
pub(super) struct Fence {
    /// 0 until this store leads.
    pub(super) epoch: AtomicI64,
    /// Set once a write found a newer epoch.
    pub(super) deposed: AtomicBool,
    pub(super) wake: tokio::sync::Notify,
}

/// Postgres advisory-lock key held by the coordinator that drives runs ("STAR").
const LEADER_LOCK_KEY: i64 = 0x5354_4152;

/// How long a leader's claim lasts without renewal: a standby takes over at most this long (plus
/// its own [`STANDBY_POLL`]) after the leader last renewed.
pub const LEASE: Duration = Duration::from_secs(10);
/// How often the leader renews its lease (and checks that its lock's session is alive).
pub const RENEW_EVERY: Duration = Duration::from_secs(1);
/// A renewal slower than this is logged as a warning and waited for.
pub const RENEW_TIMEOUT: Duration = Duration::from_secs(4);
/// A renewal still unanswered this long after the last one that succeeded counts as the lock
/// lost (the database is unreachable); past the lease, so that slowness alone never deposes a
/// leader no standby replaced.
pub const RENEW_GIVE_UP: Duration = Duration::from_secs(LEASE.as_secs() + 5);
/// How often a standby tries the lock and looks for a lapsed lease.
pub const STANDBY_POLL: Duration = Duration::from_secs(1);

/// The database's clock in ms, as a BIGINT (the store's time columns).
macro_rules! db_now_ms {
    () => {
        "(extract(epoch from clock_timestamp()) * 1000)::bigint"
    };
}

/// Settings of every Postgres session of the coordinator. Server-side keepalives: a client
/// that vanished (cut off, its host gone) is noticed in about 10 + 5 × 3 = 25 s instead of the
/// OS default of two hours. And a transaction left open and idle for a lease (its coordinator
/// paused mid-write) is ended, so the row lock it holds on `leadership` cannot stop a successor
/// from moving the epoch on; the store's transactions are never idle that long otherwise.
pub(super) const SESSION_SETTINGS: [(&str, &str); 4] = [
    ("tcp_keepalives_idle", "10"),
    ("tcp_keepalives_interval", "5"),
    ("tcp_keepalives_count", "3"),
    ("idle_in_transaction_session_timeout", "10000"),
];

/// Holds the leadership lock; dropping it releases the lock.
#[derive(Debug)]
pub struct Leadership {
    conn: Option<sqlx::PgConnection>,
    fence: Arc<Fence>,
}

/// The Postgres `application_name` of the connection that holds the leadership lock.
pub const LEADER_APPLICATION_NAME: &str = "starling-leader";

impl Leadership {
    /// Renews the lease while it holds the lock, and resolves when the lock is lost: a renewal
    /// failed or did not answer within [`RENEW_TIMEOUT`] (the server restarted, a standby
    /// terminated the session after the lease lapsed, the network broke), or another
    /// coordinator's epoch is in the row. Postgres releases an advisory lock with its session,
    /// so from then on another coordinator may drive the runs; this one must stop. Also
    /// resolves as soon as a write of this store was fenced (a successor took over). Never
    /// resolves for SQLite (one process owns the file).
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
        let epoch = self.fence.epoch.load(Ordering::SeqCst);
        let dead = async {
            let mut renewed = tokio::time::Instant::now();
            loop {
                tokio::time::sleep(RENEW_EVERY).await;
                let renewal = sqlx::query(concat!(
                    "UPDATE leadership_lease SET lease_expires_at_ms = ",
                    db_now_ms!(),
                    " + $1 WHERE id = 1 AND epoch = $2"
                ))
                .bind(LEASE.as_millis() as i64)
                .bind(epoch)
                .execute(&mut *conn);
                tokio::pin!(renewal);
                let answer = match tokio::time::timeout(RENEW_TIMEOUT, &mut renewal).await {
                    Ok(answer) => answer,
                    Err(_) => {
                        tracing::warn!(timeout = ?RENEW_TIMEOUT, "renewing the leadership lease is slow; waiting for it");
                        match tokio::time::timeout_at(renewed + RENEW_GIVE_UP, &mut renewal).await {
                            Ok(answer) => answer,
                            Err(_) => {
                                tracing::error!(give_up = ?RENEW_GIVE_UP, "renewing the leadership lease did not answer: the database is unreachable");
                                return;
                            }
                        }
                    }
                };
                match answer {
                    Ok(done) if done.rows_affected() == 1 => renewed = tokio::time::Instant::now(),
                    Ok(_) => {
                        tracing::error!(
                            epoch,
                            "another coordinator's epoch is in the leadership lease"
                        );
                        return;
                    }
                    Err(e) => {
                        tracing::error!(error = %e, "renewing the leadership lease failed");
                        return;
                    }
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

    /// Waits until this process may drive runs, as a standby does: tries the lock every
    /// [`STANDBY_POLL`], and when the holder's lease has lapsed terminates its session so the
    /// lock is released. Store errors are retried (logged).
    pub async fn wait_for_leadership(&self) -> Leadership {
        loop {
            match self.try_acquire_leadership().await {
                Ok(Some(leadership)) => return leadership,
                Ok(None) => {
                    if let Err(e) = self.break_lapsed_lease().await {
                        tracing::warn!(error = %e, "checking the leader's lease failed; retrying");
                    }
                }
                Err(e) => tracing::warn!(error = %e, "trying the leadership lock failed; retrying"),
            }
            tokio::time::sleep(STANDBY_POLL).await;
        }
    }

    /// Terminates the session holding the leadership lock if its lease has lapsed (the leader
    /// stopped renewing: paused, hung or cut off); whether it did. Only that session is
    /// terminated: the one recorded in the row *and* holding the lock now. Postgres only.
    pub async fn break_lapsed_lease(&self) -> StoreResult<bool> {
        let Pool::Postgres(pool) = &self.pool else { return Ok(false) };
        let broken: Option<(i64, i64, bool)> = sqlx::query_as(concat!(
            "SELECT l.backend_pid, l.epoch, pg_terminate_backend(l.backend_pid::int)
             FROM leadership_lease l
             WHERE l.id = 1 AND l.lease_expires_at_ms < ",
            db_now_ms!(),
            " AND l.backend_pid IN (SELECT pid::bigint FROM pg_locks
                 WHERE locktype = 'advisory' AND granted AND objid::bigint = $1)"
        ))
        .bind(LEADER_LOCK_KEY)
        .fetch_optional(pool)
        .await
        .map_err(map_err)?;
        Ok(match broken {
            Some((pid, epoch, terminated)) => {
                tracing::warn!(
                    backend_pid = pid,
                    epoch,
                    terminated,
                    "the leader's lease lapsed; terminated the session holding the leadership lock"
                );
                terminated
            }
            None => false,
        })
    }

    async fn lock_leadership(&self, wait: bool) -> StoreResult<Option<Leadership>> {
        let fence = self.fence.clone();
        match &self.pool {
            Pool::Sqlite(_) => Ok(Some(Leadership { conn: None, fence })),
            Pool::Postgres(pool) => {
                let options = (*pool.connect_options()).clone();
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
                let (epoch,): (i64,) = sqlx::query_as(concat!(
                    "UPDATE leadership SET epoch = epoch + 1, holder = $1, acquired_at_ms = $2,
                     backend_pid = pg_backend_pid(), lease_expires_at_ms = ",
                    db_now_ms!(),
                    " + $3 WHERE id = 1 RETURNING epoch"
                ))
                .bind(format!("pid {}", std::process::id()))
                .bind(crate::clock::now_ms())
                .bind(LEASE.as_millis() as i64)
                .fetch_one(&mut conn)
                .await
                .map_err(map_err)?;
                // The lease a standby reads, on a row no write of round state locks.
                sqlx::query(concat!(
                    "INSERT INTO leadership_lease (id, epoch, backend_pid, lease_expires_at_ms)
                     VALUES (1, $1, pg_backend_pid(), ",
                    db_now_ms!(),
                    " + $2)
                     ON CONFLICT (id) DO UPDATE SET epoch = EXCLUDED.epoch,
                         backend_pid = EXCLUDED.backend_pid,
                         lease_expires_at_ms = EXCLUDED.lease_expires_at_ms"
                ))
                .bind(epoch)
                .bind(LEASE.as_millis() as i64)
                .execute(&mut conn)
                .await
                .map_err(map_err)?;
                fence.epoch.store(epoch, Ordering::SeqCst);
                fence.deposed.store(false, Ordering::SeqCst);
                Ok(Some(Leadership { conn: Some(conn), fence }))
            }
        }
    }
}

impl Fence {
    /// Inside a write transaction of round state: refuses to go on when another coordinator
    /// took the leadership since this store did.
    pub(super) async fn check(
        &self,
        tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    ) -> StoreResult<()> {
        let ours = self.epoch.load(Ordering::SeqCst);
        if ours == 0 {
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
        if !self.deposed.swap(true, Ordering::SeqCst) {
            tracing::error!(
                ours,
                current,
                "another coordinator took the leadership; refusing to write"
            );
        }
        self.wake.notify_waiters();
        Err(StoreError::Fenced { ours, current })
    }
}
