//! Fleet requests relayed from replicas to the leader through the store, and their answers:
//! how a coordinator that does not lead serves devices while round decisions stay with the one
//! that does (see `crate::relay`).

use starling_core::Millis;

use super::*;

/// A relayed request the leader took: its row id and CBOR.
#[derive(Debug, Clone, PartialEq)]
pub struct RelayedRequestRow {
    /// Row id, the order requests arrived in.
    pub id: i64,
    /// The relayed request's CBOR.
    pub request: Vec<u8>,
}

impl SqlStore {
    /// Writes a request `replica` relays to the leader; its row id. `Ok` means it is in the
    /// store: a leader takes it even if it starts only later. (The table is unlogged on
    /// Postgres: a crash of Postgres itself loses it, a request nobody answered.)
    pub async fn relay_request(
        &self,
        replica: i64,
        request: &[u8],
        now: Millis,
    ) -> StoreResult<i64> {
        on_pool!(self, |pool| {
            let (id,): (i64,) = sqlx::query_as(
                "INSERT INTO relayed_requests (replica, request, created_at_ms) VALUES ($1, $2, $3)
                 RETURNING id",
            )
            .bind(replica)
            .bind(request)
            .bind(now)
            .fetch_one(pool)
            .await
            .map_err(map_err)?;
            Ok(id)
        })
    }

    /// Takes up to `limit` relayed requests nobody took yet, oldest first, marking them taken.
    /// Only the leader calls it, so no two callers take the same row.
    pub async fn take_relayed(
        &self,
        limit: i64,
        now: Millis,
    ) -> StoreResult<Vec<RelayedRequestRow>> {
        let mut rows: Vec<(i64, Vec<u8>)> = on_pool!(self, |pool| {
            sqlx::query_as(
                "UPDATE relayed_requests SET taken_at_ms = $1
                 WHERE id IN (SELECT id FROM relayed_requests WHERE taken_at_ms IS NULL
                              ORDER BY id LIMIT $2)
                 RETURNING id, request",
            )
            .bind(now)
            .bind(limit)
            .fetch_all(pool)
            .await
            .map_err(map_err)
        })?;
        rows.sort_unstable_by_key(|(id, _)| *id);
        Ok(rows.into_iter().map(|(id, request)| RelayedRequestRow { id, request }).collect())
    }

    /// Records the leader's answers to relayed requests (row id, answer), letting go of the
    /// requests' bytes: on Postgres in one statement, however many.
    pub async fn answer_relayed(&self, answers: &[(i64, Vec<u8>)], now: Millis) -> StoreResult<()> {
        match &self.pool {
            Pool::Postgres(pool) => {
                let (ids, bytes): (Vec<i64>, Vec<&[u8]>) =
                    answers.iter().map(|(id, answer)| (*id, answer.as_slice())).unzip();
                sqlx::query(
                    "UPDATE relayed_requests r
                     SET answer = a.answer, answered_at_ms = $3, request = ''::bytea
                     FROM UNNEST($1::bigint[], $2::bytea[]) AS a(id, answer) WHERE r.id = a.id",
                )
                .bind(ids)
                .bind(bytes)
                .bind(now)
                .execute(pool)
                .await
                .map(drop)
                .map_err(map_err)
            }
            // No replica shares an SQLite store: a loop is enough.
            Pool::Sqlite(pool) => {
                for (id, answer) in answers {
                    sqlx::query(
                        "UPDATE relayed_requests SET answer = $2, answered_at_ms = $3, request = X''
                         WHERE id = $1",
                    )
                    .bind(id)
                    .bind(answer)
                    .bind(now)
                    .execute(pool)
                    .await
                    .map_err(map_err)?;
                }
                Ok(())
            }
        }
    }

    /// The answers `replica` waits for that the leader has written, each read once: the rows
    /// go as they are read.
    pub async fn collect_relayed_answers(&self, replica: i64) -> StoreResult<Vec<(i64, Vec<u8>)>> {
        on_pool!(self, |pool| {
            sqlx::query_as(
                "DELETE FROM relayed_requests WHERE replica = $1 AND answer IS NOT NULL
                 RETURNING id, answer",
            )
            .bind(replica)
            .fetch_all(pool)
            .await
            .map_err(map_err)
        })
    }

    /// Withdraws relayed request `id` when the leader has not taken it yet (its replica stopped
    /// waiting); whether it was withdrawn. A request already taken stays: its answer comes, and
    /// the device's retry meets what the leader did with it.
    pub async fn withdraw_relayed(&self, id: i64) -> StoreResult<bool> {
        on_pool!(self, |pool| {
            sqlx::query("DELETE FROM relayed_requests WHERE id = $1 AND taken_at_ms IS NULL")
                .bind(id)
                .execute(pool)
                .await
                .map(|done| done.rows_affected() == 1)
                .map_err(map_err)
        })
    }

    /// At a leader's start: requests an earlier leader took but never answered are waiting
    /// again; how many.
    pub async fn retake_unanswered_relayed(&self) -> StoreResult<u64> {
        on_pool!(self, |pool| {
            sqlx::query(
                "UPDATE relayed_requests SET taken_at_ms = NULL
                 WHERE taken_at_ms IS NOT NULL AND answer IS NULL",
            )
            .execute(pool)
            .await
            .map(|done| done.rows_affected())
            .map_err(map_err)
        })
    }

    /// Drops relayed requests and answers written before `before` (their replicas are gone or
    /// stopped waiting long ago); how many.
    pub async fn expire_relayed(&self, before: Millis) -> StoreResult<u64> {
        on_pool!(self, |pool| {
            sqlx::query("DELETE FROM relayed_requests WHERE created_at_ms < $1")
                .bind(before)
                .execute(pool)
                .await
                .map(|done| done.rows_affected())
                .map_err(map_err)
        })
    }
}
