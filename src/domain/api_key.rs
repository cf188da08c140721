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
