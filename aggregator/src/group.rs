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
//! Nothing here can lose a shard that would otherwise have been reported: a member whose
//! leader is unknown, unreachable or refuses reports alone, and a leader whose merged report
//! the coordinator refuses reports each shard on its own (the coordinator takes the ones it
//! still lacks). A shard the leader accepted is lost with the leader, as one in any node's
//! memory is; its devices count as dropped.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode, header};
use starling_core::tier::{GroupRendezvous, PartialReport, ShardTask, merge_reports};
use starling_core::wire::{self, ErrorBody, ErrorCode};
use starling_core::{RoundIdx, RunId};

use crate::service::{
    Inner, Refusal, Sent, malformed, read_body, send_partial, shard_for, stale_model,
};

/// Where a group leader takes its members' finished shards.
pub(crate) const HANDOFF_ROUTE: &str = "/v1/group/runs/{run_id}/rounds/{round_idx}/partial";
/// How often a leader republishes its rendezvous and a member refreshes it.
const REFRESH_EVERY: Duration = Duration::from_secs(5);
/// Room in a handed-off shard beyond its sums (16 bytes a parameter).
const HANDOFF_ENVELOPE_LIMIT: usize = 4 * 1024 * 1024;
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

/// A leader's inbox for one round: the members' shards it took, until it reports.
#[derive(Debug, Default)]
pub(crate) struct Inbox {
    reports: Vec<PartialReport>,
    closed: bool,
}

/// A node's group state.
pub(crate) struct GroupState {
    config: GroupConfig,
    /// What the leader publishes (leader) or last found (member).
    rendezvous: Mutex<Option<GroupRendezvous>>,
    /// When the rendezvous was last published or refreshed.
    synced: Mutex<Option<Instant>>,
    /// The NCCL unique id the leader publishes, when it runs CUDA with NCCL present.
    nccl_id: Option<Vec<u8>>,
}

impl GroupState {
    pub(crate) fn new(config: GroupConfig, engine: &crate::Engine) -> Self {
        let nccl_id = match engine {
            crate::Engine::Cuda { .. } if config.rank == 0 && crate::gpu::nccl_present() => {
                crate::gpu::NcclGroup::unique_id().ok()
            }
            _ => None,
        };
        GroupState { config, rendezvous: Mutex::new(None), synced: Mutex::new(None), nccl_id }
    }

    /// The coordinator's rendezvous endpoint of this group.
    fn rendezvous_url(&self, inner: &Inner) -> String {
        format!(
            "{}/v1/aggregation/groups/{}",
            inner.config.coordinator_url.trim_end_matches('/'),
            self.config.name
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
        let members = loop {
            {
                let mut shards = inner.shards.lock().expect("shards poisoned");
                let Some(shard) = shards.get_mut(&key) else { break vec![] };
                if shard.inbox.reports.len() >= expected || Instant::now() >= give_up {
                    shard.inbox.closed = true;
                    break std::mem::take(&mut shard.inbox.reports);
                }
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        };
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
        match merged {
            Ok(Ok(merged)) => {
                if send_partial(inner, key, merged).await != Sent::Refused {
                    return;
                }
                tracing::warn!(run = %run_id, round = %round_idx, "the group's partial was refused; reporting each shard alone");
            }
            Ok(Err(e)) => {
                tracing::warn!(run = %run_id, round = %round_idx, error = %e, "cannot merge the group's shards; reporting each alone");
            }
            Err(e) => tracing::error!(error = %e, "merging the group's shards panicked"),
        }
        // The merge is over, so this is the only handle left.
        let all = std::sync::Arc::try_unwrap(all).unwrap_or_else(|shared| (*shared).clone());
        for report in all {
            send_partial(inner, key, report).await;
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
        let (own, body) = tokio::task::spawn_blocking(move || {
            let body = wire::to_vec(&own);
            (own, body)
        })
        .await
        .ok()?;
        let body = body.ok()?;
        let url = format!(
            "{}/v1/group/runs/{run_id}/rounds/{round_idx}/partial",
            leader.leader_url.trim_end_matches('/')
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
                let why = r.bytes().await.ok().and_then(|b| wire::decode::<ErrorBody>(&b).ok());
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

/// Keeps the rendezvous fresh: the leader publishes it through the coordinator, members look
/// it up (every poll until found, then every few seconds, so a restarted leader is found).
pub(crate) async fn rendezvous(inner: &Inner) {
    let Some(group) = &inner.group else { return };
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
        nccl_id: group.nccl_id.clone(),
    };
    let body = wire::to_vec(&doc).map_err(|e| e.to_string())?;
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
        tracing::info!(group = %group.config.name, world_size = group.config.world_size, nccl = group.nccl_id.is_some(), "leading the aggregator group");
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
    let doc: GroupRendezvous = wire::decode(&bytes).map_err(|e| e.to_string())?;
    doc.validate().map_err(|e| e.to_string())?;
    if doc.world_size != group.config.world_size {
        return Err(format!(
            "the leader says the group has {} members, this node was started with {}; reporting alone",
            doc.world_size, group.config.world_size
        ));
    }
    let previous = group.rendezvous.lock().expect("rendezvous poisoned").replace(doc.clone());
    if previous.as_ref() != Some(&doc) {
        tracing::info!(group = %group.config.name, leader = %doc.leader, url = %doc.leader_url, nccl = doc.nccl_id.is_some(), "found the group's leader");
    }
    Ok(())
}

async fn error_text(res: reqwest::Response) -> String {
    let status = res.status();
    let why = res.bytes().await.ok().and_then(|b| wire::decode::<ErrorBody>(&b).ok());
    format!("{status}: {}", why.map_or_else(String::new, |w| w.message))
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
    let (run_id, round_idx) = (RunId(run_id), RoundIdx(round_idx));
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
    let (schema, model_version) = shard_for(&inner, run_id, round_idx).await.map_err(|_| {
        Refusal(
            StatusCode::CONFLICT,
            ErrorCode::RoundClosed,
            format!("the leader has no shard of run {run_id} round {round_idx}; report alone"),
        )
    })?;
    let limit = schema.numel() as usize * 16 + HANDOFF_ENVELOPE_LIMIT;
    let bytes = read_body(body, limit).await?;
    let report = tokio::task::spawn_blocking(move || {
        let report: PartialReport = wire::decode(&bytes).map_err(malformed)?;
        if report.model_version != model_version {
            return Err(stale_model(model_version));
        }
        report.validate(&schema).map_err(|e| {
            Refusal(StatusCode::UNPROCESSABLE_ENTITY, ErrorCode::InvalidField, e.to_string())
        })?;
        Ok(report)
    })
    .await
    .map_err(|e| {
        Refusal(StatusCode::INTERNAL_SERVER_ERROR, ErrorCode::Internal, e.to_string())
    })??;
    let mut shards = inner.shards.lock().expect("shards poisoned");
    let Some(shard) = shards.get_mut(&(run_id, round_idx)) else {
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
    let repeats = shard
        .inbox
        .reports
        .iter()
        .any(|r| r.aggregators.iter().any(|a| report.aggregators.contains(a)));
    if repeats || report.aggregators.contains(&inner.config.id) {
        return Err(Refusal(
            StatusCode::CONFLICT,
            ErrorCode::DuplicateUpload,
            "this aggregator's shard is already here".into(),
        ));
    }
    shard.inbox.reports.push(report);
    Ok(StatusCode::ACCEPTED)
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
