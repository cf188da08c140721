//! `keyfence recover`, `reconcile` and `maintain`: the workers beside
//! traffic, run once by an operator, with progress on stderr and a summary
//! (or JSON) on stdout.

use std::process::ExitCode;

use anyhow::Context;
use clap::Args;
use keyfence::config::EngineConfig;
use keyfence::domain::Millis;
use keyfence::keystore::KeyStoreSettings;
use keyfence::keystore::{self, DynamoKeyStore, KeyStore};
use keyfence::ledger::Ledger;
use keyfence::ledger::LedgerSettings;
use keyfence::{reconcile, recovery, startup};

#[derive(Args)]
pub struct RecoverArgs {
    /// Print the report as JSON instead of a summary.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    pub(super) engine: EngineConfig,
}

#[derive(Args)]
pub struct ReconcileArgs {
    /// Compare requests created at or after this instant (RFC 3339).
    #[arg(long, value_parser = parse_instant)]
    since: Option<Millis>,
    /// Compare requests created before this instant (RFC 3339; default: now).
    #[arg(long, value_parser = parse_instant)]
    until: Option<Millis>,
    /// Repair what is found. Without it nothing is changed.
    #[arg(long, conflicts_with = "dry_run")]
    repair: bool,
    /// Report only (the default).
    #[arg(long)]
    dry_run: bool,
    /// table: findings and a summary for people; json: the whole report.
    #[arg(long, value_enum, default_value = "table")]
    format: Format,
    /// A lease over for longer than this means nobody is resuming (ms).
    #[arg(long = "stale-after-ms", default_value_t = 30_000)]
    stale_after_ms: u64,
    /// An external outcome unknown for longer than this needs settling (ms).
    #[arg(long = "unknown-after-ms", default_value_t = 300_000)]
    unknown_after_ms: u64,
    /// Parallel segments of the key-table scan.
    #[arg(long, default_value_t = 4)]
    segments: u32,
    /// Also write the run's figures here, in the Prometheus text format (for node_exporter's
    /// textfile collector: a name ending in .prom in its directory), replacing the last run's.
    #[arg(long = "metrics-file")]
    metrics_file: Option<std::path::PathBuf>,
    #[command(flatten)]
    pub(super) engine: EngineConfig,
}

/// Replaces `path` with `text` at once (a collector never reads half a file).
fn replace_file(path: &std::path::Path, text: &str) -> std::io::Result<()> {
    let mut partial = path.as_os_str().to_owned();
    partial.push(".partial");
    let written = std::fs::write(&partial, text).and_then(|()| std::fs::rename(&partial, path));
    if written.is_err() {
        let _ = std::fs::remove_file(&partial);
    }
    written
}

#[derive(Clone, Copy, clap::ValueEnum)]
pub enum Format {
    Table,
    Json,
}

pub fn parse_instant(raw: &str) -> Result<Millis, String> {
    let at = time::OffsetDateTime::parse(raw, &time::format_description::well_known::Rfc3339)
        .map_err(|e| format!("expected an RFC 3339 instant such as 2026-11-29T10:00:00Z: {e}"))?;
    u64::try_from(at.unix_timestamp_nanos() / 1_000_000).map(Millis::new).map_err(|_| "before 1970".to_owned())
}

/// Progress on stderr: a spinner while scanning, a bar while repairing.
pub struct Bar(indicatif::ProgressBar);

impl reconcile::Progress for Bar {
    fn scanned(&self, keys: usize) {
        self.0.set_message(format!("scanned {keys} keys"));
    }
    fn repairing(&self, total: usize) {
        self.0.set_style(
            indicatif::ProgressStyle::with_template("repairing [{bar:40}] {pos}/{len}")
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        self.0.set_length(total as u64);
    }
    fn repaired(&self) {
        self.0.inc(1);
    }
}

pub struct ExpiryBar(indicatif::ProgressBar);

impl keyfence::expiry::Progress for ExpiryBar {
    fn scanned(&self, keys: usize) {
        self.0.set_message(format!("scanned {keys} keys"));
    }
    fn deleted(&self, keys: usize) {
        self.0.set_position(keys as u64);
    }
}

/// Exit status 2 when the settings are refused; 1 when a key could not be resumed.
pub async fn recover(args: RecoverArgs) -> anyhow::Result<ExitCode> {
    let engine = match startup::build_engine(&args.engine).await {
        Ok(engine) => engine,
        Err(e @ startup::StartupError::Settings(_)) => {
            eprintln!("keyfence recover: {e}");
            return Ok(ExitCode::from(2));
        }
        Err(e) => return Err(e).context("connecting to the stores"),
    };
    let progress = indicatif::ProgressBar::new_spinner().with_message("scanning the in-flight index");
    progress.enable_steady_tick(std::time::Duration::from_millis(120));
    let report = recovery::sweep(
        &engine,
        recovery::Scope::Everything,
        |found| {
            progress.set_style(
                indicatif::ProgressStyle::with_template("resuming [{bar:40}] {pos}/{len} {per_sec}")
                    .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
            );
            progress.set_length(found as u64);
        },
        || progress.inc(1),
    )
    .await;
    progress.finish_and_clear();
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", report.summary());
    }
    if report.failed.is_empty() {
        Ok(ExitCode::SUCCESS)
    } else {
        eprintln!("keyfence recover: {} key(s) could not be resumed", report.failed.len());
        Ok(ExitCode::from(1))
    }
}

/// Exit status 0: the stores agree (or every finding was repaired);
/// 1: divergence remains; 2: the reconciler could not run.
pub async fn reconcile(args: ReconcileArgs) -> anyhow::Result<ExitCode> {
    let engine = match startup::build_engine(&args.engine).await {
        Ok(engine) => engine,
        Err(e) => {
            eprintln!("keyfence reconcile: connecting to the stores: {e}");
            return Ok(ExitCode::from(2));
        }
    };
    let options = reconcile::Options {
        since: args.since.unwrap_or_default(),
        until: args.until.unwrap_or_else(|| Millis::now().plus(std::time::Duration::from_secs(1))),
        repair: args.repair && !args.dry_run,
        stale_after: std::time::Duration::from_millis(args.stale_after_ms),
        unknown_after: std::time::Duration::from_millis(args.unknown_after_ms),
        segments: args.segments,
    };
    let bar = Bar(indicatif::ProgressBar::new_spinner());
    bar.0.enable_steady_tick(std::time::Duration::from_millis(120));
    let report = match reconcile::run(&engine, &options, &bar).await {
        Ok(report) => report,
        Err(e) => {
            bar.0.finish_and_clear();
            eprintln!("keyfence reconcile: {e}");
            return Ok(ExitCode::from(2));
        }
    };
    bar.0.finish_and_clear();
    match args.format {
        Format::Table => print!("{}", report.table()),
        Format::Json => println!("{}", serde_json::to_string_pretty(&report.to_json())?),
    }
    if let Some(path) = &args.metrics_file
        && let Err(e) = replace_file(path, &report.prometheus(Millis::now()))
    {
        eprintln!("keyfence reconcile: the report stands, but its metrics were not written to {}: {e}", path.display());
        return Ok(ExitCode::from(2));
    }
    Ok(if report.unrepaired() > 0 { ExitCode::from(1) } else { ExitCode::SUCCESS })
}

#[derive(Args)]
pub struct MaintainArgs {
    /// Delete finished keys past their retention (for tables without a time-to-live).
    #[arg(long)]
    expire: bool,
    /// Make the ledger's partitions ahead, drop the old ones whose requests all ended, and delete
    /// what may go from the default partition and the inbox.
    #[arg(long, requires = "region")]
    partitions: bool,
    /// Deletes per second at most.
    #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(u32).range(1..))]
    rate: u32,
    /// Parallel segments of the table scan.
    #[arg(long, default_value_t = 4)]
    segments: u32,
    /// Print the report as JSON instead of a summary.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    retention: keyfence::config::RetentionSettings,
    #[command(flatten)]
    partitioning: keyfence::config::PartitionSettings,
    /// This ledger's region (with --partitions): while hand-offs from it wait for its reconciler, no
    /// partition is dropped.
    #[arg(long, env = "KEYFENCE_REGION")]
    region: Option<String>,
    #[command(flatten)]
    keys: KeyStoreSettings,
    #[command(flatten)]
    ledger: LedgerSettings,
}

/// The ledger's partitions first (the quicker round), then the keys; the
/// JSON report holds the expiry's figures with the partitions' beside them.
pub async fn maintain(args: MaintainArgs) -> anyhow::Result<()> {
    anyhow::ensure!(args.expire || args.partitions, "nothing to do: say what to maintain (--expire, --partitions)");
    let mut json = serde_json::Map::new();
    let mut failed = Vec::new();
    let keys = DynamoKeyStore::new(keystore::connect(&args.keys).await?, args.keys.table.clone());
    if args.partitions {
        let plan = args.partitioning.partitioning(&args.retention.retention()).map_err(anyhow::Error::msg)?;
        let ledger = Ledger::connect(&args.ledger).await.context("connecting to the ledger")?;
        eprintln!("keyfence maintain: the ledger's partitions...");
        let region = args.region.as_deref().context("--partitions needs --region (KEYFENCE_REGION)")?;
        // The hand-offs that hold drops back are counted by region: counted
        // for another region's name, they would be none, and spans a
        // reconciler still needs would go.
        ledger
            .region_fence()
            .await
            .context("reading the ledger's region")?
            .belongs_to(region)
            .context("--region must name the ledger's own region")?;
        let handoffs = match keys.all_handoffs(region).await {
            Ok(handoffs) => Some(handoffs.len()),
            Err(e) => {
                eprintln!("keyfence maintain: could not read the hand-offs from {region} ({e}): dropping nothing");
                None
            }
        };
        let report = ledger.maintain_partitions(&plan, handoffs).await;
        if !args.json {
            print!("{}", report.summary());
        }
        if !report.busy.is_empty() {
            failed.push(format!("{} partition(s) busy past the lock wait", report.busy.len()));
        }
        if report.handoffs_unread {
            failed.push("the hand-offs could not be read, so nothing was dropped".to_owned());
        }
        if !report.failed.is_empty() {
            failed.push(format!("{} step(s) of the partitions' round failed", report.failed.len()));
        }
        json.insert("partitions".into(), serde_json::to_value(&report)?);
    }
    if args.expire {
        let bar = ExpiryBar(indicatif::ProgressBar::new_spinner());
        bar.0.set_style(
            indicatif::ProgressStyle::with_template("{spinner} {msg}, {pos} deleted ({per_sec})")
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_spinner()),
        );
        bar.0.enable_steady_tick(std::time::Duration::from_millis(120));
        let options =
            keyfence::expiry::Options { segments: args.segments, rate: args.rate, grace: args.retention.grace };
        let report = keyfence::expiry::sweep(&keys, Millis::now(), options, &bar).await;
        bar.0.finish_and_clear();
        if !args.json {
            print!("{}", report.summary());
        }
        if !report.failures.is_empty() {
            failed.push(format!("{} failure(s)", report.failures.len()));
        }
        if let serde_json::Value::Object(expiry) = serde_json::to_value(&report)? {
            json.extend(expiry);
        }
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&json)?);
    }
    anyhow::ensure!(failed.is_empty(), "{}", failed.join("; "));
    Ok(())
}
