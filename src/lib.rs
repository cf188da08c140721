//! keyfence makes a retried payment request take effect exactly once, across
//! regions.
//!
//! The map, in the direction data flows:
//! - [`domain`]: validated newtypes (client, key, fence, recovery point);
//!   every untrusted input becomes one of these at the edge.
//! - [`keystore`]: the global DynamoDB key table. Claim, takeover, heartbeat,
//!   finish and release are single conditional writes carrying a fencing
//!   token; it decides which attempt owns a key.
//! - [`ledger`]: the regional PostgreSQL ledger. Each phase of a request is one
//!   transaction that checks the fence and advances the recovery point.
//! - [`config`], [`startup`], [`telemetry`]: settings, bringing the stores
//!   up, and logging, shared by every subcommand of the `keyfence` binary.

pub mod config;
pub mod domain;
pub mod engine;
pub mod http;
pub mod keystore;
pub mod ledger;
pub mod rail;
pub mod startup;
pub mod telemetry;
