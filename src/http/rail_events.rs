//! `POST /v1/rail-events/{rail}`: a rail's notification of what it decided
//! after the fact. No API key: the rail signs each notification (Standard
//! Webhooks headers) with the secret keyfence holds for it, and anything
//! unsigned, signed otherwise, or signed more than five minutes ago is 401
//! (as is a rail keyfence holds no secret for). A region declared failed
//! takes nothing in (503): the rail sends it again, or to another region.
//! A message seen before is acknowledged again (and dropped): the rail may
//! stop sending it.
//!
//! Another region hands on here what it could not take ([`super::hand_on`]):
//! signed as that region, with the digest of the bytes in the signed
//! query. The rail's signature is checked all the same, at the time the
//! rail signed it (the region's signature is the fresh one). Such a message
//! is taken only if this region holds its live copy, else 404 and nothing
//! is recorded; another message under its id is 409.

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, RawQuery, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::json;

use super::extract::json_bytes;
use super::hand_on::{HANDED, digest};
use super::peers::check_target;
use super::signed::ForwardedFrom;
use super::{ApiError, AppState};
use crate::domain::webhook_signature as signature;
use crate::inbox;
use crate::ledger::inbox::{Arrival, Signed};

pub async fn receive(
    State(state): State<AppState>,
    Path(rail): Path<String>,
    RawQuery(query): RawQuery,
    handed_by: Option<axum::Extension<ForwardedFrom>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    // A rail keyfence does not know is not found; one it holds no secret
    // for is refused like a bad signature (no view of which are set up).
    if !matches!(rail.as_str(), "e1" | "e2") {
        return Err(ApiError::NotFound);
    }
    let secret = state.rail_secrets.get(&rail).ok_or(ApiError::Unauthenticated)?;
    let body = json_bytes(&headers, body)?;
    let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok()).unwrap_or_default();
    let (id, timestamp) = (header("webhook-id"), header("webhook-timestamp").parse::<i64>().unwrap_or(0));
    let handed_from = match handed_by {
        Some(axum::Extension(ForwardedFrom(from))) => {
            check_target(&headers, state.engine.region())?;
            // The region signed the digest of these very bytes.
            let named = query.as_deref().and_then(|q| q.strip_prefix(HANDED)).and_then(|q| q.strip_prefix('='));
            if named != Some(digest(&body).as_str()) {
                return Err(ApiError::Unauthenticated);
            }
            Some(from)
        }
        None => None,
    };
    let now = match handed_from {
        Some(_) => timestamp,
        None => time::OffsetDateTime::now_utc().unix_timestamp(),
    };
    let rail_signature = header("webhook-signature");
    if !signature::verify(secret, id, timestamp, &body, rail_signature, now) {
        return Err(ApiError::Unauthenticated);
    }
    let signed = Signed { raw: body.to_vec(), at: timestamp, signature: rail_signature.to_owned() };
    let mut message = inbox::parse(&rail, id, signed).map_err(ApiError::MalformedJson)?;
    message.handed_from = handed_from;
    let fence = state.engine.ledger().region_fence().await.map_err(ApiError::unavailable)?;
    if fence.failed {
        return Err(ApiError::RegionFailed(fence.region.unwrap_or_default()));
    }
    let arrival = match message.handed_from {
        None => inbox::take(&state.engine, &message).await.map_err(crate::engine::EngineError::from)?,
        Some(_) => match inbox::take_handed(&state.engine, &message).await? {
            Some(arrival) => arrival,
            None => return Err(ApiError::NotFound),
        },
    };
    if arrival == Arrival::Conflicting && message.handed_from.is_some() {
        return Ok((StatusCode::CONFLICT, axum::Json(json!({ "received": false }))).into_response());
    }
    let body = json!({ "received": true, "duplicate": arrival == Arrival::Duplicate });
    Ok(axum::Json(body).into_response())
}
