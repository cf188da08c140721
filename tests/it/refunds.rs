//! Refunds through the real stores and rails: a refund is worked once
//! however often it is sent, no set of refunds ever exceeds its payment
//! (whichever regions work them at once), a declined refund gives its
//! amount back, and every region reads every refund.

use std::time::{Duration, Instant};

use futures::future::join_all;
use keyfence::keystore::KeyStore;
use keyfence::operations::RefundOperation;
use reqwest::StatusCode;
use serde_json::{Value, json};
use uuid::Uuid;

use crate::app::{DEBTOR, TestApp, payment, spawn_app};

/// The amount of [`payment`].
const PAID: i64 = 1250;

impl TestApp {
    /// POSTs a refund of payment `payment` to the front door at `url`.
    pub async fn try_refund_at(
        &self,
        url: &str,
        payment: &str,
        key: &str,
        body: &Value,
    ) -> reqwest::Result<reqwest::Response> {
        self.http
            .post(format!("{url}/v1/payments/{payment}/refunds"))
            .bearer_auth(&self.api_key)
            .header("Idempotency-Key", key)
            .json(body)
            .send()
            .await
    }

    /// Retries a refund until its answer is final (not 409, 202 or 503);
    /// returns the status and the body's bytes.
    pub async fn refund_at(&self, url: &str, payment: &str, key: &str, body: &Value) -> (StatusCode, Vec<u8>) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let answer = self.try_refund_at(url, payment, key, body).await.expect("the service answers");
            let status = answer.status();
            if !matches!(status, StatusCode::CONFLICT | StatusCode::ACCEPTED | StatusCode::SERVICE_UNAVAILABLE) {
                return (status, answer.bytes().await.unwrap().to_vec());
            }
            assert!(Instant::now() < deadline, "the refund {key} had no final answer within 30 s");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Pays [`payment`] and returns its id.
    pub async fn paid(&self, end_to_end_id: &str) -> String {
        let paid = self.pay(&format!("pay-{end_to_end_id}"), &payment(end_to_end_id)).await;
        assert_eq!(paid.status(), StatusCode::CREATED);
        paid.json::<Value>().await.unwrap()["id"].as_str().unwrap().to_owned()
    }

    /// What the payment's refundable balance says has been refunded and reserved.
    pub async fn refunded(&self, payment: &str) -> (i64, i64) {
        let balance = RefundOperation::balance_of(payment.parse().unwrap());
        let balance = self.keys.store.balance(&balance).await.unwrap().unwrap_or_default();
        (balance.settled, balance.reserved)
    }
}

fn refund(amount_minor: i64) -> Value {
    json!({ "amount_minor": amount_minor, "reason": "returned goods" })
}

/// Refunds at the payment rail: its instructions other than the payment's own.
async fn refunds_at_rail(app: &TestApp, amount_minor: i64) -> usize {
    app.e2.statement().await.iter().filter(|a| a.amount_minor == amount_minor).count()
}

async fn rows(pool: &sqlx::PgPool, query: &str) -> i64 {
    sqlx::query_scalar(sqlx::AssertSqlSafe(query.to_owned())).fetch_one(pool).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hundred_identical_refunds_refund_once_with_one_answer() {
    let app = spawn_app().await;
    let paid = app.paid("E2E-REFUND-100").await;
    let body = refund(400);
    let answers = join_all((0..100).map(|_| app.refund_at(&app.url, &paid, "refund-once", &body))).await;
    let (status, first) = answers[0].clone();
    assert_eq!(status, StatusCode::CREATED, "{}", String::from_utf8_lossy(&first));
    assert!(answers.iter().all(|answer| *answer == (StatusCode::CREATED, first.clone())), "one answer, byte for byte");
    let refunded: Value = serde_json::from_slice(&first).unwrap();
    assert_eq!(refunded["payment_id"], paid.as_str());
    assert_eq!((refunded["amount_minor"].as_i64(), refunded["status"].as_str()), (Some(400), Some("succeeded")));
    assert_eq!(refunded["currency"], "EUR");

    assert_eq!(app.count("refunds").await, 1, "one refund in the ledger");
    assert_eq!(refunds_at_rail(&app, 400).await, 1, "one refund instruction at E2");
    assert_eq!(app.unbalanced_payments().await, 0, "every payment and refund balances");
    assert_eq!(app.refunded(&paid).await, (400, 400), "the balance settled the one refund");
    let shown: Value = app.get_as(&app.api_key, &format!("/v1/payments/{paid}")).await.json().await.unwrap();
    assert_eq!(shown["amount_refunded"], 400);
    assert_eq!(shown["status"], "succeeded");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partial_refunds_in_two_regions_at_once_never_exceed_the_payment() {
    let app = spawn_app().await;
    let b = app.second_region("test-2").await;
    let paid = app.paid("E2E-REFUND-SPLIT").await;
    let tenth = PAID / 10;
    let answers = join_all((0..20).map(|i| {
        let url = if i % 2 == 0 { app.url.clone() } else { b.url.clone() };
        let paid = paid.clone();
        let app = &app;
        async move { app.refund_at(&url, &paid, &format!("tenth-{i}"), &refund(tenth)).await }
    }))
    .await;
    let created = answers.iter().filter(|(status, _)| *status == StatusCode::CREATED).count();
    let exceeded: Vec<Value> = answers
        .iter()
        .filter(|(status, _)| *status == StatusCode::UNPROCESSABLE_ENTITY)
        .map(|(_, body)| serde_json::from_slice(body).unwrap())
        .collect();
    assert_eq!((created, exceeded.len()), (10, 10), "{answers:?}");
    assert!(exceeded.iter().all(|p| p["type"] == "urn:keyfence:problem:refund-exceeds-payment"), "{exceeded:?}");
    assert!(exceeded.iter().all(|p| p["refundable_minor"] == 0));
    assert_eq!(refunds_at_rail(&app, tenth).await, 10, "ten refund instructions at E2");

    let (pools, mut refunds, mut refunded) = ([app.db.ledger.pool(), b.db.ledger.pool()], 0, 0);
    for pool in pools {
        refunds += rows(pool, "SELECT count(*) FROM refunds WHERE status = 'succeeded'").await;
        refunded += rows(pool, "SELECT coalesce(sum(amount_minor), 0)::bigint FROM refunds").await;
        let unbalanced = "SELECT count(*) FROM (SELECT 1 FROM postings GROUP BY payment_id, currency \
                          HAVING sum(amount_minor) <> 0) AS off";
        assert_eq!(rows(pool, unbalanced).await, 0, "every entry balances");
    }
    assert_eq!((refunds, refunded), (10, PAID), "the refunds in both ledgers add up to the payment");
    assert!(rows(b.db.ledger.pool(), "SELECT count(*) FROM refunds").await > 0, "the second region worked some");
    assert_eq!(app.refunded(&paid).await, (PAID, PAID));
    // A refund refused as exceeding it was never stored: nothing was claimed for it.
    let (_, body) = &answers[answers.iter().position(|(s, _)| *s == StatusCode::UNPROCESSABLE_ENTITY).unwrap()];
    assert!(serde_json::from_slice::<Value>(body).unwrap()["detail"].as_str().unwrap().contains("Nothing was"));

    // Every region lists and shows every refund of the payment.
    for url in [&app.url, &b.url] {
        let listed: Value = app
            .http
            .get(format!("{url}/v1/payments/{paid}/refunds"))
            .bearer_auth(&app.api_key)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let listed = listed["data"].as_array().unwrap();
        assert_eq!(listed.len(), 10, "{url}: {listed:?}");
        for shown in listed {
            let one = app.http.get(format!("{url}/v1/refunds/{}", shown["id"].as_str().unwrap()));
            let one: Value = one.bearer_auth(&app.api_key).send().await.unwrap().json().await.unwrap();
            assert_eq!(one, *shown);
        }
        let payment = app.http.get(format!("{url}/v1/payments/{paid}")).bearer_auth(&app.api_key);
        let payment: Value = payment.send().await.unwrap().json().await.unwrap();
        assert_eq!(payment["amount_refunded"], PAID, "{url}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_declined_refund_gives_its_amount_back() {
    let app = spawn_app().await;
    let paid = app.paid("E2E-REFUND-DECLINED").await;
    // The refund pays the payment's debtor: the rail refuses that account.
    app.e2.set_rules(json!({ "decline_creditor_accounts": [DEBTOR] })).await;
    let (status, declined) = app.refund_at(&app.url, &paid, "refund-declined", &refund(PAID)).await;
    assert_eq!(status, StatusCode::PAYMENT_REQUIRED);
    let problem: Value = serde_json::from_slice(&declined).unwrap();
    assert_eq!(problem["type"], "urn:keyfence:problem:refund-declined");
    assert_eq!(problem["reason"], "creditor_account_blocked");
    assert_eq!(app.refunded(&paid).await, (0, 0), "the hold was released");
    let again = app.refund_at(&app.url, &paid, "refund-declined", &refund(PAID)).await;
    assert_eq!(again, (StatusCode::PAYMENT_REQUIRED, declined), "the decline is the key's final answer");

    app.e2.set_rules(json!({})).await;
    let (status, body) = app.refund_at(&app.url, &paid, "refund-after-decline", &refund(PAID)).await;
    assert_eq!(status, StatusCode::CREATED, "{}", String::from_utf8_lossy(&body));
    assert_eq!(app.refunded(&paid).await, (PAID, PAID));
    let statuses: Vec<String> = sqlx::query_scalar("SELECT status FROM refunds ORDER BY created_at")
        .fetch_all(app.db.ledger.pool())
        .await
        .unwrap();
    assert_eq!(statuses, ["rejected", "succeeded"]);
    assert_eq!(app.unbalanced_payments().await, 0);
    // The creditor gave back exactly once: the hold, its release, the refund.
    let creditor: i64 = sqlx::query_scalar(
        "SELECT coalesce(sum(amount_minor), 0)::bigint FROM postings WHERE account = 'creditor:FR1420041010050500013M02606'",
    )
    .fetch_one(app.db.ledger.pool())
    .await
    .unwrap();
    assert_eq!(creditor, 0, "paid 1250, refunded 1250");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_claim_nothing_and_a_key_is_one_request() {
    let app = spawn_app().await;
    let paid = app.paid("E2E-REFUND-REFUSED").await;
    let items = app.key_items().await;

    // Too much: refused before anything is claimed; the same key works
    // for a refund that fits.
    let (status, body) = app.refund_at(&app.url, &paid, "refund-too-much", &refund(PAID + 1)).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(serde_json::from_slice::<Value>(&body).unwrap()["type"], "urn:keyfence:problem:refund-exceeds-payment");
    assert_eq!(app.key_items().await, items, "nothing claimed");

    // Another client's payment is not found; so is no payment at all.
    let (_, other) = app.add_client().await;
    let theirs = app
        .http
        .post(format!("{}/v1/payments/{paid}/refunds", app.url))
        .bearer_auth(&other)
        .header("Idempotency-Key", "not-theirs")
        .json(&refund(100))
        .send()
        .await
        .unwrap();
    assert_eq!(theirs.status(), StatusCode::NOT_FOUND);
    let nowhere = app.refund_at(&app.url, &Uuid::now_v7().to_string(), "no-payment", &refund(100)).await;
    assert_eq!(nowhere.0, StatusCode::NOT_FOUND);
    assert_eq!(app.key_items().await, items, "nothing claimed");

    // A payment that did not succeed cannot be refunded.
    app.e2.set_rules(json!({ "decline_creditor_accounts": ["FR1420041010050500013M02606"] })).await;
    let declined = app.pay("pay-declined", &payment("E2E-REFUND-NOT-PAID")).await;
    assert_eq!(declined.status(), StatusCode::PAYMENT_REQUIRED);
    let declined: Value = declined.json().await.unwrap();
    let (status, body) = app.refund_at(&app.url, declined["id"].as_str().unwrap(), "refund-unpaid", &refund(100)).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(serde_json::from_slice::<Value>(&body).unwrap()["type"], "urn:keyfence:problem:payment-not-refundable");
    app.e2.set_rules(json!({})).await;

    // A bad body is 400, naming the field.
    let (status, body) = app.refund_at(&app.url, &paid, "refund-bad", &json!({ "amount_minor": -5 })).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(serde_json::from_slice::<Value>(&body).unwrap()["errors"][0]["field"], "amount_minor");

    // The path is part of the request: a payment's key is not a refund's.
    let (status, body) = app.refund_at(&app.url, &paid, &format!("pay-{}", "E2E-REFUND-REFUSED"), &refund(100)).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(serde_json::from_slice::<Value>(&body).unwrap()["type"], "urn:keyfence:problem:idempotency-key-reused");
    let (status, _) = app.refund_at(&app.url, &paid, "refund-once-only", &refund(100)).await;
    assert_eq!(status, StatusCode::CREATED);
    let (status, body) = app.refund_at(&app.url, &paid, "refund-once-only", &refund(101)).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{}", String::from_utf8_lossy(&body));
    assert_eq!(app.count("refunds").await, 1);
    assert_eq!(app.refunded(&paid).await, (100, 100));
}
