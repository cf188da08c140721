//! `ApiKey`: a client's secret credential. Generated once and shown once;
//! only its SHA-256 is stored, and requests are matched by that digest.

use sha2::{Digest, Sha256};
use uuid::Uuid;

pub struct ApiKey(String);

impl ApiKey {
    /// A new key: `kf_` and 64 hex digits from two random v4 UUIDs (244
    /// random bits), far beyond guessing.
    pub fn generate() -> Self {
        Self(format!("kf_{}{}", Uuid::new_v4().simple(), Uuid::new_v4().simple()))
    }

    /// Whether the presented secret has the shape every generated key has
    /// (`kf_` and 64 lowercase hex digits): anything else is refused before
    /// any lookup, at no cost.
    pub fn is_well_formed(&self) -> bool {
        self.0
            .strip_prefix("kf_")
            .is_some_and(|hex| hex.len() == 64 && hex.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')))
    }

    /// The presented secret, as received.
    pub fn presented(raw: &str) -> Self {
        Self(raw.to_owned())
    }

    /// The stored form: hex SHA-256.
    pub fn digest(&self) -> String {
        hex::encode(Sha256::digest(self.0.as_bytes()))
    }

    /// The secret itself, to show the operator once.
    pub fn reveal(&self) -> &str {
        &self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_generated_keys_are_well_formed() {
        assert!(ApiKey::generate().is_well_formed());
        for made_up in
            ["", "kf_", "kf_abc", "Bearer", &format!("kf_{}", "A".repeat(64)), &format!("xx_{}", "a".repeat(64))]
        {
            assert!(!ApiKey::presented(made_up).is_well_formed(), "{made_up:?}");
        }
    }
}
