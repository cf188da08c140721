//! `Deliveries`: the ledger's record of webhook deliveries, one row per
//! event and endpoint, and every statement the delivery worker and the
//! operators' commands make on it.
//!
//! A worker *takes* due deliveries in one statement that skips rows
//! another worker has locked, raises each row's `lease` and moves its next
//! attempt past the lease's end: until then no other worker sees it due.
//! It records the result only under the lease it took, so a worker that
//! outlived its lease (stalled, or cut off) has its result refused and the
//! delivery stays with whoever took it since. A delivery is taken only once
//! every earlier event of the same payment is fanned out and none of them
//! is still pending for the same endpoint: a payment's events arrive in
//! the order they were written.

use std::time::Duration;

use serde::Serialize;
use sqlx::PgPool;
use time::OffsetDateTime;
use uuid::Uuid;

use crate::domain::ClientId;
use crate::ledger::LedgerError;

/// An event not yet fanned out to its endpoints.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct Queued {
    pub id: i64,
    pub event_id: Uuid,
    pub client_id: Uuid,
    pub event: String,
}

/// A delivery a worker has taken, with what it sends.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct Taken {
    pub event_id: Uuid,
    pub endpoint_id: Uuid,
    pub webhook_id: String,
    pub client_id: Uuid,
    pub event: String,
    pub payload: serde_json::Value,
    pub created_at: OffsetDateTime,
    /// This attempt's number, 1 for the first.
    pub attempts: i32,
    pub lease: i64,
}

impl Taken {
    pub fn client(&self) -> ClientId {
        ClientId::new(self.client_id)
    }
}

/// Where an attempt leaves its delivery.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    Delivered {
        status: u16,
    },
    /// Tried again after `wait`.
    Retry {
        status: Option<u16>,
        error: String,
        wait: Duration,
    },
    /// Never tried again (its schedule is used up, or its endpoint is gone).
    Failed {
        status: Option<u16>,
        error: String,
    },
}

/// A delivery as operators list it.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct Listed {
    pub event_id: Uuid,
    pub event: String,
    pub payment_id: Uuid,
    pub client_id: Uuid,
    pub endpoint_id: Uuid,
    pub webhook_id: String,
    pub state: String,
    pub attempts: i32,
    pub last_status: Option<i32>,
    pub last_error: Option<String>,
    #[serde(with = "time::serde::rfc3339")]
    pub created_at: OffsetDateTime,
    #[serde(with = "time::serde::rfc3339::option")]
    pub next_attempt_at: Option<OffsetDateTime>,
    #[serde(with = "time::serde::rfc3339::option")]
    pub finished_at: Option<OffsetDateTime>,
}

/// What is still to arrive: deliveries pending and events not fanned out,
/// and the age of the oldest event among them.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Backlog {
    pub undelivered: i64,
    pub oldest_seconds: f64,
}

/// Which deliveries to send again.
#[derive(Debug, Clone, Copy)]
pub enum Redeliver {
    /// Every delivery of one event, whatever became of it.
    Event(Uuid),
    /// Every failed delivery of an event written since then.
    FailedSince(OffsetDateTime),
}

#[derive(Clone, Debug)]
pub struct Deliveries {
    pool: PgPool,
}

impl Deliveries {
    pub fn new(pool: PgPool) -> Self {
        Self { pool }
    }

    /// Events waiting to be fanned out, oldest first.
    pub async fn queued(&self, limit: i64) -> Result<Vec<Queued>, LedgerError> {
        Ok(sqlx::query_as(
            "SELECT id, event_id, client_id, event FROM outbox WHERE fanned_out_at IS NULL ORDER BY id LIMIT $1",
        )
        .bind(limit)
        .fetch_all(&self.pool)
        .await?)
    }

    /// Gives each event its deliveries (`(event, [(endpoint, webhook-id)])`)
    /// and marks it fanned out, all in one transaction. A delivery already
    /// there (another worker fanned the same event out) is kept as it is.
    pub async fn fan_out(&self, events: &[(&Queued, Vec<(Uuid, String)>)]) -> Result<(), LedgerError> {
        let mut tx = self.pool.begin().await?;
        let (mut event_ids, mut endpoint_ids, mut webhook_ids) = (Vec::new(), Vec::new(), Vec::new());
        for (event, targets) in events {
            for (endpoint, webhook_id) in targets {
                event_ids.push(event.event_id);
                endpoint_ids.push(*endpoint);
                webhook_ids.push(webhook_id.as_str());
            }
        }
        sqlx::query(
            "INSERT INTO webhook_deliveries (event_id, endpoint_id, webhook_id)
             SELECT * FROM unnest($1::uuid[], $2::uuid[], $3::text[])
             ON CONFLICT (event_id, endpoint_id) DO NOTHING",
        )
        .bind(&event_ids)
        .bind(&endpoint_ids)
        .bind(&webhook_ids)
        .execute(&mut *tx)
        .await?;
        let ids: Vec<i64> = events.iter().map(|(event, _)| event.id).collect();
        sqlx::query("UPDATE outbox SET fanned_out_at = now() WHERE id = ANY($1) AND fanned_out_at IS NULL")
            .bind(&ids)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(())
    }

    /// Takes up to `limit` due deliveries for `lease`, oldest due first.
    pub async fn take(&self, limit: i64, lease: Duration) -> Result<Vec<Taken>, LedgerError> {
        Ok(sqlx::query_as(
            "WITH due AS (
                SELECT d.event_id, d.endpoint_id
                  FROM webhook_deliveries d JOIN outbox o ON o.event_id = d.event_id
                 WHERE d.state = 'pending' AND d.next_attempt_at <= now()
                   AND NOT EXISTS (
                       SELECT 1 FROM outbox p
                         LEFT JOIN webhook_deliveries e ON e.event_id = p.event_id AND e.endpoint_id = d.endpoint_id
                        WHERE p.payment_id = o.payment_id AND p.id < o.id
                          AND (p.fanned_out_at IS NULL OR e.state = 'pending'))
                 ORDER BY d.next_attempt_at
                 LIMIT $1
                 FOR UPDATE OF d SKIP LOCKED)
             UPDATE webhook_deliveries d
                SET lease = d.lease + 1, attempts = d.attempts + 1,
                    next_attempt_at = now() + make_interval(secs => $2)
               FROM due, outbox o
              WHERE d.event_id = due.event_id AND d.endpoint_id = due.endpoint_id AND o.event_id = d.event_id
          RETURNING d.event_id, d.endpoint_id, d.webhook_id, o.client_id, o.event, o.payload, o.created_at,
                    d.attempts, d.lease",
        )
        .bind(limit)
        .bind(lease.as_secs_f64())
        .fetch_all(&self.pool)
        .await?)
    }

    /// Records what became of `taken`; false if its lease was taken over
    /// meanwhile (the result is then not recorded).
    pub async fn record(&self, taken: &Taken, outcome: &Outcome) -> Result<bool, LedgerError> {
        let (state, status, error, wait) = match outcome {
            Outcome::Delivered { status } => ("delivered", Some(*status), None, Duration::ZERO),
            Outcome::Retry { status, error, wait } => ("pending", *status, Some(error.as_str()), *wait),
            Outcome::Failed { status, error } => ("failed", *status, Some(error.as_str()), Duration::ZERO),
        };
        let done = sqlx::query(
            "UPDATE webhook_deliveries
                SET state = $4, last_status = $5, last_error = $6,
                    next_attempt_at = now() + make_interval(secs => $7),
                    finished_at = CASE WHEN $4 = 'pending' THEN NULL ELSE now() END
              WHERE event_id = $1 AND endpoint_id = $2 AND lease = $3 AND state = 'pending'",
        )
        .bind(taken.event_id)
        .bind(taken.endpoint_id)
        .bind(taken.lease)
        .bind(state)
        .bind(status.map(i32::from))
        .bind(error.map(|e| e.chars().take(500).collect::<String>()))
        .bind(wait.as_secs_f64())
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected() == 1)
    }

    /// Ends every pending delivery to `endpoint` (disabled or removed).
    pub async fn end_pending_of(&self, endpoint: Uuid, why: &str) -> Result<u64, LedgerError> {
        let done = sqlx::query(
            "UPDATE webhook_deliveries SET state = 'failed', last_error = $2, finished_at = now(), lease = lease + 1
              WHERE endpoint_id = $1 AND state = 'pending'",
        )
        .bind(endpoint)
        .bind(why)
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected())
    }

    /// Deletes up to `limit` events written more than `retention` ago whose
    /// deliveries are all finished, with their deliveries; returns how many.
    pub async fn prune(&self, retention: Duration, limit: i64) -> Result<u64, LedgerError> {
        let done = sqlx::query(
            "DELETE FROM outbox WHERE id IN (
                SELECT o.id FROM outbox o
                 WHERE o.created_at < now() - make_interval(secs => $1) AND o.fanned_out_at IS NOT NULL
                   AND NOT EXISTS (SELECT 1 FROM webhook_deliveries d
                                    WHERE d.event_id = o.event_id AND d.state = 'pending')
                 ORDER BY o.id LIMIT $2)",
        )
        .bind(retention.as_secs_f64())
        .bind(limit)
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected())
    }

    /// What is still to arrive.
    pub async fn backlog(&self) -> Result<Backlog, LedgerError> {
        let (undelivered, oldest): (i64, Option<f64>) = sqlx::query_as(
            "SELECT count(*), extract(epoch FROM now() - min(created_at))::float8 FROM (
                SELECT o.created_at FROM webhook_deliveries d JOIN outbox o ON o.event_id = d.event_id
                 WHERE d.state = 'pending'
                UNION ALL
                SELECT created_at FROM outbox WHERE fanned_out_at IS NULL) AS waiting",
        )
        .fetch_one(&self.pool)
        .await?;
        Ok(Backlog { undelivered, oldest_seconds: oldest.unwrap_or(0.0).max(0.0) })
    }

    /// Deliveries, newest first: all, only failed ones, or one event's.
    pub async fn list(&self, failed_only: bool, event: Option<Uuid>, limit: i64) -> Result<Vec<Listed>, LedgerError> {
        Ok(sqlx::query_as(
            "SELECT d.event_id, o.event, o.payment_id, o.client_id, d.endpoint_id, d.webhook_id, d.state, d.attempts,
                    d.last_status, d.last_error, o.created_at,
                    CASE WHEN d.state = 'pending' THEN d.next_attempt_at END AS next_attempt_at, d.finished_at
               FROM webhook_deliveries d JOIN outbox o ON o.event_id = d.event_id
              WHERE (NOT $1 OR d.state = 'failed') AND ($2::uuid IS NULL OR d.event_id = $2)
              ORDER BY o.id DESC, d.endpoint_id LIMIT $3",
        )
        .bind(failed_only)
        .bind(event)
        .bind(limit)
        .fetch_all(&self.pool)
        .await?)
    }

    /// Sends deliveries again, from a fresh schedule and with the same
    /// `webhook-id`; returns how many. A worker still sending one of them
    /// has its result refused.
    pub async fn redeliver(&self, which: Redeliver) -> Result<u64, LedgerError> {
        let (event, since) = match which {
            Redeliver::Event(id) => (Some(id), None),
            Redeliver::FailedSince(at) => (None, Some(at)),
        };
        let done = sqlx::query(
            "UPDATE webhook_deliveries d
                SET state = 'pending', attempts = 0, next_attempt_at = now(), lease = d.lease + 1,
                    finished_at = NULL, last_error = NULL, last_status = NULL
               FROM outbox o
              WHERE o.event_id = d.event_id
                AND ($1::uuid IS NULL OR d.event_id = $1)
                AND ($2::timestamptz IS NULL OR (d.state = 'failed' AND o.created_at >= $2))",
        )
        .bind(event)
        .bind(since)
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected())
    }
}
