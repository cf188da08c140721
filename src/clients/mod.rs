//! API clients, global: a client created once is known in every region,
//! because its record is a control item of the key table that every region
//! reads ([`store`]; of its keys only digests are stored). A presented key
//! is looked up by its digest's pointer, and admitted if its client's
//! record holds it, valid ([`keys`]), and the client is not revoked. Each
//! instance caches what it looked up for [`CACHE_FOR`], so a request costs
//! no store read once its key is known, and a revoked client or key is
//! refused everywhere within that delay. Made-up keys cost little: one not
//! shaped like a keyfence key is refused unread, and well-formed unknown
//! ones are cached apart from known ones (so they evict none), one read per
//! digest and delay however many ask.

mod keys;
mod legacy;
mod profile;
mod store;

use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;

use governor::{DefaultDirectRateLimiter, Quota, RateLimiter};
use quick_cache::sync::Cache;
use serde::Serialize;
use std::time::Instant;

use crate::domain::{ApiKey, ClientId};

pub use keys::Rotated;
pub use legacy::Carried;
pub use profile::{FairUse, Limits, Profile, Refusal};
pub use store::{ClientStore, ClientsError, KeyRecord};

use crate::domain::SharedClock;

/// Partition-key prefixes of the items only an operator's CLI writes
/// (client records, key pointers, and the older layout's client and
/// profile items): the serving role is denied writing them
/// (`infra/key-table.cfn.yaml`).
pub const OPERATOR_ONLY: [&str; 3] = [store::RECORD_SPACE, legacy::CLIENT, legacy::PROFILE];

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
    /// Set once revoked: every key of the client is refused from then on.
    pub revoked_at: Option<u64>,
    /// Its keys, oldest first.
    pub keys: Vec<KeyRecord>,
}

/// A client's record and profile, as cached.
type Stored = Option<(ClientRecord, Arc<Profile>)>;

/// The clients, as this instance sees them. Known keys and unknown ones
/// are cached apart, so a flood of made-up keys evicts no legitimate one;
/// concurrent lookups of one digest make one store read between them; a
/// presented key not shaped like a keyfence key is refused with no read;
/// and keys never seen here are looked up within a budget a second (past
/// it: [`ClientsError::Busy`], answered 503), so a flood of well-formed
/// made-up keys reaches the key table at that rate at most, while keys
/// known here are looked up again whenever their time comes.
#[derive(Clone)]
pub struct Directory {
    store: ClientStore,
    /// Digests of active clients' keys, and when each was looked up.
    known: Arc<Cache<String, (Instant, ClientId)>>,
    /// The last lookup of every other digest (and, while a lookup runs, the
    /// place its concurrent twins wait on).
    unknown: Arc<Lookups<String, Option<ClientId>>>,
    /// Records and profiles looked up, and when.
    records: Arc<Lookups<ClientId, Arc<Stored>>>,
    /// Lookups of keys never seen here, a second.
    new_keys: Arc<DefaultDirectRateLimiter>,
    /// What the caches' ages, and the keys' validity when presented, are
    /// reckoned by.
    clock: SharedClock,
}

/// What a lookup found, or why it failed (shared, briefly, with the callers
/// that waited on it).
type Looked<V> = Result<V, String>;

/// Lookups cached by key, each with when it was made.
type Lookups<K, V> = Cache<K, (Instant, Looked<V>)>;

/// How long a failed lookup's error is shared with the callers asking
/// meanwhile, rather than each trying again in turn.
const FAILED_FOR: Duration = Duration::from_secs(1);

impl std::fmt::Debug for Directory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Directory").field("known", &self.known.len()).field("unknown", &self.unknown.len()).finish()
    }
}

impl Directory {
    /// A directory that looks up at most `new_keys_a_second` keys never
    /// seen here a second (twice that at once).
    pub fn new(store: ClientStore, new_keys_a_second: u32, clock: SharedClock) -> Self {
        let rate = NonZeroU32::new(new_keys_a_second).unwrap_or(NonZeroU32::MIN);
        let quota = Quota::per_second(rate).allow_burst(rate.saturating_mul(NonZeroU32::new(2).expect("2 > 0")));
        Self {
            store,
            known: Arc::new(Cache::new(KNOWN_ENTRIES)),
            unknown: Arc::new(Cache::new(UNKNOWN_ENTRIES)),
            records: Arc::new(Cache::new(KNOWN_ENTRIES)),
            new_keys: Arc::new(RateLimiter::direct(quota)),
            clock,
        }
    }

    pub fn store(&self) -> &ClientStore {
        &self.store
    }

    /// The active client a presented key lets in, if any.
    pub async fn find(&self, key: &ApiKey) -> Result<Option<ClientId>, ClientsError> {
        if !key.is_well_formed() {
            return Ok(None);
        }
        let digest = key.digest();
        let known = self.known.get(&digest);
        let asked = self.clock.instant();
        let (owner, looked_up) = match known.filter(|(at, _)| self.clock.since(*at) < CACHE_FOR) {
            Some((_, client)) => (Some(client), false),
            None => {
                let seen_here = known.is_some();
                let owner = fresh_or_load(&self.unknown, &digest, &self.clock, async || {
                    if !seen_here && self.new_keys.check().is_err() {
                        metrics::counter!("keyfence_client_lookups_total", "outcome" => "deferred").increment(1);
                        return Err(ClientsError::Busy);
                    }
                    let owner = self.store.owner_of(&digest).await?;
                    let outcome = if owner.is_some() { "found" } else { "unknown" };
                    metrics::counter!("keyfence_client_lookups_total", "outcome" => outcome).increment(1);
                    Ok(owner)
                })
                .await?;
                if let Some(client) = owner {
                    self.known.insert(digest.clone(), (asked, client));
                    self.unknown.remove(&digest);
                }
                (owner, true)
            }
        };
        let Some(client) = owner else { return Ok(None) };
        // The pointer only names the client; its record says whether the
        // key is one of its valid keys. A key just looked up that the
        // cached record lacks may be newer than it (just rotated in): the
        // record is read again, at most once a digest per cache delay.
        let admits =
            |stored: &Stored| stored.as_ref().is_some_and(|(record, _)| record.admits(&digest, self.clock.now().get()));
        let mut admitted = admits(&*self.stored(client).await?);
        if !admitted && looked_up {
            self.records.remove(&client);
            admitted = admits(&*self.stored(client).await?);
        }
        Ok(admitted.then_some(client))
    }

    /// Client `id`'s profile, as of at most [`CACHE_FOR`] ago (a change
    /// made with the CLI reaches every instance within that delay);
    /// concurrent lookups make one read. An unknown client's is empty.
    pub async fn profile(&self, id: ClientId) -> Result<Arc<Profile>, ClientsError> {
        Ok(self.stored(id).await?.as_ref().as_ref().map(|(_, profile)| profile.clone()).unwrap_or_default())
    }

    async fn stored(&self, id: ClientId) -> Result<Arc<Stored>, ClientsError> {
        fresh_or_load(&self.records, &id, &self.clock, async || {
            let stored = self.store.record(id).await?.map(|(record, profile)| (record, Arc::new(profile)));
            Ok(Arc::new(stored))
        })
        .await
    }
}

/// What `cache` holds for `key`, if it was loaded less than [`CACHE_FOR`]
/// ago (a failure: less than [`FAILED_FOR`]); otherwise one caller runs
/// `load` and the callers asking meanwhile wait for its outcome
/// (quick_cache's placeholder), so a key is read once, and a failing store
/// is not asked again by each waiter in turn.
async fn fresh_or_load<K, V>(
    cache: &Lookups<K, V>,
    key: &K,
    clock: &SharedClock,
    load: impl AsyncFnOnce() -> Result<V, ClientsError>,
) -> Result<V, ClientsError>
where
    K: Eq + std::hash::Hash + Clone,
    V: Clone,
{
    let fresh =
        |(at, looked): &(Instant, Looked<V>)| clock.since(*at) < if looked.is_ok() { CACHE_FOR } else { FAILED_FOR };
    let looked = match cache.get_value_or_guard_async(key).await {
        Ok(entry) if fresh(&entry) => return entry.1.map_err(ClientsError::Store),
        Ok(_) => {
            cache.remove(key);
            cache.get_value_or_guard_async(key).await
        }
        Err(guard) => Err(guard),
    };
    match looked {
        // Loaded meanwhile by another caller.
        Ok((_, looked)) => looked.map_err(ClientsError::Store),
        Err(guard) => {
            // Its age counts from the asking: a load that straddled a change
            // is not taken for one made after it.
            let asked = clock.instant();
            let loaded = load().await;
            // Past the budget for new keys is no outcome to share: the next
            // caller may find a token free (and the check reads nothing).
            if !matches!(loaded, Err(ClientsError::Busy)) {
                let shared = loaded.as_ref().map(Clone::clone).map_err(ToString::to_string);
                let _ = guard.insert((asked, shared));
            }
            loaded
        }
    }
}

#[cfg(test)]
mod tests {
    use super::OPERATOR_ONLY;

    #[test]
    fn the_serving_role_is_denied_writing_every_operator_only_item() {
        let template = include_str!("../../infra/key-table.cfn.yaml");
        let denied = template.split("NeverWriteClientsKeysOrAccounts").nth(1).expect("the serving role's deny");
        for prefix in OPERATOR_ONLY {
            assert!(denied.contains(&format!("\"{prefix}*\"")), "{prefix} is not denied to serve");
        }
    }
}
