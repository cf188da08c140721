//! API clients kept in a region's ledger, as keyfence once did. Clients are
//! global now (see [`crate::clients`]); `keyfence migrate` copies these into
//! the key table so an upgrade loses none.

use super::{Ledger, LedgerError};
use crate::domain::ClientId;

/// A client as a ledger held it: one key, never revoked.
#[derive(Debug)]
pub struct LegacyClient {
    pub id: ClientId,
    pub name: String,
    /// Milliseconds since the epoch.
    pub created_at: u64,
    /// The digest of its API key.
    pub digest: String,
}

impl Ledger {
    /// Every client this ledger holds.
    pub async fn legacy_clients(&self) -> Result<Vec<LegacyClient>, LedgerError> {
        let rows: Vec<(uuid::Uuid, String, String, time::OffsetDateTime)> =
            sqlx::query_as("SELECT id, name, api_key_hash, created_at FROM clients ORDER BY created_at")
                .fetch_all(&self.pool)
                .await?;
        Ok(rows
            .into_iter()
            .map(|(id, name, digest, created_at)| {
                let created_at = u64::try_from(created_at.unix_timestamp_nanos() / 1_000_000).unwrap_or_default();
                LegacyClient { id: ClientId::new(id), name, created_at, digest }
            })
            .collect())
    }
}
