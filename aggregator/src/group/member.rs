//! A member's tasks at a round's end: offer the shard to the group's collective when it shares
//! the leader's NCCL communicator, else hand the shard to the leader over HTTP; give it back to
//! be reported alone whenever the leader does not take it.

use std::time::Instant;

use axum::http::StatusCode;
use starling_core::codec;
use starling_core::tier::{GroupRendezvous, PartialReport};
use starling_core::wire::path;
use starling_core::{RoundIdx, RunId};

use super::{CollectiveOffer, CollectiveTurn, GroupState, HANDOFF_TIMEOUT};
use crate::collective::collective_timeout;
use crate::report::error_text;

/// How a member's offer to sum by collective ended.
enum Contributed {
    /// Its sums are in the group's; the leader reports them.
    Done,
    /// The leader did not take the offer (or the member is not on the communicator): hand
    /// the sums over HTTP instead.
    NotTaken(PartialReport),
    /// The collective was announced but failed: report alone (the leader will not).
    Failed(PartialReport),
}

impl GroupState {
    /// A member's part: hands its shard to the leader (`deadline` being the round's). Gives the
    /// shard back when the leader did not take it, for the member to report alone.
    pub(crate) async fn hand_to_leader(
        &self,
        (run_id, round_idx): (RunId, RoundIdx),
        own: PartialReport,
        deadline: Instant,
    ) -> Option<PartialReport> {
        if self.rendezvous.lock().expect("rendezvous poisoned").is_none() {
            // Not found yet (the leader may have published after this node's last poll).
            if let Err(e) = self.look_up().await {
                tracing::debug!(error = %e, "looking up the group's leader");
            }
        }
        let leader = self.rendezvous.lock().expect("rendezvous poisoned").clone();
        let Some(leader) = leader else {
            tracing::warn!(run = %run_id, round = %round_idx, group = %self.config.name, "the group's leader is not known yet; reporting alone");
            return Some(own);
        };
        let own = match self.contribute(&leader, (run_id, round_idx), own, deadline).await {
            Contributed::Done => return None,
            Contributed::Failed(own) => return Some(own),
            Contributed::NotTaken(own) => own,
        };
        let (own, body) = tokio::task::spawn_blocking(move || {
            let body = codec::to_vec(&own);
            (own, body)
        })
        .await
        .ok()?;
        let body = body.ok()?;
        let url = format!(
            "{}{}",
            leader.leader_url.trim_end_matches('/'),
            path::group_handoff(run_id, round_idx)
        );
        let res = self
            .link
            .cbor_request(reqwest::Method::POST, &url)
            .timeout(HANDOFF_TIMEOUT)
            .body(body)
            .send()
            .await;
        match res {
            Ok(r) if r.status() == StatusCode::ACCEPTED => {
                tracing::info!(run = %run_id, round = %round_idx, leader = %leader.leader, devices = own.devices.len(), "shard handed to the group leader");
                None
            }
            Ok(r) => {
                let why = error_text(r).await;
                tracing::warn!(run = %run_id, round = %round_idx, %why, "the group leader did not take the shard; reporting alone");
                Some(own)
            }
            Err(e) => {
                tracing::warn!(run = %run_id, round = %round_idx, error = %e, "the group leader is unreachable; reporting alone");
                Some(own)
            }
        }
    }

    /// A member's offer to sum its shard by collective, and the all-reduce when the leader
    /// gives it a turn.
    async fn contribute(
        &self,
        leader: &GroupRendezvous,
        (run_id, round_idx): (RunId, RoundIdx),
        own: PartialReport,
        deadline: Instant,
    ) -> Contributed {
        let Some((plane, tag)) = self.shared_communicator(leader) else {
            return Contributed::NotTaken(own);
        };
        let Ok(sums) = own.sums() else { return Contributed::NotTaken(own) };
        let offer = CollectiveOffer { comm: tag, report: own.without_sums() };
        let Ok(body) = codec::to_vec(&offer) else { return Contributed::NotTaken(own) };
        let url = format!(
            "{}{}",
            leader.leader_url.trim_end_matches('/'),
            path::group_collective(run_id, round_idx)
        );
        // The leader answers once every member is in, which is at its deadline at the latest
        // (plus its wait); this member may have finished early.
        let wait = self.until_decided(deadline) + HANDOFF_TIMEOUT;
        let res = self
            .link
            .cbor_request(reqwest::Method::POST, &url)
            .timeout(wait)
            .body(body)
            .send()
            .await;
        let turn = match res {
            Ok(r) if r.status() == StatusCode::OK => {
                r.bytes().await.ok().and_then(|b| codec::decode::<CollectiveTurn>(&b).ok())
            }
            Ok(r) => {
                tracing::info!(run = %run_id, round = %round_idx, status = %r.status(), "the leader sums this round over HTTP");
                None
            }
            Err(e) => {
                tracing::warn!(run = %run_id, round = %round_idx, error = %e, "offering the shard to the group's collective");
                None
            }
        };
        let Some(CollectiveTurn { seq }) = turn else { return Contributed::NotTaken(own) };
        let deadline = Instant::now() + collective_timeout(sums.0.len());
        match plane.all_reduce(tag, sums, false, deadline).await {
            Ok(_) => {
                tracing::info!(run = %run_id, round = %round_idx, seq, devices = own.devices.len(), "sums all-reduced with the group");
                Contributed::Done
            }
            Err(e) => {
                tracing::warn!(run = %run_id, round = %round_idx, seq, error = %e, "the group's collective failed; reporting alone");
                Contributed::Failed(own)
            }
        }
    }
}
