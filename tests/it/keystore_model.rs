//! Model-based test of the key-store protocol: random sequences of claims,
//! takeovers, failovers between two regions, heartbeats, finishes,
//! releases, reads, deletions past retention, restores of a lost item,
//! sweeps of stale keys, hand-offs, and holds, freezes and conclusions on a
//! balance, with clock jumps, over a few owners and keys, run against
//! `DynamoKeyStore` on the emulator (either engine) and against the
//! in-memory reference model. After every step the two must give the same
//! answer, and the history must respect the protocol:
//! - only the owner of the newest grant (claim, takeover or failover) ever
//!   writes;
//! - a finished key's answer never changes, and disappears only once past
//!   its retention;
//! - a failover never moves a request back to a region it left;
//! - the holds on the balance never exceed its total, and a frozen balance
//!   takes only lasting holds.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use keyfence::domain::{Fence, Millis, Owner, RequestHash, ScopedKey, StoredResponse};
use keyfence::keystore::{
    Balance, Claim, Concluded, Conclusion, DynamoKeyStore, Finish, Frozen, Handoff, HeldBy, Hold, HoldState, Holder,
    Holding, INFLIGHT_SHARDS, KeyItem, KeyState, KeyStore, KeyStoreError, Lease, MemoryKeyStore, Release,
};
use proptest::prelude::*;
use uuid::Uuid;

use crate::harness::{TestKeys, fresh_key};

const OWNERS: usize = 3;
const KEYS: usize = 2;
const LEASE: Duration = Duration::from_millis(1000);
/// How long a finished answer is kept: clock jumps carry keys past it.
const RETENTION: Duration = Duration::from_secs(5);
const REGIONS: [&str; 2] = ["eu-west-1", "eu-central-1"];
/// Requests drawing on the one balance, and what it allows.
const HOLDERS: usize = 3;
const TOTAL: i64 = 100;

#[derive(Clone, Debug)]
enum Op {
    Claim {
        owner: usize,
        key: usize,
    },
    TakeOver {
        owner: usize,
        key: usize,
    },
    Heartbeat {
        owner: usize,
        key: usize,
    },
    Finish {
        owner: usize,
        key: usize,
        body: u8,
    },
    Release {
        owner: usize,
        key: usize,
        forget: bool,
    },
    Get {
        key: usize,
    },
    Advance {
        ms: u64,
    },
    /// Moves the key from the region it is homed in to the other one.
    FailOver {
        owner: usize,
        key: usize,
    },
    DeleteExpired {
        key: usize,
    },
    /// Puts back the item last read of the key, as the reconciler does.
    Restore {
        key: usize,
    },
    StaleInFlight,
    /// Records (or forgets, or asks for) the hand-off of the key's request
    /// from the region it was homed in first.
    HandOff {
        key: usize,
    },
    ForgetHandoff {
        key: usize,
    },
    HandoffOf {
        key: usize,
    },
    HoldOn {
        holder: usize,
        amount: i64,
        lasting: bool,
    },
    Freeze,
    Conclude {
        holder: usize,
        how: u8,
    },
    ReadBalance,
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
        2 => (0..OWNERS, 0..KEYS).prop_map(|(owner, key)| Op::FailOver { owner, key }),
        1 => (0..KEYS).prop_map(|key| Op::DeleteExpired { key }),
        1 => (0..KEYS).prop_map(|key| Op::Restore { key }),
        1 => Just(Op::StaleInFlight),
        1 => (0..KEYS).prop_map(|key| Op::HandOff { key }),
        1 => (0..KEYS).prop_map(|key| Op::ForgetHandoff { key }),
        1 => (0..KEYS).prop_map(|key| Op::HandoffOf { key }),
        2 => (0..HOLDERS, 1..60_i64, any::<bool>())
            .prop_map(|(holder, amount, lasting)| Op::HoldOn { holder, amount, lasting }),
        1 => Just(Op::Freeze),
        2 => (0..HOLDERS, 0..3_u8).prop_map(|(holder, how)| Op::Conclude { holder, how }),
        1 => Just(Op::ReadBalance),
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
    Deleted(bool),
    /// The stale keys of this test, by key index, with their fences.
    Stale(Vec<(usize, Fence)>),
    Handed(bool),
    Holding(Holding),
    Concluded(Concluded),
    Balance(Option<Balance>),
    /// A conclusion the store refuses (see `KeyStore::conclude_hold`).
    Refused,
}

fn outcome<T>(result: Result<T, KeyStoreError>, ok: impl FnOnce(T) -> Outcome) -> Outcome {
    match result {
        Ok(value) => ok(value),
        Err(KeyStoreError::Taken(item)) => Outcome::Taken(item.map(|b| *b)),
        Err(KeyStoreError::FencedOut(item)) => Outcome::FencedOut(item.map(|b| *b)),
        Err(KeyStoreError::Fault(_)) => Outcome::Refused,
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
    /// The last item read of each key (what a restore puts back).
    last: HashMap<usize, KeyItem>,
    /// The balance the holders draw on, and their ids.
    balance: String,
    holders: Vec<Uuid>,
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
            last: HashMap::new(),
            balance: format!("refundable#payment#{}", Uuid::now_v7()),
            holders: (0..HOLDERS).map(|_| Uuid::now_v7()).collect(),
        }
    }

    fn held_by(&self, holder: usize) -> HeldBy {
        HeldBy {
            id: self.holders[holder],
            key: self.keys[0].clone(),
            created_at: Millis::new(1),
            region: REGIONS[0].into(),
        }
    }

    /// The region the key's item names, as last read (its first home if never read).
    fn home_of(&self, key: usize) -> &str {
        self.last.get(&key).map_or(REGIONS[0], |item| item.home_region.as_str())
    }

    fn handoff(&self, key: usize) -> Handoff {
        Handoff {
            from: REGIONS[0].into(),
            to: REGIONS[1].into(),
            key: self.keys[key].clone(),
            created_at: Millis::new(7),
            payment_id: self.payment_ids[key],
            fence: Fence::new(2),
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
            home_region: REGIONS[0].into(),
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
            expires_at: self.now.plus(RETENTION),
        }
    }

    /// Learns of a grant (a claim, takeover or failover `op` won).
    fn grant_to(&mut self, op: &Op, item: &KeyItem) {
        let (Op::Claim { owner, key } | Op::TakeOver { owner, key } | Op::FailOver { owner, key }) = *op else {
            unreachable!("only claims, takeovers and failovers grant")
        };
        assert_eq!(item.owner, self.owners[owner]);
        if matches!(op, Op::Claim { .. }) {
            // A claim that wins makes a new request (over an expired one, too).
            self.finished.remove(&key);
        }
        self.grant.insert(key, (item.fence, owner));
        self.held.insert((owner, key), item.fence);
        self.seen.insert((owner, key), item.fence);
    }

    /// The balance counts exactly its holds, never more than it allows.
    fn check_balance(&self, balance: Option<&Balance>) {
        let Some(balance) = balance else { return };
        let sum = |states: &[HoldState]| {
            balance.holds.iter().filter(|h| states.contains(&h.state)).map(|h| h.amount).sum::<i64>()
        };
        let (held, settled) = (sum(&[HoldState::Held, HoldState::Settled]), sum(&[HoldState::Settled]));
        assert_eq!(balance.reserved, held, "reserved is what is held and settled: {balance:?}");
        assert_eq!(balance.settled, settled, "settled is what was settled: {balance:?}");
        assert!(balance.reserved <= balance.total, "held past the total: {balance:?}");
    }

    fn assert_may_write(&self, owner: usize, key: usize, fence: Fence, what: &str) {
        assert_eq!(
            self.grant.get(&key),
            Some(&(fence, owner)),
            "{what} by owner {owner} with fence {fence} succeeded, but it does not hold the newest grant"
        );
    }

    fn check_read(&mut self, key: usize, item: &Option<KeyItem>) {
        if let Some(item) = item {
            self.last.insert(key, item.clone());
        }
        if let Some(answer) = self.finished.get(&key) {
            let item = item.as_ref().expect("a finished key disappeared");
            assert_eq!(item.state, KeyState::Finished, "a finished key went back in flight");
            assert_eq!(item.response.as_ref(), Some(answer), "a finished answer changed");
        }
    }

    /// Learns from an agreed outcome and checks the protocol's invariants.
    fn observe(&mut self, op: &Op, outcome: &Outcome) {
        match (op, outcome) {
            (Op::FailOver { key, .. }, Outcome::Item(item)) => {
                let from = self.home_of(*key).to_owned();
                assert!(!item.left.contains(&item.home_region), "failed over back to a region it left: {item:?}");
                assert!(item.left.contains(&from), "the region it left is not recorded: {item:?}");
                self.grant_to(op, item);
            }
            (Op::Claim { .. } | Op::TakeOver { .. }, Outcome::Item(item)) => self.grant_to(op, item),
            (
                Op::Claim { owner, key } | Op::TakeOver { owner, key } | Op::FailOver { owner, key },
                Outcome::Taken(Some(item)),
            ) => {
                self.seen.insert((*owner, *key), item.fence);
                self.check_read(*key, &Some(item.clone()));
            }
            (Op::DeleteExpired { key }, Outcome::Deleted(deleted)) => {
                if *deleted {
                    let item = self.last.get(key).expect("a deleted key was read before");
                    assert!(item.expired(self.now), "deleted before its retention: {item:?}");
                    self.finished.remove(key);
                    self.grant.remove(key);
                }
            }
            (Op::Restore { key }, Outcome::Released) => {
                let item = self.last.get(key).cloned().expect("restored what was read");
                if let Some(answer) = item.response.clone() {
                    self.finished.insert(*key, answer);
                }
            }
            (Op::Restore { .. }, Outcome::Taken(_)) => {}
            (Op::StaleInFlight, Outcome::Stale(stale)) => {
                for (key, fence) in stale {
                    assert!(!self.finished.contains_key(key), "a finished key listed as stale");
                    assert_eq!(self.grant.get(key).map(|(f, _)| *f), Some(*fence), "listed under an old fence");
                }
            }
            (Op::HandOff { .. } | Op::ForgetHandoff { .. }, Outcome::Released) => {}
            (Op::HandoffOf { .. }, Outcome::Handed(_)) => {}
            (Op::HoldOn { .. }, Outcome::Holding(_) | Outcome::Refused) => {}
            (Op::Freeze, Outcome::Released) => {}
            (Op::Conclude { .. }, Outcome::Concluded(_) | Outcome::Refused) => {}
            (Op::ReadBalance, Outcome::Balance(balance)) => self.check_balance(balance.as_ref()),
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
        Op::FailOver { owner, key } => {
            let seen = world.seen.get(&(owner, key)).copied().unwrap_or(Fence::FIRST);
            let from = world.home_of(key);
            let to = REGIONS.into_iter().find(|r| *r != from).expect("two regions");
            let result = store.fail_over(&world.keys[key], seen, &world.owners[owner], world.lease(), from, to).await;
            outcome(result, Outcome::Item)
        }
        Op::DeleteExpired { key } => outcome(store.delete_expired(&world.keys[key], world.now).await, Outcome::Deleted),
        Op::Restore { key } => match world.last.get(&key) {
            Some(item) => outcome(store.restore(item).await, |()| Outcome::Released),
            None => Outcome::Taken(None),
        },
        Op::StaleInFlight => {
            let mut stale = Vec::new();
            for shard in 0..INFLIGHT_SHARDS {
                for found in store.stale_in_flight(shard, world.now).await.unwrap() {
                    if let Some(key) = world.keys.iter().position(|k| *k == found.key) {
                        stale.push((key, found.fence));
                    }
                }
            }
            stale.sort();
            Outcome::Stale(stale)
        }
        Op::HandOff { key } => outcome(store.hand_off(&world.handoff(key)).await, |()| Outcome::Released),
        Op::ForgetHandoff { key } => outcome(store.forget_handoff(&world.handoff(key)).await, |()| Outcome::Released),
        Op::HandoffOf { key } => {
            let handoff = world.handoff(key);
            outcome(store.handoff_of(&handoff.from, &handoff.key, handoff.created_at).await, Outcome::Handed)
        }
        Op::HoldOn { holder, amount, lasting } => {
            let hold = Hold { balance: world.balance.clone(), total: TOTAL, amount, lasting };
            outcome(store.hold(&hold, &world.held_by(holder), world.now).await, Outcome::Holding)
        }
        Op::Freeze => {
            let frozen = Frozen { by: "a return".into(), at: world.now };
            outcome(store.freeze(&world.balance, TOTAL, &frozen).await, |()| Outcome::Released)
        }
        Op::Conclude { holder, how } => {
            let how = [Conclusion::Settle, Conclusion::Release, Conclusion::Undo][usize::from(how)];
            outcome(store.conclude_hold(&world.balance, world.holders[holder], how).await, Outcome::Concluded)
        }
        Op::ReadBalance => outcome(store.balance(&world.balance).await, |balance| Outcome::Balance(sorted(balance))),
    }
}

/// A balance with its holds in one order, to compare two stores' answers.
fn sorted(balance: Option<Balance>) -> Option<Balance> {
    balance.map(|mut balance| {
        balance.holds.sort_by_key(|hold| hold.by.id);
        balance
    })
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
        // What each key's item is now (a failover's `from`, a restore's item).
        for key in 0..KEYS {
            if let Some(item) = model.get(&world.keys[key]).await.unwrap() {
                world.last.insert(key, item);
            }
        }
    }
    for key in 0..KEYS {
        let expected = model.get(&world.keys[key]).await.unwrap();
        let actual = dynamo.get(&world.keys[key]).await.unwrap();
        assert_eq!(actual, expected, "final state of key {key} differs");
        world.check_read(key, &actual);
    }
    let (expected, actual) =
        (model.balance(&world.balance).await.unwrap(), dynamo.balance(&world.balance).await.unwrap());
    assert_eq!(sorted(actual), sorted(expected), "final balance differs");
}

/// Seeds kept as regression cases (see [`crate::seeds`]).
const KEPT: [u64; 0] = [];

#[test]
fn dynamo_key_store_follows_the_model_and_admits_one_writer() {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let keys = runtime.block_on(TestKeys::new());
    crate::seeds::run(96, &KEPT, proptest::collection::vec(op(), 1..40), |ops| {
        runtime.block_on(run_case(&keys.store, &ops))
    });
}
