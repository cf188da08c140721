//! Which copy of a payment (or of a refund, by the same rules) a region shows. After a failover the same
//! payment id is held by two ledgers: the live copy in the request's home
//! region, and a leftover in the region it moved from (pending until its
//! reconciler voids it, voided after). A copy is live when it is final
//! (succeeded or rejected: every ledger that holds a verdict learned the
//! same one from the rail, under the same derived key), when the key item
//! names this region as the request's home, or, with the key gone, when
//! neither a hand-off nor a void says the request left. Only a live copy is
//! shown, or given to another region asking; a leftover makes the reader
//! ask the request's home region first, and when no region shows the live
//! copy yet (its new home has not written it), the answer is 503: the
//! payment is moving. Never the leftover, never a 404 for money that moved.

use crate::domain::{ClientId, IdempotencyKey, ScopedKey};
use crate::engine::{Engine, EngineError};
use crate::keystore::KeyStore;
use crate::ledger::payments::Held;
use crate::ledger::refunds::HeldRefund;

/// A copy of what a request created (a payment, a refund) in this ledger:
/// its status and the request it belongs to.
pub struct Copy<'a> {
    pub status: &'a str,
    pub idem_key: &'a str,
    pub request_created_at: time::OffsetDateTime,
}

impl<'a> From<&'a Held> for Copy<'a> {
    fn from(held: &'a Held) -> Self {
        Copy { status: &held.payment.status, idem_key: &held.idem_key, request_created_at: held.request_created_at }
    }
}

impl<'a> From<&'a HeldRefund> for Copy<'a> {
    fn from(held: &'a HeldRefund) -> Self {
        Copy { status: &held.refund.status, idem_key: &held.idem_key, request_created_at: held.request_created_at }
    }
}

/// What a local copy of a payment is.
pub enum Standing {
    Live,
    /// Superseded here; the home region named by the key, if it is known.
    Leftover {
        home: Option<String>,
    },
}

/// Judges the copy `held` in this region's ledger, for `client`.
pub async fn judge<K: KeyStore>(engine: &Engine<K>, client: ClientId, held: Copy<'_>) -> Result<Standing, EngineError> {
    let status = held.status;
    if matches!(status, "succeeded" | "rejected") {
        return Ok(Standing::Live);
    }
    let created_at = crate::ledger::millis(held.request_created_at);
    let key = IdempotencyKey::parse(held.idem_key)
        .map(|key| ScopedKey::new(client, key))
        .map_err(|e| EngineError::Fault(format!("stored key {:?}: {e}", held.idem_key)))?;
    let item = engine.keys().get(&key).await?.filter(|item| item.created_at == created_at);
    Ok(match item {
        Some(item) if item.home_region == engine.region() && status != "voided" => Standing::Live,
        Some(item) => Standing::Leftover { home: Some(item.home_region) },
        None if status == "voided" || engine.keys().handoff_of(engine.region(), &key, created_at).await? => {
            Standing::Leftover { home: None }
        }
        None => Standing::Live,
    })
}
