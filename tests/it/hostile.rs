//! Input an attacker would send. Every answer is a clear problem+json error
//! (never a 500, never text/plain, never an empty body), nothing reaches the
//! key store, the ledger or a rail, and a client that holds a connection
//! open (trickling headers or a body, or idling) is cut off while others
//! are still served.

use std::time::{Duration, Instant};

use reqwest::StatusCode;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::app::{TestApp, payment, spawn_app, spawn_app_with};

/// A problem+json answer with `status`; its body.
async fn problem(response: reqwest::Response, status: StatusCode, case: &str) -> Value {
    assert_eq!(response.status(), status, "{case}");
    assert_eq!(response.headers()["content-type"], "application/problem+json", "{case}");
    let body: Value = response.json().await.unwrap_or_else(|e| panic!("{case}: not JSON: {e}"));
    assert_eq!(body["status"], status.as_u16(), "{case}");
    body
}

async fn assert_nothing_happened(app: &TestApp) {
    assert_eq!(app.key_items().await, 0, "nothing in the key store");
    assert_eq!(app.count("requests").await, 0, "nothing in the ledger");
    assert!(app.e1.statement().await.is_empty() && app.e2.statement().await.is_empty(), "nothing at the rails");
}

#[tokio::test]
async fn bodies_that_are_not_exactly_a_payment_are_refused() {
    let app = spawn_app().await;
    let post = |key: &'static str, body: String| {
        app.http
            .post(format!("{}/v1/payments", app.url))
            .bearer_auth(&app.api_key)
            .header("Idempotency-Key", key)
            .header("content-type", "application/json")
            .body(body)
            .send()
    };
    let valid = payment("E2E-HOSTILE");
    let array = json!([1250, "EUR", "DE89370400440532013000", "FR1420041010050500013M02606", "E2E-ARRAY", "x"]);
    let duplicated = valid.to_string().replacen("{", "{\"amount_minor\":1,", 1);
    let mut null_remittance = valid.clone();
    null_remittance["remittance_info"] = Value::Null;
    let mut nul = valid.clone();
    nul["end_to_end_id"] = json!("a\u{0}b");
    let cases = [
        ("an array", post("h-1", array.to_string()).await.unwrap(), "body"),
        ("a key twice", post("h-2", duplicated).await.unwrap(), ""),
        ("a null remittance", post("h-3", null_remittance.to_string()).await.unwrap(), "remittance_info"),
        ("a NUL in a field", post("h-4", nul.to_string()).await.unwrap(), "end_to_end_id"),
    ];
    for (case, response, field) in cases {
        let body = problem(response, StatusCode::BAD_REQUEST, case).await;
        if !field.is_empty() {
            assert_eq!(body["errors"][0]["field"], field, "{case}");
        }
    }
    let twice = app
        .http
        .post(format!("{}/v1/payments", app.url))
        .bearer_auth(&app.api_key)
        .header("Idempotency-Key", "h-5")
        .header("Idempotency-Key", "h-6")
        .json(&valid)
        .send()
        .await
        .unwrap();
    problem(twice, StatusCode::BAD_REQUEST, "two Idempotency-Key headers").await;
    assert_nothing_happened(&app).await;

    let lowercase = app
        .http
        .post(format!("{}/v1/payments", app.url))
        .header("authorization", format!("bearer {}", app.api_key))
        .header("Idempotency-Key", "h-7")
        .json(&valid)
        .send()
        .await
        .unwrap();
    assert_eq!(lowercase.status(), StatusCode::CREATED, "the auth scheme is case-insensitive");
}

#[tokio::test]
async fn queries_paths_and_routes_answer_problems() {
    let app = spawn_app().await;
    let too_long = format!("/v1/payments?end_to_end_id={}", "x".repeat(36));
    let bad_requests = [
        ("a NUL reference", "/v1/payments?end_to_end_id=%00"),
        ("a NUL inside a reference", "/v1/payments?end_to_end_id=a%00b"),
        ("an empty reference", "/v1/payments?end_to_end_id="),
        ("a reference of 36", too_long.as_str()),
        ("a parameter twice", "/v1/payments?end_to_end_id=a&end_to_end_id=b"),
        ("a key not UTF-8", "/v1/idempotency-keys/%FF"),
    ];
    for (case, path) in bad_requests {
        problem(app.get_as(&app.api_key, path).await, StatusCode::BAD_REQUEST, case).await;
    }
    for (case, path) in [
        ("an id not UTF-8", "/v1/payments/%FF"),
        ("an unknown route", "/v1/refunds"),
        ("a trailing slash", "/v1/payments/"),
        ("the root", "/"),
    ] {
        problem(app.get_as(&app.api_key, path).await, StatusCode::NOT_FOUND, case).await;
    }
    let delete = app.http.delete(format!("{}/v1/payments", app.url)).send().await.unwrap();
    problem(delete, StatusCode::METHOD_NOT_ALLOWED, "a method the route lacks").await;
    let listed = app.get_as(&app.api_key, "/v1/payments?end_to_end_id=x&other=1").await;
    assert_eq!(listed.status(), StatusCode::OK, "unknown parameters are ignored");
}

/// Sends raw bytes on a new connection; what came back before it closed
/// (or before `wait` ran out).
async fn raw(app: &TestApp, bytes: &[u8], wait: Duration) -> (String, Duration) {
    let started = Instant::now();
    let mut stream = TcpStream::connect(app.url.trim_start_matches("http://")).await.unwrap();
    stream.write_all(bytes).await.unwrap();
    let (mut answer, mut chunk) = (Vec::new(), [0_u8; 4096]);
    let deadline = tokio::time::Instant::now() + wait;
    while let Ok(Ok(n)) = tokio::time::timeout_at(deadline, stream.read(&mut chunk)).await {
        if n == 0 {
            break;
        }
        answer.extend_from_slice(&chunk[..n]);
    }
    (String::from_utf8_lossy(&answer).into_owned(), started.elapsed())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_clients_are_cut_off_while_others_are_served() {
    let app = spawn_app_with(|s| {
        s.header_timeout = Duration::from_millis(800);
        s.body_timeout = Duration::from_millis(800);
    })
    .await;
    let host = app.url.trim_start_matches("http://").to_owned();
    let auth = format!("Authorization: Bearer {}\r\n", app.api_key);

    // Headers that never finish, a body that never comes, a declared body
    // far over the limit, and a connection that just sits there.
    let headers_only = format!("POST /v1/payments HTTP/1.1\r\nHost: {host}\r\n");
    let trickled = raw(&app, headers_only.as_bytes(), Duration::from_secs(5));
    let half_body = format!(
        "POST /v1/payments HTTP/1.1\r\nHost: {host}\r\n{auth}Idempotency-Key: slow-1\r\n\
         Content-Type: application/json\r\nContent-Length: 200\r\n\r\n{{\"amount_minor\":"
    );
    let stalled = raw(&app, half_body.as_bytes(), Duration::from_secs(5));
    let huge = format!(
        "POST /v1/payments HTTP/1.1\r\nHost: {host}\r\n{auth}Idempotency-Key: huge-1\r\n\
         Content-Type: application/json\r\nContent-Length: 10000000\r\n\r\n"
    );
    let oversized = raw(&app, huge.as_bytes(), Duration::from_millis(500));
    let idle = raw(&app, b"", Duration::from_secs(5));
    let served = async {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let started = Instant::now();
        let response = app.pay("meanwhile-1", &payment("E2E-MEANWHILE")).await;
        (response.status(), started.elapsed())
    };
    let ((trickled, t1), (stalled, t2), (oversized, t3), (idle, t4), (status, t5)) =
        tokio::join!(trickled, stalled, oversized, idle, served);

    assert!(trickled.is_empty() && t1 < Duration::from_secs(3), "trickled headers: closed after the limit ({t1:?})");
    assert!(stalled.starts_with("HTTP/1.1 408"), "a stalled body is a 408: {stalled}");
    assert!(stalled.contains("application/problem+json") && t2 < Duration::from_secs(3), "{t2:?}");
    assert!(oversized.starts_with("HTTP/1.1 413"), "an oversized declared body at once: {oversized}");
    assert!(t3 < Duration::from_millis(500));
    assert!(idle.is_empty() && t4 < Duration::from_secs(3), "an idle connection is closed ({t4:?})");
    assert_eq!(status, StatusCode::CREATED, "others are served meanwhile");
    assert!(t5 < Duration::from_secs(3), "and promptly ({t5:?})");
    assert_eq!(app.count("payments").await, 1, "only the honest payment");
    assert_eq!(app.e2.statement().await.len(), 1);
}

/// A webhook endpoint whose body never comes in full is a 408 too, like a
/// payment's, and nothing is registered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_webhook_registration_is_a_408() {
    let app = spawn_app_with(|s| s.body_timeout = Duration::from_millis(800)).await;
    let host = app.url.trim_start_matches("http://").to_owned();
    let half_body = format!(
        "POST /v1/webhook-endpoints HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {}\r\n\
         Content-Type: application/json\r\nContent-Length: 200\r\n\r\n{{\"url\":",
        app.api_key
    );
    let (stalled, _) = raw(&app, half_body.as_bytes(), Duration::from_secs(5)).await;
    assert!(stalled.starts_with("HTTP/1.1 408"), "a stalled body is a 408: {stalled}");
    let listed = app.get_as(&app.api_key, "/v1/webhook-endpoints").await.json::<Value>().await.unwrap();
    assert_eq!(listed["data"], serde_json::json!([]));
}
