//! `ApiError`: every answer that is not a success, as RFC 9457
//! `application/problem+json`. One exhaustive match maps each to its status;
//! the cause of a 503 or a 500 rides on the answer (never in its body) to
//! the layer that sees every answer, which logs it once.

use std::sync::Arc;
use std::time::Duration;

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::json;

use super::throttle::Throttled;
use crate::domain::{FieldError, InvalidKey};
use crate::engine::EngineError;

/// How long a failed region tells clients to wait before trying it again.
const REGION_FAILED_RETRY: Duration = Duration::from_secs(30);

#[derive(Debug)]
pub enum ApiError {
    MissingKey,
    InvalidKey(InvalidKey),
    WrongContentType,
    MalformedJson(String),
    InvalidFields(Vec<FieldError>),
    InvalidEndpoint(Vec<FieldError>),
    InvalidRefund(Vec<FieldError>),
    MissingQuery(&'static str),
    InvalidQuery(String),
    RepeatedKey,
    TooLarge,
    BodyTimeout,
    Unauthenticated,
    NotFound,
    MethodNotAllowed,
    InFlight {
        retry_after: Duration,
    },
    KeyReused,
    /// A store (or a lookup) is briefly unavailable: retry in a second.
    Unavailable(Failure),
    RegionFailed(String),
    PeersUnreachable(Vec<String>),
    /// The debtor account is not one the caller holds (whoever holds it).
    AccountNotPermitted,
    /// Over one of the caller's limits.
    OverLimit {
        limit: &'static str,
        detail: String,
    },
    /// Only a succeeded payment can be refunded; this one is `status`.
    PaymentNotRefundable {
        status: String,
    },
    /// The refund is more than is left to refund of its payment (`left`).
    RefundExceedsPayment {
        left: i64,
    },
    /// This region holds only a leftover of the payment, and no region shows
    /// its live copy yet (it is moving: its new home has not written it).
    PaymentMoving,
    /// Over the caller's fair use, or the instance's task cap.
    Throttled(Throttled),
    /// A read forwarded for another region reached this one.
    Misdirected {
        meant_for: String,
        here: String,
    },
    Internal(Failure),
}

/// Why an answer is a 503 or a 500, kept whole (sources and all) for the
/// log, which the layer that sees every answer writes once; the body says
/// nothing of it.
#[derive(Clone, Debug)]
pub struct Failure(pub Arc<dyn std::error::Error + Send + Sync>);

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl ApiError {
    /// A 500 for `why` (an error, or a sentence when nothing failed below).
    pub fn internal(why: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Self {
        ApiError::Internal(Failure(Arc::from(why.into())))
    }

    /// A 503 for `why`: the client retries in a second.
    pub fn unavailable(why: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Self {
        ApiError::Unavailable(Failure(Arc::from(why.into())))
    }
}

impl From<EngineError> for ApiError {
    fn from(e: EngineError) -> Self {
        match e {
            // Another attempt owns the request now; the client's retry will
            // find it in flight or finished.
            EngineError::FencedOut(_) => ApiError::InFlight { retry_after: Duration::from_secs(1) },
            EngineError::Transient(_) => ApiError::unavailable(e),
            EngineError::RegionFailed(region) => ApiError::RegionFailed(region),
            EngineError::Fault(_) | EngineError::Broken(_) => ApiError::internal(e),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let (status, slug, title, detail, extra) = match &self {
            ApiError::MissingKey => (
                StatusCode::BAD_REQUEST,
                "missing-idempotency-key",
                "Idempotency-Key header required",
                "Send a unique Idempotency-Key (a UUID is best) with every POST, and the same one on every retry."
                    .to_owned(),
                None,
            ),
            ApiError::InvalidKey(why) => {
                (StatusCode::BAD_REQUEST, "invalid-idempotency-key", "Invalid Idempotency-Key", why.to_string(), None)
            }
            ApiError::WrongContentType => (
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "wrong-content-type",
                "Wrong content type",
                "The body must be JSON, sent with Content-Type: application/json.".to_owned(),
                None,
            ),
            ApiError::MalformedJson(why) => {
                (StatusCode::BAD_REQUEST, "malformed-json", "Malformed JSON", why.clone(), None)
            }
            ApiError::InvalidFields(errors) => (
                StatusCode::BAD_REQUEST,
                "invalid-fields",
                "Invalid payment",
                "One or more fields are invalid; see errors.".to_owned(),
                Some(json!({ "errors": errors })),
            ),
            ApiError::InvalidEndpoint(errors) => (
                StatusCode::BAD_REQUEST,
                "invalid-fields",
                "Invalid webhook endpoint",
                "One or more fields are invalid; see errors.".to_owned(),
                Some(json!({ "errors": errors })),
            ),
            ApiError::InvalidRefund(errors) => (
                StatusCode::BAD_REQUEST,
                "invalid-fields",
                "Invalid refund",
                "One or more fields are invalid; see errors.".to_owned(),
                Some(json!({ "errors": errors })),
            ),
            ApiError::PaymentNotRefundable { status } => (
                StatusCode::UNPROCESSABLE_ENTITY,
                "payment-not-refundable",
                "Payment not refundable",
                format!(
                    "Only a succeeded payment can be refunded; this one is {status}. Nothing was claimed: the same \
                     Idempotency-Key refunds once the payment has succeeded."
                ),
                None,
            ),
            ApiError::RefundExceedsPayment { left } => (
                StatusCode::UNPROCESSABLE_ENTITY,
                "refund-exceeds-payment",
                "Refund exceeds what is left of the payment",
                format!(
                    "Only {left} minor units of the payment are left to refund (succeeded and in-flight refunds \
                     count). Nothing was reserved or stored: the same Idempotency-Key may refund once another refund \
                     is declined."
                ),
                Some(json!({ "refundable_minor": left })),
            ),
            ApiError::MissingQuery(name) => (
                StatusCode::BAD_REQUEST,
                "missing-query-parameter",
                "Missing query parameter",
                format!("The query parameter {name} is required."),
                None,
            ),
            ApiError::InvalidQuery(why) => {
                (StatusCode::BAD_REQUEST, "invalid-query", "Invalid query", why.clone(), None)
            }
            ApiError::RepeatedKey => (
                StatusCode::BAD_REQUEST,
                "invalid-idempotency-key",
                "More than one Idempotency-Key",
                "Send exactly one Idempotency-Key header.".to_owned(),
                None,
            ),
            ApiError::BodyTimeout => (
                StatusCode::REQUEST_TIMEOUT,
                "body-timeout",
                "Request body too slow",
                "The body did not arrive in time; nothing was done. Send it again with the same Idempotency-Key."
                    .to_owned(),
                None,
            ),
            ApiError::MethodNotAllowed => (
                StatusCode::METHOD_NOT_ALLOWED,
                "method-not-allowed",
                "Method not allowed",
                "This resource does not support that method.".to_owned(),
                None,
            ),
            ApiError::TooLarge => (
                StatusCode::PAYLOAD_TOO_LARGE,
                "body-too-large",
                "Request body too large",
                "The body exceeds the configured size limit.".to_owned(),
                None,
            ),
            ApiError::Unauthenticated => (
                StatusCode::UNAUTHORIZED,
                "unauthenticated",
                "Missing or unknown credentials",
                "Send Authorization: Bearer <api key>.".to_owned(),
                None,
            ),
            ApiError::NotFound => {
                (StatusCode::NOT_FOUND, "not-found", "Not found", "No such resource for this client.".to_owned(), None)
            }
            ApiError::InFlight { .. } => (
                StatusCode::CONFLICT,
                "request-in-flight",
                "Request in flight",
                "An earlier attempt with this Idempotency-Key is still being worked; retry after Retry-After seconds."
                    .to_owned(),
                None,
            ),
            ApiError::KeyReused => (
                StatusCode::UNPROCESSABLE_ENTITY,
                "idempotency-key-reused",
                "Idempotency-Key reused",
                "This Idempotency-Key was already used with a different request; use a new key for a new payment."
                    .to_owned(),
                None,
            ),
            ApiError::Unavailable(_) => (
                StatusCode::SERVICE_UNAVAILABLE,
                "temporarily-unavailable",
                "Temporarily unavailable",
                "Nothing was settled; retry with the same Idempotency-Key.".to_owned(),
                None,
            ),
            ApiError::RegionFailed(region) => (
                StatusCode::SERVICE_UNAVAILABLE,
                "region-failed",
                "Region failed over",
                format!(
                    "Region {region} has been declared failed and takes no work. Send the request, with the same \
                     Idempotency-Key, to another region: it will finish it exactly once."
                ),
                None,
            ),
            ApiError::PeersUnreachable(regions) => (
                StatusCode::SERVICE_UNAVAILABLE,
                "region-unreachable",
                "Another region could not be asked",
                format!(
                    "This region does not hold it, and region(s) {} that might could not be asked; try again.",
                    regions.join(", ")
                ),
                None,
            ),
            ApiError::Throttled(Throttled::Rate { .. }) => (
                StatusCode::TOO_MANY_REQUESTS,
                "rate-limited",
                "Too many requests",
                "This client is over its request rate. Nothing was claimed: retry after Retry-After seconds with \
                 the same Idempotency-Key."
                    .to_owned(),
                None,
            ),
            ApiError::Throttled(Throttled::InFlight) => (
                StatusCode::TOO_MANY_REQUESTS,
                "too-many-in-flight",
                "Too many payments in flight",
                "This client has as many payments in flight as it may. Nothing was claimed: retry after \
                 Retry-After seconds with the same Idempotency-Key."
                    .to_owned(),
                None,
            ),
            ApiError::Throttled(Throttled::Tasks) => (
                StatusCode::SERVICE_UNAVAILABLE,
                "busy",
                "Busy",
                "This instance is working as many payments as it may. Nothing was claimed: retry with the same \
                 Idempotency-Key."
                    .to_owned(),
                None,
            ),
            ApiError::AccountNotPermitted => (
                StatusCode::FORBIDDEN,
                "account-not-permitted",
                "Account not permitted",
                "This client may not pay from this debtor account. Nothing was claimed: once the account is added \
                 to the client, the same Idempotency-Key pays."
                    .to_owned(),
                None,
            ),
            ApiError::OverLimit { limit, detail } => (
                StatusCode::UNPROCESSABLE_ENTITY,
                "limit-exceeded",
                "Over a limit of this client",
                format!("{detail}. Nothing was claimed."),
                Some(json!({ "limit": limit })),
            ),
            ApiError::PaymentMoving => (
                StatusCode::SERVICE_UNAVAILABLE,
                "payment-moving",
                "Payment moving between regions",
                "This payment is being taken over by another region, which does not show it yet; try again shortly."
                    .to_owned(),
                None,
            ),
            ApiError::Misdirected { meant_for, here } => (
                StatusCode::MISDIRECTED_REQUEST,
                "misdirected-request",
                "Misdirected request",
                format!("This read was forwarded for region {meant_for}; this front door serves region {here}."),
                None,
            ),
            ApiError::Internal(_) => (
                StatusCode::INTERNAL_SERVER_ERROR,
                "internal",
                "Internal error",
                "Retry with the same Idempotency-Key; the request will not be applied twice.".to_owned(),
                None,
            ),
        };
        let mut body = json!({
            "type": format!("urn:keyfence:problem:{slug}"),
            "title": title,
            "status": status.as_u16(),
            "detail": detail,
        });
        if let (Some(extra), Some(map)) = (extra, body.as_object_mut()) {
            map.extend(extra.as_object().cloned().unwrap_or_default());
        }
        let mut response = (status, body.to_string()).into_response();
        let headers = response.headers_mut();
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/problem+json"));
        match self {
            ApiError::PeersUnreachable(_) | ApiError::PaymentMoving => {
                headers.insert(header::RETRY_AFTER, HeaderValue::from(1));
            }
            ApiError::InFlight { retry_after } => {
                headers.insert(header::RETRY_AFTER, HeaderValue::from(retry_after.as_secs().max(1)));
            }
            ApiError::Unavailable(_) => {
                headers.insert(header::RETRY_AFTER, HeaderValue::from(1));
            }
            ApiError::RegionFailed(_) => {
                headers.insert(header::RETRY_AFTER, HeaderValue::from(REGION_FAILED_RETRY.as_secs()));
            }
            ApiError::Throttled(throttled) => {
                let wait = match throttled {
                    Throttled::Rate { retry_after } => retry_after.as_secs_f64().ceil() as u64,
                    Throttled::InFlight | Throttled::Tasks => 1,
                };
                headers.insert(header::RETRY_AFTER, HeaderValue::from(wait.max(1)));
            }
            _ => {}
        }
        if matches!(self, ApiError::Unauthenticated) {
            headers.insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        // Logged once, by the layer that sees every answer, never in the body.
        if let ApiError::Internal(why) | ApiError::Unavailable(why) = self {
            response.extensions_mut().insert(why);
        }
        response
    }
}
