//! External systems: E1 (screening) and E2 (the payment rail). Both speak
//! the same small HTTP protocol: `POST /v1/instructions` with an
//! `Idempotency-Key` (a repeat is a no-op that answers the first result),
//! and `GET /v1/instructions/{key}` to probe what became of one. Either
//! answer is a [`Verdict`]: applied (200/201 with [`Applied`]) or declined
//! (402 with [`Declined`], final: the system will never apply it).
//! [`RailClient`] calls them and classifies every answer; [`sim`] is a real
//! server that stands in for both in development and tests, with injectable
//! faults and decline rules.

mod client;
pub mod sim;

use serde::{Deserialize, Serialize};

pub use client::{CallOutcome, ProbeOutcome, RailClient};

/// What is sent to an external system.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Instruction {
    /// Who asked: the client the payment is made for.
    #[serde(default)]
    pub originator: String,
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
    /// Who asked, as the instruction said.
    #[serde(default)]
    pub originator: String,
    /// The system's own reference for the instruction.
    pub reference: String,
    /// RFC 3339.
    pub applied_at: String,
}

/// An instruction the external system refused for good (screening rejected
/// it, or the rail declined it). Recorded under its key like an applied one,
/// so a repeat or a probe answers the same refusal.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Declined {
    pub idempotency_key: String,
    pub end_to_end_id: String,
    /// Machine-readable, e.g. `creditor_account_blocked`, `amount_over_limit`.
    pub reason_code: String,
    /// For people.
    pub reason: String,
    /// RFC 3339.
    pub declined_at: String,
}

/// A definite answer from an external system: what happened, for good.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    Applied(Applied),
    Declined(Declined),
}
