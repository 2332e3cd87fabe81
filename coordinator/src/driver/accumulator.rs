//! The thread that owns one run's accumulator, so folding never blocks the async driver.
//!
//! Messages are handled in order, which is what keeps the fold order equal to the machine's
//! slot order.

use starling_core::fedavg::{Aggregate, AggregateError, FedAvgAccumulator};
use starling_core::round::Contribution;
use tokio::sync::oneshot;

/// Folds `contributions` into `acc` in order: updates next to each other together
/// ([`FedAvgAccumulator::add_all`]), a partial's sums on their own.
fn fold_all(
    acc: Option<&mut FedAvgAccumulator>,
    contributions: impl Iterator<Item = Contribution>,
) {
    let Some(acc) = acc else { return };
    let mut updates = vec![];
    for contribution in contributions {
        match contribution {
            Contribution::Update(update) => updates.push((update, 1.0)),
            Contribution::Stale { update, discount, .. } => updates.push((update, discount)),
            Contribution::Partial(sums) => {
                acc.add_all(updates.iter().map(|(u, d)| (u, *d)));
                updates.clear();
                acc.merge(&sums);
            }
        }
    }
    acc.add_all(updates.iter().map(|(u, d)| (u, *d)));
}

/// A run's accumulator on a thread of its own.
pub(super) struct AccumulatorWorker {
    tx: std::sync::mpsc::Sender<Message>,
}

enum Message {
    Reset(FedAvgAccumulator),
    Fold(Contribution),
    Finish(oneshot::Sender<Result<Aggregate, AggregateError>>),
}

impl AccumulatorWorker {
    /// A thread folding into `initial` (a fresh one, or one a restart replayed into).
    pub(super) fn spawn(initial: FedAvgAccumulator) -> Self {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::Builder::new()
            .name("fedavg-accumulator".into())
            .spawn(move || {
                let mut acc = Some(initial);
                while let Ok(first) = rx.recv() {
                    // Folds that queued while the last ones ran go in together: the same sums
                    // as one by one, for one pass over the accumulator's memory.
                    let mut folds = vec![];
                    for message in std::iter::once(first).chain(rx.try_iter()) {
                        match message {
                            Message::Fold(contribution) => folds.push(contribution),
                            Message::Reset(fresh) => {
                                fold_all(acc.as_mut(), folds.drain(..));
                                acc = Some(fresh);
                            }
                            Message::Finish(reply) => {
                                fold_all(acc.as_mut(), folds.drain(..));
                                let res = acc
                                    .take()
                                    .map_or(Err(AggregateError::Empty), FedAvgAccumulator::finish);
                                let _ = reply.send(res);
                            }
                        }
                    }
                    fold_all(acc.as_mut(), folds.drain(..));
                }
            })
            .expect("spawning the accumulator thread");
        AccumulatorWorker { tx }
    }

    /// Starts a new round's sum in `fresh` (empty, bounded as the run's strategy says).
    pub(super) fn reset(&self, fresh: FedAvgAccumulator) {
        let _ = self.tx.send(Message::Reset(fresh));
    }

    /// Folds a durable update or partial in.
    pub(super) fn fold(&self, contribution: Contribution) {
        let _ = self.tx.send(Message::Fold(contribution));
    }

    /// The round's aggregate, once every earlier fold is in.
    pub(super) fn finish(&self) -> oneshot::Receiver<Result<Aggregate, AggregateError>> {
        let (tx, rx) = oneshot::channel();
        let _ = self.tx.send(Message::Finish(tx));
        rx
    }
}
