//! `RailClient`: calls one external system with a derived idempotency key
//! and classifies what came back, in one table (the same for a send and,
//! where it applies, a probe):
//!
//! | answer                                        | class        | what follows                         |
//! |-----------------------------------------------|--------------|--------------------------------------|
//! | 200/201 with an `Applied` body                | applied      | the payment goes on                  |
//! | 402 with a `Declined` body                    | declined     | final: the payment ends, rejected    |
//! | connection refused, 429, 503                  | not applied  | transient: retried, then 503         |
//! | 404 (probe only)                              | never seen   | sent (again) under the same key      |
//! | anything else: timeout, reset, other status, unreadable body | unknown | parked (202), probed later |
//!
//! The distinction that matters most is between "not applied" (safe to
//! report as transient) and "unknown" (the instruction may have been
//! applied: never reported as failed).
//!
//! A redirect is not followed (it is an answer of its own: unknown), and
//! no proxy from the environment is used: an instruction goes to the URL
//! configured, through the proxy configured (`KEYFENCE_RAIL_PROXY`), or
//! nowhere.

use std::time::Duration;

use backon::{ExponentialBuilder, Retryable};
use reqwest::StatusCode;

use super::{Applied, Declined, Instruction, Verdict};
use crate::metrics::Timer;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CallOutcome {
    /// Applied or declined, now or earlier (a repeat answers the first result).
    Settled(Verdict),
    /// Definitely not applied (a 429/503, or no connection), retry later.
    NotApplied(String),
    /// No answer in time, or a broken one: it may or may not have applied.
    Unknown(String),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProbeOutcome {
    Found(Verdict),
    NotFound,
    Unknown(String),
}

#[derive(Clone, Debug)]
pub struct RailClient {
    http: reqwest::Client,
    /// Names the system in metrics (`screening`, `payment`).
    name: &'static str,
    base: String,
    /// Attempts per send: a definite "not applied" is retried inline, each
    /// time with the same key, so a retry can never be a second instruction.
    attempts: u32,
}

/// The first pause between attempts; each next one doubles.
const FIRST_BACKOFF: Duration = Duration::from_millis(50);

impl RailClient {
    /// The name operations call it by.
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// A client whose every attempt is cut off after `timeout`, sent
    /// through `proxy` if given.
    pub fn new(
        name: &'static str,
        base: &str,
        timeout: Duration,
        attempts: u32,
        proxy: Option<reqwest::Proxy>,
    ) -> Self {
        let mut builder = reqwest::Client::builder()
            .timeout(timeout)
            .connect_timeout(timeout)
            .redirect(reqwest::redirect::Policy::none())
            .no_proxy();
        if let Some(proxy) = proxy {
            builder = builder.proxy(proxy);
        }
        let http = builder.build().expect("an HTTP client with default TLS settings");
        Self { http, name, base: base.trim_end_matches('/').to_owned(), attempts: attempts.max(1) }
    }

    /// The longest one send can take: every attempt timing out, plus the
    /// pauses between them. An owner must hold its lease at least this long
    /// past the moment it calls.
    pub fn longest_call(timeout: Duration, attempts: u32) -> Duration {
        let pauses = (0..attempts.saturating_sub(1)).map(|i| FIRST_BACKOFF * 2_u32.pow(i)).sum::<Duration>();
        timeout * attempts + pauses
    }

    /// Sends `instruction` under `key`, retrying a definite refusal with
    /// backoff; a verdict or an unknown outcome is returned at once.
    #[tracing::instrument(skip(self, instruction), fields(rail = %self.base))]
    pub async fn send(&self, key: &str, instruction: &Instruction) -> CallOutcome {
        let _timer = Timer::start("keyfence_rail_seconds", &[("rail", self.name), ("call", "send")]);
        let attempt = || async {
            match self.send_once(key, instruction).await {
                CallOutcome::NotApplied(why) => Err(why),
                settled => Ok(settled),
            }
        };
        let backoff = ExponentialBuilder::default()
            .with_min_delay(FIRST_BACKOFF)
            .with_factor(2.0)
            .with_max_times(self.attempts as usize - 1);
        attempt.retry(backoff).await.unwrap_or_else(CallOutcome::NotApplied)
    }

    async fn send_once(&self, key: &str, instruction: &Instruction) -> CallOutcome {
        let sent = self
            .http
            .post(format!("{}/v1/instructions", self.base))
            .headers(trace_context())
            .header("Idempotency-Key", key)
            .json(instruction)
            .send()
            .await;
        let response = match sent {
            Ok(r) => r,
            // Refused before anything was sent: not applied.
            Err(e) if e.is_connect() => return CallOutcome::NotApplied(e.to_string()),
            Err(e) => return CallOutcome::Unknown(e.to_string()),
        };
        match response.status() {
            StatusCode::TOO_MANY_REQUESTS | StatusCode::SERVICE_UNAVAILABLE => {
                CallOutcome::NotApplied(format!("{} answered {}", self.base, response.status()))
            }
            _ => match verdict(response, key, instruction).await {
                Ok(verdict) => CallOutcome::Settled(verdict),
                // Anything else is not a promise either way.
                Err(why) => CallOutcome::Unknown(why),
            },
        }
    }

    /// Asks what became of the instruction sent under `key`.
    #[tracing::instrument(skip(self), fields(rail = %self.base))]
    pub async fn probe(&self, key: &str, instruction: &Instruction) -> ProbeOutcome {
        let _timer = Timer::start("keyfence_rail_seconds", &[("rail", self.name), ("call", "probe")]);
        let probe = self.http.get(format!("{}/v1/instructions/{key}", self.base)).headers(trace_context());
        let response = match probe.send().await {
            Ok(r) => r,
            Err(e) => return ProbeOutcome::Unknown(e.to_string()),
        };
        if response.status() == StatusCode::NOT_FOUND {
            return ProbeOutcome::NotFound;
        }
        match verdict(response, key, instruction).await {
            Ok(verdict) => ProbeOutcome::Found(verdict),
            Err(why) => ProbeOutcome::Unknown(why),
        }
    }
}

/// The current trace, for the external system (W3C `traceparent`).
fn trace_context() -> reqwest::header::HeaderMap {
    let mut headers = reqwest::header::HeaderMap::new();
    crate::telemetry::inject_trace_context(&mut headers);
    headers
}

/// The definite answers: 200/201 with what was applied, 402 with why it was
/// declined. Anything else, or a body that does not read, is no answer.
/// The verdict an answer carries, if it is about what was sent
/// ([`super::answers`]); one about something else counts as unknown.
async fn verdict(response: reqwest::Response, key: &str, sent: &Instruction) -> Result<Verdict, String> {
    let status = response.status();
    let unreadable = |e: reqwest::Error| format!("{status} with an unreadable answer: {e}");
    let verdict = match status {
        StatusCode::OK | StatusCode::CREATED => {
            response.json::<Applied>().await.map(Verdict::Applied).map_err(unreadable)
        }
        StatusCode::PAYMENT_REQUIRED => response.json::<Declined>().await.map(Verdict::Declined).map_err(unreadable),
        other => Err(format!("{} answered {other}", response.url().origin().ascii_serialization())),
    }?;
    if super::answers(&verdict, key, sent) {
        Ok(verdict)
    } else {
        Err(format!("an answer that does not match the instruction sent under {key}"))
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use axum::Router;
    use axum::http::{StatusCode, header};
    use axum::routing::any;

    use super::*;

    /// Serves `router` on a loopback port; its base URL.
    async fn serving(router: Router) -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, router).await });
        url
    }

    /// A rail that answers with a redirect elsewhere is not followed: the
    /// outcome is unknown (parked and probed), and the other place is
    /// never sent the instruction.
    #[tokio::test]
    async fn a_redirect_is_an_answer_not_a_place_to_send_to() {
        let reached = Arc::new(AtomicUsize::new(0));
        let counted = reached.clone();
        let elsewhere = serving(Router::new().fallback(any(move || {
            counted.fetch_add(1, Ordering::Relaxed);
            async { StatusCode::CREATED }
        })))
        .await;
        let redirecting = serving(Router::new().fallback(any(move || {
            let to = format!("{elsewhere}/v1/instructions");
            async move { (StatusCode::TEMPORARY_REDIRECT, [(header::LOCATION, to)]) }
        })))
        .await;
        let rail = RailClient::new("payment", &redirecting, Duration::from_secs(2), 1, None);
        let outcome = rail.send("k", &crate::rail::tests::sent()).await;
        assert!(matches!(outcome, CallOutcome::Unknown(ref why) if why.contains("307")), "{outcome:?}");
        assert_eq!(reached.load(Ordering::Relaxed), 0, "the redirect was not followed");
    }
}
