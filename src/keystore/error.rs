//! `KeyStoreError`: why a key-store operation did not take effect. The first
//! two are answers of the protocol (someone else owns the key); the others are
//! failures of the store, which callers treat as transient.

use super::key_item::KeyItem;

#[derive(Debug, thiserror::Error)]
pub enum KeyStoreError {
    /// A claim or takeover lost: the key exists and belongs to someone else
    /// (or its lease is still fresh). Carries the item as it stood, `None` if
    /// it no longer exists.
    #[error("the key is held by another owner")]
    Taken(Option<Box<KeyItem>>),
    /// The caller's fence no longer owns a started item: a newer owner took
    /// over, or the item finished or vanished. The caller must stop at once.
    #[error("fenced out: the key has a newer owner or is no longer in flight")]
    FencedOut(Option<Box<KeyItem>>),
    /// The store asked us to slow down and the SDK's retries ran out.
    #[error("the key store is throttling requests: {0}")]
    Throttled(#[source] StoreFailure),
    /// The store could not be reached or failed, after the SDK's retries.
    #[error("the key store is unavailable: {0}")]
    Unavailable(#[source] StoreFailure),
    /// The store answered something this code cannot accept: a missing table,
    /// a rejected request, an item that does not decode.
    #[error("key store fault: {0}")]
    Fault(#[source] StoreFailure),
}

/// A failure of the store, kept whole: the message the logs show (for an
/// SDK error, its whole chain of causes) and the error itself, if any.
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct StoreFailure {
    message: String,
    #[source]
    source: Option<Box<dyn std::error::Error + Send + Sync>>,
}

impl StoreFailure {
    /// An error of the SDK (or another library), as its source.
    pub fn of(e: impl std::error::Error + Send + Sync + 'static) -> Self {
        let message = aws_sdk_dynamodb::error::DisplayErrorContext(&e).to_string();
        Self { message, source: Some(Box::new(e)) }
    }

    /// A failure keyfence itself finds (an item that does not decode).
    pub fn said(message: impl Into<String>) -> Self {
        Self { message: message.into(), source: None }
    }
}
