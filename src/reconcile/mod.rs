//! The reconciler: compares the key store with one region's ledger and
//! repairs what disagrees, after a regional failover, a crash between the
//! two writes, or a restore of either store from a backup.
//!
//! It scans the key table in parallel segments, looks up each page of keys
//! in the ledger with one query, and classifies each request
//! ([`classify`]); then it lists the ledger's requests in the window and
//! checks that each still has a key (one finished longer ago than the
//! retention has expired, as keys are meant to: counted, never resurrected).
//! With `repair` it fixes each finding through the fence protocol
//! ([`repair`]), so it is safe beside live traffic, the recovery worker and
//! another reconciler, and safe to run again after being killed halfway;
//! each repair is checked against the stores afterwards, and one that was
//! refused or did not take stays unresolved. Report-only runs change nothing.

mod classify;
mod repair;
mod report;

use std::collections::HashSet;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use futures::StreamExt;

use crate::domain::Millis;
use crate::engine::{Engine, EngineError};
use crate::keystore::{KeyItem, KeyStore};
use crate::ledger::views::{LedgerView, RequestId};

pub use classify::{Class, Orphan, Thresholds, classify, classify_orphan};
pub use repair::Repair;
pub use report::{Finding, Report};

/// A finding with what both stores held, for its repair.
type Found = (Finding, Option<KeyItem>, Option<LedgerView>);

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
pub async fn run<K: KeyStore>(
    engine: &Engine<K>,
    options: &Options,
    progress: &impl Progress,
) -> Result<Report, EngineError> {
    let started = Instant::now();
    let thresholds = Thresholds {
        now: Millis::now(),
        stale_after: options.stale_after,
        unknown_after: options.unknown_after,
        retention: engine.retention().keep + engine.retention().grace,
    };
    let gone_before = engine.retention().gone_before(thresholds.now);
    let found: Mutex<Vec<Found>> = Mutex::default();
    let seen: Mutex<HashSet<RequestId>> = Mutex::default();
    let scanned = Mutex::new(0_usize);
    // Time spent waiting on each store, summed over segments.
    let waited = Mutex::new((Duration::ZERO, Duration::ZERO));

    let segments = (0..options.segments.max(1)).map(|segment| {
        let (found, seen, scanned, waited) = (&found, &seen, &scanned, &waited);
        async move {
            let mut cursor = None;
            loop {
                let asked = Instant::now();
                let (items, next) = engine.keys().scan(segment, options.segments.max(1), cursor).await?;
                lock(waited).0 += asked.elapsed();
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
                    if let Some(class) = classify(&item, view.as_ref(), engine.region(), &thresholds) {
                        let finding = Finding::new(class, &item.key, item.payment_id, evidence(&item, view.as_ref()));
                        lock(found).push((finding, Some(item), view));
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
        let orphan = !seen.contains(&(view.record.key.partition_key(), view.record.created_at));
        let kind = classify_orphan(&view, &thresholds);
        if orphan && kind != Orphan::Voided {
            let ours = format!("ledger at {} under fence {}", view.recovery_point, view.fence);
            let (class, evidence) = match engine.keys().get(&view.record.key).await?.filter(|i| !i.expired(gone_before))
            {
                Some(item) if item.created_at == view.record.created_at => (None, String::new()),
                _ if kind == Orphan::Expired => {
                    expired += 1;
                    (None, String::new())
                }
                Some(item) => (
                    Some(Class::WorkedTwice),
                    format!(
                        "{ours}; the key names another request (payment {}, home {}, {})",
                        item.payment_id,
                        item.home_region,
                        item.state.as_str()
                    ),
                ),
                None => (Some(Class::KeyMissing), format!("{ours}; no key item")),
            };
            if let Some(class) = class {
                let finding = Finding::new(class, &view.record.key, view.record.payment_id, evidence);
                lock(&found).push((finding, None, Some(view)));
            }
        }
        asked = Instant::now();
    }

    let mut found = found.into_inner().unwrap_or_else(|p| p.into_inner());
    found.sort_by(|a, b| (a.0.class, &a.0.client_id, &a.0.key).cmp(&(b.0.class, &b.0.client_id, &b.0.key)));
    if options.repair {
        progress.repairing(found.len());
        let repaired: Vec<_> = futures::stream::iter(found.iter_mut())
            .map(|(finding, key, view)| async move {
                finding.repair = Some(match repair::repair(engine, finding.class, key.as_ref(), view.as_ref()).await {
                    Ok(done) => done,
                    Err(e) => Repair { resolved: false, action: format!("repair failed: {e}") },
                });
                progress.repaired();
            })
            .buffer_unordered(PARALLEL_REPAIRS)
            .collect()
            .await;
        drop(repaired);
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
        findings: found.into_iter().map(|(finding, _, _)| finding).collect(),
        indeterminate: engine.ledger().indeterminate().await?,
        seconds: started.elapsed().as_secs_f64(),
    })
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
