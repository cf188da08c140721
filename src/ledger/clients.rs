//! API clients: created by operators, looked up on every request by the
//! digest of the presented API key.

use super::{Ledger, LedgerError};
use crate::domain::{ApiKey, ClientId};

impl Ledger {
    /// Registers a client under the digest of its (new) API key.
    pub async fn create_client(&self, name: &str, key: &ApiKey) -> Result<ClientId, LedgerError> {
        let id = ClientId::generate();
        sqlx::query("INSERT INTO clients (id, name, api_key_hash) VALUES ($1, $2, $3)")
            .bind(id.as_uuid())
            .bind(name)
            .bind(key.digest())
            .execute(&self.pool)
            .await?;
        Ok(id)
    }

    /// The client a presented API key belongs to, if any.
    pub async fn client_by_key(&self, key: &ApiKey) -> Result<Option<ClientId>, LedgerError> {
        let id: Option<uuid::Uuid> = sqlx::query_scalar("SELECT id FROM clients WHERE api_key_hash = $1")
            .bind(key.digest())
            .fetch_optional(&self.pool)
            .await?;
        Ok(id.map(ClientId::new))
    }
}
