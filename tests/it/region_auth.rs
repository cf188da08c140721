//! Regions prove who they are to each other. A URL in the key table that
//! points at something else (here a server recording what it is sent and
//! answering forged payments) receives no client's API key and is not
//! believed, nor can it relay what it was sent to the region meant; a
//! forwarded read with a wrong signature or a stale time is refused with
//! 401, and a right one is answered, signed; while the secret is rotated,
//! either of two secrets is accepted.

use std::sync::{Arc, Mutex};

use axum::extract::{Path, State};
use axum::http::{HeaderMap, Uri};
use axum::routing::get;
use axum::{Json, Router};
use keyfence::domain::RegionSecret;
use keyfence::http::Asking;
use keyfence::regions::RegionStore;
use keyfence::startup::REGION_VIEW_AGE;
use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::app::{REGION_SECRET, TestApp, TestRail, spawn_app, spawn_app_with};

/// Every request a server was sent: its path and query, and its headers.
type Seen = Arc<Mutex<Vec<(String, HeaderMap)>>>;

/// A server that records every request it is sent and answers any payment
/// asked for as succeeded, and any listing with a forged payment.
async fn recorder() -> (TestRail, Seen) {
    let seen: Seen = Arc::default();
    async fn record(seen: &Seen, uri: &Uri, headers: &HeaderMap) {
        let target = uri.path_and_query().map_or("/", |p| p.as_str()).to_owned();
        seen.lock().unwrap().push((target, headers.clone()));
    }
    let router = Router::new()
        .route(
            "/v1/payments/{id}",
            get(|State(seen): State<Seen>, uri: Uri, headers: HeaderMap, Path(id): Path<String>| async move {
                record(&seen, &uri, &headers).await;
                Json(json!({ "id": id, "status": "succeeded", "amount_minor": 1, "currency": "EUR" }))
            }),
        )
        .route(
            "/v1/payments",
            get(|State(seen): State<Seen>, uri: Uri, headers: HeaderMap| async move {
                record(&seen, &uri, &headers).await;
                Json(json!({ "data": [{ "id": uuid::Uuid::new_v4(), "end_to_end_id": "E2E-FORGED", "status": "succeeded" }] }))
            }),
        )
        .with_state(seen.clone());
    (TestRail::serving(router).await, seen)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_url_in_the_key_table_gets_no_api_key_and_its_forged_answers_are_not_shown() {
    let app = spawn_app().await;
    let (evil, seen) = recorder().await;
    let store = RegionStore::new(app.keys.store.client().clone(), app.keys.store.table());
    store.advertise("test-9", &evil.url).await.unwrap();
    app.clock.advance(REGION_VIEW_AGE);

    let id = uuid::Uuid::new_v4();
    let one = app.get_as(&app.api_key, &format!("/v1/payments/{id}")).await;
    assert_eq!(one.status(), StatusCode::SERVICE_UNAVAILABLE, "the forged payment is not shown");
    assert_eq!(one.json::<Value>().await.unwrap()["type"], "urn:keyfence:problem:region-unreachable");
    let listed = app.get_as(&app.api_key, "/v1/payments?end_to_end_id=E2E-FORGED").await;
    assert_eq!(listed.status(), StatusCode::SERVICE_UNAVAILABLE, "nor the forged listing");

    let seen = seen.lock().unwrap().clone();
    assert!(seen.len() >= 2, "the recorder was asked: {seen:?}");
    let sent: Vec<String> = seen
        .iter()
        .flat_map(|(_, headers)| headers.iter().map(|(name, value)| format!("{name}: {}", value.to_str().unwrap())))
        .collect();
    assert!(!sent.iter().any(|h| h.contains(&app.api_key)), "no API key was sent: {sent:?}");
    assert!(!sent.iter().any(|h| h.starts_with("authorization")), "no credentials at all: {sent:?}");

    // What it was sent, relayed to a region's front door (here this one,
    // as if the table had named it test-9), is refused: it was signed for
    // the recorder's address, not the region's.
    store.advertise("test-9", &app.url).await.unwrap();
    for (target, headers) in seen {
        let mut relayed = app.http.get(format!("{}{target}", app.url));
        for (name, value) in headers.iter().filter(|(name, _)| name.as_str().starts_with("keyfence-")) {
            relayed = relayed.header(name, value);
        }
        assert_eq!(relayed.send().await.unwrap().status(), StatusCode::UNAUTHORIZED, "relayed {target}");
    }
}

/// A forwarded read as another region would send it, signed with `secret`
/// at `at` (seconds since the epoch).
async fn forwarded(app: &TestApp, secret: &str, at: u64, path: &str) -> reqwest::Response {
    let client = app.client_id().await;
    let authority = app.url.trim_start_matches("http://");
    let asking = Asking { method: "GET", authority, target: path, region: "test-1", from: "test-2", client, at };
    let (headers, _) = RegionSecret::new(secret).unwrap().sign(&asking);
    let mut request = app.http.get(format!("{}{path}", app.url));
    for (name, value) in headers {
        request = request.header(name, value);
    }
    request.send().await.unwrap()
}

#[tokio::test]
async fn a_forwarded_read_with_a_bad_signature_or_a_stale_time_gets_401() {
    let app = spawn_app().await;
    let path = format!("/v1/payments/{}", uuid::Uuid::new_v4());
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs();

    let wrong = forwarded(&app, "not the deployment's secret, though long enough", now, &path).await;
    assert_eq!(wrong.status(), StatusCode::UNAUTHORIZED, "a wrong signature");
    let stale = forwarded(&app, REGION_SECRET, now - 120, &path).await;
    assert_eq!(stale.status(), StatusCode::UNAUTHORIZED, "a stale timestamp");
    // A client marking its own request forwarded is refused too.
    let pretending = app
        .http
        .get(format!("{}{path}", app.url))
        .bearer_auth(&app.api_key)
        .header("keyfence-forwarded", "test-1")
        .send()
        .await
        .unwrap();
    assert_eq!(pretending.status(), StatusCode::UNAUTHORIZED, "a client posing as a region");

    let right = forwarded(&app, REGION_SECRET, now, &path).await;
    assert_eq!(right.status(), StatusCode::NOT_FOUND, "a region's read is answered from this ledger");
    assert!(right.headers().contains_key("keyfence-signature"), "and its answer signed");
}

/// While the region secret is rotated, a region accepts reads signed with
/// either secret and signs its answers with its own; one not rotating
/// refuses the other secret.
#[tokio::test]
async fn during_a_rotation_reads_signed_with_either_secret_are_answered() {
    const NEXT: &str = "the deployment's next region secret, 32 bytes or more";
    let current = RegionSecret::new(REGION_SECRET).unwrap();
    let rotating = current.clone().also_accepting(&RegionSecret::new(NEXT).unwrap());
    let app = spawn_app_with(|s| s.region_secret = Some(rotating)).await;
    let path = format!("/v1/payments/{}", uuid::Uuid::new_v4());
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs();
    for secret in [REGION_SECRET, NEXT] {
        let read = forwarded(&app, secret, now, &path).await;
        assert_eq!(read.status(), StatusCode::NOT_FOUND, "signed with the secret {secret:?}: answered");
    }
    let other = forwarded(&app, "neither of the two secrets, though long enough", now, &path).await;
    assert_eq!(other.status(), StatusCode::UNAUTHORIZED);

    let plain = spawn_app().await;
    let path = format!("/v1/payments/{}", uuid::Uuid::new_v4());
    assert_eq!(forwarded(&plain, NEXT, now, &path).await.status(), StatusCode::UNAUTHORIZED, "not rotating");
}
