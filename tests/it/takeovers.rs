//! A takeover that cannot go on gives the key back at once, instead of
//! sitting on it for a whole lease: the stored request does not decode, or
//! the ledger cannot be reached to adopt it. And `serve` refuses settings
//! under which a lease could run out while a rail call is in flight.

use std::process::Stdio;
use std::time::Duration;

use keyfence::domain::{Fence, Millis};
use keyfence::engine::EngineError;
use keyfence::keystore::{KeyStore, StaleKey};
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
