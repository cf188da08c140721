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
//! the order they were written. One take gives no client more than its
//! share, and nothing is taken while the ledger's region is declared
//! failed (its work, and the events that come of it, go on elsewhere).

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
    pub created_at: OffsetDateTime,
}

/// One delivery a fan-out makes: to `endpoint`, pending, or already failed
/// with `failed` as its error (an endpoint disabled when the event came, so
/// that `redeliver --since` reaches it once the endpoint is enabled again).
#[derive(Debug, Clone)]
pub struct Target {
    pub endpoint: Uuid,
    pub webhook_id: String,
    pub failed: Option<String>,
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
    /// The payment's status in this ledger (`voided`: its live copy is in another region).
    pub payment_status: String,
    pub payment_id: Uuid,
    pub idem_key: String,
    /// Which request under the key (its `created_at`).
    pub request_created_at: OffsetDateTime,
    /// Written before the ledger's region fence last changed: the payment
    /// may have been taken over by another region meanwhile.
    pub before_fence_change: bool,
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
    /// Not sent after all (what it needed could not be read): the attempt
    /// is given back, and it is taken again after `wait`.
    NotSent {
        error: String,
        wait: Duration,
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

    /// Events waiting to be fanned out, oldest first, but none of the
    /// clients in `skipping` (whose endpoints could not be read just now).
    pub async fn queued(&self, limit: i64, skipping: &[Uuid]) -> Result<Vec<Queued>, LedgerError> {
        Ok(sqlx::query_as(
            "SELECT id, event_id, client_id, event, created_at FROM outbox
              WHERE fanned_out_at IS NULL AND client_id <> ALL($2) ORDER BY id LIMIT $1",
        )
        .bind(limit)
        .bind(skipping)
        .fetch_all(&self.pool)
        .await?)
    }

    /// Gives each event its deliveries and marks it fanned out, all in one
    /// transaction. A delivery already there (another worker fanned the
    /// same event out) is kept as it is.
    pub async fn fan_out(&self, events: &[(&Queued, Vec<Target>)]) -> Result<(), LedgerError> {
        let mut tx = self.pool.begin().await?;
        let (mut event_ids, mut endpoint_ids, mut webhook_ids, mut failed) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for (event, targets) in events {
            for target in targets {
                event_ids.push(event.event_id);
                endpoint_ids.push(target.endpoint);
                webhook_ids.push(target.webhook_id.as_str());
                failed.push(target.failed.as_deref());
            }
        }
        sqlx::query(
            "INSERT INTO webhook_deliveries (event_id, endpoint_id, webhook_id, state, last_error, finished_at)
             SELECT event_id, endpoint_id, webhook_id, CASE WHEN failed IS NULL THEN 'pending' ELSE 'failed' END,
                    failed, CASE WHEN failed IS NULL THEN NULL ELSE now() END
               FROM unnest($1::uuid[], $2::uuid[], $3::text[], $4::text[])
                    AS target(event_id, endpoint_id, webhook_id, failed)
             ON CONFLICT (event_id, endpoint_id) DO NOTHING",
        )
        .bind(&event_ids)
        .bind(&endpoint_ids)
        .bind(&webhook_ids)
        .bind(&failed)
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

    /// Takes up to `limit` due deliveries for `lease`, oldest due first:
    /// at most `per_client` of one client, and none of the clients in
    /// `busy` (those with their share in flight already). With none due,
    /// one read of the index of due deliveries says so, and the take (a
    /// join of five tables, planned afresh each time) is not sent.
    pub async fn take(
        &self,
        limit: i64,
        lease: Duration,
        busy: &[Uuid],
        per_client: i64,
    ) -> Result<Vec<Taken>, LedgerError> {
        let due: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM webhook_deliveries WHERE state = 'pending' AND next_attempt_at <= now())",
        )
        .fetch_one(&self.pool)
        .await?;
        if !due {
            return Ok(Vec::new());
        }
        Ok(sqlx::query_as(
            "WITH ranked AS (
                SELECT d.event_id, d.endpoint_id, d.next_attempt_at,
                       row_number() OVER (PARTITION BY o.client_id ORDER BY d.next_attempt_at) AS turn
                  FROM webhook_deliveries d JOIN outbox o ON o.event_id = d.event_id
                 WHERE d.state = 'pending' AND d.next_attempt_at <= now() AND o.client_id <> ALL($3)
                   AND NOT EXISTS (SELECT 1 FROM region_fence WHERE failed)
                   AND NOT EXISTS (
                       SELECT 1 FROM outbox p
                         LEFT JOIN webhook_deliveries e ON e.event_id = p.event_id AND e.endpoint_id = d.endpoint_id
                        WHERE p.payment_id = o.payment_id AND p.id < o.id
                          AND (p.fanned_out_at IS NULL OR e.state = 'pending'))),
             due AS (
                SELECT d.event_id, d.endpoint_id
                  FROM webhook_deliveries d
                  JOIN ranked r ON r.event_id = d.event_id AND r.endpoint_id = d.endpoint_id
                 WHERE r.turn <= $4 AND d.state = 'pending' AND d.next_attempt_at <= now()
                 ORDER BY r.next_attempt_at
                 LIMIT $1
                 FOR UPDATE OF d SKIP LOCKED)
             UPDATE webhook_deliveries d
                SET lease = d.lease + 1, attempts = d.attempts + 1,
                    next_attempt_at = now() + make_interval(secs => $2)
               FROM due, outbox o, ledger_subjects p
              WHERE d.event_id = due.event_id AND d.endpoint_id = due.endpoint_id
                AND o.event_id = d.event_id AND p.id = o.payment_id
          RETURNING d.event_id, d.endpoint_id, d.webhook_id, o.client_id, o.event, o.payload, o.created_at,
                    d.attempts, d.lease, p.status AS payment_status, p.id AS payment_id, p.idem_key,
                    p.request_created_at,
                    o.created_at < (SELECT changed_at FROM region_fence) AS before_fence_change",
        )
        .bind(limit)
        .bind(lease.as_secs_f64())
        .bind(busy)
        .bind(per_client)
        .fetch_all(&self.pool)
        .await?)
    }

    /// Records what became of `taken`; false if its lease was taken over
    /// meanwhile (the result is then not recorded).
    pub async fn record(&self, taken: &Taken, outcome: &Outcome) -> Result<bool, LedgerError> {
        let (state, status, error, wait, given_back) = match outcome {
            Outcome::Delivered { status } => ("delivered", Some(*status), None, Duration::ZERO, 0),
            Outcome::Retry { status, error, wait } => ("pending", *status, Some(error.as_str()), *wait, 0),
            Outcome::Failed { status, error } => ("failed", *status, Some(error.as_str()), Duration::ZERO, 0),
            Outcome::NotSent { error, wait } => ("pending", None, Some(error.as_str()), *wait, 1),
        };
        let done = sqlx::query(
            "UPDATE webhook_deliveries
                SET state = $4, last_status = coalesce($5, CASE WHEN $8 = 1 THEN last_status END), last_error = $6,
                    next_attempt_at = now() + make_interval(secs => $7), attempts = attempts - $8,
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
        .bind(given_back)
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
    /// deliveries have all ended, with their deliveries; returns how many
    /// events. The deliveries go first, each only if it has still ended when
    /// deleted (a redelivery committed meanwhile keeps it, and its event).
    pub async fn prune(&self, retention: Duration, limit: i64) -> Result<u64, LedgerError> {
        let mut tx = self.pool.begin().await?;
        let old: Vec<Uuid> = sqlx::query_scalar(
            "SELECT o.event_id FROM outbox o
              WHERE o.created_at < now() - make_interval(secs => $1) AND o.fanned_out_at IS NOT NULL
                AND NOT EXISTS (SELECT 1 FROM webhook_deliveries d WHERE d.event_id = o.event_id AND d.state = 'pending')
              ORDER BY o.id LIMIT $2",
        )
        .bind(retention.as_secs_f64())
        .bind(limit)
        .fetch_all(&mut *tx)
        .await?;
        sqlx::query("DELETE FROM webhook_deliveries WHERE event_id = ANY($1) AND state <> 'pending'")
            .bind(&old)
            .execute(&mut *tx)
            .await?;
        let done = sqlx::query(
            "DELETE FROM outbox o WHERE o.event_id = ANY($1)
                AND NOT EXISTS (SELECT 1 FROM webhook_deliveries d WHERE d.event_id = o.event_id)",
        )
        .bind(&old)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
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

    /// Sends deliveries that have ended (delivered or failed) again, from a
    /// fresh schedule and with the same `webhook-id`; returns how many. One
    /// still pending is left on its schedule: resetting it could hand it to
    /// a second worker while the first is still sending it.
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
              WHERE o.event_id = d.event_id AND d.state <> 'pending'
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
