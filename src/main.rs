//! The `keyfence` binary: a thin clap front over the library. Each subcommand
//! parses its settings and calls one library function.

use std::net::SocketAddr;

use anyhow::Context;
use clap::{Args, Parser, Subcommand};
use keyfence::config::{KeyStoreSettings, LedgerSettings, ServeSettings};
use keyfence::domain::ApiKey;
use keyfence::keystore::TableChange;
use keyfence::ledger::Ledger;
use keyfence::startup::{Application, shutdown_signal};
use keyfence::{rail, startup, telemetry};

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
    Migrate(MigrateArgs),
    /// Manage API clients.
    #[command(subcommand)]
    Clients(ClientsCommand),
    /// Run a rail simulator standing in for an external system (E1 or E2).
    RailSim(RailSimArgs),
}

#[derive(Args)]
struct MigrateArgs {
    #[command(flatten)]
    keys: KeyStoreSettings,
    #[command(flatten)]
    ledger: LedgerSettings,
    /// Print the result as JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Subcommand)]
enum ClientsCommand {
    /// Create a client and print its API key (shown only this once).
    Add {
        #[arg(long)]
        name: String,
        #[command(flatten)]
        ledger: LedgerSettings,
        /// Print {"client_id": ..., "api_key": ...}.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Args)]
struct RailSimArgs {
    #[arg(long, default_value = "127.0.0.1:9001")]
    listen: SocketAddr,
    /// Names the system in its references (e.g. e1, e2).
    #[arg(long, default_value = "rail")]
    name: String,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    telemetry::init();
    match Cli::parse().command {
        Command::Serve(settings) => serve(*settings).await,
        Command::Migrate(args) => migrate(args).await,
        Command::Clients(ClientsCommand::Add { name, ledger, json }) => add_client(&name, &ledger, json).await,
        Command::RailSim(args) => rail_sim(args).await,
    }
}

async fn serve(settings: ServeSettings) -> anyhow::Result<()> {
    let app = Application::build(&settings).await.context("starting the front door")?;
    tracing::info!(addr = %app.local_addr()?, region = %settings.region, "keyfence serving");
    app.run_until_stopped(shutdown_signal()).await?;
    tracing::info!("keyfence stopped");
    Ok(())
}

async fn add_client(name: &str, settings: &LedgerSettings, json: bool) -> anyhow::Result<()> {
    let ledger = Ledger::connect(settings).await.with_context(|| format!("connecting to {}", settings.database_url))?;
    let key = ApiKey::generate();
    let id = ledger.create_client(name, &key).await.context("creating the client (has `keyfence migrate` run?)")?;
    if json {
        println!("{}", serde_json::json!({ "client_id": id.to_string(), "api_key": key.reveal() }));
    } else {
        println!("client {name}: {id}");
        println!("api key (shown only now): {}", key.reveal());
    }
    Ok(())
}

async fn rail_sim(args: RailSimArgs) -> anyhow::Result<()> {
    let listener = tokio::net::TcpListener::bind(args.listen).await.with_context(|| format!("binding {}", args.listen))?;
    tracing::info!(addr = %listener.local_addr()?, name = %args.name, "rail simulator serving");
    rail::sim::serve(listener, &args.name, shutdown_signal()).await?;
    Ok(())
}

async fn migrate(args: MigrateArgs) -> anyhow::Result<()> {
    let done = startup::migrate(&args.keys, &args.ledger)
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
    }
    Ok(())
}
