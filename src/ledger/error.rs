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
    /// This ledger's region has been fenced as failed (by `keyfence regions
    /// fail --ledger`): no phase commits here any more.
    #[error("the ledger of region {0} is fenced: the region was declared failed")]
    RegionFailed(String),
    /// The region fence could not be changed: a phase held its lock past
    /// the wait (a stalled transaction). Nothing changed; try again.
    #[error("a phase transaction held the region fence's lock for {0:?} (a stalled phase?): not changed; try again")]
    FenceBusy(std::time::Duration),
    /// Work for one region (a fence change, counting its hand-offs) asked
    /// of a ledger bound to another.
    #[error("this ledger is region {ledger}'s, not {asked}'s")]
    OtherRegion { ledger: String, asked: String },
    /// The URL would reach another machine without requiring TLS: nothing
    /// was connected.
    #[error("{0}")]
    InClear(String),
    /// A stored value this code cannot accept.
    #[error("ledger data is corrupt: {0}")]
    Corrupt(String),
    /// A value that does not read back (or encode) as what it is: `what`
    /// it is, and why not.
    #[error("a ledger value does not read or encode: {what}: {source}")]
    Unreadable {
        what: String,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    #[error("ledger database error: {0}")]
    Database(#[from] sqlx::Error),
    #[error("ledger migration failed: {0}")]
    Migration(#[from] sqlx::migrate::MigrateError),
}

impl LedgerError {
    /// A value (`what`) that does not read or encode, kept whole.
    pub fn unreadable(what: impl Into<String>, source: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Self {
        LedgerError::Unreadable { what: what.into(), source: source.into() }
    }

    /// Whether PostgreSQL refused the statement with SQLSTATE `code`.
    pub fn has_code(&self, code: &str) -> bool {
        matches!(self, LedgerError::Database(sqlx::Error::Database(db)) if db.code().as_deref() == Some(code))
    }

    /// A failure that retrying later can fix: the database unreachable or
    /// restarting, out of connections, or a transaction that lost a
    /// serialisation or deadlock race (SQLSTATE classes 08, 53, 57P and
    /// 40). Nothing was committed by the failed statement.
    pub fn is_transient(&self) -> bool {
        match self {
            LedgerError::Database(sqlx::Error::Database(db)) => {
                let code = db.code().unwrap_or_default();
                ["08", "53", "57P", "40"].iter().any(|class| code.starts_with(class))
            }
            LedgerError::FenceBusy(_) => true,
            LedgerError::Database(
                sqlx::Error::Io(_)
                | sqlx::Error::Tls(_)
                | sqlx::Error::Protocol(_)
                | sqlx::Error::PoolTimedOut
                | sqlx::Error::PoolClosed
                | sqlx::Error::WorkerCrashed,
            ) => true,
            _ => false,
        }
    }
}
