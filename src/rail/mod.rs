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

/// An instruction the external system applied and later returned (the
/// money went back), as it reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Returned {
    pub idempotency_key: String,
    pub end_to_end_id: String,
    pub amount_minor: i64,
    pub currency: String,
    /// Machine-readable, e.g. `AC04` (account closed).
    pub reason_code: String,
    /// RFC 3339.
    pub returned_at: String,
}

/// What an external system tells its participant after the fact, posted
/// to its callback: `{"type": "instruction.applied", "id", "applied": {..}}`,
/// and so on. `id` names the message (and is its `webhook-id`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type")]
pub enum Notice {
    #[serde(rename = "instruction.applied")]
    Applied { id: String, applied: Applied },
    #[serde(rename = "instruction.declined")]
    Declined { id: String, declined: Declined },
    #[serde(rename = "instruction.returned")]
    Returned { id: String, returned: Returned },
}

impl Notice {
    pub fn id(&self) -> &str {
        match self {
            Self::Applied { id, .. } | Self::Declined { id, .. } | Self::Returned { id, .. } => id,
        }
    }
}

/// A definite answer from an external system: what happened, for good.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    Applied(Applied),
    Declined(Declined),
}

/// Whether `verdict` answers the instruction `sent` under `key`: an answer
/// for another key, amount, currency or reference (a confused or hostile
/// system, a proxy mixing answers up) settles nothing.
pub fn answers(verdict: &Verdict, key: &str, sent: &Instruction) -> bool {
    let (answered_key, reference, amount) = match verdict {
        Verdict::Applied(a) => (&a.idempotency_key, &a.end_to_end_id, Some((a.amount_minor, &a.currency))),
        Verdict::Declined(d) => (&d.idempotency_key, &d.end_to_end_id, None),
    };
    answered_key == key
        && *reference == sent.end_to_end_id
        && amount.is_none_or(|(minor, currency)| minor == sent.amount_minor && *currency == sent.currency)
}
