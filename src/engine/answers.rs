//! The finished answers this instance has given or seen, kept in memory so
//! that a replay costs no key-store round trip.
//!
//! Safe because a finished key's answer never changes while the key lives:
//! every owner write is conditioned on the item being started under that
//! owner, takeovers and failovers only move started items, and the
//! reconciler only recreates keys that are missing, with the answer the
//! ledger stored. An entry is used only until the retention's grace before
//! the key's `expires_at` (see [`Retention`]): the key store starts treating
//! the key as absent a grace after it, so even a clock running behind by up
//! to the grace never replays a key that was since claimed, and paid, anew.
//! Bounded: the least recently used entries make room for new ones.

use std::sync::Arc;

use crate::domain::{Millis, RequestHash, Retention, ScopedKey, StoredResponse};

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

    /// The answer kept for `key`, unless the key is too close to its end at `now`.
    pub fn recall(&self, key: &ScopedKey, now: Millis, retention: &Retention) -> Option<Arc<Known>> {
        let known = self.cache.get(key)?;
        if !retention.replayable(known.expires_at, now) {
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
    fn an_answer_is_recalled_until_a_grace_before_its_key_expires_and_never_after() {
        let answers = Answers::new();
        let retention = Retention { keep: Duration::from_secs(60), grace: Duration::from_secs(10) };
        let key = ScopedKey::new(ClientId::generate(), IdempotencyKey::parse("k-1").unwrap());
        let hash = RequestHash::from_hex("ab".into());
        let response = StoredResponse { status: 201, headers: BTreeMap::new(), body: b"{}".to_vec() };
        let now = Millis::now();
        let expires_at = retention.expires_at(now).as_secs();
        answers.remember(&key, &hash, &response, Some(expires_at));
        let known = answers.recall(&key, now, &retention).expect("kept");
        assert_eq!((&known.request_hash, &known.response), (&hash, &response));
        assert!(answers.recall(&key, now.plus(Duration::from_secs(45)), &retention).is_some());
        assert!(answers.recall(&key, now.plus(Duration::from_secs(51)), &retention).is_none(), "within the grace");
        assert!(answers.recall(&key, now, &retention).is_none(), "and forgotten");

        let other = ScopedKey::new(ClientId::generate(), IdempotencyKey::parse("k-2").unwrap());
        answers.remember(&other, &hash, &response, None);
        assert!(answers.recall(&other, now, &retention).is_none(), "a key without an expiry is not kept");
    }
}
