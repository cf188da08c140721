//! Crash safety with real processes: for every failpoint, `keyfence serve`
//! aborts there in the middle of a payment; a new process then completes it
//! (a) through the client's retry with the same key, and (b) with no retry
//! at all, through the recovery worker. Each time: one payment, balanced
//! postings, one instruction at each rail, no phase run twice, and the same
//! final answer for every later retry.

use std::time::{Duration, Instant};

use keyfence::domain::{IdempotencyKey, ScopedKey};
use keyfence::keystore::{KeyState, KeyStore};
use reqwest::StatusCode;
use serde_json::Value;

use crate::app::{TestApp, payment, spawn_app};
use crate::process::ServeProcess;

const KEY: &str = "crash-1";

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Completion {
    ClientRetry,
    RecoveryWorker,
}

/// Retries until a 201 (409s are expected while the dead owner's lease runs).
pub async fn retry_until_created(app: &TestApp, url: &str, key: &str, body: &Value) -> reqwest::Response {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let response = app.try_pay_at(url, &app.api_key, key, body).await.expect("the new process answers");
        match response.status() {
            StatusCode::CREATED => return response,
            StatusCode::CONFLICT | StatusCode::ACCEPTED | StatusCode::SERVICE_UNAVAILABLE => {}
            other => panic!("unexpected answer {other}: {}", response.text().await.unwrap()),
        }
        assert!(Instant::now() < deadline, "the payment did not complete within 20 s");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Waits until the key store holds a final answer for the key.
async fn wait_finished(app: &TestApp, key: &ScopedKey) -> Vec<u8> {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(item) = app.keys.store.get(key).await.unwrap()
            && item.state == KeyState::Finished
        {
            return item.response.expect("a finished item has an answer").body;
        }
        assert!(Instant::now() < deadline, "the recovery worker did not finish the payment within 20 s");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Asserts exactly one effect everywhere, and that no phase ran twice.
pub async fn assert_exactly_once(app: &TestApp) {
    assert_eq!(app.count("payments").await, 1, "payments in the ledger");
    assert_eq!(app.count("postings").await, 6, "three balanced entries");
    assert_eq!(app.unbalanced_payments().await, 0);
    assert_eq!(app.e1.statement().await.len(), 1, "instructions at E1");
    assert_eq!(app.e2.statement().await.len(), 1, "instructions at E2");
    // phase_runs has one row per recovery point reached (its primary key
    // would have failed a second run), and all seven were reached.
    let points: Vec<String> = sqlx::query_scalar("SELECT point FROM phase_runs ORDER BY ran_at, point")
        .fetch_all(app.db.ledger.pool())
        .await
        .unwrap();
    let mut sorted = points.clone();
    sorted.sort();
    let mut expected = ["H1_DONE", "EXT1_SENT", "EXT1_DONE", "H2_DONE", "EXT2_SENT", "EXT2_DONE", "FINISHED"];
    expected.sort();
    assert_eq!(sorted, expected, "every recovery point exactly once");
    let status: String =
        sqlx::query_scalar("SELECT status FROM payments").fetch_one(app.db.ledger.pool()).await.unwrap();
    assert_eq!(status, "succeeded");
}

async fn kill_at(failpoint: &str, completion: Completion) {
    let app = spawn_app().await;
    let body = payment("E2E-CRASH");
    let mut doomed = ServeProcess::start(&app, Some(&format!("{failpoint}=return")), 0).await;
    let first = app.try_pay_at(&doomed.url, &app.api_key, KEY, &body).await;
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
            retry_until_created(&app, &survivor.url, KEY, &body).await.bytes().await.unwrap().to_vec()
        }
        Completion::RecoveryWorker => {
            let _survivor = ServeProcess::start(&app, None, 200).await;
            wait_finished(&app, &key).await
        }
    };
    assert_exactly_once(&app).await;

    // Every later retry gets the same bytes, marked as a replay.
    let survivor = ServeProcess::start(&app, None, 0).await;
    for _ in 0..2 {
        let again = app.try_pay_at(&survivor.url, &app.api_key, KEY, &body).await.unwrap();
        assert_eq!(again.status(), StatusCode::CREATED);
        assert_eq!(again.headers()["idempotent-replayed"], "true");
        assert_eq!(again.bytes().await.unwrap().to_vec(), answer, "{failpoint}: the answer changed");
    }
    let stored = app.keys.store.get(&key).await.unwrap().unwrap();
    assert_eq!(stored.response.unwrap().body, answer);
    assert_exactly_once(&app).await;
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
    before_intent_ext1: "before-commit:EXT1_SENT",
    after_intent_ext1: "after-commit:EXT1_SENT",
    after_call_ext1: "after-call:ext1",
    before_outcome_ext1: "before-commit:EXT2_SENT",
    after_outcome_ext1_and_intent_ext2: "after-commit:EXT2_SENT",
    after_call_ext2: "after-call:ext2",
    before_ledger_finish: "before-commit:FINISHED",
    between_ledger_and_key_store_finish: "after-commit:FINISHED",
}

/// A payment whose row was made before payments took their request's time
/// (its `created_at` the moment of its insert), in flight when a new
/// version finishes it: the answer and the payment as shown agree, both at
/// the time the key carries, since the phase that builds the answer
/// without reading the row gives the row that time too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_payment_made_before_it_took_its_requests_time_answers_as_it_is_shown() {
    let app = spawn_app().await;
    let body = payment("E2E-OLD-ROW");
    let mut doomed = ServeProcess::start(&app, Some("after-call:ext2=return"), 0).await;
    assert!(app.try_pay_at(&doomed.url, &app.api_key, KEY, &body).await.is_err(), "died after the rail");
    assert!(!doomed.exited().await.success());
    let made_apart = "UPDATE payments SET created_at = request_created_at - interval '1.5 seconds'";
    sqlx::query(made_apart).execute(app.db.ledger.pool()).await.unwrap();

    let survivor = ServeProcess::start(&app, None, 0).await;
    let answer: Value = retry_until_created(&app, &survivor.url, KEY, &body).await.json().await.unwrap();
    let shown: Value = app
        .get_as(&app.api_key, &format!("/v1/payments/{}", answer["id"].as_str().unwrap()))
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(answer["created_at"], shown["created_at"], "the answer is the payment as shown");
    let key = ScopedKey::new(app.client_id().await, IdempotencyKey::parse(KEY).unwrap());
    let claimed = app.keys.store.get(&key).await.unwrap().unwrap().created_at;
    let took: bool = sqlx::query_scalar("SELECT created_at = $1 AND request_created_at = $1 FROM payments")
        .bind(keyfence::ledger::timestamp(claimed))
        .fetch_one(app.db.ledger.pool())
        .await
        .unwrap();
    assert!(took, "the row took the time its key carries");
    assert_exactly_once(&app).await;
}
