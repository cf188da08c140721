//! What goes over the wire and what comes back to the caller.

use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// A payment to make, as `POST /v1/payments` takes it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PaymentRequest {
    /// Integer minor units (cents).
    pub amount_minor: i64,
    /// ISO 4217 alphabetic code.
    pub currency: String,
    pub debtor_account: String,
    pub creditor_account: String,
    /// ISO 20022 end-to-end reference.
    pub end_to_end_id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remittance_info: Option<String>,
}

/// A payment as keyfence shows it.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
pub struct Payment {
    pub id: Uuid,
    /// pending, indeterminate, succeeded, rejected or voided.
    pub status: String,
    pub amount_minor: i64,
    pub currency: String,
    pub end_to_end_id: String,
    #[serde(default)]
    pub rail_reference: Option<String>,
    #[serde(default)]
    pub reason: Option<String>,
}

/// How a payment ended, as far as it is known.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Paid.
    Succeeded { payment: Payment },
    /// Declined by screening or by the payment rail (final; nothing moved).
    Rejected { payment_id: Option<Uuid>, reason: String },
    /// Not final when the deadline passed: the payment (if it was accepted
    /// at all) will finish, and paying the same operation again returns its
    /// outcome. Never a failure.
    Pending { payment_id: Option<Uuid> },
}

impl Outcome {
    /// Whether this outcome will never change.
    pub fn is_final(&self) -> bool {
        !matches!(self, Outcome::Pending { .. })
    }
}

/// The answer to one `pay`: the key it was sent under and how it ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Receipt {
    pub idempotency_key: String,
    pub outcome: Outcome,
    /// The final answer was a replay of one given before (the operation had
    /// already been paid, by an earlier attempt or an earlier run).
    pub replayed: bool,
}

/// keyfence's answer to a refused payment (`402`).
#[derive(Deserialize)]
pub(crate) struct Declined {
    #[serde(default)]
    pub reason: Option<String>,
    #[serde(default)]
    pub detail: Option<String>,
    #[serde(default)]
    pub id: Option<Uuid>,
}

/// keyfence's answer to `202`: the payment is being worked.
#[derive(Deserialize)]
pub(crate) struct Accepted {
    pub id: Uuid,
}

/// An RFC 9457 problem, for error messages.
#[derive(Deserialize)]
pub(crate) struct Problem {
    #[serde(default)]
    pub title: Option<String>,
    #[serde(default)]
    pub detail: Option<String>,
}
