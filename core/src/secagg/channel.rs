//! The share channel between two neighbours (sealing and opening shares), and the evidence an
//! accusation carries.
//!
//! Neighbours seal their shares to each other under a key from Diffie–Hellman over
//! Ristretto255. A device whose neighbour's sealed shares do not open reveals that one
//! channel's shared point with a Chaum–Pedersen proof that it is the Diffie–Hellman of its own
//! advertised key and the neighbour's (`log_G(A) = log_B(K)`). The coordinator checks the proof
//! and tries the relayed ciphertext itself: only an accusation it can confirm removes anyone,
//! and a false one removes the accuser. Revealing the point opens that one channel and no
//! other: whichever of the two lied already knew what it carries.

use chacha20poly1305::ChaCha20Poly1305;
use chacha20poly1305::aead::KeyInit;
use curve25519_dalek::constants::RISTRETTO_BASEPOINT_POINT;
use curve25519_dalek::ristretto::{CompressedRistretto, RistrettoPoint};
use curve25519_dalek::scalar::Scalar;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha512};

use super::ClientIdx;
use super::identity::{DeviceIdentity, sealed_message};
use super::messages::{SealedShares, Shares};
use super::prg::derive;

/// A device's secret for its share channels, one per round.
pub(super) struct ChannelSecret(Scalar);

/// What a device proves its channel point with: a Chaum–Pedersen proof in (challenge,
/// response) form.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChannelProof {
    /// The challenge c.
    pub challenge: [u8; 32],
    /// The response s = r + c·x.
    pub response: [u8; 32],
}

/// A device's claim that `accused`'s sealed shares to it did not open, with the evidence: the
/// channel's shared point and the proof that it is the Diffie–Hellman of the two advertised
/// channel keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Accusation {
    /// The neighbour whose shares did not open.
    pub accused: ClientIdx,
    /// The shared point of the accuser's channel with it, compressed.
    pub shared: [u8; 32],
    /// That `shared` is the Diffie–Hellman of the accuser's advertised key and the accused's.
    pub proof: ChannelProof,
}

impl ChannelSecret {
    /// The secret from 64 uniformly random bytes.
    pub(super) fn from_wide(bytes: &[u8; 64]) -> Self {
        ChannelSecret(Scalar::from_bytes_mod_order_wide(bytes))
    }

    /// The public key to advertise.
    pub(super) fn public(&self) -> [u8; 32] {
        RistrettoPoint::mul_base(&self.0).compress().to_bytes()
    }

    /// The shared point with `other` (its advertised key); `None` if that is not a point.
    pub(super) fn agree(&self, other: &[u8; 32]) -> Option<[u8; 32]> {
        let other = CompressedRistretto(*other).decompress()?;
        Some((self.0 * other).compress().to_bytes())
    }

    /// The proof that `shared` = x·`other` where `public()` = x·G. The nonce is derived from
    /// the secret and the statement, so no randomness is needed and none can be reused.
    pub(super) fn prove(&self, other: &[u8; 32], shared: &[u8; 32]) -> Option<ChannelProof> {
        let base = CompressedRistretto(*other).decompress()?;
        let public = self.public();
        let mut nonce = Sha512::new();
        nonce.update(b"starling-secagg-channel-nonce-v1");
        nonce.update(self.0.as_bytes());
        nonce.update(other);
        nonce.update(shared);
        let r = Scalar::from_bytes_mod_order_wide(&nonce.finalize().into());
        let (commit_g, commit_b) = (RistrettoPoint::mul_base(&r), r * base);
        let c = challenge(&public, other, shared, &commit_g, &commit_b);
        Some(ChannelProof { challenge: c.to_bytes(), response: (r + c * self.0).to_bytes() })
    }
}

/// Whether `bytes` are a Ristretto point (a channel key a device can agree with).
pub(super) fn is_point(bytes: &[u8; 32]) -> bool {
    CompressedRistretto(*bytes).decompress().is_some()
}

/// Whether `proof` shows `shared` = x·`other` for the x with x·G = `public`.
pub(super) fn verify(
    public: &[u8; 32],
    other: &[u8; 32],
    shared: &[u8; 32],
    proof: &ChannelProof,
) -> bool {
    let points = [public, other, shared].map(|p| CompressedRistretto(*p).decompress());
    let [Some(a), Some(b), Some(k)] = points else { return false };
    let (Some(c), Some(s)) = (
        Option::<Scalar>::from(Scalar::from_canonical_bytes(proof.challenge)),
        Option::<Scalar>::from(Scalar::from_canonical_bytes(proof.response)),
    ) else {
        return false;
    };
    // s·G − c·A = r·G and s·B − c·K = r·B for the prover's r.
    let commit_g = RistrettoPoint::mul_base(&s) - c * a;
    let commit_b = s * b - c * k;
    challenge(public, other, shared, &commit_g, &commit_b) == c
}

fn challenge(
    public: &[u8; 32],
    other: &[u8; 32],
    shared: &[u8; 32],
    commit_g: &RistrettoPoint,
    commit_b: &RistrettoPoint,
) -> Scalar {
    let mut h = Sha512::new();
    h.update(b"starling-secagg-channel-proof-v1");
    h.update(RISTRETTO_BASEPOINT_POINT.compress().as_bytes());
    h.update(public);
    h.update(other);
    h.update(shared);
    h.update(commit_g.compress().as_bytes());
    h.update(commit_b.compress().as_bytes());
    Scalar::from_bytes_mod_order_wide(&h.finalize().into())
}

/// The AEAD of the share channel between `a` and `b` (either way round) whose shared point is
/// `shared`.
fn share_cipher(
    shared: &[u8; 32],
    a: ClientIdx,
    b: ClientIdx,
    session: &[u8; 16],
) -> ChaCha20Poly1305 {
    ChaCha20Poly1305::new(&derive(shared, b"share", a, b, session).into())
}

/// Seals `shares` on the channel with point `shared`, signed by their sender, `identity`.
pub(super) fn seal(
    shared: &[u8; 32],
    shares: &Shares,
    session: &[u8; 16],
    identity: &DeviceIdentity,
) -> SealedShares {
    use chacha20poly1305::aead::{Aead, Payload};
    let plain = crate::codec::to_vec(shares).expect("shares encode");
    let ciphertext = share_cipher(shared, shares.from, shares.to, session)
        .encrypt(&share_nonce(shares.from, shares.to).into(), Payload { msg: &plain, aad: session })
        .expect("encryption into a Vec cannot fail");
    let (from, to) = (shares.from, shares.to);
    let signature = identity.sign(&sealed_message(session, from, to, &ciphertext));
    SealedShares { from, to, ciphertext, signature }
}

/// The shares `sealed` carries if it opens on the channel with point `shared` and holds what it
/// says: shares from its sender to its recipient, every value in the field. The recipient and
/// the coordinator checking an accusation ask the same question.
pub(super) fn open(shared: &[u8; 32], sealed: &SealedShares, session: &[u8; 16]) -> Option<Shares> {
    use chacha20poly1305::aead::{Aead, Payload};
    let plain = share_cipher(shared, sealed.from, sealed.to, session)
        .decrypt(
            &share_nonce(sealed.from, sealed.to).into(),
            Payload { msg: &sealed.ciphertext, aad: session },
        )
        .ok()?;
    crate::codec::decode::<Shares>(&plain).ok().filter(|shares| {
        shares.from == sealed.from
            && shares.to == sealed.to
            && shares.key.iter().chain(&shares.seed).all(|&v| v < super::shamir::P)
    })
}

fn share_nonce(from: ClientIdx, to: ClientIdx) -> [u8; 12] {
    let mut n = [0u8; 12];
    n[..4].copy_from_slice(&from.to_le_bytes());
    n[4..8].copy_from_slice(&to.to_le_bytes());
    n
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    /// A point no client's channel is on.
    pub(in crate::secagg) fn some_point() -> [u8; 32] {
        RistrettoPoint::mul_base(&Scalar::from(7u64)).compress().to_bytes()
    }

    fn secret(byte: u8) -> ChannelSecret {
        ChannelSecret::from_wide(&[byte; 64])
    }

    #[test]
    fn both_ends_agree_and_an_honest_proof_verifies() {
        let (a, b) = (secret(1), secret(2));
        let (pa, pb) = (a.public(), b.public());
        let k = a.agree(&pb).unwrap();
        assert_eq!(k, b.agree(&pa).unwrap());
        let proof = a.prove(&pb, &k).unwrap();
        assert!(verify(&pa, &pb, &k, &proof));
    }

    #[test]
    fn a_wrong_point_key_or_proof_does_not_verify() {
        let (a, b, c) = (secret(1), secret(2), secret(3));
        let (pa, pb, pc) = (a.public(), b.public(), c.public());
        let k = a.agree(&pb).unwrap();
        let proof = a.prove(&pb, &k).unwrap();
        // Another point claimed as the channel's (the channel with someone else).
        let other = a.agree(&pc).unwrap();
        assert!(!verify(&pa, &pb, &other, &proof));
        assert!(!verify(&pa, &pb, &other, &a.prove(&pb, &other).unwrap()));
        // The proof of one statement for another: other accuser, other accused.
        assert!(!verify(&pc, &pb, &k, &proof));
        assert!(!verify(&pa, &pc, &k, &proof));
        // A tampered response or challenge, bytes that are not a point.
        let mut bad = proof;
        bad.response[0] ^= 1;
        assert!(!verify(&pa, &pb, &k, &bad));
        let mut bad = proof;
        bad.challenge[3] ^= 1;
        assert!(!verify(&pa, &pb, &k, &bad));
        assert!(!verify(&pa, &pb, &[0xff; 32], &proof));
        assert!(secret(1).agree(&[0xff; 32]).is_none());
    }
}
