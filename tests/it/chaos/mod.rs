//! The fault-injecting harness: a seeded run of several clients' payments,
//! retries, refunds, returns and key thefts against the real stack in two
//! regions, while a nemesis kills, pauses and fails over its instances and
//! breaks its rails and database sessions. Then every fault is healed, both
//! regions are reconciled (report, repair, report), and the money is
//! checked from the outside ([`checks`]).
//!
//! `KEYFENCE_CHAOS_SEED` picks the seed (otherwise CI's fixed seeds and
//! every seed kept as a regression case run) and `KEYFENCE_CHAOS_SECONDS`
//! the length of the schedule (120 by default); `scripts/chaos` sets both.
//! The same seed plans the same stories and faults at the same moments, as
//! closely as real processes allow. Each run prints its seed and a log
//! folder (its plan, what happened, every instance's log, the reconciler's
//! reports and what broke).

mod checks;
mod journal;
mod nemesis;
mod stack;
mod workload;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use keyfence::reconcile::{Class, Report};

use self::journal::Journal;
use self::stack::Stack;

/// The seeds CI runs.
const CI_SEEDS: [u64; 1] = [1];

/// Seeds that once found a fault, run on every CI run.
const KEPT: [u64; 0] = [];

fn seeds() -> Vec<u64> {
    match std::env::var("KEYFENCE_CHAOS_SEED") {
        Ok(seed) if seed == "random" => vec![fastrand::u64(..)],
        Ok(seed) => vec![seed.parse().expect("KEYFENCE_CHAOS_SEED is a number or 'random'")],
        Err(_) => CI_SEEDS.into_iter().chain(KEPT).collect(),
    }
}

fn schedule() -> Duration {
    let seconds = std::env::var("KEYFENCE_CHAOS_SECONDS").ok().map(|s| s.parse().expect("a number of seconds"));
    Duration::from_secs(seconds.unwrap_or(120))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn money_moves_once_under_a_seeded_schedule_of_faults() {
    for seed in seeds() {
        run(seed, schedule()).await;
    }
}

async fn run(seed: u64, schedule: Duration) {
    let folder = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join("chaos")
        .join(format!("seed-{seed}-{}", keyfence::domain::Millis::now().get()));
    std::fs::create_dir_all(&folder).unwrap();
    eprintln!("chaos: seed {seed}, {} s of schedule; logs in {}", schedule.as_secs(), folder.display());
    let stack = Stack::start().await;
    let journal = Journal::new();
    let plan = nemesis::plan(seed, schedule);
    let planned: Vec<String> = plan.iter().map(|(at, fault)| format!("{:>8.3}s {fault:?}", at.as_secs_f64())).collect();
    write(&folder, "plan.txt", &planned);

    let until = Instant::now() + schedule;
    let (mut done, faults) =
        tokio::join!(workload::run(&stack, seed, until, &journal), nemesis::run(&stack, plan, &journal));
    journal.note("schedule over: healing");
    stack.heal(&journal).await;
    workload::finish(&stack, &mut done, &journal).await;
    quiesce(&stack, &journal).await;
    let mut reports = Vec::new();
    for (region, settings) in [("A", &stack.app.settings), ("B", &stack.b.settings)] {
        for (pass, repair) in [("report", false), ("repair", true), ("again", false)] {
            let report = crate::reconcile::reconcile_in(settings, repair).await;
            journal.note(format!("reconcile {pass} in {region}: {} findings", report.findings.len()));
            reports.push((format!("{region} {pass}"), report));
        }
    }
    let (mut broken, replayed) = checks::all(&stack, &done).await;
    for (name, report) in &reports {
        if !name.ends_with("again") {
            continue;
        }
        // A finished request whose key expired, begun within the grace of
        // a failover or restore, is left for a person by design: the
        // reconciler cannot tell it was not worked elsewhere too. The money
        // checks below see whether it was.
        let (for_a_person, left): (Vec<_>, Vec<_>) =
            report.findings.iter().partition(|f| f.class == Class::KeyMissing && f.evidence.contains("at FINISHED"));
        for finding in for_a_person {
            journal.note(format!("reconcile in {name}: left for a person: {} ({})", finding.key, finding.evidence));
        }
        if !left.is_empty() {
            broken.push(format!("reconcile in {name}: findings left after repair:\n{}", report.table()));
        }
    }

    let operations = done.requests.len() + done.returned.len();
    let summary = format!(
        "seed {seed}: {operations} operations ({} requests, {} returns), {faults} faults; \
         {replayed} answers asked for again; {} broken",
        done.requests.len(),
        done.returned.len(),
        broken.len()
    );
    journal.note(&summary);
    write(&folder, "journal.txt", &journal.lines());
    write(&folder, "broken.txt", &broken);
    write(&folder, "reconcile.txt", &reports.iter().map(|(n, r)| table(n, r)).collect::<Vec<_>>());
    for (name, lines) in stack.logs() {
        write(&folder, &format!("{name}.log"), &lines);
    }
    eprintln!("chaos: {summary}");
    assert!(
        broken.is_empty(),
        "chaos seed {seed} broke the money (logs in {}):\n{}",
        folder.display(),
        broken.join("\n")
    );
}

/// Waits until no key is in flight, no notification is on its way, and no
/// return waits to be worked or handed on (60 s at most).
async fn quiesce(stack: &Stack, journal: &Journal) {
    let deadline = Instant::now() + Duration::from_secs(60);
    let ledgers = stack.fresh_pools();
    while Instant::now() < deadline {
        let in_flight = stack.in_flight().await;
        let posting = stack.app.e1.notifications().await.outstanding + stack.app.e2.notifications().await.outstanding;
        // Verdicts about requests another region finished wait for an hour;
        // returns must have been worked, or handed on.
        let mut waiting = 0;
        for ledger in &ledgers {
            waiting += sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM inbox WHERE kind = 'returned' AND state IN ('pending', 'forwarding')",
            )
            .fetch_one(ledger)
            .await
            .unwrap_or(1);
        }
        if in_flight == 0 && posting == 0 && waiting == 0 {
            journal.note("quiet: no key in flight, no notification on its way, no return waiting");
            return;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    journal.note("still busy after 60 s; checking anyway");
}

fn table(name: &str, report: &Report) -> String {
    format!("== {name}\n{}", report.table())
}

fn write(folder: &std::path::Path, name: &str, lines: &[String]) {
    std::fs::write(folder.join(name), lines.join("\n") + "\n").unwrap();
}
