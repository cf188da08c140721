//! Fair use of one instance, tried as a client hogging it would: a flood
//! of payments on kept-alive connections is turned away with 429 while an
//! honest client is paid in the same second, a payment turned away was not
//! claimed (the same key pays later), and past the instance's task cap a
//! payment is refused with 503 before anything is claimed.

use std::time::{Duration, Instant};

use axum::routing::{get, post};
use futures::future::join_all;
use reqwest::StatusCode;

use crate::app::{TestRail, payment, spawn_app, spawn_app_on};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flooding_client_is_throttled_while_an_honest_one_is_paid() {
    let app = spawn_app().await;
    let (hog, hog_key) = app.add_client().await;
    let limits = keyfence::clients::Limits {
        fair_use: keyfence::clients::FairUse { rate: Some(2), burst: Some(6), in_flight: Some(3) },
        ..Default::default()
    };
    app.clients().set_limits(hog, &limits).await.unwrap();
    // One connection pool, kept alive: the flood reuses its connections.
    let kept_alive = reqwest::Client::new();
    let flood = (0..40).map(|i| {
        let request = kept_alive
            .post(format!("{}/v1/payments", app.url))
            .bearer_auth(&hog_key)
            .header("Idempotency-Key", format!("flood-{i}"))
            .json(&payment(&format!("E2E-FLOOD-{i}")));
        async move {
            let answer = request.send().await.unwrap();
            let retry_after = answer.headers().get("retry-after").map(|v| v.to_str().unwrap().to_owned());
            (i, answer.status(), retry_after)
        }
    });
    let honest = payment("E2E-HONEST");
    let started = Instant::now();
    let (flooded, honest) = tokio::join!(join_all(flood), app.pay("honest-1", &honest));
    assert_eq!(honest.status(), StatusCode::CREATED, "the honest client is served");
    assert!(started.elapsed() < Duration::from_secs(5), "in the same moment as the flood");
    let paid: Vec<usize> = flooded.iter().filter(|(_, s, _)| *s == StatusCode::CREATED).map(|(i, ..)| *i).collect();
    let throttled: Vec<_> = flooded.iter().filter(|(_, s, _)| *s == StatusCode::TOO_MANY_REQUESTS).collect();
    assert_eq!(paid.len() + throttled.len(), 40, "paid or throttled, nothing else: {flooded:?}");
    assert!(paid.len() <= 6, "at most a burst of the flood is paid: {}", paid.len());
    assert!(throttled.len() >= 30, "the flood is throttled: {}", throttled.len());
    assert!(throttled.iter().all(|(_, _, retry)| retry.as_deref().is_some_and(|r| r.parse::<u64>().unwrap() >= 1)));
    // Counted where the money is: one payment in the ledger and one
    // instruction at the rail for each 201, the honest one's included.
    assert_eq!(app.count("payments").await, paid.len() as i64 + 1);
    assert_eq!(app.e2.statement().await.len(), paid.len() + 1);
    assert_eq!(app.key_items().await, paid.len() + 1, "nothing throttled was claimed");

    // A throttled key was never stored: after Retry-After it pays.
    let (again, ..) = throttled[0];
    tokio::time::sleep(Duration::from_secs(1)).await;
    let retried = app.pay_as(&hog_key, &format!("flood-{again}"), &payment(&format!("E2E-FLOOD-{again}"))).await;
    assert_eq!(retried.status(), StatusCode::CREATED);
    assert!(!retried.headers().contains_key("idempotent-replayed"), "worked, not replayed");
    assert_eq!(app.e2.statement().await.len(), paid.len() + 2);
}

/// A rail that never answers keeps its payment's task busy for the whole
/// rail timeout: with a cap of one task, a second payment meanwhile is 503
/// with Retry-After and claims nothing.
#[tokio::test]
async fn past_the_task_cap_a_payment_is_refused_before_anything_is_claimed() {
    let silent = axum::Router::new()
        .route("/v1/instructions", post(|| async { std::future::pending::<StatusCode>().await }))
        .route("/v1/instructions/{key}", get(|| async { std::future::pending::<StatusCode>().await }));
    let app = spawn_app_on(TestRail::start("e1").await, TestRail::serving(silent).await, |s| {
        s.engine.rails.rail_timeout = Duration::from_secs(1);
        s.fair_use.max_payment_tasks = 1;
    })
    .await;
    let first = app.pay_in_background(&app.url, "busy-1", &payment("E2E-BUSY-1"));
    let (_, other_key) = app.add_client().await;
    let mut refused = None;
    for _ in 0..50 {
        if app.key_items().await == 1 {
            refused = Some(app.pay_as(&other_key, "busy-2", &payment("E2E-BUSY-2")).await);
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let refused = refused.expect("the first payment was claimed");
    assert_eq!(refused.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert!(refused.headers().contains_key("retry-after"));
    let problem: serde_json::Value = refused.json().await.unwrap();
    assert_eq!(problem["type"].as_str().unwrap().rsplit(':').next(), Some("busy"));
    assert_eq!(app.key_items().await, 1, "the refused payment claimed nothing");
    assert_eq!(first.await.unwrap().unwrap().status(), StatusCode::ACCEPTED, "the first is unknown, not failed");
}
