//! `RegionView`: an instance's view of the registry, read at most once per
//! `max_age` on the request path (one consistent read a second, whatever
//! the traffic) and read fresh where a decision moves a request between
//! regions. Readers share the cached registry without waiting on each
//! other; when it is due, one of them refreshes it while the rest keep
//! using the last one (before the first read, they wait for it). A registry
//! that cannot be read keeps the last view; one never read counts every
//! region active, so a registry outage stops nothing.

use std::sync::{Arc, RwLock};
use std::time::Duration;

use std::time::Instant;

use super::{RegionStore, RegionsError, Registry};
use crate::domain::SharedClock;

#[derive(Clone, Debug)]
pub struct RegionView {
    store: RegionStore,
    max_age: Duration,
    /// What the view's age is reckoned by.
    clock: SharedClock,
    cached: Arc<RwLock<(Option<Instant>, Arc<Registry>)>>,
    /// Held by the one reader refreshing a stale view.
    refreshing: Arc<tokio::sync::Mutex<()>>,
}

impl RegionView {
    pub fn new(store: RegionStore, max_age: Duration, clock: SharedClock) -> Self {
        Self { store, max_age, clock, cached: Arc::default(), refreshing: Arc::default() }
    }

    pub fn store(&self) -> &RegionStore {
        &self.store
    }

    /// The registry as of at most `max_age` ago (or the last one read, while
    /// another caller refreshes it).
    pub async fn current(&self) -> Arc<Registry> {
        let (read_at, registry) = self.cached();
        if read_at.is_some_and(|at| self.clock.since(at) < self.max_age) {
            return registry;
        }
        // Never read yet: wait for the first read rather than guess.
        let _refreshing = match (read_at, self.refreshing.try_lock()) {
            (_, Ok(guard)) => guard,
            (Some(_), Err(_)) => return registry,
            (None, Err(_)) => {
                let guard = self.refreshing.lock().await;
                let (read_at, registry) = self.cached();
                if read_at.is_some() {
                    return registry;
                }
                guard
            }
        };
        let asked = self.clock.instant();
        match self.store.read().await {
            Ok(fresh) => self.keep(fresh, asked),
            Err(e) => {
                tracing::warn!(error = %e, "could not read the region registry; keeping the last view");
                registry
            }
        }
    }

    /// The registry read now, strongly consistent.
    pub async fn fresh(&self) -> Result<Arc<Registry>, RegionsError> {
        let asked = self.clock.instant();
        Ok(self.keep(self.store.read().await?, asked))
    }

    fn cached(&self) -> (Option<Instant>, Arc<Registry>) {
        self.cached.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Keeps `registry`, read from a request made at `asked`: its age counts
    /// from then (a read that straddled a change is not taken for one made
    /// after it), and it never replaces a view asked for later.
    fn keep(&self, registry: Registry, asked: Instant) -> Arc<Registry> {
        for change in registry.regions.values() {
            let failed = if change.state == super::RegionState::Failed { 1.0 } else { 0.0 };
            metrics::gauge!("keyfence_region_declared_failed", "region" => change.region.clone()).set(failed);
        }
        let registry = Arc::new(registry);
        let mut cached = self.cached.write().unwrap_or_else(|p| p.into_inner());
        if cached.0.is_none_or(|kept| kept <= asked) {
            *cached = (Some(asked), registry.clone());
        }
        registry
    }
}
