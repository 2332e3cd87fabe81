//! Carrying out the run machines' actions, by the rules of the driver's module doc: a batch's
//! transitions, payload writes and closings handed to the run's ordered writer (`writer`),
//! which makes the transitions durable in one transaction before any of the batch's replies,
//! starts each payload write once the round row it refers to is durable (an update folded into
//! a buffer that just opened must not reach the store before that buffer's round) and records
//! each round's end; folds in slot order on the run's accumulator thread.

use starling_core::RunId;
use starling_core::codec;
use starling_core::round::{Action, Contribution, RoundSum, RunStatus};
use starling_core::wire::{SecAggInstruction, UploadAck};
use tokio::sync::oneshot;

use super::close::{CloseTask, Finish};
use super::groups::Accepted;
use super::writer::{Batch, Deferred, LastModel};
use super::{Driver, DriverError, Responder, RunEntry};
use crate::clock::now_ms;
use crate::observe::Observer;
use crate::store::{GroupMember, SqlStore, Transition};
use crate::tier::AggregatorRegistry;

fn later<T: Send + 'static>(reply: oneshot::Sender<T>, value: T) -> Deferred {
    Box::new(move || {
        let _ = reply.send(value);
    })
}

/// The parts of the driver that actions use besides the run itself.
struct Effects<'a> {
    store: &'a SqlStore,
    observer: &'a Observer,
    tier: Option<&'a AggregatorRegistry>,
}

impl Driver {
    /// Drains every machine's actions and executes them.
    pub(super) async fn execute_actions(&mut self) {
        let now = now_ms();
        let effects =
            Effects { store: &self.store, observer: &self.observer, tier: self.tier.as_ref() };
        let mut ended = vec![];
        for (&run_id, entry) in self.runs.iter_mut() {
            let mut batch = Batch::default();
            while let Some(action) = entry.machine.poll_action() {
                effects.execute(run_id, entry, action, &mut batch);
            }
            effects.seal_group(run_id, entry, &mut batch, false);
            let status = entry.machine.status();
            if status != RunStatus::Running {
                // Answered once the run's last transitions are durable.
                for stop in entry.stops.drain(..) {
                    batch.replies.push(later(stop, Ok(())));
                }
            }
            if !batch.is_empty() {
                entry.writer.write(batch, now).await;
            }
            if matches!(status, RunStatus::Stopped | RunStatus::Finished) {
                ended.push(run_id);
            }
        }
        for run_id in ended {
            if let Some(mut entry) = self.runs.remove(&run_id) {
                for (_, responder) in entry.responders.drain() {
                    responder.run_ended(run_id);
                }
                self.write_last_model(&entry);
            }
        }
    }

    /// A run that ended between two written versions (the plan's `checkpoint_interval`) has
    /// its newest model's bytes written now rather than at the next start. Not once a shutdown
    /// has begun: that start rebuilds it.
    fn write_last_model(&self, entry: &RunEntry) {
        if entry.plan.plan().checkpoint_interval <= 1 {
            return;
        }
        // Held until written: a shutdown waits for it.
        let Ok(in_flight) = self.model_writes.0.clone().try_read_owned() else { return };
        entry.writer.write_last_model(LastModel {
            plan: entry.plan.clone(),
            version: entry.machine.model_version(),
            hash: entry.model_hash.clone(),
            values: entry.global.clone(),
            optimizer_state: entry.optimizer_state.clone(),
            in_flight,
        });
    }
}

impl Effects<'_> {
    fn execute(&self, run_id: RunId, entry: &mut RunEntry, action: Action, batch: &mut Batch) {
        match action {
            Action::OpenRound(opened) => {
                tracing::info!(%run_id, round = %opened.round_idx, model_version = %opened.model_version, "round opened");
                entry.accumulator.reset(entry.plan.accumulator(&entry.optimizer_state));
                self.observer.round_opened(run_id, opened.round_idx);
                entry.writer.opens_round();
                batch.transitions.push(Transition::OpenRound(opened));
            }
            Action::PersistSelection { round_idx, device, aggregator } => {
                self.observer.selected();
                batch.transitions.push(Transition::Select { round_idx, device, aggregator });
            }
            Action::ReplyCheckIn { request, decision } => {
                if let Some(Responder::CheckIn { device, reply }) =
                    entry.responders.remove(&request)
                {
                    let answer = entry.check_in_response(run_id, device, decision, self.tier);
                    batch.replies.push(later(reply, Ok(answer)));
                }
            }
            Action::PersistUpdate { request, round_idx, device, slot, staleness, update }
                if entry.groups.is_some() =>
            {
                // Into the open group; its fold, the next action, lets go of its hold.
                let hold = match entry.responders.get_mut(&request) {
                    Some(Responder::Upload { hold, .. }) => hold.take(),
                    _ => None,
                };
                let metrics_json =
                    serde_json::to_string(update.metrics()).expect("metrics serialize");
                let example_count = update.example_count();
                let member =
                    GroupMember { device, slot, staleness, example_count, metrics_json, norm: 0.0 };
                let accepted = Accepted { request, round_idx, member, hold };
                entry.groups.as_mut().expect("matched").add(accepted, now_ms());
            }
            Action::PersistUpdate { request, round_idx, device, slot, staleness, update } => {
                let store = self.store.clone();
                entry.writer.payload(request, batch, "insert_update", async move {
                    let metrics =
                        serde_json::to_string(update.metrics()).expect("metrics serialize");
                    let res = store
                        .insert_update(
                            run_id,
                            round_idx,
                            device,
                            slot,
                            staleness,
                            update.example_count(),
                            &metrics,
                            update.delta_bytes(),
                            now_ms(),
                        )
                        .await;
                    if let Err(e) = &res {
                        tracing::warn!(%run_id, %device, error = %e, "update not persisted");
                    }
                    res
                });
            }
            Action::ReplyUpload { request, result } => {
                if let Some(Responder::Upload { round_idx, reply, .. }) =
                    entry.responders.remove(&request)
                {
                    let res = result.map(|()| UploadAck { run_id, round_idx }).map_err(Into::into);
                    batch.replies.push(later(reply, res));
                }
            }
            Action::PersistPartial { request, round_idx, slot, report } => {
                let store = self.store.clone();
                entry.writer.payload(request, batch, "insert_partial", async move {
                    let res = store.insert_partial(run_id, round_idx, slot, &report, now_ms()).await;
                    match &res {
                        Ok(()) => {
                            tracing::info!(%run_id, round = %round_idx, aggregators = ?report.aggregators, devices = report.devices.len(), "partial persisted")
                        }
                        Err(e) => {
                            tracing::warn!(%run_id, round = %round_idx, error = %e, "partial not persisted")
                        }
                    }
                    res
                });
            }
            Action::ReplyPartial { request, result } => {
                if let Some(Responder::Partial(reply)) = entry.responders.remove(&request) {
                    batch.replies.push(later(reply, result.map_err(DriverError::from)));
                }
            }
            Action::Fold(contribution) => {
                let hold = match (&contribution, entry.groups.as_mut()) {
                    (Contribution::Partial(_), Some(_)) => {
                        // The open group first: the round's sum merges in slot order.
                        self.seal_group(run_id, entry, batch, true);
                        None
                    }
                    (_, Some(groups)) => groups.take_hold(),
                    (_, None) => None,
                };
                entry.accumulator.fold(contribution, hold);
            }
            Action::PersistSecAgg { round_idx, seq, record } => {
                let record = codec::to_vec(&record).expect("records encode");
                batch.transitions.push(Transition::SecAggRecord { round_idx, seq, record });
            }
            Action::ReplySecAgg { request, result } => {
                if let Some(Responder::SecAgg(reply)) = entry.responders.remove(&request) {
                    batch.replies.push(later(reply, result.map_err(DriverError::SecAgg)));
                }
            }
            Action::ReplySecAggPoll { request, result } => {
                if let Some(Responder::SecAggPoll(reply)) = entry.responders.remove(&request) {
                    let res: Result<SecAggInstruction, _> = result.map_err(DriverError::SecAgg);
                    batch.replies.push(later(reply, res));
                }
            }
            Action::CloseRound { closing, sum } => {
                let opened_at =
                    entry.machine.current_round().map_or(closing.closed_at, |r| r.opened_at);
                let finish = match sum {
                    RoundSum::Secure(sum) => {
                        tracing::info!(%run_id, round = %closing.round_idx, survivors = sum.survivors(), "secure aggregation rebuilt the secrets of the cohort's sum");
                        if !sum.inconsistent_sharers().is_empty() {
                            tracing::warn!(%run_id, round = %closing.round_idx, devices = ?sum.inconsistent_sharers(), "devices returned wrong secret shares; they were outvoted by spare shares and left out of the rebuild");
                        }
                        Finish::Unmask(*sum)
                    }
                    RoundSum::Folded => Finish::Accumulated(entry.accumulator.finish()),
                    // The accumulator folded an update whose write failed; the next round's
                    // opening resets it.
                    RoundSum::Replayed => Finish::Replayed,
                };
                // Spawned once this batch's transitions are durable: the commit then follows
                // the round's last records, which it deletes.
                let task = CloseTask {
                    store: self.store.clone(),
                    opened_at,
                    run_id,
                    closing,
                    finish,
                    global: entry.global.clone(),
                    optimizer_state: entry.optimizer_state.clone(),
                    plan: entry.plan.clone(),
                    ends: entry.writer.round_ends(),
                };
                batch.closings.push(Box::pin(task.run()));
            }
            Action::FinishRun => {
                tracing::info!(%run_id, "run finished");
                self.observer.run_state(run_id, "finished");
                batch.transitions.push(Transition::FinishRun);
            }
            Action::StopRun { open_round, reason } => {
                if let Some(groups) = entry.groups.as_mut() {
                    groups.clear();
                }
                match &reason {
                    Some(reason) => tracing::error!(%run_id, %reason, "run stopped"),
                    None => tracing::info!(%run_id, "run stopped"),
                }
                if let Some(round_idx) = open_round {
                    self.observer.round_stopped(run_id, round_idx);
                }
                self.observer.run_state(run_id, "stopped");
                batch.transitions.push(Transition::StopRun { open_round, reason });
            }
        }
    }

    /// Seals `entry`'s open group and starts its write, when due (see `groups`).
    fn seal_group(&self, run_id: RunId, entry: &mut RunEntry, batch: &mut Batch, force: bool) {
        let Some(groups) = entry.groups.as_mut() else { return };
        if groups.due(force, now_ms()) {
            groups.seal(run_id, self.store, &entry.accumulator, &entry.writer, batch);
        }
    }
}
