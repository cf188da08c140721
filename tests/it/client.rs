//! The client library (`keyfence-client`) against a real front door: a
//! client that dies and starts again pays once, rail faults end in success
//! with one instruction each, and a region that stops serving is left for
//! the next one with the same keys.

use std::path::PathBuf;
use std::time::Duration;

use futures::future::join_all;
use keyfence::regions::{self, RegionState, RegionStore};
use keyfence::startup::REGION_VIEW_AGE;
use keyfence_client::{
    Client, Journal, JournalError, OperationId, Outcome, PayError, PaymentRequest, PaymentStatus, Receipt,
    RefundOutcome, RefundRequest, RefundStatus,
};

use crate::app::{TestApp, spawn_app, spawn_app_with};
use crate::harness::eventually;
use crate::process::{ServeProcess, keyfence_command};
use crate::proxy::Proxy;

/// A fresh directory for one test's journal.
fn journal_path() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("keyfence-client-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join("payments.journal")
}

fn request(end_to_end_id: &str) -> PaymentRequest {
    PaymentRequest::new(1250, "EUR")
        .debtor_account("DE89370400440532013000")
        .creditor_account("FR1420041010050500013M02606")
        .end_to_end_id(end_to_end_id)
}

/// Whether the journal file holds an entry for `operation`, read while
/// the client that holds the journal runs.
fn journalled(journal: &PathBuf, operation: &OperationId) -> bool {
    let text = std::fs::read_to_string(journal).unwrap_or_default();
    text.lines()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        .any(|entry| entry["operation"] == operation.as_str())
}

fn client(urls: &[&str], api_key: &str, journal: &PathBuf) -> Client {
    Client::builder(urls.iter().copied(), api_key)
        .journal(journal)
        .deadline(Duration::from_secs(30))
        .attempt_timeout(Duration::from_secs(3))
        .backoff(Duration::from_millis(50), Duration::from_millis(500))
        .build()
        .unwrap()
}

fn succeeded(receipt: &Receipt) -> bool {
    matches!(receipt.outcome, Outcome::Succeeded { .. })
}

/// How many payments the ledger holds with this end-to-end reference.
async fn payments_for(app: &TestApp, end_to_end_id: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM payments WHERE end_to_end_id = $1")
        .bind(end_to_end_id)
        .fetch_one(app.db.ledger.pool())
        .await
        .unwrap()
}

async fn instructions_for(app: &TestApp, end_to_end_id: &str) -> usize {
    app.e2.statement().await.iter().filter(|a| a.end_to_end_id == end_to_end_id).count()
}

#[tokio::test]
async fn a_client_killed_between_journalling_and_its_first_attempt_pays_once() {
    let app = spawn_app().await;
    let target = app.url.trim_start_matches("http://").parse().unwrap();
    let proxy = Proxy::start(target).await;
    let proxied = format!("http://{}", proxy.addr);
    let journal = journal_path();
    let operation = OperationId::new("invoice-killed-early").unwrap();

    // Nothing reaches the front door: the client journals its key and keeps
    // retrying against a refused connection until it is killed.
    proxy.cut();
    let first = client(&[&proxied], &app.api_key, &journal);
    let dying = tokio::spawn({
        let operation = operation.clone();
        async move { first.pay(&request("KILLED-EARLY"), &operation).await }
    });
    eventually("the key is journalled", async || journalled(&journal, &operation)).await;
    assert!(
        matches!(Journal::open(&journal), Err(JournalError::Locked { .. })),
        "the running client holds its journal"
    );
    dying.abort();
    let _ = dying.await;
    let key = Journal::open(&journal).unwrap().existing(&operation).unwrap();
    assert_eq!(payments_for(&app, "KILLED-EARLY").await, 0, "nothing was sent before the kill");

    // The restarted client reads the same key and pays.
    proxy.heal();
    let receipt = client(&[&proxied], &app.api_key, &journal).pay(&request("KILLED-EARLY"), &operation).await.unwrap();
    assert!(succeeded(&receipt), "{receipt:?}");
    assert_eq!(receipt.idempotency_key, key, "the restarted client used the journalled key");
    assert_eq!(payments_for(&app, "KILLED-EARLY").await, 1);
    assert_eq!(instructions_for(&app, "KILLED-EARLY").await, 1);
}

#[tokio::test]
async fn a_client_killed_after_its_first_attempt_pays_once_on_restart() {
    let app = spawn_app().await;
    // The payment is slow at the rail, so the client dies while it is worked.
    app.e2.set_faults(serde_json::json!({ "latency_ms": 800 })).await;
    let journal = journal_path();
    let operation = OperationId::new("invoice-killed-late").unwrap();
    let first = client(&[&app.url], &app.api_key, &journal);
    let dying = tokio::spawn({
        let operation = operation.clone();
        async move { first.pay(&request("KILLED-LATE"), &operation).await }
    });
    eventually("the first attempt reached the ledger", async || payments_for(&app, "KILLED-LATE").await == 1).await;
    dying.abort();
    let _ = dying.await;
    // The front door finishes the payment though its client went away.
    eventually("the payment finished without its client", async || {
        instructions_for(&app, "KILLED-LATE").await == 1
            && sqlx::query_scalar::<_, String>("SELECT status FROM payments WHERE end_to_end_id = 'KILLED-LATE'")
                .fetch_one(app.db.ledger.pool())
                .await
                .is_ok_and(|status| status == "succeeded")
    })
    .await;

    let again = client(&[&app.url], &app.api_key, &journal).pay(&request("KILLED-LATE"), &operation).await.unwrap();
    match &again.outcome {
        Outcome::Succeeded { payment } => assert_eq!(payment.status, PaymentStatus::Succeeded),
        other => panic!("{other:?}"),
    }
    assert_eq!(payments_for(&app, "KILLED-LATE").await, 1, "one payment, not two");
    assert_eq!(instructions_for(&app, "KILLED-LATE").await, 1, "one instruction at the rail");
    // And paying the same operation once more replays the same payment.
    let replay = client(&[&app.url], &app.api_key, &journal).pay(&request("KILLED-LATE"), &operation).await.unwrap();
    assert!(replay.replayed);
    assert_eq!(replay.outcome, again.outcome);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_pay_ends_succeeded_with_one_instruction_under_rail_faults() {
    // A recovery worker finishes what a lost rail reply parked.
    let app = spawn_app_with(|s| s.recovery_interval_ms = 300).await;
    app.e2.set_faults(serde_json::json!({ "timeout_after_apply_rate": 0.3, "error_rate": 0.2 })).await;
    let journal = journal_path();
    let payer = client(&[&app.url], &app.api_key, &journal);
    let receipts = join_all((0..16).map(|i| {
        let payer = payer.clone();
        async move {
            let operation = OperationId::new(format!("faulty-{i}")).unwrap();
            payer.pay(&request(&format!("FAULTY-{i}")), &operation).await.unwrap()
        }
    }))
    .await;
    for (i, receipt) in receipts.iter().enumerate() {
        assert!(succeeded(receipt), "operation {i}: {receipt:?}");
        assert_eq!(payments_for(&app, &format!("FAULTY-{i}")).await, 1);
        assert_eq!(instructions_for(&app, &format!("FAULTY-{i}")).await, 1, "FAULTY-{i}");
    }
    assert_eq!(app.e2.statement().await.len(), 16);
    assert_eq!(app.unbalanced_payments().await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_region_that_stops_serving_is_left_for_the_next_with_the_same_keys() {
    let app = spawn_app().await;
    let b = app.second_region("test-2").await;
    let mut a = ServeProcess::spawn(keyfence_command(&app, "serve")).await;
    app.e2.set_faults(serde_json::json!({ "latency_ms": 150 })).await;
    let journal = journal_path();
    let payer = client(&[&a.url, &b.url], &app.api_key, &journal);

    let stream = join_all((0..12).map(|i| {
        let payer = payer.clone();
        async move {
            tokio::time::sleep(Duration::from_millis(100 * i)).await;
            let operation = OperationId::new(format!("regional-{i}")).unwrap();
            payer.pay(&request(&format!("REGIONAL-{i}")), &operation).await.unwrap()
        }
    }));
    let (receipts, ()) = tokio::join!(stream, async {
        tokio::time::sleep(Duration::from_millis(450)).await;
        a.terminate().await;
        // An SRE declares A failed; B takes over what A left in flight.
        let store = RegionStore::new(app.keys.store.client().clone(), app.keys.store.table());
        regions::declare(&store, None, "test-1", RegionState::Failed, "drill", "A stopped").await.unwrap();
        tokio::time::sleep(REGION_VIEW_AGE).await;
    });
    for (i, receipt) in receipts.iter().enumerate() {
        assert!(succeeded(receipt), "operation {i}: {receipt:?}");
        assert_eq!(instructions_for(&app, &format!("REGIONAL-{i}")).await, 1, "REGIONAL-{i}");
    }
    let paid_in_b: i64 = sqlx::query_scalar("SELECT count(*) FROM payments WHERE status = 'succeeded'")
        .fetch_one(b.db.ledger.pool())
        .await
        .unwrap();
    assert!(paid_in_b >= 1, "the second region finished some of them");
    assert_eq!(app.e2.statement().await.len(), 12, "one instruction per operation across both regions");
}

#[tokio::test]
async fn a_decline_is_an_outcome_and_a_reused_key_a_programming_error() {
    let app = spawn_app().await;
    app.e2.set_rules(serde_json::json!({ "max_amount_minor": 1000 })).await;
    let journal = journal_path();
    let payer = client(&[&app.url], &app.api_key, &journal);

    let declined = payer.pay(&request("TOO-MUCH"), &OperationId::new("too-much").unwrap()).await.unwrap();
    match &declined.outcome {
        Outcome::Rejected { payment_id, reason } => {
            assert!(payment_id.is_some(), "{declined:?}");
            assert!(!reason.is_empty());
        }
        other => panic!("a decline is a final outcome: {other:?}"),
    }
    assert_eq!(app.e2.declines().await.len(), 1, "declined once, not retried");

    let mut other = request("TOO-MUCH");
    other.amount_minor = 999;
    match payer.pay_with_key(&other, &declined.idempotency_key).await {
        Err(keyfence_client::PayError::KeyReused { key, .. }) => assert_eq!(key, declined.idempotency_key),
        answer => panic!("the same key with another body is the caller's error: {answer:?}"),
    }
    assert_eq!(app.e2.statement().await.len(), 0, "nothing paid under the reused key");
}

/// A refund through the client: refunded once under its operation's key
/// (while the payment rail is slow, so attempts time out and are retried),
/// the same operation again is a replay, and one that does not fit what is
/// left is refused, not retried.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refund_is_made_once_per_operation() {
    let app = spawn_app().await;
    let journal = journal_path();
    let payer = client(&[&app.url], &app.api_key, &journal);
    let paid = payer.pay(&request("CLIENT-REFUND"), &OperationId::new("invoice-refunded").unwrap()).await.unwrap();
    let Outcome::Succeeded { payment } = paid.outcome else { panic!("{paid:?}") };

    app.e2.set_faults(serde_json::json!({ "latency_ms": 400 })).await;
    let slow = Client::builder([app.url.as_str()], &app.api_key)
        .journal(journal_path())
        .deadline(Duration::from_secs(30))
        .attempt_timeout(Duration::from_millis(200))
        .backoff(Duration::from_millis(50), Duration::from_millis(300))
        .build()
        .unwrap();
    let operation = OperationId::new("refund-of-invoice").unwrap();
    let refund = RefundRequest::new(1000).reason("returned goods");
    let first = slow.refund(payment.id, &refund, &operation).await.unwrap();
    let RefundOutcome::Succeeded { refund: made } = &first.outcome else { panic!("{first:?}") };
    assert_eq!((made.payment_id, made.amount_minor, made.status), (payment.id, 1000, RefundStatus::Succeeded));
    app.e2.clear_faults().await;

    let again = slow.refund(payment.id, &refund, &operation).await.unwrap();
    assert_eq!(
        (&again.outcome, again.replayed, &again.idempotency_key),
        (&first.outcome, true, &first.idempotency_key)
    );
    let at_rail = app.e2.statement().await.iter().filter(|a| a.amount_minor == 1000).count();
    assert_eq!(at_rail, 1, "one refund instruction at E2");

    let too_much = slow.refund(payment.id, &RefundRequest::new(251), &OperationId::new("one-too-many").unwrap()).await;
    assert!(matches!(too_much, Err(PayError::Refused { status: 422, .. })), "{too_much:?}");
    let rest = slow.refund(payment.id, &RefundRequest::new(250), &OperationId::new("the-rest").unwrap()).await.unwrap();
    assert!(matches!(rest.outcome, RefundOutcome::Succeeded { .. }), "{rest:?}");
}
