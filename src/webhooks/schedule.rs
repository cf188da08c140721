//! When a delivery that did not arrive is tried again: exponential
//! back-off with jitter (backon's), persisted as the delivery's next
//! attempt, so the schedule survives restarts. With the defaults (first
//! retry after 5 s, each wait four times the last, at most 4 h, 10 attempts)
//! the nominal waits are 5 s, 20 s, 80 s, 5.3 min, 21 min, 85 min and then
//! 4 h three times: 13.9 h in all. Jitter adds up to as much again to each
//! wait, so a delivery gives up between 14 and 28 hours after its first
//! attempt (about 21 on average), and receivers that fail together do not
//! get their retries together. A receiver that asks for a later retry
//! (`Retry-After` on 429 or 503) gets it, up to a day.

use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBuilder};

/// The longest `Retry-After` honoured.
const MOST_RETRY_AFTER: Duration = Duration::from_secs(24 * 60 * 60);

/// The retry schedule of every delivery.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Schedule {
    /// The wait before the first retry.
    pub first: Duration,
    /// The longest wait between two attempts.
    pub longest: Duration,
    /// Attempts in all, the first included.
    pub attempts: u32,
}

impl Default for Schedule {
    fn default() -> Self {
        Self { first: Duration::from_secs(5), longest: Duration::from_secs(4 * 60 * 60), attempts: 10 }
    }
}

impl Schedule {
    /// How long to wait after attempt `made` (1 for the first) did not
    /// arrive, given what the receiver asked for; `None` once the schedule
    /// is used up.
    pub fn wait_after(&self, made: u32, asked: Option<Duration>) -> Option<Duration> {
        if made >= self.attempts {
            return None;
        }
        let scheduled = self.backoff(true).nth(usize::try_from(made.saturating_sub(1)).unwrap_or(usize::MAX))?;
        Some(asked.map_or(scheduled, |asked| scheduled.max(asked.min(MOST_RETRY_AFTER))))
    }

    /// The waits without jitter, in order (what the documentation lists).
    pub fn nominal(&self) -> Vec<Duration> {
        self.backoff(false).collect()
    }

    fn backoff(&self, jitter: bool) -> impl Iterator<Item = Duration> {
        let builder = ExponentialBuilder::default()
            .with_min_delay(self.first)
            .with_max_delay(self.longest)
            .with_factor(4.0)
            .with_max_times(self.attempts.saturating_sub(1) as usize);
        if jitter { builder.with_jitter().build() } else { builder.build() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_schedule_spans_about_a_day() {
        let schedule = Schedule::default();
        let waits = schedule.nominal();
        assert_eq!(waits.len(), 9, "ten attempts");
        assert_eq!(waits[0], Duration::from_secs(5));
        assert_eq!(waits[1], Duration::from_secs(20));
        assert_eq!(*waits.last().unwrap(), Duration::from_secs(4 * 60 * 60));
        let hours = waits.iter().sum::<Duration>().as_secs_f64() / 3600.0;
        assert!((13.0..15.0).contains(&hours), "{hours} h without jitter; up to twice that with it");
    }

    #[test]
    fn waits_grow_with_jitter_and_end_with_the_schedule() {
        let schedule = Schedule::default();
        for made in 1..schedule.attempts {
            let nominal = schedule.nominal()[made as usize - 1];
            let wait = schedule.wait_after(made, None).unwrap();
            assert!(wait >= nominal && wait <= nominal * 2, "attempt {made}: {wait:?} against {nominal:?}");
        }
        assert_eq!(schedule.wait_after(schedule.attempts, None), None);
    }

    #[test]
    fn a_receiver_may_ask_for_a_later_retry_never_a_sooner_one() {
        let schedule = Schedule::default();
        let later = schedule.wait_after(1, Some(Duration::from_secs(600))).unwrap();
        assert_eq!(later, Duration::from_secs(600));
        assert!(schedule.wait_after(1, Some(Duration::ZERO)).unwrap() >= Duration::from_secs(5));
        assert_eq!(schedule.wait_after(1, Some(Duration::from_secs(1 << 40))).unwrap(), MOST_RETRY_AFTER);
    }
}
