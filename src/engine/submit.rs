//! The front of the protocol: claim the key, or branch on the item a lost
//! claim returned (in the same round trip), in the order that keeps every
//! answer honest: another request under the same key is refused; a finished
//! one is replayed byte for byte; a live one answers "in flight"; a stale
//! one is taken over (fence + 1) and resumed where it stopped. A request
//! homed in a region declared failed is taken over at once and re-homed
//! here; while this instance's own region is declared failed, it takes on
//! nothing. A finished answer this instance already knows is replayed from
//! memory, without asking the key store.

use std::time::Duration;

use uuid::Uuid;

use crate::domain::{Fence, Millis, Owner, RecoveryPoint, RequestHash, ScopedKey};
use crate::failpoint;
use crate::keystore::{Claim, Handoff, KeyItem, KeyState, KeyStore, KeyStoreError, Lease, Release};
use crate::ledger::Adoption;

use super::lease::Attempt;
use super::{Answer, Engine, EngineError, Operation};

/// A request as the engine receives it.
pub struct Submission<O> {
    pub key: ScopedKey,
    pub request_hash: RequestHash,
    /// The canonical request, kept with the claim for later repair.
    pub canonical: Vec<u8>,
    pub operation: O,
}

impl<K: KeyStore> Engine<K> {
    /// Works a request exactly once, however often it is submitted.
    #[tracing::instrument(skip_all, fields(key = %submission.key))]
    pub async fn submit<O: Operation>(&self, submission: Submission<O>) -> Result<Answer, EngineError> {
        self.before_claim(&submission.operation).await?;
        let now = self.settings.clock.now();
        if let Some(known) = self.answers.recall(&submission.key, now, &self.settings.retention) {
            metrics::counter!("keyfence_replays_from_memory_total").increment(1);
            if known.request_hash != submission.request_hash {
                return Ok(Answer::Mismatch);
            }
            return Ok(Answer::Final { response: known.response.clone(), replayed: true });
        }
        let claim = Claim {
            key: submission.key.clone(),
            request_hash: submission.request_hash.clone(),
            request: submission.canonical,
            operation: submission.operation.name().to_owned(),
            payment_id: Uuid::now_v7(),
            owner: Owner::attempt_of(&self.settings.instance),
            home_region: self.settings.region.clone(),
            lease: Lease { now, length: self.settings.lease },
            gone_before: self.settings.retention.gone_before(now),
        };
        let claimed = self.keys.claim(&claim).await;
        let outcome = if claimed.is_ok() { "won" } else { "existing" };
        metrics::counter!("keyfence_claims_total", "outcome" => outcome).increment(1);
        match claimed {
            Ok(item) => {
                failpoint::boundary(|| "after-claim".to_owned());
                let mut attempt = Attempt::new(&item, submission.operation.name(), RecoveryPoint::STARTED, true);
                self.drive(&submission.operation, &mut attempt).await
            }
            Err(KeyStoreError::Taken(Some(existing))) => {
                self.on_existing(&submission.operation, &existing, &submission.request_hash, now).await
            }
            Err(KeyStoreError::Taken(None)) => Ok(Answer::InFlight { retry_after: Duration::from_secs(1) }),
            Err(e) => Err(e.into()),
        }
    }

    /// The live item of `key`, if one is held: an item past its retention
    /// only waits to be reaped, and counts as gone.
    pub async fn live_item(&self, key: &ScopedKey) -> Result<Option<KeyItem>, EngineError> {
        let gone_before = self.settings.retention.gone_before(self.settings.clock.now());
        Ok(self.keys.get(key).await?.filter(|item| !item.expired(gone_before)))
    }

    /// Works a request as the claim `existing` (read with [`Self::live_item`])
    /// accepted it: replayed, answered in flight, taken over and resumed, or
    /// refused as another request under the key. It never claims: a request
    /// its caller could not make anew (its check refused it) is answered this
    /// way or not at all, so a key that expires between the read and this
    /// call is never claimed afresh by a request nobody checked. Every write
    /// it makes is conditional on the fence `existing` carries.
    #[tracing::instrument(skip_all, fields(key = %submission.key))]
    pub async fn submit_to_existing<O: Operation>(
        &self,
        submission: Submission<O>,
        existing: &KeyItem,
    ) -> Result<Answer, EngineError> {
        self.before_claim(&submission.operation).await?;
        self.on_existing(&submission.operation, existing, &submission.request_hash, self.settings.clock.now()).await
    }

    /// What every request passes before it claims or acts on a claim: this
    /// region is not declared failed, and every rail the operation names is
    /// configured (refused now, not after an intent is committed).
    async fn before_claim<O: Operation>(&self, op: &O) -> Result<(), EngineError> {
        self.check_region().await?;
        for step in op.steps() {
            if let super::Step::External(ext) = step {
                self.rails.get(ext.rail)?;
            }
        }
        failpoint::boundary(|| "before-claim".to_owned());
        Ok(())
    }

    async fn on_existing<O: Operation>(
        &self,
        op: &O,
        existing: &KeyItem,
        request_hash: &RequestHash,
        now: Millis,
    ) -> Result<Answer, EngineError> {
        if existing.request_hash != *request_hash {
            return Ok(Answer::Mismatch);
        }
        if existing.state == KeyState::Finished {
            return self.replay(existing);
        }
        let in_flight = Answer::InFlight { retry_after: retry_after(existing, now) };
        let taken = if existing.home_region != self.settings.region {
            if !self.regions.fresh().await?.is_failed(&existing.home_region) {
                return Ok(in_flight);
            }
            failpoint::boundary(|| "before-fail-over".to_owned());
            self.fail_over(&existing.key, existing.fence, &existing.home_region, now)
                .await
                .map(|item| (item, "failover"))
        } else {
            if existing.lease_until >= now {
                return Ok(in_flight);
            }
            let owner = Owner::attempt_of(&self.settings.instance);
            let lease = Lease { now, length: self.settings.lease };
            self.keys.take_over(&existing.key, existing.fence, &owner, lease).await.map(|item| (item, "retry"))
        };
        let (item, by) = match taken {
            Ok(taken) => taken,
            // The key finished in the meantime (its owner won the race): the
            // item the refusal carries holds the answer.
            Err(KeyStoreError::Taken(Some(current)))
                if current.state == KeyState::Finished && current.request_hash == *request_hash =>
            {
                return self.replay(&current);
            }
            Err(KeyStoreError::Taken(_)) => return Ok(in_flight),
            Err(e) => return Err(e.into()),
        };
        // The key was forgotten and claimed by another request since
        // `existing` was read, at the same fence: what was taken is not this
        // request, so it is handed straight back for its own retries.
        if item.created_at != existing.created_at || item.request_hash != existing.request_hash {
            self.keys.release(&item.key, &item.holder(), Release::Reopen).await?;
            return Ok(in_flight);
        }
        metrics::counter!("keyfence_takeovers_total", "by" => by).increment(1);
        tracing::info!(key = %item.key, fence = %item.fence, "a retry took over a request");
        self.resume(op, &item).await
    }

    /// The stored answer of a finished item, kept in memory for the next replay.
    fn replay(&self, item: &KeyItem) -> Result<Answer, EngineError> {
        let response = item
            .response
            .clone()
            .ok_or_else(|| EngineError::Fault(format!("{} is finished without an answer", item.key)))?;
        self.answers.remember(&item.key, &item.request_hash, &response, item.expires_at);
        Ok(Answer::Final { response, replayed: true })
    }

    /// Takes a request homed in a region declared failed over to this one:
    /// fence + 1 and re-homed here, whatever its lease. The caller has
    /// checked (with a fresh read) that its home region is failed.
    pub(super) async fn fail_over(
        &self,
        key: &ScopedKey,
        seen: Fence,
        home: &str,
        now: Millis,
    ) -> Result<KeyItem, KeyStoreError> {
        let owner = Owner::attempt_of(&self.settings.instance);
        let lease = Lease { now, length: self.settings.lease };
        let taken = self.keys.fail_over(key, seen, &owner, lease, home, &self.settings.region).await?;
        tracing::warn!(key = %taken.key, fence = %taken.fence, from = home, "took over a request of a failed region");
        Ok(taken)
    }

    /// Refuses work while this instance's own region is declared failed.
    pub(super) async fn check_region(&self) -> Result<(), EngineError> {
        if self.regions.current().await.is_failed(&self.settings.region) {
            return Err(EngineError::RegionFailed(self.settings.region.clone()));
        }
        Ok(())
    }

    /// Works a request this instance has just taken over: first records a
    /// hand-off for every region the request left (so each one's leftover
    /// is voided there, however long after its key is gone), then stamps its
    /// fence on the ledger (from then on the old owner's writes are refused)
    /// and carries on from the recovery point found there. If a store cannot
    /// be reached, the key is handed back at once rather than held idle.
    pub(super) async fn resume<O: Operation>(&self, op: &O, item: &KeyItem) -> Result<Answer, EngineError> {
        let mut attempt = Attempt::new(item, op.name(), RecoveryPoint::STARTED, false);
        let adopted = async {
            for from in &item.left {
                self.keys.hand_off(&Handoff::of(item, from)).await?;
            }
            Ok::<_, EngineError>(self.ledger.adopt(&attempt.record, item.fence, Adoption::Takeover).await?)
        };
        match adopted.await {
            Ok(at) => attempt.at = at,
            Err(e) => {
                self.stopped(&attempt, &e).await;
                return Err(e);
            }
        }
        self.drive(op, &mut attempt).await
    }
}

/// Whole seconds until the holder's lease ends, at least one.
fn retry_after(item: &KeyItem, now: Millis) -> Duration {
    let left_ms = item.lease_until.get().saturating_sub(now.get());
    Duration::from_secs(left_ms.div_ceil(1000).max(1))
}
