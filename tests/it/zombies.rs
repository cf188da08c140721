//! Owners that lose their lease: a stalled owner (a zombie) that wakes after
//! a takeover changes nothing and never answers with its own copy; a client
//! retry and two recovery workers that race for one stale key resume it
//! exactly once.

use std::collections::BTreeMap;
use std::time::Duration;

use keyfence::domain::{Fence, IdempotencyKey, ScopedKey};
use keyfence::keystore::{KeyState, KeyStore};
use keyfence::recovery;
use keyfence::startup::build_engine;
use reqwest::StatusCode;

use crate::app::{payment, spawn_app};
use crate::crash::{assert_exactly_once, retry_until_created};
use crate::harness::TestLedger;
use crate::process::{LEASE_MS, ServeProcess, keyfence_command};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_zombie_owner_that_wakes_after_a_takeover_changes_nothing() {
    let app = spawn_app().await;
    let body = payment("E2E-ZOMBIE");
    let zombie = ServeProcess::start(&app, Some("before-phase:EXT2_SENT=sleep(5000)"), 0).await;
    let zombie_answer = app.pay_in_background(&zombie.url, "zombie-1", &body);

    // The zombie has called E1 and stalls; once its lease is over, another
    // instance takes the retry over and finishes the payment.
    tokio::time::sleep(Duration::from_millis(LEASE_MS + 300)).await;
    let successor = ServeProcess::start(&app, None, 0).await;
    // Its lease may have been extended once before the stall: retry until it ends.
    let retry = retry_until_created(&app, &successor.url, "zombie-1", &body).await;
    assert!(retry.headers().get("idempotent-replayed").is_none(), "the successor did the work");
    let answer = retry.bytes().await.unwrap();

    let woke = zombie_answer.await.unwrap().expect("the zombie answers its client once it wakes");
    assert_eq!(woke.status(), StatusCode::CONFLICT, "the zombie must not report an answer of its own");

    assert_exactly_once(&app).await;
    let key = ScopedKey::new(app.client_id().await, IdempotencyKey::parse("zombie-1").unwrap());
    let stored = app.keys.store.get(&key).await.unwrap().unwrap();
    assert_eq!(stored.fence, Fence::new(2));
    assert_eq!(stored.response.unwrap().body, answer.to_vec(), "the stored answer is the successor's");
    let by_zombie: Vec<String> = sqlx::query_scalar("SELECT point FROM phase_runs WHERE fence = 1 ORDER BY point")
        .fetch_all(app.db.ledger.pool())
        .await
        .unwrap();
    assert_eq!(by_zombie, ["EXT1_SENT", "H1_DONE"], "nothing the zombie tried after the takeover was written");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_and_two_recovery_workers_resume_a_stale_key_once() {
    let app = spawn_app().await;
    let body = payment("E2E-RACE-RESUME");
    let mut doomed = ServeProcess::start(&app, Some("after-call:ext1=return"), 0).await;
    assert!(app.try_pay_at(&doomed.url, &app.api_key, "stale-1", &body).await.is_err());
    doomed.exited().await;

    let survivor = ServeProcess::start(&app, None, 0).await;
    let worker = |name: &str| {
        let mut settings = app.settings.clone();
        settings.engine.work.instance = name.to_owned();
        settings.engine.work.lease = Duration::from_millis(LEASE_MS);
        settings
    };
    let (first, second) = (
        build_engine(&worker("worker-a").engine).await.unwrap(),
        build_engine(&worker("worker-b").engine).await.unwrap(),
    );
    tokio::time::sleep(Duration::from_millis(LEASE_MS + 200)).await;

    let (retry, a, b) = tokio::join!(
        app.try_pay_at(&survivor.url, &app.api_key, "stale-1", &body),
        recovery::sweep(&first, recovery::Scope::Worker, |_| {}, || {}),
        recovery::sweep(&second, recovery::Scope::Worker, |_| {}, || {}),
    );
    let retry = retry.unwrap();
    let retry_resumed = retry.status() == StatusCode::CREATED && retry.headers().get("idempotent-replayed").is_none();
    let resumed = usize::from(retry_resumed) + a.finished + b.finished;
    assert_eq!(resumed, 1, "retry {} / worker a {a:?} / worker b {b:?}", retry.status());
    assert!(a.failed.is_empty() && b.failed.is_empty(), "{a:?} {b:?}");

    let key = ScopedKey::new(app.client_id().await, IdempotencyKey::parse("stale-1").unwrap());
    let item = app.keys.store.get(&key).await.unwrap().unwrap();
    assert_eq!(item.state, KeyState::Finished);
    assert_eq!(item.fence, Fence::new(2), "exactly one takeover happened");
    assert_exactly_once(&app).await;
}

/// The zombie committed FINISHED in its ledger, then stalled before storing
/// the answer in the key store. Its ledger is lost to a failover: the
/// successor, on the promoted ledger, rebuilds the payment (probing the
/// rails, which already applied it) and stores an answer of its own. When
/// the zombie wakes, its finish is refused, and it must answer its client
/// with what the key store holds (a replay), never with its own copy. The
/// two copies are the same bytes: a payment's answer is built from its
/// request, its key's time and the rail's reference, whichever ledger
/// builds it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_zombie_fenced_out_at_finish_answers_the_successors_bytes() {
    let app = spawn_app().await;
    let body = payment("E2E-ZOMBIE-FINISH");
    let promoted = TestLedger::new().await;

    let zombie = ServeProcess::start(&app, Some("after-commit:FINISHED=sleep(4000)"), 0).await;
    let zombie_answer = app.pay_in_background(&zombie.url, "zombie-finish-1", &body);
    tokio::time::sleep(Duration::from_millis(LEASE_MS + 300)).await;
    let mut command = keyfence_command(&app, "serve");
    command.env("DATABASE_URL", &promoted.url).env("KEYFENCE_RECOVERY_INTERVAL_MS", "0");
    let successor = ServeProcess::spawn(command).await;
    let retry = retry_until_created(&app, &successor.url, "zombie-finish-1", &body).await;
    let successors = retry.bytes().await.unwrap();

    let woke = zombie_answer.await.unwrap().expect("the zombie answers once it wakes");
    assert_eq!(woke.status(), StatusCode::CREATED);
    assert_eq!(woke.headers()["idempotent-replayed"], "true", "it answers what the key store holds");
    let zombies = woke.bytes().await.unwrap();
    let in_its_ledger: Vec<u8> =
        sqlx::query_scalar("SELECT response_body FROM requests").fetch_one(app.db.ledger.pool()).await.unwrap();
    let in_the_promoted: Vec<u8> =
        sqlx::query_scalar("SELECT response_body FROM requests").fetch_one(promoted.ledger.pool()).await.unwrap();
    assert_eq!(
        (&in_its_ledger, &in_the_promoted),
        (&successors.to_vec(), &successors.to_vec()),
        "one answer in both ledgers"
    );
    assert_eq!(zombies, successors, "the zombie's client gets the successor's bytes");
    assert_eq!(app.e1.statement().await.len(), 1, "the successor probed, not re-sent");
    app.e1.assert_probed_not_resent("E1").await;
    assert_eq!(app.e2.statement().await.len(), 1);
    assert_eq!(app.e2.sent_again().await, BTreeMap::new());
}
