//! The failover drill and the reconciler's safety beside others.
//!
//! Drill: payments (with retries) stream into one region; the ledger is
//! snapshotted partway while they run; more payments follow; then the old
//! snapshot is put back in the ledger's place, as when a replica that lost
//! its last commits is promoted. One reconciler run must restore every
//! finished payment exactly once, and a second run must find nothing.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::Duration;

use futures::StreamExt;
use keyfence::domain::{IdempotencyKey, ScopedKey};
use keyfence::keystore::{KeyState, KeyStore};
use reqwest::StatusCode;
use sqlx::PgPool;

use crate::app::{TestApp, payment, spawn_app};
use crate::reconcile::reconcile;

const TABLES: [&str; 9] = [
    "clients",
    "requests",
    "payments",
    "refunds",
    "postings",
    "external_calls",
    "phase_runs",
    "outbox",
    "webhook_deliveries",
];

/// A consistent copy of every ledger table into schema `snap`.
pub async fn snapshot(pool: &PgPool) {
    let mut tx = pool.begin().await.unwrap();
    sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ").execute(&mut *tx).await.unwrap();
    sqlx::query("CREATE SCHEMA snap").execute(&mut *tx).await.unwrap();
    for table in TABLES {
        let copy = format!("CREATE TABLE snap.{table} AS TABLE public.{table}");
        sqlx::query(sqlx::AssertSqlSafe(copy)).execute(&mut *tx).await.unwrap();
    }
    tx.commit().await.unwrap();
}

/// Puts the snapshot back in place of the ledger's current contents. A
/// service still running on the ledger (its webhook worker) may deadlock
/// with the truncation; PostgreSQL then ends one of the two, and if it is
/// this one, it is tried again.
pub async fn restore(pool: &PgPool) {
    for _ in 0..5 {
        match try_restore(pool).await {
            Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("40P01") => continue,
            done => return done.unwrap(),
        }
    }
    panic!("the ledger could not be restored: deadlocked five times");
}

async fn try_restore(pool: &PgPool) -> Result<(), sqlx::Error> {
    let mut tx = pool.begin().await?;
    sqlx::query("SET LOCAL session_replication_role = replica").execute(&mut *tx).await?;
    sqlx::query(sqlx::AssertSqlSafe(format!("TRUNCATE {} CASCADE", TABLES.join(", ")))).execute(&mut *tx).await?;
    for table in TABLES {
        let back = format!("INSERT INTO public.{table} OVERRIDING SYSTEM VALUE SELECT * FROM snap.{table}");
        sqlx::query(sqlx::AssertSqlSafe(back)).execute(&mut *tx).await?;
    }
    tx.commit().await
}

/// Pays under `key`, retrying as a client would, until a 201; its bytes.
async fn pay_with_retries(app: &TestApp, key: &str) -> Vec<u8> {
    let body = payment(&format!("E2E-{key}"));
    loop {
        let response = app.pay(key, &body).await;
        if response.status() == StatusCode::CREATED {
            // A client that timed out would send it again: that must replay.
            let again = app.pay(key, &body).await;
            let bytes = response.bytes().await.unwrap().to_vec();
            assert_eq!(again.bytes().await.unwrap().to_vec(), bytes);
            return bytes;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

pub async fn pay_many(app: &TestApp, keys: impl Iterator<Item = String>) -> HashMap<String, Vec<u8>> {
    futures::stream::iter(keys)
        .map(|key| async move {
            let bytes = pay_with_retries(app, &key).await;
            (key, bytes)
        })
        .buffer_unordered(4)
        .collect()
        .await
}

/// Every key in `answers` is finished with its original answer, has exactly
/// one payment with balanced postings, each rail holds one instruction per
/// derived key, and a retry replays the original bytes.
pub async fn assert_each_paid_once(app: &TestApp, answers: &HashMap<String, Vec<u8>>) {
    let client = app.client_id().await;
    for (key, bytes) in answers {
        let scoped = ScopedKey::new(client, IdempotencyKey::parse(key).unwrap());
        let item = app.keys.store.get(&scoped).await.unwrap().expect("the key exists");
        assert_eq!(item.state, KeyState::Finished);
        assert_eq!(&item.response.unwrap().body, bytes, "{key}: the stored answer changed");
        let payments: i64 = sqlx::query_scalar("SELECT count(*) FROM payments WHERE client_id = $1 AND idem_key = $2")
            .bind(client.as_uuid())
            .bind(key)
            .fetch_one(app.db.ledger.pool())
            .await
            .unwrap();
        assert_eq!(payments, 1, "{key}: payments in the ledger");
    }
    assert_eq!(app.count("payments").await, answers.len() as i64);
    assert_eq!(app.count("postings").await, 6 * answers.len() as i64);
    assert_eq!(app.unbalanced_payments().await, 0);
    for rail in [&app.e1, &app.e2] {
        let statement = rail.statement().await;
        let keys: HashSet<_> = statement.iter().map(|a| a.idempotency_key.clone()).collect();
        assert_eq!(statement.len(), answers.len(), "one instruction per payment at each rail");
        assert_eq!(keys.len(), statement.len(), "no derived key applied twice");
        assert_eq!(rail.sent_again().await, BTreeMap::new(), "no derived key sent twice");
    }
    for (key, bytes) in answers {
        let again = app.pay(key, &payment(&format!("E2E-{key}"))).await;
        assert_eq!(again.headers()["idempotent-replayed"], "true");
        assert_eq!(&again.bytes().await.unwrap().to_vec(), bytes, "{key}: a retry got other bytes");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_drill_restores_every_finished_payment_exactly_once() {
    let app = spawn_app().await;
    let mut answers = pay_many(&app, (0..12).map(|i| format!("before-{i}"))).await;

    // Snapshot while the next batch is being worked: some of its requests
    // are caught half-way in the snapshot.
    let during = pay_many(&app, (0..12).map(|i| format!("during-{i}")));
    let snap = async {
        tokio::time::sleep(Duration::from_millis(150)).await;
        snapshot(app.db.ledger.pool()).await;
    };
    let (during, ()) = tokio::join!(during, snap);
    answers.extend(during);
    answers.extend(pay_many(&app, (0..12).map(|i| format!("after-{i}"))).await);

    restore(app.db.ledger.pool()).await;
    let lost = answers.len() as i64 - app.count("payments").await;
    assert!(lost >= 12, "the restored ledger lost at least the last batch ({lost} lost)");

    let report = reconcile(&app, true).await;
    assert!(report.findings.len() as i64 >= lost, "{} findings for {lost} lost payments", report.findings.len());
    assert_eq!(report.unrepaired(), 0, "{}", report.table());
    assert_each_paid_once(&app, &answers).await;
    let again = reconcile(&app, false).await;
    assert!(again.findings.is_empty(), "{}", again.table());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_reconcilers_beside_live_traffic_repair_once() {
    let app = spawn_app().await;
    let mut answers = pay_many(&app, (0..10).map(|i| format!("old-{i}"))).await;
    snapshot(app.db.ledger.pool()).await;
    answers.extend(pay_many(&app, (0..10).map(|i| format!("lost-{i}"))).await);
    restore(app.db.ledger.pool()).await;

    // Two reconcilers at once, while clients retry the same keys and new
    // payments arrive.
    let retries = pay_many(&app, answers.keys().cloned().collect::<Vec<_>>().into_iter());
    let fresh = pay_many(&app, (0..6).map(|i| format!("new-{i}")));
    let (first, second, retried, fresh) = tokio::join!(reconcile(&app, true), reconcile(&app, true), retries, fresh);
    assert_eq!(first.unrepaired() + second.unrepaired(), 0, "{}\n{}", first.table(), second.table());
    for (key, bytes) in &retried {
        assert_eq!(bytes, &answers[key], "{key}: a retry during the repair got other bytes");
    }
    answers.extend(fresh);
    assert_each_paid_once(&app, &answers).await;
    assert!(reconcile(&app, false).await.findings.is_empty());
}
