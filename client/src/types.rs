//! What goes over the wire and what comes back to the caller.

use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// A payment to make, as `POST /v1/payments` takes it. Built with
/// [`PaymentRequest::new`] and a setter per field, so that a field keyfence
/// adds later (always optional) does not break the programs that build
/// requests today.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
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

impl PaymentRequest {
    /// A payment of `amount_minor` (cents) in `currency`. The accounts and
    /// the end-to-end reference are set by name, so that the debtor and the
    /// creditor cannot trade places unnoticed; keyfence refuses (`400`) a
    /// request without them, before anything is claimed.
    pub fn new(amount_minor: i64, currency: impl Into<String>) -> Self {
        Self {
            amount_minor,
            currency: currency.into(),
            debtor_account: String::new(),
            creditor_account: String::new(),
            end_to_end_id: String::new(),
            remittance_info: None,
        }
    }

    /// The account paid from (an IBAN).
    pub fn debtor_account(mut self, iban: impl Into<String>) -> Self {
        self.debtor_account = iban.into();
        self
    }

    /// The account paid to (an IBAN).
    pub fn creditor_account(mut self, iban: impl Into<String>) -> Self {
        self.creditor_account = iban.into();
        self
    }

    /// The ISO 20022 end-to-end reference both banks know the payment by.
    pub fn end_to_end_id(mut self, reference: impl Into<String>) -> Self {
        self.end_to_end_id = reference.into();
        self
    }

    /// Free text for the creditor.
    pub fn remittance_info(mut self, text: impl Into<String>) -> Self {
        self.remittance_info = Some(text.into());
        self
    }
}

/// Where a payment stands, as keyfence says it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Deserialize)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum PaymentStatus {
    /// Being worked, or the payment rail's outcome is not known yet.
    Pending,
    /// The outcome stayed unknown after repeated probes: it finishes when
    /// the rail answers, or is settled against the rail's statement.
    Indeterminate,
    /// Paid (final).
    Succeeded,
    /// Declined by screening or by the payment rail (final; see the reason).
    Rejected,
    /// This region's copy of a payment another region completed: the
    /// payment's key answers with the one that counts.
    Voided,
    /// A status keyfence added after this version of the crate: read as
    /// not final, so the payment is asked for again rather than misread.
    #[serde(other)]
    Unknown,
}

/// A payment as keyfence shows it.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[non_exhaustive]
pub struct Payment {
    /// keyfence's id of the payment.
    pub id: Uuid,
    /// Where it stands.
    pub status: PaymentStatus,
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

/// How a payment ended, as far as it is known. A later version may know
/// more ways (a `match` needs an arm for the rest).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
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
#[non_exhaustive]
pub struct Receipt {
    /// The key every attempt carried: the payment's reference with
    /// keyfence's support, worthless without the client's API key.
    pub idempotency_key: String,
    /// How the payment ended, or that it had not yet by the deadline.
    pub outcome: Outcome,
    /// The final answer was a replay of one given before (the operation had
    /// already been paid, by an earlier attempt or an earlier run).
    pub replayed: bool,
}

/// A refund to make of a payment, as `POST /v1/payments/{id}/refunds`
/// takes it: built with [`RefundRequest::new`] and a setter per field.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct RefundRequest {
    /// Integer minor units (cents), positive, at most what is left of the payment.
    pub amount_minor: i64,
    /// Why, for people (1 to 140 characters).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

impl RefundRequest {
    /// A refund of `amount_minor` in the payment's currency.
    pub fn new(amount_minor: i64) -> Self {
        Self { amount_minor, reason: None }
    }

    /// Why it is refunded.
    pub fn reason(mut self, text: impl Into<String>) -> Self {
        self.reason = Some(text.into());
        self
    }
}

/// Where a refund stands, as keyfence says it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Deserialize)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum RefundStatus {
    /// Being worked, or the payment rail's outcome is not known yet.
    Pending,
    /// The outcome stayed unknown after repeated probes.
    Indeterminate,
    /// Refunded (final).
    Succeeded,
    /// Declined by the payment rail (final; nothing moved).
    Rejected,
    /// This region's copy of a refund another region completed.
    Voided,
    /// A status keyfence added after this version of the crate: not final.
    #[serde(other)]
    Unknown,
}

/// A refund as keyfence shows it.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[non_exhaustive]
pub struct Refund {
    /// keyfence's id of the refund.
    pub id: Uuid,
    /// The payment it refunds.
    pub payment_id: Uuid,
    /// Where it stands.
    pub status: RefundStatus,
    /// Integer minor units (cents).
    pub amount_minor: i64,
    /// The payment's currency.
    pub currency: String,
    /// Why, as the request said.
    #[serde(default)]
    pub reason: Option<String>,
    /// The payment rail's own reference, once refunded.
    #[serde(default)]
    pub rail_reference: Option<String>,
    /// Why the rail declined it (a reason code), if it did.
    #[serde(default)]
    pub decline_reason: Option<String>,
}

/// How a refund ended, as far as it is known.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum RefundOutcome {
    /// Refunded.
    Succeeded {
        /// The refund as keyfence answered it.
        refund: Refund,
    },
    /// Declined by the payment rail (final; its amount may be refunded again).
    Rejected {
        /// The declined refund's id, when keyfence gave it.
        refund_id: Option<Uuid>,
        /// The reason code (or, failing that, the explanation).
        reason: String,
    },
    /// Not final when the deadline passed: the refund will finish, and
    /// refunding the same operation again returns its outcome.
    Pending {
        /// The refund's id, if keyfence accepted it (202) before the deadline.
        refund_id: Option<Uuid>,
    },
}

/// The answer to one `refund`: the key it was sent under and how it ended.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct RefundReceipt {
    /// The key every attempt carried.
    pub idempotency_key: String,
    /// How the refund ended, or that it had not yet by the deadline.
    pub outcome: RefundOutcome,
    /// The final answer was a replay of one given before.
    pub replayed: bool,
}

/// keyfence's answer to a refused payment or refund (`402`).
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
    #[serde(rename = "type", default)]
    pub kind: Option<String>,
    #[serde(default)]
    pub title: Option<String>,
    #[serde(default)]
    pub detail: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_status_is_read_into_its_variant_and_a_new_one_as_unknown() {
        let read = |status: &str| serde_json::from_value::<PaymentStatus>(status.into()).unwrap();
        assert_eq!(read("succeeded"), PaymentStatus::Succeeded);
        assert_eq!(read("indeterminate"), PaymentStatus::Indeterminate);
        assert_eq!(read("voided"), PaymentStatus::Voided);
        assert_eq!(read("reversed"), PaymentStatus::Unknown);
    }
}
