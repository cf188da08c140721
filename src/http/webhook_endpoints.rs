//! `/v1/webhook-endpoints`: a client registers the endpoints that hear how
//! its payments end, lists them and removes them. The signing secret is in
//! the answer that creates an endpoint, and nowhere else. Another client's
//! endpoint is not found.

use axum::body::Bytes;
use axum::extract::rejection::{BytesRejection, PathRejection};
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::json;
use uuid::Uuid;

use super::extract::{Caller, json_body};
use super::{ApiError, AppState};
use crate::domain::FieldError;
use crate::webhooks::sealing::SealError;
use crate::webhooks::target::Refused;
use crate::webhooks::{self, WebhooksError};

/// The longest webhook URL taken, in characters.
const MAX_URL: usize = 1024;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct NewEndpoint {
    url: String,
    events: Vec<String>,
}

pub async fn create(
    State(state): State<AppState>,
    Caller(client): Caller,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let value = json_body(&headers, body)?;
    let asked: NewEndpoint = serde_json::from_value(value)
        .map_err(|e| ApiError::InvalidEndpoint(vec![FieldError { field: "body", message: e.to_string() }]))?;
    let mut errors = Vec::new();
    let events = webhooks::checked_events(&asked.events)
        .map_err(|message| errors.push(FieldError { field: "events", message }))
        .ok();
    // At most 1024 characters, so the longest valid registration (however
    // its characters are escaped) stays far inside the body limit.
    let url = match asked.url.chars().count() {
        0..=MAX_URL => match state.webhook_targets.check(&asked.url, client).await {
            Ok(url) => Some(url),
            Err(Refused::Busy) => return Err(ApiError::unavailable(Refused::Busy)),
            Err(Refused::Invalid(message)) => {
                errors.push(FieldError { field: "url", message });
                None
            }
        },
        _ => {
            errors.push(FieldError { field: "url", message: format!("at most {MAX_URL} characters") });
            None
        }
    };
    let (Some(url), Some(events)) = (url, events) else { return Err(ApiError::InvalidEndpoint(errors)) };
    let issued = state.webhooks.add(client, &url, events).await.map_err(refused)?;
    let mut body = issued.endpoint.public();
    body["secret"] = json!(issued.secret.value);
    Ok((StatusCode::CREATED, axum::Json(body)).into_response())
}

pub async fn list(State(state): State<AppState>, Caller(client): Caller) -> Result<Response, ApiError> {
    let endpoints = state.webhooks.list(client).await.map_err(refused)?;
    let data: Vec<_> = endpoints.iter().map(webhooks::Endpoint::public).collect();
    Ok(axum::Json(json!({ "data": data })).into_response())
}

pub async fn remove(
    State(state): State<AppState>,
    Caller(client): Caller,
    id: Result<Path<Uuid>, PathRejection>,
) -> Result<Response, ApiError> {
    let Ok(Path(id)) = id else { return Err(ApiError::NotFound) };
    state.webhooks.remove(client, id).await.map_err(refused)?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

/// The answer to a store's refusal: not found, over the limit, or retry.
fn refused(e: WebhooksError) -> ApiError {
    match e {
        WebhooksError::Unknown(_) => ApiError::NotFound,
        WebhooksError::TooMany => ApiError::OverLimit {
            limit: "webhook_endpoints",
            detail: format!("A client has at most {} webhook endpoints", webhooks::MAX_ENDPOINTS),
        },
        WebhooksError::Contended
        | WebhooksError::Store(_)
        | WebhooksError::Deliveries(_)
        | WebhooksError::Sealing(SealError::Kms(_)) => ApiError::unavailable(e),
        WebhooksError::Malformed(_) | WebhooksError::Sealing(_) => ApiError::internal(e),
    }
}
