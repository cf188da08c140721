//! What goes over the wire and what comes back to the caller.

use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// A payment to make, as `POST /v1/payments` takes it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PaymentRequest {
    /// Integer minor units (cents), positive.
    pub amount_minor: i64,
    /// ISO 4217 alphabetic code.
    pub currency: String,
    /// The account paid from (an IBAN).
    pub debtor_account: String,
    /// The account paid to (an IBAN).
    pub creditor_account: String,
    /// ISO 20022 end-to-end reference.
    pub end_to_end_id: String,
    /// Free text for the creditor, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remittance_info: Option<String>,
}

/// A payment as keyfence shows it.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
pub struct Payment {
    /// keyfence's id of the payment.
    pub id: Uuid,
    /// pending, indeterminate, succeeded, rejected or voided.
    pub status: String,
    /// Integer minor units (cents).
    pub amount_minor: i64,
    /// ISO 4217 alphabetic code.
    pub currency: String,
    /// The end-to-end reference it was sent with.
    pub end_to_end_id: String,
    /// The payment rail's own reference, once paid.
    #[serde(default)]
    pub rail_reference: Option<String>,
    /// Why it was rejected (a reason code), if it was.
    #[serde(default)]
    pub reason: Option<String>,
}

/// How a payment ended, as far as it is known.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Paid.
    Succeeded {
        /// The payment as keyfence answered it.
        payment: Payment,
    },
    /// Declined by screening or by the payment rail (final; nothing moved).
    Rejected {
        /// The rejected payment's id, when keyfence gave it.
        payment_id: Option<Uuid>,
        /// The reason code (or, failing that, the explanation).
        reason: String,
    },
    /// Not final when the deadline passed: the payment (if it was accepted
    /// at all) will finish, and paying the same operation again returns its
    /// outcome. Never a failure.
    Pending {
        /// The payment's id, if keyfence accepted it (202) before the deadline.
        payment_id: Option<Uuid>,
    },
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
    /// The key every attempt carried.
    pub idempotency_key: String,
    /// How the payment ended, or that it had not yet by the deadline.
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
