//! Crash safety of refunds with real processes: for every failpoint a
//! refund passes, `keyfence serve` aborts there; a new process then
//! completes the refund (a) through the client's retry with the same key,
//! and (b) with no retry at all, through the recovery worker. Each time:
//! one refund, balanced postings, one refund instruction at the rail, the
//! balance's hold settled once, and the same answer for every later retry.

use std::time::{Duration, Instant};

use keyfence::domain::{Clock as _, IdempotencyKey, ScopedKey};
use keyfence::keystore::{KeyState, KeyStore};
use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::app::{TestApp, spawn_app};
use crate::process::ServeProcess;

const KEY: &str = "refund-crash-1";
const AMOUNT: i64 = 500;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Completion {
    ClientRetry,
    RecoveryWorker,
}

/// Waits until the key store holds a final answer for the key.
async fn wait_finished(app: &TestApp, key: &ScopedKey) -> Vec<u8> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(item) = app.keys.store.get(key).await.unwrap()
            && item.state == KeyState::Finished
        {
            return item.response.expect("a finished item has an answer").body;
        }
        assert!(Instant::now() < deadline, "the recovery worker did not finish the refund within 30 s");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Asserts exactly one refund everywhere, and that no phase ran twice.
async fn assert_refunded_once(app: &TestApp, paid: &str) {
    assert_eq!(app.count("refunds").await, 1, "refunds in the ledger");
    assert_eq!(app.unbalanced_payments().await, 0);
    let refund_postings: i64 =
        sqlx::query_scalar("SELECT count(*) FROM postings p JOIN refunds r ON r.id = p.payment_id")
            .fetch_one(app.db.ledger.pool())
            .await
            .unwrap();
    assert_eq!(refund_postings, 4, "two balanced entries: the hold and the refund");
    let at_rail = app.e2.statement().await.iter().filter(|a| a.amount_minor == AMOUNT).count();
    assert_eq!(at_rail, 1, "one refund instruction at E2");
    let mut points: Vec<String> = sqlx::query_scalar(
        "SELECT point FROM phase_runs p JOIN requests r USING (client_id, idem_key)
          WHERE r.operation = 'refund' AND p.request_created_at = r.created_at",
    )
    .fetch_all(app.db.ledger.pool())
    .await
    .unwrap();
    points.sort();
    assert_eq!(points, ["FINISHED", "R1_DONE", "REFUND_DONE", "REFUND_SENT"], "every recovery point exactly once");
    assert_eq!(app.refunded(paid).await, (AMOUNT, AMOUNT), "the hold settled once");
}

async fn kill_at(failpoint: &str, completion: Completion) {
    let app = spawn_app().await;
    let paid = app.paid("E2E-REFUND-CRASH").await;
    let body = json!({ "amount_minor": AMOUNT });
    let mut doomed = ServeProcess::start(&app, Some(&format!("{failpoint}=return")), 0).await;
    let first = app.try_refund_at(&doomed.url, &paid, KEY, &body).await;
    assert!(
        first.is_err(),
        "{failpoint}: the process should have died mid-request, got {:?}",
        first.map(|r| r.status())
    );
    assert!(!doomed.exited().await.success(), "{failpoint}: the process aborted");

    let key = ScopedKey::new(app.client_id().await, IdempotencyKey::parse(KEY).unwrap());
    let answer = match completion {
        Completion::ClientRetry => {
            let survivor = ServeProcess::start(&app, None, 0).await;
            let (status, answer) = app.refund_at(&survivor.url, &paid, KEY, &body).await;
            assert_eq!(status, StatusCode::CREATED, "{failpoint}: {}", String::from_utf8_lossy(&answer));
            answer
        }
        Completion::RecoveryWorker => {
            let _survivor = ServeProcess::start(&app, None, 200).await;
            wait_finished(&app, &key).await
        }
    };
    assert_refunded_once(&app, &paid).await;
    let refund: Value = serde_json::from_slice(&answer).unwrap();
    assert_eq!(refund["status"], "succeeded", "{failpoint}");

    let survivor = ServeProcess::start(&app, None, 0).await;
    for _ in 0..2 {
        let again = app.try_refund_at(&survivor.url, &paid, KEY, &body).await.unwrap();
        assert_eq!(again.status(), StatusCode::CREATED);
        assert_eq!(again.headers()["idempotent-replayed"], "true");
        assert_eq!(again.bytes().await.unwrap().to_vec(), answer, "{failpoint}: the answer changed");
    }
    assert_refunded_once(&app, &paid).await;
}

macro_rules! kill_tests {
    ($($name:ident: $failpoint:literal,)*) => {
        mod by_client_retry {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::kill_at($failpoint, super::Completion::ClientRetry).await;
                }
            )*
        }
        mod by_recovery_worker {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::kill_at($failpoint, super::Completion::RecoveryWorker).await;
                }
            )*
        }
    };
}

kill_tests! {
    after_claim: "after-claim",
    after_hold: "after-hold",
    before_first_phase: "before-commit:REFUND_SENT",
    after_first_phase: "after-commit:REFUND_SENT",
    after_call: "after-call:refund",
    before_ledger_finish: "before-commit:FINISHED",
    between_ledger_and_key_store_finish: "after-commit:FINISHED",
}

/// Refunds in flight in a region that dies: once it is declared failed,
/// another region takes them over (one probed at the rail, one that never
/// reached a phase), the balance is never overspent, and the dead region's
/// reconciler voids what it left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refunds_in_flight_in_a_failed_region_finish_in_another_without_overspending() {
    use keyfence::reconcile::{self, Class, Options};
    use keyfence::regions::{self, RegionState, RegionStore};
    use keyfence::startup::{REGION_VIEW_AGE, build_engine};

    let app = spawn_app().await;
    let b = app.second_region("test-2").await;
    let paid = app.paid("E2E-REFUND-FAILOVER").await;
    let body = json!({ "amount_minor": AMOUNT });
    // One refund dies in A right after the rail applied it, another right after its hold.
    for (key, failpoint) in [("failover-sent", "after-call:refund"), ("failover-held", "after-hold")] {
        let mut a = ServeProcess::start(&app, Some(&format!("{failpoint}=return")), 0).await;
        assert!(app.try_refund_at(&a.url, &paid, key, &body).await.is_err(), "{failpoint}");
        a.exited().await;
    }
    assert_eq!(app.refunded(&paid).await, (0, 2 * AMOUNT), "both hold their amount");
    let waiting = app.try_refund_at(&b.url, &paid, "failover-sent", &body).await.unwrap();
    assert_eq!(waiting.status(), StatusCode::CONFLICT, "A is not declared failed: its refund is in flight");

    let store = RegionStore::new(app.keys.store.client().clone(), app.keys.store.table());
    regions::declare(&store, None, "test-1", RegionState::Failed, "test", "drill").await.unwrap();
    tokio::time::sleep(REGION_VIEW_AGE + Duration::from_millis(100)).await;
    for key in ["failover-sent", "failover-held"] {
        let (status, answer) = app.refund_at(&b.url, &paid, key, &body).await;
        assert_eq!(status, StatusCode::CREATED, "{key}: {}", String::from_utf8_lossy(&answer));
    }
    assert_eq!(app.refunded(&paid).await, (2 * AMOUNT, 2 * AMOUNT), "settled once each");
    let at_rail = app.e2.statement().await.iter().filter(|a| a.amount_minor == AMOUNT).count();
    assert_eq!(at_rail, 2, "the applied refund was probed, not sent again");
    let sent = app.e2.sends().await;
    assert!(sent.values().all(|n| *n == 1), "each instruction sent once: {sent:?}");
    let applied_by_a = app.e2.statement().await.into_iter().find(|a| a.amount_minor == AMOUNT).unwrap();
    assert!(app.e2.probes().await.contains(&applied_by_a.idempotency_key), "the refund A sent was probed");
    let in_b: i64 = sqlx::query_scalar("SELECT count(*) FROM refunds WHERE status = 'succeeded'")
        .fetch_one(b.db.ledger.pool())
        .await
        .unwrap();
    assert_eq!(in_b, 2, "both finished in B's ledger");

    // A is back (an instance of it says where it is reached): a refund
    // asked of B, which must ask A for the payment, finds 250 left.
    regions::declare(&store, None, "test-1", RegionState::Active, "test", "healed").await.unwrap();
    let _a = ServeProcess::start(&app, None, 0).await;
    tokio::time::sleep(REGION_VIEW_AGE + Duration::from_millis(100)).await;
    let (status, _) = app.refund_at(&b.url, &paid, "failover-more", &body).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "only 250 are left");
    // Its reconciler voids the refund A left half done.
    let a_engine = build_engine(&app.settings.engine).await.unwrap();
    let options = Options {
        since: keyfence::domain::Millis::new(0),
        until: app.clock.now().plus(Duration::from_secs(60)),
        repair: true,
        stale_after: Duration::ZERO,
        unknown_after: Duration::ZERO,
        segments: 2,
    };
    let report = reconcile::run(&a_engine, &options, &crate::reconcile::Quiet).await.unwrap();
    assert_eq!(
        report.findings.iter().map(|f| f.class).collect::<Vec<_>>(),
        [Class::MovedInFlight],
        "{}",
        report.table()
    );
    assert_eq!(report.unrepaired(), 0, "{}", report.table());
    let voided: i64 = sqlx::query_scalar("SELECT count(*) FROM refunds WHERE status = 'voided'")
        .fetch_one(app.db.ledger.pool())
        .await
        .unwrap();
    assert_eq!(voided, 1);
    assert_eq!(app.unbalanced_payments().await, 0);
    assert_eq!(app.refunded(&paid).await, (2 * AMOUNT, 2 * AMOUNT), "voiding a leftover leaves the balance alone");
    let again =
        reconcile::run(&a_engine, &Options { repair: false, ..options }, &crate::reconcile::Quiet).await.unwrap();
    assert!(again.findings.is_empty(), "{}", again.table());
}

/// A refund whose first owner died before taking its hold, and whose
/// payment another refund has used up meanwhile, is given up when it is
/// taken over: its client is told it does not fit, and nothing of it is
/// left for the recovery worker to resume behind the client's back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refund_that_no_longer_fits_when_taken_over_is_given_up() {
    let app = spawn_app().await;
    let paid = app.paid("E2E-REFUND-GIVEN-UP").await;
    let whole = json!({ "amount_minor": 1250 });
    let mut doomed = ServeProcess::start(&app, Some("after-claim=return"), 0).await;
    assert!(app.try_refund_at(&doomed.url, &paid, "given-up", &whole).await.is_err());
    doomed.exited().await;

    let survivor = ServeProcess::start(&app, None, 0).await;
    let (status, _) = app.refund_at(&survivor.url, &paid, "took-it-all", &whole).await;
    assert_eq!(status, StatusCode::CREATED);
    let (status, body) = app.refund_at(&survivor.url, &paid, "given-up", &whole).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{}", String::from_utf8_lossy(&body));
    let problem: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(problem["type"], "urn:keyfence:problem:refund-exceeds-payment");

    let key = ScopedKey::new(app.client_id().await, IdempotencyKey::parse("given-up").unwrap());
    assert!(app.keys.store.get(&key).await.unwrap().is_none(), "the key is gone: nothing resumes it");
    let point: String = sqlx::query_scalar("SELECT recovery_point FROM requests WHERE idem_key = 'given-up'")
        .fetch_one(app.db.ledger.pool())
        .await
        .unwrap();
    assert_eq!(point, "VOIDED", "no reconciler puts it back");
    assert_eq!(app.count("refunds").await, 1);
    assert_eq!(app.refunded(&paid).await, (1250, 1250));
}
