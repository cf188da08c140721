//! Metrics, beside telemetry: counters and latency histograms through the
//! `metrics` facade, rendered in the Prometheus text format at `/metrics` on
//! the admin listener (with the process's CPU and memory). Labels take only values from small
//! fixed sets (routes, answer classes, operations, recovery points, rails),
//! never a key, a client or an account.
//!
//! | metric | labels | what |
//! | --- | --- | --- |
//! | `keyfence_http_requests_total` | `route`, `answer` | answers by class: `created`, `replayed`, `ok`, `pending`, `declined`, `in_flight`, `mismatch`, `throttled`, `client_error`, `unavailable`, `server_error` |
//! | `keyfence_limiter_decisions_total` | `limiter`, `decision` | each fair-use decision (`rate`, `in_flight`, `tasks`): `allowed` or `refused` |
//! | `keyfence_throttled_total` | `reason` | requests turned away: `rate` and `in_flight` (429), `tasks` (503) |
//! | `keyfence_payment_tasks_in_flight` | | payment tasks running now (a gauge) |
//! | `keyfence_connections_refused_total` | `reason` | connections closed unanswered: `per_address` |
//! | `keyfence_registry_reads_total` | | reads of the region registry |
//! | `keyfence_client_lookups_total` | `outcome` | reads of the client directory: `found` or `unknown` (a key never looked up, or not for `CACHE_FOR`; malformed keys are refused unread) |
//! | `keyfence_claims_total` | `outcome` | `won` (a new request) or `existing` (the key was there) |
//! | `keyfence_takeovers_total` | `by` | `retry`, `worker` (recovery worker and reconciler), `failover` |
//! | `keyfence_fenced_out_total` | `store` | an owner refused by the `key_store` or the `ledger` |
//! | `keyfence_hand_backs_total` | `how` | `forget` or `reopen` |
//! | `keyfence_unknown_outcomes_total`, `keyfence_indeterminate_total` | `step` | external outcomes unknown; marked indeterminate |
//! | `keyfence_declines_total` | `step` | declined by screening (`ext1`) or the rail (`ext2`) |
//! | `keyfence_recovery_sweeps_total`, `keyfence_recovery_outcomes_total` | `outcome` | sweeps, and what became of each key found |
//! | `keyfence_key_store_seconds` | `op` | latency of each key-store operation |
//! | `keyfence_ledger_phase_seconds` | `to` | latency of each ledger phase, by the recovery point it reaches |
//! | `keyfence_rail_seconds` | `rail`, `call` | latency of each call to a rail (`send`, `probe`) |
//! | `process_cpu_seconds_total`, `process_resident_memory_bytes`, ... | | the process |

use std::sync::OnceLock;
use std::time::Instant;

use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

/// Latency buckets, in seconds: from a fast key-store call to a slow rail.
const BUCKETS: [f64; 14] = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0];

static HANDLE: OnceLock<Option<PrometheusHandle>> = OnceLock::new();

/// Installs the process's recorder (once; later calls reuse it).
pub fn install() {
    HANDLE.get_or_init(|| {
        let recorder = PrometheusBuilder::new()
            .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), &BUCKETS)
            .and_then(|builder| builder.install_recorder());
        match recorder {
            Ok(handle) => {
                metrics_process::Collector::default().describe();
                Some(handle)
            }
            Err(e) => {
                tracing::warn!(error = %e, "metrics are off: another recorder is installed");
                None
            }
        }
    });
}

/// Everything recorded so far, in the Prometheus text format.
pub fn render() -> String {
    match HANDLE.get().and_then(Option::as_ref) {
        Some(handle) => {
            metrics_process::Collector::default().collect();
            handle.render()
        }
        None => String::new(),
    }
}

/// Records, when dropped, how long since it was made, in histogram `name`.
pub struct Timer {
    name: &'static str,
    labels: Vec<::metrics::Label>,
    started: Instant,
}

impl Timer {
    pub fn start(name: &'static str, labels: &[(&'static str, &str)]) -> Self {
        let labels = labels.iter().map(|(k, v)| ::metrics::Label::new(*k, (*v).to_owned())).collect();
        Self { name, labels, started: Instant::now() }
    }
}

impl Drop for Timer {
    fn drop(&mut self) {
        ::metrics::histogram!(self.name, std::mem::take(&mut self.labels)).record(self.started.elapsed().as_secs_f64());
    }
}
