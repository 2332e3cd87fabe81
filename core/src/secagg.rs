//! Secure aggregation, SecAgg+ (Bell et al., CCS 2020): the server learns the sum of the
//! cohort's quantized vectors and nothing about any single one, and the sum survives clients
//! that drop out at any stage, up to the threshold.
//!
//! Sans-IO: [`Client`] and [`Server`] take the previous stage's messages (and randomness the
//! caller draws from the OS) and return the next stage's; the coordinator and SDK carry them.
//! Stages: AdvertiseKeys → ShareKeys → MaskedInputCollection → Unmasking, over a Harary graph
//! of degree `k` on a random ring (the complete graph, i.e. SecAgg of Bonawitz et al., when
//! `k ≥ n − 1`).
//!
//! Crypto: X25519 key agreement, HKDF-SHA256, ChaCha20-Poly1305 for the client-to-client share
//! messages the server relays, Shamir `t`-of-`k` sharing over GF(2^61 − 1), and the ChaCha20
//! keystream as the mask generator. Arithmetic on masked vectors is in the ring Z/2^32.

use std::collections::{BTreeMap, BTreeSet};

use chacha20::cipher::{KeyIvInit, StreamCipher};
use chacha20poly1305::ChaCha20Poly1305;
use chacha20poly1305::aead::{Aead, KeyInit, Payload};
use serde::{Deserialize, Serialize};
use sha2::Sha256;
use x25519_dalek::{PublicKey, StaticSecret};

/// A cohort member's index, 1-based: also its Shamir evaluation point.
pub type ClientIdx = u32;

/// Why a stage could not proceed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SecAggError {
    /// A message from one client is malformed or inconsistent; that client is excluded.
    #[error("client {client}: {why}")]
    BadMessage {
        /// The offending client.
        client: ClientIdx,
        /// What is wrong.
        why: String,
    },
    /// A message arrived in the wrong stage.
    #[error("{0} is not expected now")]
    WrongStage(&'static str),
    /// Too few clients remain for the threshold: the round fails, nothing is revealed.
    #[error("only {have} clients remain at {stage}, the threshold needs {need}")]
    BelowThreshold {
        /// The stage.
        stage: &'static str,
        /// Survivors.
        have: usize,
        /// Needed.
        need: usize,
    },
    /// The configuration is unusable.
    #[error("secure aggregation config: {0}")]
    Config(String),
}

/// What every participant of one secure-aggregation round agrees on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Config {
    /// Binds every share message to this round (e.g. a hash of run, round and model version).
    pub session: [u8; 16],
    /// Clients in the cohort (indices 1..=n).
    pub n: u32,
    /// Neighbours per client (even; the complete graph when ≥ n − 1).
    pub k: u32,
    /// Shares of a client's secrets needed to rebuild them; > k/2 so no two disjoint groups of
    /// neighbours can rebuild both of a client's secrets.
    pub t: u32,
    /// Length of the masked vectors (ring elements).
    pub len: usize,
}

impl Config {
    /// A config with the default degree, `k` = the smallest even number ≥ 3·log2(n) (at most
    /// n − 1), and `t` = ⌊k/2⌋ + 1.
    pub fn with_defaults(session: [u8; 16], n: u32, len: usize) -> Self {
        let log = (n.max(2) as f64).log2().ceil() as u32;
        let mut k = (3 * log).max(2);
        k += k % 2;
        let k = k.min(n.saturating_sub(1)).max(1);
        Config { session, n, k, t: k / 2 + 1, len }
    }

    /// Checks the parameters.
    pub fn validate(&self) -> Result<(), SecAggError> {
        let fail = |m: String| Err(SecAggError::Config(m));
        if self.n < 2 {
            return fail(format!("n = {} < 2", self.n));
        }
        if self.k == 0 || self.k > self.n - 1 {
            return fail(format!("k = {} outside 1..={}", self.k, self.n - 1));
        }
        if self.t <= self.k / 2 || self.t > self.k {
            return fail(format!("t = {} outside {}..={}", self.t, self.k / 2 + 1, self.k));
        }
        if self.len == 0 {
            return fail("empty vectors".into());
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------
// Fixed-point quantization.

/// Maps reals in `[-clip, clip]` to `bits`-bit integers, so that the sum of `n` of them cannot
/// wrap the 2^32 ring: `bits = 32 − ⌈log2 n⌉`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Quantizer {
    /// Clipping range.
    pub clip: f64,
    /// Levels are `0..=2^bits − 1`.
    pub bits: u32,
}

impl Quantizer {
    /// A quantizer for sums of at most `n` vectors clipped to `clip`.
    pub fn for_cohort(clip: f64, n: u32) -> Self {
        let headroom = (n.max(1) as f64).log2().ceil() as u32;
        Quantizer { clip, bits: 32 - headroom.min(31) }
    }

    fn levels(&self) -> f64 {
        ((1u64 << self.bits) - 1) as f64
    }

    /// One value, clipped, rounded to the nearest level.
    pub fn quantize(&self, x: f64) -> u32 {
        let x = if x.is_finite() { x.clamp(-self.clip, self.clip) } else { 0.0 };
        ((x + self.clip) / (2.0 * self.clip) * self.levels()).round() as u32
    }

    /// The sum of `count` quantized values, back to reals.
    pub fn dequantize_sum(&self, sum: u32, count: u32) -> f64 {
        sum as f64 / self.levels() * 2.0 * self.clip - count as f64 * self.clip
    }

    /// The largest error per summed value.
    pub fn step(&self) -> f64 {
        2.0 * self.clip / self.levels()
    }
}

/// Example-weighted FedAvg through the masked sum: the vector carries `w·x` for each value and
/// `w·clip` last, with `w = examples / max_examples` in [0, 1] (scaled so that any clipping
/// range carries the weight exactly). The server divides the two sums.
pub fn encode_weighted(q: &Quantizer, delta: &[f32], examples: u64, max_examples: u64) -> Vec<u32> {
    let w = examples.min(max_examples) as f64 / max_examples.max(1) as f64;
    let mut v: Vec<u32> = delta.iter().map(|&x| q.quantize(w * f64::from(x))).collect();
    v.push(q.quantize(w * q.clip));
    v
}

/// The weighted mean from the unmasked sum of `count` [`encode_weighted`] vectors.
pub fn decode_weighted_mean(q: &Quantizer, sum: &[u32], count: u32) -> Option<Vec<f64>> {
    let (weight, values) = sum.split_last()?;
    let total = q.dequantize_sum(*weight, count) / q.clip;
    if total <= 0.0 {
        return None;
    }
    Some(values.iter().map(|&s| q.dequantize_sum(s, count) / total).collect())
}

/// A device's evaluation of the global model on its held-out examples, as it travels inside
/// its secure vector: the server learns only the cohort's pooled evaluation, never one device's.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EvaluationInput {
    /// Held-out examples evaluated (its weight; capped at `max_examples` like the update's).
    pub examples: u64,
    /// Accuracy, in [0, 1].
    pub accuracy: f64,
    /// Mean loss (capped at [`SECURE_LOSS_CAP`]).
    pub loss: f64,
}

/// Ring elements a secure vector carries after the weighted delta and its weight when it also
/// carries the device's evaluation: the evaluation's weight, weighted accuracy and weighted
/// (scaled) loss.
pub const EVALUATION_ENTRIES: usize = 3;

/// Losses above this count as this in a secure evaluation: the quantizer needs a range.
pub const SECURE_LOSS_CAP: f64 = 100.0;

/// Appends a device's evaluation to its [`encode_weighted`] vector (zero weight when it has
/// none, e.g. no held-out examples): `e·clip`, `e·accuracy·clip` and `e·(loss/cap)·clip` with
/// `e = examples / max_examples` in [0, 1], so every entry stays inside the clipping range.
pub fn append_evaluation(
    q: &Quantizer,
    vector: &mut Vec<u32>,
    evaluation: Option<EvaluationInput>,
    max_examples: u64,
) {
    let (e, accuracy, loss) = match evaluation {
        Some(ev) => (
            ev.examples.min(max_examples) as f64 / max_examples.max(1) as f64,
            if ev.accuracy.is_finite() { ev.accuracy.clamp(0.0, 1.0) } else { 0.0 },
            if ev.loss.is_finite() { ev.loss.clamp(0.0, SECURE_LOSS_CAP) } else { SECURE_LOSS_CAP },
        ),
        None => (0.0, 0.0, 0.0),
    };
    vector.push(q.quantize(e * q.clip));
    vector.push(q.quantize(e * accuracy * q.clip));
    vector.push(q.quantize(e * loss / SECURE_LOSS_CAP * q.clip));
}

/// The cohort's pooled evaluation from the unmasked sum of `count` vectors' evaluation entries
/// (the last [`EVALUATION_ENTRIES`]): total weight in examples, and the example-weighted mean
/// accuracy and loss. `None` when no device evaluated (a total weight below half an example).
pub fn decode_evaluation(
    q: &Quantizer,
    entries: &[u32],
    count: u32,
    max_examples: u64,
) -> Option<(f64, f64, f64)> {
    let [weight, accuracy, loss] = entries else { return None };
    let total = q.dequantize_sum(*weight, count) / q.clip;
    let examples = total * max_examples as f64;
    if examples < 0.5 {
        return None;
    }
    let accuracy = (q.dequantize_sum(*accuracy, count) / q.clip / total).clamp(0.0, 1.0);
    let loss = (q.dequantize_sum(*loss, count) / q.clip / total * SECURE_LOSS_CAP)
        .clamp(0.0, SECURE_LOSS_CAP);
    Some((examples, accuracy, loss))
}

// ---------------------------------------------------------------------------------------------
// Shamir sharing over GF(2^61 − 1), a 32-byte secret as five 7-byte (or shorter) chunks.

const P: u64 = (1 << 61) - 1;
const CHUNKS: usize = 5;

fn add(a: u64, b: u64) -> u64 {
    let s = a + b;
    if s >= P { s - P } else { s }
}

fn sub(a: u64, b: u64) -> u64 {
    if a >= b { a - b } else { a + P - b }
}

fn mul(a: u64, b: u64) -> u64 {
    let p = u128::from(a) * u128::from(b);
    let r = (p as u64 & P) + (p >> 61) as u64;
    if r >= P { r - P } else { r }
}

fn pow(mut a: u64, mut e: u64) -> u64 {
    let mut r = 1;
    while e > 0 {
        if e & 1 == 1 {
            r = mul(r, a);
        }
        a = mul(a, a);
        e >>= 1;
    }
    r
}

fn inv(a: u64) -> u64 {
    pow(a, P - 2)
}

/// One share of a 32-byte secret: the polynomials' values at the holder's index.
pub type Share = [u64; CHUNKS];

fn chunks(secret: &[u8; 32]) -> [u64; CHUNKS] {
    let mut out = [0u64; CHUNKS];
    for (i, c) in secret.chunks(7).enumerate() {
        let mut b = [0u8; 8];
        b[..c.len()].copy_from_slice(c);
        out[i] = u64::from_le_bytes(b);
    }
    out
}

fn unchunk(values: &[u64; CHUNKS]) -> Option<[u8; 32]> {
    let mut out = [0u8; 32];
    for (i, v) in values.iter().enumerate() {
        let bytes = v.to_le_bytes();
        let n = (32 - 7 * i).min(7);
        if bytes[n..].iter().any(|&b| b != 0) {
            return None;
        }
        out[7 * i..7 * i + n].copy_from_slice(&bytes[..n]);
    }
    Some(out)
}

/// Shares of `secret` for `holders`, any `t` of which rebuild it; coefficients from `rng`.
fn share(
    secret: &[u8; 32],
    t: u32,
    holders: &[ClientIdx],
    rng: &mut Keystream,
) -> BTreeMap<ClientIdx, Share> {
    let constant = chunks(secret);
    let coefficients: Vec<[u64; CHUNKS]> =
        (1..t).map(|_| std::array::from_fn(|_| rng.next_u64() % P)).collect();
    holders
        .iter()
        .map(|&x| {
            let share = std::array::from_fn(|c| {
                // Horner from the highest coefficient down to the secret.
                let mut acc = 0;
                for coefficient in coefficients.iter().rev() {
                    acc = add(mul(acc, u64::from(x)), coefficient[c]);
                }
                add(mul(acc, u64::from(x)), constant[c])
            });
            (x, share)
        })
        .collect()
}

/// The secret from exactly the given shares (at distinct non-zero points).
fn reconstruct(shares: &[(ClientIdx, Share)]) -> Option<[u8; 32]> {
    let mut values = [0u64; CHUNKS];
    for (i, (xi, share)) in shares.iter().enumerate() {
        let mut basis = 1;
        for (j, (xj, _)) in shares.iter().enumerate() {
            if i != j {
                let (xi, xj) = (u64::from(*xi), u64::from(*xj));
                basis = mul(basis, mul(xj, inv(sub(xj, xi))));
            }
        }
        for c in 0..CHUNKS {
            values[c] = add(values[c], mul(share[c], basis));
        }
    }
    unchunk(&values)
}

// ---------------------------------------------------------------------------------------------
// Key agreement, key derivation, share encryption and the mask generator.

/// The ChaCha20 keystream under a 32-byte seed: a cryptographic PRG.
struct Keystream(chacha20::ChaCha20);

impl Keystream {
    fn new(seed: &[u8; 32], stream: u8) -> Self {
        let mut nonce = [0u8; 12];
        nonce[0] = stream;
        Keystream(chacha20::ChaCha20::new(&(*seed).into(), &nonce.into()))
    }

    fn next_u64(&mut self) -> u64 {
        let mut b = [0u8; 8];
        self.0.apply_keystream(&mut b);
        u64::from_le_bytes(b)
    }

    /// Adds (`add`) or subtracts the next `out.len()` keystream ring elements to `out`.
    fn mask(mut self, out: &mut [u32], add: bool) {
        let mut buf = [0u8; 4096];
        for chunk in out.chunks_mut(1024) {
            let bytes = &mut buf[..chunk.len() * 4];
            bytes.fill(0);
            self.0.apply_keystream(bytes);
            for (v, w) in chunk.iter_mut().zip(bytes.chunks_exact(4)) {
                let m = u32::from_le_bytes([w[0], w[1], w[2], w[3]]);
                *v = if add { v.wrapping_add(m) } else { v.wrapping_sub(m) };
            }
        }
    }
}

fn derive(
    shared: &[u8; 32],
    label: &[u8],
    a: ClientIdx,
    b: ClientIdx,
    session: &[u8; 16],
) -> [u8; 32] {
    let (lo, hi) = (a.min(b), a.max(b));
    let mut info = label.to_vec();
    info.extend(session);
    info.extend(lo.to_le_bytes());
    info.extend(hi.to_le_bytes());
    let mut out = [0u8; 32];
    hkdf::Hkdf::<Sha256>::new(Some(b"starling-secagg-v1"), shared)
        .expand(&info, &mut out)
        .expect("32 bytes is a valid HKDF-SHA256 output length");
    out
}

/// The seed of the pairwise mask between `me` (secret) and `other` (public).
fn pairwise_seed(
    secret: &StaticSecret,
    me: ClientIdx,
    other_pk: &PublicKey,
    other: ClientIdx,
    session: &[u8; 16],
) -> [u8; 32] {
    derive(secret.diffie_hellman(other_pk).as_bytes(), b"mask", me, other, session)
}

fn share_cipher(
    secret: &StaticSecret,
    me: ClientIdx,
    other_pk: &PublicKey,
    other: ClientIdx,
    session: &[u8; 16],
) -> ChaCha20Poly1305 {
    let key = derive(secret.diffie_hellman(other_pk).as_bytes(), b"share", me, other, session);
    ChaCha20Poly1305::new(&key.into())
}

fn share_nonce(from: ClientIdx, to: ClientIdx) -> [u8; 12] {
    let mut n = [0u8; 12];
    n[..4].copy_from_slice(&from.to_le_bytes());
    n[4..8].copy_from_slice(&to.to_le_bytes());
    n
}

// ---------------------------------------------------------------------------------------------
// The neighbour graph.

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

// ---------------------------------------------------------------------------------------------
// Messages.

/// Stage 0, client → server: the client's two public keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct AdvertiseKeys {
    /// For the share channel.
    pub cipher_pk: [u8; 32],
    /// For pairwise masks.
    pub mask_pk: [u8; 32],
}

/// Stage 1, server → client: its neighbours' keys (those that advertised) and the graph seed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NeighbourKeys {
    /// Neighbour → its keys.
    pub keys: BTreeMap<ClientIdx, AdvertiseKeys>,
}

/// A share message from one client to another, sealed; the server only relays it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SealedShares {
    /// Sender.
    pub from: ClientIdx,
    /// Recipient.
    pub to: ClientIdx,
    /// ChaCha20-Poly1305 of the sender's shares for the recipient.
    #[serde(with = "serde_bytes")]
    pub ciphertext: Vec<u8>,
}

/// Stage 2, server → client: the sealed shares addressed to it by neighbours that shared.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MaskRequest {
    /// One per neighbour that completed ShareKeys.
    pub shares: Vec<SealedShares>,
}

/// Stage 3, server → client: who sent a masked input.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UnmaskRequest {
    /// Clients whose masked input the server holds.
    pub survivors: BTreeSet<ClientIdx>,
}

/// Stage 3, client → server: for each neighbour, the share of its self-mask seed (survivors)
/// or of its mask key (dropped after sharing), never both.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UnmaskResponse {
    /// Shares of survivors' self-mask seeds.
    pub seed_shares: BTreeMap<ClientIdx, Share>,
    /// Shares of dropped clients' mask keys.
    pub key_shares: BTreeMap<ClientIdx, Share>,
}

/// What one client sends another inside [`SealedShares`].
#[derive(Serialize, Deserialize)]
struct Shares {
    from: ClientIdx,
    to: ClientIdx,
    key: Share,
    seed: Share,
}

// ---------------------------------------------------------------------------------------------
// The client.

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ClientStage {
    Advertised,
    Shared,
    Masked,
    Done,
}

/// One client's side of a round.
pub struct Client {
    me: ClientIdx,
    config: Config,
    cipher_sk: StaticSecret,
    mask_sk: StaticSecret,
    self_seed: [u8; 32],
    coefficients: [u8; 32],
    stage: ClientStage,
    keys: BTreeMap<ClientIdx, AdvertiseKeys>,
    /// Shares received from each neighbour that completed ShareKeys.
    held: BTreeMap<ClientIdx, Shares>,
    /// Neighbours whose sealed shares arrived but did not open: this client added no pairwise
    /// mask with them, and must say so with its masked input (see [`Client::rejected`]).
    rejected: BTreeSet<ClientIdx>,
}

impl Client {
    /// Client `me` with 96 bytes of OS randomness; its [`AdvertiseKeys`].
    pub fn new(
        me: ClientIdx,
        config: Config,
        randomness: [u8; 96],
    ) -> Result<(Self, AdvertiseKeys), SecAggError> {
        config.validate()?;
        if me == 0 || me > config.n {
            return Err(SecAggError::Config(format!("client index {me} outside 1..={}", config.n)));
        }
        let part = |i: usize| -> [u8; 32] {
            randomness[32 * i..32 * i + 32].try_into().expect("32 bytes")
        };
        let cipher_sk = StaticSecret::from(part(0));
        let mask_sk = StaticSecret::from(part(1));
        let advert = AdvertiseKeys {
            cipher_pk: PublicKey::from(&cipher_sk).to_bytes(),
            mask_pk: PublicKey::from(&mask_sk).to_bytes(),
        };
        // The self-mask seed and the sharing polynomials come from the third part, expanded.
        let mut expand = Keystream::new(&part(2), 1);
        let mut self_seed = [0u8; 32];
        expand.0.apply_keystream(&mut self_seed);
        let mut coefficients = [0u8; 32];
        expand.0.apply_keystream(&mut coefficients);
        let client = Client {
            me,
            config,
            cipher_sk,
            mask_sk,
            self_seed,
            coefficients,
            stage: ClientStage::Advertised,
            keys: BTreeMap::new(),
            held: BTreeMap::new(),
            rejected: BTreeSet::new(),
        };
        Ok((client, advert))
    }

    /// ShareKeys: shares of this client's mask key and self-mask seed for each neighbour,
    /// sealed to that neighbour.
    pub fn share_keys(
        &mut self,
        neighbours: NeighbourKeys,
    ) -> Result<Vec<SealedShares>, SecAggError> {
        if self.stage != ClientStage::Advertised {
            return Err(SecAggError::WrongStage("ShareKeys"));
        }
        if neighbours.keys.contains_key(&self.me)
            || neighbours.keys.keys().any(|&j| j == 0 || j > self.config.n)
            || neighbours.keys.len() > self.config.k as usize
        {
            return Err(SecAggError::BadMessage {
                client: 0,
                why: "neighbour list is not a neighbourhood".into(),
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
            let plain = Shares { from: self.me, to, key: key_shares[&to], seed: seed_shares[&to] };
            let plain = crate::codec::to_vec(&plain).expect("shares encode");
            let cipher = share_cipher(
                &self.cipher_sk,
                self.me,
                &PublicKey::from(advert.cipher_pk),
                to,
                &self.config.session,
            );
            let ciphertext = cipher
                .encrypt(
                    &share_nonce(self.me, to).into(),
                    Payload { msg: &plain, aad: &self.config.session },
                )
                .expect("encryption into a Vec cannot fail");
            out.push(SealedShares { from: self.me, to, ciphertext });
        }
        self.keys = neighbours.keys;
        self.stage = ClientStage::Shared;
        Ok(out)
    }

    /// MaskedInputCollection: `input` (quantized) plus the self mask plus pairwise masks with
    /// every neighbour whose shares arrived. A neighbour whose shares fail to open gets no
    /// pairwise mask and is listed in [`Client::rejected`], which the masked input must carry:
    /// the server then leaves that neighbour out of the sum instead of letting its
    /// uncancelled mask corrupt it. Too few valid shares left fails.
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
                || self.rejected.contains(&sealed.from)
            {
                continue;
            }
            let cipher = share_cipher(
                &self.cipher_sk,
                self.me,
                &PublicKey::from(advert.cipher_pk),
                sealed.from,
                &self.config.session,
            );
            let opened = cipher
                .decrypt(
                    &share_nonce(sealed.from, self.me).into(),
                    Payload { msg: &sealed.ciphertext, aad: &self.config.session },
                )
                .ok()
                .and_then(|plain| crate::codec::decode::<Shares>(&plain).ok())
                .filter(|shares| {
                    shares.from == sealed.from
                        && shares.to == self.me
                        && shares.key.iter().chain(&shares.seed).all(|&v| v < P)
                });
            match opened {
                Some(shares) => {
                    self.held.insert(sealed.from, shares);
                }
                None => {
                    self.rejected.insert(sealed.from);
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

    /// Neighbours whose sealed shares did not open (known once the masked input is made).
    pub fn rejected(&self) -> &BTreeSet<ClientIdx> {
        &self.rejected
    }

    /// Unmasking: for each neighbour that shared, its seed share if it survived, its key share
    /// if it did not. A request naming this client as dropped, or asked twice, is refused.
    pub fn unmask(&mut self, request: UnmaskRequest) -> Result<UnmaskResponse, SecAggError> {
        if self.stage != ClientStage::Masked {
            return Err(SecAggError::WrongStage("Unmasking"));
        }
        if !request.survivors.contains(&self.me) {
            return Err(SecAggError::BadMessage {
                client: 0,
                why: "the survivors list leaves out this client".into(),
            });
        }
        if request.survivors.len() < self.config.t as usize {
            return Err(SecAggError::BelowThreshold {
                stage: "Unmasking",
                have: request.survivors.len(),
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

// ---------------------------------------------------------------------------------------------
// The server.

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ServerStage {
    Advertise,
    Share,
    Collect,
    Unmask,
    Done,
}

/// The server's side of a round: it relays sealed shares, collects masked inputs, and rebuilds
/// only what the unmasked sum needs. It never holds an unmasked input.
pub struct Server {
    config: Config,
    graph_seed: [u8; 32],
    stage: ServerStage,
    keys: BTreeMap<ClientIdx, AdvertiseKeys>,
    graph: BTreeMap<ClientIdx, BTreeSet<ClientIdx>>,
    sealed: BTreeMap<ClientIdx, Vec<SealedShares>>,
    shared: BTreeSet<ClientIdx>,
    masked: BTreeMap<ClientIdx, Vec<u32>>,
    /// For each masked input, the neighbours its sender could not open shares from (and so
    /// added no pairwise mask with).
    rejections: BTreeMap<ClientIdx, BTreeSet<ClientIdx>>,
    survivors: BTreeSet<ClientIdx>,
    responses: BTreeMap<ClientIdx, UnmaskResponse>,
    excluded: BTreeSet<ClientIdx>,
}

impl Server {
    /// A round; `graph_seed` (32 random bytes) draws the neighbour graph.
    pub fn new(config: Config, graph_seed: [u8; 32]) -> Result<Self, SecAggError> {
        config.validate()?;
        Ok(Server {
            config,
            graph_seed,
            stage: ServerStage::Advertise,
            keys: BTreeMap::new(),
            graph: BTreeMap::new(),
            sealed: BTreeMap::new(),
            shared: BTreeSet::new(),
            masked: BTreeMap::new(),
            rejections: BTreeMap::new(),
            survivors: BTreeSet::new(),
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

    /// AdvertiseKeys from `client`.
    pub fn receive_keys(
        &mut self,
        client: ClientIdx,
        advert: AdvertiseKeys,
    ) -> Result<(), SecAggError> {
        self.expect(ServerStage::Advertise, "AdvertiseKeys")?;
        if client == 0 || client > self.config.n || self.keys.contains_key(&client) {
            return Err(self.bad(client, "unknown index or keys sent twice"));
        }
        if advert.cipher_pk == advert.mask_pk
            || self
                .keys
                .values()
                .any(|k| k.mask_pk == advert.mask_pk || k.cipher_pk == advert.cipher_pk)
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
    /// neighbours among the advertisers, with their keys.
    pub fn close_advertise(&mut self) -> Result<BTreeMap<ClientIdx, NeighbourKeys>, SecAggError> {
        self.expect(ServerStage::Advertise, "the end of AdvertiseKeys")?;
        let members: BTreeSet<ClientIdx> = self.keys.keys().copied().collect();
        self.at_least("AdvertiseKeys", members.len())?;
        self.graph = neighbours(&members, self.config.k, &self.graph_seed);
        self.stage = ServerStage::Share;
        Ok(self
            .graph
            .iter()
            .map(|(&i, ns)| {
                (i, NeighbourKeys { keys: ns.iter().map(|j| (*j, self.keys[j])).collect() })
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
                    .remove(&i)
                    .unwrap_or_default()
                    .into_iter()
                    .filter(|s| shared.contains(&s.from))
                    .collect();
                (i, MaskRequest { shares })
            })
            .collect())
    }

    /// A masked input from `client`, with the neighbours whose shares it could not open
    /// ([`Client::rejected`]); those must be neighbours that shared.
    pub fn receive_masked(
        &mut self,
        client: ClientIdx,
        y: Vec<u32>,
        rejected: BTreeSet<ClientIdx>,
    ) -> Result<(), SecAggError> {
        self.expect(ServerStage::Collect, "MaskedInputCollection")?;
        if !self.shared.contains(&client)
            || self.masked.contains_key(&client)
            || y.len() != self.config.len
        {
            return Err(self.bad(client, "unexpected masked input or wrong length"));
        }
        if !rejected.iter().all(|j| self.graph[&client].contains(j) && self.shared.contains(j)) {
            return Err(self.bad(client, "rejects shares from clients that sent it none"));
        }
        self.masked.insert(client, y);
        self.rejections.insert(client, rejected);
        Ok(())
    }

    /// Clients whose sealed shares a neighbour could not open: they are left out of the sum
    /// (their masked input is dropped, their pairwise masks removed like a dropout's), so a
    /// client that seals garbage to a neighbour cannot corrupt the aggregate.
    pub fn accused(&self) -> BTreeSet<ClientIdx> {
        self.rejections.values().flatten().copied().collect()
    }

    /// Ends MaskedInputCollection: the survivors every one of them is told (everyone who sent
    /// a masked input, but clients a neighbour could not open shares from).
    pub fn close_masked(&mut self) -> Result<UnmaskRequest, SecAggError> {
        self.expect(ServerStage::Collect, "the end of MaskedInputCollection")?;
        let accused = self.accused();
        for &j in &accused {
            self.masked.remove(&j);
            self.rejections.remove(&j);
            self.excluded.insert(j);
        }
        self.at_least("MaskedInputCollection", self.masked.len())?;
        self.survivors = self.masked.keys().copied().collect();
        self.stage = ServerStage::Unmask;
        Ok(UnmaskRequest { survivors: self.survivors.clone() })
    }

    /// An unmasking response from a survivor: seed shares only for surviving neighbours, key
    /// shares only for neighbours that shared and then dropped.
    pub fn receive_unmask(
        &mut self,
        client: ClientIdx,
        response: UnmaskResponse,
    ) -> Result<(), SecAggError> {
        self.expect(ServerStage::Unmask, "Unmasking")?;
        if !self.survivors.contains(&client) || self.responses.contains_key(&client) {
            return Err(self.bad(client, "not a survivor, or answered twice"));
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

    /// Ends Unmasking: the sum of the survivors' inputs, and who they are. Fails cleanly when
    /// some secret has fewer than `t` shares or a rebuilt key does not match its public key.
    pub fn finish(&mut self) -> Result<(Vec<u32>, BTreeSet<ClientIdx>), SecAggError> {
        self.expect(ServerStage::Unmask, "the end of Unmasking")?;
        self.at_least("Unmasking", self.responses.len())?;
        self.stage = ServerStage::Done;
        let t = self.config.t as usize;
        let gather =
            |select: &dyn Fn(&UnmaskResponse) -> Option<Share>| -> Vec<(ClientIdx, Share)> {
                self.responses
                    .iter()
                    .filter_map(|(&i, r)| select(r).map(|s| (i, s)))
                    .take(t)
                    .collect()
            };
        let mut sum = vec![0u32; self.config.len];
        for y in self.masked.values() {
            for (s, v) in sum.iter_mut().zip(y) {
                *s = s.wrapping_add(*v);
            }
        }
        for &j in &self.survivors {
            let shares = gather(&|r| r.seed_shares.get(&j).copied());
            if shares.len() < t {
                return Err(SecAggError::BelowThreshold {
                    stage: "Unmasking (self masks)",
                    have: shares.len(),
                    need: t,
                });
            }
            let seed = reconstruct(&shares).ok_or_else(|| SecAggError::BadMessage {
                client: j,
                why: "seed shares are inconsistent".into(),
            })?;
            Keystream::new(&seed, 3).mask(&mut sum, false);
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
            let key = reconstruct(&shares).map(StaticSecret::from);
            let key = match key {
                Some(k) if PublicKey::from(&k).to_bytes() == self.keys[&j].mask_pk => k,
                _ => {
                    return Err(SecAggError::BadMessage {
                        client: j,
                        why: "rebuilt mask key does not match its public key".into(),
                    });
                }
            };
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
                Keystream::new(&seed, 4).mask(&mut sum, i > j);
            }
        }
        Ok((sum, self.survivors.clone()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn bytes<const N: usize>(seed: u64, stream: u8) -> [u8; N] {
        let mut key = [0u8; 32];
        key[..8].copy_from_slice(&seed.to_le_bytes());
        let mut out = [0u8; N];
        Keystream::new(&key, stream).0.apply_keystream(&mut out);
        out
    }

    /// Who drops where: indices leaving after AdvertiseKeys, after ShareKeys, after sending
    /// the masked input (before Unmasking), and a client sending a bad message.
    #[derive(Debug, Clone, Default)]
    struct Script {
        silent: BTreeSet<ClientIdx>,
        after_advertise: BTreeSet<ClientIdx>,
        after_share: BTreeSet<ClientIdx>,
        after_mask: BTreeSet<ClientIdx>,
        corrupt_share: Option<ClientIdx>,
        /// A sealed share (from, to) whose ciphertext is garbled: well-formed, but it does not
        /// open.
        garble: Option<(ClientIdx, ClientIdx)>,
    }

    type Outcome = Result<(Vec<u32>, BTreeSet<ClientIdx>), SecAggError>;

    /// Runs one round end to end in memory; the sum and survivors, and each client's input.
    fn run(
        config: &Config,
        seed: u64,
        script: &Script,
    ) -> (Outcome, BTreeMap<ClientIdx, Vec<u32>>) {
        let mut server = Server::new(*config, bytes(seed, 9)).unwrap();
        let mut clients = BTreeMap::new();
        let mut inputs = BTreeMap::new();
        for i in 1..=config.n {
            let (client, advert) =
                Client::new(i, *config, bytes(seed ^ u64::from(i) << 32, 1)).unwrap();
            let input: Vec<u32> = (0..config.len)
                .map(|j| (u64::from(i) * 7919 + j as u64 * 104_729 + seed) as u32 % 1000)
                .collect();
            inputs.insert(i, input);
            if !script.silent.contains(&i) {
                server.receive_keys(i, advert).unwrap();
                clients.insert(i, client);
            }
        }
        let result = (|| {
            let neighbourhoods = server.close_advertise()?;
            for (i, keys) in neighbourhoods {
                if script.after_advertise.contains(&i) {
                    continue;
                }
                let mut sealed = clients.get_mut(&i).unwrap().share_keys(keys)?;
                if script.corrupt_share == Some(i) {
                    sealed.pop();
                }
                for s in sealed.iter_mut().filter(|s| script.garble == Some((s.from, s.to))) {
                    s.ciphertext[0] ^= 0xff;
                }
                let _ = server.receive_shares(i, sealed);
            }
            for (i, request) in server.close_share_keys()? {
                if script.after_share.contains(&i) {
                    continue;
                }
                let client = clients.get_mut(&i).unwrap();
                let y = client.masked_input(request, &inputs[&i])?;
                server.receive_masked(i, y, client.rejected().clone())?;
            }
            let request = server.close_masked()?;
            for &i in &request.survivors {
                if script.after_mask.contains(&i) {
                    continue;
                }
                let response = clients.get_mut(&i).unwrap().unmask(request.clone())?;
                server.receive_unmask(i, response)?;
            }
            server.finish()
        })();
        (result, inputs)
    }

    fn plain_sum(
        inputs: &BTreeMap<ClientIdx, Vec<u32>>,
        who: &BTreeSet<ClientIdx>,
        len: usize,
    ) -> Vec<u32> {
        let mut sum = vec![0u32; len];
        for i in who {
            for (s, v) in sum.iter_mut().zip(&inputs[i]) {
                *s = s.wrapping_add(*v);
            }
        }
        sum
    }

    #[test]
    fn shamir_rebuilds_from_any_t_shares_only() {
        let secret: [u8; 32] = bytes(1, 1);
        let mut rng = Keystream::new(&bytes(2, 1), 0);
        let holders: Vec<ClientIdx> = (1..=7).collect();
        let shares = share(&secret, 4, &holders, &mut rng);
        let all: Vec<(ClientIdx, Share)> = shares.into_iter().collect();
        for start in 0..4 {
            assert_eq!(reconstruct(&all[start..start + 4]), Some(secret));
        }
        assert_ne!(reconstruct(&all[..3]), Some(secret));
    }

    #[test]
    fn no_dropout_sums_exactly_and_the_graph_is_regular() {
        let config = Config::with_defaults([7; 16], 30, 64);
        assert!(config.k < 29 && config.k.is_multiple_of(2), "{config:?}");
        let (result, inputs) = run(&config, 3, &Script::default());
        let (sum, survivors) = result.unwrap();
        assert_eq!(survivors.len(), 30);
        assert_eq!(sum, plain_sum(&inputs, &survivors, 64));
        let graph = neighbours(&(1..=30).collect(), config.k, &[5; 32]);
        for (i, ns) in &graph {
            assert_eq!(ns.len(), config.k as usize);
            assert!(ns.iter().all(|j| graph[j].contains(i)), "symmetric");
        }
    }

    #[test]
    fn dropouts_at_every_stage_up_to_the_threshold() {
        // 6 of the 18 in the graph drop after it is drawn; with k = 14 every neighbourhood keeps
        // at least 8 = t, wherever the dropouts sit on the ring.
        let config = Config { session: [4; 16], n: 20, k: 14, t: 8, len: 32 };
        let script = Script {
            silent: [1, 2].into(),
            after_advertise: [3, 4].into(),
            after_share: [5, 6].into(),
            after_mask: [7, 8].into(),
            corrupt_share: None,
            garble: None,
        };
        let (result, inputs) = run(&config, 21, &script);
        let (sum, survivors) = result.unwrap();
        assert_eq!(survivors, (7..=20).collect());
        assert_eq!(sum, plain_sum(&inputs, &survivors, 32));
    }

    #[test]
    fn complete_graph_is_secagg() {
        let config = Config { session: [1; 16], n: 6, k: 5, t: 3, len: 5 };
        let script =
            Script { after_share: [2].into(), after_mask: [5].into(), ..Default::default() };
        let (result, inputs) = run(&config, 11, &script);
        let (sum, survivors) = result.unwrap();
        assert_eq!(survivors, [1, 3, 4, 5, 6].into());
        assert_eq!(sum, plain_sum(&inputs, &survivors, 5));
    }

    #[test]
    fn a_bad_share_message_excludes_only_its_sender() {
        let config = Config::with_defaults([2; 16], 12, 8);
        let script = Script { corrupt_share: Some(4), ..Default::default() };
        let (result, inputs) = run(&config, 5, &script);
        let (sum, survivors) = result.unwrap();
        assert!(!survivors.contains(&4));
        assert_eq!(survivors.len(), 11);
        assert_eq!(sum, plain_sum(&inputs, &survivors, 8));
    }

    /// Issue 16: a client that seals an undecryptable share to one neighbour left that
    /// neighbour without their pairwise mask while the server assumed it cancelled, and the
    /// round committed a random sum. The neighbour now reports the share it could not open,
    /// and the server leaves the sender out: the sum is the honest survivors' exactly.
    #[test]
    fn r16_a_share_that_does_not_open_excludes_its_sender_not_the_sum() {
        for (config, seed) in [
            (Config::with_defaults([6; 16], 12, 8), 5),
            (Config { session: [6; 16], n: 7, k: 6, t: 4, len: 8 }, 9),
        ] {
            let from = 3;
            let to = *neighbours(&(1..=config.n).collect(), config.k, &bytes(seed, 9))[&from]
                .iter()
                .next()
                .unwrap();
            // The same graph the server draws from its seed: `run` seeds it with bytes(seed, 9).
            let script = Script { garble: Some((from, to)), ..Default::default() };
            let (result, inputs) = run(&config, seed, &script);
            let (sum, survivors) = result.unwrap();
            assert!(!survivors.contains(&from), "the sender is left out");
            assert!(survivors.contains(&to), "the neighbour that reported it stays in");
            assert_eq!(survivors.len() as u32, config.n - 1);
            assert_eq!(sum, plain_sum(&inputs, &survivors, config.len));
        }
        // With dropouts on top, the round still sums exactly or fails cleanly.
        let config = Config { session: [8; 16], n: 9, k: 4, t: 3, len: 6 };
        let script = Script { garble: Some((2, 3)), after_mask: [5].into(), ..Default::default() };
        match run(&config, 4, &script) {
            (Ok((sum, survivors)), inputs) => {
                assert!(!survivors.contains(&2));
                assert_eq!(sum, plain_sum(&inputs, &survivors, 6));
            }
            (Err(e), _) => assert!(matches!(e, SecAggError::BelowThreshold { .. }), "{e}"),
        }
    }

    #[test]
    fn a_client_cannot_reject_shares_it_never_got() {
        let config = Config::with_defaults([2; 16], 6, 4);
        let mut server = Server::new(config, bytes(1, 9)).unwrap();
        let mut clients = BTreeMap::new();
        for i in 1..=6 {
            let (client, advert) = Client::new(i, config, bytes(u64::from(i), 1)).unwrap();
            server.receive_keys(i, advert).unwrap();
            clients.insert(i, client);
        }
        for (i, keys) in server.close_advertise().unwrap() {
            let sealed = clients.get_mut(&i).unwrap().share_keys(keys).unwrap();
            server.receive_shares(i, sealed).unwrap();
        }
        server.close_share_keys().unwrap();
        let err = server.receive_masked(1, vec![0; 4], [1].into()).unwrap_err();
        assert!(matches!(err, SecAggError::BadMessage { client: 1, .. }), "{err}");
        assert!(server.excluded().contains(&1));
    }

    #[test]
    fn dropout_beyond_the_threshold_fails_cleanly() {
        let config = Config { session: [3; 16], n: 8, k: 4, t: 3, len: 4 };
        // Everyone but two leaves after sharing: too few masked inputs.
        let script = Script { after_share: (3..=8).collect(), ..Default::default() };
        let (result, _) = run(&config, 1, &script);
        assert!(matches!(result, Err(SecAggError::BelowThreshold { .. })), "{result:?}");
    }

    #[test]
    fn weighted_fedavg_through_the_ring() {
        let n = 50;
        let q = Quantizer::for_cohort(1.0, n);
        let deltas: Vec<Vec<f32>> = (0..n)
            .map(|i| (0..10).map(|j| ((i * 13 + j * 7) % 19) as f32 / 10.0 - 0.9).collect())
            .collect();
        let counts: Vec<u64> = (0..n).map(|i| 10 + u64::from(i) % 40).collect();
        let mut sum = vec![0u32; 11];
        for (d, &c) in deltas.iter().zip(&counts) {
            for (s, v) in sum.iter_mut().zip(encode_weighted(&q, d, c, 100)) {
                *s = s.wrapping_add(v);
            }
        }
        let mean = decode_weighted_mean(&q, &sum, n).unwrap();
        let total: f64 = counts.iter().map(|&c| c as f64).sum();
        for j in 0..10 {
            let exact: f64 =
                deltas.iter().zip(&counts).map(|(d, &c)| f64::from(d[j]) * c as f64).sum::<f64>()
                    / total;
            // n values each off by half a step, over a total weight of at least n·0.1.
            assert!((mean[j] - exact).abs() < 1e-4, "{j}: {} vs {exact}", mean[j]);
        }
    }

    /// Issue 16: secure runs sent per-device evaluation reports in clear. The evaluation now
    /// rides in the masked vector, and the server decodes only the cohort's pooled means.
    #[test]
    fn r16_evaluation_pools_through_the_ring() {
        let n = 40;
        let q = Quantizer::for_cohort(1.0, n);
        let mut sum = [0u32; 2 + EVALUATION_ENTRIES];
        let (mut examples, mut correct, mut loss_sum) = (0.0, 0.0, 0.0);
        for i in 0..n {
            let mut v = encode_weighted(&q, &[0.5], 10, 100);
            let ev = (!i.is_multiple_of(4)).then(|| EvaluationInput {
                examples: 5 + u64::from(i) % 30,
                accuracy: f64::from(i % 10) / 10.0,
                loss: 0.2 + f64::from(i) / 20.0,
            });
            if let Some(ev) = ev {
                examples += ev.examples as f64;
                correct += ev.examples as f64 * ev.accuracy;
                loss_sum += ev.examples as f64 * ev.loss;
            }
            append_evaluation(&q, &mut v, ev, 100);
            for (s, x) in sum.iter_mut().zip(v) {
                *s = s.wrapping_add(x);
            }
        }
        let (weight, accuracy, loss) = decode_evaluation(&q, &sum[2..], n, 100).unwrap();
        assert!((weight - examples).abs() < 0.01, "{weight} vs {examples}");
        assert!((accuracy - correct / examples).abs() < 1e-5, "{accuracy}");
        assert!((loss - loss_sum / examples).abs() < 1e-3, "{loss}");
        let mean = decode_weighted_mean(&q, &sum[..2], n).unwrap();
        assert!((mean[0] - 0.5).abs() < 1e-5);
        // Nobody evaluated: no pooled evaluation, not a 0 % one.
        let mut nobody = [0u32; EVALUATION_ENTRIES];
        for _ in 0..n {
            let mut v = vec![];
            append_evaluation(&q, &mut v, None, 100);
            for (s, x) in nobody.iter_mut().zip(v) {
                *s = s.wrapping_add(x);
            }
        }
        assert_eq!(decode_evaluation(&q, &nobody, n, 100), None);
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

        /// For random cohorts, graphs and dropout at every stage: the round either succeeds
        /// with exactly the survivors' sum, or (too many dropped) fails as below threshold.
        #[test]
        fn unmasked_sum_is_the_plaintext_sum(
            n in 4u32..24,
            k_half in 1u32..6,
            seed in any::<u64>(),
            drops in proptest::collection::vec((1u32..24, 0u8..4), 0..8),
        ) {
            let k = (2 * k_half).min(n - 1);
            let config = Config { session: [9; 16], n, k, t: k / 2 + 1, len: 16 };
            let mut script = Script::default();
            for (i, stage) in drops {
                let i = (i - 1) % n + 1;
                match stage {
                    0 => script.silent.insert(i),
                    1 => script.after_advertise.insert(i),
                    2 => script.after_share.insert(i),
                    _ => script.after_mask.insert(i),
                };
            }
            let (result, inputs) = run(&config, seed, &script);
            match result {
                Ok((sum, survivors)) => {
                    prop_assert_eq!(&sum, &plain_sum(&inputs, &survivors, 16));
                    prop_assert!(survivors.iter().all(|i| !script.silent.contains(i) && !script.after_advertise.contains(i) && !script.after_share.contains(i)));
                }
                Err(SecAggError::BelowThreshold { .. }) => {
                    prop_assert!(!script.silent.is_empty() || !script.after_advertise.is_empty() || !script.after_share.is_empty() || !script.after_mask.is_empty());
                }
                Err(e) => prop_assert!(false, "unexpected failure {e}"),
            }
        }
    }
}
