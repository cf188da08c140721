//! Payments and their double-entry postings. Writes happen inside a fenced
//! phase (the blind ones, a payment's creation and its postings, are held
//! with the phase's other writes); reads are scoped to the client that
//! asks, so one client can never see another's payment.

use serde::Serialize;
use sqlx::{FromRow, PgConnection};
use time::OffsetDateTime;
use uuid::Uuid;

use super::phase::{RequestRecord, fence_param};
use super::subjects::Subjects;
use super::writes::Writes;
use super::{Ledger, LedgerError, timestamp};
use crate::domain::{ClientId, Fence, PaymentRequest};

/// A payment as the API shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, FromRow)]
pub struct Payment {
    pub id: Uuid,
    pub status: String,
    pub amount_minor: i64,
    pub currency: String,
    pub debtor_account: String,
    pub creditor_account: String,
    pub end_to_end_id: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub remittance_info: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rail_reference: Option<String>,
    /// Why a rejected payment was refused (a reason code).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    #[serde(with = "time::serde::rfc3339")]
    pub created_at: OffsetDateTime,
}

/// The payments table, for the status changes refunds make alike.
const PAYMENTS: Subjects = Subjects { table: "payments", columns: COLUMNS, reason: "reason" };

const COLUMNS: &str = "id, status, amount_minor, currency, debtor_account, creditor_account, end_to_end_id, \
                       remittance_info, rail_reference, reason, created_at";

/// One leg of a posting: an account and a signed amount.
pub struct Leg<'a> {
    pub account: &'a str,
    pub amount_minor: i64,
}

/// Creates the payment row for a request (status `pending`), created when
/// the request was: at the time its key carries, the same in every region
/// that works it, and known to whatever builds the payment as it stands
/// without reading it back ([`succeed`]).
pub fn insert_payment(writes: &mut Writes, request: &RequestRecord, payment: &PaymentRequest, fence: Fence) {
    writes.push(
        "INSERT INTO payments (id, client_id, idem_key, request_created_at, amount_minor, currency,
                               debtor_account, creditor_account, end_to_end_id, remittance_info, status, fence,
                               created_at)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, 'pending', $11, $4)",
        |b| {
            b.bind(request.payment_id)
                .bind(request.key.client.as_uuid())
                .bind(request.key.key.as_str())
                .bind(timestamp(request.created_at))
                .bind(payment.amount_minor)
                .bind(&payment.currency)
                .bind(&payment.debtor_account)
                .bind(&payment.creditor_account)
                .bind(&payment.end_to_end_id)
                .bind(&payment.remittance_info)
                .bind(fence_param(fence));
        },
    );
}

/// Posts one balanced entry, all its legs in one statement (the legs must
/// sum to zero; the database refuses the commit otherwise).
pub fn post(writes: &mut Writes, payment_id: Uuid, entry: &str, currency: &str, legs: &[Leg<'_>], fence: Fence) {
    let accounts: Vec<&str> = legs.iter().map(|leg| leg.account).collect();
    let amounts: Vec<i64> = legs.iter().map(|leg| leg.amount_minor).collect();
    writes.push(
        "INSERT INTO postings (payment_id, entry, account, amount_minor, currency, fence)
         SELECT $1, $2, account, amount, $5, $6 FROM unnest($3::text[], $4::bigint[]) AS leg(account, amount)",
        |b| {
            b.bind(payment_id).bind(entry).bind(accounts).bind(amounts).bind(currency).bind(fence_param(fence));
        },
    );
}

/// Marks a payment indeterminate, at every park past the limit; returns
/// it as it now stands when it became so now, `None` when it already was,
/// so what follows the change (its event) happens once in its life.
pub async fn mark_indeterminate(
    conn: &mut PgConnection,
    payment_id: Uuid,
    fence: Fence,
) -> Result<Option<Payment>, LedgerError> {
    PAYMENTS.mark_indeterminate(conn, payment_id, fence).await
}

/// Marks `request`'s payment succeeded at the rail's `rail_reference`, as a
/// held write (the phase fails as corrupt if the payment has no row), and
/// returns it as it then stands, built from what its row was made of
/// (`payment`, the request's own time) rather than read back. A row made
/// before payments took their request's time takes it here, so the answer
/// and the row agree; a payment that succeeds has no reason.
pub fn succeed(
    writes: &mut Writes,
    request: &RequestRecord,
    payment: &PaymentRequest,
    rail_reference: &str,
    fence: Fence,
) -> Payment {
    writes.push_one(
        "UPDATE payments SET status = 'succeeded', rail_reference = $2, fence = $3,
                             created_at = request_created_at, updated_at = now()
          WHERE id = $1",
        format!("payment {} has no row", request.payment_id),
        |b| {
            b.bind(request.payment_id).bind(rail_reference).bind(fence_param(fence));
        },
    );
    Payment {
        id: request.payment_id,
        status: "succeeded".to_owned(),
        amount_minor: payment.amount_minor,
        currency: payment.currency.clone(),
        debtor_account: payment.debtor_account.clone(),
        creditor_account: payment.creditor_account.clone(),
        end_to_end_id: payment.end_to_end_id.clone(),
        remittance_info: payment.remittance_info.clone(),
        rail_reference: Some(rail_reference.to_owned()),
        reason: None,
        created_at: timestamp(request.created_at),
    }
}

/// The payment as it stands, inside a phase.
pub async fn current(conn: &mut PgConnection, payment_id: Uuid) -> Result<Payment, LedgerError> {
    let query = format!("SELECT {COLUMNS} FROM payments WHERE id = $1");
    sqlx::query_as(sqlx::AssertSqlSafe(query))
        .bind(payment_id)
        .fetch_optional(conn)
        .await?
        .ok_or_else(|| LedgerError::Corrupt(format!("payment {payment_id} has no row")))
}

/// Marks a settled payment returned by the rail, with the reason code;
/// returns it as it now stands, whose it is, and the fence it was last
/// written under.
pub async fn mark_returned(
    conn: &mut PgConnection,
    payment_id: Uuid,
    reason: &str,
) -> Result<(Payment, ClientId, Fence), LedgerError> {
    PAYMENTS.mark_returned(conn, payment_id, reason).await
}

/// Marks a payment voided, if it has a row (a request whose first phase
/// never committed has none).
pub async fn mark_voided(conn: &mut PgConnection, payment_id: Uuid, fence: Fence) -> Result<(), LedgerError> {
    sqlx::query("UPDATE payments SET status = 'voided', fence = $2, updated_at = now() WHERE id = $1")
        .bind(payment_id)
        .bind(fence_param(fence))
        .execute(conn)
        .await?;
    Ok(())
}

/// Marks a payment rejected, keeping the reason code it was refused with;
/// returns the payment as it now stands.
pub async fn reject(
    conn: &mut PgConnection,
    payment_id: Uuid,
    reason: &str,
    fence: Fence,
) -> Result<Payment, LedgerError> {
    let query = format!(
        "UPDATE payments SET status = 'rejected', reason = $2, fence = $3, updated_at = now()
          WHERE id = $1 RETURNING {COLUMNS}"
    );
    sqlx::query_as(sqlx::AssertSqlSafe(query))
        .bind(payment_id)
        .bind(reason)
        .bind(fence_param(fence))
        .fetch_optional(conn)
        .await?
        .ok_or_else(|| LedgerError::Corrupt(format!("payment {payment_id} has no row")))
}

/// A payment as this ledger holds it, with the request it belongs to, so a
/// reader can tell the live copy from a leftover of a request that moved.
#[derive(Debug, Clone, FromRow)]
pub struct Held {
    #[sqlx(flatten)]
    pub payment: Payment,
    pub idem_key: String,
    pub request_created_at: OffsetDateTime,
}

impl Ledger {
    /// The client's payment with this id; `None` for another client's.
    pub async fn payment_of(&self, client: ClientId, id: Uuid) -> Result<Option<Held>, LedgerError> {
        let query =
            format!("SELECT {COLUMNS}, idem_key, request_created_at FROM payments WHERE id = $1 AND client_id = $2");
        Ok(sqlx::query_as(sqlx::AssertSqlSafe(query))
            .bind(id)
            .bind(client.as_uuid())
            .fetch_optional(&self.pool)
            .await?)
    }

    /// The client's payments carrying this end-to-end reference, oldest first.
    pub async fn payments_by_reference(&self, client: ClientId, end_to_end_id: &str) -> Result<Vec<Held>, LedgerError> {
        let query = format!(
            "SELECT {COLUMNS}, idem_key, request_created_at FROM payments WHERE client_id = $1 AND end_to_end_id = $2
              ORDER BY created_at, id LIMIT 100"
        );
        Ok(sqlx::query_as(sqlx::AssertSqlSafe(query))
            .bind(client.as_uuid())
            .bind(end_to_end_id)
            .fetch_all(&self.pool)
            .await?)
    }
}
