//! `/v1/payments`: create a payment (the idempotent POST) and read the
//! caller's payments. Reads are scoped to the caller: another client's
//! payment is simply not found. A payment worked in another region is
//! fetched from that region ([`super::peers`]).

use axum::Json;
use axum::body::Bytes;
use axum::extract::rejection::{BytesRejection, PathRejection, QueryRejection};
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{Value, json};
use tracing::Instrument as _;
use uuid::Uuid;

use super::extract::{Caller, idempotency_key, json_body, profile};
use super::live::{self, Standing};
use super::peers::{Asker, check_target};
use super::signed::is_forwarded;
use super::throttle::Running;
use super::{ApiError, AppState};
use crate::clients::Refusal;
use crate::domain::ClientId;
use crate::domain::{PaymentRequest, RequestHash, ScopedKey, is_reference};
use crate::engine::{Answer, Cause, EngineError, Operation, Submission};
use crate::keystore::{KeyItem, KeyStore};
use crate::operations::{PaymentOperation, RefundOperation};

const PATH: &str = "/v1/payments";

pub async fn create(
    State(state): State<AppState>,
    Caller(client): Caller,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let key = idempotency_key(&headers)?;
    let value = json_body(&headers, body)?;
    let canonical = serde_jcs::to_vec(&value).map_err(|e| ApiError::MalformedJson(e.to_string()))?;
    let request_hash = RequestHash::of("POST", PATH, &canonical);
    let payment = PaymentRequest::parse(value).map_err(ApiError::InvalidFields)?;
    let key = ScopedKey::new(client, key);
    let profile = profile(&state, client).await?;
    let accepted = accepted_despite(&state, &key, profile.permits(&payment)).await?;
    let running = state.throttle.start(&key, &profile).map_err(ApiError::Throttled)?;
    // The request is kept in its normal form (accounts upper case, no
    // spaces), so a resume works on exactly what the first phase wrote;
    // the fingerprint stays that of the bytes the client sent.
    let stored = serde_jcs::to_vec(&payment).map_err(ApiError::internal)?;
    let submission = Submission { key, request_hash, canonical: stored, operation: PaymentOperation::new(payment) };
    respond(worked(&state, submission, accepted, running).await?, PATH)
}

/// Works `submission` on a task of its own: a client that gives up waiting
/// (or goes away) does not cut its request off halfway, which would leave
/// the key leased to nobody until the lease runs out. `running` counts it
/// against the caller's fair use until it ends. With `existing`, the
/// request is worked only as that claim accepted it, never claimed anew
/// (see [`accepted_despite`]).
pub(super) async fn worked<O: Operation + 'static>(
    state: &AppState,
    submission: Submission<O>,
    existing: Option<KeyItem>,
    running: Running,
) -> Result<Answer, ApiError> {
    let engine = state.engine.clone();
    let work = tokio::spawn(
        async move {
            let answer = match existing {
                None => engine.submit(submission).await,
                Some(item) => engine.submit_to_existing(submission, &item).await,
            };
            drop(running);
            answer
        }
        .in_current_span(),
    );
    Ok(work.await.map_err(|e| EngineError::Broken(Cause::Task(e)))??)
}

/// A new payment the caller may not make (an account it does not hold,
/// over one of its limits) is refused without a claim: no stored answer,
/// so the same key pays once the account is added or the limit raised.
/// A key already claimed is worked as it was accepted (replayed, in flight,
/// or refused as reused) whatever the caller's profile says now, and then
/// only through that claim (`Some(item)`, for [`worked`]): were the request
/// to claim, a key expiring in between would be claimed afresh by a
/// payment nobody checked. Only a refusal costs this one key-store read.
async fn accepted_despite(
    state: &AppState,
    key: &ScopedKey,
    check: Result<(), Refusal>,
) -> Result<Option<KeyItem>, ApiError> {
    let Err(refusal) = check else { return Ok(None) };
    match state.engine.live_item(key).await? {
        Some(item) => Ok(Some(item)),
        None => Err(match refusal {
            Refusal::AccountNotPermitted => ApiError::AccountNotPermitted,
            Refusal::OverLimit { limit, detail } => ApiError::OverLimit { limit, detail },
        }),
    }
}

/// Turns the engine's answer into HTTP: a final answer exactly as stored;
/// a pending one names where to look (`collection`/{id}).
pub(super) fn respond(answer: Answer, collection: &str) -> Result<Response, ApiError> {
    match answer {
        Answer::Final { response, replayed } => {
            let status = StatusCode::from_u16(response.status).map_err(ApiError::internal)?;
            let mut reply = (status, response.body).into_response();
            for (name, value) in &response.headers {
                let name = HeaderName::try_from(name.as_str()).map_err(ApiError::internal)?;
                let value = HeaderValue::try_from(value.as_str()).map_err(ApiError::internal)?;
                reply.headers_mut().insert(name, value);
            }
            if replayed {
                reply.headers_mut().insert("idempotent-replayed", HeaderValue::from_static("true"));
            }
            Ok(reply)
        }
        Answer::Pending { payment_id } => {
            let body = json!({ "id": payment_id, "status": "pending" });
            let location = format!("{collection}/{payment_id}");
            Ok((StatusCode::ACCEPTED, [(header::LOCATION, location)], Json(body)).into_response())
        }
        Answer::InFlight { retry_after } => Err(ApiError::InFlight { retry_after }),
        Answer::Mismatch => Err(ApiError::KeyReused),
        Answer::Exceeded { left } => Err(ApiError::RefundExceedsPayment { left }),
    }
}

pub async fn show(
    State(state): State<AppState>,
    Caller(client): Caller,
    headers: HeaderMap,
    id: Result<Path<String>, PathRejection>,
) -> Result<Response, ApiError> {
    check_target(&headers, state.engine.region())?;
    // Not a UUID (or not even UTF-8): no payment has that id.
    let id = id.ok().and_then(|Path(id)| Uuid::parse_str(&id).ok()).ok_or(ApiError::NotFound)?;
    let mut payment = locate(&state, client, id, is_forwarded(&headers)).await?;
    // Another region asking adds this itself (it reads the same key table).
    if !is_forwarded(&headers) {
        let balance = RefundOperation::balance_of(id);
        let refunded = state.engine.keys().balance(&balance).await.map_err(EngineError::from)?;
        payment["amount_refunded"] = refunded.map_or(0, |b| b.settled).into();
    }
    Ok(Json(payment).into_response())
}

/// The live copy of the client's payment `id`: from this region's ledger,
/// or from the region that holds it. Asked by another region
/// (`forwarded`), only this region's own live copy counts.
pub(super) async fn locate(state: &AppState, client: ClientId, id: Uuid, forwarded: bool) -> Result<Value, ApiError> {
    let local = state.engine.ledger().payment_of(client, id).await.map_err(EngineError::from)?;
    let here = local.as_ref().map(|held| (&held.payment, held.into()));
    live::copy_of(state, client, PATH, id, here, forwarded).await
}

#[derive(Deserialize)]
pub struct ByReference {
    end_to_end_id: Option<String>,
}

pub async fn by_reference(
    State(state): State<AppState>,
    Caller(client): Caller,
    headers: HeaderMap,
    query: Result<Query<ByReference>, QueryRejection>,
) -> Result<Response, ApiError> {
    check_target(&headers, state.engine.region())?;
    let Query(query) = query.map_err(|rejection| ApiError::InvalidQuery(rejection.body_text()))?;
    let reference = query.end_to_end_id.ok_or(ApiError::MissingQuery("end_to_end_id"))?;
    if !is_reference(&reference) {
        return Err(ApiError::InvalidQuery(
            "end_to_end_id must be 1-35 characters without control characters (ISO 20022 Max35Text)".into(),
        ));
    }
    let local = state.engine.ledger().payments_by_reference(client, &reference).await.map_err(EngineError::from)?;
    let (mut live, mut leftovers) = (Vec::new(), Vec::new());
    for held in local {
        match live::judge(&state.engine, client, (&held).into()).await? {
            Standing::Live => live.push(serde_json::to_value(&held.payment).map_err(ApiError::internal)?),
            Standing::Leftover { .. } => leftovers.push(held.payment.id.to_string()),
        }
    }
    // Another region asking gets live copies only.
    if is_forwarded(&headers) {
        return Ok(Json(json!({ "data": live })).into_response());
    }
    let registry = state.engine.regions().current().await;
    let asker = Asker { me: state.engine.region(), client };
    let query = [("end_to_end_id", reference.as_str())];
    let wanted = |p: &Value| p["end_to_end_id"].as_str() == Some(reference.as_str());
    let theirs = state.peers.listing(&registry, asker, PATH, &query, wanted).await;
    live.extend(theirs.map_err(ApiError::PeersUnreachable)?);
    let merged = merged(live);
    // A payment this region holds only a leftover of, and nobody shows live
    // yet, is moving: no listing without it.
    if leftovers.iter().any(|id| !merged.iter().any(|p| p["id"].as_str() == Some(id))) {
        return Err(ApiError::PaymentMoving);
    }
    Ok(Json(json!({ "data": merged })).into_response())
}

/// One entry per payment, oldest first, at most 100 (every region answers
/// with its live copies only, so each is the live one).
pub(super) fn merged(live: Vec<Value>) -> Vec<Value> {
    let mut by_id: std::collections::BTreeMap<String, Value> = std::collections::BTreeMap::new();
    for payment in live {
        let id = payment["id"].as_str().unwrap_or_default().to_owned();
        by_id.entry(id).or_insert(payment);
    }
    let mut all: Vec<Value> = by_id.into_values().collect();
    all.sort_by_cached_key(|shown| (created(shown), shown["id"].as_str().map(str::to_owned)));
    all.truncate(100);
    all
}

/// When a shown payment or refund was created, as a time: RFC 3339 leaves
/// out a fraction's trailing zeros, so the text does not sort as the time
/// does (`05.12Z` is before `05.123Z`).
fn created(shown: &Value) -> Option<time::OffsetDateTime> {
    let at = shown["created_at"].as_str()?;
    time::OffsetDateTime::parse(at, &time::format_description::well_known::Rfc3339).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn payments_from_several_regions_are_listed_in_the_order_they_were_made() {
        let shown = |id: &str, at: &str| json!({ "id": id, "created_at": at });
        let listed = merged(vec![
            shown("a", "2026-12-03T22:00:05.123Z"),
            shown("b", "2026-12-03T22:00:05.12Z"),
            shown("c", "2026-12-03T22:00:05Z"),
            shown("d", "2026-12-03T22:00:04.9Z"),
            shown("b", "2026-12-03T22:00:05.12Z"),
        ]);
        let ids: Vec<&str> = listed.iter().map(|p| p["id"].as_str().unwrap()).collect();
        assert_eq!(ids, ["d", "c", "b", "a"]);
    }
}
