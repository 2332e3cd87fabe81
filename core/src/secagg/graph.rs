//! The neighbour graph: a Harary graph of degree `k` on a ring ordered by a public hash of each
//! member's identity key and the round's session (SecAgg+), the complete graph when
//! `k ≥ n − 1`. Every device recomputes its own neighbourhood from the roster, so the
//! coordinator can neither hand a device neighbours of its choosing nor reorder the ring.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::ClientIdx;

/// Every member that advertised keys in a round: its seat and its identity key. The same for
/// every device of the round; what each recomputes the graph from.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Roster(BTreeMap<ClientIdx, serde_bytes::ByteArray<32>>);

impl Roster {
    /// The roster of these seats and identities.
    pub fn new(members: impl IntoIterator<Item = (ClientIdx, [u8; 32])>) -> Self {
        Roster(members.into_iter().map(|(i, id)| (i, serde_bytes::ByteArray::new(id))).collect())
    }

    /// The identity key at seat `i`.
    pub fn identity(&self, i: ClientIdx) -> Option<&[u8; 32]> {
        self.0.get(&i).map(|id| &**id)
    }

    /// Members.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether no one advertised.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Seats and identity keys, by seat.
    pub fn iter(&self) -> impl Iterator<Item = (ClientIdx, &[u8; 32])> {
        self.0.iter().map(|(&i, id)| (i, &**id))
    }

    /// Whether two seats hold one identity (a roster no honest coordinator sends).
    pub fn repeats_an_identity(&self) -> bool {
        let distinct: BTreeSet<&[u8; 32]> = self.0.values().map(|id| &**id).collect();
        distinct.len() != self.0.len()
    }
}

/// A member's place on the ring: a hash of the round's session and its identity key, which
/// neither the coordinator (it does not choose identity keys, and the session is a hash of the
/// run, round and model version every device knows) nor a device can pick for a round.
fn ring_position(session: &[u8; 16], identity: &[u8; 32]) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update(b"starling secagg ring v1");
    h.update(session);
    h.update(identity);
    h.finalize().into()
}

/// The members in ring order: by [`ring_position`].
fn ring(roster: &Roster, session: &[u8; 16]) -> Vec<ClientIdx> {
    let mut ring: Vec<([u8; 32], ClientIdx)> =
        roster.iter().map(|(i, id)| (ring_position(session, id), i)).collect();
    ring.sort_unstable();
    ring.into_iter().map(|(_, i)| i).collect()
}

/// The neighbours of the member at `pos` of `ring` in a Harary graph of degree `k`: its `k/2`
/// successors and predecessors; everyone else when `k ≥ |ring| − 1`.
fn around(ring: &[ClientIdx], pos: usize, k: u32) -> BTreeSet<ClientIdx> {
    let n = ring.len();
    if k as usize + 1 >= n {
        return ring.iter().copied().filter(|&o| o != ring[pos]).collect();
    }
    (1..=(k as usize).div_ceil(2))
        .flat_map(|d| [ring[(pos + d) % n], ring[(pos + n - d) % n]])
        .collect()
}

/// Each member's neighbours: a Harary graph of degree `k` on the ring ordered by
/// [`ring_position`] (each member joined to its `k/2` successors and predecessors); everyone
/// else when `k ≥ |members| − 1`.
pub fn neighbours(
    roster: &Roster,
    k: u32,
    session: &[u8; 16],
) -> BTreeMap<ClientIdx, BTreeSet<ClientIdx>> {
    let ring = ring(roster, session);
    ring.iter().enumerate().map(|(pos, &me)| (me, around(&ring, pos, k))).collect()
}

/// The neighbours of `me` alone in [`neighbours`]' graph (what a device checks its own
/// neighbourhood against, without building everyone's); `None` when `me` is not on the roster.
pub fn neighbours_of(
    roster: &Roster,
    k: u32,
    session: &[u8; 16],
    me: ClientIdx,
) -> Option<BTreeSet<ClientIdx>> {
    let ring = ring(roster, session);
    let pos = ring.iter().position(|&i| i == me)?;
    Some(around(&ring, pos, k))
}
