//! The key item as the protocol reads it: whose it is (fence, owner, lease),
//! what request it names (hash, canonical body, operation, payment id),
//! where it is worked (home region, regions it left) and, once finished,
//! its stored answer and when it may be reaped. How it is stored is
//! [`super::item`]'s business.

use std::collections::BTreeSet;

use uuid::Uuid;

use super::{Claim, Holder};
use crate::domain::{Fence, Millis, Owner, RequestHash, ScopedKey, StoredResponse};

/// A started item whose lease has run out, as the in-flight index shows it.
/// The index is eventually consistent: the item may have moved on since, so
/// a recoverer acts on it only through `take_over` with this fence.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StaleKey {
    pub key: ScopedKey,
    pub fence: Fence,
    pub home_region: String,
    pub lease_until: Millis,
    /// When the request was first claimed: with the key, it names the
    /// request in the ledger.
    pub created_at: Millis,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeyState {
    Started,
    Finished,
}

impl KeyState {
    pub fn as_str(self) -> &'static str {
        match self {
            KeyState::Started => "started",
            KeyState::Finished => "finished",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyItem {
    pub key: ScopedKey,
    pub request_hash: RequestHash,
    pub request: Vec<u8>,
    /// Which operation the request is ([`crate::engine::Operation::name`]):
    /// what a resumer rebuilds from `request`. Items written before it was
    /// kept are payments.
    pub operation: String,
    pub state: KeyState,
    pub fence: Fence,
    /// End of the current owner's lease; a takeover is allowed after it.
    pub lease_until: Millis,
    pub owner: Owner,
    /// The region that first claimed the key and works it.
    pub home_region: String,
    pub created_at: Millis,
    pub payment_id: Uuid,
    /// Present once finished.
    pub response: Option<StoredResponse>,
    /// Present once finished: when DynamoDB may reap the item (seconds).
    pub expires_at: Option<u64>,
    /// The regions this request was failed over away from, each while it
    /// was in flight there: what their ledgers hold of it are leftovers, and
    /// it never returns to one of them (its fences there are spent).
    pub left: BTreeSet<String>,
}

impl KeyItem {
    /// The item as a recoverer takes it over: as seen now.
    pub fn stale(&self) -> StaleKey {
        StaleKey {
            key: self.key.clone(),
            fence: self.fence,
            home_region: self.home_region.clone(),
            lease_until: self.lease_until,
            created_at: self.created_at,
        }
    }

    /// The item a successful claim creates.
    pub fn claimed(claim: &Claim) -> Self {
        Self {
            key: claim.key.clone(),
            request_hash: claim.request_hash.clone(),
            request: claim.request.clone(),
            operation: claim.operation.clone(),
            state: KeyState::Started,
            fence: Fence::FIRST,
            lease_until: claim.lease.until(),
            owner: claim.owner.clone(),
            home_region: claim.home_region.clone(),
            created_at: claim.lease.now,
            payment_id: claim.payment_id,
            response: None,
            expires_at: None,
            left: BTreeSet::new(),
        }
    }

    /// Who holds the item (meaningful while it is started).
    pub fn holder(&self) -> Holder {
        Holder { fence: self.fence, owner: self.owner.clone() }
    }

    /// Past its retention: a finished item whose `expires_at` lies before
    /// `gone_before` (its deciding clock's now less the retention's grace,
    /// [`crate::domain::Retention::gone_before`]). DynamoDB reaps such items
    /// lazily (up to days later), so everyone treats it as absent from then on.
    pub fn expired(&self, gone_before: Millis) -> bool {
        self.state == KeyState::Finished && self.expires_at.is_some_and(|at| at < gone_before.as_secs())
    }

    /// Whether `holder` holds this item and it is still in flight.
    pub fn held_by(&self, holder: &Holder) -> bool {
        self.state == KeyState::Started && self.fence == holder.fence && self.owner == holder.owner
    }
}
