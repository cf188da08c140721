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

use serde::Serialize;
use serde_json::Value;
use uuid::Uuid;

use super::peers::{Asked, Asker};
use super::{ApiError, AppState};
use crate::domain::{ClientId, IdempotencyKey, ScopedKey};
use crate::engine::{Engine, EngineError};
use crate::keystore::KeyStore;
use crate::ledger::payments::Held;
use crate::ledger::refunds::HeldRefund;

/// A copy of what a request created (a payment, a refund) in this ledger:
/// its status and the request it belongs to.
#[derive(Clone, Copy)]
pub struct LocalCopy<'a> {
    pub status: &'a str,
    pub idem_key: &'a str,
    pub request_created_at: time::OffsetDateTime,
}

impl<'a> From<&'a Held> for LocalCopy<'a> {
    fn from(held: &'a Held) -> Self {
        LocalCopy {
            status: &held.payment.status,
            idem_key: &held.idem_key,
            request_created_at: held.request_created_at,
        }
    }
}

impl<'a> From<&'a HeldRefund> for LocalCopy<'a> {
    fn from(held: &'a HeldRefund) -> Self {
        LocalCopy { status: &held.refund.status, idem_key: &held.idem_key, request_created_at: held.request_created_at }
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

/// The live copy of `id` of `collection` (`/v1/payments`, `/v1/refunds`)
/// for `client`: `here`, this ledger's copy, if it is live; else the one
/// another region shows, its home region asked first. Asked by another
/// region (`forwarded`), only this region's own live copy counts; a
/// leftover here says the thing exists (never a 404 for it), without
/// showing it.
pub async fn copy_of(
    state: &AppState,
    client: ClientId,
    collection: &str,
    id: Uuid,
    here: Option<(&impl Serialize, LocalCopy<'_>)>,
    forwarded: bool,
) -> Result<Value, ApiError> {
    let held_here = here.is_some();
    let home = match here {
        Some((shown, held)) => match judge(&state.engine, client, held).await? {
            Standing::Live => return serde_json::to_value(shown).map_err(ApiError::internal),
            Standing::Leftover { home } => home,
        },
        None => None,
    };
    if forwarded {
        return Err(if held_here { ApiError::PaymentMoving } else { ApiError::NotFound });
    }
    let registry = state.engine.regions().current().await;
    let asker = Asker { me: state.engine.region(), client };
    match state.peers.one(&registry, asker, home.as_deref(), collection, &id.to_string()).await {
        Asked::Found(found) => Ok(found),
        // Only a leftover, here: its live copy is not written yet.
        Asked::Nowhere if held_here => Err(ApiError::PaymentMoving),
        Asked::Nowhere => Err(ApiError::NotFound),
        Asked::Unreachable(regions) => Err(ApiError::PeersUnreachable(regions)),
    }
}

/// Judges the copy `held` in this region's ledger, for `client`.
pub async fn judge<K: KeyStore>(
    engine: &Engine<K>,
    client: ClientId,
    held: LocalCopy<'_>,
) -> Result<Standing, EngineError> {
    let status = held.status;
    if matches!(status, "succeeded" | "rejected") {
        return Ok(Standing::Live);
    }
    let created_at = crate::ledger::millis(held.request_created_at);
    let key = IdempotencyKey::parse(held.idem_key)
        .map(|key| ScopedKey::new(client, key))
        .map_err(|e| EngineError::record(format!("stored key {:?}", held.idem_key), e))?;
    Ok(match engine.moved_away(&key, created_at).await? {
        Some(moved) => Standing::Leftover { home: moved.home },
        None if status == "voided" => Standing::Leftover { home: None },
        None => Standing::Live,
    })
}
