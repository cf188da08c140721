//! `EngineError`: why the engine could not give an answer. The HTTP layer
//! maps these to 409, 503 and 500; none is ever stored as a final answer.

use crate::keystore::KeyStoreError;
use crate::ledger::LedgerError;
use crate::regions::RegionsError;

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// A newer owner holds the request; this attempt stopped at once.
    #[error("fenced out: another attempt owns the request now")]
    FencedOut,
    /// This instance's region has been declared failed: it claims and
    /// commits nothing; clients go to another region.
    #[error("this region ({0}) has been declared failed; send the request to another region")]
    RegionFailed(String),
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
            KeyStoreError::Taken(_) => EngineError::FencedOut,
            KeyStoreError::FencedOut(_) => {
                metrics::counter!("keyfence_fenced_out_total", "store" => "key_store").increment(1);
                EngineError::FencedOut
            }
            KeyStoreError::Throttled(_) | KeyStoreError::Unavailable(_) => EngineError::Transient(e.to_string()),
            KeyStoreError::Fault(_) => EngineError::Fault(e.to_string()),
        }
    }
}

impl From<RegionsError> for EngineError {
    fn from(e: RegionsError) -> Self {
        match e {
            RegionsError::Store(_) | RegionsError::Contended => EngineError::Transient(e.to_string()),
            RegionsError::Malformed(_) | RegionsError::Invalid(_) => EngineError::Fault(e.to_string()),
        }
    }
}

impl From<LedgerError> for EngineError {
    fn from(e: LedgerError) -> Self {
        match e {
            // A phase that cannot start where it expects has a newer owner
            // (or already ran): either way this attempt must stop.
            LedgerError::FencedOut { .. } | LedgerError::OutOfOrder { .. } => {
                metrics::counter!("keyfence_fenced_out_total", "store" => "ledger").increment(1);
                EngineError::FencedOut
            }
            LedgerError::RegionFailed(region) => EngineError::RegionFailed(region),
            _ if e.is_transient() => EngineError::Transient(e.to_string()),
            _ => EngineError::Fault(e.to_string()),
        }
    }
}
