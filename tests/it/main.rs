//! Integration tests against the real local services: the DynamoDB emulator
//! (or LocalStack) at `AWS_ENDPOINT_URL` and PostgreSQL at `DATABASE_URL`.
//! One binary, many modules; every test makes its own table and database.

mod answer_limit;
mod app;
mod aws_calls;
mod batch;
mod chaos;
mod cli;
mod client;
mod clients;
#[cfg(feature = "failpoints")]
mod clock_skew;
mod condition_items;
mod connections;
#[cfg(feature = "failpoints")]
mod crash;
mod declines;
mod deploy;
mod dns;
#[cfg(feature = "failpoints")]
mod drill;
mod emulator;
mod engine_costs;
mod errors;
mod example_payout;
mod expiry;
mod fail_closed;
mod failover;
mod fair_use;
mod front_door;
mod front_door_faults;
mod harness;
mod hostile;
mod inbox;
mod inbox_regions;
mod keystore_fencing;
mod keystore_model;
mod keystore_races;
mod layers;
mod ledger_indexes;
mod ledger_phases;
mod ledger_tls;
mod lost_replies;
#[cfg(feature = "failpoints")]
mod metrics;
#[cfg(feature = "failpoints")]
mod parked;
mod partitions;
mod perimeter;
mod policies;
mod process;
mod protocol_model;
mod proxy;
mod rail_keys;
mod rail_outage;
mod receiver;
mod reconcile;
#[cfg(feature = "failpoints")]
mod reconcile_crashes;
#[cfg(feature = "failpoints")]
mod refund_crashes;
mod refund_model;
mod refunds;
mod region_auth;
#[cfg(feature = "failpoints")]
mod regions;
mod rotation;
#[cfg(feature = "failpoints")]
mod sealed_secrets;
mod seams;
mod seeds;
mod store_errors;
mod takeovers;
mod telemetry;
mod webhook_delivery;
mod webhook_endpoints;
#[cfg(feature = "failpoints")]
mod zombies;
