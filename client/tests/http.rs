//! The client against real HTTP servers on 127.0.0.1 that answer the way a
//! hostile, misbehaving or merely unusual server might: how long it waits,
//! how much it reads, what it tells the server about itself.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use axum::Router;
use axum::body::Body;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use futures::StreamExt;
use keyfence_client::{BuildError, Client, Outcome, PaymentRequest, PaymentStatus};

/// Serves `router` on a port of its own; its base URL.
async fn serve(router: Router) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
    url
}

fn request() -> PaymentRequest {
    PaymentRequest::new(1250, "EUR")
        .debtor_account("DE89370400440532013000")
        .creditor_account("FR1420041010050500013M02606")
        .end_to_end_id("E2E-1")
}

const PAYMENT_ID: &str = "0190c7a4-8a8e-7bd5-a5d6-0b9e3c7a1f00";

fn payment(status: &str) -> serde_json::Value {
    serde_json::json!({
        "id": PAYMENT_ID,
        "status": status,
        "amount_minor": 1250,
        "currency": "EUR",
        "end_to_end_id": "E2E-1",
    })
}

fn paid() -> Response {
    (StatusCode::CREATED, axum::Json(payment("succeeded"))).into_response()
}

/// A client of `url` that retries quickly and gives up after `deadline`.
fn client(url: &str, deadline: Duration) -> Client {
    Client::builder([url], "kf_test_secret")
        .deadline(deadline)
        .attempt_timeout(Duration::from_secs(5))
        .backoff(Duration::from_millis(10), Duration::from_millis(50))
        .build()
        .unwrap()
}

/// Answers the first `POST` with `first`, every later one as paid; counts them.
fn first_then_paid(first: fn() -> Response) -> (Router, Arc<AtomicUsize>) {
    let posts = Arc::new(AtomicUsize::new(0));
    let counted = posts.clone();
    let router = Router::new().route(
        "/v1/payments",
        post(move || {
            let n = counted.fetch_add(1, Ordering::SeqCst);
            async move { if n == 0 { first() } else { paid() } }
        }),
    );
    (router, posts)
}

#[tokio::test]
async fn a_retry_after_beyond_the_deadline_ends_the_call_pending_at_once() {
    let (router, posts) = first_then_paid(|| {
        (StatusCode::TOO_MANY_REQUESTS, [(header::RETRY_AFTER, u64::MAX.to_string())]).into_response()
    });
    let url = serve(router).await;
    let started = Instant::now();
    let receipt = client(&url, Duration::from_secs(10)).pay_with_key(&request(), "key-1").await.unwrap();
    assert!(matches!(receipt.outcome, Outcome::Pending { payment_id: None }), "{receipt:?}");
    assert!(started.elapsed() < Duration::from_secs(5), "waiting could only end at the deadline: it answers now");
    assert_eq!(posts.load(Ordering::SeqCst), 1, "no attempt before the server's time");
}

#[tokio::test]
async fn a_retry_after_given_as_an_http_date_is_waited_for() {
    let (router, posts) = first_then_paid(|| {
        let at = httpdate::fmt_http_date(SystemTime::now() + Duration::from_secs(3));
        (StatusCode::TOO_MANY_REQUESTS, [(header::RETRY_AFTER, at)]).into_response()
    });
    let url = serve(router).await;
    let started = Instant::now();
    let receipt = client(&url, Duration::from_secs(20)).pay_with_key(&request(), "key-1").await.unwrap();
    assert!(matches!(receipt.outcome, Outcome::Succeeded { .. }), "{receipt:?}");
    assert_eq!(posts.load(Ordering::SeqCst), 2);
    // The date has whole seconds: 3 s ahead is at least 2 s ahead.
    assert!(started.elapsed() >= Duration::from_secs(2), "retried after {:?}", started.elapsed());
}

#[tokio::test]
async fn an_answer_longer_than_any_keyfence_gives_is_not_read_to_its_end() {
    const CHUNK: usize = 64 * 1024;
    const CHUNKS: usize = 2048; // 128 MiB
    let sent = Arc::new(AtomicUsize::new(0));
    let posts = Arc::new(AtomicUsize::new(0));
    let router = Router::new().route(
        "/v1/payments",
        post({
            let (sent, posts) = (sent.clone(), posts.clone());
            move || {
                let first = posts.fetch_add(1, Ordering::SeqCst) == 0;
                let sent = sent.clone();
                async move {
                    if !first {
                        return paid();
                    }
                    let body = futures::stream::iter((0..CHUNKS).map(|_| Ok::<_, std::io::Error>(vec![b' '; CHUNK])))
                        .inspect(move |_| {
                            sent.fetch_add(CHUNK, Ordering::SeqCst);
                        });
                    (StatusCode::CREATED, Body::from_stream(body)).into_response()
                }
            }
        }),
    );
    let url = serve(router).await;
    let receipt = client(&url, Duration::from_secs(20)).pay_with_key(&request(), "key-1").await.unwrap();
    assert!(matches!(receipt.outcome, Outcome::Succeeded { .. }), "the retry reads a proper answer: {receipt:?}");
    let sent = sent.load(Ordering::SeqCst);
    assert!(sent < 32 << 20, "the client read {} MiB of an endless answer", sent >> 20);
}

#[tokio::test]
async fn every_request_names_the_client_and_its_version() {
    let agents = Arc::new(Mutex::new(Vec::new()));
    let router = Router::new()
        .route(
            "/v1/payments",
            post({
                let agents = agents.clone();
                move |headers: HeaderMap| async move {
                    agents.lock().unwrap().push(headers.get(header::USER_AGENT).cloned());
                    (StatusCode::ACCEPTED, axum::Json(serde_json::json!({ "id": PAYMENT_ID, "status": "pending" })))
                }
            }),
        )
        .route(
            "/v1/payments/{id}",
            get({
                let agents = agents.clone();
                move |headers: HeaderMap| async move {
                    agents.lock().unwrap().push(headers.get(header::USER_AGENT).cloned());
                    axum::Json(payment("succeeded"))
                }
            }),
        );
    let url = serve(router).await;
    let receipt = client(&url, Duration::from_secs(10)).pay_with_key(&request(), "key-1").await.unwrap();
    let Outcome::Succeeded { payment } = &receipt.outcome else { panic!("{receipt:?}") };
    assert_eq!(payment.status, PaymentStatus::Succeeded);
    let expected = format!("keyfence-client/{}", env!("CARGO_PKG_VERSION"));
    let agents = agents.lock().unwrap();
    assert_eq!(agents.len(), 2, "a payment and a poll");
    for agent in agents.iter() {
        assert_eq!(agent.as_ref().and_then(|a| a.to_str().ok()), Some(expected.as_str()));
    }
}

#[tokio::test]
async fn a_polled_payment_is_read_by_its_status() {
    let polls = Arc::new(AtomicUsize::new(0));
    let router = Router::new()
        .route(
            "/v1/payments",
            post(|| async { (StatusCode::ACCEPTED, axum::Json(serde_json::json!({ "id": PAYMENT_ID }))) }),
        )
        .route(
            "/v1/payments/{id}",
            get({
                let polls = polls.clone();
                move || async move {
                    let mut payment = payment("indeterminate");
                    if polls.fetch_add(1, Ordering::SeqCst) > 0 {
                        payment["status"] = "rejected".into();
                        payment["reason"] = "creditor_account_blocked".into();
                    }
                    axum::Json(payment)
                }
            }),
        );
    let url = serve(router).await;
    let receipt = client(&url, Duration::from_secs(10)).pay_with_key(&request(), "key-1").await.unwrap();
    match receipt.outcome {
        Outcome::Rejected { payment_id, reason } => {
            assert_eq!(payment_id.map(|id| id.to_string()).as_deref(), Some(PAYMENT_ID));
            assert_eq!(reason, "creditor_account_blocked");
        }
        other => panic!("indeterminate is polled on, rejected is final: {other:?}"),
    }
    assert_eq!(polls.load(Ordering::SeqCst), 2);
}

#[test]
fn a_region_is_refused_unless_it_is_https_or_this_machine() {
    let fine = [
        "https://pay.example",
        "https://pay.example:8443/",
        "http://localhost:8080",
        "http://LOCALHOST:8080",
        "http://127.0.0.1:8080",
        "http://127.9.8.7",
        "http://[::1]:8080",
    ];
    for url in fine {
        assert!(Client::builder([url], "kf_test_secret").build().is_ok(), "{url} is fine");
    }
    let insecure = [
        "http://pay.example",
        "http://10.0.0.1:8080",
        "http://[::2]:8080",
        "http://localhost.pay.example",
        "ftp://pay.example",
    ];
    for url in insecure {
        match Client::builder(["https://pay.example", url], "kf_test_secret").build() {
            Err(error @ BuildError::NotHttps { .. }) => assert!(error.to_string().contains(url), "{error}"),
            other => panic!("{url} is refused: {other:?}"),
        }
    }
    for url in ["pay.example", ""] {
        let refused = Client::builder([url], "kf_test_secret").build();
        assert!(matches!(refused, Err(BuildError::InvalidUrl { .. })), "{url}: {refused:?}");
    }
    let none: [&str; 0] = [];
    assert!(matches!(Client::builder(none, "kf_test_secret").build(), Err(BuildError::NoRegions)));
}

#[test]
fn the_api_key_never_shows_in_debug() {
    let builder = Client::builder(["https://pay.example"], "kf_test_secret");
    let shown = format!("{builder:?}");
    let shown = format!("{shown} {:?}", builder.build().unwrap());
    assert!(!shown.contains("kf_test_secret"), "{shown}");
    assert!(shown.contains("https://pay.example"), "{shown}");
}
