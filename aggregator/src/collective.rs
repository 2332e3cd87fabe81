//! The data plane of an aggregator group: the members' sums meet in one all-reduce instead of
//! travelling to the leader over HTTP.
//!
//! The all-reduce is a [`Collective`]: NCCL between the GPUs of CUDA nodes ([`Nccl`]), or
//! [`tcp::Tcp`] between CPU nodes (a star through the leader, which is also how the group
//! path runs with 2 to 4 ranks in `cargo xtask test` on machines without GPUs). Everything
//! above the transport (joins, turns, broken communicators, the fallbacks in
//! [`crate::group`]) is the same code for both.
//!
//! One thread per node owns the group's communicator and runs its collectives one at a time,
//! in the order they arrive (the leader hands out turns one at a time, so every member runs
//! them in the same order). Joining blocks until every member is in, so each join runs on a
//! thread of its own and reports back; a join that takes too long is abandoned.
//!
//! What to do is decided by [`PlaneState`] (sans-IO: requests, outcomes and `now` in,
//! decisions out), which the tests drive directly; the thread carries the decisions out. A
//! collective that fails or times out breaks the communicator on that node: the leader then
//! makes a new id and publishes it, and the members join that one. Until every member is on
//! one communicator, the group hands its sums over HTTP (see [`crate::group`]).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

use crate::gpu::{GpuError, NcclGroup};
use crate::reduce::Sums;

pub mod tcp;

/// How a group's members all-reduce their sums: makes communicators' ids and joins them.
pub trait Collective: Send + Sync + 'static {
    /// The transport's name, for logs (`nccl`, `tcp`).
    fn name(&self) -> &'static str;

    /// A fresh 128-byte id of a new communicator (the leader makes it and publishes it
    /// through the coordinator).
    fn unique_id(&self) -> Result<Vec<u8>, CollectiveError>;

    /// Joins the communicator `id` as `rank` of `world_size`. Blocks until every member has
    /// joined (or the transport gives up), so call it off the async runtime.
    fn join(
        &self,
        rank: usize,
        world_size: usize,
        id: &[u8],
    ) -> Result<Box<dyn Communicator>, CollectiveError>;
}

/// One node's end of a joined communicator.
pub trait Communicator: Send {
    /// Sums `hi` and `lo` (this node's partial sums) across the group; the group's sums when
    /// `want_result`. Waits at most until `deadline`; after an error the communicator is
    /// broken: [`Communicator::abort`] it and join a new one.
    fn all_reduce_sums(
        &mut self,
        hi: &[f64],
        lo: &[f64],
        want_result: bool,
        deadline: Instant,
    ) -> Result<Option<Sums>, CollectiveError>;

    /// Leaves the communicator (peers waiting in a collective on it fail, not hang).
    fn abort(self: Box<Self>);
}

/// NCCL on the CUDA device `device`: the transport of CUDA nodes with NCCL present.
pub struct Nccl {
    /// The node's GPU.
    pub device: usize,
}

impl Collective for Nccl {
    fn name(&self) -> &'static str {
        "nccl"
    }

    fn unique_id(&self) -> Result<Vec<u8>, CollectiveError> {
        Ok(NcclGroup::unique_id()?)
    }

    fn join(
        &self,
        rank: usize,
        world_size: usize,
        id: &[u8],
    ) -> Result<Box<dyn Communicator>, CollectiveError> {
        Ok(Box::new(NcclGroup::join(self.device, rank, world_size, id)?))
    }
}

impl Communicator for NcclGroup {
    fn all_reduce_sums(
        &mut self,
        hi: &[f64],
        lo: &[f64],
        want_result: bool,
        deadline: Instant,
    ) -> Result<Option<Sums>, CollectiveError> {
        Ok(NcclGroup::all_reduce_sums(self, hi, lo, want_result, deadline)?)
    }

    fn abort(self: Box<Self>) {
        NcclGroup::abort(*self);
    }
}

/// How long a join may take before it is abandoned (a member never came).
pub const JOIN_TIMEOUT: Duration = Duration::from_secs(60);

/// How long a collective over `n_params` sums may take: 10 s, plus the 16 bytes a parameter
/// at 1 GB/s (NVLink and PCIe do better by far; a slower one means a member is stuck).
pub fn collective_timeout(n_params: usize) -> Duration {
    Duration::from_secs(10) + Duration::from_secs_f64(n_params as f64 * 16.0 / 1e9)
}

/// A communicator's name: a fingerprint (FNV-1a) of its NCCL unique id.
pub fn comm_tag(nccl_id: &[u8]) -> u64 {
    nccl_id
        .iter()
        .fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3))
}

/// Where a node's communicator stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PlaneStatus {
    /// None, and none being joined.
    Idle,
    /// Joining the communicator `tag` since `since`.
    Joining {
        /// The communicator.
        tag: u64,
        /// When the join started.
        since: Instant,
    },
    /// On the communicator `tag`: collectives can run.
    Joined {
        /// The communicator.
        tag: u64,
    },
}

/// Why a collective did not run or did not finish.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CollectiveError {
    /// This node is not on that communicator (any more).
    #[error("not on the group's communicator {0:#x}")]
    NotJoined(u64),
    /// Its deadline passed before it could start.
    #[error("the collective's deadline passed before it started")]
    Expired,
    /// NCCL or CUDA failed, or the collective timed out.
    #[error(transparent)]
    Gpu(#[from] GpuError),
    /// The TCP collective failed: a peer left, sent what the protocol does not allow, or did
    /// not keep the deadline.
    #[error("TCP collective: {0}")]
    Tcp(String),
    /// The plane's thread is gone.
    #[error("the collective's plane stopped")]
    Stopped,
}

/// The plane's decisions, apart from their IO.
#[derive(Debug)]
pub struct PlaneState {
    status: PlaneStatus,
    /// The last communicator this node left: never joined again (its peers moved on).
    left: Option<u64>,
}

impl Default for PlaneState {
    fn default() -> Self {
        PlaneState { status: PlaneStatus::Idle, left: None }
    }
}

impl PlaneState {
    /// Where the plane stands at `now`; a join older than [`JOIN_TIMEOUT`] is abandoned.
    pub fn status(&mut self, now: Instant) -> PlaneStatus {
        if let PlaneStatus::Joining { tag, since } = self.status
            && now.duration_since(since) >= JOIN_TIMEOUT
        {
            self.leave(tag);
        }
        self.status
    }

    /// A join of `tag` is asked for (the leader made a new id, or a member found one):
    /// whether to start it. Not when already on it or joining it, nor when this node left it.
    pub fn request_join(&mut self, tag: u64, now: Instant) -> bool {
        if self.left == Some(tag) {
            return false;
        }
        match self.status(now) {
            PlaneStatus::Joining { tag: t, .. } | PlaneStatus::Joined { tag: t } if t == tag => {
                false
            }
            _ => {
                self.status = PlaneStatus::Joining { tag, since: now };
                true
            }
        }
    }

    /// A join of `tag` finished (`ok`: it succeeded): whether its communicator becomes the
    /// current one. A join that was abandoned or superseded meanwhile is not kept.
    pub fn joined(&mut self, tag: u64, ok: bool) -> bool {
        if !matches!(self.status, PlaneStatus::Joining { tag: t, .. } if t == tag) {
            return false;
        }
        if ok {
            self.status = PlaneStatus::Joined { tag };
        } else {
            self.leave(tag);
        }
        ok
    }

    /// Whether a collective on `tag` may run now.
    pub fn may_run(&self, tag: u64) -> bool {
        self.status == PlaneStatus::Joined { tag }
    }

    /// A collective on `tag` failed: the communicator is broken, so this node leaves it.
    pub fn broke(&mut self, tag: u64) {
        if self.may_run(tag) {
            self.leave(tag);
        }
    }

    /// Leave whatever communicator this node is on or joining (the leader knows a collective
    /// it announced will not be matched).
    pub fn reset(&mut self) {
        if let PlaneStatus::Joining { tag, .. } | PlaneStatus::Joined { tag } = self.status {
            self.leave(tag);
        }
    }

    fn leave(&mut self, tag: u64) {
        self.left = Some(tag);
        self.status = PlaneStatus::Idle;
    }
}

enum Job {
    Join {
        tag: u64,
        id: Vec<u8>,
    },
    Joined {
        tag: u64,
        result: Result<Box<dyn Communicator>, CollectiveError>,
    },
    AllReduce {
        tag: u64,
        sums: Sums,
        want_result: bool,
        deadline: Instant,
        reply: oneshot::Sender<Result<Option<Sums>, CollectiveError>>,
    },
    Reset,
}

/// A node's collective plane: its communicator's thread, and the state the service reads.
pub struct Plane {
    jobs: std::sync::mpsc::Sender<Job>,
    state: Arc<Mutex<PlaneState>>,
    collective: Arc<dyn Collective>,
    /// The leader's turn counter: it runs the group's collectives one at a time, holding this.
    pub(crate) turns: tokio::sync::Mutex<u64>,
}

impl Plane {
    /// Starts the plane of rank `rank` of `world_size` over `collective`.
    pub fn start(collective: Arc<dyn Collective>, rank: usize, world_size: usize) -> Plane {
        let (jobs, rx) = std::sync::mpsc::channel();
        let state = Arc::new(Mutex::new(PlaneState::default()));
        let thread_state = state.clone();
        let joins = jobs.clone();
        let transport = collective.clone();
        std::thread::Builder::new()
            .name("collective-plane".into())
            .spawn(move || plane_thread(&rx, &joins, &thread_state, (transport, rank, world_size)))
            .expect("spawning the collective plane thread");
        Plane { jobs, state, collective, turns: tokio::sync::Mutex::new(0) }
    }

    /// The transport's name, for logs.
    pub fn transport(&self) -> &'static str {
        self.collective.name()
    }

    /// A fresh id of a new communicator on this plane's transport.
    pub fn unique_id(&self) -> Result<Vec<u8>, CollectiveError> {
        self.collective.unique_id()
    }

    /// Where the plane stands.
    pub fn status(&self) -> PlaneStatus {
        self.state.lock().expect("plane state poisoned").status(Instant::now())
    }

    /// Joins the communicator of `nccl_id`, unless already on it or joining it.
    pub fn join(&self, nccl_id: &[u8]) {
        let tag = comm_tag(nccl_id);
        if self.state.lock().expect("plane state poisoned").request_join(tag, Instant::now()) {
            tracing::info!(
                comm = format_args!("{tag:#x}"),
                transport = self.collective.name(),
                "joining the group's communicator"
            );
            let _ = self.jobs.send(Job::Join { tag, id: nccl_id.to_vec() });
        }
    }

    /// Leaves the current communicator.
    pub fn reset(&self) {
        self.state.lock().expect("plane state poisoned").reset();
        let _ = self.jobs.send(Job::Reset);
    }

    /// Sums `sums` across the group on communicator `tag`; the group's sums when
    /// `want_result`. Fails rather than waits past `deadline`.
    pub async fn all_reduce(
        &self,
        tag: u64,
        sums: Sums,
        want_result: bool,
        deadline: Instant,
    ) -> Result<Option<Sums>, CollectiveError> {
        let (reply, answer) = oneshot::channel();
        self.jobs
            .send(Job::AllReduce { tag, sums, want_result, deadline, reply })
            .map_err(|_| CollectiveError::Stopped)?;
        // The thread enforces the deadline; the margin covers copying the result back.
        let margin = tokio::time::Instant::from_std(deadline) + Duration::from_secs(30);
        match tokio::time::timeout_at(margin, answer).await {
            Ok(Ok(result)) => result,
            Ok(Err(_)) => Err(CollectiveError::Stopped),
            Err(_) => Err(GpuError::CollectiveTimeout.into()),
        }
    }
}

fn plane_thread(
    jobs: &std::sync::mpsc::Receiver<Job>,
    joins: &std::sync::mpsc::Sender<Job>,
    state: &Mutex<PlaneState>,
    (collective, rank, world_size): (Arc<dyn Collective>, usize, usize),
) {
    let transport = collective.name();
    let mut current: Option<(u64, Box<dyn Communicator>)> = None;
    let lock = || state.lock().expect("plane state poisoned");
    while let Ok(job) = jobs.recv() {
        match job {
            Job::Join { tag, id } => {
                if let Some((_, old)) = current.take() {
                    old.abort();
                }
                let (joins, collective) = (joins.clone(), collective.clone());
                // Blocks until every member joined; abandoned (left running) if that never
                // happens, and its result is then dropped when it comes.
                let _ =
                    std::thread::Builder::new().name("collective-join".into()).spawn(move || {
                        let result = collective.join(rank, world_size, &id);
                        if let Err(std::sync::mpsc::SendError(Job::Joined {
                            result: Ok(g), ..
                        })) = joins.send(Job::Joined { tag, result })
                        {
                            g.abort();
                        }
                    });
            }
            Job::Joined { tag, result } => {
                let keep = lock().joined(tag, result.is_ok());
                match result {
                    Ok(group) if keep => {
                        tracing::info!(
                            comm = format_args!("{tag:#x}"),
                            rank,
                            world_size,
                            transport,
                            "on the group's communicator"
                        );
                        if let Some((_, old)) = current.replace((tag, group)) {
                            old.abort();
                        }
                    }
                    Ok(stale) => stale.abort(),
                    Err(e) => {
                        tracing::warn!(comm = format_args!("{tag:#x}"), transport, error = %e, "joining the group's communicator failed");
                    }
                }
            }
            Job::AllReduce { tag, sums, want_result, deadline, reply } => {
                let result = match &mut current {
                    Some((t, group)) if *t == tag && lock().may_run(tag) => {
                        let result = if Instant::now() >= deadline {
                            Err(CollectiveError::Expired)
                        } else {
                            group.all_reduce_sums(&sums.0, &sums.1, want_result, deadline)
                        };
                        if result.is_err() {
                            // Peers may be inside this collective or past it: the
                            // communicator cannot be trusted any more.
                            lock().broke(tag);
                            if let Some((_, broken)) = current.take() {
                                broken.abort();
                            }
                        }
                        result
                    }
                    _ => Err(CollectiveError::NotJoined(tag)),
                };
                let _ = reply.send(result);
            }
            Job::Reset => {
                if let Some((_, old)) = current.take() {
                    old.abort();
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_node_joins_each_communicator_once_and_never_one_it_left() {
        let t0 = Instant::now();
        let mut s = PlaneState::default();
        assert_eq!(s.status(t0), PlaneStatus::Idle);
        assert!(s.request_join(7, t0));
        // The rendezvous is read again every few seconds: no second join of the same id.
        assert!(!s.request_join(7, t0 + Duration::from_secs(5)));
        assert!(!s.may_run(7));
        assert!(s.joined(7, true));
        assert_eq!(s.status(t0), PlaneStatus::Joined { tag: 7 });
        assert!(!s.request_join(7, t0 + Duration::from_secs(10)));
        assert!(s.may_run(7) && !s.may_run(8));
        // A collective failed: the node leaves, and does not go back to that id.
        s.broke(7);
        assert_eq!(s.status(t0), PlaneStatus::Idle);
        assert!(!s.request_join(7, t0 + Duration::from_secs(15)));
        // The leader's next id is joined.
        assert!(s.request_join(9, t0 + Duration::from_secs(15)));
    }

    #[test]
    fn a_newer_id_supersedes_a_join_in_progress_and_a_slow_join_is_abandoned() {
        let t0 = Instant::now();
        let mut s = PlaneState::default();
        assert!(s.request_join(1, t0));
        assert!(s.request_join(2, t0 + Duration::from_secs(1)));
        // The first join finishing late does not become current.
        assert!(!s.joined(1, true));
        assert_eq!(
            s.status(t0 + Duration::from_secs(2)),
            PlaneStatus::Joining { tag: 2, since: t0 + Duration::from_secs(1) }
        );
        // Nobody came for a minute: abandoned, and that id is not tried again.
        assert_eq!(s.status(t0 + Duration::from_secs(1) + JOIN_TIMEOUT), PlaneStatus::Idle);
        assert!(!s.joined(2, true));
        assert!(!s.request_join(2, t0 + JOIN_TIMEOUT * 2));
        // A failed join leaves the node idle, so a leader makes a new id.
        assert!(s.request_join(3, t0 + JOIN_TIMEOUT * 2));
        assert!(!s.joined(3, false));
        assert_eq!(s.status(t0 + JOIN_TIMEOUT * 2), PlaneStatus::Idle);
    }

    #[test]
    fn a_broken_collective_only_breaks_the_communicator_it_ran_on() {
        let t0 = Instant::now();
        let mut s = PlaneState::default();
        assert!(s.request_join(4, t0));
        assert!(s.joined(4, true));
        s.broke(3);
        assert!(s.may_run(4));
        s.reset();
        assert!(!s.may_run(4));
        assert_eq!(s.status(t0), PlaneStatus::Idle);
    }

    #[test]
    fn communicator_tags_tell_ids_apart() {
        let a = [1u8; 128];
        let mut b = a;
        b[127] = 2;
        assert_eq!(comm_tag(&a), comm_tag(&a));
        assert_ne!(comm_tag(&a), comm_tag(&b));
        assert!(collective_timeout(100_000_000) > collective_timeout(1000));
    }

    #[test]
    fn without_nccl_a_plane_fails_cleanly() {
        if crate::gpu::probe().is_ok() && crate::gpu::nccl_present() {
            starling_core::skipped::skipped(
                "without_nccl_a_plane_fails_cleanly",
                "a GPU and NCCL are present",
            );
            return;
        }
        // The join fails on its thread (no GPU or no NCCL); the plane goes idle, and a
        // collective on that communicator is refused, not hung.
        let plane = Plane::start(Arc::new(Nccl { device: 0 }), 1, 2);
        plane.join(&[5u8; 128]);
        let tag = comm_tag(&[5u8; 128]);
        let started = Instant::now();
        while plane.status() != PlaneStatus::Idle {
            assert!(started.elapsed() < Duration::from_secs(10), "the failed join never came back");
            std::thread::sleep(Duration::from_millis(10));
        }
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        let result = rt.block_on(plane.all_reduce(tag, (vec![1.0], vec![0.0]), true, deadline));
        assert!(matches!(result, Err(CollectiveError::NotJoined(t)) if t == tag), "{result:?}");
    }
}
