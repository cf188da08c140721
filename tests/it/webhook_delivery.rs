//! Webhook delivery, checked by a receiver that verifies every attempt with
//! the Standard Webhooks reference library: every event arrives signed,
//! each `webhook-id` once in effect (retries reuse it), a payment's events
//! in order; a receiver that is down gets everything once it is back, at
//! the pace it asks for; 410 disables an endpoint, and so do deliveries
//! that use up their schedule; two instances never send the same delivery
//! at once; and no crash loses an event or gives it a new id.

use std::collections::BTreeMap;
use std::time::Duration;

use futures::StreamExt;
use futures::future::join_all;
use keyfence::webhooks::deliveries::{Deliveries, Redeliver};
use keyfence::webhooks::webhook_id;
use reqwest::StatusCode;
use serde_json::{Value, json};
use uuid::Uuid;

use crate::app::{DEBTOR, TestApp, payment, spawn_app, spawn_app_with, start_instance};
use crate::harness::eventually;
use crate::process::{ServeProcess, keyfence_command};
use crate::receiver::{Arrival, Receiver};

const EVENTS: [&str; 3] = ["payment.succeeded", "payment.rejected", "payment.indeterminate"];

/// Registers endpoint `name` of the receiver for every event, answering as
/// `behaviour` says; returns its id.
pub async fn subscribe(app: &TestApp, receiver: &Receiver, name: &str, behaviour: Value) -> Uuid {
    subscribe_to(app, receiver, name, &EVENTS, behaviour).await
}

/// An endpoint of `app`'s client at `receiver`'s hook `name`, for `events`.
pub async fn subscribe_to(
    app: &TestApp,
    receiver: &Receiver,
    name: &str,
    events: &[&str],
    mut behaviour: Value,
) -> Uuid {
    let made = app
        .http
        .post(format!("{}/v1/webhook-endpoints", app.url))
        .bearer_auth(&app.api_key)
        .json(&json!({ "url": receiver.hook(name), "events": events }))
        .send()
        .await
        .unwrap();
    assert_eq!(made.status(), StatusCode::CREATED);
    let made: Value = made.json().await.unwrap();
    behaviour["secret"] = made["secret"].clone();
    receiver.behave(name, behaviour).await;
    made["id"].as_str().unwrap().parse().unwrap()
}

/// The `webhook-id` of every event in the ledger, for `endpoint`, by event type and payment.
async fn expected_ids(app: &TestApp, endpoint: Uuid) -> BTreeMap<String, (String, Uuid)> {
    let events: Vec<(Uuid, String, Uuid)> =
        sqlx::query_as("SELECT event_id, event, payment_id FROM outbox").fetch_all(app.db.ledger.pool()).await.unwrap();
    events.into_iter().map(|(event, kind, payment)| (webhook_id(event, endpoint), (kind, payment))).collect()
}

/// Attempts by `webhook-id`, in arrival order.
fn by_id(arrivals: &[Arrival]) -> BTreeMap<String, Vec<&Arrival>> {
    let mut grouped: BTreeMap<String, Vec<&Arrival>> = BTreeMap::new();
    for arrival in arrivals {
        grouped.entry(arrival.webhook_id.clone()).or_default().push(arrival);
    }
    grouped
}

async fn delivered_ids(receiver: &Receiver, name: &str) -> usize {
    by_id(&receiver.arrivals(name).await).values().filter(|a| a.iter().any(|a| a.accepted())).count()
}

async fn states(app: &TestApp) -> BTreeMap<String, i64> {
    let rows: Vec<(String, i64)> = sqlx::query_as("SELECT state, count(*) FROM webhook_deliveries GROUP BY state")
        .fetch_all(app.db.ledger.pool())
        .await
        .unwrap();
    rows.into_iter().collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_storm_every_event_arrives_signed_and_once_in_effect() {
    let receiver = Receiver::start().await;
    let app = spawn_app().await;
    // Every delivery is refused twice first: its retries must reuse its id.
    let endpoint = subscribe(&app, &receiver, "storm", json!({ "fail": 2, "status": 500 })).await;

    let body = payment("E2E-STORM");
    let storm = join_all((0..100).map(|_| app.pay("storm-1", &body))).await;
    assert!(storm.iter().any(|r| r.status() == StatusCode::CREATED));
    let distinct: Vec<StatusCode> = futures::stream::iter(0..50)
        .map(|i| {
            let app = &app;
            async move { app.pay(&format!("distinct-{i}"), &payment(&format!("E2E-D-{i}"))).await.status() }
        })
        .buffer_unordered(16)
        .collect()
        .await;
    assert!(distinct.iter().all(|s| *s == StatusCode::CREATED), "{distinct:?}");
    eventually("51 events delivered", async || delivered_ids(&receiver, "storm").await == 51).await;

    let arrivals = receiver.arrivals("storm").await;
    let invalid: Vec<&str> = arrivals.iter().filter(|a| !a.valid).map(|a| a.error.as_deref().unwrap_or("?")).collect();
    assert!(invalid.is_empty(), "every attempt verifies: {invalid:?}");
    let expected = expected_ids(&app, endpoint).await;
    assert_eq!(expected.len(), 51, "one event per payment");
    let grouped = by_id(&arrivals);
    assert_eq!(grouped.keys().collect::<Vec<_>>(), expected.keys().collect::<Vec<_>>(), "no other ids");
    for (id, attempts) in &grouped {
        let answers: Vec<Option<u16>> = attempts.iter().map(|a| a.answered).collect();
        assert_eq!(answers, [Some(500), Some(500), Some(204)], "{id}: retried with the same id, accepted once");
        let (kind, payment_id) = &expected[id];
        let data = attempts[2].data.as_ref().unwrap();
        assert_eq!(attempts[2].event.as_deref(), Some(kind.as_str()));
        assert_eq!(data["id"], json!(payment_id));
        assert_eq!(data["status"], "succeeded");
        assert_eq!(data["debtor_account"], "****3000", "masked");
    }
    let stored: String = sqlx::query_scalar("SELECT string_agg(payload::text, ' ') FROM outbox")
        .fetch_one(app.db.ledger.pool())
        .await
        .unwrap();
    assert!(!stored.contains(DEBTOR), "no full account number is kept with an event");
    eventually("every delivery recorded as delivered", async || {
        states(&app).await == BTreeMap::from([("delivered".to_owned(), 51)])
    })
    .await;
}

/// An app whose payments park quickly and are marked indeterminate at
/// their second unknown outcome, probed again every 200 ms.
async fn parking_app() -> TestApp {
    spawn_app_with(|s| {
        s.engine.work.lease = Duration::from_millis(1000);
        (s.engine.rails.rail_timeout, s.engine.rails.rail_attempts) = (Duration::from_millis(300), 1);
        s.recovery_interval_ms = 200;
        s.engine.work.max_unknown_attempts = 2;
    })
    .await
}

/// A payment whose outcome stays unknown queues `payment.indeterminate`,
/// then `payment.succeeded` once it settles: the second waits until the
/// first has arrived, however long the first takes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_payments_events_arrive_in_the_order_they_were_written() {
    let receiver = Receiver::start().await;
    let app = parking_app().await;
    let endpoint = subscribe(&app, &receiver, "ordered", json!({ "fail": 5, "status": 503 })).await;
    app.e2.set_faults(json!({ "latency_ms": 60_000 })).await;
    assert_eq!(app.pay("ordered-1", &payment("E2E-ORDER")).await.status(), StatusCode::ACCEPTED);
    let queued = async |event: &str| -> bool {
        sqlx::query_scalar("SELECT count(*) > 0 FROM outbox WHERE event = $1")
            .bind(event)
            .fetch_one(app.db.ledger.pool())
            .await
            .unwrap()
    };
    eventually("payment.indeterminate queued", async || queued("payment.indeterminate").await).await;
    app.e2.clear_faults().await;
    eventually("payment.succeeded queued", async || queued("payment.succeeded").await).await;
    eventually("both delivered", async || delivered_ids(&receiver, "ordered").await == 2).await;

    let expected = expected_ids(&app, endpoint).await;
    let arrivals = receiver.arrivals("ordered").await;
    assert!(arrivals.iter().all(|a| a.valid));
    let kinds: Vec<&str> = arrivals.iter().map(|a| expected[&a.webhook_id].0.as_str()).collect();
    let first_succeeded = kinds.iter().position(|k| *k == "payment.succeeded").unwrap();
    assert!(
        kinds[first_succeeded..].iter().all(|k| *k == "payment.succeeded"),
        "nothing of payment.succeeded before payment.indeterminate arrived: {kinds:?}"
    );
    assert_eq!(kinds.iter().filter(|k| **k == "payment.indeterminate").count(), 6, "five refusals, then accepted");
    // The second was written while the first was still being retried, so
    // the order was the worker's doing, not the clock's.
    let overlapped: bool = sqlx::query_scalar(
        "SELECT s.created_at < d.finished_at FROM outbox s, outbox i JOIN webhook_deliveries d ON d.event_id = i.event_id
          WHERE s.event = 'payment.succeeded' AND i.event = 'payment.indeterminate'",
    )
    .fetch_one(app.db.ledger.pool())
    .await
    .unwrap();
    assert!(overlapped, "payment.succeeded was queued before payment.indeterminate was delivered");
}

/// A payment parked past the limit is marked indeterminate at every park
/// from then on, but its `payment.indeterminate` event is queued once in
/// its life: once the delivered event is pruned, later parks do not queue
/// it again (the receiver would get the same `webhook-id` anew, as news).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_indeterminate_event_is_queued_once_however_often_the_payment_parks() {
    let receiver = Receiver::start().await;
    let app = parking_app().await;
    subscribe(&app, &receiver, "parks", json!({})).await;
    app.e2.set_faults(json!({ "latency_ms": 60_000 })).await;
    assert_eq!(app.pay("parks-1", &payment("E2E-PARKS")).await.status(), StatusCode::ACCEPTED);
    let arrived = async || {
        let arrivals = receiver.arrivals("parks").await;
        arrivals.iter().filter(|a| a.accepted() && a.event.as_deref() == Some("payment.indeterminate")).count()
    };
    eventually("payment.indeterminate delivered", async || arrived().await == 1).await;
    let attempts = async || -> i32 {
        sqlx::query_scalar("SELECT attempts FROM external_calls WHERE step = 'ext2'")
            .fetch_one(app.db.ledger.pool())
            .await
            .unwrap()
    };
    // The delivered event past its retention, pruned as the worker prunes.
    let pruned = Deliveries::new(app.db.ledger.pool().clone()).prune(Duration::ZERO, 100).await.unwrap();
    assert_eq!(pruned, 1);
    let parked = attempts().await;
    eventually("parked three times more", async || attempts().await >= parked + 3).await;
    // A delivery queued by the last park would be due at once.
    eventually("the worker idle", async || !states(&app).await.contains_key("pending")).await;
    assert_eq!(arrived().await, 1, "the event arrived once");
    assert_eq!(app.count("outbox").await, 0, "nothing queued again");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receiver_down_for_a_while_gets_everything_at_the_pace_it_asks_for() {
    let receiver = Receiver::start().await;
    let app = spawn_app_with(|s| s.webhook_delivery.attempts = 20).await;
    subscribe(&app, &receiver, "down", json!({ "fail": "all", "status": 503, "retry_after": 1 })).await;
    for i in 0..3 {
        assert_eq!(
            app.pay(&format!("down-{i}"), &payment(&format!("E2E-DOWN-{i}"))).await.status(),
            StatusCode::CREATED
        );
    }
    eventually("each delivery tried three times", async || {
        let arrivals = receiver.arrivals("down").await;
        let grouped = by_id(&arrivals);
        grouped.len() == 3 && grouped.values().all(|a| a.len() >= 3)
    })
    .await;
    let arrivals = receiver.arrivals("down").await;
    for attempts in by_id(&arrivals).values() {
        for pair in attempts.windows(2) {
            let gap = pair[1].at - pair[0].at;
            assert!(gap >= 0.95, "Retry-After: 1 was honoured ({gap:.3} s between attempts)");
        }
    }
    // Back up: everything arrives, on the schedule.
    let secret = receiver_secret(&app).await;
    receiver.behave("down", json!({ "secret": secret })).await;
    eventually("all three delivered", async || delivered_ids(&receiver, "down").await == 3).await;
    eventually("recorded", async || states(&app).await == BTreeMap::from([("delivered".to_owned(), 3)])).await;
}

/// The secret of the app's one endpoint, read from the key table.
async fn receiver_secret(app: &TestApp) -> String {
    let store = app.endpoints().await;
    let client = app.client_id().await;
    let endpoint = store.list(client).await.unwrap().remove(0);
    store.signing_secrets(client, &endpoint, keyfence::domain::Millis::now().get()).await.unwrap().remove(0).value
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_410_disables_an_endpoint_and_so_do_deliveries_that_use_up_their_schedule() {
    let receiver = Receiver::start().await;
    let app = spawn_app_with(|s| {
        s.webhook_delivery.attempts = 3;
        s.webhook_delivery.disable_after = 2;
    })
    .await;
    let gone = subscribe(&app, &receiver, "gone", json!({ "fail": "all", "status": 410 })).await;
    let broken = subscribe(&app, &receiver, "broken", json!({ "fail": "all", "status": 500 })).await;
    let fine = subscribe(&app, &receiver, "fine", json!({})).await;
    let status_of = async |id: Uuid| -> Value {
        let listed: Value = app.get_as(&app.api_key, "/v1/webhook-endpoints").await.json().await.unwrap();
        listed["data"].as_array().unwrap().iter().find(|e| e["id"] == json!(id)).unwrap().clone()
    };

    assert_eq!(app.pay("first", &payment("E2E-FIRST")).await.status(), StatusCode::CREATED);
    eventually("the 410 disables its endpoint", async || status_of(gone).await["status"] == "disabled").await;
    eventually("the broken one is flagged", async || status_of(broken).await["status"] == "failing").await;
    assert!(status_of(gone).await["disabled_reason"].as_str().unwrap().contains("410"));
    assert_eq!(receiver.arrivals("gone").await.len(), 1, "no retry after a 410");
    assert_eq!(receiver.arrivals("broken").await.len(), 3, "the whole schedule");
    assert_eq!(status_of(fine).await["status"], "enabled");

    assert_eq!(app.pay("second", &payment("E2E-SECOND")).await.status(), StatusCode::CREATED);
    eventually("a second failed delivery disables it", async || status_of(broken).await["status"] == "disabled").await;
    eventually("the fine one gets both", async || delivered_ids(&receiver, "fine").await == 2).await;
    assert_eq!(receiver.arrivals("gone").await.len(), 1, "nothing more is sent to a disabled endpoint");
    assert_eq!(receiver.arrivals("broken").await.len(), 6);
    let third = app.pay("third", &payment("E2E-THIRD")).await;
    assert_eq!(third.status(), StatusCode::CREATED);
    eventually("the fine one gets the third", async || delivered_ids(&receiver, "fine").await == 3).await;
    assert_eq!(receiver.arrivals("broken").await.len(), 6, "disabled: the third is not fanned out to it");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_side_by_side_never_send_one_delivery_at_once() {
    let receiver = Receiver::start().await;
    let app = spawn_app().await;
    // Slow answers, and a refusal first: plenty of chances to overlap.
    subscribe(&app, &receiver, "pair", json!({ "fail": 1, "status": 500, "delay_ms": 300 })).await;
    let (second, _stop) = start_instance(&app.settings).await;
    let paid: Vec<StatusCode> = futures::stream::iter(0..30)
        .map(|i| {
            let (app, second) = (&app, &second);
            let url = if i % 2 == 0 { app.url.clone() } else { second.clone() };
            async move {
                let body = payment(&format!("E2E-PAIR-{i}"));
                app.try_pay_at(&url, &app.api_key, &format!("pair-{i}"), &body).await.unwrap().status()
            }
        })
        .buffer_unordered(8)
        .collect()
        .await;
    assert!(paid.iter().all(|s| *s == StatusCode::CREATED), "{paid:?}");
    eventually("30 delivered", async || delivered_ids(&receiver, "pair").await == 30).await;
    let arrivals = receiver.arrivals("pair").await;
    assert!(arrivals.iter().all(|a| !a.overlapping), "no delivery was sent by both at once");
    for (id, attempts) in by_id(&arrivals) {
        assert_eq!(attempts.iter().filter(|a| a.accepted()).count(), 1, "{id} accepted once");
        assert_eq!(attempts.len(), 2, "{id}: one refusal, one acceptance");
    }
}

/// `serve` killed with deliveries in flight, and another killed between
/// its commits and any attempt: every event still arrives, under the id it
/// was given, and none under any other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_crash_loses_an_event_or_gives_it_a_new_id() {
    let receiver = Receiver::start().await;
    let app = spawn_app_with(|s| s.webhook_delivery.interval_ms = 0).await;
    let endpoint = subscribe(&app, &receiver, "crash", json!({ "delay_ms": 1500 })).await;
    let serve = |interval_ms: &str| {
        let mut command = keyfence_command(&app, "serve");
        command
            .env("KEYFENCE_WEBHOOK_INTERVAL_MS", interval_ms)
            .env("KEYFENCE_WEBHOOK_TIMEOUT_MS", "2000")
            .env("KEYFENCE_WEBHOOK_RETRY_FIRST_MS", "50");
        command
    };
    // One instance sends nothing: it commits and dies.
    let quiet = ServeProcess::spawn(serve("0")).await;
    for i in 0..5 {
        let body = payment(&format!("E2E-QUIET-{i}"));
        let paid = app.try_pay_at(&quiet.url, &app.api_key, &format!("quiet-{i}"), &body).await.unwrap();
        assert_eq!(paid.status(), StatusCode::CREATED);
    }
    drop(quiet);
    // The next dies while its deliveries are being answered.
    let busy = ServeProcess::spawn(serve("50")).await;
    for i in 0..5 {
        let body = payment(&format!("E2E-BUSY-{i}"));
        let paid = app.try_pay_at(&busy.url, &app.api_key, &format!("busy-{i}"), &body).await.unwrap();
        assert_eq!(paid.status(), StatusCode::CREATED);
    }
    eventually("deliveries in flight", async || receiver.arrivals("crash").await.iter().any(|a| a.answered.is_none()))
        .await;
    drop(busy);
    let secret = receiver_secret(&app).await;
    receiver.behave("crash", json!({ "secret": secret })).await;
    let _survivor = ServeProcess::spawn(serve("50")).await;
    eventually("every event delivered", async || delivered_ids(&receiver, "crash").await == 10).await;

    let expected = expected_ids(&app, endpoint).await;
    assert_eq!(expected.len(), 10);
    let arrivals = receiver.arrivals("crash").await;
    assert!(arrivals.iter().all(|a| a.valid && expected.contains_key(&a.webhook_id)), "only the ids given once");
    eventually("recorded", async || states(&app).await == BTreeMap::from([("delivered".to_owned(), 10)])).await;
}

/// Operators list failed deliveries and send them again, with their ids.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operators_list_deliveries_and_redeliver_them_under_the_same_id() {
    let receiver = Receiver::start().await;
    let app = spawn_app_with(|s| {
        s.webhook_delivery.attempts = 2;
        s.webhook_delivery.disable_after = 100;
    })
    .await;
    subscribe(&app, &receiver, "ops", json!({ "fail": "all", "status": 500 })).await;
    for i in 0..2 {
        assert_eq!(app.pay(&format!("ops-{i}"), &payment(&format!("E2E-OPS-{i}"))).await.status(), StatusCode::CREATED);
    }
    eventually("both failed", async || states(&app).await == BTreeMap::from([("failed".to_owned(), 2)])).await;

    let listed = keyfence_command(&app, "webhooks").args(["deliveries", "--failed", "--json"]).output().await.unwrap();
    assert!(listed.status.success(), "{}", String::from_utf8_lossy(&listed.stderr));
    let listed: Vec<Value> = serde_json::from_slice(&listed.stdout).unwrap();
    assert_eq!(listed.len(), 2);
    assert!(listed.iter().all(|d| d["state"] == "failed" && d["attempts"] == 2 && d["last_status"] == 500));
    let table = keyfence_command(&app, "webhooks").args(["deliveries"]).output().await.unwrap();
    let table = String::from_utf8(table.stdout).unwrap();
    assert!(table.contains("2 failed"), "{table}");

    let secret = receiver_secret(&app).await;
    receiver.behave("ops", json!({ "secret": secret })).await;
    let event = listed[0]["event_id"].as_str().unwrap();
    let again = keyfence_command(&app, "webhooks").args(["redeliver", "--event", event]).output().await.unwrap();
    assert!(again.status.success(), "{}", String::from_utf8_lossy(&again.stderr));
    eventually("the one redelivered arrives", async || delivered_ids(&receiver, "ops").await == 1).await;
    let accepted: Vec<String> =
        receiver.arrivals("ops").await.into_iter().filter(|a| a.accepted()).map(|a| a.webhook_id).collect();
    assert_eq!(accepted, [listed[0]["webhook_id"].as_str().unwrap()], "under the id it had");

    let rest = keyfence_command(&app, "webhooks").args(["redeliver", "--since", "1h"]).output().await.unwrap();
    assert!(String::from_utf8_lossy(&rest.stdout).contains("1 deliver"), "{}", String::from_utf8_lossy(&rest.stdout));
    eventually("the other arrives too", async || delivered_ids(&receiver, "ops").await == 2).await;
    assert_eq!(receiver.arrivals("ops").await.iter().filter(|a| a.accepted()).count(), 2);
}

/// Finished events are pruned after the retention with their deliveries;
/// events still to arrive are kept however old.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finished_events_are_pruned_after_the_retention_and_pending_ones_kept() {
    let receiver = Receiver::start().await;
    let app = spawn_app().await;
    subscribe(&app, &receiver, "prune", json!({})).await;
    for i in 0..3 {
        assert_eq!(
            app.pay(&format!("prune-{i}"), &payment(&format!("E2E-PRUNE-{i}"))).await.status(),
            StatusCode::CREATED
        );
    }
    eventually("delivered", async || states(&app).await.get("delivered") == Some(&3)).await;
    let pool = app.db.ledger.pool();
    // One is due again (as a redelivery leaves it), and all are old.
    sqlx::query("UPDATE outbox SET created_at = now() - interval '8 days'").execute(pool).await.unwrap();
    let deliveries = Deliveries::new(pool.clone());
    let pending: Uuid = sqlx::query_scalar("SELECT event_id FROM outbox LIMIT 1").fetch_one(pool).await.unwrap();
    receiver.behave("prune", json!({ "secret": receiver_secret(&app).await, "fail": "all", "delay_ms": 1000 })).await;
    assert_eq!(deliveries.redeliver(Redeliver::Event(pending)).await.unwrap(), 1);

    assert_eq!(deliveries.prune(Duration::from_secs(7 * 24 * 3600), 1000).await.unwrap(), 2);
    assert_eq!(app.count("outbox").await, 1, "the pending one is kept");
    assert_eq!(app.count("webhook_deliveries").await, 1);
    assert_eq!(deliveries.prune(Duration::from_secs(9 * 24 * 3600), 1000).await.unwrap(), 0, "within retention");
}

/// An endpoint hears what is written after it was registered; what comes
/// while it is disabled is kept as failed deliveries to it, which
/// `redeliver --since` sends once it is enabled again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_endpoint_hears_what_came_after_it_and_once_enabled_what_came_while_disabled() {
    let receiver = Receiver::start().await;
    // Nothing is fanned out until a delivering instance starts, after both.
    let app = spawn_app_with(|s| s.webhook_delivery.interval_ms = 0).await;
    assert_eq!(app.pay("before", &payment("E2E-BEFORE")).await.status(), StatusCode::CREATED);
    let endpoint = subscribe(&app, &receiver, "late", json!({})).await;
    assert_eq!(app.pay("after", &payment("E2E-AFTER")).await.status(), StatusCode::CREATED);
    let mut delivering = app.settings.clone();
    delivering.webhook_delivery.interval_ms = 50;
    let (_courier, _stop) = start_instance(&delivering).await;
    eventually("the later one delivered", async || delivered_ids(&receiver, "late").await == 1).await;
    let delivered: Vec<Value> = receiver.arrivals("late").await.into_iter().filter_map(|a| a.data).collect();
    assert_eq!(delivered[0]["end_to_end_id"], "E2E-AFTER", "not the one written before the endpoint");

    let store = app.endpoints().await;
    let client = app.client_id().await;
    store.disable(client, endpoint, "an operator's test").await.unwrap();
    assert_eq!(app.pay("while-disabled", &payment("E2E-WHILE")).await.status(), StatusCode::CREATED);
    eventually("kept as a failed delivery", async || states(&app).await.get("failed") == Some(&1)).await;
    store.enable(client, endpoint).await.unwrap();
    let again = keyfence_command(&app, "webhooks").args(["redeliver", "--since", "1h"]).output().await.unwrap();
    assert!(again.status.success(), "{}", String::from_utf8_lossy(&again.stderr));
    eventually("what it missed arrives", async || delivered_ids(&receiver, "late").await == 2).await;
    assert_eq!(app.count("webhook_deliveries").await, 2, "none for the event written before it");
}

/// A region declared failed sends nothing; once restored, it sends what it
/// holds, but not the events of a payment another region took over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_region_sends_nothing_and_once_restored_not_what_moved_away() {
    let receiver = Receiver::start().await;
    let app = spawn_app_with(|s| s.webhook_delivery.attempts = 100).await;
    subscribe(&app, &receiver, "region", json!({ "fail": "all", "status": 500 })).await;
    for key in ["moved", "stayed"] {
        assert_eq!(app.pay(key, &payment(&format!("E2E-{key}"))).await.status(), StatusCode::CREATED);
    }
    eventually("both tried", async || by_id(&receiver.arrivals("region").await).len() == 2).await;

    app.db.ledger.set_region_fence(true, "test-1", 1, "drill").await.unwrap();
    receiver.behave("region", json!({ "secret": receiver_secret(&app).await })).await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(delivered_ids(&receiver, "region").await, 0, "nothing sent while declared failed");

    // Meanwhile another region took one of the payments over.
    let moved = keyfence::domain::ScopedKey::new(
        app.client_id().await,
        keyfence::domain::IdempotencyKey::parse("moved").unwrap(),
    );
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
    app.db.ledger.set_region_fence(false, "test-1", 2, "restored").await.unwrap();
    eventually("the one that stayed delivered, the one that moved ended unsent", async || {
        states(&app).await == BTreeMap::from([("delivered".to_owned(), 1), ("failed".to_owned(), 1)])
    })
    .await;
    let accepted: Vec<Value> =
        receiver.arrivals("region").await.into_iter().filter(|a| a.accepted()).filter_map(|a| a.data).collect();
    assert_eq!(accepted.len(), 1);
    assert_eq!(accepted[0]["end_to_end_id"], "E2E-stayed");
    let why: String = sqlx::query_scalar("SELECT last_error FROM webhook_deliveries WHERE state = 'failed'")
        .fetch_one(app.db.ledger.pool())
        .await
        .unwrap();
    assert!(why.contains("taken over by region test-2"), "{why}");
}

/// A worker held up after it took a delivery and before it sends (a slow
/// key-store read stands behind the stall) checks its lease again: too
/// late to end inside it, it gives the delivery back, due at once and its
/// attempt uncounted, so the receiver never gets one id from two workers
/// at once and the schedule loses nothing.
#[cfg(feature = "failpoints")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_held_up_before_its_send_leaves_the_delivery_to_the_next() {
    let receiver = Receiver::start().await;
    let app = spawn_app_with(|s| s.webhook_delivery.interval_ms = 0).await;
    subscribe(&app, &receiver, "held", json!({ "delay_ms": 1500 })).await;
    // A 2 s timeout makes a 9 s lease; the one stall ends 1 s before it.
    let serve = |failpoints: Option<&str>| {
        let mut command = keyfence_command(&app, "serve");
        command
            .env("KEYFENCE_WEBHOOK_INTERVAL_MS", "50")
            .env("KEYFENCE_WEBHOOK_TIMEOUT_MS", "2000")
            .env("KEYFENCE_WEBHOOK_RETRY_FIRST_MS", "50");
        if let Some(failpoints) = failpoints {
            command.env("FAILPOINTS", failpoints);
        }
        command
    };
    let (held, logs) = ServeProcess::spawn_logged(serve(Some("before-webhook-send=1*sleep(8000)"))).await;
    let paid = app.try_pay_at(&held.url, &app.api_key, "held", &payment("E2E-HELD")).await.unwrap();
    assert_eq!(paid.status(), StatusCode::CREATED);
    eventually("the held worker took the delivery", async || {
        let lease = sqlx::query_scalar::<_, i64>("SELECT lease FROM webhook_deliveries");
        lease.fetch_optional(app.db.ledger.pool()).await.unwrap().is_some_and(|lease| lease > 0)
    })
    .await;
    let _next = ServeProcess::spawn(serve(None)).await;
    eventually("delivered", async || delivered_ids(&receiver, "held").await == 1).await;
    eventually("the held worker gave the delivery up or sent it too", async || {
        logs.lines().iter().any(|l| l.contains("waited past its lease")) || receiver.arrivals("held").await.len() > 1
    })
    .await;
    let arrivals = receiver.arrivals("held").await;
    assert!(arrivals.iter().all(|a| !a.overlapping), "never sent by both at once: {arrivals:?}");
    assert_eq!(arrivals.len(), 1, "sent once, by the worker that held the lease: {arrivals:?}");
    assert!(logs.lines().iter().any(|l| l.contains("waited past its lease")), "the held worker gave it up");
    let attempts: i32 =
        sqlx::query_scalar("SELECT attempts FROM webhook_deliveries").fetch_one(app.db.ledger.pool()).await.unwrap();
    assert_eq!(attempts, 1, "the attempt given back is not counted against the schedule");
}
