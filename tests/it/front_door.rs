//! The front door over real HTTP, the real emulator, PostgreSQL and two
//! rail simulators: retries take effect once, answers replay byte for byte,
//! keys are scoped per client, and bad input is refused with nothing written.

use std::collections::BTreeMap;

use futures::future::join_all;
use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::app::{TestApp, payment, spawn_app, spawn_app_with};

const SAME_KEY_RACERS: usize = 100;

async fn assert_one_effect(app: &TestApp) {
    assert_eq!(app.count("payments").await, 1, "payments in the ledger");
    assert_eq!(app.count("postings").await, 6, "three balanced entries of two legs");
    assert_eq!(app.unbalanced_payments().await, 0);
    assert_eq!(app.e1.statement().await.len(), 1, "instructions at E1");
    assert_eq!(app.e2.statement().await.len(), 1, "instructions at E2");
    for rail in [&app.e1, &app.e2] {
        assert_eq!(rail.sent_again().await, BTreeMap::new(), "each derived key sent once");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_identical_posts_take_effect_once() {
    let app = spawn_app().await;
    let body = payment("E2E-RACE");
    let responses = join_all((0..SAME_KEY_RACERS).map(|_| app.pay("race-key", &body))).await;

    let mut created = Vec::new();
    let mut in_flight = 0;
    for response in responses {
        match response.status() {
            StatusCode::CREATED => {
                let replayed = response.headers().get("idempotent-replayed").is_some();
                created.push((replayed, response.bytes().await.unwrap()));
            }
            StatusCode::CONFLICT => {
                let retry_after = response.headers().get("retry-after").expect("409 carries Retry-After");
                assert!(retry_after.to_str().unwrap().parse::<u64>().unwrap() >= 1);
                in_flight += 1;
            }
            other => panic!("unexpected answer {other}: {}", response.text().await.unwrap()),
        }
    }
    assert_eq!(created.len() + in_flight, SAME_KEY_RACERS);
    assert_eq!(created.iter().filter(|(replayed, _)| !replayed).count(), 1, "exactly one fresh 201");
    let first = &created[0].1;
    assert!(created.iter().all(|(_, body)| body == first), "every 201 body is byte-identical");
    assert_one_effect(&app).await;

    let again = app.pay("race-key", &body).await;
    assert_eq!(again.status(), StatusCode::CREATED);
    assert_eq!(&again.bytes().await.unwrap(), first);
    assert_one_effect(&app).await;
}

#[tokio::test]
async fn a_finished_request_replays_byte_for_byte() {
    let app = spawn_app().await;
    let body = payment("E2E-1");
    let first = app.pay("k-1", &body).await;
    assert_eq!(first.status(), StatusCode::CREATED);
    assert!(first.headers().get("idempotent-replayed").is_none());
    let location = first.headers()["location"].to_str().unwrap().to_owned();
    let first_bytes = first.bytes().await.unwrap();
    let created: Value = serde_json::from_slice(&first_bytes).unwrap();
    assert_eq!(created["status"], "succeeded");
    assert_eq!(location, format!("/v1/payments/{}", created["id"].as_str().unwrap()));

    // Same body, keys in another order and other whitespace: the same request.
    let reordered: Value = serde_json::from_str(
        "{ \"remittance_info\": \"invoice 42\", \"end_to_end_id\": \"E2E-1\", \"currency\": \"EUR\",
            \"creditor_account\": \"FR1420041010050500013M02606\", \"amount_minor\": 1250,
            \"debtor_account\": \"DE89370400440532013000\" }",
    )
    .unwrap();
    for retry in [&body, &reordered] {
        let replay = app.pay("k-1", retry).await;
        assert_eq!(replay.status(), StatusCode::CREATED);
        assert_eq!(replay.headers()["idempotent-replayed"], "true");
        assert_eq!(replay.headers()["location"].to_str().unwrap(), location);
        assert_eq!(replay.bytes().await.unwrap(), first_bytes);
    }
    assert_one_effect(&app).await;

    // Same key, another payment: refused, nothing more happens.
    let mut other = body.clone();
    other["amount_minor"] = json!(9999);
    let reused = app.pay("k-1", &other).await;
    assert_eq!(reused.status(), StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(reused.headers()["content-type"], "application/problem+json");
    assert_one_effect(&app).await;

    // Same body under a new key: a second, separate payment.
    let second = app.pay("k-2", &body).await;
    assert_eq!(second.status(), StatusCode::CREATED);
    let second: Value = second.json().await.unwrap();
    assert_ne!(second["id"], created["id"]);
    assert_eq!(app.count("payments").await, 2);
    assert_eq!(app.e2.statement().await.len(), 2);
    assert_eq!(app.e2.sends().await.values().max(), Some(&1), "each derived key sent once");
}

#[tokio::test]
async fn keys_and_payments_are_scoped_to_their_client() {
    let app = spawn_app().await;
    let (_, other_key) = app.add_client().await;
    let body = payment("E2E-SHARED");

    let mine: Value = app.pay("shared-key", &body).await.json().await.unwrap();
    let theirs = app.pay_as(&other_key, "shared-key", &body).await;
    assert_eq!(theirs.status(), StatusCode::CREATED, "the same key string is another client's own key");
    assert!(theirs.headers().get("idempotent-replayed").is_none());
    let theirs: Value = theirs.json().await.unwrap();
    assert_ne!(mine["id"], theirs["id"]);
    assert_eq!(app.count("payments").await, 2);
    assert_eq!(app.e2.statement().await.len(), 2);

    let mine_path = format!("/v1/payments/{}", mine["id"].as_str().unwrap());
    assert_eq!(app.get_as(&app.api_key, &mine_path).await.status(), StatusCode::OK);
    let probe = app.get_as(&other_key, &mine_path).await;
    assert_eq!(probe.status(), StatusCode::NOT_FOUND, "another client's payment is not found");
    let unknown = app.get_as(&app.api_key, "/v1/payments/00000000-0000-0000-0000-000000000000").await;
    assert_eq!(unknown.status(), StatusCode::NOT_FOUND);

    let key_view: Value = app.get_as(&app.api_key, "/v1/idempotency-keys/shared-key").await.json().await.unwrap();
    assert_eq!(key_view["state"], "finished");
    assert_eq!(key_view["payment_id"], mine["id"]);
    let (_, third_key) = app.add_client().await;
    let hidden = app.get_as(&third_key, "/v1/idempotency-keys/shared-key").await;
    assert_eq!(hidden.status(), StatusCode::NOT_FOUND, "a key this client never used is not found");

    let listed: Value = app.get_as(&app.api_key, "/v1/payments?end_to_end_id=E2E-SHARED").await.json().await.unwrap();
    assert_eq!(listed["data"].as_array().unwrap().len(), 1, "only the caller's own payments are listed");
    assert_eq!(listed["data"][0]["id"], mine["id"]);
}

#[tokio::test]
async fn bad_input_gets_a_clear_error_and_writes_nothing() {
    let app = spawn_app_with(|s| s.body_limit = 2048).await;
    let url = format!("{}/v1/payments", app.url);
    let valid = payment("E2E-BAD").to_string();
    let post = |key: Option<&str>, auth: Option<&str>, content_type: &str, body: String| {
        let mut request = app.http.post(&url).header("content-type", content_type).body(body);
        if let Some(key) = key {
            request = request.header("Idempotency-Key", key);
        }
        if let Some(auth) = auth {
            request = request.bearer_auth(auth);
        }
        request.send()
    };
    let me = Some(app.api_key.as_str());
    let json = "application/json";
    let mut invalid_amount = payment("E2E-BAD");
    invalid_amount["amount_minor"] = json!(-5);
    let mut unknown_field = payment("E2E-BAD");
    unknown_field["priority"] = json!("urgent");
    let cases = [
        ("missing key", post(None, me, json, valid.clone()).await, StatusCode::BAD_REQUEST),
        ("key too long", post(Some(&"k".repeat(256)), me, json, valid.clone()).await, StatusCode::BAD_REQUEST),
        ("key charset", post(Some("key with spaces"), me, json, valid.clone()).await, StatusCode::BAD_REQUEST),
        ("malformed JSON", post(Some("k"), me, json, "{\"amount_minor\": ".into()).await, StatusCode::BAD_REQUEST),
        (
            "wrong content type",
            post(Some("k"), me, "text/plain", valid.clone()).await,
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
        ),
        ("invalid field", post(Some("k"), me, json, invalid_amount.to_string()).await, StatusCode::BAD_REQUEST),
        ("unknown field", post(Some("k"), me, json, unknown_field.to_string()).await, StatusCode::BAD_REQUEST),
        ("no credentials", post(Some("k"), None, json, valid.clone()).await, StatusCode::UNAUTHORIZED),
        ("unknown credentials", post(Some("k"), Some("kf_nope"), json, valid.clone()).await, StatusCode::UNAUTHORIZED),
        ("body too large", post(Some("k"), me, json, " ".repeat(4096) + &valid).await, StatusCode::PAYLOAD_TOO_LARGE),
    ];
    for (case, response, expected) in cases {
        let response = response.unwrap_or_else(|e| panic!("{case}: no answer: {e}"));
        assert_eq!(response.status(), expected, "{case}");
        assert_eq!(response.headers()["content-type"], "application/problem+json", "{case}");
        let problem: Value = response.json().await.unwrap();
        assert_eq!(problem["status"], expected.as_u16(), "{case}");
        assert!(problem["detail"].as_str().is_some_and(|d| !d.is_empty()), "{case}: a detail says what is wrong");
    }
    assert_eq!(app.key_items().await, 0, "nothing in the key store");
    assert_eq!(app.count("requests").await, 0, "nothing in the ledger");
    assert_eq!(app.count("payments").await, 0);
    assert!(app.e1.statement().await.is_empty() && app.e2.statement().await.is_empty(), "nothing at the rails");

    // The same key, now with a valid request, works normally.
    assert_eq!(post(Some("k"), me, json, valid).await.unwrap().status(), StatusCode::CREATED);
}
