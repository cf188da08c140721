//! Recovering a request nobody is working: a stale in-flight key found by
//! the recovery worker (or the reconciler) is taken over with the fence
//! protocol, exactly as a client retry would, so any number of recoverers
//! and retries can race for it and one wins. Keys whose home is another
//! region are left alone, unless that region has been declared failed:
//! then they are taken over whatever their lease, and re-homed here. And rebuilding, for the reconciler, a finished
//! request whose ledger record a failover lost.

use crate::domain::{Millis, Owner, RecoveryPoint};
use crate::keystore::{KeyItem, KeyStore, KeyStoreError, Lease, Release, StaleKey};
use crate::ledger::Adoption;

use super::lease::Attempt;
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
    /// rebuilds the operation from the name and request stored with the key.
    #[tracing::instrument(skip_all, fields(key = %stale.key, seen = %stale.fence))]
    pub async fn recover<O: Operation>(
        &self,
        stale: &StaleKey,
        decode: impl Fn(&str, &[u8]) -> Result<O, EngineError>,
    ) -> Result<Recovery, EngineError> {
        self.check_region().await?;
        let now = self.settings.clock.now();
        let (taken, by) = if stale.home_region == self.settings.region {
            let owner = Owner::attempt_of(&self.settings.instance);
            let lease = Lease { now, length: self.settings.lease };
            (self.keys.take_over(&stale.key, stale.fence, &owner, lease).await, "worker")
        } else if self.regions.fresh().await?.is_failed(&stale.home_region) {
            (self.fail_over(&stale.key, stale.fence, &stale.home_region, now).await, "failover")
        } else {
            return Ok(Recovery::NotHome);
        };
        let item = match taken {
            Ok(item) => {
                metrics::counter!("keyfence_takeovers_total", "by" => by).increment(1);
                item
            }
            Err(KeyStoreError::Taken(_)) => return Ok(Recovery::Lost),
            Err(e) => return Err(e.into()),
        };
        tracing::info!(fence = %item.fence, "recovering a stale request");
        let op = match decode(&item.operation, &item.request) {
            Ok(op) => op,
            Err(e) => {
                // Hand it back rather than sit on it for a whole lease.
                if let Err(release) = self.keys.release(&item.key, &item.holder(), Release::Reopen).await {
                    tracing::warn!(error = %release, "could not hand the key back; its lease will expire");
                }
                return Err(e);
            }
        };
        self.resume(&op, &item).await.map(Recovery::Resumed)
    }

    /// Rebuilds in this region's ledger a request the key store says is
    /// finished but the ledger lost (a failover dropped its last commits).
    /// The key's fence is final, so the rebuild runs under it without a
    /// lease (joining a ledger row at that same fence, unlike a takeover);
    /// the phases' recovery-point checks stop a second rebuilder.
    /// External steps are probed by derived key and re-sent (same key) only
    /// if the rail never saw them. The phase that finishes it stores the
    /// key's answer, the bytes clients have already been given, so no
    /// moment shows the ledger finished with other bytes.
    pub async fn rebuild<O: Operation>(&self, item: &KeyItem, op: &O) -> Result<Answer, EngineError> {
        let mut attempt = Attempt::new(item, op.name(), RecoveryPoint::STARTED, false);
        attempt.lease_until = Millis::new(u64::MAX);
        attempt.known_answer = item.response.clone();
        attempt.at = self.ledger.adopt(&attempt.record, item.fence, Adoption::Rebuild).await?;
        self.drive_to_answer(op, &mut attempt).await
    }
}
