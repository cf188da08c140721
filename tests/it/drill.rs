//! The failover drill, with two regions over one key table. Payments stream
//! in with clients retrying over both regions; region A goes away mid-stream
//! (killed at a phase boundary; or, separately, cut off from the key table
//! while it keeps running). Retries to B are told "in flight" until an SRE
//! declares A failed; then B finishes them. A comes back, its old owners
//! change nothing in the key store, A's reconciler voids what they left in
//! A's ledger, and then, for every key: one payment that is not voided
//! across both ledgers, balanced postings in both, one instruction per
//! derived key at each rail, the same bytes replayed from A and from B, and
//! a second reconcile in each region that finds nothing.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::{Duration, Instant};

use futures::future::join_all;
use keyfence::config::ServeSettings;
use keyfence::reconcile::{self, Class};
use keyfence::regions::{self, RegionState, RegionStore};
use keyfence::startup::REGION_VIEW_AGE;
use reqwest::StatusCode;
use serde_json::Value;
use sqlx::PgPool;

use crate::app::{TestApp, payment, spawn_app, start_instance};
use crate::process::ServeProcess;
use crate::proxy::Proxy;
use crate::reconcile::reconcile_in;

/// What one client went through: every status it saw, and the final bytes.
struct Paid {
    statuses: Vec<Option<StatusCode>>,
    bytes: Vec<u8>,
}

/// A client paying `key`, retrying over `urls` in turn as a client with
/// several regions would, until it gets its 201.
async fn pay_until_done(app: &TestApp, urls: &[String], key: &str) -> Paid {
    let body = payment(&format!("E2E-{key}"));
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut statuses = Vec::new();
    for attempt in 0.. {
        assert!(Instant::now() < deadline, "{key} did not finish within 60 s: {statuses:?}");
        // Like a real client, it stops waiting after a while and retries
        // elsewhere: a region stuck behind a partition answers late.
        let sent = app.try_pay_at(&urls[attempt % urls.len()], &app.api_key, key, &body);
        let response = tokio::time::timeout(Duration::from_secs(1), sent).await.ok().and_then(Result::ok);
        let status = response.as_ref().map(reqwest::Response::status);
        statuses.push(status);
        match status {
            Some(StatusCode::CREATED) => {
                return Paid { statuses, bytes: response.unwrap().bytes().await.unwrap().to_vec() };
            }
            Some(StatusCode::CONFLICT | StatusCode::SERVICE_UNAVAILABLE | StatusCode::ACCEPTED) | None => {}
            Some(other) => panic!("{key}: unexpected {other}"),
        }
        tokio::time::sleep(Duration::from_millis(150)).await;
    }
    unreachable!()
}

/// The stream: `count` clients, started a little apart.
async fn stream(app: &TestApp, urls: &[String], count: usize) -> BTreeMap<String, Paid> {
    join_all((0..count).map(|i| async move {
        tokio::time::sleep(Duration::from_millis(60 * i as u64)).await;
        let key = format!("drill-{i}");
        let paid = pay_until_done(app, urls, &key).await;
        (key, paid)
    }))
    .await
    .into_iter()
    .collect()
}

async fn declare(app: &TestApp, state: RegionState) {
    let store = RegionStore::new(app.keys.store.client().clone(), app.keys.store.table());
    regions::declare(&store, Some(&app.db.ledger), "test-1", state, "drill", "region A went away").await.unwrap();
    tokio::time::sleep(REGION_VIEW_AGE + Duration::from_millis(100)).await;
}

async fn unbalanced(pool: &PgPool) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM (SELECT payment_id FROM postings GROUP BY payment_id, currency
                                HAVING sum(amount_minor) <> 0) AS off",
    )
    .fetch_one(pool)
    .await
    .unwrap()
}

/// Payments per key that are not voided, in one ledger.
async fn live_payments(pool: &PgPool) -> HashMap<String, i64> {
    sqlx::query_as("SELECT idem_key, count(*) FROM payments WHERE status <> 'voided' GROUP BY idem_key")
        .fetch_all(pool)
        .await
        .unwrap()
        .into_iter()
        .collect()
}

/// Every invariant of the drill, once A is back and reconciled.
async fn assert_paid_once_everywhere(
    app: &TestApp,
    (a, b): (&ServeSettings, &ServeSettings),
    (a_url, b_url): (&str, &str),
    b_pool: &PgPool,
    paid: &BTreeMap<String, Paid>,
) {
    let (in_a, in_b) = (live_payments(app.db.ledger.pool()).await, live_payments(b_pool).await);
    for key in paid.keys() {
        let total = in_a.get(key).unwrap_or(&0) + in_b.get(key).unwrap_or(&0);
        assert_eq!(total, 1, "{key}: payments not voided across both ledgers");
    }
    assert_eq!((unbalanced(app.db.ledger.pool()).await, unbalanced(b_pool).await), (0, 0), "balanced in both");
    for rail in [&app.e1, &app.e2] {
        let statement = rail.statement().await;
        let keys: HashSet<_> = statement.iter().map(|a| a.idempotency_key.clone()).collect();
        assert_eq!((statement.len(), keys.len()), (paid.len(), paid.len()), "one instruction per derived key");
        assert_eq!(rail.sent_again().await, BTreeMap::new(), "each derived key sent once");
    }
    for (key, first) in paid {
        for url in [a_url, b_url] {
            // A just back from its partition may answer 503 at first (its
            // key-store client times out fast here): a client retries it.
            let replay = retry_503(async || {
                app.try_pay_at(url, &app.api_key, key, &payment(&format!("E2E-{key}"))).await.unwrap()
            })
            .await;
            let status = replay.status();
            let bytes = replay.bytes().await.unwrap().to_vec();
            assert_eq!(status, StatusCode::CREATED, "{key} from {url}: {}", String::from_utf8_lossy(&bytes));
            assert_eq!(bytes, first.bytes, "{key}: the same bytes from {url}");
        }
    }
    for (region, settings) in [("A", a), ("B", b)] {
        let again = reconcile_in(settings, false).await;
        assert!(again.findings.is_empty(), "region {region}, second run: {}", again.table());
    }
}

/// Sends until the answer is not a 503 (as a client retries one), 20 tries at most.
async fn retry_503(mut send: impl AsyncFnMut() -> reqwest::Response) -> reqwest::Response {
    for _ in 1..20 {
        let answer = send().await;
        if answer.status() != StatusCode::SERVICE_UNAVAILABLE {
            return answer;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    send().await
}

/// Every payment, read by id in each region, shows the status its client
/// was answered (201: succeeded), never a leftover's pending or voided.
async fn assert_reads_show_answers(app: &TestApp, urls: [&str; 2], paid: &BTreeMap<String, Paid>, when: &str) {
    for (key, first) in paid {
        let answered: Value = serde_json::from_slice(&first.bytes).unwrap();
        let path = format!("/v1/payments/{}", answered["id"].as_str().unwrap());
        for url in urls {
            let shown = retry_503(async || {
                app.http.get(format!("{url}{path}")).bearer_auth(&app.api_key).send().await.unwrap()
            })
            .await;
            assert_eq!(shown.status(), StatusCode::OK, "{key} from {url}, {when}");
            let shown: Value = shown.json().await.unwrap();
            assert_eq!(shown["status"], answered["status"], "{key} from {url}, {when}: {shown}");
        }
    }
}

/// A's reconciler repairs; every finding is a leftover of A's old owners
/// (named by a hand-off, or by a key finished elsewhere under a newer
/// fence). Returns how many it voided.
async fn void_leftovers(a: &ServeSettings) -> usize {
    let report = reconcile_in(a, true).await;
    let leftover = |f: &reconcile::Finding| matches!(f.class, Class::FencedLeftover | Class::MovedInFlight);
    assert!(report.findings.iter().all(leftover), "{}", report.table());
    assert_eq!(report.unrepaired(), 0, "{}", report.table());
    report.findings.len()
}

/// Keys B took over from A (re-homed there under a newer fence).
async fn taken_over(app: &TestApp) -> usize {
    key_items(app).await.values().filter(|item| item[3] == "S(\"test-2\")" && item[1] != "N(\"1\")").count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_region_killed_mid_stream_is_finished_by_the_other_exactly_once() {
    let app = spawn_app().await;
    let b = app.second_region("test-2").await;
    app.e2.set_faults(serde_json::json!({ "latency_ms": 100 })).await;
    // A dies when its first payment has committed its intent to pay at E2.
    let mut a = ServeProcess::start(&app, Some("after-commit:EXT2_SENT=return"), 0).await;
    let urls = [a.url.clone(), b.url.clone()];

    let (paid, ()) = tokio::join!(stream(&app, &urls, 16), async {
        a.exited().await;
        // Retries reach B, which answers "in flight" for A's requests...
        tokio::time::sleep(Duration::from_millis(1500)).await;
        // ...until the SRE declares A failed.
        declare(&app, RegionState::Failed).await;
    });
    let told_in_flight = paid.values().any(|p| p.statuses.contains(&Some(StatusCode::CONFLICT)));
    assert!(told_in_flight, "B answered 409 for A's requests before the failover");

    assert!(taken_over(&app).await >= 1, "B took A's requests over");

    // A comes back.
    declare(&app, RegionState::Active).await;
    let a = ServeProcess::start(&app, None, 0).await;
    assert_reads_show_answers(&app, [&a.url, &b.url], &paid, "before A's reconcile").await;
    assert!(void_leftovers(&app.settings).await >= 1, "the killed owner left work in A's ledger");
    assert_reads_show_answers(&app, [&a.url, &b.url], &paid, "after A's reconcile").await;
    assert_paid_once_everywhere(&app, (&app.settings, &b.settings), (&a.url, &b.url), b.db.ledger.pool(), &paid).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_region_cut_off_from_the_key_table_while_running_changes_nothing_once_back() {
    let app = spawn_app().await;
    let b = app.second_region("test-2").await;
    let emulator = app.keys.settings.aws_endpoint_url.clone().unwrap_or("http://127.0.0.1:4566".into());
    let emulator = reqwest::Url::parse(&emulator).unwrap();
    let target = format!("{}:{}", emulator.host_str().unwrap(), emulator.port_or_known_default().unwrap());
    let proxy = Proxy::start(tokio::net::lookup_host(target).await.unwrap().next().unwrap()).await;
    // Region A reaches the key table only through the proxy.
    let mut a_settings = app.settings.clone();
    a_settings.engine.keys.aws_endpoint_url = Some(format!("http://{}", proxy.addr));
    a_settings.engine.keys.attempt_timeout = Duration::from_millis(500);
    a_settings.engine.keys.max_attempts = Some(2);
    let (a_url, _a) = start_instance(&a_settings).await;
    app.e1.set_faults(serde_json::json!({ "latency_ms": 200 })).await;
    let urls = [a_url.clone(), b.url.clone()];

    let (paid, ()) = tokio::join!(stream(&app, &urls, 12), async {
        // The partition falls while A has requests in flight.
        let started = format!("{:?}", aws_sdk_dynamodb::types::AttributeValue::S("started".into()));
        while !key_items(&app).await.values().any(|fields| fields[0] == started.as_str()) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        proxy.hang();
        tokio::time::sleep(Duration::from_millis(2500)).await;
        declare(&app, RegionState::Failed).await;
    });
    let seen: BTreeMap<&String, &Vec<Option<StatusCode>>> = paid.iter().map(|(k, p)| (k, &p.statuses)).collect();
    assert!(
        paid.values().any(|p| p.statuses.contains(&Some(StatusCode::CONFLICT))),
        "B said in flight first: {seen:?}"
    );
    assert!(taken_over(&app).await >= 1, "B took A's requests over");

    // The partition heals with A still running: its old owners try to go on.
    let before = key_items(&app).await;
    proxy.heal();
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(key_items(&app).await, before, "A's old owners changed nothing in the key store");

    declare(&app, RegionState::Active).await;
    assert_reads_show_answers(&app, [&a_url, &b.url], &paid, "before A's reconcile").await;
    void_leftovers(&app.settings).await;
    assert_reads_show_answers(&app, [&a_url, &b.url], &paid, "after A's reconcile").await;
    assert_paid_once_everywhere(&app, (&app.settings, &b.settings), (&a_url, &b.url), b.db.ledger.pool(), &paid).await;
}

/// Every key item as raw attributes, by partition key.
async fn key_items(app: &TestApp) -> BTreeMap<String, Value> {
    let out = app.keys.store.client().scan().table_name(app.keys.store.table()).send().await.unwrap();
    out.items()
        .iter()
        .filter_map(|item| {
            let pk = item.get("pk")?.as_s().ok()?.clone();
            let fields = ["state", "fence", "owner", "home_region", "lease_until"]
                .map(|name| item.get(name).map(|v| format!("{v:?}")).unwrap_or_default());
            (!pk.starts_with("control#")).then(|| (pk, serde_json::json!(fields)))
        })
        .collect()
}
