//! Derived keys: the idempotency key each external step presents,
//! `uuid5(namespace, "{client_id}:{key}:{claim}:{step}")`, where `claim` is
//! the id fixed when the key was first claimed (and kept on the key
//! item). Deterministic, so a resumed attempt presents exactly the key the
//! dead one used and the external system treats it as a replay; unique per
//! claim, so a client key reused after its retention never collides with
//! the old instruction at the rail. Written as 32 hex digits, within the 35
//! characters an ISO 20022 reference allows.

use uuid::Uuid;

use crate::domain::ScopedKey;

/// keyfence's UUID namespace (fixed forever: changing it would make every
/// in-flight request present new keys to the rails).
const NAMESPACE: Uuid = Uuid::from_u128(0x6b65_7966_656e_4365_8000_0000_0000_0001);

pub fn derived_key(key: &ScopedKey, claim: Uuid, step: &str) -> Uuid {
    Uuid::new_v5(&NAMESPACE, format!("{}:{}:{claim}:{step}", key.client, key.key).as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::{ClientId, IdempotencyKey};

    #[test]
    fn same_inputs_same_key_and_each_input_counts() {
        let client = ClientId::generate();
        let key = ScopedKey::new(client, IdempotencyKey::parse("k-1").unwrap());
        let other = ScopedKey::new(ClientId::generate(), IdempotencyKey::parse("k-1").unwrap());
        let (claim, later_claim) = (Uuid::now_v7(), Uuid::now_v7());
        assert_eq!(derived_key(&key, claim, "ext1"), derived_key(&key, claim, "ext1"));
        assert_ne!(derived_key(&key, claim, "ext1"), derived_key(&key, claim, "ext2"));
        assert_ne!(derived_key(&key, claim, "ext1"), derived_key(&other, claim, "ext1"));
        assert_ne!(derived_key(&key, claim, "ext1"), derived_key(&key, later_claim, "ext1"), "a reused key");
        assert!(derived_key(&key, claim, "ext1").simple().to_string().len() <= 35);
    }
}
