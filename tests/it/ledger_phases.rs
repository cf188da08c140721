//! The ledger's fence check, on the real PostgreSQL: a phase under a current
//! token commits; a phase under an older one, or a phase that already ran,
//! is refused and leaves nothing behind.

use keyfence::domain::{Fence, Millis, PaymentRequest, RecoveryPoint, RequestHash, StoredResponse};
use keyfence::ledger::external::{CallWrites, Intent, Sent};
use keyfence::ledger::payments::{self, Leg};
use keyfence::ledger::writes::Writes;
use keyfence::ledger::{Adoption, Ledger, LedgerError, Phase, RequestRecord};
use keyfence::rail::{Applied, Verdict};
use sqlx::PgConnection;
use uuid::Uuid;

use crate::harness::{TestLedger, fresh_key, waiting_for_lock};

const H1_DONE: RecoveryPoint = RecoveryPoint::named("H1_DONE");
const EXT1_SENT: RecoveryPoint = RecoveryPoint::named("EXT1_SENT");

fn request() -> RequestRecord {
    RequestRecord {
        key: fresh_key(),
        created_at: Millis::now(),
        operation: "payment".into(),
        request_hash: RequestHash::from_hex("cd".repeat(32)),
        payment_id: Uuid::now_v7(),
        request: b"{}".to_vec(),
    }
}

/// The test payment: its id, its request's key ($1-$4) and fence ($5).
const INSERT_PAYMENT: &str =
    "INSERT INTO payments (id, client_id, idem_key, request_created_at, amount_minor, currency,
                               debtor_account, creditor_account, end_to_end_id, status, fence)
     VALUES ($1, $2, $3, $4, 1250, 'EUR', 'DE01', 'FR02', 'E2E-1', 'pending', $5)";

/// The first phase's business writes: the payment and a balanced hold.
async fn hold_funds(conn: &mut PgConnection, req: &RequestRecord, fence: Fence) -> Result<(), sqlx::Error> {
    sqlx::query(INSERT_PAYMENT)
        .bind(req.payment_id)
        .bind(req.key.client.as_uuid())
        .bind(req.key.key.as_str())
        .bind(keyfence::ledger::timestamp(req.created_at))
        .bind(fence.get() as i64)
        .execute(&mut *conn)
        .await?;
    post(conn, req.payment_id, "hold", &[("DE01", -1250), ("DE01:held", 1250)], fence).await
}

async fn post(
    conn: &mut PgConnection,
    payment: Uuid,
    entry: &str,
    legs: &[(&str, i64)],
    fence: Fence,
) -> Result<(), sqlx::Error> {
    for (account, amount) in legs {
        sqlx::query(
            "INSERT INTO postings (payment_id, entry, account, amount_minor, currency, fence)
             VALUES ($1, $2, $3, $4, 'EUR', $5)",
        )
        .bind(payment)
        .bind(entry)
        .bind(account)
        .bind(amount)
        .bind(fence.get() as i64)
        .execute(&mut *conn)
        .await?;
    }
    Ok(())
}

async fn counts(ledger: &Ledger) -> (i64, i64, i64) {
    sqlx::query_as(
        "SELECT (SELECT count(*) FROM requests), (SELECT count(*) FROM payments), (SELECT count(*) FROM postings)",
    )
    .fetch_one(ledger.pool())
    .await
    .unwrap()
}

/// The recovery points recorded so far, in name order.
async fn points(ledger: &Ledger) -> Vec<String> {
    sqlx::query_scalar("SELECT point FROM phase_runs ORDER BY point").fetch_all(ledger.pool()).await.unwrap()
}

async fn state(ledger: &Ledger, req: &RequestRecord) -> (i64, String) {
    sqlx::query_as("SELECT fence, recovery_point FROM requests WHERE client_id = $1 AND idem_key = $2")
        .bind(req.key.client.as_uuid())
        .bind(req.key.key.as_str())
        .fetch_one(ledger.pool())
        .await
        .unwrap()
}

async fn first_phase(ledger: &Ledger, req: &RequestRecord, fence: Fence) -> Result<Phase, LedgerError> {
    let mut phase = ledger.begin_phase(req, fence, &RecoveryPoint::STARTED, &H1_DONE, &[&H1_DONE]).await?;
    hold_funds(phase.conn().await?, req, fence).await?;
    Ok(phase)
}

/// The first phase with its opening statement held: the payment and its
/// hold are held writes, sent with the opening as one statement.
async fn held_first_phase(ledger: &Ledger, req: &RequestRecord, fence: Fence) -> Result<Phase, LedgerError> {
    let from = RecoveryPoint::STARTED;
    let mut phase = ledger.begin_phase_held(req, fence, &from, &H1_DONE, &[&H1_DONE], CallWrites::default()).await?;
    phase.writes().push(INSERT_PAYMENT, |b| {
        b.bind(req.payment_id)
            .bind(req.key.client.as_uuid())
            .bind(req.key.key.as_str())
            .bind(keyfence::ledger::timestamp(req.created_at))
            .bind(fence.get() as i64);
    });
    let legs = [Leg { account: "DE01", amount_minor: -1250 }, Leg { account: "DE01:held", amount_minor: 1250 }];
    payments::post(phase.writes(), req.payment_id, "hold", "EUR", &legs, fence);
    Ok(phase)
}

#[tokio::test]
async fn a_phase_under_an_older_fence_is_refused_and_writes_nothing() {
    let db = TestLedger::new().await;
    let req = request();
    let t = Fence::new(2);
    first_phase(&db.ledger, &req, t).await.unwrap().commit().await.unwrap();
    assert_eq!(state(&db.ledger, &req).await, (2, "H1_DONE".into()));
    let before = counts(&db.ledger).await;
    assert_eq!(before, (1, 1, 2));

    let stale = Fence::new(1);
    match db.ledger.begin_phase(&req, stale, &H1_DONE, &EXT1_SENT, &[&EXT1_SENT]).await {
        Err(LedgerError::FencedOut { mine, current }) => assert_eq!((mine, current), (stale, t)),
        Err(other) => panic!("expected fenced out, got {other}"),
        Ok(_) => panic!("a phase under fence t-1 was allowed to begin"),
    }
    assert_eq!(state(&db.ledger, &req).await, (2, "H1_DONE".into()));
    assert_eq!(counts(&db.ledger).await, before);
    assert_eq!(points(&db.ledger).await, ["H1_DONE"], "the refused phase recorded a point");

    // The current owner carries on.
    let mut next = db.ledger.begin_phase(&req, t, &H1_DONE, &EXT1_SENT, &[&EXT1_SENT]).await.unwrap();
    post(next.conn().await.unwrap(), req.payment_id, "transfer", &[("DE01:held", -1250), ("FR02", 1250)], t)
        .await
        .unwrap();
    assert_eq!(next.commit().await.unwrap(), EXT1_SENT);
    assert_eq!(state(&db.ledger, &req).await, (2, "EXT1_SENT".into()));
    assert_eq!(points(&db.ledger).await, ["EXT1_SENT", "H1_DONE"]);
}

/// The external calls of `req`: step, outcome and the result recorded.
async fn calls(ledger: &Ledger, req: &RequestRecord) -> Vec<(String, String, Option<serde_json::Value>)> {
    sqlx::query_as(
        "SELECT step, outcome, result FROM external_calls WHERE client_id = $1 AND idem_key = $2 ORDER BY step",
    )
    .bind(req.key.client.as_uuid())
    .bind(req.key.key.as_str())
    .fetch_all(ledger.pool())
    .await
    .unwrap()
}

#[tokio::test]
async fn a_phases_external_call_writes_take_effect_only_with_its_fence_check() {
    let db = TestLedger::new().await;
    let req = request();
    let t = Fence::new(2);
    let e1 = CallWrites { intent: Some(intent("e1")), ..Default::default() };
    let phase =
        db.ledger.begin_phase_with(&req, t, &RecoveryPoint::STARTED, &EXT1_SENT, &[&EXT1_SENT], e1).await.unwrap();
    phase.commit().await.unwrap();
    assert_eq!(calls(&db.ledger, &req).await, [("e1".to_owned(), "sent".to_owned(), None)]);

    let applied = Verdict::Applied(Applied {
        idempotency_key: "k".into(),
        end_to_end_id: "E2E-1".into(),
        amount_minor: 1250,
        currency: "EUR".into(),
        originator: "o".into(),
        reference: "r-1".into(),
        applied_at: "2026-12-02T00:00:00Z".into(),
    });
    const EXT1_DONE: RecoveryPoint = RecoveryPoint::named("EXT1_DONE");
    let e1_done = CallWrites { verdict: Some(("e1", &applied)), intent: Some(intent("e2")) };
    // An older owner's verdict and intent: refused, and nothing of them written.
    match db.ledger.begin_phase_with(&req, Fence::new(1), &EXT1_SENT, &EXT1_DONE, &[&EXT1_DONE], e1_done).await {
        Err(LedgerError::FencedOut { .. }) => {}
        Err(other) => panic!("expected fenced out, got {other}"),
        Ok(_) => panic!("a phase under an older fence was allowed to begin"),
    }
    assert_eq!(calls(&db.ledger, &req).await, [("e1".to_owned(), "sent".to_owned(), None)]);

    // A verdict for a step that was never sent finds no intent to settle:
    // the phase fails, and its move goes with it.
    let stray = CallWrites { verdict: Some(("e9", &applied)), ..Default::default() };
    match db.ledger.begin_phase_with(&req, t, &EXT1_SENT, &EXT1_DONE, &[&EXT1_DONE], stray).await {
        Err(LedgerError::Corrupt(_)) => {}
        Err(other) => panic!("expected a refused verdict, got {other}"),
        Ok(_) => panic!("a verdict without an intent was written"),
    }
    assert_eq!(calls(&db.ledger, &req).await, [("e1".to_owned(), "sent".to_owned(), None)]);

    // The owner's: both, with the move.
    let phase = db.ledger.begin_phase_with(&req, t, &EXT1_SENT, &EXT1_DONE, &[&EXT1_DONE], e1_done).await.unwrap();
    phase.commit().await.unwrap();
    let recorded = calls(&db.ledger, &req).await;
    assert_eq!(
        recorded.iter().map(|c| (c.0.as_str(), c.1.as_str())).collect::<Vec<_>>(),
        [("e1", "done"), ("e2", "sent")]
    );
    assert_eq!(recorded[0].2.as_ref().and_then(|r| r["reference"].as_str()), Some("r-1"));
}

#[tokio::test]
async fn held_writes_go_in_order_before_the_phases_next_statement_and_fail_its_commit_with_them() {
    let db = TestLedger::new().await;
    let req = request();
    let entry = |writes: &mut Writes, name: &str, req: &RequestRecord| {
        let legs = [Leg { account: "DE01", amount_minor: -5 }, Leg { account: "FR02", amount_minor: 5 }];
        payments::post(writes, req.payment_id, name, "EUR", &legs, Fence::FIRST);
    };
    let postings = "SELECT count(*) FROM postings WHERE payment_id = $1";

    let mut phase = first_phase(&db.ledger, &req, Fence::FIRST).await.unwrap();
    entry(phase.writes(), "a", &req);
    entry(phase.writes(), "b", &req);
    // The phase's next statement sees them: they were sent before it.
    let seen: i64 =
        sqlx::query_scalar(postings).bind(req.payment_id).fetch_one(phase.conn().await.unwrap()).await.unwrap();
    assert_eq!(seen, 2 + 4, "the hold's two legs and both held entries'");
    entry(phase.writes(), "c", &req);
    phase.commit().await.unwrap();
    let committed: i64 = sqlx::query_scalar(postings).bind(req.payment_id).fetch_one(db.ledger.pool()).await.unwrap();
    assert_eq!(committed, 2 + 6, "the write held last went with the commit");

    // A held write the database refuses (an entry that does not balance)
    // fails the commit, and the phase's other writes go with it.
    let other = request();
    let mut phase = first_phase(&db.ledger, &other, Fence::FIRST).await.unwrap();
    entry(phase.writes(), "a", &other);
    payments::post(
        phase.writes(),
        other.payment_id,
        "fee",
        "EUR",
        &[Leg { account: "DE01", amount_minor: -1 }],
        Fence::FIRST,
    );
    assert!(phase.commit().await.is_err(), "an unbalanced held entry committed");
    let left: i64 = sqlx::query_scalar(postings).bind(other.payment_id).fetch_one(db.ledger.pool()).await.unwrap();
    assert_eq!(left, 0, "nothing of the phase committed");
}

/// A payment marked succeeded whose row is not there (a ledger restored in
/// part, say) fails its phase as corrupt, whether its write goes with the
/// phase's opening or after it: nothing commits, and no answer is stored.
#[tokio::test]
async fn a_payment_that_succeeds_without_its_row_fails_its_phase_as_corrupt() {
    let db = TestLedger::new().await;
    let req = request();
    let payment = PaymentRequest::parse(serde_json::json!({
        "amount_minor": 1250, "currency": "EUR", "debtor_account": "DE89370400440532013000",
        "creditor_account": "FR1420041010050500013M02606", "end_to_end_id": "E2E-GONE",
    }))
    .unwrap();
    let answer = StoredResponse { status: 201, headers: Default::default(), body: b"{}".to_vec() };
    let (from, passes) = (RecoveryPoint::STARTED, [&H1_DONE]);
    for how in ["held", "eager"] {
        let ledger = &db.ledger;
        let mut phase = match how {
            "held" => {
                ledger.begin_phase_held(&req, Fence::FIRST, &from, &H1_DONE, &passes, CallWrites::default()).await
            }
            _ => ledger.begin_phase(&req, Fence::FIRST, &from, &H1_DONE, &passes).await,
        }
        .unwrap();
        payments::succeed(phase.writes(), &req, &payment, "e2-1", Fence::FIRST);
        phase.store_answer(&req, &answer);
        match phase.commit().await {
            Err(LedgerError::Corrupt(why)) => assert!(why.contains("has no row"), "{how}: {why}"),
            other => panic!("{how}: expected corrupt, got {:?}", other.map_err(|e| e.to_string())),
        }
        assert_eq!(counts(&db.ledger).await, (0, 0, 0), "{how}: the phase left its move behind");
        assert_eq!(db.ledger.answer(&req).await.unwrap(), None, "{how}: an answer stored");
    }
}

/// A phase whose opening statement goes with its held writes commits both
/// at once, and is refused as any phase is, even where a held write runs
/// into the row of the owner that fenced it out (the statement then fails
/// on the write, and the phase's refusal is told by its opening alone).
#[tokio::test]
async fn a_held_phase_commits_its_writes_with_its_move_and_is_refused_as_any_phase_is() {
    let db = TestLedger::new().await;
    let req = request();
    let t = Fence::new(2);
    assert_eq!(held_first_phase(&db.ledger, &req, t).await.unwrap().commit().await.unwrap(), H1_DONE);
    assert_eq!(state(&db.ledger, &req).await, (2, "H1_DONE".into()));
    let before = counts(&db.ledger).await;
    assert_eq!(before, (1, 1, 2), "the request, its payment and the hold's two legs");
    assert_eq!(points(&db.ledger).await, ["H1_DONE"]);

    // The same first phase under an older fence: its payment's insert
    // collides with the one committed, its opening finds a newer fence.
    let stale = Fence::new(1);
    match held_first_phase(&db.ledger, &req, stale).await.unwrap().commit().await {
        Err(LedgerError::FencedOut { mine, current }) => assert_eq!((mine, current), (stale, t)),
        other => panic!("expected fenced out, got {:?}", other.map_err(|e| e.to_string())),
    }
    // ...and again under the current one: it already ran.
    match held_first_phase(&db.ledger, &req, t).await.unwrap().commit().await {
        Err(LedgerError::OutOfOrder { expected, found }) => {
            assert_eq!((expected, found), (RecoveryPoint::STARTED, Some(H1_DONE)));
        }
        other => panic!("expected out of order, got {:?}", other.map_err(|e| e.to_string())),
    }
    // A later phase under the older fence, whose held entry collides with
    // nothing: its statement runs, finds no row to move, and its entry
    // goes back with the transaction.
    let legs = [Leg { account: "DE01:held", amount_minor: -1250 }, Leg { account: "FR02", amount_minor: 1250 }];
    let calls = CallWrites::default();
    let mut late = db.ledger.begin_phase_held(&req, stale, &H1_DONE, &EXT1_SENT, &[&EXT1_SENT], calls).await.unwrap();
    payments::post(late.writes(), req.payment_id, "transfer", "EUR", &legs, stale);
    match late.commit().await {
        Err(LedgerError::FencedOut { mine, current }) => assert_eq!((mine, current), (stale, t)),
        other => panic!("expected fenced out, got {:?}", other.map_err(|e| e.to_string())),
    }
    assert_eq!(counts(&db.ledger).await, before, "a refused held phase left a write behind");
    assert_eq!(state(&db.ledger, &req).await, (2, "H1_DONE".into()));
    assert_eq!(points(&db.ledger).await, ["H1_DONE"], "a refused held phase recorded a point");

    // The current owner's: a statement of the phase that reads sends the
    // opening and the entry first, and sees both.
    let mut next = db.ledger.begin_phase_held(&req, t, &H1_DONE, &EXT1_SENT, &[&EXT1_SENT], calls).await.unwrap();
    payments::post(next.writes(), req.payment_id, "transfer", "EUR", &legs, t);
    let seen: (String, i64) = sqlx::query_as(
        "SELECT (SELECT recovery_point FROM requests WHERE client_id = $1 AND idem_key = $2),
                (SELECT count(*) FROM postings WHERE payment_id = $3)",
    )
    .bind(req.key.client.as_uuid())
    .bind(req.key.key.as_str())
    .bind(req.payment_id)
    .fetch_one(next.conn().await.unwrap())
    .await
    .unwrap();
    assert_eq!(seen, ("EXT1_SENT".into(), 4));
    assert_eq!(next.commit().await.unwrap(), EXT1_SENT);
    assert_eq!(counts(&db.ledger).await, (1, 1, 4));
    assert_eq!(points(&db.ledger).await, ["EXT1_SENT", "H1_DONE"]);
}

#[tokio::test]
async fn a_committed_phase_never_runs_twice() {
    let db = TestLedger::new().await;
    let req = request();
    first_phase(&db.ledger, &req, Fence::FIRST).await.unwrap().commit().await.unwrap();
    let before = counts(&db.ledger).await;
    match first_phase(&db.ledger, &req, Fence::FIRST).await {
        Err(LedgerError::OutOfOrder { expected, found }) => {
            assert_eq!(expected, RecoveryPoint::STARTED);
            assert_eq!(found, Some(H1_DONE));
        }
        Err(other) => panic!("expected out of order, got {other}"),
        Ok(_) => panic!("the first phase ran twice"),
    }
    assert!(matches!(
        db.ledger
            .begin_phase(
                &req,
                Fence::FIRST,
                &EXT1_SENT,
                &RecoveryPoint::named("EXT1_DONE"),
                &[&RecoveryPoint::named("EXT1_DONE")]
            )
            .await,
        Err(LedgerError::OutOfOrder { .. })
    ));
    assert_eq!(counts(&db.ledger).await, before);
}

#[tokio::test]
async fn adopting_fences_the_previous_owner_out_before_any_new_phase() {
    let db = TestLedger::new().await;
    let req = request();
    // Nothing committed yet: adopting creates the row at STARTED.
    assert_eq!(db.ledger.adopt(&req, Fence::new(2), Adoption::Takeover).await.unwrap(), RecoveryPoint::STARTED);
    // A fence is granted once: a second takeover adoption under it is refused,
    // while a rebuild under a key's final fence may join it.
    assert!(db.ledger.adopt(&req, Fence::new(2), Adoption::Takeover).await.is_err(), "fence 2 adopted twice");
    assert_eq!(db.ledger.adopt(&req, Fence::new(2), Adoption::Rebuild).await.unwrap(), RecoveryPoint::STARTED);
    // The old owner wakes and tries its first phase: refused.
    assert!(matches!(first_phase(&db.ledger, &req, Fence::FIRST).await, Err(LedgerError::FencedOut { .. })));
    assert_eq!(counts(&db.ledger).await, (1, 0, 0));
    // An even older owner cannot adopt it back.
    assert!(matches!(
        db.ledger.adopt(&req, Fence::FIRST, Adoption::Takeover).await,
        Err(LedgerError::FencedOut { .. })
    ));

    first_phase(&db.ledger, &req, Fence::new(2)).await.unwrap().commit().await.unwrap();
    assert_eq!(
        db.ledger.adopt(&req, Fence::new(3), Adoption::Takeover).await.unwrap(),
        H1_DONE,
        "a later owner resumes where it stopped"
    );
    assert_eq!(state(&db.ledger, &req).await, (3, "H1_DONE".into()));
}

#[tokio::test]
async fn a_phase_dropped_before_commit_leaves_nothing() {
    let db = TestLedger::new().await;
    let req = request();
    drop(first_phase(&db.ledger, &req, Fence::FIRST).await.unwrap());
    assert_eq!(counts(&db.ledger).await, (0, 0, 0));
}

#[tokio::test]
async fn postings_must_balance_and_are_never_rewritten() {
    let db = TestLedger::new().await;
    let req = request();
    let mut phase =
        db.ledger.begin_phase(&req, Fence::FIRST, &RecoveryPoint::STARTED, &H1_DONE, &[&H1_DONE]).await.unwrap();
    hold_funds(phase.conn().await.unwrap(), &req, Fence::FIRST).await.unwrap();
    post(phase.conn().await.unwrap(), req.payment_id, "fee", &[("DE01", -10)], Fence::FIRST).await.unwrap();
    let refused = phase.commit().await;
    assert!(
        matches!(&refused, Err(LedgerError::Database(e)) if e.to_string().contains("do not balance")),
        "unbalanced postings committed: {refused:?}"
    );
    assert_eq!(counts(&db.ledger).await, (0, 0, 0), "the whole phase rolled back");

    first_phase(&db.ledger, &req, Fence::FIRST).await.unwrap().commit().await.unwrap();
    let rewrite = sqlx::query("UPDATE postings SET amount_minor = 1").execute(db.ledger.pool()).await;
    assert!(rewrite.is_err(), "postings were rewritten");
    let erase = sqlx::query("DELETE FROM postings").execute(db.ledger.pool()).await;
    assert!(erase.is_err(), "postings were deleted");
    assert_eq!(counts(&db.ledger).await, (1, 1, 2));
}

/// Fencing the ledger must not starve behind the stream of phases that read
/// the fence: 32 phases in flight at every moment, each holding its
/// transaction open for 100 ms (a phase waiting on a slow disk), and the
/// fence still goes up within seconds (under row share locks it waited out
/// the whole 10 s here: share lockers kept joining past it); after it, no
/// phase commits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fencing_the_ledger_returns_promptly_while_phases_keep_coming() {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::time::Duration;

    let db = TestLedger::new().await;
    let stop = std::sync::Arc::new(AtomicBool::new(false));
    let committed = std::sync::Arc::new(AtomicUsize::new(0));
    let streams: Vec<_> = (0..32)
        .map(|_| {
            let (ledger, stop, committed) = (db.ledger.clone(), stop.clone(), committed.clone());
            tokio::spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    let req = request();
                    match ledger.begin_phase(&req, Fence::FIRST, &RecoveryPoint::STARTED, &H1_DONE, &[&H1_DONE]).await {
                        Ok(phase) => {
                            tokio::time::sleep(Duration::from_millis(100)).await;
                            if phase.commit().await.is_ok() {
                                committed.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                        Err(LedgerError::RegionFailed(_)) => tokio::time::sleep(Duration::from_millis(5)).await,
                        Err(e) => panic!("{e}"),
                    }
                }
            })
        })
        .collect();
    // Let the stream fill up.
    while committed.load(Ordering::Relaxed) < 64 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let fenced =
        tokio::time::timeout(Duration::from_secs(10), db.ledger.set_region_fence(true, "r-1", 1, "drill")).await;
    let at_fence = committed.load(Ordering::Relaxed);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let after = committed.load(Ordering::Relaxed);
    stop.store(true, Ordering::Relaxed);
    for stream in streams {
        stream.await.unwrap();
    }
    assert!(fenced.is_ok(), "fencing starved behind the phases ({at_fence} committed meanwhile)");
    fenced.unwrap().unwrap();
    assert!(after <= at_fence, "a phase committed after the fence went up ({after} > {at_fence})");
    assert!(db.ledger.region_fence().await.unwrap().failed);
}

/// Two declarations can reach a ledger in the reverse order of their
/// epochs (two SREs, or an SRE and the region's instances): the newer one
/// wins whatever the order.
#[tokio::test]
async fn only_a_newer_epoch_moves_the_region_fence() {
    use keyfence::ledger::FenceChange;
    let db = TestLedger::new().await;
    assert!(matches!(db.ledger.set_region_fence(true, "r-1", 4, "failed at 4").await, Ok(FenceChange::Set(_))));
    let late = db.ledger.set_region_fence(false, "r-1", 3, "restored at 3").await.unwrap();
    assert!(matches!(late, FenceChange::Newer(ref f) if f.failed && f.epoch == 4), "{late:?}");
    let fence = db.ledger.region_fence().await.unwrap();
    assert!(fence.failed, "still fenced: the restore was older");
    assert!(matches!(db.ledger.set_region_fence(false, "r-1", 5, "restored at 5").await, Ok(FenceChange::Set(_))));
    assert!(!db.ledger.region_fence().await.unwrap().failed);
    // The same declaration again (a retried command) is no change of mind.
    assert!(matches!(db.ledger.set_region_fence(false, "r-1", 5, "again").await, Ok(FenceChange::Set(_))));
}

/// A phase stalled inside its transaction (its owner paused) must not hold
/// the whole region behind a fence change that waits for it: the change
/// gives up after its wait and says so, and phases go on meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_phase_delays_a_fence_change_only_for_its_wait() {
    use std::time::{Duration, Instant};
    let db = TestLedger::new().await;
    let stalled =
        db.ledger.begin_phase(&request(), Fence::FIRST, &RecoveryPoint::STARTED, &H1_DONE, &[&H1_DONE]).await.unwrap();
    let started = Instant::now();
    let change = db.ledger.set_region_fence(true, "r-1", 1, "drill").await;
    assert!(matches!(change, Err(LedgerError::FenceBusy(_))), "{change:?}");
    assert!(started.elapsed() < Duration::from_secs(10), "it gave up after its wait");
    let after =
        db.ledger.begin_phase(&request(), Fence::FIRST, &RecoveryPoint::STARTED, &H1_DONE, &[&H1_DONE]).await.unwrap();
    after.commit().await.unwrap();
    assert!(!db.ledger.region_fence().await.unwrap().failed, "nothing changed");
    drop(stalled);
    assert!(db.ledger.set_region_fence(true, "r-1", 1, "drill").await.is_ok(), "once the stall ends, it goes through");
}

/// Sets a server-wide setting on the test's database, for the sessions
/// opened after it.
async fn set_on_database(db: &TestLedger, setting: &str) {
    let set = format!("DO $$ BEGIN EXECUTE format('ALTER DATABASE %I SET {setting}', current_database()); END $$");
    sqlx::query(sqlx::AssertSqlSafe(set)).execute(db.ledger.pool()).await.unwrap();
}

/// A phase queued behind a fence change waits it out even on a server
/// whose statement timeout is shorter than the change's wait (its owner's
/// setting, not keyfence's), and so does the change; once the phase holds
/// its lock the server's timeout is its own again; and a phase whose
/// opening fails all the same (an operator cancels it) leaves its pooled
/// connection clean for the next.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_phase_queued_behind_a_fence_change_outlasts_a_statement_timeout_and_a_cancel_spoils_nothing() {
    use std::time::Duration;
    let db = TestLedger::new().await;
    set_on_database(&db, "statement_timeout = 200").await;
    // One connection for phases, so the phase after a failed one uses the same.
    let mut settings = db.settings.clone();
    settings.pool_size = 1;
    let timed = Ledger::connect(&settings).await.unwrap();
    let changes = Ledger::connect(&db.settings).await.unwrap();
    let open =
        async || timed.begin_phase(&request(), Fence::FIRST, &RecoveryPoint::STARTED, &H1_DONE, &[&H1_DONE]).await;

    let mut phase = open().await.unwrap();
    let slow = sqlx::query("SELECT pg_sleep(0.5)").execute(phase.conn().await.unwrap()).await;
    assert!(
        slow.is_err_and(|e| LedgerError::from(e).has_code("57014")),
        "a phase's statements keep the server's timeout"
    );
    drop(phase);

    // A phase in flight, and a change waiting for it: phases after the
    // change queue behind it until it gives up.
    let stalled =
        db.ledger.begin_phase(&request(), Fence::FIRST, &RecoveryPoint::STARTED, &H1_DONE, &[&H1_DONE]).await.unwrap();
    let change = tokio::spawn(async move { changes.set_region_fence(true, "r-1", 1, "drill").await });
    waiting_for_lock(db.ledger.pool(), "pg_advisory_xact_lock(", 1).await;
    let cancel = async {
        // Past the statement timeout, the queued phase still waits.
        waiting_for_lock(db.ledger.pool(), "pg_advisory_xact_lock_shared", 1).await;
        tokio::time::sleep(Duration::from_millis(400)).await;
        sqlx::query_scalar::<_, bool>(
            "SELECT coalesce(bool_or(pg_cancel_backend(pid)), false) FROM pg_stat_activity
              WHERE datname = current_database() AND wait_event_type = 'Lock'
                AND query LIKE '%pg_advisory_xact_lock_shared%'",
        )
        .fetch_one(db.ledger.pool())
        .await
        .unwrap()
    };
    let (cancelled, canceled) = tokio::join!(open(), cancel);
    assert!(canceled, "the queued phase was waiting, past the statement timeout");
    assert!(cancelled.is_err_and(|e| e.has_code("57014")), "an operator's cancel fails it");
    let queued = open().await;
    let gave_up = change.await.unwrap();
    assert!(matches!(gave_up, Err(LedgerError::FenceBusy(_))), "the change waited its own wait: {gave_up:?}");
    queued.expect("the next phase, on the same connection, waited the change out").commit().await.unwrap();
    drop(stalled);
}

/// On a server whose transactions default to repeatable read, a phase
/// queued behind a change that fails the region still reads the fence as
/// the change left it: it commits nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_phase_queued_behind_a_failover_reads_the_fence_it_left_whatever_the_isolation() {
    let db = TestLedger::new().await;
    set_on_database(&db, "default_transaction_isolation = ''repeatable read''").await;
    let ledger = Ledger::connect(&db.settings).await.unwrap();
    let stalled =
        ledger.begin_phase(&request(), Fence::FIRST, &RecoveryPoint::STARTED, &H1_DONE, &[&H1_DONE]).await.unwrap();
    let changing = ledger.clone();
    let change = tokio::spawn(async move { changing.set_region_fence(true, "r-1", 1, "failover").await });
    waiting_for_lock(ledger.pool(), "pg_advisory_xact_lock(", 1).await;
    let queuing = ledger.clone();
    let queued = tokio::spawn(async move {
        let phase =
            queuing.begin_phase(&request(), Fence::FIRST, &RecoveryPoint::STARTED, &H1_DONE, &[&H1_DONE]).await?;
        phase.commit().await
    });
    waiting_for_lock(ledger.pool(), "pg_advisory_xact_lock_shared", 1).await;
    stalled.commit().await.unwrap();
    assert!(change.await.unwrap().is_ok(), "the change went through once the phase in flight ended");
    let after = queued.await.unwrap();
    assert!(matches!(after, Err(LedgerError::RegionFailed(_))), "{after:?}");
    let (requests,): (i64,) = sqlx::query_as("SELECT count(*) FROM requests").fetch_one(ledger.pool()).await.unwrap();
    assert_eq!(requests, 1, "only the phase that ended before the change committed");
}

/// A phase that opens while a change holds the fence's lock (not waiting
/// for it: it has it, and has not yet committed) finds the lock taken,
/// waits its turn past the server's statement timeout, and then reads the
/// fence as the change left it: failed, so it commits nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_phase_that_opens_while_a_change_holds_the_fence_waits_and_reads_what_it_left() {
    use std::time::Duration;
    let db = TestLedger::new().await;
    set_on_database(&db, "statement_timeout = 200").await;
    let ledger = Ledger::connect(&db.settings).await.unwrap();
    // A change midway: the lock held exclusively, the row written, not
    // yet committed (the key is the one src/ledger/region_fence.rs uses).
    let mut change = db.ledger.pool().begin().await.unwrap();
    sqlx::raw_sql(
        "SET LOCAL statement_timeout = 0; SELECT pg_advisory_xact_lock(7738977954614962543);
         UPDATE region_fence SET failed = true, epoch = 1, reason = 'failover'",
    )
    .execute(&mut *change)
    .await
    .unwrap();
    let opening = ledger.clone();
    let queued = tokio::spawn(async move {
        let phase =
            opening.begin_phase(&request(), Fence::FIRST, &RecoveryPoint::STARTED, &H1_DONE, &[&H1_DONE]).await?;
        phase.commit().await
    });
    // Waiting for the lock, and past the statement timeout (the watcher's
    // own queries are not held to it).
    let mut watcher = db.ledger.pool().acquire().await.unwrap();
    sqlx::query("SET statement_timeout = 0").execute(&mut *watcher).await.unwrap();
    let waiting = async {
        loop {
            let waiting: bool = sqlx::query_scalar(
                "SELECT count(*) > 0 FROM pg_stat_activity
                  WHERE datname = current_database() AND wait_event_type = 'Lock'
                    AND query LIKE '%pg_advisory_xact_lock_shared%'",
            )
            .fetch_one(&mut *watcher)
            .await
            .unwrap();
            if waiting {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(10), waiting).await.expect("the phase waits for the change's lock");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!queued.is_finished(), "the phase still waits for the change");
    change.commit().await.unwrap();
    let after = queued.await.unwrap();
    assert!(matches!(after, Err(LedgerError::RegionFailed(_))), "{after:?}");
    assert_eq!(counts(&ledger).await.0, 0, "nothing committed after the change");
}

/// On a ledger without migration 0011 (an instance of this version started
/// before `migrate` ran), phases still open, waiting for the fence's lock
/// as before, and a failed region still refuses them.
#[tokio::test]
async fn phases_open_on_a_ledger_without_the_fences_try() {
    let db = TestLedger::new().await;
    sqlx::query("DROP FUNCTION region_fence_busy()").execute(db.ledger.pool()).await.unwrap();
    let ledger = Ledger::connect(&db.settings).await.unwrap();
    for _ in 0..2 {
        let phase =
            ledger.begin_phase(&request(), Fence::FIRST, &RecoveryPoint::STARTED, &H1_DONE, &[&H1_DONE]).await.unwrap();
        phase.commit().await.unwrap();
    }
    db.ledger.set_region_fence(true, "r-1", 1, "failover").await.unwrap();
    let after = async {
        ledger
            .begin_phase(&request(), Fence::FIRST, &RecoveryPoint::STARTED, &H1_DONE, &[&H1_DONE])
            .await?
            .commit()
            .await
    }
    .await;
    assert!(matches!(after, Err(LedgerError::RegionFailed(_))), "{after:?}");
    assert_eq!(counts(&ledger).await.0, 2, "the two phases before the failover, and nothing after");
}

/// A ledger bound to its region refuses a change naming another one (an
/// SRE's `--ledger` pointed at the wrong database).
#[tokio::test]
async fn a_fence_change_for_another_region_is_refused() {
    let db = TestLedger::new().await;
    assert_eq!(db.ledger.bind_region_fence("r-1").await.unwrap().region.as_deref(), Some("r-1"));
    assert_eq!(db.ledger.bind_region_fence("r-2").await.unwrap().region.as_deref(), Some("r-1"), "bound once");
    let wrong = db.ledger.set_region_fence(false, "r-2", 9, "restored r-2").await;
    assert!(matches!(wrong, Err(LedgerError::OtherRegion { .. })), "{wrong:?}");
    assert!(db.ledger.set_region_fence(true, "r-1", 9, "failed r-1").await.is_ok());
}

/// Two binds of a fresh ledger at once (serve's region follower and its
/// partition housekeeper): the one that waited reports the region that won,
/// never an unbound ledger.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bind_that_waited_for_another_reports_the_winner() {
    let db = TestLedger::new().await;
    let mut first = db.ledger.pool().begin().await.unwrap();
    sqlx::query("UPDATE region_fence SET region = 'r-1' WHERE region IS NULL").execute(&mut *first).await.unwrap();
    let ledger = db.ledger.clone();
    let second = tokio::spawn(async move { ledger.bind_region_fence("r-2").await });
    // The second bind is waiting for the row the first holds.
    waiting_for_lock(db.ledger.pool(), "UPDATE region_fence SET region", 1).await;
    assert!(!second.is_finished(), "the second bind waits for the first");
    first.commit().await.unwrap();
    let fence = second.await.unwrap().unwrap();
    assert_eq!(fence.region.as_deref(), Some("r-1"), "{fence:?}");
}

/// The ledger pool is as large as `KEYFENCE_LEDGER_POOL_SIZE` says.
#[tokio::test]
async fn the_ledger_pool_has_the_size_it_is_given() {
    let db = TestLedger::new().await;
    let mut settings = db.settings.clone();
    settings.pool_size = 3;
    let ledger = Ledger::connect(&settings).await.unwrap();
    assert_eq!(ledger.pool().options().get_max_connections(), 3);
    assert_eq!(db.ledger.pool().options().get_max_connections(), 20, "20 unless told");
}

/// Spans of a day made for today and the next two, as `serve` makes them.
async fn make_spans(ledger: &Ledger) {
    use keyfence::ledger::partitions::Partitioning;
    use std::time::Duration;
    let day = Duration::from_secs(86_400);
    let plan = Partitioning { span: day, ahead: 3, keep: day * 35 };
    let report = ledger.maintain_partitions(&plan, Some(0)).await;
    assert!(report.failed.is_empty() && report.created.len() >= 3, "{report:?}");
}

/// How many of the partitioned tables themselves (not their partitions)
/// the session holds a lock on, and how many generic plans its prepared
/// phase openings have been run with.
async fn parent_locks_and_generic_plans(conn: &mut PgConnection) -> (i64, i64) {
    sqlx::query_as(
        "SELECT (SELECT count(*) FROM pg_locks WHERE pid = pg_backend_pid()
                   AND relation IN ('requests'::regclass, 'phase_runs'::regclass, 'external_calls'::regclass)),
                (SELECT coalesce(sum(generic_plans), 0)::bigint FROM pg_prepared_statements
                  WHERE statement LIKE 'WITH fence AS%')",
    )
    .fetch_one(conn)
    .await
    .unwrap()
}

/// A phase writes to the partitions of its request's span, not through the
/// partitioned tables: PostgreSQL keeps one plan for its opening on each
/// connection instead of planning it afresh on every call, and the phase
/// holds no lock on the partitioned tables (which making a span takes).
#[tokio::test]
async fn a_phase_writes_to_its_spans_partitions_with_a_plan_kept_once_made() {
    let db = TestLedger::new().await;
    make_spans(&db.ledger).await;
    let mut settings = db.settings.clone();
    settings.pool_size = 1;
    let ledger = Ledger::connect(&settings).await.unwrap();
    for _ in 0..8 {
        let req = request();
        first_phase(&ledger, &req, Fence::FIRST).await.unwrap().commit().await.unwrap();
        let next = ledger.begin_phase(&req, Fence::FIRST, &H1_DONE, &EXT1_SENT, &[&EXT1_SENT]).await.unwrap();
        next.commit().await.unwrap();
    }
    let req = request();
    let mut phase =
        ledger.begin_phase(&req, Fence::FIRST, &RecoveryPoint::STARTED, &H1_DONE, &[&H1_DONE]).await.unwrap();
    let (locks, generic) = parent_locks_and_generic_plans(phase.conn().await.unwrap()).await;
    phase.commit().await.unwrap();
    assert_eq!(locks, 0, "the phase locked a partitioned table");
    assert!(generic >= 2, "both openings settled on a generic plan: {generic} run with one");
    let today = format!("requests_{}", &suffix_of(&db.ledger, &req).await);
    let (in_span,): (i64,) = sqlx::query_as(sqlx::AssertSqlSafe(format!("SELECT count(*) FROM {today}")))
        .fetch_one(db.ledger.pool())
        .await
        .unwrap();
    assert_eq!(in_span, 9, "every request is in today's span");
}

/// The suffix of the partition holding `req`'s row.
async fn suffix_of(ledger: &Ledger, req: &RequestRecord) -> String {
    sqlx::query_scalar(
        "SELECT substr(tableoid::regclass::text, length('requests_') + 1) FROM requests
          WHERE client_id = $1 AND idem_key = $2",
    )
    .bind(req.key.client.as_uuid())
    .bind(req.key.key.as_str())
    .fetch_one(ledger.pool())
    .await
    .unwrap()
}

/// The suffix and the lower bound (as PostgreSQL prints it) of the span
/// holding `req`.
async fn span_of(ledger: &Ledger, req: &RequestRecord) -> (String, String) {
    sqlx::query_as(
        "SELECT substr(relname, length('requests_') + 1), (regexp_match(bound, $$FROM \\('([^']+)'\\)$$))[1] FROM (
            SELECT c.relname, pg_get_expr(c.relpartbound, c.oid) AS bound
              FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid WHERE i.inhparent = 'requests'::regclass) p
          WHERE (regexp_match(bound, $$FROM \\('([^']+)'\\)$$))[1]::timestamptz <= $1
            AND $1 < (regexp_match(bound, $$TO \\('([^']+)'\\)$$))[1]::timestamptz",
    )
    .bind(keyfence::ledger::timestamp(req.created_at))
    .fetch_one(ledger.pool())
    .await
    .unwrap()
}

/// A request made a day after one whose first phase read the spans (the
/// ledger's spans made first), with the suffix and lower bound of its span
/// as read then.
async fn a_request_in_a_span_read(ledger: &Ledger) -> (RequestRecord, String, String) {
    make_spans(ledger).await;
    let req = request();
    first_phase(ledger, &req, Fence::FIRST).await.unwrap().commit().await.unwrap();
    let mut later = request();
    later.created_at = req.created_at.plus(std::time::Duration::from_secs(86_400));
    let (suffix, from) = span_of(ledger, &later).await;
    (later, suffix, from)
}

/// Runs `sql(table)` by hand for each partitioned table, those whose
/// partitions name `requests` first.
async fn on_each_table(ledger: &Ledger, sql: impl Fn(&str) -> String) {
    for table in ["external_calls", "phase_runs", "requests"] {
        sqlx::raw_sql(sqlx::AssertSqlSafe(sql(table))).execute(ledger.pool()).await.unwrap();
    }
}

/// A request in a span read by the ledger, that span then dropped by hand
/// over the three tables.
async fn a_request_whose_span_read_is_gone(ledger: &Ledger) -> RequestRecord {
    let (later, tomorrow, _) = a_request_in_a_span_read(ledger).await;
    on_each_table(ledger, |table| {
        format!("ALTER TABLE {table} DETACH PARTITION {table}_{tomorrow}; DROP TABLE {table}_{tomorrow}")
    })
    .await;
    later
}

/// A span dropped after an instance read the spans (by another instance,
/// once every request in it ended) sends that instance's next phase in it
/// through the partitioned tables, to the default partition, rather than
/// failing it.
#[tokio::test]
async fn a_phase_whose_span_is_gone_goes_through_the_partitioned_tables() {
    let db = TestLedger::new().await;
    let later = a_request_whose_span_read_is_gone(&db.ledger).await;
    first_phase(&db.ledger, &later, Fence::FIRST)
        .await
        .expect("through the partitioned tables")
        .commit()
        .await
        .unwrap();
    let next = db.ledger.begin_phase(&later, Fence::FIRST, &H1_DONE, &EXT1_SENT, &[&EXT1_SENT]).await.unwrap();
    next.commit().await.unwrap();
    assert_eq!(suffix_of(&db.ledger, &later).await, "default");
    assert_eq!(state(&db.ledger, &later).await, (1, "EXT1_SENT".into()));
}

/// The same with the first phase's opening held: the statement that sends
/// it with the phase's writes fails on the table gone, and the phase is
/// opened again through the partitioned tables, its writes with it, and
/// the answer it stored meanwhile.
#[tokio::test]
async fn a_held_phase_whose_span_is_gone_goes_through_the_partitioned_tables_with_its_writes() {
    let db = TestLedger::new().await;
    let later = a_request_whose_span_read_is_gone(&db.ledger).await;
    let mut phase = held_first_phase(&db.ledger, &later, Fence::FIRST).await.unwrap();
    let answer = StoredResponse { status: 201, headers: Default::default(), body: b"{}".to_vec() };
    phase.store_answer(&later, &answer);
    assert_eq!(phase.commit().await.expect("through the partitioned tables"), H1_DONE);
    assert_eq!(db.ledger.answer(&later).await.unwrap(), Some(answer));
    assert_eq!(suffix_of(&db.ledger, &later).await, "default");
    assert_eq!(state(&db.ledger, &later).await, (1, "H1_DONE".into()));
    let postings: i64 = sqlx::query_scalar("SELECT count(*) FROM postings WHERE payment_id = $1")
        .bind(later.payment_id)
        .fetch_one(db.ledger.pool())
        .await
        .unwrap();
    assert_eq!(postings, 2, "the hold went with the phase");
}

/// A span made again by hand, under its name but without a request's time,
/// after an instance read the spans: the request's first phase goes
/// through the partitioned tables rather than failing on the partition's
/// bounds.
#[tokio::test]
async fn a_phase_whose_span_was_made_again_without_its_time_goes_through_the_partitioned_tables() {
    let db = TestLedger::new().await;
    let (later, tomorrow, from) = a_request_in_a_span_read(&db.ledger).await;
    let until: String = sqlx::query_scalar("SELECT $1::timestamptz::text")
        .bind(keyfence::ledger::timestamp(later.created_at))
        .fetch_one(db.ledger.pool())
        .await
        .unwrap();
    on_each_table(&db.ledger, |table| {
        format!(
            "ALTER TABLE {table} DETACH PARTITION {table}_{tomorrow}; DROP TABLE {table}_{tomorrow};
             CREATE TABLE {table}_{tomorrow} PARTITION OF {table} FOR VALUES FROM ('{from}') TO ('{until}')"
        )
    })
    .await;
    first_phase(&db.ledger, &later, Fence::FIRST)
        .await
        .expect("through the partitioned tables")
        .commit()
        .await
        .unwrap();
    assert_eq!(suffix_of(&db.ledger, &later).await, "default");
    assert_eq!(state(&db.ledger, &later).await, (1, "H1_DONE".into()));
}

/// A span detached by hand after an instance read the spans takes none of
/// its phases' writes once the spans are read again.
#[tokio::test]
async fn a_span_detached_by_hand_is_named_by_no_phase_once_the_spans_are_read_again() {
    let db = TestLedger::new().await;
    let (later, tomorrow, _) = a_request_in_a_span_read(&db.ledger).await;
    on_each_table(&db.ledger, |table| format!("ALTER TABLE {table} DETACH PARTITION {table}_{tomorrow}")).await;
    tokio::time::sleep(keyfence::ledger::routes::RELOAD_EVERY + std::time::Duration::from_millis(100)).await;
    first_phase(&db.ledger, &later, Fence::FIRST).await.unwrap().commit().await.unwrap();
    assert_eq!(suffix_of(&db.ledger, &later).await, "default", "the row is where the partitioned tables see it");
    assert_eq!(state(&db.ledger, &later).await, (1, "H1_DONE".into()));
}

/// Reading the spans again waits for no lock on any partition: a phase in
/// a span read goes on while another session holds the default partition
/// (as making a span does, while it checks that partition's rows).
#[tokio::test]
async fn reading_the_spans_again_waits_for_no_partition_held_by_another_session() {
    let db = TestLedger::new().await;
    let (later, tomorrow, _) = a_request_in_a_span_read(&db.ledger).await;
    let mut other = db.ledger.pool().begin().await.unwrap();
    sqlx::query("LOCK TABLE requests_default IN ACCESS EXCLUSIVE MODE").execute(&mut *other).await.unwrap();
    tokio::time::sleep(keyfence::ledger::routes::RELOAD_EVERY + std::time::Duration::from_millis(100)).await;
    let phase = async { first_phase(&db.ledger, &later, Fence::FIRST).await.unwrap().commit().await.unwrap() };
    tokio::time::timeout(std::time::Duration::from_secs(5), phase)
        .await
        .expect("the phase waited behind the lock on the default partition");
    other.rollback().await.unwrap();
    assert_eq!(suffix_of(&db.ledger, &later).await, tomorrow);
}

/// The intent of `step`, under a fresh derived key.
fn intent(step: &str) -> Intent<'_> {
    let sent = Sent { end_to_end_id: "E2E-PHASES", amount_minor: 1250, currency: "EUR" };
    Intent { step, derived_key: Uuid::new_v4(), sent }
}
