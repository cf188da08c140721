//! The delivery worker's settings: how often it looks, how many deliveries
//! it sends at once, how long a receiver has, the retry schedule they make
//! ([`Schedule`]), when an endpoint is disabled and how long finished
//! events are kept.

use std::time::Duration;

use clap::Args;

use super::schedule::Schedule;
use crate::domain::{parse_duration, parse_millis};

/// How `serve` delivers webhook events (see `webhooks::schedule` for what
/// the retry settings make of a delivery).
#[derive(Args, Clone, Copy, Debug)]
pub struct DeliverySettings {
    /// How often the delivery worker looks for webhook events to send, in milliseconds (0: this
    /// instance sends none).
    #[arg(
        id = "webhook-interval-ms",
        long = "webhook-interval-ms",
        env = "KEYFENCE_WEBHOOK_INTERVAL_MS",
        default_value_t = 1000
    )]
    pub interval_ms: u64,
    /// Deliveries one instance sends at once.
    #[arg(id = "webhook-concurrency", long = "webhook-concurrency", env = "KEYFENCE_WEBHOOK_CONCURRENCY", default_value_t = 16,
          value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub concurrency: u32,
    /// How long a receiver has to answer one delivery, in milliseconds.
    #[arg(id = "webhook-timeout-ms", long = "webhook-timeout-ms", env = "KEYFENCE_WEBHOOK_TIMEOUT_MS", default_value = "10000", value_parser = parse_millis)]
    pub timeout: Duration,
    /// The wait before a delivery's first retry, in milliseconds; each later wait is four times the last.
    #[arg(id = "webhook-retry-first-ms", long = "webhook-retry-first-ms", env = "KEYFENCE_WEBHOOK_RETRY_FIRST_MS", default_value = "5000", value_parser = parse_millis)]
    pub retry_first: Duration,
    /// The longest wait between two attempts of a delivery, in milliseconds.
    #[arg(id = "webhook-retry-max-ms", long = "webhook-retry-max-ms", env = "KEYFENCE_WEBHOOK_RETRY_MAX_MS", default_value = "14400000", value_parser = parse_millis)]
    pub retry_longest: Duration,
    /// Attempts of one delivery in all; then it has failed and its endpoint is flagged as failing.
    #[arg(id = "webhook-attempts", long = "webhook-attempts", env = "KEYFENCE_WEBHOOK_ATTEMPTS", default_value_t = 10,
          value_parser = clap::value_parser!(u32).range(1..=100))]
    pub attempts: u32,
    /// Failed deliveries in a row after which an endpoint is disabled.
    #[arg(id = "webhook-disable-after", long = "webhook-disable-after", env = "KEYFENCE_WEBHOOK_DISABLE_AFTER", default_value_t = 5,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub disable_after: u32,
    /// How long a webhook event and its deliveries are kept once every delivery has finished.
    #[arg(id = "webhook-retention", long = "webhook-retention", env = "KEYFENCE_WEBHOOK_RETENTION", default_value = "7d", value_parser = parse_duration)]
    pub retention: Duration,
}

impl DeliverySettings {
    pub fn schedule(&self) -> Schedule {
        Schedule { first: self.retry_first, longest: self.retry_longest, attempts: self.attempts }
    }
}
