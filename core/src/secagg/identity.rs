//! Device identities: the Ed25519 key a device registers when it enrolls, with which it signs
//! its key advertisement and the survivor set of each secure round. A coordinator that relays
//! the protocol's messages can then neither substitute a device's keys, nor replay them from
//! another round, nor show two survivor sets to the cohort without the devices noticing.

use std::collections::BTreeSet;

use ed25519_dalek::{Signer, SigningKey, VerifyingKey};
use serde::{Deserialize, Serialize};

use super::{AdvertiseKeys, ClientIdx};

/// A device's long-lived signing key: created at enrollment, kept with its credential, its
/// public half registered with the coordinator.
#[derive(Clone)]
pub struct DeviceIdentity(SigningKey);

impl std::fmt::Debug for DeviceIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The secret never appears in logs.
        f.debug_tuple("DeviceIdentity").field(&hex::encode(self.public())).finish()
    }
}

impl DeviceIdentity {
    /// The identity whose secret is these 32 bytes (fresh OS randomness for a new device).
    pub fn from_secret(secret: [u8; 32]) -> Self {
        DeviceIdentity(SigningKey::from_bytes(&secret))
    }

    /// The secret, for the device to store beside its credential.
    pub fn secret(&self) -> [u8; 32] {
        self.0.to_bytes()
    }

    /// The public key the device registers at enrollment.
    pub fn public(&self) -> [u8; 32] {
        self.0.verifying_key().to_bytes()
    }

    pub(super) fn sign(&self, message: &[u8]) -> Signature {
        let bytes = self.0.sign(message).to_bytes();
        Signature {
            r: bytes[..32].try_into().expect("32 bytes"),
            s: bytes[32..].try_into().expect("32 bytes"),
        }
    }
}

/// An Ed25519 signature.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Signature {
    /// Its first half, the commitment R.
    pub r: [u8; 32],
    /// Its second half, the response s.
    pub s: [u8; 32],
}

/// Whether `signature` is `identity`'s over `message` (strict verification: no malleable or
/// small-order keys).
pub(super) fn verify(identity: &[u8; 32], message: &[u8], signature: &Signature) -> bool {
    let Ok(key) = VerifyingKey::from_bytes(identity) else { return false };
    let mut bytes = [0u8; 64];
    bytes[..32].copy_from_slice(&signature.r);
    bytes[32..].copy_from_slice(&signature.s);
    key.verify_strict(message, &ed25519_dalek::Signature::from_bytes(&bytes)).is_ok()
}

/// What a device signs when it advertises its keys: the keys, bound to the round (the session)
/// and to its index in it, so an advertisement is good for that one seat only.
pub(super) fn advert_message(
    session: &[u8; 16],
    client: ClientIdx,
    keys: &AdvertiseKeys,
) -> Vec<u8> {
    let mut m = Vec::with_capacity(160);
    m.extend_from_slice(b"starling secagg advertisement v1");
    m.extend_from_slice(session);
    m.extend_from_slice(&client.to_le_bytes());
    m.extend_from_slice(&keys.identity);
    m.extend_from_slice(&keys.cipher_pk);
    m.extend_from_slice(&keys.mask_pk);
    m.extend_from_slice(&keys.seed_commitment);
    m
}

/// What a survivor signs in the consistency check: the round and the survivor set it was shown.
pub(super) fn survivors_message(session: &[u8; 16], survivors: &BTreeSet<ClientIdx>) -> Vec<u8> {
    let mut m = Vec::with_capacity(60 + 4 * survivors.len());
    m.extend_from_slice(b"starling secagg survivors v1");
    m.extend_from_slice(session);
    m.extend_from_slice(&(survivors.len() as u64).to_le_bytes());
    for i in survivors {
        m.extend_from_slice(&i.to_le_bytes());
    }
    m
}

/// What a device signs when it sends sealed shares: the round, both ends and the ciphertext.
pub(super) fn sealed_message(
    session: &[u8; 16],
    from: ClientIdx,
    to: ClientIdx,
    ciphertext: &[u8],
) -> Vec<u8> {
    let mut m = Vec::with_capacity(60 + ciphertext.len());
    m.extend_from_slice(b"starling secagg sealed shares v1");
    m.extend_from_slice(session);
    m.extend_from_slice(&from.to_le_bytes());
    m.extend_from_slice(&to.to_le_bytes());
    m.extend_from_slice(ciphertext);
    m
}

/// Whether `keys` carries its identity's signature for seat `client` of the round `session`.
pub(super) fn advert_is_signed(
    session: &[u8; 16],
    client: ClientIdx,
    keys: &AdvertiseKeys,
) -> bool {
    verify(&keys.identity, &advert_message(session, client, keys), &keys.signature)
}
