//! How a [`KeyItem`] (one idempotency key's record in the key store) is
//! encoded as DynamoDB attributes. The sparse `inflight` attribute exists
//! only while the item is started; it names one of [`INFLIGHT_SHARDS`] GSI
//! partitions (from a hash of the partition key) so the recovery worker can
//! find stale leases without one hot index partition.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use aws_sdk_dynamodb::primitives::Blob;
use aws_sdk_dynamodb::types::AttributeValue;

use super::key_item::{KeyItem, KeyState, StaleKey};
use super::{KeyStoreError, StoreFailure};
use crate::domain::{ClientId, Fence, IdempotencyKey, Millis, Owner, RequestHash, ScopedKey, StoredResponse};

/// The partition-key prefix of the table's control items (the region
/// registry, API clients). A key item's partition key begins with a
/// client's UUID, so it can never begin with this.
pub const CONTROL_PREFIX: &str = "control#";

/// How many GSI partitions the in-flight index is spread over.
pub const INFLIGHT_SHARDS: u64 = 16;

/// Attribute names, in one place so expressions and codecs agree.
pub(super) mod attr {
    pub const PK: &str = "pk";
    pub const CLIENT_ID: &str = "client_id";
    pub const KEY: &str = "idem_key";
    pub const REQUEST_HASH: &str = "request_hash";
    pub const REQUEST: &str = "request";
    pub const STATE: &str = "state";
    pub const FENCE: &str = "fence";
    pub const LEASE_UNTIL: &str = "lease_until";
    pub const OWNER: &str = "owner";
    pub const HOME_REGION: &str = "home_region";
    pub const CREATED_AT: &str = "created_at";
    pub const PAYMENT_ID: &str = "payment_id";
    pub const RESPONSE_STATUS: &str = "response_status";
    pub const RESPONSE_HEADERS: &str = "response_headers";
    pub const RESPONSE_BODY: &str = "response_body";
    pub const EXPIRES_AT: &str = "expires_at";
    pub const INFLIGHT: &str = "inflight";
    pub const LEFT: &str = "left";
    pub const OPERATION: &str = "operation";
}

/// The in-flight GSI partition of a partition key.
pub fn inflight_shard(pk: &str) -> String {
    shard_name(inflight_shard_of(pk))
}

/// The shard of a partition key (FNV-1a, stable forever: changing it would
/// strand started items and hand-offs in shards nobody queries).
pub(super) fn inflight_shard_of(pk: &str) -> u64 {
    let hash =
        pk.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3));
    hash % INFLIGHT_SHARDS
}

/// The `inflight` value of shard `i` (0 to [`INFLIGHT_SHARDS`] - 1).
pub fn shard_name(i: u64) -> String {
    format!("inflight#{i:02}")
}

/// Decodes an in-flight index entry (only the projected attributes).
pub(super) fn decode_stale(attrs: &HashMap<String, AttributeValue>) -> Result<StaleKey, KeyStoreError> {
    let client: ClientId = get_s(attrs, attr::CLIENT_ID)?.parse().map_err(|e| malformed(attr::CLIENT_ID, e))?;
    let key = IdempotencyKey::parse(get_s(attrs, attr::KEY)?).map_err(|e| malformed(attr::KEY, e))?;
    Ok(StaleKey {
        key: ScopedKey::new(client, key),
        fence: Fence::new(get_n(attrs, attr::FENCE)?),
        home_region: get_s(attrs, attr::HOME_REGION)?.to_owned(),
        lease_until: Millis::new(get_n(attrs, attr::LEASE_UNTIL)?),
        created_at: Millis::new(get_n(attrs, attr::CREATED_AT)?),
    })
}

pub(super) fn n(value: u64) -> AttributeValue {
    AttributeValue::N(value.to_string())
}

pub(super) fn s(value: impl Into<String>) -> AttributeValue {
    AttributeValue::S(value.into())
}

pub(super) fn b(value: &[u8]) -> AttributeValue {
    AttributeValue::B(Blob::new(value))
}

/// Encodes a freshly claimed item.
pub(super) fn encode(item: &KeyItem) -> HashMap<String, AttributeValue> {
    let pk = item.key.partition_key();
    let mut attrs = HashMap::from([
        (attr::INFLIGHT.to_owned(), s(inflight_shard(&pk))),
        (attr::PK.to_owned(), s(pk)),
        (attr::CLIENT_ID.to_owned(), s(item.key.client.to_string())),
        (attr::KEY.to_owned(), s(item.key.key.as_str())),
        (attr::REQUEST_HASH.to_owned(), s(item.request_hash.as_str())),
        (attr::REQUEST.to_owned(), b(&item.request)),
        (attr::OPERATION.to_owned(), s(item.operation.as_str())),
        (attr::STATE.to_owned(), s(item.state.as_str())),
        (attr::FENCE.to_owned(), n(item.fence.get())),
        (attr::LEASE_UNTIL.to_owned(), n(item.lease_until.get())),
        (attr::OWNER.to_owned(), s(item.owner.as_str())),
        (attr::HOME_REGION.to_owned(), s(item.home_region.as_str())),
        (attr::CREATED_AT.to_owned(), n(item.created_at.get())),
        (attr::PAYMENT_ID.to_owned(), s(item.payment_id.to_string())),
    ]);
    if let Some(response) = &item.response {
        attrs.extend(encode_response(response));
    }
    if let Some(expires_at) = item.expires_at {
        attrs.insert(attr::EXPIRES_AT.to_owned(), n(expires_at));
    }
    // A string set cannot be empty: absent means none.
    if !item.left.is_empty() {
        attrs.insert(attr::LEFT.to_owned(), AttributeValue::Ss(item.left.iter().cloned().collect()));
    }
    if item.state == KeyState::Finished {
        attrs.remove(attr::INFLIGHT);
    }
    attrs
}

pub(super) fn encode_response(response: &StoredResponse) -> [(String, AttributeValue); 3] {
    let headers = response.headers.iter().map(|(k, v)| (k.clone(), s(v.as_str()))).collect();
    [
        (attr::RESPONSE_STATUS.to_owned(), n(u64::from(response.status))),
        (attr::RESPONSE_HEADERS.to_owned(), AttributeValue::M(headers)),
        (attr::RESPONSE_BODY.to_owned(), b(&response.body)),
    ]
}

/// Decodes an item read back from the table.
pub(super) fn decode(attrs: &HashMap<String, AttributeValue>) -> Result<KeyItem, KeyStoreError> {
    let client: ClientId = get_s(attrs, attr::CLIENT_ID)?.parse().map_err(|e| malformed(attr::CLIENT_ID, e))?;
    let key = IdempotencyKey::parse(get_s(attrs, attr::KEY)?).map_err(|e| malformed(attr::KEY, e))?;
    let state = match get_s(attrs, attr::STATE)? {
        "started" => KeyState::Started,
        "finished" => KeyState::Finished,
        other => return Err(malformed(attr::STATE, other)),
    };
    let response = match attrs.get(attr::RESPONSE_STATUS) {
        None => None,
        Some(_) => Some(StoredResponse {
            status: u16::try_from(get_n(attrs, attr::RESPONSE_STATUS)?)
                .map_err(|e| malformed(attr::RESPONSE_STATUS, e))?,
            headers: decode_headers(attrs)?,
            body: get_b(attrs, attr::RESPONSE_BODY)?.to_vec(),
        }),
    };
    Ok(KeyItem {
        key: ScopedKey::new(client, key),
        request_hash: RequestHash::from_hex(get_s(attrs, attr::REQUEST_HASH)?.to_owned()),
        request: get_b(attrs, attr::REQUEST)?.to_vec(),
        operation: match attrs.get(attr::OPERATION) {
            None => "payment".to_owned(),
            Some(_) => get_s(attrs, attr::OPERATION)?.to_owned(),
        },
        state,
        fence: Fence::new(get_n(attrs, attr::FENCE)?),
        lease_until: Millis::new(get_n(attrs, attr::LEASE_UNTIL)?),
        owner: Owner::from_stored(get_s(attrs, attr::OWNER)?.to_owned()),
        home_region: get_s(attrs, attr::HOME_REGION)?.to_owned(),
        created_at: Millis::new(get_n(attrs, attr::CREATED_AT)?),
        payment_id: get_s(attrs, attr::PAYMENT_ID)?.parse().map_err(|e| malformed(attr::PAYMENT_ID, e))?,
        response,
        expires_at: attrs.get(attr::EXPIRES_AT).map(|_| get_n(attrs, attr::EXPIRES_AT)).transpose()?,
        left: match attrs.get(attr::LEFT) {
            None => BTreeSet::new(),
            Some(AttributeValue::Ss(regions)) => regions.iter().cloned().collect(),
            Some(_) => return Err(malformed(attr::LEFT, "not a string set")),
        },
    })
}

fn decode_headers(attrs: &HashMap<String, AttributeValue>) -> Result<BTreeMap<String, String>, KeyStoreError> {
    let Some(value) = attrs.get(attr::RESPONSE_HEADERS) else {
        return Ok(BTreeMap::new());
    };
    let map = value.as_m().map_err(|_| malformed(attr::RESPONSE_HEADERS, "not a map"))?;
    map.iter()
        .map(|(k, v)| match v.as_s() {
            Ok(v) => Ok((k.clone(), v.clone())),
            Err(_) => Err(malformed(attr::RESPONSE_HEADERS, k)),
        })
        .collect()
}

pub(super) fn get_s<'a>(attrs: &'a HashMap<String, AttributeValue>, name: &str) -> Result<&'a str, KeyStoreError> {
    match attrs.get(name) {
        Some(AttributeValue::S(v)) => Ok(v),
        _ => Err(malformed(name, "missing or not a string")),
    }
}

pub(super) fn get_n(attrs: &HashMap<String, AttributeValue>, name: &str) -> Result<u64, KeyStoreError> {
    match attrs.get(name) {
        Some(AttributeValue::N(v)) => v.parse().map_err(|e| malformed(name, e)),
        _ => Err(malformed(name, "missing or not a number")),
    }
}

fn get_b<'a>(attrs: &'a HashMap<String, AttributeValue>, name: &str) -> Result<&'a [u8], KeyStoreError> {
    match attrs.get(name) {
        Some(AttributeValue::B(v)) => Ok(v.as_ref()),
        _ => Err(malformed(name, "missing or not binary")),
    }
}

pub(super) fn malformed(name: &str, why: impl std::fmt::Display) -> KeyStoreError {
    KeyStoreError::Fault(StoreFailure::said(format!("key item attribute {name}: {why}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_are_stable_and_spread() {
        assert_eq!(inflight_shard("a#b"), inflight_shard("a#b"));
        let shards: std::collections::HashSet<_> =
            (0..1000).map(|i| inflight_shard(&format!("client#key-{i}"))).collect();
        assert_eq!(shards.len() as u64, INFLIGHT_SHARDS);
    }
}
