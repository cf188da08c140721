//! Queuing an event: a row of `outbox`, written inside the phase that
//! causes it, so the event exists if and only if its effect committed.
//! Nothing is sent here; the delivery worker sends it after the commit.

use uuid::Uuid;

use crate::domain::ClientId;
use crate::ledger::writes::Writes;

/// Queues event `event` of `payment` with `data` (what receivers get as
/// the event's `data`: no full account numbers). An event a phase queues
/// again (a phase run twice by a reconciler's repair) is kept once.
pub fn event(writes: &mut Writes, client: ClientId, payment: Uuid, event: &str, data: &serde_json::Value) {
    writes.push(
        "INSERT INTO outbox (event_id, client_id, payment_id, event, payload) VALUES ($1, $2, $3, $4, $5)
         ON CONFLICT (payment_id, event) DO NOTHING",
        |b| {
            b.bind(super::event_id(payment, event)).bind(client.as_uuid()).bind(payment).bind(event).bind(data);
        },
    );
}
