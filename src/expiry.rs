//! The expiry sweeper: deletes finished key items past their retention.
//! DynamoDB's own time-to-live does this on ordinary tables, lazily; a
//! global table with multi-Region strong consistency has none, so keyfence
//! expires keys itself: `keyfence maintain --expire`, or inside `serve` on
//! an interval, where one instance at a time sweeps (the one leading the
//! job, [`Leader`]: the table is global, and one sweep covers it). Claims already treat an item past `expires_at` as absent,
//! so the sweeper only reclaims space; it is safe beside traffic because
//! each delete is conditioned on the item still being finished and expired
//! (an item claimed again meanwhile is a new request, and is left alone),
//! and it is rate-limited so it never crowds out claims.

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;
use tokio::sync::{Mutex, watch};
use tokio::time::{Interval, MissedTickBehavior};

use crate::domain::Millis;
use crate::engine::Engine;
use crate::keystore::{KeyStore, Leader};

#[derive(Debug, Clone, Copy)]
pub struct Options {
    /// Parallel segments of the table scan.
    pub segments: u32,
    /// Deletes per second at most.
    pub rate: u32,
    /// A key is deleted only a grace after its retention ends on this
    /// clock, so a clock running ahead cannot cut the retention short.
    pub grace: Duration,
}

/// What one sweep did.
#[derive(Debug, Default, Clone, Serialize)]
pub struct Report {
    pub keys_scanned: usize,
    /// Finished items found past their retention.
    pub expired: usize,
    pub deleted: usize,
    /// Expired when scanned, changed before the delete (claimed again): left alone.
    pub changed_meanwhile: usize,
    pub failures: Vec<String>,
    pub seconds: f64,
}

impl Report {
    pub fn summary(&self) -> String {
        let mut out = format!(
            "{} keys scanned in {:.1} s: {} past retention, {} deleted, {} changed meanwhile (left alone)\n",
            self.keys_scanned, self.seconds, self.expired, self.deleted, self.changed_meanwhile
        );
        for failure in &self.failures {
            out += &format!("  failed: {failure}\n");
        }
        out
    }
}

/// Progress of a sweep: keys scanned so far, deletes so far.
pub trait Progress: Sync {
    fn scanned(&self, keys: usize);
    fn deleted(&self, keys: usize);
}

/// Sweeps the whole table once, as of `now`.
pub async fn sweep<K: KeyStore>(keys: &K, now: Millis, options: Options, progress: &impl Progress) -> Report {
    let started = Instant::now();
    let gone_before = now.minus(options.grace);
    let mut pace = tokio::time::interval(Duration::from_secs(1) / options.rate.max(1));
    pace.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let pace: Arc<Mutex<Interval>> = Arc::new(Mutex::new(pace));
    let report = Arc::new(std::sync::Mutex::new(Report::default()));
    let segments = options.segments.max(1);
    let work = (0..segments).map(|segment| {
        let (pace, report) = (pace.clone(), report.clone());
        async move {
            let mut cursor = None;
            loop {
                let (items, next) = match keys.scan(segment, segments, cursor).await {
                    Ok(page) => (page.items, page.next),
                    Err(e) => {
                        lock(&report).failures.push(format!("scanning segment {segment}: {e}"));
                        return;
                    }
                };
                let scanned = {
                    let mut r = lock(&report);
                    r.keys_scanned += items.len();
                    r.keys_scanned
                };
                progress.scanned(scanned);
                for item in items.into_iter().filter(|item| item.expired(gone_before)) {
                    lock(&report).expired += 1;
                    pace.lock().await.tick().await;
                    let deleted = keys.delete_expired(&item.key, gone_before).await;
                    let mut r = lock(&report);
                    match deleted {
                        Ok(true) => {
                            r.deleted += 1;
                            progress.deleted(r.deleted);
                        }
                        Ok(false) => r.changed_meanwhile += 1,
                        Err(e) => r.failures.push(format!("{}: {e}", item.key)),
                    }
                }
                match next {
                    Some(next) => cursor = Some(next),
                    None => return,
                }
            }
        }
    });
    futures::future::join_all(work).await;
    let mut report = lock(&report).clone();
    report.seconds = started.elapsed().as_secs_f64();
    report
}

/// Sweeps every `interval` until `stop`'s sender is dropped.
pub async fn run_until_stopped<K: KeyStore + 'static>(
    engine: Arc<Engine<K>>,
    interval: Duration,
    options: Options,
    leader: Leader,
    mut stop: watch::Receiver<()>,
) {
    let term = leader_term(interval);
    loop {
        tokio::select! {
            _ = stop.changed() => return,
            () = tokio::time::sleep(interval) => {}
        }
        match leader.lead(engine.clock().now(), term).await {
            Ok(true) => {}
            Ok(false) => {
                metrics::counter!("keyfence_expiry_sweeps_total", "outcome" => "led_elsewhere").increment(1);
                continue;
            }
            Err(e) => {
                tracing::warn!(error = %e, "could not take the expiry sweep's lease; no sweep this round");
                metrics::counter!("keyfence_expiry_sweeps_total", "outcome" => "failed").increment(1);
                continue;
            }
        }
        // The lease is renewed while the sweep runs; lost, the sweep stops.
        let swept = tokio::select! {
            report = sweep(engine.keys(), engine.clock().now(), options, &Silent) => Some(report),
            () = keep_leading(&engine, &leader, interval, term) => None,
        };
        let Some(report) = swept else {
            tracing::warn!("the expiry sweep's lease was lost or could not be renewed; the sweep stopped");
            metrics::counter!("keyfence_expiry_sweeps_total", "outcome" => "failed").increment(1);
            continue;
        };
        let outcome = if report.failures.is_empty() { "swept" } else { "failed" };
        metrics::counter!("keyfence_expiry_sweeps_total", "outcome" => outcome).increment(1);
        metrics::counter!("keyfence_expiry_deleted_total").increment(report.deleted as u64);
        if report.failures.is_empty() {
            metrics::gauge!("keyfence_expiry_last_sweep_timestamp_seconds").set(engine.clock().now().as_secs() as f64);
        }
        if report.deleted > 0 || !report.failures.is_empty() {
            tracing::info!(deleted = report.deleted, failures = report.failures.len(), "expiry sweep");
        }
    }
}

/// Renews the lease every `interval` while a sweep runs; returns once it
/// is lost (or cannot be renewed).
async fn keep_leading<K: KeyStore>(engine: &Engine<K>, leader: &Leader, interval: Duration, term: Duration) {
    loop {
        tokio::time::sleep(interval).await;
        if !matches!(leader.lead(engine.clock().now(), term).await, Ok(true)) {
            return;
        }
    }
}

/// How long one lead of the sweep lasts: three rounds, and at least
/// [`LEADER_TERM_LEAST`], so a leader busy with a long sweep keeps it.
pub fn leader_term(interval: Duration) -> Duration {
    (interval * 3).max(LEADER_TERM_LEAST)
}

/// The shortest lead of the sweep.
pub const LEADER_TERM_LEAST: Duration = Duration::from_secs(30);

struct Silent;

impl Progress for Silent {
    fn scanned(&self, _: usize) {}
    fn deleted(&self, _: usize) {}
}

fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
