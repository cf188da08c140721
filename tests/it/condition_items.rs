//! A key store that refuses a conditional write without the item it failed
//! on. DynamoDB sends that item back (`ReturnValuesOnConditionCheckFailure`);
//! dynalite does not. keyfence then reads the item itself, consistently,
//! and every answer stays what it is against DynamoDB: a lost claim still
//! shows the stored answer, a retried write still recognises its own
//! success, a superseded owner still sees who superseded it. The bundled
//! emulator's `omit_item` fault makes it answer as dynalite does, for this
//! test's table only.

use std::time::Duration;

use keyfence::domain::{Fence, Millis, Owner};
use keyfence::keystore::{KeyState, KeyStore, KeyStoreError, Lease, Release};
use reqwest::StatusCode;
use serde_json::json;

use crate::app::{payment, spawn_app, start_instance};
use crate::harness::{TestKeys, claim_of, fresh_key};
use crate::keystore_fencing::answer;

const LEASE: Duration = Duration::from_secs(10);

/// Every conditional write on the table is refused without its item.
async fn omit_items(keys: &TestKeys) {
    for operation in ["PutItem", "UpdateItem", "DeleteItem"] {
        keys.arm(json!({ "operation": operation, "count": 100_000, "action": "omit_item" })).await;
    }
}

#[tokio::test]
async fn every_refused_write_still_sees_the_item_it_failed_on() {
    let keys = TestKeys::new().await;
    omit_items(&keys).await;
    let key = fresh_key();
    let t0 = Millis::now();
    let claim = claim_of(&key, t0, LEASE);
    let first = keys.store.claim(&claim).await.unwrap();

    // A retried claim whose first delivery landed is our own success.
    assert_eq!(keys.store.claim(&claim).await.unwrap(), first, "a retried claim");
    // Another attempt loses and is shown the item.
    let rival = claim_of(&key, t0, LEASE);
    match keys.store.claim(&rival).await {
        Err(KeyStoreError::Taken(Some(existing))) => assert_eq!(*existing, first),
        other => panic!("a lost claim: {other:?}"),
    }
    // A takeover of a fresh lease loses and is shown the owner.
    match keys.store.take_over(&key, first.fence, &Owner::attempt_of("early"), Lease { now: t0, length: LEASE }).await {
        Err(KeyStoreError::Taken(Some(existing))) => assert_eq!(*existing, first),
        other => panic!("taking over a fresh lease: {other:?}"),
    }

    // After a takeover the old owner is fenced out and told by whom.
    let late = Lease { now: first.lease_until.plus(Duration::from_millis(1)), length: LEASE };
    let taker = Owner::attempt_of("new");
    let new = keys.store.take_over(&key, first.fence, &taker, late).await.unwrap();
    assert_eq!(
        keys.store.take_over(&key, first.fence, &taker, late).await.unwrap(),
        new,
        "a retried takeover recognises itself"
    );
    let fenced = |r: Result<(), KeyStoreError>, what: &str| match r {
        Err(KeyStoreError::FencedOut(Some(item))) => assert_eq!(*item, new, "{what}: the loser sees the new item"),
        other => panic!("{what} by the old owner: {other:?}"),
    };
    fenced(keys.store.heartbeat(&key, &first.holder(), late).await.map(|_| ()), "heartbeat");
    fenced(keys.store.finish(&key, &first.holder(), &answer("{\"by\":\"old\"}")).await.map(|_| ()), "finish");
    fenced(keys.store.release(&key, &first.holder(), Release::Forget).await, "forget");

    // The new owner finishes; a retried finish is its own, a later claim
    // is shown the answer, and a restore finds the key there.
    let done = keys.store.finish(&key, &new.holder(), &answer("{\"by\":\"new\"}")).await.unwrap();
    assert_eq!(keys.store.finish(&key, &new.holder(), &answer("other")).await.unwrap(), done, "a retried finish");
    match keys.store.claim(&claim_of(&key, t0, LEASE)).await {
        Err(KeyStoreError::Taken(Some(existing))) => {
            assert_eq!(existing.state, KeyState::Finished);
            assert_eq!(existing.response.as_ref().map(|r| r.body.as_slice()), Some(&b"{\"by\":\"new\"}"[..]));
        }
        other => panic!("claiming a finished key: {other:?}"),
    }
    match keys.store.restore(&done).await {
        Err(KeyStoreError::Taken(Some(existing))) => assert_eq!(*existing, done),
        other => panic!("restoring a key that is there: {other:?}"),
    }
    assert_eq!(done.fence, Fence::new(2));
}

#[tokio::test]
async fn the_answer_matrix_holds_when_refusals_carry_no_item() {
    let app = spawn_app().await;
    omit_items(&app.keys).await;
    let body = payment("E2E-OMIT-ITEM");

    let first = app.pay("omit-item-1", &body).await;
    assert_eq!(first.status(), StatusCode::CREATED);
    let first = first.bytes().await.unwrap();
    // A fresh instance has no answer in memory: its claim loses, and the
    // item it lost to holds the answer.
    let (fresh, _stop) = start_instance(&app.settings).await;
    let replay = app.try_pay_at(&fresh, &app.api_key, "omit-item-1", &body).await.unwrap();
    assert_eq!(replay.status(), StatusCode::CREATED, "a replay is the stored answer, not 'in flight'");
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    assert_eq!(replay.bytes().await.unwrap(), first, "byte for byte");
    let (other, _stop) = start_instance(&app.settings).await;
    let reused = app.try_pay_at(&other, &app.api_key, "omit-item-1", &payment("E2E-OMIT-OTHER")).await.unwrap();
    assert_eq!(reused.status(), StatusCode::UNPROCESSABLE_ENTITY, "the key reused with another body");
    assert_eq!(app.count("payments").await, 1, "paid once");
    assert_eq!(app.e2.statement().await.len(), 1, "one instruction at the rail");
}
