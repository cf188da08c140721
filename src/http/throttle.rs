//! Fair use of one instance. Each client has a token bucket of requests
//! (GCRA, `governor`) and a number of payments in flight (distinct keys: a
//! retry of a payment this instance is working takes no second place),
//! sized by its own limits or the instance's defaults; all clients together have a fixed
//! number of payment tasks. Past a client's bucket or in-flight count a
//! request is refused with 429, past the tasks with 503, in both cases
//! before anything is claimed, so a retry later with the same key is worked
//! as if it were the first. The limits are per instance: behind a load
//! balancer over N instances a client may get up to N times as much.

use std::collections::HashMap;
use std::num::NonZeroU32;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use clap::Args;
use governor::clock::{Clock, DefaultClock};
use governor::{DefaultDirectRateLimiter, Quota, RateLimiter};
use quick_cache::sync::{Cache, GuardResult};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::clients::Profile;
use crate::domain::{ClientId, IdempotencyKey, ScopedKey};

/// Clients whose buckets are kept at most (a bucket evicted starts full).
const BUCKETS: usize = 100_000;

/// What one client may take of one instance (every client alike, unless
/// `keyfence clients limits` gives it its own), and what all of them may.
/// Per instance: behind a load balancer over N instances a client gets up
/// to N times these.
#[derive(Args, Clone, Copy, Debug)]
pub struct FairUseSettings {
    /// Requests a second one client may make (its token bucket's refill).
    #[arg(long = "client-rate", env = "KEYFENCE_CLIENT_RATE", default_value_t = 100,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub client_rate: u32,
    /// Requests one client may make at once after a quiet spell (the bucket's size).
    #[arg(long = "client-burst", env = "KEYFENCE_CLIENT_BURST", default_value_t = 200,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub client_burst: u32,
    /// Payments one client may have in flight at once.
    #[arg(long = "client-in-flight", env = "KEYFENCE_CLIENT_IN_FLIGHT", default_value_t = 16,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub client_in_flight: u32,
    /// Payment tasks in flight at once, all clients together (past it: 503, nothing claimed).
    #[arg(long = "max-payment-tasks", env = "KEYFENCE_MAX_PAYMENT_TASKS", default_value_t = 256,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub max_payment_tasks: u32,
}

impl Default for FairUseSettings {
    fn default() -> Self {
        Self { client_rate: 100, client_burst: 200, client_in_flight: 16, max_payment_tasks: 256 }
    }
}

/// Why a request was turned away.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Throttled {
    /// The client's bucket is empty; a token is back after `retry_after`.
    Rate { retry_after: Duration },
    /// The client has as many payments in flight as it may.
    InFlight,
    /// The instance has as many payment tasks as it may.
    Tasks,
}

impl Throttled {
    fn reason(self) -> &'static str {
        match self {
            Throttled::Rate { .. } => "rate",
            Throttled::InFlight => "in_flight",
            Throttled::Tasks => "tasks",
        }
    }
}

#[derive(Clone)]
pub struct Throttle {
    inner: Arc<Inner>,
}

struct Inner {
    defaults: FairUseSettings,
    /// Each client's bucket, with the quota it was made for.
    buckets: Cache<ClientId, Arc<(Quota, DefaultDirectRateLimiter)>>,
    /// Payments in flight, per client (absent: none), each with the
    /// requests working on it.
    running: Mutex<HashMap<ClientId, HashMap<IdempotencyKey, u32>>>,
    tasks: Arc<Semaphore>,
}

/// A payment's place among those in flight, given back when dropped.
pub struct Running {
    inner: Arc<Inner>,
    key: ScopedKey,
    _task: OwnedSemaphorePermit,
}

impl Throttle {
    pub fn new(defaults: FairUseSettings) -> Self {
        let tasks = Arc::new(Semaphore::new(defaults.max_payment_tasks as usize));
        let inner = Inner { defaults, buckets: Cache::new(BUCKETS), running: Mutex::new(HashMap::new()), tasks };
        Self { inner: Arc::new(inner) }
    }

    /// Takes a token from `client`'s bucket, for one request.
    pub fn admit(&self, client: ClientId, profile: &Profile) -> Result<(), Throttled> {
        let rate = profile.fair_use.rate.unwrap_or(self.inner.defaults.client_rate);
        let burst = profile.fair_use.burst.unwrap_or(self.inner.defaults.client_burst);
        let quota = Quota::per_second(positive(rate)).allow_burst(positive(burst));
        // Concurrent first requests share the one bucket made (a second
        // would be a second burst); a changed quota makes a new one.
        let made = || Arc::new((quota, RateLimiter::direct(quota)));
        let bucket = match self.inner.buckets.get_value_or_guard(&client, None) {
            GuardResult::Value(bucket) if bucket.0 == quota => bucket,
            GuardResult::Guard(guard) => {
                let bucket = made();
                let _ = guard.insert(bucket.clone());
                bucket
            }
            GuardResult::Value(_) | GuardResult::Timeout => {
                let bucket = made();
                self.inner.buckets.insert(client, bucket.clone());
                bucket
            }
        };
        let decided = bucket.1.check().map_err(|not_until| Throttled::Rate {
            retry_after: not_until.wait_time_from(DefaultClock::default().now()),
        });
        decision("rate", decided)
    }

    /// A task for a request of payment `key`, if its client may have one
    /// more payment in flight (or is already working this one) and the
    /// instance has a task free.
    pub fn start(&self, key: &ScopedKey, profile: &Profile) -> Result<Running, Throttled> {
        let allowed = profile.fair_use.in_flight.unwrap_or(self.inner.defaults.client_in_flight) as usize;
        let mut running = self.inner.running.lock().expect("the in-flight counts are never poisoned");
        let payments = running.get(&key.client);
        let room = payments.is_some_and(|p| p.contains_key(&key.key)) || payments.map_or(0, HashMap::len) < allowed;
        decision("in_flight", if room { Ok(()) } else { Err(Throttled::InFlight) })?;
        let task = decision("tasks", self.inner.tasks.clone().try_acquire_owned().map_err(|_| Throttled::Tasks))?;
        *running.entry(key.client).or_default().entry(key.key.clone()).or_default() += 1;
        metrics::gauge!("keyfence_payment_tasks_in_flight").increment(1.0);
        Ok(Running { inner: self.inner.clone(), key: key.clone(), _task: task })
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let mut running = self.inner.running.lock().expect("the in-flight counts are never poisoned");
        if let Some(payments) = running.get_mut(&self.key.client) {
            if let Some(requests) = payments.get_mut(&self.key.key) {
                *requests -= 1;
                if *requests == 0 {
                    payments.remove(&self.key.key);
                }
            }
            if payments.is_empty() {
                running.remove(&self.key.client);
            }
        }
        metrics::gauge!("keyfence_payment_tasks_in_flight").decrement(1.0);
    }
}

/// Counts a limiter's decision (and a refusal by its reason).
fn decision<T>(limiter: &'static str, decided: Result<T, Throttled>) -> Result<T, Throttled> {
    let outcome = if decided.is_ok() { "allowed" } else { "refused" };
    metrics::counter!("keyfence_limiter_decisions_total", "limiter" => limiter, "decision" => outcome).increment(1);
    if let Err(throttled) = &decided {
        metrics::counter!("keyfence_throttled_total", "reason" => throttled.reason()).increment(1);
    }
    decided
}

fn positive(n: u32) -> NonZeroU32 {
    NonZeroU32::new(n).unwrap_or(NonZeroU32::MIN)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn throttle(rate: u32, burst: u32, in_flight: u32, tasks: u32) -> Throttle {
        Throttle::new(FairUseSettings {
            client_rate: rate,
            client_burst: burst,
            client_in_flight: in_flight,
            max_payment_tasks: tasks,
        })
    }

    #[test]
    fn a_bucket_holds_its_burst_then_says_when_to_come_back() {
        let throttle = throttle(1, 3, 10, 10);
        let client = ClientId::generate();
        let profile = Profile::default();
        for _ in 0..3 {
            assert_eq!(throttle.admit(client, &profile), Ok(()));
        }
        let Err(Throttled::Rate { retry_after }) = throttle.admit(client, &profile) else { panic!("not throttled") };
        assert!(retry_after > Duration::ZERO && retry_after <= Duration::from_secs(1), "{retry_after:?}");
        // Another client has a bucket of its own.
        assert_eq!(throttle.admit(ClientId::generate(), &profile), Ok(()));
    }

    fn key(client: ClientId, key: &str) -> ScopedKey {
        ScopedKey::new(client, IdempotencyKey::parse(key).unwrap())
    }

    #[test]
    fn a_clients_own_limits_replace_the_defaults() {
        let throttle = throttle(1, 1, 1, 10);
        let client = ClientId::generate();
        let mut profile = Profile::default();
        profile.fair_use.burst = Some(5);
        profile.fair_use.in_flight = Some(2);
        for _ in 0..5 {
            assert_eq!(throttle.admit(client, &profile), Ok(()));
        }
        let held = [
            throttle.start(&key(client, "a"), &profile).unwrap(),
            throttle.start(&key(client, "b"), &profile).unwrap(),
        ];
        assert_eq!(throttle.start(&key(client, "c"), &profile).err(), Some(Throttled::InFlight));
        drop(held);
        assert!(throttle.start(&key(client, "c"), &profile).is_ok());
    }

    #[test]
    fn retries_of_a_payment_in_flight_take_no_second_place() {
        let throttle = throttle(100, 100, 1, 10);
        let client = ClientId::generate();
        let profile = Profile::default();
        let first = throttle.start(&key(client, "a"), &profile).unwrap();
        let retry = throttle.start(&key(client, "a"), &profile).unwrap();
        assert_eq!(throttle.start(&key(client, "b"), &profile).err(), Some(Throttled::InFlight));
        drop(first);
        assert_eq!(
            throttle.start(&key(client, "b"), &profile).err(),
            Some(Throttled::InFlight),
            "the retry still runs"
        );
        drop(retry);
        assert!(throttle.start(&key(client, "b"), &profile).is_ok());
    }

    #[test]
    fn tasks_are_capped_across_clients_and_given_back() {
        let throttle = throttle(100, 100, 10, 2);
        let profile = Profile::default();
        let (a, b) = (ClientId::generate(), ClientId::generate());
        let first = throttle.start(&key(a, "a"), &profile).unwrap();
        let _second = throttle.start(&key(b, "b"), &profile).unwrap();
        assert_eq!(throttle.start(&key(b, "c"), &profile).err(), Some(Throttled::Tasks));
        // A refusal by the task cap takes no place of the client's.
        drop(first);
        let _third = throttle.start(&key(b, "c"), &profile).unwrap();
        assert_eq!(throttle.inner.running.lock().unwrap().get(&b).map(HashMap::len), Some(2));
        assert!(!throttle.inner.running.lock().unwrap().contains_key(&a));
    }
}
