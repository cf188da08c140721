//! The faults of a chaos run, planned from its seed before it starts (the
//! same seed plans the same faults at the same moments) and then applied
//! on that schedule: `kill -9` of a serve process (started again a moment
//! later), SIGSTOP past its lease and SIGCONT (a zombie owner), rail faults
//! for a while (503s, answers later than the timeout, answers held back,
//! notifications late and twice), PostgreSQL sessions terminated, the key
//! table failing for a while (the bundled emulator's fault switch:
//! throttled, failing and unavailable operations, a write applied whose
//! reply is lost; dynalite has no switch, and a run there skips them), and
//! a failover of region A with its restore and reconcile, in
//! docs/failover.md's order.

use std::time::Duration;

use futures::future::join_all;
use serde_json::{Value, json};

use super::journal::Journal;
use super::stack::{INSTANCES, Region, Stack};

#[derive(Debug, Clone)]
pub enum Fault {
    Kill { instance: usize, down_for: Duration },
    Pause { instance: usize, paused_for: Duration },
    Rail { rail: &'static str, faults: Value, lasting: Duration },
    Backends,
    KeyStore { faults: Vec<Value>, lasting: Duration },
    Failover { lasting: Duration },
}

/// The faults of a run of `schedule` from `seed`, each with when it begins.
pub fn plan(seed: u64, schedule: Duration) -> Vec<(Duration, Fault)> {
    let mut rng = fastrand::Rng::with_seed(seed.rotate_left(17) ^ 0x006e_656d_6573_6973);
    let ms = |rng: &mut fastrand::Rng, range: std::ops::Range<u64>| Duration::from_millis(rng.u64(range));
    let (mut at, mut failover_over) = (Duration::from_secs(2), Duration::ZERO);
    // Until when each rail's faults are planned: one rail's faults never
    // overlap (clearing one would clear the other).
    let mut rail_free = [Duration::ZERO; 2];
    let mut planned = Vec::new();
    while at + Duration::from_secs(5) < schedule {
        let fault = match rng.u8(0..10) {
            0..=2 => Fault::Kill { instance: rng.usize(0..INSTANCES.len()), down_for: ms(&mut rng, 300..3000) },
            3 | 4 => Fault::Pause { instance: rng.usize(0..INSTANCES.len()), paused_for: ms(&mut rng, 1500..4000) },
            5..=7 => {
                let faults = match rng.u8(0..4) {
                    0 => json!({ "error_rate": 0.5 }),
                    1 => json!({ "latency_ms": 600 }),
                    2 => json!({ "timeout_after_apply_rate": 0.5 }),
                    _ => json!({ "delay_ms": 3000, "duplicate_rate": 0.5 }),
                };
                let (first, lasting) = (rng.usize(0..2), ms(&mut rng, 1000..5000));
                match [first, 1 - first].into_iter().find(|&r| rail_free[r] <= at) {
                    Some(r) => {
                        rail_free[r] = at + lasting + Duration::from_millis(100);
                        Fault::Rail { rail: ["e1", "e2"][r], faults, lasting }
                    }
                    None => Fault::Backends,
                }
            }
            8 if rng.bool() => Fault::Backends,
            8 => {
                let (count, dropped) = (rng.u32(2..8), ["UpdateItem", "PutItem"][rng.usize(0..2)]);
                let faults = vec![
                    json!({ "operation": "UpdateItem", "count": count, "action": "error", "code": "ThrottlingException" }),
                    json!({ "operation": "PutItem", "count": count, "action": "error", "code": "InternalServerError" }),
                    json!({ "operation": "GetItem", "count": count, "action": "error", "code": "ServiceUnavailable" }),
                    json!({ "operation": dropped, "count": 1, "action": "drop_reply", "delay_ms": 1500 }),
                ];
                Fault::KeyStore { faults, lasting: ms(&mut rng, 1000..4000) }
            }
            _ if at >= failover_over => {
                let lasting = ms(&mut rng, 3000..8000);
                failover_over = at + lasting + Duration::from_secs(10);
                Fault::Failover { lasting }
            }
            _ => Fault::Backends,
        };
        planned.push((at, fault));
        at += ms(&mut rng, 1500..4000);
    }
    planned
}

/// Applies `plan` on its schedule; how many faults took effect.
pub async fn run(stack: &Stack, plan: Vec<(Duration, Fault)>, journal: &Journal) -> usize {
    let began = tokio::time::Instant::now();
    let applied = join_all(plan.into_iter().map(|(at, fault)| async move {
        tokio::time::sleep_until(began + at).await;
        apply(stack, fault, journal).await
    }))
    .await;
    applied.into_iter().filter(|took| *took).count()
}

async fn apply(stack: &Stack, fault: Fault, journal: &Journal) -> bool {
    match fault {
        Fault::Kill { instance, down_for } => {
            let name = INSTANCES[instance].0;
            if !stack.kill(instance).await {
                journal.note(format!("fault skipped: kill {name} (down or paused)"));
                return false;
            }
            journal.note(format!("fault: killed {name} (kill -9), down for {down_for:?}"));
            tokio::time::sleep(down_for).await;
            stack.restart(instance).await;
            journal.note(format!("fault over: {name} started again"));
        }
        Fault::Pause { instance, paused_for } => {
            let name = INSTANCES[instance].0;
            if !stack.pause(instance, true).await {
                journal.note(format!("fault skipped: pause {name} (down or paused)"));
                return false;
            }
            journal.note(format!("fault: paused {name} (SIGSTOP) for {paused_for:?}"));
            tokio::time::sleep(paused_for).await;
            stack.pause(instance, false).await;
            journal.note(format!("fault over: {name} continued (SIGCONT)"));
        }
        Fault::Rail { rail, faults, lasting } => {
            let rail_of = |name| if name == "e1" { &stack.app.e1 } else { &stack.app.e2 };
            rail_of(rail).set_faults(faults.clone()).await;
            journal.note(format!("fault: {rail} {faults} for {lasting:?}"));
            tokio::time::sleep(lasting).await;
            rail_of(rail).clear_faults().await;
            journal.note(format!("fault over: {rail} faults cleared"));
        }
        Fault::Backends => {
            let ended = stack.terminate_backends().await;
            journal.note(format!("fault: terminated {ended} PostgreSQL sessions"));
        }
        Fault::KeyStore { faults, lasting } => {
            for fault in &faults {
                if !stack.app.keys.try_arm(fault.clone()).await {
                    journal.note("fault skipped: the key table's faults (this emulator has no fault switch)");
                    return false;
                }
            }
            journal.note(format!("fault: the key table fails: {}", Value::Array(faults)));
            tokio::time::sleep(lasting).await;
            stack.app.keys.disarm().await;
            journal.note("fault over: the key table's faults disarmed");
        }
        Fault::Failover { lasting } => failover(stack, lasting, journal).await,
    }
    true
}

/// docs/failover.md: declare A failed (its ledger fenced), let B drain it,
/// restore A, and reconcile A with repair.
async fn failover(stack: &Stack, lasting: Duration, journal: &Journal) {
    let ledger = stack.app.db.url.as_str();
    let declare = async |verb: &str| {
        stack
            .operator(Region::B, &["regions", verb, "--region", "test-1", "--reason", "chaos", "--ledger", ledger])
            .await
    };
    let (code, said) = declare("fail").await;
    journal.note(format!("fault: region A declared failed (exit {code:?}): {}", one_line(&said)));
    let (code, said) = stack.operator(Region::B, &["recover"]).await;
    journal.note(format!("operator: recover in B (exit {code:?}): {}", one_line(&said)));
    tokio::time::sleep(lasting).await;
    let (code, said) = declare("restore").await;
    journal.note(format!("fault over: region A restored (exit {code:?}): {}", one_line(&said)));
    let (code, said) = stack.operator(Region::A, &["reconcile", "--repair"]).await;
    journal.note(format!("operator: reconcile --repair in A (exit {code:?}): {}", one_line(&said)));
}

fn one_line(said: &str) -> String {
    said.trim().lines().collect::<Vec<_>>().join(" / ")
}
