//! Who drives the runs: the Postgres advisory lock that elects one coordinator among those
//! sharing a database, and the leadership epoch that fences a deposed leader's writes.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};

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
