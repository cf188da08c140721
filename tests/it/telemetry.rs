//! With `OTEL_EXPORTER_OTLP_ENDPOINT` set, `keyfence serve` exports its
//! spans over OTLP/HTTP, and a graceful stop flushes the last batch. The
//! collector here is a real HTTP server that keeps what it is sent.

use std::sync::{Arc, Mutex};

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, Uri};
use axum::routing::post;
use reqwest::StatusCode as Status;
use serde_json::Value;

use crate::app::{TestApp, payment, spawn_app};
use crate::process::{ServeProcess, keyfence_command};

/// One export request: path, content type and body.
type Received = Arc<Mutex<Vec<(String, String, Vec<u8>)>>>;

async fn collect(State(received): State<Received>, uri: Uri, headers: HeaderMap, body: Bytes) -> StatusCode {
    let content_type = headers.get("content-type").and_then(|v| v.to_str().ok()).unwrap_or_default().to_owned();
    received.lock().unwrap().push((uri.path().to_owned(), content_type, body.to_vec()));
    StatusCode::OK
}

/// An OTLP/HTTP collector on a free port; returns its base URL.
async fn collector(received: Received) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let routes = Router::new().route("/v1/traces", post(collect)).with_state(received);
    tokio::spawn(async move { axum::serve(listener, routes).await.unwrap() });
    url
}

fn contains(haystack: &[u8], needle: &str) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle.as_bytes())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_of_a_payment_reach_the_otlp_collector_by_the_time_serve_stops() {
    let app = spawn_app().await;
    let received = Received::default();
    let endpoint = collector(received.clone()).await;
    let mut command = keyfence_command(&app, "serve");
    command
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint)
        // Longer than the test: only the flush at shutdown can deliver them.
        .env("OTEL_BSP_SCHEDULE_DELAY", "60000")
        .env("KEYFENCE_RECOVERY_INTERVAL_MS", "0")
        .env("RUST_LOG", "info,sqlx=warn");
    let mut serve = ServeProcess::spawn(command).await;

    let created = app.try_pay_at(&serve.url, &app.api_key, "traced-1", &payment("E2E-TRACED")).await.unwrap();
    assert_eq!(created.status(), Status::CREATED);
    assert!(received.lock().unwrap().is_empty(), "nothing is sent before the batch is due");

    assert!(serve.terminate().await.success(), "serve stops cleanly on SIGTERM");
    let received = received.lock().unwrap();
    assert!(!received.is_empty(), "no spans were exported");
    for (path, content_type, _) in received.iter() {
        assert_eq!(path, "/v1/traces");
        assert_eq!(content_type, "application/x-protobuf");
    }
    let exported: Vec<u8> = received.iter().flat_map(|(_, _, body)| body.iter().copied()).collect();
    // Named by OpenTelemetry's conventions: the HTTP request by its route,
    // DynamoDB calls by their operation, both stores by their system.
    for expected in [
        "keyfence",
        "POST /v1/payments",
        "submit",
        "PutItem",
        "UpdateItem",
        "aws.dynamodb",
        "postgresql",
        "begin_phase",
        "send",
    ] {
        assert!(contains(&exported, expected), "no {expected:?} in the exported spans");
    }
}

/// A payment sent with a caller's `traceparent`.
async fn pay_traced(app: &TestApp, url: &str, key: &str, traceparent: &str, end_to_end_id: &str) -> reqwest::Response {
    app.http
        .post(format!("{url}/v1/payments"))
        .bearer_auth(&app.api_key)
        .header("Idempotency-Key", key)
        .header("traceparent", traceparent)
        .json(&payment(end_to_end_id))
        .send()
        .await
        .unwrap()
}

/// A rail simulator that also keeps the `traceparent` of every request it
/// is sent; returns its base URL.
async fn tracing_rail(seen: Arc<Mutex<Vec<String>>>) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let keep = axum::middleware::from_fn(move |request: axum::extract::Request, next: axum::middleware::Next| {
        let seen = seen.clone();
        async move {
            if let Some(parent) = request.headers().get("traceparent").and_then(|v| v.to_str().ok()) {
                seen.lock().unwrap().push(parent.to_owned());
            }
            next.run(request).await
        }
    });
    let routes = keyfence::rail::sim::router(keyfence::rail::sim::Simulator::new("e2", None)).layer(keep);
    tokio::spawn(async move { axum::serve(listener, routes).await.unwrap() });
    url
}

/// A trace runs client → keyfence → rail: the caller's `traceparent` is the
/// parent of the exported spans, and the rail receives the trace.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_callers_trace_runs_through_keyfence_to_the_rail() {
    let app = spawn_app().await;
    let received = Received::default();
    let endpoint = collector(received.clone()).await;
    let rail_saw = Arc::new(Mutex::new(Vec::new()));
    let rail_url = tracing_rail(rail_saw.clone()).await;
    let mut command = keyfence_command(&app, "serve");
    command
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint)
        .env("KEYFENCE_E2_URL", &rail_url)
        .env("KEYFENCE_RECOVERY_INTERVAL_MS", "0")
        .env("RUST_LOG", "info,sqlx=warn");
    let mut serve = ServeProcess::spawn(command).await;

    let trace_id = "4bf92f3577b34da6a3ce929d0e0e4736";
    let created =
        pay_traced(&app, &serve.url, "traced-2", &format!("00-{trace_id}-00f067aa0ba902b7-01"), "E2E-TRACED-2").await;
    assert_eq!(created.status(), Status::CREATED);
    assert!(serve.terminate().await.success());

    let exported: Vec<u8> = received.lock().unwrap().iter().flat_map(|(_, _, body)| body.clone()).collect();
    let raw_id = hex::decode(trace_id).unwrap();
    assert!(exported.windows(raw_id.len()).any(|w| w == raw_id), "the exported spans carry the caller's trace id");
    let rail_saw = rail_saw.lock().unwrap();
    assert!(rail_saw.iter().any(|parent| parent.contains(trace_id)), "the rail received the trace: {rail_saw:?}");
}

/// With `KEYFENCE_LOG_FORMAT=json` every line is one JSON object, and no
/// line, whatever happened, holds an API key, an account number or a body.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logs_are_json_lines_without_secrets_accounts_or_bodies() {
    let app = spawn_app().await;
    let mut command = keyfence_command(&app, "serve");
    command.env("KEYFENCE_LOG_FORMAT", "json").env("RUST_LOG", "debug,sqlx=warn,aws=info,hyper=info,h2=info");
    let (mut serve, logs) = ServeProcess::spawn_logged(command).await;

    let body = payment("E2E-LOGGED");
    let paid = app.try_pay_at(&serve.url, &app.api_key, "logged-1", &body).await.unwrap();
    assert_eq!(paid.status(), Status::CREATED);
    app.try_pay_at(&serve.url, &app.api_key, "logged-1", &body).await.unwrap();
    let mut other = body.clone();
    other["amount_minor"] = 99.into();
    app.try_pay_at(&serve.url, &app.api_key, "logged-1", &other).await.unwrap();
    app.e2.set_rules(serde_json::json!({ "max_amount_minor": 100 })).await;
    app.try_pay_at(&serve.url, &app.api_key, "logged-2", &body).await.unwrap();
    app.try_pay_at(&serve.url, "kf_not_a_key", "logged-3", &body).await.unwrap();
    assert!(serve.terminate().await.success());

    let lines = logs.lines();
    assert!(lines.len() > 5, "something was logged: {lines:?}");
    let secrets = [
        app.api_key.as_str(),
        body["debtor_account"].as_str().unwrap(),
        body["creditor_account"].as_str().unwrap(),
        "kf_not_a_key",
        "invoice 42",
    ];
    for line in &lines {
        let event: serde_json::Value = serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"));
        assert!(event.get("level").is_some() && event.get("timestamp").is_some(), "{line}");
        for secret in secrets {
            assert!(!line.contains(secret), "a log line holds {secret:?}: {line}");
        }
    }
}

/// With no exporter, traces still run through: every log line of a
/// request names the caller's trace id, and the rail is sent it too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_an_exporter_every_line_of_a_request_names_its_trace_and_the_rail_gets_it() {
    let app = spawn_app().await;
    let rail_saw = Arc::new(Mutex::new(Vec::new()));
    let rail_url = tracing_rail(rail_saw.clone()).await;
    let mut command = keyfence_command(&app, "serve");
    command
        .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
        .env_remove("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        .env("KEYFENCE_E2_URL", &rail_url)
        .env("KEYFENCE_LOG_FORMAT", "json")
        .env("KEYFENCE_RECOVERY_INTERVAL_MS", "0")
        .env("RUST_LOG", "debug,sqlx=warn,aws=info,hyper=info,h2=info,rustls=info");
    let (mut serve, logs) = ServeProcess::spawn_logged(command).await;

    let trace_id = "0af7651916cd43dd8448eb211c80319c";
    let created =
        pay_traced(&app, &serve.url, "traced-3", &format!("00-{trace_id}-b7ad6b7169203331-01"), "E2E-TRACED-3").await;
    assert_eq!(created.status(), Status::CREATED);
    assert!(serve.terminate().await.success());

    let lines: Vec<Value> = logs.lines().iter().filter_map(|l| serde_json::from_str(l).ok()).collect();
    let in_request: Vec<&Value> = lines
        .iter()
        .filter(|l| l["spans"].as_array().is_some_and(|spans| spans.iter().any(|s| s["name"] == "request")))
        .collect();
    assert!(in_request.len() >= 3, "the request logged lines: {lines:?}");
    for line in &in_request {
        assert!(line.to_string().contains(trace_id), "a line of the request without its trace id: {line}");
    }
    let rail_saw = rail_saw.lock().unwrap();
    assert!(rail_saw.iter().any(|parent| parent.contains(trace_id)), "the rail was sent the trace: {rail_saw:?}");
}

/// A read this region cannot answer is asked of the other regions with the
/// caller's trace (signed reads carry `traceparent` beside their
/// signature), with no exporter configured.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_asked_of_another_region_carries_the_callers_trace() {
    let app = spawn_app().await;
    let peer_saw = Arc::new(Mutex::new(Vec::new()));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let peer_url = format!("http://{}", listener.local_addr().unwrap());
    let saw = peer_saw.clone();
    let routes = Router::new().route(
        "/v1/payments/{id}",
        axum::routing::get(move |headers: HeaderMap| async move {
            let parent = headers.get("traceparent").and_then(|v| v.to_str().ok()).unwrap_or("-").to_owned();
            saw.lock().unwrap().push(parent);
            StatusCode::NOT_FOUND
        }),
    );
    tokio::spawn(async move { axum::serve(listener, routes).await.unwrap() });
    let regions = keyfence::regions::RegionStore::new(app.keys.store.client().clone(), app.keys.store.table());
    regions.advertise("test-9", &peer_url).await.unwrap();
    let mut command = keyfence_command(&app, "serve");
    command.env_remove("OTEL_EXPORTER_OTLP_ENDPOINT").env("KEYFENCE_RECOVERY_INTERVAL_MS", "0");
    let mut serve = ServeProcess::spawn(command).await;

    let trace_id = "5b8aa5a2d2c872e8321cf37308d69df2";
    let _ = app
        .http
        .get(format!("{}/v1/payments/{}", serve.url, uuid::Uuid::new_v4()))
        .bearer_auth(&app.api_key)
        .header("traceparent", format!("00-{trace_id}-051581bf3cb55c13-01"))
        .send()
        .await
        .unwrap();
    assert!(serve.terminate().await.success());
    let peer_saw = peer_saw.lock().unwrap();
    assert!(!peer_saw.is_empty(), "the other region was asked");
    assert!(peer_saw.iter().all(|parent| parent.contains(trace_id)), "it was sent the caller's trace: {peer_saw:?}");
}
