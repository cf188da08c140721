//! Extractors for what every request carries: the caller (from its bearer
//! API key) and the Idempotency-Key, and the checks of what a body declares
//! (its type, its length). Each turns an untrusted header into a domain type
//! or a clear error, before any work starts.

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{FromRequestParts, Request, State};
use axum::http::request::Parts;
use axum::http::{HeaderMap, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use serde_json::Value;

use std::sync::Arc;

use super::signed::ForwardedFor;
use super::{ApiError, AppState};
use crate::clients::Profile;
use crate::domain::{ApiKey, ClientId, IdempotencyKey};

/// The authenticated client: a bearer API key's, within its request rate,
/// or the one a verified forwarded read is for (counted where it began).
pub struct Caller(pub ClientId);

impl FromRequestParts<AppState> for Caller {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, ApiError> {
        if let Some(ForwardedFor(client)) = parts.extensions.get::<ForwardedFor>() {
            return Ok(Caller(*client));
        }
        // The scheme is case-insensitive (RFC 9110, section 11.1).
        let token = parts
            .headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.split_once(' '))
            .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
            .map(|(_, token)| token.trim())
            .filter(|t| !t.is_empty())
            .ok_or(ApiError::Unauthenticated)?;
        let client = match state.clients.find(&ApiKey::presented(token)).await {
            Ok(Some(client)) => client,
            Ok(None) => return Err(ApiError::Unauthenticated),
            Err(e) => return Err(ApiError::unavailable(e)),
        };
        state.throttle.admit(client, &*profile(state, client).await?).map_err(ApiError::Throttled)?;
        Ok(Caller(client))
    }
}

/// Client `id`'s profile (as cached), or 503 when it cannot be read.
pub async fn profile(state: &AppState, id: ClientId) -> Result<Arc<Profile>, ApiError> {
    state.clients.profile(id).await.map_err(ApiError::unavailable)
}

/// The request's Idempotency-Key, validated. Exactly one: with two, which
/// one a proxy on the way honoured is anyone's guess.
pub fn idempotency_key(headers: &HeaderMap) -> Result<IdempotencyKey, ApiError> {
    let mut all = headers.get_all("idempotency-key").iter();
    let raw = all.next().ok_or(ApiError::MissingKey)?;
    if all.next().is_some() {
        return Err(ApiError::RepeatedKey);
    }
    let raw = raw.to_str().map_err(|_| ApiError::InvalidKey(crate::domain::InvalidKey::BadCharacter))?;
    IdempotencyKey::from_header(raw).map_err(ApiError::InvalidKey)
}

/// Middleware: refuses a body whose declared length is over the limit at
/// once (413), before anything waits for it to arrive.
pub async fn refuse_oversized(State(state): State<AppState>, request: Request, next: Next) -> Response {
    let declared =
        request.headers().get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.parse().ok());
    if declared.is_some_and(|length: u64| length > state.body_limit as u64) {
        return ApiError::TooLarge.into_response();
    }
    next.run(request).await
}

/// Refuses a body that is not declared as JSON.
pub fn require_json(headers: &HeaderMap) -> Result<(), ApiError> {
    let declared = headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).unwrap_or("");
    let essence = declared.split(';').next().unwrap_or("").trim();
    if essence.eq_ignore_ascii_case("application/json") { Ok(()) } else { Err(ApiError::WrongContentType) }
}

/// A request's JSON body: of the declared type, whole (413 past the limit,
/// 408 when it comes too slowly) and strict ([`super::json`]).
pub fn json_body(headers: &HeaderMap, body: Result<Bytes, BytesRejection>) -> Result<Value, ApiError> {
    let body = json_bytes(headers, body)?;
    super::json::parse(&body).map_err(|e| ApiError::MalformedJson(e.to_string()))
}

/// A JSON body's bytes as they came (for a signature over them), read as
/// [`json_body`] reads them.
pub fn json_bytes(headers: &HeaderMap, body: Result<Bytes, BytesRejection>) -> Result<Bytes, ApiError> {
    require_json(headers)?;
    body.map_err(|rejection| match rejection.status() {
        StatusCode::PAYLOAD_TOO_LARGE => ApiError::TooLarge,
        _ if timed_out(&rejection) => ApiError::BodyTimeout,
        _ => ApiError::MalformedJson(rejection.body_text()),
    })
}

/// Whether reading the body failed because the client took too long.
fn timed_out(rejection: &BytesRejection) -> bool {
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(rejection);
    while let Some(error) = cause {
        if error.is::<tower_http::timeout::TimeoutError>() {
            return true;
        }
        cause = error.source();
    }
    false
}
