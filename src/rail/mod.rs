//! External systems: E1 (screening) and E2 (the payment rail). Both speak
//! the same small HTTP protocol: `POST /v1/instructions` with an
//! `Idempotency-Key` (a repeat is a no-op that answers the first result),
//! and `GET /v1/instructions/{key}` to probe what became of one.
//! [`RailClient`] calls them; [`sim`] is a real server that stands in for
//! both in development and tests, with injectable faults.

mod client;
pub mod sim;

use serde::{Deserialize, Serialize};

pub use client::{CallOutcome, ProbeOutcome, RailClient};

/// What is sent to an external system.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Instruction {
    pub end_to_end_id: String,
    pub amount_minor: i64,
    pub currency: String,
    pub debtor_account: String,
    pub creditor_account: String,
}

/// An instruction the external system applied, as it reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Applied {
    pub idempotency_key: String,
    pub end_to_end_id: String,
    pub amount_minor: i64,
    pub currency: String,
    /// The system's own reference for the instruction.
    pub reference: String,
    /// RFC 3339.
    pub applied_at: String,
}
