//! `keyfence clients ...` and `keyfence accounts ...`: API clients, their
//! keys, limits and the debtor accounts each may pay from. Clients are
//! global (control items of the key table): made once, they work in every region.

use anyhow::Context;
use clap::{Args, Subcommand};
use keyfence::clients::ClientStore;
use keyfence::domain::{ApiKey, Millis};
use keyfence::keystore;
use keyfence::keystore::KeyStoreSettings;

/// API clients are global: created once, they work in every region.
#[derive(Subcommand)]
pub enum ClientsCommand {
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
pub enum AccountsCommand {
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
pub struct AccountsArgs {
    #[arg(long)]
    client: keyfence::domain::ClientId,
    #[arg(long = "account", required = true, value_parser = parse_account)]
    accounts: Vec<String>,
    #[command(flatten)]
    keys: KeyStoreSettings,
}

pub fn parse_account(raw: &str) -> Result<String, String> {
    keyfence::domain::normal_account(raw).map_err(str::to_owned)
}

pub async fn client_store(keys: &KeyStoreSettings) -> anyhow::Result<ClientStore> {
    Ok(ClientStore::new(keystore::connect(keys).await?, keys.table.clone()))
}

pub async fn add_client(name: &str, accounts: &[String], keys: &KeyStoreSettings, json: bool) -> anyhow::Result<()> {
    let key = ApiKey::generate();
    let store = client_store(keys).await?;
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

pub async fn change_accounts(args: AccountsArgs, add: bool) -> anyhow::Result<()> {
    let changed = client_store(&args.keys).await?.change_accounts(args.client, &args.accounts, add).await;
    show_profile(changed, args.client, false)
}

/// A client's profile, for people or as JSON.
pub fn show_profile(
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

pub async fn list_clients(keys: &KeyStoreSettings, json: bool) -> anyhow::Result<()> {
    let clients = client_store(keys).await?.list().await?;
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

pub async fn revoke(id: keyfence::domain::ClientId, key: Option<&str>, keys: &KeyStoreSettings) -> anyhow::Result<()> {
    let store = client_store(keys).await?;
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
pub fn when(ms: u64) -> String {
    keyfence::ledger::timestamp(Millis::new(ms))
        .format(&time::format_description::well_known::Rfc3339)
        .unwrap_or_default()
}

pub async fn rotate(
    id: keyfence::domain::ClientId,
    grace: std::time::Duration,
    keys: &KeyStoreSettings,
    json: bool,
) -> anyhow::Result<()> {
    let rotated = client_store(keys).await?.rotate(id, grace).await?;
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

pub async fn list_keys(id: keyfence::domain::ClientId, keys: &KeyStoreSettings, json: bool) -> anyhow::Result<()> {
    let (record, _) =
        client_store(keys).await?.record(id).await?.ok_or(keyfence::clients::ClientsError::Unknown(id))?;
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

impl ClientsCommand {
    pub async fn run(self) -> anyhow::Result<()> {
        match self {
            Self::Add { name, accounts, keys, json } => add_client(&name, &accounts, &keys, json).await,
            Self::List { keys, json } => list_clients(&keys, json).await,
            Self::Revoke { id, key, keys } => revoke(id, key.as_deref(), &keys).await,
            Self::Rotate { id, grace, keys, json } => rotate(id, grace, &keys, json).await,
            Self::Keys { id, keys, json } => list_keys(id, &keys, json).await,
            Self::Limits { id, max_amount, currencies, rate, burst, in_flight, keys, json } => {
                let limits = keyfence::clients::Limits {
                    currencies: currencies.map(|c| c.into_iter().map(|c| c.trim().to_ascii_uppercase()).collect()),
                    max_amount_minor: max_amount,
                    fair_use: keyfence::clients::FairUse { rate, burst, in_flight },
                };
                show_profile(client_store(&keys).await?.set_limits(id, &limits).await, id, json)
            }
        }
    }
}

impl AccountsCommand {
    pub async fn run(self) -> anyhow::Result<()> {
        match self {
            Self::Add(args) => change_accounts(args, true).await,
            Self::Remove(args) => change_accounts(args, false).await,
            Self::List { client, keys, json } => {
                show_profile(client_store(&keys).await?.profile(client).await, client, json)
            }
        }
    }
}
