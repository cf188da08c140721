//! The finished answers this instance has given or seen, kept in memory so
//! that a replay costs no key-store round trip.
//!
//! Safe because a finished key's answer never changes while the key lives:
//! every owner write is conditioned on the item being started under that
//! owner, takeovers and failovers only move started items, and the
//! reconciler only recreates keys that are missing, with the answer the
//! ledger stored. An entry is used only until the key's `expires_at`, the
//! instant the key store itself starts treating the key as absent (so a key
//! reused after its retention is claimed, and paid, anew). Bounded: the
//! least recently used entries make room for new ones.

use std::sync::Arc;

use crate::domain::{Millis, RequestHash, ScopedKey, StoredResponse};

/// How many answers an instance keeps (a few kilobytes each at most).
const CAPACITY: usize = 10_000;

/// A finished key's request and answer, and when the key expires.
pub(super) struct Known {
    pub request_hash: RequestHash,
    pub response: StoredResponse,
    /// Seconds since the epoch, as the key item stores it.
    expires_at: u64,
}

pub(super) struct Answers {
    cache: quick_cache::sync::Cache<ScopedKey, Arc<Known>>,
}

impl Answers {
    pub fn new() -> Self {
        Self { cache: quick_cache::sync::Cache::new(CAPACITY) }
    }

    /// Keeps a finished key's answer; a key with no expiry is not kept.
    pub fn remember(
        &self,
        key: &ScopedKey,
        request_hash: &RequestHash,
        response: &StoredResponse,
        expires_at: Option<u64>,
    ) {
        if let Some(expires_at) = expires_at {
            let known = Known { request_hash: request_hash.clone(), response: response.clone(), expires_at };
            self.cache.insert(key.clone(), Arc::new(known));
        }
    }

    /// The answer kept for `key`, unless the key has expired by `now`.
    pub fn recall(&self, key: &ScopedKey, now: Millis) -> Option<Arc<Known>> {
        let known = self.cache.get(key)?;
        if known.expires_at < now.as_secs() {
            self.cache.remove(key);
            return None;
        }
        Some(known)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::time::Duration;

    use super::*;
    use crate::domain::{ClientId, IdempotencyKey};

    #[test]
    fn an_answer_is_recalled_until_its_key_expires_and_never_after() {
        let answers = Answers::new();
        let key = ScopedKey::new(ClientId::generate(), IdempotencyKey::parse("k-1").unwrap());
        let hash = RequestHash::from_hex("ab".into());
        let response = StoredResponse { status: 201, headers: BTreeMap::new(), body: b"{}".to_vec() };
        let now = Millis::now();
        let expires_at = now.plus(Duration::from_secs(60)).as_secs();
        answers.remember(&key, &hash, &response, Some(expires_at));
        let known = answers.recall(&key, now).expect("kept");
        assert_eq!((&known.request_hash, &known.response), (&hash, &response));
        assert!(answers.recall(&key, now.plus(Duration::from_secs(61))).is_none(), "past its expiry");
        assert!(answers.recall(&key, now).is_none(), "and forgotten");

        let other = ScopedKey::new(ClientId::generate(), IdempotencyKey::parse("k-2").unwrap());
        answers.remember(&other, &hash, &response, None);
        assert!(answers.recall(&other, now).is_none(), "a key without an expiry is not kept");
    }
}
