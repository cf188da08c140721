//! Webhook signing secrets are kept sealed in the key table: reading the
//! table gives nobody a secret, and a sealed secret copied into another
//! client's item does not open. A secret kept in the clear by an older
//! version still signs; `keyfence migrate` counts it, and seals it when
//! asked (once no older version runs). With an AWS KMS
//! key, secrets are sealed under data keys only KMS opens (the emulator's
//! KMS here): with KMS out of reach, an instance that has not opened the
//! data key yet opens nothing.

use std::collections::HashMap;

use aws_sdk_dynamodb::types::AttributeValue;
use keyfence::domain::{ClientId, Millis, WebhookSecret};
use keyfence::webhooks::sealing::SealError;
use keyfence::webhooks::{Sealer, SealingSettings, WebhooksError};
use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::app::{TestApp, spawn_app};
use crate::process::keyfence_command;

/// The client's endpoints item as the table holds it.
async fn stored(app: &TestApp) -> String {
    stored_for(app, app.client_id().await).await
}

async fn stored_for(app: &TestApp, client: ClientId) -> String {
    let pk = format!("control#webhooks#client#{client}");
    let out = app
        .keys
        .store
        .client()
        .get_item()
        .table_name(app.keys.store.table())
        .key("pk", AttributeValue::S(pk))
        .consistent_read(true)
        .send()
        .await
        .unwrap();
    out.item().unwrap()["endpoints"].as_s().unwrap().clone()
}

/// Writes `client`'s endpoints item with `endpoints` as its text.
async fn overwrite(app: &TestApp, client: ClientId, endpoints: &str) {
    let item = HashMap::from([
        ("pk".to_owned(), AttributeValue::S(format!("control#webhooks#client#{client}"))),
        ("endpoints".to_owned(), AttributeValue::S(endpoints.into())),
        ("version".to_owned(), AttributeValue::N("100".into())),
    ]);
    app.keys.store.client().put_item().table_name(app.keys.store.table()).set_item(Some(item)).send().await.unwrap();
}

/// The secrets that sign for the app's one endpoint, opened.
async fn signing(app: &TestApp) -> Vec<String> {
    let store = app.endpoints().await;
    let client = app.client_id().await;
    let endpoint = store.list(client).await.unwrap().remove(0);
    store.signing_secrets(client, &endpoint, Millis::now().get()).await.unwrap().into_iter().map(|s| s.value).collect()
}

async fn migrate(app: &TestApp, args: &[&str]) -> String {
    let out = keyfence_command(app, "migrate").args(args).output().await.unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_secret_is_stored_sealed_and_one_kept_in_the_clear_is_sealed_by_migrate() {
    let app = spawn_app().await;
    let hook = json!({ "url": "http://127.0.0.1:9/hooks", "events": ["payment.succeeded"] });
    let made = app
        .http
        .post(format!("{}/v1/webhook-endpoints", app.url))
        .bearer_auth(&app.api_key)
        .json(&hook)
        .send()
        .await
        .unwrap();
    assert_eq!(made.status(), StatusCode::CREATED);
    let secret = made.json::<Value>().await.unwrap()["secret"].as_str().unwrap().to_owned();
    let kept = stored(&app).await;
    assert!(!kept.contains(&secret) && !kept.contains("whsec_"), "the table holds the secret: {kept}");
    assert_eq!(
        signing(&app).await,
        std::slice::from_ref(&secret),
        "the sealed secret opens to the one the client was shown"
    );

    // Copied into another client's item (by whoever may write endpoints),
    // it does not open there.
    let (other, _) = app.add_client().await;
    overwrite(&app, other, &kept).await;
    let store = app.endpoints().await;
    let copied = store.list(other).await.unwrap().remove(0);
    let opened = store.signing_secrets(other, &copied, Millis::now().get()).await;
    assert!(matches!(opened, Err(WebhooksError::Sealing(SealError::Altered))), "{opened:?}");
    assert!(stored_for(&app, other).await.contains("kfsealed1.local."));

    // As an older version kept it: in the clear.
    let older = WebhookSecret::generate(Millis::now().get()).value;
    let mut endpoints: Value = serde_json::from_str(&kept).unwrap();
    endpoints[0]["secrets"][0]["value"] = older.clone().into();
    overwrite(&app, app.client_id().await, &endpoints.to_string()).await;
    assert_eq!(signing(&app).await, std::slice::from_ref(&older), "a secret in the clear still signs");

    let counted = migrate(&app, &[]).await;
    assert!(counted.contains("1 webhook secret(s) are kept in the clear by an older version"), "{counted}");
    assert!(stored(&app).await.contains(&older), "sealed before it was asked to");
    let report = migrate(&app, &["--seal-webhook-secrets"]).await;
    assert!(report.contains("1 webhook secret(s) kept in the clear are sealed now"), "{report}");
    let kept = stored(&app).await;
    assert!(!kept.contains(&older) && !kept.contains("whsec_"), "still in the clear: {kept}");
    assert_eq!(signing(&app).await, [older], "sealed, it is the same secret");
    let again = migrate(&app, &["--seal-webhook-secrets"]).await;
    assert!(!again.contains("sealed now") && !again.contains("in the clear"), "nothing left: {again}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_kms_key_secrets_are_sealed_under_data_keys_only_kms_opens() {
    let app = spawn_app().await;
    let kms = aws_sdk_kms::Client::new(&keyfence::keystore::sdk_config(&app.keys.settings).await.unwrap());
    let key = kms.create_key().description("keyfence test webhook secrets").send().await.unwrap();
    let key_id = key.key_metadata().unwrap().key_id().to_owned();

    let client = app.client_id().await.to_string();
    let out = keyfence_command(&app, "webhooks")
        .args(["add", "--client", &client, "--url", "http://127.0.0.1:9/kms", "--event", "payment.succeeded", "--json"])
        .env("KEYFENCE_WEBHOOK_KMS_KEY", &key_id)
        .output()
        .await
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let secret = serde_json::from_slice::<Value>(&out.stdout).unwrap()["secret"].as_str().unwrap().to_owned();
    let kept = stored(&app).await;
    assert!(kept.contains("kfsealed1.kms.") && !kept.contains(&secret), "{kept}");

    let store = app.endpoints().await;
    let endpoint = store.list(app.client_id().await).await.unwrap().remove(0);
    let sealed = &endpoint.secrets[0].value;
    let id = format!("{}/{}", app.client_id().await, endpoint.id);
    let with_kms = SealingSettings { kms_key: Some(key_id.clone()), key_file: None };
    let opener = Sealer::new(&with_kms, &app.keys.settings).await.unwrap();
    assert_eq!(opener.open(sealed, &id).await.unwrap(), secret);
    let local = Sealer::new(&SealingSettings::default(), &app.keys.settings).await.unwrap();
    assert!(matches!(local.open(sealed, &id).await, Err(SealError::OtherKey(_))), "the development key opens it");

    // KMS out of reach: an instance that has not opened the data key yet
    // opens nothing; one that has keeps it.
    let mut unreachable = app.keys.settings.clone();
    unreachable.aws_endpoint_url = Some("http://127.0.0.1:9".into());
    let fresh = Sealer::new(&with_kms, &unreachable).await.unwrap();
    assert!(matches!(fresh.open(sealed, &id).await, Err(SealError::Kms(_))), "opened without KMS");
    assert_eq!(opener.open(sealed, &id).await.unwrap(), secret, "a data key once opened is kept");
}
