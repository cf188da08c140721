//! The simulator's notifications: what a real rail posts to its
//! participant's callback after the fact. Every verdict it reaches (also
//! one whose answer it held back) and every return it decides later is
//! posted to the callback URL, signed the Standard Webhooks way with the
//! callback's secret, and sent until the callback answers 2xx (at least
//! once). Faults make it behave like a real network: each notification
//! waits a random time up to `delay_ms` first (so they arrive out of
//! order), and a share of them (`duplicate_rate`) is sent twice. It counts
//! the copies taken and those still on their way, so a test can wait until
//! every copy has arrived.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::domain::WebhookSecret;
use crate::domain::webhook_signature as signature;
use crate::rail::Notice;
use backon::{ExponentialBuilder, Retryable};

/// Where and how the rail posts its notifications.
#[derive(Clone, Debug)]
pub struct Callback {
    pub url: String,
    /// A Standard Webhooks secret (`whsec_` and base64).
    pub secret: String,
}

/// Sends notifications, numbering them.
pub struct Notifier {
    callback: Callback,
    http: reqwest::Client,
    numbered: AtomicU64,
    rail: String,
    /// Names this run, so a restarted simulator's ids are new ones.
    run: String,
    /// Copies the callback took (answered 2xx).
    delivered: AtomicU64,
    /// Copies posted and not yet taken or given up.
    outstanding: AtomicU64,
}

/// How the notifications stand: copies taken, and copies on their way.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Tally {
    pub delivered: u64,
    pub outstanding: u64,
}

impl Notifier {
    pub fn new(rail: &str, callback: Callback) -> Arc<Self> {
        let http = reqwest::Client::builder().timeout(Duration::from_secs(5)).build().expect("a plain HTTP client");
        let run = format!("{:08x}", fastrand::u32(..));
        Arc::new(Self {
            callback,
            http,
            numbered: AtomicU64::new(0),
            rail: rail.to_owned(),
            run,
            delivered: AtomicU64::new(0),
            outstanding: AtomicU64::new(0),
        })
    }

    pub fn tally(&self) -> Tally {
        Tally { delivered: self.delivered.load(Ordering::SeqCst), outstanding: self.outstanding.load(Ordering::SeqCst) }
    }

    /// A fresh notification id.
    pub fn next_id(&self) -> String {
        format!("evt_{}_{}_{:08}", self.rail, self.run, self.numbered.fetch_add(1, Ordering::Relaxed) + 1)
    }

    /// Posts `notice` in the background: after up to `delay` at random,
    /// once or (at `duplicate_rate`) twice, each until it is taken.
    pub fn post(self: &Arc<Self>, notice: Notice, delay: Duration, duplicate_rate: f64) {
        let copies = if fastrand::f64() < duplicate_rate { 2 } else { 1 };
        for _ in 0..copies {
            let (me, notice) = (self.clone(), notice.clone());
            let wait = delay.mul_f64(fastrand::f64());
            self.outstanding.fetch_add(1, Ordering::SeqCst);
            tokio::spawn(async move {
                tokio::time::sleep(wait).await;
                if me.send(&notice).await {
                    me.delivered.fetch_add(1, Ordering::SeqCst);
                }
                me.outstanding.fetch_sub(1, Ordering::SeqCst);
            });
        }
    }

    /// Sends one copy until it is taken; whether it was.
    async fn send(&self, notice: &Notice) -> bool {
        let body = serde_json::to_vec(notice).expect("a notice serialises");
        let secret = WebhookSecret { value: self.callback.secret.clone(), created_at: 0, valid_until: None };
        let attempt = || async {
            let mut request = self.http.post(&self.callback.url).header("content-type", "application/json");
            for (name, value) in signature::headers(&[&secret], notice.id(), &body) {
                request = request.header(name, value);
            }
            let response = request.body(body.clone()).send().await.map_err(|e| e.to_string())?;
            if response.status().is_success() { Ok(()) } else { Err(format!("answered {}", response.status())) }
        };
        let backoff = ExponentialBuilder::default()
            .with_min_delay(Duration::from_millis(50))
            .with_max_delay(Duration::from_secs(2))
            .with_max_times(30);
        match attempt.retry(backoff).await {
            Ok(()) => true,
            Err(why) => {
                tracing::warn!(rail = %self.rail, id = notice.id(), why, "a notification was never taken");
                false
            }
        }
    }
}
