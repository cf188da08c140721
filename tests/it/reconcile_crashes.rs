//! The reconciler on what crashed processes leave: a request whose ledger
//! finished while its key did not, and one in flight with nobody resuming.
//! Both are taken over and finished exactly once.

use keyfence::domain::{IdempotencyKey, ScopedKey};
use keyfence::keystore::{KeyState, KeyStore};
use keyfence::reconcile::Class;

use crate::app::{TestApp, payment, spawn_app};
use crate::crash::assert_exactly_once;
use crate::process::{LEASE_MS, ServeProcess};
use crate::reconcile::reconcile;

/// Makes a process die at `failpoint` in the middle of a payment.
async fn crash_at(app: &TestApp, failpoint: &str, key: &str) -> ScopedKey {
    let mut doomed = ServeProcess::start(app, Some(&format!("{failpoint}=return")), 0).await;
    assert!(app.try_pay_at(&doomed.url, &app.api_key, key, &payment("E2E-RC")).await.is_err());
    doomed.exited().await;
    tokio::time::sleep(std::time::Duration::from_millis(LEASE_MS + 100)).await;
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
