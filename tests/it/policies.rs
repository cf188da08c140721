//! Each duty's IAM policy lets its role do its job's calls and none of the
//! other duties': `serve` (paying, replaying, registering a webhook
//! endpoint, delivering to it, and its workers' rounds), an SRE (declaring
//! a region failed and restored, recovering, reconciling, expiring keys),
//! security (clients, their keys, accounts, limits, webhook endpoints) and
//! migration. Every DynamoDB and KMS call each duty's commands make is
//! recorded through an HTTP proxy in front of the emulator, and evaluated
//! against the policies of the templates (`infra/key-table.policies.json`,
//! which `scripts/lint-infra` checks both templates against) by an
//! evaluator of the policy language those policies use (actions, resources,
//! `ForAllValues` and `Null` conditions on `dynamodb:LeadingKeys`,
//! `dynamodb:Attributes`, the KMS encryption context, and the role's
//! `keyfence-region` tag); anything else in a policy fails the test rather
//! than being guessed at.
//!
//! Beside what is recorded, each duty declares the kinds of write its job
//! needs (the table below): every write recorded must be of a declared
//! kind, and each role is allowed every kind it declares and refused every
//! other write to every kind of item.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::app::{DEBTOR, TestApp, payment, spawn_app, spawn_app_with};
use crate::aws_calls::{Call, recording_proxy, taken};
use crate::process::{ServeProcess, keyfence_command};

const ACCOUNT: &str = "123456789012";
const AWS_REGION: &str = "us-east-1";
/// The region `keyfence_command` runs in: serve's role carries it as its tag.
const REGION: &str = "test-1";
const CLIENT: &str = "0191d1a0-0000-7000-8000-000000000001";

// --- what each duty's job needs ---------------------------------------------

/// The kinds of item a write is to, by the partition key's beginning (the
/// idempotency keys, which begin with their client's id, are the rest).
const KINDS: [&str; 10] = [
    "control#clients#",
    "control#client#",
    "control#profile#",
    "control#webhooks#client#",
    "control#balance#",
    "control#handoff#",
    "control#leader#",
    "control#regions",
    "control#",
    "",
];

fn kind_of(pk: &str) -> &'static str {
    KINDS.iter().find(|k| pk.starts_with(**k)).unwrap()
}

/// A write a duty's job needs: an action on a kind of item ("" for a key
/// item; none for a call that names no item).
type Need = (&'static str, Option<&'static str>);

const KEY: Option<&str> = Some("");

fn needs(duty: &str) -> Vec<Need> {
    let kms_both = [("kms:GenerateDataKey", None), ("kms:Decrypt", None)];
    let keys = [("dynamodb:PutItem", KEY), ("dynamodb:UpdateItem", KEY), ("dynamodb:DeleteItem", KEY)];
    match duty {
        "serve" => [
            &keys[..],
            &[
                ("dynamodb:UpdateItem", Some("control#balance#")),
                ("dynamodb:PutItem", Some("control#handoff#")),
                ("dynamodb:PutItem", Some("control#leader#")),
                ("dynamodb:PutItem", Some("control#webhooks#client#")),
                // Its own URL only: see the registry's own checks below.
                ("dynamodb:UpdateItem", Some("control#regions")),
            ],
            &kms_both,
        ]
        .concat(),
        "sre" => [
            &keys[..],
            &[
                ("dynamodb:UpdateItem", Some("control#balance#")),
                ("dynamodb:PutItem", Some("control#handoff#")),
                ("dynamodb:DeleteItem", Some("control#handoff#")),
                ("dynamodb:UpdateItem", Some("control#regions")),
            ],
        ]
        .concat(),
        "security" => vec![
            ("dynamodb:PutItem", Some("control#clients#")),
            ("dynamodb:UpdateItem", Some("control#clients#")),
            ("dynamodb:DeleteItem", Some("control#clients#")),
            ("dynamodb:PutItem", Some("control#webhooks#client#")),
            ("kms:GenerateDataKey", None),
        ],
        "migration" => {
            let carried = ["control#clients#", "control#client#", "control#profile#", "control#webhooks#client#"];
            let mut needs: Vec<Need> = carried
                .iter()
                .flat_map(|k| ["dynamodb:PutItem", "dynamodb:UpdateItem", "dynamodb:DeleteItem"].map(|a| (a, Some(*k))))
                .collect();
            needs.extend([
                ("dynamodb:UpdateItem", Some("control#regions")),
                ("dynamodb:CreateTable", None),
                ("dynamodb:UpdateTimeToLive", None),
                ("kms:GenerateDataKey", None),
            ]);
            needs
        }
        other => panic!("no duty {other}"),
    }
}

const DUTIES: [&str; 4] = ["serve", "sre", "security", "migration"];

/// Whether `action` changes something (the needs name every such call).
fn writes(action: &str) -> bool {
    !["Get", "BatchGet", "Query", "Scan", "Describe", "List"].iter().any(|read| action.contains(&format!(":{read}")))
}

// --- the calls as IAM sees them --------------------------------------------

/// What IAM evaluates of one call.
#[derive(Debug)]
struct Asked {
    action: String,
    resource: String,
    context: BTreeMap<&'static str, Vec<String>>,
}

impl Asked {
    fn of(call: &Call, table: &str, kms_key: &str) -> Self {
        let body = &call.body;
        let mut context = BTreeMap::new();
        let pk = |item: &Value| item["pk"]["S"].as_str().map(str::to_owned);
        let resource = if call.action.starts_with("kms:") {
            if let Some(purpose) = body["EncryptionContext"]["purpose"].as_str() {
                context.insert("kms:EncryptionContext:purpose", vec![purpose.to_owned()]);
            }
            // The key the call names (a key id, as keyfence is given it).
            let key = body["KeyId"].as_str().unwrap_or(kms_key);
            format!("arn:aws:kms:{AWS_REGION}:{ACCOUNT}:key/{key}")
        } else {
            let keys: Vec<String> = match call.action.as_str() {
                "dynamodb:PutItem" => pk(&body["Item"]).into_iter().collect(),
                "dynamodb:BatchGetItem" => {
                    body["RequestItems"][table]["Keys"].as_array().unwrap().iter().filter_map(pk).collect()
                }
                "dynamodb:BatchWriteItem" => body["RequestItems"][table]
                    .as_array()
                    .unwrap()
                    .iter()
                    .filter_map(|w| pk(&w["PutRequest"]["Item"]).or_else(|| pk(&w["DeleteRequest"]["Key"])))
                    .collect(),
                _ => pk(&body["Key"]).into_iter().collect(),
            };
            if !keys.is_empty() {
                context.insert("dynamodb:LeadingKeys", keys);
            }
            if writes(&call.action)
                && call.action != "dynamodb:CreateTable"
                && call.action != "dynamodb:UpdateTimeToLive"
            {
                context.insert("dynamodb:Attributes", attributes(body).into_iter().collect());
            }
            let table = body["TableName"].as_str().unwrap_or(table);
            match body["IndexName"].as_str() {
                Some(index) => format!("arn:aws:dynamodb:{AWS_REGION}:{ACCOUNT}:table/{table}/index/{index}"),
                None => format!("arn:aws:dynamodb:{AWS_REGION}:{ACCOUNT}:table/{table}"),
            }
        };
        Self { action: call.action.clone(), resource, context }
    }

    /// A write of `need`'s kind to the table, touching `attributes`.
    fn of_need(need: Need, table: &str, kms_key: &str, attributes: &[&str]) -> Self {
        let (action, kind) = need;
        let pk = match kind {
            Some("") => format!("{CLIENT}#order-1"),
            Some("control#regions") => "control#regions".to_owned(),
            Some(kind) => format!("{kind}x"),
            None => String::new(),
        };
        let item = json!({ "pk": { "S": pk } });
        let mut body = json!({ "TableName": table, "EncryptionContext": { "purpose": "keyfence-webhook-secrets" } });
        match (action, kind) {
            (_, None) => {}
            ("dynamodb:PutItem", _) => body["Item"] = item,
            ("dynamodb:BatchWriteItem", _) => {
                body["RequestItems"] = json!({ table: [{ "PutRequest": { "Item": item } }] })
            }
            _ => body["Key"] = item,
        }
        let mut asked = Self::of(&Call { action: action.to_owned(), body }, table, kms_key);
        if kind.is_some() {
            asked.context.insert("dynamodb:Attributes", attributes.iter().map(|a| (*a).to_owned()).collect());
        }
        asked
    }
}

/// The top-level attributes a write touches: its key or item, and the names
/// in its update and condition expressions.
fn attributes(body: &Value) -> BTreeSet<String> {
    let names = body["ExpressionAttributeNames"].as_object().cloned().unwrap_or_default();
    let mut out: BTreeSet<String> = ["Key", "Item"]
        .iter()
        .filter_map(|field| body[field].as_object())
        .flat_map(|item| item.keys().cloned())
        .collect();
    for field in ["UpdateExpression", "ConditionExpression"] {
        let Some(expression) = body[field].as_str() else { continue };
        let chars: Vec<char> = expression.chars().collect();
        let word = |c: char| c.is_alphanumeric() || "#:_".contains(c);
        let mut i = 0;
        while i < chars.len() {
            if !word(chars[i]) {
                i += 1;
                continue;
            }
            let start = i;
            while i < chars.len() && word(chars[i]) {
                i += 1;
            }
            let token: String = chars[start..i].iter().collect();
            let nested = start > 0 && chars[start - 1] == '.';
            let function = chars[i..].iter().find(|c| !c.is_whitespace()) == Some(&'(');
            let keyword = ["SET", "REMOVE", "ADD", "DELETE", "AND", "OR", "NOT", "BETWEEN", "IN"]
                .contains(&token.to_uppercase().as_str());
            if nested || function || keyword || token.starts_with(':') || token.chars().all(|c| c.is_ascii_digit()) {
                continue;
            }
            let name = names.get(&token).and_then(Value::as_str).map_or(token, str::to_owned);
            out.insert(name);
        }
    }
    out
}

// --- the policies ------------------------------------------------------------

/// The policy of `duty`, its placeholders filled in.
fn policy(duty: &str, table: &str, kms_key: &str) -> Vec<Value> {
    let all: Value = serde_json::from_str(include_str!("../../infra/key-table.policies.json")).unwrap();
    let text = all[format!("{{table}}-{duty}")]["statements"].to_string();
    let text = text
        .replace("{partition}", "aws")
        .replace("{account}", ACCOUNT)
        .replace("{table}", table)
        .replace("{webhook_key}", kms_key);
    let statements: Value = serde_json::from_str(&text).unwrap();
    statements.as_object().unwrap_or_else(|| panic!("no policy for {duty}")).values().cloned().collect()
}

/// IAM's `*` and `?` wildcards.
fn like(pattern: &str, value: &str) -> bool {
    let (p, v): (Vec<char>, Vec<char>) = (pattern.chars().collect(), value.chars().collect());
    fn go(p: &[char], v: &[char]) -> bool {
        match (p.first(), v.first()) {
            (None, None) => true,
            (Some('*'), _) => go(&p[1..], v) || (!v.is_empty() && go(p, &v[1..])),
            (Some('?'), Some(_)) => go(&p[1..], &v[1..]),
            (Some(a), Some(b)) if a == b => go(&p[1..], &v[1..]),
            _ => false,
        }
    }
    go(&p, &v)
}

/// Whether one condition holds for `asked`, by a role tagged `tag`.
fn holds(test: &str, key: &str, values: &[Value], asked: &Asked, tag: Option<&str>) -> bool {
    let tags: BTreeMap<&str, &str> = tag.map(|t| ("aws:PrincipalTag/keyfence-region", t)).into_iter().collect();
    // A value naming a tag the role lacks matches nothing.
    let values: Vec<String> = values
        .iter()
        .filter_map(|v| {
            let v = v.as_str().unwrap();
            match v.split_once("${aws:PrincipalTag/keyfence-region}") {
                Some((head, tail)) => tag.map(|t| format!("{head}{t}{tail}")),
                None => Some(v.to_owned()),
            }
        })
        .collect();
    let present: Option<Vec<String>> = match tags.get(key) {
        Some(t) => Some(vec![(*t).to_owned()]),
        None => asked.context.get(key).cloned(),
    };
    match test {
        "Null" => present.is_none() == (values == ["true"]),
        "StringEquals" => present.is_some_and(|p| p.iter().any(|x| values.contains(x))),
        "ForAnyValue:StringEquals" => present.unwrap_or_default().iter().any(|x| values.contains(x)),
        "ForAllValues:StringEquals" => present.unwrap_or_default().iter().all(|x| values.contains(x)),
        "ForAllValues:StringLike" => present.unwrap_or_default().iter().all(|x| values.iter().any(|v| like(v, x))),
        "ForAllValues:StringNotLike" => present.unwrap_or_default().iter().all(|x| !values.iter().any(|v| like(v, x))),
        other => panic!("the policies use the condition {other}, which this evaluator does not know: teach it first"),
    }
}

/// IAM's decision for `asked` under `statements`, by a role tagged `tag`:
/// allowed when a statement allows it and none denies it.
fn allowed(statements: &[Value], asked: &Asked, tag: Option<&str>) -> bool {
    let applies = |st: &Value| {
        let list = |field: &str| {
            st[field].as_array().unwrap().iter().map(|v| v.as_str().unwrap().to_owned()).collect::<Vec<_>>()
        };
        list("actions").iter().any(|a| like(a, &asked.action))
            && list("resources").iter().any(|r| like(r, &asked.resource))
            && st["conditions"].as_object().unwrap().iter().all(|(test_key, values)| {
                let (test, key) = test_key.split_once(' ').unwrap();
                holds(test, key, values.as_array().unwrap(), asked, tag)
            })
    };
    let effect = |e: &str| statements.iter().filter(|st| st["effect"] == e).any(applies);
    effect("Allow") && !effect("Deny")
}

fn tag_of(duty: &str) -> Option<&'static str> {
    (duty == "serve").then_some(REGION)
}

/// Checks every call `duty` made against its policy and its needs.
fn check_made(duty: &str, made: &[Call], table: &str, kms_key: &str) {
    let statements = policy(duty, table, kms_key);
    let needs = needs(duty);
    for call in made {
        let asked = Asked::of(call, table, kms_key);
        assert!(allowed(&statements, &asked, tag_of(duty)), "{duty}'s policy refuses a call its job makes: {asked:?}");
        if writes(&call.action) {
            let kind = asked.context.get("dynamodb:LeadingKeys").map(|keys| kind_of(&keys[0]));
            assert!(
                needs.iter().any(|(action, k)| *action == call.action && *k == kind),
                "{duty} wrote {} to {kind:?}, which its needs do not name: {asked:?}",
                call.action
            );
        }
    }
}

// --- the tests -----------------------------------------------------------------

#[test]
fn each_role_may_write_what_its_duty_needs_and_nothing_else() {
    let (table, kms_key) = ("keyfence-keys", "mrk-0123456789abcdef0123456789abcdef");
    // Every write to every kind of item, and the calls that name none.
    let items = ["dynamodb:PutItem", "dynamodb:UpdateItem", "dynamodb:DeleteItem", "dynamodb:BatchWriteItem"];
    let others = ["dynamodb:CreateTable", "dynamodb:UpdateTable", "dynamodb:DeleteTable", "dynamodb:UpdateTimeToLive"];
    let every: BTreeSet<Need> = items
        .iter()
        .flat_map(|action| KINDS.map(|kind| (*action, Some(kind))))
        .chain(
            others.iter().chain(&["kms:GenerateDataKey", "kms:Decrypt", "kms:Encrypt"]).map(|action| (*action, None)),
        )
        .collect();
    assert!(DUTIES.iter().flat_map(|d| needs(d)).all(|need| every.contains(&need)));
    for duty in DUTIES {
        let statements = policy(duty, table, kms_key);
        let mine: BTreeSet<Need> = needs(duty).into_iter().collect();
        for need in &every {
            // The registry's attributes as the duty that writes it touches them.
            let attributes: &[&str] = match (duty, need.1) {
                ("serve", Some("control#regions")) => &["pk", "url#test-1"],
                _ => &["pk", "epoch", "regions", "history"],
            };
            let asked = Asked::of_need(*need, table, kms_key, attributes);
            assert_eq!(
                allowed(&statements, &asked, tag_of(duty)),
                mine.contains(need),
                "{duty}: {need:?} should be {}",
                if mine.contains(need) { "allowed" } else { "refused" }
            );
        }
    }
    // Of the registry, serve may write its own region's URL and nothing else.
    let serve = policy("serve", table, kms_key);
    let advertise = ("dynamodb:UpdateItem", Some("control#regions"));
    let url = |region: &str| Asked::of_need(advertise, table, kms_key, &["pk", &format!("url#{region}")]);
    assert!(allowed(&serve, &url(REGION), Some(REGION)));
    assert!(!allowed(&serve, &url("test-2"), Some(REGION)), "another region's URL");
    assert!(!allowed(&serve, &url(REGION), None), "a serve role without its region's tag");
    let bare = Asked::of_need(advertise, table, kms_key, &["pk"]);
    assert!(!allowed(&serve, &bare, Some(REGION)), "an update that writes no URL (a bare registry)");
    let declare = Asked::of_need(advertise, table, kms_key, &["pk", "epoch", "regions", "history"]);
    assert!(!allowed(&serve, &declare, Some(REGION)), "a region's state");
    // Secrets open for serve only; data keys of anything else for nobody.
    let open = Asked::of_need(("kms:Decrypt", None), table, kms_key, &[]);
    for duty in DUTIES {
        assert_eq!(
            allowed(&policy(duty, table, kms_key), &open, tag_of(duty)),
            duty == "serve",
            "{duty} opens secrets"
        );
    }
    let mut other = Asked::of_need(("kms:Decrypt", None), table, kms_key, &[]);
    other.context.insert("kms:EncryptionContext:purpose", vec!["something-else".into()]);
    assert!(!allowed(&serve, &other, Some(REGION)), "a data key made for something else");
}

#[test]
fn the_evaluator_reads_expressions_as_iam_does() {
    let body = json!({
        "Key": { "pk": { "S": "control#regions" } },
        "UpdateExpression": "SET epoch = :next, regions.#r = :change, history = list_append(history, :h)",
        "ConditionExpression": "attribute_exists(pk) AND #v = :seen",
        "ExpressionAttributeNames": { "#r": "test-1", "#v": "version" },
    });
    let expected: BTreeSet<String> = ["pk", "epoch", "regions", "history", "version"].map(str::to_owned).into();
    assert_eq!(attributes(&body), expected);
    assert!(like("control#*", "control#regions") && !like("control#*", "0191#key"));
}

async fn kms_key(app: &TestApp) -> String {
    let kms = aws_sdk_kms::Client::new(&keyfence::keystore::sdk_config(&app.keys.settings).await.unwrap());
    let key = kms.create_key().description("keyfence policies test").send().await.unwrap();
    key.key_metadata().unwrap().key_id().to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_call_serve_makes_is_one_its_policy_allows() {
    // The test's own instance sends no webhooks: the process under test does.
    let app = spawn_app_with(|s| s.webhook_delivery.interval_ms = 0).await;
    let key = kms_key(&app).await;
    let (proxy, calls) = recording_proxy(app.keys.settings.aws_endpoint_url.clone().unwrap()).await;
    let mut command = keyfence_command(&app, "serve");
    command
        .env("AWS_ENDPOINT_URL", &proxy.url)
        .env("KEYFENCE_WEBHOOK_KMS_KEY", &key)
        .env("KEYFENCE_RECOVERY_INTERVAL_MS", "200")
        .env("KEYFENCE_EXPIRE_INTERVAL_MS", "200")
        .env("KEYFENCE_WEBHOOK_INTERVAL_MS", "200")
        .env("KEYFENCE_INBOX_INTERVAL_MS", "200");
    // An endpoint an operator registered: serve opens its secret with KMS.
    let client = app.client_id().await.to_string();
    let out = keyfence_command(&app, "webhooks")
        .args(["add", "--client", &client, "--url", "http://127.0.0.1:9/ops", "--event", "payment.succeeded"])
        .env("KEYFENCE_WEBHOOK_KMS_KEY", &key)
        .output()
        .await
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let mut serve = ServeProcess::spawn(command).await;
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
    let paid = app.try_pay_at(&serve.url, &app.api_key, "policy-1", &payment("E2E-POLICY-1")).await.unwrap();
    assert_eq!(paid.status(), StatusCode::CREATED);
    let again = app.try_pay_at(&serve.url, &app.api_key, "policy-1", &payment("E2E-POLICY-1")).await.unwrap();
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    let id = paid.json::<Value>().await.unwrap()["id"].as_str().unwrap().to_owned();
    for path in [format!("/v1/payments/{id}"), "/v1/idempotency-keys/policy-1".to_owned()] {
        let read = app.http.get(format!("{}{path}", serve.url)).bearer_auth(&app.api_key).send().await.unwrap();
        assert_eq!(read.status(), StatusCode::OK, "{path}");
    }
    // The delivery opens the endpoint's secret; the workers go round.
    let opened = || calls.lock().unwrap().iter().any(|c| c.action == "kms:Decrypt");
    for _ in 0..100 {
        if opened() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(opened(), "the delivery worker never opened the endpoint's secret");
    tokio::time::sleep(Duration::from_secs(1)).await;
    serve.terminate().await;

    let made = taken(&calls);
    let actions: BTreeSet<&str> = made.iter().map(|c| c.action.as_str()).collect();
    for expected in ["dynamodb:PutItem", "dynamodb:UpdateItem", "dynamodb:BatchGetItem", "kms:GenerateDataKey"] {
        assert!(actions.contains(expected), "serve never made {expected}: {actions:?}");
    }
    check_made("serve", &made, app.keys.store.table(), &key);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_call_each_operators_duty_makes_is_one_its_policy_allows() {
    let app = spawn_app().await;
    let key = kms_key(&app).await;
    let (proxy, calls) = recording_proxy(app.keys.settings.aws_endpoint_url.clone().unwrap()).await;
    let run = |line: String| {
        let args: Vec<String> = line.split(' ').map(str::to_owned).collect();
        let mut command = keyfence_command(&app, &args[0]);
        command.env("AWS_ENDPOINT_URL", &proxy.url).env("KEYFENCE_WEBHOOK_KMS_KEY", &key).args(&args[1..]);
        async move {
            let out = command.output().await.unwrap();
            assert!(out.status.success(), "keyfence {line}: {}", String::from_utf8_lossy(&out.stderr));
            String::from_utf8(out.stdout).unwrap()
        }
    };
    let made: Value = serde_json::from_str(&run("clients add --name policy --json".into()).await).unwrap();
    let id = made["client_id"].as_str().unwrap().to_owned();
    for line in [
        format!("accounts add --client {id} --account {DEBTOR}"),
        format!("clients limits --id {id} --max-amount 5000"),
        format!("clients rotate --id {id} --grace 1s"),
        "clients list --json".to_owned(),
        format!("webhooks add --client {id} --url http://127.0.0.1:9/hooks --event payment.succeeded --json"),
        format!("webhooks list --client {id}"),
        format!("clients revoke --id {id}"),
    ] {
        run(line).await;
    }
    let security = taken(&calls);

    for line in [
        "regions list",
        "regions fail --region test-9 --reason policy-drill",
        "regions restore --region test-9 --reason policy-drill",
        "recover",
        "reconcile",
        "maintain --expire",
    ] {
        run(line.to_owned()).await;
    }
    let sre = taken(&calls);
    run("migrate".to_owned()).await;
    let migration = taken(&calls);

    let table = app.keys.store.table();
    for (duty, made) in [("security", &security), ("sre", &sre), ("migration", &migration)] {
        assert!(made.iter().any(|c| writes(&c.action)), "{duty} wrote nothing: {made:?}");
        check_made(duty, made, table, &key);
    }
}
