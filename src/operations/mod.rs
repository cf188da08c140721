//! The operations keyfence works through the engine: each says what its
//! steps are, what each local step writes, and what it sends to which rail
//! ([`crate::engine::Operation`]). The engine knows none of them by name;
//! [`Registered`] is the one place that does, so whatever finds a request
//! by itself (the recovery worker, the reconciler, the inbox) rebuilds it
//! as the operation it was stored as.

pub mod payment;
pub mod refund;

pub use payment::{PaymentOperation, ReturnEffect, apply_return};
pub use refund::{
    RefundOperation, RefundOrder, RefundedPayment, apply_return as apply_refund_return, returnable as refund_returnable,
};

use crate::domain::{RecoveryPoint, StoredResponse};
use crate::engine::{EngineError, ExternalStep, Operation, Step, StepContext};
use crate::keystore::Hold;
use crate::rail::{Declined, Instruction};

/// The rail a payment is screened and authorised at (E1).
pub const SCREENING: &str = "screening";

/// The payment rail, where the money moves (E2).
pub const PAYMENT_RAIL: &str = "payment";

/// Every operation keyfence serves, rebuilt by the name it was stored under.
pub enum Registered {
    Payment(PaymentOperation),
    Refund(RefundOperation),
}

impl Registered {
    /// Rebuilds operation `name` from the canonical request kept with its key.
    pub fn decode(name: &str, request: &[u8]) -> Result<Self, EngineError> {
        match name {
            PaymentOperation::NAME => PaymentOperation::from_canonical(request).map(Self::Payment),
            RefundOperation::NAME => RefundOperation::from_canonical(request).map(Self::Refund),
            other => Err(EngineError::Fault(format!("no operation is named {other:?}"))),
        }
    }
}

impl Operation for Registered {
    fn name(&self) -> &'static str {
        match self {
            Self::Payment(op) => op.name(),
            Self::Refund(op) => op.name(),
        }
    }

    fn steps(&self) -> &'static [Step] {
        match self {
            Self::Payment(op) => op.steps(),
            Self::Refund(op) => op.steps(),
        }
    }

    async fn local(
        &self,
        point: &RecoveryPoint,
        cx: &mut StepContext<'_>,
    ) -> Result<Option<StoredResponse>, EngineError> {
        match self {
            Self::Payment(op) => op.local(point, cx).await,
            Self::Refund(op) => op.local(point, cx).await,
        }
    }

    async fn declined(
        &self,
        step: &ExternalStep,
        declined: &Declined,
        cx: &mut StepContext<'_>,
    ) -> Result<StoredResponse, EngineError> {
        match self {
            Self::Payment(op) => op.declined(step, declined, cx).await,
            Self::Refund(op) => op.declined(step, declined, cx).await,
        }
    }

    async fn indeterminate(&self, step: &ExternalStep, cx: &mut StepContext<'_>) -> Result<(), EngineError> {
        match self {
            Self::Payment(op) => op.indeterminate(step, cx).await,
            Self::Refund(op) => op.indeterminate(step, cx).await,
        }
    }

    fn instruction(&self, step: &ExternalStep) -> Instruction {
        match self {
            Self::Payment(op) => op.instruction(step),
            Self::Refund(op) => op.instruction(step),
        }
    }

    fn hold(&self) -> Option<Hold> {
        match self {
            Self::Payment(op) => op.hold(),
            Self::Refund(op) => op.hold(),
        }
    }
}
