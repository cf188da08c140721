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
//! - [`rail`]: the client for external systems, and the simulator that
//!   stands in for them locally.
//! - [`engine`]: the protocol: claim or branch, then drive an operation's
//!   phases and external calls, resuming from the recovery point.
//! - [`clients`]: the API clients, global (control items of the key table),
//!   cached by each instance.
//! - [`regions`]: which regions are active or declared failed (a control
//!   item of the key table, with an epoch), as each instance sees it.
//! - [`http`]: the axum front door; validates input and calls the engine.
//! - [`recovery`], [`reconcile`], [`expiry`]: the workers beside traffic:
//!   resuming stale requests, repairing divergence, reaping expired keys.
//! - [`webhooks`]: the endpoints clients register to hear how their
//!   payments end (global, control items of the key table).
//! - [`batch`]: `keyfence pay --file`, paying a file's lines through the
//!   client library (the `keyfence-client` crate) under deterministic keys.
//! - [`config`], [`startup`], [`telemetry`], [`metrics`]: gathering each
//!   room's settings (the key store's, the ledger's, the front door's, the
//!   webhook worker's: each room owns its type) from flags and the
//!   environment, building the service, logs and trace export, Prometheus
//!   metrics.
//!
//! No room imports one that imports it back, and no two modules of a room
//! do (`tests/it/layers.rs` follows every `crate::`, `super::` and `self::`
//! path to where it is defined and fails on a circle): what several rooms
//! share, such as secrets and the Standard Webhooks signature, lives in
//! [`domain`]. So does the [`domain::Clock`] every part reckons time by
//! (leases, expiry, holds, the caches): the system's in the service, one a
//! test moves on instead of waiting.
//!
//! The `keyfence` binary (`src/cli/`) serves and operates; the benchmarks
//! and the rail simulator's command are in `keyfence-tools` (`tools/`).

pub mod batch;
pub mod clients;
pub mod config;
pub mod domain;
pub mod engine;
pub mod expiry;
pub mod failpoint;
pub mod http;
pub mod inbox;
pub mod keystore;
pub mod ledger;
pub mod metrics;
pub mod operations;
pub mod rail;
pub mod reconcile;
pub mod recovery;
pub mod regions;
pub mod startup;
pub mod telemetry;
pub mod webhooks;

#[cfg(all(feature = "failpoints", not(debug_assertions)))]
compile_error!("the failpoints feature lets the environment crash the process: test builds only");
