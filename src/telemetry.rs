//! Logging: structured `tracing` events to stderr, filtered by `RUST_LOG`
//! (default `info`, sqlx notices at `warn`), so stdout stays free for a command's own output.

use tracing_subscriber::EnvFilter;

/// Installs the global subscriber; call once, first thing in `main`.
pub fn init() {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info,sqlx=warn"));
    tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).init();
}
