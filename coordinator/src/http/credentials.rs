//! Device credentials already checked, kept for a while so that a device's check-in, model
//! download and upload read its row once, not three times: at 10 000 devices a round the
//! store answered 30 000 credential reads a round, a large share of what Postgres did beside
//! the updates themselves.
//!
//! A revocation through this coordinator forgets the device at once ([`CredentialCache::forget`]),
//! so it is refused from its next request on, as before. A row changed some other way (there
//! is no such path today: revocation goes through the admin API, which only the leader serves)
//! is seen within [`CREDENTIAL_TTL`]. Replicas serve devices too but would not hear of a
//! revocation through the leader, so they keep nothing ([`CredentialCache::keeping_none`]). Unknown and revoked credentials are never kept:
//! a refusal always asks the store.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use starling_core::DeviceId;

use crate::store::DeviceAccess;

/// How long a checked credential is trusted without reading the store again.
pub const CREDENTIAL_TTL: Duration = Duration::from_secs(30);

/// Credentials kept at most; a full cache drops what has expired, and everything if that is
/// not enough (a credential read again costs one query, so the bound is what matters).
pub const CREDENTIAL_CAPACITY: usize = 100_000;

/// Checked credentials by their SHA-256, with when each was read.
pub struct CredentialCache {
    entries: Mutex<Entries>,
    /// How long a credential is trusted: [`CREDENTIAL_TTL`], or zero on a replica.
    ttl: Duration,
}

impl Default for CredentialCache {
    /// Trusts a checked credential for [`CREDENTIAL_TTL`].
    fn default() -> Self {
        CredentialCache { entries: Mutex::default(), ttl: CREDENTIAL_TTL }
    }
}

#[derive(Default)]
struct Entries {
    by_hash: HashMap<[u8; 32], (DeviceAccess, Instant)>,
    /// Revocations forgotten so far: a read that began before one may have seen the device
    /// still enrolled, so it is not kept ([`CredentialCache::insert`]).
    revocations: u64,
}

/// When a store read began, as the cache counts revocations ([`CredentialCache::read_began`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadBegan(u64);

impl CredentialCache {
    /// A cache that trusts nothing it read: every request reads the store (a replica's; see
    /// the module's note on revocations).
    pub fn keeping_none() -> Self {
        CredentialCache { ttl: Duration::ZERO, ..Self::default() }
    }

    /// The access of the credential hashing to `hash`, if it was read within the TTL.
    pub fn get(&self, hash: &[u8; 32], now: Instant) -> Option<DeviceAccess> {
        if self.ttl.is_zero() {
            return None;
        }
        let entries = self.entries.lock().expect("credential cache poisoned");
        let (access, read_at) = entries.by_hash.get(hash)?;
        (now.saturating_duration_since(*read_at) < self.ttl).then(|| access.clone())
    }

    /// Taken before reading a credential from the store, and handed to [`Self::insert`].
    pub fn read_began(&self) -> ReadBegan {
        ReadBegan(self.entries.lock().expect("credential cache poisoned").revocations)
    }

    /// Keeps a credential the store confirmed in a read that began at `began`, unless a
    /// revocation was forgotten since (the read may predate it).
    pub fn insert(&self, hash: [u8; 32], access: DeviceAccess, began: ReadBegan, now: Instant) {
        let mut entries = self.entries.lock().expect("credential cache poisoned");
        if entries.revocations != began.0 || self.ttl.is_zero() {
            return;
        }
        let by_hash = &mut entries.by_hash;
        if by_hash.len() >= CREDENTIAL_CAPACITY {
            let ttl = self.ttl;
            by_hash.retain(|_, (_, read_at)| now.saturating_duration_since(*read_at) < ttl);
            if by_hash.len() >= CREDENTIAL_CAPACITY {
                by_hash.clear();
            }
        }
        by_hash.insert(hash, (access, now));
    }

    /// Forgets every credential of `device` (its revocation, once it is durable).
    pub fn forget(&self, device: DeviceId) {
        let mut entries = self.entries.lock().expect("credential cache poisoned");
        entries.revocations += 1;
        entries.by_hash.retain(|_, (access, _)| access.device != device);
    }

    /// Credentials kept now.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.entries.lock().expect("credential cache poisoned").by_hash.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn access(device: i64) -> DeviceAccess {
        DeviceAccess { device: DeviceId(device), populations: None, identity_key: None }
    }

    #[test]
    fn a_credential_is_trusted_for_the_ttl_and_read_again_after() {
        let (cache, t0) = (CredentialCache::default(), Instant::now());
        cache.insert([1; 32], access(1), cache.read_began(), t0);
        assert_eq!(cache.get(&[1; 32], t0 + CREDENTIAL_TTL / 2), Some(access(1)));
        assert_eq!(cache.get(&[1; 32], t0 + CREDENTIAL_TTL), None, "expired");
        assert_eq!(cache.get(&[2; 32], t0), None, "never read");
    }

    #[test]
    fn a_revoked_device_is_forgotten_whatever_credential_it_used() {
        let (cache, t0) = (CredentialCache::default(), Instant::now());
        cache.insert([1; 32], access(7), cache.read_began(), t0);
        cache.insert([2; 32], access(7), cache.read_began(), t0);
        cache.insert([3; 32], access(8), cache.read_began(), t0);
        cache.forget(DeviceId(7));
        assert_eq!(cache.get(&[1; 32], t0), None);
        assert_eq!(cache.get(&[2; 32], t0), None);
        assert_eq!(cache.get(&[3; 32], t0), Some(access(8)), "another device is kept");
    }

    /// A request that read the device's row just before its revocation committed must not
    /// put it back after the revocation forgot it.
    #[test]
    fn a_read_that_began_before_a_revocation_is_not_kept() {
        let (cache, t0) = (CredentialCache::default(), Instant::now());
        let began = cache.read_began();
        cache.forget(DeviceId(7));
        cache.insert([1; 32], access(7), began, t0);
        assert_eq!(cache.get(&[1; 32], t0), None);
        cache.insert([1; 32], access(7), cache.read_began(), t0);
        assert_eq!(cache.get(&[1; 32], t0), Some(access(7)), "a read after it is kept");
    }

    #[test]
    fn a_full_cache_drops_the_expired_then_everything() {
        let (cache, t0) = (CredentialCache::default(), Instant::now());
        for i in 0..CREDENTIAL_CAPACITY {
            let mut hash = [0; 32];
            hash[..8].copy_from_slice(&(i as u64).to_le_bytes());
            cache.insert(hash, access(i as i64), cache.read_began(), t0);
        }
        // All still fresh: the cache starts over rather than grow.
        cache.insert([0xff; 32], access(-1), cache.read_began(), t0);
        assert_eq!(cache.len(), 1);
        assert_eq!(cache.get(&[0xff; 32], t0), Some(access(-1)));
    }
}
