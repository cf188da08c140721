//! The refund operation: money of a settled payment goes back from its
//! creditor to its debtor, once. Before its first phase the engine takes
//! the refund's hold on the payment's refundable balance (one conditional
//! write in the key table, shared by every region), so no two refunds,
//! wherever they are worked, together exceed the payment. Its steps:
//! - `R1_DONE`: the refund row (pending) and a hold on the creditor's funds;
//! - `REFUND_SENT` / `REFUND_DONE`: the refund instruction at E2, the
//!   payment rail, under its own derived key;
//! - `FINISHED`: the held funds go to the debtor, the refund succeeds,
//!   `refund.succeeded` is queued, and the 201 answer is built (the hold on
//!   the balance is then settled).
//!
//! If the rail declines it, that phase gives the creditor its funds back,
//! marks the refund `rejected` with the reason, queues `refund.rejected`
//! and answers 402 (and the balance's hold is released, so a later refund
//! may have the amount). A refund whose outcome stays unknown so long it is
//! listed for settlement is marked `indeterminate` and queues
//! `refund.indeterminate`. Its postings are the refund's own and sum to zero.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::domain::{RecoveryPoint, RefundRequest, StoredResponse};
use crate::engine::{EngineError, ExternalStep, Operation, Step, StepContext};
use crate::keystore::Hold;
use crate::ledger::payments::{self, Leg};
use crate::ledger::refunds::{self, NewRefund, Refund, Standing};
use crate::ledger::writes::Writes;
use crate::rail::{Declined, Instruction, Returned};
use crate::webhooks;

use super::{PAYMENT_RAIL, ReturnEffect};

const R1_DONE: RecoveryPoint = RecoveryPoint::named("R1_DONE");

static STEPS: [Step; 3] = [
    Step::Local(R1_DONE),
    Step::External(ExternalStep {
        name: "refund",
        rail: PAYMENT_RAIL,
        sent: RecoveryPoint::named("REFUND_SENT"),
        done: RecoveryPoint::named("REFUND_DONE"),
    }),
    Step::Local(RecoveryPoint::FINISHED),
];

/// What the payment refunded is, as far as a refund needs it: read when
/// the refund is accepted (from whichever region holds the payment) and
/// kept with the request, so a resume in any region works on the same.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RefundedPayment {
    pub id: Uuid,
    pub amount_minor: i64,
    pub currency: String,
    pub debtor_account: String,
    pub creditor_account: String,
    pub end_to_end_id: String,
}

/// A refund as accepted: the client's request and the payment it refunds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RefundOrder {
    pub refund: RefundRequest,
    pub payment: RefundedPayment,
}

/// What the name of a payment's refundable balance starts with.
const BALANCE: &str = "refundable#payment#";

pub struct RefundOperation {
    order: RefundOrder,
}

impl RefundOperation {
    pub const NAME: &'static str = "refund";

    pub fn new(order: RefundOrder) -> Self {
        Self { order }
    }

    /// Rebuilds the operation from the canonical request kept with the key.
    pub fn from_canonical(request: &[u8]) -> Result<Self, EngineError> {
        let order: RefundOrder =
            serde_json::from_slice(request).map_err(|e| EngineError::record("a stored refund request", e))?;
        Ok(Self::new(order))
    }

    /// The balance a payment's refunds draw on.
    pub fn balance_of(payment: Uuid) -> String {
        format!("{BALANCE}{payment}")
    }

    /// The payment whose refundable balance `balance` is, if it is one.
    pub fn payment_of(balance: &str) -> Option<Uuid> {
        balance.strip_prefix(BALANCE).and_then(|id| Uuid::parse_str(id).ok())
    }

    /// What a return of payment `payment` (of `amount_minor`) holds on its
    /// balance: all of it, so no refund and no return overlap. It is never
    /// concluded: a returned payment has nothing left to refund.
    pub fn hold_for_return(payment: Uuid, amount_minor: i64) -> Hold {
        Hold { balance: Self::balance_of(payment), total: amount_minor, amount: amount_minor, lasting: true }
    }

    /// The id the return of payment `payment` holds under (one per payment).
    pub fn return_hold_id(payment: Uuid) -> Uuid {
        Uuid::new_v5(&payment, b"return")
    }

    fn transfer(&self, cx: &mut StepContext<'_>, entry: &str, from: &str, to: &str) {
        let amount = self.order.refund.amount_minor;
        let legs = [Leg { account: from, amount_minor: -amount }, Leg { account: to, amount_minor: amount }];
        let (id, fence) = (cx.request.payment_id, cx.fence);
        payments::post(cx.writes(), id, entry, &self.order.payment.currency, &legs, fence);
    }

    fn creditor_account(&self) -> String {
        format!("creditor:{}", self.order.payment.creditor_account)
    }

    fn hold_account(&self) -> String {
        format!("hold:{}", self.order.payment.creditor_account)
    }

    async fn finish(&self, cx: &mut StepContext<'_>) -> Result<StoredResponse, EngineError> {
        let rail = cx.applied("refund").await?;
        let (id, fence) = (cx.request.payment_id, cx.fence);
        let refund = refunds::set_status(cx.conn().await?, id, "succeeded", Some(&rail.reference), None, fence).await?;
        self.transfer(cx, "refund", &self.hold_account(), &format!("debtor:{}", self.order.payment.debtor_account));
        queue_event(cx, &refund, "refund.succeeded")?;
        let body = serde_json::to_vec(&refund).map_err(|e| EngineError::record("a refund's answer", e))?;
        Ok(StoredResponse {
            status: 201,
            headers: BTreeMap::from([
                ("content-type".to_owned(), "application/json".to_owned()),
                ("location".to_owned(), format!("/v1/refunds/{}", refund.id)),
            ]),
            body,
        })
    }
}

/// Queues webhook event `event` about `refund`, in the phase that causes it.
fn queue_event(cx: &mut StepContext<'_>, refund: &Refund, event: &str) -> Result<(), EngineError> {
    let data = serde_json::to_value(refund).map_err(|e| EngineError::record("a refund event", e))?;
    let client = cx.request.key.client;
    webhooks::queue::event(cx.writes(), client, refund.id, event, &data);
    Ok(())
}

/// Whether the rail's return of refund `standing` takes effect now: the
/// refund succeeded, and the return is of what it sent (its amount and
/// currency; the notification was matched against its instruction on
/// arrival); else what becomes of the return.
pub fn returnable(standing: &Standing, returned: &Returned) -> Result<(), ReturnEffect> {
    match standing.refund.status.as_str() {
        "succeeded" => {}
        "pending" | "indeterminate" => return Err(ReturnEffect::NotYetSettled),
        "returned" => return Err(ReturnEffect::AlreadyReturned),
        "voided" => return Err(ReturnEffect::Unmatched("this ledger holds a leftover of the refund")),
        _ => return Err(ReturnEffect::Unmatched("the refund did not settle, yet the rail returned it")),
    }
    if standing.refund.amount_minor != returned.amount_minor || standing.refund.currency != returned.currency {
        return Err(ReturnEffect::Unmatched("the return is not of what the refund settled"));
    }
    Ok(())
}

/// Applies the rail's return of refund `standing` (see [`returnable`]),
/// inside the phase that takes it: the money never reached the debtor, so
/// it moves back from the debtor to the payment's creditor in one balanced
/// entry, the refund is marked `returned` with the reason code, and
/// `refund.returned` is queued. The refund's hold on its payment's balance
/// is undone before (the caller's), so what is left to refund grows again.
pub async fn apply_return(
    conn: &mut sqlx::PgConnection,
    standing: &Standing,
    returned: &Returned,
) -> Result<(), EngineError> {
    let (refund, client, fence) = refunds::mark_returned(conn, standing.refund.id, &returned.reason_code).await?;
    let amount = refund.amount_minor;
    let legs = [
        Leg { account: &format!("debtor:{}", standing.debtor_account), amount_minor: -amount },
        Leg { account: &format!("creditor:{}", standing.creditor_account), amount_minor: amount },
    ];
    let mut writes = Writes::default();
    payments::post(&mut writes, refund.id, "refund_return", &refund.currency, &legs, fence);
    let data = serde_json::to_value(&refund).map_err(|e| EngineError::record("a refund event", e))?;
    webhooks::queue::event(&mut writes, client, refund.id, "refund.returned", &data);
    writes.send(conn).await?;
    Ok(())
}

/// The final answer of a declined refund: RFC 9457 problem+json, with the
/// reason code and the refund's id so the client can look it up.
fn declined_answer(refund_id: Uuid, declined: &Declined) -> StoredResponse {
    let body = serde_json::json!({
        "type": "urn:keyfence:problem:refund-declined",
        "title": "Refund declined",
        "status": 402,
        "detail": format!("The refund was declined by the payment rail: {}.", declined.reason),
        "reason": declined.reason_code,
        "id": refund_id,
    });
    StoredResponse {
        status: 402,
        headers: BTreeMap::from([
            ("content-type".to_owned(), "application/problem+json".to_owned()),
            ("location".to_owned(), format!("/v1/refunds/{refund_id}")),
        ]),
        body: body.to_string().into_bytes(),
    }
}

impl Operation for RefundOperation {
    fn name(&self) -> &'static str {
        Self::NAME
    }

    fn steps(&self) -> &'static [Step] {
        &STEPS
    }

    async fn local(
        &self,
        point: &RecoveryPoint,
        cx: &mut StepContext<'_>,
    ) -> Result<Option<StoredResponse>, EngineError> {
        if *point == R1_DONE {
            let (order, payment) = (&self.order.refund, &self.order.payment);
            let refund = NewRefund {
                payment_id: payment.id,
                amount_minor: order.amount_minor,
                currency: &payment.currency,
                debtor_account: &payment.debtor_account,
                creditor_account: &payment.creditor_account,
                reason: order.reason.as_deref(),
            };
            let (request, fence) = (cx.request, cx.fence);
            refunds::insert(cx.writes(), request, &refund, fence);
            self.transfer(cx, "hold", &self.creditor_account(), &self.hold_account());
            Ok(None)
        } else if *point == RecoveryPoint::FINISHED {
            self.finish(cx).await.map(Some)
        } else {
            Err(EngineError::Fault(format!("the refund has no local step {point}")))
        }
    }

    async fn declined(
        &self,
        _step: &ExternalStep,
        declined: &Declined,
        cx: &mut StepContext<'_>,
    ) -> Result<StoredResponse, EngineError> {
        let (id, fence) = (cx.request.payment_id, cx.fence);
        let refund =
            refunds::set_status(cx.conn().await?, id, "rejected", None, Some(&declined.reason_code), fence).await?;
        self.transfer(cx, "release", &self.hold_account(), &self.creditor_account());
        queue_event(cx, &refund, "refund.rejected")?;
        Ok(declined_answer(refund.id, declined))
    }

    async fn indeterminate(&self, _step: &ExternalStep, cx: &mut StepContext<'_>) -> Result<(), EngineError> {
        let (id, fence) = (cx.request.payment_id, cx.fence);
        match refunds::mark_indeterminate(cx.conn().await?, id, fence).await? {
            Some(refund) => queue_event(cx, &refund, "refund.indeterminate"),
            None => Ok(()),
        }
    }

    /// Money back from the payment's creditor to its debtor, naming the
    /// payment's own end-to-end reference, as a return of it does.
    fn instruction(&self, _step: &ExternalStep) -> Instruction {
        let payment = &self.order.payment;
        Instruction {
            originator: String::new(),
            end_to_end_id: payment.end_to_end_id.clone(),
            amount_minor: self.order.refund.amount_minor,
            currency: payment.currency.clone(),
            debtor_account: payment.creditor_account.clone(),
            creditor_account: payment.debtor_account.clone(),
        }
    }

    fn hold(&self) -> Option<Hold> {
        Some(Hold {
            balance: Self::balance_of(self.order.payment.id),
            total: self.order.payment.amount_minor,
            amount: self.order.refund.amount_minor,
            lasting: false,
        })
    }
}
