//! `RecoveryPoint`: the name of the last phase a request committed. Each
//! operation defines its own sequence; the ledger only stores the name and
//! refuses to move a request from any point but the one a phase expects.

use std::borrow::Cow;
use std::fmt;

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct RecoveryPoint(Cow<'static, str>);

impl RecoveryPoint {
    /// Claimed, nothing committed in the ledger yet.
    pub const STARTED: RecoveryPoint = RecoveryPoint::named("STARTED");
    /// The final answer is stored; only the key store may still need it.
    pub const FINISHED: RecoveryPoint = RecoveryPoint::named("FINISHED");
    /// Another owner finished the request; what this ledger held of it was
    /// reversed by the reconciler.
    pub const VOIDED: RecoveryPoint = RecoveryPoint::named("VOIDED");

    pub const fn named(name: &'static str) -> Self {
        Self(Cow::Borrowed(name))
    }

    /// A recovery point read back from storage.
    pub fn from_stored(name: String) -> Self {
        Self(Cow::Owned(name))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for RecoveryPoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}
