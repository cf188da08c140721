//! Model-based test of the whole protocol, in memory: the key store is the
//! reference model (`MemoryKeyStore`), the ledger and the rails are small
//! models of their own, and up to three owners act in random interleavings
//! with crashes, stalls (an owner simply not scheduled while the clock
//! runs), lease expiries, unknown outcomes, failed transactions (before the
//! commit is sent, or a commit that landed but whose answer was lost),
//! retries, and owner writes to the key store delivered again at any later
//! moment (an SDK retry of a write that landed but whose reply was lost). Each owner follows the engine's rules: claim or take over, adopt
//! the ledger row, one fenced transaction per stretch, intent before every
//! call, probe-or-send on resume, publish the ledger's answer. After every
//! action:
//! - no phase runs twice, and once an owner has adopted the request no
//!   older owner writes to the ledger again;
//! - no call is sent without its intent committed, and each rail applies a
//!   step at most once;
//! - a finished answer never changes and is the ledger's;
//! - the key store never forgets a request the ledger holds (a new claim
//!   would start a second request, and a second payment).
//!
//! Then, with no more crashes, a last retry must finish the request with
//! every effect exactly once.

use std::time::Duration;

use futures::executor::block_on;
use keyfence::domain::{Fence, Millis, Owner, RequestHash, StoredResponse};
use keyfence::keystore::{
    Claim, Finish, Holder, KeyItem, KeyState, KeyStore, KeyStoreError, Lease, MemoryKeyStore, Release,
};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};

use crate::harness::fresh_key;

const LEASE: Duration = Duration::from_millis(1000);
const ACTORS: usize = 3;

/// The operation: recovery points in order. Calls are made at the `*_SENT`
/// points; the transactions end at intents and at the end.
const POINTS: [&str; 8] = ["STARTED", "H1", "EXT1_SENT", "EXT1_DONE", "H2", "EXT2_SENT", "EXT2_DONE", "FINISHED"];
const SENT: [usize; 2] = [2, 5];
const FINISHED: usize = 7;

/// Where the next transaction from `at` ends: the next intent, or the end.
fn stretch_end(at: usize) -> usize {
    SENT.into_iter().find(|&s| s > at).unwrap_or(FINISHED)
}

#[derive(Default)]
struct LedgerModel {
    /// (fence, recovery point) of the request row, once adopted or written.
    row: Option<(Fence, usize)>,
    /// Every point reached, with the fence that wrote it, in order.
    runs: Vec<(usize, Fence)>,
    answer: Option<StoredResponse>,
}

impl LedgerModel {
    /// The fence check of a phase (and of adoption, with `expected` None).
    fn admits(&self, fence: Fence, expected: Option<usize>) -> bool {
        match (self.row, expected) {
            (None, _) => true,
            (Some((f, _)), None) => f < fence,
            (Some((f, at)), Some(e)) => f <= fence && at == e,
        }
    }
}

#[derive(Clone, Debug)]
enum Actor {
    Idle,
    Owner {
        owner: Owner,
        fence: Fence,
        lease_until: Millis,
        at: usize,
        outcome_in_hand: bool,
        /// The lease was checked and the next action not yet taken: the
        /// window in which a stalled owner becomes a zombie.
        checked: bool,
    },
}

/// How a phase transaction fails, if it does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum TxnFault {
    None,
    /// The transaction fails before its commit is sent: nothing lands.
    BeforeCommit,
    /// The commit lands, but its answer never reaches the owner.
    AnswerLost,
}

#[derive(Clone, Debug)]
enum Action {
    /// The actor takes its next step; `unknown` makes a call's outcome unknown
    /// (`applied` says whether the rail applied it anyway), `fault` makes a
    /// transaction fail.
    Step {
        actor: usize,
        unknown: bool,
        applied: bool,
        fault: TxnFault,
    },
    Crash {
        actor: usize,
    },
    /// One of the owner writes made so far reaches the key store again.
    Redeliver {
        pick: usize,
    },
    Advance {
        ms: u64,
    },
}

fn action() -> impl Strategy<Value = Action> {
    prop_oneof![
        6 => (0..ACTORS, prop::bool::weighted(0.2), any::<bool>(), txn_fault())
            .prop_map(|(actor, unknown, applied, fault)| Action::Step { actor, unknown, applied, fault }),
        1 => (0..ACTORS).prop_map(|actor| Action::Crash { actor }),
        1 => any::<usize>().prop_map(|pick| Action::Redeliver { pick }),
        2 => (0..1500_u64).prop_map(|ms| Action::Advance { ms }),
    ]
}

fn txn_fault() -> impl Strategy<Value = TxnFault> {
    prop_oneof![8 => Just(TxnFault::None), 1 => Just(TxnFault::BeforeCommit), 1 => Just(TxnFault::AnswerLost)]
}

/// An owner write to the key store, kept so it can be delivered again.
#[derive(Clone, Debug)]
enum Write {
    Heartbeat(Holder, Lease),
    Finish(Holder, Finish),
    Release(Holder, Release),
}

struct World {
    keys: MemoryKeyStore,
    /// Every owner write delivered so far.
    writes: Vec<Write>,
    ledger: LedgerModel,
    /// Times each external step was applied at its rail.
    applied: [u32; 2],
    actors: Vec<Actor>,
    now: Millis,
    claim: Claim,
    /// The first answer the key store ever held.
    published: Option<StoredResponse>,
}

impl World {
    fn new() -> Self {
        let now = Millis::new(1_000_000);
        let claim = Claim {
            key: fresh_key(),
            request_hash: RequestHash::from_hex("00".into()),
            request: b"{}".to_vec(),
            payment_id: uuid::Uuid::now_v7(),
            owner: Owner::attempt_of("model"),
            home_region: "r".into(),
            lease: Lease { now, length: LEASE },
            gone_before: now,
        };
        Self {
            keys: MemoryKeyStore::new(),
            writes: Vec::new(),
            ledger: LedgerModel::default(),
            applied: [0; 2],
            actors: vec![Actor::Idle; ACTORS],
            now,
            claim,
            published: None,
        }
    }

    fn lease(&self) -> Lease {
        Lease { now: self.now, length: LEASE }
    }

    /// Adopts the ledger row for a new owner; `None` if fenced out.
    fn adopt(&mut self, owner: Owner, item: &KeyItem) -> Actor {
        if !self.ledger.admits(item.fence, None) {
            return Actor::Idle;
        }
        let at = self.ledger.row.map_or(0, |(_, at)| at);
        self.ledger.row = Some((item.fence, at));
        Actor::Owner {
            owner,
            fence: item.fence,
            lease_until: item.lease_until,
            at,
            outcome_in_hand: false,
            checked: false,
        }
    }

    /// An idle actor presents the request, as a client retry would.
    fn present(&mut self) -> Actor {
        let owner = Owner::attempt_of("model");
        let claim = Claim { owner: owner.clone(), lease: self.lease(), gone_before: self.now, ..self.claim.clone() };
        match block_on(self.keys.claim(&claim)) {
            Ok(item) => Actor::Owner {
                owner,
                fence: item.fence,
                lease_until: item.lease_until,
                at: 0,
                outcome_in_hand: false,
                checked: false,
            },
            Err(KeyStoreError::Taken(Some(existing))) if existing.state == KeyState::Finished => {
                assert_eq!(existing.response, self.published, "a replay differs from the first answer");
                Actor::Idle
            }
            Err(KeyStoreError::Taken(Some(existing))) if existing.lease_until < self.now => {
                match block_on(self.keys.take_over(&existing.key, existing.fence, &owner, self.lease())) {
                    Ok(item) => self.adopt(owner, &item),
                    Err(_) => Actor::Idle,
                }
            }
            Err(_) => Actor::Idle,
        }
    }

    /// The engine's hand-back after a failed transaction: the key is
    /// forgotten only if nothing can have reached the ledger (no row was
    /// adopted and no commit was sent); otherwise it is reopened.
    fn hand_back(&mut self, holder: &Holder, at: usize, fault: TxnFault) {
        let how = if at == 0 && fault == TxnFault::BeforeCommit { Release::Forget } else { Release::Reopen };
        let _ = self.deliver(Write::Release(holder.clone(), how));
    }

    /// Delivers an owner write (again, perhaps); `Some` for a finish that
    /// took, with the item it left.
    fn deliver(&mut self, write: Write) -> Result<Option<KeyItem>, KeyStoreError> {
        let key = &self.claim.key;
        let result = match &write {
            Write::Heartbeat(holder, lease) => block_on(self.keys.heartbeat(key, holder, *lease)).map(|_| None),
            Write::Finish(holder, finish) => block_on(self.keys.finish(key, holder, finish)).map(Some),
            Write::Release(holder, how) => block_on(self.keys.release(key, holder, *how)).map(|()| None),
        };
        self.writes.push(write);
        if let Ok(Some(item)) = &result {
            let published = item.response.clone().expect("finished items carry the answer");
            assert!(self.published.as_ref().is_none_or(|p| *p == published), "the finished answer changed");
            self.published = Some(published);
        }
        result
    }

    fn step(&mut self, index: usize, unknown: bool, applied: bool, fault: TxnFault) {
        let actor = self.actors[index].clone();
        let Actor::Owner { owner, fence, mut lease_until, at, outcome_in_hand, checked } = actor else {
            self.actors[index] = self.present();
            return;
        };
        let holder = Holder { fence, owner: owner.clone() };
        if !checked {
            // Lazy heartbeat; refused means fenced out: stop at once.
            if lease_until.get().saturating_sub(self.now.get()) * 3 < LEASE.as_millis() as u64 * 2 {
                match self.deliver(Write::Heartbeat(holder.clone(), self.lease())) {
                    Ok(_) => lease_until = self.lease().until(),
                    Err(_) => {
                        self.actors[index] = Actor::Idle;
                        return;
                    }
                }
            }
            self.actors[index] = Actor::Owner { owner, fence, lease_until, at, outcome_in_hand, checked: true };
            return;
        }
        let next = if at == FINISHED {
            let answer = self.ledger.answer.clone().expect("a finished ledger row has an answer");
            let finish = Finish { response: answer, expires_at: self.now.plus(LEASE * 100) };
            let _ = self.deliver(Write::Finish(holder, finish));
            Actor::Idle
        } else if SENT.contains(&at) && !outcome_in_hand {
            let step = if at == SENT[0] { 0 } else { 1 };
            let row_at = self.ledger.row.map_or(0, |(_, a)| a);
            assert!(row_at >= at, "a call was sent before its intent was committed");
            if !unknown || applied {
                // The rail deduplicates by derived key: a repeat applies nothing.
                self.applied[step] = 1;
            }
            if unknown {
                // Park: a fenced write of the attempt, then the lease is handed back.
                if self.ledger.admits(fence, Some(at)) {
                    let _ = self.deliver(Write::Release(holder, Release::Reopen));
                }
                Actor::Idle
            } else {
                Actor::Owner { owner, fence, lease_until, at, outcome_in_hand: true, checked: false }
            }
        } else {
            let to = stretch_end(at);
            if !self.ledger.admits(fence, Some(at)) {
                Actor::Idle
            } else if fault == TxnFault::BeforeCommit {
                self.hand_back(&holder, at, fault);
                Actor::Idle
            } else {
                if let Some((newest, _)) = self.ledger.row {
                    assert!(fence >= newest, "fence {fence} wrote after fence {newest} adopted the request");
                }
                for (point, name) in POINTS.iter().enumerate().take(to + 1).skip(at + 1) {
                    assert!(self.ledger.runs.iter().all(|(p, _)| *p != point), "{name} ran twice");
                    if let Some((_, last)) = self.ledger.runs.last() {
                        assert!(*last <= fence, "a write went back to an older fence");
                    }
                    self.ledger.runs.push((point, fence));
                }
                if to == FINISHED {
                    self.ledger.answer = Some(StoredResponse {
                        status: 201,
                        headers: Default::default(),
                        body: format!("finished under fence {fence}").into_bytes(),
                    });
                }
                self.ledger.row = Some((fence, to));
                if fault == TxnFault::AnswerLost {
                    self.hand_back(&holder, at, fault);
                    Actor::Idle
                } else {
                    Actor::Owner { owner, fence, lease_until, at: to, outcome_in_hand: false, checked: false }
                }
            }
        };
        self.actors[index] = next;
        assert!(self.applied.iter().all(|&n| n <= 1));
    }

    fn apply(&mut self, action: &Action) {
        match *action {
            Action::Step { actor, unknown, applied, fault } => self.step(actor, unknown, applied, fault),
            Action::Crash { actor } => self.actors[actor] = Actor::Idle,
            Action::Redeliver { pick } => {
                if !self.writes.is_empty() {
                    let _ = self.deliver(self.writes[pick % self.writes.len()].clone());
                }
            }
            Action::Advance { ms } => self.now = self.now.plus(Duration::from_millis(ms)),
        }
        if self.ledger.row.is_some() {
            let item = block_on(self.keys.get(&self.claim.key)).unwrap();
            assert!(item.is_some(), "the key store forgot a request the ledger holds, after {action:?}");
        }
    }

    /// With no more faults, one client retries until it gets the answer.
    fn finish_by_retrying(&mut self) {
        self.actors = vec![Actor::Idle];
        for _ in 0..200 {
            if self.published.is_some() {
                return;
            }
            self.now = self.now.plus(LEASE / 2);
            self.step(0, false, false, TxnFault::None);
        }
        panic!("the request never finished: ledger at {:?}", self.ledger.row);
    }
}

#[test]
fn random_interleavings_of_owners_crashes_and_retries_take_effect_once() {
    let mut runner = TestRunner::new(Config { cases: 1024, failure_persistence: None, ..Config::default() });
    let result = runner.run(&prop::collection::vec(action(), 0..60), |actions| {
        let mut world = World::new();
        for action in &actions {
            world.apply(action);
        }
        world.finish_by_retrying();

        let mut points: Vec<usize> = world.ledger.runs.iter().map(|(p, _)| *p).collect();
        points.sort_unstable();
        prop_assert_eq!(points, (1..=FINISHED).collect::<Vec<_>>(), "every phase exactly once");
        prop_assert_eq!(world.applied, [1, 1], "each rail applied its step exactly once");
        let stored = block_on(world.keys.get(&world.claim.key)).unwrap().expect("the key exists");
        prop_assert_eq!(stored.state, KeyState::Finished);
        prop_assert_eq!(stored.response, world.ledger.answer.clone(), "the key store holds the ledger's answer");
        Ok(())
    });
    if let Err(failure) = result {
        panic!("{failure}");
    }
}
