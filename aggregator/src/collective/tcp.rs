//! A CPU [`Collective`] over TCP, for groups of CPU nodes: a star through the leader, which
//! sums the members' sums in rank order and sends the group's sums back to every member.
//!
//! The communicator's id (what the leader publishes through the coordinator, in place of
//! NCCL's) names the address the leader listens on for it and a random 16-byte token; a member
//! joins by connecting there and presenting the token with its rank. Only a node that could
//! read the rendezvous (with the cluster secret) knows the token. Like NCCL's traffic, the
//! sums themselves are not encrypted: run groups inside one trusted network.
//!
//! Frames are little-endian: a member's hello is the token, its rank and the world size
//! (`u32` each); the leader answers one byte once every member is in. A collective is, both
//! ways, the parameter count (`u64`) and then the high and the low parts (`f64` each).

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::{Collective, CollectiveError, Communicator, JOIN_TIMEOUT};
use crate::reduce::Sums;

/// The first bytes of a TCP communicator's id.
const MAGIC: &[u8; 12] = b"starling-tcp";
/// Bytes of the token in an id.
const TOKEN: usize = 16;
/// An id's length (NCCL's, so the rendezvous document carries either).
pub const ID_LEN: usize = 128;
/// The byte the leader sends each member once every member joined.
const ALL_IN: u8 = 1;

/// The TCP collective of a node whose members reach it at `host`.
pub struct Tcp {
    /// Where the leader listens for its members (the IP its service listens on).
    bind: IpAddr,
    /// How members reach it (its public URL's host).
    host: String,
    /// Listeners of ids this node made and has not joined yet.
    listening: Mutex<HashMap<Vec<u8>, TcpListener>>,
}

impl Tcp {
    /// A TCP collective that listens on `bind` and tells members to connect to `host`.
    pub fn new(bind: IpAddr, host: impl Into<String>) -> Self {
        Tcp { bind, host: host.into(), listening: Mutex::new(HashMap::new()) }
    }
}

fn tcp_error(what: impl std::fmt::Display) -> CollectiveError {
    CollectiveError::Tcp(what.to_string())
}

/// An id's parts: the leader's address and the token.
fn parse_id(id: &[u8]) -> Result<(String, [u8; TOKEN]), CollectiveError> {
    if id.len() != ID_LEN || &id[..MAGIC.len()] != MAGIC {
        return Err(tcp_error("not a TCP communicator id"));
    }
    let rest = &id[MAGIC.len()..];
    let token: [u8; TOKEN] = rest[..TOKEN].try_into().expect("16 bytes");
    let len = usize::from(rest[TOKEN]);
    let address = rest.get(TOKEN + 1..TOKEN + 1 + len).ok_or_else(|| tcp_error("id too short"))?;
    let address = std::str::from_utf8(address).map_err(|_| tcp_error("id's address"))?;
    Ok((address.to_owned(), token))
}

impl Collective for Tcp {
    fn name(&self) -> &'static str {
        "tcp"
    }

    fn unique_id(&self) -> Result<Vec<u8>, CollectiveError> {
        let listener = TcpListener::bind((self.bind, 0)).map_err(tcp_error)?;
        let port = listener.local_addr().map_err(tcp_error)?.port();
        let address = match self.host.parse::<IpAddr>() {
            Ok(IpAddr::V6(ip)) => SocketAddr::from((ip, port)).to_string(),
            _ => format!("{}:{port}", self.host),
        };
        let mut token = [0u8; TOKEN];
        getrandom::fill(&mut token).map_err(tcp_error)?;
        let mut id = Vec::with_capacity(ID_LEN);
        id.extend_from_slice(MAGIC);
        id.extend_from_slice(&token);
        let len = u8::try_from(address.len())
            .ok()
            .filter(|&n| MAGIC.len() + TOKEN + 1 + usize::from(n) <= ID_LEN)
            .ok_or_else(|| tcp_error(format!("the address {address} does not fit an id")))?;
        id.push(len);
        id.extend_from_slice(address.as_bytes());
        id.resize(ID_LEN, 0);
        self.listening.lock().expect("listeners poisoned").insert(id.clone(), listener);
        Ok(id)
    }

    fn join(
        &self,
        rank: usize,
        world_size: usize,
        id: &[u8],
    ) -> Result<Box<dyn Communicator>, CollectiveError> {
        let (address, token) = parse_id(id)?;
        let deadline = Instant::now() + JOIN_TIMEOUT;
        if rank == 0 {
            let listener = self
                .listening
                .lock()
                .expect("listeners poisoned")
                .remove(id)
                .ok_or_else(|| tcp_error("the leader did not make this id"))?;
            Ok(Box::new(accept_members(&listener, &token, world_size, deadline)?))
        } else {
            Ok(Box::new(join_leader(&address, &token, (rank, world_size), deadline)?))
        }
    }
}

/// Sets `stream`'s timeouts to what is left until `deadline`; an error once it passed.
fn until(stream: &TcpStream, deadline: Instant) -> Result<(), CollectiveError> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(tcp_error("the deadline passed"));
    }
    stream.set_read_timeout(Some(left)).map_err(tcp_error)?;
    stream.set_write_timeout(Some(left)).map_err(tcp_error)
}

/// The leader's join: every member's hello, checked, then [`ALL_IN`] to each.
fn accept_members(
    listener: &TcpListener,
    token: &[u8; TOKEN],
    world_size: usize,
    deadline: Instant,
) -> Result<Leader, CollectiveError> {
    listener.set_nonblocking(true).map_err(tcp_error)?;
    let mut members: Vec<Option<TcpStream>> = (1..world_size).map(|_| None).collect();
    while members.iter().any(Option::is_none) {
        let stream = match listener.accept() {
            Ok((stream, _)) => stream,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    return Err(tcp_error("not every member joined in time"));
                }
                std::thread::sleep(Duration::from_millis(5));
                continue;
            }
            Err(e) => return Err(tcp_error(e)),
        };
        stream.set_nonblocking(false).map_err(tcp_error)?;
        stream.set_nodelay(true).map_err(tcp_error)?;
        // A connection that does not say who it is in time is dropped, not waited for.
        until(&stream, deadline.min(Instant::now() + Duration::from_secs(5)))?;
        let mut hello = [0u8; TOKEN + 8];
        if (&stream).read_exact(&mut hello).is_err() || hello[..TOKEN] != token[..] {
            tracing::warn!("a connection to the group's TCP collective did not present its token");
            continue;
        }
        let rank = u32::from_le_bytes(hello[TOKEN..TOKEN + 4].try_into().expect("4")) as usize;
        let size = u32::from_le_bytes(hello[TOKEN + 4..].try_into().expect("4")) as usize;
        if size != world_size || !(1..world_size).contains(&rank) {
            return Err(tcp_error(format!("a member says rank {rank} of {size}")));
        }
        if members[rank - 1].replace(stream).is_some() {
            return Err(tcp_error(format!("rank {rank} joined twice")));
        }
    }
    let members: Vec<TcpStream> = members.into_iter().map(|m| m.expect("all in")).collect();
    for member in &members {
        until(member, deadline)?;
        (&*member).write_all(&[ALL_IN]).map_err(tcp_error)?;
    }
    Ok(Leader { members })
}

/// A member's join: connect, say who it is, wait until every member is in.
fn join_leader(
    address: &str,
    token: &[u8; TOKEN],
    (rank, world_size): (usize, usize),
    deadline: Instant,
) -> Result<Member, CollectiveError> {
    let stream = loop {
        match TcpStream::connect(address) {
            Ok(stream) => break stream,
            Err(e) if Instant::now() >= deadline => return Err(tcp_error(e)),
            Err(_) => std::thread::sleep(Duration::from_millis(50)),
        }
    };
    stream.set_nodelay(true).map_err(tcp_error)?;
    until(&stream, deadline)?;
    let mut hello = token.to_vec();
    hello.extend_from_slice(&(rank as u32).to_le_bytes());
    hello.extend_from_slice(&(world_size as u32).to_le_bytes());
    (&stream).write_all(&hello).map_err(tcp_error)?;
    let mut all_in = [0u8; 1];
    (&stream).read_exact(&mut all_in).map_err(tcp_error)?;
    if all_in[0] != ALL_IN {
        return Err(tcp_error("the leader's answer to the join"));
    }
    Ok(Member { leader: stream })
}

fn write_sums(mut stream: &TcpStream, hi: &[f64], lo: &[f64]) -> Result<(), CollectiveError> {
    let mut frame = Vec::with_capacity(8 + 16 * hi.len());
    frame.extend_from_slice(&(hi.len() as u64).to_le_bytes());
    for v in hi.iter().chain(lo) {
        frame.extend_from_slice(&v.to_le_bytes());
    }
    stream.write_all(&frame).map_err(tcp_error)
}

fn read_sums(mut stream: &TcpStream, n: usize) -> Result<Sums, CollectiveError> {
    let mut count = [0u8; 8];
    stream.read_exact(&mut count).map_err(tcp_error)?;
    if u64::from_le_bytes(count) != n as u64 {
        return Err(tcp_error(format!(
            "a peer sums {} parameters, not {n}",
            u64::from_le_bytes(count)
        )));
    }
    let mut bytes = vec![0u8; 16 * n];
    stream.read_exact(&mut bytes).map_err(tcp_error)?;
    let mut values = bytes.chunks_exact(8).map(|b| f64::from_le_bytes(b.try_into().expect("8")));
    let hi = values.by_ref().take(n).collect();
    Ok((hi, values.collect()))
}

/// The leader's end: one stream per member, in rank order.
struct Leader {
    members: Vec<TcpStream>,
}

impl Communicator for Leader {
    fn all_reduce_sums(
        &mut self,
        hi: &[f64],
        lo: &[f64],
        want_result: bool,
        deadline: Instant,
    ) -> Result<Option<Sums>, CollectiveError> {
        let (mut sum_hi, mut sum_lo) = (hi.to_vec(), lo.to_vec());
        for member in &self.members {
            until(member, deadline)?;
            let (h, l) = read_sums(member, hi.len())?;
            for (s, v) in sum_hi.iter_mut().zip(h) {
                *s += v;
            }
            for (s, v) in sum_lo.iter_mut().zip(l) {
                *s += v;
            }
        }
        for member in &self.members {
            until(member, deadline)?;
            write_sums(member, &sum_hi, &sum_lo)?;
        }
        Ok(want_result.then_some((sum_hi, sum_lo)))
    }

    fn abort(self: Box<Self>) {
        for member in &self.members {
            let _ = member.shutdown(std::net::Shutdown::Both);
        }
    }
}

/// A member's end: its stream to the leader.
struct Member {
    leader: TcpStream,
}

impl Communicator for Member {
    fn all_reduce_sums(
        &mut self,
        hi: &[f64],
        lo: &[f64],
        want_result: bool,
        deadline: Instant,
    ) -> Result<Option<Sums>, CollectiveError> {
        until(&self.leader, deadline)?;
        write_sums(&self.leader, hi, lo)?;
        let sums = read_sums(&self.leader, hi.len())?;
        Ok(want_result.then_some(sums))
    }

    fn abort(self: Box<Self>) {
        let _ = self.leader.shutdown(std::net::Shutdown::Both);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    fn loopback() -> Arc<Tcp> {
        Arc::new(Tcp::new(IpAddr::from([127, 0, 0, 1]), "127.0.0.1"))
    }

    /// Every rank's communicator of one id, joined on threads of their own.
    fn joined(world_size: usize) -> Vec<Box<dyn Communicator>> {
        let tcp = loopback();
        let id = tcp.unique_id().unwrap();
        assert_eq!(id.len(), ID_LEN);
        let joins: Vec<_> = (0..world_size)
            .map(|rank| {
                let (tcp, id) = (tcp.clone(), id.clone());
                std::thread::spawn(move || tcp.join(rank, world_size, &id).unwrap())
            })
            .collect();
        joins.into_iter().map(|j| j.join().unwrap()).collect()
    }

    #[test]
    fn two_to_four_ranks_all_reduce_to_the_exact_sums() {
        for world_size in 2..=4 {
            let deadline = Instant::now() + Duration::from_secs(10);
            let results: Vec<_> = joined(world_size)
                .into_iter()
                .enumerate()
                .map(|(rank, mut comm)| {
                    std::thread::spawn(move || {
                        let hi = vec![rank as f64 + 0.5, -(rank as f64), 1e300];
                        let lo = vec![1e-20 * rank as f64, 0.0, 0.0];
                        comm.all_reduce_sums(&hi, &lo, true, deadline).unwrap().unwrap()
                    })
                })
                .collect::<Vec<_>>()
                .into_iter()
                .map(|t| t.join().unwrap())
                .collect();
            let ranks: Vec<f64> = (0..world_size).map(|r| r as f64).collect();
            let expected_hi = vec![
                ranks.iter().map(|r| r + 0.5).sum::<f64>(),
                -ranks.iter().sum::<f64>(),
                1e300 * world_size as f64,
            ];
            let expected_lo = vec![ranks.iter().map(|r| 1e-20 * r).sum::<f64>(), 0.0, 0.0];
            for (hi, lo) in &results {
                assert_eq!((hi, lo), (&expected_hi, &expected_lo), "{world_size} ranks");
            }
        }
    }

    #[test]
    fn a_member_that_leaves_mid_collective_fails_the_others_before_their_deadline() {
        let mut comms = joined(3);
        let gone = comms.pop().unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        let started = Instant::now();
        let others: Vec<_> = comms
            .into_iter()
            .map(|mut comm| {
                std::thread::spawn(move || comm.all_reduce_sums(&[1.0], &[0.0], true, deadline))
            })
            .collect();
        gone.abort();
        for other in others {
            let result = other.join().unwrap();
            assert!(matches!(result, Err(CollectiveError::Tcp(_))), "{result:?}");
        }
        assert!(started.elapsed() < Duration::from_secs(10), "failed at once, not at the deadline");
    }

    #[test]
    fn a_wrong_token_or_rank_never_joins() {
        let tcp = loopback();
        let id = tcp.unique_id().unwrap();
        let (address, _) = parse_id(&id).unwrap();
        let mut forged = id.clone();
        forged[MAGIC.len()] ^= 1;
        let leader = std::thread::spawn({
            let (tcp, id) = (tcp.clone(), id.clone());
            move || tcp.join(0, 2, &id).map(|_| ())
        });
        // A stranger with the wrong token is dropped; the real member still joins.
        let deadline = Instant::now() + Duration::from_secs(10);
        let (_, forged_token) = parse_id(&forged).unwrap();
        let stranger = join_leader(&address, &forged_token, (1, 2), deadline);
        assert!(stranger.is_err());
        tcp.join(1, 2, &id).unwrap();
        leader.join().unwrap().unwrap();
        assert!(matches!(parse_id(&[0; ID_LEN]), Err(CollectiveError::Tcp(_))));
        assert!(tcp.join(0, 2, &id).is_err(), "an id is joined once");
    }
}
