//! The layout an older keyfence kept clients in: one item per key digest
//! (`control#client#{digest}`, naming the client) and a profile item per
//! client (`control#profile#{id}`). `keyfence migrate` moves each into the
//! client's record (with its key, accounts and limits) and deletes the old
//! items; a second run finds nothing. This is the one place that scans the
//! table, and it runs only from `migrate`.

use std::collections::HashMap;

use aws_sdk_dynamodb::types::AttributeValue;

use super::ClientRecord;
use super::store::{Attrs, ClientStore, ClientsError, number, record_pk, s, store};
use crate::domain::ClientId;

pub(super) const CLIENT: &str = "control#client#";
pub(super) const PROFILE: &str = "control#profile#";

/// Profile attributes carried over as they are.
const PROFILE_ATTRIBUTES: [&str; 6] = ["accounts", "currencies", "max_amount_minor", "rate", "burst", "in_flight"];

impl ClientStore {
    /// Moves every client of the older layout into its record; how many.
    pub async fn migrate_legacy(&self) -> Result<usize, ClientsError> {
        let (clients, profiles) = self.legacy_items().await?;
        for (pk, item) in &clients {
            let digest = pk.trim_start_matches(CLIENT);
            let text = |name: &str| match item.get(name) {
                Some(AttributeValue::S(value)) => Ok(value.clone()),
                _ => Err(ClientsError::Malformed(name.to_owned())),
            };
            let id: ClientId = text("client_id")?.parse().map_err(|_| ClientsError::Malformed("client_id".into()))?;
            let record = ClientRecord {
                id,
                name: text("name")?,
                created_at: number(item, "created_at")?.unwrap_or_default(),
                revoked_at: number(item, "revoked_at")?,
                keys: Vec::new(),
            };
            self.put(record, digest).await?;
            if let Some(profile) = profiles.get(&format!("{PROFILE}{id}")) {
                self.carry_profile(id, profile).await?;
            }
        }
        for pk in clients.iter().map(|(pk, _)| pk).chain(profiles.keys()) {
            self.client()
                .delete_item()
                .table_name(self.table())
                .key("pk", s(pk.as_str()))
                .send()
                .await
                .map_err(store)?;
        }
        Ok(clients.len())
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
        let sets: Vec<String> = carried.keys().map(|value| format!("{} = {value}", &value[1..])).collect();
        self.client()
            .update_item()
            .table_name(self.table())
            .key("pk", s(record_pk(id)))
            .update_expression(format!("SET {}", sets.join(", ")))
            .condition_expression("attribute_exists(pk)")
            .set_expression_attribute_values(Some(carried))
            .send()
            .await
            .map(drop)
            .map_err(store)
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
