//! A client's API keys. A client holds several, each with the time it was
//! made, the time it stops being valid (set when a newer key replaces it,
//! after a grace) and the time it was revoked. Only digests are stored; a
//! key is named to people by its id, the first 12 hex digits of its digest.
//! Rotating claims the new key's pointer, then has the record take the key
//! (on the condition that it is live and unchanged since it was read) and
//! give the keys valid until then the grace; revoking a key is one
//! conditional write of the record. A request's scope is the client,
//! not the key, so a retry with the new key of a request made with the old
//! one is a replay.

use std::collections::HashMap;
use std::time::Duration;

use super::ClientRecord;
use super::store::{ClientStore, ClientsError, KeyRecord, n, pointer, pointer_pk, record_pk, s, store, version};
use crate::domain::{ApiKey, ClientId, Millis};

/// Times a rotation is tried when the record changes under it.
const ROTATE_ATTEMPTS: usize = 3;

/// What a rotation made (no `Debug`: it holds the key).
pub struct Rotated {
    pub client_id: ClientId,
    pub api_key: ApiKey,
    /// When the keys valid until now stop being valid; `None` if there
    /// were none.
    pub previous_key_valid_until: Option<u64>,
}

impl ClientRecord {
    /// Whether the key with `digest` lets this client in at `now`.
    pub fn admits(&self, digest: &str, now: u64) -> bool {
        self.revoked_at.is_none() && self.keys.iter().any(|key| key.digest == digest && key.valid_at(now))
    }
}

impl ClientStore {
    /// Mints a new key for client `id`; the keys valid until now stay
    /// valid for `grace` more (never longer than they already were).
    pub async fn rotate(&self, id: ClientId, grace: Duration) -> Result<Rotated, ClientsError> {
        let (mut record, mut read_at) = self.live_record(id).await?;
        let api_key = ApiKey::generate();
        let digest = api_key.digest();
        self.put_new(id, pointer(id, &digest)).await?;
        for _ in 0..ROTATE_ATTEMPTS {
            let now = Millis::now().get();
            let until = now.saturating_add(grace.as_millis() as u64);
            match self.take_key(id, &record, read_at, &digest, now, until).await {
                Ok(shortened) => {
                    self.changed(id).await;
                    let previous_key_valid_until = shortened.then_some(until);
                    return Ok(Rotated { client_id: id, api_key, previous_key_valid_until });
                }
                Err(ClientsError::Contended(_)) => match self.live_record(id).await {
                    Ok(again) => (record, read_at) = again,
                    Err(e) => return Err(self.unclaimed(&digest, e).await),
                },
                Err(e) => return Err(self.unclaimed(&digest, e).await),
            }
        }
        Err(self.unclaimed(&digest, ClientsError::Contended(id)).await)
    }

    /// Has `record` (read at version `read_at`) take the key `digest`, and
    /// gives its keys valid past `until` that end; whether any had one.
    async fn take_key(
        &self,
        id: ClientId,
        record: &ClientRecord,
        read_at: u64,
        digest: &str,
        now: u64,
        until: u64,
    ) -> Result<bool, ClientsError> {
        let shortened: Vec<&KeyRecord> = record
            .keys
            .iter()
            .filter(|key| key.valid_at(now) && key.valid_until.is_none_or(|old| old > until))
            .collect();
        let mut names =
            HashMap::from([("#keys".to_owned(), "keys".to_owned()), ("#new".to_owned(), digest.to_owned())]);
        let mut values = HashMap::from([
            (":new".to_owned(), KeyRecord::new(digest.to_owned(), now).encode()),
            (":read".to_owned(), n(read_at)),
            (":next".to_owned(), n(read_at + 1)),
        ]);
        let mut sets = vec!["#keys.#new = :new".to_owned(), "version = :next".to_owned()];
        for (i, key) in shortened.iter().enumerate() {
            names.insert(format!("#old{i}"), key.digest.clone());
            sets.push(format!("#keys.#old{i}.valid_until = :until"));
        }
        if !shortened.is_empty() {
            values.insert(":until".to_owned(), n(until));
        }
        let out = self
            .client()
            .update_item()
            .table_name(self.table())
            .key("pk", s(record_pk(id)))
            .update_expression(format!("SET {}", sets.join(", ")))
            .condition_expression("attribute_exists(pk) AND attribute_not_exists(revoked_at) AND version = :read")
            .set_expression_attribute_names(Some(names))
            .set_expression_attribute_values(Some(values))
            .send()
            .await;
        match out {
            Ok(_) => Ok(!shortened.is_empty()),
            Err(e) if e.as_service_error().is_some_and(|e| e.is_conditional_check_failed_exception()) => {
                Err(ClientsError::Contended(id))
            }
            Err(e) => Err(store(e)),
        }
    }

    /// Gives up the pointer of a key no record took (best effort: a pointer
    /// left behind lets nobody in), and passes `why` on.
    async fn unclaimed(&self, digest: &str, why: ClientsError) -> ClientsError {
        let deleted =
            self.client().delete_item().table_name(self.table()).key("pk", s(pointer_pk(digest))).send().await;
        if let Err(e) = deleted {
            tracing::warn!(error = %store(e), "a pointer of a key never taken was left behind");
        }
        why
    }

    /// Revokes the key of client `id` whose id (or digest) is `key_id`.
    pub async fn revoke_key(&self, id: ClientId, key_id: &str) -> Result<ClientRecord, ClientsError> {
        let (record, _) = self.record(id).await?.ok_or(ClientsError::Unknown(id))?;
        let digest = record
            .keys
            .iter()
            .find(|key| key.key_id == key_id || key.digest == key_id)
            .map(|key| key.digest.clone())
            .ok_or_else(|| ClientsError::UnknownKey(id, key_id.to_owned()))?;
        let out = self
            .client()
            .update_item()
            .table_name(self.table())
            .key("pk", s(record_pk(id)))
            .update_expression("SET #keys.#key.revoked_at = if_not_exists(#keys.#key.revoked_at, :at)")
            .condition_expression("attribute_exists(#keys.#key)")
            .expression_attribute_names("#keys", "keys")
            .expression_attribute_names("#key", digest)
            .expression_attribute_values(":at", n(Millis::now().get()))
            .return_values(aws_sdk_dynamodb::types::ReturnValue::AllNew)
            .send()
            .await
            .map_err(store)?;
        let record = out.attributes().map(super::store::decode).transpose()?.ok_or(ClientsError::Unknown(id))?;
        self.changed(id).await;
        Ok(record)
    }

    /// Client `id`'s record, refused if revoked, and the version read.
    async fn live_record(&self, id: ClientId) -> Result<(ClientRecord, u64), ClientsError> {
        let item = self.record_item(id).await?.ok_or(ClientsError::Unknown(id))?;
        let record = super::store::decode(&item)?;
        if record.revoked_at.is_some() {
            return Err(ClientsError::Revoked(id));
        }
        Ok((record, version(&item)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_is_valid_until_its_end_or_its_revocation() {
        let mut key = KeyRecord::new("ab".repeat(32), 1_000);
        assert!(key.valid_at(1_000) && key.valid_at(u64::MAX));
        key.valid_until = Some(2_000);
        assert!(key.valid_at(1_999) && !key.valid_at(2_000));
        key.valid_until = None;
        key.revoked_at = Some(1_500);
        assert!(!key.valid_at(1_000), "revoked is revoked, whenever asked");
        assert_eq!(key.key_id, "abababababab");
    }

    #[test]
    fn a_record_admits_only_its_own_valid_keys_and_none_once_revoked() {
        let mut record = ClientRecord {
            id: ClientId::generate(),
            name: "acme".into(),
            created_at: 0,
            revoked_at: None,
            keys: vec![KeyRecord::new("aa".repeat(32), 0), KeyRecord::new("bb".repeat(32), 0)],
        };
        record.keys[0].valid_until = Some(10);
        assert!(record.admits(&"aa".repeat(32), 9) && !record.admits(&"aa".repeat(32), 10));
        assert!(record.admits(&"bb".repeat(32), 10));
        assert!(!record.admits(&"cc".repeat(32), 0), "a key it never took");
        record.revoked_at = Some(5);
        assert!(!record.admits(&"bb".repeat(32), 0));
    }
}
