//! What the ledger holds about requests, read in bulk for the reconciler:
//! the view of each request a key names (one query per page of keys), and
//! the requests in a time window (to find those whose key is gone).

use std::collections::{BTreeMap, HashMap};

use futures::{Stream, StreamExt};
use sqlx::FromRow;
use sqlx::types::Json;
use time::OffsetDateTime;
use uuid::Uuid;

use super::phase::{RequestRecord, fence_param};
use super::{Ledger, LedgerError, Phase, payments, timestamp};
use crate::domain::{ClientId, Fence, IdempotencyKey, Millis, RecoveryPoint, RequestHash, ScopedKey, StoredResponse};

/// The ledger's side of one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LedgerView {
    pub record: RequestRecord,
    pub fence: Fence,
    pub recovery_point: RecoveryPoint,
    pub answer: Option<StoredResponse>,
    /// The status of what the request created (its payment, or its
    /// refund); `None` if that row is missing.
    pub payment_status: Option<String>,
    /// The oldest last attempt among calls whose outcome is unknown.
    pub unknown_since: Option<OffsetDateTime>,
    /// When the request last moved (for a finished one: when it finished).
    pub updated_at: Millis,
}

#[derive(FromRow)]
struct ViewRow {
    client_id: Uuid,
    idem_key: String,
    created_at: OffsetDateTime,
    operation: String,
    request_hash: String,
    payment_id: Uuid,
    request: Vec<u8>,
    fence: i64,
    recovery_point: String,
    response_status: Option<i32>,
    response_headers: Option<Json<BTreeMap<String, String>>>,
    response_body: Option<Vec<u8>>,
    payment_status: Option<String>,
    unknown_since: Option<OffsetDateTime>,
    updated_at: OffsetDateTime,
}

const VIEW_COLUMNS: &str =
    "r.client_id, r.idem_key, r.created_at, r.operation, r.request_hash, r.payment_id, r.request,
       r.fence, r.recovery_point, r.response_status, r.response_headers, r.response_body, r.updated_at,
       p.status AS payment_status,
       (SELECT min(c.last_attempt_at) FROM external_calls c
         WHERE (c.client_id, c.idem_key, c.request_created_at) = (r.client_id, r.idem_key, r.created_at)
           AND c.outcome IN ('unknown', 'indeterminate')) AS unknown_since";

impl ViewRow {
    fn into_view(self) -> Result<LedgerView, LedgerError> {
        let key = IdempotencyKey::parse(&self.idem_key)
            .map_err(|e| LedgerError::unreadable(format!("stored key {:?}", self.idem_key), e))?;
        let answer = match (self.response_status, self.response_headers, self.response_body) {
            (Some(status), Some(headers), Some(body)) => {
                Some(StoredResponse { status: u16::try_from(status).unwrap_or(500), headers: headers.0, body })
            }
            _ => None,
        };
        Ok(LedgerView {
            record: RequestRecord {
                key: ScopedKey::new(ClientId::new(self.client_id), key),
                created_at: super::millis(self.created_at),
                operation: self.operation,
                request_hash: RequestHash::from_hex(self.request_hash),
                payment_id: self.payment_id,
                request: self.request,
            },
            fence: Fence::new(self.fence.unsigned_abs()),
            recovery_point: RecoveryPoint::from_stored(self.recovery_point),
            answer,
            payment_status: self.payment_status,
            unknown_since: self.unknown_since,
            updated_at: super::millis(self.updated_at),
        })
    }
}

/// Identifies a request across both stores: its key and the key's `created_at`.
pub type RequestId = (String, Millis);

impl Ledger {
    /// The ledger's view of each request in `wanted` that it has.
    pub async fn views(&self, wanted: &[(ScopedKey, Millis)]) -> Result<HashMap<RequestId, LedgerView>, LedgerError> {
        let clients: Vec<Uuid> = wanted.iter().map(|(k, _)| k.client.as_uuid()).collect();
        let keys: Vec<&str> = wanted.iter().map(|(k, _)| k.key.as_str()).collect();
        let created: Vec<OffsetDateTime> = wanted.iter().map(|(_, at)| timestamp(*at)).collect();
        let query = format!(
            "SELECT {VIEW_COLUMNS}
               FROM unnest($1::uuid[], $2::text[], $3::timestamptz[]) AS k(client_id, idem_key, created_at)
               JOIN requests r USING (client_id, idem_key, created_at)
               LEFT JOIN ledger_subjects p ON p.id = r.payment_id"
        );
        let rows: Vec<ViewRow> = sqlx::query_as(sqlx::AssertSqlSafe(query))
            .bind(clients)
            .bind(keys)
            .bind(created)
            .fetch_all(&self.pool)
            .await?;
        rows.into_iter()
            .map(|row| {
                let view = row.into_view()?;
                Ok(((view.record.key.partition_key(), view.record.created_at), view))
            })
            .collect()
    }

    /// Every request created in `[since, until)`, oldest first, streamed so
    /// a wide window never has to fit in memory.
    pub fn requests_between(
        &self,
        since: Millis,
        until: Millis,
    ) -> impl Stream<Item = Result<LedgerView, LedgerError>> + Send + '_ {
        let query = format!(
            "SELECT {VIEW_COLUMNS}
               FROM requests r LEFT JOIN ledger_subjects p ON p.id = r.payment_id
              WHERE r.created_at >= $1 AND r.created_at < $2
              ORDER BY r.created_at"
        );
        sqlx::query_as::<_, ViewRow>(sqlx::AssertSqlSafe(query))
            .bind(timestamp(since))
            .bind(timestamp(until))
            .fetch(&self.pool)
            .map(|row| row.map_err(LedgerError::from).and_then(ViewRow::into_view))
    }

    /// Voids what this ledger holds of a request another owner finished:
    /// every posting is reversed by a compensating entry (history is never
    /// deleted), the payment (if a phase ever created it) is marked voided
    /// and the request `VOIDED`. A request adopted by a takeover that was
    /// fenced before its first phase has no payment and nothing to reverse.
    pub async fn void(&self, request: &RequestRecord, fence: Fence, from: &RecoveryPoint) -> Result<(), LedgerError> {
        let mut phase = self.begin_phase(request, fence, from, &RecoveryPoint::VOIDED, &[]).await?;
        reverse_postings(&mut phase, request, fence).await?;
        phase.commit().await?;
        Ok(())
    }
}

impl Ledger {
    /// Voids a request this ledger never held, named by a hand-off: a
    /// `VOIDED` row under `fence`, so an owner of the old region that wakes
    /// later finds the request fenced instead of starting it here. False if
    /// a row appeared meanwhile (that one is voided like any leftover).
    pub async fn void_absent(
        &self,
        key: &ScopedKey,
        created_at: Millis,
        payment_id: Uuid,
        fence: Fence,
    ) -> Result<bool, LedgerError> {
        let inserted = sqlx::query(
            "INSERT INTO requests
                (client_id, idem_key, created_at, operation, request_hash, payment_id, fence, recovery_point, request)
             VALUES ($1, $2, $3, 'payment', '', $4, $5, 'VOIDED', ''::bytea)
             ON CONFLICT (client_id, idem_key, created_at) DO NOTHING",
        )
        .bind(key.client.as_uuid())
        .bind(key.key.as_str())
        .bind(timestamp(created_at))
        .bind(payment_id)
        .bind(fence_param(fence))
        .execute(&self.pool)
        .await?;
        Ok(inserted.rows_affected() == 1)
    }
}

async fn reverse_postings(phase: &mut Phase, request: &RequestRecord, fence: Fence) -> Result<(), LedgerError> {
    // The payment is locked before its postings are summed, so a return
    // applied meanwhile (which locks it too) is either all in the sum or
    // waits and then finds the payment voided. (A refund's request has a
    // refund row instead, which nothing but its own phases writes.)
    sqlx::query("SELECT 1 FROM payments WHERE id = $1 FOR UPDATE")
        .bind(request.payment_id)
        .execute(phase.conn().await?)
        .await?;
    let totals: Vec<(String, String, i64)> = sqlx::query_as(
        "SELECT account, currency, sum(amount_minor)::bigint FROM postings WHERE payment_id = $1
          GROUP BY account, currency HAVING sum(amount_minor) <> 0 ORDER BY account",
    )
    .bind(request.payment_id)
    .fetch_all(phase.conn().await?)
    .await?;
    for (account, currency, total) in totals {
        phase.writes().push(
            "INSERT INTO postings (payment_id, entry, account, amount_minor, currency, fence)
             VALUES ($1, 'void', $2, $3, $4, $5)",
            |b| {
                b.bind(request.payment_id).bind(account).bind(-total).bind(currency).bind(fence_param(fence));
            },
        );
    }
    payments::mark_voided(phase.conn().await?, request.payment_id, fence).await?;
    super::refunds::mark_voided(phase.conn().await?, request.payment_id, fence).await
}
