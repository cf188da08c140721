//! The inbox's statements: recording a rail's message once by its id,
//! finding the verdict a notification brought for an instruction in
//! flight, and opening the phase that applies a return. A verdict is
//! applied by the phase that records the external call's outcome
//! ([`super::external::record_verdict`] marks it in the same statement).

use sqlx::{Postgres, Row, Transaction};
use uuid::Uuid;

use super::{Ledger, LedgerError, millis};
use crate::domain::{ClientId, IdempotencyKey, Millis, ScopedKey};

/// A message as the rail sent it, checked and parsed.
#[derive(Debug, Clone)]
pub struct Message {
    pub rail: String,
    pub id: String,
    /// `applied`, `declined` or `returned`.
    pub kind: &'static str,
    pub derived_key: Option<Uuid>,
    pub body: serde_json::Value,
}

/// What became of a message on arrival.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Arrival {
    /// Seen before under the same id: dropped.
    Duplicate,
    /// Kept to take effect: its instruction's request, to be resumed.
    Pending(Option<InFlight>),
    /// Nothing left to do (the outcome was known already).
    Ignored,
    /// Names no instruction of this ledger: kept for the reconciler.
    Unknown,
}

/// The request an instruction belongs to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InFlight {
    pub key: ScopedKey,
    pub created_at: Millis,
}

/// A message that names no instruction of this ledger, kept for the
/// reconciler (and a person: the rail may have a payment keyfence lost).
#[derive(Debug, Clone, serde::Serialize, sqlx::FromRow)]
pub struct Unmatched {
    pub rail: String,
    pub message_id: String,
    pub kind: String,
    /// The instruction's key as the rail named it.
    pub idempotency_key: Option<String>,
    #[serde(with = "time::serde::rfc3339")]
    pub received_at: time::OffsetDateTime,
}

/// A pending return, with the payment it returns.
#[derive(Debug, Clone)]
pub struct PendingReturn {
    pub rail: String,
    pub message_id: String,
    pub body: serde_json::Value,
    pub payment_id: Uuid,
}

impl Ledger {
    /// Records `message` once: a message id seen before is a duplicate.
    pub async fn receive(&self, message: &Message) -> Result<Arrival, LedgerError> {
        let call = match message.derived_key {
            None => None,
            Some(key) => sqlx::query(
                "SELECT client_id, idem_key, request_created_at, outcome FROM external_calls WHERE derived_key = $1",
            )
            .bind(key)
            .fetch_optional(&self.pool)
            .await?
            .map(|row| -> Result<_, sqlx::Error> {
                Ok((
                    row.try_get::<Uuid, _>(0)?,
                    row.try_get::<String, _>(1)?,
                    row.try_get::<time::OffsetDateTime, _>(2)?,
                    row.try_get::<String, _>(3)?,
                ))
            })
            .transpose()?,
        };
        let (state, note, arrival) = match &call {
            None => ("unknown", Some("no instruction of this ledger has this key"), Arrival::Unknown),
            Some((_, _, _, outcome))
                if message.kind != "returned" && matches!(outcome.as_str(), "done" | "declined") =>
            {
                ("ignored", Some("the outcome was recorded already"), Arrival::Ignored)
            }
            Some((client, key, created_at, _)) => {
                let in_flight = IdempotencyKey::parse(key).ok().map(|key| InFlight {
                    key: ScopedKey::new(ClientId::new(*client), key),
                    created_at: millis(*created_at),
                });
                ("pending", None, Arrival::Pending(in_flight))
            }
        };
        let kept = sqlx::query(
            "INSERT INTO inbox (rail, message_id, kind, derived_key, body, state, note) VALUES ($1, $2, $3, $4, $5, $6, $7)
             ON CONFLICT (rail, message_id) DO NOTHING",
        )
        .bind(&message.rail)
        .bind(&message.id)
        .bind(message.kind)
        .bind(message.derived_key)
        .bind(&message.body)
        .bind(state)
        .bind(note)
        .execute(&self.pool)
        .await?;
        Ok(if kept.rows_affected() == 0 { Arrival::Duplicate } else { arrival })
    }

    /// The verdict a notification brought for the instruction sent under
    /// `derived_key`, if one waits: (`applied` or `declined`, its body).
    pub async fn notified_verdict(
        &self,
        derived_key: Uuid,
    ) -> Result<Option<(String, serde_json::Value)>, LedgerError> {
        Ok(sqlx::query_as(
            "SELECT kind, body FROM inbox WHERE derived_key = $1 AND state = 'pending' AND kind <> 'returned'
              ORDER BY received_at LIMIT 1",
        )
        .bind(derived_key)
        .fetch_optional(&self.pool)
        .await?)
    }

    /// Ends verdicts that wait for an outcome recorded meanwhile (they
    /// arrived as it was being recorded, too late to be marked by it).
    pub async fn end_overtaken_verdicts(&self) -> Result<u64, LedgerError> {
        let done = sqlx::query(
            "UPDATE inbox i SET state = 'ignored', note = 'the outcome was recorded already', applied_at = now()
               FROM external_calls c
              WHERE c.derived_key = i.derived_key AND i.state = 'pending' AND i.kind <> 'returned'
                AND c.outcome IN ('done', 'declined')",
        )
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected())
    }

    /// Every message that named no instruction of this ledger, oldest first.
    pub async fn unmatched(&self) -> Result<Vec<Unmatched>, LedgerError> {
        Ok(sqlx::query_as(
            "SELECT rail, message_id, kind, body->>'idempotency_key' AS idempotency_key, received_at
               FROM inbox WHERE state = 'unknown' ORDER BY received_at LIMIT 1000",
        )
        .fetch_all(&self.pool)
        .await?)
    }

    /// Requests with a verdict waiting in the inbox, oldest first.
    pub async fn notified_in_flight(&self, limit: i64) -> Result<Vec<InFlight>, LedgerError> {
        let rows: Vec<(Uuid, String, time::OffsetDateTime)> = sqlx::query_as(
            "SELECT DISTINCT c.client_id, c.idem_key, c.request_created_at
               FROM inbox i JOIN external_calls c ON c.derived_key = i.derived_key
              WHERE i.state = 'pending' AND i.kind <> 'returned' LIMIT $1",
        )
        .bind(limit)
        .fetch_all(&self.pool)
        .await?;
        Ok(rows
            .into_iter()
            .filter_map(|(client, key, created_at)| {
                Some(InFlight {
                    key: ScopedKey::new(ClientId::new(client), IdempotencyKey::parse(&key).ok()?),
                    created_at: millis(created_at),
                })
            })
            .collect())
    }

    /// Returns waiting to be applied, oldest first.
    pub async fn pending_returns(&self, limit: i64) -> Result<Vec<PendingReturn>, LedgerError> {
        let rows: Vec<(String, String, serde_json::Value, Uuid)> = sqlx::query_as(
            "SELECT i.rail, i.message_id, i.body, r.payment_id
               FROM inbox i
               JOIN external_calls c ON c.derived_key = i.derived_key
               JOIN requests r ON (r.client_id, r.idem_key, r.created_at) = (c.client_id, c.idem_key, c.request_created_at)
              WHERE i.state = 'pending' AND i.kind = 'returned'
              ORDER BY i.received_at LIMIT $1",
        )
        .bind(limit)
        .fetch_all(&self.pool)
        .await?;
        Ok(rows
            .into_iter()
            .map(|(rail, message_id, body, payment_id)| PendingReturn { rail, message_id, body, payment_id })
            .collect())
    }

    /// Opens the phase that applies a return: under the region fence like
    /// every phase, with the message still pending and locked (so it takes
    /// effect once), and the payment locked. `None` if the message was
    /// applied meanwhile; `Err(RegionFailed)` if the region is declared failed.
    pub async fn begin_return(
        &self,
        pending: &PendingReturn,
    ) -> Result<Option<Transaction<'static, Postgres>>, LedgerError> {
        let mut tx = self.pool.begin_with(super::region_fence::BEGIN_PHASE).await?;
        let fenced: Option<(bool, Option<String>)> =
            sqlx::query_as("SELECT failed, region FROM region_fence").fetch_optional(&mut *tx).await?;
        if let Some((true, region)) = fenced {
            return Err(LedgerError::RegionFailed(region.unwrap_or_default()));
        }
        let still: Option<i32> = sqlx::query_scalar(
            "SELECT 1 FROM inbox WHERE rail = $1 AND message_id = $2 AND state = 'pending' FOR UPDATE",
        )
        .bind(&pending.rail)
        .bind(&pending.message_id)
        .fetch_optional(&mut *tx)
        .await?;
        if still.is_none() {
            return Ok(None);
        }
        sqlx::query("SELECT 1 FROM payments WHERE id = $1 FOR UPDATE")
            .bind(pending.payment_id)
            .execute(&mut *tx)
            .await?;
        Ok(Some(tx))
    }
}

/// Ends a message inside the phase that took (or found no) effect.
pub async fn settle_message(
    tx: &mut Transaction<'static, Postgres>,
    rail: &str,
    message_id: &str,
    state: &str,
    note: Option<&str>,
) -> Result<(), LedgerError> {
    sqlx::query("UPDATE inbox SET state = $3, note = $4, applied_at = now() WHERE rail = $1 AND message_id = $2")
        .bind(rail)
        .bind(message_id)
        .bind(state)
        .bind(note)
        .execute(&mut **tx)
        .await?;
    Ok(())
}
