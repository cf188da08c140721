//! Derived keys: the idempotency key each external step presents,
//! `uuid5(namespace, "{client_id}:{key}:{step}")`. Deterministic, so a
//! resumed attempt presents exactly the key the dead one used and the
//! external system treats it as a replay. Written as 32 hex digits, within
//! the 35 characters an ISO 20022 reference allows.

use uuid::Uuid;

use crate::domain::ScopedKey;

/// keyfence's UUID namespace (fixed forever: changing it would make every
/// in-flight request present new keys to the rails).
const NAMESPACE: Uuid = Uuid::from_u128(0x6b65_7966_656e_4365_8000_0000_0000_0001);

pub fn derived_key(key: &ScopedKey, step: &str) -> Uuid {
    Uuid::new_v5(&NAMESPACE, format!("{}:{}:{step}", key.client, key.key).as_bytes())
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
        assert_eq!(derived_key(&key, "ext1"), derived_key(&key, "ext1"));
        assert_ne!(derived_key(&key, "ext1"), derived_key(&key, "ext2"));
        assert_ne!(derived_key(&key, "ext1"), derived_key(&other, "ext1"));
        assert!(derived_key(&key, "ext1").simple().to_string().len() <= 35);
    }
}
