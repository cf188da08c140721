//! Reads of the ledger that run again and again while its tables hold the
//! retention's worth of rows go through an index, not through every row:
//! a rail's notification finds its instruction by derived key, and each
//! recovery sweep lists the calls whose outcome is in doubt. PostgreSQL's
//! statistics count the rows each read, as planned for a table of that
//! size.

use keyfence::ledger::Ledger;
use keyfence::ledger::LedgerSettings;
use keyfence::ledger::inbox::{Arrival, Message};
use serde_json::json;
use uuid::Uuid;

use crate::harness::{TestLedger, eventually};

/// Calls in the ledger: each lookup must read a handful of them, not all.
const CALLS: i64 = 2000;

#[tokio::test]
async fn a_notifications_instruction_and_the_calls_in_doubt_are_found_by_index() {
    let db = TestLedger::new().await;
    let (in_doubt, settled) = (Uuid::new_v4(), Uuid::new_v4());
    sqlx::query(
        "INSERT INTO requests (client_id, idem_key, created_at, operation, request_hash, payment_id, fence, recovery_point)
         SELECT gen_random_uuid(), 'k' || n, now(), 'payment', 'h', gen_random_uuid(), 1, 'FINISHED'
           FROM generate_series(1, $1) AS n",
    )
    .bind(CALLS)
    .execute(db.ledger.pool())
    .await
    .unwrap();
    // Every call settled, but one parked and then called indeterminate.
    sqlx::query(
        "INSERT INTO external_calls (client_id, idem_key, request_created_at, step, derived_key, fence, outcome,
                                     next_probe_at)
         SELECT client_id, idem_key, created_at, 'ext2',
                CASE idem_key WHEN 'k1' THEN $1 WHEN 'k2' THEN $2 ELSE gen_random_uuid() END, 1,
                CASE idem_key WHEN 'k1' THEN 'indeterminate' ELSE 'done' END,
                CASE idem_key WHEN 'k1' THEN now() END
           FROM requests",
    )
    .bind(in_doubt)
    .bind(settled)
    .execute(db.ledger.pool())
    .await
    .unwrap();
    sqlx::query("ANALYZE requests, external_calls").execute(db.ledger.pool()).await.unwrap();

    // The lookups run on a handle of their own, closed after them: a
    // backend that ends reports its statistics, on every version.
    let lookups = Ledger::connect(&LedgerSettings { pool_size: 1, ..db.settings.clone() }).await.unwrap();
    let before = rows_read(&db).await;
    let listed = lookups.indeterminate().await.unwrap();
    assert_eq!(listed.iter().map(|c| c.derived_key).collect::<Vec<_>>(), [in_doubt]);
    let message = Message {
        rail: "e2".into(),
        id: "m-1".into(),
        kind: "applied",
        derived_key: Some(settled),
        body: json!({}),
        signed: Default::default(),
        handed_from: None,
    };
    let arrival = lookups.receive(&message, false).await.unwrap();
    assert_ne!(arrival, Arrival::Unknown("no instruction of this ledger has this key"), "the instruction is found");
    lookups.pool().close().await;

    // All of them at once, so the first count seen is the whole of it.
    let mut read = 0;
    eventually("the lookups' statistics", async || {
        read = rows_read(&db).await - before;
        read > 0
    })
    .await;
    assert!(read < 20, "the two lookups read {read} of the {CALLS} calls");
}

/// Rows of `external_calls` (any partition) read so far, whole-table reads
/// and index entries together.
async fn rows_read(db: &TestLedger) -> i64 {
    sqlx::query_scalar(
        "SELECT ((SELECT coalesce(sum(seq_tup_read), 0) FROM pg_stat_user_tables WHERE relname LIKE 'external_calls%')
              + (SELECT coalesce(sum(idx_tup_read), 0) FROM pg_stat_user_indexes WHERE relname LIKE 'external_calls%'))::int8",
    )
    .fetch_one(db.ledger.pool())
    .await
    .unwrap()
}
