//! Repairs, one per divergence class, each through the same fence protocol
//! as live traffic, so each is idempotent and safe beside it: a stale or
//! half-published request is taken over and resumed like any retry would;
//! a payment the ledger lost is rebuilt under the key's final fence, phase
//! by phase (the phases' recovery-point checks stop a second rebuilder); a
//! lost key is put back only where no item exists; a leftover is voided by
//! compensating entries. An answer mismatch is left for a person.

use serde::Serialize;

use crate::domain::{Millis, Owner};
use crate::engine::{Answer, Engine, EngineError, PaymentOperation, Recovery};
use crate::keystore::{KeyItem, KeyState, KeyStore, KeyStoreError, StaleKey};
use crate::ledger::views::LedgerView;

use super::Class;

/// What a repair did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Repair {
    /// True once the divergence is gone (by this repair or by another actor).
    pub resolved: bool,
    pub action: String,
}

fn resolved(action: impl Into<String>) -> Repair {
    Repair { resolved: true, action: action.into() }
}

fn unresolved(action: impl Into<String>) -> Repair {
    Repair { resolved: false, action: action.into() }
}

/// Repairs one finding. `key` is the item as scanned (absent for a missing
/// key); `ledger` is this region's view of the request.
pub async fn repair<K: KeyStore>(
    engine: &Engine<K>,
    class: Class,
    key: Option<&KeyItem>,
    ledger: Option<&LedgerView>,
) -> Result<Repair, EngineError> {
    match (class, key, ledger) {
        (Class::PaymentMissing, Some(key), _) => rebuild(engine, key).await,
        (Class::KeyNotFinished | Class::StaleInFlight | Class::UnknownOutcome, Some(key), _) => {
            resume(engine, key).await
        }
        (Class::KeyMissing, None, Some(ledger)) => restore_key(engine, ledger).await,
        (Class::FencedLeftover, Some(key), Some(ledger)) => {
            engine.ledger().void(&ledger.record, key.fence, &ledger.recovery_point).await?;
            Ok(resolved(format!(
                "voided this ledger's entries (written under fence {}) by compensating postings",
                ledger.fence
            )))
        }
        (Class::AnswerMismatch, _, _) => Ok(unresolved(
            "not repaired: clients have been given the key store's answer; compare both and decide by hand",
        )),
        (class, _, _) => Err(EngineError::Fault(format!("{class:?}: the finding lacks what its repair needs"))),
    }
}

async fn rebuild<K: KeyStore>(engine: &Engine<K>, key: &KeyItem) -> Result<Repair, EngineError> {
    let op = PaymentOperation::from_canonical(&key.request)?;
    match engine.rebuild(key, &op).await {
        Ok(Answer::Final { .. }) => Ok(resolved("rebuilt the payment from the stored request and the rails' records")),
        Ok(Answer::Pending { .. }) => Ok(unresolved("rebuilt up to a call whose outcome is unknown; run again later")),
        Ok(other) => Ok(unresolved(format!("rebuild stopped: {other:?}"))),
        // A phase was already past where this rebuild stood: another
        // reconciler is rebuilding it (if it dies, the next run resumes).
        Err(EngineError::FencedOut) => Ok(resolved("another reconciler was already rebuilding it")),
        Err(e) => Err(e),
    }
}

async fn resume<K: KeyStore>(engine: &Engine<K>, key: &KeyItem) -> Result<Repair, EngineError> {
    let stale = StaleKey {
        key: key.key.clone(),
        fence: key.fence,
        home_region: key.home_region.clone(),
        lease_until: key.lease_until,
    };
    match engine.recover(&stale, PaymentOperation::from_canonical).await {
        Ok(Recovery::Resumed(Answer::Final { .. })) => Ok(resolved("took it over and finished it")),
        Ok(Recovery::Resumed(Answer::Pending { .. })) => Ok(unresolved(
            "took it over; the external outcome is still unknown (probed, parked, listed if indeterminate)",
        )),
        Ok(Recovery::Lost) | Err(EngineError::FencedOut) => Ok(resolved("another owner took it over first")),
        Ok(other) => Ok(unresolved(format!("not resumed: {other:?}"))),
        Err(e) => Err(e),
    }
}

async fn restore_key<K: KeyStore>(engine: &Engine<K>, ledger: &LedgerView) -> Result<Repair, EngineError> {
    let finished = ledger.answer.is_some() && ledger.recovery_point == crate::domain::RecoveryPoint::FINISHED;
    let item = KeyItem {
        key: ledger.record.key.clone(),
        request_hash: ledger.record.request_hash.clone(),
        request: ledger.record.request.clone(),
        state: if finished { KeyState::Finished } else { KeyState::Started },
        fence: ledger.fence,
        // A restored in-flight key has no live owner: its lease is over.
        lease_until: Millis::new(0),
        owner: Owner::attempt_of("reconciler"),
        home_region: engine.region().to_owned(),
        created_at: ledger.record.created_at,
        payment_id: ledger.record.payment_id,
        response: if finished { ledger.answer.clone() } else { None },
        expires_at: finished.then(|| Millis::now().plus(engine.retention()).as_secs()),
    };
    match engine.keys().restore(&item).await {
        Ok(()) if finished => Ok(resolved("recreated the finished key with the ledger's answer")),
        Ok(()) => {
            let resumed = resume(engine, &item).await?;
            Ok(Repair {
                resolved: resumed.resolved,
                action: format!("recreated the key in flight, then {}", resumed.action),
            })
        }
        Err(KeyStoreError::Taken(_)) => Ok(resolved("the key exists again (restored by another reconciler)")),
        Err(e) => Err(e.into()),
    }
}
