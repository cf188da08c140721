//! A rail that answers nothing for a while: the payment parks (202), the
//! recovery worker keeps probing and, after the configured attempts, lists
//! it as indeterminate; when the rail answers again the payment finishes
//! once, and the client's retry gets the final answer.

use std::time::Duration;

use keyfence::domain::{IdempotencyKey, ScopedKey};
use keyfence::keystore::{KeyState, KeyStore};
use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::app::{TestApp, payment, spawn_app_with};
use crate::harness::eventually;

async fn payment_status(app: &TestApp, location: &str) -> String {
    let shown: Value = app.get_as(&app.api_key, location).await.json().await.unwrap();
    shown["status"].as_str().unwrap().to_owned()
}

/// A front door whose recovery worker probes parked payments every 200 ms
/// and lists one for settlement after three unknown outcomes.
async fn silent_rail_app() -> TestApp {
    spawn_app_with(|s| {
        s.engine.work.lease = Duration::from_millis(1000);
        s.engine.rails.rail_timeout = Duration::from_millis(300);
        s.engine.rails.rail_attempts = 1;
        s.recovery_interval_ms = 200;
        s.engine.work.max_unknown_attempts = 3;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_rail_parks_the_payment_until_it_answers_again() {
    let app = silent_rail_app().await;
    app.e2.set_faults(json!({ "latency_ms": 60_000 })).await;
    let body = payment("E2E-SILENT");

    let first = app.pay("silent-1", &body).await;
    assert_eq!(first.status(), StatusCode::ACCEPTED);
    let location = first.headers()["location"].to_str().unwrap().to_owned();
    assert_eq!(payment_status(&app, &location).await, "pending");

    // The worker keeps probing; after three unknown attempts it is listed.
    eventually("the payment is marked indeterminate", async || {
        payment_status(&app, &location).await == "indeterminate"
    })
    .await;
    let listed = app.db.ledger.indeterminate().await.unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].step, "ext2");
    assert!(listed[0].attempts >= 3);
    let key = ScopedKey::new(app.client_id().await, IdempotencyKey::parse("silent-1").unwrap());
    assert_eq!(app.keys.store.get(&key).await.unwrap().unwrap().state, KeyState::Started, "never reported as failed");

    app.e2.clear_faults().await;
    eventually("the worker finishes the payment", async || {
        app.keys.store.get(&key).await.unwrap().is_some_and(|item| item.state == KeyState::Finished)
    })
    .await;
    assert_eq!(payment_status(&app, &location).await, "succeeded");
    assert!(app.db.ledger.indeterminate().await.unwrap().is_empty(), "settled calls leave the list");
    let probes_left: i64 = sqlx::query_scalar("SELECT count(*) FROM external_calls WHERE next_probe_at IS NOT NULL")
        .fetch_one(app.db.ledger.pool())
        .await
        .unwrap();
    assert_eq!(probes_left, 0, "and the index of calls in doubt");

    let retry = app.pay("silent-1", &body).await;
    assert_eq!(retry.status(), StatusCode::CREATED);
    assert_eq!(retry.headers()["idempotent-replayed"], "true");
    assert_eq!(app.e2.statement().await.len(), 1, "exactly one instruction at E2");
    assert_eq!(app.e1.statement().await.len(), 1);
    assert_eq!(app.count("payments").await, 1);
    assert_eq!(app.unbalanced_payments().await, 0);
}

/// A payment whose unknown outcomes passed the limit under another setting
/// (a lower `KEYFENCE_MAX_UNKNOWN_ATTEMPTS` after a restart, an instance of
/// a rolling deploy) is marked indeterminate at its next park all the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_payment_past_a_lowered_limit_is_marked_indeterminate_at_its_next_park() {
    let app = silent_rail_app().await;
    app.e2.set_faults(json!({ "latency_ms": 60_000 })).await;
    let first = app.pay("lowered-1", &payment("E2E-LOWERED")).await;
    assert_eq!(first.status(), StatusCode::ACCEPTED);
    let location = first.headers()["location"].to_str().unwrap().to_owned();
    // Parked under a higher limit: more unknown outcomes than this one's.
    sqlx::query("UPDATE external_calls SET attempts = 4 WHERE step = 'ext2'")
        .execute(app.db.ledger.pool())
        .await
        .unwrap();
    eventually("the payment is marked indeterminate", async || {
        payment_status(&app, &location).await == "indeterminate"
    })
    .await;
}
