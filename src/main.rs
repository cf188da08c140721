//! The `keyfence` binary: a thin clap front over the library. Each subcommand
//! parses its settings and calls one library function.

use std::net::SocketAddr;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Args, Parser, Subcommand};
use keyfence::clients::ClientStore;
use keyfence::config::{EngineConfig, KeyStoreSettings, LedgerSettings, RailSettings, ServeSettings};
use keyfence::domain::{ApiKey, Millis};
use keyfence::keystore::{self, DynamoKeyStore, TableChange};
use keyfence::ledger::{FenceChange, Ledger};
use keyfence::rail::RailClient;
use keyfence::regions::{self, Changed, RegionState, RegionStore};
use keyfence::startup::{Application, StartupError, shutdown_signal};
use keyfence::{batch, bench, rail, reconcile, recovery, startup, telemetry};

#[derive(Parser)]
#[command(name = "keyfence", version, about = "Exactly-once payment requests across regions")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the front door: POST /v1/payments and friends.
    Serve(Box<ServeSettings>),
    /// Create the key table and apply the ledger's migrations (idempotent).
    Migrate(Box<MigrateArgs>),
    /// Manage API clients.
    #[command(subcommand)]
    Clients(ClientsCommand),
    /// The debtor accounts each client may pay from.
    #[command(subcommand)]
    Accounts(AccountsCommand),
    /// Housekeeping beside traffic: --expire deletes finished keys past their retention.
    Maintain(MaintainArgs),
    /// See which regions are active, declare one failed, or bring it back.
    #[command(subcommand)]
    Regions(RegionsCommand),
    /// Run a rail simulator standing in for an external system (E1 or E2).
    ///
    /// POST /v1/instructions (honours Idempotency-Key), GET /v1/instructions/{key},
    /// GET /v1/statement (applied), GET /v1/declines (declined);
    /// PUT/DELETE /v1/faults {"latency_ms", "error_rate", "timeout_after_apply_rate"};
    /// PUT/DELETE /v1/rules {"decline_creditor_accounts": [...], "max_amount_minor": N}:
    /// matching instructions are declined with 402 and a reason code.
    RailSim(RailSimArgs),
    /// Resume every stale in-flight request once, then report (the worker inside `serve` does this on an interval).
    Recover(Box<RecoverArgs>),
    /// Compare the key store with this region's ledger; report, or repair with --repair.
    Reconcile(Box<ReconcileArgs>),
    /// Pay every line of a CSV or JSON-lines file, exactly once even when run again.
    Pay(Box<PayArgs>),
    /// Measure a running front door against the floor of its store and rail calls.
    Bench(Box<BenchArgs>),
    /// Measure the reconciler's scan and repair rates at several table sizes.
    BenchReconcile(Box<BenchReconcileArgs>),
}

#[derive(Args)]
struct RecoverArgs {
    /// Print the report as JSON instead of a summary.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    engine: EngineConfig,
}

#[derive(Args)]
struct ReconcileArgs {
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
    #[command(flatten)]
    engine: EngineConfig,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum Format {
    Table,
    Json,
}

fn parse_instant(raw: &str) -> Result<Millis, String> {
    let at = time::OffsetDateTime::parse(raw, &time::format_description::well_known::Rfc3339)
        .map_err(|e| format!("expected an RFC 3339 instant such as 2026-11-29T10:00:00Z: {e}"))?;
    u64::try_from(at.unix_timestamp_nanos() / 1_000_000).map(Millis::new).map_err(|_| "before 1970".to_owned())
}

/// Progress on stderr: a spinner while scanning, a bar while repairing.
struct Bar(indicatif::ProgressBar);

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

#[derive(Args)]
struct BenchReconcileArgs {
    /// Numbers of keys to measure at, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "10000,100000")]
    sizes: Vec<usize>,
    /// Share of payments erased from the ledger for the divergent runs.
    #[arg(long, default_value_t = 0.01)]
    divergent: f64,
    /// Where to write the figures (JSON).
    #[arg(long, default_value = "bench-results/reconcile.json")]
    out: std::path::PathBuf,
    /// The region the loaded payments are homed in.
    #[arg(long, env = "KEYFENCE_REGION", default_value = "local-1")]
    region: String,
    #[command(flatten)]
    keys: KeyStoreSettings,
    #[command(flatten)]
    ledger: LedgerSettings,
}

#[derive(Args)]
struct PayArgs {
    /// The payments: CSV with a header line, or JSON lines (.jsonl), with the fields
    /// client_ref, amount_minor, currency, debtor_account, creditor_account,
    /// end_to_end_id and remittance_info (may be empty).
    #[arg(long)]
    file: std::path::PathBuf,
    /// The front door; comma-separate several regions' URLs to fail over in order.
    #[arg(long, env = "KEYFENCE_URL", value_delimiter = ',', default_value = "http://127.0.0.1:8080")]
    url: Vec<String>,
    /// A file holding the client's API key; else KEYFENCE_API_KEY. Never the key itself as a flag:
    /// a command line is visible to every user of the machine.
    #[arg(long = "api-key-file", env = "KEYFENCE_API_KEY_FILE")]
    api_key_file: Option<std::path::PathBuf>,
    /// Refused: an API key on the command line (see --api-key-file).
    #[arg(long = "api-key", hide = true)]
    api_key_flag: Option<String>,
    /// The file's id, part of every line's key (default: the SHA-256 of its bytes).
    #[arg(long = "file-id")]
    file_id: Option<String>,
    /// Payments in flight at once.
    #[arg(short = 'c', long, default_value_t = 8, value_parser = clap::value_parser!(u16).range(1..=256))]
    concurrency: u16,
    /// Where to write one CSV line per payment (default: FILE.results.csv).
    #[arg(long)]
    results: Option<std::path::PathBuf>,
    /// How long a line may stay unsettled before it is reported pending (seconds).
    #[arg(long = "deadline-secs", default_value_t = 60)]
    deadline_secs: u64,
    /// Print the summary as JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
struct BenchArgs {
    /// The front door to measure.
    #[arg(long, default_value = "http://127.0.0.1:8080")]
    url: String,
    /// Its admin listener, for the CPU time serve spends (its /metrics).
    #[arg(long = "admin-url", default_value = "http://127.0.0.1:9090")]
    admin_url: String,
    /// Payments to send (each phase sends this many).
    #[arg(short = 'n', long, default_value_t = 1000)]
    requests: usize,
    /// Requests in flight at once; a comma-separated list measures each in turn.
    #[arg(short = 'c', long, value_delimiter = ',', default_value = "16")]
    concurrency: Vec<usize>,
    /// Where to write the figures (JSON).
    #[arg(long, default_value = "bench-results/front-door.json")]
    out: std::path::PathBuf,
    /// Also draw throughput.png and cpu.png against concurrency into this directory.
    #[arg(long)]
    plots: Option<std::path::PathBuf>,
    /// The stores and rails of the same stack, for the floor loop.
    #[command(flatten)]
    keys: KeyStoreSettings,
    #[command(flatten)]
    ledger: LedgerSettings,
    #[command(flatten)]
    rails: RailSettings,
}

#[derive(Args)]
struct MigrateArgs {
    #[command(flatten)]
    keys: KeyStoreSettings,
    #[command(flatten)]
    ledger: LedgerSettings,
    /// Delete the older layout's client items once copied: only when every region runs this version.
    #[arg(long = "drop-older-clients")]
    drop_older_clients: bool,
    /// Print the result as JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
struct MaintainArgs {
    /// Delete finished keys past their retention (for tables without a time-to-live).
    #[arg(long)]
    expire: bool,
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
    keys: KeyStoreSettings,
}

#[derive(Subcommand)]
enum RegionsCommand {
    /// Every region's state, epoch and last change (who, when, why).
    List {
        #[command(flatten)]
        keys: KeyStoreSettings,
        /// The whole registry, with its history, as JSON.
        #[arg(long)]
        json: bool,
        /// A region's ledger: show its own region fence too (failed or open, at which epoch).
        #[command(flatten)]
        ledger: RemoteLedger,
    },
    /// Declare a region failed: its instances stop claiming and committing
    /// within a second, and other regions take its requests over.
    Fail(DeclareArgs),
    /// Bring a failed region back for new requests (keys now homed elsewhere stay there).
    Restore(DeclareArgs),
}

#[derive(Args)]
struct DeclareArgs {
    /// The region to declare.
    #[arg(long)]
    region: String,
    /// Why, for the record.
    #[arg(long, default_value = "")]
    reason: String,
    /// Who declares it (default: $USER@$HOSTNAME).
    #[arg(long)]
    by: Option<String>,
    /// The region's own ledger, if it can still be reached: fenced (or
    /// unfenced) too, so its phases stop in the transaction that would commit them.
    #[command(flatten)]
    ledger: RemoteLedger,
    #[command(flatten)]
    keys: KeyStoreSettings,
}

/// A region's ledger named on the command line, which every user of the
/// machine can read: its URL there must hold no password. One that does
/// comes from a file or from KEYFENCE_REGION_LEDGER_URL.
#[derive(Args)]
struct RemoteLedger {
    /// The region's ledger URL, without a password.
    #[arg(long = "ledger")]
    ledger: Option<String>,
    /// A file holding the region's ledger URL (which may hold a password); else KEYFENCE_REGION_LEDGER_URL.
    #[arg(long = "ledger-file", conflicts_with = "ledger")]
    ledger_file: Option<std::path::PathBuf>,
}

impl RemoteLedger {
    /// The ledger named, if any; a password on the command line is refused
    /// (and not repeated).
    fn url(&self) -> anyhow::Result<Option<keyfence::config::DatabaseUrl>> {
        let raw = match (&self.ledger, &self.ledger_file) {
            (Some(url), _) => {
                let with_password = reqwest::Url::parse(url).is_ok_and(|u| u.password().is_some());
                anyhow::ensure!(
                    !with_password,
                    "a ledger URL with a password is not taken from the command line, where every user of the \
                     machine can read it: put it in a file named by --ledger-file, or in KEYFENCE_REGION_LEDGER_URL"
                );
                Some(url.clone())
            }
            (None, Some(file)) => Some(
                std::fs::read_to_string(file)
                    .with_context(|| format!("reading the ledger URL from {}", file.display()))?
                    .trim()
                    .to_owned(),
            ),
            (None, None) => std::env::var("KEYFENCE_REGION_LEDGER_URL").ok().filter(|url| !url.is_empty()),
        };
        raw.map(|raw| raw.parse().map_err(|e: String| anyhow::anyhow!("the ledger URL: {e}"))).transpose()
    }
}

/// API clients are global: created once, they work in every region.
#[derive(Subcommand)]
enum ClientsCommand {
    /// Create a client and print its API key (shown only this once).
    Add {
        #[arg(long)]
        name: String,
        /// A debtor account the client may pay from (repeat for more).
        #[arg(long = "account", value_parser = parse_account)]
        accounts: Vec<String>,
        #[command(flatten)]
        keys: KeyStoreSettings,
        /// Print {"client_id": ..., "api_key": ...}.
        #[arg(long)]
        json: bool,
    },
    /// Every client: id, name, when created, whether revoked.
    List {
        #[command(flatten)]
        keys: KeyStoreSettings,
        #[arg(long)]
        json: bool,
    },
    /// Revoke a client (or with --key one of its keys): refused in every region within 5 seconds.
    Revoke {
        /// The client's id.
        #[arg(long)]
        id: keyfence::domain::ClientId,
        /// Only this key (its id, as `clients keys` shows it); the client's other keys go on working.
        #[arg(long)]
        key: Option<String>,
        #[command(flatten)]
        keys: KeyStoreSettings,
    },
    /// Mint a new API key for a client; its keys valid until now stay valid for the grace.
    Rotate {
        /// The client's id.
        #[arg(long)]
        id: keyfence::domain::ClientId,
        /// How long the previous keys keep working (`24h`, `30m`, `0s`).
        #[arg(long, default_value = "24h", value_parser = humantime::parse_duration)]
        grace: std::time::Duration,
        #[command(flatten)]
        keys: KeyStoreSettings,
        /// Print {"client_id", "api_key", "previous_key_valid_until"}.
        #[arg(long)]
        json: bool,
    },
    /// A client's keys: id, when made, until when valid, when revoked.
    Keys {
        /// The client's id.
        #[arg(long)]
        id: keyfence::domain::ClientId,
        #[command(flatten)]
        keys: KeyStoreSettings,
        #[arg(long)]
        json: bool,
    },
    /// Set a client's limits (each left as it is unless given); seen by every instance within 5 seconds.
    Limits {
        /// The client's id.
        #[arg(long)]
        id: keyfence::domain::ClientId,
        /// The largest amount of one payment, in minor units.
        #[arg(long = "max-amount", value_parser = clap::value_parser!(i64).range(1..))]
        max_amount: Option<i64>,
        /// The currencies the client may pay in, comma-separated (EUR,USD).
        #[arg(long, value_delimiter = ',')]
        currencies: Option<Vec<String>>,
        /// Requests a second the client may make of each instance.
        #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
        rate: Option<u32>,
        /// Requests at once after a quiet spell, per instance.
        #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
        burst: Option<u32>,
        /// Payments in flight at once, per instance.
        #[arg(long = "in-flight", value_parser = clap::value_parser!(u32).range(1..))]
        in_flight: Option<u32>,
        #[command(flatten)]
        keys: KeyStoreSettings,
        #[arg(long)]
        json: bool,
    },
}

/// The debtor accounts a client may pay from (normalised: upper case, no spaces, IBAN check digits checked).
#[derive(Subcommand)]
enum AccountsCommand {
    /// Let a client pay from these accounts.
    Add(AccountsArgs),
    /// Stop a client paying from these accounts.
    Remove(AccountsArgs),
    /// The accounts a client may pay from, and its limits.
    List {
        #[arg(long)]
        client: keyfence::domain::ClientId,
        #[command(flatten)]
        keys: KeyStoreSettings,
        #[arg(long)]
        json: bool,
    },
}

#[derive(Args)]
struct AccountsArgs {
    #[arg(long)]
    client: keyfence::domain::ClientId,
    #[arg(long = "account", required = true, value_parser = parse_account)]
    accounts: Vec<String>,
    #[command(flatten)]
    keys: KeyStoreSettings,
}

fn parse_account(raw: &str) -> Result<String, String> {
    keyfence::domain::normal_account(raw).map_err(str::to_owned)
}

#[derive(Args)]
struct RailSimArgs {
    #[arg(long, default_value = "127.0.0.1:9001")]
    listen: SocketAddr,
    /// Names the system in its references (e.g. e1, e2).
    #[arg(long, default_value = "rail")]
    name: String,
    /// Forget a key's deduplication this many ms after its instruction (as real
    /// rails do); a repeat after that is a new instruction. Default: never.
    #[arg(long = "dedup-window-ms")]
    dedup_window_ms: Option<u64>,
}

#[tokio::main]
async fn main() -> anyhow::Result<ExitCode> {
    let cli = Cli::parse();
    let telemetry = telemetry::init()?;
    #[cfg(feature = "failpoints")]
    let _failpoints = keyfence::failpoint::from_env();
    let done = |result: anyhow::Result<()>| result.map(|()| ExitCode::SUCCESS);
    let outcome = match cli.command {
        Command::Serve(settings) => serve(*settings).await,
        Command::Migrate(args) => done(migrate(*args).await),
        Command::Clients(ClientsCommand::Add { name, accounts, keys, json }) => {
            done(add_client(&name, &accounts, &keys, json).await)
        }
        Command::Clients(ClientsCommand::Limits { id, max_amount, currencies, rate, burst, in_flight, keys, json }) => {
            let limits = keyfence::clients::Limits {
                currencies: currencies.map(|c| c.into_iter().map(|c| c.trim().to_ascii_uppercase()).collect()),
                max_amount_minor: max_amount,
                fair_use: keyfence::clients::FairUse { rate, burst, in_flight },
            };
            done(show_profile(client_store(&keys).await.set_limits(id, &limits).await, id, json))
        }
        Command::Accounts(AccountsCommand::Add(args)) => done(change_accounts(args, true).await),
        Command::Accounts(AccountsCommand::Remove(args)) => done(change_accounts(args, false).await),
        Command::Accounts(AccountsCommand::List { client, keys, json }) => {
            done(show_profile(client_store(&keys).await.profile(client).await, client, json))
        }
        Command::Clients(ClientsCommand::List { keys, json }) => done(list_clients(&keys, json).await),
        Command::Clients(ClientsCommand::Revoke { id, key, keys }) => done(revoke(id, key.as_deref(), &keys).await),
        Command::Clients(ClientsCommand::Rotate { id, grace, keys, json }) => {
            done(rotate(id, grace, &keys, json).await)
        }
        Command::Clients(ClientsCommand::Keys { id, keys, json }) => done(list_keys(id, &keys, json).await),
        Command::Maintain(args) => done(maintain(args).await),
        Command::Regions(RegionsCommand::List { keys, json, ledger }) => {
            done(async { list_regions(&keys, ledger.url()?.as_ref(), json).await }.await)
        }
        Command::Regions(RegionsCommand::Fail(args)) => done(declare(args, RegionState::Failed).await),
        Command::Regions(RegionsCommand::Restore(args)) => done(declare(args, RegionState::Active).await),
        Command::RailSim(args) => done(rail_sim(args).await),
        Command::Pay(args) => pay(*args).await,
        Command::Bench(args) => done(bench(*args).await),
        Command::Recover(args) => done(recover(*args).await),
        Command::Reconcile(args) => reconcile(*args).await,
        Command::BenchReconcile(args) => done(bench_reconcile(*args).await),
    };
    telemetry.shutdown().await;
    outcome
}

async fn bench_reconcile(args: BenchReconcileArgs) -> anyhow::Result<()> {
    let stores = bench::reconcile::Stores { keys: &args.keys, ledger: &args.ledger, region: &args.region };
    let figures = bench::reconcile::run(stores, &args.sizes, args.divergent).await?;
    if let Some(dir) = args.out.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(&args.out, serde_json::to_vec_pretty(&figures)?)?;
    println!(
        "{:>8} {:>8} {:>12} {:>10} {:>12} {:>10} {:>12}",
        "keys", "load s", "clean keys/s", "divergent", "report keys/s", "repair s", "repairs/s"
    );
    let relative = figures.seconds_per_key_relative.iter().zip(&figures.ledger_seconds_per_key_relative);
    for (f, (all, ledger)) in figures.sizes.iter().zip(relative) {
        println!(
            "{:>8} {:>8.1} {:>12.0} {:>10} {:>12.0} {:>10.1} {:>12.1}",
            f.keys,
            f.load_seconds,
            f.clean_keys_per_second,
            f.divergent,
            f.report_keys_per_second,
            f.repair_seconds,
            f.repairs_per_second
        );
        println!(
            "         seconds per key vs the smallest size: x{all:.2} in all, x{ledger:.2} in the ledger \
             (waiting on key-table scan pages {:.1} s, on the ledger {:.1} s, summed over segments)",
            f.clean_key_store_seconds, f.clean_ledger_seconds
        );
    }
    println!("figures written to {}", args.out.display());
    Ok(())
}

/// Exit status 0: the stores agree (or every finding was repaired);
/// 1: divergence remains; 2: the reconciler could not run.
async fn reconcile(args: ReconcileArgs) -> anyhow::Result<ExitCode> {
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
    Ok(if report.unrepaired() > 0 { ExitCode::from(1) } else { ExitCode::SUCCESS })
}

async fn recover(args: RecoverArgs) -> anyhow::Result<()> {
    let engine = startup::build_engine(&args.engine).await.context("connecting to the stores")?;
    let progress = indicatif::ProgressBar::new_spinner().with_message("scanning the in-flight index");
    progress.enable_steady_tick(std::time::Duration::from_millis(120));
    let report = recovery::sweep(
        &engine,
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
    if report.failed.is_empty() { Ok(()) } else { anyhow::bail!("{} key(s) could not be resumed", report.failed.len()) }
}

async fn bench(args: BenchArgs) -> anyhow::Result<()> {
    let ledger = Ledger::connect(&args.ledger).await.context("connecting to the ledger")?;
    let api_key = ApiKey::generate();
    let store = client_store(&args.keys).await;
    let bench = store.add("bench", &api_key).await.context("creating the bench client")?;
    store.change_accounts(bench.id, &["DE89370400440532013000".to_owned()], true).await?;
    let floor = bench::front_door::Floor {
        keys: DynamoKeyStore::new(keystore::connect(&args.keys).await, args.keys.table.clone()),
        ledger,
        e1: RailClient::new("screening", &args.rails.e1_url, args.rails.rail_timeout, args.rails.rail_attempts),
        e2: RailClient::new("payment", &args.rails.e2_url, args.rails.rail_timeout, args.rails.rail_attempts),
    };
    let mut runs = Vec::new();
    for &concurrency in &args.concurrency {
        let plan = bench::front_door::BenchPlan {
            url: args.url.clone(),
            admin_url: args.admin_url.clone(),
            api_key: api_key.reveal().to_owned(),
            requests: args.requests,
            concurrency,
        };
        let report = bench::front_door::run(&plan, &floor).await;
        print!("{}", report.table());
        for figures in [&report.payments, &report.replays] {
            if figures.failures > 0 || figures.statuses.keys().any(|&status| status != 201) {
                anyhow::bail!(
                    "{} did not all answer 201 ({:?}, {} failed): these figures would not measure payments",
                    figures.label,
                    figures.statuses,
                    figures.failures
                );
            }
        }
        runs.push(report);
    }
    let sweep = bench::front_door::Sweep { machine: bench::Machine::this(), runs };
    if let Some(dir) = args.out.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(&args.out, serde_json::to_vec_pretty(&sweep)?)?;
    println!("figures written to {}", args.out.display());
    if let Some(dir) = &args.plots {
        std::fs::create_dir_all(dir)?;
        for path in bench::plot::draw(&sweep.runs, dir)? {
            println!("plot drawn to {}", path.display());
        }
    }
    Ok(())
}

/// Exit status: 0 every line final, 1 some pending, 2 bad input (nothing sent
/// when the file does not validate).
async fn pay(args: PayArgs) -> anyhow::Result<ExitCode> {
    let bytes = std::fs::read(&args.file).with_context(|| format!("reading {}", args.file.display()))?;
    let file_id = batch::file::file_id(&bytes, args.file_id.as_deref());
    let items = match batch::file::read(&args.file, &bytes, &file_id) {
        Ok(items) => items,
        Err(invalid) => {
            eprintln!("keyfence pay: {} does not validate; nothing was sent.\n{invalid}", args.file.display());
            return Ok(ExitCode::from(2));
        }
    };
    let beside_the_file = || {
        let mut results = args.file.clone().into_os_string();
        results.push(".results.csv");
        std::path::PathBuf::from(results)
    };
    let api_key = match api_key(args.api_key_flag.is_some(), args.api_key_file.as_deref()) {
        Ok(key) => key,
        Err(why) => {
            eprintln!("keyfence pay: {why}; nothing was sent.");
            return Ok(ExitCode::from(2));
        }
    };
    let submission = batch::Submission {
        regions: args.url,
        api_key,
        concurrency: usize::from(args.concurrency),
        deadline: std::time::Duration::from_secs(args.deadline_secs),
        results: args.results.unwrap_or_else(beside_the_file),
    };
    let summary = batch::submit(items, file_id, &submission).await?;
    if args.json {
        println!("{}", serde_json::to_string(&summary)?);
    } else {
        println!("{summary}");
    }
    Ok(ExitCode::from(summary.exit_code()))
}

/// The client's API key, from `file` or else `KEYFENCE_API_KEY`; never
/// from a flag (`flagged`: one was given), which every user of the machine
/// could read in the process list.
fn api_key(flagged: bool, file: Option<&std::path::Path>) -> Result<String, String> {
    if flagged {
        return Err("an API key is not taken from the command line, where every user of the machine can read it: \
                    put it in KEYFENCE_API_KEY or in a file named by --api-key-file"
            .into());
    }
    let key = match file {
        Some(file) => std::fs::read_to_string(file)
            .map_err(|e| format!("cannot read the API key from {}: {e}", file.display()))?
            .trim()
            .to_owned(),
        None => std::env::var("KEYFENCE_API_KEY").map_err(|_| "no API key: set KEYFENCE_API_KEY or --api-key-file")?,
    };
    if key.is_empty() { Err("the API key is empty".into()) } else { Ok(key) }
}

/// Exit status 2 when the settings cannot work together.
async fn serve(settings: ServeSettings) -> anyhow::Result<ExitCode> {
    let app = match Application::build(&settings).await {
        Ok(app) => app,
        Err(e @ StartupError::Settings(_)) => {
            eprintln!("keyfence serve: {e}");
            return Ok(ExitCode::from(2));
        }
        Err(e) => return Err(e).context("starting the front door"),
    };
    let (addr, admin) = (app.local_addr()?, app.admin_addr()?);
    tracing::info!(%addr, %admin, region = %settings.engine.work.region, "keyfence serving");
    println!("keyfence: listening on http://{addr} (admin: http://{admin})");
    app.run_until_stopped(shutdown_signal()).await?;
    tracing::info!("keyfence stopped");
    Ok(ExitCode::SUCCESS)
}

struct ExpiryBar(indicatif::ProgressBar);

impl keyfence::expiry::Progress for ExpiryBar {
    fn scanned(&self, keys: usize) {
        self.0.set_message(format!("scanned {keys} keys"));
    }
    fn deleted(&self, keys: usize) {
        self.0.set_position(keys as u64);
    }
}

async fn maintain(args: MaintainArgs) -> anyhow::Result<()> {
    anyhow::ensure!(args.expire, "nothing to do: say what to maintain (--expire)");
    let keys = DynamoKeyStore::new(keystore::connect(&args.keys).await, args.keys.table.clone());
    let bar = ExpiryBar(indicatif::ProgressBar::new_spinner());
    bar.0.set_style(
        indicatif::ProgressStyle::with_template("{spinner} {msg}, {pos} deleted ({per_sec})")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_spinner()),
    );
    bar.0.enable_steady_tick(std::time::Duration::from_millis(120));
    let options = keyfence::expiry::Options { segments: args.segments, rate: args.rate, grace: args.retention.grace };
    let report = keyfence::expiry::sweep(&keys, options, &bar).await;
    bar.0.finish_and_clear();
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", report.summary());
    }
    anyhow::ensure!(report.failures.is_empty(), "{} failure(s)", report.failures.len());
    Ok(())
}

async fn list_regions(
    keys: &KeyStoreSettings,
    ledger: Option<&keyfence::config::DatabaseUrl>,
    json: bool,
) -> anyhow::Result<()> {
    let store = RegionStore::new(keystore::connect(keys).await, keys.table.clone());
    let registry = store.read().await.context("reading the region registry")?;
    let fence = match ledger {
        Some(url) => {
            let ledger = Ledger::connect(&LedgerSettings::remote(url.clone()))
                .await
                .with_context(|| format!("connecting to {url}"))?;
            Some(ledger.region_fence().await.with_context(|| format!("reading the region fence of {url}"))?)
        }
        None => None,
    };
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(&serde_json::json!({ "registry": registry, "ledger_fence": fence }))?
        );
    } else {
        print!("{}", registry.table());
        if let Some(fence) = fence {
            println!(
                "ledger fence: {} for {} at epoch {}{}",
                fence.state(),
                fence.region.as_deref().unwrap_or("(never set)"),
                fence.epoch,
                fence.reason.filter(|r| !r.is_empty()).map(|r| format!(" ({r})")).unwrap_or_default()
            );
        }
    }
    Ok(())
}

async fn declare(args: DeclareArgs, state: RegionState) -> anyhow::Result<()> {
    let store = RegionStore::new(keystore::connect(&args.keys).await, args.keys.table.clone());
    let ledger = match &args.ledger.url()? {
        Some(url) => {
            let settings = LedgerSettings::remote(url.clone());
            Some(Ledger::connect(&settings).await.with_context(|| format!("connecting to {url}"))?)
        }
        None => None,
    };
    let by = args.by.clone().unwrap_or_else(|| {
        let user = std::env::var("USER").or_else(|_| std::env::var("LOGNAME")).unwrap_or_else(|_| "unknown".into());
        let host = std::env::var("HOSTNAME")
            .or_else(|_| std::fs::read_to_string("/etc/hostname").map(|h| h.trim().to_owned()))
            .unwrap_or_else(|_| "unknown".into());
        format!("{user}@{host}")
    });
    let (changed, fence) = regions::declare(&store, ledger.as_ref(), &args.region, state, &by, &args.reason).await?;
    match changed {
        Changed::Made(change) => println!(
            "region {} is now {} (epoch {}, by {}{})",
            change.region,
            change.state.as_str(),
            change.epoch,
            change.by,
            if change.reason.is_empty() { String::new() } else { format!(": {}", change.reason) }
        ),
        Changed::AlreadySo(Some(change)) => println!(
            "region {} was already {} (epoch {}, by {})",
            change.region,
            change.state.as_str(),
            change.epoch,
            change.by
        ),
        Changed::AlreadySo(None) => println!("region {} was already {}", args.region, state.as_str()),
    }
    match fence {
        Some(FenceChange::Set(_)) => {
            println!("its ledger is {}", if state == RegionState::Failed { "fenced" } else { "open again" })
        }
        Some(FenceChange::Newer(fence)) => println!(
            "its ledger follows a newer declaration (epoch {}: {}) and was left as it is",
            fence.epoch,
            fence.state()
        ),
        None => {
            println!("its instances bring its ledger's fence in line within seconds (`regions list --ledger` shows it)")
        }
    }
    Ok(())
}

async fn client_store(keys: &KeyStoreSettings) -> ClientStore {
    ClientStore::new(keystore::connect(keys).await, keys.table.clone())
}

async fn add_client(name: &str, accounts: &[String], keys: &KeyStoreSettings, json: bool) -> anyhow::Result<()> {
    let key = ApiKey::generate();
    let store = client_store(keys).await;
    let id = store.add(name, &key).await.context("creating the client (has `keyfence migrate` run?)")?.id;
    store.change_accounts(id, accounts, true).await.context("recording the client's accounts")?;
    if json {
        println!(
            "{}",
            serde_json::json!({ "client_id": id.to_string(), "api_key": key.reveal(), "accounts": accounts })
        );
    } else {
        println!("client {name}: {id}");
        println!("api key (shown only now): {}", key.reveal());
        println!(
            "accounts: {}",
            if accounts.is_empty() { "none yet (keyfence accounts add)".to_owned() } else { accounts.join(", ") }
        );
    }
    Ok(())
}

async fn change_accounts(args: AccountsArgs, add: bool) -> anyhow::Result<()> {
    let changed = client_store(&args.keys).await.change_accounts(args.client, &args.accounts, add).await;
    show_profile(changed, args.client, false)
}

/// A client's profile, for people or as JSON.
fn show_profile(
    profile: Result<keyfence::clients::Profile, keyfence::clients::ClientsError>,
    id: keyfence::domain::ClientId,
    json: bool,
) -> anyhow::Result<()> {
    let profile = profile?;
    if json {
        println!("{}", serde_json::json!({ "client_id": id.to_string(), "profile": profile }));
        return Ok(());
    }
    println!("client {id}");
    println!("accounts: {}", profile.accounts.iter().cloned().collect::<Vec<_>>().join(", "));
    let currencies = profile.currencies.map(|c| c.into_iter().collect::<Vec<_>>().join(", "));
    println!("currencies: {}", currencies.unwrap_or_else(|| "any".into()));
    println!(
        "largest payment: {}",
        profile.max_amount_minor.map_or("no limit of its own".to_owned(), |m| format!("{m} minor units"))
    );
    let own =
        |limit: Option<u32>, unit: &str| limit.map_or("the instance's default".to_owned(), |n| format!("{n} {unit}"));
    println!(
        "rate: {} (burst: {}), per instance",
        own(profile.fair_use.rate, "a second"),
        own(profile.fair_use.burst, "at once")
    );
    println!("in flight: {}, per instance", own(profile.fair_use.in_flight, "payments"));
    Ok(())
}

async fn list_clients(keys: &KeyStoreSettings, json: bool) -> anyhow::Result<()> {
    let clients = client_store(keys).await.list().await?;
    if json {
        println!("{}", serde_json::to_string_pretty(&clients)?);
        return Ok(());
    }
    println!("{:<36}  {:<24}  {:<20}  revoked", "client", "name", "created");
    for c in &clients {
        println!(
            "{:<36}  {:<24}  {:<20}  {}",
            c.id,
            c.name,
            when(c.created_at),
            c.revoked_at.map(when).unwrap_or_default()
        );
    }
    println!("{} client(s)", clients.len());
    Ok(())
}

async fn revoke(id: keyfence::domain::ClientId, key: Option<&str>, keys: &KeyStoreSettings) -> anyhow::Result<()> {
    let store = client_store(keys).await;
    let delay = keyfence::clients::CACHE_FOR.as_secs();
    match key {
        Some(key) => {
            let record = store.revoke_key(id, key).await?;
            println!(
                "key {key} of client {} ({}) revoked; refused in every region within {delay} s",
                record.id, record.name
            );
        }
        None => {
            let record = store.revoke(id).await?;
            println!(
                "client {} ({}) revoked; its keys are refused in every region within {delay} s",
                record.id, record.name
            );
        }
    }
    Ok(())
}

/// Milliseconds since the epoch, as RFC 3339.
fn when(ms: u64) -> String {
    keyfence::ledger::timestamp(Millis::new(ms))
        .format(&time::format_description::well_known::Rfc3339)
        .unwrap_or_default()
}

async fn rotate(
    id: keyfence::domain::ClientId,
    grace: std::time::Duration,
    keys: &KeyStoreSettings,
    json: bool,
) -> anyhow::Result<()> {
    let rotated = client_store(keys).await.rotate(id, grace).await?;
    if json {
        let body = serde_json::json!({
            "client_id": rotated.client_id.to_string(),
            "api_key": rotated.api_key.reveal(),
            "previous_key_valid_until": rotated.previous_key_valid_until.map(when),
        });
        println!("{body}");
        return Ok(());
    }
    println!("client {id}: new api key (shown only now): {}", rotated.api_key.reveal());
    match rotated.previous_key_valid_until {
        Some(until) => println!("the previous key(s) keep working until {}", when(until)),
        None => println!("no previous key was valid"),
    }
    Ok(())
}

async fn list_keys(id: keyfence::domain::ClientId, keys: &KeyStoreSettings, json: bool) -> anyhow::Result<()> {
    let (record, _) = client_store(keys).await.record(id).await?.ok_or(keyfence::clients::ClientsError::Unknown(id))?;
    if json {
        println!("{}", serde_json::to_string_pretty(&record.keys)?);
        return Ok(());
    }
    println!("{:<12}  {:<20}  {:<20}  revoked", "key", "created", "valid until");
    for key in &record.keys {
        let until = key.valid_until.map(when).unwrap_or_else(|| "-".into());
        println!(
            "{:<12}  {:<20}  {:<20}  {}",
            key.key_id,
            when(key.created_at),
            until,
            key.revoked_at.map(when).unwrap_or_default()
        );
    }
    println!("{} key(s); client {}", record.keys.len(), if record.revoked_at.is_some() { "revoked" } else { "active" });
    Ok(())
}

async fn rail_sim(args: RailSimArgs) -> anyhow::Result<()> {
    let listener =
        tokio::net::TcpListener::bind(args.listen).await.with_context(|| format!("binding {}", args.listen))?;
    let addr = listener.local_addr()?;
    tracing::info!(%addr, name = %args.name, "rail simulator serving");
    println!("rail-sim {}: listening on http://{addr}", args.name);
    let sim = rail::sim::Simulator::new(&args.name, args.dedup_window_ms.map(std::time::Duration::from_millis));
    rail::sim::serve(listener, sim, shutdown_signal()).await?;
    Ok(())
}

async fn migrate(args: MigrateArgs) -> anyhow::Result<()> {
    let done = startup::migrate(&args.keys, &args.ledger, args.drop_older_clients)
        .await
        .with_context(|| format!("migrating table {} and ledger {}", args.keys.table, args.ledger.database_url))?;
    let table = match done.table {
        TableChange::Created => "created",
        TableChange::AlreadyThere => "already there",
    };
    if args.json {
        let report = serde_json::json!({
            "table": { "name": args.keys.table, "change": table },
            "ledger": {
                "database": args.ledger.database_url.to_string(),
                "database_created": done.ledger.database_created,
                "applied": done.ledger.applied,
                "version": done.ledger.version,
            },
            "clients_copied": done.clients_copied,
            "older_clients": {
                "copied": done.older_clients.copied,
                "kept": done.older_clients.kept,
                "dropped": done.older_clients.dropped,
                "revocations": done.older_clients.revocations,
            },
        });
        println!("{report}");
    } else {
        println!("key table {}: {table}", args.keys.table);
        println!(
            "ledger {}: {}{} migration(s) applied, schema version {}",
            args.ledger.database_url,
            if done.ledger.database_created { "database created, " } else { "" },
            done.ledger.applied.len(),
            done.ledger.version.map_or_else(|| "none".to_owned(), |v| v.to_string()),
        );
        let older = done.older_clients;
        if older.copied > 0 {
            println!("{} client(s) of the older layout copied into client records", older.copied);
        }
        if older.kept > 0 {
            println!(
                "{} client item(s) of the older layout kept for instances of an older version; once every region \
                 runs this one: keyfence migrate --drop-older-clients",
                older.kept
            );
        }
        if older.revocations > 0 {
            println!("{} revocation(s) made in the older layout carried into client records", older.revocations);
        }
        if older.dropped > 0 {
            println!("{} item(s) of the older layout deleted", older.dropped);
        }
        if done.clients_copied > 0 {
            println!("{} client(s) of this ledger are in the key table now (clients are global)", done.clients_copied);
        }
    }
    Ok(())
}
