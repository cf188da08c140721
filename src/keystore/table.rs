//! The key table's schema ([`Schema`]): partition key `pk`, the sparse
//! in-flight index the recovery worker queries, and time-to-live on
//! `expires_at` where the table supports it. `keyfence migrate` creates it
//! on a local endpoint (and the test harness, one table per test) or when
//! told to; against AWS, where the infrastructure templates make it, it
//! checks an existing table against the schema instead and says what
//! differs. Creating is idempotent: an existing table is left as it is.
//! `infra/key-table.schema.json` is [`Schema::expected`] written out, for
//! the templates' own check.

use std::collections::BTreeMap;
use std::time::Duration;

use aws_sdk_dynamodb::Client;
use aws_sdk_dynamodb::error::ProvideErrorMetadata;
use aws_sdk_dynamodb::types::{
    AttributeDefinition, BillingMode, GlobalSecondaryIndex, KeySchemaElement, KeyType, MultiRegionConsistency,
    Projection, ProjectionType, ScalarAttributeType, TableDescription, TableStatus, TimeToLiveSpecification,
    TimeToLiveStatus,
};
use serde::{Deserialize, Serialize};

use super::item::attr;
use super::{KeyStoreError, StoreFailure};

/// The GSI over started items: hash `inflight` (a shard), range `lease_until`.
pub const INFLIGHT_INDEX: &str = "inflight-by-lease";

/// What [`ensure_table`] did, or that an existing table was checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TableChange {
    Created,
    AlreadyThere,
    Checked,
}

/// The shape of a key table: its key, the types of its key attributes, and
/// its indexes with what each projects.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Schema {
    pub billing_mode: String,
    /// Attribute name to type (`S`, `N`), for every key attribute.
    pub attributes: BTreeMap<String, String>,
    pub key_schema: Keys,
    pub indexes: BTreeMap<String, Index>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Keys {
    pub hash: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub range: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Index {
    pub hash: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub range: Option<String>,
    /// `ALL`, `KEYS_ONLY` or `INCLUDE`.
    pub projection: String,
    /// With `INCLUDE`: the attributes projected beside the keys, sorted.
    #[serde(default)]
    pub non_key_attributes: Vec<String>,
}

/// What [`check_table`] found: what keeps keyfence from working on the
/// table, and what an operator should know about it.
#[derive(Debug, Clone, Default)]
pub struct TableCheck {
    pub problems: Vec<String>,
    pub notes: Vec<String>,
}

impl Schema {
    /// The schema keyfence creates and needs.
    pub fn expected() -> Self {
        let mut projected = [
            attr::CLIENT_ID,
            attr::KEY,
            attr::FENCE,
            attr::OWNER,
            attr::HOME_REGION,
            attr::CREATED_AT,
            attr::PAYMENT_ID,
        ]
        .map(String::from)
        .to_vec();
        projected.sort();
        let attributes = [(attr::PK, "S"), (attr::INFLIGHT, "S"), (attr::LEASE_UNTIL, "N")];
        let index = Index {
            hash: attr::INFLIGHT.into(),
            range: Some(attr::LEASE_UNTIL.into()),
            projection: "INCLUDE".into(),
            non_key_attributes: projected,
        };
        Self {
            billing_mode: "PAY_PER_REQUEST".into(),
            attributes: attributes.into_iter().map(|(n, t)| (n.into(), t.into())).collect(),
            key_schema: Keys { hash: attr::PK.into(), range: None },
            indexes: BTreeMap::from([(INFLIGHT_INDEX.into(), index)]),
        }
    }

    /// The schema of a table as DynamoDB describes it.
    pub fn of(table: &TableDescription) -> Self {
        let keys = |elements: &[KeySchemaElement]| {
            let named =
                |kind: KeyType| elements.iter().find(|e| *e.key_type() == kind).map(|e| e.attribute_name().to_owned());
            Keys { hash: named(KeyType::Hash).unwrap_or_default(), range: named(KeyType::Range) }
        };
        let indexes = table
            .global_secondary_indexes()
            .iter()
            .map(|index| {
                let Keys { hash, range } = keys(index.key_schema());
                let projection = index.projection();
                let mut non_key_attributes = projection.map(|p| p.non_key_attributes().to_vec()).unwrap_or_default();
                non_key_attributes.sort();
                let projection =
                    projection.and_then(Projection::projection_type).map(|t| t.as_str().to_owned()).unwrap_or_default();
                (
                    index.index_name().unwrap_or_default().to_owned(),
                    Index { hash, range, projection, non_key_attributes },
                )
            })
            .collect();
        Self {
            billing_mode: table
                .billing_mode_summary()
                .and_then(|b| b.billing_mode())
                .map_or("PROVISIONED", BillingMode::as_str)
                .to_owned(),
            attributes: table
                .attribute_definitions()
                .iter()
                .map(|d| (d.attribute_name().to_owned(), d.attribute_type().as_str().to_owned()))
                .collect(),
            key_schema: keys(table.key_schema()),
            indexes,
        }
    }

    /// What `actual` lacks of this schema, one sentence each. A table may
    /// have more (another index, a wider projection, provisioned capacity).
    pub fn missing_from(&self, actual: &Schema) -> Vec<String> {
        let mut missing = Vec::new();
        let typed = |name: &str| format!("{name} ({})", self.attributes.get(name).map_or("?", String::as_str));
        if actual.key_schema != self.key_schema {
            missing.push(format!(
                "the table's key is {}, keyfence needs the partition key {} and no sort key",
                describe_keys(&actual.key_schema),
                typed(&self.key_schema.hash)
            ));
        }
        for (name, kind) in &self.attributes {
            match actual.attributes.get(name) {
                Some(theirs) if theirs != kind => {
                    missing.push(format!("attribute {name} is of type {theirs}, keyfence needs {kind}"));
                }
                _ => {}
            }
        }
        for (name, index) in &self.indexes {
            let Some(theirs) = actual.indexes.get(name) else {
                missing.push(format!(
                    "no index {name} (partition key {}, sort key {}): the recovery worker finds stale requests \
                     through it",
                    typed(&index.hash),
                    index.range.as_deref().map_or_else(|| "none".to_owned(), typed)
                ));
                continue;
            };
            if (&theirs.hash, &theirs.range) != (&index.hash, &index.range) {
                missing.push(format!(
                    "index {name} is keyed {}, keyfence needs {}",
                    describe_keys(&Keys { hash: theirs.hash.clone(), range: theirs.range.clone() }),
                    describe_keys(&Keys { hash: index.hash.clone(), range: index.range.clone() })
                ));
            }
            if theirs.projection != "ALL" {
                let lacking: Vec<&str> = index
                    .non_key_attributes
                    .iter()
                    .filter(|a| !theirs.non_key_attributes.contains(a))
                    .map(String::as_str)
                    .collect();
                if !lacking.is_empty() {
                    missing.push(format!("index {name} does not project {}", lacking.join(", ")));
                }
            }
        }
        missing
    }
}

fn describe_keys(keys: &Keys) -> String {
    match &keys.range {
        Some(range) => format!("partition key {} with sort key {range}", keys.hash),
        None => format!("partition key {}", keys.hash),
    }
}

/// Checks an existing table against [`Schema::expected`] without changing
/// it: for tables the infrastructure templates made.
#[tracing::instrument(skip(client))]
pub async fn check_table(client: &Client, table: &str) -> Result<TableCheck, KeyStoreError> {
    let described = match client.describe_table().table_name(table).send().await {
        Ok(out) => out,
        Err(e) if e.code() == Some("ResourceNotFoundException") => {
            return Ok(TableCheck {
                problems: vec![format!(
                    "table {table} does not exist: create it with infra/key-table.cfn.yaml or infra/terraform/, \
                     or let `keyfence migrate --create-table` create it"
                )],
                notes: Vec::new(),
            });
        }
        Err(e) => return Err(fault(e)),
    };
    let Some(description) = described.table() else {
        return Err(KeyStoreError::Fault(StoreFailure::said(format!(
            "table {table} was described without a description"
        ))));
    };
    let mut check =
        TableCheck { problems: Schema::expected().missing_from(&Schema::of(description)), notes: Vec::new() };
    if description.table_status() != Some(&TableStatus::Active) {
        let status = description.table_status().map_or("unknown", TableStatus::as_str);
        check.notes.push(format!("table {table} is {status}, not yet ACTIVE"));
    }
    let ttl = client.describe_time_to_live().table_name(table).send().await.map_err(fault)?;
    let ttl = ttl.time_to_live_description();
    let on = ttl
        .and_then(|d| d.time_to_live_status())
        .is_some_and(|s| matches!(s, TimeToLiveStatus::Enabled | TimeToLiveStatus::Enabling));
    let on_attribute = ttl.and_then(|d| d.attribute_name()).filter(|_| on);
    let strong = description.multi_region_consistency() == Some(&MultiRegionConsistency::Strong);
    if !strong {
        check.notes.push(
            "not multi-Region strongly consistent: two regions could both win one key, so only one region may \
             claim (see \"MRSC or MREC\" in the README)"
                .into(),
        );
    }
    match on_attribute {
        Some(name) if name != attr::EXPIRES_AT => check.problems.push(format!(
            "time-to-live is on attribute {name}: DynamoDB would delete keys by it; keyfence expires keys by {}",
            attr::EXPIRES_AT
        )),
        Some(_) => {}
        None if strong => check.notes.push(
            "multi-Region strongly consistent: no time-to-live, so run `keyfence maintain --expire` on a schedule \
             or set KEYFENCE_EXPIRE_INTERVAL_MS on serve"
                .into(),
        ),
        None => check.notes.push(format!(
            "time-to-live is off: enable it on {} or run `keyfence maintain --expire` on a schedule",
            attr::EXPIRES_AT
        )),
    }
    Ok(check)
}

/// Creates the key table if it does not exist, waits until it is active, and
/// makes sure time-to-live is on.
#[tracing::instrument(skip(client))]
pub async fn ensure_table(client: &Client, table: &str) -> Result<TableChange, KeyStoreError> {
    let change = match client.describe_table().table_name(table).send().await {
        Ok(_) => TableChange::AlreadyThere,
        Err(e) if e.code() == Some("ResourceNotFoundException") => {
            create(client, table).await?;
            TableChange::Created
        }
        Err(e) => return Err(fault(e)),
    };
    wait_active(client, table).await?;
    // A strongly consistent global table has no time-to-live: keyfence
    // expires keys itself there (claims and `keyfence maintain --expire`).
    if let Err(e) = enable_ttl(client, table).await {
        tracing::warn!(error = %e, "the key table has no time-to-live; expire keys with `keyfence maintain --expire`");
    }
    Ok(change)
}

/// Deletes a table (tests clean up after themselves with it).
pub async fn delete_table(client: &Client, table: &str) -> Result<(), KeyStoreError> {
    match client.delete_table().table_name(table).send().await {
        Ok(_) => Ok(()),
        Err(e) if e.code() == Some("ResourceNotFoundException") => Ok(()),
        Err(e) => Err(fault(e)),
    }
}

async fn create(client: &Client, table: &str) -> Result<(), KeyStoreError> {
    let schema = Schema::expected();
    let key = |name: &str, kind| KeySchemaElement::builder().attribute_name(name).key_type(kind).build();
    let elements = |keys: &Keys| -> Result<Vec<KeySchemaElement>, KeyStoreError> {
        let mut elements = vec![key(&keys.hash, KeyType::Hash).map_err(fault)?];
        if let Some(range) = &keys.range {
            elements.push(key(range, KeyType::Range).map_err(fault)?);
        }
        Ok(elements)
    };
    let mut request = client
        .create_table()
        .table_name(table)
        .billing_mode(BillingMode::from(schema.billing_mode.as_str()))
        .set_key_schema(Some(elements(&schema.key_schema)?));
    for (name, kind) in &schema.attributes {
        let definition = AttributeDefinition::builder()
            .attribute_name(name)
            .attribute_type(ScalarAttributeType::from(kind.as_str()))
            .build()
            .map_err(fault)?;
        request = request.attribute_definitions(definition);
    }
    for (name, index) in &schema.indexes {
        let projection = Projection::builder()
            .projection_type(ProjectionType::from(index.projection.as_str()))
            .set_non_key_attributes(Some(index.non_key_attributes.clone()).filter(|a| !a.is_empty()))
            .build();
        let keys = Keys { hash: index.hash.clone(), range: index.range.clone() };
        let index = GlobalSecondaryIndex::builder()
            .index_name(name)
            .set_key_schema(Some(elements(&keys)?))
            .projection(projection)
            .build()
            .map_err(fault)?;
        request = request.global_secondary_indexes(index);
    }
    match request.send().await {
        Ok(_) => Ok(()),
        // Another migrate created it between our describe and create.
        Err(e) if e.code() == Some("ResourceInUseException") => Ok(()),
        Err(e) => Err(fault(e)),
    }
}

async fn wait_active(client: &Client, table: &str) -> Result<(), KeyStoreError> {
    for _ in 0..120 {
        let out = client.describe_table().table_name(table).send().await.map_err(fault)?;
        if out.table().and_then(|t| t.table_status()) == Some(&TableStatus::Active) {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    Err(KeyStoreError::Unavailable(StoreFailure::said(format!("table {table} did not become active within a minute"))))
}

async fn enable_ttl(client: &Client, table: &str) -> Result<(), KeyStoreError> {
    let out = client.describe_time_to_live().table_name(table).send().await.map_err(fault)?;
    let status = out.time_to_live_description().and_then(|d| d.time_to_live_status());
    if matches!(status, Some(TimeToLiveStatus::Enabled | TimeToLiveStatus::Enabling)) {
        return Ok(());
    }
    let spec =
        TimeToLiveSpecification::builder().attribute_name(attr::EXPIRES_AT).enabled(true).build().map_err(fault)?;
    client.update_time_to_live().table_name(table).time_to_live_specification(spec).send().await.map_err(fault)?;
    Ok(())
}

fn fault(e: impl std::error::Error + Send + Sync + 'static) -> KeyStoreError {
    KeyStoreError::Fault(StoreFailure::of(e))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The templates are checked against the file; the file against this.
    #[test]
    fn the_schema_file_is_what_keyfence_creates() {
        let written = include_str!("../../infra/key-table.schema.json");
        let written: Schema = serde_json::from_str(written).unwrap();
        assert_eq!(written, Schema::expected(), "infra/key-table.schema.json differs from Schema::expected()");
    }

    #[test]
    fn what_a_table_lacks_is_named() {
        let expected = Schema::expected();
        assert!(expected.missing_from(&expected).is_empty());
        let mut wider = expected.clone();
        wider.billing_mode = "PROVISIONED".into();
        wider.indexes.get_mut(INFLIGHT_INDEX).unwrap().projection = "ALL".into();
        wider.indexes.get_mut(INFLIGHT_INDEX).unwrap().non_key_attributes.clear();
        assert!(expected.missing_from(&wider).is_empty(), "provisioned, projecting all: enough");

        let mut narrow = expected.clone();
        narrow.indexes.get_mut(INFLIGHT_INDEX).unwrap().non_key_attributes.retain(|a| a != attr::FENCE);
        narrow.attributes.insert(attr::LEASE_UNTIL.into(), "S".into());
        let missing = expected.missing_from(&narrow);
        assert!(missing.iter().any(|m| m.contains("does not project fence")), "{missing:?}");
        assert!(missing.iter().any(|m| m.contains("lease_until is of type S")), "{missing:?}");

        let mut bare = expected.clone();
        bare.indexes.clear();
        bare.key_schema.range = Some("sk".into());
        let missing = expected.missing_from(&bare);
        assert!(missing.iter().any(|m| m.starts_with("no index inflight-by-lease")), "{missing:?}");
        assert!(missing.iter().any(|m| m.contains("with sort key sk")), "{missing:?}");
    }
}
