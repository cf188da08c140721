//! `keyfence bench`: measures a running front door. It sends N payments
//! with distinct keys at concurrency C and replays all N, to the instance
//! that worked them (which replays from memory) and, when given one, to a
//! second instance that has not seen them (which asks the key store). In
//! the same run it measures the two floors of [`super::floor`]: a bare
//! loop doing only what a payment must do, and one key-store round trip of
//! the kind a replay makes on an instance that has not seen its answer, so
//! the front door's own overhead is the ratio of each pair; and both floors
//! again behind HTTP ([`super::http_floor`]), which splits that overhead
//! into what HTTP costs and what keyfence's own work does. CPU per request
//! is the working process's: serve's from its own `/metrics`
//! (`process_cpu_seconds_total`), the floors' from this process's
//! `/proc/self/stat`, the HTTP floors' from their server's threads, each
//! read before and after its phase, with PostgreSQL's and the whole
//! machine's beside them ([`super::cpu`]). Figures go to a JSON file and a
//! table on stdout; a progress bar shows on a terminal.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;
use uuid::Uuid;

use keyfence::domain::ClientId;

use super::floor::{self, Floor};
use super::http_floor::{HttpFloor, Loop};
use super::{cpu, percentile};

/// Where and how hard to push.
pub struct BenchPlan {
    /// The instance that works the payments.
    pub serve: Instance,
    /// A second instance of the same stack, for replays it has not seen.
    pub cold: Option<Instance>,
    pub api_key: String,
    pub requests: usize,
    pub concurrency: usize,
    /// Measure the floors before the front door (runs alternate, so that a
    /// store slowing as it fills weighs on both sides alike).
    pub floors_first: bool,
}

/// One serve process: its API and its admin listener (for its CPU time).
#[derive(Debug, Clone)]
pub struct Instance {
    pub url: String,
    pub admin_url: String,
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
    /// Answers by HTTP status (the bare floors count 200 for a completed
    /// iteration).
    pub statuses: BTreeMap<u16, usize>,
    /// CPU time per request of what does the work: serve for the front
    /// door, this process for the bare floors, their server's threads for
    /// the floors behind HTTP.
    pub cpu_ms_per_request: Option<f64>,
    /// What every PostgreSQL process spent per request meanwhile.
    pub postgres_cpu_ms_per_request: Option<f64>,
    /// The whole machine's busy CPU per request meanwhile: serve, this
    /// process, PostgreSQL, the key store's emulator and the rails.
    pub machine_cpu_ms_per_request: Option<f64>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub requests: usize,
    pub concurrency: usize,
    pub payments: Figures,
    /// Replays answered by the instance that worked them, from memory.
    pub replays: Figures,
    /// Replays answered by an instance that had not seen them.
    pub cold_replays: Option<Figures>,
    pub floor: Figures,
    pub replay_floor: Figures,
    /// The floor loop behind HTTP ([`super::http_floor`]), with its
    /// server's CPU per iteration.
    pub http_floor: Figures,
    /// The replay floor behind HTTP.
    pub http_replay_floor: Figures,
}

impl Report {
    /// The figures of what the front door answered: payments, replays from
    /// memory, and cold replays when measured.
    pub fn front_door(&self) -> impl Iterator<Item = &Figures> {
        [Some(&self.payments), Some(&self.replays), self.cold_replays.as_ref()].into_iter().flatten()
    }

    /// Front-door p50 latency over the floor's.
    pub fn p50_over_floor(&self) -> f64 {
        self.payments.p50_ms / self.floor.p50_ms.max(f64::EPSILON)
    }

    /// The front door's throughput over the floor's (1.0: no overhead).
    pub fn payments_over_floor(&self) -> f64 {
        throughput(&self.payments, &self.floor)
    }

    /// serve's CPU per payment over the floor loop's CPU per iteration.
    pub fn cpu_over_floor(&self) -> Option<f64> {
        cpu(&self.payments, &self.floor)
    }

    /// Replays from memory over the raw replay floor's throughput.
    pub fn replays_over_floor(&self) -> f64 {
        throughput(&self.replays, &self.replay_floor)
    }

    /// Replays on an instance that has not seen them, over the replay floor.
    pub fn cold_replays_over_floor(&self) -> Option<f64> {
        Some(throughput(self.cold_replays.as_ref()?, &self.replay_floor))
    }

    /// Their CPU per replay over the replay floor's CPU per round trip.
    pub fn cold_cpu_over_floor(&self) -> Option<f64> {
        cpu(self.cold_replays.as_ref()?, &self.replay_floor)
    }

    /// The floor behind HTTP's throughput over the floor's: what HTTP
    /// leaves of the floor's rate.
    pub fn http_floor_over_floor(&self) -> f64 {
        throughput(&self.http_floor, &self.floor)
    }

    /// Its p50 latency over the floor's.
    pub fn http_floor_p50_over_floor(&self) -> f64 {
        self.http_floor.p50_ms / self.floor.p50_ms.max(f64::EPSILON)
    }

    /// The replay floor behind HTTP's throughput over the replay floor's.
    pub fn http_replay_floor_over_floor(&self) -> f64 {
        throughput(&self.http_replay_floor, &self.replay_floor)
    }

    /// Payments' throughput over the floor behind HTTP's: what keyfence's
    /// own work leaves of the rate of the same store calls served over HTTP.
    pub fn payments_over_http_floor(&self) -> f64 {
        throughput(&self.payments, &self.http_floor)
    }

    /// serve's CPU per payment over the floor's HTTP server's per iteration.
    pub fn cpu_over_http_floor(&self) -> Option<f64> {
        cpu(&self.payments, &self.http_floor)
    }

    /// Cold replays' throughput over the replay floor behind HTTP's.
    pub fn cold_replays_over_http_floor(&self) -> Option<f64> {
        Some(throughput(self.cold_replays.as_ref()?, &self.http_replay_floor))
    }

    /// serve's CPU per cold replay over the replay floor's HTTP server's.
    pub fn cold_cpu_over_http_floor(&self) -> Option<f64> {
        cpu(self.cold_replays.as_ref()?, &self.http_replay_floor)
    }

    /// Every floor measured, in the order its table shows them.
    pub fn floors(&self) -> [&Figures; 4] {
        [&self.floor, &self.replay_floor, &self.http_floor, &self.http_replay_floor]
    }
}

fn throughput(a: &Figures, floor: &Figures) -> f64 {
    a.per_second / floor.per_second.max(f64::EPSILON)
}

fn cpu(a: &Figures, floor: &Figures) -> Option<f64> {
    Some(a.cpu_ms_per_request? / floor.cpu_ms_per_request?.max(f64::EPSILON))
}

/// Runs the seven measurements at one concurrency. Every other run
/// measures the floors first, the ones behind HTTP before the bare ones,
/// so that each pair sits as far apart in either order.
pub async fn run(plan: &BenchPlan, stack: &Floor, served: &HttpFloor) -> Report {
    let (front, [floor, replay_floor], [http_floor, http_replay_floor]) = if plan.floors_first {
        let behind_http = http_floors(plan, served).await;
        let bare = floors(plan, stack).await;
        (front_door(plan).await, bare, behind_http)
    } else {
        let front = front_door(plan).await;
        let bare = floors(plan, stack).await;
        (front, bare, http_floors(plan, served).await)
    };
    let (payments, replays, cold_replays) = front;
    Report {
        requests: plan.requests,
        concurrency: plan.concurrency,
        payments,
        replays,
        cold_replays,
        floor,
        replay_floor,
        http_floor,
        http_replay_floor,
    }
}

/// N payments with fresh keys, then the same N replayed to the instance
/// that worked them and to the one that has not seen them.
async fn front_door(plan: &BenchPlan) -> (Figures, Figures, Option<Figures>) {
    let http = reqwest::Client::new();
    let batch = Uuid::new_v4().simple().to_string();
    let send = |to: &Instance, i: usize| post(&http, plan, format!("{}/v1/payments", to.url), &batch, i);
    let payments = against(&http, plan, &plan.serve, "payments", |i| send(&plan.serve, i)).await;
    let replays = against(&http, plan, &plan.serve, "replays", |i| send(&plan.serve, i)).await;
    let cold_replays = match &plan.cold {
        Some(cold) => Some(against(&http, plan, cold, "cold replays", |i| send(cold, i)).await),
        None => None,
    };
    (payments, replays, cold_replays)
}

/// A payment request as the front door gets one, to `url`: its status.
fn post(
    http: &reqwest::Client,
    plan: &BenchPlan,
    url: String,
    batch: &str,
    i: usize,
) -> impl Future<Output = Result<u16, String>> + use<> {
    let request = http
        .post(url)
        .bearer_auth(&plan.api_key)
        .header("Idempotency-Key", format!("bench-{batch}-{i}"))
        .json(&floor::payment(i));
    async move {
        let response = request.send().await.map_err(|e| e.to_string())?;
        let status = response.status().as_u16();
        // The whole answer is read, as a client reads it.
        response.bytes().await.map_err(|e| e.to_string())?;
        Ok(status)
    }
}

/// `send` measured against one instance, with its CPU per request.
async fn against<F, Fut>(
    http: &reqwest::Client,
    plan: &BenchPlan,
    to: &Instance,
    label: &'static str,
    send: F,
) -> Figures
where
    F: Fn(usize) -> Fut + Sync,
    Fut: Future<Output = Result<u16, String>>,
{
    let before = serve_cpu_seconds(http, &to.admin_url).await;
    let mut figures = measure(label, plan, send).await;
    figures.cpu_ms_per_request = per_request(before, serve_cpu_seconds(http, &to.admin_url).await, figures.requests);
    figures
}

/// The floor loop and the replay floor over the floor's own keys, with
/// this process's CPU per iteration.
async fn floors(plan: &BenchPlan, stack: &Floor) -> [Figures; 2] {
    let client = ClientId::generate();
    let done = |outcome: Result<_, String>| outcome.map(|_| 200);
    let before = cpu::own_seconds();
    let mut floor = measure("floor", plan, |i| async move { done(floor::payment_loop(stack, client, i).await) }).await;
    let between = cpu::own_seconds();
    let mut replay_floor =
        measure("replay floor", plan, |i| async move { done(floor::replay_loop(stack, client, i).await) }).await;
    floor.cpu_ms_per_request = per_request(before, between, floor.requests);
    replay_floor.cpu_ms_per_request = per_request(between, cpu::own_seconds(), replay_floor.requests);
    [floor, replay_floor]
}

/// Both floors again behind HTTP, over keys of their own, with their
/// server's CPU per iteration.
async fn http_floors(plan: &BenchPlan, served: &HttpFloor) -> [Figures; 2] {
    let (http, client, batch) = (reqwest::Client::new(), ClientId::generate(), Uuid::new_v4().simple().to_string());
    let before = served.cpu_seconds();
    let mut floor =
        measure("floor over HTTP", plan, |i| post(&http, plan, served.iteration(client, Loop::Payments, i), &batch, i))
            .await;
    let between = served.cpu_seconds();
    let mut replay_floor = measure("replay floor over HTTP", plan, |i| {
        post(&http, plan, served.iteration(client, Loop::Replays, i), &batch, i)
    })
    .await;
    floor.cpu_ms_per_request = per_request(before, between, floor.requests);
    replay_floor.cpu_ms_per_request = per_request(between, served.cpu_seconds(), replay_floor.requests);
    [floor, replay_floor]
}

/// CPU milliseconds per request between two readings of CPU seconds.
fn per_request(from: Option<f64>, to: Option<f64>, requests: usize) -> Option<f64> {
    Some((to? - from?) * 1000.0 / requests.max(1) as f64)
}

/// The serve process's CPU seconds so far, from its `/metrics`.
async fn serve_cpu_seconds(http: &reqwest::Client, url: &str) -> Option<f64> {
    let text = http.get(format!("{url}/metrics")).send().await.ok()?.text().await.ok()?;
    text.lines().find_map(|line| line.strip_prefix("process_cpu_seconds_total ")?.trim().parse().ok())
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
    let (postgres, machine) = (cpu::postgres_seconds(), cpu::machine_seconds());
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
    let (postgres, machine) = ((postgres, cpu::postgres_seconds()), (machine, cpu::machine_seconds()));
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
        cpu_ms_per_request: None,
        postgres_cpu_ms_per_request: per_request(postgres.0, postgres.1, results.len()),
        machine_cpu_ms_per_request: per_request(machine.0, machine.1, results.len()),
    }
}

impl Report {
    /// A table for people.
    pub fn table(&self) -> String {
        let mut out = format!("{} requests at concurrency {}\n", self.requests, self.concurrency);
        out += &format!(
            "{:<22} {:>9} {:>9} {:>9} {:>8} {:>12} {:>8} {:>8}  statuses\n",
            "", "req/s", "p50 ms", "p99 ms", "failed", "cpu ms/req", "pg ms", "all ms"
        );
        for f in self.front_door().chain(self.floors()) {
            let ms = |v: Option<f64>| v.map_or_else(|| "-".to_owned(), |ms| format!("{ms:.3}"));
            out += &format!(
                "{:<22} {:>9.1} {:>9.2} {:>9.2} {:>8} {:>12} {:>8} {:>8}  {:?}\n",
                f.label,
                f.per_second,
                f.p50_ms,
                f.p99_ms,
                f.failures,
                ms(f.cpu_ms_per_request),
                ms(f.postgres_cpu_ms_per_request),
                ms(f.machine_cpu_ms_per_request),
                f.statuses
            );
        }
        let or_dash = |r: Option<f64>| r.map_or_else(|| "-".to_owned(), |r| format!("{r:.2}x"));
        out += &format!(
            "payments: {:.2}x the floor's throughput, p50 {:.2}x, CPU {}; replays from memory {:.2}x, \
             cold {} (CPU {}) the replay floor's\n",
            self.payments_over_floor(),
            self.p50_over_floor(),
            or_dash(self.cpu_over_floor()),
            self.replays_over_floor(),
            or_dash(self.cold_replays_over_floor()),
            or_dash(self.cold_cpu_over_floor()),
        );
        out += &format!(
            "behind HTTP: the floor {:.2}x the floor's throughput (p50 {:.2}x), the replay floor {:.2}x the replay \
             floor's; payments {:.2}x the floor behind HTTP's throughput (CPU {}), cold replays {} (CPU {}) the \
             replay floor behind HTTP's\n",
            self.http_floor_over_floor(),
            self.http_floor_p50_over_floor(),
            self.http_replay_floor_over_floor(),
            self.payments_over_http_floor(),
            or_dash(self.cpu_over_http_floor()),
            or_dash(self.cold_replays_over_http_floor()),
            or_dash(self.cold_cpu_over_http_floor()),
        );
        out
    }
}
