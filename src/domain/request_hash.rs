//! `RequestHash`: the fingerprint of a request (method, path and canonical
//! body). A key presented again with a different fingerprint is a client bug
//! and is refused rather than replayed.

use std::fmt;

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct RequestHash(String);

impl RequestHash {
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
