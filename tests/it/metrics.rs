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

use crate::app::{TestApp, payment, spawn_app, spawn_app_with};
use crate::process::{LEASE_MS, ServeProcess, keyfence_command};
use crate::receiver::Receiver;
use crate::webhook_delivery::subscribe;

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

/// The metric names `text` (a dashboard's JSON or a rules file) reads:
/// every `keyfence_`, `http_server_` and `process_` name, a histogram's
/// series under its own name, and none that is part of a recording rule's
/// name (`region:http_server_requests:rate5m`) or a wildcard (`keyfence_x_*`).
fn names_read(text: &str) -> std::collections::BTreeSet<String> {
    let mut names = std::collections::BTreeSet::new();
    let bytes = text.as_bytes();
    for prefix in ["keyfence_", "http_server_", "process_"] {
        for (at, _) in text.match_indices(prefix) {
            let before = at.checked_sub(1).map(|i| bytes[i]);
            if before.is_some_and(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b':') {
                continue;
            }
            let end =
                text[at..].find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).map_or(text.len(), |n| at + n);
            if text[end..].starts_with([':', '*']) || text[at..end].ends_with('_') {
                continue;
            }
            let name = &text[at..end];
            let base = ["_bucket", "_count", "_sum"].iter().find_map(|s| name.strip_suffix(s)).unwrap_or(name);
            names.insert(base.to_owned());
        }
    }
    names
}

/// The metric names in a scrape (histograms under their own name).
fn names_exported(scrape: &str) -> std::collections::BTreeSet<String> {
    scrape
        .lines()
        .filter_map(|line| line.strip_prefix("# TYPE "))
        .filter_map(|line| line.split(' ').next())
        .map(str::to_owned)
        .collect()
}

/// Every metric the Grafana dashboard and the Prometheus rules read is one
/// a live keyfence exports: two `serve` processes (one of them left behind
/// by a takeover) and a reconcile run, through a storm, a takeover, a
/// fenced-out zombie, a decline, a rail that never answers, a throttled key
/// store, a throttled client and a region declared failed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_metric_the_dashboard_and_the_alerts_read_is_exported() {
    // Webhooks are delivered by the process, whose metrics are read.
    let app = spawn_app_with(|s| s.webhook_delivery.interval_ms = 0).await;
    let receiver = Receiver::start().await;
    subscribe(&app, &receiver, "live", json!({})).await;
    let mut command = keyfence_command(&app, "serve");
    command.env("KEYFENCE_RECOVERY_INTERVAL_MS", "200").env("KEYFENCE_MAX_UNKNOWN_ATTEMPTS", "1");
    let served = ServeProcess::spawn(command).await;
    let (url, admin) = (served.url.clone(), served.admin_url.clone().expect("serve has an admin listener"));

    let storm = payment("E2E-LIVE-STORM");
    join_all((0..5).map(|_| app.try_pay_at(&url, &app.api_key, "live-storm", &storm))).await;
    // A zombie: stalls after E1 past its lease, is taken over, then wakes to a fence.
    let mut zombie_command = keyfence_command(&app, "serve");
    zombie_command
        .env("KEYFENCE_RECOVERY_INTERVAL_MS", "0")
        .env("FAILPOINTS", "after-call:ext1=sleep(6000)")
        .env("KEYFENCE_CLIENT_RATE", "1")
        .env("KEYFENCE_CLIENT_BURST", "1");
    let zombie = ServeProcess::spawn(zombie_command).await;
    let zombie_admin = zombie.admin_url.clone().expect("the zombie has an admin listener");
    let stalled = app.pay_in_background(&zombie.url, "live-zombie", &payment("E2E-LIVE-ZOMBIE"));
    // Retried until its lease has run out (409 before), while the zombie still sleeps.
    tokio::time::sleep(Duration::from_millis(LEASE_MS)).await;
    crate::harness::eventually("a retry takes the zombie's request over", async || {
        let taken = app.try_pay_at(&url, &app.api_key, "live-zombie", &payment("E2E-LIVE-ZOMBIE")).await.unwrap();
        taken.status().is_success()
    })
    .await;
    let _ = stalled.await;
    // The zombie's client is over its rate of one a second.
    for _ in 0..3 {
        let _ = app.try_pay_at(&zombie.url, &app.api_key, "live-rated", &payment("E2E-LIVE-RATED")).await;
    }
    // A decline, a screening outage (the key handed back), a rail that never answers.
    app.e2.set_rules(json!({ "max_amount_minor": 1000 })).await;
    let _ = app.try_pay_at(&url, &app.api_key, "live-declined", &payment("E2E-LIVE-DECLINED")).await;
    app.e2.set_rules(json!({})).await;
    app.e1.set_faults(json!({ "error_rate": 1.0 })).await;
    let _ = app.try_pay_at(&url, &app.api_key, "live-outage", &payment("E2E-LIVE-OUTAGE")).await;
    app.e1.clear_faults().await;
    app.e2.set_faults(json!({ "latency_ms": 2000 })).await;
    let _ = app.try_pay_at(&url, &app.api_key, "live-silent", &payment("E2E-LIVE-SILENT")).await;
    // A throttled key store, and a region declared failed.
    app.keys.arm(json!({ "operation": "PutItem", "count": 1, "action": "error", "code": "ThrottlingException" })).await;
    let _ = app.try_pay_at(&url, &app.api_key, "live-throttled", &payment("E2E-LIVE-THROTTLED")).await;
    let regions = keyfence::regions::RegionStore::new(app.keys.store.client().clone(), app.keys.store.table());
    keyfence::regions::declare(
        &regions,
        None,
        "live-elsewhere",
        keyfence::regions::RegionState::Failed,
        "test",
        "drill",
    )
    .await
    .unwrap();
    crate::harness::eventually("a webhook delivered", async || {
        receiver.arrivals("live").await.iter().any(crate::receiver::Arrival::accepted)
    })
    .await;
    // Sweeps mark the silent payment indeterminate and read the registry.
    crate::harness::eventually("a sweep marks the silent payment indeterminate", async || {
        sample(&scrape(&app, &admin).await, "keyfence_indeterminate_total", &[]) >= 1.0
            && sample(&scrape(&app, &admin).await, "keyfence_region_declared_failed", &[("region", "live-elsewhere")])
                == 1.0
    })
    .await;
    app.e2.clear_faults().await;
    let metrics_file = std::env::temp_dir().join(format!("keyfence-reconcile-{}.prom", uuid::Uuid::new_v4()));
    let reconciled = keyfence_command(&app, "reconcile")
        .args(["--metrics-file", metrics_file.to_str().unwrap()])
        .stdout(std::process::Stdio::null())
        .status()
        .await
        .unwrap();
    assert!(reconciled.code().is_some_and(|c| c < 2), "reconcile ran");

    let mut exported = names_exported(&scrape(&app, &admin).await);
    exported.extend(names_exported(&scrape(&app, &zombie_admin).await));
    exported.extend(names_exported(&std::fs::read_to_string(&metrics_file).unwrap()));
    std::fs::remove_file(&metrics_file).unwrap();
    let root = env!("CARGO_MANIFEST_DIR");
    let read_file = |file: &str| std::fs::read_to_string(format!("{root}/{file}")).unwrap();
    let recorded = read_file("infra/prometheus/recording.rules.yml");
    for file in
        ["infra/grafana/keyfence.json", "infra/prometheus/recording.rules.yml", "infra/prometheus/alerts.rules.yml"]
    {
        let text = read_file(file);
        let read = names_read(&text);
        let unknown: Vec<_> = read.difference(&exported).collect();
        assert!(
            unknown.is_empty(),
            "{file} reads metrics keyfence does not export: {unknown:?}\nexported: {exported:?}"
        );
        // The dashboard reads mostly recording rules: each must be one the rules define.
        let rules = rules_read(&text);
        assert!(read.len() + rules.len() > 5, "{file} reads metrics");
        let undefined: Vec<_> = rules.iter().filter(|r| !recorded.contains(&format!("record: {r}\n"))).collect();
        assert!(undefined.is_empty(), "{file} reads recording rules that are not defined: {undefined:?}");
    }
}

/// The recording rules `text` reads (names with colons, `level:metric:operations`),
/// other than where it defines them.
fn rules_read(text: &str) -> std::collections::BTreeSet<String> {
    text.lines()
        .filter(|line| !line.trim_start().starts_with("- record:") && !line.trim_start().starts_with('#'))
        .flat_map(|line| line.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':')))
        .filter(|word| word.matches(':').count() == 2 && word.starts_with(char::is_alphabetic))
        .map(str::to_owned)
        .collect()
}

#[test]
fn metric_names_are_read_off_queries() {
    let read = names_read(
        r#"{"expr": "sum(rate(keyfence_claims_total{x=\"y\"}[5m])) / region:http_server_requests:rate5m + histogram_quantile(0.99, http_server_request_duration_seconds_bucket) keyfence_indeterminate_* process_cpu_seconds_total"}"#,
    );
    let read: Vec<_> = read.iter().map(String::as_str).collect();
    assert_eq!(read, ["http_server_request_duration_seconds", "keyfence_claims_total", "process_cpu_seconds_total"]);
}
