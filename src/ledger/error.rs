//! `LedgerError`: why a ledger write did not take effect. `FencedOut` and
//! `OutOfOrder` are the protocol refusing a write; `Database` is a failure.

use crate::domain::{Fence, RecoveryPoint};

#[derive(Debug, thiserror::Error)]
pub enum LedgerError {
    /// A newer owner has written this request: the caller must stop at once.
    #[error("fenced out: the request was written under fence {current}, newer than {mine}")]
    FencedOut { mine: Fence, current: Fence },
    /// The request is not at the recovery point this phase starts from: the
    /// phase already committed (it must not run twice) or an earlier one has not.
    #[error("the request is at {found:?}, not at {expected} where this phase starts")]
    OutOfOrder { expected: RecoveryPoint, found: Option<RecoveryPoint> },
    /// A stored value this code cannot accept.
    #[error("ledger data is corrupt: {0}")]
    Corrupt(String),
    #[error("ledger database error: {0}")]
    Database(#[from] sqlx::Error),
    #[error("ledger migration failed: {0}")]
    Migration(#[from] sqlx::migrate::MigrateError),
}
