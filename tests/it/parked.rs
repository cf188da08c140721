//! Recovery under a flood of parked requests. A parked request waits out
//! its probe back-off before the recovery worker takes it again, and a
//! sweep resumes a bounded batch, oldest lease first: 200 requests parked
//! on a silent rail neither take every sweep nor keep a request whose
//! owner died waiting behind them.

use std::time::{Duration, Instant};

use futures::StreamExt;
use reqwest::StatusCode;
use serde_json::json;

use crate::app::{payment, spawn_app_with};
use crate::harness::claim_of;
use crate::process::{LEASE_MS, ServeProcess};
use keyfence::domain::{ClientId, IdempotencyKey, Millis, ScopedKey};
use keyfence::keystore::{KeyState, KeyStore};

const PARKED: usize = 200;
const SWEEP: Duration = Duration::from_millis(500);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crashed_request_is_resumed_within_two_sweeps_while_two_hundred_wait_on_a_silent_rail() {
    let app = spawn_app_with(|s| {
        s.engine.work.probe_backoff_first = Duration::from_secs(120);
        s.engine.work.probe_backoff_max = Duration::from_secs(120);
        (s.engine.rails.rail_timeout, s.engine.rails.rail_attempts) = (Duration::from_millis(200), 1);
    })
    .await;
    // A request whose owner dies after committing its answer, before the key store hears of it.
    let mut doomed = ServeProcess::start(&app, Some("after-commit:FINISHED=return"), 0).await;
    assert!(app.try_pay_at(&doomed.url, &app.api_key, "crashed-1", &payment("E2E-CRASHED")).await.is_err());
    doomed.exited().await;

    // The rail goes silent; 200 requests park on it (each a 202).
    app.e2.set_faults(json!({ "latency_ms": 1000 })).await;
    let parked: Vec<StatusCode> = futures::stream::iter(0..PARKED)
        .map(|i| {
            let app = &app;
            async move { app.pay(&format!("parked-{i}"), &payment(&format!("E2E-PARKED-{i}"))).await.status() }
        })
        .buffer_unordered(16)
        .collect()
        .await;
    assert!(parked.iter().all(|s| *s == StatusCode::ACCEPTED), "all parked: {parked:?}");
    let attempts = async || -> i64 {
        sqlx::query_scalar("SELECT sum(attempts)::int8 FROM external_calls WHERE step = 'ext2'")
            .fetch_one(app.db.ledger.pool())
            .await
            .unwrap()
    };
    tokio::time::sleep(Duration::from_millis(LEASE_MS)).await;
    let attempted = attempts().await;

    // A recovery worker starts, the rail still silent.
    let worker = ServeProcess::start(&app, None, SWEEP.as_millis() as u64).await;
    let started = Instant::now();
    let client = app.client_id().await;
    let crashed = ScopedKey::new(client, IdempotencyKey::parse("crashed-1").unwrap());
    loop {
        let item = app.keys.store.get(&crashed).await.unwrap().expect("the crashed request's key");
        if item.state == KeyState::Finished {
            break;
        }
        // Two sweeps, and time for a loaded machine to run them; without the
        // back-off the 200 parked requests come first, for seconds.
        assert!(started.elapsed() < SWEEP * 2 + Duration::from_secs(3), "not resumed within two sweeps");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Two more sweeps: none of the parked requests was probed again.
    tokio::time::sleep(SWEEP * 2).await;
    assert_eq!(attempts().await, attempted, "a parked request is probed again only when its back-off ends");
    drop(worker);
}

/// One sweep resumes at most a batch, the oldest leases first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sweep_takes_a_bounded_batch_oldest_lease_first() {
    let app = spawn_app_with(|_| {}).await;
    let extra = 6;
    let client = ClientId::generate();
    let mut keys = Vec::new();
    for i in 0..keyfence::recovery::BATCH + extra {
        let key = ScopedKey::new(client, IdempotencyKey::parse(&format!("stale-{i:03}")).unwrap());
        let mut claim = claim_of(&key, Millis::new(1_000 + i as u64), Duration::from_secs(1));
        claim.home_region = app.settings.engine.work.region.clone();
        app.keys.store.claim(&claim).await.unwrap();
        keys.push(key);
    }
    let engine = keyfence::startup::build_engine(&app.settings.engine).await.unwrap();
    let report = keyfence::recovery::sweep(&engine, keyfence::recovery::Scope::Worker, |_| {}, || {}).await;
    assert_eq!((report.found, report.deferred), (keyfence::recovery::BATCH + extra, extra), "{report:?}");
    for (i, key) in keys.iter().enumerate() {
        let fence = app.keys.store.get(key).await.unwrap().unwrap().fence.get();
        let taken = fence > 1;
        assert_eq!(taken, i < keyfence::recovery::BATCH, "key {i} (fence {fence}): the oldest leases go first");
    }
}

/// Keys another region handed back (its rail silent, say) fill no batch
/// here: a region resumes its own, and those of regions declared failed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_regions_handed_back_keys_do_not_crowd_out_this_regions_crashed_owner() {
    let app = spawn_app_with(|_| {}).await;
    let client = ClientId::generate();
    let elsewhere = keyfence::recovery::BATCH + 6;
    for i in 0..elsewhere {
        let key = ScopedKey::new(client, IdempotencyKey::parse(&format!("theirs-{i:03}")).unwrap());
        let mut claim = claim_of(&key, Millis::new(1_000), Duration::from_secs(1));
        claim.home_region = "test-8".into();
        let item = app.keys.store.claim(&claim).await.unwrap();
        app.keys.store.release(&key, &item.holder(), keyfence::keystore::Release::Reopen).await.unwrap();
    }
    let mine = ScopedKey::new(client, IdempotencyKey::parse("mine-crashed").unwrap());
    let mut claim = claim_of(&mine, Millis::new(5_000), Duration::from_secs(1));
    claim.home_region = app.settings.engine.work.region.clone();
    app.keys.store.claim(&claim).await.unwrap();

    let engine = keyfence::startup::build_engine(&app.settings.engine).await.unwrap();
    let report = keyfence::recovery::sweep(&engine, keyfence::recovery::Scope::Worker, |_| {}, || {}).await;
    assert_eq!((report.other_region, report.deferred), (elsewhere, 0), "{report:?}");
    assert_eq!(
        app.keys.store.get(&mine).await.unwrap().unwrap().fence.get(),
        2,
        "this region's crashed owner is taken over"
    );
}
