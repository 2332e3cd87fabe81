//! The thread that owns one run's accumulator, so folding never blocks the async driver.
//!
//! Messages are handled in order, which is what keeps the fold order equal to the machine's
//! slot order. In a run whose updates are stored as the sums of groups
//! ([`ValidatedPlan::stores_update_sums`](starling_core::plan::ValidatedPlan::stores_update_sums)),
//! updates fold into the open group, and sealing a group merges it into the round's sum and
//! hands it over to be written: the round's sum is then the very merges a replay of the stored
//! groups makes.

use starling_core::fedavg::{
    Aggregate, AggregateError, FedAvgAccumulator, FoldedGroup, ValidatedUpdate,
};
use starling_core::round::Contribution;
use tokio::sync::oneshot;

/// What an upload's HTTP edge holds while its bytes are in memory (its upload permit), let go
/// once its update is folded into a group: from then on its answer waits on the group's write,
/// which holds no update.
pub struct Hold(pub Box<dyn Send + Sync>);

impl std::fmt::Debug for Hold {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Hold")
    }
}

/// A sealed group: its sums, and each update's L2 norm in slot order (stored beside its row,
/// to trace a refused round to its updates).
pub(super) struct Sealed {
    pub(super) group: FoldedGroup,
    pub(super) norms: Vec<f64>,
}

/// The sums a run folds into: the round's, and the open group's when updates are grouped.
struct Sums {
    round: Option<FedAvgAccumulator>,
    group: Option<FedAvgAccumulator>,
    norms: Vec<f64>,
}

impl Sums {
    /// Folds `contributions` in order: updates next to each other together
    /// ([`FedAvgAccumulator::add_all`]) into the open group if there is one, else into the
    /// round's sum; a partial's sums into the round's, on their own.
    fn fold_all(&mut self, contributions: impl Iterator<Item = Contribution>) {
        if self.round.is_none() {
            return;
        }
        let mut updates = vec![];
        for contribution in contributions {
            match contribution {
                Contribution::Update(update) => updates.push((update, 1.0)),
                Contribution::Stale { update, discount, .. } => updates.push((update, discount)),
                Contribution::Partial(sums) => {
                    self.fold_updates(&mut updates);
                    self.round.as_mut().expect("checked above").merge(&sums);
                }
            }
        }
        self.fold_updates(&mut updates);
    }

    /// Folds a run of updates (each with its discount) into the open group, their norms kept
    /// for its rows, or into the round's sum; leaves `updates` empty.
    fn fold_updates(&mut self, updates: &mut Vec<(ValidatedUpdate, f64)>) {
        let run = updates.iter().map(|(u, d)| (u, *d));
        match (self.group.as_mut(), self.round.as_mut()) {
            (Some(group), _) => {
                self.norms.extend(updates.iter().map(|(u, _)| u.norm()));
                group.add_all(run);
            }
            (None, Some(round)) => round.add_all(run),
            (None, None) => {}
        }
        updates.clear();
    }

    /// Merges the open group into the round's sum and returns it.
    fn seal(&mut self) -> Option<Sealed> {
        let (round, group) = (self.round.as_mut()?, self.group.as_mut()?);
        let group = group.take_group()?;
        round.merge_group(&group.sums, group.n_within_bound);
        Some(Sealed { group, norms: std::mem::take(&mut self.norms) })
    }
}

/// A run's accumulator on a thread of its own.
pub(super) struct AccumulatorWorker {
    tx: std::sync::mpsc::Sender<Message>,
}

enum Message {
    Reset(FedAvgAccumulator),
    Fold(Contribution, Option<Hold>),
    Seal(oneshot::Sender<Option<Sealed>>),
    Finish(oneshot::Sender<Result<Aggregate, AggregateError>>),
}

impl AccumulatorWorker {
    /// A thread folding into `initial` (a fresh one, or one a restart replayed into), its
    /// updates in groups when `grouped`.
    pub(super) fn spawn(initial: FedAvgAccumulator, grouped: bool) -> Self {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::Builder::new()
            .name("fedavg-accumulator".into())
            .spawn(move || {
                let group = grouped.then(|| initial.empty_like());
                let mut sums = Sums { round: Some(initial), group, norms: vec![] };
                while let Ok(first) = rx.recv() {
                    // Folds that queued while the last ones ran go in together: the same sums
                    // as one by one, for one pass over the accumulator's memory.
                    let (mut folds, mut holds) = (vec![], vec![]);
                    for message in std::iter::once(first).chain(rx.try_iter()) {
                        match message {
                            Message::Fold(contribution, hold) => {
                                folds.push(contribution);
                                holds.extend(hold);
                            }
                            Message::Reset(fresh) => {
                                sums.fold_all(folds.drain(..));
                                sums.group = sums.group.is_some().then(|| fresh.empty_like());
                                sums.norms.clear();
                                sums.round = Some(fresh);
                            }
                            Message::Seal(reply) => {
                                sums.fold_all(folds.drain(..));
                                let _ = reply.send(sums.seal());
                            }
                            Message::Finish(reply) => {
                                sums.fold_all(folds.drain(..));
                                let res = sums
                                    .round
                                    .take()
                                    .map_or(Err(AggregateError::Empty), FedAvgAccumulator::finish);
                                let _ = reply.send(res);
                            }
                        }
                    }
                    sums.fold_all(folds.drain(..));
                    drop(holds);
                }
            })
            .expect("spawning the accumulator thread");
        AccumulatorWorker { tx }
    }

    /// Starts a new round's sum in `fresh` (empty, bounded as the run's strategy says).
    pub(super) fn reset(&self, fresh: FedAvgAccumulator) {
        let _ = self.tx.send(Message::Reset(fresh));
    }

    /// Folds a durable update or partial in; `hold` is let go once it is folded.
    pub(super) fn fold(&self, contribution: Contribution, hold: Option<Hold>) {
        let _ = self.tx.send(Message::Fold(contribution, hold));
    }

    /// The open group, merged into the round's sum once every earlier fold is in (`None` when
    /// it holds no update).
    pub(super) fn seal(&self) -> oneshot::Receiver<Option<Sealed>> {
        let (tx, rx) = oneshot::channel();
        let _ = self.tx.send(Message::Seal(tx));
        rx
    }

    /// The round's aggregate, once every earlier fold is in.
    pub(super) fn finish(&self) -> oneshot::Receiver<Result<Aggregate, AggregateError>> {
        let (tx, rx) = oneshot::channel();
        let _ = self.tx.send(Message::Finish(tx));
        rx
    }
}
