//! The client: one key per operation, retries that keep it, polling of
//! pending payments and refunds, and failover from one region to the next.

use std::fmt;
use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, SystemTime};

use backon::{BackoffBuilder, ExponentialBuilder};
use reqwest::{Response, StatusCode};
use tokio::time::Instant;
use uuid::Uuid;

use crate::OperationId;
use crate::answer;
use crate::error::{BuildError, PayError};
use crate::journal::Journal;
use crate::region;
use crate::types::{
    Accepted, Declined, Outcome, Payment, PaymentRequest, PaymentStatus, Problem, Receipt, Refund, RefundOutcome,
    RefundReceipt, RefundRequest, RefundStatus,
};

/// What every request says it is, so that keyfence's operators can tell
/// which client (and which version of it) sent what.
const USER_AGENT: &str = concat!(env!("CARGO_PKG_NAME"), "/", env!("CARGO_PKG_VERSION"));

/// Builds a [`Client`].
pub struct ClientBuilder {
    regions: Vec<String>,
    api_key: String,
    journal: Option<PathBuf>,
    deadline: Duration,
    attempt_timeout: Duration,
    min_delay: Duration,
    max_delay: Duration,
}

impl ClientBuilder {
    /// The journal file that keeps each operation's key (created if absent,
    /// readable by its owner only). The client holds it, exclusively, for
    /// as long as it lives.
    pub fn journal(mut self, path: impl Into<PathBuf>) -> Self {
        self.journal = Some(path.into());
        self
    }

    /// How long `pay` keeps trying before it answers `Pending` (default 60 s).
    pub fn deadline(mut self, deadline: Duration) -> Self {
        self.deadline = deadline;
        self
    }

    /// How long one attempt may take before it is abandoned and retried
    /// with the same key (default 10 s).
    pub fn attempt_timeout(mut self, timeout: Duration) -> Self {
        self.attempt_timeout = timeout;
        self
    }

    /// The shortest and longest pause between attempts (default 100 ms and
    /// 5 s). A `Retry-After` longer than the pause wins; one that reaches
    /// past the deadline ends the call with `Pending` at once, since waiting
    /// could only end there.
    pub fn backoff(mut self, min: Duration, max: Duration) -> Self {
        self.min_delay = min;
        self.max_delay = max.max(min);
        self
    }

    /// Checks the region URLs, opens the journal (if one was given) and
    /// makes the client.
    pub fn build(self) -> Result<Client, BuildError> {
        if self.regions.is_empty() {
            return Err(BuildError::NoRegions);
        }
        let regions: Vec<String> = self.regions.iter().map(|url| region::checked(url)).collect::<Result<_, _>>()?;
        let journal = self.journal.map(Journal::open).transpose()?;
        let mut http = reqwest::Client::builder()
            .timeout(self.attempt_timeout)
            .user_agent(USER_AGENT)
            // A redirect could lead the API key anywhere, plain http included.
            .redirect(reqwest::redirect::Policy::none());
        // Plain http is allowed to this machine only: never through a proxy
        // (HTTP_PROXY), which would carry the API key in clear off it.
        if regions.iter().any(|url| url.to_ascii_lowercase().starts_with("http://")) {
            http = http.no_proxy();
        }
        let http = http.build().map_err(BuildError::Http)?;
        Ok(Client {
            inner: Arc::new(Inner {
                regions,
                api_key: self.api_key,
                http,
                journal,
                deadline: self.deadline,
                backoff: ExponentialBuilder::default()
                    .with_min_delay(self.min_delay)
                    .with_max_delay(self.max_delay)
                    .with_jitter()
                    .without_max_times(),
                current: AtomicUsize::new(0),
            }),
        })
    }
}

/// Shows everything but the API key, so that a builder in a log line
/// gives nothing away.
impl fmt::Debug for ClientBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClientBuilder")
            .field("regions", &self.regions)
            .field("api_key", &"<redacted>")
            .field("journal", &self.journal)
            .field("deadline", &self.deadline)
            .field("attempt_timeout", &self.attempt_timeout)
            .field("backoff", &(self.min_delay..self.max_delay))
            .finish()
    }
}

/// A keyfence client. Cheap to clone; clones share the journal and the
/// region currently in use.
#[derive(Clone)]
pub struct Client {
    inner: Arc<Inner>,
}

struct Inner {
    regions: Vec<String>,
    api_key: String,
    http: reqwest::Client,
    journal: Option<Journal>,
    deadline: Duration,
    backoff: ExponentialBuilder,
    /// The region requests go to; moves on when one fails.
    current: AtomicUsize,
}

/// Shows the regions, the one in use and the journal, never the API key
/// (nor, through the journal, any idempotency key).
impl fmt::Debug for Client {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Client")
            .field("regions", &self.inner.regions)
            .field("region", &self.region())
            .field("api_key", &"<redacted>")
            .field("journal", &self.inner.journal)
            .field("deadline", &self.inner.deadline)
            .finish_non_exhaustive()
    }
}

/// What one attempt at the front door came to.
pub(crate) enum Step<T> {
    Done(T, bool),
    /// Worked on; poll this payment (or refund).
    Accepted(Uuid),
    /// Try again, after at least this long, here or in the next region.
    Retry {
        after: Option<Duration>,
        next_region: bool,
    },
}

/// A request the client sees through to its final outcome: how one
/// attempt is sent, how an accepted one is asked after, and what it is
/// when the deadline comes first.
pub(crate) trait Attempted: Sync {
    type Outcome: Send;

    fn attempt<'a>(
        &'a self,
        client: &'a Client,
        key: &'a str,
    ) -> impl Future<Output = Result<Step<Self::Outcome>, PayError>> + Send + 'a;

    fn poll<'a>(
        &'a self,
        client: &'a Client,
        id: Uuid,
    ) -> impl Future<Output = Result<Step<Self::Outcome>, PayError>> + Send + 'a;

    fn pending(id: Option<Uuid>) -> Self::Outcome;
}

impl Client {
    /// A client of one region with its journal at `journal`.
    pub fn new(base_url: &str, api_key: &str, journal: impl Into<PathBuf>) -> Result<Self, BuildError> {
        Self::builder([base_url], api_key).journal(journal).build()
    }

    /// A client of these regions, tried in order: `https` URLs, or `http`
    /// ones to this machine (checked by [`ClientBuilder::build`]).
    pub fn builder<I, S>(regions: I, api_key: &str) -> ClientBuilder
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        ClientBuilder {
            regions: regions.into_iter().map(|url| url.as_ref().to_owned()).collect(),
            api_key: api_key.to_owned(),
            journal: None,
            deadline: Duration::from_secs(60),
            attempt_timeout: Duration::from_secs(10),
            min_delay: Duration::from_millis(100),
            max_delay: Duration::from_secs(5),
        }
    }

    /// Pays `request` once for `operation`: the operation's key comes from
    /// the journal (made and journalled first if it is new), and every
    /// retry, in any region, after any crash, carries it.
    pub async fn pay(&self, request: &PaymentRequest, operation: &OperationId) -> Result<Receipt, PayError> {
        let journal = self.inner.journal.as_ref().ok_or(PayError::NoJournal)?;
        let key = journal.key_for(operation)?;
        self.pay_with_key(request, &key).await
    }

    /// Pays `request` under a key the caller derived and keeps itself (as
    /// the batch channel does from a file's lines). The same key must never
    /// carry a different request.
    pub async fn pay_with_key(&self, request: &PaymentRequest, key: &str) -> Result<Receipt, PayError> {
        let (outcome, replayed) = self.see_through(request, key).await?;
        Ok(Receipt { idempotency_key: key.to_owned(), outcome, replayed })
    }

    /// Refunds `request` of payment `payment_id` once for `operation` (the
    /// caller's name for this refund, kept in the journal as for `pay`).
    /// A refund beyond what is left of the payment is refused (`422`,
    /// [`PayError::Refused`]) with nothing kept: the same operation may
    /// refund later, once another refund of the payment is declined.
    pub async fn refund(
        &self,
        payment_id: Uuid,
        request: &RefundRequest,
        operation: &OperationId,
    ) -> Result<RefundReceipt, PayError> {
        let journal = self.inner.journal.as_ref().ok_or(PayError::NoJournal)?;
        let key = journal.key_for(operation)?;
        self.refund_with_key(payment_id, request, &key).await
    }

    /// Refunds under a key the caller derived and keeps itself.
    pub async fn refund_with_key(
        &self,
        payment_id: Uuid,
        request: &RefundRequest,
        key: &str,
    ) -> Result<RefundReceipt, PayError> {
        let (outcome, replayed) = self.see_through(&Refunding { payment_id, request }, key).await?;
        Ok(RefundReceipt { idempotency_key: key.to_owned(), outcome, replayed })
    }

    /// Sends `request` under `key` until its outcome is final or the
    /// deadline passes: retries with the same key, polls what was
    /// accepted, and moves to the next region when one fails.
    async fn see_through<R: Attempted>(&self, request: &R, key: &str) -> Result<(R::Outcome, bool), PayError> {
        // None: a deadline further off than the clock can count, so never.
        let deadline = Instant::now().checked_add(self.inner.deadline);
        let mut pauses = self.inner.backoff.build();
        // What keyfence said it is working on, and whether to poll it.
        let mut known: Option<Uuid> = None;
        let mut polling = false;
        loop {
            let step = match known.filter(|_| polling) {
                None => request.attempt(self, key).await?,
                Some(id) => request.poll(self, id).await?,
            };
            let (after, next_region) = match step {
                Step::Done(outcome, replayed) => return Ok((outcome, replayed)),
                Step::Accepted(id) => {
                    (known, polling) = (Some(id), true);
                    (None, false)
                }
                Step::Retry { after, next_region } => {
                    // What stopped answering to polls is asked for with its
                    // key again: that resumes it or replays it.
                    polling = false;
                    (after, next_region)
                }
            };
            if next_region {
                self.fail_over();
            }
            let pause = pauses.next().unwrap_or(self.inner.deadline).max(after.unwrap_or_default());
            let left = deadline.map_or(Duration::MAX, |deadline| deadline.saturating_duration_since(Instant::now()));
            if pause >= left {
                return Ok((R::pending(known), false));
            }
            tokio::time::sleep(pause).await;
        }
    }

    fn region(&self) -> &str {
        let regions = &self.inner.regions;
        &regions[self.inner.current.load(Ordering::Relaxed) % regions.len()]
    }

    fn fail_over(&self) {
        if self.inner.regions.len() > 1 {
            self.inner.current.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// POSTs `body` to `path` of the region in use under `key`.
    async fn post(&self, path: &str, key: &str, body: &impl serde::Serialize) -> Result<Response, reqwest::Error> {
        let url = format!("{}{path}", self.region());
        let request = self.inner.http.post(url).bearer_auth(&self.inner.api_key).header("Idempotency-Key", key);
        request.json(body).send().await
    }

    /// GETs `path` of the region in use and reads its 200 as a `T`; else
    /// what to do.
    async fn read<T: serde::de::DeserializeOwned, S>(&self, path: &str) -> Result<T, Step<S>> {
        let response = self.get(path).await?;
        answer::json::<T>(response).await.ok_or(Step::Retry { after: None, next_region: false })
    }

    /// GETs `path` of the region in use: `Ok` with a 200, else what to do.
    async fn get<T>(&self, path: &str) -> Result<Response, Step<T>> {
        let asked =
            self.inner.http.get(format!("{}{path}", self.region())).bearer_auth(&self.inner.api_key).send().await;
        match asked {
            Ok(response) if response.status() == StatusCode::OK => Ok(response),
            Ok(response) => {
                let next_region = response.status() == StatusCode::SERVICE_UNAVAILABLE;
                let after = answer::retry_after(response.headers(), SystemTime::now());
                Err(Step::Retry { after, next_region })
            }
            Err(e) => Err(unanswered(&e)),
        }
    }
}

impl Attempted for PaymentRequest {
    type Outcome = Outcome;

    async fn attempt(&self, client: &Client, key: &str) -> Result<Step<Outcome>, PayError> {
        let response = match client.post("/v1/payments", key, self).await {
            Ok(response) => response,
            // Refused, reset or timed out: the attempt may or may not have
            // reached keyfence, which is why the retry carries the same key.
            Err(e) => return Ok(unanswered(&e)),
        };
        let replayed = response.headers().contains_key("idempotent-replayed");
        let status = response.status();
        let after = answer::retry_after(response.headers(), SystemTime::now());
        Ok(match status.as_u16() {
            200 | 201 => match answer::json::<Payment>(response).await {
                Some(payment) => Step::Done(Outcome::Succeeded { payment }, replayed),
                None => Step::Retry { after: None, next_region: false },
            },
            202 => accepted(response).await,
            402 => {
                let (payment_id, reason) = declined(response).await;
                Step::Done(Outcome::Rejected { payment_id, reason }, replayed)
            }
            422 => return Err(PayError::KeyReused { key: key.to_owned(), detail: detail(response).await }),
            _ => other(status, after, response).await?,
        })
    }

    /// Asks how a payment that answered `202` stands.
    async fn poll(&self, client: &Client, id: Uuid) -> Result<Step<Outcome>, PayError> {
        let payment: Payment = match client.read(&format!("/v1/payments/{id}")).await {
            Ok(payment) => payment,
            Err(step) => return Ok(step),
        };
        Ok(match payment.status {
            PaymentStatus::Succeeded => Step::Done(Outcome::Succeeded { payment }, false),
            PaymentStatus::Rejected => {
                let reason = payment.reason.clone().unwrap_or_else(|| "declined".into());
                Step::Done(Outcome::Rejected { payment_id: Some(payment.id), reason }, false)
            }
            PaymentStatus::Pending | PaymentStatus::Indeterminate => Step::Accepted(id),
            // Voided here because another region finished it, or a status
            // this version does not know: the key's answer says how it stands.
            PaymentStatus::Voided | PaymentStatus::Unknown => Step::Retry { after: None, next_region: false },
        })
    }

    fn pending(payment_id: Option<Uuid>) -> Outcome {
        Outcome::Pending { payment_id }
    }
}

/// A refund of one payment, as the client sends it.
struct Refunding<'a> {
    payment_id: Uuid,
    request: &'a RefundRequest,
}

impl Attempted for Refunding<'_> {
    type Outcome = RefundOutcome;

    async fn attempt(&self, client: &Client, key: &str) -> Result<Step<RefundOutcome>, PayError> {
        let path = format!("/v1/payments/{}/refunds", self.payment_id);
        let response = match client.post(&path, key, self.request).await {
            Ok(response) => response,
            Err(e) => return Ok(unanswered(&e)),
        };
        let replayed = response.headers().contains_key("idempotent-replayed");
        let status = response.status();
        let after = answer::retry_after(response.headers(), SystemTime::now());
        Ok(match status.as_u16() {
            200 | 201 => match answer::json::<Refund>(response).await {
                Some(refund) => Step::Done(RefundOutcome::Succeeded { refund }, replayed),
                None => Step::Retry { after: None, next_region: false },
            },
            202 => accepted(response).await,
            402 => {
                let (refund_id, reason) = declined(response).await;
                Step::Done(RefundOutcome::Rejected { refund_id, reason }, replayed)
            }
            // A refund has more than one 422: only one is a reused key.
            422 => {
                let problem = answer::json::<Problem>(response).await;
                let detail = problem.as_ref().and_then(|p| p.detail.clone()).unwrap_or_else(|| status.to_string());
                if problem.and_then(|p| p.kind).is_some_and(|kind| kind.ends_with(":idempotency-key-reused")) {
                    return Err(PayError::KeyReused { key: key.to_owned(), detail });
                }
                return Err(PayError::Refused { status: 422, detail });
            }
            _ => other(status, after, response).await?,
        })
    }

    /// Asks how a refund that answered `202` stands.
    async fn poll(&self, client: &Client, id: Uuid) -> Result<Step<RefundOutcome>, PayError> {
        let refund: Refund = match client.read(&format!("/v1/refunds/{id}")).await {
            Ok(refund) => refund,
            Err(step) => return Ok(step),
        };
        Ok(match refund.status {
            RefundStatus::Succeeded => Step::Done(RefundOutcome::Succeeded { refund }, false),
            RefundStatus::Rejected => {
                let reason = refund.decline_reason.clone().unwrap_or_else(|| "declined".into());
                Step::Done(RefundOutcome::Rejected { refund_id: Some(refund.id), reason }, false)
            }
            RefundStatus::Pending | RefundStatus::Indeterminate => Step::Accepted(id),
            RefundStatus::Voided | RefundStatus::Unknown => Step::Retry { after: None, next_region: false },
        })
    }

    fn pending(refund_id: Option<Uuid>) -> RefundOutcome {
        RefundOutcome::Pending { refund_id }
    }
}

/// A `202`: poll what it names.
async fn accepted<T>(response: Response) -> Step<T> {
    match answer::json::<Accepted>(response).await {
        Some(accepted) => Step::Accepted(accepted.id),
        None => Step::Retry { after: None, next_region: false },
    }
}

/// A `402`'s id and reason code (or, failing that, its explanation).
async fn declined(response: Response) -> (Option<Uuid>, String) {
    let declined: Option<Declined> = answer::json(response).await;
    declined
        .map(|d| (d.id, d.reason.or(d.detail).unwrap_or_else(|| "declined".into())))
        .unwrap_or((None, "declined".into()))
}

/// Every other answer: retried, or refused for good.
async fn other<T>(status: StatusCode, after: Option<Duration>, response: Response) -> Result<Step<T>, PayError> {
    Ok(match status.as_u16() {
        409 | 429 | 408 => Step::Retry { after, next_region: false },
        503 => Step::Retry { after, next_region: true },
        300..=499 => return Err(PayError::Refused { status: status.as_u16(), detail: detail(response).await }),
        _ => Step::Retry { after, next_region: false },
    })
}

/// A request that got no answer is tried again; a region that refuses the
/// connection or stops answering is left for the next.
fn unanswered<T>(error: &reqwest::Error) -> Step<T> {
    Step::Retry { after: None, next_region: error.is_connect() || error.is_timeout() }
}

/// A refusal's explanation, from its problem+json body.
async fn detail(response: Response) -> String {
    let status = response.status();
    match answer::json::<Problem>(response).await {
        Some(problem) => problem.detail.or(problem.title).unwrap_or_else(|| status.to_string()),
        None => status.to_string(),
    }
}
