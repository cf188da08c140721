//! Declines are final answers: screening (E1) rejects or the rail (E2)
//! declines, the hold goes back to the debtor, the payment shows `rejected`
//! with the reason, and every retry replays the same 402 bytes. A storm of
//! identical requests records one decline; a decline whose answer was lost
//! is found by the probe and ends the same way.

use std::time::Duration;

use futures::future::join_all;
use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::app::{TestApp, payment, spawn_app, spawn_app_with};

const CREDITOR: &str = "FR1420041010050500013M02606";

/// What one request got: status, whether it was a replay, and the body.
struct Reply {
    status: StatusCode,
    replayed: bool,
    body: Vec<u8>,
}

async fn send(app: &TestApp, key: &str, body: &Value) -> Reply {
    let response = app.pay(key, body).await;
    let status = response.status();
    let replayed = response.headers().get("idempotent-replayed").is_some();
    Reply { status, replayed, body: response.bytes().await.unwrap().to_vec() }
}

/// `n` identical requests at once; every one must be a 402 or a 409, and
/// exactly one of them did the work. Returns the 402's bytes.
async fn storm_of_declines(app: &TestApp, key: &str, body: &Value, n: usize) -> Vec<u8> {
    let replies = join_all((0..n).map(|_| send(app, key, body))).await;
    let first: Vec<&Reply> =
        replies.iter().filter(|r| r.status == StatusCode::PAYMENT_REQUIRED && !r.replayed).collect();
    assert_eq!(first.len(), 1, "exactly one request worked the payment");
    let bytes = first[0].body.clone();
    for reply in &replies {
        match reply.status {
            StatusCode::PAYMENT_REQUIRED => assert_eq!(reply.body, bytes, "every 402 carries the same bytes"),
            StatusCode::CONFLICT => {}
            other => panic!("a storm request got {other}: {}", String::from_utf8_lossy(&reply.body)),
        }
    }
    let again = send(app, key, body).await;
    assert_eq!((again.status, again.replayed), (StatusCode::PAYMENT_REQUIRED, true));
    assert_eq!(again.body, bytes, "a later retry replays the exact bytes");
    bytes
}

/// What the postings leave on the accounts matching `pattern` (SQL LIKE).
async fn balance(app: &TestApp, pattern: &str) -> i64 {
    sqlx::query_scalar("SELECT coalesce(sum(amount_minor), 0)::bigint FROM postings WHERE account LIKE $1")
        .bind(pattern)
        .fetch_one(app.db.ledger.pool())
        .await
        .unwrap()
}

/// The 402's problem details, and the payment it names as the API shows it.
async fn declined_payment(app: &TestApp, bytes: &[u8], reason: &str) -> Value {
    let problem: Value = serde_json::from_slice(bytes).unwrap();
    assert_eq!(problem["type"], "urn:keyfence:problem:payment-declined");
    assert_eq!(problem["status"], 402);
    assert_eq!(problem["reason"], reason);
    let id = problem["id"].as_str().expect("the problem names the payment");
    let shown: Value = app.get_as(&app.api_key, &format!("/v1/payments/{id}")).await.json().await.unwrap();
    assert_eq!(shown["status"], "rejected");
    assert_eq!(shown["reason"], reason);
    shown
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn screening_rejects_once_and_the_rail_never_hears_of_it() {
    let app = spawn_app().await;
    app.e1.set_rules(json!({ "decline_creditor_accounts": [CREDITOR] })).await;
    let body = payment("E2E-SCREENED");

    let bytes = storm_of_declines(&app, "screened-1", &body, 20).await;
    declined_payment(&app, &bytes, "creditor_account_blocked").await;

    assert_eq!(app.e1.declines().await.len(), 1, "one rejection recorded at E1");
    assert!(app.e1.statement().await.is_empty());
    assert!(app.e2.statement().await.is_empty() && app.e2.declines().await.is_empty(), "E2 never asked");
    assert_eq!(app.count("payments").await, 1);
    assert_eq!(app.count("postings").await, 4, "the hold, and its release");
    assert_eq!(app.unbalanced_payments().await, 0);
    let events: Vec<String> =
        sqlx::query_scalar("SELECT event FROM outbox").fetch_all(app.db.ledger.pool()).await.unwrap();
    assert_eq!(events, ["payment.rejected"]);
    assert_eq!(balance(&app, "debtor:%").await, 0, "the debtor has its funds back");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_rail_declines_once_and_the_funds_come_back_from_clearing() {
    let app = spawn_app().await;
    app.e2.set_rules(json!({ "max_amount_minor": 1000 })).await;
    let body = payment("E2E-DECLINED");

    let bytes = storm_of_declines(&app, "declined-1", &body, 20).await;
    declined_payment(&app, &bytes, "amount_over_limit").await;

    assert_eq!(app.e1.statement().await.len(), 1, "screening passed once");
    assert_eq!(app.e2.declines().await.len(), 1, "one decline recorded at E2");
    assert!(app.e2.statement().await.is_empty(), "no money moved at the rail");
    assert_eq!(app.count("postings").await, 6, "hold, clear, and the release from clearing");
    assert_eq!(app.unbalanced_payments().await, 0);
    assert_eq!(balance(&app, "clearing:rail").await, 0, "nothing left in clearing");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decline_whose_answer_was_lost_is_found_by_the_probe() {
    let app = spawn_app_with(|s| s.engine.rails.rail_timeout = Duration::from_millis(500)).await;
    app.e2.set_rules(json!({ "decline_creditor_accounts": [CREDITOR] })).await;
    app.e2.set_faults(json!({ "timeout_after_apply_rate": 1.0 })).await;
    let body = payment("E2E-LOST-DECLINE");

    let first = send(&app, "lost-decline-1", &body).await;
    assert_eq!(first.status, StatusCode::ACCEPTED, "the outcome is unknown, not failed");
    assert_eq!(app.e2.declines().await.len(), 1, "the rail recorded its decline");

    app.e2.clear_faults().await;
    let retry = send(&app, "lost-decline-1", &body).await;
    assert_eq!((retry.status, retry.replayed), (StatusCode::PAYMENT_REQUIRED, false), "the probe found the decline");
    let again = send(&app, "lost-decline-1", &body).await;
    assert_eq!((again.status, again.replayed), (StatusCode::PAYMENT_REQUIRED, true));
    assert_eq!(again.body, retry.body);
    let shown = declined_payment(&app, &retry.body, "creditor_account_blocked").await;
    let pending: Value = serde_json::from_slice(&first.body).unwrap();
    assert_eq!(shown["id"], pending["id"], "the same payment ends rejected");
    assert_eq!(app.e2.declines().await.len(), 1, "probed, not sent again");
    app.e2.assert_probed_not_resent("E2").await;
    assert!(app.e2.statement().await.is_empty());
    assert_eq!(app.unbalanced_payments().await, 0);
}
