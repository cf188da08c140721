//! `ClientStore`: client records as control items of the key table. Adding
//! is a conditional put (a key digest is registered once); listing and
//! revoking are operator commands that scan for the records.

use std::collections::HashMap;

use aws_sdk_dynamodb::Client;
use aws_sdk_dynamodb::error::DisplayErrorContext;
use aws_sdk_dynamodb::types::AttributeValue;

use super::ClientRecord;
use crate::domain::{ApiKey, ClientId, Millis};

const PREFIX: &str = "control#client#";

#[derive(Debug, thiserror::Error)]
pub enum ClientsError {
    #[error("the client directory could not be read or written: {0}")]
    Store(String),
    #[error("a client record is malformed: {0}")]
    Malformed(String),
    #[error("no client {0}")]
    Unknown(ClientId),
}

type Attrs = HashMap<String, AttributeValue>;

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

    /// Registers a new client under the digest of its (new) API key.
    pub async fn add(&self, name: &str, key: &ApiKey) -> Result<ClientRecord, ClientsError> {
        let record = ClientRecord {
            id: ClientId::generate(),
            name: name.to_owned(),
            created_at: Millis::now().get(),
            revoked_at: None,
        };
        self.put(record, &key.digest()).await
    }

    /// Registers a client that already exists elsewhere (moved from a
    /// ledger), under its id and the digest of its key; a no-op if there.
    pub async fn put(&self, record: ClientRecord, digest: &str) -> Result<ClientRecord, ClientsError> {
        let mut item: Attrs = HashMap::from([
            ("pk".to_owned(), AttributeValue::S(format!("{PREFIX}{digest}"))),
            ("kind".to_owned(), AttributeValue::S("client".into())),
            ("client_id".to_owned(), AttributeValue::S(record.id.to_string())),
            ("name".to_owned(), AttributeValue::S(record.name.clone())),
            ("created_at".to_owned(), AttributeValue::N(record.created_at.to_string())),
        ]);
        if let Some(at) = record.revoked_at {
            item.insert("revoked_at".to_owned(), AttributeValue::N(at.to_string()));
        }
        let put = self
            .client
            .put_item()
            .table_name(&self.table)
            .set_item(Some(item))
            .condition_expression("attribute_not_exists(pk)")
            .send()
            .await;
        match put {
            Ok(_) => Ok(record),
            Err(e) if e.as_service_error().is_some_and(|e| e.is_conditional_check_failed_exception()) => {
                self.by_digest(digest).await?.ok_or_else(|| ClientsError::Malformed("vanished while added".into()))
            }
            Err(e) => Err(store(e)),
        }
    }

    /// The record registered under a key digest, revoked or not.
    pub async fn by_digest(&self, digest: &str) -> Result<Option<ClientRecord>, ClientsError> {
        let out = self
            .client
            .get_item()
            .table_name(&self.table)
            .key("pk", AttributeValue::S(format!("{PREFIX}{digest}")))
            .consistent_read(true)
            .send()
            .await
            .map_err(store)?;
        out.item().map(decode).transpose()
    }

    /// Every client, oldest first.
    pub async fn list(&self) -> Result<Vec<ClientRecord>, ClientsError> {
        Ok(self.records().await?.into_iter().map(|(_, record)| record).collect())
    }

    /// Revokes client `id`: its key is refused everywhere once caches age out.
    pub async fn revoke(&self, id: ClientId) -> Result<ClientRecord, ClientsError> {
        let (pk, mut record) =
            self.records().await?.into_iter().find(|(_, r)| r.id == id).ok_or(ClientsError::Unknown(id))?;
        if record.revoked_at.is_some() {
            return Ok(record);
        }
        let at = Millis::now().get();
        self.client
            .update_item()
            .table_name(&self.table)
            .key("pk", AttributeValue::S(pk))
            .update_expression("SET revoked_at = if_not_exists(revoked_at, :at)")
            .expression_attribute_values(":at", AttributeValue::N(at.to_string()))
            .send()
            .await
            .map_err(store)?;
        record.revoked_at = Some(at);
        Ok(record)
    }

    /// Every client record with its partition key, oldest first.
    async fn records(&self) -> Result<Vec<(String, ClientRecord)>, ClientsError> {
        let mut records = Vec::new();
        let mut start = None;
        loop {
            let page = self
                .client
                .scan()
                .table_name(&self.table)
                .filter_expression("begins_with(pk, :prefix)")
                .expression_attribute_values(":prefix", AttributeValue::S(PREFIX.into()))
                .set_exclusive_start_key(start)
                .consistent_read(true)
                .send()
                .await
                .map_err(store)?;
            for item in page.items() {
                let pk = item.get("pk").and_then(|v| v.as_s().ok()).cloned().unwrap_or_default();
                records.push((pk, decode(item)?));
            }
            start = page.last_evaluated_key().cloned();
            if start.is_none() {
                records.sort_by_key(|(_, r)| r.created_at);
                return Ok(records);
            }
        }
    }
}

pub(super) fn store(e: impl std::error::Error + 'static) -> ClientsError {
    ClientsError::Store(DisplayErrorContext(&e).to_string())
}

fn decode(item: &Attrs) -> Result<ClientRecord, ClientsError> {
    let text = |name: &str| match item.get(name) {
        Some(AttributeValue::S(s)) => Ok(s.clone()),
        _ => Err(ClientsError::Malformed(name.to_owned())),
    };
    let number = |name: &str| match item.get(name) {
        Some(AttributeValue::N(n)) => n.parse().map(Some).map_err(|_| ClientsError::Malformed(name.to_owned())),
        None => Ok(None),
        _ => Err(ClientsError::Malformed(name.to_owned())),
    };
    Ok(ClientRecord {
        id: text("client_id")?.parse().map_err(|_| ClientsError::Malformed("client_id".into()))?,
        name: text("name")?,
        created_at: number("created_at")?.unwrap_or_default(),
        revoked_at: number("revoked_at")?,
    })
}
