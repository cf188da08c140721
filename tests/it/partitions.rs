//! The idempotency tables stay bounded: `serve` makes the ledger's
//! partitions ahead and drops old ones while payments flow, `keyfence
//! maintain --partitions --expire` finishes the job, and afterwards the
//! ledger holds only what has not ended (with every row of it) and the key
//! table only keys within their retention. Payments, business records, stay.

use std::collections::HashSet;
use std::time::Duration;

use futures::StreamExt;
use keyfence::config::ServeSettings;
use keyfence::domain::{ClientId, Fence, IdempotencyKey, Millis, ScopedKey};
use keyfence::keystore::{Handoff, KeyState, KeyStore};
use reqwest::StatusCode;
use serde_json::{Value, json};
use uuid::Uuid;

use crate::app::{TestApp, payment, spawn_app_with};
use crate::process::keyfence_command;

/// Short enough to elapse within a test: keys kept 1 s (the grace must
/// cover a third of the tests' 10-second lease), the ledger 10 s (at least
/// the key retention and two graces), spans of one second.
const FLAGS: [&str; 10] = [
    "--retention",
    "1s",
    "--retention-grace",
    "4s",
    "--ledger-retention",
    "10s",
    "--partition-span",
    "1s",
    "--partitions-ahead",
    "60",
];

fn short(s: &mut ServeSettings, housekeeping: Duration) {
    // A rail call that stalls past this is an unknown outcome and parks
    // its payment (202): a second, so that a loaded machine does not park
    // one of twenty thousand now and then, which is not what these tests
    // are about (three attempts and their pauses stay within a third of
    // the tests' 10-second lease).
    s.engine.rails.rail_timeout = Duration::from_secs(1);
    s.engine.work.retention.retention = Some(Duration::from_secs(1));
    s.engine.work.retention.grace = Duration::from_secs(4);
    s.partitions.keep = Duration::from_secs(10);
    s.partitions.span = Duration::from_secs(1);
    s.partitions.ahead = 60;
    s.partition_interval_ms = housekeeping.as_millis() as u64;
}

/// Rows per idempotency table, and the keys of the requests left.
async fn ledger_rows(app: &TestApp) -> (i64, i64, i64, i64, HashSet<String>) {
    let pool = app.db.ledger.pool();
    let count = async |table: &str| -> i64 {
        sqlx::query_scalar(sqlx::AssertSqlSafe(format!("SELECT count(*) FROM {table}"))).fetch_one(pool).await.unwrap()
    };
    let left: Vec<String> = sqlx::query_scalar("SELECT idem_key FROM requests").fetch_all(pool).await.unwrap();
    (
        count("requests").await,
        count("phase_runs").await,
        count("external_calls").await,
        count("payments").await,
        left.into_iter().collect(),
    )
}

/// Every key item in the table, by key string and state.
async fn key_items(app: &TestApp) -> Vec<(String, KeyState)> {
    let (mut items, mut cursor) = (Vec::new(), None);
    loop {
        let page = app.keys.store.scan(0, 1, cursor).await.unwrap();
        items.extend(page.items.into_iter().map(|item| (item.key.key.as_str().to_owned(), item.state)));
        match page.next {
            Some(next) => cursor = Some(next),
            None => return items,
        }
    }
}

/// Pays `count` payments, `concurrency` at a time; all must succeed.
async fn pay_many(app: &TestApp, prefix: &str, count: usize, concurrency: usize) {
    let answers: Vec<StatusCode> = futures::stream::iter(0..count)
        .map(
            |i| async move { app.pay(&format!("{prefix}-{i}"), &payment(&format!("E2E-{prefix}-{i}"))).await.status() },
        )
        .buffer_unordered(concurrency)
        .collect()
        .await;
    let created = answers.iter().filter(|s| **s == StatusCode::CREATED).count();
    assert_eq!(
        created,
        count,
        "every payment succeeds while partitions come and go: {:?}",
        answers.iter().find(|s| **s != StatusCode::CREATED)
    );
}

/// Left in flight: the payment rail never answers them.
async fn pay_in_flight(app: &TestApp, keys: &[&str]) {
    app.e2.set_faults(json!({ "latency_ms": 600_000 })).await;
    for key in keys {
        assert_eq!(app.pay(key, &payment(&format!("E2E-{key}"))).await.status(), StatusCode::ACCEPTED);
    }
    app.e2.clear_faults().await;
    // The payments after them begin in a later span.
    tokio::time::sleep(Duration::from_millis(1100)).await;
}

/// `keyfence maintain` with the short settings and `what`; its JSON report.
async fn maintain(app: &TestApp, what: &[&str]) -> Value {
    let (succeeded, report) = try_maintain(app, what).await;
    assert!(succeeded, "{report}");
    report
}

/// `keyfence maintain` as [`maintain`], which may fail: whether it
/// succeeded, and its JSON report.
async fn try_maintain(app: &TestApp, what: &[&str]) -> (bool, Value) {
    let run = keyfence_command(app, "maintain")
        .args(what)
        .args(FLAGS)
        .args(["--json", "--rate", "1000"])
        .env("KEYFENCE_KEYSTORE_ATTEMPT_TIMEOUT_MS", "60000")
        .output()
        .await
        .unwrap();
    let report = serde_json::from_slice(&run.stdout)
        .unwrap_or_else(|e| panic!("a JSON report ({e}): {}", String::from_utf8_lossy(&run.stderr)));
    (run.status.success(), report)
}

/// Whether the newest partition of `requests` ends later than now.
async fn spans_made_past_now(app: &TestApp) -> bool {
    sqlx::query_scalar(
        "SELECT coalesce(max((regexp_match(pg_get_expr(c.relpartbound, c.oid), $$TO \\('([^']+)'\\)$$))[1]::timestamptz) > now(), false)
           FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
          WHERE i.inhparent = 'requests'::regclass",
    )
    .fetch_one(app.db.ledger.pool())
    .await
    .unwrap()
}

/// Waits until every span holding the payments so far is past the ledger's retention.
async fn until_retention_elapsed() {
    tokio::time::sleep(Duration::from_secs(12)).await;
}

/// Asserts the ledger holds exactly the requests in flight, each with its
/// phase runs and external call, and that every payment is still there.
async fn only_in_flight_left(app: &TestApp, in_flight: &[&str], paid: i64) {
    let (requests, runs, calls, payments, left) = ledger_rows(app).await;
    let expected: HashSet<String> = in_flight.iter().map(|k| (*k).to_owned()).collect();
    assert_eq!(left, expected, "only the requests in flight are left");
    assert_eq!(requests, in_flight.len() as i64);
    let pool = app.db.ledger.pool();
    let (own_runs, own_calls): (i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM phase_runs p JOIN requests r ON (r.client_id, r.idem_key, r.created_at) = (p.client_id, p.idem_key, p.request_created_at)),
                (SELECT count(*) FROM external_calls c JOIN requests r ON (r.client_id, r.idem_key, r.created_at) = (c.client_id, c.idem_key, c.request_created_at))",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    assert!(runs >= in_flight.len() as i64 && calls >= in_flight.len() as i64, "runs {runs}, calls {calls}");
    assert_eq!((own_runs, own_calls), (runs, calls), "nothing is left of the requests dropped");
    assert_eq!(payments, paid + in_flight.len() as i64, "payments are business records: all kept");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn old_partitions_go_once_their_requests_ended_and_a_request_in_flight_keeps_its_own() {
    // No housekeeping in `serve` beyond making the spans at start-up.
    let app = spawn_app_with(|s| short(s, Duration::from_secs(3600))).await;
    let in_flight = ["in-flight-1", "in-flight-2"];
    pay_in_flight(&app, &in_flight).await;
    pay_many(&app, "paid", 40, 8).await;
    let before = ledger_rows(&app).await;
    assert_eq!(before.0, 42, "every request written");
    until_retention_elapsed().await;

    // A hand-off from this region waits for its reconciler: nothing goes.
    let handoff = Handoff {
        from: "test-1".into(),
        to: "test-2".into(),
        key: ScopedKey::new(ClientId::new(Uuid::new_v4()), IdempotencyKey::parse("handed-off").unwrap()),
        created_at: Millis::now(),
        payment_id: Uuid::new_v4(),
        fence: Fence::new(2),
    };
    app.keys.store.hand_off(&handoff).await.unwrap();
    let held = maintain(&app, &["--partitions"]).await;
    assert_eq!(
        (held["partitions"]["held_for_handoffs"].as_u64(), held["partitions"]["dropped"].as_array().map(Vec::len)),
        (Some(1), Some(0)),
        "{held}"
    );
    assert_eq!(ledger_rows(&app).await.0, 42, "nothing dropped while a hand-off waits");
    app.keys.store.forget_handoff(&handoff).await.unwrap();

    // Counted for another region's name, the hand-offs would be none: the
    // ledger knows whose it is, and refuses.
    let run = keyfence_command(&app, "maintain")
        .args(["--partitions", "--region", "test-2"])
        .args(FLAGS)
        .stderr(std::process::Stdio::piped())
        .output()
        .await
        .unwrap();
    let said = String::from_utf8_lossy(&run.stderr);
    assert!(!run.status.success() && said.contains("region test-1's, not test-2's"), "{said}");
    assert_eq!(ledger_rows(&app).await.0, 42, "nothing dropped for a region that is not the ledger's");

    let report = maintain(&app, &["--partitions"]).await;
    let partitions = &report["partitions"];
    let dropped = partitions["dropped"].as_array().unwrap();
    assert!(!dropped.is_empty(), "{report}");
    assert_eq!(dropped.iter().map(|d| d["requests"].as_i64().unwrap()).sum::<i64>(), 40, "{report}");
    let kept = partitions["kept"].as_array().unwrap();
    assert_eq!(kept.iter().map(|k| k["open"].as_i64().unwrap()).sum::<i64>(), 2, "kept and reported: {report}");
    only_in_flight_left(&app, &in_flight, 40).await;

    // A second round drops no request (only spans that have since grown
    // old empty), and still keeps them.
    let again = maintain(&app, &["--partitions"]).await;
    let dropped = again["partitions"]["dropped"].as_array().unwrap();
    assert_eq!(dropped.iter().map(|d| d["requests"].as_i64().unwrap()).sum::<i64>(), 0, "{again}");
    assert_eq!(again["partitions"]["kept"].as_array().unwrap().len(), kept.len(), "{again}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_no_partition_was_made_for_land_in_the_default_and_are_deleted_once_ended() {
    // `serve` makes no partitions: every request lands in the default one.
    let app = spawn_app_with(|s| short(s, Duration::ZERO)).await;
    let in_flight = ["in-flight-1"];
    pay_in_flight(&app, &in_flight).await;
    pay_many(&app, "paid", 20, 8).await;
    let (where_, rows): (String, i64) =
        sqlx::query_as("SELECT tableoid::regclass::text, count(*) FROM requests GROUP BY 1")
            .fetch_one(app.db.ledger.pool())
            .await
            .unwrap();
    assert_eq!((where_.as_str(), rows), ("requests_default", 21));
    until_retention_elapsed().await;

    let report = maintain(&app, &["--partitions"]).await;
    assert_eq!(report["partitions"]["default_deleted"], 20, "{report}");
    only_in_flight_left(&app, &in_flight, 20).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_span_that_cannot_be_dropped_is_reported_and_the_rest_still_go() {
    let app = spawn_app_with(|s| short(s, Duration::from_secs(3600))).await;
    for round in 0..3 {
        pay_many(&app, &format!("paid-{round}"), 5, 5).await;
        tokio::time::sleep(Duration::from_millis(1100)).await;
    }
    let pool = app.db.ledger.pool();
    let oldest: String =
        sqlx::query_scalar("SELECT tableoid::regclass::text FROM requests ORDER BY created_at LIMIT 1")
            .fetch_one(pool)
            .await
            .unwrap();
    // Something of a person's depends on the oldest span: it cannot be dropped.
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE VIEW a_report AS SELECT * FROM {oldest}")))
        .execute(pool)
        .await
        .unwrap();
    until_retention_elapsed().await;

    let (succeeded, report) = try_maintain(&app, &["--partitions"]).await;
    assert!(!succeeded, "a failed drop fails the run: {report}");
    let failed = report["partitions"]["failed"].as_array().unwrap();
    let suffix = oldest.trim_start_matches("requests_");
    assert_eq!(failed.len(), 1, "{report}");
    assert_eq!(failed[0]["step"], format!("dropping {suffix}"), "{report}");
    let dropped = report["partitions"]["dropped"].as_array().unwrap();
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM requests").fetch_one(pool).await.unwrap();
    assert_eq!(
        15 - dropped.iter().map(|d| d["requests"].as_i64().unwrap()).sum::<i64>(),
        left,
        "the spans after it were still dropped: {report}"
    );
    let in_oldest: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!("SELECT count(*) FROM {oldest}")))
        .fetch_one(pool)
        .await
        .unwrap();
    assert!(in_oldest > 0 && left == in_oldest, "only the span that could not go is left: {left}, {report}");

    sqlx::query("DROP VIEW a_report").execute(pool).await.unwrap();
    maintain(&app, &["--partitions"]).await;
    only_in_flight_left(&app, &[], 15).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_span_another_instance_drops_while_this_round_goes_is_left_to_it() {
    let app = spawn_app_with(|s| short(s, Duration::from_secs(3600))).await;
    pay_many(&app, "paid", 5, 5).await;
    until_retention_elapsed().await;
    let pool = app.db.ledger.pool();
    let span: String = sqlx::query_scalar(
        "SELECT substr(c.relname, length('requests_') + 1)
           FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
          WHERE i.inhparent = 'requests'::regclass AND c.relname LIKE 'requests\\_p%'
          ORDER BY c.relname LIMIT 1",
    )
    .fetch_one(pool)
    .await
    .unwrap();

    let bound: String = sqlx::query_scalar("SELECT pg_get_expr(relpartbound, oid) FROM pg_class WHERE relname = $1")
        .bind(format!("requests_{span}"))
        .fetch_one(pool)
        .await
        .unwrap();

    // A reader of the oldest partitions holds up the round's first drop,
    // after it has listed the spans; meanwhile another instance drops
    // one of them.
    let mut other = pool.begin().await.unwrap();
    sqlx::query("LOCK TABLE requests_history IN ACCESS SHARE MODE").execute(&mut *other).await.unwrap();
    let other_drops = async {
        let round_waits = async || -> bool {
            sqlx::query_scalar(
                "SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE 'LOCK TABLE requests, %')",
            )
            .fetch_one(pool)
            .await
            .unwrap()
        };
        let mut waited = 0;
        while !round_waits().await {
            waited += 1;
            assert!(waited < 300, "the round never came to drop a span");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        for table in ["external_calls", "phase_runs", "requests"] {
            let detach = format!("ALTER TABLE {table} DETACH PARTITION {table}_{span}");
            sqlx::query(sqlx::AssertSqlSafe(detach)).execute(&mut *other).await.unwrap();
            let drop = format!("DROP TABLE {table}_{span}");
            sqlx::query(sqlx::AssertSqlSafe(drop)).execute(&mut *other).await.unwrap();
        }
        other.commit().await.unwrap();
    };
    let ((succeeded, report), ()) = tokio::join!(try_maintain(&app, &["--partitions"]), other_drops);
    assert!(succeeded, "a span another instance dropped is no failure: {report}");
    let dropped = report["partitions"]["dropped"].as_array().unwrap();
    assert!(dropped.iter().all(|d| d["partition"] != span.as_str()), "{report}");
    only_in_flight_left(&app, &[], 5).await;

    // A span that is there but not where its name finds it (another
    // schema) is no span another instance dropped: it is reported.
    let elsewhere =
        format!("CREATE SCHEMA elsewhere; CREATE TABLE elsewhere.requests_{span} PARTITION OF requests {bound}");
    sqlx::raw_sql(sqlx::AssertSqlSafe(elsewhere)).execute(pool).await.unwrap();
    let (succeeded, report) = try_maintain(&app, &["--partitions"]).await;
    assert!(!succeeded, "{report}");
    assert_eq!(report["partitions"]["failed"][0]["step"], format!("counting {span}"), "{report}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn while_the_key_table_cannot_be_read_spans_are_made_ahead_and_nothing_is_dropped() {
    let app = spawn_app_with(|s| {
        short(s, Duration::from_secs(1));
        s.partitions.ahead = 2;
    })
    .await;
    pay_many(&app, "paid", 5, 5).await;
    // Every query of the key table, the hand-offs' included, is refused.
    app.keys
        .arm(json!({ "operation": "Query", "count": 1_000_000, "action": "error", "code": "AccessDeniedException" }))
        .await;
    until_retention_elapsed().await;
    assert!(spans_made_past_now(&app).await, "serve went on making the spans ahead");
    assert_eq!(ledger_rows(&app).await.0, 5, "nothing dropped while the hand-offs could not be read");

    let (succeeded, report) = try_maintain(&app, &["--partitions"]).await;
    assert!(!succeeded && report["partitions"]["handoffs_unread"] == true, "{report}");
    assert_eq!(report["partitions"]["dropped"].as_array().map(Vec::len), Some(0), "{report}");

    // The region a ledger belongs to is said, never assumed.
    let run = keyfence_command(&app, "maintain")
        .args(["--partitions"])
        .env_remove("KEYFENCE_REGION")
        .stderr(std::process::Stdio::piped())
        .output()
        .await
        .unwrap();
    assert!(!run.status.success() && String::from_utf8_lossy(&run.stderr).contains("--region"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_drops_nothing_from_a_ledger_that_is_another_regions() {
    let app = spawn_app_with(|s| short(s, Duration::from_secs(1))).await;
    pay_many(&app, "paid", 5, 5).await;
    // The ledger turns out to be another region's (this instance's
    // KEYFENCE_REGION is stale): hand-offs counted under this instance's
    // name would be none, so serve's rounds drop nothing.
    let rebind = async |region: &str| {
        sqlx::query("UPDATE region_fence SET region = $1").bind(region).execute(app.db.ledger.pool()).await.unwrap();
    };
    rebind("test-2").await;
    until_retention_elapsed().await;
    assert!(spans_made_past_now(&app).await, "serve went on making the spans ahead");
    assert_eq!(ledger_rows(&app).await.0, 5, "nothing dropped from another region's ledger");

    // Its own again, the next rounds drop what has ended.
    rebind("test-1").await;
    for _ in 0..50 {
        if ledger_rows(&app).await.0 == 0 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    panic!("serve's rounds never dropped the ended requests of its own ledger: {:?}", ledger_rows(&app).await.0);
}

/// 20,000 payments with `serve` making and dropping partitions every
/// second beside them; then one maintenance run of the ledger and the keys.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_thousand_payments_leave_only_what_the_retention_allows() {
    let app = spawn_app_with(|s| {
        short(s, Duration::from_secs(1));
        // One client pays them all, as fast as the emulator takes them.
        (s.fair_use.client_rate, s.fair_use.client_burst, s.fair_use.client_in_flight) = (100_000, 100_000, 64);
    })
    .await;
    let in_flight = ["in-flight-1", "in-flight-2", "in-flight-3"];
    pay_in_flight(&app, &in_flight).await;
    pay_many(&app, "paid", 20_000, 32).await;
    until_retention_elapsed().await;

    let report = maintain(&app, &["--partitions", "--expire"]).await;
    only_in_flight_left(&app, &in_flight, 20_000).await;
    let kept = report["partitions"]["kept"].as_array().unwrap();
    assert_eq!(kept.iter().map(|k| k["open"].as_i64().unwrap()).sum::<i64>(), 3, "{report}");
    let mut keys = key_items(&app).await;
    keys.sort_by(|a, b| a.0.cmp(&b.0));
    assert_eq!(
        keys,
        in_flight.iter().map(|k| ((*k).to_owned(), KeyState::Started)).collect::<Vec<_>>(),
        "the key table holds the keys in flight and nothing past its retention: {report}"
    );
}
