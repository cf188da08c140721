//! Whether a request moved away from a region: the one question every
//! part of a region asks before it acts for a request it once worked (a
//! return, a webhook event, a read, a resume). The key item says so while
//! it lives (another home region); once it is gone (expired past its
//! retention, or another request under the key), the hand-off the new home
//! recorded still does, until this region's reconciler has voided its
//! leftover. Asking the key item alone forgets every move older than the
//! retention: a region restored after a long outage would then act for
//! requests it handed off.

use crate::domain::{Millis, ScopedKey};
use crate::keystore::{KeyStore, KeyStoreError};

use super::{Engine, EngineError};

/// A request that left the region asking.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Moved {
    /// Its home region, while its key item names it.
    pub home: Option<String>,
}

/// Whether the request made under `key` at `created_at` moved away from
/// `region`: its key item names another home, or, with the item gone, a
/// hand-off from `region` waits for it.
pub async fn moved_away<K: KeyStore>(
    keys: &K,
    region: &str,
    key: &ScopedKey,
    created_at: Millis,
) -> Result<Option<Moved>, KeyStoreError> {
    if let Some(item) = keys.get(key).await?.filter(|item| item.created_at == created_at) {
        return Ok((item.home_region != region).then_some(Moved { home: Some(item.home_region) }));
    }
    Ok(keys.handoff_of(region, key, created_at).await?.then_some(Moved { home: None }))
}

impl<K: KeyStore> Engine<K> {
    /// Whether the request made under `key` at `created_at` moved away
    /// from this engine's region (see [`moved_away`]).
    pub async fn moved_away(&self, key: &ScopedKey, created_at: Millis) -> Result<Option<Moved>, EngineError> {
        Ok(moved_away(&self.keys, &self.settings.region, key, created_at).await?)
    }
}
