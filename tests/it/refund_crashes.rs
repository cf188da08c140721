//! Crash safety of refunds with real processes: for every failpoint a
//! refund passes, `keyfence serve` aborts there; a new process then
//! completes the refund (a) through the client's retry with the same key,
//! and (b) with no retry at all, through the recovery worker. Each time:
//! one refund, balanced postings, one refund instruction at the rail, the
//! balance's hold settled once, and the same answer for every later retry.

use std::time::{Duration, Instant};

use keyfence::domain::{IdempotencyKey, ScopedKey};
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
