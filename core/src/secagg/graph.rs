//! The neighbour graph: a Harary graph of degree `k` on a random ring (SecAgg+), the complete
//! graph when `k ≥ n − 1` (SecAgg).

use std::collections::{BTreeMap, BTreeSet};

use super::ClientIdx;
use super::prg::Keystream;

/// Client `i`'s neighbours among `members`: a Harary graph of degree `k` on the ring order
/// given by a permutation drawn from `seed` (each node joined to its `k/2` successors and
/// predecessors); everyone else when `k ≥ |members| − 1`.
pub fn neighbours(
    members: &BTreeSet<ClientIdx>,
    k: u32,
    seed: &[u8; 32],
) -> BTreeMap<ClientIdx, BTreeSet<ClientIdx>> {
    let mut ring: Vec<ClientIdx> = members.iter().copied().collect();
    let n = ring.len();
    let mut rng = Keystream::new(seed, 7);
    for i in (1..n).rev() {
        let j = (rng.next_u64() % (i as u64 + 1)) as usize;
        ring.swap(i, j);
    }
    let half = (k as usize).div_ceil(2);
    let mut out: BTreeMap<ClientIdx, BTreeSet<ClientIdx>> = BTreeMap::new();
    for (pos, &me) in ring.iter().enumerate() {
        let set = out.entry(me).or_default();
        if k as usize + 1 >= n {
            set.extend(ring.iter().copied().filter(|&o| o != me));
            continue;
        }
        for d in 1..=half {
            set.insert(ring[(pos + d) % n]);
            set.insert(ring[(pos + n - d) % n]);
        }
    }
    out
}
