//! Which divergence, if any, a request shows: the key store's item and this
//! region's ledger view, compared. Pure: no I/O, so every rule is tested
//! here on its own.

use std::time::Duration;

use serde::Serialize;

use crate::domain::{Millis, RecoveryPoint};
use crate::keystore::{KeyItem, KeyState};
use crate::ledger::views::LedgerView;
use crate::regions::{RegionState, Registry};

/// The kinds of disagreement between the key store and a region's ledger.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Class {
    /// The key is finished here but the ledger lacks the payment or is
    /// behind (a failover lost its last commits).
    PaymentMissing,
    /// The ledger finished the request; the key is still started.
    KeyNotFinished,
    /// The ledger has the request; the key store has no item for it.
    KeyMissing,
    /// In flight past its lease, and nobody resumed it.
    StaleInFlight,
    /// An external outcome has been unknown for longer than the threshold.
    UnknownOutcome,
    /// Another region finished the request under a newer fence; what this
    /// ledger holds of it is a leftover.
    FencedLeftover,
    /// The request was failed over away from this region while in flight
    /// here (its hand-off, or the key's `left` set, says so); whatever its
    /// state now (in flight elsewhere, finished, or expired), what this
    /// ledger holds of it is a leftover, never to be worked again.
    MovedInFlight,
    /// Both finished, with different answers.
    AnswerMismatch,
    /// The key names another request than this ledger's for it: the key
    /// was claimed twice (two regions both won one claim under eventual
    /// consistency, or a lost key was claimed afresh by a retry), so the
    /// payment was worked twice, each time under its own derived keys. Or
    /// two regions hold it under one fence (a fence granted twice: the key
    /// table went back to an older copy).
    WorkedTwice,
    /// A hold on a balance (a refund's on its payment) whose request is
    /// gone: held for nobody, it keeps its amount from every other request.
    OrphanedHold,
    /// A request this ledger finished has no hold on its balance: what the
    /// balance has left is overstated.
    HoldMissing,
}

impl Class {
    pub const ALL: [Class; 11] = [
        Class::PaymentMissing,
        Class::KeyNotFinished,
        Class::KeyMissing,
        Class::StaleInFlight,
        Class::UnknownOutcome,
        Class::FencedLeftover,
        Class::MovedInFlight,
        Class::AnswerMismatch,
        Class::WorkedTwice,
        Class::OrphanedHold,
        Class::HoldMissing,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Class::PaymentMissing => "payment_missing",
            Class::KeyNotFinished => "key_not_finished",
            Class::KeyMissing => "key_missing",
            Class::StaleInFlight => "stale_in_flight",
            Class::UnknownOutcome => "unknown_outcome",
            Class::FencedLeftover => "fenced_leftover",
            Class::MovedInFlight => "moved_in_flight",
            Class::AnswerMismatch => "answer_mismatch",
            Class::WorkedTwice => "worked_twice",
            Class::OrphanedHold => "orphaned_hold",
            Class::HoldMissing => "hold_missing",
        }
    }
}

/// When "late" begins.
#[derive(Debug, Clone, Copy)]
pub struct Thresholds {
    pub now: Millis,
    /// A lease over for longer than this means nobody is resuming.
    pub stale_after: Duration,
    /// An outcome unknown for longer than this needs settling.
    pub unknown_after: Duration,
    /// How long finished keys are kept, with the grace after it: past it, a
    /// key is meant to be gone.
    pub retention: Duration,
}

/// What a ledger request whose key is gone amounts to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Orphan {
    /// Voided here already: nothing to compare.
    Voided,
    /// Finished longer ago than the retention: its key expired, as keys
    /// are meant to. Counted, never repaired (a key is never resurrected).
    Expired,
    /// Its key should still be there.
    KeyMissing,
}

/// Compares a key item with this region's ledger view of it.
pub fn classify(key: &KeyItem, ledger: Option<&LedgerView>, region: &str, t: &Thresholds) -> Option<Class> {
    let finished_here = |l: &LedgerView| l.recovery_point == RecoveryPoint::FINISHED && l.payment_status.is_some();
    let leftover = ledger.filter(|l| l.recovery_point != RecoveryPoint::VOIDED);
    match key.state {
        // Finished elsewhere: what this ledger holds was superseded, unless
        // it was written under the key's own fence or a newer one (one fence
        // granted twice): then two regions hold the request.
        KeyState::Finished if key.home_region != region => leftover.map(|l| {
            if key.left.contains(region) || l.fence < key.fence { Class::FencedLeftover } else { Class::WorkedTwice }
        }),
        KeyState::Started if key.home_region != region => {
            leftover.filter(|_| key.left.contains(region)).map(|_| Class::MovedInFlight)
        }
        KeyState::Finished => match ledger {
            Some(l) if !finished_here(l) => Some(Class::PaymentMissing),
            None => Some(Class::PaymentMissing),
            Some(l) if l.answer != key.response => Some(Class::AnswerMismatch),
            Some(_) => None,
        },
        KeyState::Started => {
            let lease_over = key.lease_until.plus(t.stale_after) < t.now;
            let unknown_too_long = ledger.and_then(|l| l.unknown_since).is_some_and(|since| {
                let since_ms = since.unix_timestamp_nanos() / 1_000_000;
                since_ms + (t.unknown_after.as_millis() as i128) < i128::from(t.now.get())
            });
            match ledger {
                Some(l) if l.recovery_point == RecoveryPoint::FINISHED => lease_over.then_some(Class::KeyNotFinished),
                Some(_) if unknown_too_long => Some(Class::UnknownOutcome),
                _ => lease_over.then_some(Class::StaleInFlight),
            }
        }
    }
}

/// Whether `region` owned a request created at `since` throughout: the
/// registry records no change of the region from `margin` (the clock-skew
/// margin) before the request began, so no failover can have moved it and
/// no other region can have worked it. Only then may the reconciler put a
/// lost key back and resume the request here; otherwise its hand-off may
/// be lost with the key (a key table restored from a backup), and a person
/// must look before anything is settled again.
pub fn owned_throughout(registry: &Registry, region: &str, since: Millis, margin: Duration) -> bool {
    registry
        .regions
        .get(region)
        .is_none_or(|c| c.state == RegionState::Active && c.at.saturating_add(margin.as_millis() as u64) < since.get())
}

/// A ledger request whose key is gone (checked with a consistent read).
pub fn classify_orphan(ledger: &LedgerView, t: &Thresholds) -> Orphan {
    if ledger.recovery_point == RecoveryPoint::VOIDED {
        Orphan::Voided
    } else if ledger.recovery_point == RecoveryPoint::FINISHED && ledger.updated_at.plus(t.retention) < t.now {
        Orphan::Expired
    } else {
        Orphan::KeyMissing
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use time::OffsetDateTime;
    use uuid::Uuid;

    use super::*;
    use crate::domain::{ClientId, Fence, IdempotencyKey, Owner, RequestHash, ScopedKey, StoredResponse};
    use crate::ledger::RequestRecord;

    const NOW: u64 = 10_000_000;
    const T: Thresholds = Thresholds {
        now: Millis::new(NOW),
        stale_after: Duration::from_secs(30),
        unknown_after: Duration::from_secs(60),
        retention: Duration::from_secs(3600),
    };

    fn answer(body: &str) -> StoredResponse {
        StoredResponse { status: 201, headers: BTreeMap::new(), body: body.as_bytes().to_vec() }
    }

    fn key(state: KeyState, fence: u64, region: &str, lease_until: u64) -> KeyItem {
        KeyItem {
            key: ScopedKey::new(ClientId::generate(), IdempotencyKey::parse("k").unwrap()),
            request_hash: RequestHash::from_hex("h".into()),
            request: Vec::new(),
            operation: "payment".into(),
            state,
            fence: Fence::new(fence),
            lease_until: Millis::new(lease_until),
            owner: Owner::from_stored("o".into()),
            home_region: region.into(),
            created_at: Millis::new(1),
            payment_id: Uuid::nil(),
            response: (state == KeyState::Finished).then(|| answer("a")),
            expires_at: None,
            left: Default::default(),
        }
    }

    fn view(point: RecoveryPoint, fence: u64, answer_body: Option<&str>, unknown_since_ms: Option<u64>) -> LedgerView {
        LedgerView {
            record: RequestRecord {
                key: ScopedKey::new(ClientId::generate(), IdempotencyKey::parse("k").unwrap()),
                created_at: Millis::new(1),
                operation: "payment".into(),
                request_hash: RequestHash::from_hex("h".into()),
                payment_id: Uuid::nil(),
                request: Vec::new(),
            },
            fence: Fence::new(fence),
            recovery_point: point,
            answer: answer_body.map(answer),
            payment_status: Some("succeeded".into()),
            unknown_since: unknown_since_ms
                .map(|ms| OffsetDateTime::from_unix_timestamp_nanos(i128::from(ms) * 1_000_000).unwrap()),
            updated_at: Millis::new(NOW - 1000),
        }
    }

    #[test]
    fn finished_keys() {
        let done = key(KeyState::Finished, 2, "r", 0);
        let finished = view(RecoveryPoint::FINISHED, 2, Some("a"), None);
        assert_eq!(classify(&done, Some(&finished), "r", &T), None);
        assert_eq!(classify(&done, None, "r", &T), Some(Class::PaymentMissing));
        let behind = view(RecoveryPoint::named("EXT1_SENT"), 1, None, None);
        assert_eq!(classify(&done, Some(&behind), "r", &T), Some(Class::PaymentMissing));
        let mut no_payment = finished.clone();
        no_payment.payment_status = None;
        assert_eq!(classify(&done, Some(&no_payment), "r", &T), Some(Class::PaymentMissing));
        let other = view(RecoveryPoint::FINISHED, 2, Some("b"), None);
        assert_eq!(classify(&done, Some(&other), "r", &T), Some(Class::AnswerMismatch));
    }

    #[test]
    fn keys_finished_by_another_region() {
        let theirs = key(KeyState::Finished, 3, "elsewhere", 0);
        assert_eq!(classify(&theirs, None, "r", &T), None, "nothing here: nothing to void");
        let leftover = view(RecoveryPoint::named("EXT1_SENT"), 1, None, None);
        assert_eq!(classify(&theirs, Some(&leftover), "r", &T), Some(Class::FencedLeftover));
        let voided = view(RecoveryPoint::VOIDED, 3, None, None);
        assert_eq!(classify(&theirs, Some(&voided), "r", &T), None);
        let same_fence = view(RecoveryPoint::FINISHED, 3, Some("b"), None);
        assert_eq!(classify(&theirs, Some(&same_fence), "r", &T), Some(Class::WorkedTwice), "one fence, two homes");
        let mut moved = theirs.clone();
        moved.left.insert("r".into());
        assert_eq!(classify(&moved, Some(&same_fence), "r", &T), Some(Class::FencedLeftover), "it left this region");
    }

    #[test]
    fn keys_in_flight_in_another_region() {
        let leftover = view(RecoveryPoint::named("EXT2_SENT"), 1, None, None);
        let mut moved = key(KeyState::Started, 2, "elsewhere", NOW + 1000);
        assert_eq!(classify(&moved, Some(&leftover), "r", &T), None, "never here as far as the key says");
        moved.left.insert("r".into());
        assert_eq!(classify(&moved, Some(&leftover), "r", &T), Some(Class::MovedInFlight));
        assert_eq!(classify(&moved, None, "r", &T), None, "nothing here to void");
        let voided = view(RecoveryPoint::VOIDED, 2, None, None);
        assert_eq!(classify(&moved, Some(&voided), "r", &T), None);
    }

    #[test]
    fn a_region_owned_a_request_only_if_never_declared_since_it_began() {
        use crate::regions::Change;
        let change =
            |state, at| Change { region: "r".into(), state, epoch: 1, by: "sre".into(), at, reason: String::new() };
        let mut registry = Registry::default();
        let margin = Duration::from_secs(600);
        assert!(owned_throughout(&registry, "r", Millis::new(NOW), margin), "never declared");
        registry.regions.insert("r".into(), change(RegionState::Active, NOW - 700_000));
        assert!(owned_throughout(&registry, "r", Millis::new(NOW), margin), "restored long before it began");
        registry.regions.insert("r".into(), change(RegionState::Active, NOW - 500_000));
        assert!(!owned_throughout(&registry, "r", Millis::new(NOW), margin), "too close to tell, with skew");
        registry.regions.insert("r".into(), change(RegionState::Active, NOW + 1000));
        assert!(!owned_throughout(&registry, "r", Millis::new(NOW), margin), "failed and restored since");
        registry.regions.insert("r".into(), change(RegionState::Failed, NOW - 700_000));
        assert!(!owned_throughout(&registry, "r", Millis::new(NOW), margin), "failed now");
    }

    #[test]
    fn started_keys() {
        let fresh = key(KeyState::Started, 1, "r", NOW + 1000);
        let stale = key(KeyState::Started, 1, "r", NOW - 31_000);
        let barely = key(KeyState::Started, 1, "r", NOW - 1_000);
        let working = view(RecoveryPoint::named("H1_DONE"), 1, None, None);
        let finished = view(RecoveryPoint::FINISHED, 1, Some("a"), None);
        assert_eq!(classify(&fresh, Some(&working), "r", &T), None);
        assert_eq!(classify(&barely, Some(&working), "r", &T), None, "the worker gets its chance first");
        assert_eq!(classify(&stale, Some(&working), "r", &T), Some(Class::StaleInFlight));
        assert_eq!(classify(&stale, None, "r", &T), Some(Class::StaleInFlight));
        assert_eq!(classify(&stale, Some(&finished), "r", &T), Some(Class::KeyNotFinished));
        assert_eq!(classify(&fresh, Some(&finished), "r", &T), None, "its owner is about to finish it");
        let long_unknown = view(RecoveryPoint::named("EXT2_SENT"), 1, None, Some(NOW - 61_000));
        let short_unknown = view(RecoveryPoint::named("EXT2_SENT"), 1, None, Some(NOW - 1_000));
        assert_eq!(classify(&fresh, Some(&long_unknown), "r", &T), Some(Class::UnknownOutcome));
        assert_eq!(classify(&fresh, Some(&short_unknown), "r", &T), None);
    }

    #[test]
    fn orphans() {
        let finished = view(RecoveryPoint::FINISHED, 1, Some("a"), None);
        assert_eq!(classify_orphan(&finished, &T), Orphan::KeyMissing);
        assert_eq!(classify_orphan(&view(RecoveryPoint::VOIDED, 1, None, None), &T), Orphan::Voided);
        let long_ago = LedgerView { updated_at: Millis::new(NOW - 3_601_000), ..finished };
        assert_eq!(classify_orphan(&long_ago, &T), Orphan::Expired, "its key was meant to expire");
        let stuck = LedgerView { recovery_point: RecoveryPoint::named("EXT2_SENT"), ..long_ago };
        assert_eq!(classify_orphan(&stuck, &T), Orphan::KeyMissing, "an unfinished key never expires");
    }
}
