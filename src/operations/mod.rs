//! The operations keyfence works through the engine: each says what its
//! steps are, what each local step writes, and what it sends to which rail
//! ([`crate::engine::Operation`]). The engine knows none of them by name.

pub mod payment;

pub use payment::{PaymentOperation, ReturnEffect, apply_return};

/// The rail a payment is screened and authorised at (E1).
pub const SCREENING: &str = "screening";

/// The payment rail, where the money moves (E2).
pub const PAYMENT_RAIL: &str = "payment";
