//! `StoredResponse`: a final answer exactly as it will be replayed. The
//! ledger writes it in the phase that finishes a request, the key store keeps
//! a copy, and every retry gets these bytes back.

use std::collections::BTreeMap;

/// The largest final answer a request stores by default, in bytes
/// ([`StoredResponse::size`]): a few times the largest valid payment's or
/// refund's answer, and a small fraction of a DynamoDB item (400 KB), so
/// a key item stays cheap to read on every replay.
pub const ANSWER_LIMIT: u32 = 4096;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredResponse {
    pub status: u16,
    /// The headers worth replaying (content type, location), by lower-case name.
    pub headers: BTreeMap<String, String>,
    pub body: Vec<u8>,
}

impl StoredResponse {
    /// What the answer takes to store: its body, its headers' names and
    /// values, and its status.
    pub fn size(&self) -> usize {
        self.body.len() + self.headers.iter().map(|(name, value)| name.len() + value.len()).sum::<usize>() + 3
    }
}
