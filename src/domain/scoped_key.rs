//! `ScopedKey`: an idempotency key inside its client's namespace. This pair,
//! never the key alone, identifies a request everywhere: one tenant's key can
//! neither collide with nor reveal another's.

use std::fmt;

use super::{ClientId, IdempotencyKey};

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ScopedKey {
    pub client: ClientId,
    pub key: IdempotencyKey,
}

impl ScopedKey {
    pub fn new(client: ClientId, key: IdempotencyKey) -> Self {
        Self { client, key }
    }

    /// The key store's partition key, `{client_id}#{key}`: spread over
    /// partitions by key, so one busy client is not one hot partition.
    pub fn partition_key(&self) -> String {
        format!("{}#{}", self.client, self.key)
    }
}

impl fmt::Display for ScopedKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}#{}", self.client, self.key)
    }
}
