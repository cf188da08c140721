//! Derived keys and the rails' memory. Real rails deduplicate a key only
//! for a while, so anything that may send what an earlier attempt already
//! sent probes first; and derived keys are unique per claim, so a client
//! key reused after its retention is a new payment at the rail, not a
//! replay of the old instruction.

use std::time::Duration;

use aws_sdk_dynamodb::types::AttributeValue;
use keyfence::domain::Millis;
use keyfence::keystore::KeyStore;
use reqwest::StatusCode;
use serde_json::Value;

use crate::app::{TestRail, payment, spawn_app, spawn_app_on, start_instance};
use crate::reconcile::{lose_from_ledger, pay_once, reconcile};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rebuild_after_the_rails_forgot_the_keys_sends_nothing_twice() {
    let window = Some(Duration::from_millis(200));
    let (e1, e2) = (TestRail::start_with("e1", window).await, TestRail::start_with("e2", window).await);
    let app = spawn_app_on(e1, e2, |_| {}).await;
    let (key, bytes) = pay_once(&app, "forgotten-1").await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    lose_from_ledger(&app, &key).await;

    let repaired = reconcile(&app, true).await;
    assert_eq!(repaired.unrepaired(), 0, "{}", repaired.table());
    assert_eq!(app.e1.statement().await.len(), 1, "probed, not sent again past the dedup window");
    assert_eq!(app.e2.statement().await.len(), 1);
    app.e1.assert_probed_not_resent("E1").await;
    app.e2.assert_probed_not_resent("E2").await;
    let stored = app.keys.store.get(&key).await.unwrap().unwrap();
    assert_eq!(stored.response.unwrap().body, bytes);
}

#[tokio::test]
async fn a_key_reused_after_its_retention_is_a_new_payment() {
    let app = spawn_app().await;
    let body = payment("E2E-REUSED");
    let (key, first) = pay_once(&app, "reused-1").await;
    // Past its time-to-live and the grace after it; the store has not reaped it yet.
    app.keys
        .store
        .client()
        .update_item()
        .table_name(app.keys.store.table())
        .key("pk", AttributeValue::S(key.partition_key()))
        .update_expression("SET expires_at = :past")
        .expression_attribute_values(":past", AttributeValue::N((Millis::now().as_secs() - 3600).to_string()))
        .send()
        .await
        .unwrap();
    let gone = app.get_as(&app.api_key, "/v1/idempotency-keys/reused-1").await;
    assert_eq!(gone.status(), StatusCode::NOT_FOUND, "an expired key is gone");

    // Days later, on an instance that does not remember the first answer
    // (the first one's memory of it would have expired with the key; here
    // only the store's copy was moved into the past).
    let (later, _stop) = start_instance(&app.settings).await;
    let again = app.try_pay_at(&later, &app.api_key, "reused-1", &body).await.unwrap();
    assert_eq!(again.status(), StatusCode::CREATED);
    assert!(again.headers().get("idempotent-replayed").is_none(), "a new payment, not a replay");
    let (first, second): (Value, Value) = (serde_json::from_slice(&first).unwrap(), again.json().await.unwrap());
    assert_ne!(first["id"], second["id"]);
    assert_eq!(app.count("payments").await, 2);
    for rail in [&app.e1, &app.e2] {
        let statement = rail.statement().await;
        assert_eq!(statement.len(), 2, "two instructions, not a replay of the old one");
        assert_ne!(statement[0].idempotency_key, statement[1].idempotency_key);
    }
}
