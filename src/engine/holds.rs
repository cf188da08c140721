//! Orphaned holds: a hold whose request is gone. A request takes its hold
//! after its claim and before its first phase; if the claim is then
//! forgotten (a failure before anything was committed) and giving the hold
//! back fails too, the hold is held for nobody. It is found by its key: a
//! hold held for longer than a lease whose key no longer names its
//! request (the key is gone, or names a later request) has nothing behind
//! it, and is released, once (the balance records it). Only holds taken
//! in this region are judged here, and only if this region's ledger never
//! wrote their request (or holds it voided): one it holds lost its key, which the reconciler
//! repairs; another region's hold is that region's to judge, against its
//! own ledger. A lasting hold (a return's) stands for money the rail took
//! back: once its request's key and ledger rows are gone (the partition
//! dropped) it is no orphan; only one whose request this ledger holds
//! voided (a leftover's) is.

use crate::domain::RecoveryPoint;
use crate::keystore::{Concluded, Conclusion, HoldEntry, HoldState, KeyStore};

use super::{Engine, EngineError};

impl<K: KeyStore> Engine<K> {
    /// Releases the orphaned holds on `balance`; returns how many this call released.
    pub async fn release_orphans(&self, balance: &str) -> Result<usize, EngineError> {
        let Some(current) = self.keys.balance(balance).await? else { return Ok(0) };
        let now = self.settings.clock.now();
        let mut released = 0;
        for hold in current.holds.iter().filter(|h| h.state == HoldState::Held && h.at.plus(self.settings.lease) < now)
        {
            if !self.orphaned(hold).await? {
                continue;
            }
            if self.keys.conclude_hold(balance, hold.by.id, Conclusion::Release).await? == Concluded::Now {
                tracing::warn!(balance, request = %hold.by.id, key = %hold.by.key, "released a hold whose request is gone");
                metrics::counter!("keyfence_orphaned_holds_released_total").increment(1);
                released += 1;
            }
        }
        Ok(released)
    }

    /// Whether nothing stands behind `hold` any more.
    pub async fn orphaned(&self, hold: &HoldEntry) -> Result<bool, EngineError> {
        let by = &hold.by;
        if by.region != self.settings.region
            || self.keys.get(&by.key).await?.is_some_and(|item| item.created_at == by.created_at)
        {
            return Ok(false);
        }
        // Never written here, or only voided (given up, or a leftover). A
        // lasting hold's request whose rows are gone was written here once
        // (the ledger dropped them past its retention): it stands.
        let held = self.ledger.views(&[(by.key.clone(), by.created_at)]).await?;
        if hold.lasting && held.is_empty() {
            return Ok(false);
        }
        Ok(held.values().all(|view| view.recovery_point == RecoveryPoint::VOIDED))
    }
}
