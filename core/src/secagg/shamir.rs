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

/// Lagrange interpolation through shares at fixed points: the `t` inversions are done once,
/// then each point the polynomials are evaluated at costs `t²` multiplications.
struct Lagrange<'a> {
    shares: &'a [(ClientIdx, Share)],
    /// `1 / Π_{j≠i} (x_j − x_i)` for each share `i`.
    inverse_denominators: Vec<u64>,
}

impl<'a> Lagrange<'a> {
    /// Through exactly `shares` (at distinct non-zero points).
    fn through(shares: &'a [(ClientIdx, Share)]) -> Self {
        let x = |i: usize| u64::from(shares[i].0);
        let inverse_denominators = (0..shares.len())
            .map(|i| {
                let d =
                    (0..shares.len()).filter(|&j| j != i).fold(1, |d, j| mul(d, sub(x(j), x(i))));
                inv(d)
            })
            .collect();
        Lagrange { shares, inverse_denominators }
    }

    /// The shared polynomials' values at `at`.
    fn at(&self, at: u64) -> [u64; CHUNKS] {
        let mut values = [0u64; CHUNKS];
        for (i, (_, share)) in self.shares.iter().enumerate() {
            let numerator = self
                .shares
                .iter()
                .enumerate()
                .filter(|&(j, _)| j != i)
                .fold(1, |n, (_, (xj, _))| mul(n, sub(u64::from(*xj), at)));
            let basis = mul(numerator, self.inverse_denominators[i]);
            for c in 0..CHUNKS {
                values[c] = add(values[c], mul(share[c], basis));
            }
        }
        values
    }
}

/// The secret from exactly the given shares (at distinct non-zero points), unchecked.
#[cfg(test)]
pub(super) fn reconstruct(shares: &[(ClientIdx, Share)]) -> Option<[u8; 32]> {
    unchunk(&Lagrange::through(shares).at(0))
}

/// A secret rebuilt from more shares than it needs, with the holders whose shares were off.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Rebuilt {
    pub(super) secret: [u8; 32],
    /// Holders whose shares do not lie on the polynomial that rebuilds `secret`.
    pub(super) inconsistent: Vec<ClientIdx>,
}

/// The secret of a `t`-of-`k` sharing that `accept` recognizes (it checks the secret against
/// a commitment or public key), from all the `shares` gathered (at least `t`). The first `t`
/// rebuild a candidate; if `accept` refuses it and there are spare shares, the candidates
/// leaving out one share each are tried, so a single holder that returned a wrong share is
/// found and left out. Every share not on the accepted polynomial is named. `None` when no
/// candidate is accepted: the shares cannot be trusted, and nothing may be rebuilt from them.
pub(super) fn reconstruct_checked(
    shares: &[(ClientIdx, Share)],
    t: usize,
    accept: impl Fn(&[u8; 32]) -> bool,
) -> Option<Rebuilt> {
    if t == 0 || shares.len() < t {
        return None;
    }
    let rebuilt = |basis: &[(ClientIdx, Share)]| -> Option<Rebuilt> {
        let polynomial = Lagrange::through(basis);
        let secret = unchunk(&polynomial.at(0)).filter(|s| accept(s))?;
        let inconsistent = shares
            .iter()
            .filter(|share| !basis.contains(share) && polynomial.at(u64::from(share.0)) != share.1)
            .map(|(x, _)| *x)
            .collect();
        Some(Rebuilt { secret, inconsistent })
    };
    if let Some(found) = rebuilt(&shares[..t]) {
        return Some(found);
    }
    if shares.len() == t {
        return None;
    }
    // Leaving out a share past the first t would rebuild from the same t again.
    (0..t).find_map(|left_out| {
        let others: Vec<(ClientIdx, Share)> = shares
            .iter()
            .enumerate()
            .filter(|&(i, _)| i != left_out)
            .map(|(_, s)| *s)
            .take(t)
            .collect();
        rebuilt(&others)
    })
}
