//! Device identities: the Ed25519 key a device registers when it enrolls, with which it signs
//! its key advertisement and the survivor set of each secure round. A coordinator that relays
//! the protocol's messages can then neither substitute a device's keys, nor replay them from
//! another round, nor show two survivor sets to the cohort without the devices noticing.
//!
//! And the operator's enrolment authority, which certifies identity keys: devices that pin its
//! public key accept as neighbours only identities it certified, so a coordinator cannot make
//! up members (it holds no certificate for a key it invented). The authority's secret is the
//! operator's, kept away from the coordinator, and is not its TLS key.

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

/// The operator's key that certifies device identities at enrolment (see the module's doc): an
/// Ed25519 key like a device's, kept for another purpose.
#[derive(Clone)]
pub struct EnrolmentAuthority(DeviceIdentity);

impl std::fmt::Debug for EnrolmentAuthority {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("EnrolmentAuthority").field(&self.public_hex()).finish()
    }
}

impl EnrolmentAuthority {
    /// The authority whose secret is these 32 bytes.
    pub fn from_secret(secret: [u8; 32]) -> Self {
        EnrolmentAuthority(DeviceIdentity::from_secret(secret))
    }

    /// The secret, for the operator to keep (never on the coordinator).
    pub fn secret(&self) -> [u8; 32] {
        self.0.secret()
    }

    /// The public key devices pin.
    pub fn public(&self) -> [u8; 32] {
        self.0.public()
    }

    /// The authority whose secret is written as 64 hex digits (as `starling enrolment
    /// new-authority` stores it).
    pub fn from_secret_hex(text: &str) -> Result<Self, String> {
        hex_bytes(text)
            .map(EnrolmentAuthority::from_secret)
            .ok_or_else(|| "not an enrolment authority's secret (64 hex digits)".to_owned())
    }

    /// The secret as 64 hex digits.
    pub fn secret_hex(&self) -> String {
        hex::encode(self.secret())
    }

    /// The public key as 64 hex digits.
    pub fn public_hex(&self) -> String {
        key_hex(&self.public())
    }

    /// The certificate of the device identity key `identity`.
    pub fn certify(&self, identity: &[u8; 32]) -> Signature {
        self.0.sign(&certificate_message(identity))
    }
}

/// What the enrolment authority signs: the identity key, for this purpose only.
fn certificate_message(identity: &[u8; 32]) -> Vec<u8> {
    let mut m = Vec::with_capacity(64);
    m.extend_from_slice(b"starling enrolment certificate v1");
    m.extend_from_slice(identity);
    m
}

/// `N` bytes written as `2N` hex digits, surrounding whitespace ignored.
fn hex_bytes<const N: usize>(text: &str) -> Option<[u8; N]> {
    hex::decode(text.trim()).ok()?.try_into().ok()
}

/// A public key (a device's identity key, an authority's) as the 64 hex digits
/// [`parse_public_key`] reads.
pub fn key_hex(key: &[u8; 32]) -> String {
    hex::encode(key)
}

/// An Ed25519 public key written as 64 hex digits (an enrolment authority's, as an operator
/// configures it), checked to be a key.
pub fn parse_public_key(text: &str) -> Result<[u8; 32], String> {
    let bytes: [u8; 32] =
        hex_bytes(text).ok_or_else(|| format!("{:?} is not 64 hex digits", text.trim()))?;
    VerifyingKey::from_bytes(&bytes).map_err(|_| "not an Ed25519 public key".to_owned())?;
    Ok(bytes)
}

/// Whether `certificate` is the enrolment authority `authority`'s over the identity key
/// `identity`.
pub fn certificate_is_valid(
    authority: &[u8; 32],
    identity: &[u8; 32],
    certificate: &Signature,
) -> bool {
    verify(authority, &certificate_message(identity), certificate)
}

impl Signature {
    /// The 64 bytes, R then s, as Ed25519 writes them.
    pub fn to_bytes(&self) -> [u8; 64] {
        let mut bytes = [0u8; 64];
        bytes[..32].copy_from_slice(&self.r);
        bytes[32..].copy_from_slice(&self.s);
        bytes
    }

    /// The signature of these 64 bytes.
    pub fn from_bytes(bytes: &[u8; 64]) -> Self {
        Signature {
            r: bytes[..32].try_into().expect("32 bytes"),
            s: bytes[32..].try_into().expect("32 bytes"),
        }
    }

    /// The 128 hex digits of [`Signature::to_bytes`].
    pub fn to_hex(&self) -> String {
        hex::encode(self.to_bytes())
    }

    /// Reads 128 hex digits (an enrolment certificate, as `starling enrolment certify` prints
    /// it).
    pub fn from_hex(text: &str) -> Result<Self, String> {
        hex_bytes(text)
            .map(|b| Signature::from_bytes(&b))
            .ok_or_else(|| format!("{:?} is not 128 hex digits", text.trim()))
    }
}

/// Whether `signature` is `identity`'s over `message` (strict verification: no malleable or
/// small-order keys).
pub(super) fn verify(identity: &[u8; 32], message: &[u8], signature: &Signature) -> bool {
    let Ok(key) = VerifyingKey::from_bytes(identity) else { return false };
    key.verify_strict(message, &ed25519_dalek::Signature::from_bytes(&signature.to_bytes())).is_ok()
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
