//! One device's side of a round: its secrets, its shares for its neighbours, its masked input,
//! its signature over the survivor set, and the unmasking shares it reveals (never both of one
//! neighbour's secrets, and only for the set it signed).

use std::collections::{BTreeMap, BTreeSet};

use chacha20::cipher::StreamCipher;
use x25519_dalek::{PublicKey, StaticSecret};

use super::channel::{Accusation, ChannelSecret, open, seal};
use super::graph::neighbours_of;
use super::identity::{
    DeviceIdentity, advert_is_signed, advert_message, certificate_is_valid, survivors_message,
    verify,
};
use super::messages::Shares;
use super::prg::{Keystream, pairwise_seed, seed_commitment};
use super::shamir::share;
use super::*;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ClientStage {
    Advertised,
    Shared,
    Masked,
    Signed,
    Done,
}

/// One client's side of a round.
pub struct Client {
    me: ClientIdx,
    config: Config,
    identity: DeviceIdentity,
    channel: ChannelSecret,
    mask_sk: StaticSecret,
    self_seed: [u8; 32],
    coefficients: [u8; 32],
    stage: ClientStage,
    keys: BTreeMap<ClientIdx, AdvertiseKeys>,
    /// The shared point of this client's channel with each neighbour, from ShareKeys.
    channels: BTreeMap<ClientIdx, [u8; 32]>,
    /// Shares received from each neighbour that completed ShareKeys.
    held: BTreeMap<ClientIdx, Shares>,
    /// Neighbours whose sealed shares arrived but did not open: this client added no pairwise
    /// mask with them, and must say so with its masked input, with the evidence (see
    /// [`Client::accusations`]).
    accusations: BTreeMap<ClientIdx, Accusation>,
    /// The survivor set this client signed in the consistency check: the only one it unmasks
    /// for.
    signed: Option<BTreeSet<ClientIdx>>,
    /// The fewest survivors whose sum this client helps unmask, beyond the threshold `t` (see
    /// [`Client::require_survivors`]).
    min_survivors: u32,
    /// The enrolment authority this device pins, whose certificate every neighbour's identity
    /// must carry (see [`Client::require_certificates`]).
    authority: Option<[u8; 32]>,
}

impl Client {
    /// Client `me`, the device `identity`, with 96 bytes of OS randomness; its
    /// [`AdvertiseKeys`], signed.
    pub fn new(
        me: ClientIdx,
        config: Config,
        identity: DeviceIdentity,
        randomness: [u8; 96],
    ) -> Result<(Self, AdvertiseKeys), SecAggError> {
        config.validate()?;
        if me == 0 || me > config.n {
            return Err(SecAggError::Config(format!("client index {me} outside 1..={}", config.n)));
        }
        let part = |i: usize| -> [u8; 32] {
            randomness[32 * i..32 * i + 32].try_into().expect("32 bytes")
        };
        // The channel secret is a scalar: 64 bytes reduced, from the first part expanded.
        let mut wide = [0u8; 64];
        Keystream::new(&part(0), 5).0.apply_keystream(&mut wide);
        let channel = ChannelSecret::from_wide(&wide);
        let mask_sk = StaticSecret::from(part(1));
        // The self-mask seed and the sharing polynomials come from the third part, expanded.
        let mut expand = Keystream::new(&part(2), 1);
        let mut self_seed = [0u8; 32];
        expand.0.apply_keystream(&mut self_seed);
        let mut advert = AdvertiseKeys {
            identity: identity.public(),
            cipher_pk: channel.public(),
            mask_pk: PublicKey::from(&mask_sk).to_bytes(),
            seed_commitment: seed_commitment(&self_seed, me, &config.session),
            signature: Signature { r: [0; 32], s: [0; 32] },
            certificate: None,
        };
        advert.signature = identity.sign(&advert_message(&config.session, me, &advert));
        let mut coefficients = [0u8; 32];
        expand.0.apply_keystream(&mut coefficients);
        let client = Client {
            me,
            config,
            identity,
            channel,
            mask_sk,
            self_seed,
            coefficients,
            stage: ClientStage::Advertised,
            keys: BTreeMap::new(),
            channels: BTreeMap::new(),
            held: BTreeMap::new(),
            accusations: BTreeMap::new(),
            signed: None,
            min_survivors: 0,
            authority: None,
        };
        Ok((client, advert))
    }

    /// ShareKeys: shares of this client's mask key and self-mask seed for each neighbour,
    /// sealed to that neighbour. The neighbours must be exactly those the public graph gives
    /// this client on the roster, each neighbour's identity the one the roster lists, and each
    /// neighbour's keys signed by that identity for its seat in this round (keys the server
    /// substituted, or replayed from another round or seat, are refused before anything is
    /// shared). A client that pins an enrolment authority also requires each neighbour's
    /// identity to carry its certificate, so no neighbour is a member the coordinator made up.
    pub fn share_keys(
        &mut self,
        neighbours: NeighbourKeys,
    ) -> Result<Vec<SealedShares>, SecAggError> {
        if self.stage != ClientStage::Advertised {
            return Err(SecAggError::WrongStage("ShareKeys"));
        }
        self.check_neighbourhood(&neighbours)?;
        let session = &self.config.session;
        if let Some((&j, _)) =
            neighbours.keys.iter().find(|(j, keys)| !advert_is_signed(session, **j, keys))
        {
            return Err(SecAggError::BadMessage {
                client: 0,
                why: format!("neighbour {j}'s keys are not signed by its identity for this round"),
            });
        }
        if let Some(authority) = &self.authority
            && let Some((&j, _)) = neighbours.keys.iter().find(|(_, keys)| {
                !keys
                    .certificate
                    .is_some_and(|c| certificate_is_valid(authority, &keys.identity, &c))
            })
        {
            return Err(SecAggError::BadMessage {
                client: 0,
                why: format!(
                    "neighbour {j}'s identity carries no certificate from the pinned enrolment authority"
                ),
            });
        }
        if neighbours.keys.len() < self.config.t as usize {
            return Err(SecAggError::BelowThreshold {
                stage: "ShareKeys",
                have: neighbours.keys.len(),
                need: self.config.t as usize,
            });
        }
        let holders: Vec<ClientIdx> = neighbours.keys.keys().copied().collect();
        let mut rng = Keystream::new(&self.coefficients, 2);
        let key_shares = share(&self.mask_sk.to_bytes(), self.config.t, &holders, &mut rng);
        let seed_shares = share(&self.self_seed, self.config.t, &holders, &mut rng);
        let mut out = Vec::with_capacity(holders.len());
        for (&to, advert) in &neighbours.keys {
            let shared = self.channel.agree(&advert.cipher_pk).ok_or_else(|| {
                SecAggError::BadMessage { client: to, why: "its channel key is not a point".into() }
            })?;
            let shares = Shares { from: self.me, to, key: key_shares[&to], seed: seed_shares[&to] };
            out.push(seal(&shared, &shares, &self.config.session, &self.identity));
            self.channels.insert(to, shared);
        }
        self.keys = neighbours.keys;
        self.stage = ClientStage::Shared;
        Ok(out)
    }

    /// MaskedInputCollection: `input` (quantized) plus the self mask plus pairwise masks with
    /// every neighbour whose shares arrived. A neighbour whose shares fail to open gets no
    /// pairwise mask and is accused in [`Client::accusations`], which the masked input must
    /// carry: the server checks the evidence and then leaves that neighbour out of the sum
    /// instead of letting its uncancelled mask corrupt it. Too few valid shares left fails.
    pub fn masked_input(
        &mut self,
        request: MaskRequest,
        input: &[u32],
    ) -> Result<Vec<u32>, SecAggError> {
        if self.stage != ClientStage::Shared {
            return Err(SecAggError::WrongStage("MaskedInputCollection"));
        }
        if input.len() != self.config.len {
            return Err(SecAggError::Config(format!(
                "input has {} values, the round {}",
                input.len(),
                self.config.len
            )));
        }
        for sealed in request.shares {
            let Some(advert) = self.keys.get(&sealed.from) else { continue };
            if sealed.to != self.me
                || self.held.contains_key(&sealed.from)
                || self.accusations.contains_key(&sealed.from)
            {
                continue;
            }
            // Only an honest coordinator's relay reaches here unchanged: one that altered a
            // neighbour's shares gets nothing from this device, no accusation (whose evidence
            // would open the original it kept) and no masked input.
            if !sealed.is_signed_by(&advert.identity, &self.config.session) {
                return Err(SecAggError::RelayAltered { from: sealed.from });
            }
            let shared = self.channels[&sealed.from];
            match open(&shared, &sealed, &self.config.session) {
                Some(shares) => {
                    self.held.insert(sealed.from, shares);
                }
                None => {
                    let proof = self
                        .channel
                        .prove(&advert.cipher_pk, &shared)
                        .expect("a key this client agreed with is a point");
                    let accusation = Accusation { accused: sealed.from, shared, proof };
                    self.accusations.insert(sealed.from, accusation);
                }
            }
        }
        if self.held.len() < self.config.t as usize {
            return Err(SecAggError::BelowThreshold {
                stage: "MaskedInputCollection",
                have: self.held.len(),
                need: self.config.t as usize,
            });
        }
        let mut y = input.to_vec();
        Keystream::new(&self.self_seed, 3).mask(&mut y, true);
        for &j in self.held.keys() {
            let pk = PublicKey::from(self.keys[&j].mask_pk);
            let seed = pairwise_seed(&self.mask_sk, self.me, &pk, j, &self.config.session);
            Keystream::new(&seed, 4).mask(&mut y, self.me < j);
        }
        self.stage = ClientStage::Masked;
        Ok(y)
    }

    /// Neighbours whose sealed shares did not open, each with the evidence the server checks
    /// (known once the masked input is made).
    pub fn accusations(&self) -> Vec<Accusation> {
        self.accusations.values().copied().collect()
    }

    /// ConsistencyCheck: this client's signature over the survivor set it is shown. It signs
    /// once; the set must hold this client and at least `t` members.
    pub fn sign_survivors(
        &mut self,
        request: ConsistencyRequest,
    ) -> Result<Signature, SecAggError> {
        if self.stage != ClientStage::Masked {
            return Err(SecAggError::WrongStage("ConsistencyCheck"));
        }
        self.check_survivors(&request.survivors)?;
        let signature =
            self.identity.sign(&survivors_message(&self.config.session, &request.survivors));
        self.signed = Some(request.survivors);
        self.stage = ClientStage::Signed;
        Ok(signature)
    }

    fn check_survivors(&self, survivors: &BTreeSet<ClientIdx>) -> Result<(), SecAggError> {
        if !survivors.contains(&self.me) || survivors.iter().any(|&j| j == 0 || j > self.config.n) {
            return Err(SecAggError::BadMessage {
                client: 0,
                why: "the survivor set leaves out this client or names no member".into(),
            });
        }
        let need = self.config.t.max(self.min_survivors) as usize;
        if survivors.len() < need {
            return Err(SecAggError::BelowThreshold {
                stage: "ConsistencyCheck",
                have: survivors.len(),
                need,
            });
        }
        Ok(())
    }

    /// The neighbourhood the server relayed must be the one the public graph gives this client
    /// on the roster it relayed: a roster of seats in the round, with this client's identity at
    /// its seat and no identity twice, and neighbours whose identities are the roster's.
    fn check_neighbourhood(&self, neighbours: &NeighbourKeys) -> Result<(), SecAggError> {
        let refuse = |why: &str| Err(SecAggError::BadMessage { client: 0, why: why.into() });
        let roster = &neighbours.roster;
        if roster.len() > self.config.n as usize
            || roster.iter().any(|(j, _)| j == 0 || j > self.config.n)
            || roster.identity(self.me) != Some(&self.identity.public())
            || roster.repeats_an_identity()
        {
            return refuse("the roster is not one of this round's members with this client in it");
        }
        if neighbours.keys.iter().any(|(&j, keys)| roster.identity(j) != Some(&keys.identity)) {
            return refuse("a neighbour's identity is not the roster's");
        }
        let mine = neighbours_of(roster, self.config.k, &self.config.session, self.me);
        if !mine.is_some_and(|mine| mine.iter().eq(neighbours.keys.keys())) {
            return refuse("the neighbours are not the ones the public graph gives this client");
        }
        Ok(())
    }

    /// Requires every neighbour's identity key to carry a certificate from the enrolment
    /// authority `authority` (its public key, pinned on the device by the operator, never taken
    /// from the coordinator).
    pub fn require_certificates(&mut self, authority: [u8; 32]) {
        self.authority = Some(authority);
    }

    /// Signs (and so unmasks) only a survivor set of at least `min` devices, as well as `t`. A
    /// round with distributed noise sets it to the `min_survivors` its devices' noise was
    /// calibrated for: a coordinator that left survivors' inputs out of the sum would otherwise
    /// unmask a sum of fewer devices, with less noise than the plan's ε assumes (the noise of
    /// `min` devices is the least the accountant counts on).
    pub fn require_survivors(&mut self, min: u32) {
        self.min_survivors = min;
    }

    /// Unmasking: for each neighbour that shared, its seed share if it survived, its key share
    /// if it did not. Refused unless the survivor set is the one this client signed and at
    /// least `t` of the members it knows (itself and its neighbours) signed that same set, so a
    /// server that shows different sets to different devices gets too few signatures on each;
    /// and asked a second time, whatever the set.
    pub fn unmask(&mut self, request: UnmaskRequest) -> Result<UnmaskResponse, SecAggError> {
        if self.stage != ClientStage::Signed {
            return Err(SecAggError::WrongStage("Unmasking"));
        }
        if self.signed.as_ref() != Some(&request.survivors) {
            return Err(SecAggError::BadMessage {
                client: 0,
                why: "the survivor set differs from the one this client signed".into(),
            });
        }
        let message = survivors_message(&self.config.session, &request.survivors);
        let me = self.identity.public();
        let vouching = request
            .signatures
            .iter()
            .filter(|(j, signature)| {
                let identity =
                    if **j == self.me { Some(&me) } else { self.keys.get(j).map(|k| &k.identity) };
                request.survivors.contains(j)
                    && identity.is_some_and(|id| verify(id, &message, signature))
            })
            .count();
        if vouching < self.config.t as usize {
            // Honest or not, the round cannot end well: fewer than t of this client's
            // neighbours will unmask, so its own self mask cannot be rebuilt.
            return Err(SecAggError::BelowThreshold {
                stage: "Unmasking (signers of the survivor set among this client's neighbours)",
                have: vouching,
                need: self.config.t as usize,
            });
        }
        let mut response =
            UnmaskResponse { seed_shares: BTreeMap::new(), key_shares: BTreeMap::new() };
        for (&j, shares) in &self.held {
            if request.survivors.contains(&j) {
                response.seed_shares.insert(j, shares.seed);
            } else {
                response.key_shares.insert(j, shares.key);
            }
        }
        self.stage = ClientStage::Done;
        Ok(response)
    }
}
