//! Owner writes whose reply is lost. The SDK retries a write that already
//! landed; the retry must never act on an item that is no longer the
//! writer's. The classic case: an attempt forgets its claim (nothing was
//! committed), the delete lands but its reply is lost, the client retries
//! meanwhile and a new claim at fence 1 works the payment; then the SDK's
//! retried delete arrives. Conditioned on the fence alone it would delete
//! the new owner's claim, and a third retry would pay a second time.

use std::time::Duration;

use keyfence::domain::{IdempotencyKey, ScopedKey};
use keyfence::keystore::{KeyState, KeyStore};
use reqwest::StatusCode;
use serde_json::json;

use crate::app::{TestApp, payment, spawn_app_with};
use crate::harness::eventually;

/// The first transaction that tries to create a request row fails once
/// with a serialisation failure (a transient database error), so the
/// attempt that made it hands its claim back untouched.
async fn fail_the_first_phase_once(app: &TestApp) {
    for statement in [
        "CREATE SEQUENCE first_phase_failures",
        "CREATE FUNCTION fail_once() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
             IF nextval('first_phase_failures') = 1 THEN
                 RAISE EXCEPTION 'injected serialisation failure' USING ERRCODE = '40001';
             END IF;
             RETURN NEW;
         END $$",
        "CREATE TRIGGER fail_once BEFORE INSERT ON requests FOR EACH ROW EXECUTE FUNCTION fail_once()",
    ] {
        sqlx::query(statement).execute(app.db.ledger.pool()).await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_forget_never_deletes_a_newer_claim() {
    let app = spawn_app_with(|s| {
        (s.engine.rails.rail_timeout, s.engine.rails.rail_attempts) = (Duration::from_secs(5), 1);
        s.engine.work.lease = Duration::from_secs(15);
    })
    .await;
    fail_the_first_phase_once(&app).await;
    // The forget lands; its reply is lost 1.5 s later and the SDK retries it.
    app.keys.arm(json!({ "operation": "DeleteItem", "count": 1, "action": "drop_reply", "delay_ms": 1500 })).await;
    // The second attempt is still at E1 when the retried delete arrives.
    app.e1.set_faults(json!({ "latency_ms": 3000 })).await;
    let body = payment("E2E-LOST-REPLY");
    let key = ScopedKey::new(app.client_id().await, IdempotencyKey::parse("lost-reply-1").unwrap());

    let first = app.pay_in_background(&app.url, "lost-reply-1", &body);
    eventually("the first attempt's forget lands", async || {
        sqlx::query_scalar::<_, bool>("SELECT is_called FROM first_phase_failures")
            .fetch_one(app.db.ledger.pool())
            .await
            .unwrap()
            && app.keys.store.get(&key).await.unwrap().is_none()
    })
    .await;

    let second = app.pay("lost-reply-1", &body).await;
    assert_eq!(second.status(), StatusCode::CREATED, "the second attempt worked it");
    let answer = second.bytes().await.unwrap();
    let first = first.await.unwrap().unwrap();
    assert_eq!(first.status(), StatusCode::SERVICE_UNAVAILABLE, "the first attempt failed transiently");

    let item = app.keys.store.get(&key).await.unwrap().expect("the new claim survived the retried delete");
    assert_eq!(item.state, KeyState::Finished);
    let third = app.pay("lost-reply-1", &body).await;
    assert_eq!(third.headers()["idempotent-replayed"], "true", "a third attempt replays");
    assert_eq!(third.bytes().await.unwrap(), answer, "one answer");
    assert_eq!(app.count("payments").await, 1, "one payment");
    assert_eq!(app.e1.statement().await.len(), 1);
    assert_eq!(app.e2.statement().await.len(), 1);
    assert_eq!(app.unbalanced_payments().await, 0);
}
