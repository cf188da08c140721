//! The IAM policies the templates give each role allow every DynamoDB call
//! that role's commands make: `keyfence serve` (paying, reading, replaying,
//! registering a webhook endpoint, and its workers' rounds) under
//! ServePolicy, the operators' CLI under AdminPolicy. Every call is counted
//! through an HTTP proxy in front of the emulator, and checked against the
//! actions `infra/key-table.cfn.yaml` allows (`scripts/lint-infra` keeps
//! the Terraform module's the same).

use std::collections::BTreeSet;
use std::time::Duration;

use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::app::{DEBTOR, payment, spawn_app};
use crate::process::{ServeProcess, keyfence_command};
use crate::rotation::{Seen, counting_proxy};

/// The DynamoDB actions the template's `policy` allows, without `dynamodb:`.
fn allowed(policy: &str) -> BTreeSet<String> {
    let template = include_str!("../../infra/key-table.cfn.yaml");
    let after = template.split(&format!("\n  {policy}:\n")).nth(1).expect("the policy is in the template");
    // The resource ends where the next one (or the next section) begins.
    let body: Vec<&str> = after.lines().take_while(|line| line.is_empty() || line.starts_with("   ")).collect();
    body.join("\n")
        .split("- Sid:")
        .filter(|statement| statement.contains("Effect: Allow"))
        .flat_map(str::lines)
        .filter_map(|line| line.trim().strip_prefix("- dynamodb:").map(str::to_owned))
        .collect()
}

/// The operations the proxy saw, once each, and forgets them.
fn taken(seen: &Seen) -> BTreeSet<String> {
    std::mem::take(&mut *seen.lock().unwrap()).into_iter().collect()
}

#[test]
fn the_policies_are_read_from_the_template() {
    let serve = allowed("ServePolicy");
    assert!(serve.contains("GetItem") && serve.contains("BatchGetItem"), "{serve:?}");
    assert!(!serve.contains("BatchWriteItem"), "only what the Allow statements name: {serve:?}");
    assert!(allowed("AdminPolicy").contains("DescribeTimeToLive"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_call_serve_makes_is_one_its_policy_allows() {
    let app = spawn_app().await;
    let (proxy, seen) = counting_proxy(app.keys.settings.aws_endpoint_url.clone().unwrap()).await;
    let mut command = keyfence_command(&app, "serve");
    command
        .env("AWS_ENDPOINT_URL", &proxy.url)
        .env("KEYFENCE_RECOVERY_INTERVAL_MS", "200")
        .env("KEYFENCE_EXPIRE_INTERVAL_MS", "200")
        .env("KEYFENCE_WEBHOOK_INTERVAL_MS", "200")
        .env("KEYFENCE_INBOX_INTERVAL_MS", "200");
    let mut serve = ServeProcess::spawn(command).await;
    let paid = app.try_pay_at(&serve.url, &app.api_key, "policy-1", &payment("E2E-POLICY-1")).await.unwrap();
    assert_eq!(paid.status(), StatusCode::CREATED);
    let again = app.try_pay_at(&serve.url, &app.api_key, "policy-1", &payment("E2E-POLICY-1")).await.unwrap();
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    let id = paid.json::<Value>().await.unwrap()["id"].as_str().unwrap().to_owned();
    for path in [format!("/v1/payments/{id}"), "/v1/idempotency-keys/policy-1".to_owned()] {
        let read = app.http.get(format!("{}{path}", serve.url)).bearer_auth(&app.api_key).send().await.unwrap();
        assert_eq!(read.status(), StatusCode::OK, "{path}");
    }
    let hook = json!({ "url": "http://127.0.0.1:9/hooks", "events": ["payment.succeeded"] });
    let registered = app
        .http
        .post(format!("{}/v1/webhook-endpoints", serve.url))
        .bearer_auth(&app.api_key)
        .json(&hook)
        .send()
        .await
        .unwrap();
    assert_eq!(registered.status(), StatusCode::CREATED);
    // The workers' rounds: recovery, expiry, webhooks, the inbox, the
    // directory's and the registry's reads.
    tokio::time::sleep(Duration::from_secs(2)).await;
    serve.terminate().await;

    let made = taken(&seen);
    let policy = allowed("ServePolicy");
    let refused: Vec<&String> = made.difference(&policy).collect();
    assert!(refused.is_empty(), "serve calls {refused:?}, which ServePolicy does not allow (it made {made:?})");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_call_the_operators_cli_makes_is_one_its_policy_allows() {
    let app = spawn_app().await;
    let (proxy, seen) = counting_proxy(app.keys.settings.aws_endpoint_url.clone().unwrap()).await;
    let run = |args: Vec<String>| {
        let mut command = keyfence_command(&app, &args[0]);
        command.env("AWS_ENDPOINT_URL", &proxy.url).args(&args[1..]);
        async move {
            let out = command.output().await.unwrap();
            assert!(out.status.success(), "keyfence {args:?}: {}", String::from_utf8_lossy(&out.stderr));
            String::from_utf8(out.stdout).unwrap()
        }
    };
    let args = |line: &str| line.split(' ').map(str::to_owned).collect::<Vec<_>>();
    let made: Value = serde_json::from_str(&run(args("clients add --name policy --json")).await).unwrap();
    let id = made["client_id"].as_str().unwrap().to_owned();
    for line in [
        format!("accounts add --client {id} --account {DEBTOR}"),
        format!("clients limits --id {id} --max-amount 5000"),
        format!("clients rotate --id {id} --grace 1s"),
        "clients list --json".to_owned(),
        format!("webhooks add --client {id} --url http://127.0.0.1:9/hooks --event payment.succeeded"),
        format!("webhooks list --client {id}"),
        format!("clients revoke --id {id}"),
        "regions list".to_owned(),
        "recover".to_owned(),
        "reconcile".to_owned(),
        "maintain --expire".to_owned(),
        "migrate".to_owned(),
    ] {
        run(args(&line)).await;
    }
    let made = taken(&seen);
    let policy = allowed("AdminPolicy");
    let refused: Vec<&String> = made.difference(&policy).collect();
    assert!(refused.is_empty(), "the CLI calls {refused:?}, which AdminPolicy does not allow (it made {made:?})");
}
