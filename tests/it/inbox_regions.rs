//! A rail notifies one URL, not one per region: here both rails notify
//! region A only. A notification about region B's instruction is handed to
//! B, which checks the rail's signature itself and takes it in once; after
//! a failover, a return reaching the region that holds a leftover goes to
//! the request's live copy, never to the leftover. Counted in both inboxes,
//! both ledgers and the rail.

use std::collections::BTreeMap;
use std::time::Duration;

use keyfence::domain::{IdempotencyKey, ScopedKey};
use keyfence::keystore::{KeyState, KeyStore};
use keyfence::reconcile::{self, Class, Options};
use keyfence::regions::{self, RegionState, RegionStore};
use keyfence::startup::build_engine;
use reqwest::StatusCode;
use serde_json::{Value, json};

use keyfence::domain::WebhookSecret;
use keyfence::domain::webhook_signature as signature;

use crate::app::{RAIL_NOTIFY_SECRET, TestApp, payment};
use crate::harness::eventually;
use crate::inbox::{notify, quiet_app};
use crate::reconcile::Quiet;

/// Every finding of the whole ledger, at once.
fn options(repair: bool) -> Options {
    Options {
        since: keyfence::domain::Millis::new(0),
        until: keyfence::domain::Millis::now().plus(Duration::from_secs(60)),
        repair,
        stale_after: Duration::ZERO,
        unknown_after: Duration::ZERO,
        segments: 1,
    }
}

/// Each inbox message of a ledger: (kind, state, note).
async fn inbox_of(pool: &sqlx::PgPool) -> Vec<(String, String, Option<String>)> {
    sqlx::query_as("SELECT kind, state, note FROM inbox ORDER BY received_at").fetch_all(pool).await.unwrap()
}

async fn key_state(app: &TestApp, key: &str) -> Option<KeyState> {
    let key = ScopedKey::new(app.client_id().await, IdempotencyKey::parse(key).unwrap());
    app.keys.store.get(&key).await.unwrap().map(|item| item.state)
}

/// Messages waiting to be handed on that some region could not be asked for.
async fn unanswered(pool: &sqlx::PgPool) -> i64 {
    count(pool, "SELECT count(*) FROM inbox WHERE state = 'forwarding' AND unanswered_at IS NOT NULL").await
}

async fn count(pool: &sqlx::PgPool, query: &'static str) -> i64 {
    sqlx::query_scalar(query).fetch_one(pool).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_notification_for_another_regions_instruction_is_handed_to_it_once() {
    let app = quiet_app().await;
    let b = app.second_region("test-2").await;
    notify(&app.e2, &app, "e2");
    app.e2.set_faults(json!({ "timeout_after_apply_rate": 1.0, "duplicate_rate": 1.0 })).await;
    let held = app.try_pay_at(&b.url, &app.api_key, "held", &payment("E2E-HANDED")).await.unwrap();
    assert_eq!(held.status(), StatusCode::ACCEPTED, "the rail held its answer back");

    eventually("B settled the payment by the notification A handed on", async || {
        key_state(&app, "held").await == Some(KeyState::Finished)
    })
    .await;
    eventually("both copies of the notification reached A and were handed on", async || {
        let copies = app.e2.notifications().await;
        let a = inbox_of(app.db.ledger.pool()).await;
        copies.outstanding == 0 && a.iter().all(|(_, state, _)| state == "forwarded")
    })
    .await;
    assert_eq!(app.e2.notifications().await.delivered, 2, "two copies, both taken by A");
    assert!(app.e2.probes().await.is_empty(), "nothing probed the rail: the notification settled it");
    assert_eq!(app.e2.statement().await.len(), 1);
    assert_eq!(app.e2.sent_again().await, BTreeMap::new());
    let handed = ("applied".to_owned(), "forwarded".to_owned(), Some("handed to region test-2".to_owned()));
    assert_eq!(inbox_of(app.db.ledger.pool()).await, [handed], "A kept it once, handed on");
    let taken: Vec<(String, String)> =
        inbox_of(b.db.ledger.pool()).await.into_iter().map(|(kind, state, _)| (kind, state)).collect();
    assert_eq!(taken, [("applied".to_owned(), "applied".to_owned())], "B took it in once");
    assert_eq!(count(b.db.ledger.pool(), "SELECT count(*) FROM payments WHERE status = 'succeeded'").await, 1);
    assert_eq!(app.count("payments").await, 0, "A holds nothing of it");

    let replay = app.try_pay_at(&app.url, &app.api_key, "held", &payment("E2E-HANDED")).await.unwrap();
    assert_eq!(replay.status(), StatusCode::CREATED);
    assert_eq!(replay.json::<Value>().await.unwrap()["status"], "succeeded");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_failover_a_return_reaches_the_live_copy_not_the_leftover() {
    let app = quiet_app().await;
    let b = app.second_region("test-2").await;
    let store = RegionStore::new(app.keys.store.client().clone(), app.keys.store.table());
    // A sends the instruction and hears nothing back; it fails, and B
    // takes the payment over and finishes it (probing the rail).
    app.e2.set_faults(json!({ "timeout_after_apply_rate": 1.0 })).await;
    let held = app.pay("moved", &payment("E2E-MOVED")).await;
    assert_eq!(held.status(), StatusCode::ACCEPTED);
    app.e2.clear_faults().await;
    regions::declare(&store, Some(&app.db.ledger), "test-1", RegionState::Failed, "test", "drill").await.unwrap();
    let done = app.try_pay_at(&b.url, &app.api_key, "moved", &payment("E2E-MOVED")).await.unwrap();
    assert_eq!(done.status(), StatusCode::CREATED, "B finished it");
    let location = done.headers()["location"].to_str().unwrap().to_owned();
    regions::declare(&store, Some(&app.db.ledger), "test-1", RegionState::Active, "test", "healed").await.unwrap();
    // A's reconciler voids A's copy: A holds a leftover.
    let a_engine = build_engine(&app.settings.engine).await.unwrap();
    let options = options(true);
    let report = reconcile::run(&a_engine, &options, &Quiet).await.unwrap();
    assert_eq!(report.findings.iter().map(|f| f.class).collect::<Vec<_>>(), [Class::MovedInFlight]);
    assert_eq!(count(app.db.ledger.pool(), "SELECT count(*) FROM payments WHERE status = 'voided'").await, 1);

    // The rail returns the payment, and tells A.
    notify(&app.e2, &app, "e2");
    let key = app.e2.statement().await[0].idempotency_key.clone();
    let returned = reqwest::Client::new()
        .put(format!("{}/v1/returns", app.e2.url))
        .json(&json!({ "idempotency_key": key }))
        .send()
        .await
        .unwrap();
    assert_eq!(returned.status(), StatusCode::OK);
    eventually("the return was handed to B and applied there", async || {
        let shown: Value = app.get_as(&app.api_key, &location).await.json().await.unwrap();
        let a = inbox_of(app.db.ledger.pool()).await;
        shown["status"] == "returned" && a.iter().all(|(_, state, _)| state == "forwarded")
    })
    .await;
    let handed = ("returned".to_owned(), "forwarded".to_owned(), Some("handed to region test-2".to_owned()));
    assert_eq!(inbox_of(app.db.ledger.pool()).await, [handed], "A kept it once, handed on");
    let taken: Vec<(String, String)> =
        inbox_of(b.db.ledger.pool()).await.into_iter().map(|(kind, state, _)| (kind, state)).collect();
    assert_eq!(taken, [("returned".to_owned(), "applied".to_owned())], "B applied it once");
    let returns = "SELECT count(*) FROM postings WHERE entry = 'return'";
    assert_eq!(count(b.db.ledger.pool(), returns).await, 2, "one compensating entry (two legs), in B");
    assert_eq!(count(app.db.ledger.pool(), returns).await, 0, "nothing posted to A's leftover");
    let (status, _) =
        app.refund_at(&b.url, location_id(&location), "after-return", &json!({ "amount_minor": 1 })).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "a returned payment is not refunded");
}

fn location_id(location: &str) -> &str {
    location.rsplit('/').next().unwrap()
}

/// A region that cannot be asked (here: declared failed, so it takes
/// nothing in) leaves the message waiting, counted by the reconciler; it
/// is offered again until the region takes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_waits_for_a_region_that_cannot_be_asked_and_is_counted_meanwhile() {
    let app = quiet_app().await;
    let b = app.second_region("test-2").await;
    let store = RegionStore::new(app.keys.store.client().clone(), app.keys.store.table());
    let paid = app.try_pay_at(&b.url, &app.api_key, "in-b", &payment("E2E-IN-B")).await.unwrap();
    assert_eq!(paid.status(), StatusCode::CREATED);
    let location = paid.headers()["location"].to_str().unwrap().to_owned();
    regions::declare(&store, Some(&b.db.ledger), "test-2", RegionState::Failed, "test", "drill").await.unwrap();

    notify(&app.e2, &app, "e2");
    let key = app.e2.statement().await[0].idempotency_key.clone();
    let returned = reqwest::Client::new()
        .put(format!("{}/v1/returns", app.e2.url))
        .json(&json!({ "idempotency_key": key }))
        .send()
        .await
        .unwrap();
    assert_eq!(returned.status(), StatusCode::OK);
    eventually("A took the return in and offered it to B, which could not be asked", async || {
        unanswered(app.db.ledger.pool()).await == 1
    })
    .await;
    let a_engine = build_engine(&app.settings.engine).await.unwrap();
    let options = options(false);
    let report = reconcile::run(&a_engine, &options, &Quiet).await.unwrap();
    assert_eq!(report.notifications_to_hand_on, 1, "{}", report.table());
    assert!(report.unmatched_notifications.is_empty(), "not kept for a person: {}", report.table());
    let metrics = report.prometheus(keyfence::domain::Millis::now());
    assert!(metrics.contains("keyfence_reconcile_notifications_to_hand_on 1\n"), "{metrics}");

    regions::declare(&store, Some(&b.db.ledger), "test-2", RegionState::Active, "test", "healed").await.unwrap();
    eventually("offered again, and taken by B once it was back", async || {
        let shown: Value = app.get_as(&app.api_key, &location).await.json().await.unwrap();
        shown["status"] == "returned"
    })
    .await;
    let taken: Vec<(String, String)> =
        inbox_of(b.db.ledger.pool()).await.into_iter().map(|(kind, state, _)| (kind, state)).collect();
    assert_eq!(taken, [("returned".to_owned(), "applied".to_owned())]);
    let again = reconcile::run(&a_engine, &options, &Quiet).await.unwrap();
    assert_eq!(again.notifications_to_hand_on, 0, "{}", again.table());
}

/// A notification A could not take when it came (the instruction was B's)
/// becomes A's once A adopts the request from B, declared failed: A takes
/// it back from the messages it was handing on, instead of offering it to
/// B until a person gets it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_waiting_to_be_handed_on_is_taken_back_once_the_request_is_adopted_here() {
    let app = quiet_app().await;
    let b = app.second_region("test-2").await;
    let store = RegionStore::new(app.keys.store.client().clone(), app.keys.store.table());
    app.e2.set_faults(json!({ "timeout_after_apply_rate": 1.0 })).await;
    let body = payment("E2E-ADOPTED");
    let held = app.try_pay_at(&b.url, &app.api_key, "adopted", &body).await.unwrap();
    assert_eq!(held.status(), StatusCode::ACCEPTED, "B's instruction is at the rail, its answer held back");
    app.e2.clear_faults().await;
    regions::declare(&store, Some(&b.db.ledger), "test-2", RegionState::Failed, "test", "drill").await.unwrap();

    // The rail's verdict reaches A, which holds nothing of it yet.
    let applied = app.e2.statement().await[0].clone();
    let notice = json!({ "type": "instruction.applied", "id": "evt_e2_adopted", "applied": applied });
    let raw = serde_json::to_vec(&notice).unwrap();
    let secret = WebhookSecret { value: RAIL_NOTIFY_SECRET.to_owned(), created_at: 0, valid_until: None };
    let now = time::OffsetDateTime::now_utc().unix_timestamp();
    let posted = app
        .http
        .post(format!("{}/v1/rail-events/e2", app.url))
        .header("content-type", "application/json")
        .header("webhook-id", "evt_e2_adopted")
        .header("webhook-timestamp", now.to_string())
        .header("webhook-signature", signature::header(&[&secret], "evt_e2_adopted", now, &raw))
        .body(raw)
        .send()
        .await
        .unwrap();
    assert_eq!(posted.status(), StatusCode::OK);
    eventually("offered to B, which could not be asked", async || unanswered(app.db.ledger.pool()).await == 1).await;

    // A client retries at A: A adopts the request and finishes it.
    eventually("A finished the request it adopted", async || {
        let answer = app.try_pay_at(&app.url, &app.api_key, "adopted", &body).await.unwrap();
        answer.status() == StatusCode::CREATED
    })
    .await;
    eventually("A took the notification back and ended it here", async || {
        let a = inbox_of(app.db.ledger.pool()).await;
        a.len() == 1 && ["applied", "ignored"].contains(&a[0].1.as_str())
    })
    .await;
    assert_eq!(app.e2.sent_again().await, BTreeMap::new(), "the instruction was not sent again");
    assert_eq!(count(app.db.ledger.pool(), "SELECT count(*) FROM payments WHERE status = 'succeeded'").await, 1);
}
