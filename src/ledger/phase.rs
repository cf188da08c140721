//! Phases: the only way anything is written to the ledger for a request.
//!
//! A phase is one transaction whose first statement moves the request row
//! from the recovery point the phase starts at to the one it ends at, and
//! only if the caller's fence is at least the row's (`fence <= $mine`), and
//! records the recovery points the phase passes, only if the row moved (the
//! primary key of `phase_runs` stands behind that: no point is recorded
//! twice), and makes the phase's external-call writes, also only if it
//! moved ([`super::external::CallWrites`]; a verdict that finds no intent
//! to settle fails the phase). Zero rows means a newer owner exists or the
//! phase already ran; the transaction is then dropped, so nothing the
//! caller would have written survives. The row stays locked until commit,
//! so an older owner cannot slip a write in between the check and the
//! business writes that follow it. The same statement reads the ledger's
//! region fence, under the advisory lock the transaction took as it began
//! ([`super::region_fence`]): a ledger whose region was declared failed
//! commits nothing more.
//!
//! [`Ledger::begin_phase_with`] sends that statement before it returns;
//! [`Ledger::begin_phase_held`] holds it, to go with the phase's first held
//! writes as one statement, saving a round trip when nothing is read
//! before them; a final answer stored meanwhile goes with the move itself,
//! on the row it moves, so a phase that reads nothing is one statement
//! between its `BEGIN` and its `COMMIT`. Those writes run whether or not the row moves, and are
//! taken back with the transaction when it does not; a write that fails
//! on a constraint instead (a newer owner's row in its way, or a deadlock
//! with that owner), or a span gone, takes the transaction with it, and
//! the phase is opened again by its opening statement alone, which tells
//! a refusal from a failing write, before its writes are sent again. Any
//! other failure ends the phase, as it would end any.

use std::collections::BTreeMap;
use std::sync::Arc;

use sqlx::{AssertSqlSafe, PgConnection, Postgres, Row, Transaction};
use tracing::Instrument as _;
use uuid::Uuid;

use super::external::{self, CallBinds, CallWrites};
use super::routes::{Route, Routes};
use super::writes::{Binds, Writes};
use super::{Ledger, LedgerError, timestamp};
use crate::domain::{Fence, Millis, RecoveryPoint, RequestHash, ScopedKey, StoredResponse};
use crate::metrics::Timer;

/// Identifies a request in the ledger and carries what its first write needs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RequestRecord {
    pub key: ScopedKey,
    /// The key item's `created_at`; part of the row's identity.
    pub created_at: Millis,
    /// Which operation this request is (payments are one kind).
    pub operation: String,
    pub request_hash: RequestHash,
    pub payment_id: Uuid,
    /// The canonical request, stored with the row so a lost key can be
    /// recreated from the ledger alone.
    pub request: Vec<u8>,
}

/// An open phase transaction whose fence has been checked, or is checked
/// by its first statement. Dropping it without [`Phase::commit`] rolls
/// everything back, and so does any statement of it that fails.
pub struct Phase {
    /// `None` while statements are under way, and for good once one failed
    /// (the phase is over, and commits nothing).
    tx: Option<Transaction<'static, Postgres>>,
    /// The tables the request's rows are in.
    route: Arc<Route>,
    /// The opening statement, while it waits to go with the first writes.
    opening: Option<Opening>,
    /// Where the phase is opened again if its first statement fails.
    ledger: Ledger,
    to: RecoveryPoint,
    /// Writes held until the phase's next other statement or its commit.
    writes: Writes,
    /// Times the phase from its first statement to its commit (or rollback).
    _timer: Timer,
}

impl Phase {
    /// The transaction, for the phase's business statements, with every
    /// held statement sent first.
    pub async fn conn(&mut self) -> Result<&mut PgConnection, LedgerError> {
        let tx = self.flush().await?;
        Ok(&mut **tx)
    }

    /// Sends every held statement, the opening among them if it waits: all
    /// that is left of the phase is its commit.
    pub async fn send(&mut self) -> Result<(), LedgerError> {
        self.flush().await.map(|_| ())
    }

    /// Writes whose results the phase does not read, sent together later.
    pub fn writes(&mut self) -> &mut Writes {
        &mut self.writes
    }

    /// Stores the request's final answer, in the phase that finishes it:
    /// with the move, if the opening still waits (one statement must not
    /// write the request's row twice), else as a held write.
    pub fn store_answer(&mut self, request: &RequestRecord, answer: &StoredResponse) {
        match &mut self.opening {
            Some(opening)
                if (&opening.request.key, opening.request.created_at) == (&request.key, request.created_at) =>
            {
                opening.answer = Some(answer.clone())
            }
            _ => hold_answer(&mut self.writes, &self.route, request, answer),
        }
    }

    /// Commits the business writes and the new recovery point together.
    pub async fn commit(mut self) -> Result<RecoveryPoint, LedgerError> {
        self.flush().await?;
        self.tx.take().ok_or_else(over)?.commit().await?;
        Ok(self.to)
    }

    /// Sends what the phase holds. The transaction is out of the phase
    /// meanwhile: a send cut off halfway (its future dropped) or failing
    /// drops it, and everything the phase wrote with it.
    async fn flush(&mut self) -> Result<&mut Transaction<'static, Postgres>, LedgerError> {
        let tx = self.tx.take().ok_or_else(over)?;
        let tx = self.send_held(tx).await?;
        Ok(self.tx.insert(tx))
    }

    /// The opening statement, if it waits, with the writes held so far as
    /// one statement; then whatever else is held.
    async fn send_held(
        &mut self,
        tx: Transaction<'static, Postgres>,
    ) -> Result<Transaction<'static, Postgres>, LedgerError> {
        let mut tx = match self.opening.take() {
            Some(opening) => {
                let span = tracing::info_span!("begin_phase", otel.kind = "client", db.system.name = "postgresql",
                    db.operation.name = "begin_phase", key = %opening.request.key, fence = %opening.fence, to = %opening.to);
                self.send_opening(&opening, tx).instrument(span).await?
            }
            None => tx,
        };
        self.writes.send(&mut tx).await?;
        Ok(tx)
    }

    /// The opening with the writes held so far, as one statement, and why
    /// not if the row did not move.
    async fn send_opening(
        &mut self,
        opening: &Opening,
        mut tx: Transaction<'static, Postgres>,
    ) -> Result<Transaction<'static, Postgres>, LedgerError> {
        let held = std::mem::take(&mut self.writes);
        let ctes = opening.ctes(&self.route);
        match held.clone().send_with(&mut tx, ctes, OPENED, |b| opening.bind(b)).await {
            Ok(moved) => opening.settle(&mut tx, moved).await?,
            // A write that failed where the row did not move (a newer
            // owner's row in its way), or a span gone: nothing of the phase
            // stands. Opened again by its opening alone, which names a
            // refusal or a span gone as such.
            Err(e) if hides_a_refusal(&e) => {
                tracing::debug!(error = %e, "a phase's first statement failed; opening it alone");
                // A connection that cannot roll back is closed, which rolls back too.
                let _ = tx.rollback().await;
                let route;
                (tx, route) = self.ledger.open_anew(opening).await?;
                self.route = route;
                let mut held = held;
                held.send(&mut tx).await?;
            }
            Err(e) => return Err(e),
        }
        Ok(tx)
    }
}

/// Holds the statement that stores `answer` on `request`'s row in `route`'s table.
fn hold_answer(writes: &mut Writes, route: &Route, request: &RequestRecord, answer: &StoredResponse) {
    writes.push(&route.statements.answer, |b| {
        b.bind(request.key.client.as_uuid())
            .bind(request.key.key.as_str())
            .bind(timestamp(request.created_at))
            .bind(i32::from(answer.status))
            .bind(sqlx::types::Json(&answer.headers))
            .bind(&answer.body);
    });
}

/// Whether a failed first statement may have failed on a held write where
/// its opening would have been refused (an integrity constraint on a newer
/// owner's row, or a deadlock with that owner: 40P01), or on its span gone
/// (42P01, or 23514 for one made again).
fn hides_a_refusal(e: &LedgerError) -> bool {
    matches!(e, LedgerError::Database(sqlx::Error::Database(db))
        if db.code().is_some_and(|code| code.starts_with("23") || code == "42P01" || code == "40P01"))
}

/// What a phase whose statement failed answers from then on.
fn over() -> LedgerError {
    LedgerError::Database(sqlx::Error::Protocol("the phase ended when a statement of it failed".into()))
}

/// Adoption: insert the row, or raise its fence (strictly, for a takeover).
const ADOPT_ABOVE: &str = "INSERT INTO requests AS r
        (client_id, idem_key, created_at, operation, request_hash, payment_id, fence, recovery_point, request)
     VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)
     ON CONFLICT (client_id, idem_key, created_at) DO UPDATE
        SET fence = EXCLUDED.fence, updated_at = now()
      WHERE r.fence < EXCLUDED.fence
     RETURNING r.recovery_point";
const ADOPT_AT_LEAST: &str = "INSERT INTO requests AS r
        (client_id, idem_key, created_at, operation, request_hash, payment_id, fence, recovery_point, request)
     VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)
     ON CONFLICT (client_id, idem_key, created_at) DO UPDATE
        SET fence = EXCLUDED.fence, updated_at = now()
      WHERE r.fence <= EXCLUDED.fence
     RETURNING r.recovery_point";

/// What a phase's opening statement returns, after its common table
/// expressions: a row only if the request's row moved, holding the number
/// of verdicts it recorded.
const OPENED: &str = "SELECT (SELECT count(*) FROM verdict) FROM moved";

/// A phase's statements, naming the tables its request's rows are in (the
/// partitioned tables, or the partitions of the request's span:
/// [`super::routes`]).
pub(super) struct Statements {
    /// The first phase's opening, as common table expressions before
    /// [`OPENED`]: insert the row at its first recovery point, or move a
    /// row adopted at `STARTED` ($10) there, with the final answer if the
    /// phase stores one ($18-$20), record the points it passes ($11) and
    /// make its external-call writes ($12-$17). Like every phase it first
    /// reads the region fence, in the same statement.
    first: String,
    /// A later phase's opening, likewise: move the row from $6 to $5 under
    /// fence $4, with the final answer if the phase stores one ($14-$16),
    /// record the points it passes ($7) and make its external-call writes
    /// ($8-$13), reading the region fence in the same statement.
    next: String,
    /// Stores the final answer ($4-$6) on the request's row.
    answer: String,
}

impl Statements {
    pub(super) fn naming(requests: &str, phase_runs: &str, external_calls: &str) -> Self {
        let keep = keep_answer("EXCLUDED.response_status", "EXCLUDED.response_headers", "EXCLUDED.response_body");
        let first = format!(
            "fence AS (SELECT failed FROM region_fence),
     moved AS (
        INSERT INTO {requests} AS r
           (client_id, idem_key, created_at, operation, request_hash, payment_id, fence, recovery_point, request,
            response_status, response_headers, response_body)
        SELECT $1, $2, $3, $4, $5, $6, $7, $8, $9, $18, $19, $20 WHERE NOT EXISTS (SELECT 1 FROM fence WHERE failed)
        ON CONFLICT (client_id, idem_key, created_at) DO UPDATE
           SET fence = EXCLUDED.fence, recovery_point = EXCLUDED.recovery_point, updated_at = now(),
               {keep}
         WHERE r.fence <= EXCLUDED.fence AND r.recovery_point = $10
        RETURNING 1),
     passed AS (
        INSERT INTO {phase_runs} (client_id, idem_key, request_created_at, point, fence)
        SELECT $1, $2, $3, point, $7 FROM unnest($11::text[]) AS point WHERE EXISTS (SELECT 1 FROM moved)),
     {}",
            external::call_writes(external_calls, 7, 12)
        );
        let next = format!(
            "fence AS (SELECT failed FROM region_fence),
     moved AS (
        UPDATE {requests} AS r SET fence = $4, recovery_point = $5, updated_at = now(),
               {}
         WHERE client_id = $1 AND idem_key = $2 AND created_at = $3
           AND fence <= $4 AND recovery_point = $6
           AND NOT EXISTS (SELECT 1 FROM fence WHERE failed)
        RETURNING 1),
     passed AS (
        INSERT INTO {phase_runs} (client_id, idem_key, request_created_at, point, fence)
        SELECT $1, $2, $3, point, $4 FROM unnest($7::text[]) AS point WHERE EXISTS (SELECT 1 FROM moved)),
     {}",
            keep_answer("$14", "$15", "$16"),
            external::call_writes(external_calls, 4, 8)
        );
        let answer = format!(
            "UPDATE {requests} SET response_status = $4, response_headers = $5, response_body = $6
              WHERE client_id = $1 AND idem_key = $2 AND created_at = $3"
        );
        Statements { first, next, answer }
    }
}

/// The answer columns of a moved row: the answer given ($status,
/// $headers, $body) if there is one, else the row's own (none before it
/// finishes; an answer once stored is never taken back).
fn keep_answer(status: &str, headers: &str, body: &str) -> String {
    format!(
        "response_status = coalesce({status}, r.response_status), \
         response_headers = coalesce({headers}, r.response_headers), \
         response_body = coalesce({body}, r.response_body)"
    )
}

/// `sql` (one of the inserts above) with the row's columns bound as $1-$9.
fn insert_row<'q>(
    sql: &'q str,
    request: &'q RequestRecord,
    fence: Fence,
    point: &'q RecoveryPoint,
) -> sqlx::query::Query<'q, Postgres, sqlx::postgres::PgArguments> {
    sqlx::query(AssertSqlSafe(sql))
        .bind(request.key.client.as_uuid())
        .bind(request.key.key.as_str())
        .bind(timestamp(request.created_at))
        .bind(&request.operation)
        .bind(request.request_hash.as_str())
        .bind(request.payment_id)
        .bind(fence_param(fence))
        .bind(point.as_str())
        .bind(&request.request)
}

pub(super) fn fence_param(fence: Fence) -> i64 {
    i64::try_from(fence.get()).unwrap_or(i64::MAX)
}

/// Who adopts a request, which decides the fence it must beat.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Adoption {
    /// A new owner after a takeover: its fence was granted once, so it must
    /// be strictly above any fence the row has seen. Equal means the fence
    /// was granted twice, and the adoption is refused.
    Takeover,
    /// The reconciler rebuilding under a finished key's final fence, which
    /// the row may already carry from the request's own last owner.
    Rebuild,
}

impl Ledger {
    /// Stamps `fence` on the request (creating its row at `STARTED` if no
    /// phase has committed yet) and returns where to resume. A new owner
    /// calls this right after a takeover: from then on every write of the
    /// previous owner finds a newer fence and is refused.
    #[tracing::instrument(skip_all, fields(otel.kind = "client", db.system.name = "postgresql", db.operation.name = "adopt", key = %request.key, fence = %fence))]
    pub async fn adopt(
        &self,
        request: &RequestRecord,
        fence: Fence,
        how: Adoption,
    ) -> Result<RecoveryPoint, LedgerError> {
        let query = match how {
            Adoption::Takeover => ADOPT_ABOVE,
            Adoption::Rebuild => ADOPT_AT_LEAST,
        };
        let row = insert_row(query, request, fence, &RecoveryPoint::STARTED).fetch_optional(&self.pool).await?;
        match row {
            Some(row) => Ok(RecoveryPoint::from_stored(row.try_get(0)?)),
            None => {
                let mut conn = self.pool.acquire().await?;
                Err(refusal(&mut conn, request, fence, &RecoveryPoint::STARTED).await?)
            }
        }
    }

    /// Opens the phase that moves `request` from `from` to `to` under
    /// `fence`, recording the recovery points it passes (`to` among them
    /// unless the phase only writes beside the request, as a parked step's
    /// does). The first phase (from `STARTED`) also creates the row.
    pub async fn begin_phase(
        &self,
        request: &RequestRecord,
        fence: Fence,
        from: &RecoveryPoint,
        to: &RecoveryPoint,
        passes: &[&RecoveryPoint],
    ) -> Result<Phase, LedgerError> {
        self.begin_phase_with(request, fence, from, to, passes, CallWrites::default()).await
    }

    /// [`Ledger::begin_phase`], making `calls` in the same statement.
    pub async fn begin_phase_with(
        &self,
        request: &RequestRecord,
        fence: Fence,
        from: &RecoveryPoint,
        to: &RecoveryPoint,
        passes: &[&RecoveryPoint],
        calls: CallWrites<'_>,
    ) -> Result<Phase, LedgerError> {
        let mut phase = self.begin_phase_held(request, fence, from, to, passes, calls).await?;
        phase.send().await?;
        Ok(phase)
    }

    /// [`Ledger::begin_phase_with`], but with the opening statement held,
    /// to go with the phase's first held writes as one statement: before
    /// its first statement that reads, or when it is sent
    /// ([`Phase::send`]) or committed. Its refusals come from there, in the
    /// span of that statement.
    pub async fn begin_phase_held(
        &self,
        request: &RequestRecord,
        fence: Fence,
        from: &RecoveryPoint,
        to: &RecoveryPoint,
        passes: &[&RecoveryPoint],
        calls: CallWrites<'_>,
    ) -> Result<Phase, LedgerError> {
        let timer = Timer::start("keyfence_ledger_phase_seconds", &[("to", to.as_str())]);
        let opening = Opening::new(request, fence, from, to, passes, calls)?;
        let route = self.routes.to(&self.pool, timestamp(request.created_at)).await;
        let tx = self.opener.begin(&self.pool).await?;
        Ok(Phase {
            tx: Some(tx),
            route,
            opening: Some(opening),
            ledger: self.clone(),
            to: to.clone(),
            writes: Writes::default(),
            _timer: timer,
        })
    }

    /// Opens the phase's transaction with its opening statement alone,
    /// through the tables of the request's span as last read.
    async fn open_anew(&self, opening: &Opening) -> Result<(Transaction<'static, Postgres>, Arc<Route>), LedgerError> {
        let route = self.routes.to(&self.pool, timestamp(opening.request.created_at)).await;
        match self.open(&route, opening).await {
            // The span was dropped since it was read (its requests had all
            // ended), or made again by hand without the request's time: the
            // partitioned tables find where the rows are now.
            Err(e)
                if route.suffix.as_deref().is_some_and(|suffix| {
                    (e.has_code("42P01") || e.has_code("23514")) && e.to_string().contains(suffix)
                }) =>
            {
                self.routes.forget().await;
                let route = Routes::partitioned();
                self.open(&route, opening).await.map(|tx| (tx, route))
            }
            opened => opened.map(|tx| (tx, route)),
        }
    }

    /// Opens the transaction and runs the phase's opening statement through
    /// `route`'s tables; an error if the request did not move.
    async fn open(&self, route: &Route, opening: &Opening) -> Result<Transaction<'static, Postgres>, LedgerError> {
        let mut tx = self.opener.begin(&self.pool).await?;
        let moved = Writes::default().send_with(&mut tx, opening.ctes(route), OPENED, |b| opening.bind(b)).await?;
        opening.settle(&mut tx, moved).await?;
        Ok(tx)
    }
}

/// What a phase's opening statement is given, its own to keep while the
/// statement waits for the phase's first writes.
struct Opening {
    request: RequestRecord,
    fence: Fence,
    from: RecoveryPoint,
    to: RecoveryPoint,
    passes: Vec<String>,
    calls: CallBinds,
    /// The final answer, stored with the move.
    answer: Option<StoredResponse>,
}

impl Opening {
    fn new(
        request: &RequestRecord,
        fence: Fence,
        from: &RecoveryPoint,
        to: &RecoveryPoint,
        passes: &[&RecoveryPoint],
        calls: CallWrites<'_>,
    ) -> Result<Self, LedgerError> {
        Ok(Opening {
            request: request.clone(),
            fence,
            from: from.clone(),
            to: to.clone(),
            passes: passes.iter().map(|p| p.as_str().to_owned()).collect(),
            calls: calls.binds()?,
            answer: None,
        })
    }

    /// Its common table expressions, through `route`'s tables.
    fn ctes<'r>(&self, route: &'r Route) -> &'r str {
        if self.from == RecoveryPoint::STARTED { &route.statements.first } else { &route.statements.next }
    }

    /// Binds its placeholders, in order.
    fn bind(&self, b: &mut Binds<'_>) {
        let (request, fence) = (&self.request, fence_param(self.fence));
        b.bind(request.key.client.as_uuid()).bind(request.key.key.as_str()).bind(timestamp(request.created_at));
        if self.from == RecoveryPoint::STARTED {
            b.bind(&request.operation)
                .bind(request.request_hash.as_str())
                .bind(request.payment_id)
                .bind(fence)
                .bind(self.to.as_str())
                .bind(&request.request)
                .bind(self.from.as_str());
        } else {
            b.bind(fence).bind(self.to.as_str()).bind(self.from.as_str());
        }
        let calls = &self.calls;
        b.bind(&self.passes)
            .bind(&calls.intent_steps)
            .bind(&calls.intent_keys)
            .bind(&calls.verdict_steps)
            .bind(&calls.verdict_outcomes)
            .bind(&calls.verdict_results)
            .bind(&calls.intent_sent);
        let answer = self.answer.as_ref();
        b.bind(answer.map(|a| i32::from(a.status)))
            .bind(answer.map(|a| sqlx::types::Json(&a.headers)))
            .bind(answer.map(|a| a.body.as_slice()));
    }

    /// What the statement's answer says: nothing if the row `moved`, else
    /// why not (read in the same transaction).
    async fn settle(&self, conn: &mut PgConnection, moved: Option<i64>) -> Result<(), LedgerError> {
        match moved {
            // Dropping the transaction takes the move back with it.
            Some(settled) if settled != self.calls.verdict_steps.len() as i64 => Err(LedgerError::Corrupt(format!(
                "{}: a verdict for a call that has no intent recorded",
                self.request.key
            ))),
            Some(_) => Ok(()),
            None => {
                let fenced: Option<(bool, Option<String>)> =
                    sqlx::query_as("SELECT failed, region FROM region_fence").fetch_optional(&mut *conn).await?;
                match fenced {
                    Some((true, region)) => Err(LedgerError::RegionFailed(region.unwrap_or_default())),
                    _ => Err(refusal(conn, &self.request, self.fence, &self.from).await?),
                }
            }
        }
    }
}

/// The answer columns of a request row, all null until it finishes.
type AnswerRow = (Option<i32>, Option<sqlx::types::Json<BTreeMap<String, String>>>, Option<Vec<u8>>);

impl Ledger {
    /// The final answer stored for a finished request.
    pub async fn answer(&self, request: &RequestRecord) -> Result<Option<StoredResponse>, LedgerError> {
        let row: Option<AnswerRow> = sqlx::query_as(
            "SELECT response_status, response_headers, response_body FROM requests
                  WHERE client_id = $1 AND idem_key = $2 AND created_at = $3",
        )
        .bind(request.key.client.as_uuid())
        .bind(request.key.key.as_str())
        .bind(timestamp(request.created_at))
        .fetch_optional(&self.pool)
        .await?;
        Ok(match row {
            Some((Some(status), Some(headers), Some(body))) => {
                Some(StoredResponse { status: u16::try_from(status).unwrap_or(500), headers: headers.0, body })
            }
            _ => None,
        })
    }
}

/// Explains a zero-row fence check: a newer fence, or the wrong recovery point.
async fn refusal(
    conn: &mut PgConnection,
    request: &RequestRecord,
    fence: Fence,
    expected: &RecoveryPoint,
) -> Result<LedgerError, LedgerError> {
    let row = sqlx::query(
        "SELECT fence, recovery_point FROM requests
          WHERE client_id = $1 AND idem_key = $2 AND created_at = $3",
    )
    .bind(request.key.client.as_uuid())
    .bind(request.key.key.as_str())
    .bind(timestamp(request.created_at))
    .fetch_optional(conn)
    .await?;
    let current = row
        .map(|row| -> Result<_, sqlx::Error> {
            Ok((Fence::new(row.try_get::<i64, _>(0)?.unsigned_abs()), RecoveryPoint::from_stored(row.try_get(1)?)))
        })
        .transpose()?;
    Ok(match current {
        Some((current, _)) if current > fence => LedgerError::FencedOut { mine: fence, current },
        found => LedgerError::OutOfOrder { expected: expected.clone(), found: found.map(|(_, point)| point) },
    })
}
