//! Shamir `t`-of-`k` sharing of 32-byte secrets over GF(2^61 − 1): how a device's secrets
//! survive it dropping out, without any `t − 1` neighbours learning them.

use std::collections::BTreeMap;

use super::ClientIdx;
use super::prg::Keystream;

pub(super) const P: u64 = (1 << 61) - 1;
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
pub(super) fn share(
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
pub(super) fn reconstruct(shares: &[(ClientIdx, Share)]) -> Option<[u8; 32]> {
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
