//! `keyfence bench`: measures a running front door. It sends N payments
//! with distinct keys at concurrency C, then replays all N, and in the same
//! run measures two floors: a bare loop doing only what a payment must do
//! (a claim and a finish in the key store, three PostgreSQL transactions,
//! one call to each rail), and the raw replay floor (one key-store round
//! trip of the kind a replay makes on an instance that has not seen its
//! answer: a claim of an existing key, answered with the item), so the
//! front door's own overhead is the ratio of each pair. The serve process's
//! CPU time per request comes from its own `/metrics`
//! (`process_cpu_seconds_total`, read before and after each phase). Figures
//! go to a JSON file and a table on stdout; a progress bar shows on a
//! terminal.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;
use serde_json::json;
use uuid::Uuid;

use keyfence::domain::{ClientId, IdempotencyKey, Millis, Owner, RequestHash, ScopedKey, StoredResponse};
use keyfence::keystore::{Claim, DynamoKeyStore, Finish, KeyStore, Lease};
use keyfence::ledger::Ledger;
use keyfence::rail::{CallOutcome, Instruction, RailClient};

use super::percentile;

/// Where and how hard to push.
pub struct BenchPlan {
    pub url: String,
    /// Its admin listener (for serve's CPU time).
    pub admin_url: String,
    pub api_key: String,
    pub requests: usize,
    pub concurrency: usize,
}

/// The parts the floor loop talks to directly.
pub struct Floor {
    pub keys: DynamoKeyStore,
    pub ledger: Ledger,
    pub e1: RailClient,
    pub e2: RailClient,
}

#[derive(Debug, Clone, Serialize)]
pub struct Figures {
    pub label: &'static str,
    pub requests: usize,
    pub failures: usize,
    pub seconds: f64,
    pub per_second: f64,
    pub p50_ms: f64,
    pub p99_ms: f64,
    /// Answers by HTTP status (the floor counts 200 for a completed loop).
    pub statuses: BTreeMap<u16, usize>,
    /// CPU time the serve process spent per request (front-door phases only).
    pub serve_cpu_ms_per_request: Option<f64>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub requests: usize,
    pub concurrency: usize,
    pub payments: Figures,
    pub replays: Figures,
    pub floor: Figures,
    pub replay_floor: Figures,
    /// Front-door p50 latency over the floor's.
    pub p50_over_floor: f64,
    /// The front door's throughput over the floor's (1.0: no overhead).
    pub payments_over_floor: f64,
    /// Replay throughput over the raw replay floor's.
    pub replays_over_floor: f64,
}

/// Every run of one `keyfence bench`, one per concurrency, and where it ran.
#[derive(Debug, Clone, Serialize)]
pub struct Sweep {
    pub machine: super::Machine,
    pub runs: Vec<Report>,
}

/// Runs the four measurements at one concurrency.
pub async fn run(plan: &BenchPlan, stack: &Floor) -> Report {
    let http = reqwest::Client::new();
    let batch = Uuid::new_v4().simple().to_string();
    let send = |i: usize| {
        let request = http
            .post(format!("{}/v1/payments", plan.url))
            .bearer_auth(&plan.api_key)
            .header("Idempotency-Key", format!("bench-{batch}-{i}"))
            .json(&json!({
                "amount_minor": 100 + i as i64,
                "currency": "EUR",
                "debtor_account": "DE89370400440532013000",
                "creditor_account": "FR1420041010050500013M02606",
                "end_to_end_id": format!("BENCH-{i}"),
            }));
        async move { request.send().await.map(|r| r.status().as_u16()).map_err(|e| e.to_string()) }
    };
    let cpu = || serve_cpu_seconds(&http, &plan.admin_url);
    let before = cpu().await;
    let mut payments = measure("payments", plan, send).await;
    let between = cpu().await;
    let mut replays = measure("replays", plan, send).await;
    let after = cpu().await;
    let per_request =
        |from: Option<f64>, to: Option<f64>, f: &Figures| Some((to? - from?) * 1000.0 / f.requests.max(1) as f64);
    payments.serve_cpu_ms_per_request = per_request(before, between, &payments);
    replays.serve_cpu_ms_per_request = per_request(between, after, &replays);
    let client = ClientId::generate();
    let floor = measure("floor", plan, |i| floor_loop(stack, client, i)).await;
    let replay_floor = measure("replay floor", plan, |i| replay_floor_loop(stack, client, i)).await;
    let ratio = |a: &Figures, b: &Figures| a.per_second / b.per_second.max(f64::EPSILON);
    Report {
        requests: plan.requests,
        concurrency: plan.concurrency,
        p50_over_floor: payments.p50_ms / floor.p50_ms.max(f64::EPSILON),
        payments_over_floor: ratio(&payments, &floor),
        replays_over_floor: ratio(&replays, &replay_floor),
        payments,
        replays,
        floor,
        replay_floor,
    }
}

/// The serve process's CPU seconds so far, from its `/metrics`.
async fn serve_cpu_seconds(http: &reqwest::Client, url: &str) -> Option<f64> {
    let text = http.get(format!("{url}/metrics")).send().await.ok()?.text().await.ok()?;
    text.lines().find_map(|line| line.strip_prefix("process_cpu_seconds_total ")?.trim().parse().ok())
}

/// One key-store round trip of the kind a replay makes: a claim of a key
/// that exists (the floor loop made it), answered with the item.
async fn replay_floor_loop(floor: &Floor, client: ClientId, i: usize) -> Result<u16, String> {
    let key = ScopedKey::new(client, IdempotencyKey::parse(&format!("floor-{i}")).map_err(|e| e.to_string())?);
    let claim = Claim {
        key,
        request_hash: RequestHash::from_hex(String::new()),
        request: Vec::new(),
        operation: "payment".into(),
        payment_id: Uuid::now_v7(),
        owner: Owner::attempt_of("bench"),
        home_region: "bench".into(),
        lease: Lease { now: Millis::now(), length: Duration::from_secs(10) },
        gone_before: Millis::now(),
    };
    match floor.keys.claim(&claim).await {
        Err(keyfence::keystore::KeyStoreError::Taken(Some(_))) => Ok(200),
        Ok(_) => Err("the key did not exist".into()),
        Err(e) => Err(e.to_string()),
    }
}

/// The irreducible work of one payment, with none of keyfence's logic.
async fn floor_loop(floor: &Floor, client: ClientId, i: usize) -> Result<u16, String> {
    let key = ScopedKey::new(client, IdempotencyKey::parse(&format!("floor-{i}")).map_err(|e| e.to_string())?);
    let now = Millis::now();
    let claim = Claim {
        key: key.clone(),
        request_hash: RequestHash::from_hex(String::new()),
        request: Vec::new(),
        operation: "payment".into(),
        payment_id: Uuid::now_v7(),
        owner: Owner::attempt_of("bench"),
        home_region: "bench".into(),
        lease: Lease { now, length: Duration::from_secs(10) },
        gone_before: now,
    };
    let item = floor.keys.claim(&claim).await.map_err(|e| e.to_string())?;
    for _ in 0..3 {
        let mut tx = floor.ledger.pool().begin().await.map_err(|e| e.to_string())?;
        sqlx::query("SELECT pg_current_xact_id()").execute(&mut *tx).await.map_err(|e| e.to_string())?;
        tx.commit().await.map_err(|e| e.to_string())?;
    }
    let instruction = Instruction {
        originator: client.to_string(),
        end_to_end_id: format!("FLOOR-{i}"),
        amount_minor: 1,
        currency: "EUR".into(),
        debtor_account: "D".into(),
        creditor_account: "C".into(),
    };
    for rail in [&floor.e1, &floor.e2] {
        if let CallOutcome::NotApplied(why) | CallOutcome::Unknown(why) =
            rail.send(&Uuid::new_v4().simple().to_string(), &instruction).await
        {
            return Err(why);
        }
    }
    let response = StoredResponse { status: 201, headers: BTreeMap::new(), body: b"{}".to_vec() };
    let finish = Finish { response, expires_at: now.plus(Duration::from_secs(3600)) };
    floor.keys.finish(&key, &item.holder(), &finish).await.map_err(|e| e.to_string())?;
    Ok(200)
}

/// Runs `one(i)` for i in 0..N on C workers and summarises the latencies.
async fn measure<F, Fut>(label: &'static str, plan: &BenchPlan, one: F) -> Figures
where
    F: Fn(usize) -> Fut + Sync,
    Fut: Future<Output = Result<u16, String>>,
{
    let progress = ProgressBar::new(plan.requests as u64).with_message(label);
    progress.set_style(
        ProgressStyle::with_template("{msg:>9} [{bar:40}] {pos}/{len} {per_sec} eta {eta}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let next = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let workers = (0..plan.concurrency.max(1)).map(|_| {
        let (next, progress, one) = (next.clone(), progress.clone(), &one);
        async move {
            let mut seen = Vec::new();
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= plan.requests {
                    return seen;
                }
                let t = Instant::now();
                let outcome = one(i).await;
                seen.push((t.elapsed(), outcome));
                progress.inc(1);
            }
        }
    });
    let results: Vec<_> = futures::future::join_all(workers).await.into_iter().flatten().collect();
    let seconds = started.elapsed().as_secs_f64();
    progress.finish_and_clear();

    let mut latencies: Vec<Duration> = results.iter().map(|(d, _)| *d).collect();
    latencies.sort();
    let mut statuses = BTreeMap::new();
    let mut failures = 0;
    for (_, outcome) in &results {
        match outcome {
            Ok(status) => *statuses.entry(*status).or_insert(0) += 1,
            Err(why) => {
                failures += 1;
                tracing::warn!(label, error = %why, "bench request failed");
            }
        }
    }
    Figures {
        label,
        requests: results.len(),
        failures,
        seconds,
        per_second: results.len() as f64 / seconds.max(f64::EPSILON),
        p50_ms: percentile(&latencies, 0.50),
        p99_ms: percentile(&latencies, 0.99),
        statuses,
        serve_cpu_ms_per_request: None,
    }
}

impl Report {
    /// A table for people.
    pub fn table(&self) -> String {
        let mut out = format!("{} requests at concurrency {}\n", self.requests, self.concurrency);
        out += &format!(
            "{:<12} {:>9} {:>9} {:>9} {:>8} {:>12}  statuses\n",
            "", "req/s", "p50 ms", "p99 ms", "failed", "cpu ms/req"
        );
        for f in [&self.payments, &self.replays, &self.floor, &self.replay_floor] {
            let cpu = f.serve_cpu_ms_per_request.map_or_else(|| "-".to_owned(), |ms| format!("{ms:.3}"));
            out += &format!(
                "{:<12} {:>9.1} {:>9.2} {:>9.2} {:>8} {:>12}  {:?}\n",
                f.label, f.per_second, f.p50_ms, f.p99_ms, f.failures, cpu, f.statuses
            );
        }
        out += &format!(
            "payments run at {:.2}x the floor's throughput (p50 {:.2}x); replays at {:.2}x the replay floor's\n",
            self.payments_over_floor, self.p50_over_floor, self.replays_over_floor
        );
        out
    }
}
