//! The leader's tasks: taking members' shards and offers into the round's inbox, and at the
//! round's end carrying out the inbox's decision (merge over HTTP, or one all-reduce) and
//! reporting once for the group.

use std::sync::Arc;
use std::time::{Duration, Instant};

use starling_core::tier::{
    PartialReport, PartialReportError, ShardTask, merge_collective, merge_reports,
};
use starling_core::{RoundIdx, RunId};

use super::inbox::{Decision, Inbox, Offer};
use super::{CONVERT_WAIT, CollectiveOffer, GroupState, HANDOFF_TIMEOUT, HandoffRefusal};
use crate::collective::{CollectiveError, PlaneStatus, collective_timeout};
use crate::report::{Sent, send_partial};

impl GroupState {
    /// A member's finished shard, taken into the round's inbox (the leader now reports it).
    pub(crate) fn take_shard(
        &self,
        key: (RunId, RoundIdx),
        report: PartialReport,
    ) -> Result<(), HandoffRefusal> {
        if !self.is_leader() {
            return Err(HandoffRefusal::NotLeader);
        }
        let aggregators = report.aggregators.clone();
        let converting = self.with_inbox(key, |inbox| inbox.take_report(report, self.me))?;
        if let Some(plane) = &self.plane
            && !converting
            && matches!(plane.status(), PlaneStatus::Joined { .. })
        {
            // A member that hands its sums over HTTP is not on this communicator (it
            // restarted, or a collective failed there): a new one, which it will join, is due.
            tracing::info!(member = ?aggregators, "a member is off the group's NCCL communicator; renewing it");
            plane.reset();
        }
        Ok(())
    }

    /// A member's offer to sum by collective; answers once every member is in (or the
    /// leader's wait is over, `deadline` being the round's): the member's turn, or why not.
    pub(crate) async fn take_offer(
        &self,
        key: (RunId, RoundIdx),
        offer: CollectiveOffer,
        deadline: Instant,
    ) -> Result<u64, HandoffRefusal> {
        if !self.is_leader() {
            return Err(HandoffRefusal::NotLeader);
        }
        let on_it = self
            .plane
            .as_ref()
            .is_some_and(|p| p.status() == PlaneStatus::Joined { tag: offer.comm });
        if !on_it {
            return Err(HandoffRefusal::NotOnCommunicator);
        }
        let (turn, answer) = tokio::sync::oneshot::channel();
        let offer = Offer { report: offer.report, turn };
        self.with_inbox(key, |inbox| inbox.take_offer(offer, self.me))?;
        // Shorter than the member's own wait, so a turn is never given to a member gone.
        let wait = self.until_decided(deadline) + HANDOFF_TIMEOUT - Duration::from_secs(5);
        match tokio::time::timeout(wait, answer).await {
            Ok(Ok(Some(seq))) => Ok(seq),
            _ => Err(HandoffRefusal::NotByCollective),
        }
    }

    /// How long until the leader decides a round whose deadline is `deadline` at the latest.
    pub(super) fn until_decided(&self, deadline: Instant) -> Duration {
        deadline.saturating_duration_since(Instant::now()) + self.config.wait
    }

    /// The leader's part at a round's end (`deadline` being the round's): takes the members'
    /// shards (all of them, or those in by its deadline plus the wait), merges them with its
    /// own, reports once.
    pub(crate) async fn lead(
        &self,
        key: (RunId, RoundIdx),
        task: &ShardTask,
        own: Option<PartialReport>,
        deadline: Instant,
    ) {
        let expected = self.config.world_size as usize - 1;
        let give_up = deadline + self.config.wait;
        let decision = self
            .collect(
                key,
                give_up,
                |inbox| inbox.members() >= expected,
                |inbox| inbox.close(expected),
            )
            .await;
        let mut members = match decision {
            Decision::Collective(offers) => {
                return self.lead_collective(key, task, own, offers).await;
            }
            Decision::Merge { reports, convert } => reports.into_iter().chain(
                // Not every member is in by collective (one had no uploads, or is gone): those
                // that offered hand their sums over HTTP instead, into a reopened inbox.
                self.convert(key, convert).await,
            ),
        }
        .collect::<Vec<_>>();
        let (run_id, round_idx) = key;
        if members.len() < expected {
            tracing::warn!(run = %run_id, round = %round_idx, got = members.len(), expected, "reporting without every member's shard");
        }
        members.extend(own);
        let all = members;
        if all.len() <= 1 {
            for report in all {
                send_partial(&self.link, key, report).await;
            }
            return;
        }
        // Shared with the merge, not copied: the shards are kept for the fallback below.
        let all = Arc::new(all);
        let merged = {
            let (schema, shards) = (task.schema.clone(), all.clone());
            tokio::task::spawn_blocking(move || merge_reports(&schema, &shards)).await
        };
        if self.send_merged(key, merged).await {
            return;
        }
        tracing::warn!(run = %run_id, round = %round_idx, "reporting each of the group's shards alone");
        // The merge is over, so this is the only handle left.
        let all = Arc::try_unwrap(all).unwrap_or_else(|shared| (*shared).clone());
        for report in all {
            send_partial(&self.link, key, report).await;
        }
    }

    /// Turns the offers down and waits (at most [`CONVERT_WAIT`]) for those members' sums over
    /// HTTP.
    async fn convert(&self, key: (RunId, RoundIdx), offers: Vec<Offer>) -> Vec<PartialReport> {
        if offers.is_empty() {
            return vec![];
        }
        let converting: Vec<_> =
            offers.iter().flat_map(|o| o.report.aggregators.iter().copied()).collect();
        self.with_inbox(key, |inbox| inbox.reopen_for(converting));
        for offer in offers {
            let _ = offer.turn.send(None);
        }
        let give_up = Instant::now() + CONVERT_WAIT;
        self.collect(key, give_up, Inbox::converted, Inbox::close_late).await
    }

    /// The leader's part when every member offered its shard by collective: one turn for
    /// all, the all-reduce, and one report of the merged metadata with the summed sums.
    async fn lead_collective(
        &self,
        key: (RunId, RoundIdx),
        task: &ShardTask,
        own: Option<PartialReport>,
        offers: Vec<Offer>,
    ) {
        let (run_id, round_idx) = key;
        let plane = self.plane.as_ref().expect("offers are taken only on a communicator");
        let mut turns = plane.turns.lock().await;
        let PlaneStatus::Joined { tag } = plane.status() else {
            // The communicator broke since the offers were taken.
            for offer in offers {
                let _ = offer.turn.send(None);
            }
            tracing::warn!(run = %run_id, round = %round_idx, "no NCCL communicator any more; members report alone");
            if let Some(own) = own {
                send_partial(&self.link, key, own).await;
            }
            return;
        };
        let seq = *turns;
        *turns += 1;
        let mut metadata = Vec::with_capacity(offers.len() + 1);
        let mut all_told = true;
        for offer in offers {
            metadata.push(offer.report);
            all_told &= offer.turn.send(Some(seq)).is_ok();
        }
        let own_sums = match own.as_ref().map(PartialReport::sums) {
            Some(Ok(sums)) => Some(sums),
            None => {
                let n = task.schema.numel() as usize;
                Some((vec![0.0; n], vec![0.0; n]))
            }
            Some(Err(_)) => None,
        };
        let summed = match own_sums {
            Some(sums) if all_told => {
                let deadline = Instant::now() + collective_timeout(sums.0.len());
                plane.all_reduce(tag, sums, true, deadline).await
            }
            _ => {
                // A member will not come to this collective: nobody may wait in it.
                plane.reset();
                Err(CollectiveError::NotJoined(tag))
            }
        };
        drop(turns);
        match summed {
            Ok(Some((hi, lo))) => {
                metadata.extend(own.as_ref().map(PartialReport::without_sums));
                let schema = task.schema.clone();
                let merged = tokio::task::spawn_blocking(move || {
                    merge_collective(&schema, &metadata, hi, lo)
                })
                .await;
                tracing::info!(run = %run_id, round = %round_idx, seq, "the group's sums were all-reduced");
                if self.send_merged(key, merged).await {
                    return;
                }
                tracing::error!(run = %run_id, round = %round_idx, "the members' shards of this round are lost (their sums exist only in the group's); the leader reports its own alone");
            }
            Ok(None) => tracing::error!("the collective gave no sums back"),
            Err(e) => {
                tracing::warn!(run = %run_id, round = %round_idx, seq, error = %e, "the group's collective failed; every member reports alone");
            }
        }
        if let Some(own) = own {
            send_partial(&self.link, key, own).await;
        }
    }

    /// Reports a group's merged report: whether the coordinator took it (or it could not be
    /// delivered at all, when reporting shards alone would fare no better). Logs why not.
    async fn send_merged(
        &self,
        key: (RunId, RoundIdx),
        merged: Result<Result<PartialReport, PartialReportError>, tokio::task::JoinError>,
    ) -> bool {
        let (run_id, round_idx) = key;
        match merged {
            Ok(Ok(merged)) => {
                if send_partial(&self.link, key, merged).await != Sent::Refused {
                    return true;
                }
                tracing::warn!(run = %run_id, round = %round_idx, "the group's partial was refused");
            }
            Ok(Err(e)) => {
                tracing::warn!(run = %run_id, round = %round_idx, error = %e, "the group's reports do not merge");
            }
            Err(e) => tracing::error!(error = %e, "merging the group's reports panicked"),
        }
        false
    }

    /// Waits until `done` holds for the round's inbox, or until `give_up`; then `take`s from it
    /// (which closes it).
    async fn collect<T>(
        &self,
        key: (RunId, RoundIdx),
        give_up: Instant,
        done: impl Fn(&Inbox) -> bool,
        take: impl FnOnce(&mut Inbox) -> T,
    ) -> T {
        let mut take = Some(take);
        loop {
            // Checked and taken under one lock: nothing slips in between.
            let taken = self.with_inbox(key, |inbox| {
                let ready = done(inbox) || Instant::now() >= give_up;
                ready.then(|| (take.take().expect("taken once"))(inbox))
            });
            if let Some(taken) = taken {
                return taken;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }
}
