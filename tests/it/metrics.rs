//! `/metrics` and `/readyz`, on a `keyfence serve` process of its own (so
//! its counters are its alone): after a storm of identical requests, a
//! takeover of a request whose owner died, and a declined payment, the
//! counters add up to what the rails' statements and the ledger show, the
//! latency histograms and process figures are there, and no label carries
//! a key or a client.

use std::time::Duration;

use futures::future::join_all;
use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::app::{TestApp, payment, spawn_app};
use crate::process::{LEASE_MS, ServeProcess, keyfence_command};

/// The value of the sample `name{labels...}` (0 if absent).
fn sample(text: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    text.lines()
        .filter(|line| line.starts_with(name) && line[name.len()..].starts_with(['{', ' ']))
        .filter(|line| labels.iter().all(|(k, v)| line.contains(&format!("{k}=\"{v}\""))))
        .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

async fn scrape(app: &TestApp, admin: &str) -> String {
    app.http.get(format!("{admin}/metrics")).send().await.unwrap().text().await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_counters_add_up_to_the_ledger_and_the_rails() {
    let app = spawn_app().await;
    let served = ServeProcess::spawn(keyfence_command(&app, "serve")).await;
    let (url, admin) = (served.url.clone(), served.admin_url.clone().expect("serve has an admin listener"));

    // A storm of identical requests.
    let storm = payment("E2E-STORM");
    join_all((0..20).map(|_| app.try_pay_at(&url, &app.api_key, "storm-1", &storm))).await;
    // A request whose owner died after E1, taken over by a retry here.
    let mut doomed = ServeProcess::start(&app, Some("after-call:ext1=return"), 0).await;
    let orphan = payment("E2E-ORPHAN");
    assert!(app.try_pay_at(&doomed.url, &app.api_key, "orphan-1", &orphan).await.is_err());
    doomed.exited().await;
    tokio::time::sleep(Duration::from_millis(LEASE_MS + 200)).await;
    let retried = app.try_pay_at(&url, &app.api_key, "orphan-1", &orphan).await.unwrap();
    assert_eq!(retried.status(), StatusCode::CREATED);
    // A payment the rail declines.
    app.e2.set_rules(json!({ "max_amount_minor": 1000 })).await;
    let declined = app.try_pay_at(&url, &app.api_key, "declined-1", &payment("E2E-DECLINED")).await.unwrap();
    assert_eq!(declined.status(), StatusCode::PAYMENT_REQUIRED);

    let text = scrape(&app, &admin).await;
    let requests =
        |answer| sample(&text, "keyfence_http_requests_total", &[("route", "create_payment"), ("answer", answer)]);
    let (applied, declines) = (app.e2.statement().await.len() as f64, app.e2.declines().await.len() as f64);
    assert_eq!(requests("created"), applied, "one first 201 per instruction the rail applied");
    assert_eq!(requests("declined"), declines);
    assert_eq!(sample(&text, "keyfence_declines_total", &[("step", "ext2")]), declines);
    assert_eq!(requests("created") + requests("replayed") + requests("in_flight") + requests("declined"), 22.0);
    let won = sample(&text, "keyfence_claims_total", &[("outcome", "won")]);
    let taken = sample(&text, "keyfence_takeovers_total", &[("by", "retry")]);
    assert_eq!((won, taken), (2.0, 1.0), "{text}");
    assert_eq!(
        won + 1.0,
        app.count("payments").await as f64,
        "every payment began with a claim; the dead owner's here"
    );
    for (name, labels) in [
        ("keyfence_key_store_seconds_count", [("op", "claim")]),
        ("keyfence_ledger_phase_seconds_count", [("to", "FINISHED")]),
        ("keyfence_rail_seconds_count", [("call", "probe")]),
    ] {
        assert!(sample(&text, name, &labels) >= 1.0, "{name} {labels:?}");
    }
    assert!(sample(&text, "process_cpu_seconds_total", &[]) > 0.0, "process figures");
    assert!(sample(&text, "process_resident_memory_bytes", &[]) > 0.0);
    let client = app.client_id().await.to_string();
    assert!(!text.contains("storm-1") && !text.contains(&client), "no key or client in a label");

    let ready = app.http.get(format!("{admin}/readyz")).send().await.unwrap();
    assert_eq!(ready.status(), StatusCode::OK);
    let ready: Value = ready.json().await.unwrap();
    assert_eq!((ready["key_table"].as_str(), ready["ledger"].as_str()), (Some("ok"), Some("ok")));
}
