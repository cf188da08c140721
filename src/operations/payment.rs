//! The payment operation. Its steps and what each commits:
//! - `H1_DONE`: the payment row (pending) and a hold on the debtor's funds;
//! - `EXT1_SENT` / `EXT1_DONE`: screening at E1;
//! - `H2_DONE`: the held funds move to clearing for the rail;
//! - `EXT2_SENT` / `EXT2_DONE`: the instruction at E2, the payment rail;
//! - `FINISHED`: clearing settles to the creditor, the payment succeeds, a
//!   webhook event (`payment.succeeded`) is queued, and the 201 answer is built.
//!
//! If screening rejects it or the rail declines it, the phase that records
//! the refusal moves the funds back to the debtor from wherever they wait
//! (the hold, or clearing), marks the payment `rejected` with the reason,
//! queues `payment.rejected`, and builds the final answer: 402 problem+json.
//! A payment whose outcome at a system stays unknown so long it is listed
//! for settlement is marked `indeterminate` and queues
//! `payment.indeterminate` (and, once settled, one of the two above).
//!
//! Every entry posts two legs that cancel, so each payment's postings sum
//! to zero.

use std::collections::BTreeMap;

use crate::domain::{PaymentRequest, RecoveryPoint, StoredResponse};
use crate::ledger::payments::{self, Leg, Payment};
use crate::ledger::writes::Writes;
use crate::rail::{Declined, Instruction};
use crate::webhooks;

use super::{PAYMENT_RAIL, SCREENING};
use crate::engine::{EngineError, ExternalStep, Operation, Step, StepContext};

const H1_DONE: RecoveryPoint = RecoveryPoint::named("H1_DONE");
const H2_DONE: RecoveryPoint = RecoveryPoint::named("H2_DONE");

static STEPS: [Step; 5] = [
    Step::Local(H1_DONE),
    Step::External(ExternalStep {
        name: "ext1",
        rail: SCREENING,
        sent: RecoveryPoint::named("EXT1_SENT"),
        done: RecoveryPoint::named("EXT1_DONE"),
    }),
    Step::Local(H2_DONE),
    Step::External(ExternalStep {
        name: "ext2",
        rail: PAYMENT_RAIL,
        sent: RecoveryPoint::named("EXT2_SENT"),
        done: RecoveryPoint::named("EXT2_DONE"),
    }),
    Step::Local(RecoveryPoint::FINISHED),
];

/// The account the payment rail settles through.
const CLEARING: &str = "clearing:rail";

pub struct PaymentOperation {
    payment: PaymentRequest,
}

impl PaymentOperation {
    pub const NAME: &'static str = "payment";

    pub fn new(payment: PaymentRequest) -> Self {
        Self { payment }
    }

    /// Rebuilds the operation from the canonical request kept with the key.
    pub fn from_canonical(request: &[u8]) -> Result<Self, EngineError> {
        // Validated (and put in normal form) when it was accepted, under the
        // rules of that day: a resume must work it exactly as it began, not
        // refuse it (or rename its accounts) under newer ones.
        let payment: PaymentRequest =
            serde_json::from_slice(request).map_err(|e| EngineError::record("a stored payment request", e))?;
        Ok(Self::new(payment))
    }

    /// Moves the amount from one account to another as one balanced entry.
    fn transfer(&self, cx: &mut StepContext<'_>, entry: &str, from: &str, to: &str) {
        let amount = self.payment.amount_minor;
        let legs = [Leg { account: from, amount_minor: -amount }, Leg { account: to, amount_minor: amount }];
        let (id, fence) = (cx.request.payment_id, cx.fence);
        payments::post(cx.writes(), id, entry, &self.payment.currency, &legs, fence);
    }

    fn hold_account(&self) -> String {
        format!("hold:{}", self.payment.debtor_account)
    }

    fn debtor_account(&self) -> String {
        format!("debtor:{}", self.payment.debtor_account)
    }

    /// Where the funds wait while `step` is asked: the hold before screening,
    /// clearing before the rail.
    fn funds_awaiting(&self, step: &ExternalStep) -> String {
        if step.rail == SCREENING { self.hold_account() } else { CLEARING.to_owned() }
    }

    async fn finish(&self, cx: &mut StepContext<'_>) -> Result<StoredResponse, EngineError> {
        let rail = cx.applied("ext2").await?;
        let (request, fence) = (cx.request, cx.fence);
        let payment = payments::succeed(cx.writes(), request, &self.payment, &rail.reference, fence);
        self.transfer(cx, "settle", CLEARING, &format!("creditor:{}", self.payment.creditor_account));
        let body = serde_json::to_vec(&payment).map_err(|e| EngineError::record("a payment's answer", e))?;
        queue_event(cx, &payment, "payment.succeeded")?;
        Ok(StoredResponse {
            status: 201,
            headers: BTreeMap::from([
                ("content-type".to_owned(), "application/json".to_owned()),
                ("location".to_owned(), format!("/v1/payments/{}", payment.id)),
            ]),
            body,
        })
    }
}

/// What a rail's return of a payment did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReturnEffect {
    /// Posted: the payment is `returned`, and `payment.returned` queued.
    Returned,
    /// The payment has not settled yet: the return waits for it.
    NotYetSettled,
    /// The payment was returned already: nothing to do.
    AlreadyReturned,
    /// It cannot take effect here, and why (for the reconciler).
    Unmatched(&'static str),
}

/// Applies the rail's return of payment `payment_id`, inside the phase
/// that takes it (the return checked against the payment: its reference,
/// amount and currency): the settled
/// amount moves back from the creditor to the debtor in one balanced
/// entry, the payment is marked `returned` with the reason code, and
/// `payment.returned` is queued. A return is taken once: a payment
/// returned already is left as it is.
pub async fn apply_return(
    conn: &mut sqlx::PgConnection,
    payment_id: uuid::Uuid,
    returned: &crate::rail::Returned,
) -> Result<ReturnEffect, EngineError> {
    let payment = payments::current(conn, payment_id).await?;
    match payment.status.as_str() {
        "succeeded" => {}
        "pending" | "indeterminate" => return Ok(ReturnEffect::NotYetSettled),
        "returned" => return Ok(ReturnEffect::AlreadyReturned),
        "voided" => return Ok(ReturnEffect::Unmatched("this ledger holds a leftover of the payment")),
        _ => return Ok(ReturnEffect::Unmatched("the payment did not settle, yet the rail returned it")),
    }
    if payment.end_to_end_id != returned.end_to_end_id
        || payment.amount_minor != returned.amount_minor
        || payment.currency != returned.currency
    {
        return Ok(ReturnEffect::Unmatched("the return is not of what the payment settled"));
    }
    let (amount_minor, currency) = (returned.amount_minor, returned.currency.as_str());
    let (payment, client, fence) = payments::mark_returned(conn, payment_id, &returned.reason_code).await?;
    let legs = [
        Leg { account: &format!("creditor:{}", payment.creditor_account), amount_minor: -amount_minor },
        Leg { account: &format!("debtor:{}", payment.debtor_account), amount_minor },
    ];
    let mut writes = Writes::default();
    payments::post(&mut writes, payment_id, "return", currency, &legs, fence);
    queue(&mut writes, client, &payment, "payment.returned")?;
    writes.send(conn).await?;
    Ok(ReturnEffect::Returned)
}

/// Queues webhook event `event` about `payment`, in the phase that causes
/// it: the payment as the API shows it, but with its account numbers
/// masked (the whole payment is one authenticated GET away).
fn queue_event(cx: &mut StepContext<'_>, payment: &Payment, event: &str) -> Result<(), EngineError> {
    let client = cx.request.key.client;
    queue(cx.writes(), client, payment, event)
}

fn queue(
    writes: &mut Writes,
    client: crate::domain::ClientId,
    payment: &Payment,
    event: &str,
) -> Result<(), EngineError> {
    let mut data = serde_json::to_value(payment).map_err(|e| EngineError::record("a payment event", e))?;
    data["debtor_account"] = webhooks::masked(&payment.debtor_account).into();
    data["creditor_account"] = webhooks::masked(&payment.creditor_account).into();
    if let Some(info) = data.as_object_mut() {
        info.remove("remittance_info");
    }
    webhooks::queue::event(writes, client, payment.id, event, &data);
    Ok(())
}

/// The final answer of a declined payment: RFC 9457 problem+json, with the
/// reason code and the payment's id so the client can look it up.
fn declined_answer(payment_id: uuid::Uuid, step: &ExternalStep, declined: &Declined) -> StoredResponse {
    let by = if step.rail == SCREENING { "screening" } else { "the payment rail" };
    let body = serde_json::json!({
        "type": "urn:keyfence:problem:payment-declined",
        "title": "Payment declined",
        "status": 402,
        "detail": format!("The payment was declined by {by}: {}.", declined.reason),
        "reason": declined.reason_code,
        "id": payment_id,
    });
    StoredResponse {
        status: 402,
        headers: BTreeMap::from([
            ("content-type".to_owned(), "application/problem+json".to_owned()),
            ("location".to_owned(), format!("/v1/payments/{payment_id}")),
        ]),
        body: body.to_string().into_bytes(),
    }
}

impl Operation for PaymentOperation {
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
        if *point == H1_DONE {
            let (request, fence) = (cx.request, cx.fence);
            payments::insert_payment(cx.writes(), request, &self.payment, fence);
            self.transfer(cx, "hold", &self.debtor_account(), &self.hold_account());
            Ok(None)
        } else if *point == H2_DONE {
            cx.applied("ext1").await?;
            self.transfer(cx, "clear", &self.hold_account(), CLEARING);
            Ok(None)
        } else if *point == RecoveryPoint::FINISHED {
            self.finish(cx).await.map(Some)
        } else {
            Err(EngineError::Fault(format!("the payment has no local step {point}")))
        }
    }

    async fn declined(
        &self,
        step: &ExternalStep,
        declined: &Declined,
        cx: &mut StepContext<'_>,
    ) -> Result<StoredResponse, EngineError> {
        let (id, fence) = (cx.request.payment_id, cx.fence);
        let payment = payments::reject(cx.conn().await?, id, &declined.reason_code, fence).await?;
        self.transfer(cx, "release", &self.funds_awaiting(step), &self.debtor_account());
        queue_event(cx, &payment, "payment.rejected")?;
        Ok(declined_answer(payment.id, step, declined))
    }

    async fn indeterminate(&self, _step: &ExternalStep, cx: &mut StepContext<'_>) -> Result<(), EngineError> {
        let (id, fence) = (cx.request.payment_id, cx.fence);
        match payments::mark_indeterminate(cx.conn().await?, id, fence).await? {
            Some(payment) => queue_event(cx, &payment, "payment.indeterminate"),
            None => Ok(()),
        }
    }

    fn instruction(&self, _step: &ExternalStep) -> Instruction {
        Instruction {
            originator: String::new(),
            end_to_end_id: self.payment.end_to_end_id.clone(),
            amount_minor: self.payment.amount_minor,
            currency: self.payment.currency.clone(),
            debtor_account: self.payment.debtor_account.clone(),
            creditor_account: self.payment.creditor_account.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A request is resumed as it was accepted: not checked again under
    /// rules added since (a stored account with wrong IBAN check digits, an
    /// account in lower case), and not renamed.
    #[test]
    fn a_stored_request_decodes_as_it_was_accepted() {
        let stored = br#"{"amount_minor":1250,"creditor_account":"FR1420041010050500013M02606","currency":"EUR","debtor_account":"de88370400440532013000","end_to_end_id":"OLD-1"}"#;
        let op = PaymentOperation::from_canonical(stored).unwrap();
        assert_eq!(op.payment.debtor_account, "de88370400440532013000");
        assert!(PaymentOperation::from_canonical(b"[1250]").is_err(), "still a payment, or nothing");
    }
}
