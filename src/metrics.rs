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
//! | `keyfence_connections_dropped_total` | `reason` | connections cut off: `write_stall` (the peer read nothing), `drain` (told to close, still busy) |
//! | `keyfence_registry_reads_total` | | reads of the region registry |
//! | `keyfence_client_lookups_total` | `outcome` | keys this instance's directory did not hold when presented, looked up again after the next read of the change log: `found` (made a moment ago), `unknown` (refused), `deferred` (no read in time: 503) |
//! | `keyfence_client_directory_reads_total` | `outcome` | rounds of reading the client directory's change log (and what changed), once a second: `ok` or `failed` |
//! | `keyfence_claims_total` | `outcome` | `won` (a new request) or `existing` (the key was there) |
//! | `keyfence_takeovers_total` | `by` | `retry`, `worker` (recovery worker and reconciler), `failover` |
//! | `keyfence_fenced_out_total` | `store` | an owner refused by the `key_store` or the `ledger` |
//! | `keyfence_hand_backs_total` | `how` | `forget` or `reopen` |
//! | `keyfence_unknown_outcomes_total`, `keyfence_indeterminate_total` | `step` | external outcomes unknown; marked indeterminate |
//! | `keyfence_declines_total` | `step` | declined by screening (`ext1`) or the rail (`ext2`, and `refund` for refunds) |
//! | `keyfence_holds_exceeded_total` | | holds on a balance that did not fit (a refund over what is left: 422) |
//! | `keyfence_orphaned_holds_released_total` | | holds whose request was gone, given back when a later hold needed the room |
//! | `keyfence_recovery_sweeps_total`, `keyfence_recovery_outcomes_total` | `outcome` | sweeps (`completed`, `failed`), and what became of each key found |
//! | `keyfence_expiry_sweeps_total` | `outcome` | rounds of `serve`'s expiry sweeper: `swept`, `led_elsewhere` (another instance leads the sweep), `failed` |
//! | `keyfence_expiry_deleted_total` | | expired keys its sweeps deleted |
//! | `keyfence_webhook_secrets_in_clear_total` | | webhook secrets used as an older version kept them, in the clear (`keyfence migrate --seal-webhook-secrets` seals them) |
//! | `keyfence_expiry_last_sweep_timestamp_seconds` | | when this instance last finished a sweep without a failure (a gauge; absent on an instance that never led one) |
//! | `keyfence_indeterminate_requests`, `keyfence_indeterminate_oldest_seconds` | | the region's external calls marked indeterminate, and the age of the oldest request among them, at the last sweep (gauges) |
//! | `keyfence_region_declared_failed` | `region` | 1 while that region is declared failed (a gauge) |
//! | `keyfence_key_store_seconds` | `op` | latency of each key-store operation |
//! | `keyfence_key_store_errors_total` | `op`, `kind` | failed attempts at the key table by DynamoDB operation: `throttled`, `unavailable`, `other` |
//! | `http_server_request_duration_seconds` | `http_request_method`, `http_route`, `http_response_status_code` | OpenTelemetry's `http.server.request.duration` |
//! | `keyfence_ledger_phase_seconds` | `to` | latency of each ledger phase, by the recovery point it reaches |
//! | `keyfence_rail_seconds` | `rail`, `call` | latency of each call to a rail (`send`, `probe`) |
//! | `process_cpu_seconds_total` (a counter), `process_resident_memory_bytes`, ... | | the process |
//!
//! Every metric has HELP text. `keyfence reconcile --metrics-file` writes
//! its own (`keyfence_reconcile_*`) for a textfile collector.

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
                describe();
                Some(handle)
            }
            Err(e) => {
                tracing::warn!(error = %e, "metrics are off: another recorder is installed");
                None
            }
        }
    });
}

/// The HELP text of every metric keyfence records.
fn describe() {
    use ::metrics::{Unit, describe_counter, describe_gauge, describe_histogram};
    describe_histogram!(
        "http_server_request_duration_seconds",
        Unit::Seconds,
        "Duration of HTTP server requests, by method, route template and status code (OpenTelemetry's http.server.request.duration)"
    );
    describe_counter!("keyfence_http_requests_total", "Answers of the front door, by route and answer class");
    describe_counter!("keyfence_limiter_decisions_total", "Fair-use decisions, by limiter and decision");
    describe_counter!("keyfence_throttled_total", "Requests turned away by fair use, by reason");
    describe_gauge!("keyfence_payment_tasks_in_flight", "Payment tasks running now in this instance");
    describe_counter!("keyfence_connections_refused_total", "Connections closed unanswered, by reason");
    describe_counter!("keyfence_connections_dropped_total", "Connections cut off while open, by reason");
    describe_counter!("keyfence_registry_reads_total", "Reads of the region registry");
    describe_gauge!(
        "keyfence_region_declared_failed",
        "1 while the region is declared failed in the registry, as this instance last read it"
    );
    describe_counter!("keyfence_client_lookups_total", "Keys not held when presented, looked up again, by outcome");
    describe_counter!("keyfence_client_directory_reads_total", "Rounds of reading the client directory's changes");
    describe_counter!("keyfence_claims_total", "Claims of idempotency keys: won (a new request) or existing");
    describe_counter!("keyfence_replays_from_memory_total", "Replays answered from this instance's memory");
    describe_counter!("keyfence_takeovers_total", "Requests taken over from an earlier owner, by who took them");
    describe_counter!("keyfence_fenced_out_total", "Owners refused by a store because a newer owner holds the key");
    describe_counter!("keyfence_hand_backs_total", "Keys handed back unworked, by how");
    describe_counter!("keyfence_unknown_outcomes_total", "External calls whose outcome is unknown, by step");
    describe_counter!("keyfence_indeterminate_total", "External calls marked indeterminate for settlement, by step");
    describe_counter!("keyfence_declines_total", "Payments and refunds declined, by the step that declined them");
    describe_counter!(
        "keyfence_holds_exceeded_total",
        "Holds on a balance refused for lack of room (refunds over what is left)"
    );
    describe_counter!(
        "keyfence_orphaned_holds_released_total",
        "Holds whose request was gone, released when the room was needed"
    );
    describe_counter!("keyfence_recovery_sweeps_total", "Recovery sweeps, completed or failed (some key not resumed)");
    describe_counter!(
        "keyfence_expiry_sweeps_total",
        "Rounds of the expiry sweeper: swept, led elsewhere (another instance sweeps), or failed"
    );
    describe_counter!("keyfence_expiry_deleted_total", "Expired keys the expiry sweeper deleted");
    describe_counter!(
        "keyfence_webhook_secrets_in_clear_total",
        "Webhook secrets used as an older version kept them, in the clear (migrate --seal-webhook-secrets seals them)"
    );
    describe_gauge!(
        "keyfence_expiry_last_sweep_timestamp_seconds",
        Unit::Seconds,
        "When this instance last finished an expiry sweep without a failure (seconds since the epoch)"
    );
    describe_counter!("keyfence_recovery_outcomes_total", "What recovery sweeps did with each stale key, by outcome");
    describe_gauge!(
        "keyfence_indeterminate_requests",
        "External calls of this region marked indeterminate for settlement, at the last sweep"
    );
    describe_gauge!(
        "keyfence_indeterminate_oldest_seconds",
        Unit::Seconds,
        "Age of the oldest request among them at the last sweep (0 when none)"
    );
    describe_histogram!("keyfence_key_store_seconds", Unit::Seconds, "Latency of key-store operations, by operation");
    describe_counter!(
        "keyfence_key_store_errors_total",
        "Failed attempts at the key table (retries included), by DynamoDB operation and kind"
    );
    describe_histogram!(
        "keyfence_ledger_phase_seconds",
        Unit::Seconds,
        "Latency of ledger phases, by the recovery point reached"
    );
    describe_histogram!("keyfence_rail_seconds", Unit::Seconds, "Latency of calls to the rails, by rail and call");
    describe_counter!(
        "keyfence_webhook_attempts_total",
        "Attempts to deliver a webhook event, by what the receiver did"
    );
    describe_counter!(
        "keyfence_webhook_deliveries_total",
        "Webhook deliveries ended: delivered, failed, or superseded (a lease that ran out)"
    );
    describe_counter!("keyfence_webhook_endpoints_disabled_total", "Webhook endpoints disabled, by why");
    describe_counter!(
        "keyfence_rail_notifications_total",
        "Notifications from the rails, by kind and what became of them on arrival"
    );
    describe_counter!("keyfence_notified_verdicts_total", "External steps settled by a rail's notification, by step");
    describe_counter!(
        "keyfence_returns_total",
        "Returns the rail made of what settled, posted back: of a payment (to its debtor) or of a refund (to the creditor)"
    );
    describe_gauge!(
        "keyfence_webhook_undelivered",
        "Webhook deliveries of this region's ledger still to arrive (and events not yet fanned out)"
    );
    describe_gauge!(
        "keyfence_webhook_oldest_undelivered_seconds",
        Unit::Seconds,
        "Age of the oldest webhook event still to arrive (0 when none)"
    );
}

/// Everything recorded so far, in the Prometheus text format.
pub fn render() -> String {
    match HANDLE.get().and_then(Option::as_ref) {
        Some(handle) => {
            metrics_process::Collector::default().collect();
            // The facade's counters hold whole numbers, so the CPU seconds
            // are recorded as a gauge (to the 10 ms the kernel counts); they
            // only ever grow, and are declared the counter they are.
            handle.render().replacen(
                "# TYPE process_cpu_seconds_total gauge",
                "# TYPE process_cpu_seconds_total counter",
                1,
            )
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
