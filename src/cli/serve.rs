//! `keyfence serve` and `keyfence migrate`: the front door, and the schema
//! of the stores it needs.

use std::process::ExitCode;

use anyhow::Context;
use clap::Args;
use keyfence::config::ServeSettings;
use keyfence::keystore::KeyStoreSettings;
use keyfence::keystore::TableChange;
use keyfence::ledger::LedgerSettings;
use keyfence::startup::{self, Application, MigrateOptions, StartupError, shutdown_signal};
use keyfence::webhooks::SealingSettings;

/// Exit status 2 when the settings cannot work together (or are left at
/// local defaults away from a local endpoint).
pub async fn serve(settings: ServeSettings) -> anyhow::Result<ExitCode> {
    let app = match Application::build(&settings).await {
        Ok(app) => app,
        Err(e @ (StartupError::Settings(_) | StartupError::Connect(_))) => {
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

#[derive(Args)]
pub struct MigrateArgs {
    #[command(flatten)]
    keys: KeyStoreSettings,
    #[command(flatten)]
    ledger: LedgerSettings,
    /// The key webhook secrets kept in the clear (from before they were sealed) are sealed with.
    #[command(flatten)]
    sealing: SealingSettings,
    /// Seal the webhook secrets older versions kept in the clear: only once every region's
    /// instances run this version (an older one cannot sign with a sealed secret).
    #[arg(long = "seal-webhook-secrets")]
    seal_webhook_secrets: bool,
    /// Delete the older layout's client items once copied: only when every region runs this version.
    #[arg(long = "drop-older-clients")]
    drop_older_clients: bool,
    /// Create the key table if it is missing, also on AWS (a local endpoint always may). Without
    /// it an existing table is checked against the schema keyfence needs, and left as it is.
    #[arg(long = "create-table")]
    create_table: bool,
    /// Print the result as JSON.
    #[arg(long)]
    json: bool,
}

pub async fn migrate(args: MigrateArgs) -> anyhow::Result<()> {
    let options = MigrateOptions {
        create_table: args.create_table,
        drop_older_clients: args.drop_older_clients,
        seal_webhook_secrets: args.seal_webhook_secrets,
    };
    let done = startup::migrate(&args.keys, &args.ledger, &args.sealing, options)
        .await
        .with_context(|| format!("migrating table {} and ledger {}", args.keys.table, args.ledger.database_url))?;
    let table = match done.table {
        TableChange::Created => "created",
        TableChange::AlreadyThere => "already there",
        TableChange::Checked => "checked",
    };
    if args.json {
        let report = serde_json::json!({
            "table": { "name": args.keys.table, "change": table, "notes": done.table_notes },
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
            "webhook_secrets": {
                "sealed": done.webhook_secrets.sealed,
                "left_in_clear": done.webhook_secrets.left,
                "clients_failed": done.webhook_secrets.failed,
            },
        });
        println!("{report}");
    } else {
        println!("key table {}: {table}", args.keys.table);
        for note in &done.table_notes {
            println!("  {note}");
        }
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
        let secrets = done.webhook_secrets;
        if secrets.sealed > 0 {
            println!("{} webhook secret(s) kept in the clear are sealed now", secrets.sealed);
        }
        if secrets.left > 0 {
            println!(
                "{} webhook secret(s) are kept in the clear by an older version; once every region runs this one: \
                 keyfence migrate --seal-webhook-secrets",
                secrets.left
            );
        }
    }
    anyhow::ensure!(
        done.webhook_secrets.failed == 0,
        "the webhook secrets of {} client(s) could not be read or sealed (the log says why); run migrate again",
        done.webhook_secrets.failed
    );
    Ok(())
}
