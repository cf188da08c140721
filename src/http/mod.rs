//! The HTTP front door (axum). Routes, extractors and problem+json errors;
//! every handler validates its input into domain types and hands the work to
//! the engine, and every error, down to an unknown route, is problem+json.
//! `router` is all a test needs to call it without a socket; [`server`]
//! serves it with the limits a public port needs. `admin_router` is the
//! operators' listener: metrics and readiness in detail.

mod extract;
mod hand_on;
mod json;
mod keys;
mod live;
mod payments;
mod peers;
mod probes;
mod problem;
mod rail_events;
mod read_deadline;
mod refunds;
pub mod server;
mod signed;
mod throttle;
mod webhook_endpoints;
mod write_deadline;

use std::sync::Arc;

use axum::Router;
use axum::extract::{DefaultBodyLimit, MatchedPath, Request};
use axum::http::{HeaderName, HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::Response;
use axum::routing::get;
use tower_http::request_id::{MakeRequestUuid, PropagateRequestIdLayer, SetRequestIdLayer};
use tower_http::set_header::SetResponseHeaderLayer;
use tower_http::trace::TraceLayer;

use crate::clients::Directory;
use crate::engine::Engine;
use crate::keystore::DynamoKeyStore;

pub use hand_on::PeerInboxes;
pub use peers::Peers;
pub use probes::Readiness;
pub use problem::{ApiError, Failure};
pub use signed::Asking;
pub use throttle::{FairUseSettings, Throttle};

/// The header naming each request in its answer (and in the caller's logs).
const REQUEST_ID: &str = "request-id";

#[derive(Clone)]
pub struct AppState {
    pub engine: Arc<Engine<DynamoKeyStore>>,
    pub clients: Directory,
    /// The other regions, for reads this region's ledger cannot answer.
    pub peers: peers::Peers,
    /// Each client's fair use of this instance, and the task cap.
    pub throttle: Throttle,
    /// The public readiness answer, checked at most once a second.
    pub readiness: probes::Readiness,
    /// Bodies over this many bytes are refused (413), as soon as their
    /// declared length says so.
    pub body_limit: usize,
    /// The clients' webhook endpoints.
    pub webhooks: crate::webhooks::EndpointStore,
    /// Where a webhook endpoint may point.
    pub webhook_targets: crate::webhooks::TargetPolicy,
    /// The secrets the rails sign their notifications with.
    pub rail_secrets: crate::domain::RailSecrets,
}

impl AppState {
    /// The other regions' inboxes, reached as this front door reaches the
    /// other regions for reads.
    pub fn peer_inboxes(&self) -> PeerInboxes {
        PeerInboxes {
            peers: self.peers.clone(),
            regions: self.engine.regions().clone(),
            me: self.engine.region().to_owned(),
        }
    }
}

/// Counts every answer by route and class, and times it the way
/// OpenTelemetry's HTTP conventions name it (`http.server.request.duration`
/// by method, route template and status). Labels come from fixed sets only.
async fn count_answers(request: Request, next: Next) -> Response {
    let started = std::time::Instant::now();
    let template = request.extensions().get::<MatchedPath>().map(|m| m.as_str().to_owned()).unwrap_or_default();
    let method = known_method(request.method());
    let route = match (request.method().as_str(), template.as_str()) {
        ("POST", "/v1/payments") => "create_payment",
        ("GET", "/v1/payments") => "list_payments",
        (_, "/v1/payments/{id}") => "get_payment",
        ("POST", "/v1/payments/{id}/refunds") => "create_refund",
        (_, "/v1/payments/{id}/refunds") => "list_refunds",
        (_, "/v1/refunds/{id}") => "get_refund",
        (_, "/v1/idempotency-keys/{key}") => "get_key",
        (_, "/v1/webhook-endpoints" | "/v1/webhook-endpoints/{id}") => "webhook_endpoints",
        (_, "/v1/rail-events/{rail}") => "rail_events",
        (_, "/healthz" | "/readyz") => return next.run(request).await,
        _ => "other",
    };
    let response = next.run(request).await;
    if let Some(problem::Failure(why)) = response.extensions().get() {
        match response.status() {
            StatusCode::INTERNAL_SERVER_ERROR => tracing::error!(route, error = %why, "internal error"),
            _ => tracing::warn!(route, error = %why, "temporarily unavailable"),
        }
    }
    let replayed = response.headers().contains_key("idempotent-replayed");
    let answer = match response.status().as_u16() {
        201 if replayed => "replayed",
        201 => "created",
        202 => "pending",
        402 => "declined",
        429 => "throttled",
        409 => "in_flight",
        422 => "mismatch",
        200..=299 => "ok",
        503 => "unavailable",
        400..=499 => "client_error",
        _ => "server_error",
    };
    metrics::counter!("keyfence_http_requests_total", "route" => route, "answer" => answer).increment(1);
    metrics::histogram!(
        "http_server_request_duration_seconds",
        "http_request_method" => method,
        "http_route" => template,
        "http_response_status_code" => response.status().as_str().to_owned(),
    )
    .record(started.elapsed().as_secs_f64());
    response
}

/// The request's method, or `_OTHER` for one outside HTTP's own (as the
/// conventions say), so a caller cannot mint labels.
fn known_method(method: &axum::http::Method) -> &'static str {
    const KNOWN: [&str; 9] = ["GET", "POST", "PUT", "DELETE", "HEAD", "OPTIONS", "PATCH", "TRACE", "CONNECT"];
    KNOWN.into_iter().find(|known| *known == method.as_str()).unwrap_or("_OTHER")
}

/// The service's routes.
pub fn router(state: AppState) -> Router {
    Router::new()
        .route("/v1/payments", axum::routing::post(payments::create).get(payments::by_reference))
        .route("/v1/payments/{id}", get(payments::show))
        .route("/v1/payments/{id}/refunds", axum::routing::post(refunds::create).get(refunds::list))
        .route("/v1/refunds/{id}", get(refunds::show))
        .route("/v1/idempotency-keys/{key}", get(keys::show))
        .route("/v1/webhook-endpoints", axum::routing::post(webhook_endpoints::create).get(webhook_endpoints::list))
        .route("/v1/webhook-endpoints/{id}", axum::routing::delete(webhook_endpoints::remove))
        .route("/v1/rail-events/{rail}", axum::routing::post(rail_events::receive))
        .route("/healthz", get(probes::health))
        .route("/readyz", get(probes::ready))
        .fallback(|| async { ApiError::NotFound })
        .method_not_allowed_fallback(|| async { ApiError::MethodNotAllowed })
        .layer(axum::middleware::from_fn_with_state(state.clone(), signed::from_a_region))
        .layer(axum::middleware::from_fn(count_answers))
        .layer(DefaultBodyLimit::max(state.body_limit))
        .layer(axum::middleware::from_fn_with_state(state.clone(), extract::refuse_oversized))
        .layer(TraceLayer::new_for_http().make_span_with(crate::telemetry::request_span))
        // Answers are about one caller's money at one moment: never cached.
        .layer(SetResponseHeaderLayer::overriding(header::CACHE_CONTROL, HeaderValue::from_static("no-store")))
        // Every answer names itself (the caller's id when it sent one).
        .layer(PropagateRequestIdLayer::new(HeaderName::from_static(REQUEST_ID)))
        .layer(SetRequestIdLayer::new(HeaderName::from_static(REQUEST_ID), MakeRequestUuid))
        .with_state(state)
}

/// The admin listener's routes: metrics and readiness in detail, for
/// operators and scrapers only (it listens on loopback unless told).
pub fn admin_router(state: AppState) -> Router {
    Router::new()
        .route("/metrics", get(|| async { crate::metrics::render() }))
        .route("/readyz", get(probes::ready_in_detail))
        .route("/healthz", get(probes::health))
        .fallback(|| async { ApiError::NotFound })
        .method_not_allowed_fallback(|| async { ApiError::MethodNotAllowed })
        .layer(SetResponseHeaderLayer::overriding(header::CACHE_CONTROL, HeaderValue::from_static("no-store")))
        .with_state(state)
}
