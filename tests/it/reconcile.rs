//! The reconciler, one divergence class at a time, on the real stores: each
//! test makes one payment through the front door, puts the stores into the
//! state a failure would leave, and checks detection, repair and the report.
//! Then: report-only runs change nothing, and a second run finds nothing.

use std::time::Duration;

use aws_sdk_dynamodb::primitives::Blob;
use aws_sdk_dynamodb::types::AttributeValue;
use keyfence::config::ServeSettings;
use keyfence::domain::{Fence, IdempotencyKey, Millis, Owner, RecoveryPoint, RequestHash, ScopedKey, StoredResponse};
use keyfence::engine::derived_key;
use keyfence::keystore::{KeyItem, KeyState, KeyStore};
use keyfence::reconcile::{self, Class, Options, Progress, Report};
use keyfence::startup::build_engine;
use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::app::{TestApp, payment, spawn_app, spawn_app_with};

pub struct Quiet;

impl Progress for Quiet {
    fn scanned(&self, _: usize) {}
    fn repairing(&self, _: usize) {}
    fn repaired(&self) {}
}

/// One reconciler run over everything, with thresholds of zero.
pub async fn reconcile(app: &TestApp, repair: bool) -> Report {
    reconcile_in(&app.settings, repair).await
}

/// The same, in the region `settings` name (its ledger, its region).
pub async fn reconcile_in(settings: &ServeSettings, repair: bool) -> Report {
    let engine = build_engine(&settings.engine).await.unwrap();
    let options = Options {
        since: Millis::new(0),
        until: settings.engine.clock.now().plus(Duration::from_secs(60)),
        repair,
        stale_after: Duration::ZERO,
        unknown_after: Duration::ZERO,
        segments: 3,
    };
    reconcile::run(&engine, &options, &Quiet).await.unwrap()
}

fn classes(report: &Report) -> Vec<Class> {
    report.findings.iter().map(|f| f.class).collect()
}

/// Pays once through the front door; returns the key and the 201's bytes.
pub async fn pay_once(app: &TestApp, key: &str) -> (ScopedKey, Vec<u8>) {
    let response = app.pay(key, &payment(&format!("E2E-{key}"))).await;
    assert_eq!(response.status(), StatusCode::CREATED);
    let scoped = ScopedKey::new(app.client_id().await, IdempotencyKey::parse(key).unwrap());
    (scoped, response.bytes().await.unwrap().to_vec())
}

/// Erases a request from the ledger, as a failover to a replica that never
/// got its commits would (history is append-only, so triggers are set aside).
pub async fn lose_from_ledger(app: &TestApp, key: &ScopedKey) {
    let mut tx = app.db.ledger.pool().begin().await.unwrap();
    sqlx::query("SET LOCAL session_replication_role = replica").execute(&mut *tx).await.unwrap();
    for table in ["outbox", "postings"] {
        let sql = format!(
            "DELETE FROM {table} WHERE payment_id IN (SELECT id FROM payments WHERE client_id = $1 AND idem_key = $2)"
        );
        sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(key.client.as_uuid())
            .bind(key.key.as_str())
            .execute(&mut *tx)
            .await
            .unwrap();
    }
    for table in ["payments", "external_calls", "phase_runs", "requests"] {
        let sql = format!("DELETE FROM {table} WHERE client_id = $1 AND idem_key = $2");
        sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(key.client.as_uuid())
            .bind(key.key.as_str())
            .execute(&mut *tx)
            .await
            .unwrap();
    }
    tx.commit().await.unwrap();
}

fn pk(key: &ScopedKey) -> AttributeValue {
    AttributeValue::S(key.partition_key())
}

/// A replay through the front door: same status and bytes, marked replayed.
/// A retry replays `bytes` from the key store: asked of a fresh instance,
/// which has no answer of its own in memory.
async fn assert_replays(app: &TestApp, key: &ScopedKey, bytes: &[u8]) {
    let (fresh, _stop) = crate::app::start_instance(&app.settings).await;
    let body = payment(&format!("E2E-{}", key.key));
    let again = app.try_pay_at(&fresh, &app.api_key, key.key.as_str(), &body).await.unwrap();
    assert_eq!(again.status(), StatusCode::CREATED);
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    assert_eq!(again.bytes().await.unwrap().to_vec(), bytes, "the replayed answer changed");
}

async fn assert_clean(app: &TestApp) {
    let again = reconcile(app, false).await;
    assert!(again.findings.is_empty(), "a second run still finds {:?}", classes(&again));
}

#[tokio::test]
async fn a_payment_the_ledger_lost_is_rebuilt_once_from_the_key_and_the_rails() {
    let app = spawn_app().await;
    let (key, bytes) = pay_once(&app, "lost-1").await;
    // The answer clients were given, marked so that one the rebuild made
    // afresh would differ from it (the same payment builds the same bytes).
    let bytes = [bytes.as_slice(), b" "].concat();
    app.keys
        .store
        .client()
        .update_item()
        .table_name(app.keys.store.table())
        .key("pk", pk(&key))
        .update_expression("SET response_body = :given")
        .expression_attribute_values(":given", AttributeValue::B(Blob::new(bytes.clone())))
        .send()
        .await
        .unwrap();
    lose_from_ledger(&app, &key).await;
    assert_eq!(app.count("payments").await, 0);

    let report = reconcile(&app, false).await;
    assert_eq!(classes(&report), [Class::PaymentMissing]);
    assert_eq!(report.unrepaired(), 1);
    assert_eq!(app.count("payments").await, 0, "report-only changes nothing");

    let repaired = reconcile(&app, true).await;
    assert_eq!(repaired.unrepaired(), 0, "{:?}", repaired.findings);
    assert_eq!(app.count("payments").await, 1);
    assert_eq!(app.unbalanced_payments().await, 0);
    assert_eq!(app.count("postings").await, 6);
    assert_eq!(app.e1.statement().await.len(), 1, "the rails were probed, not paid again");
    assert_eq!(app.e2.statement().await.len(), 1);
    app.e1.assert_probed_not_resent("E1").await;
    app.e2.assert_probed_not_resent("E2").await;
    let ledger_answer: Vec<u8> =
        sqlx::query_scalar("SELECT response_body FROM requests").fetch_one(app.db.ledger.pool()).await.unwrap();
    assert_eq!(ledger_answer, bytes, "the ledger holds the answer clients were given");
    assert_replays(&app, &key, &bytes).await;
    assert_clean(&app).await;
}

#[tokio::test]
async fn a_lost_key_is_recreated_so_a_retry_replays_instead_of_paying_again() {
    let app = spawn_app().await;
    let (key, bytes) = pay_once(&app, "keyless-1").await;
    app.keys.lose(&key).await;

    let report = reconcile(&app, false).await;
    assert_eq!(classes(&report), [Class::KeyMissing]);
    let repaired = reconcile(&app, true).await;
    assert_eq!(repaired.unrepaired(), 0, "{:?}", repaired.findings);
    let item = app.keys.store.get(&key).await.unwrap().expect("the key is back");
    assert_eq!(item.state, KeyState::Finished);
    assert_eq!(item.fence, Fence::new(2), "above any fence the ledger has seen (1): none is granted twice");
    assert_replays(&app, &key, &bytes).await;
    assert_eq!(app.count("payments").await, 1, "the retry did not pay again");
    assert_eq!(app.e2.statement().await.len(), 1);
    assert_clean(&app).await;
}

#[tokio::test]
async fn a_leftover_of_a_request_finished_in_another_region_is_voided() {
    let app = spawn_app().await;
    let (key, _) = pay_once(&app, "moved-1").await;
    // Another region took the request over (fence 3) and finished it there.
    let client = app.keys.store.client();
    client
        .update_item()
        .table_name(app.keys.store.table())
        .key("pk", pk(&key))
        .update_expression("SET fence = :f, home_region = :r")
        .expression_attribute_values(":f", AttributeValue::N("3".into()))
        .expression_attribute_values(":r", AttributeValue::S("other-1".into()))
        .send()
        .await
        .unwrap();

    let report = reconcile(&app, false).await;
    assert_eq!(classes(&report), [Class::FencedLeftover]);
    let repaired = reconcile(&app, true).await;
    assert_eq!(repaired.unrepaired(), 0, "{:?}", repaired.findings);
    let (status, point): (String, String) =
        sqlx::query_as("SELECT p.status, r.recovery_point FROM payments p JOIN requests r ON r.payment_id = p.id")
            .fetch_one(app.db.ledger.pool())
            .await
            .unwrap();
    assert_eq!((status.as_str(), point.as_str()), ("voided", "VOIDED"));
    let open_balances: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM (SELECT account FROM postings GROUP BY account HAVING sum(amount_minor) <> 0) a",
    )
    .fetch_one(app.db.ledger.pool())
    .await
    .unwrap();
    assert_eq!(open_balances, 0, "every account this payment touched is back to zero");
    // The debtor and the creditor still carried the payment: one
    // compensating leg each; the six original legs stay in the history.
    assert_eq!(app.count("postings").await, 6 + 2, "history kept, compensating entries added");
    assert_clean(&app).await;
}

#[tokio::test]
async fn an_answer_mismatch_is_reported_and_left_for_a_person() {
    let app = spawn_app().await;
    let (key, bytes) = pay_once(&app, "differs-1").await;
    sqlx::query("UPDATE requests SET response_body = 'tampered'").execute(app.db.ledger.pool()).await.unwrap();

    let report = reconcile(&app, true).await;
    assert_eq!(classes(&report), [Class::AnswerMismatch]);
    assert_eq!(report.unrepaired(), 1, "not repaired automatically");
    assert!(report.table().contains("NOT repaired"));
    assert_replays(&app, &key, &bytes).await;
}

#[tokio::test]
async fn an_unknown_outcome_past_the_threshold_is_probed_and_settled_once_the_rail_answers() {
    let app = spawn_app_with(|s| {
        s.engine.rails.rail_timeout = Duration::from_millis(300);
        s.engine.work.max_unknown_attempts = 2;
    })
    .await;
    app.e2.set_faults(json!({ "latency_ms": 60_000 })).await;
    let body = payment("E2E-unknown-1");
    assert_eq!(app.pay("unknown-1", &body).await.status(), StatusCode::ACCEPTED);

    let still_silent = reconcile(&app, true).await;
    assert_eq!(classes(&still_silent), [Class::UnknownOutcome]);
    assert_eq!(still_silent.unrepaired(), 1, "the rail still says nothing");
    assert_eq!(still_silent.indeterminate.len(), 1, "listed for settlement");

    app.e2.clear_faults().await;
    let settled = reconcile(&app, true).await;
    assert_eq!(settled.unrepaired(), 0, "{:?}", settled.findings);
    assert!(settled.indeterminate.is_empty());
    assert_eq!(app.e2.statement().await.len(), 1);
    let retry = app.pay("unknown-1", &body).await;
    assert_eq!(retry.status(), StatusCode::CREATED);
    assert_clean(&app).await;
}

#[tokio::test]
async fn a_report_only_run_changes_nothing() {
    let app = spawn_app().await;
    let (lost, _) = pay_once(&app, "dry-1").await;
    let (keyless, _) = pay_once(&app, "dry-2").await;
    lose_from_ledger(&app, &lost).await;
    app.keys.lose(&keyless).await;

    let before = snapshot(&app).await;
    let report = reconcile(&app, false).await;
    assert_eq!(report.findings.len(), 2);
    assert!(report.findings.iter().all(|f| f.repair.is_none()));
    assert_eq!(snapshot(&app).await, before, "a report-only run wrote something");
}

/// Everything both stores hold, in a comparable form.
async fn snapshot(app: &TestApp) -> (Vec<String>, String) {
    let page = app.keys.store.scan(0, 1, None).await.unwrap();
    let (items, more) = (page.items, page.next);
    assert!(more.is_none(), "one page holds this test's keys");
    let mut items: Vec<String> = items.iter().map(|item| format!("{item:?}")).collect();
    items.sort();
    let ledger: String = sqlx::query_scalar(
        "SELECT concat_ws('|',
            (SELECT string_agg(concat_ws(',', client_id, idem_key, fence, recovery_point, md5(response_body)), ';' ORDER BY idem_key) FROM requests),
            (SELECT string_agg(concat_ws(',', id, status, fence), ';' ORDER BY id) FROM payments),
            (SELECT count(*) FROM postings), (SELECT count(*) FROM external_calls), (SELECT count(*) FROM phase_runs))",
    )
    .fetch_one(app.db.ledger.pool())
    .await
    .unwrap();
    (items, ledger)
}

#[tokio::test]
async fn a_finished_key_whose_instructions_never_reached_the_rails_is_completed_with_the_same_keys() {
    let app = spawn_app().await;
    // The key store says finished (restored from another region's work,
    // say), but neither this ledger nor the rails ever saw the payment.
    let key = ScopedKey::new(app.client_id().await, IdempotencyKey::parse("unsent-1").unwrap());
    let body = payment("E2E-unsent-1");
    let canonical = serde_jcs::to_vec(&body).unwrap();
    let answer = StoredResponse { status: 201, headers: Default::default(), body: b"{\"id\":\"unsent\"}".to_vec() };
    let item = KeyItem {
        key: key.clone(),
        request_hash: RequestHash::of("POST", "/v1/payments", &canonical),
        request: canonical,
        operation: "payment".into(),
        state: KeyState::Finished,
        fence: Fence::new(2),
        lease_until: Millis::new(0),
        owner: Owner::attempt_of("elsewhere"),
        home_region: "test-1".into(),
        created_at: Millis::now(),
        payment_id: uuid::Uuid::now_v7(),
        response: Some(answer.clone()),
        expires_at: None,
        left: Default::default(),
    };
    app.keys.store.restore(&item).await.unwrap();

    let repaired = reconcile(&app, true).await;
    assert_eq!(classes(&repaired), [Class::PaymentMissing]);
    assert_eq!(repaired.unrepaired(), 0, "{}", repaired.table());
    let derived = |step: &str| derived_key(&key, item.payment_id, step).simple().to_string();
    let e1: Vec<_> = app.e1.statement().await.into_iter().map(|a| a.idempotency_key).collect();
    let e2: Vec<_> = app.e2.statement().await.into_iter().map(|a| a.idempotency_key).collect();
    assert_eq!((e1, e2), (vec![derived("ext1")], vec![derived("ext2")]), "sent once, under the derived keys");
    assert_eq!(app.count("payments").await, 1);
    assert_eq!(app.unbalanced_payments().await, 0);
    assert_replays(&app, &key, &answer.body).await;
    assert_clean(&app).await;
}

#[tokio::test]
async fn keys_past_their_retention_are_expired_not_missing_and_never_recreated() {
    let app = spawn_app().await;
    let (key, _) = pay_once(&app, "old-1").await;
    let (kept, _) = pay_once(&app, "old-2").await;
    // Three days and more go by: the ledger rows age past the retention,
    // one key has been reaped, the other is past its time-to-live but not
    // reaped yet (DynamoDB deletes lazily).
    sqlx::query("UPDATE requests SET updated_at = now() - interval '73 hours'")
        .execute(app.db.ledger.pool())
        .await
        .unwrap();
    app.keys.lose(&key).await;
    app.keys
        .store
        .client()
        .update_item()
        .table_name(app.keys.store.table())
        .key("pk", pk(&kept))
        .update_expression("SET expires_at = :past")
        .expression_attribute_values(":past", AttributeValue::N((Millis::now().as_secs() - 3600).to_string()))
        .send()
        .await
        .unwrap();

    let repaired = reconcile(&app, true).await;
    assert!(repaired.findings.is_empty(), "{}", repaired.table());
    assert_eq!(repaired.expired, 2, "both keys expired, as meant");
    assert!(repaired.table().contains("expired (past retention, key gone as meant): 2"));
    assert_eq!(app.keys.store.get(&key).await.unwrap(), None, "never recreated");
    let unreaped = app.keys.store.get(&kept).await.unwrap().expect("still in the table");
    assert!(unreaped.expires_at.unwrap() < Millis::now().as_secs(), "its time-to-live was not renewed");
}

#[tokio::test]
async fn an_unknown_outcome_under_a_live_lease_is_left_alone() {
    let app = spawn_app_with(|s| s.engine.rails.rail_timeout = Duration::from_millis(300)).await;
    app.e2.set_faults(json!({ "latency_ms": 60_000 })).await;
    assert_eq!(app.pay("live-1", &payment("E2E-live-1")).await.status(), StatusCode::ACCEPTED);
    let key = ScopedKey::new(app.client_id().await, IdempotencyKey::parse("live-1").unwrap());
    // A live owner takes the parked request over and is still working it.
    let parked = app.keys.store.get(&key).await.unwrap().unwrap();
    let now = Millis::now();
    let lease = keyfence::keystore::Lease { now, length: Duration::from_secs(600) };
    let live = app.keys.store.take_over(&key, parked.fence, &Owner::attempt_of("live"), lease).await.unwrap();

    let report = reconcile(&app, true).await;
    assert_eq!(classes(&report), [Class::UnknownOutcome]);
    let repair = report.findings[0].repair.as_ref().unwrap();
    assert!(!repair.resolved && repair.action.contains("a live owner holds the lease"), "{repair:?}");
    assert_eq!(app.keys.store.get(&key).await.unwrap().unwrap(), live, "the live owner keeps it");
}

/// A rebuild the ledger refuses: it holds the request under a newer fence
/// than the key's final one. The reconciler must say so and exit 1, not
/// call it repaired.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_repair_stays_unresolved_and_exits_1() {
    let app = spawn_app().await;
    pay_once(&app, "refused-1").await;
    sqlx::query("UPDATE requests SET fence = 5, recovery_point = 'EXT1_SENT'")
        .execute(app.db.ledger.pool())
        .await
        .unwrap();

    let run = crate::process::keyfence_command(&app, "reconcile").arg("--repair").output().await.unwrap();
    let out = String::from_utf8_lossy(&run.stdout);
    assert_eq!(run.status.code(), Some(1), "divergence remains: {out}");
    assert!(out.contains("NOT repaired: refused"), "{out}");
    assert!(out.contains("under fence 5, newer than the key's final fence 1"), "says why: {out}");
    assert!(out.contains("unrepaired divergence: 1"), "{out}");
    let point: String =
        sqlx::query_scalar("SELECT recovery_point FROM requests").fetch_one(app.db.ledger.pool()).await.unwrap();
    assert_eq!(point, "EXT1_SENT", "nothing changed");
}

/// A key lost from the table, then claimed afresh by the client's retry:
/// the payment was made twice. The reconciler names it and leaves it for a
/// person (the first copy's instructions reached the rails under their own
/// derived keys), instead of trying to put back a key that now names
/// another request.
#[tokio::test]
async fn a_key_claimed_twice_is_reported_as_worked_twice_and_left_for_a_person() {
    let app = spawn_app().await;
    let (key, _) = pay_once(&app, "twice-1").await;
    app.keys.lose(&key).await;
    // The retry reaches an instance that never saw the first answer (the
    // one that gave it would replay it from memory).
    let (fresh, _stop) = crate::app::start_instance(&app.settings).await;
    let retry = app.try_pay_at(&fresh, &app.api_key, "twice-1", &payment("E2E-twice-1")).await.unwrap();
    assert_eq!(retry.status(), StatusCode::CREATED);
    let again = retry.bytes().await.unwrap().to_vec();
    assert_eq!(app.count("payments").await, 2, "the retry paid again");

    let report = reconcile(&app, true).await;
    assert_eq!(classes(&report), [Class::WorkedTwice]);
    assert_eq!(report.unrepaired(), 1);
    let first: Vec<Value> = app.e2.statement().await.into_iter().map(|a| json!(a.idempotency_key)).collect();
    assert_eq!(first.len(), 2, "both reached the rail");
    let stored = app.keys.store.get(&key).await.unwrap().unwrap();
    assert_eq!(stored.response.unwrap().body, again, "the key keeps the answer of the request it names");
    let answered = report.findings[0].answered.clone().expect("names the answered copy");
    assert_eq!((answered.payment_id, answered.region.as_str()), (stored.payment_id, "test-1"));
    assert_ne!(answered.payment_id, report.findings[0].payment_id, "the duplicate is this ledger's other copy");
    assert!(report.table().contains("look its payment id up in every region's ledger"), "{}", report.table());
}

/// A takeover adopts a request's row at `STARTED`, with no payment yet; its
/// owner is fenced before its first phase (its region failed) and another
/// region finishes the request. What is left here has nothing to reverse,
/// and is voided all the same, once: not a finding every run stumbles on.
#[tokio::test]
async fn a_leftover_that_never_committed_a_phase_is_voided() {
    let app = spawn_app().await;
    let key = ScopedKey::new(app.client_id().await, IdempotencyKey::parse("adopted-1").unwrap());
    let created_at = Millis::now();
    let answer = StoredResponse { status: 201, headers: Default::default(), body: b"{\"elsewhere\":true}".to_vec() };
    let item = KeyItem {
        key: key.clone(),
        request_hash: RequestHash::from_hex("ab".repeat(32)),
        request: serde_json::to_vec(&payment("E2E-adopted-1")).unwrap(),
        operation: "payment".into(),
        state: KeyState::Finished,
        fence: Fence::new(3),
        lease_until: Millis::new(0),
        owner: Owner::attempt_of("other"),
        home_region: "other-1".into(),
        created_at,
        payment_id: uuid::Uuid::now_v7(),
        response: Some(answer),
        expires_at: Some(Millis::now().plus(Duration::from_secs(3600)).as_secs()),
        left: Default::default(),
    };
    app.keys.store.seed(std::slice::from_ref(&item)).await.unwrap();
    let record = keyfence::ledger::RequestRecord {
        key: key.clone(),
        created_at,
        operation: "payment".into(),
        request_hash: item.request_hash.clone(),
        payment_id: item.payment_id,
        request: item.request.clone(),
    };
    app.db.ledger.adopt(&record, Fence::new(2), keyfence::ledger::Adoption::Takeover).await.unwrap();
    assert_eq!(app.count("payments").await, 0, "no phase committed: no payment row");

    assert_eq!(classes(&reconcile(&app, false).await), [Class::FencedLeftover]);
    let repaired = reconcile(&app, true).await;
    assert_eq!(repaired.unrepaired(), 0, "{}", repaired.table());
    let point: String =
        sqlx::query_scalar("SELECT recovery_point FROM requests").fetch_one(app.db.ledger.pool()).await.unwrap();
    assert_eq!(point, "VOIDED");
    assert_eq!(app.count("postings").await, 0, "nothing to reverse");
    assert_clean(&app).await;
}

/// A hand-off naming a request this region's ledger never held (its owner
/// here claimed it and was fenced before any phase): the reconciler voids
/// it all the same, as a row, so that owner, waking late, cannot start it
/// here once the hand-off is gone.
#[tokio::test]
async fn a_handoff_for_a_request_never_written_here_leaves_a_void_that_stops_a_late_owner() {
    let app = spawn_app().await;
    let key = ScopedKey::new(app.client_id().await, IdempotencyKey::parse("never-here-1").unwrap());
    let handoff = keyfence::keystore::Handoff {
        from: "test-1".into(),
        to: "other-1".into(),
        key: key.clone(),
        created_at: Millis::now(),
        payment_id: uuid::Uuid::now_v7(),
        fence: Fence::new(2),
    };
    app.keys.store.hand_off(&handoff).await.unwrap();

    let report = reconcile(&app, true).await;
    assert!(report.findings.is_empty(), "{}", report.table());
    assert_eq!((report.handoffs, report.handoffs_cleared), (1, 1));
    let record = keyfence::ledger::RequestRecord {
        key,
        created_at: handoff.created_at,
        operation: "payment".into(),
        request_hash: RequestHash::from_hex("ab".repeat(32)),
        payment_id: handoff.payment_id,
        request: b"{}".to_vec(),
    };
    let late = app
        .db
        .ledger
        .begin_phase(
            &record,
            Fence::FIRST,
            &RecoveryPoint::STARTED,
            &RecoveryPoint::named("H1_DONE"),
            &[&RecoveryPoint::named("H1_DONE")],
        )
        .await;
    assert!(matches!(late, Err(keyfence::ledger::LedgerError::FencedOut { .. })), "{:?}", late.map(|_| ()));
    assert_clean(&app).await;
}
