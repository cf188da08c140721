//! `EngineError`: why the engine could not give an answer. The HTTP layer
//! maps these to 409, 503 and 500; none is ever stored as a final answer.

use crate::keystore::KeyStoreError;
use crate::ledger::LedgerError;

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// A newer owner holds the request; this attempt stopped at once.
    #[error("fenced out: another attempt owns the request now")]
    FencedOut,
    /// A store or an external system is briefly unavailable; retry.
    #[error("temporarily unavailable: {0}")]
    Transient(String),
    /// Something that retrying will not fix.
    #[error("internal fault: {0}")]
    Fault(String),
}

impl From<KeyStoreError> for EngineError {
    fn from(e: KeyStoreError) -> Self {
        match e {
            KeyStoreError::Taken(_) | KeyStoreError::FencedOut(_) => EngineError::FencedOut,
            KeyStoreError::Throttled(_) | KeyStoreError::Unavailable(_) => EngineError::Transient(e.to_string()),
            KeyStoreError::Fault(_) => EngineError::Fault(e.to_string()),
        }
    }
}

impl From<LedgerError> for EngineError {
    fn from(e: LedgerError) -> Self {
        match e {
            // A phase that cannot start where it expects has a newer owner
            // (or already ran): either way this attempt must stop.
            LedgerError::FencedOut { .. } | LedgerError::OutOfOrder { .. } => EngineError::FencedOut,
            _ if e.is_transient() => EngineError::Transient(e.to_string()),
            _ => EngineError::Fault(e.to_string()),
        }
    }
}
