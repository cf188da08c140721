//! Many racers, one key: exactly one claim and exactly one takeover win per
//! round, and every loser learns the winner's item from its failed write.

use std::time::Duration;

use futures::future::join_all;
use keyfence::domain::{Fence, Millis, Owner};
use keyfence::keystore::{KeyItem, KeyState, KeyStore, KeyStoreError, Lease};

use crate::harness::{TestKeys, claim_of, fresh_key};

const RACERS: usize = 200;
const ROUNDS: usize = 30;
const LEASE: Duration = Duration::from_secs(30);

/// Splits racers' results into winners and the items the losers were shown.
fn tally(results: Vec<Result<KeyItem, KeyStoreError>>) -> (Vec<KeyItem>, Vec<KeyItem>) {
    let mut winners = Vec::new();
    let mut shown = Vec::new();
    for result in results {
        match result {
            Ok(item) => winners.push(item),
            Err(KeyStoreError::Taken(Some(item))) => shown.push(*item),
            Err(other) => panic!("a racer failed instead of winning or losing: {other}"),
        }
    }
    (winners, shown)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_claims_of_one_key_have_exactly_one_winner() {
    let keys = TestKeys::new().await;
    for round in 0..ROUNDS {
        let key = fresh_key();
        let now = Millis::now();
        let claims: Vec<_> = (0..RACERS).map(|_| claim_of(&key, now, LEASE)).collect();
        let results = join_all(claims.iter().map(|c| keys.store.claim(c))).await;
        let (winners, shown) = tally(results);

        assert_eq!(winners.len(), 1, "round {round}: {} claims won", winners.len());
        let winner = &winners[0];
        assert_eq!(winner.fence, Fence::FIRST);
        assert_eq!(shown.len(), RACERS - 1);
        for item in &shown {
            assert_eq!(item, winner, "round {round}: a loser was shown another item than the winner's");
        }
        let stored = keys.store.get(&key).await.unwrap().expect("the claimed item");
        assert_eq!(&stored, winner);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_takeovers_of_one_stale_item_have_exactly_one_winner() {
    let keys = TestKeys::new().await;
    for round in 0..ROUNDS {
        let key = fresh_key();
        let start = Millis::now();
        let first = keys.store.claim(&claim_of(&key, start, Duration::from_millis(10))).await.unwrap();
        let later = Lease { now: start.plus(Duration::from_secs(1)), length: LEASE };

        let owners: Vec<_> = (0..RACERS).map(|i| Owner::attempt_of(&format!("racer-{i}"))).collect();
        let results = join_all(owners.iter().map(|o| keys.store.take_over(&key, first.fence, o, later))).await;
        let (winners, shown) = tally(results);

        assert_eq!(winners.len(), 1, "round {round}: {} takeovers won", winners.len());
        let winner = &winners[0];
        assert_eq!(winner.fence, first.fence.next(), "the fence grows by exactly one");
        assert_eq!(winner.state, KeyState::Started);
        assert_eq!(winner.lease_until, later.until());
        assert_ne!(winner.owner, first.owner);
        for item in &shown {
            assert_eq!(item, winner, "round {round}: a loser was shown another item than the winner's");
        }
        let stored = keys.store.get(&key).await.unwrap().expect("the item");
        assert_eq!(&stored, winner);
    }
}
