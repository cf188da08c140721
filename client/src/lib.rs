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
//!   [`Journal`], a small local file, or makes one and writes it there,
//!   flushed to disk, before anything is sent;
//! - it retries on network errors, `409` and `429` (after `Retry-After`) and
//!   `503` (on the next region), with exponential backoff and jitter, never
//!   on `400`, `401`, `402`, `404` or `422`;
//! - on `202` it polls the payment until its outcome is final or the
//!   caller's deadline passes;
//! - given several region URLs it sends to the first and moves to the next
//!   on a connection failure, a timeout or a `503`, with the same key.
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
//! let request = PaymentRequest {
//!     amount_minor: 1250,
//!     currency: "EUR".into(),
//!     debtor_account: "DE89370400440532013000".into(),
//!     creditor_account: "FR1420041010050500013M02606".into(),
//!     end_to_end_id: "INV-4711".into(),
//!     remittance_info: Some("Invoice 4711".into()),
//! };
//! match client.pay(&request, &OperationId::new("invoice-4711")?).await?.outcome {
//!     Outcome::Succeeded { payment } => println!("paid: {}", payment.id),
//!     Outcome::Rejected { reason, .. } => println!("declined: {reason}"),
//!     Outcome::Pending { .. } => println!("not final yet; pay the same operation again later"),
//! }
//! # Ok(())
//! # }
//! ```

#![warn(missing_docs)]

mod client;
mod journal;
mod types;

pub use client::{Client, ClientBuilder, PayError};
pub use journal::{Journal, JournalError};
pub use types::{Outcome, Payment, PaymentRequest, Receipt};

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
