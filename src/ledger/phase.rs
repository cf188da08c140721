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

use std::collections::BTreeMap;
use std::sync::Arc;

use sqlx::postgres::PgRow;
use sqlx::{AssertSqlSafe, PgConnection, Postgres, Row, Transaction};
use uuid::Uuid;

use super::external::{self, CallWrites};
use super::routes::{Route, Routes};
use super::writes::Writes;
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

/// An open phase transaction whose fence has been checked. Dropping it
/// without [`Phase::commit`] rolls everything back.
pub struct Phase {
    tx: Transaction<'static, Postgres>,
    /// The tables the request's rows are in.
    route: Arc<Route>,
    to: RecoveryPoint,
    /// Writes held until the phase's next other statement or its commit.
    writes: Writes,
    /// Times the phase from its first statement to its commit (or rollback).
    _timer: Timer,
}

impl Phase {
    /// The transaction, for the phase's business statements, with every
    /// held write sent first.
    pub async fn conn(&mut self) -> Result<&mut PgConnection, LedgerError> {
        self.writes.send(&mut self.tx).await?;
        Ok(&mut self.tx)
    }

    /// Writes whose results the phase does not read, sent together later.
    pub fn writes(&mut self) -> &mut Writes {
        &mut self.writes
    }

    /// Stores the request's final answer, in the phase that finishes it.
    pub fn store_answer(&mut self, request: &RequestRecord, answer: &StoredResponse) {
        self.writes.push(&self.route.statements.answer, |b| {
            b.bind(request.key.client.as_uuid())
                .bind(request.key.key.as_str())
                .bind(timestamp(request.created_at))
                .bind(i32::from(answer.status))
                .bind(sqlx::types::Json(&answer.headers))
                .bind(&answer.body);
        });
    }

    /// Commits the business writes and the new recovery point together.
    pub async fn commit(mut self) -> Result<RecoveryPoint, LedgerError> {
        self.writes.send(&mut self.tx).await?;
        self.tx.commit().await?;
        Ok(self.to)
    }
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

/// A phase's statements, naming the tables its request's rows are in (the
/// partitioned tables, or the partitions of the request's span:
/// [`super::routes`]).
pub(super) struct Statements {
    /// The first phase: insert the row at its first recovery point, or
    /// move a row adopted at `STARTED` ($10) there, record the points it
    /// passes ($11) and make its external-call writes ($12-$16). Like every
    /// phase it first reads the region fence, in the same statement. It
    /// returns a row only if the row moved, holding the number of verdicts
    /// it recorded.
    first: String,
    /// A later phase: move the row from $6 to $5 under fence $4, record the
    /// points it passes ($7) and make its external-call writes ($8-$12),
    /// reading the region fence in the same statement; it returns what
    /// `first` does.
    next: String,
    /// Stores the final answer ($4-$6) on the request's row.
    answer: String,
}

impl Statements {
    pub(super) fn naming(requests: &str, phase_runs: &str, external_calls: &str) -> Self {
        let first = format!(
            "WITH fence AS (SELECT failed FROM region_fence),
     moved AS (
        INSERT INTO {requests} AS r
           (client_id, idem_key, created_at, operation, request_hash, payment_id, fence, recovery_point, request)
        SELECT $1, $2, $3, $4, $5, $6, $7, $8, $9 WHERE NOT EXISTS (SELECT 1 FROM fence WHERE failed)
        ON CONFLICT (client_id, idem_key, created_at) DO UPDATE
           SET fence = EXCLUDED.fence, recovery_point = EXCLUDED.recovery_point, updated_at = now()
         WHERE r.fence <= EXCLUDED.fence AND r.recovery_point = $10
        RETURNING 1),
     passed AS (
        INSERT INTO {phase_runs} (client_id, idem_key, request_created_at, point, fence)
        SELECT $1, $2, $3, point, $7 FROM unnest($11::text[]) AS point WHERE EXISTS (SELECT 1 FROM moved)),
     {}
     SELECT (SELECT count(*) FROM verdict) FROM moved",
            external::call_writes(external_calls, 7, 12)
        );
        let next = format!(
            "WITH fence AS (SELECT failed FROM region_fence),
     moved AS (
        UPDATE {requests} SET fence = $4, recovery_point = $5, updated_at = now()
         WHERE client_id = $1 AND idem_key = $2 AND created_at = $3
           AND fence <= $4 AND recovery_point = $6
           AND NOT EXISTS (SELECT 1 FROM fence WHERE failed)
        RETURNING 1),
     passed AS (
        INSERT INTO {phase_runs} (client_id, idem_key, request_created_at, point, fence)
        SELECT $1, $2, $3, point, $4 FROM unnest($7::text[]) AS point WHERE EXISTS (SELECT 1 FROM moved)),
     {}
     SELECT (SELECT count(*) FROM verdict) FROM moved",
            external::call_writes(external_calls, 4, 8)
        );
        let answer = format!(
            "UPDATE {requests} SET response_status = $4, response_headers = $5, response_body = $6
              WHERE client_id = $1 AND idem_key = $2 AND created_at = $3"
        );
        Statements { first, next, answer }
    }
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
    #[tracing::instrument(skip_all, fields(otel.kind = "client", db.system.name = "postgresql", db.operation.name = "begin_phase", key = %request.key, fence = %fence, to = %to))]
    pub async fn begin_phase_with(
        &self,
        request: &RequestRecord,
        fence: Fence,
        from: &RecoveryPoint,
        to: &RecoveryPoint,
        passes: &[&RecoveryPoint],
        calls: CallWrites<'_>,
    ) -> Result<Phase, LedgerError> {
        let timer = Timer::start("keyfence_ledger_phase_seconds", &[("to", to.as_str())]);
        let opening = Opening { request, fence, from, to, passes, calls };
        let route = self.routes.to(&self.pool, timestamp(request.created_at)).await;
        let tx = match self.open(&route, &opening).await {
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
                self.open(&route, &opening).await.map(|tx| (tx, route))
            }
            opened => opened.map(|tx| (tx, route)),
        };
        let (tx, route) = tx?;
        Ok(Phase { tx, route, to: to.clone(), writes: Writes::default(), _timer: timer })
    }

    /// Opens the transaction and runs the phase's opening statement through
    /// `route`'s tables; an error if the request did not move.
    async fn open(&self, route: &Route, o: &Opening<'_>) -> Result<Transaction<'static, Postgres>, LedgerError> {
        let Opening { request, fence, from, to, passes, calls } = o;
        let passes: Vec<&str> = passes.iter().map(|p| p.as_str()).collect();
        let calls = calls.binds()?;
        let mut tx = self.pool.begin_with(super::region_fence::BEGIN_PHASE).await?;
        let opening = if **from == RecoveryPoint::STARTED {
            insert_row(&route.statements.first, request, *fence, to).bind(from.as_str())
        } else {
            sqlx::query(AssertSqlSafe(route.statements.next.as_str()))
                .bind(request.key.client.as_uuid())
                .bind(request.key.key.as_str())
                .bind(timestamp(request.created_at))
                .bind(fence_param(*fence))
                .bind(to.as_str())
                .bind(from.as_str())
        };
        let verdicts = calls.verdict_steps.len();
        let moved: Option<i64> = opening
            .bind(passes)
            .bind(calls.intent_steps)
            .bind(calls.intent_keys)
            .bind(calls.verdict_steps)
            .bind(calls.verdict_outcomes)
            .bind(calls.verdict_results)
            .try_map(|row: PgRow| row.try_get(0))
            .fetch_optional(&mut *tx)
            .await?;
        match moved {
            // Dropping the transaction takes the move back with it.
            Some(settled) if settled != verdicts as i64 => {
                return Err(LedgerError::Corrupt(format!(
                    "{}: a verdict for a call that has no intent recorded",
                    request.key
                )));
            }
            Some(_) => return Ok(tx),
            None => {}
        }
        let fenced: Option<(bool, Option<String>)> =
            sqlx::query_as("SELECT failed, region FROM region_fence").fetch_optional(&mut *tx).await?;
        match fenced {
            Some((true, region)) => Err(LedgerError::RegionFailed(region.unwrap_or_default())),
            _ => Err(refusal(&mut tx, request, *fence, from).await?),
        }
    }
}

/// What a phase's opening statement is given.
struct Opening<'a> {
    request: &'a RequestRecord,
    fence: Fence,
    from: &'a RecoveryPoint,
    to: &'a RecoveryPoint,
    passes: &'a [&'a RecoveryPoint],
    calls: CallWrites<'a>,
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
