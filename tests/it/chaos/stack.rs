//! The stack a chaos run works against: one key table, two regions (A,
//! `test-1`, and B, `test-2`) with a ledger each, the two rail simulators,
//! and three `keyfence serve` processes (two in A, one in B) that the
//! nemesis kills, pauses and restarts. Region A's in-process instance takes
//! the rails' notifications and is never faulted; clients never call it.
//! Keys are kept 20 s, so they expire during a run.

use std::sync::Mutex;
use std::time::Duration;

use keyfence::config::RetentionSettings;
use keyfence::domain::ClientId;
use tokio::process::Command;

use super::journal::Journal;
use crate::app::{TestApp, TestRail, TestRegion, spawn_app_on};
use crate::process::{Logs, ServeProcess, keyfence_command};

/// How long the rails deduplicate a key: longer than any pause the nemesis
/// makes and a lease, as a real rail's day is. A zombie woken after a
/// rail forgot its key would pay again: the engine counts on the window.
const RAIL_MEMORY: Duration = Duration::from_secs(60);

/// How long finished keys are kept, and the grace after it.
pub const RETENTION: Duration = Duration::from_secs(20);
pub const GRACE: Duration = Duration::from_secs(1);

/// The serve processes: their names and regions.
pub const INSTANCES: [(&str, Region); 3] = [("a1", Region::A), ("a2", Region::A), ("b1", Region::B)];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Region {
    A,
    B,
}

impl Region {
    pub fn name(self) -> &'static str {
        match self {
            Self::A => "test-1",
            Self::B => "test-2",
        }
    }
}

/// A client of the run: its API key and the one account it holds.
pub struct Client {
    pub id: ClientId,
    pub api_key: String,
    pub account: &'static str,
}

/// Accounts of the clients, one each (valid IBANs).
const ACCOUNTS: [&str; 3] = ["DE89370400440532013000", "GB82WEST12345698765432", "NL91ABNA0417164300"];

/// One serve process's place: what runs there now, and every log it wrote.
struct Slot {
    process: Option<ServeProcess>,
    url: String,
    paused: bool,
    logs: Vec<Logs>,
}

pub struct Stack {
    pub app: TestApp,
    pub b: TestRegion,
    pub clients: Vec<Client>,
    slots: Vec<Mutex<Slot>>,
}

impl Stack {
    pub async fn start() -> Self {
        let (e1, e2) =
            (TestRail::start_with("e1", Some(RAIL_MEMORY)).await, TestRail::start_with("e2", Some(RAIL_MEMORY)).await);
        let app = spawn_app_on(e1, e2, |s| {
            s.engine.work.retention = retention();
            s.engine.work.lease = Duration::from_millis(crate::process::LEASE_MS);
            (s.engine.rails.rail_timeout, s.engine.rails.rail_attempts) = (Duration::from_millis(330), 1);
            s.inbox_interval_ms = 200;
        })
        .await;
        let b = app.second_region("test-2").await;
        for (rail, name) in [(&app.e1, "e1"), (&app.e2, "e2")] {
            let url = format!("{}/v1/rail-events/{name}", app.url);
            let secret = crate::app::RAIL_NOTIFY_SECRET.to_owned();
            rail.sim.as_ref().unwrap().notify_to(keyfence::rail::sim::notify::Callback { url, secret });
        }
        let mut clients = Vec::new();
        for account in ACCOUNTS {
            let (id, api_key) = app.add_client_holding(&[account]).await;
            clients.push(Client { id, api_key, account });
        }
        let mut stack = Self { app, b, clients, slots: Vec::new() };
        for (_, region) in INSTANCES {
            let (process, logs) = ServeProcess::spawn_logged(stack.serve(region)).await;
            let slot = Slot { url: process.url.clone(), process: Some(process), paused: false, logs: vec![logs] };
            stack.slots.push(Mutex::new(slot));
        }
        stack
    }

    /// `keyfence serve` in `region`, with the run's short retention.
    fn serve(&self, region: Region) -> Command {
        let mut command = keyfence_command(&self.app, "serve");
        command
            .env("KEYFENCE_RETENTION", format!("{}s", RETENTION.as_secs()))
            .env("KEYFENCE_RETENTION_GRACE", format!("{}s", GRACE.as_secs()))
            .env("KEYFENCE_EXPIRE_INTERVAL_MS", "1000")
            .env("KEYFENCE_RECOVERY_INTERVAL_MS", "500")
            .env("KEYFENCE_WEBHOOK_INTERVAL_MS", "0");
        if region == Region::B {
            command.env("KEYFENCE_REGION", Region::B.name()).env("DATABASE_URL", &self.b.db.url);
        }
        command
    }

    /// Where instance `i` listens now (a dead one's last address).
    pub fn url(&self, i: usize) -> String {
        self.slot(i).url.clone()
    }

    fn slot(&self, i: usize) -> std::sync::MutexGuard<'_, Slot> {
        self.slots[i].lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Kills instance `i` with SIGKILL; false if it is down or paused already.
    pub async fn kill(&self, i: usize) -> bool {
        let Some(mut process) = ({
            let mut slot = self.slot(i);
            if slot.paused { None } else { slot.process.take() }
        }) else {
            return false;
        };
        process.signal("KILL").await;
        process.exited().await;
        true
    }

    /// Starts instance `i` again if it is down.
    pub async fn restart(&self, i: usize) {
        if self.slot(i).process.is_some() {
            return;
        }
        let (process, logs) = ServeProcess::spawn_logged(self.serve(INSTANCES[i].1)).await;
        let mut slot = self.slot(i);
        slot.url = process.url.clone();
        slot.logs.push(logs);
        slot.process = Some(process);
    }

    /// Stops (SIGSTOP) or continues (SIGCONT) instance `i`; false if it is
    /// down, or already so.
    pub async fn pause(&self, i: usize, paused: bool) -> bool {
        let pid = {
            let mut slot = self.slot(i);
            let Some(pid) = slot.process.as_ref().map(ServeProcess::pid).filter(|_| slot.paused != paused) else {
                return false;
            };
            slot.paused = paused;
            pid
        };
        let signal = if paused { "-STOP" } else { "-CONT" };
        Command::new("kill").args([signal, &pid.to_string()]).status().await.expect("running kill").success()
    }

    /// Ends every PostgreSQL session of both ledgers but this one's; how many.
    pub async fn terminate_backends(&self) -> i64 {
        let names: Vec<String> = [&self.app.db.url, &self.b.db.url]
            .iter()
            .map(|url| url.rsplit('/').next().unwrap_or_default().split('?').next().unwrap_or_default().to_owned())
            .collect();
        sqlx::query_scalar(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
              WHERE datname = ANY($1) AND pid <> pg_backend_pid()",
        )
        .bind(&names)
        .fetch_one(&self.fresh_pools()[0])
        .await
        .unwrap_or(0)
    }

    /// Runs `keyfence <args>` in `region` as an operator would; its exit
    /// code and what it printed (its report, not its log).
    pub async fn operator(&self, region: Region, args: &[&str]) -> (Option<i32>, String) {
        let mut command = keyfence_command(&self.app, args[0]);
        command.args(&args[1..]).env("KEYFENCE_REGION", region.name());
        if region == Region::B {
            command.env("DATABASE_URL", &self.b.db.url);
        }
        let out = command.stderr(std::process::Stdio::null()).output().await.expect("running keyfence");
        (out.status.code(), String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// Undoes every fault in force: rails cleared, the key table's faults
    /// disarmed, paused instances continued, dead ones started again,
    /// region A active (a restore cut short by ended sessions is made
    /// again).
    pub async fn heal(&self, journal: &Journal) {
        self.app.e1.clear_faults().await;
        self.app.e2.clear_faults().await;
        self.app.keys.disarm().await;
        let ledger = self.app.db.url.as_str();
        let restore = ["regions", "restore", "--region", "test-1", "--reason", "healed", "--ledger", ledger];
        let (code, said) = self.operator(Region::B, &restore).await;
        journal.note(format!("heal: region A restored (exit {code:?}): {}", said.trim().replace('\n', " / ")));
        for (i, (name, _)) in INSTANCES.iter().enumerate() {
            if self.pause(i, false).await {
                journal.note(format!("heal: continued {name}"));
            }
            if self.slot(i).process.is_none() {
                self.restart(i).await;
                journal.note(format!("heal: started {name} again"));
            }
        }
    }

    /// How long client `c`'s `key` is still kept, if it is stored and
    /// finished.
    pub async fn kept_for(&self, c: usize, key: &str) -> Option<Duration> {
        use keyfence::keystore::KeyStore;
        let key =
            keyfence::domain::ScopedKey::new(self.clients[c].id, keyfence::domain::IdempotencyKey::parse(key).ok()?);
        let expires_at = self.app.keys.store.get(&key).await.ok()??.expires_at?;
        let now = keyfence::domain::Millis::now().get();
        (expires_at * 1000).checked_sub(now).map(Duration::from_millis)
    }

    /// New connections to both ledgers (A's, B's): the nemesis ends the
    /// sessions of the pools the run began with.
    pub fn fresh_pools(&self) -> [sqlx::PgPool; 2] {
        let connect = |url: &str| sqlx::postgres::PgPoolOptions::new().max_connections(2).connect_lazy(url).unwrap();
        [connect(&self.app.db.url), connect(&self.b.db.url)]
    }

    /// Keys still in flight (claimed and not finished), read off the
    /// in-flight index shard by shard (a scan of the whole table grows with
    /// every balance and hand-off a long run leaves); `usize::MAX` if the
    /// table cannot be read.
    pub async fn in_flight(&self) -> usize {
        use keyfence::keystore::{INFLIGHT_SHARDS, KeyStore};
        // Every lease ends before then: every started item.
        let later = keyfence::domain::Millis::now().plus(Duration::from_secs(86_400));
        let mut found = 0;
        for shard in 0..INFLIGHT_SHARDS {
            match self.app.keys.store.stale_in_flight(shard, later).await {
                Ok(started) => found += started.len(),
                Err(_) => return usize::MAX,
            }
        }
        found
    }

    /// Every line each instance logged, by instance.
    pub fn logs(&self) -> Vec<(&'static str, Vec<String>)> {
        (0..INSTANCES.len())
            .map(|i| (INSTANCES[i].0, self.slot(i).logs.iter().flat_map(Logs::lines).collect()))
            .collect()
    }
}

fn retention() -> RetentionSettings {
    RetentionSettings { retention: Some(RETENTION), retention_hours: None, grace: GRACE }
}
