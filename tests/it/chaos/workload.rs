//! The clients of a chaos run. Each follows stories drawn from its own
//! seeded stream: pay under a fresh key; then perhaps refund in parts (some
//! asking for more than is left); perhaps have the rail return the payment
//! and ask for a refund again; and now and then resend one of its own
//! finished keys with another client's account, in a burst aimed at the
//! instant the key expires. Every request is retried over random instances
//! of both regions until its answer is final, as a client that keeps its
//! key does, and every answer it got is kept.

use std::time::{Duration, Instant};

use futures::future::join_all;
use keyfence::domain::{IdempotencyKey, ScopedKey};
use keyfence::keystore::KeyStore;
use reqwest::StatusCode;
use serde_json::{Value, json};

use super::journal::Journal;
use super::stack::{GRACE, INSTANCES, RETENTION, Stack};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Payment,
    Refund,
    /// A client's own key resent with another client's account.
    Stolen,
}

/// One request as its client made it, and every answer it got that was
/// not "try again".
pub struct Request {
    pub client: usize,
    pub kind: Kind,
    pub key: String,
    pub path: String,
    pub body: Value,
    pub answers: Vec<(StatusCode, Vec<u8>)>,
    /// When the last of them came.
    pub answered_at: Option<Instant>,
}

impl Request {
    fn new(client: usize, kind: Kind, key: String, path: String, body: Value) -> Self {
        Self { client, kind, key, path, body, answers: Vec::new(), answered_at: None }
    }

    pub fn last(&self) -> Option<&(StatusCode, Vec<u8>)> {
        self.answers.last()
    }
}

/// What the clients did.
#[derive(Default)]
pub struct Done {
    pub requests: Vec<Request>,
    /// Derived keys of payment instructions the rail was asked to return.
    pub returned: Vec<String>,
    /// Answers asked for again while their keys were kept, and the same.
    pub replayed: usize,
    /// Answers that came back different when asked for again.
    pub changed: Vec<String>,
}

/// Answers after which a client stops retrying.
fn is_final(status: StatusCode) -> bool {
    matches!(status.as_u16(), 200 | 201 | 400..=404 | 422)
}

/// Runs every client's stories until `until`; each ends the story it is in.
pub async fn run(stack: &Stack, seed: u64, until: Instant, journal: &Journal) -> Done {
    let clients = join_all((0..stack.clients.len()).map(|c| client(stack, seed, c, until, journal))).await;
    clients.into_iter().fold(Done::default(), |mut all, done| {
        all.requests.extend(done.requests);
        all.returned.extend(done.returned);
        all.replayed += done.replayed;
        all.changed.extend(done.changed);
        all
    })
}

/// Asks again, with patience, every payment and refund that has no final
/// answer yet (faults healed).
pub async fn finish(stack: &Stack, done: &mut Done, journal: &Journal) {
    let mut rng = fastrand::Rng::with_seed(0);
    for request in done.requests.iter_mut().filter(|r| r.kind != Kind::Stolen && r.last().is_none()) {
        settle(stack, &mut rng, request, Duration::from_secs(60), journal).await;
    }
}

async fn client(stack: &Stack, seed: u64, c: usize, until: Instant, journal: &Journal) -> Done {
    // Each story draws from a stream of its own, so one more retry (which
    // draws from `retries`) changes nothing in the stories after it.
    let mut retries = fastrand::Rng::with_seed(seed ^ (c as u64).rotate_right(8) ^ 0x7265_7472_6965_7300);
    let mut done = Done::default();
    let mut paid: Vec<(String, Value)> = Vec::new();
    for n in 0_u64.. {
        if Instant::now() >= until {
            break;
        }
        let mut rng = fastrand::Rng::with_seed(seed.wrapping_mul(1_000_003) ^ ((c as u64) << 40) ^ n);
        if !paid.is_empty() && rng.u8(0..100) < 10 {
            let (key, original) = paid[rng.usize(0..paid.len())].clone();
            steal(stack, &mut rng, c, &key, &original, &mut done, journal).await;
            continue;
        }
        let amount = [1000, 2500, 4000][rng.usize(0..3)];
        let end_to_end_id = format!("E2E-S{seed}-C{c}-{n}");
        let body = json!({
            "amount_minor": amount,
            "currency": "EUR",
            "debtor_account": stack.clients[c].account,
            "creditor_account": "FR1420041010050500013M02606",
            "end_to_end_id": end_to_end_id,
        });
        let key = format!("s{seed}-c{c}-p{n}");
        let mut payment = Request::new(c, Kind::Payment, key, "/v1/payments".into(), body);
        settle(stack, &mut retries, &mut payment, Duration::from_secs(90), journal).await;
        let mut story = Vec::new();
        let id = match payment.last() {
            Some((StatusCode::CREATED, bytes)) => serde_json::from_slice::<Value>(bytes).ok().map(|v| v["id"].clone()),
            _ => None,
        };
        if let Some(Value::String(id)) = id {
            paid.push((payment.key.clone(), payment.body.clone()));
            let refund = |r: usize, amount: i64| {
                let (key, path) = (format!("{}-r{r}", payment.key), format!("/v1/payments/{id}/refunds"));
                Request::new(c, Kind::Refund, key, path, json!({ "amount_minor": amount }))
            };
            let mut parts = 0;
            if rng.bool() {
                for _ in 0..rng.usize(1..4) {
                    let mut asked = refund(parts, rng.i64(amount / 5..=amount / 2));
                    settle(stack, &mut retries, &mut asked, Duration::from_secs(90), journal).await;
                    story.push(asked);
                    parts += 1;
                }
            }
            if rng.u8(0..100) < 25 && ask_return(stack, &end_to_end_id, amount, &mut done, journal).await {
                tokio::time::sleep(Duration::from_millis(rng.u64(0..1500))).await;
                let mut asked = refund(parts, rng.i64(1..=amount / 5));
                settle(stack, &mut retries, &mut asked, Duration::from_secs(90), journal).await;
                story.push(asked);
            }
        }
        story.push(payment);
        for request in &story {
            ask_again(stack, &mut retries, request, &mut done, journal).await;
        }
        done.requests.extend(story);
        tokio::time::sleep(Duration::from_millis(rng.u64(50..300))).await;
    }
    done
}

/// Sends `request` to random instances until its answer is final or
/// `patience` runs out; keeps every answer that is not "try again".
async fn settle(stack: &Stack, rng: &mut fastrand::Rng, request: &mut Request, patience: Duration, journal: &Journal) {
    let deadline = Instant::now() + patience;
    let client = &stack.clients[request.client];
    while Instant::now() < deadline {
        let url = stack.url(rng.usize(0..INSTANCES.len()));
        let sent = stack
            .app
            .http
            .post(format!("{url}{}", request.path))
            .bearer_auth(&client.api_key)
            .header("Idempotency-Key", &request.key)
            .json(&request.body)
            .send();
        if let Ok(Ok(answer)) = tokio::time::timeout(Duration::from_secs(2), sent).await {
            let status = answer.status();
            if is_final(status)
                && let Ok(bytes) = answer.bytes().await
            {
                journal.note(format!("{:?} {} from {url}: {status}", request.kind, request.key));
                request.answers.push((status, bytes.to_vec()));
                request.answered_at = Some(Instant::now());
                return;
            }
        }
        tokio::time::sleep(Duration::from_millis(rng.u64(100..300))).await;
    }
    journal.note(format!("{:?} {}: no final answer within {patience:?}", request.kind, request.key));
}

/// Sends an answered request again, to any instance, while its key is
/// surely kept (within half the retention of its answer): an answer that
/// was stored (its key is kept) must come back as the same bytes.
async fn ask_again(stack: &Stack, rng: &mut fastrand::Rng, request: &Request, done: &mut Done, journal: &Journal) {
    let (Some(first), Some(at)) = (request.last(), request.answered_at) else { return };
    if at.elapsed() > RETENTION / 2
        || stack.kept_for(request.client, &request.key).await.is_none_or(|left| left < Duration::from_secs(8))
    {
        return;
    }
    let (key, path) = (request.key.clone(), request.path.clone());
    let mut again = Request::new(request.client, request.kind, key, path, request.body.clone());
    settle(stack, rng, &mut again, Duration::from_secs(5), journal).await;
    match again.last() {
        None => {}
        Some(answer) if answer == first => done.replayed += 1,
        Some((status, bytes)) => done.changed.push(format!(
            "{:?} {}: answered {} {}, then {status} {}",
            request.kind,
            request.key,
            first.0,
            String::from_utf8_lossy(&first.1),
            String::from_utf8_lossy(bytes)
        )),
    }
}

/// Has the rail return the payment `end_to_end_id`, whichever region sent
/// it (the rails notify region A alone, which hands on what is B's);
/// whether it asked.
async fn ask_return(stack: &Stack, end_to_end_id: &str, amount: i64, done: &mut Done, journal: &Journal) -> bool {
    let statement = stack.app.e2.statement().await;
    let Some(applied) = statement.iter().find(|a| a.end_to_end_id == end_to_end_id && a.amount_minor == amount) else {
        return false;
    };
    let url = format!("{}/v1/returns", stack.app.e2.url);
    let asked = stack.app.http.put(url).json(&json!({ "idempotency_key": applied.idempotency_key })).send().await;
    let returned = asked.is_ok_and(|r| r.status().is_success());
    if returned {
        journal.note(format!("return: {end_to_end_id} ({})", applied.idempotency_key));
        done.returned.push(applied.idempotency_key.clone());
    }
    returned
}

/// Resends client `c`'s finished `key` with another client's account in a
/// burst around the instant the key is first counted as gone.
async fn steal(
    stack: &Stack,
    rng: &mut fastrand::Rng,
    c: usize,
    key: &str,
    original: &Value,
    done: &mut Done,
    journal: &Journal,
) {
    let scoped = ScopedKey::new(stack.clients[c].id, IdempotencyKey::parse(key).unwrap());
    let Ok(Some(item)) = stack.app.keys.store.get(&scoped).await else { return };
    let Some(expires_at) = item.expires_at else { return };
    let gone_at = (expires_at + 1) * 1000 + GRACE.as_millis() as u64;
    let now = keyfence::domain::Millis::now().get();
    if gone_at < now + 500 || gone_at > now + 25_000 {
        return;
    }
    let victim = &stack.clients[(c + 1 + rng.usize(0..stack.clients.len() - 1)) % stack.clients.len()];
    let mut body = original.clone();
    body["debtor_account"] = json!(victim.account);
    journal.note(format!("steal: {key} with {}'s account, at {gone_at}", victim.account));
    // 60 requests 5 ms apart, from 150 ms before the instant.
    tokio::time::sleep(Duration::from_millis(gone_at - now - 150)).await;
    let targets: Vec<usize> = (0..60).map(|_| rng.usize(0..INSTANCES.len())).collect();
    let burst = join_all(targets.into_iter().enumerate().map(|(i, target)| {
        let (url, body) = (stack.url(target), body.clone());
        async move {
            tokio::time::sleep(Duration::from_millis(5 * i as u64)).await;
            let sent = stack
                .app
                .http
                .post(format!("{url}/v1/payments"))
                .bearer_auth(&stack.clients[c].api_key)
                .header("Idempotency-Key", key)
                .json(&body)
                .send();
            match tokio::time::timeout(Duration::from_secs(2), sent).await {
                Ok(Ok(answer)) => Some((answer.status(), answer.bytes().await.unwrap_or_default().to_vec())),
                _ => None,
            }
        }
    }))
    .await;
    let answers: Vec<_> = burst.into_iter().flatten().collect();
    let statuses: Vec<u16> = answers.iter().map(|(s, _)| s.as_u16()).collect();
    journal.note(format!("steal: {key} answered {statuses:?}"));
    let mut stolen = Request::new(c, Kind::Stolen, key.to_owned(), "/v1/payments".into(), body);
    stolen.answers = answers;
    done.requests.push(stolen);
}
