//! How long a parked request waits before the recovery worker probes it
//! again. Each unknown outcome doubles the wait, from `first` up to `max`,
//! with ±20% jitter so requests parked together are not probed together: a
//! rail that stays silent is asked less and less often, and a flood of
//! parked requests leaves the worker free for requests whose owner died.
//! A client's own retry does not wait: it resumes (and probes) at once.

use std::time::Duration;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProbeBackoff {
    /// The wait after the first unknown outcome.
    pub first: Duration,
    /// The longest wait, however many outcomes were unknown.
    pub max: Duration,
}
