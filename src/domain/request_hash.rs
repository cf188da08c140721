//! `RequestHash`: the fingerprint of a request (method, path and canonical
//! body). A key presented again with a different fingerprint is a client bug
//! and is refused rather than replayed.

use std::fmt;

use sha2::{Digest, Sha256};

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct RequestHash(String);

impl RequestHash {
    /// SHA-256 over method, path and the body in canonical JSON (RFC 8785),
    /// so key order and whitespace do not change it.
    pub fn of(method: &str, path: &str, canonical_body: &[u8]) -> Self {
        let mut hash = Sha256::new();
        hash.update(method.as_bytes());
        hash.update(b" ");
        hash.update(path.as_bytes());
        hash.update(b"\n");
        hash.update(canonical_body);
        Self(hex::encode(hash.finalize()))
    }

    /// A fingerprint already computed (hex), as stored in the key store.
    pub fn from_hex(hex: String) -> Self {
        Self(hex)
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for RequestHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn method_path_and_body_all_count() {
        let base = RequestHash::of("POST", "/v1/payments", b"{}");
        assert_eq!(base, RequestHash::of("POST", "/v1/payments", b"{}"));
        assert_ne!(base, RequestHash::of("POST", "/v1/refunds", b"{}"));
        assert_ne!(base, RequestHash::of("PUT", "/v1/payments", b"{}"));
        assert_ne!(base, RequestHash::of("POST", "/v1/payments", b"{\"a\":1}"));
    }
}
