//! The protocol's messages, stage by stage, as the coordinator relays them.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::ClientIdx;
use super::graph::Roster;
use super::identity::{DeviceIdentity, Signature, sealed_message, verify};
use super::shamir::Share;

/// Stage 0, client → server: the client's two public keys, signed with its identity for its
/// seat in this round.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct AdvertiseKeys {
    /// The device's identity key, as registered at enrollment: the coordinator checks it is
    /// the sender's, neighbours check the signature with it.
    pub identity: [u8; 32],
    /// For the share channel.
    pub cipher_pk: [u8; 32],
    /// For pairwise masks.
    pub mask_pk: [u8; 32],
    /// A hash of the client's self-mask seed (bound to the session and its index), which the
    /// seed rebuilt from its neighbours' shares must match.
    pub seed_commitment: [u8; 32],
    /// The identity's signature over the keys, the session and the client's index.
    pub signature: Signature,
    /// The operator's enrolment certificate of the identity key, which neighbours that pin the
    /// enrolment authority require (see [`EnrolmentAuthority`](super::EnrolmentAuthority)).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub certificate: Option<Signature>,
}

/// Stage 1, server → client: its neighbours' keys, and the roster of everyone who advertised,
/// from which the client recomputes who its neighbours must be.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NeighbourKeys {
    /// Neighbour → its keys.
    pub keys: BTreeMap<ClientIdx, AdvertiseKeys>,
    /// Every member that advertised, with its identity key: one list shared by the round.
    pub roster: Arc<Roster>,
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
    /// The sender's identity signature over the round, both ends and the ciphertext: the
    /// recipient opens (and so may accuse) only what its neighbour sent, never a ciphertext the
    /// coordinator altered on the way (see [`SealedShares::sign`]).
    pub signature: Signature,
}

impl SealedShares {
    /// Signs the message as its sender, `identity`, for the round `session`. A neighbour whose
    /// shares do not open reveals their channel's point as evidence; were the ciphertext not
    /// signed, a coordinator could garble its relay of a device's shares to `t` neighbours,
    /// keep the originals, and open them with the points their accusations reveal: `t` shares
    /// of both of that device's secrets, its input in clear.
    pub fn sign(&mut self, identity: &DeviceIdentity, session: &[u8; 16]) {
        let message = sealed_message(session, self.from, self.to, &self.ciphertext);
        self.signature = identity.sign(&message);
    }

    /// Whether the message carries the signature of `identity` (its sender's) for `session`.
    pub(super) fn is_signed_by(&self, identity: &[u8; 32], session: &[u8; 16]) -> bool {
        let message = sealed_message(session, self.from, self.to, &self.ciphertext);
        verify(identity, &message, &self.signature)
    }
}

/// Stage 2, server → client: the sealed shares addressed to it by neighbours that shared.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MaskRequest {
    /// One per neighbour that completed ShareKeys.
    pub shares: Vec<SealedShares>,
}

/// Stage 3 (consistency check), server → client: who sent a masked input. Each survivor signs
/// the set it was shown, once.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConsistencyRequest {
    /// Clients whose masked input the server holds.
    pub survivors: BTreeSet<ClientIdx>,
}

/// Stage 4, server → client: the survivor set with the signatures the survivors made over it;
/// a client unmasks only for the set it signed, and only once at least `t` of the cohort it
/// knows (itself and its neighbours) signed that same set.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UnmaskRequest {
    /// Clients whose masked input the server holds.
    pub survivors: BTreeSet<ClientIdx>,
    /// Survivor → its signature over the set.
    pub signatures: BTreeMap<ClientIdx, Signature>,
}

impl UnmaskRequest {
    /// The request as `client`, with `neighbours`, needs it: only the signatures it can check
    /// (its own and its neighbours'), so what a device downloads does not grow with the cohort.
    pub fn for_client(&self, client: ClientIdx, neighbours: &NeighbourKeys) -> UnmaskRequest {
        UnmaskRequest {
            survivors: self.survivors.clone(),
            signatures: self
                .signatures
                .iter()
                .filter(|(j, _)| **j == client || neighbours.keys.contains_key(j))
                .map(|(j, s)| (*j, *s))
                .collect(),
        }
    }
}

/// Stage 4, client → server: for each neighbour, the share of its self-mask seed (survivors)
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
pub(super) struct Shares {
    pub(super) from: ClientIdx,
    pub(super) to: ClientIdx,
    pub(super) key: Share,
    pub(super) seed: Share,
}
