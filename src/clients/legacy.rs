//! The layout an older keyfence kept clients in: one item per key digest
//! (`control#client#{digest}`, naming the client) and a profile item per
//! client (`control#profile#{id}`). `keyfence migrate` copies each into the
//! client's record (with its key, accounts and limits) and marks the old
//! item copied, keeping it: instances of the older version, in regions not
//! upgraded yet, go on finding their clients there. Once every region runs
//! this version, `keyfence migrate --drop-older-clients` deletes the old
//! items. This is the one place that scans the table, and it runs only from
//! `migrate`.

use std::collections::HashMap;

use aws_sdk_dynamodb::types::AttributeValue;

use super::ClientRecord;
use super::store::{Attrs, ClientStore, ClientsError, number, record_pk, s, store, text};
use crate::domain::ClientId;

pub(super) const CLIENT: &str = "control#client#";
pub(super) const PROFILE: &str = "control#profile#";

/// Profile attributes carried over as they are.
const PROFILE_ATTRIBUTES: [&str; 6] = ["accounts", "currencies", "max_amount_minor", "rate", "burst", "in_flight"];

/// What `migrate` did with the older layout.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Carried {
    /// Clients copied into their records by this run.
    pub copied: usize,
    /// Clients of the older layout still there (copied, kept for older
    /// instances).
    pub kept: usize,
    /// Older items deleted by this run.
    pub dropped: usize,
    /// Revocations made in the older layout after it was copied, carried
    /// into the records.
    pub revocations: usize,
}

impl ClientStore {
    /// Copies every client of the older layout not copied yet into its
    /// record; with `drop`, deletes the older items instead of keeping them.
    pub async fn migrate_legacy(&self, drop: bool) -> Result<Carried, ClientsError> {
        let (clients, profiles) = self.legacy_items().await?;
        let mut carried = Carried::default();
        for (pk, item) in &clients {
            if item.contains_key("copied_at") {
                // Revoked with an older CLI since it was copied (during an
                // upgrade, in a hurry): the record is revoked too.
                if item.contains_key("revoked_at") {
                    let id = text(item, "client_id")?;
                    self.revoke(id.parse().map_err(|_| ClientsError::Malformed("client_id".into()))?).await?;
                    carried.revocations += 1;
                }
                continue;
            }
            let digest = pk.trim_start_matches(CLIENT);
            let id: ClientId =
                text(item, "client_id")?.parse().map_err(|_| ClientsError::Malformed("client_id".into()))?;
            let record = ClientRecord {
                id,
                name: text(item, "name")?.to_owned(),
                created_at: number(item, "created_at")?.unwrap_or_default(),
                revoked_at: number(item, "revoked_at")?,
                keys: Vec::new(),
            };
            self.put(record, digest).await?;
            if let Some(profile) = profiles.get(&format!("{PROFILE}{id}")) {
                self.carry_profile(id, profile).await?;
            }
            // Marked once the record holds it all: a run cut short before
            // this copies it again, and no later run copies over changes
            // made to the record since.
            self.client()
                .update_item()
                .table_name(self.table())
                .key("pk", s(pk.as_str()))
                .update_expression("SET copied_at = :at")
                .condition_expression("attribute_exists(pk)")
                .expression_attribute_values(":at", AttributeValue::N(crate::domain::Millis::now().get().to_string()))
                .send()
                .await
                .map_err(store)?;
            carried.copied += 1;
        }
        if !drop {
            carried.kept = clients.len();
            return Ok(carried);
        }
        for pk in clients.iter().map(|(pk, _)| pk).chain(profiles.keys()) {
            self.client()
                .delete_item()
                .table_name(self.table())
                .key("pk", s(pk.as_str()))
                .send()
                .await
                .map_err(store)?;
            carried.dropped += 1;
        }
        Ok(carried)
    }

    /// Copies the older profile item's attributes onto client `id`'s record.
    async fn carry_profile(&self, id: ClientId, profile: &Attrs) -> Result<(), ClientsError> {
        let carried: HashMap<String, AttributeValue> = PROFILE_ATTRIBUTES
            .iter()
            .filter_map(|name| profile.get(*name).map(|value| (format!(":{name}"), value.clone())))
            .collect();
        if carried.is_empty() {
            return Ok(());
        }
        // Only what the record lacks: a run cut short and run again copies
        // nothing over changes made to the record since.
        let sets: Vec<String> =
            carried.keys().map(|value| format!("{0} = if_not_exists({0}, {value})", &value[1..])).collect();
        self.client()
            .update_item()
            .table_name(self.table())
            .key("pk", s(record_pk(id)))
            .update_expression(format!("SET {}", sets.join(", ")))
            .condition_expression("attribute_exists(pk)")
            .set_expression_attribute_values(Some(carried))
            .send()
            .await
            .map_err(store)?;
        self.changed(id).await;
        Ok(())
    }

    /// The older layout's client items and profile items, by partition key.
    async fn legacy_items(&self) -> Result<(Vec<(String, Attrs)>, HashMap<String, Attrs>), ClientsError> {
        let (mut clients, mut profiles) = (Vec::new(), HashMap::new());
        let mut start = None;
        loop {
            let page = self
                .client()
                .scan()
                .table_name(self.table())
                .filter_expression("begins_with(pk, :client) OR begins_with(pk, :profile)")
                .expression_attribute_values(":client", s(CLIENT))
                .expression_attribute_values(":profile", s(PROFILE))
                .set_exclusive_start_key(start)
                .consistent_read(true)
                .send()
                .await
                .map_err(store)?;
            for item in page.items() {
                let pk = item.get("pk").and_then(|v| v.as_s().ok()).cloned().unwrap_or_default();
                if pk.starts_with(CLIENT) {
                    clients.push((pk, item.clone()));
                } else {
                    profiles.insert(pk, item.clone());
                }
            }
            start = page.last_evaluated_key().cloned();
            if start.is_none() {
                clients.sort_by_key(|(_, item)| number::<u64>(item, "created_at").ok().flatten());
                return Ok((clients, profiles));
            }
        }
    }
}
