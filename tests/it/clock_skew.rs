//! Clock skew. Leases are compared against each caller's own clock, so an
//! instance whose clock runs ahead by more than a lease sees a live owner's
//! lease as over and takes its request over. That costs the live owner its
//! work (it is fenced out and answers 409), never a second payment: the
//! fences decide, not the clocks.

use keyfence::domain::{Fence, IdempotencyKey, ScopedKey};
use keyfence::keystore::{KeyState, KeyStore};
use reqwest::StatusCode;
use serde_json::json;

use crate::app::{payment, spawn_app};
use crate::crash::assert_exactly_once;
use crate::process::{ServeProcess, keyfence_command};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_whose_clock_runs_a_lease_ahead_pays_nothing_twice() {
    let app = spawn_app().await;
    // Another instance whose clock runs 30 s (three leases) ahead, started
    // first: the race below is between two requests, not a process start.
    let mut command = keyfence_command(&app, "serve");
    command
        .env("KEYFENCE_CLOCK_OFFSET_MS", "30000")
        .env("KEYFENCE_RECOVERY_INTERVAL_MS", "0")
        // Long enough to wait out E1's latency when it probes.
        .env("KEYFENCE_LEASE_MS", "10000")
        .env("KEYFENCE_RAIL_TIMEOUT_MS", "3000");
    let skewed = ServeProcess::spawn(command).await;

    app.e1.set_faults(json!({ "latency_ms": 1500 })).await;
    let body = payment("E2E-SKEW");
    // The live owner: this app, with a true clock and a 10 s lease, at E1.
    let live = app.pay_in_background(&app.url, "skew-1", &body);
    app.reaches("EXT1_SENT").await;
    let taken = app.try_pay_at(&skewed.url, &app.api_key, "skew-1", &body).await.unwrap();
    assert_eq!(taken.status(), StatusCode::CREATED, "it saw the lease as over and took the request over");

    let live = live.await.unwrap().unwrap();
    assert_eq!(live.status(), StatusCode::CONFLICT, "the live owner was fenced out, not paid twice");
    let key = ScopedKey::new(app.client_id().await, IdempotencyKey::parse("skew-1").unwrap());
    let item = app.keys.store.get(&key).await.unwrap().unwrap();
    assert_eq!((item.state, item.fence), (KeyState::Finished, Fence::new(2)));
    assert_exactly_once(&app).await;
}
