//! The `keyfence` command line: one module per command group, each
//! parsing its settings and calling the library. What only tools need (the
//! benchmarks, the rail simulator) is in `keyfence-tools`, not here.

mod clients;
mod inbox;
mod pay;
mod regions;
mod serve;
mod webhooks;
mod workers;

use std::process::ExitCode;

use clap::{ArgMatches, Parser, Subcommand};
use keyfence::config::ServeSettings;

#[derive(Parser)]
#[command(name = "keyfence", version, about = "Exactly-once payment requests across regions")]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the front door: POST /v1/payments and friends.
    Serve(Box<ServeSettings>),
    /// Create the key table and apply the ledger's migrations (idempotent).
    Migrate(Box<serve::MigrateArgs>),
    /// Manage API clients.
    #[command(subcommand)]
    Clients(clients::ClientsCommand),
    /// The debtor accounts each client may pay from.
    #[command(subcommand)]
    Accounts(clients::AccountsCommand),
    /// Housekeeping beside traffic: --expire deletes finished keys past their retention; --partitions
    /// keeps the ledger's idempotency tables to what the retention allows.
    Maintain(workers::MaintainArgs),
    /// See which regions are active, declare one failed, or bring it back.
    #[command(subcommand)]
    Regions(regions::RegionsCommand),
    /// Resume every stale in-flight request once, then report (the worker inside `serve` does this on an interval).
    Recover(Box<workers::RecoverArgs>),
    /// Compare the key store with this region's ledger; report, or repair with --repair.
    Reconcile(Box<workers::ReconcileArgs>),
    /// Pay every line of a CSV or JSON-lines file, exactly once even when run again.
    Pay(Box<pay::PayArgs>),
    /// A client's webhook endpoints: add, list, remove, rotate a secret.
    #[command(subcommand)]
    Webhooks(webhooks::WebhooksCommand),
    /// Rail notifications kept for a person: settle one.
    #[command(subcommand)]
    Inbox(inbox::InboxCommand),
}

/// The settings whose defaults suit only the dev stack, by argument id and variable.
const LOCAL_DEFAULTS: [(&str, &str); 4] = [
    ("region", "KEYFENCE_REGION"),
    ("database_url", "DATABASE_URL"),
    ("e1_url", "KEYFENCE_E1_URL"),
    ("e2_url", "KEYFENCE_E2_URL"),
];

/// The settings that take a URL which may hold a credential, by argument
/// id and flag: taken from the environment or a file, never the command
/// line, where every user of the machine can read it.
const SECRET_URLS: [(&str, &str); 2] = [("database_url", "--database-url"), ("rail_proxy", "--rail-proxy")];

/// Whether `url` holds a credential: a password (in its user part, or a
/// `password` parameter, which PostgreSQL's URLs take), or for a proxy, a
/// user name too (often a token).
pub fn holds_credential(url: &str, user_counts: bool) -> bool {
    reqwest::Url::parse(url).is_ok_and(|u| {
        u.password().is_some()
            || (user_counts && !u.username().is_empty())
            || u.query_pairs().any(|(name, _)| name.eq_ignore_ascii_case("password"))
    })
}

/// The flags of `matches` (and its subcommands) given a URL with a
/// credential on the command line.
pub fn passwords_on_command_line(matches: &ArgMatches) -> Vec<&'static str> {
    let mut found: Vec<&'static str> = SECRET_URLS
        .iter()
        .filter(|(id, _)| {
            matches.try_get_raw(id).ok().flatten().is_some_and(|mut raw| {
                matches.value_source(id) == Some(clap::parser::ValueSource::CommandLine)
                    && raw.any(|url| url.to_str().is_some_and(|url| holds_credential(url, *id == "rail_proxy")))
            })
        })
        .map(|&(_, flag)| flag)
        .collect();
    if let Some((_, sub)) = matches.subcommand() {
        found.extend(passwords_on_command_line(sub));
    }
    found
}

/// The settings of the subcommand `matches` ran that were left at their
/// local-development defaults.
fn defaulted(matches: &ArgMatches) -> Vec<&'static str> {
    let Some((_, command)) = matches.subcommand() else { return Vec::new() };
    LOCAL_DEFAULTS
        .iter()
        .filter(|(id, _)| command.value_source(id) == Some(clap::parser::ValueSource::DefaultValue))
        .map(|&(_, variable)| variable)
        .collect()
}

impl Cli {
    /// Runs the command (`matches`: where each setting came from); its exit
    /// status says how it went.
    pub async fn run(self, matches: &ArgMatches) -> anyhow::Result<ExitCode> {
        let done = |result: anyhow::Result<()>| result.map(|()| ExitCode::SUCCESS);
        match self.command {
            Command::Serve(mut settings) => {
                settings.engine.defaulted = defaulted(matches);
                serve::serve(*settings).await
            }
            Command::Migrate(args) => done(serve::migrate(*args).await),
            Command::Clients(command) => done(command.run().await),
            Command::Accounts(command) => done(command.run().await),
            Command::Maintain(args) => done(workers::maintain(args).await),
            Command::Regions(command) => done(command.run().await),
            Command::Recover(mut args) => {
                args.engine.defaulted = defaulted(matches);
                workers::recover(*args).await
            }
            Command::Reconcile(mut args) => {
                args.engine.defaulted = defaulted(matches);
                workers::reconcile(*args).await
            }
            Command::Pay(args) => pay::pay(*args).await,
            Command::Webhooks(command) => done(command.run().await),
            Command::Inbox(command) => done(command.run().await),
        }
    }
}
