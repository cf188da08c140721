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
/// profile items): only the security and migration roles may write them
/// (`infra/key-table.cfn.yaml`; `tests/it/policies.rs` checks every role).
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

    /// The item kinds a policy lets its role write (`ForAllValues:StringLike`
    /// on the partition key), as prefixes.
    fn writable(policy: &str) -> Vec<String> {
        let all: serde_json::Value = serde_json::from_str(include_str!("../../infra/key-table.policies.json")).unwrap();
        let statements = all[format!("{{table}}-{policy}")]["statements"].as_object().unwrap().clone();
        statements
            .values()
            .filter(|st| st["effect"] == "Allow")
            .filter_map(|st| st["conditions"]["ForAllValues:StringLike dynamodb:LeadingKeys"].as_array().cloned())
            .flatten()
            .map(|pattern| pattern.as_str().unwrap().trim_end_matches('*').to_owned())
            .collect()
    }

    #[test]
    fn only_security_and_migration_may_write_the_operator_only_items() {
        for prefix in OPERATOR_ONLY {
            let covers = |policy: &str| writable(policy).iter().any(|kind| prefix.starts_with(kind.as_str()));
            assert!(!covers("serve") && !covers("sre"), "{prefix} is writable by serve or SREs");
            assert!(covers("migration"), "{prefix} is not carried by migrate");
        }
        assert!(writable("security").iter().any(|kind| OPERATOR_ONLY[0].starts_with(kind.as_str())));
    }
}
