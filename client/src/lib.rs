//! The client half of exactly-once payments with keyfence.
//!
//! keyfence makes a retried `POST /v1/payments` take effect once, as long as
//! every retry carries the same `Idempotency-Key`. That part is the
//! client's: the key must be made once per logical operation and kept
//! before the first attempt, so that neither a timeout nor a crash of the
//! client itself ever leads to a second key for the same payment. This crate
//! does it:
//!
//! - [`Client::pay`] takes the caller's name for the operation (an
//!   [`OperationId`], such as an invoice number) and looks its key up in a
//!   [`Journal`], a small local file that one process at a time may hold,
//!   or makes one and writes it there, flushed to disk, before anything is
//!   sent;
//! - it retries on network errors, `409` and `429` (after `Retry-After`,
//!   in seconds or as an HTTP date) and `503` (on the next region), with
//!   exponential backoff and jitter, never on `400`, `401`, `402`, `404` or
//!   `422`;
//! - on `202` it polls the payment until its outcome is final or the
//!   caller's deadline passes;
//! - [`Client::refund`] does the same for a refund of a payment, under a
//!   key of its own;
//! - given several region URLs it sends to the first and moves to the next
//!   on a connection failure, a timeout or a `503`, with the same key.
//!
//! Region URLs are `https`, except to this machine itself (`localhost`,
//! `127.0.0.0/8`, `::1`); redirects are not followed, since one could lead
//! the API key anywhere; every request names the crate and its version in
//! `User-Agent`; and no answer is read past 64 KiB, far more than keyfence
//! ever sends.
//!
//! The answer is a [`Receipt`]: the key used and an [`Outcome`]
//! (succeeded, rejected with a reason, or still pending at the deadline).
//! Pending is not a failure: the payment will finish, and paying the same
//! operation again later returns its final outcome.
//!
//! ```no_run
//! use keyfence_client::{Client, OperationId, PaymentRequest, Outcome};
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let client = Client::builder(["https://eu.pay.example", "https://us.pay.example"], "kf_live_...")
//!     .journal("payments.journal")
//!     .build()?;
//! let request = PaymentRequest::new(1250, "EUR")
//!     .debtor_account("DE89370400440532013000")
//!     .creditor_account("FR1420041010050500013M02606")
//!     .end_to_end_id("INV-4711")
//!     .remittance_info("Invoice 4711");
//! match client.pay(&request, &OperationId::new("invoice-4711")?).await?.outcome {
//!     Outcome::Succeeded { payment } => println!("paid: {}", payment.id),
//!     Outcome::Rejected { reason, .. } => println!("declined: {reason}"),
//!     Outcome::Pending { .. } => println!("not final yet; pay the same operation again later"),
//!     _ => println!("an outcome this program does not know yet"),
//! }
//! # Ok(())
//! # }
//! ```

#![warn(missing_docs)]

mod answer;
mod client;
mod error;
mod journal;
mod region;
mod types;

pub use answer::retry_after;
pub use client::{Client, ClientBuilder};
pub use error::{BuildError, PayError};
pub use journal::{Journal, JournalError};
pub use types::{
    Outcome, Payment, PaymentRequest, PaymentStatus, Receipt, Refund, RefundOutcome, RefundReceipt, RefundRequest,
    RefundStatus,
};

use std::fmt;

/// The caller's name for one logical payment: the same operation always
/// gets the same idempotency key. 1 to 200 printable characters.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct OperationId(String);

/// An operation id that is empty, too long, or holds control characters.
#[derive(Debug, thiserror::Error)]
#[error("an operation id is 1 to 200 printable characters")]
pub struct InvalidOperationId;

impl OperationId {
    /// Checks and wraps the caller's name for an operation.
    pub fn new(id: impl Into<String>) -> Result<Self, InvalidOperationId> {
        let id = id.into();
        let printable = id.chars().all(|c| !c.is_control());
        if id.is_empty() || id.chars().count() > 200 || !printable {
            return Err(InvalidOperationId);
        }
        Ok(Self(id))
    }

    /// The name as given.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for OperationId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// What may grow in a later version without breaking a program written
/// against this one: a `match` on an outcome or an error needs an arm for
/// what it does not know, and a request is built, not spelt out field by
/// field.
///
/// ```compile_fail
/// fn exhaustive(outcome: keyfence_client::Outcome) {
///     match outcome {
///         keyfence_client::Outcome::Succeeded { .. } => {}
///         keyfence_client::Outcome::Rejected { .. } => {}
///         keyfence_client::Outcome::Pending { .. } => {}
///     }
/// }
/// ```
///
/// ```compile_fail
/// let request = keyfence_client::PaymentRequest {
///     amount_minor: 1250,
///     currency: "EUR".into(),
///     debtor_account: "DE89370400440532013000".into(),
///     creditor_account: "FR1420041010050500013M02606".into(),
///     end_to_end_id: "INV-4711".into(),
///     remittance_info: None,
/// };
/// ```
///
/// ```compile_fail
/// fn exhaustive(error: keyfence_client::PayError) {
///     match error {
///         keyfence_client::PayError::KeyReused { .. } => {}
///         keyfence_client::PayError::Refused { .. } => {}
///         keyfence_client::PayError::Journal(_) => {}
///         keyfence_client::PayError::NoJournal => {}
///     }
/// }
/// ```
#[cfg(doctest)]
pub struct MayGrow;
