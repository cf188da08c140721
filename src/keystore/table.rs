//! The key table's schema, created by `keyfence migrate` (and by the test
//! harness, one table per test): partition key `pk`, the sparse in-flight
//! index the recovery worker queries, and time-to-live on `expires_at` where
//! the table supports it.
//! Creating is idempotent: an existing table is left as it is.

use std::time::Duration;

use aws_sdk_dynamodb::Client;
use aws_sdk_dynamodb::error::{DisplayErrorContext, ProvideErrorMetadata};
use aws_sdk_dynamodb::types::{
    AttributeDefinition, BillingMode, GlobalSecondaryIndex, KeySchemaElement, KeyType, Projection, ProjectionType,
    ScalarAttributeType, TableStatus, TimeToLiveSpecification, TimeToLiveStatus,
};

use super::KeyStoreError;
use super::item::attr;

/// The GSI over started items: hash `inflight` (a shard), range `lease_until`.
pub const INFLIGHT_INDEX: &str = "inflight-by-lease";

/// What [`ensure_table`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TableChange {
    Created,
    AlreadyThere,
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
    let key = |name: &str, kind| KeySchemaElement::builder().attribute_name(name).key_type(kind).build();
    let def = |name: &str, kind| AttributeDefinition::builder().attribute_name(name).attribute_type(kind).build();
    let projection = Projection::builder()
        .projection_type(ProjectionType::Include)
        .set_non_key_attributes(Some(
            [
                attr::CLIENT_ID,
                attr::KEY,
                attr::FENCE,
                attr::OWNER,
                attr::HOME_REGION,
                attr::CREATED_AT,
                attr::PAYMENT_ID,
            ]
            .map(String::from)
            .to_vec(),
        ))
        .build();
    let index = GlobalSecondaryIndex::builder()
        .index_name(INFLIGHT_INDEX)
        .key_schema(key(attr::INFLIGHT, KeyType::Hash).map_err(fault)?)
        .key_schema(key(attr::LEASE_UNTIL, KeyType::Range).map_err(fault)?)
        .projection(projection)
        .build()
        .map_err(fault)?;
    let created = client
        .create_table()
        .table_name(table)
        .billing_mode(BillingMode::PayPerRequest)
        .key_schema(key(attr::PK, KeyType::Hash).map_err(fault)?)
        .attribute_definitions(def(attr::PK, ScalarAttributeType::S).map_err(fault)?)
        .attribute_definitions(def(attr::INFLIGHT, ScalarAttributeType::S).map_err(fault)?)
        .attribute_definitions(def(attr::LEASE_UNTIL, ScalarAttributeType::N).map_err(fault)?)
        .global_secondary_indexes(index)
        .send()
        .await;
    match created {
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
    Err(KeyStoreError::Unavailable(format!("table {table} did not become active within a minute")))
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

fn fault(e: impl std::error::Error + 'static) -> KeyStoreError {
    KeyStoreError::Fault(DisplayErrorContext(&e).to_string())
}
