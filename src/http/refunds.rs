//! Refunds: `POST /v1/payments/{id}/refunds` (idempotent, like a payment),
//! `GET /v1/payments/{id}/refunds` and `GET /v1/refunds/{id}`. A refund is
//! worked in the region that claims it, whichever region holds its
//! payment; reads ask the other regions for what this one lacks, as for
//! payments ([`super::peers`]). What is left to refund is the payment's
//! balance in the key table to say, not any one region's.

use axum::Json;
use axum::body::Bytes;
use axum::extract::rejection::{BytesRejection, PathRejection};
use axum::extract::{Path, State};
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use uuid::Uuid;

use super::extract::{Caller, idempotency_key, json_body, profile};
use super::live::{self, Standing};
use super::payments::{locate, merged, respond, worked};
use super::peers::{Asker, check_target};
use super::signed::is_forwarded;
use super::{ApiError, AppState};
use crate::domain::{ClientId, RefundRequest, RequestHash, ScopedKey};
use crate::engine::{EngineError, Submission};
use crate::keystore::KeyItem;
use crate::operations::{RefundOperation, RefundOrder, RefundedPayment};

const REFUNDS: &str = "/v1/refunds";

pub async fn create(
    State(state): State<AppState>,
    Caller(client): Caller,
    headers: HeaderMap,
    id: Result<Path<String>, PathRejection>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let payment_id = payment_id(id)?;
    let key = idempotency_key(&headers)?;
    let value = json_body(&headers, body)?;
    let canonical = serde_jcs::to_vec(&value).map_err(|e| ApiError::MalformedJson(e.to_string()))?;
    // The path is part of the fingerprint: the same key and body for
    // another payment (or as a payment) is another request.
    let request_hash = RequestHash::of("POST", &format!("/v1/payments/{payment_id}/refunds"), &canonical);
    let refund = RefundRequest::parse(value).map_err(ApiError::InvalidRefund)?;
    let key = ScopedKey::new(client, key);
    let profile = profile(&state, client).await?;
    let (order, existing) = match order(&state, client, payment_id, refund).await {
        Ok(order) => (order, None),
        Err(refusal) => {
            let (order, item) = already_accepted(&state, &key, &request_hash).await?.ok_or(refusal)?;
            (order, Some(item))
        }
    };
    let running = state.throttle.start(&key, &profile).map_err(ApiError::Throttled)?;
    let stored = serde_jcs::to_vec(&order).map_err(ApiError::internal)?;
    let submission = Submission { key, request_hash, canonical: stored, operation: RefundOperation::new(order) };
    respond(worked(&state, submission, existing, running).await?, REFUNDS)
}

/// The refund as it will be worked: the request and what it needs of its
/// payment, which must be the caller's and must have succeeded (a payment
/// whose outcome is still unknown is never refunded).
async fn order(
    state: &AppState,
    client: ClientId,
    payment_id: Uuid,
    refund: RefundRequest,
) -> Result<RefundOrder, ApiError> {
    let payment = locate(state, client, payment_id, false).await?;
    let status = payment["status"].as_str().unwrap_or_default();
    if status != "succeeded" {
        return Err(ApiError::PaymentNotRefundable { status: status.to_owned() });
    }
    let payment: RefundedPayment = serde_json::from_value(json!({
        "id": payment["id"],
        "amount_minor": payment["amount_minor"],
        "currency": payment["currency"],
        "debtor_account": payment["debtor_account"],
        "creditor_account": payment["creditor_account"],
        "end_to_end_id": payment["end_to_end_id"],
    }))
    .map_err(|e| ApiError::from(EngineError::record(format!("payment {payment_id} as shown"), e)))?;
    if payment.id != payment_id {
        return Err(ApiError::internal(format!("asked for payment {payment_id}, shown {}", payment.id)));
    }
    if refund.amount_minor > payment.amount_minor {
        return Err(ApiError::RefundExceedsPayment { left: payment.amount_minor });
    }
    Ok(RefundOrder { refund, payment })
}

/// A refund already accepted under this key, worked as it was accepted
/// (replayed, in flight, resumed) whatever its payment shows now, and then
/// only through that claim (the item, for [`worked`]): a key expiring in
/// between is never claimed afresh by a refund nobody checked. Only a
/// refusal costs this key-store read. Another request under the key is 422.
async fn already_accepted(
    state: &AppState,
    key: &ScopedKey,
    request_hash: &RequestHash,
) -> Result<Option<(RefundOrder, KeyItem)>, ApiError> {
    let Some(item) = state.engine.live_item(key).await? else {
        return Ok(None);
    };
    if item.request_hash != *request_hash || item.operation != RefundOperation::NAME {
        return Err(ApiError::KeyReused);
    }
    let order = serde_json::from_slice(&item.request).map_err(|e| EngineError::record("a stored refund request", e))?;
    Ok(Some((order, item)))
}

pub async fn show(
    State(state): State<AppState>,
    Caller(client): Caller,
    headers: HeaderMap,
    id: Result<Path<String>, PathRejection>,
) -> Result<Response, ApiError> {
    check_target(&headers, state.engine.region())?;
    let id = id.ok().and_then(|Path(id)| Uuid::parse_str(&id).ok()).ok_or(ApiError::NotFound)?;
    let local = state.engine.ledger().refund_of(client, id).await.map_err(EngineError::from)?;
    let here = local.as_ref().map(|held| (&held.refund, held.into()));
    Ok(Json(live::copy_of(&state, client, REFUNDS, id, here, is_forwarded(&headers)).await?).into_response())
}

/// The refunds of one payment, from every region, oldest first.
pub async fn list(
    State(state): State<AppState>,
    Caller(client): Caller,
    headers: HeaderMap,
    id: Result<Path<String>, PathRejection>,
) -> Result<Response, ApiError> {
    check_target(&headers, state.engine.region())?;
    let payment_id = payment_id(id)?;
    let forwarded = is_forwarded(&headers);
    // Asked by another region, this one lists what it holds, payment or not.
    if !forwarded {
        locate(&state, client, payment_id, false).await?;
    }
    let held = state.engine.ledger().refunds_of_payment(client, payment_id).await.map_err(EngineError::from)?;
    let (mut live, mut leftovers) = (Vec::new(), Vec::new());
    for held in &held {
        match live::judge(&state.engine, client, held.into()).await? {
            Standing::Live => live.push(serde_json::to_value(&held.refund).map_err(ApiError::internal)?),
            Standing::Leftover { .. } => leftovers.push(held.refund.id.to_string()),
        }
    }
    if forwarded {
        return Ok(Json(json!({ "data": live })).into_response());
    }
    let registry = state.engine.regions().current().await;
    let asker = Asker { me: state.engine.region(), client };
    let path = format!("/v1/payments/{payment_id}/refunds");
    let id = payment_id.to_string();
    let wanted = |r: &Value| r["payment_id"].as_str() == Some(id.as_str());
    live.extend(state.peers.listing(&registry, asker, &path, &[], wanted).await.map_err(ApiError::PeersUnreachable)?);
    let merged = merged(live);
    if leftovers.iter().any(|id| !merged.iter().any(|r| r["id"].as_str() == Some(id))) {
        return Err(ApiError::PaymentMoving);
    }
    Ok(Json(json!({ "data": merged })).into_response())
}

/// The payment named by the path; not a UUID, no payment has that id.
fn payment_id(id: Result<Path<String>, PathRejection>) -> Result<Uuid, ApiError> {
    id.ok().and_then(|Path(id)| Uuid::parse_str(&id).ok()).ok_or(ApiError::NotFound)
}
