//! Holds on balances, compared with the requests behind them (a refund's
//! hold on its payment's refundable balance). A hold taken in this region
//! and still held longer than the stale threshold whose request is gone
//! (its key no longer names it, and this ledger never wrote it) has nothing
//! behind it: the repair checks that again, then releases it, once. A request this ledger finished whose
//! balance has no hold for it is reported only: what the balance has left
//! is then overstated by its amount, which a person settles.

use std::collections::HashMap;

use super::{Class, Finding, Found, FrozenPayment, Thresholds};
use crate::domain::RecoveryPoint;
use crate::engine::{Engine, EngineError, Operation};
use crate::keystore::{Balance, Concluded, Conclusion, HoldEntry, HoldState, KeyStore};
use crate::ledger::views::LedgerView;
use crate::operations::{RefundOperation, Registered};

/// The hold a finding is about, and its balance.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct HoldRef {
    pub balance: String,
    pub hold: HoldEntry,
}

/// The orphaned holds among `balances`.
pub(super) async fn orphaned<K: KeyStore>(
    engine: &Engine<K>,
    balances: &[(String, Balance)],
    t: &Thresholds,
) -> Result<Vec<Found>, EngineError> {
    let mut found = Vec::new();
    for (balance, current) in balances {
        let held = current.holds.iter().filter(|h| h.state == HoldState::Held && h.at.plus(t.stale_after) < t.now);
        for hold in held {
            if !engine.orphaned(hold).await? {
                continue;
            }
            let evidence = format!(
                "balance {balance} holds {} for this request since {} (taken in {}); its key no longer names it",
                hold.amount,
                hold.at.get(),
                hold.by.region
            );
            let finding = Finding::new(Class::OrphanedHold, &hold.by.key, hold.by.id, evidence);
            let mut one = Found::new(finding, None, None);
            one.balance = Some(HoldRef { balance: balance.clone(), hold: hold.clone() });
            found.push(one);
        }
    }
    Ok(found)
}

/// The payments among `balances` frozen by a return that has not taken
/// effect (the return's lasting hold is missing).
pub(super) fn frozen(balances: &[(String, Balance)]) -> Vec<FrozenPayment> {
    let mut frozen: Vec<FrozenPayment> = balances
        .iter()
        .filter(|(_, balance)| !balance.holds.iter().any(|h| h.lasting))
        .filter_map(|(name, balance)| {
            let by = balance.frozen.as_ref()?;
            Some(FrozenPayment {
                payment_id: RefundOperation::payment_of(name)?,
                by: by.by.clone(),
                frozen_at: crate::ledger::timestamp(by.at),
                refunded: balance.settled,
                held: balance.reserved - balance.settled,
            })
        })
        .collect();
    frozen.sort_by_key(|f| (f.frozen_at, f.payment_id));
    frozen
}

/// A finding if `view` is a request this ledger finished whose operation
/// holds on a balance that has no hold for it.
pub(super) fn missing(view: &LedgerView, balances: &HashMap<&str, &Balance>) -> Option<Finding> {
    if view.recovery_point != RecoveryPoint::FINISHED
        || !matches!(view.payment_status.as_deref(), Some("succeeded" | "rejected"))
    {
        return None;
    }
    let hold = Registered::decode(&view.record.operation, &view.record.request).ok()?.hold()?;
    if balances.get(hold.balance.as_str()).is_some_and(|b| b.hold(view.record.payment_id).is_some()) {
        return None;
    }
    let evidence = format!(
        "ledger finished it ({}); balance {} has no hold of {} for it, so what it has left is overstated",
        view.payment_status.as_deref().unwrap_or_default(),
        hold.balance,
        hold.amount
    );
    Some(Finding::new(Class::HoldMissing, &view.record.key, view.record.payment_id, evidence))
}

/// Releases an orphaned hold, if it still is one; whether it is released
/// now, by whoever.
pub(super) async fn release<K: KeyStore>(engine: &Engine<K>, found: &HoldRef) -> Result<(bool, String), EngineError> {
    if !engine.orphaned(&found.hold).await? {
        return Ok((false, "left alone: its request is found again".into()));
    }
    Ok(match engine.keys().conclude_hold(&found.balance, found.hold.by.id, Conclusion::Release).await? {
        Concluded::Now => (true, "released the hold: nothing stands behind it".into()),
        Concluded::Already => (true, "the hold was released meanwhile".into()),
        Concluded::Missing => (false, "the hold is gone from its balance".into()),
    })
}
