//! Each tool's arguments and the few lines that run it over the library.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use anyhow::Context;
use clap::Args;
use keyfence::clients::ClientStore;
use keyfence::config::RailSettings;
use keyfence::domain::ApiKey;
use keyfence::keystore;
use keyfence::keystore::KeyStoreSettings;
use keyfence::ledger;
use keyfence::ledger::LedgerSettings;
use keyfence::rail;
use keyfence::startup::shutdown_signal;

use crate::bench;

#[derive(Args)]
pub struct RailSimArgs {
    #[arg(long, default_value = "127.0.0.1:9001")]
    listen: SocketAddr,
    /// Names the system in its references (e.g. e1, e2).
    #[arg(long, default_value = "rail")]
    name: String,
    /// Forget a key's deduplication this many ms after its instruction (as real
    /// rails do); a repeat after that is a new instruction. Default: never.
    #[arg(long = "dedup-window-ms")]
    dedup_window_ms: Option<u64>,
    /// Post a signed notification of every verdict and return to this URL (keyfence's
    /// `/v1/rail-events/{rail}`).
    #[arg(long, requires = "notify_secret")]
    notify: Option<String>,
    /// The Standard Webhooks secret (`whsec_...`) notifications are signed with.
    #[arg(long = "notify-secret", env = "RAIL_SIM_NOTIFY_SECRET", hide_env_values = true)]
    notify_secret: Option<String>,
}

#[derive(Args)]
pub struct BenchArgs {
    /// The front door to measure.
    #[arg(long, default_value = "http://127.0.0.1:8080")]
    url: String,
    /// Its admin listener, for the CPU time serve spends (its /metrics).
    #[arg(long = "admin-url", default_value = "http://127.0.0.1:9090")]
    admin_url: String,
    /// A second instance of the same stack: every payment is replayed to it
    /// as well, where its answer is not in memory.
    #[arg(long = "cold-url", requires = "cold_admin_url")]
    cold_url: Option<String>,
    /// That instance's admin listener.
    #[arg(long = "cold-admin-url")]
    cold_admin_url: Option<String>,
    /// Runs at each concurrency; the summary takes their median.
    #[arg(long, default_value_t = 3)]
    repeat: usize,
    /// Payments to send (each phase sends this many).
    #[arg(short = 'n', long, default_value_t = 1000)]
    requests: usize,
    /// Requests in flight at once; a comma-separated list measures each in turn.
    #[arg(short = 'c', long, value_delimiter = ',', default_value = "16")]
    concurrency: Vec<usize>,
    /// Where to write the figures (JSON).
    #[arg(long, default_value = "bench-results/front-door.json")]
    out: PathBuf,
    /// Also draw throughput.svg and cpu.svg against concurrency into this directory.
    #[arg(long)]
    plots: Option<PathBuf>,
    /// The stores and rails of the same stack, for the floor loop.
    #[command(flatten)]
    keys: KeyStoreSettings,
    #[command(flatten)]
    ledger: LedgerSettings,
    #[command(flatten)]
    rails: RailSettings,
}

#[derive(Args)]
pub struct BenchReconcileArgs {
    /// Numbers of keys to measure at, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "10000,100000")]
    sizes: Vec<usize>,
    /// Share of payments erased from the ledger for the divergent runs.
    #[arg(long, default_value_t = 0.01)]
    divergent: f64,
    /// Where to write the figures (JSON).
    #[arg(long, default_value = "bench-results/reconcile.json")]
    out: PathBuf,
    /// The region the loaded payments are homed in.
    #[arg(long, env = "KEYFENCE_REGION", default_value = "local-1")]
    region: String,
    #[command(flatten)]
    keys: KeyStoreSettings,
    #[command(flatten)]
    ledger: LedgerSettings,
}

pub async fn rail_sim(args: RailSimArgs) -> anyhow::Result<()> {
    let listener =
        tokio::net::TcpListener::bind(args.listen).await.with_context(|| format!("binding {}", args.listen))?;
    let addr = listener.local_addr()?;
    tracing::info!(%addr, name = %args.name, "rail simulator serving");
    println!("rail-sim {}: listening on http://{addr}", args.name);
    let sim = rail::sim::Simulator::new(&args.name, args.dedup_window_ms.map(std::time::Duration::from_millis));
    if let (Some(url), Some(secret)) = (args.notify, args.notify_secret) {
        tracing::info!(%url, "posting notifications");
        sim.notify_to(rail::sim::notify::Callback { url, secret });
    }
    rail::sim::serve(listener, sim, shutdown_signal()).await?;
    Ok(())
}

pub async fn bench(args: BenchArgs) -> anyhow::Result<()> {
    let (ledger, settings) = bench::floor::fresh_ledger(&args.ledger).await.context("making the floor's own ledger")?;
    ledger.pool().close().await;
    let stores = bench::floor::Stores { keys: args.keys.clone(), ledger: settings.clone(), rails: args.rails.clone() };
    let swept = sweep(&args, &stores).await;
    let dropped = ledger::drop_database(&settings).await.context("dropping the floor's own ledger");
    match (swept, dropped) {
        (Err(e), Err(also)) => {
            tracing::warn!(error = %also, "the floor's own ledger is left behind");
            Err(e)
        }
        (swept, dropped) => swept.and(dropped),
    }
}

/// Every run of the front door and its floors, then their summary and plots.
/// The floors' clients are closed before it returns.
async fn sweep(args: &BenchArgs, stores: &bench::floor::Stores) -> anyhow::Result<()> {
    let floor = bench::floor::Floor::connect(stores).await?;
    let swept = match bench::http_floor::HttpFloor::start(stores.clone()).context("starting the floor behind HTTP") {
        Ok(served) => runs(args, &floor, &served).await,
        Err(e) => Err(e),
    };
    floor.ledger.pool().close().await;
    swept
}

async fn runs(
    args: &BenchArgs,
    floor: &bench::floor::Floor,
    served: &bench::http_floor::HttpFloor,
) -> anyhow::Result<()> {
    let api_key = ApiKey::generate();
    let store = ClientStore::new(keystore::connect(&args.keys).await?, args.keys.table.clone());
    let bench = store.add("bench", &api_key).await.context("creating the bench client")?;
    store.change_accounts(bench.id, &["DE89370400440532013000".to_owned()], true).await?;
    let serve = bench::front_door::Instance { url: args.url.clone(), admin_url: args.admin_url.clone() };
    let cold = args.cold_url.clone().zip(args.cold_admin_url.clone());
    let cold = cold.map(|(url, admin_url)| bench::front_door::Instance { url, admin_url });
    let mut runs = Vec::new();
    for repeat in 0..args.repeat.max(1) {
        for &concurrency in &args.concurrency {
            let plan = bench::front_door::BenchPlan {
                serve: serve.clone(),
                cold: cold.clone(),
                api_key: api_key.reveal().to_owned(),
                requests: args.requests,
                concurrency,
                floors_first: repeat % 2 == 1,
            };
            let report = bench::front_door::run(&plan, floor, served).await;
            println!("run {} of {}", repeat + 1, args.repeat.max(1));
            print!("{}", report.table());
            for figures in report.front_door() {
                if figures.failures > 0 || figures.statuses.keys().any(|&status| status != 201) {
                    anyhow::bail!(
                        "{} did not all answer 201 ({:?}, {} failed): these figures would not measure payments",
                        figures.label,
                        figures.statuses,
                        figures.failures
                    );
                }
            }
            for figures in report.floors() {
                if figures.failures > 0 || figures.statuses.keys().any(|&status| status >= 300) {
                    anyhow::bail!(
                        "{} failed {} times and answered {:?} (see the warnings): there is nothing to measure against",
                        figures.label,
                        figures.failures,
                        figures.statuses
                    );
                }
            }
            runs.push(report);
        }
    }
    let sweep = bench::summary::Sweep::new(bench::Machine::this(), runs);
    print!("{}", sweep.table());
    write_figures(&args.out, &serde_json::to_vec_pretty(&sweep)?)?;
    if let Some(dir) = &args.plots {
        std::fs::create_dir_all(dir)?;
        for path in bench::plot::draw(&sweep.runs, dir)? {
            println!("plot drawn to {}", path.display());
        }
    }
    Ok(())
}

pub async fn bench_reconcile(args: BenchReconcileArgs) -> anyhow::Result<()> {
    let stores = bench::reconcile::Stores { keys: &args.keys, ledger: &args.ledger, region: &args.region };
    let figures = bench::reconcile::run(stores, &args.sizes, args.divergent).await?;
    write_figures(&args.out, &serde_json::to_vec_pretty(&figures)?)?;
    print!("{}", figures.table());
    Ok(())
}

/// Writes a run's figures, making the folder they go in.
fn write_figures(out: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    if let Some(dir) = out.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(out, bytes).with_context(|| format!("writing {}", out.display()))?;
    println!("figures written to {}", out.display());
    Ok(())
}
