//! Handing a notification to the region that holds its live copy. A rail
//! notifies one URL, not one per region, so a notification about another
//! region's instruction (or about a request that moved away, or that this
//! ledger holds only a leftover of) may arrive here. It waits `forwarding`
//! with the rail's own bytes and signature, and each round offers it to
//! every other region ([`HandOn`], the front door's signed region-to-region
//! requests): the region holding the live copy checks the rail's signature
//! itself and takes it in; the others take nothing and say so.
//! - taken by one region: `forwarded`, naming it;
//! - every region says it holds no live copy, for [`OFFERED_FOR`] (a
//!   region may not have adopted a request yet just after a failover):
//!   kept for a person (`unknown`), like a message no region can match;
//! - a region could not be asked (unreachable, declared failed, an answer
//!   not to be believed): offered again after [`AGAIN_AFTER`], for up to
//!   [`GIVE_UP_AFTER`] (the reconciler counts what waits so, and an alert
//!   fires), then kept for a person; a person may settle it before that.
//!
//! Before each offer the region asks its own ledger again: a request
//! adopted here since the message arrived (after a failover) makes the
//! message this region's to take, and it is taken back instead.
//! Offers go out together, so one region that does not answer holds a
//! round up by one timeout, not one per message.

use std::sync::Arc;
use std::time::Duration;

use futures::future::join_all;

use crate::engine::{Engine, EngineError};
use crate::keystore::KeyStore;
use crate::ledger::inbox::{HandOnEnd, NOWHERE, Waiting};
use crate::regions::Registry;

/// How long a message no region takes is offered before a person gets it.
pub const OFFERED_FOR: Duration = Duration::from_secs(300);

/// How soon a message not taken yet is offered again.
pub const AGAIN_AFTER: Duration = Duration::from_secs(10);

/// How long a message is offered while some region cannot be asked.
pub const GIVE_UP_AFTER: Duration = Duration::from_secs(24 * 3600);

/// Messages handed on per round at most.
const BATCH: i64 = 16;

/// What the other regions did with a message offered to them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Handed {
    /// This region took it in.
    To(String),
    /// Every other region answered, and none holds a live copy of its
    /// instruction.
    Nowhere,
    /// A region holds another message under the same id.
    Conflicting(String),
    /// Some region could not be asked; offer it again later.
    NotYet,
}

/// Offers a message to the other regions' inboxes.
pub trait HandOn: Send + Sync {
    fn hand_on(&self, waiting: &Waiting) -> impl Future<Output = Handed> + Send;
}

/// Whether any other region is known (advertises where it answers): with
/// none, a message this region cannot take is kept for a person at once.
/// A view that shows none is read again first, so that a region that has
/// just begun to advertise is not missed.
pub async fn others_known<K: KeyStore>(engine: &Engine<K>) -> bool {
    let others = |registry: &Arc<Registry>| registry.urls.keys().any(|region| region != engine.region());
    others(&engine.regions().current().await) || engine.regions().fresh().await.is_ok_and(|fresh| others(&fresh))
}

/// Offers the messages due to the other regions, and ends those taken or
/// that no region holds.
pub async fn hand_on_waiting<K: KeyStore, H: HandOn>(engine: &Engine<K>, hands: &H) {
    let waiting = match engine.ledger().to_hand_on(BATCH, AGAIN_AFTER).await {
        Ok(waiting) => waiting,
        Err(e) => {
            tracing::warn!(error = %e, "could not read the messages to hand on");
            return;
        }
    };
    join_all(waiting.iter().map(|one| offer(engine, hands, one))).await;
}

/// Takes `one` back here if this region holds its live copy now, or else
/// offers it to the other regions and records what came of it.
async fn offer<K: KeyStore, H: HandOn>(engine: &Engine<K>, hands: &H, one: &Waiting) {
    match take_back(engine, one).await {
        Ok(true) => {
            metrics::counter!("keyfence_rail_notifications_handed_total", "outcome" => "here").increment(1);
            tracing::info!(rail = one.rail, id = one.message_id, "a rail notification to hand on is this region's now");
            return;
        }
        Ok(false) => {}
        Err(e) => tracing::warn!(id = one.message_id, error = %e, "could not tell whether a notification is ours now"),
    }
    let handed = hands.hand_on(one).await;
    let now = engine.clock().now();
    let (ended, outcome) = match &handed {
        Handed::To(region) => (Some(HandOnEnd::To(region)), "handed"),
        Handed::Nowhere if one.since.plus(OFFERED_FOR) <= now => (Some(HandOnEnd::Kept(NOWHERE)), "nowhere"),
        Handed::Conflicting(_) => {
            (Some(HandOnEnd::Kept("another region holds another message under its id")), "conflicting")
        }
        Handed::NotYet if one.since.plus(GIVE_UP_AFTER) <= now => {
            (Some(HandOnEnd::Kept("no region could take it within a day of trying")), "given_up")
        }
        Handed::Nowhere => (None, "not_yet"),
        Handed::NotYet => (None, "unanswered"),
    };
    metrics::counter!("keyfence_rail_notifications_handed_total", "outcome" => outcome).increment(1);
    let recorded = match ended {
        Some(ended) => engine.ledger().hand_on_ended(&one.rail, &one.message_id, ended).await,
        None => engine.ledger().offered(&one.rail, &one.message_id, handed == Handed::NotYet).await,
    };
    match recorded {
        Ok(()) if ended.is_some() => {
            tracing::info!(rail = one.rail, id = one.message_id, ?handed, "a rail notification handed on")
        }
        Ok(()) => {}
        Err(e) => tracing::warn!(id = one.message_id, error = %e, "could not record an offer; offering it again"),
    }
}

/// Whether `one` became this region's to take, and was taken back.
async fn take_back<K: KeyStore>(engine: &Engine<K>, one: &Waiting) -> Result<bool, EngineError> {
    let Ok(message) = super::parse(&one.rail, &one.message_id, one.signed.clone()) else { return Ok(false) };
    let Some(request) = engine.ledger().live_request_of(&message).await? else { return Ok(false) };
    if engine.moved_away(&request.key, request.created_at).await?.is_some() {
        return Ok(false);
    }
    Ok(engine.ledger().take_back(&message).await?.is_some())
}
