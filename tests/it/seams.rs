//! The seams between regions, following docs/failover.md to the letter: a
//! request in flight in region A when A goes dark is failed over to B and
//! finished there. Whatever happens next (A stays out past the retention
//! and the key expires, A's reconciler runs while B still works the
//! request, the client reuses the key after its retention), A's leftover is
//! voided, never worked again: no second settlement, no key recreated in A,
//! no instruction sent twice, and step 5 of the runbook does not pass until
//! the leftover is voided.

use std::time::Duration;

use keyfence::config::{RetentionSettings, ServeSettings};
use keyfence::domain::RegionSecret;
use keyfence::domain::{Clock as _, IdempotencyKey, Millis, ScopedKey};
use keyfence::http::Asking;
use keyfence::keystore::{INFLIGHT_SHARDS, KeyStore};
use keyfence::reconcile::{Class, Report};
use keyfence::regions::{RegionState, RegionStore};
use keyfence::startup::REGION_VIEW_AGE;
use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::app::{REGION_SECRET, TestApp, TestRegion, payment, spawn_app_with};
use crate::process::{ServeProcess, keyfence_command};
use crate::reconcile::reconcile_in;

/// Keys expire two seconds after they finish, and are gone four after that.
fn short_retention(settings: &mut ServeSettings) {
    settings.engine.work.retention = RetentionSettings {
        retention: Some(Duration::from_secs(2)),
        retention_hours: None,
        grace: Duration::from_secs(4),
    };
}

/// Declares region A in `state` (every instance of A in a process of its
/// own is dead by then).
async fn declare(app: &TestApp, state: RegionState) {
    crate::regions::declare(app, "test-1", state).await;
}

fn classes(report: &Report) -> Vec<Class> {
    report.findings.iter().map(|f| f.class).collect()
}

/// A's instance dies right after committing its intent to pay at E2; A is
/// declared failed; the client's retry at B fails the key over and B
/// finishes it. Returns the key and B's 201.
async fn moved_to_b(app: &TestApp, b: &TestRegion, key: &str) -> (ScopedKey, Value) {
    let body = payment(&format!("E2E-{key}"));
    let mut a = ServeProcess::start(app, Some("after-commit:EXT2_SENT=return"), 0).await;
    assert!(app.try_pay_at(&a.url, &app.api_key, key, &body).await.is_err(), "A died mid-request");
    a.exited().await;
    declare(app, RegionState::Failed).await;
    let done = app.try_pay_at(&b.url, &app.api_key, key, &body).await.unwrap();
    assert_eq!(done.status(), StatusCode::CREATED, "B failed the key over and finished it");
    let scoped = ScopedKey::new(app.client_id().await, IdempotencyKey::parse(key).unwrap());
    (scoped, done.json().await.unwrap())
}

/// Time moves past the key's retention (and its grace); the sweeper
/// deletes it.
async fn expire(app: &TestApp, key: &ScopedKey) {
    let item = app.keys.store.get(key).await.unwrap().expect("the key is there");
    let gone_at = Millis::new((item.expires_at.unwrap() + 4 + 1) * 1000);
    app.clock.advance(Duration::from_millis(gone_at.get().saturating_sub(app.clock.now().get())));
    let options = keyfence::expiry::Options { segments: 1, rate: 50, grace: Duration::from_secs(4) };
    let report = keyfence::expiry::sweep(&app.keys.store, app.clock.now(), options, &Unwatched).await;
    assert_eq!(report.deleted, 1, "{report:?}");
    assert_eq!(app.keys.store.get(key).await.unwrap(), None, "the key is gone");
}

/// A sweep nobody watches.
struct Unwatched;

impl keyfence::expiry::Progress for Unwatched {
    fn scanned(&self, _: usize) {}
    fn deleted(&self, _: usize) {}
}

async fn scalar(pool: &sqlx::PgPool, sql: &'static str) -> String {
    sqlx::query_scalar(sql).fetch_one(pool).await.unwrap()
}

async fn handoffs_from_a(app: &TestApp) -> Vec<keyfence::keystore::Handoff> {
    let mut all = Vec::new();
    for shard in 0..INFLIGHT_SHARDS {
        all.extend(app.keys.store.handoffs("test-1", shard).await.unwrap());
    }
    all
}

/// The runbook's own interleaving: A stays out longer than the retention,
/// the key expires, A comes back and its reconciler runs with `--repair`.
/// It must void A's leftover, not recreate the key and settle it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_region_out_past_the_retention_voids_its_leftover_and_settles_nothing_again() {
    let app = spawn_app_with(short_retention).await;
    let b = app.second_region("test-2").await;
    let (key, answered) = moved_to_b(&app, &b, "out-long-1").await;
    assert_eq!(scalar(app.db.ledger.pool(), "SELECT recovery_point FROM requests").await, "EXT2_SENT");
    assert_eq!(handoffs_from_a(&app).await.len(), 1, "B recorded that the request left A");
    expire(&app, &key).await;

    declare(&app, RegionState::Active).await;
    let report = reconcile_in(&app.settings, false).await;
    assert_eq!(classes(&report), [Class::MovedInFlight], "{}", report.table());
    let repaired = reconcile_in(&app.settings, true).await;
    assert_eq!(repaired.unrepaired(), 0, "{}", repaired.table());
    assert_eq!(repaired.handoffs_cleared, 1);

    assert_eq!(app.keys.store.get(&key).await.unwrap(), None, "the key was not recreated");
    assert_eq!(scalar(app.db.ledger.pool(), "SELECT recovery_point FROM requests").await, "VOIDED");
    assert_eq!(scalar(app.db.ledger.pool(), "SELECT status FROM payments").await, "voided");
    let settled: i64 = sqlx::query_scalar("SELECT count(*) FROM phase_runs WHERE point IN ('EXT2_DONE', 'FINISHED')")
        .fetch_one(app.db.ledger.pool())
        .await
        .unwrap();
    assert_eq!(settled, 0, "A never settled it");
    assert_eq!(app.unbalanced_payments().await, 0);
    assert_eq!((app.e1.statement().await.len(), app.e2.statement().await.len()), (1, 1), "one instruction each");
    assert!(handoffs_from_a(&app).await.is_empty(), "the hand-off is removed once the leftover is voided");

    let again = reconcile_in(&app.settings, false).await;
    assert!(again.findings.is_empty(), "{}", again.table());
    let in_b = reconcile_in(&b.settings, false).await;
    assert!(in_b.findings.is_empty(), "{}", in_b.table());
    let there: String = sqlx::query_scalar("SELECT status FROM payments WHERE id = $1")
        .bind(uuid::Uuid::parse_str(answered["id"].as_str().unwrap()).unwrap())
        .fetch_one(b.db.ledger.pool())
        .await
        .unwrap();
    assert_eq!(there, "succeeded", "the copy the client was answered stands");
}

/// A's reconciler runs while the request is still in flight in B (parked
/// on an unknown outcome at E2, typical during an incident): the runbook's
/// step 5 must not pass (exit 1, `moved_in_flight`) until A's leftover is
/// voided; B then finishes it, and nothing is paid twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconciling_a_region_whose_request_is_still_in_flight_elsewhere_does_not_pass_until_voided() {
    let app = spawn_app_with(|_| {}).await;
    let b = app.second_region("test-2").await;
    let body = payment("E2E-still-1");
    let mut a = ServeProcess::start(&app, Some("after-commit:EXT2_SENT=return"), 0).await;
    assert!(app.try_pay_at(&a.url, &app.api_key, "still-1", &body).await.is_err());
    a.exited().await;
    declare(&app, RegionState::Failed).await;
    app.e2.set_faults(json!({ "latency_ms": 60_000 })).await;
    let parked = app.try_pay_at(&b.url, &app.api_key, "still-1", &body).await.unwrap();
    assert_eq!(parked.status(), StatusCode::ACCEPTED, "B took it over and parked it on E2");
    declare(&app, RegionState::Active).await;

    let step5 = keyfence_command(&app, "reconcile").output().await.unwrap();
    let out = String::from_utf8_lossy(&step5.stdout);
    assert_eq!(step5.status.code(), Some(1), "step 5 must not pass: {out}");
    assert!(out.contains("moved_in_flight"), "{out}");
    let repair = keyfence_command(&app, "reconcile").arg("--repair").output().await.unwrap();
    assert_eq!(repair.status.code(), Some(0), "{}", String::from_utf8_lossy(&repair.stdout));
    let done = keyfence_command(&app, "reconcile").output().await.unwrap();
    assert_eq!(done.status.code(), Some(0), "{}", String::from_utf8_lossy(&done.stdout));
    assert_eq!(scalar(app.db.ledger.pool(), "SELECT recovery_point FROM requests").await, "VOIDED");

    app.e2.clear_faults().await;
    let finished = app.try_pay_at(&b.url, &app.api_key, "still-1", &body).await.unwrap();
    assert_eq!(finished.status(), StatusCode::CREATED, "B finishes it");
    assert_eq!(app.e2.statement().await.len(), 1, "one instruction at E2");
    assert_eq!(scalar(app.db.ledger.pool(), "SELECT recovery_point FROM requests").await, "VOIDED", "A stays out");
    let settled_in_b: i64 = sqlx::query_scalar("SELECT count(*) FROM payments WHERE status = 'succeeded'")
        .fetch_one(b.db.ledger.pool())
        .await
        .unwrap();
    assert_eq!(settled_in_b, 1);
}

/// The client reuses the key after its retention: a new request. A's
/// leftover of the old one is still voided through its hand-off, never
/// taken for a second payment to refund. Had the hand-off been lost (a key
/// table restored from an older backup), the finding is `worked_twice`, and
/// it names the copy clients are answered for the key, to keep.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_reused_after_its_retention_leaves_the_old_leftover_to_be_voided_not_refunded() {
    let app = spawn_app_with(short_retention).await;
    let b = app.second_region("test-2").await;
    let (key, _) = moved_to_b(&app, &b, "reused-2").await;
    expire(&app, &key).await;
    declare(&app, RegionState::Active).await;
    let reused = app.try_pay_at(&b.url, &app.api_key, "reused-2", &payment("E2E-reused-2b")).await.unwrap();
    assert_eq!(reused.status(), StatusCode::CREATED, "a new request under the old key");
    let new_id = reused.json::<Value>().await.unwrap()["id"].as_str().unwrap().to_owned();

    let report = reconcile_in(&app.settings, false).await;
    assert_eq!(classes(&report), [Class::MovedInFlight], "voided, not refunded: {}", report.table());

    // The hand-off lost: the leftover is ambiguous, and a person decides.
    for handoff in handoffs_from_a(&app).await {
        app.keys.store.forget_handoff(&handoff).await.unwrap();
    }
    let report = reconcile_in(&app.settings, true).await;
    assert_eq!(classes(&report), [Class::WorkedTwice], "{}", report.table());
    let answered = report.findings[0].answered.as_ref().expect("the answered copy is named");
    assert_eq!((answered.payment_id.to_string(), answered.region.as_str()), (new_id.clone(), "test-2"));
    let table = report.table();
    assert!(table.contains(&format!("clients are answered payment {new_id} in region test-2: keep that one")));
    assert!(table.contains("look its payment id up in every region's ledger"), "{table}");
    assert_eq!(report.unrepaired(), 1, "left for a person");
    assert_eq!(scalar(app.db.ledger.pool(), "SELECT recovery_point FROM requests").await, "EXT2_SENT", "untouched");
}

/// What region `url` shows the caller for payment `id`.
async fn read(app: &TestApp, url: &str, path: &str) -> (StatusCode, Value) {
    let response = app.http.get(format!("{url}{path}")).bearer_auth(&app.api_key).send().await.unwrap();
    (response.status(), response.json().await.unwrap_or(Value::Null))
}

/// After a failover the payment id lives in two ledgers. Every read, in
/// the region it left (before and after its reconciler voids the leftover)
/// and in a third region (whose name sorts before both), shows the copy the
/// client was answered; the listing shows it once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_show_the_live_copy_never_the_leftover() {
    let app = spawn_app_with(|_| {}).await;
    let b = app.second_region("test-2").await;
    let c = app.second_region("test-0").await;
    let (_, answered) = moved_to_b(&app, &b, "read-moved-1").await;
    declare(&app, RegionState::Active).await;
    let id = answered["id"].as_str().unwrap().to_owned();
    let path = format!("/v1/payments/{id}");
    assert_eq!(scalar(app.db.ledger.pool(), "SELECT status FROM payments").await, "pending", "A's leftover");

    let check = async |when: &str| {
        for (region, url) in [("A", &app.url), ("B", &b.url), ("C", &c.url)] {
            let (status, shown) = read(&app, url, &path).await;
            assert_eq!(status, StatusCode::OK, "{when}, from {region}: {shown}");
            assert_eq!(shown["status"], "succeeded", "{when}, from {region}: {shown}");
        }
        let (_, listed) = read(&app, &app.url, "/v1/payments?end_to_end_id=E2E-read-moved-1").await;
        let listed = listed["data"].as_array().unwrap().clone();
        assert_eq!(listed.len(), 1, "{when}: one entry per payment: {listed:?}");
        assert_eq!(listed[0]["status"], "succeeded", "{when}");
    };
    check("before A's reconcile").await;
    assert_eq!(reconcile_in(&app.settings, true).await.unrepaired(), 0);
    assert_eq!(scalar(app.db.ledger.pool(), "SELECT status FROM payments").await, "voided");
    check("after A's reconcile").await;
}

/// A region whose advertised URL reaches another region's front door (a
/// load balancer shared by every region, or a loopback address): the read
/// forwarded for it is refused there with 421, and the asker answers 503,
/// never 404 for a payment that exists.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_forwarded_to_the_wrong_region_is_refused_and_never_a_404() {
    let app = spawn_app_with(|_| {}).await;
    let b = app.second_region("test-2").await;
    let paid = app.try_pay_at(&b.url, &app.api_key, "misdirected-1", &payment("E2E-misdirected-1")).await.unwrap();
    let id = paid.json::<Value>().await.unwrap()["id"].as_str().unwrap().to_owned();
    let store = RegionStore::new(app.keys.store.client().clone(), app.keys.store.table());
    store.advertise("test-2", &app.url).await.unwrap();
    app.clock.advance(REGION_VIEW_AGE);

    let (status, problem) = read(&app, &app.url, &format!("/v1/payments/{id}")).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{problem}");
    assert_eq!(problem["type"], "urn:keyfence:problem:region-unreachable");
    let path = format!("/v1/payments/{id}");
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs();
    let client = app.client_id().await;
    let authority = app.url.trim_start_matches("http://");
    let asking = Asking { method: "GET", authority, target: &path, region: "test-2", from: "test-3", client, at: now };
    let (signed, _) = RegionSecret::new(REGION_SECRET).unwrap().sign(&asking);
    let mut direct = app.http.get(format!("{}{path}", app.url));
    for (name, value) in signed {
        direct = direct.header(name, value);
    }
    let direct = direct.send().await.unwrap();
    assert_eq!(direct.status(), StatusCode::MISDIRECTED_REQUEST);
    assert_eq!(direct.json::<Value>().await.unwrap()["type"], "urn:keyfence:problem:misdirected-request");
}

/// Without `KEYFENCE_LOCAL_REGIONS`, a region listening on a loopback
/// address does not advertise it: another region would reach itself.
#[tokio::test]
async fn a_loopback_url_is_not_advertised_unless_every_region_is_local() {
    let app = spawn_app_with(|s| s.local_regions = false).await;
    let store = RegionStore::new(app.keys.store.client().clone(), app.keys.store.table());
    let registry = store.read().await.unwrap();
    assert_eq!(registry.urls.get("test-1"), None, "{:?}", registry.urls);
}

/// A retry in region B reads the key in flight in A (declared failed) and
/// races A's owner, which finishes it just before B's failover lands: B
/// must replay the answer the key now holds, not answer 409.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_that_races_the_keys_finish_replays_it() {
    let app = spawn_app_with(|s| s.engine.rails.rail_timeout = Duration::from_millis(300)).await;
    let b = app.second_region("test-2").await;
    let body = payment("E2E-race-1");
    app.e2.set_faults(json!({ "latency_ms": 60_000 })).await;
    assert_eq!(app.pay("race-1", &body).await.status(), StatusCode::ACCEPTED, "parked in A");
    app.e2.clear_faults().await;
    let key = ScopedKey::new(app.client_id().await, IdempotencyKey::parse("race-1").unwrap());
    let parked = app.keys.store.get(&key).await.unwrap().unwrap();
    declare(&app, RegionState::Failed).await;

    // B's instance stalls between reading the key and failing it over.
    let mut command = keyfence_command(&app, "serve");
    command
        .env("KEYFENCE_REGION", "test-2")
        .env("DATABASE_URL", &b.db.url)
        .env("KEYFENCE_RECOVERY_INTERVAL_MS", "0")
        .env("FAILPOINTS", "before-fail-over=sleep(1500)");
    let b_stalled = ServeProcess::spawn(command).await;
    let retry = app.pay_in_background(&b_stalled.url, "race-1", &body);
    tokio::time::sleep(Duration::from_millis(700)).await;
    // Meanwhile A's owner finishes it (its holder, as A's instance would).
    let answer = keyfence::domain::StoredResponse {
        status: 201,
        headers: [("content-type".to_owned(), "application/json".to_owned())].into(),
        body: br#"{"finished":"in A"}"#.to_vec(),
    };
    let finish = keyfence::keystore::Finish {
        response: answer.clone(),
        expires_at: Millis::now().plus(Duration::from_secs(3600)),
    };
    app.keys.store.finish(&key, &parked.holder(), &finish).await.unwrap();

    let retried = retry.await.unwrap().unwrap();
    assert_eq!(retried.status(), StatusCode::CREATED, "a replay, not 409");
    assert_eq!(retried.headers()["idempotent-replayed"], "true");
    assert_eq!(retried.bytes().await.unwrap().to_vec(), answer.body, "the answer the key holds");
}

/// The gap of a failover: the key already names the new home B, whose
/// ledger has not written the payment yet, while A holds a leftover. No
/// region may say 404 for it, or show A's copy: each answers 503 (payment
/// moving) until B shows the live copy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn while_a_payment_moves_reads_answer_503_never_a_404_or_the_leftover() {
    let app = spawn_app_with(|s| s.engine.rails.rail_timeout = Duration::from_millis(300)).await;
    let b = app.second_region("test-2").await;
    let body = payment("E2E-moving-1");
    app.e2.set_faults(json!({ "latency_ms": 60_000 })).await;
    let parked = app.pay("moving-1", &body).await;
    assert_eq!(parked.status(), StatusCode::ACCEPTED, "parked in A");
    let id = parked.json::<Value>().await.unwrap()["id"].as_str().unwrap().to_owned();
    let key = ScopedKey::new(app.client_id().await, IdempotencyKey::parse("moving-1").unwrap());
    declare(&app, RegionState::Failed).await;
    // B's owner has moved the key and recorded the hand-off, not yet adopted it.
    let item = app.keys.store.get(&key).await.unwrap().unwrap();
    let owner = keyfence::domain::Owner::attempt_of("b-owner");
    let lease = keyfence::keystore::Lease { now: Millis::now(), length: Duration::from_millis(1) };
    let moved = app.keys.store.fail_over(&key, item.fence, &owner, lease, "test-1", "test-2").await.unwrap();
    app.keys.store.hand_off(&keyfence::keystore::Handoff::of(&moved, "test-1")).await.unwrap();
    declare(&app, RegionState::Active).await;

    let path = format!("/v1/payments/{id}");
    for (region, url) in [("A", &app.url), ("B", &b.url)] {
        let (status, problem) = read(&app, url, &path).await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "from {region}: {problem}");
    }
    let (status, _) = read(&app, &app.url, "/v1/payments?end_to_end_id=E2E-moving-1").await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "no listing without it");

    app.e2.clear_faults().await;
    let done = app.try_pay_at(&b.url, &app.api_key, "moving-1", &body).await.unwrap();
    assert_eq!(done.status(), StatusCode::CREATED, "B takes it over and finishes it");
    for (region, url) in [("A", &app.url), ("B", &b.url)] {
        let (status, shown) = read(&app, url, &path).await;
        assert_eq!((status, shown["status"].as_str()), (StatusCode::OK, Some("succeeded")), "from {region}");
    }
}
