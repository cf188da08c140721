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
//!   not to be believed): offered again after [`AGAIN_AFTER`], for as long
//!   as it takes (the reconciler reports what waits, and an alert fires).

use std::sync::Arc;
use std::time::Duration;

use crate::domain::Millis;
use crate::engine::Engine;
use crate::keystore::KeyStore;
use crate::ledger::inbox::{HandOnEnd, Waiting};
use crate::regions::Registry;

/// How long a message no region takes is offered before a person gets it.
pub const OFFERED_FOR: Duration = Duration::from_secs(300);

/// How soon a message not taken yet is offered again.
pub const AGAIN_AFTER: Duration = Duration::from_secs(10);

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
    for one in waiting {
        let handed = hands.hand_on(&one).await;
        let offered_long = one.since.plus(OFFERED_FOR) <= Millis::now();
        let (ended, outcome) = match &handed {
            Handed::To(region) => (Some(HandOnEnd::To(region)), "handed"),
            Handed::Nowhere if offered_long => {
                (Some(HandOnEnd::Kept("no region holds a live copy of its instruction")), "nowhere")
            }
            Handed::Conflicting(_) => {
                (Some(HandOnEnd::Kept("another region holds another message under its id")), "conflicting")
            }
            Handed::Nowhere | Handed::NotYet => (None, "not_yet"),
        };
        metrics::counter!("keyfence_rail_notifications_handed_total", "outcome" => outcome).increment(1);
        let Some(ended) = ended else { continue };
        match engine.ledger().hand_on_ended(&one.rail, &one.message_id, ended).await {
            Ok(()) => tracing::info!(rail = one.rail, id = one.message_id, ?handed, "a rail notification handed on"),
            Err(e) => tracing::warn!(id = one.message_id, error = %e, "could not record a hand-on; offering it again"),
        }
    }
}
