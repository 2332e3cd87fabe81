//! Secure aggregation, SecAgg+ (Bell et al., CCS 2020): the server learns the sum of the
//! cohort's quantized vectors and nothing about any single one, and the sum survives clients
//! that drop out at any stage, up to the threshold.
//!
//! Sans-IO: [`Client`] and [`Server`] take the previous stage's messages (and randomness the
//! caller draws from the OS) and return the next stage's; the coordinator and SDK carry them.
//! Stages: AdvertiseKeys → ShareKeys → MaskedInputCollection → ConsistencyCheck → Unmasking,
//! over a Harary graph of degree `k` on a random ring (the complete graph, i.e. SecAgg of
//! Bonawitz et al., when `k ≥ n − 1`), whose ring order is a public hash of the members'
//! identity keys and the session, so each device checks the neighbourhood it is given.
//!
//! Against a malicious server (Bonawitz et al. 2017, §6): every device signs its key
//! advertisement, bound to the round and its seat, with the Ed25519 identity it registered at
//! enrollment, and neighbours refuse keys that are not so signed; in the consistency check
//! every survivor signs the survivor set it was shown, and a device reveals unmasking shares
//! only for the set it signed, once, after checking that at least `t` of the devices it knows
//! signed that same set. It never reveals both secrets of one neighbour. A device that pins the
//! operator's enrolment authority also requires each neighbour's identity key to carry the
//! authority's certificate, so a coordinator cannot invent members.
//!
//! Crypto: Ed25519 device signatures, X25519 key agreement for pairwise masks, Diffie–Hellman over Ristretto255 for the
//! client-to-client share channel (so that a client can prove the channel's key when it accuses
//! a neighbour of sending shares that do not open; `channel`), HKDF-SHA256, ChaCha20-Poly1305
//! for the share messages the server relays, Shamir `t`-of-`k` sharing over GF(2^61 − 1), and the ChaCha20
//! keystream as the mask generator. Arithmetic on masked vectors is in the ring Z/2^32.

//!
//! * [`quantize`]: fixed-point encoding into the ring, and what a secure vector carries;
//! * `shamir`, `prg`, `channel`: secret sharing, key agreement, the mask generator and the
//!   share channel with its accusation evidence (private);
//! * `identity`: device identities and what they sign;
//! * [`graph`]: the neighbour graph; [`messages`]: what each stage sends;
//! * [`client`], [`server`]: the two state machines.

use serde::{Deserialize, Serialize};

mod channel;
pub mod client;
pub mod graph;
mod identity;
pub mod messages;
mod prg;
pub mod quantize;
pub mod server;
mod shamir;

pub use channel::{Accusation, ChannelProof};
pub use client::Client;
pub use graph::{Roster, neighbours};
pub use identity::{
    DeviceIdentity, EnrolmentAuthority, Signature, certificate_is_valid, key_hex, parse_public_key,
};
pub use messages::{
    AdvertiseKeys, ConsistencyRequest, MaskRequest, NeighbourKeys, SealedShares, UnmaskRequest,
    UnmaskResponse,
};
pub use quantize::{
    EVALUATION_ENTRIES, EvaluationInput, Quantizer, SECURE_LOSS_CAP, append_evaluation,
    decode_evaluation, decode_weighted_mean, encode_weighted, evaluation_sums,
};
pub use server::{Server, Unmasking};
pub use shamir::Share;

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
    /// The coordinator relayed sealed shares that their sender did not sign: it altered them on
    /// the way. The device leaves the round without accusing (the evidence would open the
    /// original the coordinator kept) or sending its masked input.
    #[error("the coordinator relayed sealed shares that client {from} did not sign")]
    RelayAltered {
        /// The neighbour the shares claim to come from.
        from: ClientIdx,
    },
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

#[cfg(test)]
mod tests;
