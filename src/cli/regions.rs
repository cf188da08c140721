//! `keyfence regions list|fail|restore`: which regions are active, and the
//! SRE's declaration that one has failed (or is back).

use anyhow::Context;
use clap::{Args, Subcommand};
use keyfence::keystore;
use keyfence::keystore::KeyStoreSettings;
use keyfence::ledger::LedgerSettings;
use keyfence::ledger::{FenceChange, Ledger};
use keyfence::regions::{self, Changed, RegionState, RegionStore};

#[derive(Subcommand)]
pub enum RegionsCommand {
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
pub struct DeclareArgs {
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
pub struct RemoteLedger {
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
    fn url(&self) -> anyhow::Result<Option<keyfence::ledger::DatabaseUrl>> {
        let raw = match (&self.ledger, &self.ledger_file) {
            (Some(url), _) => {
                anyhow::ensure!(
                    !super::holds_credential(url, false),
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

pub async fn list_regions(
    keys: &KeyStoreSettings,
    ledger: Option<&keyfence::ledger::DatabaseUrl>,
    json: bool,
) -> anyhow::Result<()> {
    let store = RegionStore::new(keystore::connect(keys).await?, keys.table.clone());
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

pub async fn declare(args: DeclareArgs, state: RegionState) -> anyhow::Result<()> {
    let store = RegionStore::new(keystore::connect(&args.keys).await?, args.keys.table.clone());
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

impl RegionsCommand {
    pub async fn run(self) -> anyhow::Result<()> {
        match self {
            Self::List { keys, json, ledger } => list_regions(&keys, ledger.url()?.as_ref(), json).await,
            Self::Fail(args) => declare(args, RegionState::Failed).await,
            Self::Restore(args) => declare(args, RegionState::Active).await,
        }
    }
}
