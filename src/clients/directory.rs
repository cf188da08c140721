//! The clients as an instance serves them: every record, read whole before
//! the instance serves ([`Directory::load`]) and kept current by reading
//! the change log once a second ([`Directory::follow`]), so a presented key
//! is looked up in memory. A key the instance does not know costs no store
//! read: it may have been made since the last read of the log, so its
//! request waits for the next one (a second at most) and is then refused
//! if the key is still unknown; a flood of made-up keys waits on that one
//! read between them and never competes with a real key. A key made or
//! rotated in a moment ago is served from its first request, a revoked one
//! refused everywhere within a second. When the log cannot be read, the
//! directory is trusted for [`CACHE_FOR`], then requests wait for a read
//! that succeeds, and are answered 503 when none does in time.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::watch;

use super::profile::{Decoded, decoded};
use super::{CACHE_FOR, ClientRecord, ClientStore, ClientsError, Profile};
use crate::domain::{ApiKey, ClientId, SharedClock};

/// How often the change log is read.
const POLL: Duration = Duration::from_secs(1);

/// How often the whole directory is read again, whatever the log says (a
/// change whose log write failed is seen then).
const FULL_READ: Duration = Duration::from_secs(60);

/// How long a request waits for a read of the log made after it arrived.
const WAIT_FOR_READ: Duration = Duration::from_secs(3);

/// A client's record and profile.
type Client = Arc<(ClientRecord, Arc<Profile>)>;

/// Every record as of one version of the change log.
#[derive(Clone, Default)]
struct Records {
    /// The change log's version it holds every change up to.
    version: u64,
    /// Every key digest of every record, and whose it is.
    owners: HashMap<String, ClientId>,
    records: HashMap<ClientId, Client>,
}

impl Records {
    /// Replaces the records of these clients (and their keys' owners). A
    /// record that does not read keeps its last copy (or none), and is
    /// counted and logged: one bad record stops no one else's requests.
    fn take(&mut self, read: Vec<Result<Decoded, ClientsError>>) {
        for found in read {
            let (record, profile) = match found {
                Ok(found) => found,
                Err(e) => {
                    metrics::counter!("keyfence_client_records_unreadable_total").increment(1);
                    tracing::error!(error = %e, "a client record does not read; keeping its last copy");
                    continue;
                }
            };
            if let Some(old) = self.records.get(&record.id) {
                for key in &old.0.keys {
                    self.owners.remove(&key.digest);
                }
            }
            for key in &record.keys {
                self.owners.insert(key.digest.clone(), record.id);
            }
            self.records.insert(record.id, Arc::new((record, Arc::new(profile))));
        }
    }

    /// Reads the records of `ids` again (100 a call) and takes them in.
    async fn read(&mut self, store: &ClientStore, mut ids: Vec<ClientId>) -> Result<(), ClientsError> {
        ids.sort();
        ids.dedup();
        for chunk in ids.chunks(100) {
            self.take(store.records(chunk).await?.iter().map(decoded).collect());
        }
        Ok(())
    }

    /// The client `digest` lets in at `now`, if any.
    fn admits(&self, digest: &str, now: u64) -> Option<ClientId> {
        let client = *self.owners.get(digest)?;
        self.records.get(&client)?.0.admits(digest, now).then_some(client)
    }
}

/// The records, and when a read of the change log last confirmed them.
#[derive(Clone)]
struct View {
    records: Arc<Records>,
    /// When the read that confirmed them was asked (by the directory's clock).
    confirmed: Instant,
}

/// The clients, as this instance sees them; cheap to clone.
#[derive(Clone)]
pub struct Directory {
    store: ClientStore,
    view: watch::Sender<Arc<View>>,
    /// What the view's age, and the keys' validity when presented, are
    /// reckoned by.
    clock: SharedClock,
}

impl std::fmt::Debug for Directory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Directory").field("clients", &self.view.borrow().records.records.len()).finish()
    }
}

impl Directory {
    /// Every client, read now: the change log, then the records the index
    /// lists and those the log names (the index may not list yet a client
    /// made a moment ago).
    pub async fn load(store: ClientStore, clock: SharedClock) -> Result<Self, ClientsError> {
        let asked = clock.instant();
        let view = read_whole(&store, asked).await?;
        Ok(Self { store, view: watch::Sender::new(Arc::new(view)), clock })
    }

    /// Reads the change log every [`POLL`] until `stopped` changes, taking
    /// in what changed; and, beside it (so a long read holds up no
    /// confirmation), the whole directory every [`FULL_READ`].
    pub async fn follow(self, mut stopped: watch::Receiver<()>) {
        let whole = tokio::spawn(self.clone().read_whole_every(stopped.clone()));
        loop {
            let outcome = match self.refresh().await {
                Ok(()) => "ok",
                Err(e) => {
                    tracing::warn!(error = %e, "could not read the client directory's changes; keeping the last view");
                    "failed"
                }
            };
            metrics::counter!("keyfence_client_directory_reads_total", "outcome" => outcome).increment(1);
            tokio::select! {
                () = tokio::time::sleep(POLL) => {}
                _ = stopped.changed() => break,
            }
        }
        whole.abort();
    }

    async fn read_whole_every(self, mut stopped: watch::Receiver<()>) {
        loop {
            tokio::select! {
                () = tokio::time::sleep(FULL_READ) => {}
                _ = stopped.changed() => return,
            }
            match read_whole(&self.store, self.clock.instant()).await {
                Ok(view) => self.install(view, true),
                Err(e) => tracing::warn!(error = %e, "could not read the client directory whole; trying again later"),
            }
        }
    }

    /// One read of the change log, and of what it says changed.
    async fn refresh(&self) -> Result<(), ClientsError> {
        let asked = self.clock.instant();
        let current = self.view.borrow().records.clone();
        let changes = self.store.changes().await?;
        let next = if changes.version == current.version {
            View { records: current, confirmed: asked }
        } else if let Some(changed) = changes.since(current.version) {
            let mut records = Records { version: changes.version, ..(*current).clone() };
            records.read(&self.store, changed).await?;
            View { records: Arc::new(records), confirmed: asked }
        } else {
            // Too far behind for the log: everything again.
            read_whole(&self.store, asked).await?
        };
        self.install(next, false);
        Ok(())
    }

    /// Takes `next` in if it holds later changes than the view, or is the
    /// whole directory read again at the same version (which also catches a
    /// change the log missed); a read of the same version only confirms the
    /// view's records later (they may be a whole read's, taken meanwhile);
    /// an older one changes nothing.
    fn install(&self, next: View, whole: bool) {
        self.view.send_if_modified(|view| {
            let (mine, theirs) = (view.records.version, next.records.version);
            let confirmed = next.confirmed.max(view.confirmed);
            let records = match theirs.cmp(&mine) {
                std::cmp::Ordering::Greater => next.records,
                std::cmp::Ordering::Equal if whole => next.records,
                std::cmp::Ordering::Equal if confirmed > view.confirmed => view.records.clone(),
                _ => return false,
            };
            *view = Arc::new(View { records, confirmed });
            true
        });
    }

    /// The active client a presented key lets in, if any.
    pub async fn find(&self, key: &ApiKey) -> Result<Option<ClientId>, ClientsError> {
        if !key.is_well_formed() {
            return Ok(None);
        }
        let digest = key.digest();
        let arrived = self.clock.instant();
        let view = self.trusted(arrived).await?;
        if let Some(client) = view.records.admits(&digest, self.clock.now().get()) {
            return Ok(Some(client));
        }
        // Made since the view was read, perhaps: the next read says.
        let view = if view.confirmed >= arrived { view } else { self.confirmed_after(arrived).await? };
        let client = view.records.admits(&digest, self.clock.now().get());
        let outcome = if client.is_some() { "found" } else { "unknown" };
        metrics::counter!("keyfence_client_lookups_total", "outcome" => outcome).increment(1);
        Ok(client)
    }

    /// Client `id`'s profile (empty for an unknown client).
    pub async fn profile(&self, id: ClientId) -> Result<Arc<Profile>, ClientsError> {
        let view = self.trusted(self.clock.instant()).await?;
        Ok(view.records.records.get(&id).map(|client| client.1.clone()).unwrap_or_default())
    }

    /// The view, if confirmed within [`CACHE_FOR`]; else the next one.
    async fn trusted(&self, arrived: Instant) -> Result<Arc<View>, ClientsError> {
        let view = self.view.borrow().clone();
        if self.clock.since(view.confirmed) < CACHE_FOR { Ok(view) } else { self.confirmed_after(arrived).await }
    }

    /// The first view confirmed by a read asked at or after `arrived`.
    async fn confirmed_after(&self, arrived: Instant) -> Result<Arc<View>, ClientsError> {
        let mut views = self.view.subscribe();
        let waited = tokio::time::timeout(WAIT_FOR_READ, views.wait_for(|view| view.confirmed >= arrived)).await;
        match waited {
            Ok(Ok(view)) => Ok(view.clone()),
            _ => {
                metrics::counter!("keyfence_client_lookups_total", "outcome" => "deferred").increment(1);
                Err(ClientsError::Busy)
            }
        }
    }
}

/// The whole directory, as of a read of the change log asked at `asked`.
async fn read_whole(store: &ClientStore, asked: Instant) -> Result<View, ClientsError> {
    let changes = store.changes().await?;
    let mut ids = store.listed().await?;
    ids.extend(changes.named());
    let mut records = Records { version: changes.version, ..Records::default() };
    records.read(store, ids).await?;
    Ok(View { records: Arc::new(records), confirmed: asked })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn directory(view: View) -> Directory {
        let config = aws_sdk_dynamodb::Config::builder().behavior_version_latest().build();
        let store = ClientStore::new(aws_sdk_dynamodb::Client::from_conf(config), "unused");
        Directory { store, view: watch::Sender::new(Arc::new(view)), clock: SharedClock::default() }
    }

    /// Records at `version` holding one key digest, `marker`.
    fn records(version: u64, marker: &str) -> Arc<Records> {
        let owners = HashMap::from([(marker.to_owned(), ClientId::generate())]);
        Arc::new(Records { version, owners, records: HashMap::new() })
    }

    /// A poll that began before a whole read was taken in confirms the view
    /// later, but does not put its older records back over the whole read's.
    #[test]
    fn a_slower_poll_of_the_same_version_keeps_the_whole_reads_records() {
        let start = Instant::now();
        let at = |ms: u64| start + Duration::from_millis(ms);
        let directory = directory(View { records: records(7, "polled"), confirmed: at(10) });
        directory.install(View { records: records(7, "whole"), confirmed: at(5) }, true);
        directory.install(View { records: records(7, "polled"), confirmed: at(20) }, false);
        let view = directory.view.borrow().clone();
        assert!(view.records.owners.contains_key("whole"), "the whole read's records stay");
        assert_eq!(view.confirmed, at(20), "confirmed by the later poll");
        directory.install(View { records: records(8, "newer"), confirmed: at(15) }, false);
        assert!(directory.view.borrow().records.owners.contains_key("newer"), "later changes are taken");
        directory.install(View { records: records(7, "older"), confirmed: at(30) }, true);
        assert!(directory.view.borrow().records.owners.contains_key("newer"), "an older version is not");
    }
}
