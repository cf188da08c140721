//! `Attempt`: one owner's hold on a request while it works it: the fence it
//! was granted, its lease, and how far the request has got. The lease is
//! extended lazily, once a third of it is gone, so a quick request costs no
//! heartbeat at all; a refused heartbeat means fenced out.

use std::time::Duration;

use crate::domain::{Millis, RecoveryPoint, StoredResponse};
use crate::keystore::{Holder, KeyItem, KeyStore, Lease};
use crate::ledger::RequestRecord;

use super::EngineError;

pub(super) struct Attempt {
    pub record: RequestRecord,
    /// The fence and identity this attempt writes under.
    pub holder: Holder,
    pub lease_until: Millis,
    /// The last recovery point committed (by anyone, as of our adoption).
    pub at: RecoveryPoint,
    /// A commit was sent: even if its answer was lost, the ledger may hold
    /// work, so the key must never be forgotten.
    pub commit_attempted: bool,
    /// The operation's hold was sent, and may have been taken whatever the
    /// answer: the key must not be forgotten either (its hold would be
    /// left for nobody).
    pub hold_sent: bool,
    /// This attempt made the claim itself: no earlier attempt can have sent
    /// anything, so its calls need no probe first. Every other attempt (a
    /// takeover, a rebuild) probes before any send.
    pub fresh: bool,
    /// The answer clients were already given, when rebuilding a finished
    /// key: the ledger stores these bytes rather than its own, in the same
    /// transaction that finishes the request.
    pub known_answer: Option<StoredResponse>,
    /// The final answer this attempt's own phase stored and committed: the
    /// ledger's answer, known without reading it back.
    pub committed_answer: Option<StoredResponse>,
}

impl Attempt {
    pub fn new(item: &KeyItem, operation: &str, at: RecoveryPoint, fresh: bool) -> Self {
        Self {
            record: RequestRecord {
                key: item.key.clone(),
                created_at: item.created_at,
                operation: operation.to_owned(),
                request_hash: item.request_hash.clone(),
                payment_id: item.payment_id,
                request: item.request.clone(),
            },
            holder: item.holder(),
            lease_until: item.lease_until,
            at,
            commit_attempted: false,
            hold_sent: false,
            fresh,
            known_answer: None,
            committed_answer: None,
        }
    }

    /// Whether handing the key back forgets it: this attempt made the claim
    /// and no commit or hold was ever sent (one whose answer was lost may
    /// have landed), so nothing of the request exists anywhere else.
    pub fn forgettable(&self) -> bool {
        self.fresh && self.at == RecoveryPoint::STARTED && !self.commit_attempted && !self.hold_sent
    }

    /// Extends the lease if a third of it is gone by `now`.
    pub async fn keep_alive<K: KeyStore>(
        &mut self,
        keys: &K,
        now: Millis,
        length: Duration,
    ) -> Result<(), EngineError> {
        let left = self.lease_until.get().saturating_sub(now.get());
        if u128::from(left) * 3 < length.as_millis() * 2 {
            self.lease_until = keys.heartbeat(&self.record.key, &self.holder, Lease { now, length }).await?;
        }
        Ok(())
    }
}
