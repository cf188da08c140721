//! Two regions over one key table, each with its own ledger, sharing the
//! rails. A region declared failed stops working; another region takes its
//! requests over (on a client's retry, or through its recovery worker),
//! rebuilds them in its own ledger from the request kept on the key item,
//! probes the rails and finishes them exactly once; the failed region's
//! leftovers are voided by its reconciler once it is back.

use std::collections::{BTreeMap, HashSet};
use std::time::Duration;

use futures::future::join_all;
use keyfence::domain::{Clock as _, Fence, IdempotencyKey, ScopedKey};
use keyfence::keystore::{KeyState, KeyStore};
use keyfence::reconcile::{self, Class, Options};
use keyfence::recovery;
use keyfence::regions::{self, Changed, RegionState, RegionStore};
use keyfence::startup::{REGION_VIEW_AGE, build_engine};
use reqwest::StatusCode;
use serde_json::Value;

use crate::app::{TestApp, payment, spawn_app, spawn_app_with};
use crate::reconcile::Quiet;

fn store(app: &TestApp) -> RegionStore {
    RegionStore::new(app.keys.store.client().clone(), app.keys.store.table())
}

/// Declares `region` in `state`, then moves time on until every instance
/// in this process sees it, and waits for the region's instance here to
/// bring its ledger's fence in line (it does, on a round of its own).
pub async fn declare(app: &TestApp, region: &str, state: RegionState) {
    regions::declare(&store(app), None, region, state, "test", "drill").await.unwrap();
    app.clock.advance(REGION_VIEW_AGE);
    if region == app.settings.engine.work.region {
        let failed = state == RegionState::Failed;
        let follows = async || app.db.ledger.region_fence().await.is_ok_and(|fence| fence.failed == failed);
        crate::harness::eventually("the ledger's fence follows the registry", follows).await;
    }
}

async fn payments_in(pool: &sqlx::PgPool, status: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM payments WHERE status = $1").bind(status).fetch_one(pool).await.unwrap()
}

#[tokio::test]
async fn two_declarations_at_once_raise_the_epoch_once() {
    let app = spawn_app().await;
    let (store, other) = (store(&app), store(&app));
    let (a, b) = tokio::join!(
        regions::declare(&store, None, "eu-1", RegionState::Failed, "sre-a", "network partition"),
        regions::declare(&other, None, "eu-1", RegionState::Failed, "sre-b", "pager said so"),
    );
    let outcomes = [a.unwrap().0, b.unwrap().0];
    let made = outcomes.iter().filter(|o| matches!(o, Changed::Made(_))).count();
    assert_eq!(made, 1, "one declaration wins: {outcomes:?}");
    let registry = store.read().await.unwrap();
    assert_eq!(registry.epoch, 1, "the epoch rose once");
    assert_eq!(registry.history.len(), 1);
    assert!(registry.is_failed("eu-1") && !registry.is_failed("eu-2"));
    assert!(registry.table().contains("eu-1"), "{}", registry.table());

    let (restored, _) = regions::declare(&store, None, "eu-1", RegionState::Active, "sre-a", "healed").await.unwrap();
    assert!(matches!(restored, Changed::Made(ref c) if c.epoch == 2), "{restored:?}");
    assert_eq!(store.read().await.unwrap().history.len(), 2, "who, when and why of both changes");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_regions_instance_takes_on_nothing_until_restored() {
    let app = spawn_app().await;
    let body = payment("E2E-FAILED-REGION");
    declare(&app, "test-1", RegionState::Failed).await;

    let refused = app.pay("failed-region-1", &body).await;
    assert_eq!(refused.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert!(refused.headers().get("retry-after").is_some());
    let problem: Value = refused.json().await.unwrap();
    assert_eq!(problem["type"], "urn:keyfence:problem:region-failed");
    let health: Value = app.http.get(format!("{}/healthz", app.url)).send().await.unwrap().json().await.unwrap();
    assert_eq!(health["region_state"], "failed");
    assert_eq!(app.key_items().await, 0, "nothing claimed");
    let ready = app.http.get(format!("{}/readyz", app.admin_url)).send().await.unwrap();
    assert_eq!(ready.status(), StatusCode::SERVICE_UNAVAILABLE, "a failed region's instance is not ready");
    assert_eq!(ready.json::<Value>().await.unwrap()["region_state"], "failed");

    // The instance fenced its own ledger meanwhile; restored, it opens it
    // again, and is ready once it has.
    declare(&app, "test-1", RegionState::Active).await;
    crate::harness::eventually("ready once restored", async || {
        app.http.get(format!("{}/readyz", app.admin_url)).send().await.unwrap().status() == StatusCode::OK
    })
    .await;
    assert_eq!(app.pay("failed-region-1", &body).await.status(), StatusCode::CREATED, "serving again");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fenced_ledger_commits_nothing_more_and_another_region_finishes() {
    let app = spawn_app().await;
    let b = app.second_region("test-2").await;
    let body = payment("E2E-FENCED");
    app.e1.set_faults(serde_json::json!({ "latency_ms": 600 })).await;
    // A's payment is at E1 when the SRE fences A's ledger.
    let in_a = app.pay_in_background(&app.url, "fenced-1", &body);
    app.reaches("EXT1_SENT").await;
    regions::declare(&store(&app), Some(&app.db.ledger), "test-1", RegionState::Failed, "test", "drill").await.unwrap();
    let answer = in_a.await.unwrap().unwrap();
    assert_eq!(answer.status(), StatusCode::SERVICE_UNAVAILABLE, "A stopped at its next phase");
    let point: String =
        sqlx::query_scalar("SELECT recovery_point FROM requests").fetch_one(app.db.ledger.pool()).await.unwrap();
    assert_eq!(point, "EXT1_SENT", "nothing committed after the fence");

    let finished = app.try_pay_at(&b.url, &app.api_key, "fenced-1", &body).await.unwrap();
    assert_eq!(finished.status(), StatusCode::CREATED, "B took it over");
    assert_eq!(payments_in(b.db.ledger.pool(), "succeeded").await, 1);
    assert_eq!(app.e1.statement().await.len(), 1, "E1 probed, not asked twice");
    app.e1.assert_probed_not_resent("E1").await;
    assert_eq!(app.e2.statement().await.len(), 1);
    assert_eq!(app.e2.sent_again().await, BTreeMap::new());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_regions_request_finishes_in_another_once_the_region_is_declared_failed() {
    let app = spawn_app().await;
    let b = app.second_region("test-2").await;
    let body = payment("E2E-FAILOVER");
    // A dies right after E1 applied the screening.
    let mut a = crate::process::ServeProcess::start(&app, Some("after-call:ext1=return"), 0).await;
    assert!(app.try_pay_at(&a.url, &app.api_key, "failover-1", &body).await.is_err());
    a.exited().await;

    let waiting = app.try_pay_at(&b.url, &app.api_key, "failover-1", &body).await.unwrap();
    assert_eq!(waiting.status(), StatusCode::CONFLICT, "A is not declared failed: its request is in flight");
    declare(&app, "test-1", RegionState::Failed).await;
    let done = app.try_pay_at(&b.url, &app.api_key, "failover-1", &body).await.unwrap();
    assert_eq!(done.status(), StatusCode::CREATED);
    assert!(done.headers().get("idempotent-replayed").is_none(), "B worked it");
    let bytes = done.bytes().await.unwrap();

    let key = ScopedKey::new(app.client_id().await, IdempotencyKey::parse("failover-1").unwrap());
    let item = app.keys.store.get(&key).await.unwrap().unwrap();
    assert_eq!((item.state, item.fence, item.home_region.as_str()), (KeyState::Finished, Fence::new(2), "test-2"));
    assert_eq!(payments_in(b.db.ledger.pool(), "succeeded").await, 1, "rebuilt and finished in B");
    assert_eq!(app.e1.statement().await.len(), 1, "E1 was probed, not asked again");
    app.e1.assert_probed_not_resent("E1").await;
    assert_eq!(app.e2.statement().await.len(), 1);
    assert_eq!(app.e2.sent_again().await, BTreeMap::new());

    // A comes back: new requests again, this key stays in B; replays agree.
    declare(&app, "test-1", RegionState::Active).await;
    for url in [&app.url, &b.url] {
        let replay = app.try_pay_at(url, &app.api_key, "failover-1", &body).await.unwrap();
        assert_eq!(replay.headers()["idempotent-replayed"], "true");
        assert_eq!(replay.bytes().await.unwrap(), bytes, "the same bytes from both regions");
    }
    // A's reconciler voids what the dead owner left in A's ledger.
    let a_engine = build_engine(&app.settings.engine).await.unwrap();
    let options = Options {
        since: keyfence::domain::Millis::new(0),
        until: app.clock.now().plus(Duration::from_secs(60)),
        repair: true,
        stale_after: Duration::ZERO,
        unknown_after: Duration::ZERO,
        segments: 2,
    };
    let report = reconcile::run(&a_engine, &options, &Quiet).await.unwrap();
    assert_eq!(
        report.findings.iter().map(|f| f.class).collect::<Vec<_>>(),
        [Class::MovedInFlight],
        "named by its hand-off"
    );
    assert_eq!(report.unrepaired(), 0, "{}", report.table());
    assert_eq!(payments_in(app.db.ledger.pool(), "voided").await, 1);
    assert_eq!(app.unbalanced_payments().await, 0);
    let again = reconcile::run(&a_engine, &Options { repair: false, ..options.clone() }, &Quiet).await.unwrap();
    assert!(again.findings.is_empty(), "{}", again.table());
    let b_engine = build_engine(&b.settings.engine).await.unwrap();
    let in_b = reconcile::run(&b_engine, &Options { repair: false, ..options }, &Quiet).await.unwrap();
    assert!(in_b.findings.is_empty(), "{}", in_b.table());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_regions_worker_drains_a_failed_region_in_one_sweep() {
    let app = spawn_app().await;
    let b = app.second_region("test-2").await;
    let keys: Vec<String> = (0..5).map(|i| format!("drain-{i}")).collect();
    // A stalls every request before its first phase, then dies.
    let a = crate::process::ServeProcess::start(&app, Some("before-phase:EXT1_SENT=sleep(60000)"), 0).await;
    let stuck: Vec<_> = keys.iter().map(|k| app.pay_in_background(&a.url, k, &payment(&format!("E2E-{k}")))).collect();
    let client = app.client_id().await;
    crate::harness::eventually("A claimed all five", async || app.key_items().await == keys.len()).await;
    drop(a);
    for request in stuck {
        assert!(request.await.unwrap().is_err(), "A died without answering");
    }

    declare(&app, "test-1", RegionState::Failed).await;
    let b_engine = build_engine(&b.settings.engine).await.unwrap();
    let report = recovery::sweep(&b_engine, recovery::Scope::Worker, |_| {}, || {}).await;
    assert_eq!(report.finished, keys.len(), "{}", report.summary());
    for key in &keys {
        let item = app.keys.store.get(&ScopedKey::new(client, IdempotencyKey::parse(key).unwrap())).await.unwrap();
        let item = item.unwrap();
        assert_eq!((item.state, item.home_region.as_str()), (KeyState::Finished, "test-2"), "{key}");
    }
    assert_eq!(payments_in(b.db.ledger.pool(), "succeeded").await, keys.len() as i64);
    assert_eq!(app.e2.statement().await.len(), keys.len());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_key_sent_to_both_regions_at_once_is_paid_once() {
    let app = spawn_app().await;
    let b = app.second_region("test-2").await;
    let rounds = 50;
    for round in 0..rounds {
        let key = format!("both-{round}");
        let body = payment(&format!("E2E-BOTH-{round}"));
        let answers = join_all([&app.url, &b.url].map(|url| async {
            let response = app.try_pay_at(url, &app.api_key, &key, &body).await.unwrap();
            let replayed = response.headers().get("idempotent-replayed").is_some();
            (response.status(), replayed, response.bytes().await.unwrap())
        }))
        .await;
        let worked = answers.iter().filter(|(s, replayed, _)| *s == StatusCode::CREATED && !replayed).count();
        assert_eq!(worked, 1, "round {round}: one region worked it: {answers:?}");
        let bytes = &answers.iter().find(|(s, r, _)| *s == StatusCode::CREATED && !r).unwrap().2;
        for url in [&app.url, &b.url] {
            let replay = app.try_pay_at(url, &app.api_key, &key, &body).await.unwrap();
            assert_eq!(&replay.bytes().await.unwrap(), bytes, "round {round}: the same bytes from both regions");
        }
    }
    let total = app.count("payments").await
        + sqlx::query_scalar::<_, i64>("SELECT count(*) FROM payments").fetch_one(b.db.ledger.pool()).await.unwrap();
    assert_eq!(total, rounds, "one payment per key across both ledgers");
    for rail in [&app.e1, &app.e2] {
        let statement = rail.statement().await;
        let distinct: HashSet<_> = statement.iter().map(|a| a.idempotency_key.clone()).collect();
        assert_eq!((statement.len(), distinct.len()), (rounds as usize, rounds as usize), "one instruction each");
        assert_eq!(rail.sent_again().await, BTreeMap::new(), "each sent once");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_region_answers_for_the_callers_own_payments() {
    let app = spawn_app().await;
    let b = app.second_region("test-2").await;
    let paid = app.pay("read-1", &payment("E2E-READ")).await;
    assert_eq!(paid.status(), StatusCode::CREATED);
    let id = paid.json::<Value>().await.unwrap()["id"].as_str().unwrap().to_owned();
    let get = |url: &str, path: &str, api_key: &str| {
        app.http.get(format!("{url}{path}")).bearer_auth(api_key.to_owned()).send()
    };

    let here: Value = get(&app.url, &format!("/v1/payments/{id}"), &app.api_key).await.unwrap().json().await.unwrap();
    let there = get(&b.url, &format!("/v1/payments/{id}"), &app.api_key).await.unwrap();
    assert_eq!(there.status(), StatusCode::OK, "B asks A for it");
    assert_eq!(there.json::<Value>().await.unwrap(), here, "the same payment from either region");
    let listed: Value =
        get(&b.url, "/v1/payments?end_to_end_id=E2E-READ", &app.api_key).await.unwrap().json().await.unwrap();
    assert_eq!(listed["data"].as_array().unwrap().len(), 1);
    assert_eq!(listed["data"][0]["id"], id.as_str());
    let key = get(&b.url, "/v1/idempotency-keys/read-1", &app.api_key).await.unwrap();
    assert_eq!(key.json::<Value>().await.unwrap()["state"], "finished");

    let (_, stranger) = app.add_client().await;
    let theirs = get(&b.url, &format!("/v1/payments/{id}"), &stranger).await.unwrap();
    assert_eq!(theirs.status(), StatusCode::NOT_FOUND, "another client's payment is 404 everywhere");
    let nowhere = get(&b.url, &format!("/v1/payments/{}", uuid::Uuid::now_v7()), &app.api_key).await.unwrap();
    assert_eq!(nowhere.status(), StatusCode::NOT_FOUND, "404 once every region said so");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_in_flight_when_its_region_fails_commits_no_further_phase() {
    let app =
        spawn_app_with(|s| (s.engine.rails.rail_timeout, s.engine.rails.rail_attempts) = (Duration::from_secs(3), 1))
            .await;
    app.e1.set_faults(serde_json::json!({ "latency_ms": 1500 })).await;
    let in_flight = app.pay_in_background(&app.url, "mid-flight-1", &payment("E2E-MID-FLIGHT"));
    app.reaches("EXT1_SENT").await;
    // The registry only: this region's own instance notices within a second.
    regions::declare(&store(&app), None, "test-1", RegionState::Failed, "test", "drill").await.unwrap();

    let answer = in_flight.await.unwrap().unwrap();
    assert_eq!(answer.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(answer.json::<Value>().await.unwrap()["type"], "urn:keyfence:problem:region-failed");
    let point: String =
        sqlx::query_scalar("SELECT recovery_point FROM requests").fetch_one(app.db.ledger.pool()).await.unwrap();
    assert_eq!(point, "EXT1_SENT", "the phase after E1 was not committed");
}

/// `regions fail --ledger` fences the region's ledger; `regions restore`
/// without `--ledger` (the SRE could not reach it, or forgot) must not
/// leave a region that claims keys but commits no phase: its instances
/// bring the ledger fence in line with the registry, and `/readyz` says
/// what the ledger fence holds meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restore_without_the_ledger_still_opens_it_through_the_regions_instances() {
    let app = spawn_app().await;
    let body = payment("E2E-REOPENED");
    regions::declare(&store(&app), Some(&app.db.ledger), "test-1", RegionState::Failed, "test", "drill").await.unwrap();
    app.clock.advance(REGION_VIEW_AGE);
    let ready: Value = app.http.get(format!("{}/readyz", app.admin_url)).send().await.unwrap().json().await.unwrap();
    assert_eq!(ready["ledger_fence"]["state"], "failed", "{ready}");

    regions::declare(&store(&app), None, "test-1", RegionState::Active, "test", "healed").await.unwrap();
    crate::harness::eventually("the instance opened its ledger", async || {
        let ready = app.http.get(format!("{}/readyz", app.admin_url)).send().await.unwrap();
        ready.status() == StatusCode::OK
    })
    .await;
    let ready: Value = app.http.get(format!("{}/readyz", app.admin_url)).send().await.unwrap().json().await.unwrap();
    assert_eq!(ready["ledger_fence"]["state"], "open", "{ready}");
    assert_eq!(app.pay("reopened-1", &body).await.status(), StatusCode::CREATED, "phases commit again");
    assert!(!app.db.ledger.region_fence().await.unwrap().failed);
}

/// The reverse: a region declared failed without `--ledger`, whose
/// instances still reach their ledger, fences it themselves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_regions_instances_fence_the_ledger_they_can_reach() {
    let app = spawn_app().await;
    regions::declare(&store(&app), None, "test-1", RegionState::Failed, "test", "drill").await.unwrap();
    crate::harness::eventually("the instance fenced its ledger", async || {
        app.db.ledger.region_fence().await.unwrap().failed
    })
    .await;
    let fence = app.db.ledger.region_fence().await.unwrap();
    assert_eq!((fence.region.as_deref(), fence.reason.as_deref()), (Some("test-1"), Some("drill")));
}

/// However often regions change state, the registry item keeps only its
/// last changes (it would otherwise grow to DynamoDB's item limit and
/// block `regions fail` exactly when it is needed), and a declaration's
/// text is bounded.
#[tokio::test]
async fn the_registry_keeps_its_last_changes_and_bounded_reasons() {
    let app = spawn_app().await;
    let store = store(&app);
    let changes = regions::HISTORY_KEPT + 6;
    for i in 0..changes {
        let state = if i % 2 == 0 { RegionState::Failed } else { RegionState::Active };
        regions::declare(&store, None, "eu-1", state, "sre", &format!("change {i}")).await.unwrap();
    }
    let registry = store.read().await.unwrap();
    assert_eq!(registry.epoch, changes as u64, "every change counted");
    assert_eq!(registry.history.len(), regions::HISTORY_KEPT);
    assert_eq!(registry.history.last().unwrap().reason, format!("change {}", changes - 1), "the newest kept");
    assert_eq!(registry.history[0].reason, format!("change {}", changes - regions::HISTORY_KEPT));

    let long = "x".repeat(regions::TEXT_LIMIT + 1);
    let refused = regions::declare(&store, None, "eu-1", RegionState::Active, "sre", &long).await;
    assert!(refused.is_err(), "an overlong reason is refused");
    assert_eq!(store.read().await.unwrap().epoch, changes as u64, "and changes nothing");
}

/// Sets attribute `name` of the registry item to `value`, as whoever may
/// write it could.
async fn set_in_registry(app: &TestApp, name: &str, value: aws_sdk_dynamodb::types::AttributeValue) {
    app.keys
        .store
        .client()
        .update_item()
        .table_name(app.keys.store.table())
        .key("pk", aws_sdk_dynamodb::types::AttributeValue::S("control#regions".into()))
        .update_expression("SET #name = :value")
        .expression_attribute_names("#name", name)
        .expression_attribute_values(":value", value)
        .send()
        .await
        .unwrap();
}

/// The registry item as the table holds it, if any.
async fn registry_item(
    app: &TestApp,
) -> Option<std::collections::HashMap<String, aws_sdk_dynamodb::types::AttributeValue>> {
    let key = aws_sdk_dynamodb::types::AttributeValue::S("control#regions".into());
    let got = app.keys.store.client().get_item().table_name(app.keys.store.table()).key("pk", key).send().await;
    got.unwrap().item().cloned()
}

/// What one region's instances may write of the registry (their own URL
/// attribute) cannot make the registry unreadable: a URL that is not one
/// is skipped, and the next change removes it; a registry item made bare
/// is completed by `migrate`.
#[tokio::test]
async fn a_regions_own_url_attribute_cannot_stop_the_registry_being_read_or_changed() {
    use aws_sdk_dynamodb::types::AttributeValue;
    let app = spawn_app().await;
    let registry = store(&app);
    registry.advertise("eu-1", "https://eu-1.example").await.unwrap();
    set_in_registry(&app, "url#eu-2", AttributeValue::N("1".into())).await;
    let read = registry.read().await.unwrap();
    assert_eq!(read.urls.get("eu-1").map(String::as_str), Some("https://eu-1.example"));
    assert!(!read.urls.contains_key("eu-2"), "{:?}", read.urls);
    set_in_registry(&app, "url#eu-2", AttributeValue::S("x".repeat(300_000))).await;
    let (failed, _) = regions::declare(&registry, None, "eu-2", RegionState::Failed, "sre", "drill").await.unwrap();
    assert!(matches!(failed, Changed::Made(_)), "{failed:?}");
    assert!(!registry_item(&app).await.unwrap().contains_key("url#eu-2"), "the change removed what is not a URL");
    assert!(registry.read().await.unwrap().is_failed("eu-2"));

    // A URL written where no registry was makes a bare item; migrate completes it.
    let bare = spawn_app().await;
    let bare_store = store(&bare);
    let key = AttributeValue::S("control#regions".into());
    bare.keys.store.client().delete_item().table_name(bare.keys.store.table()).key("pk", key).send().await.unwrap();
    assert!(matches!(bare_store.advertise("eu-1", "https://eu-1.example").await, Err(regions::RegionsError::Missing)));
    set_in_registry(&bare, "url#eu-1", AttributeValue::S("https://eu-1.example".into())).await;
    assert_eq!(registry_item(&bare).await.unwrap().len(), 2, "a bare item: its key and the URL");
    assert_eq!(bare_store.read().await.unwrap().epoch, 0, "a bare registry reads as an empty one");
    bare_store.create().await.unwrap();
    let (made, _) = regions::declare(&bare_store, None, "eu-1", RegionState::Failed, "sre", "drill").await.unwrap();
    assert!(matches!(made, Changed::Made(ref c) if c.epoch == 1), "{made:?}");
    assert_eq!(bare_store.read().await.unwrap().urls["eu-1"], "https://eu-1.example", "its URL kept");
}
