//! The thread that owns one run's accumulator, so folding never blocks the async driver.
//!
//! Messages are handled in order, which is what keeps the fold order equal to the machine's
//! slot order.

use starling_core::fedavg::{Aggregate, AggregateError, FedAvgAccumulator};
use starling_core::round::Contribution;
use tokio::sync::oneshot;

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
                while let Ok(message) = rx.recv() {
                    match message {
                        Message::Reset(fresh) => acc = Some(fresh),
                        Message::Fold(contribution) => {
                            if let Some(acc) = acc.as_mut() {
                                match &contribution {
                                    Contribution::Update(update) => acc.add(update),
                                    Contribution::Stale { update, discount, .. } => {
                                        acc.add_scaled(update, *discount)
                                    }
                                    Contribution::Partial(sums) => acc.merge(sums),
                                }
                            }
                        }
                        Message::Finish(reply) => {
                            let res = acc
                                .take()
                                .map_or(Err(AggregateError::Empty), FedAvgAccumulator::finish);
                            let _ = reply.send(res);
                        }
                    }
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
