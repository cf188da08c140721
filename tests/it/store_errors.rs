//! Store errors are never 500. Every DynamoDB error class that means "not
//! now" (throttling, a write racing another region's, an internal error, a
//! timeout) is retried by the SDK and then answered 503 problem+json with
//! Retry-After; so is a PostgreSQL connection failure. Nothing is stored as
//! final, and the client's next retry completes the payment once.

use std::time::Duration;

use keyfence::domain::{IdempotencyKey, ScopedKey};
use keyfence::keystore::KeyStore;
use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::app::{TestApp, payment, spawn_app_with, start_serving};
use crate::harness::eventually;

/// Attempts per key-store request in these tests (the SDK's retries included).
const ATTEMPTS: u32 = 3;

/// Asserts a transient refusal: 503, problem+json, Retry-After.
async fn assert_unavailable(response: reqwest::Response, what: &str) {
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE, "{what}");
    assert!(response.headers().get("retry-after").is_some(), "{what}: Retry-After");
    assert_eq!(response.headers()["content-type"], "application/problem+json", "{what}");
    let problem: Value = response.json().await.unwrap();
    assert_eq!(problem["type"], "urn:keyfence:problem:temporarily-unavailable", "{what}");
}

async fn key_exists(app: &TestApp, key: &str) -> bool {
    let scoped = ScopedKey::new(app.client_id().await, IdempotencyKey::parse(key).unwrap());
    app.keys.store.get(&scoped).await.unwrap().is_some()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_transient_store_error_is_a_503_that_stores_nothing() {
    let app = spawn_app_with(|s| s.engine.keys.max_attempts = Some(ATTEMPTS)).await;
    let codes = [
        "ThrottlingException",
        "ProvisionedThroughputExceededException",
        "RequestLimitExceeded",
        "InternalServerError",
        "ServiceUnavailable",
        "ReplicatedWriteConflictException",
    ];
    for (i, code) in codes.iter().enumerate() {
        let (key, body) = (format!("err-{i}"), payment(&format!("E2E-ERR-{i}")));
        app.keys.arm(json!({ "operation": "PutItem", "count": ATTEMPTS, "action": "error", "code": code })).await;
        assert_unavailable(app.pay(&key, &body).await, code).await;
        assert!(!key_exists(&app, &key).await, "{code}: nothing claimed");

        // One error fewer than the attempts: the SDK's own retry gets through.
        app.keys.arm(json!({ "operation": "PutItem", "count": ATTEMPTS - 1, "action": "error", "code": code })).await;
        let retry = app.pay(&key, &body).await;
        assert_eq!(retry.status(), StatusCode::CREATED, "{code}: {}", retry.text().await.unwrap());
    }
    assert_eq!(app.count("payments").await, codes.len() as i64, "one payment per key");
    assert_eq!(app.e2.statement().await.len(), codes.len());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_store_that_stops_answering_is_a_503_and_the_retry_finishes_once() {
    let app = spawn_app_with(|s| {
        s.engine.keys.max_attempts = Some(ATTEMPTS);
        s.engine.keys.attempt_timeout = Duration::from_millis(300);
        s.engine.work.lease = Duration::from_millis(1000);
        (s.engine.rails.rail_timeout, s.engine.rails.rail_attempts) = (Duration::from_millis(300), 1);
    })
    .await;
    let body = payment("E2E-TIMEOUT");
    // Every attempt lands but its answer never comes back in time.
    app.keys.arm(json!({ "operation": "PutItem", "count": ATTEMPTS, "action": "drop_reply", "delay_ms": 600 })).await;
    assert_unavailable(app.pay("timeout-1", &body).await, "timeouts").await;

    // The claim landed, so the retry finds it in flight until its lease
    // ends, then takes it over and finishes it.
    let mut last = StatusCode::CONFLICT;
    eventually("the retry finishes the payment", async || {
        last = app.pay("timeout-1", &body).await.status();
        assert!(matches!(last, StatusCode::CONFLICT | StatusCode::CREATED), "retry got {last}");
        last == StatusCode::CREATED
    })
    .await;
    assert_eq!(app.count("payments").await, 1);
    assert_eq!(app.e2.statement().await.len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ledger_that_cannot_be_reached_is_a_503() {
    let app = spawn_app_with(|_| {}).await;
    let (proxy, settings) = app.behind_a_proxied_ledger().await;
    let served = start_serving(&settings).await;
    let (instance, admin) = (served.url.clone(), served.admin_url.clone());
    let body = payment("E2E-NO-LEDGER");

    proxy.cut();
    let cut = app.try_pay_at(&instance, &app.api_key, "no-ledger-1", &body).await.unwrap();
    assert_unavailable(cut, "ledger unreachable").await;
    assert!(!key_exists(&app, "no-ledger-1").await, "nothing claimed");
    let ready = app.http.get(format!("{admin}/readyz")).send().await.unwrap();
    assert_eq!(ready.status(), StatusCode::SERVICE_UNAVAILABLE, "not ready without its ledger");
    let ready: Value = ready.json().await.unwrap();
    assert_eq!((ready["key_table"].as_str(), ready["ledger"].as_str() != Some("ok")), (Some("ok"), true), "{ready}");

    proxy.heal();
    let ready = app.http.get(format!("{admin}/readyz")).send().await.unwrap();
    assert_eq!(ready.status(), StatusCode::OK, "ready again");
    let healed = app.try_pay_at(&instance, &app.api_key, "no-ledger-1", &body).await.unwrap();
    assert_eq!(healed.status(), StatusCode::CREATED);
    assert_eq!(app.count("payments").await, 1);
}
