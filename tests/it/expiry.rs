//! Expiry without a table time-to-live (the emulator never reaps, as a
//! strongly consistent global table would not): `keyfence maintain
//! --expire` deletes finished keys past their retention and its grace, and
//! touches nothing else, neither a key still within them nor one in flight.
//! A request refused by its checks is never worked through a key that
//! expires under it. Inside `serve`, one instance at a time sweeps.

use std::time::Duration;

use aws_sdk_dynamodb::types::AttributeValue;
use keyfence::domain::{IdempotencyKey, Millis, ScopedKey};
use keyfence::keystore::{KeyState, KeyStore};
use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::app::{TestApp, payment, spawn_app_with, start_serving};
use crate::aws_calls::{Calls, recording_proxy};
use crate::harness::eventually;
use crate::process::keyfence_command;

/// Moves `key`'s `expires_at` back to `ago` before now.
async fn expire(app: &TestApp, key: &str, ago: Duration) {
    app.keys
        .store
        .client()
        .update_item()
        .table_name(app.keys.store.table())
        .key("pk", AttributeValue::S(format!("{}#{key}", app.client_id().await)))
        .update_expression("SET expires_at = :past")
        .expression_attribute_values(":past", AttributeValue::N((Millis::now().as_secs() - ago.as_secs()).to_string()))
        .send()
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sweeper_deletes_expired_keys_and_nothing_in_flight() {
    let app = spawn_app_with(|s| s.engine.rails.rail_timeout = Duration::from_millis(300)).await;
    for key in ["old-1", "old-2", "recent-1"] {
        assert_eq!(app.pay(key, &payment(&format!("E2E-{key}"))).await.status(), StatusCode::CREATED);
    }
    app.e2.set_faults(json!({ "latency_ms": 60_000 })).await;
    assert_eq!(app.pay("in-flight-1", &payment("E2E-in-flight")).await.status(), StatusCode::ACCEPTED);
    // An hour past: beyond the retention's grace (ten minutes by default).
    expire(&app, "old-1", Duration::from_secs(3600)).await;
    expire(&app, "old-2", Duration::from_secs(3600)).await;

    let run = keyfence_command(&app, "maintain").args(["--expire", "--json", "--rate", "20"]).output().await.unwrap();
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    let report: Value = serde_json::from_slice(&run.stdout).unwrap();
    assert_eq!((report["expired"].as_u64(), report["deleted"].as_u64()), (Some(2), Some(2)), "{report}");
    assert_eq!(report["keys_scanned"], 4, "the region registry and clients are not keys");

    let client = app.client_id().await;
    let mut states = Vec::new();
    for key in ["old-1", "old-2", "recent-1", "in-flight-1"] {
        let key = ScopedKey::new(client, IdempotencyKey::parse(key).unwrap());
        states.push(app.keys.store.get(&key).await.unwrap().map(|item| item.state));
    }
    assert_eq!(
        states,
        [None, None, Some(KeyState::Finished), Some(KeyState::Started)],
        "expired keys deleted; one within retention and one in flight untouched"
    );
    assert_eq!(app.count("payments").await, 4, "the ledger keeps its history");
}

/// A sweeper (or a claimer) whose clock runs a minute ahead sees a key
/// whose retention ended a minute ago. Within the grace it must neither
/// delete the key nor claim it anew: a late retry replays the answer the
/// client was given instead of paying a second time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_just_past_its_retention_on_a_clock_running_ahead_is_kept_and_replayed() {
    let app = spawn_app_with(|_| {}).await;
    let first = app.pay("late-1", &payment("E2E-late-1")).await;
    assert_eq!(first.status(), StatusCode::CREATED);
    let bytes = first.bytes().await.unwrap();
    expire(&app, "late-1", Duration::from_secs(60)).await;

    let run = keyfence_command(&app, "maintain").args(["--expire", "--json"]).output().await.unwrap();
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    let report: Value = serde_json::from_slice(&run.stdout).unwrap();
    assert_eq!(report["deleted"].as_u64(), Some(0), "within the grace: {report}");

    // A fresh instance has no answer in memory: it must ask the key store.
    let (fresh, _stop) = crate::app::start_instance(&app.settings).await;
    let retry = app.try_pay_at(&fresh, &app.api_key, "late-1", &payment("E2E-late-1")).await.unwrap();
    assert_eq!(retry.status(), StatusCode::CREATED);
    assert_eq!(retry.headers()["idempotent-replayed"], "true", "a replay, not a new claim");
    assert_eq!(retry.bytes().await.unwrap(), bytes);
    assert_eq!(app.count("payments").await, 1, "paid once");
    assert_eq!(app.e2.statement().await.len(), 1);
}

/// The account another client holds, which the test client must never pay from.
#[cfg(feature = "failpoints")]
const VICTIM: &str = "GB82WEST12345698765432";

/// A client resends its own old key with another client's account just
/// before the key expires: the account check refuses it, but the key is
/// still live, so the request is worked as that key accepted it (here:
/// another body under the key, 422). A stall after the check
/// (`before-claim`) carries the request past the key's expiry: had it
/// claimed, the claim would have made a new payment from the account nobody
/// checked. Nothing is paid from that account, in the ledger or at the rail.
#[cfg(feature = "failpoints")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_request_never_claims_a_key_that_expires_under_it() {
    use crate::process::ServeProcess;

    let app = spawn_app_with(|_| {}).await;
    let (_, victim_key) = app.add_client_holding(&[VICTIM]).await;
    let mut command = keyfence_command(&app, "serve");
    command
        .env("KEYFENCE_RETENTION", "2s")
        .env("KEYFENCE_RETENTION_GRACE", "1s")
        .env("KEYFENCE_RECOVERY_INTERVAL_MS", "0")
        .env("FAILPOINTS", "before-claim=sleep(5000)");
    let serve = ServeProcess::spawn(command).await;
    let own = app.try_pay_at(&serve.url, &app.api_key, "expiring-1", &payment("E2E-OWN")).await.unwrap();
    assert_eq!(own.status(), StatusCode::CREATED);

    // The instant a claim first counts the key as gone: past its
    // `expires_at` (whole seconds) and the grace.
    let key = ScopedKey::new(app.client_id().await, IdempotencyKey::parse("expiring-1").unwrap());
    let expires_at = app.keys.store.get(&key).await.unwrap().unwrap().expires_at.unwrap();
    let gone_at = (expires_at + 1) * 1000 + 1000;
    let mut stolen = payment("E2E-STOLEN");
    stolen["debtor_account"] = json!(VICTIM);
    // Checked well before that instant; after the stall, the request acts well after it.
    tokio::time::sleep(Duration::from_millis(gone_at.saturating_sub(Millis::now().get() + 2500))).await;
    let before = app.try_pay_at(&serve.url, &app.api_key, "expiring-1", &stolen).await.unwrap();
    assert_eq!(before.status(), StatusCode::UNPROCESSABLE_ENTITY, "another body under a live key");
    tokio::time::sleep(Duration::from_millis(gone_at.saturating_sub(Millis::now().get()) + 100)).await;
    let after = app.try_pay_at(&serve.url, &app.api_key, "expiring-1", &stolen).await.unwrap();
    assert_eq!(after.status(), StatusCode::FORBIDDEN, "the key is gone: refused as a new payment");

    let from_victim: i64 = sqlx::query_scalar("SELECT count(*) FROM payments WHERE debtor_account = $1")
        .bind(VICTIM)
        .fetch_one(app.db.ledger.pool())
        .await
        .unwrap();
    assert_eq!(from_victim, 0, "nothing paid from an account the client does not hold");
    let sent: Vec<String> = app.e2.statement().await.into_iter().map(|applied| applied.end_to_end_id).collect();
    assert_eq!(sent, ["E2E-OWN"], "the rail applied the client's own payment only");
    // The account's holder pays from it as usual.
    let mut theirs = payment("E2E-THEIRS");
    theirs["debtor_account"] = json!(VICTIM);
    let paid = app.try_pay_at(&serve.url, &victim_key, "theirs-1", &theirs).await.unwrap();
    assert_eq!(paid.status(), StatusCode::CREATED);
}

/// Every instance may run the sweeper; one at a time sweeps (the holder of
/// its lease), and another takes over once the leader stops and its lease
/// runs out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_instance_at_a_time_sweeps_and_another_takes_over_when_it_stops() {
    let app = spawn_app_with(|_| {}).await;
    let emulator = app.keys.settings.aws_endpoint_url.clone().unwrap();
    let instance = |name: &str, endpoint: &str| {
        let mut settings = app.settings.clone();
        settings.engine.work.instance = name.into();
        settings.engine.keys.aws_endpoint_url = Some(endpoint.into());
        settings.expire_interval_ms = 100;
        settings
    };
    let (through_a, calls_a) = recording_proxy(emulator.clone()).await;
    let (through_b, calls_b) = recording_proxy(emulator).await;
    let a = start_serving(&instance("sweeper-a", &through_a.url)).await;
    let b = start_serving(&instance("sweeper-b", &through_b.url)).await;
    let scans = |calls: &Calls| calls.lock().unwrap().iter().filter(|c| c.action == "dynamodb:Scan").count();
    eventually("five sweeps", async || scans(&calls_a) + scans(&calls_b) >= 5).await;
    let (by_a, by_b) = (scans(&calls_a), scans(&calls_b));
    assert!(by_a == 0 || by_b == 0, "both swept: {by_a} and {by_b} sweeps");

    let (leader, other) = if by_a > 0 { (a, &calls_b) } else { (b, &calls_a) };
    leader.stop.send(()).unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(scans(other), 0, "taken over while the lease ran");
    app.clock.advance(keyfence::expiry::LEADER_TERM_LEAST);
    eventually("the other instance sweeps", async || scans(other) > 0).await;
}
