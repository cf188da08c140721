//! `EngineError`: why the engine could not give an answer. The HTTP layer
//! maps these to 409, 503 and 500; none is ever stored as a final answer.
//! A failure below the engine is kept whole as the error's source, for the
//! logs of whoever handles it; nothing here logs or counts.

use crate::keystore::KeyStoreError;
use crate::ledger::LedgerError;
use crate::regions::RegionsError;

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// A newer owner holds the request; this attempt stopped at once.
    #[error("fenced out by the {}: another attempt owns the request now", .0.as_str())]
    FencedOut(Fenced),
    /// This instance's region has been declared failed: it claims and
    /// commits nothing; clients go to another region.
    #[error("this region ({0}) has been declared failed; send the request to another region")]
    RegionFailed(String),
    /// A store or an external system is briefly unavailable; retry.
    #[error("temporarily unavailable: {0}")]
    Transient(#[source] Cause),
    /// Something that retrying will not fix, kept with its cause: a store's
    /// failure, a value that does not read or encode, a task that ended
    /// without an answer. A person must look (the request is handed back).
    #[error("fault: {0}")]
    Broken(#[source] Cause),
    /// A rule the engine keeps does not hold (a defect, not a failure of
    /// anything below it): a person must look.
    #[error("internal fault: {0}")]
    Fault(String),
}

/// Where an attempt learnt that it no longer owns its request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fenced {
    /// The key store refused its fence.
    KeyStore,
    /// The ledger refused its fence (or the phase had already run).
    Ledger,
    /// Another owner won the key first (a claim or takeover lost).
    Race,
}

impl Fenced {
    pub fn as_str(self) -> &'static str {
        match self {
            Fenced::KeyStore => "key_store",
            Fenced::Ledger => "ledger",
            Fenced::Race => "race",
        }
    }
}

/// What failed below the engine.
#[derive(Debug, thiserror::Error)]
pub enum Cause {
    #[error(transparent)]
    KeyStore(KeyStoreError),
    #[error(transparent)]
    Ledger(LedgerError),
    #[error(transparent)]
    Regions(RegionsError),
    /// An external system answered that it applied nothing.
    #[error("{0}")]
    Rail(String),
    /// A value the engine stored (or is about to) that does not read back
    /// (or encode) as what it is: `what` it is, and why not.
    #[error("{what}: {source}")]
    Record {
        what: String,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The task working a request ended without an answer (it panicked).
    #[error("the request's task ended: {0}")]
    Task(#[source] tokio::task::JoinError),
}

impl EngineError {
    /// A stored value (`what`) that does not read or encode, kept whole.
    pub fn record(what: impl Into<String>, source: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Self {
        EngineError::Broken(Cause::Record { what: what.into(), source: source.into() })
    }

    /// A failure the key is handed back after: the next actor resumes.
    pub fn hands_back(&self) -> bool {
        matches!(self, EngineError::Transient(_) | EngineError::Broken(_) | EngineError::Fault(_))
    }
}

impl From<KeyStoreError> for EngineError {
    fn from(e: KeyStoreError) -> Self {
        match e {
            KeyStoreError::Taken(_) => EngineError::FencedOut(Fenced::Race),
            KeyStoreError::FencedOut(_) => EngineError::FencedOut(Fenced::KeyStore),
            KeyStoreError::Throttled(_) | KeyStoreError::Unavailable(_) => EngineError::Transient(Cause::KeyStore(e)),
            KeyStoreError::Fault(_) => EngineError::Broken(Cause::KeyStore(e)),
        }
    }
}

impl From<RegionsError> for EngineError {
    fn from(e: RegionsError) -> Self {
        match e {
            RegionsError::Store(_) | RegionsError::Contended => EngineError::Transient(Cause::Regions(e)),
            RegionsError::Malformed(_) | RegionsError::Invalid(_) | RegionsError::Missing => {
                EngineError::Broken(Cause::Regions(e))
            }
        }
    }
}

impl From<LedgerError> for EngineError {
    fn from(e: LedgerError) -> Self {
        match e {
            // A phase that cannot start where it expects has a newer owner
            // (or already ran): either way this attempt must stop.
            LedgerError::FencedOut { .. } | LedgerError::OutOfOrder { .. } => EngineError::FencedOut(Fenced::Ledger),
            LedgerError::RegionFailed(region) => EngineError::RegionFailed(region),
            _ if e.is_transient() => EngineError::Transient(Cause::Ledger(e)),
            _ => EngineError::Broken(Cause::Ledger(e)),
        }
    }
}
