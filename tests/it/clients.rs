//! API clients are global: created once with `keyfence clients add`, a
//! client works in every region; revoked once, it is refused in every
//! region within the documented delay; and clients an older keyfence kept
//! in a region's ledger are carried into the key table by `migrate`.

use std::time::{Duration, Instant};

use keyfence::clients::CACHE_FOR;
use keyfence::domain::ApiKey;
use reqwest::StatusCode;
use serde_json::Value;

use crate::app::{DEBTOR, payment, spawn_app};
use crate::process::keyfence_command;

async fn cli(app: &crate::app::TestApp, args: &[&str]) -> String {
    let out = keyfence_command(app, args[0]).args(&args[1..]).output().await.unwrap();
    assert!(out.status.success(), "keyfence {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_created_once_works_everywhere_and_revoked_once_nowhere() {
    let app = spawn_app().await;
    let b = app.second_region("test-2").await;
    let created: Value =
        serde_json::from_str(&cli(&app, &["clients", "add", "--name", "acme", "--account", DEBTOR, "--json"]).await)
            .unwrap();
    let (id, key) = (created["client_id"].as_str().unwrap(), created["api_key"].as_str().unwrap());

    for (i, url) in [&app.url, &b.url].into_iter().enumerate() {
        let paid = app.try_pay_at(url, key, &format!("acme-{i}"), &payment("E2E-ACME")).await.unwrap();
        assert_eq!(paid.status(), StatusCode::CREATED, "region {i} knows the client");
    }
    let listed: Value = serde_json::from_str(&cli(&app, &["clients", "list", "--json"]).await).unwrap();
    assert!(
        listed.as_array().unwrap().iter().any(|c| c["id"] == id && c["name"] == "acme" && c["revoked_at"].is_null())
    );

    cli(&app, &["clients", "revoke", "--id", id]).await;
    let revoked = Instant::now();
    for (i, url) in [&app.url, &b.url].into_iter().enumerate() {
        loop {
            let status =
                app.try_pay_at(url, key, &format!("acme-late-{i}"), &payment("E2E-LATE")).await.unwrap().status();
            if status == StatusCode::UNAUTHORIZED {
                break;
            }
            assert_eq!(status, StatusCode::CREATED);
            assert!(revoked.elapsed() < CACHE_FOR + Duration::from_secs(1), "region {i} still accepts a revoked key");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    let listed: Value = serde_json::from_str(&cli(&app, &["clients", "list", "--json"]).await).unwrap();
    assert!(listed.as_array().unwrap().iter().any(|c| c["id"] == id && c["revoked_at"].is_u64()));
}

#[tokio::test]
async fn migrate_carries_a_ledgers_clients_into_the_key_table() {
    let app = spawn_app().await;
    let key = ApiKey::generate();
    let id = uuid::Uuid::now_v7();
    sqlx::query("INSERT INTO clients (id, name, api_key_hash) VALUES ($1, 'old client', $2)")
        .bind(id)
        .bind(key.digest())
        .execute(app.db.ledger.pool())
        .await
        .unwrap();
    let refused = app.pay_as(key.reveal(), "old-1", &payment("E2E-OLD")).await;
    assert_eq!(refused.status(), StatusCode::UNAUTHORIZED, "not known until migrated");

    let said = cli(&app, &["migrate"]).await;
    assert!(said.contains("1 client(s) of this ledger are in the key table now"), "{said}");
    let record = app.clients().by_digest(&key.digest()).await.unwrap().expect("copied");
    assert_eq!((record.id.as_uuid(), record.name.as_str()), (id, "old client"));
    // A client from before accounts held none: its accounts are added.
    cli(&app, &["accounts", "add", "--client", &record.id.to_string(), "--account", DEBTOR]).await;
    app.clock.advance(CACHE_FOR);
    assert_eq!(app.pay_as(key.reveal(), "old-1", &payment("E2E-OLD")).await.status(), StatusCode::CREATED);
    cli(&app, &["migrate"]).await;
    assert_eq!(app.clients().list().await.unwrap().len(), 2, "a second migrate copies nothing twice");
}

/// A client kept in the older layout of the key table (an item per key
/// digest, a profile item) is copied into its record by `migrate`, with its
/// accounts and limits: its key goes on paying. The old items stay (older
/// instances still read them) until `migrate --drop-older-clients`, and a
/// second migrate copies nothing over changes made since.
#[tokio::test]
async fn migrate_moves_clients_of_the_older_layout_into_their_records() {
    use aws_sdk_dynamodb::types::AttributeValue;
    let app = spawn_app().await;
    let key = ApiKey::generate();
    let id = keyfence::domain::ClientId::generate();
    let dynamo = app.keys.store.client();
    let table = app.keys.store.table();
    let s = |v: &str| AttributeValue::S(v.to_owned());
    dynamo
        .put_item()
        .table_name(table)
        .item("pk", s(&format!("control#client#{}", key.digest())))
        .item("kind", s("client"))
        .item("client_id", s(&id.to_string()))
        .item("name", s("old layout"))
        .item("created_at", AttributeValue::N("1".into()))
        .send()
        .await
        .unwrap();
    dynamo
        .put_item()
        .table_name(table)
        .item("pk", s(&format!("control#profile#{id}")))
        .item("accounts", AttributeValue::Ss(vec![DEBTOR.to_owned()]))
        .item("max_amount_minor", AttributeValue::N("5000".into()))
        .send()
        .await
        .unwrap();

    let said = cli(&app, &["migrate"]).await;
    assert!(said.contains("1 client(s) of the older layout copied"), "{said}");
    let paid = app.pay_as(key.reveal(), "old-layout-1", &payment("E2E-OLD-LAYOUT")).await;
    assert_eq!(paid.status(), StatusCode::CREATED);
    let profile = app.clients().profile(id).await.unwrap();
    assert_eq!(profile.max_amount_minor, Some(5000), "its limits came along");
    let old_profile = || dynamo.get_item().table_name(table).key("pk", s(&format!("control#profile#{id}"))).send();
    assert!(old_profile().await.unwrap().item().is_some(), "kept for older instances");

    let limits = keyfence::clients::Limits { max_amount_minor: Some(9000), ..Default::default() };
    app.clients().set_limits(id, &limits).await.unwrap();
    let again = cli(&app, &["migrate"]).await;
    assert!(!again.contains("copied into"), "{again}");
    assert_eq!(app.clients().profile(id).await.unwrap().max_amount_minor, Some(9000), "nothing copied over it");
    let paid = app.pay_as(key.reveal(), "old-layout-2", &payment("E2E-OLD-LAYOUT-2")).await;
    assert_eq!(paid.status(), StatusCode::CREATED, "the key pays on");

    // Revoked with an older CLI meanwhile: the next migrate carries it over.
    dynamo
        .update_item()
        .table_name(table)
        .key("pk", s(&format!("control#client#{}", key.digest())))
        .update_expression("SET revoked_at = :at")
        .expression_attribute_values(":at", AttributeValue::N("2".into()))
        .send()
        .await
        .unwrap();
    let carried = cli(&app, &["migrate"]).await;
    assert!(carried.contains("1 revocation(s) made in the older layout carried"), "{carried}");
    let dropped = cli(&app, &["migrate", "--drop-older-clients"]).await;
    assert!(dropped.contains("2 item(s) of the older layout deleted"), "{dropped}");
    assert!(old_profile().await.unwrap().item().is_none(), "the old items are gone");
    app.clock.advance(CACHE_FOR);
    let refused = app.pay_as(key.reveal(), "old-layout-3", &payment("E2E-OLD-LAYOUT-3")).await;
    assert_eq!(refused.status(), StatusCode::UNAUTHORIZED, "the revocation held");
}

/// A client record that does not read (a field of the wrong type, written
/// by hand or by another version) keeps no instance from starting and locks
/// out no other client: that client alone is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_that_does_not_read_locks_out_no_other_client() {
    let app = spawn_app().await;
    let (broken, broken_key) = app.add_client().await;
    app.keys
        .store
        .client()
        .update_item()
        .table_name(app.keys.store.table())
        .key("pk", aws_sdk_dynamodb::types::AttributeValue::S(format!("control#clients#record#{broken}")))
        .update_expression("SET rate = :text")
        .expression_attribute_values(":text", aws_sdk_dynamodb::types::AttributeValue::S("fast".into()))
        .send()
        .await
        .unwrap();
    let fresh = crate::app::start_serving(&app.settings).await;
    let paid = app.try_pay_at(&fresh.url, &app.api_key, "fine-1", &payment("E2E-FINE-1")).await.unwrap();
    assert_eq!(paid.status(), StatusCode::CREATED, "another client is served");
    let refused = app.try_pay_at(&fresh.url, &broken_key, "broken-1", &payment("E2E-BROKEN-1")).await.unwrap();
    assert_eq!(refused.status(), StatusCode::UNAUTHORIZED, "the client whose record does not read is not");
    let metrics = app.http.get(format!("{}/metrics", fresh.admin_url)).send().await.unwrap().text().await.unwrap();
    assert!(metrics.contains("keyfence_client_records_unreadable_total"), "and it is counted");
    assert_eq!(app.e2.statement().await.len(), 1);
}
