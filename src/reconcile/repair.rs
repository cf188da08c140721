//! Repairs, one per divergence class, each through the same fence protocol
//! as live traffic, so each is idempotent and safe beside it: a stale or
//! half-published request is taken over and resumed like any retry would;
//! a payment the ledger lost is rebuilt under the key's final fence, phase
//! by phase (the phases' recovery-point checks stop a second rebuilder); a
//! lost key is put back only where no item exists, under a fence above any
//! the ledger has seen; a leftover is voided by compensating entries. An
//! answer mismatch is left for a person, and so is a rebuild the ledger
//! refuses (it holds a newer fence than the key).
//!
//! A repair is never taken at its word: afterwards the stores are read
//! again, and only a divergence that is gone counts as resolved. When
//! another actor was found at work (another reconciler, a retry, the
//! recovery worker), its result is waited for a few seconds first.

use std::time::Duration;

use crate::domain::{Millis, Owner, RecoveryPoint};
use crate::engine::{Answer, Engine, EngineError, Recovery};
use crate::keystore::{KeyItem, KeyState, KeyStore, KeyStoreError};
use crate::ledger::views::LedgerView;
use crate::operations::Registered;

use super::{Class, Found, Repair};

/// How long to wait for another actor found at work on the same request.
const OTHERS_WAIT: Duration = Duration::from_secs(5);

/// What a repair attempt came to, before the stores are read again.
enum Acted {
    /// It made its change.
    Done(String),
    /// Another actor is on it: check what it leaves, after a short wait.
    Others(String),
    /// Refused, or left alone on purpose: the divergence stands.
    Unresolved(String),
}

/// Repairs one finding: its key item as scanned (absent for a missing
/// key), this region's view of the request, and the hand-off that named it.
pub(super) async fn repair<K: KeyStore>(engine: &Engine<K>, found: &Found) -> Result<Repair, EngineError> {
    let (class, key, ledger) = (found.finding.class, found.key.as_ref(), found.view.as_ref());
    if let Some(hold) = &found.hold {
        return Ok(Repair { resolved: false, action: hold.clone() });
    }
    match (class, &found.balance) {
        (Class::OrphanedHold, Some(hold)) => {
            let (resolved, action) = super::holds::release(engine, hold).await?;
            return Ok(Repair { resolved, action });
        }
        (Class::HoldMissing, _) => {
            let action = "not repaired: the request finished without a hold on its balance, so the balance has \
                          its amount left to give again; compare the balance item with every region's ledger and \
                          settle it by hand"
                .to_owned();
            return Ok(Repair { resolved: false, action });
        }
        _ => {}
    }
    let acted = match (class, key, ledger) {
        (Class::PaymentMissing, Some(key), ledger) => rebuild(engine, key, ledger).await?,
        (Class::UnknownOutcome, Some(key), _) if key.lease_until >= engine.clock().now() => Acted::Unresolved(format!(
            "left alone: a live owner holds the lease (until {}) and probes the rail itself",
            key.lease_until.get()
        )),
        (Class::KeyNotFinished | Class::StaleInFlight | Class::UnknownOutcome, Some(key), _) => {
            resume(engine, key).await?
        }
        (Class::KeyMissing, None, Some(ledger)) => restore_key(engine, ledger).await?,
        (Class::FencedLeftover | Class::MovedInFlight, key, Some(ledger)) => {
            let Some(fence) = found.handoff.as_ref().map(|h| h.fence).or(key.map(|k| k.fence)) else {
                return Err(EngineError::Fault("a leftover names no fence to void it under".into()));
            };
            match engine.ledger().void(&ledger.record, fence, &ledger.recovery_point).await {
                Ok(()) => Acted::Done(format!(
                    "voided this ledger's entries (written under fence {}) by compensating postings",
                    ledger.fence
                )),
                // Another reconciler voided it first, or a newer owner wrote here.
                Err(crate::ledger::LedgerError::OutOfOrder { .. } | crate::ledger::LedgerError::FencedOut { .. }) => {
                    Acted::Others("the ledger moved on meanwhile".into())
                }
                Err(e) => return Err(e.into()),
            }
        }
        (Class::AnswerMismatch, _, _) => Acted::Unresolved(
            "not repaired: clients have been given the key store's answer; compare both and decide by hand".into(),
        ),
        (Class::WorkedTwice, _, _) => Acted::Unresolved(
            "not repaired: the key was worked twice; clients hold the answer of the copy named as answered. Before \
             refunding this ledger's copy, look its payment id up in every region's ledger: held there too, it is \
             the same payment (one instruction at each rail) and this copy is only to be voided; held nowhere \
             else, its instructions reached the rails under its own derived keys: refund them"
                .into(),
        ),
        (class, _, _) => return Err(EngineError::Fault(format!("{class:?}: the finding lacks what its repair needs"))),
    };
    let (action, wait) = match acted {
        Acted::Unresolved(action) => return Ok(Repair { resolved: false, action }),
        Acted::Done(action) => (action, Duration::ZERO),
        Acted::Others(action) => (action, OTHERS_WAIT),
    };
    let Some(request) = key.map(|k| (&k.key, k.created_at)).or(ledger.map(|l| (&l.record.key, l.record.created_at)))
    else {
        return Err(EngineError::Fault("a finding names no request".into()));
    };
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        if gone(engine, class, request, key).await? {
            if let Some(handoff) = &found.handoff {
                engine.keys().forget_handoff(handoff).await?;
            }
            return Ok(Repair { resolved: true, action });
        }
        if tokio::time::Instant::now() >= deadline {
            return Ok(Repair { resolved: false, action: format!("{action}; but the divergence is still there") });
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// Whether the stores, read again now, no longer show the divergence.
async fn gone<K: KeyStore>(
    engine: &Engine<K>,
    class: Class,
    (key, created_at): (&crate::domain::ScopedKey, Millis),
    scanned: Option<&KeyItem>,
) -> Result<bool, EngineError> {
    let item = engine.keys().get(key).await?.filter(|item| item.created_at == created_at);
    let finished = item.as_ref().is_some_and(|item| item.state == KeyState::Finished);
    Ok(match class {
        Class::KeyNotFinished | Class::StaleInFlight | Class::UnknownOutcome | Class::KeyMissing => finished,
        Class::PaymentMissing | Class::FencedLeftover | Class::MovedInFlight => {
            let views = engine.ledger().views(&[(key.clone(), created_at)]).await?;
            let view = views.into_values().next();
            match class {
                Class::FencedLeftover | Class::MovedInFlight => {
                    view.is_some_and(|v| v.recovery_point == RecoveryPoint::VOIDED)
                }
                _ => view.is_some_and(|v| {
                    v.recovery_point == RecoveryPoint::FINISHED
                        && v.payment_status.is_some()
                        && v.answer == scanned.and_then(|k| k.response.clone())
                }),
            }
        }
        Class::AnswerMismatch | Class::WorkedTwice | Class::OrphanedHold | Class::HoldMissing => false,
    })
}

async fn rebuild<K: KeyStore>(
    engine: &Engine<K>,
    key: &KeyItem,
    ledger: Option<&LedgerView>,
) -> Result<Acted, EngineError> {
    if let Some(ledger) = ledger.filter(|l| l.fence > key.fence) {
        return Ok(Acted::Unresolved(format!(
            "refused: this ledger holds the request under fence {}, newer than the key's final fence {}; \
             a later owner wrote here, so compare both by hand",
            ledger.fence, key.fence
        )));
    }
    let op = Registered::decode(&key.operation, &key.request)?;
    Ok(match engine.rebuild(key, &op).await {
        Ok(Answer::Final { .. }) => {
            Acted::Done("rebuilt the payment from the stored request and the rails' records".into())
        }
        Ok(Answer::Pending { .. }) => {
            Acted::Unresolved("rebuilt up to a call whose outcome is unknown; run again later".into())
        }
        Ok(other) => Acted::Unresolved(format!("rebuild stopped: {other:?}")),
        // A phase was already past where this rebuild stood: another
        // reconciler is rebuilding it (if it dies, the next run resumes).
        Err(EngineError::FencedOut(_)) => Acted::Others("another reconciler is rebuilding it".into()),
        Err(e) => return Err(e),
    })
}

async fn resume<K: KeyStore>(engine: &Engine<K>, key: &KeyItem) -> Result<Acted, EngineError> {
    Ok(match engine.recover(&key.stale(), Registered::decode).await {
        Ok(Recovery::Resumed(Answer::Final { .. })) => Acted::Done("took it over and finished it".into()),
        Ok(Recovery::Resumed(Answer::Pending { .. })) => Acted::Unresolved(
            "took it over; the external outcome is still unknown (probed, parked, listed if indeterminate)".into(),
        ),
        Ok(Recovery::Lost) | Err(EngineError::FencedOut(_)) => Acted::Others("another owner holds it now".into()),
        Ok(other) => Acted::Unresolved(format!("not resumed: {other:?}")),
        Err(e) => return Err(e),
    })
}

async fn restore_key<K: KeyStore>(engine: &Engine<K>, ledger: &LedgerView) -> Result<Acted, EngineError> {
    let finished = ledger.answer.is_some() && ledger.recovery_point == RecoveryPoint::FINISHED;
    let item = KeyItem {
        key: ledger.record.key.clone(),
        request_hash: ledger.record.request_hash.clone(),
        request: ledger.record.request.clone(),
        operation: ledger.record.operation.clone(),
        state: if finished { KeyState::Finished } else { KeyState::Started },
        // Above any fence the ledger has seen: whoever held the old one
        // (a stalled owner, say) can never write again.
        fence: ledger.fence.next(),
        // A restored in-flight key has no live owner: its lease is over.
        lease_until: Millis::new(0),
        owner: Owner::attempt_of("reconciler"),
        home_region: engine.region().to_owned(),
        created_at: ledger.record.created_at,
        payment_id: ledger.record.payment_id,
        response: if finished { ledger.answer.clone() } else { None },
        // A retention after the ledger finished it, as the lost key had: a
        // restored key never outlives the ledger's rows of its request.
        expires_at: finished.then(|| engine.retention().expires_at(ledger.updated_at).as_secs()),
        left: Default::default(),
    };
    Ok(match engine.keys().restore(&item).await {
        Ok(()) if finished => Acted::Done("recreated the finished key with the ledger's answer".into()),
        Ok(()) => match resume(engine, &item).await? {
            Acted::Done(action) => Acted::Done(format!("recreated the key in flight, then {action}")),
            Acted::Others(action) => Acted::Others(format!("recreated the key in flight, then {action}")),
            Acted::Unresolved(action) => Acted::Unresolved(format!("recreated the key in flight, then {action}")),
        },
        Err(KeyStoreError::Taken(_)) => Acted::Others("the key exists again (restored by another reconciler)".into()),
        Err(e) => return Err(e.into()),
    })
}
