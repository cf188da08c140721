//! The fence at work on single items: leases, takeovers, and every write of
//! a superseded owner refused without changing the item.

use std::collections::BTreeMap;
use std::time::Duration;

use keyfence::domain::StoredResponse;
use keyfence::domain::{Fence, Millis, Owner};
use keyfence::keystore::{Finish, KeyState, KeyStore, KeyStoreError, Lease, Release};

use crate::harness::{TestKeys, claim_of, fresh_key};

const LEASE: Duration = Duration::from_secs(10);

pub(crate) fn answer(body: &str) -> Finish {
    Finish {
        response: StoredResponse {
            status: 201,
            headers: BTreeMap::from([("content-type".into(), "application/json".into())]),
            body: body.as_bytes().to_vec(),
        },
        expires_at: Millis::now().plus(Duration::from_secs(86_400)),
    }
}

#[tokio::test]
async fn a_fresh_lease_cannot_be_taken_over_and_an_expired_one_can() {
    let keys = TestKeys::new().await;
    let key = fresh_key();
    let t0 = Millis::now();
    let first = keys.store.claim(&claim_of(&key, t0, LEASE)).await.unwrap();
    let rival = Owner::attempt_of("rival");

    let early = Lease { now: t0.plus(LEASE / 2), length: LEASE };
    match keys.store.take_over(&key, first.fence, &rival, early).await {
        Err(KeyStoreError::Taken(Some(item))) => assert_eq!(*item, first),
        other => panic!("a fresh lease was taken over: {other:?}"),
    }
    let at_expiry = Lease { now: first.lease_until, length: LEASE };
    assert!(
        matches!(keys.store.take_over(&key, first.fence, &rival, at_expiry).await, Err(KeyStoreError::Taken(_))),
        "the lease still holds at its last millisecond"
    );

    let late = Lease { now: first.lease_until.plus(Duration::from_millis(1)), length: LEASE };
    let taken = keys.store.take_over(&key, first.fence, &rival, late).await.unwrap();
    assert_eq!(taken.fence, Fence::new(2));
    assert_eq!(taken.owner, rival);
    assert_eq!(taken.payment_id, first.payment_id, "a takeover keeps the payment");
    assert_eq!(taken.created_at, first.created_at);

    let stale_seen = Lease { now: taken.lease_until.plus(Duration::from_millis(1)), length: LEASE };
    assert!(
        matches!(keys.store.take_over(&key, first.fence, &Owner::attempt_of("third"), stale_seen).await,
                 Err(KeyStoreError::Taken(Some(item))) if item.fence == Fence::new(2)),
        "a takeover based on an old fence must lose"
    );
}

#[tokio::test]
async fn after_a_takeover_the_old_owner_is_fenced_out_of_everything() {
    let keys = TestKeys::new().await;
    let key = fresh_key();
    let t0 = Millis::now();
    let old = keys.store.claim(&claim_of(&key, t0, LEASE)).await.unwrap();
    let late = Lease { now: old.lease_until.plus(Duration::from_millis(1)), length: LEASE };
    let new = keys.store.take_over(&key, old.fence, &Owner::attempt_of("new"), late).await.unwrap();

    let fenced = |r: Result<(), KeyStoreError>, what: &str| match r {
        Err(KeyStoreError::FencedOut(Some(item))) => assert_eq!(*item, new, "{what}: the loser sees the new item"),
        other => panic!("{what} by the old owner was not fenced out: {other:?}"),
    };
    fenced(keys.store.heartbeat(&key, &old.holder(), late).await.map(|_| ()), "heartbeat");
    fenced(keys.store.finish(&key, &old.holder(), &answer("{\"by\":\"old\"}")).await.map(|_| ()), "finish");
    fenced(keys.store.release(&key, &old.holder(), Release::Reopen).await, "release (reopen)");
    fenced(keys.store.release(&key, &old.holder(), Release::Forget).await, "release (forget)");

    assert_eq!(keys.store.get(&key).await.unwrap().as_ref(), Some(&new), "the item is unchanged");

    // The new owner still works normally.
    let until = keys.store.heartbeat(&key, &new.holder(), Lease { now: late.now, length: LEASE * 2 }).await.unwrap();
    assert_eq!(until, late.now.plus(LEASE * 2));
    let done = keys.store.finish(&key, &new.holder(), &answer("{\"by\":\"new\"}")).await.unwrap();
    assert_eq!(done.state, KeyState::Finished);
    assert_eq!(done.response.unwrap().body, b"{\"by\":\"new\"}");
}

#[tokio::test]
async fn a_finished_item_keeps_its_answer_and_refuses_more_writes() {
    let keys = TestKeys::new().await;
    let key = fresh_key();
    let t0 = Millis::now();
    let claim = claim_of(&key, t0, LEASE);
    let item = keys.store.claim(&claim).await.unwrap();
    let finish = answer("{\"id\":\"p-1\",\"status\":\"succeeded\"}");
    let done = keys.store.finish(&key, &item.holder(), &finish).await.unwrap();
    assert_eq!(done.response.as_ref(), Some(&finish.response));
    assert_eq!(done.expires_at, Some(finish.expires_at.as_secs()));
    assert_eq!(done.request, claim.request, "the original request stays recoverable");

    // The same owner finishing again (a retried request) sees its own answer.
    assert_eq!(keys.store.finish(&key, &item.holder(), &answer("other")).await.unwrap(), done);
    // A later claim loses and is shown the stored answer in the same round trip.
    match keys.store.claim(&claim_of(&key, t0, LEASE)).await {
        Err(KeyStoreError::Taken(Some(existing))) => assert_eq!(*existing, done),
        other => panic!("claiming a finished key: {other:?}"),
    }
    let much_later = Lease { now: t0.plus(LEASE * 100), length: LEASE };
    assert!(matches!(
        keys.store.take_over(&key, item.fence, &Owner::attempt_of("late"), much_later).await,
        Err(KeyStoreError::Taken(_))
    ));
    assert!(matches!(keys.store.heartbeat(&key, &item.holder(), much_later).await, Err(KeyStoreError::FencedOut(_))));
    assert!(matches!(
        keys.store.release(&key, &item.holder(), Release::Forget).await,
        Err(KeyStoreError::FencedOut(_))
    ));
    assert_eq!(keys.store.get(&key).await.unwrap(), Some(done));
}

#[tokio::test]
async fn release_forgets_a_first_claim_and_reopens_a_taken_over_one() {
    let keys = TestKeys::new().await;
    let t0 = Millis::now();

    let key = fresh_key();
    let item = keys.store.claim(&claim_of(&key, t0, LEASE)).await.unwrap();
    keys.store.release(&key, &item.holder(), Release::Forget).await.unwrap();
    assert_eq!(keys.store.get(&key).await.unwrap(), None);
    let again = keys.store.claim(&claim_of(&key, t0, LEASE)).await.unwrap();
    assert_eq!(again.fence, Fence::FIRST, "a forgotten key can be claimed afresh");

    let key = fresh_key();
    let item = keys.store.claim(&claim_of(&key, t0, LEASE)).await.unwrap();
    let late = Lease { now: item.lease_until.plus(Duration::from_millis(1)), length: LEASE };
    let taken = keys.store.take_over(&key, item.fence, &Owner::attempt_of("b"), late).await.unwrap();
    keys.store.release(&key, &taken.holder(), Release::Forget).await.unwrap();
    let kept = keys.store.get(&key).await.unwrap().expect("a taken-over key is never deleted");
    assert_eq!(kept.fence, taken.fence);
    assert_eq!(kept.lease_until, Millis::new(0), "reopened: the lease is over");
    let resumed =
        keys.store.take_over(&key, taken.fence, &Owner::attempt_of("c"), Lease { now: t0, length: LEASE }).await;
    assert_eq!(resumed.unwrap().fence, Fence::new(3), "the next actor takes over at once");
}

#[tokio::test]
async fn a_retried_claim_recognises_its_own_success() {
    let keys = TestKeys::new().await;
    let key = fresh_key();
    let claim = claim_of(&key, Millis::now(), LEASE);
    let first = keys.store.claim(&claim).await.unwrap();
    assert_eq!(keys.store.claim(&claim).await.unwrap(), first);
}
