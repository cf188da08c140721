//! `Millis`: a wall-clock instant in milliseconds since the Unix epoch. Leases
//! are compared as these numbers inside conditional writes, so callers pass
//! the instant explicitly; tests drive it, production reads the clock.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct Millis(u64);

impl Millis {
    pub const fn new(ms: u64) -> Self {
        Self(ms)
    }

    pub fn now() -> Self {
        let since = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default();
        Self((since.as_millis() as i64).saturating_add(crate::failpoint::clock_offset_ms()).max(0) as u64)
    }

    pub fn get(self) -> u64 {
        self.0
    }

    pub fn plus(self, d: Duration) -> Self {
        Self(self.0.saturating_add(d.as_millis() as u64))
    }

    pub fn minus(self, d: Duration) -> Self {
        Self(self.0.saturating_sub(d.as_millis() as u64))
    }

    /// Whole seconds, the unit of DynamoDB's time-to-live attribute.
    pub fn as_secs(self) -> u64 {
        self.0 / 1000
    }
}
