//! `Fence`: the fencing token. It grows by one at every claim or takeover of
//! a key, and every write an owner makes (to the key store and to the ledger)
//! carries it, so storage rejects an owner that has been superseded.

use std::fmt;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Fence(u64);

impl Fence {
    /// The token of the first claim of a key.
    pub const FIRST: Fence = Fence(1);

    pub fn new(value: u64) -> Self {
        Self(value)
    }

    pub fn get(self) -> u64 {
        self.0
    }

    /// The token a takeover installs over this one.
    pub fn next(self) -> Self {
        Self(self.0 + 1)
    }
}

impl fmt::Display for Fence {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}
