//! The `keyfence` binary: a thin clap front over the library. Each subcommand
//! parses its settings and calls one library function.

use anyhow::Context;
use clap::{Args, Parser, Subcommand};
use keyfence::config::{KeyStoreSettings, LedgerSettings};
use keyfence::keystore::TableChange;
use keyfence::{startup, telemetry};

#[derive(Parser)]
#[command(name = "keyfence", version, about = "Exactly-once payment requests across regions")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Create the key table and apply the ledger's migrations (idempotent).
    Migrate(MigrateArgs),
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

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    telemetry::init();
    match Cli::parse().command {
        Command::Migrate(args) => migrate(args).await,
    }
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
