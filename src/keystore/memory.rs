//! `MemoryKeyStore`: the key-store protocol as plain Rust over a map, the
//! reference model that property tests compare `DynamoKeyStore` against.
//! It is never wired into the service: an in-process map cannot arbitrate
//! between processes or regions.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;

use super::{
    Balance, Claim, Concluded, Conclusion, Finish, Frozen, Handoff, HeldBy, Hold, HoldEntry, HoldState, Holder,
    Holding, KeyItem, KeyState, KeyStore, KeyStoreError, Lease, Release, ScanPage, StaleKey, StoreFailure,
    inflight_shard, shard_name,
};
use crate::domain::{Fence, Millis, Owner, ScopedKey};
use uuid::Uuid;

#[derive(Debug, Default)]
pub struct MemoryKeyStore {
    items: Mutex<HashMap<String, KeyItem>>,
    /// Hand-offs by their partition key.
    handoffs: Mutex<BTreeMap<String, Handoff>>,
    /// Balances by name.
    balances: Mutex<HashMap<String, Balance>>,
}

impl MemoryKeyStore {
    pub fn new() -> Self {
        Self::default()
    }

    fn with_items<T>(&self, f: impl FnOnce(&mut HashMap<String, KeyItem>) -> T) -> T {
        f(&mut self.items.lock().unwrap_or_else(|poisoned| poisoned.into_inner()))
    }

    fn with_balances<T>(&self, f: impl FnOnce(&mut HashMap<String, Balance>) -> T) -> T {
        f(&mut self.balances.lock().unwrap_or_else(|poisoned| poisoned.into_inner()))
    }

    fn with_handoffs<T>(&self, f: impl FnOnce(&mut BTreeMap<String, Handoff>) -> T) -> T {
        f(&mut self.handoffs.lock().unwrap_or_else(|poisoned| poisoned.into_inner()))
    }
}

fn fenced_out(current: Option<&KeyItem>) -> KeyStoreError {
    KeyStoreError::FencedOut(current.cloned().map(Box::new))
}

impl KeyStore for MemoryKeyStore {
    async fn claim(&self, claim: &Claim) -> Result<KeyItem, KeyStoreError> {
        let live = |item: &&KeyItem| !item.expired(claim.gone_before);
        self.with_items(|items| match items.get(&claim.key.partition_key()).filter(live) {
            Some(existing) if existing.owner == claim.owner && existing.fence == Fence::FIRST => Ok(existing.clone()),
            Some(existing) => Err(KeyStoreError::Taken(Some(Box::new(existing.clone())))),
            None => {
                let item = KeyItem::claimed(claim);
                items.insert(claim.key.partition_key(), item.clone());
                Ok(item)
            }
        })
    }

    async fn take_over(
        &self,
        key: &ScopedKey,
        seen: Fence,
        owner: &Owner,
        lease: Lease,
    ) -> Result<KeyItem, KeyStoreError> {
        self.with_items(|items| {
            let Some(item) = items.get_mut(&key.partition_key()) else {
                return Err(KeyStoreError::Taken(None));
            };
            let stale = item.state == KeyState::Started && item.lease_until < lease.now && item.fence == seen;
            let ours = item.owner == *owner && item.fence == seen.next() && item.state == KeyState::Started;
            if stale {
                item.fence = seen.next();
                item.lease_until = lease.until();
                item.owner = owner.clone();
            }
            if stale || ours { Ok(item.clone()) } else { Err(KeyStoreError::Taken(Some(Box::new(item.clone())))) }
        })
    }

    async fn fail_over(
        &self,
        key: &ScopedKey,
        seen: Fence,
        owner: &Owner,
        lease: Lease,
        from: &str,
        to: &str,
    ) -> Result<KeyItem, KeyStoreError> {
        self.with_items(|items| {
            let Some(item) = items.get_mut(&key.partition_key()) else {
                return Err(KeyStoreError::Taken(None));
            };
            let movable = item.state == KeyState::Started
                && item.fence == seen
                && item.home_region == from
                && !item.left.contains(to);
            let ours = item.state == KeyState::Started
                && item.owner == *owner
                && item.fence == seen.next()
                && item.home_region == to
                && item.left.contains(from);
            if movable {
                item.fence = seen.next();
                item.lease_until = lease.until();
                item.owner = owner.clone();
                item.home_region = to.to_owned();
                item.left.insert(from.to_owned());
            }
            if movable || ours { Ok(item.clone()) } else { Err(KeyStoreError::Taken(Some(Box::new(item.clone())))) }
        })
    }

    async fn heartbeat(&self, key: &ScopedKey, holder: &Holder, lease: Lease) -> Result<Millis, KeyStoreError> {
        self.with_items(|items| match items.get_mut(&key.partition_key()) {
            Some(item) if item.held_by(holder) => {
                item.lease_until = lease.until();
                Ok(item.lease_until)
            }
            other => Err(fenced_out(other.as_deref())),
        })
    }

    async fn finish(&self, key: &ScopedKey, holder: &Holder, finish: &Finish) -> Result<KeyItem, KeyStoreError> {
        self.with_items(|items| match items.get_mut(&key.partition_key()) {
            Some(item) if item.held_by(holder) => {
                item.state = KeyState::Finished;
                item.response = Some(finish.response.clone());
                item.expires_at = Some(finish.expires_at.as_secs());
                Ok(item.clone())
            }
            Some(item)
                if item.state == KeyState::Finished && item.fence == holder.fence && item.owner == holder.owner =>
            {
                Ok(item.clone())
            }
            other => Err(fenced_out(other.as_deref())),
        })
    }

    async fn release(&self, key: &ScopedKey, holder: &Holder, how: Release) -> Result<(), KeyStoreError> {
        let how = if how == Release::Forget && holder.fence != Fence::FIRST { Release::Reopen } else { how };
        self.with_items(|items| {
            let pk = key.partition_key();
            match (items.get_mut(&pk), how) {
                (Some(item), Release::Forget | Release::Abandon) if item.held_by(holder) => {
                    items.remove(&pk);
                    Ok(())
                }
                (Some(item), Release::Reopen) if item.held_by(holder) => {
                    item.lease_until = Millis::new(0);
                    Ok(())
                }
                (None, Release::Forget | Release::Abandon) => Ok(()),
                (other, _) => Err(fenced_out(other.as_deref())),
            }
        })
    }

    async fn delete_expired(&self, key: &ScopedKey, gone_before: Millis) -> Result<bool, KeyStoreError> {
        self.with_items(|items| {
            let pk = key.partition_key();
            let expired = items.get(&pk).is_some_and(|item| item.expired(gone_before));
            if expired {
                items.remove(&pk);
            }
            Ok(expired)
        })
    }

    async fn get(&self, key: &ScopedKey) -> Result<Option<KeyItem>, KeyStoreError> {
        Ok(self.with_items(|items| items.get(&key.partition_key()).cloned()))
    }

    async fn restore(&self, item: &KeyItem) -> Result<(), KeyStoreError> {
        self.with_items(|items| match items.get(&item.key.partition_key()) {
            Some(existing) => Err(KeyStoreError::Taken(Some(Box::new(existing.clone())))),
            None => {
                items.insert(item.key.partition_key(), item.clone());
                Ok(())
            }
        })
    }

    /// Segments by a hash of the partition key; the cursor is the last
    /// partition key returned (pages of at most 100, in key order).
    async fn scan(&self, segment: u32, total: u32, cursor: Option<String>) -> Result<ScanPage, KeyStoreError> {
        // Every balance comes with the first page of segment 0.
        let balances = if segment == 0 && cursor.is_none() {
            self.with_balances(|all| all.iter().map(|(name, b)| (name.clone(), b.clone())).collect())
        } else {
            Vec::new()
        };
        let (items, next) = self.with_items(|items| {
            let mut mine: Vec<(&String, &KeyItem)> = items
                .iter()
                .filter(|(pk, _)| {
                    let hash = pk.bytes().fold(0_u32, |h, b| h.wrapping_mul(31).wrapping_add(u32::from(b)));
                    hash % total.max(1) == segment
                })
                .filter(|(pk, _)| cursor.as_ref().is_none_or(|c| *pk > c))
                .collect();
            mine.sort_by(|a, b| a.0.cmp(b.0));
            let page: Vec<KeyItem> = mine.iter().take(100).map(|(_, item)| (*item).clone()).collect();
            let next = (mine.len() > 100).then(|| mine[99].0.clone());
            (page, next)
        });
        Ok(ScanPage { items, balances, next })
    }

    async fn stale_in_flight(&self, shard: u64, now: Millis) -> Result<Vec<StaleKey>, KeyStoreError> {
        Ok(self.with_items(|items| {
            items
                .iter()
                .filter(|(pk, item)| {
                    item.state == KeyState::Started && item.lease_until < now && inflight_shard(pk) == shard_name(shard)
                })
                .map(|(_, item)| item.stale())
                .collect()
        }))
    }

    async fn hand_off(&self, handoff: &Handoff) -> Result<(), KeyStoreError> {
        self.with_handoffs(|all| all.insert(handoff.partition_key(), handoff.clone()));
        Ok(())
    }

    async fn handoffs(&self, from: &str, shard: u64) -> Result<Vec<Handoff>, KeyStoreError> {
        Ok(self.with_handoffs(|all| {
            all.values()
                .filter(|h| h.from == from && inflight_shard(&h.key.partition_key()) == shard_name(shard))
                .cloned()
                .collect()
        }))
    }

    async fn handoff_of(&self, from: &str, key: &ScopedKey, created_at: Millis) -> Result<bool, KeyStoreError> {
        Ok(self.with_handoffs(|all| all.contains_key(&super::handoff::partition_key(from, key, created_at))))
    }

    async fn forget_handoff(&self, handoff: &Handoff) -> Result<(), KeyStoreError> {
        self.with_handoffs(|all| all.remove(&handoff.partition_key()));
        Ok(())
    }

    async fn hold(&self, hold: &Hold, by: &HeldBy, now: Millis) -> Result<Holding, KeyStoreError> {
        self.with_balances(|all| {
            let balance =
                all.entry(hold.balance.clone()).or_insert_with(|| Balance { total: hold.total, ..Balance::default() });
            if balance.total != hold.total {
                return Err(KeyStoreError::Fault(StoreFailure::said(format!(
                    "balance {} allows {}",
                    hold.balance, balance.total
                ))));
            }
            if balance.hold(by.id).is_some() {
                return Ok(Holding::Held);
            }
            if hold.amount <= 0 || hold.amount > balance.room_for(hold) {
                return Ok(Holding::Exceeded { left: balance.left() });
            }
            balance.reserved += hold.amount;
            balance.holds.push(HoldEntry {
                by: by.clone(),
                amount: hold.amount,
                state: HoldState::Held,
                at: now,
                lasting: hold.lasting,
            });
            Ok(Holding::Held)
        })
    }

    async fn freeze(&self, balance: &str, total: i64, frozen: &Frozen) -> Result<(), KeyStoreError> {
        self.with_balances(|all| {
            let balance = all.entry(balance.to_owned()).or_insert_with(|| Balance { total, ..Balance::default() });
            if balance.total != total {
                return Err(KeyStoreError::Fault(StoreFailure::said("the balance allows another total")));
            }
            balance.frozen.get_or_insert_with(|| frozen.clone());
            Ok(())
        })
    }

    async fn conclude_hold(&self, balance: &str, id: Uuid, how: Conclusion) -> Result<Concluded, KeyStoreError> {
        self.with_balances(|all| {
            let Some(balance) = all.get_mut(balance) else { return Ok(Concluded::Missing) };
            let Some(entry) = balance.holds.iter_mut().find(|h| h.by.id == id) else { return Ok(Concluded::Missing) };
            let to = match how {
                Conclusion::Settle => HoldState::Settled,
                Conclusion::Release => HoldState::Released,
                Conclusion::Undo => HoldState::Undone,
            };
            let amount = entry.amount;
            match (entry.state, how) {
                (HoldState::Held, Conclusion::Settle) => balance.settled += amount,
                (HoldState::Held, Conclusion::Release) => balance.reserved -= amount,
                (HoldState::Settled, Conclusion::Undo) => {
                    balance.settled -= amount;
                    balance.reserved -= amount;
                }
                (state, _) if state == to => return Ok(Concluded::Already),
                // Released, then settled after all: taken back first, if there is room.
                (HoldState::Released, Conclusion::Settle) if balance.total - balance.reserved >= amount => {
                    balance.reserved += amount;
                    balance.settled += amount;
                }
                _ => return Err(KeyStoreError::Fault(StoreFailure::said("the hold cannot be concluded so"))),
            }
            entry.state = to;
            Ok(Concluded::Now)
        })
    }

    async fn balance(&self, balance: &str) -> Result<Option<Balance>, KeyStoreError> {
        Ok(self.with_balances(|all| all.get(balance).cloned()))
    }
}
