//! The HTTP front door (axum). Routes, extractors and problem+json errors;
//! every handler validates its input into domain types and hands the work to
//! the engine, and every error, down to an unknown route, is problem+json.
//! `router` is all a test needs to call it without a socket; [`server`]
//! serves it with the limits a public port needs.

mod extract;
mod json;
mod keys;
mod payments;
mod peers;
mod problem;
pub mod server;

use std::sync::Arc;

use axum::extract::{DefaultBodyLimit, State};
use axum::routing::get;
use axum::{Json, Router};
use tower_http::trace::TraceLayer;

use crate::clients::Directory;
use crate::engine::Engine;
use crate::keystore::DynamoKeyStore;

pub use peers::Peers;
pub use problem::ApiError;

#[derive(Clone)]
pub struct AppState {
    pub engine: Arc<Engine<DynamoKeyStore>>,
    pub clients: Directory,
    /// The other regions, for reads this region's ledger cannot answer.
    pub peers: peers::Peers,
    /// Bodies over this many bytes are refused (413), as soon as their
    /// declared length says so.
    pub body_limit: usize,
}

/// Liveness, and this instance's region as the registry says (a failed
/// region's instances are alive, and answer every request 503).
async fn health(State(state): State<AppState>) -> Json<serde_json::Value> {
    let region = state.engine.region();
    let registry = state.engine.regions().current().await;
    Json(serde_json::json!({ "status": "ok", "region": region, "region_state": registry.state_of(region).as_str() }))
}

/// The service's routes.
pub fn router(state: AppState) -> Router {
    Router::new()
        .route("/v1/payments", axum::routing::post(payments::create).get(payments::by_reference))
        .route("/v1/payments/{id}", get(payments::show))
        .route("/v1/idempotency-keys/{key}", get(keys::show))
        .route("/healthz", get(health))
        .fallback(|| async { ApiError::NotFound })
        .method_not_allowed_fallback(|| async { ApiError::MethodNotAllowed })
        .layer(DefaultBodyLimit::max(state.body_limit))
        .layer(axum::middleware::from_fn_with_state(state.clone(), extract::refuse_oversized))
        .layer(TraceLayer::new_for_http())
        .with_state(state)
}
