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

/// The most characters a rail's answer may carry in a text keyfence keeps
/// (its reference and time, a decline's code, reason and time). An answer
/// with more settles nothing, so no rail can make a final answer outgrow
/// the stored-answer cap.
pub const MAX_RAIL_TEXT: usize = 140;

fn short(text: &str) -> bool {
    text.chars().count() <= MAX_RAIL_TEXT
}

impl Applied {
    /// Whether its reference and time are within [`MAX_RAIL_TEXT`].
    pub fn fits(&self) -> bool {
        short(&self.reference) && short(&self.applied_at)
    }
}

impl Declined {
    /// Whether its code, reason and time are within [`MAX_RAIL_TEXT`].
    pub fn fits(&self) -> bool {
        short(&self.reason_code) && short(&self.reason) && short(&self.declined_at)
    }
}

impl Verdict {
    pub fn fits(&self) -> bool {
        match self {
            Verdict::Applied(applied) => applied.fits(),
            Verdict::Declined(declined) => declined.fits(),
        }
    }
}

/// Whether `verdict` answers the instruction `sent` under `key`: an answer
/// for another key, amount, currency or reference (a confused or hostile
/// system, a proxy mixing answers up), or one with texts too long to keep,
/// settles nothing.
pub fn answers(verdict: &Verdict, key: &str, sent: &Instruction) -> bool {
    let (answered_key, reference, amount) = match verdict {
        Verdict::Applied(a) => (&a.idempotency_key, &a.end_to_end_id, Some((a.amount_minor, &a.currency))),
        Verdict::Declined(d) => (&d.idempotency_key, &d.end_to_end_id, None),
    };
    verdict.fits()
        && answered_key == key
        && *reference == sent.end_to_end_id
        && amount.is_none_or(|(minor, currency)| minor == sent.amount_minor && *currency == sent.currency)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// An instruction as a payment sends it (the rail client's tests too).
    pub(crate) fn sent() -> Instruction {
        Instruction {
            originator: "client".into(),
            end_to_end_id: "E2E-1".into(),
            amount_minor: 1250,
            currency: "EUR".into(),
            debtor_account: "DE89370400440532013000".into(),
            creditor_account: "FR1420041010050500013M02606".into(),
        }
    }

    fn applied(reference: &str) -> Verdict {
        Verdict::Applied(Applied {
            idempotency_key: "k".into(),
            end_to_end_id: "E2E-1".into(),
            amount_minor: 1250,
            currency: "EUR".into(),
            originator: "client".into(),
            reference: reference.into(),
            applied_at: "2026-12-01T00:00:00Z".into(),
        })
    }

    fn declined(reason: &str) -> Verdict {
        Verdict::Declined(Declined {
            idempotency_key: "k".into(),
            end_to_end_id: "E2E-1".into(),
            reason_code: "amount_over_limit".into(),
            reason: reason.into(),
            declined_at: "2026-12-01T00:00:00Z".into(),
        })
    }

    #[test]
    fn an_answer_with_texts_too_long_to_keep_settles_nothing() {
        let longest = "\u{1D11E}".repeat(MAX_RAIL_TEXT);
        assert!(answers(&applied(&longest), "k", &sent()));
        assert!(!answers(&applied(&format!("{longest}x")), "k", &sent()));
        assert!(answers(&declined(&longest), "k", &sent()));
        assert!(!answers(&declined(&format!("{longest}x")), "k", &sent()));
    }

    #[test]
    fn an_answer_about_another_instruction_settles_nothing() {
        assert!(!answers(&applied("R-1"), "other", &sent()));
        let mut other = sent();
        other.amount_minor = 1251;
        assert!(!answers(&applied("R-1"), "k", &other));
    }
}
