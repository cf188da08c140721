//! `ClientId`: the tenant that owns an idempotency key. Keys are unique per
//! client, never globally, so every lookup carries one.

use std::fmt;
use std::str::FromStr;

use uuid::Uuid;

/// A client of the API. A UUID, so it can never contain the `#` that
/// separates it from the key in the key store's partition key.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
#[serde(transparent)]
pub struct ClientId(Uuid);

impl ClientId {
    pub fn new(id: Uuid) -> Self {
        Self(id)
    }

    /// A fresh client id (time-ordered, so a table keyed by it stays local).
    pub fn generate() -> Self {
        Self(Uuid::now_v7())
    }

    pub fn as_uuid(&self) -> Uuid {
        self.0
    }
}

impl fmt::Display for ClientId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.hyphenated().fmt(f)
    }
}

impl FromStr for ClientId {
    type Err = uuid::Error;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Uuid::parse_str(s).map(Self)
    }
}
