//! The rail simulator: a real HTTP server standing in for an external system
//! (`keyfence rail-sim`). It honours idempotency keys exactly as a real rail
//! must (a repeat is a no-op answering the first result), keeps a statement
//! of every applied instruction and a list of every declined one so tests
//! can count effects, and takes at runtime:
//! - faults: added latency, a rate of 503s that apply nothing, and a rate of
//!   timeout-after-apply (recorded, then the answer never comes in time);
//! - decline rules: instructions for listed creditor accounts, or above an
//!   amount, are declined (402 with a reason code), recorded like applied
//!   ones so a repeat or a probe answers the same refusal.
//!
//! Like a real rail it keeps idempotency keys for a limited window when
//! started with one (`--dedup-window-ms`): past it, a repeat under the same
//! key is a new instruction. Its status API (the probe) keeps answering
//! from the full history, and it lists the keys it was probed for and
//! counts the instructions it took under each key (every send not refused
//! with a 503, new or a repeat), so a test sees a second send even where
//! the rail deduplicated it.
//!
//! Given a callback ([`notify`]), it also tells its participant what it
//! decided after the fact: every verdict, and returns it decides later
//! (`PUT /v1/returns`, or a `return_rate` fault), with at-least-once
//! delivery, duplicates and reordering, counting the copies taken and
//! those on their way (`GET /v1/notifications`).

pub mod notify;

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;

use self::notify::{Callback, Notifier};
use super::{Applied, Declined, Instruction, Notice, Returned, Verdict};

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
    /// Share of notifications sent twice.
    pub duplicate_rate: f64,
    /// Each notification waits a random time up to this first (so they arrive out of order).
    pub delay_ms: u64,
    /// Share of applied instructions returned a moment later (reason `AC04`).
    pub return_rate: f64,
}

impl Faults {
    fn validate(&self) -> Result<(), String> {
        let rate = |r: f64| (0.0..=1.0).contains(&r);
        if [self.error_rate, self.timeout_after_apply_rate, self.duplicate_rate, self.return_rate].into_iter().all(rate)
        {
            Ok(())
        } else {
            Err("rates are shares between 0.0 and 1.0".into())
        }
    }
}

/// Which instructions are declined; empty declines nothing.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Rules {
    /// Instructions to these creditor accounts are declined (`creditor_account_blocked`).
    pub decline_creditor_accounts: Vec<String>,
    /// Instructions above this amount are declined (`amount_over_limit`).
    pub max_amount_minor: Option<i64>,
}

impl Rules {
    /// Why `instruction` is declined, if it is: (reason code, reason).
    fn decline(&self, instruction: &Instruction) -> Option<(&'static str, String)> {
        if self.decline_creditor_accounts.contains(&instruction.creditor_account) {
            return Some(("creditor_account_blocked", "the creditor account is blocked".to_owned()));
        }
        self.max_amount_minor.filter(|max| instruction.amount_minor > *max).map(|max| {
            ("amount_over_limit", format!("the amount {} exceeds the limit of {max}", instruction.amount_minor))
        })
    }
}

/// One instruction as recorded, with what became of it.
struct Entry {
    instruction: Instruction,
    verdict: Verdict,
    at: Instant,
}

#[derive(Default)]
struct Book {
    /// Every instruction recorded, in order.
    entries: Vec<Entry>,
    /// The newest entry under each key.
    latest: HashMap<String, usize>,
    /// Returns decided, by key, and in order.
    returns: HashMap<String, Returned>,
    returned: Vec<String>,
    /// Every key probed, in order.
    probes: Vec<String>,
    /// How many instructions were taken under each key (not refused with a 503).
    sends: BTreeMap<String, u32>,
}

/// One simulated external system.
pub struct Simulator {
    name: String,
    /// How long a key deduplicates; `None`: forever.
    dedup_window: Option<Duration>,
    book: Mutex<Book>,
    faults: Mutex<Faults>,
    rules: Mutex<Rules>,
    notifier: Mutex<Option<Arc<Notifier>>>,
}

impl Simulator {
    pub fn new(name: &str, dedup_window: Option<Duration>) -> Arc<Self> {
        Arc::new(Self {
            name: name.to_owned(),
            dedup_window,
            book: Mutex::default(),
            faults: Mutex::default(),
            rules: Mutex::default(),
            notifier: Mutex::default(),
        })
    }

    /// Posts notifications to `callback` from now on.
    pub fn notify_to(&self, callback: Callback) {
        *self.notifier.lock().unwrap_or_else(|p| p.into_inner()) = Some(Notifier::new(&self.name, callback));
    }

    /// Posts `notice(id)` if a callback is set, under the faults in force.
    fn notify(&self, notice: impl FnOnce(String) -> Notice) {
        let notifier = self.notifier.lock().unwrap_or_else(|p| p.into_inner()).clone();
        if let Some(notifier) = notifier {
            let faults = self.faults();
            notifier.post(notice(notifier.next_id()), Duration::from_millis(faults.delay_ms), faults.duplicate_rate);
        }
    }

    /// Returns the instruction applied under `key` (once: a repeat answers
    /// the first return, and notifies it again). `None` if nothing was
    /// applied under it.
    fn return_instruction(&self, key: &str, reason_code: &str) -> Option<Returned> {
        let returned = {
            let mut book = self.book();
            match book.returns.get(key) {
                Some(first) => first.clone(),
                None => {
                    let Verdict::Applied(applied) = &book.entries[*book.latest.get(key)?].verdict else { return None };
                    let returned = Returned {
                        idempotency_key: key.to_owned(),
                        end_to_end_id: applied.end_to_end_id.clone(),
                        amount_minor: applied.amount_minor,
                        currency: applied.currency.clone(),
                        reason_code: reason_code.to_owned(),
                        returned_at: OffsetDateTime::now_utc().format(&Rfc3339).unwrap_or_default(),
                    };
                    book.returns.insert(key.to_owned(), returned.clone());
                    book.returned.push(key.to_owned());
                    returned
                }
            }
        };
        tracing::info!(rail = %self.name, key, "instruction returned");
        self.notify(|id| Notice::Returned { id, returned: returned.clone() });
        Some(returned)
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

    fn rules(&self) -> Rules {
        self.rules.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    fn set_rules(&self, rules: Rules) {
        *self.rules.lock().unwrap_or_else(|p| p.into_inner()) = rules;
    }

    /// The recorded verdicts `pick` keeps, in order.
    fn verdicts<T>(&self, pick: impl Fn(&Verdict) -> Option<T>) -> Vec<T> {
        self.book().entries.iter().filter_map(|entry| pick(&entry.verdict)).collect()
    }

    /// Records the instruction once per key (within the dedup window): a
    /// repeat gets the first verdict. Returns the verdict and whether it is
    /// new; a key reused for another instruction, that one's reference.
    fn record(&self, key: &str, instruction: Instruction) -> Result<(Verdict, bool), String> {
        let mut book = self.book();
        if let Some(first) = book.latest.get(key).map(|&i| &book.entries[i])
            && self.dedup_window.is_none_or(|window| first.at.elapsed() < window)
        {
            return if first.instruction == instruction {
                Ok((first.verdict.clone(), false))
            } else {
                Err(first.instruction.end_to_end_id.clone())
            };
        }
        let now = OffsetDateTime::now_utc().format(&Rfc3339).unwrap_or_default();
        let verdict = match self.rules().decline(&instruction) {
            Some((code, reason)) => Verdict::Declined(Declined {
                idempotency_key: key.to_owned(),
                end_to_end_id: instruction.end_to_end_id.clone(),
                reason_code: code.to_owned(),
                reason,
                declined_at: now,
            }),
            None => Verdict::Applied(Applied {
                idempotency_key: key.to_owned(),
                end_to_end_id: instruction.end_to_end_id.clone(),
                amount_minor: instruction.amount_minor,
                currency: instruction.currency.clone(),
                originator: instruction.originator.clone(),
                reference: format!("{}-{:08}", self.name, book.entries.len() + 1),
                applied_at: now,
            }),
        };
        let index = book.entries.len();
        book.entries.push(Entry { instruction, verdict: verdict.clone(), at: Instant::now() });
        book.latest.insert(key.to_owned(), index);
        Ok((verdict, true))
    }
}

/// The trace id of the caller's W3C `traceparent`, or "-" without one.
fn trace_id(headers: &HeaderMap) -> &str {
    headers.get("traceparent").and_then(|v| v.to_str().ok()).and_then(|t| t.split('-').nth(1)).unwrap_or("-")
}

/// A verdict as the rail answers it: 201/200 applied, 402 declined.
fn answer(verdict: Verdict, fresh: bool) -> Response {
    match verdict {
        Verdict::Applied(applied) => {
            (if fresh { StatusCode::CREATED } else { StatusCode::OK }, Json(applied)).into_response()
        }
        Verdict::Declined(declined) => (StatusCode::PAYMENT_REQUIRED, Json(declined)).into_response(),
    }
}

/// The simulator's routes.
pub fn router(sim: Arc<Simulator>) -> Router {
    Router::new()
        .route("/v1/instructions", post(instruct))
        .route("/v1/instructions/{key}", get(probe))
        .route("/v1/statement", get(statement))
        .route("/v1/declines", get(declines))
        .route("/v1/returns", put(make_return).get(returns))
        .route("/v1/probes", get(probes))
        .route("/v1/sends", get(sends))
        .route("/v1/notifications", get(notifications))
        .route("/v1/faults", put(set_faults).delete(reset_faults).get(show_faults))
        .route("/v1/rules", put(set_rules).delete(reset_rules).get(show_rules))
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
    tracing::info!(rail = %sim.name, key, trace_id = trace_id(&headers), "instruction received");
    let faults = sim.faults();
    tokio::time::sleep(Duration::from_millis(faults.latency_ms)).await;
    if fastrand::f64() < faults.error_rate {
        return (StatusCode::SERVICE_UNAVAILABLE, "simulated outage: nothing applied").into_response();
    }
    *sim.book().sends.entry(key.to_owned()).or_default() += 1;
    match sim.record(key, instruction) {
        Ok((verdict, fresh)) => {
            if fresh {
                sim.notify(|id| match verdict.clone() {
                    Verdict::Applied(applied) => Notice::Applied { id, applied },
                    Verdict::Declined(declined) => Notice::Declined { id, declined },
                });
                if matches!(verdict, Verdict::Applied(_)) && fastrand::f64() < faults.return_rate {
                    let (sim, key) = (sim.clone(), key.to_owned());
                    tokio::spawn(async move {
                        tokio::time::sleep(Duration::from_millis(faults.delay_ms)).await;
                        sim.return_instruction(&key, "AC04");
                    });
                }
            }
            if fresh && fastrand::f64() < faults.timeout_after_apply_rate {
                tracing::info!(rail = %sim.name, key, "recorded; holding the answer back");
                tokio::time::sleep(HANG).await;
            }
            answer(verdict, fresh)
        }
        Err(first) => (
            StatusCode::UNPROCESSABLE_ENTITY,
            format!("key {key} was used for another instruction (end_to_end_id {first})"),
        )
            .into_response(),
    }
}

async fn probe(State(sim): State<Arc<Simulator>>, headers: HeaderMap, Path(key): Path<String>) -> Response {
    tracing::info!(rail = %sim.name, key, trace_id = trace_id(&headers), "probe received");
    tokio::time::sleep(Duration::from_millis(sim.faults().latency_ms)).await;
    let found = {
        let mut book = sim.book();
        book.probes.push(key.clone());
        book.latest.get(&key).map(|&i| book.entries[i].verdict.clone())
    };
    match found {
        Some(verdict) => answer(verdict, false),
        None => (StatusCode::NOT_FOUND, "no instruction under this key").into_response(),
    }
}

/// Every applied instruction, in order: the money that moved.
async fn statement(State(sim): State<Arc<Simulator>>) -> Json<Vec<Applied>> {
    Json(sim.verdicts(|verdict| if let Verdict::Applied(applied) = verdict { Some(applied.clone()) } else { None }))
}

/// Every declined instruction, in order.
async fn declines(State(sim): State<Arc<Simulator>>) -> Json<Vec<Declined>> {
    Json(sim.verdicts(|verdict| if let Verdict::Declined(declined) = verdict { Some(declined.clone()) } else { None }))
}

/// What `PUT /v1/returns` takes.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ReturnRequest {
    idempotency_key: String,
    #[serde(default = "account_closed")]
    reason_code: String,
}

fn account_closed() -> String {
    "AC04".to_owned()
}

/// Returns an applied instruction (its notification follows); 404 if none
/// was applied under the key.
async fn make_return(State(sim): State<Arc<Simulator>>, Json(asked): Json<ReturnRequest>) -> Response {
    match sim.return_instruction(&asked.idempotency_key, &asked.reason_code) {
        Some(returned) => Json(returned).into_response(),
        None => (StatusCode::NOT_FOUND, "no instruction applied under this key").into_response(),
    }
}

/// Every return decided, in order.
async fn returns(State(sim): State<Arc<Simulator>>) -> Json<Vec<Returned>> {
    let book = sim.book();
    Json(book.returned.iter().filter_map(|key| book.returns.get(key).cloned()).collect())
}

/// Every key probed, in order.
async fn probes(State(sim): State<Arc<Simulator>>) -> Json<Vec<String>> {
    Json(sim.book().probes.clone())
}

/// How its notifications stand (all zero without a callback).
async fn notifications(State(sim): State<Arc<Simulator>>) -> Json<notify::Tally> {
    let notifier = sim.notifier.lock().unwrap_or_else(|p| p.into_inner()).clone();
    Json(notifier.map(|n| n.tally()).unwrap_or_default())
}

/// How many instructions were taken under each key (new or repeats; a 503
/// takes nothing).
async fn sends(State(sim): State<Arc<Simulator>>) -> Json<BTreeMap<String, u32>> {
    Json(sim.book().sends.clone())
}

async fn set_rules(State(sim): State<Arc<Simulator>>, Json(rules): Json<Rules>) -> Json<Rules> {
    sim.set_rules(rules.clone());
    Json(rules)
}

async fn reset_rules(State(sim): State<Arc<Simulator>>) -> StatusCode {
    sim.set_rules(Rules::default());
    StatusCode::NO_CONTENT
}

async fn show_rules(State(sim): State<Arc<Simulator>>) -> Json<Rules> {
    Json(sim.rules())
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

/// Serves `sim` on `listener` until `shutdown` resolves.
pub async fn serve(
    listener: tokio::net::TcpListener,
    sim: Arc<Simulator>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, router(sim)).with_graceful_shutdown(shutdown).await
}
