//! Probes. `/healthz` says the process lives (and its region's state), on
//! both listeners. The public `/readyz` says only ready or not: it is
//! checked at most once every [`READY_FOR`], however many probes arrive
//! (concurrent ones wait for the one check), and names no store or error,
//! so it can be neither an amplifier nor an oracle. The admin listener's
//! `/readyz` checks every time and says why not.

use std::sync::Arc;
use std::time::Duration;

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use tokio::sync::Mutex;
use tokio::time::Instant;

use super::AppState;

/// How long a public readiness answer stands.
pub const READY_FOR: Duration = Duration::from_secs(1);

/// The last public readiness check, and when it was made.
#[derive(Clone, Default)]
pub struct Readiness(Arc<Mutex<Option<(Instant, bool)>>>);

/// Liveness, and this instance's region as the registry says (a failed
/// region's instances are alive, and answer every request 503).
pub async fn health(State(state): State<AppState>) -> Json<Value> {
    let region = state.engine.region();
    let registry = state.engine.regions().current().await;
    Json(json!({ "status": "ok", "region": region, "region_state": registry.state_of(region).as_str() }))
}

/// Ready or not, and nothing more.
pub async fn ready(State(state): State<AppState>) -> Response {
    let ready = {
        let mut last = state.readiness.0.lock().await;
        match *last {
            Some((at, ready)) if at.elapsed() < READY_FOR => ready,
            _ => {
                let (ready, _) = check(&state).await;
                *last = Some((Instant::now(), ready));
                ready
            }
        }
    };
    let status = if ready { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
    (status, Json(json!({ "ready": ready }))).into_response()
}

/// Ready, and if not why: for operators, on the admin listener.
pub async fn ready_in_detail(State(state): State<AppState>) -> Response {
    let (ready, body) = check(&state).await;
    let status = if ready { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
    (status, Json(body)).into_response()
}

/// Ready for traffic: the key table and the ledger answer, this region is
/// not declared failed, and its ledger's region fence is open (a fenced
/// ledger commits no phase).
async fn check(state: &AppState) -> (bool, Value) {
    let region = state.engine.region();
    let (registry, fence) = tokio::join!(state.engine.regions().fresh(), state.engine.ledger().region_fence());
    let key_table = registry.as_ref().map(|_| "ok".to_owned()).unwrap_or_else(|e| e.to_string());
    let region_state = registry.as_ref().map_or("unknown", |r| r.state_of(region).as_str());
    let ledger = fence.as_ref().map(|_| "ok".to_owned()).unwrap_or_else(|e| e.to_string());
    let ledger_fence = fence.as_ref().ok().map(|f| json!({ "state": f.state(), "epoch": f.epoch }));
    let fence_open = fence.as_ref().is_ok_and(|f| !f.failed);
    let ready = key_table == "ok" && fence_open && region_state == "active";
    let body = json!({ "ready": ready, "region": region, "region_state": region_state,
                       "key_table": key_table, "ledger": ledger, "ledger_fence": ledger_fence });
    (ready, body)
}
