//! Hand-offs: the durable record that a request left a region. A failover
//! moves a request from region R to another while R's ledger still holds
//! what R's owners did of it; the key item names R in its `left` set (in
//! the failover's own conditional write), but the key item expires with
//! its retention, and R may come back long after. So before the new owner
//! writes anything of the request, it records a hand-off per region the
//! request left: a control item of the key table, kept until R's
//! reconciler has voided its leftover and removes it. R's reconciler finds
//! its hand-offs without a scan, through the in-flight index (the hand-off
//! items use its two attributes, under partitions of their own:
//! `handoff#{region}#NN`, sharded like in-flight keys).

use std::collections::HashMap;

use aws_sdk_dynamodb::types::AttributeValue;
use uuid::Uuid;

use super::item::{CONTROL_PREFIX, attr, get_n, get_s, inflight_shard_of, malformed, n, s};
use super::{KeyItem, KeyStoreError};
use crate::domain::{ClientId, Fence, IdempotencyKey, Millis, ScopedKey};

/// One request that left region `from` for region `to`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Handoff {
    pub from: String,
    pub to: String,
    pub key: ScopedKey,
    /// The key item's `created_at`: which request under the key.
    pub created_at: Millis,
    pub payment_id: Uuid,
    /// A fence granted after the move: every owner `from` ever had held an
    /// older one, so a void under this fence passes `from`'s ledger check.
    pub fence: Fence,
}

impl Handoff {
    /// The hand-off from `from` of the request `item` now holds.
    pub fn of(item: &KeyItem, from: &str) -> Self {
        Self {
            from: from.to_owned(),
            to: item.home_region.clone(),
            key: item.key.clone(),
            created_at: item.created_at,
            payment_id: item.payment_id,
            fence: item.fence,
        }
    }

    /// Its item's partition key: one per region left and request.
    pub(super) fn partition_key(&self) -> String {
        partition_key(&self.from, &self.key, self.created_at)
    }
}

pub(super) fn partition_key(from: &str, key: &ScopedKey, created_at: Millis) -> String {
    format!("{CONTROL_PREFIX}handoff#{from}#{}#{}", created_at.get(), key.partition_key())
}

/// The index partition of `from`'s hand-offs in shard `shard`.
pub(super) fn index_partition(from: &str, shard: u64) -> String {
    format!("handoff#{from}#{shard:02}")
}

pub(super) fn encode(handoff: &Handoff, at: Millis) -> HashMap<String, AttributeValue> {
    let shard = inflight_shard_of(&handoff.key.partition_key());
    HashMap::from([
        (attr::PK.to_owned(), s(handoff.partition_key())),
        ("kind".to_owned(), s("handoff")),
        ("from".to_owned(), s(handoff.from.as_str())),
        (attr::INFLIGHT.to_owned(), s(index_partition(&handoff.from, shard))),
        (attr::LEASE_UNTIL.to_owned(), n(at.get())),
        (attr::CLIENT_ID.to_owned(), s(handoff.key.client.to_string())),
        (attr::KEY.to_owned(), s(handoff.key.key.as_str())),
        (attr::CREATED_AT.to_owned(), n(handoff.created_at.get())),
        (attr::PAYMENT_ID.to_owned(), s(handoff.payment_id.to_string())),
        (attr::FENCE.to_owned(), n(handoff.fence.get())),
        (attr::HOME_REGION.to_owned(), s(handoff.to.as_str())),
    ])
}

/// Decodes a hand-off from what the index projects (`from` is the
/// partition the caller asked for).
pub(super) fn decode(from: &str, attrs: &HashMap<String, AttributeValue>) -> Result<Handoff, KeyStoreError> {
    let client: ClientId = get_s(attrs, attr::CLIENT_ID)?.parse().map_err(|e| malformed(attr::CLIENT_ID, e))?;
    let key = IdempotencyKey::parse(get_s(attrs, attr::KEY)?).map_err(|e| malformed(attr::KEY, e))?;
    Ok(Handoff {
        from: from.to_owned(),
        to: get_s(attrs, attr::HOME_REGION)?.to_owned(),
        key: ScopedKey::new(client, key),
        created_at: Millis::new(get_n(attrs, attr::CREATED_AT)?),
        payment_id: get_s(attrs, attr::PAYMENT_ID)?.parse().map_err(|e| malformed(attr::PAYMENT_ID, e))?,
        fence: Fence::new(get_n(attrs, attr::FENCE)?),
    })
}
