//! The server's side of a round: it relays sealed shares, adds masked inputs into one running
//! sum in the ring (memory of one vector, whatever the cohort), leaves out clients a neighbour
//! could not open shares from, gathers the survivors' signatures over the survivor set, and
//! rebuilds only what the sum needs.

use std::collections::{BTreeMap, BTreeSet};

use x25519_dalek::{PublicKey, StaticSecret};

use super::channel::{self, Accusation, open};
use super::identity::{Signature, advert_is_signed, survivors_message, verify};
use super::prg::{Keystream, pairwise_seed, seed_commitment};
use super::shamir::{P, Share, reconstruct_checked};
use super::*;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ServerStage {
    Advertise,
    Share,
    Collect,
    Consistency,
    Unmask,
    Done,
}

/// The server's side of a round: it relays sealed shares, sums masked inputs as they come,
/// and rebuilds only what the unmasked sum needs. It never holds an unmasked input.
pub struct Server {
    config: Config,
    stage: ServerStage,
    keys: BTreeMap<ClientIdx, AdvertiseKeys>,
    graph: BTreeMap<ClientIdx, BTreeSet<ClientIdx>>,
    /// The sealed shares relayed, by recipient: kept to check accusations against.
    sealed: BTreeMap<ClientIdx, Vec<SealedShares>>,
    shared: BTreeSet<ClientIdx>,
    /// Who sent a masked input.
    masked: BTreeSet<ClientIdx>,
    /// The running sum of every masked input received, in the ring (empty until the first).
    sum: Vec<u32>,
    /// Clients whose masked input is in `sum` but must come out (a neighbour could not open
    /// their shares): the caller of [`Unmasking::sum`] hands their vectors back.
    withdrawn: BTreeSet<ClientIdx>,
    /// For each masked input, the neighbours its sender could not open shares from (and so
    /// added no pairwise mask with), each accusation checked.
    rejections: BTreeMap<ClientIdx, BTreeSet<ClientIdx>>,
    survivors: BTreeSet<ClientIdx>,
    /// Survivors' signatures over `survivors`, each checked.
    signatures: BTreeMap<ClientIdx, Signature>,
    responses: BTreeMap<ClientIdx, UnmaskResponse>,
    excluded: BTreeSet<ClientIdx>,
}

impl Server {
    /// A round. Its neighbour graph is the public one of [`neighbours`]: nothing the server
    /// draws.
    pub fn new(config: Config) -> Result<Self, SecAggError> {
        config.validate()?;
        Ok(Server {
            config,
            stage: ServerStage::Advertise,
            keys: BTreeMap::new(),
            graph: BTreeMap::new(),
            sealed: BTreeMap::new(),
            shared: BTreeSet::new(),
            masked: BTreeSet::new(),
            sum: Vec::new(),
            withdrawn: BTreeSet::new(),
            rejections: BTreeMap::new(),
            survivors: BTreeSet::new(),
            signatures: BTreeMap::new(),
            responses: BTreeMap::new(),
            excluded: BTreeSet::new(),
        })
    }

    /// Clients excluded for bad messages so far.
    pub fn excluded(&self) -> &BTreeSet<ClientIdx> {
        &self.excluded
    }

    fn bad(&mut self, client: ClientIdx, why: impl Into<String>) -> SecAggError {
        self.excluded.insert(client);
        SecAggError::BadMessage { client, why: why.into() }
    }

    fn expect(&self, stage: ServerStage, what: &'static str) -> Result<(), SecAggError> {
        if self.stage == stage { Ok(()) } else { Err(SecAggError::WrongStage(what)) }
    }

    /// AdvertiseKeys from `client`, signed by its identity for its seat in this round. (Whether
    /// the identity is the device's, as enrolled, is the caller's check.)
    pub fn receive_keys(
        &mut self,
        client: ClientIdx,
        advert: AdvertiseKeys,
    ) -> Result<(), SecAggError> {
        self.expect(ServerStage::Advertise, "AdvertiseKeys")?;
        if client == 0 || client > self.config.n || self.keys.contains_key(&client) {
            return Err(self.bad(client, "unknown index or keys sent twice"));
        }
        if !advert_is_signed(&self.config.session, client, &advert) {
            return Err(self.bad(client, "its keys are not signed by its identity for this seat"));
        }
        if !channel::is_point(&advert.cipher_pk) {
            return Err(self.bad(client, "its channel key is not a point"));
        }
        if advert.cipher_pk == advert.mask_pk
            || self.keys.values().any(|k| {
                k.mask_pk == advert.mask_pk
                    || k.cipher_pk == advert.cipher_pk
                    || k.identity == advert.identity
            })
        {
            return Err(self.bad(client, "reused public key"));
        }
        self.keys.insert(client, advert);
        Ok(())
    }

    fn at_least(&self, stage: &'static str, have: usize) -> Result<(), SecAggError> {
        let need = self.config.t as usize + 1;
        if have < need { Err(SecAggError::BelowThreshold { stage, have, need }) } else { Ok(()) }
    }

    /// Ends AdvertiseKeys (its deadline passed or everyone answered): each advertiser's
    /// neighbours among the advertisers, with their keys and the roster they are drawn from
    /// (one roster, shared by every message).
    pub fn close_advertise(&mut self) -> Result<BTreeMap<ClientIdx, NeighbourKeys>, SecAggError> {
        self.expect(ServerStage::Advertise, "the end of AdvertiseKeys")?;
        self.at_least("AdvertiseKeys", self.keys.len())?;
        let roster =
            std::sync::Arc::new(Roster::new(self.keys.iter().map(|(&i, keys)| (i, keys.identity))));
        self.graph = neighbours(&roster, self.config.k, &self.config.session);
        self.stage = ServerStage::Share;
        Ok(self
            .graph
            .iter()
            .map(|(&i, ns)| {
                let keys = ns.iter().map(|j| (*j, self.keys[j])).collect();
                (i, NeighbourKeys { keys, roster: roster.clone() })
            })
            .collect())
    }

    /// ShareKeys from `client`: exactly one sealed message per neighbour.
    pub fn receive_shares(
        &mut self,
        client: ClientIdx,
        shares: Vec<SealedShares>,
    ) -> Result<(), SecAggError> {
        self.expect(ServerStage::Share, "ShareKeys")?;
        let Some(ns) = self.graph.get(&client) else {
            return Err(self.bad(client, "not in the round"));
        };
        let targets: BTreeSet<ClientIdx> = shares.iter().map(|s| s.to).collect();
        if self.shared.contains(&client)
            || targets != *ns
            || shares.len() != ns.len()
            || shares.iter().any(|s| s.from != client || s.ciphertext.len() > 1024)
        {
            return Err(self.bad(client, "share messages do not match the neighbourhood"));
        }
        let identity = self.keys[&client].identity;
        if shares.iter().any(|s| !s.is_signed_by(&identity, &self.config.session)) {
            return Err(self.bad(client, "share messages not signed by its identity"));
        }
        for s in shares {
            self.sealed.entry(s.to).or_default().push(s);
        }
        self.shared.insert(client);
        Ok(())
    }

    /// Ends ShareKeys: what each sharer receives (shares from its neighbours that shared).
    pub fn close_share_keys(&mut self) -> Result<BTreeMap<ClientIdx, MaskRequest>, SecAggError> {
        self.expect(ServerStage::Share, "the end of ShareKeys")?;
        self.at_least("ShareKeys", self.shared.len())?;
        self.stage = ServerStage::Collect;
        let shared = self.shared.clone();
        Ok(shared
            .iter()
            .map(|&i| {
                let shares = self
                    .sealed
                    .get(&i)
                    .into_iter()
                    .flatten()
                    .filter(|s| shared.contains(&s.from))
                    .cloned()
                    .collect();
                (i, MaskRequest { shares })
            })
            .collect())
    }

    /// A masked input from `client`, with its accusations: the neighbours whose shares it
    /// could not open ([`Client::accusations`]), each with its evidence. The server checks each
    /// one: the accused must be a neighbour that shared, the proof must show the revealed point
    /// is the Diffie–Hellman of the two advertised channel keys, and the sealed shares relayed
    /// from the accused must indeed not open under it. A masked input with an accusation that
    /// fails any check is refused, and its sender excluded, so no device can take a neighbour
    /// out of the sum without proof.
    pub fn receive_masked(
        &mut self,
        client: ClientIdx,
        y: Vec<u32>,
        accusations: &[Accusation],
    ) -> Result<(), SecAggError> {
        self.expect(ServerStage::Collect, "MaskedInputCollection")?;
        if !self.shared.contains(&client)
            || self.masked.contains(&client)
            || y.len() != self.config.len
        {
            return Err(self.bad(client, "unexpected masked input or wrong length"));
        }
        let mut accused = BTreeSet::new();
        for a in accusations {
            if let Err(why) = self.check_accusation(client, a, &accused) {
                return Err(self.bad(client, why));
            }
            accused.insert(a.accused);
        }
        if self.sum.is_empty() {
            self.sum = y;
        } else {
            for (s, v) in self.sum.iter_mut().zip(&y) {
                *s = s.wrapping_add(*v);
            }
        }
        self.masked.insert(client);
        self.rejections.insert(client, accused);
        Ok(())
    }

    /// Why `client`'s accusation `a` does not hold, if it does not (`earlier`: the neighbours
    /// it accused before in the same message).
    fn check_accusation(
        &self,
        client: ClientIdx,
        a: &Accusation,
        earlier: &BTreeSet<ClientIdx>,
    ) -> Result<(), String> {
        let j = a.accused;
        if !(self.graph[&client].contains(&j) && self.shared.contains(&j)) || earlier.contains(&j) {
            return Err(format!("accuses {j}, which sent it no shares"));
        }
        let (mine, theirs) = (&self.keys[&client].cipher_pk, &self.keys[&j].cipher_pk);
        if !channel::verify(mine, theirs, &a.shared, &a.proof) {
            return Err(format!("accuses {j} with a channel point it does not prove"));
        }
        let sealed = self.sealed[&client].iter().find(|s| s.from == j);
        if sealed.is_some_and(|s| open(&a.shared, s, &self.config.session).is_some()) {
            return Err(format!("accuses {j} falsely: its shares open"));
        }
        Ok(())
    }

    /// Clients whose sealed shares a neighbour could not open: they are left out of the sum
    /// (their masked input is dropped, their pairwise masks removed like a dropout's), so a
    /// client that seals garbage to a neighbour cannot corrupt the aggregate.
    pub fn accused(&self) -> BTreeSet<ClientIdx> {
        self.rejections.values().flatten().copied().collect()
    }

    /// Ends MaskedInputCollection: the survivors every one of them is told, to sign (everyone
    /// who sent a masked input, but clients a neighbour could not open shares from).
    pub fn close_masked(&mut self) -> Result<ConsistencyRequest, SecAggError> {
        self.expect(ServerStage::Collect, "the end of MaskedInputCollection")?;
        let accused = self.accused();
        for &j in &accused {
            if self.masked.remove(&j) {
                self.withdrawn.insert(j);
            }
            self.rejections.remove(&j);
            self.excluded.insert(j);
        }
        self.at_least("MaskedInputCollection", self.masked.len())?;
        self.survivors = self.masked.clone();
        self.stage = ServerStage::Consistency;
        Ok(ConsistencyRequest { survivors: self.survivors.clone() })
    }

    /// A survivor's signature over the survivor set, checked against its identity.
    pub fn receive_signature(
        &mut self,
        client: ClientIdx,
        signature: Signature,
    ) -> Result<(), SecAggError> {
        self.expect(ServerStage::Consistency, "ConsistencyCheck")?;
        if !self.survivors.contains(&client) || self.signatures.contains_key(&client) {
            return Err(self.bad(client, "not a survivor, or signed twice"));
        }
        let message = survivors_message(&self.config.session, &self.survivors);
        if !verify(&self.keys[&client].identity, &message, &signature) {
            return Err(self.bad(client, "its signature over the survivor set does not verify"));
        }
        self.signatures.insert(client, signature);
        Ok(())
    }

    /// Ends the consistency check: the survivor set with every signature over it, for each
    /// signer to check before it unmasks.
    pub fn close_consistency(&mut self) -> Result<UnmaskRequest, SecAggError> {
        self.expect(ServerStage::Consistency, "the end of ConsistencyCheck")?;
        self.at_least("ConsistencyCheck", self.signatures.len())?;
        self.stage = ServerStage::Unmask;
        Ok(UnmaskRequest { survivors: self.survivors.clone(), signatures: self.signatures.clone() })
    }

    /// An unmasking response from a survivor that signed the survivor set: seed shares only for
    /// surviving neighbours, key shares only for neighbours that shared and then dropped.
    pub fn receive_unmask(
        &mut self,
        client: ClientIdx,
        response: UnmaskResponse,
    ) -> Result<(), SecAggError> {
        self.expect(ServerStage::Unmask, "Unmasking")?;
        if !self.signatures.contains_key(&client) || self.responses.contains_key(&client) {
            return Err(self.bad(client, "not a signer of the survivor set, or answered twice"));
        }
        let ns = &self.graph[&client];
        let seeds_ok =
            response.seed_shares.keys().all(|j| ns.contains(j) && self.survivors.contains(j));
        let keys_ok = response
            .key_shares
            .keys()
            .all(|j| ns.contains(j) && self.shared.contains(j) && !self.survivors.contains(j));
        let values_ok = response
            .seed_shares
            .values()
            .chain(response.key_shares.values())
            .flatten()
            .all(|&v| v < P);
        if !(seeds_ok && keys_ok && values_ok) {
            return Err(self.bad(client, "unmasking shares for the wrong clients"));
        }
        self.responses.insert(client, response);
        Ok(())
    }

    /// Ends Unmasking: every secret the sum needs, rebuilt from every share the survivors
    /// returned and checked, with the survivors' masked inputs. A self-mask seed must match its
    /// owner's commitment and a dropped client's key its public key; with spare shares, a
    /// holder that returned a wrong one is found and left out ([`Unmasking::inconsistent`]).
    /// Fails cleanly when some secret has fewer than `t` shares or none of its candidates
    /// checks out: a wrong share never turns the sum into noise that commits. The model-sized work, adding the vectors and removing the
    /// masks, is [`Unmasking::sum`]'s, which cannot fail: a caller runs it where it costs
    /// nobody (the coordinator: off its driver task).
    pub fn finish(&mut self) -> Result<Unmasking, SecAggError> {
        self.expect(ServerStage::Unmask, "the end of Unmasking")?;
        self.at_least("Unmasking", self.responses.len())?;
        self.stage = ServerStage::Done;
        let t = self.config.t as usize;
        let gather =
            |select: &dyn Fn(&UnmaskResponse) -> Option<Share>| -> Vec<(ClientIdx, Share)> {
                self.responses.iter().filter_map(|(&i, r)| select(r).map(|s| (i, s))).collect()
            };
        let mut inconsistent = BTreeSet::new();
        let mut masks = Vec::new();
        for &j in &self.survivors {
            let shares = gather(&|r| r.seed_shares.get(&j).copied());
            if shares.len() < t {
                return Err(SecAggError::BelowThreshold {
                    stage: "Unmasking (self masks)",
                    have: shares.len(),
                    need: t,
                });
            }
            let commitment = self.keys[&j].seed_commitment;
            let session = self.config.session;
            let accept = |seed: &[u8; 32]| seed_commitment(seed, j, &session) == commitment;
            let rebuilt =
                reconstruct_checked(&shares, t, accept).ok_or_else(|| SecAggError::BadMessage {
                    client: j,
                    why: "its seed shares rebuild no seed that matches its commitment".into(),
                })?;
            inconsistent.extend(rebuilt.inconsistent);
            masks.push(MaskRemoval { seed: rebuilt.secret, stream: 3, add: false });
        }
        for &j in self.shared.difference(&self.survivors) {
            let shares = gather(&|r| r.key_shares.get(&j).copied());
            if shares.len() < t {
                return Err(SecAggError::BelowThreshold {
                    stage: "Unmasking (dropped keys)",
                    have: shares.len(),
                    need: t,
                });
            }
            let mask_pk = self.keys[&j].mask_pk;
            let accept =
                |k: &[u8; 32]| PublicKey::from(&StaticSecret::from(*k)).to_bytes() == mask_pk;
            let Some(rebuilt) = reconstruct_checked(&shares, t, accept) else {
                return Err(SecAggError::BadMessage {
                    client: j,
                    why: "rebuilt mask key does not match its public key".into(),
                });
            };
            inconsistent.extend(rebuilt.inconsistent);
            let key = StaticSecret::from(rebuilt.secret);
            for &i in self.graph[&j].intersection(&self.survivors) {
                if self.rejections.get(&i).is_some_and(|r| r.contains(&j)) {
                    // i could not open j's shares, so it never added their pairwise mask.
                    continue;
                }
                let seed = pairwise_seed(
                    &key,
                    j,
                    &PublicKey::from(self.keys[&i].mask_pk),
                    i,
                    &self.config.session,
                );
                // Survivor i added the pairwise mask if i < j and subtracted it otherwise.
                masks.push(MaskRemoval { seed, stream: 4, add: i > j });
            }
        }
        let mut sum = std::mem::take(&mut self.sum);
        sum.resize(self.config.len, 0);
        Ok(Unmasking {
            sum,
            withdrawn: self.withdrawn.clone(),
            masks,
            survivors: self.survivors.clone(),
            inconsistent,
        })
    }
}

/// One keystream the sum of masked inputs still carries, and which way to take it out.
#[derive(Clone, PartialEq, Eq)]
struct MaskRemoval {
    seed: [u8; 32],
    stream: u8,
    add: bool,
}

/// A finished round's running sum of masked inputs and the keystreams that remove their
/// masks: everything the sum needs, checked by [`Server::finish`].
#[derive(Clone, PartialEq, Eq)]
pub struct Unmasking {
    /// Every masked input received, summed.
    sum: Vec<u32>,
    /// Clients whose input is in `sum` but must come out.
    withdrawn: BTreeSet<ClientIdx>,
    masks: Vec<MaskRemoval>,
    survivors: BTreeSet<ClientIdx>,
    /// Survivors that returned a share off its polynomial (left out of the rebuild).
    inconsistent: BTreeSet<ClientIdx>,
}

impl Unmasking {
    /// Survivors that returned a wrong share in Unmasking: found among spare shares and left
    /// out, so the sum is right; the caller names them.
    pub fn inconsistent(&self) -> &BTreeSet<ClientIdx> {
        &self.inconsistent
    }

    /// The clients whose inputs are in the sum.
    pub fn survivors(&self) -> &BTreeSet<ClientIdx> {
        &self.survivors
    }

    /// Clients whose masked input the running sum holds but the result must not: those a
    /// neighbour could not open shares from (a malicious or broken sender). [`Unmasking::sum`]
    /// needs each one's masked vector back; honest rounds have none.
    pub fn withdrawn(&self) -> &BTreeSet<ClientIdx> {
        &self.withdrawn
    }

    /// The sum of the survivors' inputs in the ring: the withdrawn clients' masked vectors
    /// (`withdrawn_input`, which answers for each of [`Unmasking::withdrawn`]) taken out of the
    /// running sum, then one keystream expanded per mask: O(masks × len) work and one vector
    /// of memory. Fails if a withdrawn vector is missing or of the wrong length.
    pub fn sum(
        &self,
        mut withdrawn_input: impl FnMut(ClientIdx) -> Option<Vec<u32>>,
    ) -> Result<Vec<u32>, SecAggError> {
        let mut sum = self.sum.clone();
        for &j in &self.withdrawn {
            let y = withdrawn_input(j).filter(|y| y.len() == sum.len()).ok_or_else(|| {
                SecAggError::BadMessage {
                    client: j,
                    why: "its masked input, to take out of the sum, is missing".into(),
                }
            })?;
            for (s, v) in sum.iter_mut().zip(&y) {
                *s = s.wrapping_sub(*v);
            }
        }
        for m in &self.masks {
            Keystream::new(&m.seed, m.stream).mask(&mut sum, m.add);
        }
        Ok(sum)
    }
}

impl std::fmt::Debug for Unmasking {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Seeds are secrets and the vectors model-sized: counts only.
        f.debug_struct("Unmasking")
            .field("len", &self.sum.len())
            .field("withdrawn", &self.withdrawn)
            .field("survivors", &self.survivors)
            .field("masks", &self.masks.len())
            .field("inconsistent", &self.inconsistent)
            .finish_non_exhaustive()
    }
}
