//! `ClientStore`: clients as control items of the key table. Each client
//! is one record, `control#clients#record#{id}`: its name, when it was
//! created and revoked, its keys (by digest, each with its own times), its
//! accounts and limits. Each key also has a pointer,
//! `control#clients#key#{digest}`, naming the client: a presented key is
//! one read from its client's id, and the record says whether it is
//! valid. The pointer is only a claim on the digest (written first, on the
//! condition that it is new); a key exists once the record takes it, in a
//! write conditioned on the record existing, unrevoked and unchanged since
//! it was read. A pointer naming a client whose record does not hold its
//! key (left by a crash between the two writes, or written by anyone
//! else) lets nobody in. No transactions: the table may be a multi-Region
//! strongly consistent one, which has none. Records are listed through the
//! table's index (partition `clients`, in order of creation), and every
//! change reads and writes the one record: nothing scans the table.

use std::collections::HashMap;

use aws_sdk_dynamodb::Client;
use aws_sdk_dynamodb::error::DisplayErrorContext;
use aws_sdk_dynamodb::types::{AttributeValue, KeysAndAttributes};
use serde::Serialize;

use super::ClientRecord;
use crate::domain::{ApiKey, ClientId, Millis};
use crate::keystore::{INDEX_PARTITION, INDEX_SORT, INFLIGHT_INDEX};

/// Where every client item of this layout lives.
pub(super) const RECORD_SPACE: &str = "control#clients#";
const RECORD: &str = "control#clients#record#";
const POINTER: &str = "control#clients#key#";

/// The index partition every client record is listed under.
const LISTED: &str = "clients";

#[derive(Debug, thiserror::Error)]
pub enum ClientsError {
    #[error("the client directory could not be read or written: {0}")]
    Store(String),
    #[error("a client record is malformed: {0}")]
    Malformed(String),
    #[error("no client {0}")]
    Unknown(ClientId),
    #[error("client {0} is revoked")]
    Revoked(ClientId),
    #[error("client {0} has no key {1}")]
    UnknownKey(ClientId, String),
    #[error("client {0} was changed by someone else meanwhile; try again")]
    Contended(ClientId),
    #[error("the client directory has not been read in time")]
    Busy,
}

pub(super) type Attrs = HashMap<String, AttributeValue>;

/// The pause before asking again for records a batch read left
/// unprocessed (longer each time), and how often it is asked again.
const UNPROCESSED_WAIT: std::time::Duration = std::time::Duration::from_millis(50);
const UNPROCESSED_TRIES: u32 = 8;

/// Hex digits of the digest that name a key to people.
const KEY_ID_DIGITS: usize = 12;

/// One of a client's keys.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct KeyRecord {
    #[serde(skip)]
    pub digest: String,
    /// The first hex digits of the digest: how a person names the key.
    pub key_id: String,
    /// Milliseconds since the epoch, all three.
    pub created_at: u64,
    /// Past it, the key is refused (a newer one replaced it).
    pub valid_until: Option<u64>,
    pub revoked_at: Option<u64>,
}

impl KeyRecord {
    pub(super) fn new(digest: String, created_at: u64) -> Self {
        let key_id = digest.chars().take(KEY_ID_DIGITS).collect();
        Self { digest, key_id, created_at, valid_until: None, revoked_at: None }
    }

    /// Whether the key is valid at `now` (milliseconds since the epoch).
    pub fn valid_at(&self, now: u64) -> bool {
        self.revoked_at.is_none() && self.valid_until.is_none_or(|until| now < until)
    }

    pub(super) fn encode(&self) -> AttributeValue {
        let mut key = HashMap::from([("created_at".to_owned(), n(self.created_at))]);
        if let Some(until) = self.valid_until {
            key.insert("valid_until".to_owned(), n(until));
        }
        if let Some(at) = self.revoked_at {
            key.insert("revoked_at".to_owned(), n(at));
        }
        AttributeValue::M(key)
    }

    pub(super) fn decode(digest: &str, value: &AttributeValue) -> Result<Self, ClientsError> {
        let AttributeValue::M(key) = value else { return Err(ClientsError::Malformed("keys".into())) };
        let mut record = Self::new(digest.to_owned(), number(key, "created_at")?.unwrap_or_default());
        record.valid_until = number(key, "valid_until")?;
        record.revoked_at = number(key, "revoked_at")?;
        Ok(record)
    }
}

#[derive(Clone, Debug)]
pub struct ClientStore {
    client: Client,
    table: String,
}

impl ClientStore {
    pub fn new(client: Client, table: impl Into<String>) -> Self {
        Self { client, table: table.into() }
    }

    pub(super) fn client(&self) -> &Client {
        &self.client
    }

    pub(super) fn table(&self) -> &str {
        &self.table
    }

    /// Client `id`'s record item as it is now (a strongly consistent read).
    pub(super) async fn record_item(&self, id: ClientId) -> Result<Option<Attrs>, ClientsError> {
        let out = self
            .client
            .get_item()
            .table_name(&self.table)
            .key("pk", s(record_pk(id)))
            .consistent_read(true)
            .send()
            .await
            .map_err(store)?;
        Ok(out.item)
    }

    /// Registers a new client holding the (new) API key `key`.
    pub async fn add(&self, name: &str, key: &ApiKey) -> Result<ClientRecord, ClientsError> {
        let now = Millis::now().get();
        let record = ClientRecord {
            id: ClientId::generate(),
            name: name.to_owned(),
            created_at: now,
            revoked_at: None,
            keys: vec![KeyRecord::new(key.digest(), now)],
        };
        self.create(&record).await?;
        Ok(record)
    }

    /// Registers a client that already exists elsewhere (an older layout,
    /// a ledger), under its id, holding the key with `digest`; a no-op if
    /// that key is registered already.
    pub async fn put(&self, mut record: ClientRecord, digest: &str) -> Result<ClientRecord, ClientsError> {
        if let Some(existing) = self.by_digest(digest).await? {
            return Ok(existing);
        }
        record.keys = vec![KeyRecord::new(digest.to_owned(), record.created_at)];
        match self.create(&record).await {
            Ok(()) => Ok(record),
            // Put there meanwhile, by another migrate.
            Err(ClientsError::Contended(_)) => {
                self.by_digest(digest).await?.ok_or_else(|| ClientsError::Malformed("vanished while added".into()))
            }
            Err(e) => Err(e),
        }
    }

    /// Writes the pointers of a new record's keys, then the record.
    async fn create(&self, record: &ClientRecord) -> Result<(), ClientsError> {
        let mut item: Attrs = HashMap::from([
            ("pk".to_owned(), s(record_pk(record.id))),
            ("kind".to_owned(), s("client")),
            ("client_id".to_owned(), s(record.id.to_string())),
            ("name".to_owned(), s(&record.name)),
            ("created_at".to_owned(), n(record.created_at)),
            ("version".to_owned(), n(0)),
            (
                "keys".to_owned(),
                AttributeValue::M(record.keys.iter().map(|k| (k.digest.clone(), k.encode())).collect()),
            ),
            (INDEX_PARTITION.to_owned(), s(LISTED)),
            (INDEX_SORT.to_owned(), n(record.created_at)),
        ]);
        if let Some(at) = record.revoked_at {
            item.insert("revoked_at".to_owned(), n(at));
        }
        for key in &record.keys {
            match self.put_new(record.id, pointer(record.id, &key.digest)).await {
                // Claimed for this client before a crash: go on.
                Err(ClientsError::Contended(_)) if self.owner_of(&key.digest).await? == Some(record.id) => {}
                claimed => claimed?,
            }
        }
        self.put_new(record.id, item).await?;
        self.changed(record.id).await;
        Ok(())
    }

    /// Puts `item` on the condition that nothing is there yet (else
    /// `Contended`).
    pub(super) async fn put_new(&self, id: ClientId, item: Attrs) -> Result<(), ClientsError> {
        self.put_when(id, item, "attribute_not_exists(pk)", None).await
    }

    /// Puts `item` (a change of client `id`'s) on `condition` with `values`;
    /// `Contended` when the condition does not hold.
    pub(super) async fn put_when(
        &self,
        id: ClientId,
        item: Attrs,
        condition: &str,
        values: Option<Attrs>,
    ) -> Result<(), ClientsError> {
        let put = self
            .client
            .put_item()
            .table_name(&self.table)
            .set_item(Some(item))
            .condition_expression(condition)
            .set_expression_attribute_values(values)
            .send()
            .await;
        match put {
            Ok(_) => Ok(()),
            Err(e) if e.as_service_error().is_some_and(|e| e.is_conditional_check_failed_exception()) => {
                Err(ClientsError::Contended(id))
            }
            Err(e) => Err(store(e)),
        }
    }

    /// The client the key with `digest` was minted for, whatever its state.
    pub async fn by_digest(&self, digest: &str) -> Result<Option<ClientRecord>, ClientsError> {
        match self.owner_of(digest).await? {
            Some(id) => Ok(self.record(id).await?.map(|(record, _)| record)),
            None => Ok(None),
        }
    }

    /// The id the pointer of `digest` names, if there is one.
    pub async fn owner_of(&self, digest: &str) -> Result<Option<ClientId>, ClientsError> {
        let out = self
            .client
            .get_item()
            .table_name(&self.table)
            .key("pk", s(pointer_pk(digest)))
            .consistent_read(true)
            .send()
            .await
            .map_err(store)?;
        out.item().map(|item| text(item, "client_id")?.parse().map_err(|_| malformed("client_id"))).transpose()
    }

    /// Every client, oldest first: the index's `clients` partition, then
    /// the records it names (100 a read).
    pub async fn list(&self) -> Result<Vec<ClientRecord>, ClientsError> {
        let ids = self.listed().await?;
        let mut records = Vec::with_capacity(ids.len());
        for chunk in ids.chunks(100) {
            for item in self.records(chunk).await? {
                records.push(decode(&item)?);
            }
        }
        records.sort_by_key(|r| (r.created_at, r.id));
        Ok(records)
    }

    /// The ids of every client the index lists (a client made a moment ago
    /// may not be listed yet).
    pub(super) async fn listed(&self) -> Result<Vec<ClientId>, ClientsError> {
        let mut ids = Vec::new();
        let mut start = None;
        loop {
            let page = self
                .client
                .query()
                .table_name(&self.table)
                .index_name(INFLIGHT_INDEX)
                .key_condition_expression("#partition = :listed")
                .expression_attribute_names("#partition", INDEX_PARTITION)
                .expression_attribute_values(":listed", s(LISTED))
                .set_exclusive_start_key(start)
                .send()
                .await
                .map_err(store)?;
            for entry in page.items() {
                // One listing that does not read hides no other client.
                match text(entry, "client_id").ok().and_then(|id| id.parse::<ClientId>().ok()) {
                    Some(id) => ids.push(id),
                    None => tracing::error!(pk = ?entry.get("pk"), "a client listing names no client; left out"),
                }
            }
            start = page.last_evaluated_key().cloned();
            if start.is_none() {
                return Ok(ids);
            }
        }
    }

    /// The record items of `ids` (at most 100), in one batch (and its
    /// retries), as stored: the caller decodes each, so one that does not
    /// read keeps no other from being read.
    pub(super) async fn records(&self, ids: &[ClientId]) -> Result<Vec<Attrs>, ClientsError> {
        let keys = ids.iter().map(|id| HashMap::from([("pk".to_owned(), s(record_pk(*id)))])).collect();
        let mut wanted =
            Some(KeysAndAttributes::builder().set_keys(Some(keys)).consistent_read(true).build().map_err(store)?);
        let mut found = Vec::new();
        let mut throttled = 0;
        while let Some(batch) = wanted.take() {
            let out = self.client.batch_get_item().request_items(&self.table, batch).send().await.map_err(store)?;
            for item in out.responses().and_then(|r| r.get(&self.table)).into_iter().flatten() {
                found.push(item.clone());
            }
            wanted = out.unprocessed_keys().and_then(|u| u.get(&self.table)).cloned();
            if wanted.is_some() {
                // Throttled: give the table a moment before asking again,
                // and give up (the caller keeps what it had) past a few.
                throttled += 1;
                if throttled > UNPROCESSED_TRIES {
                    return Err(ClientsError::Store("the table kept leaving records unread (throttled)".into()));
                }
                tokio::time::sleep(UNPROCESSED_WAIT * throttled).await;
            }
        }
        Ok(found)
    }

    /// Revokes client `id`: every key of it is refused everywhere once
    /// caches age out. One write.
    pub async fn revoke(&self, id: ClientId) -> Result<ClientRecord, ClientsError> {
        let out = self
            .client
            .update_item()
            .table_name(&self.table)
            .key("pk", s(record_pk(id)))
            .update_expression("SET revoked_at = if_not_exists(revoked_at, :at)")
            .condition_expression("attribute_exists(pk)")
            .expression_attribute_values(":at", n(Millis::now().get()))
            .return_values(aws_sdk_dynamodb::types::ReturnValue::AllNew)
            .send()
            .await;
        let revoked = match out {
            Ok(out) => out.attributes().map(decode).transpose()?.ok_or(ClientsError::Unknown(id))?,
            Err(e) if e.as_service_error().is_some_and(|e| e.is_conditional_check_failed_exception()) => {
                return Err(ClientsError::Unknown(id));
            }
            Err(e) => return Err(store(e)),
        };
        self.changed(id).await;
        Ok(revoked)
    }
}

pub(super) fn record_pk(id: ClientId) -> String {
    format!("{RECORD}{id}")
}

pub(super) fn pointer_pk(digest: &str) -> String {
    format!("{POINTER}{digest}")
}

/// The pointer item of a key of client `id`.
pub(super) fn pointer(id: ClientId, digest: &str) -> Attrs {
    HashMap::from([
        ("pk".to_owned(), s(pointer_pk(digest))),
        ("kind".to_owned(), s("api_key")),
        ("client_id".to_owned(), s(id.to_string())),
    ])
}

pub(super) fn store(e: impl std::error::Error + 'static) -> ClientsError {
    ClientsError::Store(DisplayErrorContext(&e).to_string())
}

pub(super) fn s(value: impl Into<String>) -> AttributeValue {
    AttributeValue::S(value.into())
}

pub(super) fn n(value: u64) -> AttributeValue {
    AttributeValue::N(value.to_string())
}

fn malformed(name: &str) -> ClientsError {
    ClientsError::Malformed(name.to_owned())
}

pub(super) fn text<'a>(item: &'a Attrs, name: &str) -> Result<&'a str, ClientsError> {
    match item.get(name) {
        Some(AttributeValue::S(value)) => Ok(value),
        _ => Err(malformed(name)),
    }
}

pub(super) fn number<T: std::str::FromStr>(item: &Attrs, name: &str) -> Result<Option<T>, ClientsError> {
    match item.get(name) {
        Some(AttributeValue::N(value)) => value.parse().map(Some).map_err(|_| malformed(name)),
        None => Ok(None),
        _ => Err(malformed(name)),
    }
}

/// The version a record was read at (for conditional changes).
pub(super) fn version(item: &Attrs) -> Result<u64, ClientsError> {
    Ok(number(item, "version")?.unwrap_or(0))
}

pub(super) fn decode(item: &Attrs) -> Result<ClientRecord, ClientsError> {
    let mut keys = match item.get("keys") {
        Some(AttributeValue::M(keys)) => {
            keys.iter().map(|(digest, key)| KeyRecord::decode(digest, key)).collect::<Result<Vec<_>, _>>()?
        }
        None => Vec::new(),
        _ => return Err(malformed("keys")),
    };
    keys.sort_by(|a, b| (a.created_at, &a.digest).cmp(&(b.created_at, &b.digest)));
    Ok(ClientRecord {
        id: text(item, "client_id")?.parse().map_err(|_| malformed("client_id"))?,
        name: text(item, "name")?.to_owned(),
        created_at: number(item, "created_at")?.unwrap_or_default(),
        revoked_at: number(item, "revoked_at")?,
        keys,
    })
}
