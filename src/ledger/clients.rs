//! API clients kept in a region's ledger, as keyfence once did. Clients are
//! global now (see [`crate::clients`]); `keyfence migrate` copies these into
//! the key table so an upgrade loses none.

use super::{Ledger, LedgerError};
use crate::clients::ClientRecord;
use crate::domain::ClientId;

impl Ledger {
    /// Every client this ledger holds, with the digest of its API key.
    pub async fn legacy_clients(&self) -> Result<Vec<(ClientRecord, String)>, LedgerError> {
        let rows: Vec<(uuid::Uuid, String, String, time::OffsetDateTime)> =
            sqlx::query_as("SELECT id, name, api_key_hash, created_at FROM clients ORDER BY created_at")
                .fetch_all(&self.pool)
                .await?;
        Ok(rows
            .into_iter()
            .map(|(id, name, digest, created_at)| {
                let created_at = u64::try_from(created_at.unix_timestamp_nanos() / 1_000_000).unwrap_or_default();
                (ClientRecord { id: ClientId::new(id), name, created_at, revoked_at: None, keys: Vec::new() }, digest)
            })
            .collect())
    }
}
