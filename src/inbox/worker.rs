//! The inbox worker inside `serve`: every round it hands on the messages
//! due to go to another region ([`super::hand`]), and, if any message is
//! pending, it applies the returns whose payment has settled since they
//! arrived, ends verdicts whose outcome was recorded as they arrived, and
//! resumes the requests a verdict waits for that no owner is working
//! (their owner parked them, or died).

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use super::hand::{HandOn, hand_on_waiting};
use crate::engine::Engine;
use crate::keystore::KeyStore;

/// Messages looked at per round at most.
const BATCH: i64 = 64;

pub async fn run_until_stopped<K: KeyStore + 'static, H: HandOn>(
    engine: Arc<Engine<K>>,
    hands: H,
    interval: Duration,
    mut stop: watch::Receiver<()>,
) {
    loop {
        tokio::select! {
            _ = stop.changed() => return,
            () = tokio::time::sleep(interval) => {}
        }
        round(&engine, &hands).await;
    }
}

/// One round. Each of its reads looks for pending messages only, and joins
/// them to the partitioned call and request tables, which PostgreSQL plans
/// afresh each time (a few milliseconds a round on a small ledger): a round
/// that finds nothing to do ends there, at the cost of one read of the
/// inbox's indexes of pending messages and of messages to hand on. A
/// message that arrives after that read waits for the next round, as one
/// arriving after the round's last read always did.
pub async fn round<K: KeyStore, H: HandOn>(engine: &Engine<K>, hands: &H) {
    let due = match engine.ledger().inbox_due().await {
        Ok(due) => due,
        Err(e) => {
            tracing::warn!(error = %e, "could not read the inbox");
            return;
        }
    };
    // Handing on waits on other regions: it goes on beside this region's
    // own work, never ahead of it.
    let handing = async {
        if due.to_hand_on {
            hand_on_waiting(engine, hands).await;
        }
    };
    tokio::join!(handing, async {
        if due.pending {
            work_pending(engine).await;
        }
    });
}

/// Applies returns that can take effect, ends overtaken verdicts, and
/// resumes requests a verdict waits for.
async fn work_pending<K: KeyStore>(engine: &Engine<K>) {
    apply_returns(engine).await;
    if let Err(e) = engine.ledger().end_overtaken_verdicts().await {
        tracing::warn!(error = %e, "could not read the inbox");
    }
    match engine.ledger().notified_in_flight(BATCH).await {
        Ok(waiting) => {
            for in_flight in waiting {
                super::resume(engine, &in_flight).await;
            }
        }
        Err(e) => tracing::warn!(error = %e, "could not read the inbox"),
    }
}

/// Applies the returns that wait, each in its own phase.
async fn apply_returns<K: KeyStore>(engine: &Engine<K>) {
    match engine.ledger().pending_returns(BATCH).await {
        Ok(pending) => {
            for one in pending {
                if let Err(e) = super::apply_return(engine, &one).await {
                    tracing::warn!(id = one.message_id, error = %e, "could not apply a return; trying again");
                }
            }
        }
        Err(e) => tracing::warn!(error = %e, "could not read the inbox"),
    }
}
