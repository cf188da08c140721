//! `StoredResponse`: a final answer exactly as it will be replayed. The
//! ledger writes it in the phase that finishes a request, the key store keeps
//! a copy, and every retry gets these bytes back.

use std::collections::BTreeMap;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredResponse {
    pub status: u16,
    /// The headers worth replaying (content type, location), by lower-case name.
    pub headers: BTreeMap<String, String>,
    pub body: Vec<u8>,
}
