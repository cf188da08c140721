//! The inbox: the rail simulator notifies keyfence of what it decided after
//! the fact, with duplicates and reordering. Each effect happens once
//! (counted in postings, statuses and the rail's statement); an answer the
//! rail held back is settled by its notification before anything probes;
//! a return after settlement posts one compensating entry however often it
//! is sent; a notification naming nothing of ours is kept, and one not
//! signed by the rail is refused.

use std::time::Duration;

use futures::StreamExt;
use keyfence::domain::WebhookSecret;
use keyfence::domain::webhook_signature as signature;
use keyfence::domain::{IdempotencyKey, ScopedKey};
use keyfence::keystore::{Handoff, KeyState, KeyStore};
use keyfence::operations::RefundOperation;
use keyfence::rail::sim::notify::Callback;
use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::app::{RAIL_NOTIFY_SECRET, TestApp, TestRail, payment, spawn_app_with};
use crate::harness::eventually;
use keyfence::rail::sim::notify::Tally;

/// Has `rail` notify `app` as rail `name`.
pub(crate) fn notify(rail: &TestRail, app: &TestApp, name: &str) {
    let url = format!("{}/v1/rail-events/{name}", app.url);
    rail.sim.as_ref().unwrap().notify_to(Callback { url, secret: RAIL_NOTIFY_SECRET.to_owned() });
}

pub(crate) async fn quiet_app() -> TestApp {
    spawn_app_with(|s| {
        s.engine.work.lease = Duration::from_millis(1000);
        (s.engine.rails.rail_timeout, s.engine.rails.rail_attempts) = (Duration::from_millis(300), 1);
        // Nothing but the inbox resumes a parked payment.
        s.recovery_interval_ms = 0;
    })
    .await
}

async fn finished(app: &TestApp, key: &str) -> bool {
    let key = ScopedKey::new(app.client_id().await, IdempotencyKey::parse(key).unwrap());
    app.keys.store.get(&key).await.unwrap().is_some_and(|item| item.state == KeyState::Finished)
}

async fn inbox_states(app: &TestApp) -> Vec<(String, String, i64)> {
    sqlx::query_as("SELECT kind, state, count(*) FROM inbox GROUP BY kind, state ORDER BY kind, state")
        .fetch_all(app.db.ledger.pool())
        .await
        .unwrap()
}

/// Waits until every notification copy the rails posted has arrived and
/// the inbox has worked every message it took in.
async fn worked_off(app: &TestApp) {
    eventually("every notification copy arrived and was worked", async || {
        let (e1, e2) = (app.e1.notifications().await, app.e2.notifications().await);
        let pending = inbox_states(app).await.iter().any(|(_, state, _)| state == "pending");
        e1.outstanding == 0 && e2.outstanding == 0 && !pending
    })
    .await;
}

/// Asserts the inbox holds `verdicts` verdict messages (each taken as a
/// probe's answer, or found known already) and exactly `returns` (state,
/// count) of returns, once everything is worked off.
async fn assert_inbox(app: &TestApp, verdicts: i64, returns: &[(&str, i64)]) {
    worked_off(app).await;
    let states = inbox_states(app).await;
    let (kept, returned): (Vec<_>, Vec<_>) = states.iter().partition(|(kind, _, _)| kind != "returned");
    let taken = kept.iter().filter(|(_, state, _)| state == "applied" || state == "ignored");
    assert_eq!(taken.map(|(_, _, n)| n).sum::<i64>(), verdicts, "verdicts, all applied or ignored: {states:?}");
    assert_eq!(kept.iter().map(|(_, _, n)| n).sum::<i64>(), verdicts, "no other verdicts: {states:?}");
    let returned: Vec<(&str, i64)> = returned.iter().map(|(_, state, n)| (state.as_str(), *n)).collect();
    assert_eq!(returned, returns, "returns: {states:?}");
}

async fn return_instruction(rail: &TestRail, key: &str) -> StatusCode {
    let body = json!({ "idempotency_key": key });
    reqwest::Client::new().put(format!("{}/v1/returns", rail.url)).json(&body).send().await.unwrap().status()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_back_answer_is_settled_by_its_notification_before_any_probe() {
    let app = quiet_app().await;
    notify(&app.e2, &app, "e2");
    app.e2.set_faults(json!({ "timeout_after_apply_rate": 1.0 })).await;
    let first = app.pay("held", &payment("E2E-HELD")).await;
    assert_eq!(first.status(), StatusCode::ACCEPTED, "the rail held its answer back");
    eventually("settled by the notification", async || finished(&app, "held").await).await;

    assert!(app.e2.probes().await.is_empty(), "nothing probed the rail");
    assert_eq!(app.e2.statement().await.len(), 1);
    let retry = app.pay("held", &payment("E2E-HELD")).await;
    assert_eq!(retry.status(), StatusCode::CREATED);
    let shown: Value = retry.json().await.unwrap();
    assert_eq!(shown["status"], "succeeded");
    assert_eq!(inbox_states(&app).await, [("applied".to_owned(), "applied".to_owned(), 1)]);
    assert_eq!(app.unbalanced_payments().await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicated_and_reordered_notifications_take_effect_once() {
    let app = quiet_app().await;
    notify(&app.e2, &app, "e2");
    app.e2.set_faults(json!({ "duplicate_rate": 1.0, "delay_ms": 300, "timeout_after_apply_rate": 0.5 })).await;
    let answers: Vec<StatusCode> = futures::stream::iter(0..20)
        .map(|i| {
            let app = &app;
            async move { app.pay(&format!("dup-{i}"), &payment(&format!("E2E-DUP-{i}"))).await.status() }
        })
        .buffer_unordered(8)
        .collect()
        .await;
    assert!(answers.iter().all(|s| *s == StatusCode::CREATED || *s == StatusCode::ACCEPTED), "{answers:?}");
    assert!(answers.contains(&StatusCode::ACCEPTED), "some answers were held back: {answers:?}");
    for i in 0..20 {
        eventually("every payment finished", async || finished(&app, &format!("dup-{i}")).await).await;
    }
    // Every notification was sent twice: both copies of each arrive.
    worked_off(&app).await;
    assert_eq!(app.e2.notifications().await, Tally { delivered: 40, outstanding: 0 }, "two copies of each");
    assert_eq!(app.e2.statement().await.len(), 20, "one instruction each at the rail");
    let succeeded: i64 = sqlx::query_scalar("SELECT count(*) FROM payments WHERE status = 'succeeded'")
        .fetch_one(app.db.ledger.pool())
        .await
        .unwrap();
    assert_eq!(succeeded, 20);
    assert_eq!(app.count("postings").await, 20 * 6, "hold, clear and settle, two legs each, once per payment");
    assert_eq!(app.count("inbox").await, 20, "each message kept once, however often it came");
    assert_inbox(&app, 20, &[]).await;
    assert_eq!(app.unbalanced_payments().await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_return_after_settlement_posts_one_compensating_entry_however_often_it_is_sent() {
    let app = quiet_app().await;
    notify(&app.e2, &app, "e2");
    app.e2.set_faults(json!({ "duplicate_rate": 1.0 })).await;
    let paid = app.pay("returned", &payment("E2E-RETURNED")).await;
    assert_eq!(paid.status(), StatusCode::CREATED);
    let location = paid.headers()["location"].to_str().unwrap().to_owned();
    let key = app.e2.statement().await[0].idempotency_key.clone();
    for _ in 0..3 {
        assert_eq!(return_instruction(&app.e2, &key).await, StatusCode::OK);
    }
    eventually("the payment is returned", async || {
        let shown: Value = app.get_as(&app.api_key, &location).await.json().await.unwrap();
        shown["status"] == "returned"
    })
    .await;
    // The payment's verdict and the three returns, each sent twice.
    worked_off(&app).await;
    assert_eq!(app.e2.notifications().await, Tally { delivered: 8, outstanding: 0 });
    // Each return asked is notified under an id of its own: the first applied, the rest known already.
    assert_inbox(&app, 1, &[("applied", 1), ("ignored", 2)]).await;
    let entries: Vec<(String, i64)> =
        sqlx::query_as("SELECT entry, count(*) FROM postings WHERE entry = 'return' GROUP BY entry")
            .fetch_all(app.db.ledger.pool())
            .await
            .unwrap();
    assert_eq!(entries, [("return".to_owned(), 2)], "one entry of two legs");
    let events: Vec<String> =
        sqlx::query_scalar("SELECT event FROM outbox ORDER BY id").fetch_all(app.db.ledger.pool()).await.unwrap();
    assert_eq!(events, ["payment.succeeded", "payment.returned"]);
    let shown: Value = app.get_as(&app.api_key, &location).await.json().await.unwrap();
    assert_eq!(shown["reason"], "AC04");
    let returns: Vec<(String, i64)> =
        sqlx::query_as("SELECT state, count(*) FROM inbox WHERE kind = 'returned' GROUP BY state ORDER BY state")
            .fetch_all(app.db.ledger.pool())
            .await
            .unwrap();
    assert_eq!(returns, [("applied".to_owned(), 1), ("ignored".to_owned(), 2)], "three returns sent, one taken");
    assert_eq!(app.unbalanced_payments().await, 0);
    assert_eq!(return_instruction(&app.e2, "no-such-key").await, StatusCode::NOT_FOUND);
}

/// A return may arrive before the verdict it follows (both delayed at
/// random): it waits until the payment has settled, then takes effect once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_return_that_overtakes_its_settlement_waits_for_it() {
    let app = quiet_app().await;
    notify(&app.e2, &app, "e2");
    app.e2.set_faults(json!({ "timeout_after_apply_rate": 1.0, "return_rate": 1.0, "delay_ms": 400 })).await;
    for i in 0..5 {
        let paid = app.pay(&format!("overtaken-{i}"), &payment(&format!("E2E-OVERTAKEN-{i}"))).await;
        assert_eq!(paid.status(), StatusCode::ACCEPTED);
    }
    eventually("all five returned", async || {
        let returned: i64 = sqlx::query_scalar("SELECT count(*) FROM payments WHERE status = 'returned'")
            .fetch_one(app.db.ledger.pool())
            .await
            .unwrap();
        returned == 5
    })
    .await;
    let entries: i64 = sqlx::query_scalar("SELECT count(*) FROM postings WHERE entry = 'return'")
        .fetch_one(app.db.ledger.pool())
        .await
        .unwrap();
    assert_eq!(entries, 10, "one entry of two legs each");
    assert_eq!(app.e2.statement().await.len(), 5);
    assert!(app.e2.probes().await.is_empty(), "settled by notifications alone");
    assert_eq!(app.unbalanced_payments().await, 0);
}

/// Posts a notification to `app` as rail `rail`, signed with `secret` at `timestamp`.
async fn post_notice(app: &TestApp, rail: &str, secret: &str, timestamp: i64, body: &Value) -> StatusCode {
    let body = serde_json::to_vec(body).unwrap();
    let id = body_id(&body);
    let secret = WebhookSecret { value: secret.to_owned(), created_at: 0, valid_until: None };
    app.http
        .post(format!("{}/v1/rail-events/{rail}", app.url))
        .header("content-type", "application/json")
        .header("webhook-id", &id)
        .header("webhook-timestamp", timestamp.to_string())
        .header("webhook-signature", signature::header(&[&secret], &id, timestamp, &body))
        .body(body)
        .send()
        .await
        .unwrap()
        .status()
}

fn body_id(body: &[u8]) -> String {
    serde_json::from_slice::<Value>(body).unwrap()["id"].as_str().unwrap().to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_notification_for_nothing_of_ours_is_kept_and_an_unsigned_one_refused() {
    let app = quiet_app().await;
    let now = time::OffsetDateTime::now_utc().unix_timestamp();
    let notice = json!({
        "type": "instruction.applied",
        "id": "evt_e2_99999999",
        "applied": {
            "idempotency_key": uuid::Uuid::new_v4().simple().to_string(),
            "end_to_end_id": "E2E-STRANGER",
            "amount_minor": 100,
            "currency": "EUR",
            "reference": "e2-99999999",
            "applied_at": "2026-12-01T00:00:00Z",
        },
    });
    let other = WebhookSecret::generate(0).value;
    assert_eq!(post_notice(&app, "e2", &other, now, &notice).await, StatusCode::UNAUTHORIZED, "another secret");
    assert_eq!(post_notice(&app, "e2", RAIL_NOTIFY_SECRET, now - 600, &notice).await, StatusCode::UNAUTHORIZED);
    assert_eq!(post_notice(&app, "e9", RAIL_NOTIFY_SECRET, now, &notice).await, StatusCode::NOT_FOUND);
    assert_eq!(app.count("inbox").await, 0, "nothing kept of what was refused");

    assert_eq!(post_notice(&app, "e2", RAIL_NOTIFY_SECRET, now, &notice).await, StatusCode::OK);
    assert_eq!(post_notice(&app, "e2", RAIL_NOTIFY_SECRET, now, &notice).await, StatusCode::OK, "again: acknowledged");
    assert_eq!(inbox_states(&app).await, [("applied".to_owned(), "unknown".to_owned(), 1)], "kept once, as unknown");
    let report = crate::reconcile::reconcile(&app, false).await;
    assert_eq!(report.unmatched_notifications.len(), 1, "the reconciler lists it");
    assert_eq!(report.unmatched_notifications[0].message_id, "evt_e2_99999999");
    assert!(report.table().contains("naming no instruction of this ledger"));
    let mangled = json!({ "type": "instruction.applied", "id": "evt_e2_1" });
    assert_eq!(post_notice(&app, "e2", RAIL_NOTIFY_SECRET, now, &mangled).await, StatusCode::BAD_REQUEST);
}

/// Only the payment rail returns a payment, and only as it was sent: a
/// return posted as screening's (even of screening's own instruction), or
/// of another amount, is kept for the reconciler and changes nothing. A
/// region declared failed takes nothing in; an id reused with another body
/// is dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_payment_rail_returns_a_payment_and_only_as_it_was_sent() {
    let app = quiet_app().await;
    let paid = app.pay("kept", &payment("E2E-KEPT")).await;
    assert_eq!(paid.status(), StatusCode::CREATED);
    let location = paid.headers()["location"].to_str().unwrap().to_owned();
    let (screened, instructed) = (app.e1.statement().await.remove(0), app.e2.statement().await.remove(0));
    let now = time::OffsetDateTime::now_utc().unix_timestamp();
    let returned = |id: &str, key: &str, amount: i64| {
        json!({ "type": "instruction.returned", "id": id, "returned": {
            "idempotency_key": key, "end_to_end_id": "E2E-KEPT", "amount_minor": amount, "currency": "EUR",
            "reason_code": "AC04", "returned_at": "2026-12-01T00:00:00Z",
        }})
    };
    for (rail, id, key, amount) in [
        ("e1", "evt_1", &instructed.idempotency_key, 1250),
        ("e1", "evt_2", &screened.idempotency_key, 1250),
        ("e2", "evt_3", &instructed.idempotency_key, 1000),
    ] {
        let notice = returned(id, key, amount);
        assert_eq!(post_notice(&app, rail, RAIL_NOTIFY_SECRET, now, &notice).await, StatusCode::OK, "{id}");
    }
    worked_off(&app).await;
    let shown: Value = app.get_as(&app.api_key, &location).await.json().await.unwrap();
    assert_eq!(shown["status"], "succeeded", "not returned by any of them");
    assert_eq!(inbox_states(&app).await, [("returned".to_owned(), "unknown".to_owned(), 3)]);
    let report = crate::reconcile::reconcile(&app, false).await;
    let notes: Vec<String> = report.unmatched_notifications.iter().filter_map(|n| n.note.clone()).collect();
    assert_eq!(notes.len(), 3, "{notes:?}");

    // The same id again with another body: acknowledged, and the first kept.
    let reused = returned("evt_3", &instructed.idempotency_key, 1250);
    assert_eq!(post_notice(&app, "e2", RAIL_NOTIFY_SECRET, now, &reused).await, StatusCode::OK);
    let kept: Value = sqlx::query_scalar("SELECT body FROM inbox WHERE message_id = 'evt_3'")
        .fetch_one(app.db.ledger.pool())
        .await
        .unwrap();
    assert_eq!(kept["amount_minor"], 1000);
    worked_off(&app).await;
    let shown: Value = app.get_as(&app.api_key, &location).await.json().await.unwrap();
    assert_eq!(shown["status"], "succeeded");

    app.db.ledger.set_region_fence(true, "test-1", 1, "drill").await.unwrap();
    let late = returned("evt_4", &instructed.idempotency_key, 1250);
    assert_eq!(
        post_notice(&app, "e2", RAIL_NOTIFY_SECRET, now, &late).await,
        StatusCode::SERVICE_UNAVAILABLE,
        "a region declared failed takes nothing in"
    );
    assert_eq!(app.count("inbox").await, 3);
}

/// A return that reaches a region whose copy of the payment another region
/// took over (not voided yet) is not applied there: it is kept for the
/// reconciler, and the copy is left as it is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_return_reaching_a_copy_that_moved_away_is_kept_not_applied() {
    let app = quiet_app().await;
    notify(&app.e2, &app, "e2");
    let paid = app.pay("moved", &payment("E2E-MOVED")).await;
    assert_eq!(paid.status(), StatusCode::CREATED);
    let location = paid.headers()["location"].to_str().unwrap().to_owned();
    let moved = ScopedKey::new(app.client_id().await, IdempotencyKey::parse("moved").unwrap());
    app.keys
        .store
        .client()
        .update_item()
        .table_name(app.keys.store.table())
        .key("pk", aws_sdk_dynamodb::types::AttributeValue::S(moved.partition_key()))
        .update_expression("SET home_region = :there")
        .expression_attribute_values(":there", aws_sdk_dynamodb::types::AttributeValue::S("test-2".into()))
        .send()
        .await
        .unwrap();
    let key = app.e2.statement().await[0].idempotency_key.clone();
    assert_eq!(return_instruction(&app.e2, &key).await, StatusCode::OK);
    assert_inbox(&app, 1, &[("unknown", 1)]).await;
    let shown: Value = app.get_as(&app.api_key, &location).await.json().await.unwrap();
    assert_eq!(shown["status"], "succeeded", "not returned here");
    let entries: i64 = sqlx::query_scalar("SELECT count(*) FROM postings WHERE entry = 'return'")
        .fetch_one(app.db.ledger.pool())
        .await
        .unwrap();
    assert_eq!(entries, 0);
}

/// A return and refunds never both give a payment back: a return of a
/// payment with a refund is kept for a person, not applied; a returned
/// payment holds all of its balance, so no refund of it begins.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_return_and_a_refund_never_both_give_a_payment_back() {
    let app = quiet_app().await;
    notify(&app.e2, &app, "e2");
    let refunded = app.paid("E2E-RETURN-REFUNDED").await;
    let (status, _) = app.refund_at(&app.url, &refunded, "refund-then-return", &json!({ "amount_minor": 100 })).await;
    assert_eq!(status, StatusCode::CREATED);
    let returned = app.paid("E2E-RETURN-THEN-REFUND").await;
    let statement = app.e2.statement().await;
    let keys: Vec<String> =
        statement.iter().filter(|a| a.amount_minor == 1250).map(|a| a.idempotency_key.clone()).collect();
    for key in &keys {
        assert_eq!(return_instruction(&app.e2, key).await, StatusCode::OK);
    }
    eventually("the unrefunded payment is returned", async || {
        let shown: Value = app.get_as(&app.api_key, &format!("/v1/payments/{returned}")).await.json().await.unwrap();
        shown["status"] == "returned"
    })
    .await;
    assert_inbox(&app, 3, &[("applied", 1), ("unknown", 1)]).await;
    let shown: Value = app.get_as(&app.api_key, &format!("/v1/payments/{refunded}")).await.json().await.unwrap();
    assert_eq!((shown["status"].as_str(), shown["amount_refunded"].as_i64()), (Some("succeeded"), Some(100)));
    assert_eq!(app.refunded(&returned).await, (0, 1250), "the return holds all of it");
    let (status, body) =
        app.refund_at(&app.url, &returned, "refund-after-return", &json!({ "amount_minor": 100 })).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(serde_json::from_slice::<Value>(&body).unwrap()["type"], "urn:keyfence:problem:payment-not-refundable");
    let returns: i64 = sqlx::query_scalar("SELECT count(*) FROM postings WHERE entry = 'return'")
        .fetch_one(app.db.ledger.pool())
        .await
        .unwrap();
    assert_eq!(returns, 2, "one return posted, of one payment");
}

/// A return of a payment with a refund overlaps it and is kept for a
/// person; the payment still shows succeeded with most of it left, yet from
/// the moment the return was received no new refund of it begins.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_return_of_a_refunded_payment_freezes_what_is_left() {
    let app = quiet_app().await;
    notify(&app.e2, &app, "e2");
    let paid = app.paid("E2E-RETURN-FREEZES").await;
    let (status, _) = app.refund_at(&app.url, &paid, "refund-before-return", &json!({ "amount_minor": 100 })).await;
    assert_eq!(status, StatusCode::CREATED);
    let statement = app.e2.statement().await;
    let key = statement.iter().find(|a| a.amount_minor == 1250).unwrap().idempotency_key.clone();
    assert_eq!(return_instruction(&app.e2, &key).await, StatusCode::OK);
    assert_inbox(&app, 2, &[("unknown", 1)]).await;
    let shown: Value = app.get_as(&app.api_key, &format!("/v1/payments/{paid}")).await.json().await.unwrap();
    assert_eq!((shown["status"].as_str(), shown["amount_refunded"].as_i64()), (Some("succeeded"), Some(100)));

    let (status, body) = app.refund_at(&app.url, &paid, "refund-after-return", &json!({ "amount_minor": 500 })).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{}", String::from_utf8_lossy(&body));
    assert_eq!(app.count("refunds").await, 1, "no second refund begun");
    assert_eq!(app.e2.statement().await.len(), statement.len(), "nothing more sent to the rail");
    let balance = app.keys.store.balance(&RefundOperation::balance_of(paid.parse().unwrap())).await.unwrap().unwrap();
    assert!(balance.frozen.as_ref().is_some_and(|f| f.by.contains("from e2")), "{balance:?}");
    let report = crate::reconcile::reconcile(&app, true).await;
    let frozen: Vec<(String, i64)> =
        report.frozen_payments.iter().map(|f| (f.payment_id.to_string(), f.refunded)).collect();
    assert_eq!(frozen, [(paid.clone(), 100)], "listed for a person, repair or not");
    assert!(report.table().contains("payments frozen by a return"), "{}", report.table());

    // A person settles the return with the rail and says so: the message
    // ends, and is no longer counted for the alert.
    let message: String = sqlx::query_scalar("SELECT message_id FROM inbox WHERE state = 'unknown'")
        .fetch_one(app.db.ledger.pool())
        .await
        .unwrap();
    let settle = |note: &str| {
        let mut command = crate::process::keyfence_command(&app, "inbox");
        command.args(["settle", "--rail", "e2", "--message", &message, "--note", note, "--json"]);
        command.stderr(std::process::Stdio::piped());
        command
    };
    let settled = settle("the debtor repaid the refund").output().await.unwrap();
    assert!(settled.status.success(), "{}", String::from_utf8_lossy(&settled.stderr));
    let shown: Value = serde_json::from_slice(&settled.stdout).unwrap();
    assert_eq!(
        (shown["kind"].as_str(), shown["note"].as_str()),
        (Some("returned"), Some("the debtor repaid the refund"))
    );
    assert!(shown["kept_because"].as_str().unwrap().contains("overlaps"), "{shown}");
    let report = crate::reconcile::reconcile(&app, false).await;
    assert!(report.unmatched_notifications.is_empty(), "settled");
    assert!(
        report
            .prometheus(keyfence::domain::Millis::now())
            .contains("\nkeyfence_reconcile_notifications_for_a_person 0\n")
    );
    let again = settle("again").output().await.unwrap();
    assert!(!again.status.success(), "nothing waits any more");
    assert!(
        String::from_utf8_lossy(&again.stderr).contains("waits for a person"),
        "{}",
        String::from_utf8_lossy(&again.stderr)
    );
    let (status, _) = app.refund_at(&app.url, &paid, "refund-after-settling", &json!({ "amount_minor": 500 })).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "the payment stays frozen");
}

/// A region restored after a failover longer than the key retention: the
/// payment's key is gone, and only the hand-off its new home recorded says
/// it moved. A return the rail sends here is not applied to the leftover
/// (no hold of it, no compensating entry): it is kept for a person, and
/// the payment's balance is frozen, so its live copy is not refunded either.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_return_for_a_payment_handed_off_after_its_key_expired_is_not_applied_here() {
    let app = quiet_app().await;
    notify(&app.e2, &app, "e2");
    let paid = app.paid("E2E-RETURN-MOVED").await;
    let key = ScopedKey::new(app.client_id().await, IdempotencyKey::parse("pay-E2E-RETURN-MOVED").unwrap());
    let item = app.keys.store.get(&key).await.unwrap().unwrap();
    let handoff = Handoff {
        from: "test-1".into(),
        to: "test-2".into(),
        key: key.clone(),
        created_at: item.created_at,
        payment_id: item.payment_id,
        fence: item.fence.next(),
    };
    app.keys.store.hand_off(&handoff).await.unwrap();
    app.keys.lose(&key).await;

    let sent = app.e2.statement().await[0].idempotency_key.clone();
    assert_eq!(return_instruction(&app.e2, &sent).await, StatusCode::OK);
    assert_inbox(&app, 1, &[("unknown", 1)]).await;
    let status: String =
        sqlx::query_scalar("SELECT status FROM payments").fetch_one(app.db.ledger.pool()).await.unwrap();
    assert_eq!(status, "succeeded", "the leftover is not returned");
    let returns: i64 = sqlx::query_scalar("SELECT count(*) FROM postings WHERE entry = 'return'")
        .fetch_one(app.db.ledger.pool())
        .await
        .unwrap();
    assert_eq!(returns, 0);
    let balance = app.keys.store.balance(&RefundOperation::balance_of(paid.parse().unwrap())).await.unwrap().unwrap();
    assert!(balance.holds.is_empty(), "no hold taken here: {balance:?}");
    assert!(balance.frozen.is_some(), "no refund of the live copy begins either");
}

/// A return reaching a region whose reconciler voided its copy already
/// (the payment was finished in another region, and its key and hand-off
/// are gone since): nothing is applied to the leftover, but the payment's
/// balance is frozen all the same, so its live copy is not refunded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_return_reaching_a_voided_leftover_still_freezes_its_payment() {
    let app = quiet_app().await;
    notify(&app.e2, &app, "e2");
    let paid = app.paid("E2E-RETURN-VOIDED").await;
    worked_off(&app).await;
    sqlx::query("UPDATE payments SET status = 'voided'").execute(app.db.ledger.pool()).await.unwrap();
    let key = ScopedKey::new(app.client_id().await, IdempotencyKey::parse("pay-E2E-RETURN-VOIDED").unwrap());
    app.keys.lose(&key).await;

    let sent = app.e2.statement().await[0].idempotency_key.clone();
    assert_eq!(return_instruction(&app.e2, &sent).await, StatusCode::OK);
    assert_inbox(&app, 1, &[("unknown", 1)]).await;
    let note: String = sqlx::query_scalar("SELECT note FROM inbox WHERE kind = 'returned'")
        .fetch_one(app.db.ledger.pool())
        .await
        .unwrap();
    assert!(note.contains("leftover"), "{note}");
    let status: String =
        sqlx::query_scalar("SELECT status FROM payments").fetch_one(app.db.ledger.pool()).await.unwrap();
    assert_eq!(status, "voided", "the leftover is not returned");
    let balance = app.keys.store.balance(&RefundOperation::balance_of(paid.parse().unwrap())).await.unwrap();
    let balance = balance.expect("the return froze the payment's balance");
    assert!(balance.holds.is_empty() && balance.frozen.is_some(), "{balance:?}");
}

/// Messages kept for a person are never pruned, and the reconciler lists
/// every one of them, oldest first (past a page of a thousand), and gives
/// their number to the metrics file an alert reads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_reconciler_lists_every_message_kept_for_a_person() {
    let app = quiet_app().await;
    sqlx::query(
        "INSERT INTO inbox (rail, message_id, kind, body, state, note, received_at)
         SELECT 'e2', 'evt_kept_' || lpad(n::text, 5, '0'), 'returned', '{}'::jsonb, 'unknown', 'kept',
                now() - make_interval(secs => 5000 - n)
           FROM generate_series(1, 1050) AS n",
    )
    .execute(app.db.ledger.pool())
    .await
    .unwrap();
    let report = crate::reconcile::reconcile(&app, false).await;
    let ids: Vec<&str> = report.unmatched_notifications.iter().map(|n| n.message_id.as_str()).collect();
    assert_eq!(ids.len(), 1050, "all of them");
    assert_eq!((ids[0], ids[1049]), ("evt_kept_00001", "evt_kept_01050"), "oldest first");
    assert!(ids.windows(2).all(|w| w[0] < w[1]), "each once, in order");
    let metrics = report.prometheus(keyfence::domain::Millis::now());
    assert!(metrics.contains("\nkeyfence_reconcile_notifications_for_a_person 1050\n"), "{metrics}");
}

/// A refund whose answer the rail held back is settled by the rail's
/// notification, as a payment's is: matched against what the refund's
/// instruction carried (the payment's reference, the refund's amount), not
/// against a payment row, which a refund's request has none of.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refunds_held_back_answer_is_settled_by_its_notification() {
    let app = quiet_app().await;
    notify(&app.e2, &app, "e2");
    let paid = app.paid("E2E-REFUND-HELD").await;
    app.e2.set_faults(json!({ "timeout_after_apply_rate": 1.0 })).await;
    let refund = json!({ "amount_minor": 300 });
    // The rail held its answer back: the refund is settled by the rail's
    // notification, at once if it is in by the time the call gives up (201),
    // or when it comes (202 first).
    let (status, _) = app.refund_at(&app.url, &paid, "refund-held", &refund).await;
    assert!([StatusCode::CREATED, StatusCode::ACCEPTED].contains(&status), "{status}");
    app.e2.clear_faults().await;
    eventually("settled by the notification", async || finished(&app, "refund-held").await).await;

    assert!(app.e2.probes().await.is_empty(), "nothing probed the rail");
    let (status, body) = app.refund_at(&app.url, &paid, "refund-held", &refund).await;
    assert_eq!(status, StatusCode::CREATED, "{}", String::from_utf8_lossy(&body));
    assert_eq!(serde_json::from_slice::<Value>(&body).unwrap()["status"], "succeeded");
    assert_inbox(&app, 2, &[]).await;
    let sent = app.e2.statement().await.into_iter().find(|a| a.amount_minor == 300).unwrap().idempotency_key;
    let refunds: String = sqlx::query_scalar("SELECT state FROM inbox WHERE derived_key = $1::uuid")
        .bind(&sent)
        .fetch_one(app.db.ledger.pool())
        .await
        .unwrap();
    assert_eq!(refunds, "applied", "the refund's verdict took effect as its probe would have");
    assert_eq!(app.refunded(&paid).await, (300, 300));
}

/// A refund the rail returned (its money never reached the debtor): the
/// refund says so, its hold is undone, so the payment's `amount_refunded`
/// drops and the amount may be refunded again, one compensating entry is
/// posted, and `refund.returned` arrives signed at the client's endpoint.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_returned_refund_gives_its_amount_back_and_says_so() {
    let receiver = crate::receiver::Receiver::start().await;
    let app = quiet_app().await;
    notify(&app.e2, &app, "e2");
    crate::webhook_delivery::subscribe_to(&app, &receiver, "refunds", &["refund.returned"], json!({})).await;
    let paid = app.paid("E2E-REFUND-RETURNED").await;
    let (status, body) = app.refund_at(&app.url, &paid, "refund-returned", &json!({ "amount_minor": 400 })).await;
    assert_eq!(status, StatusCode::CREATED, "{}", String::from_utf8_lossy(&body));
    let refund = serde_json::from_slice::<Value>(&body).unwrap()["id"].as_str().unwrap().to_owned();
    assert_eq!(app.refunded(&paid).await, (400, 400));
    let statement = app.e2.statement().await;
    let sent = statement.iter().find(|a| a.amount_minor == 400).unwrap().idempotency_key.clone();
    assert_eq!(return_instruction(&app.e2, &sent).await, StatusCode::OK);
    eventually("the refund is returned", async || {
        let shown: Value = app.get_as(&app.api_key, &format!("/v1/refunds/{refund}")).await.json().await.unwrap();
        shown["status"] == "returned"
    })
    .await;

    assert_eq!(app.refunded(&paid).await, (0, 0), "its hold undone");
    let shown: Value = app.get_as(&app.api_key, &format!("/v1/payments/{paid}")).await.json().await.unwrap();
    assert_eq!((shown["status"].as_str(), shown["amount_refunded"].as_i64()), (Some("succeeded"), Some(0)));
    let entries: i64 = sqlx::query_scalar("SELECT count(*) FROM postings WHERE entry = 'refund_return'")
        .fetch_one(app.db.ledger.pool())
        .await
        .unwrap();
    assert_eq!(entries, 2, "one entry, two legs");
    assert_eq!(app.unbalanced_payments().await, 0);
    assert_inbox(&app, 2, &[("applied", 1)]).await;
    eventually("refund.returned delivered", async || {
        receiver.arrivals("refunds").await.iter().any(|a| a.accepted() && a.event.as_deref() == Some("refund.returned"))
    })
    .await;
    let arrivals = receiver.arrivals("refunds").await;
    assert!(arrivals.iter().all(|a| a.valid), "verified by the reference library");
    let data = arrivals[0].data.clone().unwrap();
    assert_eq!((data["id"].as_str(), data["status"].as_str()), (Some(refund.as_str()), Some("returned")));

    let (status, _) = app.refund_at(&app.url, &paid, "refund-again", &json!({ "amount_minor": 1250 })).await;
    assert_eq!(status, StatusCode::CREATED, "the whole payment may be refunded again");
}
