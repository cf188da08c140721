//! Stored answers are capped (`KEYFENCE_ANSWER_LIMIT`): every field of a
//! request has a length limit, and the largest valid payment and refund
//! answer well within the default cap; an answer over the cap is refused
//! before it is stored, so nothing oversized ever reaches the ledger or a
//! key item.

use keyfence::domain::{ANSWER_LIMIT, IdempotencyKey, ScopedKey};
use keyfence::keystore::{KeyState, KeyStore};
use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::app::{TestApp, payment, spawn_app, spawn_app_with};

/// The longest key, account numbers, reference and texts there are, the
/// texts in characters of four bytes each (the most UTF-8 takes).
fn largest_payment() -> Value {
    json!({
        "amount_minor": 1_000_000_000_000_000_i64,
        "currency": "EUR",
        "debtor_account": "1".repeat(34),
        "creditor_account": "2".repeat(34),
        "end_to_end_id": "\u{1D11E}".repeat(35),
        "remittance_info": "\u{1D11E}".repeat(140),
    })
}

/// The size of the answer the key store holds for `key` of the app's client.
async fn stored_size(app: &TestApp, client: keyfence::domain::ClientId, key: &str) -> usize {
    let item = app.keys.store.get(&ScopedKey::new(client, IdempotencyKey::parse(key).unwrap())).await.unwrap();
    let item = item.expect("the key is stored");
    assert_eq!(item.state, KeyState::Finished);
    item.response.expect("a finished key holds its answer").size()
}

#[tokio::test]
async fn the_largest_valid_payment_and_refund_fit_the_stored_answer_limit() {
    let app = spawn_app().await;
    let (client, api_key) = app.add_client_holding(&[&"1".repeat(34)]).await;
    let key = "k".repeat(255);
    let paid = app.pay_as(&api_key, &key, &largest_payment()).await;
    assert_eq!(paid.status(), StatusCode::CREATED);
    let id = paid.json::<Value>().await.unwrap()["id"].as_str().unwrap().to_owned();
    let payment_answer = stored_size(&app, client, &key).await;

    let refund_key = "r".repeat(255);
    let refunded = app
        .http
        .post(format!("{}/v1/payments/{id}/refunds", app.url))
        .bearer_auth(&api_key)
        .header("Idempotency-Key", &refund_key)
        .json(&json!({ "amount_minor": 1_000_000_000_000_000_i64, "reason": "\u{1D11E}".repeat(140) }))
        .send()
        .await
        .unwrap();
    assert_eq!(refunded.status(), StatusCode::CREATED);
    let refund_answer = stored_size(&app, client, &refund_key).await;

    let limit = ANSWER_LIMIT as usize;
    for (what, size) in [("payment", payment_answer), ("refund", refund_answer)] {
        assert!(size <= limit / 2, "the largest {what} answers in {size} bytes: keep it well under {limit}");
    }
}

#[tokio::test]
async fn an_answer_over_the_limit_is_never_stored() {
    let app = spawn_app_with(|s| s.engine.work.answer_limit = 256).await;
    let answer = app.pay("over-the-limit", &payment("E2E-OVER-LIMIT")).await;
    assert!(answer.status().is_server_error(), "an oversized answer is a fault: {}", answer.status());

    let key = ScopedKey::new(app.client_id().await, IdempotencyKey::parse("over-the-limit").unwrap());
    let item = app.keys.store.get(&key).await.unwrap().expect("the key is kept for the request");
    assert_ne!(item.state, KeyState::Finished, "no answer reached the key item");
    let answers: i64 = sqlx::query_scalar("SELECT count(*) FROM requests WHERE response_body IS NOT NULL")
        .fetch_one(app.db.ledger.pool())
        .await
        .unwrap();
    assert_eq!(answers, 0, "no answer reached the ledger");
    let finished: i64 = sqlx::query_scalar("SELECT count(*) FROM requests WHERE recovery_point = 'FINISHED'")
        .fetch_one(app.db.ledger.pool())
        .await
        .unwrap();
    assert_eq!(finished, 0, "the phase that would store it rolled back");
}
