//! The key store: the one consistent place, shared by every region, that
//! decides who owns an idempotency key. Every operation is a single
//! conditional write (or a consistent read) on one item, and every write by
//! an owner carries its fencing token, so a superseded owner is rejected by
//! the store itself rather than by anyone's good behaviour.
//!
//! Lifecycle of an item: `claim` creates it (`started`, fence 1); `take_over`
//! replaces a stale owner (fence + 1); `heartbeat` extends the lease; `finish`
//! stores the final answer (`finished`); `release` hands back a key whose
//! attempt failed transiently. `DynamoKeyStore` is the product's store;
//! `MemoryKeyStore` is a reference model for property tests only.

mod attempts;
mod balance;
mod dynamo;
mod error;
mod failure;
mod handoff;
mod item;
mod key_item;
mod leader;
mod memory;
mod settings;
mod table;

use std::future::Future;
use std::time::Duration;

use uuid::Uuid;

use crate::domain::{Fence, Millis, Owner, RequestHash, ScopedKey, StoredResponse};

pub use balance::{Balance, Concluded, Conclusion, Frozen, HeldBy, Hold, HoldEntry, HoldState, Holding};
pub use dynamo::{ConnectError, DynamoKeyStore, connect, sdk_config};
pub use error::{KeyStoreError, StoreFailure};
pub use handoff::Handoff;
pub use item::attr::{INFLIGHT as INDEX_PARTITION, LEASE_UNTIL as INDEX_SORT};
pub use item::{CONTROL_PREFIX, INFLIGHT_SHARDS, inflight_shard, shard_name};
pub use key_item::{KeyItem, KeyState, StaleKey};
pub use leader::Leader;
pub use memory::MemoryKeyStore;
pub use settings::KeyStoreSettings;
pub use table::{INFLIGHT_INDEX, Schema, TableChange, TableCheck, check_table, delete_table, ensure_table};

/// A lease as the caller sees it: taken at `now`, held for `length`.
#[derive(Clone, Copy, Debug)]
pub struct Lease {
    pub now: Millis,
    pub length: Duration,
}

impl Lease {
    pub fn until(&self) -> Millis {
        self.now.plus(self.length)
    }
}

/// Everything a first attempt writes when it claims a key.
#[derive(Clone, Debug)]
pub struct Claim {
    pub key: ScopedKey,
    pub request_hash: RequestHash,
    /// The canonical request, kept so the reconciler can rebuild a payment
    /// that a failover erased from the regional ledger.
    pub request: Vec<u8>,
    /// Which operation it is ([`crate::engine::Operation::name`]).
    pub operation: String,
    /// Fixed at claim, so every resumer and repair works on the same payment.
    pub payment_id: Uuid,
    pub owner: Owner,
    pub home_region: String,
    pub lease: Lease,
    /// An existing item finished with an `expires_at` before this instant is
    /// past its retention and claimed over ([`crate::domain::Retention::gone_before`]).
    pub gone_before: Millis,
}

/// Who holds a started item: the fence it was granted and the identity of
/// the attempt. Every write an owner makes is conditioned on both. The fence
/// orders owners; the identity tells a retried write of ours (whose first
/// delivery landed but whose reply was lost) from someone else's item that
/// happens to carry the same fence, as a key forgotten and claimed again
/// does (it starts at fence 1 once more).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Holder {
    pub fence: Fence,
    pub owner: Owner,
}

/// The final answer of a request, stored when it finishes.
#[derive(Clone, Debug)]
pub struct Finish {
    pub response: StoredResponse,
    /// When the store may reap the finished item (DynamoDB TTL).
    pub expires_at: Millis,
}

/// How an owner gives a key back after a transient failure.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Release {
    /// Nothing was committed anywhere: delete the claim, as if never made.
    /// Only the first claim (fence 1) is ever deleted; a key that was taken
    /// over is reopened instead. A deleted key can be claimed again at fence
    /// 1, and this rule keeps that new fence 1 from meeting a stale holder
    /// of the old one: no takeover ever happened, so no other holder exists.
    Forget,
    /// Work was committed: keep the item but end the lease, so the next
    /// retry or the recovery worker resumes at once instead of waiting.
    Reopen,
    /// The request is given up for good: delete the item whatever its
    /// fence. Only for a holder that has voided the request's ledger row
    /// under its own fence first (so no older owner can write it, and no
    /// reconciler finds it keyless and puts it back). A key claimed again
    /// afterwards is another request (a new `created_at`, a new owner): no
    /// stale holder's write, conditioned on its own identity, can touch it.
    Abandon,
}

/// One page of a scan of the key table.
#[derive(Clone, Debug, Default)]
pub struct ScanPage {
    pub items: Vec<KeyItem>,
    /// The balances on the page, by name.
    pub balances: Vec<(String, Balance)>,
    /// Where the next page starts (a partition key); `None` after the last.
    pub next: Option<String>,
}

/// The conditional operations on key items. Failed conditions come back as
/// [`KeyStoreError::Taken`] or [`KeyStoreError::FencedOut`] carrying the item
/// as it stood, so a loser learns the current state without a second read.
pub trait KeyStore: Send + Sync {
    /// Creates the item if the key was never seen, or if its item is past
    /// its retention as of `claim.gone_before` ([`KeyItem::expired`]): a new request, with a new
    /// payment id and fence 1. A loser gets `Taken(existing)` from the same
    /// round trip.
    fn claim(&self, claim: &Claim) -> impl Future<Output = Result<KeyItem, KeyStoreError>> + Send;

    /// Replaces the owner of a started item whose lease ended before
    /// `lease.now`, if its fence is still `seen`. Exactly one racer wins.
    fn take_over(
        &self,
        key: &ScopedKey,
        seen: Fence,
        owner: &Owner,
        lease: Lease,
    ) -> impl Future<Output = Result<KeyItem, KeyStoreError>> + Send;

    /// Moves a started item homed in `from` (a region declared failed) to a
    /// new owner in region `to`, whatever its lease, if its fence is still
    /// `seen` and the request never left `to` before: fence + 1, so the
    /// failed region's owner is fenced out of the key store, and `from`
    /// joins the item's `left` set in the same write (the fact that `from`'s
    /// ledger holds a leftover is never lost). Exactly one racer wins.
    fn fail_over(
        &self,
        key: &ScopedKey,
        seen: Fence,
        owner: &Owner,
        lease: Lease,
        from: &str,
        to: &str,
    ) -> impl Future<Output = Result<KeyItem, KeyStoreError>> + Send;

    /// Extends the lease of `holder` if it still holds the started item;
    /// returns the new end.
    fn heartbeat(
        &self,
        key: &ScopedKey,
        holder: &Holder,
        lease: Lease,
    ) -> impl Future<Output = Result<Millis, KeyStoreError>> + Send;

    /// Stores the final answer if `holder` still holds the started item.
    /// Refused, it returns `FencedOut` with the item as it stands, whose
    /// answer (if finished) is the one clients get.
    fn finish(
        &self,
        key: &ScopedKey,
        holder: &Holder,
        finish: &Finish,
    ) -> impl Future<Output = Result<KeyItem, KeyStoreError>> + Send;

    /// Hands the key back after a transient failure, if `holder` still holds it.
    fn release(
        &self,
        key: &ScopedKey,
        holder: &Holder,
        how: Release,
    ) -> impl Future<Output = Result<(), KeyStoreError>> + Send;

    /// Deletes the item if it is finished and its `expires_at` lies before
    /// `gone_before` (for tables without a time-to-live of their own). False
    /// if it does not (any more): gone, or claimed again meanwhile.
    fn delete_expired(
        &self,
        key: &ScopedKey,
        gone_before: Millis,
    ) -> impl Future<Output = Result<bool, KeyStoreError>> + Send;

    /// A strongly consistent read of the item.
    fn get(&self, key: &ScopedKey) -> impl Future<Output = Result<Option<KeyItem>, KeyStoreError>> + Send;

    /// Puts back an item lost from the table (the reconciler's repair of a
    /// key missing while the ledger has its request). Only where no item
    /// exists: a present item comes back as `Taken`.
    fn restore(&self, item: &KeyItem) -> impl Future<Output = Result<(), KeyStoreError>> + Send;

    /// One page of segment `segment` of `total` of a scan of every key item
    /// and every balance (other control items, such as the region registry,
    /// are left out), continuing after `cursor` (a partition key).
    fn scan(
        &self,
        segment: u32,
        total: u32,
        cursor: Option<String>,
    ) -> impl Future<Output = Result<ScanPage, KeyStoreError>> + Send;

    /// Started items in in-flight shard `shard` whose lease ended before `now`.
    fn stale_in_flight(
        &self,
        shard: u64,
        now: Millis,
    ) -> impl Future<Output = Result<Vec<StaleKey>, KeyStoreError>> + Send;

    /// Records that a request left region `handoff.from` (see [`Handoff`]).
    /// Idempotent: the same hand-off written again changes nothing that
    /// matters.
    fn hand_off(&self, handoff: &Handoff) -> impl Future<Output = Result<(), KeyStoreError>> + Send;

    /// The hand-offs from region `from` in shard `shard` (0 to
    /// [`INFLIGHT_SHARDS`] - 1), read through the index: eventually
    /// consistent, so one written a moment ago may be missing (its request's
    /// key item names the region in `left` meanwhile).
    fn handoffs(&self, from: &str, shard: u64) -> impl Future<Output = Result<Vec<Handoff>, KeyStoreError>> + Send;

    /// Every hand-off from region `from`, shard by shard.
    fn all_handoffs(&self, from: &str) -> impl Future<Output = Result<Vec<Handoff>, KeyStoreError>> + Send {
        async move {
            let mut all = Vec::new();
            for shard in 0..INFLIGHT_SHARDS {
                all.extend(self.handoffs(from, shard).await?);
            }
            Ok(all)
        }
    }

    /// Whether a hand-off from `from` names this request (a consistent read).
    fn handoff_of(
        &self,
        from: &str,
        key: &ScopedKey,
        created_at: Millis,
    ) -> impl Future<Output = Result<bool, KeyStoreError>> + Send;

    /// Removes a hand-off once `from`'s leftover of it is voided (or was never there).
    fn forget_handoff(&self, handoff: &Handoff) -> impl Future<Output = Result<(), KeyStoreError>> + Send;

    /// Takes `hold` on its balance for request `by` at `now` (see
    /// [`Balance`]): one conditional write, so no two holds together ever
    /// exceed the balance's total. A hold `by` took before is recognised
    /// (`Held`), not taken twice.
    fn hold(
        &self,
        hold: &Hold,
        by: &HeldBy,
        now: Millis,
    ) -> impl Future<Output = Result<Holding, KeyStoreError>> + Send;

    /// Freezes `balance` (allowing `total`) for good, recording `frozen`:
    /// from then on only lasting holds are taken on it. A balance never
    /// drawn on is made frozen; freezing again keeps the first record.
    fn freeze(
        &self,
        balance: &str,
        total: i64,
        frozen: &Frozen,
    ) -> impl Future<Output = Result<(), KeyStoreError>> + Send;

    /// Settles or releases the hold of request `id` on `balance`, or undoes
    /// a settled one, once: concluding it again the same way is `Already`.
    /// A hold released before is settled only if the balance has room for
    /// it again (taken back first); without room, releasing a settled hold,
    /// undoing one not settled yet, and concluding an undone one otherwise,
    /// is a fault.
    fn conclude_hold(
        &self,
        balance: &str,
        id: Uuid,
        how: Conclusion,
    ) -> impl Future<Output = Result<Concluded, KeyStoreError>> + Send;

    /// The balance as it stands (a consistent read); `None` if never drawn on.
    fn balance(&self, balance: &str) -> impl Future<Output = Result<Option<Balance>, KeyStoreError>> + Send;
}
