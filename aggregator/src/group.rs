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
//! With a collective ([`crate::collective`]: NCCL on GPUs, or TCP between CPU nodes) the sums
//! do not travel over HTTP: once every member is on the group's communicator (the id the
//! leader publishes), a member sends
//! the leader only who and how much (its report without sums) and waits for its turn; when
//! every member is in, the leader hands out one turn and all of them all-reduce their sums,
//! and the leader reports the merged metadata with the summed sums (core's
//! `merge_collective`). A member that is not on the communicator, an offer the leader cannot
//! take, or a collective that fails falls back to the HTTP hand-off or to reporting alone.
//!
//! The leader's decisions are sans-IO ([`inbox`]); its tasks are in `leader`, a member's in
//! `member`, and the rendezvous through the coordinator in `rendezvous`. The HTTP endpoints
//! members call on their leader are the service's; they hand what they decode to
//! [`GroupState::take_shard`] and [`GroupState::take_offer`].
//!
//! Nothing here can lose a shard that would otherwise have been reported: a member whose
//! leader is unknown, unreachable or refuses reports alone, and a leader whose merged report
//! the coordinator refuses reports each shard on its own (the coordinator takes the ones it
//! still lacks). A shard the leader accepted is lost with the leader, as one in any node's
//! memory is; its devices count as dropped.

use std::collections::{HashMap, HashSet};
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use starling_core::tier::{GroupRendezvous, PartialReport};
use starling_core::wire::path;
use starling_core::{AggregatorId, RoundIdx, RunId};

use crate::collective::tcp::Tcp;
use crate::collective::{Collective, Nccl, Plane, PlaneStatus, comm_tag};
use crate::engine::Engine;
use crate::report::Link;

pub(crate) mod inbox;
mod leader;
mod member;
mod rendezvous;

use inbox::Inbox;

/// How often a leader republishes its rendezvous and a member refreshes it.
const REFRESH_EVERY: Duration = Duration::from_secs(5);
/// How long the leader waits for the sums of members whose collective offers it turned down.
const CONVERT_WAIT: Duration = Duration::from_secs(10);
/// How long a member waits for the leader to take its shard before reporting it alone.
pub(crate) const HANDOFF_TIMEOUT: Duration = Duration::from_secs(30);

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
    /// How the members' sums meet.
    pub collective: CollectiveChoice,
}

/// How a group's members' sums meet at the leader (every member must choose the same).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum CollectiveChoice {
    /// NCCL on CUDA nodes with NCCL present; over HTTP otherwise.
    #[default]
    Auto,
    /// The TCP collective ([`crate::collective::tcp`]), on any engine.
    Tcp,
    /// Always over HTTP: members post their shards to the leader.
    Http,
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

/// Why a leader did not take a member's shard or offer (the member then reports alone, or
/// hands its sums over HTTP).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub(crate) enum HandoffRefusal {
    /// This node leads no group.
    #[error("this node leads no aggregator group")]
    NotLeader,
    /// The leader already reported the round.
    #[error("the leader already reported this round; report alone")]
    Closed,
    /// That member's shard (or offer) is already in, or it names the leader.
    #[error("this aggregator's shard is already here")]
    Duplicate,
    /// The offer names a communicator the leader is not on.
    #[error("the leader is not on that NCCL communicator; hand the sums over HTTP")]
    NotOnCommunicator,
    /// Not every member is in by collective this round.
    #[error("not every member is in by collective this round; hand the sums over HTTP")]
    NotByCollective,
}

/// A node's group state.
pub(crate) struct GroupState {
    config: GroupConfig,
    /// This node.
    me: AggregatorId,
    /// Where members reach this node (what a leader publishes).
    my_url: String,
    /// To the coordinator and the leader.
    link: Link,
    /// What the leader publishes (leader) or last found (member).
    rendezvous: Mutex<Option<GroupRendezvous>>,
    /// When the rendezvous was last published or refreshed.
    synced: Mutex<Option<Instant>>,
    /// The communicator id the leader publishes (a new one whenever its communicator broke).
    nccl_id: Mutex<Option<Vec<u8>>>,
    /// The collective plane: NCCL when the node runs CUDA with NCCL present, TCP when chosen.
    plane: Option<Plane>,
    /// A leader's inbox per round.
    inboxes: Mutex<HashMap<(RunId, RoundIdx), Inbox>>,
}

impl GroupState {
    /// `bind` is the IP the node's service listens on (a TCP collective's leader listens
    /// there too).
    pub(crate) fn new(
        config: GroupConfig,
        engine: &Engine,
        (me, my_url, bind): (AggregatorId, String, IpAddr),
        link: Link,
    ) -> Self {
        let collective: Option<Arc<dyn Collective>> = match (config.collective, engine) {
            (CollectiveChoice::Http, _) => None,
            (CollectiveChoice::Tcp, _) => Some(Arc::new(Tcp::new(bind, url_host(&my_url)))),
            (CollectiveChoice::Auto, &Engine::Cuda { device }) if crate::gpu::nccl_present() => {
                Some(Arc::new(Nccl { device }))
            }
            (CollectiveChoice::Auto, _) => None,
        };
        let (rank, world_size) = (config.rank as usize, config.world_size as usize);
        let plane = collective.map(|c| Plane::start(c, rank, world_size));
        GroupState {
            config,
            me,
            my_url,
            link,
            rendezvous: Mutex::new(None),
            synced: Mutex::new(None),
            nccl_id: Mutex::new(None),
            plane,
            inboxes: Mutex::new(HashMap::new()),
        }
    }

    pub(crate) fn is_leader(&self) -> bool {
        self.config.rank == 0
    }

    /// The leader's part in keeping a communicator: when it has none (at start, or after one
    /// broke or a join was abandoned), a new id, joined and published at once.
    fn renew_communicator(&self) {
        let Some(plane) = &self.plane else { return };
        if !self.is_leader() || plane.status() != PlaneStatus::Idle {
            return;
        }
        match plane.unique_id() {
            Ok(id) => {
                plane.join(&id);
                *self.nccl_id.lock().expect("nccl id poisoned") = Some(id);
                *self.synced.lock().expect("synced poisoned") = None;
            }
            Err(e) => {
                tracing::warn!(error = %e, transport = plane.transport(), "cannot make a communicator id; the group sums over HTTP")
            }
        }
    }

    /// The communicator this node and its leader are both on, if any.
    fn shared_communicator(&self, leader: &GroupRendezvous) -> Option<(&Plane, u64)> {
        let plane = self.plane.as_ref()?;
        let PlaneStatus::Joined { tag } = plane.status() else { return None };
        (leader.nccl_id.as_deref().map(comm_tag) == Some(tag)).then_some((plane, tag))
    }

    /// The coordinator's rendezvous endpoint of this group.
    fn rendezvous_url(&self) -> String {
        self.link.coordinator(&path::group(&self.config.name))
    }

    /// Runs `f` on the round's inbox (made on first use).
    fn with_inbox<T>(&self, key: (RunId, RoundIdx), f: impl FnOnce(&mut Inbox) -> T) -> T {
        f(self.inboxes.lock().expect("inboxes poisoned").entry(key).or_default())
    }

    /// Forgets the inboxes of rounds this node no longer holds a shard of.
    pub(crate) fn forget_rounds_but(&self, held: &HashSet<(RunId, RoundIdx)>) {
        self.inboxes.lock().expect("inboxes poisoned").retain(|key, _| held.contains(key));
    }
}

/// The host of `url` (what members connect to), the URL itself when it has none.
fn url_host(url: &str) -> String {
    let rest = url.split_once("://").map_or(url, |(_, rest)| rest);
    let authority = rest.split('/').next().unwrap_or(rest);
    let host = match authority.strip_prefix('[') {
        Some(v6) => v6.split(']').next().unwrap_or(v6),
        None => authority.rsplit_once(':').map_or(authority, |(host, _)| host),
    };
    host.to_owned()
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
            collective: CollectiveChoice::Auto,
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
    fn members_reach_the_host_of_the_nodes_url() {
        assert_eq!(url_host("http://10.0.0.7:9090"), "10.0.0.7");
        assert_eq!(url_host("https://agg-1.rack.svc:443/"), "agg-1.rack.svc");
        assert_eq!(url_host("http://[fd00::7]:9090/x"), "fd00::7");
        assert_eq!(url_host("http://agg-2"), "agg-2");
    }
}
