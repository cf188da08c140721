//! Model-based test of the key-store protocol: random sequences of claims,
//! takeovers, heartbeats, finishes, releases, reads and clock jumps, over a
//! few owners and keys, run against `DynamoKeyStore` on the emulator and
//! against the in-memory reference model. After every step the two must
//! give the same answer, and the history must respect the protocol:
//! - only the owner of the newest grant (claim or takeover) ever writes;
//! - a finished key's answer never changes and never disappears.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use keyfence::domain::{Fence, Millis, Owner, RequestHash, ScopedKey, StoredResponse};
use keyfence::keystore::{
    Claim, DynamoKeyStore, Finish, Holder, KeyItem, KeyState, KeyStore, KeyStoreError, Lease, MemoryKeyStore, Release,
};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use uuid::Uuid;

use crate::harness::{TestKeys, fresh_key};

const OWNERS: usize = 3;
const KEYS: usize = 2;
const LEASE: Duration = Duration::from_millis(1000);

#[derive(Clone, Debug)]
enum Op {
    Claim { owner: usize, key: usize },
    TakeOver { owner: usize, key: usize },
    Heartbeat { owner: usize, key: usize },
    Finish { owner: usize, key: usize, body: u8 },
    Release { owner: usize, key: usize, forget: bool },
    Get { key: usize },
    Advance { ms: u64 },
}

fn op() -> impl Strategy<Value = Op> {
    let who = (0..OWNERS, 0..KEYS);
    prop_oneof![
        3 => who.clone().prop_map(|(owner, key)| Op::Claim { owner, key }),
        3 => who.clone().prop_map(|(owner, key)| Op::TakeOver { owner, key }),
        2 => who.clone().prop_map(|(owner, key)| Op::Heartbeat { owner, key }),
        2 => (who.clone(), any::<u8>()).prop_map(|((owner, key), body)| Op::Finish { owner, key, body }),
        2 => (who, any::<bool>()).prop_map(|((owner, key), forget)| Op::Release { owner, key, forget }),
        1 => (0..KEYS).prop_map(|key| Op::Get { key }),
        3 => (0..2500_u64).prop_map(|ms| Op::Advance { ms }),
    ]
}

/// One step's answer, in a form both stores can be compared on.
#[derive(Debug, PartialEq)]
enum Outcome {
    Item(KeyItem),
    Read(Option<KeyItem>),
    Until(Millis),
    Released,
    Taken(Option<KeyItem>),
    FencedOut(Option<KeyItem>),
}

fn outcome<T>(result: Result<T, KeyStoreError>, ok: impl FnOnce(T) -> Outcome) -> Outcome {
    match result {
        Ok(value) => ok(value),
        Err(KeyStoreError::Taken(item)) => Outcome::Taken(item.map(|b| *b)),
        Err(KeyStoreError::FencedOut(item)) => Outcome::FencedOut(item.map(|b| *b)),
        Err(other) => panic!("the store failed instead of answering: {other}"),
    }
}

/// What the test knows about the history so far.
struct World {
    keys: Vec<ScopedKey>,
    owners: Vec<Owner>,
    payment_ids: Vec<Uuid>,
    now: Millis,
    /// The fence each owner believes it holds, per key.
    held: HashMap<(usize, usize), Fence>,
    /// The newest fence each owner has seen, per key.
    seen: HashMap<(usize, usize), Fence>,
    /// The newest grant per key: the only (fence, owner) allowed to write.
    grant: HashMap<usize, (Fence, usize)>,
    finished: HashMap<usize, StoredResponse>,
}

impl World {
    fn new() -> Self {
        Self {
            keys: (0..KEYS).map(|_| fresh_key()).collect(),
            owners: (0..OWNERS).map(|i| Owner::attempt_of(&format!("owner-{i}"))).collect(),
            payment_ids: (0..KEYS).map(|_| Uuid::now_v7()).collect(),
            now: Millis::new(1_000_000),
            held: HashMap::new(),
            seen: HashMap::new(),
            grant: HashMap::new(),
            finished: HashMap::new(),
        }
    }

    fn lease(&self) -> Lease {
        Lease { now: self.now, length: LEASE }
    }

    fn claim(&self, owner: usize, key: usize) -> Claim {
        Claim {
            key: self.keys[key].clone(),
            request_hash: RequestHash::from_hex(format!("{key:064x}")),
            request: format!("request-{key}").into_bytes(),
            operation: "payment".into(),
            payment_id: self.payment_ids[key],
            owner: self.owners[owner].clone(),
            home_region: "eu-west-1".into(),
            lease: self.lease(),
            gone_before: self.now,
        }
    }

    /// An owner that never held the key writes with fence 0, which no item has.
    fn fence_of(&self, owner: usize, key: usize) -> Fence {
        self.held.get(&(owner, key)).copied().unwrap_or(Fence::new(0))
    }

    /// The fence and identity `owner` writes `key` under.
    fn holder(&self, owner: usize, key: usize) -> Holder {
        Holder { fence: self.fence_of(owner, key), owner: self.owners[owner].clone() }
    }

    fn finish(&self, body: u8) -> Finish {
        Finish {
            response: StoredResponse {
                status: 201,
                headers: BTreeMap::from([("content-type".into(), "application/json".into())]),
                body: vec![body; 3],
            },
            expires_at: self.now.plus(Duration::from_secs(3600)),
        }
    }

    fn assert_may_write(&self, owner: usize, key: usize, fence: Fence, what: &str) {
        assert_eq!(
            self.grant.get(&key),
            Some(&(fence, owner)),
            "{what} by owner {owner} with fence {fence} succeeded, but it does not hold the newest grant"
        );
    }

    fn check_read(&self, key: usize, item: &Option<KeyItem>) {
        if let Some(answer) = self.finished.get(&key) {
            let item = item.as_ref().expect("a finished key disappeared");
            assert_eq!(item.state, KeyState::Finished, "a finished key went back in flight");
            assert_eq!(item.response.as_ref(), Some(answer), "a finished answer changed");
        }
    }

    /// Learns from an agreed outcome and checks the protocol's invariants.
    fn observe(&mut self, op: &Op, outcome: &Outcome) {
        match (op, outcome) {
            (Op::Claim { owner, key } | Op::TakeOver { owner, key }, Outcome::Item(item)) => {
                assert_eq!(item.owner, self.owners[*owner]);
                self.grant.insert(*key, (item.fence, *owner));
                self.held.insert((*owner, *key), item.fence);
                self.seen.insert((*owner, *key), item.fence);
            }
            (Op::Claim { owner, key } | Op::TakeOver { owner, key }, Outcome::Taken(Some(item))) => {
                self.seen.insert((*owner, *key), item.fence);
                self.check_read(*key, &Some(item.clone()));
            }
            (Op::Heartbeat { owner, key }, Outcome::Until(_)) => {
                self.assert_may_write(*owner, *key, self.fence_of(*owner, *key), "heartbeat");
            }
            (Op::Finish { owner, key, .. }, Outcome::Item(item)) => {
                self.assert_may_write(*owner, *key, self.fence_of(*owner, *key), "finish");
                let answer = item.response.clone().expect("a finished item has an answer");
                if let Some(earlier) = self.finished.get(key) {
                    assert_eq!(&answer, earlier, "finishing again changed the answer");
                }
                self.finished.insert(*key, answer);
            }
            (Op::Release { owner, key, forget }, Outcome::Released) => {
                let fence = self.fence_of(*owner, *key);
                if self.grant.contains_key(key) {
                    self.assert_may_write(*owner, *key, fence, "release");
                }
                if *forget && fence == Fence::FIRST {
                    self.grant.remove(key);
                }
                // An owner that gave the key back stops using its fence.
                self.held.remove(&(*owner, *key));
            }
            (Op::Get { key }, Outcome::Read(item)) => self.check_read(*key, item),
            (Op::Advance { .. }, Outcome::Released) => {}
            (_, Outcome::Taken(_) | Outcome::FencedOut(_)) => {}
            (op, outcome) => panic!("{op:?} gave an impossible outcome {outcome:?}"),
        }
    }
}

async fn step<S: KeyStore>(store: &S, world: &World, op: &Op) -> Outcome {
    match *op {
        Op::Claim { owner, key } => outcome(store.claim(&world.claim(owner, key)).await, Outcome::Item),
        Op::TakeOver { owner, key } => {
            let seen = world.seen.get(&(owner, key)).copied().unwrap_or(Fence::FIRST);
            let result = store.take_over(&world.keys[key], seen, &world.owners[owner], world.lease()).await;
            outcome(result, Outcome::Item)
        }
        Op::Heartbeat { owner, key } => {
            let result = store.heartbeat(&world.keys[key], &world.holder(owner, key), world.lease()).await;
            outcome(result, Outcome::Until)
        }
        Op::Finish { owner, key, body } => {
            let result = store.finish(&world.keys[key], &world.holder(owner, key), &world.finish(body)).await;
            outcome(result, Outcome::Item)
        }
        Op::Release { owner, key, forget } => {
            let how = if forget { Release::Forget } else { Release::Reopen };
            let result = store.release(&world.keys[key], &world.holder(owner, key), how).await;
            outcome(result, |()| Outcome::Released)
        }
        Op::Get { key } => outcome(store.get(&world.keys[key]).await, Outcome::Read),
        Op::Advance { .. } => Outcome::Released,
    }
}

async fn run_case(dynamo: &DynamoKeyStore, ops: &[Op]) {
    let model = MemoryKeyStore::new();
    let mut world = World::new();
    for (i, op) in ops.iter().enumerate() {
        if let Op::Advance { ms } = op {
            world.now = world.now.plus(Duration::from_millis(*ms));
        }
        let expected = step(&model, &world, op).await;
        let actual = step(dynamo, &world, op).await;
        assert_eq!(actual, expected, "step {i} ({op:?}): DynamoDB and the model disagree");
        world.observe(op, &actual);
    }
    for key in 0..KEYS {
        let expected = model.get(&world.keys[key]).await.unwrap();
        let actual = dynamo.get(&world.keys[key]).await.unwrap();
        assert_eq!(actual, expected, "final state of key {key} differs");
        world.check_read(key, &actual);
    }
}

#[test]
fn dynamo_key_store_follows_the_model_and_admits_one_writer() {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let keys = runtime.block_on(TestKeys::new());
    let mut runner = TestRunner::new(Config { cases: 96, failure_persistence: None, ..Config::default() });
    let result = runner.run(&proptest::collection::vec(op(), 1..40), |ops| {
        runtime.block_on(run_case(&keys.store, &ops));
        Ok(())
    });
    if let Err(failure) = result {
        panic!("{failure}");
    }
}
