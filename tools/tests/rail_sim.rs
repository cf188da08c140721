//! `keyfence-tools rail-sim --notify URL --notify-secret S` as a process:
//! an instruction it applies is notified to URL, signed with S (checked
//! with keyfence's own verifier), and sent again until it is taken.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use keyfence::domain::webhook_signature as signature;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Command;

const SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rail_sim_started_to_notify_posts_signed_notifications_until_taken() {
    // A callback that refuses the first attempt and keeps what it verified.
    let seen: Arc<Mutex<Vec<(bool, serde_json::Value)>>> = Arc::default();
    let kept = seen.clone();
    let callback = axum::Router::new().route(
        "/hook",
        axum::routing::post(move |headers: axum::http::HeaderMap, body: axum::body::Bytes| {
            let kept = kept.clone();
            async move {
                let header = |name: &str| headers[name].to_str().unwrap().to_owned();
                let now = time::OffsetDateTime::now_utc().unix_timestamp();
                let timestamp = header("webhook-timestamp").parse().unwrap();
                let valid = signature::verify(
                    SECRET,
                    &header("webhook-id"),
                    timestamp,
                    &body,
                    &header("webhook-signature"),
                    now,
                );
                let mut kept = kept.lock().unwrap();
                kept.push((valid, serde_json::from_slice(&body).unwrap()));
                if kept.len() == 1 { axum::http::StatusCode::SERVICE_UNAVAILABLE } else { axum::http::StatusCode::OK }
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let hook = format!("http://{}/hook", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, callback).await });

    let mut sim = Command::new(env!("CARGO_BIN_EXE_keyfence-tools"))
        .args(["rail-sim", "--listen", "127.0.0.1:0", "--name", "e2", "--notify", &hook, "--notify-secret", SECRET])
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let first = BufReader::new(sim.stdout.take().unwrap()).lines().next_line().await.unwrap().unwrap();
    let url = first.split_once("listening on ").unwrap().1.to_owned();
    let instruction = serde_json::json!({
        "end_to_end_id": "E2E-1", "amount_minor": 100, "currency": "EUR",
        "debtor_account": "DE89370400440532013000", "creditor_account": "FR1420041010050500013M02606",
    });
    let sent = reqwest::Client::new()
        .post(format!("{url}/v1/instructions"))
        .header("idempotency-key", "k-1")
        .json(&instruction)
        .send()
        .await
        .unwrap();
    assert_eq!(sent.status(), reqwest::StatusCode::CREATED);

    for _ in 0..100 {
        if seen.lock().unwrap().len() >= 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 2, "refused once, sent again, then taken: {seen:?}");
    assert!(seen.iter().all(|(valid, _)| *valid), "signed with the secret");
    assert_eq!(seen[0].1, seen[1].1, "the same notification both times");
    assert_eq!(seen[0].1["type"], "instruction.applied");
    assert_eq!(seen[0].1["applied"]["idempotency_key"], "k-1");
}
