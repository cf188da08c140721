//! Webhook endpoints: a client registers, lists and removes its own, the
//! signing secret is shown once, another client's are not found, a URL
//! inside the network is refused unless the operator allows it, a client
//! whose names never resolve holds up only itself, and an operator manages
//! them from the CLI, rotating a secret with a grace.

use std::net::Ipv4Addr;
use std::sync::atomic::Ordering;
use std::time::Duration;

use futures::future::join_all;
use keyfence::webhooks::names::PER_CLIENT;
use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::app::{TestApp, spawn_app, spawn_app_with};
use crate::dns::TestDns;
use crate::process::keyfence_command;

async fn register(app: &TestApp, api_key: &str, body: Value) -> reqwest::Response {
    app.http.post(format!("{}/v1/webhook-endpoints", app.url)).bearer_auth(api_key).json(&body).send().await.unwrap()
}

async fn listed(app: &TestApp, api_key: &str) -> Vec<Value> {
    let list = app.get_as(api_key, "/v1/webhook-endpoints").await;
    assert_eq!(list.status(), StatusCode::OK);
    list.json::<Value>().await.unwrap()["data"].as_array().unwrap().clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_registers_lists_and_removes_its_own_endpoints_and_sees_the_secret_once() {
    let app = spawn_app().await;
    let made =
        register(&app, &app.api_key, json!({ "url": "http://127.0.0.1:9/hooks", "events": ["payment.succeeded"] }))
            .await;
    assert_eq!(made.status(), StatusCode::CREATED);
    let made: Value = made.json().await.unwrap();
    let secret = made["secret"].as_str().unwrap();
    assert!(secret.starts_with("whsec_"), "{made}");
    assert_eq!(made["events"], json!(["payment.succeeded"]));

    let mine = listed(&app, &app.api_key).await;
    assert_eq!(mine.len(), 1);
    assert_eq!(mine[0]["id"], made["id"]);
    assert!(!mine[0].to_string().contains(secret) && mine[0].get("secret").is_none(), "no secret in a listing");

    let (_, other_key) = app.add_client().await;
    assert!(listed(&app, &other_key).await.is_empty(), "another client sees none");
    let path = format!("{}/v1/webhook-endpoints/{}", app.url, made["id"].as_str().unwrap());
    let theirs = app.http.delete(&path).bearer_auth(&other_key).send().await.unwrap();
    assert_eq!(theirs.status(), StatusCode::NOT_FOUND, "nor removes it");
    let removed = app.http.delete(&path).bearer_auth(&app.api_key).send().await.unwrap();
    assert_eq!(removed.status(), StatusCode::NO_CONTENT);
    assert!(listed(&app, &app.api_key).await.is_empty());
    let again = app.http.delete(&path).bearer_auth(&app.api_key).send().await.unwrap();
    assert_eq!(again.status(), StatusCode::NOT_FOUND);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn endpoints_inside_the_network_or_in_clear_are_refused_unless_allowed() {
    let app = spawn_app_with(|s| s.webhooks_allow_private = false).await;
    for url in [
        "http://93.184.216.34/hooks",
        "https://127.0.0.1/hooks",
        "https://10.1.2.3/hooks",
        "https://169.254.169.254/latest/meta-data",
        "https://[::1]/hooks",
        "https://localhost/hooks",
    ] {
        let refused = register(&app, &app.api_key, json!({ "url": url, "events": ["payment.succeeded"] })).await;
        assert_eq!(refused.status(), StatusCode::BAD_REQUEST, "{url}");
        let problem: Value = refused.json().await.unwrap();
        assert_eq!(problem["errors"][0]["field"], "url", "{url}: {problem}");
    }
    let unknown =
        register(&app, &app.api_key, json!({ "url": "https://93.184.216.34/h", "events": ["payment.created"] })).await;
    assert_eq!(unknown.status(), StatusCode::BAD_REQUEST);
    let extra = register(&app, &app.api_key, json!({ "url": "https://93.184.216.34/h", "events": [], "x": 1 })).await;
    assert_eq!(extra.status(), StatusCode::BAD_REQUEST);
    assert!(listed(&app, &app.api_key).await.is_empty(), "nothing was kept");
}

/// Registrations racing each other are all kept; past the limit, 422.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_registrations_are_all_kept_up_to_the_limit() {
    let app = spawn_app().await;
    let body = |i: usize| json!({ "url": format!("http://127.0.0.1:9/hooks/{i}"), "events": ["payment.rejected"] });
    let made = join_all((0..4).map(|i| register(&app, &app.api_key, body(i)))).await;
    assert!(
        made.iter().all(|r| r.status() == StatusCode::CREATED),
        "{:?}",
        made.iter().map(|r| r.status()).collect::<Vec<_>>()
    );
    for i in 4..keyfence::webhooks::MAX_ENDPOINTS {
        assert_eq!(register(&app, &app.api_key, body(i)).await.status(), StatusCode::CREATED);
    }
    assert_eq!(listed(&app, &app.api_key).await.len(), keyfence::webhooks::MAX_ENDPOINTS);
    let over = register(&app, &app.api_key, body(99)).await;
    assert_eq!(over.status(), StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(over.json::<Value>().await.unwrap()["limit"], "webhook_endpoints");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_adds_rotates_and_removes_an_endpoint_from_the_cli() {
    let app = spawn_app().await;
    let client = app.client_id().await.to_string();
    let run = |args: &[&str]| {
        let mut command = keyfence_command(&app, "webhooks");
        command.args(args).env("KEYFENCE_WEBHOOKS_ALLOW_PRIVATE", "1").stdout(std::process::Stdio::piped());
        command
    };
    let out =
        run(&["add", "--client", &client, "--url", "http://127.0.0.1:9/ops", "--event", "payment.succeeded", "--json"])
            .output()
            .await
            .unwrap();
    assert!(out.status.success());
    let added: Value = serde_json::from_slice(&out.stdout).unwrap();
    let id = added["id"].as_str().unwrap().to_owned();

    let out =
        run(&["rotate-secret", "--client", &client, "--id", &id, "--grace", "1h", "--json"]).output().await.unwrap();
    assert!(out.status.success());
    let rotated: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_ne!(rotated["secret"], added["secret"]);
    let store = app.endpoints().await;
    let endpoint = store.list(app.client_id().await).await.unwrap().remove(0);
    let now = keyfence::domain::Millis::now().get();
    let opened = store.signing_secrets(app.client_id().await, &endpoint, now).await.unwrap();
    let signing: Vec<&str> = opened.iter().map(|s| s.value.as_str()).collect();
    assert_eq!(
        signing,
        [rotated["secret"].as_str().unwrap(), added["secret"].as_str().unwrap()],
        "both sign for the grace"
    );
    assert!(endpoint.secrets[1].valid_until.is_some_and(|until| until > now + 3_500_000));

    let out = run(&["list", "--client", &client]).output().await.unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains(&id) && !text.contains("whsec_"), "{text}");
    assert!(run(&["remove", "--client", &client, "--id", &id]).output().await.unwrap().status.success());
    assert!(listed(&app, &app.api_key).await.is_empty());
    let strict = keyfence_command(&app, "webhooks")
        .args(["add", "--client", &client, "--url", "http://127.0.0.1:9/ops", "--event", "payment.succeeded"])
        .env_remove("KEYFENCE_WEBHOOKS_ALLOW_PRIVATE")
        .output()
        .await
        .unwrap();
    assert!(!strict.status.success(), "plain http refused without the dev setting");
}

/// A client registering endpoints whose names never resolve (its zone's
/// name servers do not answer) waits on its own lookups only: past its
/// share of lookups at once it is told to retry (503), and every other
/// client's registration is looked up and kept meanwhile. (With one pool of
/// name-lookup slots for the process, held until the system's resolver
/// gave up, such a client made everyone's registrations 503.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn names_that_never_resolve_hold_up_only_their_own_client() {
    let public = Ipv4Addr::new(93, 184, 216, 34);
    let dns = TestDns::start(&[("hooks.honest.test", public)], "silent.test").await;
    let app = spawn_app_with(|s| {
        s.webhooks_allow_private = false;
        s.webhooks_resolver = Some(dns.addr);
    })
    .await;
    let (_, flooder) = app.add_client().await;
    let flood = join_all((0..12).map(|i| {
        let url = format!("https://h{i}.silent.test/hooks");
        register(&app, &flooder, json!({ "url": url, "events": ["payment.succeeded"] }))
    }));
    let honest = async {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let body = json!({ "url": "https://hooks.honest.test/in", "events": ["payment.succeeded"] });
        let made = register(&app, &app.api_key, body).await;
        let status = made.status();
        (status, made.json::<Value>().await.unwrap())
    };
    let (flooded, (status, made)) = tokio::join!(flood, honest);
    assert_eq!(status, StatusCode::CREATED, "the other client's endpoint was looked up and kept: {made}");
    let count = |wanted: StatusCode| flooded.iter().filter(|r| r.status() == wanted).count();
    assert_eq!(count(StatusCode::BAD_REQUEST), PER_CLIENT, "its own share looked up, found nothing public");
    assert_eq!(count(StatusCode::SERVICE_UNAVAILABLE), 12 - PER_CLIENT, "the rest told to retry");
    let retry = flooded.iter().find(|r| r.status() == StatusCode::SERVICE_UNAVAILABLE).unwrap();
    assert!(retry.headers().contains_key("retry-after"), "{:?}", retry.headers());
    assert!(dns.unanswered.load(Ordering::Relaxed) >= PER_CLIENT, "the silent zone was asked");
    assert!(listed(&app, &flooder).await.is_empty());
    assert_eq!(listed(&app, &app.api_key).await.len(), 1);
}
