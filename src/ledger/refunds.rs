//! Refunds and their rows. Writes happen inside a fenced phase (the row's
//! creation is held with the phase's other writes); reads are scoped to
//! the client that asks. A
//! refund's postings are posted with [`super::payments::post`] under the
//! refund's own id, so each refund balances on its own.

use serde::Serialize;
use sqlx::{FromRow, PgConnection, Row};
use time::OffsetDateTime;
use uuid::Uuid;

use super::phase::{RequestRecord, fence_param};
use super::subjects::Subjects;
use super::writes::Writes;
use super::{Ledger, LedgerError, timestamp};
use crate::domain::{ClientId, Fence};

/// A refund as the API shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, FromRow)]
pub struct Refund {
    pub id: Uuid,
    pub payment_id: Uuid,
    pub status: String,
    pub amount_minor: i64,
    pub currency: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rail_reference: Option<String>,
    /// Why the rail declined it, or returned it (a reason code).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub decline_reason: Option<String>,
    #[serde(with = "time::serde::rfc3339")]
    pub created_at: OffsetDateTime,
}

/// The refunds table, for the status changes payments make alike.
const REFUNDS: Subjects = Subjects { table: "refunds", columns: COLUMNS, reason: "decline_reason" };

const COLUMNS: &str =
    "id, payment_id, status, amount_minor, currency, reason, rail_reference, decline_reason, created_at";

/// What a refund's first phase writes.
pub struct NewRefund<'a> {
    pub payment_id: Uuid,
    pub amount_minor: i64,
    pub currency: &'a str,
    pub debtor_account: &'a str,
    pub creditor_account: &'a str,
    pub reason: Option<&'a str>,
}

/// Creates the refund row for a request (status `pending`).
pub fn insert(writes: &mut Writes, request: &RequestRecord, refund: &NewRefund<'_>, fence: Fence) {
    writes.push(
        "INSERT INTO refunds (id, client_id, idem_key, request_created_at, payment_id, amount_minor, currency,
                              debtor_account, creditor_account, reason, status, fence)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, 'pending', $11)",
        |b| {
            b.bind(request.payment_id)
                .bind(request.key.client.as_uuid())
                .bind(request.key.key.as_str())
                .bind(timestamp(request.created_at))
                .bind(refund.payment_id)
                .bind(refund.amount_minor)
                .bind(refund.currency)
                .bind(refund.debtor_account)
                .bind(refund.creditor_account)
                .bind(refund.reason)
                .bind(fence_param(fence));
        },
    );
}

/// Moves refund `id` to `status`, keeping the rail's reference or the
/// decline's reason code once known; returns the refund as it now stands.
pub async fn set_status(
    conn: &mut PgConnection,
    id: Uuid,
    status: &str,
    rail_reference: Option<&str>,
    decline_reason: Option<&str>,
    fence: Fence,
) -> Result<Refund, LedgerError> {
    let query = format!(
        "UPDATE refunds SET status = $2, rail_reference = coalesce($3, rail_reference),
                decline_reason = coalesce($4, decline_reason), fence = $5, updated_at = now()
          WHERE id = $1 RETURNING {COLUMNS}"
    );
    sqlx::query_as(sqlx::AssertSqlSafe(query))
        .bind(id)
        .bind(status)
        .bind(rail_reference)
        .bind(decline_reason)
        .bind(fence_param(fence))
        .fetch_optional(conn)
        .await?
        .ok_or_else(|| LedgerError::Corrupt(format!("refund {id} has no row")))
}

/// Marks a refund indeterminate, at every park past the limit; returns it
/// as it now stands when it became so now, `None` when it already was
/// (see [`super::payments::mark_indeterminate`]).
pub async fn mark_indeterminate(
    conn: &mut PgConnection,
    id: Uuid,
    fence: Fence,
) -> Result<Option<Refund>, LedgerError> {
    REFUNDS.mark_indeterminate(conn, id, fence).await
}

/// A refund as it stands, with the accounts it moved money between.
pub struct Standing {
    pub refund: Refund,
    pub debtor_account: String,
    pub creditor_account: String,
}

/// Refund `id` as it stands, if this ledger holds it.
pub async fn current(conn: &mut PgConnection, id: Uuid) -> Result<Option<Standing>, LedgerError> {
    let query = format!("SELECT {COLUMNS}, debtor_account, creditor_account FROM refunds WHERE id = $1");
    let Some(row) = sqlx::query(sqlx::AssertSqlSafe(query)).bind(id).fetch_optional(conn).await? else {
        return Ok(None);
    };
    Ok(Some(Standing {
        refund: Refund::from_row(&row)?,
        debtor_account: row.try_get("debtor_account")?,
        creditor_account: row.try_get("creditor_account")?,
    }))
}

/// Marks a refund returned by the rail (its money never reached the
/// debtor), keeping the reason code where a decline's goes; returns it as
/// it now stands, whose it is, and the fence it was last written under.
pub async fn mark_returned(
    conn: &mut PgConnection,
    id: Uuid,
    reason: &str,
) -> Result<(Refund, ClientId, Fence), LedgerError> {
    REFUNDS.mark_returned(conn, id, reason).await
}

/// Marks a refund voided, if it has a row (see [`super::payments::mark_voided`]).
pub async fn mark_voided(conn: &mut PgConnection, id: Uuid, fence: Fence) -> Result<(), LedgerError> {
    sqlx::query("UPDATE refunds SET status = 'voided', fence = $2, updated_at = now() WHERE id = $1")
        .bind(id)
        .bind(fence_param(fence))
        .execute(conn)
        .await?;
    Ok(())
}

/// A refund as this ledger holds it, with the request it belongs to, so a
/// reader can tell the live copy from a leftover of a request that moved.
#[derive(Debug, Clone, FromRow)]
pub struct HeldRefund {
    #[sqlx(flatten)]
    pub refund: Refund,
    pub idem_key: String,
    pub request_created_at: OffsetDateTime,
}

impl Ledger {
    /// The client's refund with this id; `None` for another client's.
    pub async fn refund_of(&self, client: ClientId, id: Uuid) -> Result<Option<HeldRefund>, LedgerError> {
        let query =
            format!("SELECT {COLUMNS}, idem_key, request_created_at FROM refunds WHERE id = $1 AND client_id = $2");
        Ok(sqlx::query_as(sqlx::AssertSqlSafe(query))
            .bind(id)
            .bind(client.as_uuid())
            .fetch_optional(&self.pool)
            .await?)
    }

    /// The client's refunds of payment `payment_id` this ledger holds, oldest first.
    pub async fn refunds_of_payment(&self, client: ClientId, payment_id: Uuid) -> Result<Vec<HeldRefund>, LedgerError> {
        let query = format!(
            "SELECT {COLUMNS}, idem_key, request_created_at FROM refunds WHERE client_id = $1 AND payment_id = $2
              ORDER BY created_at, id LIMIT 1000"
        );
        Ok(sqlx::query_as(sqlx::AssertSqlSafe(query))
            .bind(client.as_uuid())
            .bind(payment_id)
            .fetch_all(&self.pool)
            .await?)
    }
}
