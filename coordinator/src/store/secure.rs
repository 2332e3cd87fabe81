//! A secure round's protocol records: deleted when the round closes, and audited by the tests
//! for anything that is not masked.

use futures_util::TryStreamExt;
use starling_core::{RoundIdx, RunId};

use super::*;

impl SqlStore {
    /// Streams a round's protocol records in order to `each`, one at a time: how a secure
    /// round's close reads back the masked inputs to take out of its running sum, without
    /// holding the cohort's.
    pub async fn for_each_secagg_record(
        &self,
        run_id: RunId,
        round_idx: RoundIdx,
        mut each: impl FnMut(Vec<u8>),
    ) -> StoreResult<()> {
        on_pool!(self, |pool| {
            let mut rows = sqlx::query_as::<_, (Vec<u8>,)>(
                "SELECT record FROM secagg_records WHERE run_id = $1 AND round_idx = $2 ORDER BY seq",
            )
            .bind(run_id.0)
            .bind(round_idx.0)
            .fetch(pool);
            while let Some((record,)) = rows.try_next().await.map_err(map_err)? {
                each(record);
            }
            Ok(())
        })
    }

    /// How many secure-aggregation records a run holds (closed rounds hold none).
    pub async fn secagg_record_count(&self, run_id: RunId) -> StoreResult<usize> {
        on_pool!(self, |pool| {
            let (n,): (i64,) =
                sqlx::query_as("SELECT COUNT(*) FROM secagg_records WHERE run_id = $1")
                    .bind(run_id.0)
                    .fetch_one(pool)
                    .await
                    .map_err(map_err)?;
            Ok(n as usize)
        })
    }

    /// Every stored secure-aggregation record of a run's open round and every stored update
    /// payload of the run: what an audit of "the server never holds an unmasked update" reads.
    pub async fn stored_payloads(&self, run_id: RunId) -> StoreResult<Vec<Vec<u8>>> {
        on_pool!(self, |pool| {
            let mut out: Vec<(Vec<u8>,)> =
                sqlx::query_as("SELECT record FROM secagg_records WHERE run_id = $1")
                    .bind(run_id.0)
                    .fetch_all(pool)
                    .await
                    .map_err(map_err)?;
            let updates: Vec<(Vec<u8>,)> =
                sqlx::query_as("SELECT delta FROM updates WHERE run_id = $1 AND delta IS NOT NULL")
                    .bind(run_id.0)
                    .fetch_all(pool)
                    .await
                    .map_err(map_err)?;
            out.extend(updates);
            Ok(out.into_iter().map(|(b,)| b).collect())
        })
    }
}
