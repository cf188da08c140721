//! The real `keyfence` binary as a child process, wired to a test's own
//! stack (table, database, rail simulators). Crash tests give `serve`
//! `FAILPOINTS` so it aborts or stalls at a boundary; the telemetry test
//! stops it with SIGTERM, as an orchestrator would.

use std::process::{ExitStatus, Stdio};
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

use crate::app::TestApp;

/// Lease of spawned instances: short, so takeovers happen quickly.
pub const LEASE_MS: u64 = 1000;

/// `keyfence <subcommand>` with the environment of `app`'s stack.
pub fn keyfence_command(app: &TestApp, subcommand: &str) -> Command {
    let keys = &app.keys.settings;
    let mut command = Command::new(env!("CARGO_BIN_EXE_keyfence"));
    command
        .arg(subcommand)
        .env("AWS_ENDPOINT_URL", keys.aws_endpoint_url.as_deref().unwrap_or("http://127.0.0.1:4566"))
        .env("AWS_REGION", keys.aws_region.as_deref().unwrap_or("us-east-1"))
        .env("KEYFENCE_TABLE", &keys.table)
        .env("DATABASE_URL", &app.db.url)
        .env("KEYFENCE_LISTEN", "127.0.0.1:0")
        .env("KEYFENCE_ADMIN_LISTEN", "127.0.0.1:0")
        .env("KEYFENCE_LOCAL_REGIONS", "1")
        .env("KEYFENCE_WEBHOOKS_ALLOW_PRIVATE", "1")
        .env("KEYFENCE_REGION", "test-1")
        .env("KEYFENCE_REGION_SECRET", crate::app::REGION_SECRET)
        .env("KEYFENCE_E1_NOTIFY_SECRET", crate::app::RAIL_NOTIFY_SECRET)
        .env("KEYFENCE_E2_NOTIFY_SECRET", crate::app::RAIL_NOTIFY_SECRET)
        .env("KEYFENCE_E1_URL", &app.e1.url)
        .env("KEYFENCE_E2_URL", &app.e2.url)
        .env("KEYFENCE_LEASE_MS", LEASE_MS.to_string())
        // The longest rail call must fit in a third of the lease.
        .env("KEYFENCE_RAIL_TIMEOUT_MS", "330")
        .env("KEYFENCE_RAIL_ATTEMPTS", "1")
        // Parked requests are probed again at once; the back-off has tests of its own.
        .env("KEYFENCE_PROBE_BACKOFF_MS", "1")
        .env("KEYFENCE_PROBE_BACKOFF_MAX_MS", "1")
        .env("RUST_LOG", "warn")
        .env_remove("FAILPOINTS")
        .stderr(Stdio::inherit())
        .kill_on_drop(true);
    command
}

/// Every line a process wrote to stderr, so far.
#[derive(Clone, Default)]
pub struct Logs(std::sync::Arc<std::sync::Mutex<Vec<String>>>);

impl Logs {
    pub fn lines(&self) -> Vec<String> {
        self.0.lock().unwrap().clone()
    }
}

pub struct ServeProcess {
    child: Child,
    pub url: String,
    /// Its admin listener (/metrics, /readyz in detail), if it has one.
    pub admin_url: Option<String>,
}

impl ServeProcess {
    /// Starts an instance of the service on `app`'s stack, for the crash
    /// tests (which need the failpoints build). `recovery_ms` 0 means no
    /// recovery worker in this instance.
    #[cfg(feature = "failpoints")]
    pub async fn start(app: &TestApp, failpoints: Option<&str>, recovery_ms: u64) -> Self {
        let mut command = keyfence_command(app, "serve");
        command.env("KEYFENCE_RECOVERY_INTERVAL_MS", recovery_ms.to_string());
        if let Some(failpoints) = failpoints {
            command.env("FAILPOINTS", failpoints);
        }
        Self::spawn(command).await
    }

    /// Starts `command` (a `keyfence serve` or `rail-sim`), keeping every
    /// line it logs, and waits until it listens.
    pub async fn spawn_logged(mut command: Command) -> (Self, Logs) {
        let logs = Logs::default();
        let mut child = command.stderr(Stdio::piped()).stdout(Stdio::piped()).spawn().expect("spawning keyfence");
        let mut lines = BufReader::new(child.stderr.take().expect("piped stderr")).lines();
        let kept = logs.clone();
        tokio::spawn(async move {
            while let Ok(Some(line)) = lines.next_line().await {
                kept.0.lock().unwrap().push(line);
            }
        });
        (Self::listening(child).await, logs)
    }

    /// Starts `command` (a `keyfence serve`) and waits until it listens.
    pub async fn spawn(mut command: Command) -> Self {
        Self::listening(command.stdout(Stdio::piped()).spawn().expect("spawning keyfence serve")).await
    }

    async fn listening(mut child: Child) -> Self {
        let stdout = child.stdout.take().expect("piped stdout");
        let mut lines = BufReader::new(stdout).lines();
        let first = tokio::time::timeout(Duration::from_secs(30), lines.next_line())
            .await
            .expect("keyfence serve started within 30 s")
            .expect("reading its stdout")
            .expect("keyfence printed where it listens");
        let Some((_, listening)) = first.split_once("listening on ") else { panic!("not the listening line: {first}") };
        let (url, admin_url) = match listening.split_once(" (admin: ") {
            Some((url, admin)) => (url.to_owned(), Some(admin.trim_end_matches(')').to_owned())),
            None => (listening.to_owned(), None),
        };
        // Keep draining stdout so the child never blocks on a full pipe.
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        Self { child, url, admin_url }
    }

    /// The process's id.
    pub fn pid(&self) -> u32 {
        self.child.id().expect("the process is running")
    }

    /// Sends `signal` (`KILL`, `STOP`, `CONT`, ...) to the process.
    pub async fn signal(&self, signal: &str) {
        let pid = self.pid().to_string();
        let sent = Command::new("kill").args([&format!("-{signal}"), &pid]).status().await.expect("running kill");
        assert!(sent.success(), "kill -{signal} {pid} failed");
    }

    /// Asks the process to stop (SIGTERM) and waits until it has.
    pub async fn terminate(&mut self) -> ExitStatus {
        let pid = self.child.id().expect("the process is running");
        let sent = Command::new("kill").args(["-TERM", &pid.to_string()]).status().await.expect("running kill");
        assert!(sent.success(), "kill -TERM {pid} failed");
        self.exited().await
    }

    /// Waits for the process to exit by itself.
    pub async fn exited(&mut self) -> ExitStatus {
        tokio::time::timeout(Duration::from_secs(30), self.child.wait())
            .await
            .expect("the process exited within 30 s")
            .expect("waiting for the process")
    }
}
