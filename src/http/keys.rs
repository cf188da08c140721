//! `/v1/idempotency-keys/{key}`: what became of one of the caller's keys.
//! Keys are looked up inside the caller's namespace only, so another
//! client's key is indistinguishable from one never used (404), and so is a
//! key past its retention.

use axum::Json;
use axum::extract::rejection::PathRejection;
use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use serde_json::json;
use time::format_description::well_known::Rfc3339;

use super::extract::Caller;
use super::{ApiError, AppState};
use crate::domain::{IdempotencyKey, InvalidKey, ScopedKey};
use crate::engine::EngineError;
use crate::keystore::KeyStore;

pub async fn show(
    State(state): State<AppState>,
    Caller(client): Caller,
    key: Result<Path<String>, PathRejection>,
) -> Result<Response, ApiError> {
    // A segment that is not even UTF-8 holds a character no key may have.
    let Ok(Path(key)) = key else { return Err(ApiError::InvalidKey(InvalidKey::BadCharacter)) };
    let key = IdempotencyKey::parse(&key).map_err(ApiError::InvalidKey)?;
    let item = state
        .engine
        .keys()
        .get(&ScopedKey::new(client, key))
        .await
        .map_err(EngineError::from)?
        .filter(|item| !item.expired(state.engine.retention().gone_before(state.engine.clock().now())))
        .ok_or(ApiError::NotFound)?;
    let created_at = crate::ledger::timestamp(item.created_at).format(&Rfc3339).ok();
    Ok(Json(json!({
        "key": item.key.key.as_str(),
        "state": item.state.as_str(),
        "created_at": created_at,
        "payment_id": item.payment_id,
    }))
    .into_response())
}
