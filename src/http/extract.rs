//! Extractors for what every request carries: the caller (from its bearer
//! API key) and the Idempotency-Key. Each turns an untrusted header into a
//! domain type or a clear error, before any work starts.

use axum::extract::FromRequestParts;
use axum::http::request::Parts;
use axum::http::{HeaderMap, header};

use super::{ApiError, AppState};
use crate::domain::{ApiKey, ClientId, IdempotencyKey};

/// The authenticated client.
pub struct Caller(pub ClientId);

impl FromRequestParts<AppState> for Caller {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, ApiError> {
        let token = parts
            .headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::trim)
            .filter(|t| !t.is_empty())
            .ok_or(ApiError::Unauthenticated)?;
        match state.engine.ledger().client_by_key(&ApiKey::presented(token)).await {
            Ok(Some(client)) => Ok(Caller(client)),
            Ok(None) => Err(ApiError::Unauthenticated),
            Err(e) => Err(crate::engine::EngineError::from(e).into()),
        }
    }
}

/// The request's Idempotency-Key, validated.
pub fn idempotency_key(headers: &HeaderMap) -> Result<IdempotencyKey, ApiError> {
    let raw = headers.get("idempotency-key").ok_or(ApiError::MissingKey)?;
    let raw = raw.to_str().map_err(|_| ApiError::InvalidKey(crate::domain::InvalidKey::BadCharacter))?;
    IdempotencyKey::parse(raw).map_err(ApiError::InvalidKey)
}

/// Refuses a body that is not declared as JSON.
pub fn require_json(headers: &HeaderMap) -> Result<(), ApiError> {
    let declared = headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).unwrap_or("");
    let essence = declared.split(';').next().unwrap_or("").trim();
    if essence.eq_ignore_ascii_case("application/json") { Ok(()) } else { Err(ApiError::WrongContentType) }
}
