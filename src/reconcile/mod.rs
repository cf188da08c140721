//! The reconciler: compares the key store with one region's ledger and
//! repairs what disagrees, after a regional failover, a crash between the
//! two writes, or a restore of either store from a backup.
//!
//! It reads first the hand-offs of requests that were failed over away
//! from this region (each names a leftover here, whatever became of the
//! request elsewhere); then it scans the key table in parallel segments,
//! looks up each page of keys in the ledger with one query, and classifies
//! each request ([`classify`]); then it lists the ledger's requests in the
//! window and checks that each still has a key (one finished longer ago
//! than the retention has expired, as keys are meant to: counted, never
//! resurrected; one unfinished is put back only if this region owned it
//! throughout, never in another region's place).
//! With `repair` it fixes each finding through the fence protocol
//! ([`repair`]), so it is safe beside live traffic, the recovery worker and
//! another reconciler, and safe to run again after being killed halfway;
//! each repair is checked against the stores afterwards, and one that was
//! refused or did not take stays unresolved. Report-only runs change nothing.

mod classify;
mod holds;
mod repair;
mod report;

use std::collections::HashSet;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use futures::StreamExt;

use crate::domain::{Millis, RecoveryPoint};
use crate::engine::{Engine, EngineError};
use crate::keystore::{Handoff, KeyItem, KeyStore};
use crate::ledger::views::{LedgerView, RequestId};

pub use classify::{Class, Orphan, Thresholds, classify, classify_orphan, owned_throughout};
pub use report::{Answered, Finding, FrozenPayment, Repair, Report};

/// A finding with what both stores held, for its repair.
struct Found {
    finding: Finding,
    key: Option<KeyItem>,
    view: Option<LedgerView>,
    /// The hand-off that named the request, if one did.
    handoff: Option<Handoff>,
    /// Why the finding must not be repaired automatically, if it must not.
    hold: Option<String>,
    /// The balance's hold the finding is about, if it is about one.
    balance: Option<holds::HoldRef>,
}

impl Found {
    fn new(finding: Finding, key: Option<KeyItem>, view: Option<LedgerView>) -> Self {
        Self { finding, key, view, handoff: None, hold: None, balance: None }
    }
}

/// Repairs running at once.
const PARALLEL_REPAIRS: usize = 8;

#[derive(Debug, Clone)]
pub struct Options {
    /// Requests created in `[since, until)` are compared.
    pub since: Millis,
    pub until: Millis,
    /// Repair what is found (otherwise only report).
    pub repair: bool,
    /// A lease over for longer than this counts as nobody resuming.
    pub stale_after: Duration,
    /// An outcome unknown for longer than this counts as needing settlement.
    pub unknown_after: Duration,
    /// Parallel segments of the key-table scan.
    pub segments: u32,
}

/// Hooks for showing progress: keys scanned so far, then repairs.
pub trait Progress: Sync {
    fn scanned(&self, keys: usize);
    fn repairing(&self, total: usize);
    fn repaired(&self);
}

/// Compares, and repairs if asked; returns what was found and done.
///
/// First the hand-offs of requests that left this region: each names a
/// leftover here, voided whatever the request's state elsewhere (in
/// flight, finished or long expired), before anything else looks at it.
/// Then the key table, then the ledger's requests whose key is gone.
pub async fn run<K: KeyStore>(
    engine: &Engine<K>,
    options: &Options,
    progress: &impl Progress,
) -> Result<Report, EngineError> {
    let started = Instant::now();
    let retention = engine.retention();
    let thresholds = Thresholds {
        now: engine.clock().now(),
        stale_after: options.stale_after,
        unknown_after: options.unknown_after,
        retention: retention.keep + retention.grace,
    };
    let gone_before = retention.gone_before(thresholds.now);
    let registry = engine.regions().fresh().await?;
    let found: Mutex<Vec<Found>> = Mutex::default();
    let seen: Mutex<HashSet<RequestId>> = Mutex::default();
    let scanned = Mutex::new(0_usize);
    let balances: Mutex<Vec<(String, crate::keystore::Balance)>> = Mutex::default();
    // Time spent waiting on each store, summed over segments.
    let waited = Mutex::new((Duration::ZERO, Duration::ZERO));

    let (handed, cleared) = handoffs(engine, &found).await?;
    let handoffs = handed.len();
    let handed: HashSet<RequestId> = handed.into_iter().collect();

    let segments = (0..options.segments.max(1)).map(|segment| {
        let (found, seen, scanned, waited, handed, balances) = (&found, &seen, &scanned, &waited, &handed, &balances);
        async move {
            let mut cursor = None;
            loop {
                let asked = Instant::now();
                let page = engine.keys().scan(segment, options.segments.max(1), cursor).await?;
                lock(waited).0 += asked.elapsed();
                lock(balances).extend(page.balances);
                let (items, next) = (page.items, page.next);
                // An item past its retention is absent, whether or not the
                // store has reaped it yet.
                let items: Vec<KeyItem> = items
                    .into_iter()
                    .filter(|i| {
                        i.created_at >= options.since && i.created_at < options.until && !i.expired(gone_before)
                    })
                    .collect();
                let wanted: Vec<_> = items.iter().map(|i| (i.key.clone(), i.created_at)).collect();
                let asked = Instant::now();
                let views = engine.ledger().views(&wanted).await?;
                lock(waited).1 += asked.elapsed();
                for item in items {
                    let id = (item.key.partition_key(), item.created_at);
                    let view = views.get(&id).cloned();
                    let class = classify(&item, view.as_ref(), engine.region(), &thresholds);
                    if let Some(class) = class.filter(|_| !handed.contains(&id)) {
                        let mut finding =
                            Finding::new(class, &item.key, item.payment_id, evidence(&item, view.as_ref()));
                        if class == Class::WorkedTwice {
                            finding.answered =
                                Some(Answered { payment_id: item.payment_id, region: item.home_region.clone() });
                        }
                        lock(found).push(Found::new(finding, Some(item), view));
                    }
                    lock(seen).insert(id);
                }
                let total = {
                    let mut n = lock(scanned);
                    *n += wanted.len();
                    *n
                };
                progress.scanned(total);
                match next {
                    Some(next) => cursor = Some(next),
                    None => return Ok::<(), EngineError>(()),
                }
            }
        }
    });
    for result in futures::future::join_all(segments).await {
        result?;
    }

    // Holds whose request is gone, and finished requests without a hold.
    let balances = balances.into_inner().unwrap_or_else(|p| p.into_inner());
    let orphaned = holds::orphaned(engine, &balances, &thresholds).await?;
    let frozen_payments = holds::frozen(&balances);
    lock(&found).extend(orphaned);
    let by_name: std::collections::HashMap<&str, &crate::keystore::Balance> =
        balances.iter().map(|(name, balance)| (name.as_str(), balance)).collect();

    // Ledger requests whose key is gone. The scan is not a snapshot, so a
    // key is declared gone only after a consistent read finds no live item
    // for this very request (a key reused after its retention is another).
    let seen = seen.into_inner().unwrap_or_else(|p| p.into_inner());
    let (mut ledger_rows_scanned, mut expired) = (0, 0);
    let mut rows = std::pin::pin!(engine.ledger().requests_between(options.since, options.until));
    let mut asked = Instant::now();
    while let Some(view) = rows.next().await {
        lock(&waited).1 += asked.elapsed();
        let view = view?;
        ledger_rows_scanned += 1;
        let id = (view.record.key.partition_key(), view.record.created_at);
        if let Some(finding) = holds::missing(&view, &by_name) {
            lock(&found).push(Found::new(finding, None, Some(view.clone())));
        }
        let orphan = !seen.contains(&id) && !handed.contains(&id);
        let kind = classify_orphan(&view, &thresholds);
        if orphan && kind != Orphan::Voided {
            let ours = format!("ledger at {} under fence {}", view.recovery_point, view.fence);
            match engine.keys().get(&view.record.key).await?.filter(|i| !i.expired(gone_before)) {
                Some(item) if item.created_at == view.record.created_at => {}
                _ if kind == Orphan::Expired => expired += 1,
                Some(item) => {
                    let evidence = format!(
                        "{ours}; the key names another request (payment {}, home {}, {})",
                        item.payment_id,
                        item.home_region,
                        item.state.as_str()
                    );
                    let mut finding =
                        Finding::new(Class::WorkedTwice, &view.record.key, view.record.payment_id, evidence);
                    finding.answered = Some(Answered { payment_id: item.payment_id, region: item.home_region });
                    lock(&found).push(Found::new(finding, None, Some(view)));
                }
                None => {
                    let owned = owned_throughout(&registry, engine.region(), view.record.created_at, retention.grace);
                    let evidence = if owned {
                        format!("{ours}; no key item")
                    } else {
                        format!(
                            "{ours}; no key item, and this region was declared failed or restored since the request began"
                        )
                    };
                    let finding = Finding::new(Class::KeyMissing, &view.record.key, view.record.payment_id, evidence);
                    let mut found_one = Found::new(finding, None, Some(view));
                    found_one.hold = (!owned).then(|| {
                        "not repaired: another region may have taken it over while this one was declared failed, \
                         and no hand-off says so (a key table restored from a backup loses them); never re-homed: \
                         look the payment up in every region's ledger, and probe the rails by its derived keys, \
                         before settling anything"
                            .to_owned()
                    });
                    lock(&found).push(found_one);
                }
            }
        }
        asked = Instant::now();
    }

    let mut found = found.into_inner().unwrap_or_else(|p| p.into_inner());
    found.sort_by(|a, b| {
        let (a, b) = (&a.finding, &b.finding);
        (a.class, &a.client_id, &a.key).cmp(&(b.class, &b.client_id, &b.key))
    });
    let mut handoffs_cleared = 0;
    if options.repair {
        progress.repairing(found.len());
        futures::stream::iter(found.iter_mut())
            .for_each_concurrent(PARALLEL_REPAIRS, |found| async move {
                found.finding.repair = Some(match repair::repair(engine, found).await {
                    Ok(done) => done,
                    Err(e) => Repair { resolved: false, action: format!("repair failed: {e}") },
                });
                progress.repaired();
            })
            .await;
        for (handoff, absent) in &cleared {
            // Never here: a voided row stops an old owner that wakes later.
            let voided = !absent
                || engine
                    .ledger()
                    .void_absent(&handoff.key, handoff.created_at, handoff.payment_id, handoff.fence)
                    .await?;
            if voided {
                engine.keys().forget_handoff(handoff).await?;
                handoffs_cleared += 1;
            }
        }
        handoffs_cleared += found
            .iter()
            .filter(|f| f.handoff.is_some() && f.finding.repair.as_ref().is_some_and(|r| r.resolved))
            .count();
    }
    let (key_store_seconds, ledger_seconds) = waited.into_inner().unwrap_or_else(|p| p.into_inner());
    Ok(Report {
        key_store_seconds: key_store_seconds.as_secs_f64(),
        ledger_seconds: ledger_seconds.as_secs_f64(),
        region: engine.region().to_owned(),
        repair: options.repair,
        keys_scanned: scanned.into_inner().unwrap_or_else(|p| p.into_inner()),
        ledger_rows_scanned,
        expired,
        handoffs,
        handoffs_cleared,
        findings: found.into_iter().map(|f| f.finding).collect(),
        indeterminate: engine.ledger().indeterminate().await?,
        unmatched_notifications: engine.ledger().unmatched().await?,
        notifications_to_hand_on: engine.ledger().waiting_to_hand_on().await?,
        frozen_payments,
        seconds: started.elapsed().as_secs_f64(),
    })
}

/// Reads every hand-off of a request that left this region; each one whose
/// leftover is still here becomes a `moved_in_flight` finding. Returns the
/// requests they name, and the hand-offs with nothing left here to void
/// (true: the request has no row here at all).
async fn handoffs<K: KeyStore>(
    engine: &Engine<K>,
    found: &Mutex<Vec<Found>>,
) -> Result<(Vec<RequestId>, Vec<(Handoff, bool)>), EngineError> {
    let all = engine.keys().all_handoffs(engine.region()).await?;
    let mut named = Vec::new();
    let mut cleared = Vec::new();
    for page in all.chunks(100) {
        let wanted: Vec<_> = page.iter().map(|h| (h.key.clone(), h.created_at)).collect();
        let views = engine.ledger().views(&wanted).await?;
        for handoff in page {
            let id = (handoff.key.partition_key(), handoff.created_at);
            let view = views.get(&id);
            match view.filter(|v| v.recovery_point != RecoveryPoint::VOIDED) {
                Some(view) => {
                    let evidence = format!(
                        "failed over to {} under fence {} (hand-off); this ledger at {} under fence {}, payment {}",
                        handoff.to,
                        handoff.fence,
                        view.recovery_point,
                        view.fence,
                        view.payment_status.as_deref().unwrap_or("missing"),
                    );
                    let finding = Finding::new(Class::MovedInFlight, &handoff.key, handoff.payment_id, evidence);
                    let mut one = Found::new(finding, None, Some(view.clone()));
                    one.handoff = Some(handoff.clone());
                    lock(found).push(one);
                }
                None => cleared.push((handoff.clone(), view.is_none())),
            }
            named.push(id);
        }
    }
    Ok((named, cleared))
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// What each store said, for the report.
fn evidence(key: &KeyItem, ledger: Option<&LedgerView>) -> String {
    let key_side = format!(
        "key {} under fence {} (home {}, lease until {})",
        key.state.as_str(),
        key.fence,
        key.home_region,
        key.lease_until.get()
    );
    match ledger {
        None => format!("{key_side}; no request in this ledger"),
        Some(l) => format!(
            "{key_side}; ledger at {} under fence {}, payment {}{}",
            l.recovery_point,
            l.fence,
            l.payment_status.as_deref().unwrap_or("missing"),
            if l.unknown_since.is_some() { ", an external outcome unknown" } else { "" }
        ),
    }
}
