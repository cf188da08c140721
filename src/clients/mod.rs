//! API clients, global: a client created once is known in every region,
//! because its record is a control item of the key table that every region
//! reads ([`store`]; of its keys only digests are stored). Every change of
//! a record is logged in one item ([`changes`]) that every instance reads
//! once a second, so each instance holds the whole directory in memory
//! ([`directory`]): a presented key is admitted if its client's record
//! holds it, valid ([`keys`]), and the client is not revoked, with no store
//! read on the request's path; a key made, rotated or revoked a moment ago
//! is seen everywhere within a second, and a made-up key costs nothing but
//! a wait for the next read.

mod changes;
mod directory;
mod keys;
mod legacy;
mod profile;
mod store;

use serde::Serialize;
use std::time::Duration;

use crate::domain::ClientId;

pub use directory::Directory;
pub use keys::Rotated;
pub use legacy::Carried;
pub use profile::{FairUse, Limits, Profile, Refusal};
pub use store::{ClientStore, ClientsError, KeyRecord};

/// Partition-key prefixes of the items only an operator's CLI writes
/// (client records, key pointers, and the older layout's client and
/// profile items): the serving role is denied writing them
/// (`infra/key-table.cfn.yaml`).
pub const OPERATOR_ONLY: [&str; 3] = [store::RECORD_SPACE, legacy::CLIENT, legacy::PROFILE];

/// How long the directory is trusted without a successful read of the
/// change log: past it, requests wait for one (and get 503 without it).
pub const CACHE_FOR: Duration = Duration::from_secs(5);

/// A client as the directory records it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ClientRecord {
    pub id: ClientId,
    pub name: String,
    /// Milliseconds since the epoch.
    pub created_at: u64,
    /// Set once revoked: every key of the client is refused from then on.
    pub revoked_at: Option<u64>,
    /// Its keys, oldest first.
    pub keys: Vec<KeyRecord>,
}

#[cfg(test)]
mod tests {
    use super::OPERATOR_ONLY;

    #[test]
    fn the_serving_role_is_denied_writing_every_operator_only_item() {
        let template = include_str!("../../infra/key-table.cfn.yaml");
        let denied = template.split("NeverWriteClientsKeysOrAccounts").nth(1).expect("the serving role's deny");
        for prefix in OPERATOR_ONLY {
            assert!(denied.contains(&format!("\"{prefix}*\"")), "{prefix} is not denied to serve");
        }
    }
}
