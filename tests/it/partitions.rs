//! The idempotency tables stay bounded: 20,000 payments over twelve days,
//! the retention over for most of them, one maintenance run: the days past
//! their keeping are dropped from `requests`, `phase_runs` and
//! `external_calls`, the key table keeps only the keys within the
//! retention, a day with an unfinished request (or a request finished late)
//! is kept and reported, payments are all still there, and days ahead exist.

use std::collections::BTreeMap;
use std::time::Duration;

use keyfence::domain::{ClientId, Fence, IdempotencyKey, Millis, Owner, RequestHash, ScopedKey, StoredResponse};
use keyfence::keystore::{KeyItem, KeyState};
use serde_json::Value;
use time::OffsetDateTime;

use crate::app::{TestApp, spawn_app};
use crate::process::keyfence_command;

const PER_DAY: i64 = 2_000;
/// Days back from today (UTC) that hold payments: twelve days, 20,000 payments
/// with today's (yesterday and the day before stay empty, clear of the cut).
const OLD_DAYS: std::ops::RangeInclusive<i64> = 3..=11;

/// Seeds `PER_DAY` finished payments created in the first hours of the UTC
/// day `back` days ago: their requests (finished a second after they
/// began), four phase runs and two external calls each, and the payment.
async fn seed_day(app: &TestApp, client: ClientId, back: i64) {
    let statement = "
        WITH seeded AS (
            SELECT n, date_trunc('day', now() AT TIME ZONE 'UTC') AT TIME ZONE 'UTC'
                      - make_interval(days => $2) + n * interval '1 second' AS at
              FROM generate_series(1, $3) AS n
        ), r AS (
            INSERT INTO requests (client_id, idem_key, created_at, operation, request_hash, payment_id, fence,
                                  recovery_point, updated_at, response_status)
            SELECT $1, 'day' || $2 || '-' || n, at, 'payment', 'ab', gen_random_uuid(), 1, 'FINISHED',
                   at + interval '1 second', 201
              FROM seeded
            RETURNING client_id, idem_key, created_at, payment_id
        ), p AS (
            INSERT INTO phase_runs (client_id, idem_key, request_created_at, point, fence)
            SELECT client_id, idem_key, created_at, point, 1
              FROM r, unnest(ARRAY['H1_DONE', 'EXT1_SENT', 'EXT2_SENT', 'FINISHED']) AS point
        ), c AS (
            INSERT INTO external_calls (client_id, idem_key, request_created_at, step, derived_key, fence, outcome)
            SELECT client_id, idem_key, created_at, step, gen_random_uuid(), 1, 'done'
              FROM r, unnest(ARRAY['ext1', 'ext2']) AS step
        )
        INSERT INTO payments (id, client_id, idem_key, request_created_at, amount_minor, currency, debtor_account,
                              creditor_account, end_to_end_id, status, fence)
        SELECT payment_id, client_id, idem_key, created_at, 1250, 'EUR', 'DE89370400440532013000',
               'FR1420041010050500013M02606', 'E2E-' || idem_key, 'succeeded', 1
          FROM r";
    sqlx::query(statement)
        .bind(client.as_uuid())
        .bind(back as i32)
        .bind(PER_DAY)
        .execute(app.db.ledger.pool())
        .await
        .unwrap();
}

/// A finished key item per seeded payment of the day `back` days ago,
/// expired when the day is old (`expires_at` a day after it began).
fn keys_of_day(client: ClientId, back: i64) -> Vec<KeyItem> {
    let day = Millis::new(
        u64::try_from(
            (OffsetDateTime::now_utc().date().midnight().assume_utc().unix_timestamp() - back * 86_400) * 1000,
        )
        .unwrap(),
    );
    (1..=PER_DAY)
        .map(|n| KeyItem {
            key: ScopedKey::new(client, IdempotencyKey::parse(&format!("day{back}-{n}")).unwrap()),
            request_hash: RequestHash::from_hex("ab".repeat(32)),
            request: b"{}".to_vec(),
            operation: "payment".into(),
            state: KeyState::Finished,
            fence: Fence::FIRST,
            lease_until: day,
            owner: Owner::attempt_of("seed"),
            home_region: "test-1".into(),
            created_at: day,
            payment_id: uuid::Uuid::now_v7(),
            response: Some(StoredResponse { status: 201, headers: BTreeMap::new(), body: b"{}".to_vec() }),
            expires_at: Some(day.plus(Duration::from_secs(86_400)).as_secs()),
            left: Default::default(),
        })
        .collect()
}

async fn count(app: &TestApp, table: &str) -> i64 {
    app.count(table).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn maintenance_bounds_the_idempotency_tables_and_keeps_what_is_unfinished() {
    let app = spawn_app().await;
    let client = app.client_id().await;
    let days: Vec<i64> = std::iter::once(0).chain(OLD_DAYS).collect();
    // The days are there before any maintenance ran (the migration made
    // today and the days ahead; older ones land in the default partition
    // until a maintenance run adds them, so add them first as an ingest of
    // old data would).
    sqlx::query(
        "SELECT keyfence_add_day_partitions((now() AT TIME ZONE 'UTC')::date - 12, (now() AT TIME ZONE 'UTC')::date)",
    )
    .execute(app.db.ledger.pool())
    .await
    .unwrap();
    for &back in &days {
        seed_day(&app, client, back).await;
        app.keys.store.seed(&keys_of_day(client, back)).await.unwrap();
    }
    // Five requests of one old day never finished; one of another finished only an hour ago.
    sqlx::query("UPDATE requests SET recovery_point = 'EXT2_SENT' WHERE idem_key IN ('day5-1','day5-2','day5-3','day5-4','day5-5')")
        .execute(app.db.ledger.pool())
        .await
        .unwrap();
    sqlx::query("UPDATE requests SET updated_at = now() - interval '1 hour' WHERE idem_key = 'day4-7'")
        .execute(app.db.ledger.pool())
        .await
        .unwrap();
    assert_eq!(count(&app, "requests").await, 20_000);
    assert_eq!(app.key_items().await, 20_000);

    let run = keyfence_command(&app, "maintain")
        .args(["--partitions", "--expire", "--json", "--rate", "5000", "--segments", "8"])
        // A scan page of 20,000 fresh keys takes the emulator seconds to serve.
        .env("KEYFENCE_KEYSTORE_ATTEMPT_TIMEOUT_MS", "60000")
        .env("KEYFENCE_RETENTION", "1d")
        .env("KEYFENCE_PARTITION_MARGIN", "1h")
        .output()
        .await
        .unwrap();
    assert!(run.status.success(), "{}\n{}", String::from_utf8_lossy(&run.stderr), String::from_utf8_lossy(&run.stdout));
    let report: Value = serde_json::from_slice(&run.stdout).unwrap();
    let partitions = &report["partitions"];

    // Of the nine old days seven are dropped; the one with unfinished
    // requests and the one written an hour ago are kept. (Empty days are
    // dropped too once past their keeping; which of the last two are
    // depends on the hour.)
    let today = OffsetDateTime::now_utc().date();
    let day = |back: i64| (today - time::Duration::days(back)).to_string();
    let seeded: Vec<String> = days.iter().map(|&back| day(back)).collect();
    let dropped: Vec<String> = partitions["days_dropped"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d.as_str().unwrap().to_owned())
        .filter(|d| seeded.contains(d))
        .collect();
    let mut expected: Vec<String> = OLD_DAYS.filter(|back| ![4, 5].contains(back)).map(day).collect();
    expected.sort();
    assert_eq!(dropped, expected, "{report}");
    assert!(partitions["days_dropped"].as_array().unwrap().iter().any(|d| d == &day(12)), "the empty day: {report}");
    let kept = partitions["days_kept"].as_array().unwrap();
    assert_eq!(kept.len(), 2, "{report}");
    assert!(kept.iter().any(|k| k["unfinished"] == 5), "the day with unfinished requests is reported: {report}");
    assert!(kept.iter().any(|k| k["unfinished"] == 0), "the day finished late is reported: {report}");
    assert_eq!(partitions["outside_days"], 0);

    // What the retention allows: today's, and the two kept days'.
    let left = 3 * PER_DAY;
    assert_eq!(count(&app, "requests").await, left);
    assert_eq!(count(&app, "phase_runs").await, 4 * left);
    assert_eq!(count(&app, "external_calls").await, 2 * left);
    let unfinished: i64 = sqlx::query_scalar("SELECT count(*) FROM requests WHERE recovery_point <> 'FINISHED'")
        .fetch_one(app.db.ledger.pool())
        .await
        .unwrap();
    assert_eq!(unfinished, 5, "nothing unfinished was dropped");
    assert_eq!(count(&app, "payments").await, 20_000, "payments are business records: all kept");
    // The key table: the old days' keys expired and were deleted; today's remain.
    // (The emulator may reap an expired key itself first: then the sweep
    // finds it gone, and counts it as changed meanwhile.)
    assert_eq!(report["expired"], 9 * PER_DAY, "{report}");
    let reaped = report["deleted"].as_i64().unwrap() + report["changed_meanwhile"].as_i64().unwrap();
    assert_eq!(reaped, 9 * PER_DAY, "{report}");
    assert_eq!(app.key_items().await, PER_DAY as usize);

    // Today and the days ahead are partitioned; a second run changes nothing.
    let ahead: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
          WHERE i.inhparent = 'requests'::regclass
            AND c.relname IN (SELECT 'requests_' || to_char((now() AT TIME ZONE 'UTC')::date + n, 'YYYYMMDD') FROM generate_series(0, 2) n)",
    )
    .fetch_one(app.db.ledger.pool())
    .await
    .unwrap();
    assert_eq!(ahead, 3);
    let again = keyfence_command(&app, "maintain")
        .args(["--partitions", "--json"])
        .env("KEYFENCE_RETENTION", "1d")
        .env("KEYFENCE_PARTITION_MARGIN", "1h")
        .output()
        .await
        .unwrap();
    let again: Value = serde_json::from_slice(&again.stdout).unwrap();
    assert_eq!(again["partitions"]["days_dropped"].as_array().map(Vec::len), Some(0), "{again}");
    assert_eq!(count(&app, "requests").await, left);
}
