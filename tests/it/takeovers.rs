//! A takeover that cannot go on gives the key back at once, instead of
//! sitting on it for a whole lease: the stored request does not decode, the
//! ledger cannot be reached to adopt it, or what was taken over is another
//! request than the one read. And `serve` refuses settings
//! under which a lease could run out while a rail call is in flight.

use std::process::Stdio;
use std::time::Duration;

use keyfence::domain::{Fence, Millis, PaymentRequest, RequestHash};
use keyfence::engine::{Answer, EngineError, Submission};
use keyfence::keystore::{KeyStore, Release, StaleKey};
use keyfence::operations::PaymentOperation;
use keyfence::startup::build_engine;

use crate::app::spawn_app;
use crate::harness::{claim_of, fresh_key};
use crate::process::keyfence_command;

/// A started key whose owner died long ago, with `request` stored on it.
async fn stale_key(app: &crate::app::TestApp, request: &[u8]) -> StaleKey {
    let key = fresh_key();
    let mut claim = claim_of(&key, Millis::new(1_000), Duration::from_secs(1));
    claim.request = request.to_vec();
    claim.home_region = app.settings.engine.work.region.clone();
    let item = app.keys.store.claim(&claim).await.unwrap();
    StaleKey {
        key,
        fence: item.fence,
        home_region: item.home_region,
        lease_until: item.lease_until,
        created_at: item.created_at,
    }
}

#[tokio::test]
async fn a_request_that_does_not_decode_is_handed_back_at_once() {
    let app = spawn_app().await;
    let stale = stale_key(&app, b"not a payment").await;
    let engine = build_engine(&app.settings.engine).await.unwrap();

    let recovered = engine.recover(&stale, |_, request| PaymentOperation::from_canonical(request)).await;
    assert!(matches!(recovered, Err(EngineError::Fault(_) | EngineError::Broken(_))), "{recovered:?}");
    let item = app.keys.store.get(&stale.key).await.unwrap().unwrap();
    assert_eq!(item.fence, Fence::new(2), "it was taken over");
    assert_eq!(item.lease_until, Millis::new(0), "and handed back, not held for a lease");
}

#[tokio::test]
async fn a_ledger_out_of_reach_at_adoption_hands_the_key_back() {
    let app = spawn_app().await;
    let request = serde_json::to_vec(&crate::app::payment("E2E-ADOPT")).unwrap();
    let stale = stale_key(&app, &request).await;
    let (proxy, settings) = app.behind_a_proxied_ledger().await;
    let engine = build_engine(&settings.engine).await.unwrap();
    proxy.cut();

    let recovered = engine.recover(&stale, |_, request| PaymentOperation::from_canonical(request)).await;
    assert!(matches!(recovered, Err(EngineError::Transient(_))), "{recovered:?}");
    let item = app.keys.store.get(&stale.key).await.unwrap().unwrap();
    assert_eq!(item.fence, Fence::new(2));
    assert_eq!(item.lease_until, Millis::new(0), "handed back for the next actor");
}

/// A request refused by its check goes on only through the item its read
/// found. If that key was forgotten meanwhile and claimed by another
/// request of the client, at the same fence, the takeover lands on that
/// other request: it is handed straight back, never worked with this
/// request's body under the other's payment id.
#[tokio::test]
async fn a_takeover_that_lands_on_another_request_hands_it_back() {
    let app = spawn_app().await;
    let engine = build_engine(&app.settings.engine).await.unwrap();
    let region = app.settings.engine.work.region.clone();
    let key = fresh_key();
    let body = crate::app::payment("E2E-READ");
    let request = serde_json::to_vec(&body).unwrap();
    let hash = RequestHash::of("POST", "/v1/payments", &request);
    // What the read found: this request's claim, whose owner died.
    let mut first = claim_of(&key, Millis::new(1_000), Duration::from_secs(1));
    (first.request_hash, first.request, first.home_region) = (hash.clone(), request.clone(), region.clone());
    let read = app.keys.store.claim(&first).await.unwrap();
    // Given up before anything committed (forgotten), then claimed by another request.
    app.keys.store.release(&key, &read.holder(), Release::Forget).await.unwrap();
    let mut second = claim_of(&key, Millis::new(2_000), Duration::from_secs(1));
    second.home_region = region;
    app.keys.store.claim(&second).await.unwrap();

    let operation = PaymentOperation::new(PaymentRequest::parse(body).unwrap());
    let submission = Submission { key: key.clone(), request_hash: hash, canonical: request, operation };
    let answer = engine.submit_to_existing(submission, &read).await.unwrap();
    assert!(matches!(answer, Answer::InFlight { .. }), "{answer:?}");
    let item = app.keys.store.get(&key).await.unwrap().unwrap();
    assert_eq!(item.request_hash, second.request_hash, "still the other request");
    assert_eq!(item.lease_until, Millis::new(0), "handed back for its own retries");
    assert!(app.e2.statement().await.is_empty(), "nothing sent");
    assert_eq!(app.count("payments").await, 0, "nothing written");
}

#[tokio::test]
async fn serve_refuses_a_lease_shorter_than_three_rail_calls() {
    let app = spawn_app().await;
    let refused = keyfence_command(&app, "serve")
        .env("KEYFENCE_LEASE_MS", "1000")
        .env("KEYFENCE_RAIL_TIMEOUT_MS", "2000")
        .stderr(Stdio::piped())
        .output()
        .await
        .unwrap();
    assert_eq!(refused.status.code(), Some(2));
    let said = String::from_utf8_lossy(&refused.stderr);
    assert!(said.contains("more than a third of KEYFENCE_LEASE_MS=1000"), "{said}");
    assert!(said.contains("raise the lease to at least"), "says what to do: {said}");
}
