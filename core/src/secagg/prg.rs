//! Key agreement, key derivation and the mask generator: X25519 for pairwise masks, HKDF-SHA256,
//! and the ChaCha20 keystream as the PRG (the share channel's encryption is `channel`'s).

use chacha20::cipher::{KeyIvInit, StreamCipher};
use sha2::Sha256;
use x25519_dalek::{PublicKey, StaticSecret};

use super::ClientIdx;

/// The ChaCha20 keystream under a 32-byte seed: a cryptographic PRG.
pub(super) struct Keystream(pub(super) chacha20::ChaCha20);

impl Keystream {
    pub(super) fn new(seed: &[u8; 32], stream: u8) -> Self {
        let mut nonce = [0u8; 12];
        nonce[0] = stream;
        Keystream(chacha20::ChaCha20::new(&(*seed).into(), &nonce.into()))
    }

    pub(super) fn next_u64(&mut self) -> u64 {
        let mut b = [0u8; 8];
        self.0.apply_keystream(&mut b);
        u64::from_le_bytes(b)
    }

    /// Adds (`add`) or subtracts the next `out.len()` keystream ring elements to `out`.
    pub(super) fn mask(mut self, out: &mut [u32], add: bool) {
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

pub(super) fn derive(
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

/// What a client commits to its self-mask seed with, in its key advertisement: the server
/// checks the seed its neighbours' shares rebuild against it, so a neighbour returning a wrong
/// share cannot turn the sum into noise unnoticed. The seed is 32 random bytes, so the hash
/// hides it.
pub(super) fn seed_commitment(seed: &[u8; 32], me: ClientIdx, session: &[u8; 16]) -> [u8; 32] {
    use sha2::Digest;
    let mut h = Sha256::new();
    h.update(b"starling-secagg-self-seed-v1");
    h.update(session);
    h.update(me.to_le_bytes());
    h.update(seed);
    h.finalize().into()
}

/// The seed of the pairwise mask between `me` (secret) and `other` (public).
pub(super) fn pairwise_seed(
    secret: &StaticSecret,
    me: ClientIdx,
    other_pk: &PublicKey,
    other: ClientIdx,
    session: &[u8; 16],
) -> [u8; 32] {
    derive(secret.diffie_hellman(other_pk).as_bytes(), b"mask", me, other, session)
}
