//! Bringing the stores up: `migrate` creates the key table and applies the
//! ledger's migrations. Every subcommand that needs the stores calls into
//! here, so the binary and the tests build them the same way.

use crate::config::{KeyStoreSettings, LedgerSettings};
use crate::keystore::{self, KeyStoreError, TableChange};
use crate::ledger::{Ledger, LedgerError, MigrationReport};

#[derive(Debug, thiserror::Error)]
pub enum StartupError {
    #[error("key store: {0}")]
    KeyStore(#[from] KeyStoreError),
    #[error("ledger: {0}")]
    Ledger(#[from] LedgerError),
}

/// What `keyfence migrate` did to each store.
#[derive(Debug)]
pub struct Migrated {
    pub table: TableChange,
    pub ledger: MigrationReport,
}

/// Creates the key table if missing and brings the ledger schema up to date.
/// Idempotent: a second run changes nothing.
pub async fn migrate(keys: &KeyStoreSettings, ledger: &LedgerSettings) -> Result<Migrated, StartupError> {
    let client = keystore::connect(keys).await;
    let table = keystore::ensure_table(&client, &keys.table).await?;
    let (_, ledger) = Ledger::migrate(ledger).await?;
    Ok(Migrated { table, ledger })
}
