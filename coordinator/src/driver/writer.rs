//! One ordered writer per run, off the driver task: a batch's transitions (round opened,
//! devices selected, a secure round's records with their model-sized masked inputs, run
//! finished) are made durable in order, then the batch's payload writes (updates, partials)
//! are started, its replies sent and its closings spawned. The driver only decides and queues;
//! a slow write delays that run's answers, not every run's. Batches that queue while a write is in flight are written together, in order,
//! in the next transaction (group commit).

use std::time::Duration;

use starling_core::{Millis, RunId};
use tokio::sync::mpsc;

use super::Internal;
use super::close::CloseTask;
use crate::observe::Observer;
use crate::store::{SqlStore, StoreError, Transition};

/// A reply held back until the batch's transitions are durable.
pub(super) type Deferred = Box<dyn FnOnce() + Send>;

/// A payload write (an update, a partial) started once the batch's transitions are durable.
pub(super) type PayloadWrite = std::pin::Pin<Box<dyn Future<Output = ()> + Send>>;

/// What one batch of a run's actions adds up to: transitions to persist together, then (once
/// they and every earlier batch's are durable) payloads to write, replies to send and rounds
/// to close.
#[derive(Default)]
pub(super) struct Batch {
    pub(super) transitions: Vec<Transition>,
    pub(super) writes: Vec<PayloadWrite>,
    pub(super) replies: Vec<Deferred>,
    pub(super) closings: Vec<CloseTask>,
}

impl Batch {
    pub(super) fn is_empty(&self) -> bool {
        self.transitions.is_empty()
            && self.writes.is_empty()
            && self.replies.is_empty()
            && self.closings.is_empty()
    }
}

/// Batches a run's writer may hold before the driver waits for it (backpressure when the
/// store falls behind, instead of unbounded memory of queued masked inputs).
const QUEUED_BATCHES: usize = 64;

/// A run's writer task.
pub(super) struct RunWriter {
    tx: mpsc::Sender<(Batch, Millis)>,
    task: tokio::task::JoinHandle<()>,
}

impl RunWriter {
    /// Starts the writer of `run_id`; it ends when the run's entry (and so this) is dropped
    /// and its queue is written, or when a write is fenced off (then it tells the driver).
    pub(super) fn spawn(
        run_id: RunId,
        store: SqlStore,
        observer: Observer,
        internal: mpsc::UnboundedSender<Internal>,
    ) -> Self {
        let (tx, mut rx) = mpsc::channel::<(Batch, Millis)>(QUEUED_BATCHES);
        let task = tokio::spawn(async move {
            while let Some(first) = rx.recv().await {
                // Batches that queued while the last write was in flight join this one: one
                // transaction, one flush, for a cohort checking in at once.
                let mut batches = vec![first];
                while let Ok(next) = rx.try_recv() {
                    batches.push(next);
                }
                let transitions: Vec<(&[Transition], Millis)> = batches
                    .iter()
                    .filter(|(batch, _)| !batch.transitions.is_empty())
                    .map(|(batch, now)| (batch.transitions.as_slice(), *now))
                    .collect();
                if !transitions.is_empty() {
                    let started = std::time::Instant::now();
                    if persist_transitions(&store, run_id, &transitions).await.is_err() {
                        // A successor leads: nothing of these batches (or any later one) is
                        // durable, so nobody hears of them, and the driver stops.
                        let _ = internal.send(Internal::Deposed);
                        return;
                    }
                    observer.store_latency("transitions", started.elapsed().as_secs_f64());
                }
                for (batch, _) in batches {
                    // Concurrent with each other and with later batches' transitions: only
                    // the round rows they refer to must come first.
                    for write in batch.writes {
                        tokio::spawn(write);
                    }
                    for task in batch.closings {
                        tokio::spawn(task.run());
                    }
                    for reply in batch.replies {
                        reply();
                    }
                }
            }
        });
        RunWriter { tx, task }
    }

    /// Ends the writer once what it was handed is written (or fenced off), so that a driver
    /// that stops leaves no write behind it for a successor to race.
    pub(super) async fn finish(self) {
        drop(self.tx);
        let _ = self.task.await;
    }

    /// Queues `batch`, waiting only when the writer is [`QUEUED_BATCHES`] behind.
    pub(super) async fn write(&self, batch: Batch, now: Millis) {
        // The writer only stops after a fence, and then the driver stops too.
        let _ = self.tx.send((batch, now)).await;
    }
}

/// Writes batches of transitions in one transaction, retrying with backoff until they are
/// durable; `Err` only when the write was fenced off (another coordinator leads).
async fn persist_transitions(
    store: &SqlStore,
    run_id: RunId,
    batches: &[(&[Transition], Millis)],
) -> Result<(), StoreError> {
    let mut backoff = Duration::from_millis(50);
    loop {
        match store.apply_transition_batches(run_id, batches).await {
            Ok(()) => return Ok(()),
            Err(e @ StoreError::Fenced { .. }) => {
                tracing::error!(%run_id, error = %e, "transitions fenced off; this coordinator no longer leads");
                return Err(e);
            }
            Err(e) => {
                tracing::error!(%run_id, error = %e, ?backoff, "persisting round transitions failed; retrying");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(2));
            }
        }
    }
}
