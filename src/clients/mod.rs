//! API clients, global: a client created once is known in every region,
//! because its record is a control item of the key table that every region
//! reads (`control#client#{sha256 of the API key}`; only the digest is
//! stored). Each instance caches what it looked up for [`CACHE_FOR`], so a
//! request costs no store read once its key is known, and a revoked client
//! is refused everywhere within that delay.

mod store;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::Serialize;
use tokio::time::Instant;

use crate::domain::{ApiKey, ClientId};

pub use store::{ClientStore, ClientsError};

/// How long a looked-up key is trusted: the revocation delay.
pub const CACHE_FOR: Duration = Duration::from_secs(5);

/// Cached lookups kept at most; past it the cache starts afresh (so a flood
/// of made-up keys cannot grow it without bound).
const CACHE_ENTRIES: usize = 100_000;

/// A client as the directory records it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ClientRecord {
    pub id: ClientId,
    pub name: String,
    /// Milliseconds since the epoch.
    pub created_at: u64,
    /// Set once revoked: the client's key is refused from then on.
    pub revoked_at: Option<u64>,
}

/// Lookups by key digest: when, and what was found (`None`: no active client).
type Cache = HashMap<String, (Instant, Option<ClientId>)>;

/// The clients, as this instance sees them.
#[derive(Clone, Debug)]
pub struct Directory {
    store: ClientStore,
    cache: Arc<Mutex<Cache>>,
}

impl Directory {
    pub fn new(store: ClientStore) -> Self {
        Self { store, cache: Arc::default() }
    }

    pub fn store(&self) -> &ClientStore {
        &self.store
    }

    /// The active client a presented key belongs to, if any.
    pub async fn find(&self, key: &ApiKey) -> Result<Option<ClientId>, ClientsError> {
        let digest = key.digest();
        if let Some((at, found)) = self.lock().get(&digest)
            && at.elapsed() < CACHE_FOR
        {
            return Ok(*found);
        }
        let found = self.store.by_digest(&digest).await?.filter(|c| c.revoked_at.is_none()).map(|c| c.id);
        let mut cache = self.lock();
        if cache.len() >= CACHE_ENTRIES {
            cache.clear();
        }
        cache.insert(digest, (Instant::now(), found));
        Ok(found)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Cache> {
        self.cache.lock().unwrap_or_else(|p| p.into_inner())
    }
}
