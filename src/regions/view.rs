//! `RegionView`: an instance's view of the registry, read at most once per
//! `max_age` on the request path (one consistent read a second, whatever
//! the traffic) and read fresh where a decision moves a request between
//! regions. A registry that cannot be read keeps the last view; one never
//! read counts every region active, so a registry outage stops nothing.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Mutex;
use tokio::time::Instant;

use super::{RegionStore, RegionsError, Registry};

#[derive(Clone, Debug)]
pub struct RegionView {
    store: RegionStore,
    max_age: Duration,
    cached: Arc<Mutex<Option<(Instant, Registry)>>>,
}

impl RegionView {
    pub fn new(store: RegionStore, max_age: Duration) -> Self {
        Self { store, max_age, cached: Arc::default() }
    }

    pub fn store(&self) -> &RegionStore {
        &self.store
    }

    /// The registry as of at most `max_age` ago.
    pub async fn current(&self) -> Registry {
        let mut cached = self.cached.lock().await;
        if let Some((at, registry)) = cached.as_ref()
            && at.elapsed() < self.max_age
        {
            return registry.clone();
        }
        match self.store.read().await {
            Ok(registry) => {
                *cached = Some((Instant::now(), registry.clone()));
                registry
            }
            Err(e) => {
                tracing::warn!(error = %e, "could not read the region registry; keeping the last view");
                cached.as_ref().map(|(_, r)| r.clone()).unwrap_or_default()
            }
        }
    }

    /// The registry read now, strongly consistent.
    pub async fn fresh(&self) -> Result<Registry, RegionsError> {
        let registry = self.store.read().await?;
        *self.cached.lock().await = Some((Instant::now(), registry.clone()));
        Ok(registry)
    }
}
