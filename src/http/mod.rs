//! The HTTP front door (axum). Routes, extractors and problem+json errors;
//! every handler validates its input into domain types and hands the work to
//! the engine. `router` is all a test needs to call it without a socket.

mod extract;
mod keys;
mod payments;
mod problem;

use std::sync::Arc;

use axum::Router;
use axum::extract::DefaultBodyLimit;
use axum::routing::get;
use tower_http::trace::TraceLayer;

use crate::engine::Engine;
use crate::keystore::DynamoKeyStore;

pub use problem::ApiError;

#[derive(Clone)]
pub struct AppState {
    pub engine: Arc<Engine<DynamoKeyStore>>,
}

/// The service's routes; bodies over `body_limit` bytes are refused (413).
pub fn router(state: AppState, body_limit: usize) -> Router {
    Router::new()
        .route("/v1/payments", axum::routing::post(payments::create).get(payments::by_reference))
        .route("/v1/payments/{id}", get(payments::show))
        .route("/v1/idempotency-keys/{key}", get(keys::show))
        .route("/healthz", get(|| async { "ok" }))
        .layer(DefaultBodyLimit::max(body_limit))
        .layer(TraceLayer::new_for_http())
        .with_state(state)
}
