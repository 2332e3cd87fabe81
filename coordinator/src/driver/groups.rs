//! A run's updates written as the sums of groups of them, so that the store's write load is a
//! model's sums per group, not a model-sized row per update.
//!
//! Group commit: the updates accepted while the run's previous group is being written make up
//! the next group. Each folds into the open group on the run's accumulator thread (its upload
//! permit then let go: its bytes are in the sum); once no group is being written and the open
//! one holds [`GROUP_TARGET`] updates, or its first waited [`GROUP_WAIT_MS`] and the previous
//! seal is [`GROUP_SPACING_MS`] old, it is sealed — merged into the round's sum and handed over
//! as its sums — and written in one transaction with a row per update (everything but the
//! delta, and its norm); its devices are acknowledged when that transaction commits. Under a
//! trickle every group holds one update; under load a group holds whatever arrived during a
//! write and the spacing after it, so the store sees a bounded rate of transactions however
//! many devices upload. A partial from the aggregator tier seals the open group first, so the
//! live sum merges in slot order, as a replay does.

use starling_core::RunId;
use starling_core::round::RequestId;
use starling_core::{Millis, RoundIdx};

use super::accumulator::{AccumulatorWorker, Hold};
use super::writer::{Batch, RunWriter};
use crate::clock::now_ms;
use crate::store::{GroupMember, SqlStore, StoreError};

/// A group this large is sealed as soon as no other is being written.
const GROUP_TARGET: usize = 64;

/// A smaller group is sealed once its first update waited this long (or a partial, or the
/// run's stop, comes): a little more latency for an update that arrives alone, against a
/// model's sums written for every few updates under load.
const GROUP_WAIT_MS: Millis = 10;

/// ... and no sooner than this after the previous seal: under load a run writes at most 25
/// groups a second, each a model's sums, however fast its writes come back.
const GROUP_SPACING_MS: Millis = 40;

/// The accepted updates of a run's open group, and how many sealed groups are being written.
#[derive(Default)]
pub(super) struct UpdateGroups {
    /// The open group's updates in slot order, with their requests.
    open: Vec<(RequestId, GroupMember)>,
    /// When its first update was added.
    opened_at: Millis,
    /// When the last group was sealed.
    sealed_at: Millis,
    /// The round they are in.
    round_idx: Option<RoundIdx>,
    /// The hold of the update whose fold comes next (taken at its persist action).
    next_hold: Option<Hold>,
    /// Sealed groups whose write has not reported back.
    writing: usize,
}

/// An accepted update as [`UpdateGroups::add`] takes it.
pub(super) struct Accepted {
    pub(super) request: RequestId,
    pub(super) round_idx: RoundIdx,
    /// Its row (its norm filled in when its group is sealed).
    pub(super) member: GroupMember,
    pub(super) hold: Option<Hold>,
}

impl UpdateGroups {
    /// Adds an accepted update to the open group; its fold follows.
    pub(super) fn add(&mut self, accepted: Accepted, now: Millis) {
        let Accepted { request, round_idx, member, hold } = accepted;
        if self.round_idx != Some(round_idx) {
            debug_assert!(self.open.is_empty(), "a round closed with an open group");
            self.open.clear();
            self.round_idx = Some(round_idx);
        }
        if self.open.is_empty() {
            self.opened_at = now;
        }
        self.open.push((request, member));
        self.next_hold = hold;
    }

    /// The hold to let go of once the update just added is folded.
    pub(super) fn take_hold(&mut self) -> Option<Hold> {
        self.next_hold.take()
    }

    /// Whether the open group should be sealed now: it holds updates, no group is being
    /// written and it is large or old enough (or `force`, before a partial is folded).
    pub(super) fn due(&self, force: bool, now: Millis) -> bool {
        let ready = self.open.len() >= GROUP_TARGET || now >= self.ready_at();
        !self.open.is_empty() && (force || (self.writing == 0 && ready))
    }

    /// When the open group will be due if nothing else comes (the driver wakes then).
    pub(super) fn deadline(&self) -> Option<Millis> {
        (!self.open.is_empty() && self.writing == 0).then(|| self.ready_at())
    }

    fn ready_at(&self) -> Millis {
        (self.opened_at + GROUP_WAIT_MS).max(self.sealed_at + GROUP_SPACING_MS)
    }

    /// A sealed group's write reported back.
    pub(super) fn written(&mut self) {
        self.writing = self.writing.saturating_sub(1);
    }

    /// The run stopped: the open group's devices were answered by the machine.
    pub(super) fn clear(&mut self) {
        self.open.clear();
        self.next_hold = None;
    }

    /// Seals the open group on `accumulator` and hands its write to `writer`.
    pub(super) fn seal(
        &mut self,
        run_id: RunId,
        store: &SqlStore,
        accumulator: &AccumulatorWorker,
        writer: &RunWriter,
        batch: &mut Batch,
    ) {
        let Some(round_idx) = self.round_idx else { return };
        let (requests, mut members): (Vec<RequestId>, Vec<GroupMember>) =
            std::mem::take(&mut self.open).into_iter().unzip();
        if members.is_empty() {
            return;
        }
        self.writing += 1;
        self.sealed_at = now_ms();
        let sealed = accumulator.seal();
        let store = store.clone();
        writer.group_payload(requests, batch, async move {
            let Ok(Some(sealed)) = sealed.await else {
                return Err(StoreError::Corrupt("the accumulator sealed no group".into()));
            };
            if sealed.norms.len() != members.len() {
                return Err(StoreError::Corrupt(format!(
                    "a group of {} updates sealed with {} norms",
                    members.len(),
                    sealed.norms.len()
                )));
            }
            for (member, norm) in members.iter_mut().zip(sealed.norms) {
                member.norm = norm;
            }
            let res = store
                .insert_update_group(run_id, round_idx, &members, &sealed.group, now_ms())
                .await;
            match &res {
                Ok(()) => {
                    tracing::debug!(%run_id, round = %round_idx, updates = members.len(), "group of updates persisted")
                }
                Err(e) => {
                    tracing::warn!(%run_id, round = %round_idx, updates = members.len(), error = %e, "group of updates not persisted")
                }
            }
            res
        });
    }
}
