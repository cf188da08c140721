//! Rail faults at the front door: an unknown outcome is answered 202 and
//! never as a failure; a rail outage is a transient 503 that is never stored.
//! Either way the next retry finishes the payment with exactly one
//! instruction at each rail.

use std::time::Duration;

use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::app::{payment, spawn_app_with};

#[tokio::test]
async fn a_timeout_after_the_rail_applied_is_pending_then_finishes_once() {
    let app = spawn_app_with(|s| s.engine.rails.rail_timeout = Duration::from_millis(500)).await;
    app.e2.set_faults(json!({ "timeout_after_apply_rate": 1.0 })).await;
    let body = payment("E2E-TIMEOUT");

    let first = app.pay("t-1", &body).await;
    assert_eq!(first.status(), StatusCode::ACCEPTED);
    let location = first.headers()["location"].to_str().unwrap().to_owned();
    let pending: Value = first.json().await.unwrap();
    assert_eq!(pending["status"], "pending");
    let shown: Value = app.get_as(&app.api_key, &location).await.json().await.unwrap();
    assert_eq!(shown["status"], "pending", "an unknown outcome is never shown as failed");
    assert_eq!(app.e2.statement().await.len(), 1, "the rail applied it");
    let key: Value = app.get_as(&app.api_key, "/v1/idempotency-keys/t-1").await.json().await.unwrap();
    assert_eq!(key["state"], "started", "a 202 is not a final answer");

    app.e2.clear_faults().await;
    let retry = app.pay("t-1", &body).await;
    assert_eq!(retry.status(), StatusCode::CREATED);
    let done: Value = retry.json().await.unwrap();
    assert_eq!(done["id"], pending["id"], "the retry finishes the same payment");
    assert_eq!(done["status"], "succeeded");
    assert_eq!(app.e2.statement().await.len(), 1, "exactly one instruction at E2");
    assert_eq!(app.e1.statement().await.len(), 1);
    assert_eq!(app.count("payments").await, 1);
    assert_eq!(app.unbalanced_payments().await, 0);
    let attempts: i32 = sqlx::query_scalar("SELECT attempts FROM external_calls WHERE step = 'ext2'")
        .fetch_one(app.db.ledger.pool())
        .await
        .unwrap();
    assert_eq!(attempts, 2, "the unknown attempt was recorded");
}

#[tokio::test]
async fn a_rail_outage_is_transient_and_the_retry_succeeds() {
    let app = spawn_app_with(|_| {}).await;
    app.e2.set_faults(json!({ "error_rate": 1.0 })).await;
    let body = payment("E2E-OUTAGE");

    let first = app.pay("o-1", &body).await;
    assert_eq!(first.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert!(first.headers().get("retry-after").is_some());
    assert_eq!(first.headers()["content-type"], "application/problem+json");
    assert!(app.e2.statement().await.is_empty(), "a 503 applied nothing");
    let key: Value = app.get_as(&app.api_key, "/v1/idempotency-keys/o-1").await.json().await.unwrap();
    assert_eq!(key["state"], "started", "the 503 was not stored as the answer");

    app.e2.clear_faults().await;
    let retry = app.pay("o-1", &body).await;
    assert_eq!(retry.status(), StatusCode::CREATED, "{}", retry.text().await.unwrap());
    assert_eq!(app.e2.statement().await.len(), 1);
    assert_eq!(app.e1.statement().await.len(), 1, "E1 was not asked twice");
    assert_eq!(app.count("payments").await, 1);

    let replay = app.pay("o-1", &body).await;
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
}
