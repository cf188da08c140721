//! The reconciler on what crashed processes leave: a request whose ledger
//! finished while its key did not, and one in flight with nobody resuming.
//! Both are taken over and finished exactly once.

use keyfence::domain::{IdempotencyKey, ScopedKey};
use keyfence::keystore::{KeyState, KeyStore};
use keyfence::reconcile::Class;

use crate::app::{TestApp, payment, spawn_app};
use crate::crash::assert_exactly_once;
use crate::failover::{assert_each_paid_once, pay_many, restore, snapshot};
use crate::process::{LEASE_MS, ServeProcess, keyfence_command};
use crate::reconcile::reconcile;

/// Makes a process die at `failpoint` in the middle of a payment.
async fn crash_at(app: &TestApp, failpoint: &str, key: &str) -> ScopedKey {
    let mut doomed = ServeProcess::start(app, Some(&format!("{failpoint}=return")), 0).await;
    assert!(app.try_pay_at(&doomed.url, &app.api_key, key, &payment("E2E-RC")).await.is_err());
    doomed.exited().await;
    // Past its lease, as the reconciler (in this process) reckons.
    app.clock.advance(std::time::Duration::from_millis(LEASE_MS + 100));
    ScopedKey::new(app.client_id().await, IdempotencyKey::parse(key).unwrap())
}

async fn detect_and_repair(app: &TestApp, key: &ScopedKey, class: Class) {
    let report = reconcile(app, false).await;
    assert_eq!(report.findings.iter().map(|f| f.class).collect::<Vec<_>>(), [class]);
    let repaired = reconcile(app, true).await;
    assert_eq!(repaired.unrepaired(), 0, "{:?}", repaired.findings);
    assert_eq!(app.keys.store.get(key).await.unwrap().unwrap().state, KeyState::Finished);
    assert_exactly_once(app).await;
    assert!(reconcile(app, false).await.findings.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ledger_finish_without_a_key_finish_is_published() {
    let app = spawn_app().await;
    let key = crash_at(&app, "after-commit:FINISHED", "half-published-1").await;
    detect_and_repair(&app, &key, Class::KeyNotFinished).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_request_nobody_resumed_is_finished() {
    let app = spawn_app().await;
    let key = crash_at(&app, "after-call:ext1", "abandoned-1").await;
    detect_and_repair(&app, &key, Class::StaleInFlight).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reconciler_killed_halfway_and_run_again_repairs_once() {
    let app = spawn_app().await;
    snapshot(app.db.ledger.pool()).await;
    let answers = pay_many(&app, (0..40).map(|i| format!("killed-{i}"))).await;
    restore(app.db.ledger.pool()).await;
    assert_eq!(app.count("payments").await, 0, "the restored ledger lost every payment");

    let mut doomed = keyfence_command(&app, "reconcile")
        .args(["--repair", "--stale-after-ms", "0", "--unknown-after-ms", "0", "--format", "json"])
        .stdout(std::process::Stdio::null())
        .spawn()
        .expect("spawning keyfence reconcile");
    // Kill it as soon as it has rebuilt a few payments.
    while app.count("payments").await < 3 {
        tokio::time::sleep(std::time::Duration::from_millis(2)).await;
    }
    doomed.kill().await.expect("killing the reconciler");
    let partial = app.count("payments").await;
    assert!(partial < 40, "the reconciler was killed halfway ({partial} of 40 rebuilt)");

    let report = reconcile(&app, true).await;
    assert_eq!(report.unrepaired(), 0, "{}", report.table());
    assert_each_paid_once(&app, &answers).await;
    assert!(reconcile(&app, false).await.findings.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_exit_status_says_whether_divergence_remains() {
    let app = spawn_app().await;
    let clean = keyfence_command(&app, "reconcile").status().await.unwrap();
    assert_eq!(clean.code(), Some(0), "nothing to find");

    snapshot(app.db.ledger.pool()).await;
    pay_many(&app, (0..2).map(|i| format!("status-{i}"))).await;
    restore(app.db.ledger.pool()).await;
    let found = keyfence_command(&app, "reconcile").arg("--dry-run").status().await.unwrap();
    assert_eq!(found.code(), Some(1), "divergence found, nothing repaired");
    let repaired = keyfence_command(&app, "reconcile").arg("--repair").status().await.unwrap();
    assert_eq!(repaired.code(), Some(0), "everything repaired");
    let unreachable = keyfence_command(&app, "reconcile")
        .env("DATABASE_URL", "postgres://nobody@127.0.0.1:1/x")
        .status()
        .await
        .unwrap();
    assert_eq!(unreachable.code(), Some(2), "the reconciler could not run");
}
