//! What the common path costs in round trips, counted on the real stores: a
//! first payment is one claim and one finish in the key store (no read, no
//! heartbeat) and three ledger transactions of 6 statements (each phase
//! sends its opening with its held writes, the last its answer too, and
//! then commits; sqlx logs no `BEGIN`, so with the one that opens each
//! transaction a payment makes 9 round trips to PostgreSQL); a replay is
//! one claim whose failure carries
//! the answer, or nothing at all in an instance that already knows the
//! answer. An idle instance's inbox round and webhook take ask one
//! question each, and its recovery sweep one statement.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use keyfence::domain::{Fence, IdempotencyKey, Millis, Owner, PaymentRequest, RequestHash, ScopedKey};
use keyfence::engine::{Answer, Engine, EngineSettings, Rails, Submission};
use keyfence::keystore::{
    Balance, Claim, Concluded, Conclusion, Finish, Frozen, Handoff, HeldBy, Hold, Holder, Holding, KeyItem, KeyStore,
    KeyStoreError, Lease, Release, ScanPage, StaleKey,
};
use keyfence::operations::PaymentOperation;
use keyfence::rail::RailClient;
use keyfence::regions::{RegionStore, RegionView};
use keyfence::startup::REGION_VIEW_AGE;
use keyfence::webhooks::deliveries::Deliveries;
use tracing_subscriber::filter::Targets;
use tracing_subscriber::prelude::*;
use uuid::Uuid;

use crate::app::{TestRail, payment};
use crate::harness::{TestKeys, TestLedger, fresh_key};

/// Counts the statements sqlx sends to PostgreSQL (each one round trip on a
/// connection that has prepared it), from the event it logs for each.
#[derive(Clone, Default)]
struct Statements(Arc<AtomicUsize>);

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Statements {
    fn on_event(&self, _: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }
}

/// A key store that counts the operations passing through to the real one.
struct Counting<K> {
    inner: K,
    calls: Mutex<BTreeMap<&'static str, usize>>,
}

impl<K> Counting<K> {
    fn note(&self, op: &'static str) {
        *self.calls.lock().unwrap().entry(op).or_default() += 1;
    }

    fn take(&self) -> BTreeMap<&'static str, usize> {
        std::mem::take(&mut *self.calls.lock().unwrap())
    }
}

impl<K: KeyStore> KeyStore for Counting<K> {
    async fn claim(&self, claim: &Claim) -> Result<KeyItem, KeyStoreError> {
        self.note("claim");
        self.inner.claim(claim).await
    }
    async fn take_over(
        &self,
        key: &ScopedKey,
        seen: Fence,
        owner: &Owner,
        lease: Lease,
    ) -> Result<KeyItem, KeyStoreError> {
        self.note("take_over");
        self.inner.take_over(key, seen, owner, lease).await
    }
    async fn fail_over(
        &self,
        key: &ScopedKey,
        seen: Fence,
        owner: &Owner,
        lease: Lease,
        from: &str,
        to: &str,
    ) -> Result<KeyItem, KeyStoreError> {
        self.note("fail_over");
        self.inner.fail_over(key, seen, owner, lease, from, to).await
    }
    async fn heartbeat(&self, key: &ScopedKey, holder: &Holder, lease: Lease) -> Result<Millis, KeyStoreError> {
        self.note("heartbeat");
        self.inner.heartbeat(key, holder, lease).await
    }
    async fn finish(&self, key: &ScopedKey, holder: &Holder, finish: &Finish) -> Result<KeyItem, KeyStoreError> {
        self.note("finish");
        self.inner.finish(key, holder, finish).await
    }
    async fn release(&self, key: &ScopedKey, holder: &Holder, how: Release) -> Result<(), KeyStoreError> {
        self.note("release");
        self.inner.release(key, holder, how).await
    }
    async fn delete_expired(&self, key: &ScopedKey, gone_before: Millis) -> Result<bool, KeyStoreError> {
        self.note("delete_expired");
        self.inner.delete_expired(key, gone_before).await
    }
    async fn get(&self, key: &ScopedKey) -> Result<Option<KeyItem>, KeyStoreError> {
        self.note("get");
        self.inner.get(key).await
    }
    async fn restore(&self, item: &KeyItem) -> Result<(), KeyStoreError> {
        self.note("restore");
        self.inner.restore(item).await
    }
    async fn scan(&self, segment: u32, total: u32, cursor: Option<String>) -> Result<ScanPage, KeyStoreError> {
        self.note("scan");
        self.inner.scan(segment, total, cursor).await
    }
    async fn stale_in_flight(&self, shard: u64, now: Millis) -> Result<Vec<StaleKey>, KeyStoreError> {
        self.note("stale_in_flight");
        self.inner.stale_in_flight(shard, now).await
    }
    async fn hand_off(&self, handoff: &Handoff) -> Result<(), KeyStoreError> {
        self.note("hand_off");
        self.inner.hand_off(handoff).await
    }
    async fn handoffs(&self, from: &str, shard: u64) -> Result<Vec<Handoff>, KeyStoreError> {
        self.note("handoffs");
        self.inner.handoffs(from, shard).await
    }
    async fn handoff_of(&self, from: &str, key: &ScopedKey, created_at: Millis) -> Result<bool, KeyStoreError> {
        self.note("handoff_of");
        self.inner.handoff_of(from, key, created_at).await
    }
    async fn forget_handoff(&self, handoff: &Handoff) -> Result<(), KeyStoreError> {
        self.note("forget_handoff");
        self.inner.forget_handoff(handoff).await
    }
    async fn hold(&self, hold: &Hold, by: &HeldBy, now: Millis) -> Result<Holding, KeyStoreError> {
        self.note("hold");
        self.inner.hold(hold, by, now).await
    }
    async fn freeze(&self, balance: &str, total: i64, frozen: &Frozen) -> Result<(), KeyStoreError> {
        self.note("freeze");
        self.inner.freeze(balance, total, frozen).await
    }
    async fn conclude_hold(&self, balance: &str, id: Uuid, how: Conclusion) -> Result<Concluded, KeyStoreError> {
        self.note("conclude_hold");
        self.inner.conclude_hold(balance, id, how).await
    }
    async fn balance(&self, balance: &str) -> Result<Option<Balance>, KeyStoreError> {
        self.note("balance");
        self.inner.balance(balance).await
    }
}

#[tokio::test]
async fn a_payment_costs_two_key_store_writes_and_a_replay_at_most_one_round_trip() {
    let keys = TestKeys::new().await;
    let db = TestLedger::new().await;
    let (e1, e2) = (TestRail::start("e1").await, TestRail::start("e2").await);
    let counting = Counting { inner: keys.store.clone(), calls: Mutex::default() };
    let rails = Rails::new([
        RailClient::new("screening", &e1.url, Duration::from_secs(2), 3, None),
        RailClient::new("payment", &e2.url, Duration::from_secs(2), 3, None),
    ]);
    let settings = settings();
    let regions = regions_of(&keys);
    let other = Engine::new(
        Counting { inner: keys.store.clone(), calls: Mutex::default() },
        db.ledger.clone(),
        rails.clone(),
        regions.clone(),
        EngineSettings { instance: "other".into(), ..settings.clone() },
    );
    let engine = Engine::new(counting, db.ledger.clone(), rails, regions, settings);
    let client = fresh_key().client;
    let body = payment("E2E-COST");
    let submit = |key: &str| Submission {
        key: ScopedKey::new(client, IdempotencyKey::parse(key).unwrap()),
        request_hash: RequestHash::of("POST", "/v1/payments", body.to_string().as_bytes()),
        canonical: body.to_string().into_bytes(),
        operation: PaymentOperation::new(PaymentRequest::parse(body.clone()).unwrap()),
    };

    // A payment before, so the ledger's spans (read once a minute at most,
    // on first use) are read already, as they are on a serving instance.
    engine.submit(submit("cost-0")).await.unwrap();
    engine.keys().take();
    let (first, statements) = statements_of(engine.submit(submit("cost-1"))).await;
    let first = first.unwrap();
    assert!(matches!(&first, Answer::Final { replayed: false, .. }), "{first:?}");
    assert_eq!(engine.keys().take(), BTreeMap::from([("claim", 1), ("finish", 1)]));
    assert_eq!(statements, 6, "PostgreSQL statements for the whole payment");

    // Another instance replays with one claim whose failure carries the answer...
    let replay = other.submit(submit("cost-1")).await.unwrap();
    assert!(matches!(&replay, Answer::Final { replayed: true, .. }), "{replay:?}");
    assert_eq!(other.keys().take(), BTreeMap::from([("claim", 1)]));
    // ...and from then on, like the instance that worked it, from memory.
    for engine in [&engine, &other] {
        let again = engine.submit(submit("cost-1")).await.unwrap();
        assert_eq!(again, replay, "the same answer, byte for byte");
        assert_eq!(engine.keys().take(), BTreeMap::new(), "no key-store round trip");
    }

    let ledger_transactions: i64 =
        sqlx::query_scalar("SELECT count(DISTINCT ran_at) FROM phase_runs WHERE idem_key = 'cost-1'")
            .fetch_one(db.ledger.pool())
            .await
            .unwrap();
    assert_eq!(ledger_transactions, 3, "three ledger transactions for the whole payment");
    let points: i64 = sqlx::query_scalar("SELECT count(*) FROM phase_runs WHERE idem_key = 'cost-1'")
        .fetch_one(db.ledger.pool())
        .await
        .unwrap();
    assert_eq!(points, 7, "every recovery point was still recorded");
}

/// With nothing to do, an inbox round and a webhook take each ask
/// PostgreSQL one question of an index (is any message pending, is any
/// delivery due) and go no further, and a recovery sweep sends only its
/// list of the calls in doubt: the reads they skip join partitioned tables
/// and are planned afresh every time, on every instance.
#[tokio::test]
async fn idle_rounds_skip_the_joins_they_have_no_use_for() {
    let keys = TestKeys::new().await;
    let db = TestLedger::new().await;
    let engine = Engine::new(keys.store.clone(), db.ledger.clone(), Rails::new([]), regions_of(&keys), settings());
    let deliveries = Deliveries::new(db.ledger.pool().clone());

    let ((), inbox) = statements_of(keyfence::inbox::worker::round(&engine, &NoOtherRegion)).await;
    assert_eq!(inbox, 1, "statements of an inbox round with nothing pending");
    let (taken, webhooks) = statements_of(deliveries.take(8, Duration::from_secs(30), &[], 2)).await;
    assert!(taken.unwrap().is_empty());
    assert_eq!(webhooks, 1, "statements of a webhook take with nothing due");
    let (report, recovery) =
        statements_of(keyfence::recovery::sweep(&engine, keyfence::recovery::Scope::Worker, |_| {}, || {})).await;
    assert_eq!(report.found, 0);
    assert_eq!(recovery, 1, "statements of a recovery sweep with nothing stale: the list of calls in doubt");

    // With a message pending, the round reads on: this one has waited over
    // an hour for an owner, and is kept for the reconciler.
    sqlx::query(
        "INSERT INTO inbox (rail, message_id, kind, derived_key, body, state, received_at)
         VALUES ('e1', 'late', 'applied', gen_random_uuid(), '{}', 'pending', now() - interval '2 hours')",
    )
    .execute(db.ledger.pool())
    .await
    .unwrap();
    let ((), inbox) = statements_of(keyfence::inbox::worker::round(&engine, &NoOtherRegion)).await;
    assert!(inbox > 1, "a round with a message pending reads on ({inbox} statements)");
    let state: String = sqlx::query_scalar("SELECT state FROM inbox WHERE message_id = 'late'")
        .fetch_one(db.ledger.pool())
        .await
        .unwrap();
    assert_eq!(state, "unknown");
}

/// Hands nothing on (the engine here has no other region to hand to).
struct NoOtherRegion;

impl keyfence::inbox::hand::HandOn for NoOtherRegion {
    async fn hand_on(&self, _: &keyfence::ledger::inbox::Waiting) -> keyfence::inbox::hand::Handed {
        keyfence::inbox::hand::Handed::Nowhere
    }
}

fn settings() -> EngineSettings {
    EngineSettings {
        region: "test-1".into(),
        instance: "test".into(),
        lease: Duration::from_secs(30),
        retention: keyfence::domain::Retention { keep: Duration::from_secs(3600), grace: Duration::from_secs(600) },
        max_unknown_attempts: 5,
        probe_backoff: keyfence::domain::ProbeBackoff { first: Duration::ZERO, max: Duration::ZERO },
        answer_limit: keyfence::domain::ANSWER_LIMIT as usize,
        clock: Default::default(),
    }
}

fn regions_of(keys: &TestKeys) -> RegionView {
    RegionView::new(
        RegionStore::new(keys.store.client().clone(), keys.store.table()),
        REGION_VIEW_AGE,
        Default::default(),
    )
}

/// What `work` gives, and how many statements sqlx sent to PostgreSQL for
/// it. The test's runtime runs every task on this thread, so a subscriber
/// of this thread's sees every statement.
async fn statements_of<T>(work: impl std::future::Future<Output = T>) -> (T, usize) {
    let statements = Statements::default();
    let only_statements = Targets::new().with_target("sqlx::query", tracing::Level::TRACE);
    let counting = tracing_subscriber::registry().with(statements.clone().with_filter(only_statements));
    let done = {
        let _counting = tracing::subscriber::set_default(counting);
        work.await
    };
    (done, statements.0.load(Ordering::Relaxed))
}
