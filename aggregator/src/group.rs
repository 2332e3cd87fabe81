//! Aggregator groups: several nodes (one per GPU of a host, say) that report one partial
//! between them, so the coordinator merges one report per group instead of one per node.
//!
//! The leader (rank 0) publishes where it listens through the coordinator
//! (`PUT /v1/aggregation/groups/{group}`, with the group's NCCL unique id when it runs on
//! CUDA with NCCL present) and republishes it every few seconds; members look it up there.
//! A member hands its finished shard to the leader instead of the coordinator; the leader
//! waits for every member (or until its own deadline plus `--group-wait-ms`), merges the
//! shards exactly (core's `merge_reports`, in aggregator order) and reports once for all.
//!
//! On GPUs with NCCL ([`crate::collective`]) the sums do not travel over HTTP: once every
//! member is on the group's communicator (the NCCL id the leader publishes), a member sends
//! the leader only who and how much (its report without sums) and waits for its turn; when
//! every member is in, the leader hands out one turn and all of them all-reduce their sums,
//! and the leader reports the merged metadata with the summed sums (core's
//! `merge_collective`). A member that is not on the communicator, an offer the leader cannot
//! take, or a collective that fails falls back to the HTTP hand-off or to reporting alone.
//!
//! Nothing here can lose a shard that would otherwise have been reported: a member whose
//! leader is unknown, unreachable or refuses reports alone, and a leader whose merged report
//! the coordinator refuses reports each shard on its own (the coordinator takes the ones it
//! still lacks). A shard the leader accepted is lost with the leader, as one in any node's
//! memory is; its devices count as dropped.

use starling_core::codec;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::IntoResponse;
use serde::{Deserialize, Serialize};
use starling_core::tier::{
    GroupRendezvous, PartialReport, ShardTask, merge_collective, merge_reports,
};
use starling_core::wire::path;
use starling_core::wire::{self, ErrorBody, ErrorCode};
use starling_core::{RoundIdx, RunId};

use crate::collective::{Plane, PlaneStatus, collective_timeout, comm_tag};
use crate::service::{
    Inner, Refusal, Sent, ShardRules, decode_then, read_body, send_partial, shard_for, stale_model,
};

/// How often a leader republishes its rendezvous and a member refreshes it.
const REFRESH_EVERY: Duration = Duration::from_secs(5);
/// Room in a handed-off shard beyond its sums (16 bytes a parameter).
const HANDOFF_ENVELOPE_LIMIT: usize = 4 * 1024 * 1024;
/// How long the leader waits for the sums of members whose collective offers it turned down.
const CONVERT_WAIT: Duration = Duration::from_secs(10);
/// How long a member waits for the leader to take its shard before reporting it alone.
const HANDOFF_TIMEOUT: Duration = Duration::from_secs(30);

/// A node's place in an aggregator group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupConfig {
    /// The group's name (`[A-Za-z0-9._-]`, at most 64).
    pub name: String,
    /// This node's rank; rank 0 leads.
    pub rank: u32,
    /// Members, the leader included.
    pub world_size: u32,
    /// How long past its own deadline the leader waits for members' shards.
    pub wait: Duration,
}

/// Why a group setting is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum GroupConfigError {
    /// Name or size, as core checks them.
    #[error(transparent)]
    Group(#[from] starling_core::tier::GroupError),
    /// A rank outside `0..world_size`.
    #[error("rank {rank} is not below the world size {world_size}")]
    Rank {
        /// The rank given.
        rank: u32,
        /// The world size given.
        world_size: u32,
    },
}

impl GroupConfig {
    /// Checks name, size and rank.
    pub fn validate(&self) -> Result<(), GroupConfigError> {
        starling_core::tier::validate_group_name(&self.name)?;
        let size = starling_core::tier::MAX_AGGREGATORS_PER_PARTIAL as u32;
        if !(2..=size).contains(&self.world_size) {
            return Err(starling_core::tier::GroupError::BadWorldSize(self.world_size).into());
        }
        if self.rank >= self.world_size {
            return Err(GroupConfigError::Rank { rank: self.rank, world_size: self.world_size });
        }
        Ok(())
    }
}

/// A leader's inbox for one round: the members' shards it took (or their offers to sum by
/// collective), until it reports.
#[derive(Debug, Default)]
pub(crate) struct Inbox {
    reports: Vec<PartialReport>,
    offers: Vec<Offer>,
    /// Members whose offers were turned down, now handing their sums over HTTP.
    converting: Vec<starling_core::AggregatorId>,
    closed: bool,
}

impl Inbox {
    fn members(&self) -> usize {
        self.reports.len() + self.offers.len()
    }

    /// Whether a member's shard (or offer) for these aggregators is already here.
    fn holds_any_of(&self, aggregators: &[starling_core::AggregatorId]) -> bool {
        self.reports
            .iter()
            .chain(self.offers.iter().map(|o| &o.report))
            .any(|r| r.aggregators.iter().any(|a| aggregators.contains(a)))
    }
}

/// A member's offer to sum its shard by collective: its report without sums, and where the
/// leader answers with the member's turn (`None`: not by collective this round).
#[derive(Debug)]
struct Offer {
    report: PartialReport,
    turn: tokio::sync::oneshot::Sender<Option<u64>>,
}

/// `POST` [`path::GROUP_COLLECTIVE`]: a member on the communicator `comm` offers its shard's
/// metadata; the sums follow through NCCL once the leader answers with a [`CollectiveTurn`].
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CollectiveOffer {
    /// The communicator the member is on ([`comm_tag`] of the NCCL id).
    pub comm: u64,
    /// The member's report, without its sums.
    pub report: PartialReport,
}

/// The leader's answer to a [`CollectiveOffer`]: every member all-reduces now; `seq` numbers
/// the leader's collectives since it started (for logs: they run one at a time).
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct CollectiveTurn {
    /// The collective's number.
    pub seq: u64,
}

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

/// A node's group state.
pub(crate) struct GroupState {
    config: GroupConfig,
    /// What the leader publishes (leader) or last found (member).
    rendezvous: Mutex<Option<GroupRendezvous>>,
    /// When the rendezvous was last published or refreshed.
    synced: Mutex<Option<Instant>>,
    /// The NCCL unique id the leader publishes (a new one whenever its communicator broke).
    nccl_id: Mutex<Option<Vec<u8>>>,
    /// The NCCL plane, when the node runs CUDA with NCCL present.
    plane: Option<Plane>,
}

impl GroupState {
    pub(crate) fn new(config: GroupConfig, engine: &crate::Engine) -> Self {
        let plane = match *engine {
            crate::Engine::Cuda { device } if crate::gpu::nccl_present() => {
                Some(Plane::start(device, config.rank as usize, config.world_size as usize))
            }
            _ => None,
        };
        GroupState {
            config,
            rendezvous: Mutex::new(None),
            synced: Mutex::new(None),
            nccl_id: Mutex::new(None),
            plane,
        }
    }

    /// The leader's part in keeping a communicator: when it has none (at start, or after one
    /// broke or a join was abandoned), a new NCCL id, joined and published at once.
    fn renew_communicator(&self) {
        let Some(plane) = &self.plane else { return };
        if !self.is_leader() || plane.status() != PlaneStatus::Idle {
            return;
        }
        match crate::gpu::NcclGroup::unique_id() {
            Ok(id) => {
                plane.join(&id);
                *self.nccl_id.lock().expect("nccl id poisoned") = Some(id);
                *self.synced.lock().expect("synced poisoned") = None;
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot make an NCCL id; the group sums over HTTP")
            }
        }
    }

    /// How long until the leader decides a round at the latest: the round's deadline (as this
    /// node knows it) plus the group's wait.
    fn until_decided(&self, inner: &Inner, key: (RunId, RoundIdx)) -> Duration {
        let deadline = inner.shards.lock().expect("shards poisoned").get(&key).map(|s| s.deadline);
        deadline.map_or(Duration::ZERO, |d| d.saturating_duration_since(Instant::now()))
            + self.config.wait
    }

    /// The communicator this node and its leader are both on, if any.
    fn shared_communicator(&self, leader: &GroupRendezvous) -> Option<(&Plane, u64)> {
        let plane = self.plane.as_ref()?;
        let PlaneStatus::Joined { tag } = plane.status() else { return None };
        (leader.nccl_id.as_deref().map(comm_tag) == Some(tag)).then_some((plane, tag))
    }

    /// The coordinator's rendezvous endpoint of this group.
    fn rendezvous_url(&self, inner: &Inner) -> String {
        format!(
            "{}{}",
            inner.config.coordinator_url.trim_end_matches('/'),
            path::group(&self.config.name)
        )
    }

    pub(crate) fn is_leader(&self) -> bool {
        self.config.rank == 0
    }

    /// The leader's part at a round's end: takes the members' shards (all of them, or those
    /// in by its deadline plus the wait), merges them with its own, reports once.
    pub(crate) async fn lead(
        &self,
        inner: &Inner,
        key: (RunId, RoundIdx),
        task: &ShardTask,
        own: Option<PartialReport>,
    ) {
        let expected = self.config.world_size as usize - 1;
        let give_up = inner
            .shards
            .lock()
            .expect("shards poisoned")
            .get(&key)
            .map_or_else(Instant::now, |s| s.deadline)
            + self.config.wait;
        let Inbox { reports: mut members, offers, .. } =
            collect(inner, key, give_up, |inbox| inbox.members() >= expected).await;
        if !offers.is_empty() {
            if members.is_empty() && offers.len() == expected {
                return self.lead_collective(inner, key, task, own, offers).await;
            }
            // Not every member is in by collective (one had no uploads, or is gone): those
            // that offered hand their sums over HTTP instead, into a reopened inbox.
            let converting: Vec<_> =
                offers.iter().flat_map(|o| o.report.aggregators.iter().copied()).collect();
            if let Some(shard) = inner.shards.lock().expect("shards poisoned").get_mut(&key) {
                shard.inbox.closed = false;
                shard.inbox.converting.clone_from(&converting);
            }
            for offer in offers {
                let _ = offer.turn.send(None);
            }
            let late = collect(inner, key, Instant::now() + CONVERT_WAIT, |inbox| {
                converting.iter().all(|a| inbox.reports.iter().any(|r| r.aggregators.contains(a)))
            })
            .await;
            members.extend(late.reports);
        }
        let (run_id, round_idx) = key;
        if members.len() < expected {
            tracing::warn!(run = %run_id, round = %round_idx, got = members.len(), expected, "reporting without every member's shard");
        }
        let mut all = members;
        all.extend(own);
        if all.len() <= 1 {
            for report in all {
                send_partial(inner, key, report).await;
            }
            return;
        }
        // Shared with the merge, not copied: the shards are kept for the fallback below.
        let all = std::sync::Arc::new(all);
        let merged = {
            let (schema, shards) = (task.schema.clone(), all.clone());
            tokio::task::spawn_blocking(move || merge_reports(&schema, &shards)).await
        };
        if send_merged(inner, key, merged).await {
            return;
        }
        tracing::warn!(run = %run_id, round = %round_idx, "reporting each of the group's shards alone");
        // The merge is over, so this is the only handle left.
        let all = std::sync::Arc::try_unwrap(all).unwrap_or_else(|shared| (*shared).clone());
        for report in all {
            send_partial(inner, key, report).await;
        }
    }

    /// The leader's part when every member offered its shard by collective: one turn for
    /// all, the all-reduce, and one report of the merged metadata with the summed sums.
    async fn lead_collective(
        &self,
        inner: &Inner,
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
                send_partial(inner, key, own).await;
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
                Err(crate::collective::CollectiveError::NotJoined(tag))
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
                if send_merged(inner, key, merged).await {
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
            send_partial(inner, key, own).await;
        }
    }

    /// A member's offer to sum its shard by collective, and the all-reduce when the leader
    /// gives it a turn.
    async fn contribute(
        &self,
        inner: &Inner,
        leader: &GroupRendezvous,
        (run_id, round_idx): (RunId, RoundIdx),
        own: PartialReport,
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
        let wait = self.until_decided(inner, (run_id, round_idx)) + HANDOFF_TIMEOUT;
        let res =
            inner.cbor_request(reqwest::Method::POST, &url).timeout(wait).body(body).send().await;
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

    /// A member's part: hands its shard to the leader. Gives the shard back when the leader
    /// did not take it, for the member to report alone.
    pub(crate) async fn hand_to_leader(
        &self,
        inner: &Inner,
        (run_id, round_idx): (RunId, RoundIdx),
        own: PartialReport,
    ) -> Option<PartialReport> {
        if self.rendezvous.lock().expect("rendezvous poisoned").is_none() {
            // Not found yet (the leader may have published after this node's last poll).
            if let Err(e) = look_up(inner, self, &self.rendezvous_url(inner)).await {
                tracing::debug!(error = %e, "looking up the group's leader");
            }
        }
        let leader = self.rendezvous.lock().expect("rendezvous poisoned").clone();
        let Some(leader) = leader else {
            tracing::warn!(run = %run_id, round = %round_idx, group = %self.config.name, "the group's leader is not known yet; reporting alone");
            return Some(own);
        };
        let own = match self.contribute(inner, &leader, (run_id, round_idx), own).await {
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
        let res = inner
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
                let status = r.status();
                let why = r.bytes().await.ok().and_then(|b| codec::decode::<ErrorBody>(&b).ok());
                tracing::warn!(run = %run_id, round = %round_idx, %status, why = ?why.map(|w| w.message), "the group leader did not take the shard; reporting alone");
                Some(own)
            }
            Err(e) => {
                tracing::warn!(run = %run_id, round = %round_idx, error = %e, "the group leader is unreachable; reporting alone");
                Some(own)
            }
        }
    }
}

/// Reports a group's merged report: whether the coordinator took it (or it could not be
/// delivered at all, when reporting shards alone would fare no better). Logs why not.
async fn send_merged(
    inner: &Inner,
    key: (RunId, RoundIdx),
    merged: Result<
        Result<PartialReport, starling_core::tier::PartialReportError>,
        tokio::task::JoinError,
    >,
) -> bool {
    let (run_id, round_idx) = key;
    match merged {
        Ok(Ok(merged)) => {
            if send_partial(inner, key, merged).await != Sent::Refused {
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

/// Waits until `done` holds for the round's inbox, or until `give_up`; then closes the inbox
/// and takes what is in it.
async fn collect(
    inner: &Inner,
    key: (RunId, RoundIdx),
    give_up: Instant,
    done: impl Fn(&Inbox) -> bool,
) -> Inbox {
    loop {
        {
            let mut shards = inner.shards.lock().expect("shards poisoned");
            let Some(shard) = shards.get_mut(&key) else { return Inbox::default() };
            if done(&shard.inbox) || Instant::now() >= give_up {
                shard.inbox.closed = true;
                return std::mem::take(&mut shard.inbox);
            }
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// Keeps the rendezvous fresh: the leader publishes it through the coordinator, members look
/// it up (every poll until found, then every few seconds, so a restarted leader is found).
pub(crate) async fn rendezvous(inner: &Inner) {
    let Some(group) = &inner.group else { return };
    group.renew_communicator();
    let fresh =
        group.synced.lock().expect("synced poisoned").is_some_and(|t| t.elapsed() < REFRESH_EVERY);
    if fresh {
        return;
    }
    let url = group.rendezvous_url(inner);
    let outcome = if group.is_leader() {
        publish(inner, group, &url).await
    } else {
        look_up(inner, group, &url).await
    };
    match outcome {
        Ok(()) => *group.synced.lock().expect("synced poisoned") = Some(Instant::now()),
        Err(e) => tracing::warn!(group = %group.config.name, error = %e, "group rendezvous"),
    }
}

async fn publish(inner: &Inner, group: &GroupState, url: &str) -> Result<(), String> {
    let doc = GroupRendezvous {
        leader: inner.config.id,
        leader_url: inner.url.clone(),
        world_size: group.config.world_size,
        nccl_id: group.nccl_id.lock().expect("nccl id poisoned").clone(),
    };
    let body = codec::to_vec(&doc).map_err(|e| e.to_string())?;
    let res = inner
        .cbor_request(reqwest::Method::PUT, url)
        .body(body)
        .send()
        .await
        .map_err(|e| e.to_string())?;
    if !res.status().is_success() {
        return Err(error_text(res).await);
    }
    let first = group.rendezvous.lock().expect("rendezvous poisoned").replace(doc).is_none();
    if first {
        tracing::info!(group = %group.config.name, world_size = group.config.world_size, nccl = group.plane.is_some(), "leading the aggregator group");
    }
    Ok(())
}

async fn look_up(inner: &Inner, group: &GroupState, url: &str) -> Result<(), String> {
    let res = inner
        .http
        .get(url)
        .bearer_auth(&inner.config.secret)
        .send()
        .await
        .map_err(|e| e.to_string())?;
    if !res.status().is_success() {
        return Err(error_text(res).await);
    }
    let bytes = res.bytes().await.map_err(|e| e.to_string())?;
    let doc: GroupRendezvous = codec::decode(&bytes).map_err(|e| e.to_string())?;
    doc.validate().map_err(|e| e.to_string())?;
    if doc.world_size != group.config.world_size {
        return Err(format!(
            "the leader says the group has {} members, this node was started with {}; reporting alone",
            doc.world_size, group.config.world_size
        ));
    }
    if let (Some(plane), Some(id)) = (&group.plane, &doc.nccl_id) {
        plane.join(id);
    }
    let previous = group.rendezvous.lock().expect("rendezvous poisoned").replace(doc.clone());
    if previous.as_ref() != Some(&doc) {
        tracing::info!(group = %group.config.name, leader = %doc.leader, url = %doc.leader_url, nccl = doc.nccl_id.is_some(), "found the group's leader");
    }
    Ok(())
}

async fn error_text(res: reqwest::Response) -> String {
    let status = res.status();
    let why = res.bytes().await.ok().and_then(|b| codec::decode::<ErrorBody>(&b).ok());
    format!("{status}: {}", why.map_or_else(String::new, |w| w.message))
}

/// What both hand-off endpoints check first: this node leads a group, the caller holds the
/// cluster secret, and the round's shard is here. What the shard's updates are checked against.
async fn as_leader(
    inner: &Inner,
    headers: &HeaderMap,
    (run_id, round_idx): (RunId, RoundIdx),
) -> Result<ShardRules, Refusal> {
    if !inner.group.as_ref().is_some_and(GroupState::is_leader) {
        return Err(Refusal(
            StatusCode::NOT_FOUND,
            ErrorCode::NotFound,
            "this node leads no aggregator group".into(),
        ));
    }
    let presented = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or("");
    if !same_secret(presented.as_bytes(), inner.config.secret.as_bytes()) {
        return Err(Refusal(
            StatusCode::UNAUTHORIZED,
            ErrorCode::Unauthorized,
            "missing or wrong cluster secret".into(),
        ));
    }
    shard_for(inner, run_id, round_idx).await.map_err(|_| {
        Refusal(
            StatusCode::CONFLICT,
            ErrorCode::RoundClosed,
            format!("the leader has no shard of run {run_id} round {round_idx}; report alone"),
        )
    })
}

/// The model version and the report's own checks, as the hand-offs answer them.
fn check_report(
    report: &PartialReport,
    model_version: starling_core::ModelVersion,
    check: impl FnOnce(&PartialReport) -> Result<(), starling_core::tier::PartialReportError>,
) -> Result<(), Refusal> {
    if report.model_version != model_version {
        return Err(stale_model(model_version));
    }
    check(report).map_err(|e| {
        Refusal(StatusCode::UNPROCESSABLE_ENTITY, ErrorCode::InvalidField, e.to_string())
    })
}

/// Puts a member's shard or offer into the round's inbox: refused when the leader already
/// reported the round, or the member's aggregators are already there.
fn into_inbox(
    inner: &Inner,
    key: (RunId, RoundIdx),
    aggregators: &[starling_core::AggregatorId],
    put: impl FnOnce(&mut Inbox),
) -> Result<(), Refusal> {
    let mut shards = inner.shards.lock().expect("shards poisoned");
    let Some(shard) = shards.get_mut(&key) else {
        return Err(Refusal(
            StatusCode::CONFLICT,
            ErrorCode::RoundClosed,
            "round forgotten".into(),
        ));
    };
    if shard.inbox.closed {
        return Err(Refusal(
            StatusCode::CONFLICT,
            ErrorCode::RoundClosed,
            "the leader already reported this round; report alone".into(),
        ));
    }
    if shard.inbox.holds_any_of(aggregators) || aggregators.contains(&inner.config.id) {
        return Err(Refusal(
            StatusCode::CONFLICT,
            ErrorCode::DuplicateUpload,
            "this aggregator's shard is already here".into(),
        ));
    }
    put(&mut shard.inbox);
    Ok(())
}

/// A member hands its finished shard to this node, the group's leader: 202 once taken (the
/// leader now reports it), 409 when the leader already reported the round or has no shard of
/// it, and the member reports alone.
pub(crate) async fn handoff(
    State(inner): State<std::sync::Arc<Inner>>,
    Path((run_id, round_idx)): Path<(i64, i64)>,
    headers: HeaderMap,
    body: Body,
) -> Result<StatusCode, Refusal> {
    let key = (RunId(run_id), RoundIdx(round_idx));
    let ShardRules { schema, model_version, .. } = as_leader(&inner, &headers, key).await?;
    let limit = schema.numel() as usize * 16 + HANDOFF_ENVELOPE_LIMIT;
    let bytes = read_body(body, limit).await?;
    let report = decode_then(bytes, move |r: PartialReport| {
        check_report(&r, model_version, |r| r.validate(&schema).map(drop))?;
        Ok(r)
    })
    .await?;
    let aggregators = report.aggregators.clone();
    let mut converting = false;
    into_inbox(&inner, key, &aggregators, |inbox| {
        converting = inbox.converting.iter().any(|a| aggregators.contains(a));
        inbox.reports.push(report);
    })?;
    let group = inner.group.as_ref().expect("checked by as_leader");
    if let Some(plane) = &group.plane
        && !converting
        && matches!(plane.status(), PlaneStatus::Joined { .. })
    {
        // A member that hands its sums over HTTP is not on this communicator (it restarted,
        // or a collective failed there): a new one, which it will join, is due.
        tracing::info!(member = ?aggregators, "a member is off the group's NCCL communicator; renewing it");
        plane.reset();
    }
    Ok(StatusCode::ACCEPTED)
}

/// A member on this leader's NCCL communicator offers its shard's metadata; the answer waits
/// until every member is in (or the leader's wait is over): 200 with the member's
/// [`CollectiveTurn`] (all-reduce now), or 409 (hand the sums over HTTP, or report alone).
pub(crate) async fn collective(
    State(inner): State<std::sync::Arc<Inner>>,
    Path((run_id, round_idx)): Path<(i64, i64)>,
    headers: HeaderMap,
    body: Body,
) -> Result<axum::response::Response, Refusal> {
    let key = (RunId(run_id), RoundIdx(round_idx));
    let ShardRules { schema, model_version, .. } = as_leader(&inner, &headers, key).await?;
    let bytes = read_body(body, HANDOFF_ENVELOPE_LIMIT).await?;
    let offer = decode_then(bytes, move |o: CollectiveOffer| {
        check_report(&o.report, model_version, |r| r.validate_metadata(&schema))?;
        Ok(o)
    })
    .await?;
    let group = inner.group.as_ref().expect("checked by as_leader");
    let on_it =
        group.plane.as_ref().is_some_and(|p| p.status() == PlaneStatus::Joined { tag: offer.comm });
    if !on_it {
        return Err(Refusal(
            StatusCode::CONFLICT,
            ErrorCode::Conflict,
            "the leader is not on that NCCL communicator; hand the sums over HTTP".into(),
        ));
    }
    let (turn, answer) = tokio::sync::oneshot::channel();
    let aggregators = offer.report.aggregators.clone();
    into_inbox(&inner, key, &aggregators, |inbox| {
        inbox.offers.push(Offer { report: offer.report, turn });
    })?;
    // Shorter than the member's own wait, so a turn is never given to a member gone.
    let wait = group.until_decided(&inner, key) + HANDOFF_TIMEOUT - Duration::from_secs(5);
    match tokio::time::timeout(wait, answer).await {
        Ok(Ok(Some(seq))) => {
            let body = codec::to_vec(&CollectiveTurn { seq }).unwrap_or_default();
            Ok(([(header::CONTENT_TYPE, wire::CBOR_MEDIA_TYPE)], body).into_response())
        }
        _ => Err(Refusal(
            StatusCode::CONFLICT,
            ErrorCode::Conflict,
            "not every member is in by collective this round; hand the sums over HTTP".into(),
        )),
    }
}

/// Compares secrets in time that does not depend on where they differ.
fn same_secret(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn group_settings_are_checked() {
        let config = |name: &str, rank, world_size| GroupConfig {
            name: name.into(),
            rank,
            world_size,
            wait: Duration::from_secs(1),
        };
        assert_eq!(config("rack-1", 0, 2).validate(), Ok(()));
        assert_eq!(config("rack-1", 7, 8).validate(), Ok(()));
        assert_eq!(
            config("rack-1", 2, 2).validate(),
            Err(GroupConfigError::Rank { rank: 2, world_size: 2 })
        );
        assert!(matches!(config("rack 1", 0, 2).validate(), Err(GroupConfigError::Group(_))));
        assert!(matches!(config("rack-1", 0, 1).validate(), Err(GroupConfigError::Group(_))));
    }

    #[test]
    fn secrets_compare_whole() {
        assert!(same_secret(b"abcdefgh", b"abcdefgh"));
        assert!(!same_secret(b"abcdefgh", b"abcdefgx"));
        assert!(!same_secret(b"abcdefgh", b"abcdefg"));
        assert!(!same_secret(b"", b"x"));
    }
}
