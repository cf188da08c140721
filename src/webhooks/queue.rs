//! Queuing an event: a row of `outbox`, written inside the phase that
//! causes it, so the event exists if and only if its effect committed.
//! Nothing is sent here; the delivery worker sends it after the commit.

use sqlx::PgConnection;
use uuid::Uuid;

use crate::domain::ClientId;
use crate::ledger::LedgerError;

/// Queues event `event` of `payment` with `data` (what receivers get as
/// the event's `data`: no full account numbers). An event a phase queues
/// again (a phase run twice by a reconciler's repair) is kept once.
pub async fn event(
    conn: &mut PgConnection,
    client: ClientId,
    payment: Uuid,
    event: &str,
    data: &serde_json::Value,
) -> Result<(), LedgerError> {
    sqlx::query(
        "INSERT INTO outbox (event_id, client_id, payment_id, event, payload) VALUES ($1, $2, $3, $4, $5)
         ON CONFLICT (payment_id, event) DO NOTHING",
    )
    .bind(super::event_id(payment, event))
    .bind(client.as_uuid())
    .bind(payment)
    .bind(event)
    .bind(data)
    .execute(conn)
    .await?;
    Ok(())
}
