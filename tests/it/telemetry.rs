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

use crate::app::{payment, spawn_app};
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
    for expected in ["keyfence", "submit", "claim", "begin_phase", "send", "finish"] {
        assert!(contains(&exported, expected), "no {expected:?} in the exported spans");
    }
}
