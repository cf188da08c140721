//! Away from the dev stack keyfence fails closed: `serve` refuses to start
//! on local-development defaults or without an AWS region, saying why, and
//! `migrate` checks a table it did not make against the schema it needs.

use aws_sdk_dynamodb::types::{AttributeDefinition, BillingMode, KeySchemaElement, KeyType, ScalarAttributeType};
use keyfence::keystore;
use tokio::process::Command;

use crate::harness::TestKeys;

/// `keyfence serve` as on a host of AWS's: no endpoint (so AWS itself), no
/// instance metadata to ask, no profile, and only `env`.
async fn serve_on_aws(env: &[(&str, &str)]) -> (Option<i32>, String) {
    on_aws("serve", env).await
}

/// `keyfence <subcommand>` on such a host.
async fn on_aws(subcommand: &str, env: &[(&str, &str)]) -> (Option<i32>, String) {
    let mut command = Command::new(env!("CARGO_BIN_EXE_keyfence"));
    command
        .arg(subcommand)
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        // Nothing here may reach beyond this machine: no metadata service, no profile.
        .env("AWS_EC2_METADATA_DISABLED", "true")
        .env("AWS_CONFIG_FILE", "/nonexistent/keyfence-config")
        .env("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/keyfence-credentials")
        .env("KEYFENCE_LISTEN", "127.0.0.1:0")
        .env("KEYFENCE_ADMIN_LISTEN", "127.0.0.1:0")
        .kill_on_drop(true);
    command.envs(env.iter().copied());
    let out = tokio::time::timeout(std::time::Duration::from_secs(30), command.output())
        .await
        .expect("serve gives up at once")
        .unwrap();
    (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned())
}

#[tokio::test]
async fn serve_refuses_local_defaults_away_from_a_local_endpoint() {
    let (code, stderr) = serve_on_aws(&[("AWS_REGION", "eu-west-1")]).await;
    assert_eq!(code, Some(2), "{stderr}");
    let all = "KEYFENCE_REGION, DATABASE_URL, KEYFENCE_E1_URL, KEYFENCE_E2_URL left at the local-development default";
    assert!(stderr.contains(all), "{stderr}");

    let (code, stderr) = serve_on_aws(&[("AWS_REGION", "eu-west-1"), ("KEYFENCE_REGION", "")]).await;
    assert_eq!(code, Some(2), "an empty region is no region: {stderr}");
    assert!(stderr.contains("--region"), "{stderr}");

    let (code, stderr) = serve_on_aws(&[("AWS_REGION", "eu-west-1"), ("KEYFENCE_REGION", "eu-west-1")]).await;
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("DATABASE_URL, KEYFENCE_E1_URL") && !stderr.contains("KEYFENCE_REGION,"), "{stderr}");
}

/// The workers an operator runs by hand refuse the same defaults.
#[tokio::test]
async fn recover_and_reconcile_refuse_local_defaults_away_from_a_local_endpoint() {
    for subcommand in ["recover", "reconcile"] {
        let (code, stderr) = on_aws(subcommand, &[("AWS_REGION", "eu-west-1")]).await;
        assert_eq!(code, Some(2), "{subcommand}: {stderr}");
        assert!(stderr.contains("KEYFENCE_REGION, DATABASE_URL"), "{subcommand}: {stderr}");
    }
}

/// An emulator named only in the SDK's own DynamoDB variable is local too:
/// its dev stack keeps its defaults (and asks no metadata service).
#[tokio::test]
async fn an_endpoint_in_the_sdks_own_variable_counts_as_local() {
    let (_, stderr) = on_aws("recover", &[("AWS_ENDPOINT_URL_DYNAMODB", "http://127.0.0.1:1")]).await;
    assert!(!stderr.contains("local-development default"), "{stderr}");
    // Unless the SDK is told to ignore it: then it goes to AWS, and so do the checks.
    let ignoring =
        [("AWS_ENDPOINT_URL_DYNAMODB", "http://127.0.0.1:1"), ("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", "true")];
    let (code, stderr) = on_aws("recover", &ignoring).await;
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("local-development default"), "{stderr}");
}

#[tokio::test]
async fn serve_refuses_to_start_without_an_aws_region() {
    let explicit = [
        ("KEYFENCE_REGION", "eu-west-1"),
        ("DATABASE_URL", "postgres://keyfence@127.0.0.1:1/keyfence"),
        ("KEYFENCE_E1_URL", "http://127.0.0.1:1"),
        ("KEYFENCE_E2_URL", "http://127.0.0.1:1"),
    ];
    let (code, stderr) = serve_on_aws(&explicit).await;
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("no AWS region") && stderr.contains("AWS_REGION"), "{stderr}");
}

#[tokio::test]
async fn a_table_keyfence_did_not_make_is_checked_and_what_it_lacks_is_named() {
    let keys = TestKeys::new().await;
    let client = keys.store.client();
    let made = keystore::check_table(client, keys.store.table()).await.unwrap();
    assert!(made.problems.is_empty(), "the table migrate makes passes: {:?}", made.problems);

    let missing = format!("{}-missing", keys.store.table());
    let absent = keystore::check_table(client, &missing).await.unwrap();
    assert!(absent.problems.iter().any(|p| p.contains("does not exist") && p.contains("--create-table")), "{absent:?}");

    // A table with the right key but no in-flight index.
    let bare = format!("{}-bare", keys.store.table());
    client
        .create_table()
        .table_name(&bare)
        .billing_mode(BillingMode::PayPerRequest)
        .key_schema(KeySchemaElement::builder().attribute_name("pk").key_type(KeyType::Hash).build().unwrap())
        .attribute_definitions(
            AttributeDefinition::builder().attribute_name("pk").attribute_type(ScalarAttributeType::S).build().unwrap(),
        )
        .send()
        .await
        .unwrap();
    let check = keystore::check_table(client, &bare).await;
    keystore::delete_table(client, &bare).await.unwrap();
    let check = check.unwrap();
    assert!(check.problems.iter().any(|p| p.starts_with("no index inflight-by-lease")), "{check:?}");
    assert!(check.notes.iter().any(|n| n.contains("time-to-live is off")), "{check:?}");
}

/// `AWS_MAX_ATTEMPTS` sets the key store's attempts when keyfence's own
/// setting is unset; `KEYFENCE_KEYSTORE_ATTEMPTS` wins when both are set.
#[tokio::test]
async fn aws_max_attempts_counts_unless_keyfence_sets_its_own() {
    // No partition housekeeper: its start-up round queries the same index
    // for hand-offs and would take a throttle armed for the command.
    let app = crate::app::spawn_app_with(|s| s.partition_interval_ms = 0).await;
    let list = |env: &[(&str, &str)]| {
        let mut command = crate::process::keyfence_command(&app, "clients");
        command.args(["list", "--json"]).env_remove("KEYFENCE_KEYSTORE_ATTEMPTS").envs(env.iter().copied());
        command.stderr(std::process::Stdio::piped());
        command
    };
    let three_throttles =
        serde_json::json!({ "operation": "Query", "count": 3, "action": "error", "code": "ThrottlingException" });

    app.keys.arm(three_throttles.clone()).await;
    let out = list(&[("AWS_MAX_ATTEMPTS", "4")]).output().await.unwrap();
    assert!(out.status.success(), "four attempts outlast three throttles: {}", String::from_utf8_lossy(&out.stderr));

    app.keys.arm(three_throttles).await;
    let out = list(&[("AWS_MAX_ATTEMPTS", "4"), ("KEYFENCE_KEYSTORE_ATTEMPTS", "3")]).output().await.unwrap();
    assert!(!out.status.success(), "keyfence's own three attempts do not");

    // Retry settings the SDK would panic on are refused, or left unread.
    let out = list(&[("AWS_MAX_ATTEMPTS", "lots")]).output().await.unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && stderr.contains("AWS_MAX_ATTEMPTS=lots"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    let out = list(&[("AWS_RETRY_MODE", "legacy")]).output().await.unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

/// A reconcile run whose metrics file cannot be written still prints its
/// report, and says the run did not complete (exit 2), not "divergence".
#[tokio::test]
async fn a_metrics_file_that_cannot_be_written_leaves_the_report_and_exits_2() {
    let app = crate::app::spawn_app().await;
    let out = crate::process::keyfence_command(&app, "reconcile")
        .args(["--metrics-file", "/nonexistent/keyfence/reconcile.prom", "--format", "json"])
        .stderr(std::process::Stdio::piped())
        .output()
        .await
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).expect("the report, as JSON");
    assert_eq!(report["unrepaired"], 0);
    assert!(String::from_utf8_lossy(&out.stderr).contains("the report stands"));
}
