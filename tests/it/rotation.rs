//! Keys can be rotated and revoked without a scan. A client rotates its key
//! and keeps its history: a retry with the new key of a request made with
//! the old one is a replay, and the old key works until its grace ends.
//! Revoking a key or a client, and listing clients, read only the clients'
//! own items, with 20,000 idempotency keys in the table (counted through an
//! HTTP proxy in front of DynamoDB). A pointer naming a client that never
//! took the key lets nobody in.

use std::collections::HashMap;
use std::time::Duration;

use aws_sdk_dynamodb::types::{AttributeValue, PutRequest, WriteRequest};
use futures::StreamExt;
use keyfence::clients::{CACHE_FOR, ClientsError};
use keyfence::domain::{ApiKey, ClientId};
use reqwest::StatusCode;
use serde_json::Value;

use crate::app::{TestApp, payment, spawn_app};
use crate::aws_calls::{operations, recording_proxy};
use crate::process::keyfence_command;

async fn cli(app: &TestApp, endpoint: Option<&str>, args: &[&str]) -> String {
    let mut command = keyfence_command(app, args[0]);
    if let Some(endpoint) = endpoint {
        command.env("AWS_ENDPOINT_URL", endpoint);
    }
    let out = command.args(&args[1..]).output().await.unwrap();
    assert!(out.status.success(), "keyfence {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rotated_key_keeps_the_clients_history_and_the_old_one_works_through_its_grace() {
    let app = spawn_app().await;
    let id = app.client_id().await.to_string();
    let body = payment("E2E-ROTATE-1");
    let first = app.pay("rotate-1", &body).await;
    assert_eq!(first.status(), StatusCode::CREATED);
    let first = first.bytes().await.unwrap();

    let rotated: Value =
        serde_json::from_str(&cli(&app, None, &["clients", "rotate", "--id", &id, "--grace", "3s", "--json"]).await)
            .unwrap();
    assert_eq!(rotated["client_id"], id.as_str());
    let new_key = rotated["api_key"].as_str().unwrap().to_owned();
    assert!(rotated["previous_key_valid_until"].is_string(), "{rotated}");

    // The retry with the new key is the same client's same request.
    let retried = app.pay_as(&new_key, "rotate-1", &body).await;
    assert_eq!(retried.status(), StatusCode::CREATED);
    assert_eq!(retried.headers()["idempotent-replayed"], "true");
    assert_eq!(retried.bytes().await.unwrap(), first, "the same bytes");
    // The old key works through its grace.
    assert_eq!(app.pay("rotate-2", &payment("E2E-ROTATE-2")).await.status(), StatusCode::CREATED);
    app.clock.advance(Duration::from_secs(3) + CACHE_FOR);
    assert_eq!(app.pay("rotate-3", &payment("E2E-ROTATE-3")).await.status(), StatusCode::UNAUTHORIZED, "past it");
    assert_eq!(app.pay_as(&new_key, "rotate-3", &payment("E2E-ROTATE-3")).await.status(), StatusCode::CREATED);
    assert_eq!(app.e2.statement().await.len(), 3, "one instruction per payment, none for the replay");

    let listed: Value =
        serde_json::from_str(&cli(&app, None, &["clients", "keys", "--id", &id, "--json"]).await).unwrap();
    let listed = listed.as_array().unwrap();
    assert_eq!(listed.len(), 2);
    assert!(listed[0]["valid_until"].is_u64() && listed[1]["valid_until"].is_null(), "{listed:?}");
}

/// Puts `count` idempotency-key items of `client` into the table.
async fn fill(app: &TestApp, client: ClientId, count: usize) {
    let dynamo = app.keys.store.client().clone();
    let table = app.keys.store.table().to_owned();
    let batches = (0..count).collect::<Vec<_>>();
    let written = futures::stream::iter(batches.chunks(25).map(|chunk| {
        let requests = chunk
            .iter()
            .map(|i| {
                let item = HashMap::from([
                    ("pk".to_owned(), AttributeValue::S(format!("{client}#filler-{i}"))),
                    ("state".to_owned(), AttributeValue::S("finished".into())),
                ]);
                WriteRequest::builder().put_request(PutRequest::builder().set_item(Some(item)).build().unwrap()).build()
            })
            .collect::<Vec<_>>();
        let (dynamo, table) = (dynamo.clone(), table.clone());
        async move {
            let mut pending = Some(requests);
            while let Some(requests) = pending.take() {
                let out = dynamo.batch_write_item().request_items(&table, requests).send().await.unwrap();
                pending = out.unprocessed_items().and_then(|u| u.get(&table)).cloned().filter(|r| !r.is_empty());
            }
        }
    }))
    .buffer_unordered(8)
    .collect::<Vec<()>>()
    .await;
    assert_eq!(written.len(), count.div_ceil(25));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn revoking_and_listing_read_only_the_clients_items_among_20000_keys() {
    let app = spawn_app().await;
    let client = app.client_id().await;
    fill(&app, client, 20_000).await;
    let (other, other_key) = app.add_client().await;
    let endpoint = app.keys.settings.aws_endpoint_url.clone().unwrap();
    let (proxy, calls) = recording_proxy(endpoint).await;
    let through = Some(proxy.url.as_str());

    let listed: Value = serde_json::from_str(&cli(&app, through, &["clients", "list", "--json"]).await).unwrap();
    assert_eq!(listed.as_array().unwrap().len(), 2);
    let listing = operations(&calls);
    assert!(listing.iter().all(|op| op == "Query" || op == "BatchGetItem"), "listing: {listing:?}");
    assert!(listing.len() <= 2, "listing: {listing:?}");

    let key_id = ApiKey::presented(&app.api_key).digest()[..12].to_owned();
    cli(&app, through, &["clients", "revoke", "--id", &client.to_string(), "--key", &key_id]).await;
    let one_key = operations(&calls);
    // The record read and changed, then the change log read and written.
    assert_eq!(one_key, ["GetItem", "UpdateItem", "GetItem", "PutItem"], "revoking a key");
    cli(&app, through, &["clients", "revoke", "--id", &other.to_string()]).await;
    let a_client = operations(&calls);
    assert_eq!(a_client, ["UpdateItem", "GetItem", "PutItem"], "revoking a client");

    app.clock.advance(CACHE_FOR);
    assert_eq!(app.pay("revoked-1", &payment("E2E-REVOKED-1")).await.status(), StatusCode::UNAUTHORIZED);
    assert_eq!(app.pay_as(&other_key, "revoked-2", &payment("E2E-REVOKED-2")).await.status(), StatusCode::UNAUTHORIZED);
}

#[tokio::test]
async fn a_key_is_minted_only_through_a_live_clients_record() {
    let app = spawn_app().await;
    let clients = app.clients();
    let nobody = ClientId::generate();
    assert!(matches!(clients.rotate(nobody, Duration::ZERO).await, Err(ClientsError::Unknown(_))));
    let (other, _) = app.add_client().await;
    clients.revoke(other).await.unwrap();
    assert!(matches!(clients.rotate(other, Duration::ZERO).await, Err(ClientsError::Revoked(_))));

    // Items naming a client that never took the key, in the layout of
    // today and of before: neither lets anyone in.
    let forged = ApiKey::generate();
    let client = app.client_id().await;
    let table = app.keys.store.table();
    for (pk, kind) in [
        (format!("control#clients#key#{}", forged.digest()), "api_key"),
        (format!("control#client#{}", forged.digest()), "client"),
    ] {
        app.keys
            .store
            .client()
            .put_item()
            .table_name(table)
            .item("pk", AttributeValue::S(pk))
            .item("kind", AttributeValue::S(kind.into()))
            .item("client_id", AttributeValue::S(client.to_string()))
            .item("name", AttributeValue::S("forged".into()))
            .item("created_at", AttributeValue::N("0".into()))
            .send()
            .await
            .unwrap();
    }
    let refused = app.pay_as(forged.reveal(), "forged-1", &payment("E2E-FORGED")).await;
    assert_eq!(refused.status(), StatusCode::UNAUTHORIZED);
    assert_eq!(app.key_items().await, 0, "nothing claimed");
}
