//! The inbox: what the rails tell keyfence after the fact, each message
//! taken in once. A rail posts a signed notification (the Standard Webhooks
//! way, with the secret keyfence holds for it) of every verdict it reaches
//! and of returns it decides later; `POST /v1/rail-events/{rail}` checks
//! the signature, and [`take`] records the message by its id (seen again,
//! it is acknowledged and dropped) and sets its effect going:
//! - a verdict for an instruction in flight is applied only through the
//!   protocol: whoever next settles the external step (its owner, or a
//!   takeover started here) reads the verdict from the inbox instead of
//!   probing, and the phase that records the outcome marks the message
//!   applied in the same transaction;
//! - a return of a settled payment is applied in a phase of its own
//!   ([`apply_return`]): compensating entries, the payment `returned`,
//!   `payment.returned` queued, the message marked applied, all at once; a
//!   return that arrives before its payment has settled waits for it; a
//!   return first freezes the payment's refundable balance (no refund
//!   begins after it, whatever becomes of the return), then holds the whole
//!   payment on it; one of a payment with refunds (made or in flight) is
//!   kept for a person instead;
//! - a return of a refund (its money never reached the debtor) undoes the
//!   refund's hold on its payment's balance, then marks it `returned` with
//!   a compensating entry and queues `refund.returned`;
//! - a return of a request that moved to another region is kept for a
//!   person, whether its key still says so, only a hand-off does, or this
//!   ledger voided its copy already; its payment's balance is frozen first
//!   all the same;
//! - a message this region cannot take (no instruction of its ledger has
//!   its key, this ledger holds a leftover, or the request moved to another
//!   region) is handed to the region that holds the live copy ([`hand`]):
//!   a rail notifies one URL, not one per region. Only a message no region
//!   takes is kept (state `unknown`) for the reconciler, as is every
//!   message when no other region is known.
//!
//! [`worker`] retries what waits: returns whose payment has settled since,
//! verdicts whose request no owner is working, and messages to hand on.

pub mod hand;
pub mod worker;

use std::sync::Arc;

use sqlx::{Postgres, Transaction};

use crate::engine::{Engine, EngineError};
use crate::keystore::{Concluded, Conclusion, Frozen, HeldBy, Holding, KeyState, KeyStore};
use crate::ledger::inbox::{
    Arrival, HandOnEnd, InFlight, LEFTOVER, Message, PendingReturn, Signed, hand_on_later, settle_message,
};
use crate::ledger::{LedgerError, payments, refunds};
use crate::operations::{
    RefundOperation, Registered, ReturnEffect, apply_refund_return, apply_return as apply_payment_return,
    refund_returnable,
};
use crate::rail::{Notice, Returned};

/// The message in `signed`, signed as `id`; an error says what is wrong.
pub fn parse(rail: &str, id: &str, signed: Signed) -> Result<Message, String> {
    let notice: Notice = serde_json::from_slice(&signed.raw).map_err(|e| format!("not a rail notification: {e}"))?;
    let (own_id, kind, key, inner) = match notice {
        Notice::Applied { id, applied } => {
            if !applied.fits() {
                return Err(too_long());
            }
            let key = applied.idempotency_key.clone();
            (id, "applied", key, serde_json::to_value(applied))
        }
        Notice::Declined { id, declined } => {
            if !declined.fits() {
                return Err(too_long());
            }
            let key = declined.idempotency_key.clone();
            (id, "declined", key, serde_json::to_value(declined))
        }
        Notice::Returned { id, returned } => {
            let key = returned.idempotency_key.clone();
            (id, "returned", key, serde_json::to_value(returned))
        }
    };
    if own_id != id {
        return Err("the notification's id is not the one it was signed as".into());
    }
    if id.is_empty() || id.len() > 200 {
        return Err("a notification id is 1 to 200 characters".into());
    }
    Ok(Message {
        rail: rail.to_owned(),
        id: own_id,
        kind,
        // Only the form keyfence sends (32 hex digits) names an instruction.
        derived_key: uuid::Uuid::try_parse(&key).ok().filter(|k| k.simple().to_string() == key),
        body: inner.map_err(|e| e.to_string())?,
        signed,
        handed_from: None,
    })
}

fn too_long() -> String {
    format!("a reference, reason or time is over {} characters", crate::rail::MAX_RAIL_TEXT)
}

/// Takes `message` in: recorded once, and its effect set going.
pub async fn take<K: KeyStore + 'static>(engine: &Arc<Engine<K>>, message: &Message) -> Result<Arrival, LedgerError> {
    let mut arrival = engine.ledger().receive(message, message.handed_from.is_none()).await?;
    if let Arrival::Forwarding(why) = arrival
        && !hand::others_known(engine).await
    {
        // No other region to hand it to: kept for a person at once.
        engine.ledger().hand_on_ended(&message.rail, &message.id, HandOnEnd::Kept(why)).await?;
        arrival = Arrival::Unknown(why);
    }
    metrics::counter!("keyfence_rail_notifications_total", "kind" => message.kind, "arrival" => arrival.label())
        .increment(1);
    match &arrival {
        Arrival::Pending(in_flight) if message.kind == "returned" => {
            let pending = PendingReturn {
                rail: message.rail.clone(),
                message_id: message.id.clone(),
                key: in_flight.key.clone(),
                created_at: in_flight.created_at,
                body: message.body.clone(),
                payment_id: in_flight.payment_id,
                may_hand_on: message.handed_from.is_none() && !message.signed.raw.is_empty(),
            };
            let engine = engine.clone();
            tokio::spawn(async move {
                if let Err(e) = apply_return(&engine, &pending).await {
                    tracing::warn!(id = pending.message_id, error = %e, "could not apply a return yet; the inbox worker will");
                }
            });
        }
        Arrival::Pending(in_flight) => {
            let (engine, in_flight) = (engine.clone(), in_flight.clone());
            tokio::spawn(async move { resume(&engine, &in_flight).await });
        }
        Arrival::Unknown(why) => {
            tracing::warn!(rail = %message.rail, id = %message.id, why, "a rail notification cannot take effect here; kept for the reconciler");
        }
        Arrival::Forwarding(why) => {
            tracing::info!(rail = %message.rail, id = %message.id, why, "a rail notification to hand to another region");
        }
        Arrival::Conflicting => {
            tracing::warn!(rail = %message.rail, id = %message.id, "a rail sent another message under an id it used before; dropped");
        }
        Arrival::Duplicate | Arrival::Ignored => {}
    }
    Ok(arrival)
}

/// Takes in `message`, handed here by another region, if this region
/// holds its live copy (the instruction is in its ledger, not voided, and
/// the request did not move away); `None` if not, with nothing recorded.
pub async fn take_handed<K: KeyStore + 'static>(
    engine: &Arc<Engine<K>>,
    message: &Message,
) -> Result<Option<Arrival>, EngineError> {
    let Some(request) = engine.ledger().live_request_of(message).await? else { return Ok(None) };
    if engine.moved_away(&request.key, request.created_at).await?.is_some() {
        return Ok(None);
    }
    // Received here first, while this region held no live copy, and
    // waiting to be handed on: it is this region's to take now.
    if let Some(arrival) = engine.ledger().take_back(message).await? {
        return Ok(Some(arrival));
    }
    Ok(Some(take(engine, message).await?))
}

/// Resumes the request a verdict arrived for, if nobody is working it (an
/// owner that is reads the verdict when it next settles the step). A
/// request that moved to another region is not resumed here: its verdicts
/// are handed on.
pub async fn resume<K: KeyStore>(engine: &Engine<K>, in_flight: &InFlight) {
    match engine.moved_away(&in_flight.key, in_flight.created_at).await {
        Ok(None) => {}
        Ok(Some(_)) => {
            if hand::others_known(engine).await
                && let Err(e) = engine.ledger().hand_on_verdicts(in_flight, MOVED).await
            {
                tracing::warn!(key = %in_flight.key, error = %e, "could not hand on a moved request's verdicts");
            }
            return;
        }
        Err(e) => {
            tracing::warn!(key = %in_flight.key, error = %e, "could not read a notified request's key");
            return;
        }
    }
    let item = match engine.keys().get(&in_flight.key).await {
        Ok(Some(item)) => item,
        Ok(None) => return,
        Err(e) => {
            tracing::warn!(key = %in_flight.key, error = %e, "could not read a notified request's key");
            return;
        }
    };
    if item.state != KeyState::Started
        || item.created_at != in_flight.created_at
        || item.lease_until > engine.clock().now()
    {
        return;
    }
    if let Err(e) = engine.recover(&item.stale(), Registered::decode).await {
        tracing::warn!(key = %in_flight.key, error = %e, "could not resume a notified request");
    }
}

/// Applies one waiting return, in a phase of its own.
pub async fn apply_return<K: KeyStore>(engine: &Engine<K>, pending: &PendingReturn) -> Result<(), EngineError> {
    let returned: Returned =
        serde_json::from_value(pending.body.clone()).map_err(|e| EngineError::record("a stored return", e))?;
    let Some(mut tx) = engine.ledger().begin_return(pending).await? else { return Ok(()) };
    let effect = match refunds::current(&mut tx, pending.payment_id).await? {
        Some(refund) => return_refund(engine, pending, &mut tx, &refund, &returned).await?,
        None => return_payment(engine, pending, &mut tx, &returned).await?,
    };
    let what = if effect.refund { "refund" } else { "payment" };
    let (state, note) = match effect.effect {
        ReturnEffect::Returned => ("applied", None),
        ReturnEffect::NotYetSettled => return Ok(()),
        ReturnEffect::AlreadyReturned => ("ignored", Some("it was returned already")),
        ReturnEffect::Unmatched(why) => ("unknown", Some(why)),
    };
    let elsewhere = [LEFTOVER, MOVED].contains(&note.unwrap_or_default());
    if state == "unknown" && elsewhere && pending.may_hand_on && hand::others_known(engine).await {
        hand_on_later(&mut tx, &pending.rail, &pending.message_id, note.unwrap_or_default()).await?;
        tx.commit().await.map_err(LedgerError::from)?;
        tracing::info!(message = pending.message_id, id = %pending.payment_id, what, "a return to hand to another region");
        return Ok(());
    }
    settle_message(&mut tx, &pending.rail, &pending.message_id, state, note).await?;
    tx.commit().await.map_err(LedgerError::from)?;
    match effect.effect {
        ReturnEffect::Returned => {
            metrics::counter!("keyfence_returns_total", "of" => what).increment(1);
            tracing::info!(id = %pending.payment_id, what, reason = returned.reason_code, "returned by the rail");
        }
        ReturnEffect::Unmatched(why) => {
            tracing::warn!(message = pending.message_id, id = %pending.payment_id, what, why, "a return kept for a person");
        }
        _ => {}
    }
    Ok(())
}

/// What a return came to, and whether it was of a refund.
struct Taken {
    effect: ReturnEffect,
    refund: bool,
}

/// A payment's return. From the moment a return is received no new refund
/// of the payment begins, whatever becomes of the return: the balance is
/// frozen first, before anything is settled in the ledger (a retry freezes
/// it again, harmlessly), so a crash in between leaves it frozen and the
/// message pending, to be applied again. Then the return holds the whole
/// payment, for good, on the same balance refunds hold on, so money
/// refunded (or held for a refund in flight) never goes back twice: one
/// that overlaps refunds is kept for a person.
async fn return_payment<K: KeyStore>(
    engine: &Engine<K>,
    pending: &PendingReturn,
    tx: &mut Transaction<'static, Postgres>,
    returned: &Returned,
) -> Result<Taken, EngineError> {
    let taken = |effect| Ok(Taken { effect, refund: false });
    let paid = payments::current(tx, pending.payment_id).await?;
    let frozen =
        Frozen { by: format!("return {} from {}", pending.message_id, pending.rail), at: engine.clock().now() };
    engine.keys().freeze(&RefundOperation::balance_of(pending.payment_id), paid.amount_minor, &frozen).await?;
    if paid.status == "voided" {
        return taken(ReturnEffect::Unmatched(LEFTOVER));
    }
    if engine.moved_away(&pending.key, pending.created_at).await?.is_some() {
        return taken(ReturnEffect::Unmatched(MOVED));
    }
    let hold = RefundOperation::hold_for_return(pending.payment_id, paid.amount_minor);
    let by = HeldBy {
        id: RefundOperation::return_hold_id(pending.payment_id),
        key: pending.key.clone(),
        created_at: pending.created_at,
        region: engine.region().to_owned(),
    };
    if let Holding::Exceeded { .. } = engine.keys().hold(&hold, &by, engine.clock().now()).await? {
        return taken(ReturnEffect::Unmatched(
            "the payment has refunds, made or in flight: the return overlaps them; settle it with the rail",
        ));
    }
    taken(apply_payment_return(tx, pending.payment_id, returned).await?)
}

/// A refund's return: its money never reached the debtor. The refund's
/// hold on its payment's balance is undone first (what is left to refund
/// grows by its amount), before anything is settled in the ledger (a retry
/// finds it undone and goes on), then the refund is marked returned.
async fn return_refund<K: KeyStore>(
    engine: &Engine<K>,
    pending: &PendingReturn,
    tx: &mut Transaction<'static, Postgres>,
    refund: &refunds::Standing,
    returned: &Returned,
) -> Result<Taken, EngineError> {
    let taken = |effect| Ok(Taken { effect, refund: true });
    if engine.moved_away(&pending.key, pending.created_at).await?.is_some() {
        return taken(ReturnEffect::Unmatched(MOVED));
    }
    if let Err(effect) = refund_returnable(refund, returned) {
        return taken(effect);
    }
    let balance = RefundOperation::balance_of(refund.refund.payment_id);
    if engine.keys().conclude_hold(&balance, refund.refund.id, Conclusion::Undo).await? == Concluded::Missing {
        tracing::warn!(refund = %refund.refund.id, balance, "a returned refund had no hold to undo");
    }
    apply_refund_return(tx, refund, returned).await?;
    taken(ReturnEffect::Returned)
}

/// Why a return of a request that moved away is kept.
const MOVED: &str = "its live copy is in another region, which must take the return";

impl Arrival {
    fn label(&self) -> &'static str {
        match self {
            Self::Duplicate => "duplicate",
            Self::Conflicting => "conflicting",
            Self::Pending(_) => "pending",
            Self::Ignored => "ignored",
            Self::Unknown(_) => "unknown",
            Self::Forwarding(_) => "forwarding",
        }
    }
}
