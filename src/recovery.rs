//! The recovery worker: finds in-flight requests whose lease has run out
//! (through the sparse in-flight index, shard by shard), and every in-flight
//! request of a region declared failed, and resumes each from its recovery
//! point through the engine's takeover, so it is safe beside client retries
//! and other workers. It runs inside `keyfence serve`
//! on an interval and once, for operators, as `keyfence recover`.
//! The worker leaves a parked request (handed back after an unknown
//! external outcome) alone until its next probe is due (an exponential
//! back-off, `KEYFENCE_PROBE_BACKOFF_MS` doubled per unknown outcome up to
//! `KEYFENCE_PROBE_BACKOFF_MAX_MS`), and resumes at most [`BATCH`] requests
//! a sweep: requests whose owner died first, oldest lease first, then keys
//! handed back, in a fresh order each sweep. A flood of parked requests
//! neither takes every sweep nor delays a request whose owner died, and no
//! key waits behind the same others for ever. `keyfence recover` takes
//! everything stale at once. Requests still unknown after the configured
//! attempts are listed as indeterminate for settlement (and still probed).

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use serde::Serialize;
use tokio::sync::watch;

use crate::domain::Millis;
use crate::engine::{Answer, Engine, EngineError, Recovery};
use crate::keystore::{INFLIGHT_SHARDS, KeyStore, StaleKey};
use crate::ledger::external::Indeterminate;
use crate::operations::Registered;

/// Requests resumed at once by one sweep.
const PARALLEL: usize = 8;

/// Requests one sweep of the worker resumes at most; the rest wait for the next.
pub const BATCH: usize = 64;

/// How much one sweep takes on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scope {
    /// The worker inside `serve`: parked requests wait out their back-off,
    /// and at most [`BATCH`] are resumed.
    Worker,
    /// An operator's `keyfence recover`: every stale request, now.
    Everything,
}

/// What one sweep did.
#[derive(Debug, Default, Clone, Serialize)]
pub struct SweepReport {
    /// Stale in-flight keys found in the index.
    pub found: usize,
    /// Of them, parked until a probe that is not due yet: left alone.
    pub waiting: usize,
    /// Of them, over this sweep's batch: left for the next sweep.
    pub deferred: usize,
    /// Resumed to their final answer.
    pub finished: usize,
    /// Resumed, then parked again: an external outcome is still unknown.
    pub pending: usize,
    /// Taken by someone else first (a retry, another worker) or already moved on.
    pub lost: usize,
    /// Homed in another region: left alone.
    pub other_region: usize,
    /// Given up: a hold that no longer fits its balance (nothing of the
    /// request was held or committed).
    pub given_up: usize,
    /// Keys that could not be resumed, with why (they will be tried again).
    pub failed: Vec<Failure>,
    /// External calls whose outcome stays unknown, for settlement.
    pub indeterminate: Vec<Indeterminate>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Failure {
    pub key: String,
    pub error: String,
}

/// Finds every stale key (and every in-flight key of a region declared
/// failed) and resumes those `scope` takes on; `tick` is called once per
/// key handled.
pub async fn sweep<K: KeyStore>(
    engine: &Engine<K>,
    scope: Scope,
    on_found: impl FnOnce(usize),
    tick: impl Fn(),
) -> SweepReport {
    let mut report = SweepReport::default();
    let now = engine.clock().now();
    let failed: HashSet<String> = match engine.regions().fresh().await {
        Ok(registry) if registry.is_failed(engine.region()) => {
            report
                .failed
                .push(Failure { key: "(this region)".into(), error: "declared failed: sweeping nothing".into() });
            report.count(None);
            return report;
        }
        Ok(registry) => registry.failed_except(engine.region()).map(str::to_owned).collect(),
        Err(e) => {
            report.failed.push(Failure { key: "(region registry)".into(), error: e.to_string() });
            HashSet::new()
        }
    };
    // A failed region's requests are taken over whatever their lease.
    let before = if failed.is_empty() { now } else { Millis::new(u64::MAX) };
    let mut stale: Vec<StaleKey> = Vec::new();
    for shard in 0..INFLIGHT_SHARDS {
        match engine.keys().stale_in_flight(shard, before).await {
            Ok(found) => {
                stale.extend(found.into_iter().filter(|s| s.lease_until < now || failed.contains(&s.home_region)))
            }
            Err(e) => report.failed.push(Failure { key: format!("(shard {shard})"), error: e.to_string() }),
        }
    }
    report.found = stale.len();
    // Requests of a region not declared failed are that region's to resume.
    stale.retain(|s| s.home_region == engine.region() || failed.contains(&s.home_region));
    report.other_region = report.found - stale.len();
    if scope == Scope::Worker {
        report.waiting = leave_parked(engine, &mut stale, &mut report.failed).await;
        // Owners that died (a lease that ran out) first, oldest first; then
        // keys handed back (lease 0), shuffled so none waits behind the same others.
        let (mut died, mut handed_back): (Vec<_>, Vec<_>) = stale.into_iter().partition(|s| s.lease_until.get() > 0);
        died.sort_by_key(|s| s.lease_until);
        fastrand::shuffle(&mut handed_back);
        stale = died.into_iter().chain(handed_back).collect();
        report.deferred = stale.len().saturating_sub(BATCH);
        stale.truncate(BATCH);
    }
    on_found(stale.len());
    let outcomes: Vec<_> = futures::stream::iter(stale)
        .map(|s| async move {
            let outcome = engine.recover(&s, Registered::decode).await;
            (s, outcome)
        })
        .buffer_unordered(PARALLEL)
        .inspect(|_| tick())
        .collect()
        .await;
    for (stale, outcome) in outcomes {
        let counted = match outcome {
            Ok(Recovery::Resumed(Answer::Final { .. })) => {
                report.finished += 1;
                "finished"
            }
            Ok(Recovery::Resumed(Answer::Pending { .. })) => {
                report.pending += 1;
                "pending"
            }
            Ok(Recovery::Resumed(Answer::InFlight { .. } | Answer::Mismatch) | Recovery::Lost)
            | Err(EngineError::FencedOut(_)) => {
                report.lost += 1;
                "lost"
            }
            // Its first owner died before its hold was taken, and the
            // balance has no room left: given up, as its client was told.
            Ok(Recovery::Resumed(Answer::Exceeded { .. })) => {
                report.given_up += 1;
                "given_up"
            }
            Ok(Recovery::NotHome) => {
                report.other_region += 1;
                "other_region"
            }
            Err(e) => {
                report.failed.push(Failure { key: stale.key.to_string(), error: e.to_string() });
                "failed"
            }
        };
        metrics::counter!("keyfence_recovery_outcomes_total", "outcome" => counted).increment(1);
    }
    let listed = match engine.ledger().indeterminate().await {
        Ok(list) => {
            report.indeterminate = list;
            Some(now)
        }
        Err(e) => {
            report.failed.push(Failure { key: "(indeterminate list)".into(), error: e.to_string() });
            None
        }
    };
    report.count(listed);
    report
}

/// Leaves out of `stale` the keys handed back after an unknown outcome
/// whose next probe is not due yet; returns how many. A key taken over
/// since it was parked (its lease no longer 0) is not left: its owner may
/// have died with it.
async fn leave_parked<K: KeyStore>(engine: &Engine<K>, stale: &mut Vec<StaleKey>, failed: &mut Vec<Failure>) -> usize {
    let parked: Vec<_> = stale
        .iter()
        .filter(|s| s.lease_until.get() == 0 && s.home_region == engine.region())
        .map(|s| (s.key.client.as_uuid(), s.key.key.as_str().to_owned(), s.created_at))
        .collect();
    match engine.ledger().parked_until_later(&parked).await {
        Ok(later) => {
            let before = stale.len();
            stale.retain(|s| {
                s.lease_until.get() != 0 || !later.contains(&(s.key.client.as_uuid(), s.key.key.as_str().to_owned()))
            });
            before - stale.len()
        }
        // Without the back-off's word, every stale key is due (as before it existed).
        Err(e) => {
            failed.push(Failure { key: "(parked requests)".into(), error: e.to_string() });
            0
        }
    }
}

/// Sweeps every `interval` until `stop`'s sender is dropped.
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
        let report = sweep(&engine, Scope::Worker, |_| {}, || {}).await;
        if report.found > report.waiting || !report.failed.is_empty() {
            tracing::info!(
                found = report.found,
                waiting = report.waiting,
                deferred = report.deferred,
                finished = report.finished,
                pending = report.pending,
                lost = report.lost,
                failed = report.failed.len(),
                indeterminate = report.indeterminate.len(),
                "recovery sweep"
            );
        }
    }
}

impl SweepReport {
    /// Counts the sweep, and sets the gauges of what waits for settlement
    /// from the list read at `listed` (if it could be read: else they keep
    /// their last values rather than claim nothing waits).
    fn count(&self, listed: Option<Millis>) {
        let outcome = if self.failed.is_empty() { "completed" } else { "failed" };
        metrics::counter!("keyfence_recovery_sweeps_total", "outcome" => outcome).increment(1);
        let Some(now) = listed else { return };
        metrics::gauge!("keyfence_indeterminate_requests").set(self.indeterminate.len() as f64);
        let oldest = self.indeterminate.iter().map(|i| i.created_at).min();
        let age = oldest.map_or(0.0, |since| (crate::ledger::timestamp(now) - since).as_seconds_f64().max(0.0));
        metrics::gauge!("keyfence_indeterminate_oldest_seconds").set(age);
    }

    /// A summary for people.
    pub fn summary(&self) -> String {
        let rows = [
            ("finished", self.finished),
            ("still pending", self.pending),
            ("taken by others", self.lost),
            ("other region", self.other_region),
            ("given up", self.given_up),
            ("failed", self.failed.len()),
        ];
        let mut out = format!("stale in-flight keys found: {}\n", self.found);
        out += &format!("  {:<16} {}\n", "parked, not due", self.waiting);
        out += &format!("  {:<16} {}\n", "next sweep", self.deferred);
        for (label, count) in rows {
            out += &format!("  {label:<16} {count}\n");
        }
        for f in &self.failed {
            out += &format!("    {}: {}\n", f.key, f.error);
        }
        out += &format!("indeterminate, for settlement: {}\n", self.indeterminate.len());
        for i in &self.indeterminate {
            out += &format!(
                "    client {} key {} payment {} step {} (derived key {}, {} attempts, last {})\n",
                i.client_id, i.idem_key, i.payment_id, i.step, i.derived_key, i.attempts, i.last_attempt_at
            );
        }
        out
    }
}
