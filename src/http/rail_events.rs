//! `POST /v1/rail-events/{rail}`: a rail's notification of what it decided
//! after the fact. No API key: the rail signs each notification (Standard
//! Webhooks headers) with the secret keyfence holds for it, and anything
//! unsigned, signed otherwise, or signed more than five minutes ago is 401
//! (as is a rail keyfence holds no secret for). A region declared failed
//! takes nothing in (503): the rail sends it again, or to another region.
//! A message seen before is acknowledged again (and dropped): the rail may
//! stop sending it.

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, State};
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use serde_json::json;

use super::extract::json_bytes;
use super::{ApiError, AppState};
use crate::inbox;
use crate::ledger::inbox::Arrival;
use crate::webhooks::signature;

pub async fn receive(
    State(state): State<AppState>,
    Path(rail): Path<String>,
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
    let now = time::OffsetDateTime::now_utc().unix_timestamp();
    if !signature::verify(secret, id, timestamp, &body, header("webhook-signature"), now) {
        return Err(ApiError::Unauthenticated);
    }
    let message = inbox::parse(&rail, id, &body).map_err(ApiError::MalformedJson)?;
    let unavailable = |_| ApiError::Unavailable { retry_after: std::time::Duration::from_secs(1) };
    let fence = state.engine.ledger().region_fence().await.map_err(unavailable)?;
    if fence.failed {
        return Err(ApiError::RegionFailed(fence.region.unwrap_or_default()));
    }
    let arrival = inbox::take(&state.engine, &message).await.map_err(crate::engine::EngineError::from)?;
    let body = json!({ "received": true, "duplicate": arrival == Arrival::Duplicate });
    Ok(axum::Json(body).into_response())
}
