//! `keyfence webhooks add|list|remove|rotate-secret|enable`: a client's
//! webhook endpoints, for operators (clients manage their own through the
//! API); `keyfence webhooks deliveries|redeliver`: what this region's
//! ledger sent, and sending it again.

use anyhow::Context;
use clap::Subcommand;
use keyfence::clients::{ClientStore, ClientsError};
use keyfence::domain::ClientId;
use keyfence::keystore;
use keyfence::keystore::KeyStoreSettings;
use keyfence::ledger::Ledger;
use keyfence::ledger::LedgerSettings;
use keyfence::webhooks::deliveries::{Deliveries, Listed, Redeliver};
use keyfence::webhooks::{self, EndpointStore, Issued, Sealer, SealingSettings, TargetPolicy};
use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;
use uuid::Uuid;

#[derive(Subcommand)]
pub enum WebhooksCommand {
    /// Register an endpoint for a client and print its signing secret (shown only this once).
    Add {
        #[arg(long)]
        client: ClientId,
        /// Where to send the events (https; see --allow-private).
        #[arg(long)]
        url: String,
        /// An event to send (repeat for more): payment.succeeded, payment.rejected, payment.indeterminate,
        /// payment.returned, refund.succeeded, refund.rejected, refund.indeterminate, refund.returned.
        #[arg(long = "event", required = true)]
        events: Vec<String>,
        /// The endpoint may be inside the network or plain http on this machine (development only).
        #[arg(long = "allow-private", env = "KEYFENCE_WEBHOOKS_ALLOW_PRIVATE", default_value_t = false,
              value_parser = clap::builder::BoolishValueParser::new(), num_args = 0..=1,
              default_missing_value = "true", action = clap::ArgAction::Set)]
        allow_private: bool,
        /// The DNS server (`IP:PORT`) the URL's name is looked up at; else the system's.
        #[arg(long = "resolver", env = "KEYFENCE_WEBHOOKS_RESOLVER")]
        resolver: Option<std::net::SocketAddr>,
        #[command(flatten)]
        keys: KeyStoreSettings,
        #[command(flatten)]
        sealing: SealingSettings,
        #[arg(long)]
        json: bool,
    },
    /// A client's endpoints (never their secrets).
    List {
        #[arg(long)]
        client: ClientId,
        #[command(flatten)]
        keys: KeyStoreSettings,
        #[arg(long)]
        json: bool,
    },
    /// Remove one of a client's endpoints.
    Remove {
        #[arg(long)]
        client: ClientId,
        #[arg(long)]
        id: Uuid,
        #[command(flatten)]
        keys: KeyStoreSettings,
    },
    /// Give an endpoint a new secret (printed once); the previous one signs too for the grace.
    RotateSecret {
        #[arg(long)]
        client: ClientId,
        #[arg(long)]
        id: Uuid,
        /// How long the previous secret keeps signing beside the new one (`24h`, `0s`).
        #[arg(long, default_value = "24h", value_parser = humantime::parse_duration)]
        grace: std::time::Duration,
        #[command(flatten)]
        keys: KeyStoreSettings,
        #[command(flatten)]
        sealing: SealingSettings,
        #[arg(long)]
        json: bool,
    },
    /// Send to a disabled or failing endpoint again (then redeliver what it missed).
    Enable {
        #[arg(long)]
        client: ClientId,
        #[arg(long)]
        id: Uuid,
        #[command(flatten)]
        keys: KeyStoreSettings,
    },
    /// The deliveries of this region's ledger, newest first.
    Deliveries {
        /// Only the failed ones (their retries used up, or their endpoint disabled or removed).
        #[arg(long)]
        failed: bool,
        /// Only those of one event.
        #[arg(long)]
        event: Option<Uuid>,
        /// At most this many.
        #[arg(long, default_value_t = 100)]
        limit: i64,
        #[command(flatten)]
        ledger: LedgerSettings,
        #[arg(long)]
        json: bool,
    },
    /// Send deliveries that ended (delivered or failed) again, from a fresh schedule and with the
    /// same `webhook-id`.
    #[command(group(clap::ArgGroup::new("which").required(true).args(["event", "since"])))]
    Redeliver {
        /// Every delivery of this event, whatever became of it.
        #[arg(long)]
        event: Option<Uuid>,
        /// Every failed delivery of an event written since then: an RFC 3339 time, or a duration ago (`6h`).
        #[arg(long, value_parser = parse_since)]
        since: Option<OffsetDateTime>,
        #[command(flatten)]
        ledger: LedgerSettings,
    },
}

impl WebhooksCommand {
    pub async fn run(self) -> anyhow::Result<()> {
        match self {
            Self::Add { client, url, events, allow_private, resolver, keys, sealing, json } => {
                anyhow::ensure!(
                    !allow_private || keys.local_endpoint(),
                    "--allow-private is for a development stack: refused while the key table is not on this machine"
                );
                existing(&keys, client).await?;
                let events = webhooks::checked_events(&events).map_err(anyhow::Error::msg)?;
                let names = webhooks::Names::new(resolver)?;
                let url = TargetPolicy { allow_private, names }.check(&url, client).await?;
                let Issued { endpoint, secret } = store(&keys, Some(&sealing)).await?.add(client, &url, events).await?;
                let secret = &secret.value;
                if json {
                    let mut body = endpoint.public();
                    body["secret"] = secret.clone().into();
                    println!("{body}");
                } else {
                    println!(
                        "endpoint {} for client {client}: {} ({})",
                        endpoint.id,
                        endpoint.url,
                        endpoint.events.join(", ")
                    );
                    println!("signing secret (shown only now): {secret}");
                }
            }
            Self::List { client, keys, json } => {
                let endpoints = store(&keys, None).await?.list(client).await?;
                if json {
                    let data: Vec<_> = endpoints.iter().map(webhooks::Endpoint::public).collect();
                    println!("{}", serde_json::to_string_pretty(&data)?);
                } else {
                    for e in &endpoints {
                        println!("{}  {}  {}  {}", e.id, e.status(), e.url, e.events.join(","));
                    }
                    println!("{} endpoint(s)", endpoints.len());
                }
            }
            Self::Remove { client, id, keys } => {
                store(&keys, None).await?.remove(client, id).await?;
                println!("endpoint {id} of client {client} removed");
            }
            Self::RotateSecret { client, id, grace, keys, sealing, json } => {
                let Issued { endpoint, secret } = store(&keys, Some(&sealing)).await?.rotate(client, id, grace).await?;
                let secret = &secret.value;
                if json {
                    println!("{}", serde_json::json!({ "id": endpoint.id, "secret": secret }));
                } else {
                    println!("endpoint {id}: new signing secret (shown only now): {secret}");
                    println!("the previous secret signs too for {}", humantime::format_duration(grace));
                }
            }
            Self::Enable { client, id, keys } => {
                store(&keys, None).await?.enable(client, id).await?;
                println!(
                    "endpoint {id} of client {client} enabled; `keyfence webhooks redeliver` sends what it missed"
                );
            }
            Self::Deliveries { failed, event, limit, ledger, json } => {
                let listed = deliveries(&ledger).await?.list(failed, event, limit).await?;
                if json {
                    println!("{}", serde_json::to_string_pretty(&listed)?);
                } else {
                    print_deliveries(&listed);
                }
            }
            Self::Redeliver { event, since, ledger } => {
                let which = match (event, since) {
                    (Some(event), _) => Redeliver::Event(event),
                    (None, Some(since)) => Redeliver::FailedSince(since),
                    (None, None) => anyhow::bail!("name an --event or give --since"),
                };
                let sent = deliveries(&ledger).await?.redeliver(which).await?;
                println!(
                    "{sent} delivery(ies) will be sent again, each with the webhook-id it had (any still pending stay \
                     on their schedule)"
                );
            }
        }
        Ok(())
    }
}

fn print_deliveries(listed: &[Listed]) {
    let when = |at: Option<OffsetDateTime>| at.and_then(|at| at.format(&Rfc3339).ok()).unwrap_or_else(|| "-".into());
    for d in listed {
        let status = d.last_status.map_or_else(|| "-".to_owned(), |s| s.to_string());
        println!(
            "{}  {:<22} payment {}  endpoint {}  {:<9} attempts {}  last {}  next {}  {}",
            d.webhook_id,
            d.event,
            d.payment_id,
            d.endpoint_id,
            d.state,
            d.attempts,
            status,
            when(d.next_attempt_at),
            d.last_error.as_deref().unwrap_or(""),
        );
    }
    let count = |state: &str| listed.iter().filter(|d| d.state == state).count();
    println!(
        "{} deliveries: {} delivered, {} pending, {} failed",
        listed.len(),
        count("delivered"),
        count("pending"),
        count("failed")
    );
}

/// A time (RFC 3339), or a duration before now.
fn parse_since(raw: &str) -> Result<OffsetDateTime, String> {
    if let Ok(at) = OffsetDateTime::parse(raw, &Rfc3339) {
        return Ok(at);
    }
    let ago =
        humantime::parse_duration(raw).map_err(|_| format!("{raw:?} is neither an RFC 3339 time nor a duration"))?;
    Ok(OffsetDateTime::now_utc() - ago)
}

async fn deliveries(ledger: &LedgerSettings) -> anyhow::Result<Deliveries> {
    let connected =
        Ledger::connect(ledger).await.with_context(|| format!("connecting to the ledger {}", ledger.database_url))?;
    Ok(Deliveries::new(connected.pool().clone()))
}

/// The endpoints store; `sealing` for the commands that issue a secret.
async fn store(keys: &KeyStoreSettings, sealing: Option<&SealingSettings>) -> anyhow::Result<EndpointStore> {
    let sealer = match sealing {
        Some(sealing) => Sealer::new(sealing, keys).await?,
        None => Sealer::unavailable(),
    };
    Ok(EndpointStore::new(keystore::connect(keys).await?, keys.table.clone(), sealer))
}

/// Refuses endpoints for a client that does not exist.
async fn existing(keys: &KeyStoreSettings, client: ClientId) -> anyhow::Result<()> {
    let clients = ClientStore::new(keystore::connect(keys).await?, keys.table.clone());
    clients.record(client).await.context("reading the client")?.ok_or(ClientsError::Unknown(client))?;
    Ok(())
}
