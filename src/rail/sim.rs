//! The rail simulator: a real HTTP server standing in for an external system
//! (`keyfence rail-sim`). It honours idempotency keys exactly as a real rail
//! must (a repeat is a no-op answering the first result), keeps a statement
//! of every applied instruction so tests can count effects, and takes
//! runtime faults: added latency, a rate of 503s that apply nothing, and a
//! rate of timeout-after-apply (applied, then the answer never comes in time).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;

use super::{Applied, Instruction};

/// How long a timed-out answer is held back: far past any client's timeout.
const HANG: Duration = Duration::from_secs(120);

/// Faults in force; all zero means a perfect rail.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Faults {
    /// Added before every instruction and probe is handled.
    pub latency_ms: u64,
    /// Share of instructions answered 503 without being applied.
    pub error_rate: f64,
    /// Share of instructions applied whose answer is then held back.
    pub timeout_after_apply_rate: f64,
}

impl Faults {
    fn validate(&self) -> Result<(), String> {
        let rate = |r: f64| (0.0..=1.0).contains(&r);
        if rate(self.error_rate) && rate(self.timeout_after_apply_rate) {
            Ok(())
        } else {
            Err("rates are shares between 0.0 and 1.0".into())
        }
    }
}

#[derive(Default)]
struct Book {
    by_key: HashMap<String, (Instruction, Applied)>,
    /// Keys in the order their instructions were applied.
    order: Vec<String>,
}

/// One simulated external system.
pub struct Simulator {
    name: String,
    book: Mutex<Book>,
    faults: Mutex<Faults>,
}

impl Simulator {
    pub fn new(name: &str) -> Arc<Self> {
        Arc::new(Self { name: name.to_owned(), book: Mutex::default(), faults: Mutex::default() })
    }

    fn book(&self) -> MutexGuard<'_, Book> {
        self.book.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn faults(&self) -> Faults {
        *self.faults.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn set_faults(&self, faults: Faults) {
        *self.faults.lock().unwrap_or_else(|p| p.into_inner()) = faults;
    }

    /// Applies the instruction once per key; a repeat gets the first result.
    fn apply(&self, key: &str, instruction: Instruction) -> Result<(Applied, bool), Instruction> {
        let mut book = self.book();
        if let Some((first, applied)) = book.by_key.get(key) {
            return if *first == instruction { Ok((applied.clone(), false)) } else { Err(first.clone()) };
        }
        let applied = Applied {
            idempotency_key: key.to_owned(),
            end_to_end_id: instruction.end_to_end_id.clone(),
            amount_minor: instruction.amount_minor,
            currency: instruction.currency.clone(),
            reference: format!("{}-{:08}", self.name, book.order.len() + 1),
            applied_at: OffsetDateTime::now_utc().format(&Rfc3339).unwrap_or_default(),
        };
        book.by_key.insert(key.to_owned(), (instruction, applied.clone()));
        book.order.push(key.to_owned());
        Ok((applied, true))
    }
}

/// The simulator's routes.
pub fn router(sim: Arc<Simulator>) -> Router {
    Router::new()
        .route("/v1/instructions", post(instruct))
        .route("/v1/instructions/{key}", get(probe))
        .route("/v1/statement", get(statement))
        .route("/v1/faults", put(set_faults).delete(reset_faults).get(show_faults))
        .route("/healthz", get(|| async { "ok" }))
        .with_state(sim)
}

async fn instruct(
    State(sim): State<Arc<Simulator>>,
    headers: HeaderMap,
    Json(instruction): Json<Instruction>,
) -> Response {
    let Some(key) = headers.get("idempotency-key").and_then(|v| v.to_str().ok()).filter(|k| !k.is_empty()) else {
        return (StatusCode::BAD_REQUEST, "Idempotency-Key is required").into_response();
    };
    let faults = sim.faults();
    tokio::time::sleep(Duration::from_millis(faults.latency_ms)).await;
    if fastrand::f64() < faults.error_rate {
        return (StatusCode::SERVICE_UNAVAILABLE, "simulated outage: nothing applied").into_response();
    }
    match sim.apply(key, instruction) {
        Ok((applied, fresh)) => {
            if fresh && fastrand::f64() < faults.timeout_after_apply_rate {
                tracing::info!(rail = %sim.name, key, "applied; holding the answer back");
                tokio::time::sleep(HANG).await;
            }
            let status = if fresh { StatusCode::CREATED } else { StatusCode::OK };
            (status, Json(applied)).into_response()
        }
        Err(first) => (
            StatusCode::UNPROCESSABLE_ENTITY,
            format!("key {key} was used for another instruction (end_to_end_id {})", first.end_to_end_id),
        )
            .into_response(),
    }
}

async fn probe(State(sim): State<Arc<Simulator>>, Path(key): Path<String>) -> Response {
    tokio::time::sleep(Duration::from_millis(sim.faults().latency_ms)).await;
    match sim.book().by_key.get(&key) {
        Some((_, applied)) => Json(applied.clone()).into_response(),
        None => (StatusCode::NOT_FOUND, "no instruction under this key").into_response(),
    }
}

async fn statement(State(sim): State<Arc<Simulator>>) -> Json<Vec<Applied>> {
    let book = sim.book();
    Json(book.order.iter().map(|key| book.by_key[key].1.clone()).collect())
}

async fn set_faults(State(sim): State<Arc<Simulator>>, Json(faults): Json<Faults>) -> Response {
    match faults.validate() {
        Ok(()) => {
            sim.set_faults(faults);
            Json(faults).into_response()
        }
        Err(why) => (StatusCode::BAD_REQUEST, why).into_response(),
    }
}

async fn reset_faults(State(sim): State<Arc<Simulator>>) -> StatusCode {
    sim.set_faults(Faults::default());
    StatusCode::NO_CONTENT
}

async fn show_faults(State(sim): State<Arc<Simulator>>) -> Json<Faults> {
    Json(sim.faults())
}

/// Serves a simulator named `name` on `listener` until `shutdown` resolves.
pub async fn serve(
    listener: tokio::net::TcpListener,
    name: &str,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, router(Simulator::new(name))).with_graceful_shutdown(shutdown).await
}
