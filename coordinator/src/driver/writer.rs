//! One ordered writer per run, off the driver task: a batch's transitions (round opened,
//! devices selected, a secure round's records with their model-sized masked inputs, run
//! finished) are made durable in order, then the batch's payload writes (updates, partials)
//! are started, its replies sent and its closings spawned. The driver only decides and queues;
//! a slow write delays that run's answers, not every run's. Batches that queue while a write is in flight are written together, in order,
//! in the next transaction (group commit).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
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
    tx: mpsc::Sender<(Batch, Millis, u64)>,
    task: tokio::task::JoinHandle<()>,
    /// Batches queued so far; the next one is numbered one more.
    queued: u64,
    /// The number of the last batch whose transitions are durable (or that had none).
    durable: Arc<AtomicU64>,
    /// The batch that opened the run's newest round.
    round_opened_in: u64,
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
        let (tx, mut rx) = mpsc::channel::<(Batch, Millis, u64)>(QUEUED_BATCHES);
        let durable = Arc::new(AtomicU64::new(0));
        let written = durable.clone();
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
                    .filter(|(batch, ..)| !batch.transitions.is_empty())
                    .map(|(batch, now, _)| (batch.transitions.as_slice(), *now))
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
                let last = batches.last().map_or(0, |(.., seq)| *seq);
                written.store(last, Ordering::Release);
                for (batch, ..) in batches {
                    // Concurrent with each other and with later batches' transitions: only
                    // the round row they refer to had to come first.
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
        RunWriter { tx, task, queued: 0, durable, round_opened_in: 0 }
    }

    /// The batch being built opens a round: payloads for it wait until that batch is durable.
    pub(super) fn opens_round(&mut self) {
        self.round_opened_in = self.queued + 1;
    }

    /// Whether the newest round's row is durable, so a payload for it may be written at once
    /// (else it goes with the batch, after the transitions before it).
    pub(super) fn round_is_durable(&self) -> bool {
        self.durable.load(Ordering::Acquire) >= self.round_opened_in
    }

    /// Ends the writer once what it was handed is written (or fenced off), so that a driver
    /// that stops leaves no write behind it for a successor to race.
    pub(super) async fn finish(self) {
        drop(self.tx);
        let _ = self.task.await;
    }

    /// Queues `batch`, waiting only when the writer is [`QUEUED_BATCHES`] behind.
    pub(super) async fn write(&mut self, batch: Batch, now: Millis) {
        self.queued += 1;
        // The writer only stops after a fence, and then the driver stops too.
        let _ = self.tx.send((batch, now, self.queued)).await;
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
