//! Recovering a request nobody is working: a stale in-flight key found by
//! the recovery worker (or the reconciler) is taken over with the fence
//! protocol, exactly as a client retry would, so any number of recoverers
//! and retries can race for it and one wins. Keys whose home is another
//! region are left alone.

use crate::domain::{Millis, Owner};
use crate::keystore::{KeyStore, KeyStoreError, Lease, StaleKey};

use super::{Answer, Engine, EngineError, Operation};

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Recovery {
    /// This recoverer took it over and drove it to an answer.
    Resumed(Answer),
    /// Someone else took it over first, or it had moved on already.
    Lost,
    /// It belongs to another region.
    NotHome,
}

impl<K: KeyStore> Engine<K> {
    /// Takes over `stale` (if still as seen) and resumes it; `decode`
    /// rebuilds the operation from the request stored with the key.
    #[tracing::instrument(skip_all, fields(key = %stale.key, seen = %stale.fence))]
    pub async fn recover<O: Operation>(
        &self,
        stale: &StaleKey,
        decode: impl Fn(&[u8]) -> Result<O, EngineError>,
    ) -> Result<Recovery, EngineError> {
        if stale.home_region != self.settings.region {
            return Ok(Recovery::NotHome);
        }
        let owner = Owner::attempt_of(&self.settings.instance);
        let lease = Lease { now: Millis::now(), length: self.settings.lease };
        let item = match self.keys.take_over(&stale.key, stale.fence, &owner, lease).await {
            Ok(item) => item,
            Err(KeyStoreError::Taken(_)) => return Ok(Recovery::Lost),
            Err(e) => return Err(e.into()),
        };
        tracing::info!(fence = %item.fence, "recovering a stale request");
        let op = decode(&item.request)?;
        self.resume(&op, &item).await.map(Recovery::Resumed)
    }
}
