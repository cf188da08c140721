//! `Clock`: where the service reads the time it decides by. The engine
//! (leases, expiry, holds), the workers beside it and the caches of the
//! registry and the clients ask the clock they were given, not the
//! system's, so a test moves time forward ([`TestClock::advance`]) instead
//! of waiting for it. Times a store merely records (when a client or a key
//! was made, when a region was declared) and PostgreSQL's own `now()` stay
//! the system's. The service runs on [`SystemClock`]; a [`SharedClock`] is
//! the handle every part holds (cloned, one clock for an instance).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::Millis;

/// A source of time.
pub trait Clock: Send + Sync {
    /// The wall-clock time: what leases, expiry and holds are written in
    /// (and compared in, inside conditional writes).
    fn now(&self) -> Millis;
    /// A monotonic instant: what caches are aged by.
    fn instant(&self) -> Instant;
}

/// The machine's clock (in builds with failpoints, set off by
/// `KEYFENCE_CLOCK_OFFSET_MS` for the clock-skew tests).
#[derive(Clone, Copy, Debug, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Millis {
        Millis::now()
    }

    fn instant(&self) -> Instant {
        Instant::now()
    }
}

/// The machine's clock and however far a test has moved it on: time still
/// passes (the stores and servers around a test run in real time), and
/// [`advance`](Self::advance) adds to it at once.
#[derive(Debug, Default)]
pub struct TestClock {
    ahead_ms: AtomicU64,
}

impl TestClock {
    /// Moves this clock `by` forward, for everything that holds it.
    pub fn advance(&self, by: Duration) {
        self.ahead_ms.fetch_add(by.as_millis() as u64, Ordering::SeqCst);
    }

    fn ahead(&self) -> Duration {
        Duration::from_millis(self.ahead_ms.load(Ordering::SeqCst))
    }
}

impl Clock for TestClock {
    fn now(&self) -> Millis {
        Millis::now().plus(self.ahead())
    }

    fn instant(&self) -> Instant {
        Instant::now() + self.ahead()
    }
}

/// The clock an instance's parts share.
#[derive(Clone)]
pub struct SharedClock(Arc<dyn Clock>);

impl SharedClock {
    pub fn new(clock: Arc<dyn Clock>) -> Self {
        Self(clock)
    }

    pub fn now(&self) -> Millis {
        self.0.now()
    }

    pub fn instant(&self) -> Instant {
        self.0.instant()
    }

    /// How long ago `earlier` (an [`instant`](Self::instant) of this clock) was.
    pub fn since(&self, earlier: Instant) -> Duration {
        self.0.instant().saturating_duration_since(earlier)
    }
}

impl Default for SharedClock {
    fn default() -> Self {
        Self(Arc::new(SystemClock))
    }
}

impl std::fmt::Debug for SharedClock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SharedClock")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_test_clock_moves_both_times_for_everyone_holding_it() {
        let moved = Arc::new(TestClock::default());
        let shared = SharedClock::new(moved.clone());
        let (wall, mark) = (shared.now(), shared.instant());
        moved.advance(Duration::from_secs(3600));
        assert!(shared.now() >= wall.plus(Duration::from_secs(3600)));
        assert!(shared.since(mark) >= Duration::from_secs(3600));
        assert!(SharedClock::default().now() < wall.plus(Duration::from_secs(60)), "the system's clock stays put");
    }
}
