//! The inbox worker inside `serve`: every round, if any message is pending,
//! it applies the returns whose payment has settled since they arrived,
//! ends verdicts whose outcome was recorded as they arrived, and resumes
//! the requests a verdict waits for that no owner is working (their owner
//! parked them, or died).

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use crate::engine::Engine;
use crate::keystore::KeyStore;

/// Messages looked at per round at most.
const BATCH: i64 = 64;

pub async fn run_until_stopped<K: KeyStore + 'static>(
    engine: Arc<Engine<K>>,
    interval: Duration,
    mut stop: watch::Receiver<()>,
) {
    loop {
        tokio::select! {
            _ = stop.changed() => return,
            () = tokio::time::sleep(interval) => {}
        }
        round(&engine).await;
    }
}

/// One round. Each of its reads looks for pending messages only, and joins
/// them to the partitioned call and request tables, which PostgreSQL plans
/// afresh each time (a few milliseconds a round on a small ledger): a round
/// that finds no message pending ends there, at the cost of one read of
/// the inbox's index of pending messages. A message that arrives after
/// that read waits for the next round, as one arriving after the round's
/// last read always did.
pub async fn round<K: KeyStore>(engine: &Engine<K>) {
    match engine.ledger().inbox_pending().await {
        Ok(true) => {}
        Ok(false) => return,
        Err(e) => {
            tracing::warn!(error = %e, "could not read the inbox");
            return;
        }
    }
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
