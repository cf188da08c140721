//! `EndpointStore`: a client's webhook endpoints as one control item of
//! the key table, `control#webhooks#client#{id}`, holding the endpoints as
//! JSON and a version. Every change reads the item and writes it back on
//! the condition that its version is unchanged (retried a few times when
//! two changes meet), so no change is lost and nothing needs a transaction
//! (the table may be multi-Region strongly consistent, which has none).
//! Reading a client's endpoints is one strongly consistent read. Signing
//! secrets are stored sealed ([`super::sealing`]): a new one is shown to
//! its caller once, in the clear, and kept only sealed.

use std::collections::HashMap;
use std::time::Duration;

use aws_sdk_dynamodb::Client;
use aws_sdk_dynamodb::error::ProvideErrorMetadata;
use aws_sdk_dynamodb::types::AttributeValue;
use uuid::Uuid;

use super::sealing::{SealError, Sealer, is_sealed};
use super::{Disabled, Endpoint, MAX_ENDPOINTS};
use crate::domain::WebhookSecret;
use crate::domain::{ClientId, Millis};
use crate::keystore::StoreFailure;
use crate::ledger::LedgerError;

const ITEM: &str = "control#webhooks#client#";

/// Changes tried again when another change of the same client's endpoints came first.
const TRIES: usize = 5;

#[derive(Debug, thiserror::Error)]
pub enum WebhooksError {
    #[error("the webhook endpoints could not be read or written: {0}")]
    Store(#[source] StoreFailure),
    #[error("a webhook's deliveries could not be updated: {0}")]
    Deliveries(#[source] LedgerError),
    #[error("a webhook endpoints item is malformed: {0}")]
    Malformed(#[source] StoreFailure),
    #[error("no webhook endpoint {0} of this client")]
    Unknown(Uuid),
    #[error("a client has at most {MAX_ENDPOINTS} webhook endpoints")]
    TooMany,
    #[error("the client's webhook endpoints kept changing meanwhile; try again")]
    Contended,
    #[error("a webhook secret could not be sealed or opened: {0}")]
    Sealing(#[from] SealError),
}

/// Webhook secrets found in the clear by [`EndpointStore::seal_in_clear`].
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct InClear {
    /// Sealed by this run.
    pub sealed: usize,
    /// Left in the clear (not asked to seal, or changed meanwhile).
    pub left: usize,
    /// Clients whose endpoints could not be read or written.
    pub failed: usize,
}

/// An endpoint given a new secret (registered, or its secret rotated), and
/// that secret in the clear: shown to the caller this once, stored sealed.
#[derive(Debug)]
pub struct Issued {
    pub endpoint: Endpoint,
    pub secret: WebhookSecret,
}

/// A client's endpoints as read, with the version they were read at.
struct Read {
    endpoints: Vec<Endpoint>,
    version: Option<u64>,
}

#[derive(Clone, Debug)]
pub struct EndpointStore {
    client: Client,
    table: String,
    sealer: Sealer,
}

impl EndpointStore {
    pub fn new(client: Client, table: impl Into<String>, sealer: Sealer) -> Self {
        Self { client, table: table.into(), sealer }
    }

    /// The secrets of `owner`'s `endpoint` that sign at `now`, newest
    /// first, opened.
    pub async fn signing_secrets(
        &self,
        owner: ClientId,
        endpoint: &Endpoint,
        now: u64,
    ) -> Result<Vec<WebhookSecret>, WebhooksError> {
        let mut opened = Vec::new();
        for secret in endpoint.secrets.iter().filter(|s| s.signs_at(now)) {
            let value = self.sealer.open(&secret.value, &sealed_for(owner, endpoint.id)).await?;
            opened.push(WebhookSecret { value, ..secret.clone() });
        }
        Ok(opened)
    }

    /// A new secret for `owner`'s endpoint `id`, and it sealed for storing.
    async fn issue(
        &self,
        owner: ClientId,
        id: Uuid,
        now: u64,
    ) -> Result<(WebhookSecret, WebhookSecret), WebhooksError> {
        let fresh = WebhookSecret::generate(now);
        let sealed = self.sealer.seal(&fresh.value, &sealed_for(owner, id)).await?;
        Ok((fresh.clone(), WebhookSecret { value: sealed, ..fresh }))
    }

    /// The client's endpoints, oldest first.
    pub async fn list(&self, owner: ClientId) -> Result<Vec<Endpoint>, WebhooksError> {
        Ok(self.read(owner).await?.endpoints)
    }

    /// Registers an endpoint (its URL already checked) with a new secret.
    pub async fn add(&self, owner: ClientId, url: &str, events: Vec<String>) -> Result<Issued, WebhooksError> {
        let now = Millis::now().get();
        let id = Uuid::now_v7();
        let (secret, sealed) = self.issue(owner, id, now).await?;
        let endpoint = Endpoint {
            id,
            url: url.to_owned(),
            events,
            created_at: now,
            secrets: vec![sealed],
            failed_deliveries: 0,
            disabled: None,
        };
        self.change(owner, |endpoints| {
            if endpoints.len() >= MAX_ENDPOINTS {
                return Err(WebhooksError::TooMany);
            }
            endpoints.push(endpoint.clone());
            Ok(())
        })
        .await?;
        Ok(Issued { endpoint, secret })
    }

    /// Removes endpoint `id` of the client.
    pub async fn remove(&self, owner: ClientId, id: Uuid) -> Result<(), WebhooksError> {
        self.change(owner, |endpoints| {
            let before = endpoints.len();
            endpoints.retain(|e| e.id != id);
            if endpoints.len() == before { Err(WebhooksError::Unknown(id)) } else { Ok(()) }
        })
        .await
    }

    /// Gives endpoint `id` a new secret; the ones that signed until now go
    /// on signing for `grace` (a receiver that has not yet switched still
    /// verifies). Returns the endpoint, the new secret first.
    pub async fn rotate(&self, owner: ClientId, id: Uuid, grace: Duration) -> Result<Issued, WebhooksError> {
        let now = Millis::now().get();
        let until = now.saturating_add(u64::try_from(grace.as_millis()).unwrap_or(u64::MAX));
        let (secret, sealed) = self.issue(owner, id, now).await?;
        let endpoint = self
            .update(owner, id, |endpoint| {
                endpoint.secrets.retain(|s| s.signs_at(now));
                for secret in &mut endpoint.secrets {
                    secret.valid_until = Some(secret.valid_until.map_or(until, |at| at.min(until)));
                }
                endpoint.secrets.insert(0, sealed.clone());
            })
            .await?;
        Ok(Issued { endpoint, secret })
    }

    /// The secrets still stored in the clear (kept by a version from
    /// before secrets were sealed), sealed when `seal` (for `keyfence
    /// migrate --seal-webhook-secrets`, once no instance of such a version
    /// runs: it could not sign with a sealed one), else counted. A client
    /// whose item cannot be read or written is logged and counted, and the
    /// others are sealed all the same.
    pub async fn seal_in_clear(&self, seal: bool) -> Result<InClear, WebhooksError> {
        let mut found = InClear::default();
        for owner in self.owners().await? {
            match self.seal_client(owner, seal).await {
                Ok((clear, sealed)) => {
                    found.sealed += sealed;
                    found.left += clear - sealed;
                }
                Err(e) => {
                    tracing::warn!(client = %owner, error = %e, "could not seal a client's webhook secrets");
                    found.failed += 1;
                }
            }
        }
        Ok(found)
    }

    /// How many of `owner`'s secrets are in the clear, and how many of
    /// them this sealed.
    async fn seal_client(&self, owner: ClientId, seal: bool) -> Result<(usize, usize), WebhooksError> {
        // Sealing is async and `change` edits synchronously: seal what the
        // item holds first, then put the seals in on its version (a secret
        // changed meanwhile is left for the next run).
        let mut fresh = Vec::new();
        for endpoint in self.read(owner).await?.endpoints {
            for secret in endpoint.secrets.iter().filter(|s| !is_sealed(&s.value)) {
                let sealed = if seal {
                    Some(self.sealer.seal(&secret.value, &sealed_for(owner, endpoint.id)).await?)
                } else {
                    None
                };
                fresh.push((endpoint.id, secret.value.clone(), sealed));
            }
        }
        let clear = fresh.len();
        if !seal || clear == 0 {
            return Ok((clear, 0));
        }
        let mut sealed = 0;
        self.change(owner, |endpoints| {
            sealed = 0;
            for endpoint in endpoints.iter_mut() {
                for secret in &mut endpoint.secrets {
                    let seal = fresh.iter().find(|(id, value, _)| *id == endpoint.id && *value == secret.value);
                    if let Some((_, _, Some(seal))) = seal {
                        secret.value = seal.clone();
                        sealed += 1;
                    }
                }
            }
            Ok(())
        })
        .await?;
        Ok((clear, sealed))
    }

    /// Notes a delivery that used up its schedule: the endpoint is flagged
    /// as failing, and disabled once `disable_after` such deliveries came
    /// in a row. Returns whether this disabled it.
    pub async fn note_failed_delivery(
        &self,
        owner: ClientId,
        id: Uuid,
        disable_after: u32,
    ) -> Result<bool, WebhooksError> {
        let mut disabled_now = false;
        self.update(owner, id, |endpoint| {
            endpoint.failed_deliveries = endpoint.failed_deliveries.saturating_add(1);
            disabled_now = endpoint.disabled.is_none() && endpoint.failed_deliveries >= disable_after;
            if disabled_now {
                endpoint.disabled = Some(Disabled {
                    reason: format!("{} deliveries in a row used up their retries", endpoint.failed_deliveries),
                    at: Millis::now().get(),
                });
            }
        })
        .await?;
        Ok(disabled_now)
    }

    /// Clears the failing flag once a delivery arrives again.
    pub async fn note_delivered(&self, owner: ClientId, id: Uuid) -> Result<Endpoint, WebhooksError> {
        self.update(owner, id, |endpoint| endpoint.failed_deliveries = 0).await
    }

    /// Stops sending to the endpoint, keeping why.
    pub async fn disable(&self, owner: ClientId, id: Uuid, reason: &str) -> Result<Endpoint, WebhooksError> {
        let at = Millis::now().get();
        self.update(owner, id, |endpoint| {
            endpoint.disabled.get_or_insert_with(|| Disabled { reason: reason.to_owned(), at });
        })
        .await
    }

    /// Sends to a disabled or failing endpoint again.
    pub async fn enable(&self, owner: ClientId, id: Uuid) -> Result<Endpoint, WebhooksError> {
        self.update(owner, id, |endpoint| {
            endpoint.disabled = None;
            endpoint.failed_deliveries = 0;
        })
        .await
    }

    /// Changes endpoint `id` of the client; returns it as changed.
    async fn update(
        &self,
        owner: ClientId,
        id: Uuid,
        mut edit: impl FnMut(&mut Endpoint),
    ) -> Result<Endpoint, WebhooksError> {
        let mut changed = None;
        self.change(owner, |endpoints| {
            let endpoint = endpoints.iter_mut().find(|e| e.id == id).ok_or(WebhooksError::Unknown(id))?;
            edit(endpoint);
            changed = Some(endpoint.clone());
            Ok(())
        })
        .await?;
        changed.ok_or(WebhooksError::Unknown(id))
    }

    /// Reads, applies `edit`, and writes back if nobody wrote meanwhile.
    async fn change(
        &self,
        owner: ClientId,
        mut edit: impl FnMut(&mut Vec<Endpoint>) -> Result<(), WebhooksError>,
    ) -> Result<(), WebhooksError> {
        for _ in 0..TRIES {
            let Read { mut endpoints, version } = self.read(owner).await?;
            edit(&mut endpoints)?;
            let text = serde_json::to_string(&endpoints).map_err(|e| WebhooksError::Malformed(StoreFailure::of(e)))?;
            let next = version.unwrap_or(0) + 1;
            let mut put = self
                .client
                .put_item()
                .table_name(&self.table)
                .item("pk", AttributeValue::S(pk(owner)))
                .item("endpoints", AttributeValue::S(text))
                .item("version", AttributeValue::N(next.to_string()));
            put = match version {
                Some(seen) => put
                    .condition_expression("#version = :seen")
                    .expression_attribute_names("#version", "version")
                    .expression_attribute_values(":seen", AttributeValue::N(seen.to_string())),
                None => put.condition_expression("attribute_not_exists(pk)"),
            };
            match put.send().await {
                Ok(_) => return Ok(()),
                Err(e) if e.code() == Some("ConditionalCheckFailedException") => continue,
                Err(e) => return Err(WebhooksError::Store(StoreFailure::of(e))),
            }
        }
        Err(WebhooksError::Contended)
    }

    /// The clients that have an endpoints item, by one scan of the table.
    async fn owners(&self) -> Result<Vec<ClientId>, WebhooksError> {
        let mut owners = Vec::new();
        let mut next = None;
        loop {
            let page = self
                .client
                .scan()
                .table_name(&self.table)
                .filter_expression("begins_with(pk, :item)")
                .expression_attribute_values(":item", AttributeValue::S(ITEM.into()))
                .projection_expression("pk")
                .set_exclusive_start_key(next)
                .send()
                .await
                .map_err(|e| WebhooksError::Store(StoreFailure::of(e)))?;
            for item in page.items() {
                let id = item.get("pk").and_then(|v| v.as_s().ok()).and_then(|pk| pk.strip_prefix(ITEM));
                owners.extend(id.and_then(|id| id.parse::<ClientId>().ok()));
            }
            next = page.last_evaluated_key().cloned();
            if next.is_none() {
                return Ok(owners);
            }
        }
    }

    async fn read(&self, owner: ClientId) -> Result<Read, WebhooksError> {
        let out = self
            .client
            .get_item()
            .table_name(&self.table)
            .key("pk", AttributeValue::S(pk(owner)))
            .consistent_read(true)
            .send()
            .await
            .map_err(|e| WebhooksError::Store(StoreFailure::of(e)))?;
        let Some(item) = out.item() else { return Ok(Read { endpoints: Vec::new(), version: None }) };
        decode(item)
    }
}

/// What a secret is sealed for: its client and endpoint, so a sealed
/// secret copied to another endpoint, or to another client's item, does
/// not open.
fn sealed_for(owner: ClientId, endpoint: Uuid) -> String {
    format!("{owner}/{endpoint}")
}

fn pk(owner: ClientId) -> String {
    format!("{ITEM}{owner}")
}

fn decode(item: &HashMap<String, AttributeValue>) -> Result<Read, WebhooksError> {
    let malformed = |what: &str| WebhooksError::Malformed(StoreFailure::said(what));
    let text = item.get("endpoints").and_then(|v| v.as_s().ok()).ok_or_else(|| malformed("no endpoints"))?;
    let endpoints = serde_json::from_str(text).map_err(|e| WebhooksError::Malformed(StoreFailure::of(e)))?;
    let version = item.get("version").and_then(|v| v.as_n().ok()).and_then(|n| n.parse().ok());
    Ok(Read { endpoints, version: Some(version.ok_or_else(|| malformed("no version"))?) })
}
