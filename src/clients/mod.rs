//! API clients, global: a client created once is known in every region,
//! because its record is a control item of the key table that every region
//! reads (`control#client#{sha256 of the API key}`; only the digest is
//! stored). Each instance caches what it looked up for [`CACHE_FOR`], so a
//! request costs no store read once its key is known, and a revoked client
//! is refused everywhere within that delay. Made-up keys cost little: one
//! not shaped like a keyfence key is refused unread, and well-formed unknown
//! ones are cached apart from known ones (so they evict none), one read per
//! digest and delay however many ask.

mod profile;
mod store;

use std::sync::Arc;
use std::time::Duration;

use quick_cache::sync::Cache;
use serde::Serialize;
use tokio::time::Instant;

use crate::domain::{ApiKey, ClientId};

pub use profile::{FairUse, Limits, Profile, Refusal};
use store::store;
pub use store::{ClientStore, ClientsError};

/// How long a looked-up key is trusted: the revocation delay.
pub const CACHE_FOR: Duration = Duration::from_secs(5);

/// Active clients' keys kept at most.
const KNOWN_ENTRIES: usize = 100_000;

/// Other lookups kept at most (the least recently used make room).
const UNKNOWN_ENTRIES: usize = 10_000;

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

/// The clients, as this instance sees them. Known keys and unknown ones
/// are cached apart, so a flood of made-up keys evicts no legitimate one;
/// concurrent lookups of one digest make one store read between them; a
/// presented key not shaped like a keyfence key is refused with no read.
#[derive(Clone)]
pub struct Directory {
    store: ClientStore,
    /// Digests of active clients' keys, and when each was looked up.
    known: Arc<Cache<String, (Instant, ClientId)>>,
    /// The last lookup of every other digest (and, while a lookup runs, the
    /// place its concurrent twins wait on).
    unknown: Arc<Cache<String, (Instant, Option<ClientId>)>>,
    /// Profiles looked up, and when.
    profiles: Arc<Cache<ClientId, (Instant, Arc<Profile>)>>,
}

impl std::fmt::Debug for Directory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Directory").field("known", &self.known.len()).field("unknown", &self.unknown.len()).finish()
    }
}

impl Directory {
    pub fn new(store: ClientStore) -> Self {
        Self {
            store,
            known: Arc::new(Cache::new(KNOWN_ENTRIES)),
            unknown: Arc::new(Cache::new(UNKNOWN_ENTRIES)),
            profiles: Arc::new(Cache::new(KNOWN_ENTRIES)),
        }
    }

    pub fn store(&self) -> &ClientStore {
        &self.store
    }

    /// The active client a presented key belongs to, if any.
    pub async fn find(&self, key: &ApiKey) -> Result<Option<ClientId>, ClientsError> {
        if !key.is_well_formed() {
            return Ok(None);
        }
        let digest = key.digest();
        if let Some((_, client)) = self.known.get(&digest).filter(|(at, _)| at.elapsed() < CACHE_FOR) {
            return Ok(Some(client));
        }
        let found = fresh_or_load(&self.unknown, &digest, async || {
            let found = self.store.by_digest(&digest).await?.filter(|c| c.revoked_at.is_none()).map(|c| c.id);
            let outcome = if found.is_some() { "found" } else { "unknown" };
            metrics::counter!("keyfence_client_lookups_total", "outcome" => outcome).increment(1);
            Ok(found)
        })
        .await?;
        if let Some(client) = found {
            self.known.insert(digest.clone(), (Instant::now(), client));
            self.unknown.remove(&digest);
        }
        Ok(found)
    }

    /// Client `id`'s profile, as of at most [`CACHE_FOR`] ago (a change
    /// made with the CLI reaches every instance within that delay);
    /// concurrent lookups make one read.
    pub async fn profile(&self, id: ClientId) -> Result<Arc<Profile>, ClientsError> {
        fresh_or_load(&self.profiles, &id, async || Ok(Arc::new(self.store.profile(id).await?))).await
    }
}

/// What `cache` holds for `key`, if it was loaded less than [`CACHE_FOR`]
/// ago; otherwise one caller runs `load` and the callers asking meanwhile
/// wait for its value (quick_cache's placeholder), so a key is read once.
async fn fresh_or_load<K, V>(
    cache: &Cache<K, (Instant, V)>,
    key: &K,
    load: impl AsyncFnOnce() -> Result<V, ClientsError>,
) -> Result<V, ClientsError>
where
    K: Eq + std::hash::Hash + Clone,
    V: Clone,
{
    let looked = match cache.get_value_or_guard_async(key).await {
        Ok((at, value)) if at.elapsed() < CACHE_FOR => return Ok(value),
        Ok(_) => {
            cache.remove(key);
            cache.get_value_or_guard_async(key).await
        }
        Err(guard) => Err(guard),
    };
    match looked {
        // Loaded meanwhile by another caller.
        Ok((_, value)) => Ok(value),
        Err(guard) => {
            let value = load().await?;
            let _ = guard.insert((Instant::now(), value.clone()));
            Ok(value)
        }
    }
}
