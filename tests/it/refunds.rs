//! Refunds through the real stores and rails: a refund is worked once
//! however often it is sent, no set of refunds ever exceeds its payment
//! (whichever regions work them at once), a declined refund gives its
//! amount back, and every region reads every refund.

use std::time::{Duration, Instant};

use aws_sdk_dynamodb::types::AttributeValue;
use futures::future::join_all;
use keyfence::domain::{IdempotencyKey, Millis, RefundRequest, RequestHash, ScopedKey};
use keyfence::engine::{Answer, EngineError, Submission};
use keyfence::keystore::{Concluded, Conclusion, Frozen, HeldBy, Hold, HoldState, Holding, KeyStore};
use keyfence::operations::{RefundOperation, RefundOrder, RefundedPayment};
use keyfence::reconcile::Class;
use keyfence::startup::build_engine;
use reqwest::StatusCode;
use serde_json::{Value, json};
use uuid::Uuid;

use crate::app::{DEBTOR, TestApp, payment, spawn_app};
use crate::harness::eventually;
use crate::receiver::Receiver;

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

    /// Retries a refund until its answer is final (not 409, 202 or 503, and
    /// not 429: a caller that floods its own bucket waits as told and tries
    /// again); returns the status and the body's bytes.
    pub async fn refund_at(&self, url: &str, payment: &str, key: &str, body: &Value) -> (StatusCode, Vec<u8>) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let answer = self.try_refund_at(url, payment, key, body).await.expect("the service answers");
            let pause = match answer.status() {
                StatusCode::CONFLICT | StatusCode::ACCEPTED | StatusCode::SERVICE_UNAVAILABLE => {
                    Duration::from_millis(100)
                }
                StatusCode::TOO_MANY_REQUESTS => {
                    let told = answer.headers().get("retry-after").and_then(|v| v.to_str().ok()?.parse().ok());
                    Duration::from_secs(told.expect("a 429 says when to come back"))
                }
                status => return (status, answer.bytes().await.unwrap().to_vec()),
            };
            assert!(Instant::now() < deadline, "the refund {key} had no final answer within 30 s");
            tokio::time::sleep(pause).await;
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
    let others: Vec<_> = answers.iter().filter(|answer| **answer != (StatusCode::CREATED, first.clone())).collect();
    assert!(
        others.is_empty(),
        "one answer, byte for byte: {} of 100 differ from {:?}, e.g. {:?}",
        others.len(),
        String::from_utf8_lossy(&first),
        others.first().map(|(status, body)| (status, String::from_utf8_lossy(body)))
    );
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
    // Until the first region's view of the registry names the second (each
    // keeps its view up to REGION_VIEW_AGE): its listing asks only the
    // regions it knows of.
    app.clock.advance(keyfence::startup::REGION_VIEW_AGE);
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
    // Which region's refunds win the room is a matter of timing (the second
    // region asks the first for the payment before it claims); what is
    // checked is that the one balance decides, wherever they are worked.
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

/// Takes a hold on `paid`'s balance for a request that never was (a claim
/// forgotten after its hold was taken), a minute ago.
async fn orphan_hold(app: &TestApp, paid: &str, amount: i64) -> Uuid {
    gone_hold(app, paid, amount, false).await
}

/// Takes a hold on `paid`'s balance, a minute ago, for a request whose key
/// and ledger rows are gone (`lasting`: a return's, whose payment's
/// partition was dropped).
async fn gone_hold(app: &TestApp, paid: &str, amount: i64, lasting: bool) -> Uuid {
    let id = Uuid::now_v7();
    let key = ScopedKey::new(app.client_id().await, IdempotencyKey::parse(&format!("gone-{id}")).unwrap());
    let by = HeldBy { id, key, created_at: Millis::now().minus(Duration::from_secs(60)), region: "test-1".into() };
    let hold = Hold { balance: RefundOperation::balance_of(paid.parse().unwrap()), total: PAID, amount, lasting };
    let taken = app.keys.store.hold(&hold, &by, Millis::now().minus(Duration::from_secs(60))).await.unwrap();
    assert_eq!(taken, Holding::Held);
    id
}

async fn hold_state(app: &TestApp, paid: &str, id: Uuid) -> Option<HoldState> {
    let balance = RefundOperation::balance_of(paid.parse().unwrap());
    app.keys.store.balance(&balance).await.unwrap().and_then(|b| b.hold(id).map(|h| h.state))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hold_held_for_nobody_is_released_when_a_refund_needs_it() {
    let app = spawn_app().await;
    let paid = app.paid("E2E-REFUND-ORPHAN").await;
    let orphan = orphan_hold(&app, &paid, PAID).await;
    let (status, _) = app.refund_at(&app.url, &paid, "refund-beside-orphan", &refund(100)).await;
    assert_eq!(status, StatusCode::CREATED, "the orphan's amount was given back for it");
    assert_eq!(hold_state(&app, &paid, orphan).await, Some(HoldState::Released));
    assert_eq!(app.refunded(&paid).await, (100, 100));
}

/// A return holds the whole payment for good. Once the payment's key and
/// ledger rows are gone (its partition dropped), its hold looks like one
/// held for nobody; it is not: no refund gets its amount back, and the
/// reconciler neither reports nor releases it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_returns_hold_is_never_an_orphan() {
    let app = spawn_app().await;
    let paid = app.paid("E2E-REFUND-RETURNED").await;
    let returned = gone_hold(&app, &paid, PAID, true).await;
    let (status, body) = app.refund_at(&app.url, &paid, "refund-after-return", &refund(100)).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{}", String::from_utf8_lossy(&body));
    assert_eq!(hold_state(&app, &paid, returned).await, Some(HoldState::Held));

    let found = crate::reconcile::reconcile(&app, true).await;
    assert!(found.findings.is_empty(), "{}", found.table());
    assert_eq!(hold_state(&app, &paid, returned).await, Some(HoldState::Held), "the repair left it");
    assert_eq!(app.count("refunds").await, 0);
    assert_eq!(app.e2.statement().await.len(), 1, "the payment only: no refund sent");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_reconciler_releases_orphaned_holds_and_reports_missing_ones() {
    let app = spawn_app().await;
    let paid = app.paid("E2E-REFUND-RECONCILE").await;
    let (status, _) = app.refund_at(&app.url, &paid, "refund-kept", &refund(200)).await;
    assert_eq!(status, StatusCode::CREATED);
    let orphan = orphan_hold(&app, &paid, 300).await;
    assert_eq!(app.refunded(&paid).await, (200, 500));

    let found = crate::reconcile::reconcile(&app, false).await;
    let classes: Vec<Class> = found.findings.iter().map(|f| f.class).collect();
    assert_eq!(classes, [Class::OrphanedHold], "{}", found.table());
    assert_eq!(found.findings[0].payment_id, orphan);
    assert_eq!(hold_state(&app, &paid, orphan).await, Some(HoldState::Held), "a report changes nothing");

    let repaired = crate::reconcile::reconcile(&app, true).await;
    assert!(repaired.findings.iter().all(|f| f.repair.as_ref().is_some_and(|r| r.resolved)), "{}", repaired.table());
    assert_eq!(hold_state(&app, &paid, orphan).await, Some(HoldState::Released));
    assert_eq!(app.refunded(&paid).await, (200, 200), "released once");
    assert!(crate::reconcile::reconcile(&app, true).await.findings.is_empty(), "nothing left to find");

    // A finished refund whose hold is gone from its balance is reported, never guessed at.
    let refund_id: Uuid = sqlx::query_scalar("SELECT id FROM refunds").fetch_one(app.db.ledger.pool()).await.unwrap();
    app.keys
        .store
        .client()
        .update_item()
        .table_name(app.keys.store.table())
        .key("pk", AttributeValue::S(format!("control#balance#{}", RefundOperation::balance_of(paid.parse().unwrap()))))
        .update_expression("REMOVE #hold")
        .expression_attribute_names("#hold", format!("hold#{refund_id}"))
        .send()
        .await
        .unwrap();
    let missing = crate::reconcile::reconcile(&app, true).await;
    let classes: Vec<Class> = missing.findings.iter().map(|f| f.class).collect();
    assert_eq!(classes, [Class::HoldMissing], "{}", missing.table());
    assert_eq!(missing.findings[0].payment_id, refund_id);
    assert!(!missing.findings[0].repair.as_ref().unwrap().resolved);
}

/// A refund whose first phase fails after its hold was taken is handed
/// back, not forgotten: the hold stays with its request (nobody gives it
/// back while an owner may still be working it), and the retry finishes
/// the refund under the same hold.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refund_that_fails_after_its_hold_keeps_it_for_the_retry() {
    let app = spawn_app().await;
    let (proxy, settings) = app.behind_a_proxied_ledger().await;
    let engine = build_engine(&settings.engine).await.unwrap();
    let order = RefundOrder {
        refund: RefundRequest { amount_minor: 500, reason: None },
        payment: RefundedPayment {
            id: Uuid::now_v7(),
            amount_minor: PAID,
            currency: "EUR".into(),
            debtor_account: DEBTOR.into(),
            creditor_account: "FR1420041010050500013M02606".into(),
            end_to_end_id: "E2E-REFUND-HANDED-BACK".into(),
        },
    };
    let key = ScopedKey::new(app.client_id().await, IdempotencyKey::parse("handed-back").unwrap());
    let canonical = serde_json::to_vec(&order).unwrap();
    let submission = || Submission {
        key: key.clone(),
        request_hash: RequestHash::of("POST", "/v1/payments/x/refunds", &canonical),
        canonical: canonical.clone(),
        operation: RefundOperation::new(order.clone()),
    };
    proxy.cut();
    let failed = engine.submit(submission()).await;
    assert!(matches!(failed, Err(EngineError::Transient(_))), "{failed:?}");
    let item = app.keys.store.get(&key).await.unwrap().expect("handed back, not forgotten");
    assert_eq!(item.lease_until, Millis::new(0));
    let paid = order.payment.id.to_string();
    assert_eq!(hold_state(&app, &paid, item.payment_id).await, Some(HoldState::Held));

    proxy.heal();
    let answer = engine.submit(submission()).await.unwrap();
    assert!(matches!(&answer, Answer::Final { response, .. } if response.status == 201), "{answer:?}");
    assert_eq!(hold_state(&app, &paid, item.payment_id).await, Some(HoldState::Settled), "the same hold, settled");
    assert_eq!(app.refunded(&paid).await, (500, 500));
}

/// Two refunds' events reach the client's endpoint, signed and verified by
/// the Standard Webhooks reference library: `refund.succeeded` with the
/// refund as `GET /v1/refunds/{id}` shows it, and `refund.rejected`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refunds_events_arrive_signed() {
    let receiver = Receiver::start().await;
    let app = spawn_app().await;
    let made = app
        .http
        .post(format!("{}/v1/webhook-endpoints", app.url))
        .bearer_auth(&app.api_key)
        .json(&json!({ "url": receiver.hook("refunds"), "events": ["refund.succeeded", "refund.rejected"] }))
        .send()
        .await
        .unwrap();
    assert_eq!(made.status(), StatusCode::CREATED);
    let made: Value = made.json().await.unwrap();
    receiver.behave("refunds", json!({ "secret": made["secret"] })).await;

    let paid = app.paid("E2E-REFUND-EVENTS").await;
    let (status, body) = app.refund_at(&app.url, &paid, "refund-evented", &refund(300)).await;
    assert_eq!(status, StatusCode::CREATED);
    let refunded: Value = serde_json::from_slice(&body).unwrap();
    app.e2.set_rules(json!({ "decline_creditor_accounts": [DEBTOR] })).await;
    let (status, _) = app.refund_at(&app.url, &paid, "refund-declined-evented", &refund(300)).await;
    assert_eq!(status, StatusCode::PAYMENT_REQUIRED);

    eventually("both refund events delivered", async || {
        receiver.arrivals("refunds").await.iter().filter(|a| a.accepted()).count() >= 2
    })
    .await;
    let arrivals = receiver.arrivals("refunds").await;
    assert!(arrivals.iter().all(|a| a.valid), "{arrivals:?}");
    // Each refund is a subject of its own: its events arrive in order, but
    // two refunds' events may arrive either way round.
    let mut kinds: Vec<&str> = arrivals.iter().filter_map(|a| a.event.as_deref()).collect();
    kinds.sort_unstable();
    assert_eq!(kinds, ["refund.rejected", "refund.succeeded"], "once each, the payment's own events not asked for");
    let of = |kind: &str| arrivals.iter().find(|a| a.event.as_deref() == Some(kind)).and_then(|a| a.data.clone());
    let shown: Value = app
        .get_as(&app.api_key, &format!("/v1/refunds/{}", refunded["id"].as_str().unwrap()))
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(of("refund.succeeded"), Some(shown));
    assert_eq!(of("refund.rejected").unwrap()["decline_reason"], "creditor_account_blocked");
}

/// A hold is concluded once: settled or released, and concluding it again
/// the same way changes nothing. A hold released and then settled after
/// all (a rail that declined an instruction and later applied it) is taken
/// back first, only while the balance has room for it.
#[tokio::test]
async fn a_hold_concludes_once_and_a_released_one_settles_only_with_room() {
    let app = spawn_app().await;
    let balance = "refundable#payment#conclude-once";
    let hold = |amount| Hold { balance: balance.to_owned(), total: 1000, amount, lasting: false };
    let by = async |name: &str| HeldBy {
        id: Uuid::now_v7(),
        key: ScopedKey::new(app.client_id().await, IdempotencyKey::parse(name).unwrap()),
        created_at: Millis::now(),
        region: "test-1".into(),
    };
    let store = &app.keys.store;
    let (first, second) = (by("first").await, by("second").await);
    assert_eq!(store.hold(&hold(600), &first, Millis::now()).await.unwrap(), Holding::Held);
    assert_eq!(store.hold(&hold(600), &first, Millis::now()).await.unwrap(), Holding::Held, "recognised");
    assert_eq!(store.hold(&hold(600), &second, Millis::now()).await.unwrap(), Holding::Exceeded { left: 400 });
    assert_eq!(store.conclude_hold(balance, first.id, Conclusion::Release).await.unwrap(), Concluded::Now);
    assert_eq!(store.conclude_hold(balance, first.id, Conclusion::Release).await.unwrap(), Concluded::Already);
    assert_eq!(store.hold(&hold(600), &second, Millis::now()).await.unwrap(), Holding::Held, "the room came back");
    // Released, then settled after all: no room for it now.
    assert!(store.conclude_hold(balance, first.id, Conclusion::Settle).await.is_err(), "it would overspend");
    assert_eq!(store.conclude_hold(balance, second.id, Conclusion::Release).await.unwrap(), Concluded::Now);
    assert_eq!(store.conclude_hold(balance, first.id, Conclusion::Settle).await.unwrap(), Concluded::Now);
    let now = store.balance(balance).await.unwrap().unwrap();
    assert_eq!((now.total, now.reserved, now.settled), (1000, 600, 600));
    assert!(store.conclude_hold(balance, first.id, Conclusion::Release).await.is_err(), "a settled hold stays settled");
    // Undone (a refund the rail returned): once, and never settled again.
    assert_eq!(store.conclude_hold(balance, first.id, Conclusion::Undo).await.unwrap(), Concluded::Now);
    assert_eq!(store.conclude_hold(balance, first.id, Conclusion::Undo).await.unwrap(), Concluded::Already);
    assert!(store.conclude_hold(balance, first.id, Conclusion::Settle).await.is_err(), "an undone hold stays undone");
    let now = store.balance(balance).await.unwrap().unwrap();
    assert_eq!((now.reserved, now.settled, now.hold(first.id).unwrap().state), (0, 0, HoldState::Undone));
    assert_eq!(store.conclude_hold(balance, Uuid::now_v7(), Conclusion::Settle).await.unwrap(), Concluded::Missing);
}

/// A frozen balance (a return was received) takes no hold but a lasting
/// one, whatever it has left, and a hold released after the freeze does not
/// make room for a new one; freezing again keeps the first record, and a
/// balance never drawn on is made frozen. The key store in memory (the
/// model's) behaves the same.
#[tokio::test]
async fn a_frozen_balance_takes_only_lasting_holds() {
    let app = spawn_app().await;
    let client = app.client_id().await;
    check_freeze(&app.keys.store, client).await;
    check_freeze(&keyfence::keystore::MemoryKeyStore::new(), client).await;
}

async fn check_freeze(store: &impl KeyStore, client: keyfence::domain::ClientId) {
    let balance = format!("refundable#payment#{}", Uuid::now_v7());
    let hold = |amount, lasting| Hold { balance: balance.clone(), total: 1000, amount, lasting };
    let by = |name: &str| HeldBy {
        id: Uuid::now_v7(),
        key: ScopedKey::new(client, IdempotencyKey::parse(name).unwrap()),
        created_at: Millis::now(),
        region: "test-1".into(),
    };
    let (refund, later, returned) = (by("refund"), by("later"), by("return"));
    assert_eq!(store.hold(&hold(300, false), &refund, Millis::now()).await.unwrap(), Holding::Held);
    let first = Frozen { by: "return evt_1 from e2".into(), at: Millis::new(1_000) };
    store.freeze(&balance, 1000, &first).await.unwrap();
    let again = Frozen { by: "return evt_2 from e2".into(), at: Millis::new(2_000) };
    store.freeze(&balance, 1000, &again).await.unwrap();
    assert_eq!(store.conclude_hold(&balance, refund.id, Conclusion::Release).await.unwrap(), Concluded::Now);
    assert_eq!(store.hold(&hold(100, false), &later, Millis::now()).await.unwrap(), Holding::Exceeded { left: 0 });
    assert_eq!(store.hold(&hold(1000, true), &returned, Millis::now()).await.unwrap(), Holding::Held, "lasting");
    let now = store.balance(&balance).await.unwrap().unwrap();
    assert_eq!((now.reserved, now.left(), now.frozen), (1000, 0, Some(first)), "the first freeze is kept");
    assert!(store.freeze(&balance, 999, &again).await.is_err(), "another total");

    let untouched = format!("refundable#payment#{}", Uuid::now_v7());
    store.freeze(&untouched, 500, &again).await.unwrap();
    let made = store.balance(&untouched).await.unwrap().unwrap();
    assert_eq!((made.total, made.reserved, made.frozen.is_some()), (500, 0, true));
}
