//! `keyfence bench`: measures a running front door. It sends N payments
//! with distinct keys at concurrency C, then replays all N, and in the same
//! run measures the floor: a bare loop doing only what a payment must do
//! (a claim and a finish in the key store, three PostgreSQL transactions,
//! one call to each rail), so the front door's own overhead is the ratio of
//! the two. Figures go to a JSON file and a table on stdout; a progress bar
//! shows on a terminal.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;
use serde_json::json;
use uuid::Uuid;

use crate::domain::{ClientId, IdempotencyKey, Millis, Owner, RequestHash, ScopedKey, StoredResponse};
use crate::keystore::{Claim, DynamoKeyStore, Finish, KeyStore, Lease};
use crate::ledger::Ledger;
use crate::rail::{CallOutcome, Instruction, RailClient};

use super::percentile;

/// Where and how hard to push.
pub struct BenchPlan {
    pub url: String,
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
}

#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub requests: usize,
    pub concurrency: usize,
    pub payments: Figures,
    pub replays: Figures,
    pub floor: Figures,
    /// Front-door p50 latency over the floor's.
    pub p50_over_floor: f64,
    /// Floor throughput over the front door's.
    pub throughput_floor_over_payments: f64,
}

/// Runs the three measurements.
pub async fn run(plan: &BenchPlan, floor: &Floor) -> Report {
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
    let payments = measure("payments", plan, send).await;
    let replays = measure("replays", plan, send).await;
    let client = ClientId::generate();
    let floor = measure("floor", plan, |i| floor_loop(floor, client, i)).await;
    Report {
        requests: plan.requests,
        concurrency: plan.concurrency,
        p50_over_floor: payments.p50_ms / floor.p50_ms.max(f64::EPSILON),
        throughput_floor_over_payments: floor.per_second / payments.per_second.max(f64::EPSILON),
        payments,
        replays,
        floor,
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
        payment_id: Uuid::now_v7(),
        owner: Owner::attempt_of("bench"),
        home_region: "bench".into(),
        lease: Lease { now, length: Duration::from_secs(10) },
    };
    let item = floor.keys.claim(&claim).await.map_err(|e| e.to_string())?;
    for _ in 0..3 {
        let mut tx = floor.ledger.pool().begin().await.map_err(|e| e.to_string())?;
        sqlx::query("SELECT pg_current_xact_id()").execute(&mut *tx).await.map_err(|e| e.to_string())?;
        tx.commit().await.map_err(|e| e.to_string())?;
    }
    let instruction = Instruction {
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
    }
}

impl Report {
    /// A table for people.
    pub fn table(&self) -> String {
        let mut out = format!("{} requests at concurrency {}\n", self.requests, self.concurrency);
        out += &format!("{:<9} {:>9} {:>9} {:>9} {:>8}  statuses\n", "", "req/s", "p50 ms", "p99 ms", "failed");
        for f in [&self.payments, &self.replays, &self.floor] {
            out += &format!(
                "{:<9} {:>9.1} {:>9.2} {:>9.2} {:>8}  {:?}\n",
                f.label, f.per_second, f.p50_ms, f.p99_ms, f.failures, f.statuses
            );
        }
        out += &format!(
            "payment p50 is {:.2}x the floor's; the floor's throughput is {:.2}x the front door's\n",
            self.p50_over_floor, self.throughput_floor_over_payments
        );
        out
    }
}
