//! `Retention`: how long a finished key is kept, and the margin for clock
//! skew that every decision about its end leaves. A key's `expires_at` is
//! written once, from the finishing instance's clock; it is then read
//! against other clocks: a sweeper that deletes it, a claim that writes over
//! it, an instance replaying it from memory. A clock running ahead would
//! end the retention early (a late retry claimed afresh: a second payment),
//! one running behind would replay an answer after the key began a new
//! request. So deletion and claim-over-expired wait `grace` past
//! `expires_at`, and memory stops serving `grace` before it: clocks may
//! disagree by up to `grace` either way without either happening.

use std::time::Duration;

use super::Millis;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Retention {
    /// How long a finished key is kept and replayed.
    pub keep: Duration,
    /// The margin for clock skew on either side of the end.
    pub grace: Duration,
}

impl Retention {
    /// The `expires_at` of a key finished at `now`.
    pub fn expires_at(&self, now: Millis) -> Millis {
        now.plus(self.keep)
    }

    /// The instant an `expires_at` must lie before, at `now` on this clock,
    /// for the key to count as gone (deleted, or claimed as a new request).
    pub fn gone_before(&self, now: Millis) -> Millis {
        now.minus(self.grace)
    }

    /// Whether an answer kept in memory may still be replayed at `now`:
    /// until `grace` before its key's `expires_at` (seconds).
    pub fn replayable(&self, expires_at_secs: u64, now: Millis) -> bool {
        now.plus(self.grace).as_secs() < expires_at_secs
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_end_is_late_for_deletion_and_early_for_replay() {
        let r = Retention { keep: Duration::from_secs(3600), grace: Duration::from_secs(600) };
        let finished = Millis::new(1_000_000_000);
        let expires = r.expires_at(finished).as_secs();
        let at_expiry = Millis::new(expires * 1000);
        assert!(r.gone_before(at_expiry).as_secs() < expires, "not gone at expires_at itself");
        let after_grace = at_expiry.plus(Duration::from_secs(601));
        assert!(r.gone_before(after_grace).as_secs() > expires, "gone once the grace has passed too");
        assert!(r.replayable(expires, finished));
        assert!(!r.replayable(expires, at_expiry.minus(Duration::from_secs(600))), "memory stops a grace early");
    }
}
