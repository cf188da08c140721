//! `keyfence webhooks add|list|remove|rotate-secret`: a client's webhook
//! endpoints, for operators (clients manage their own through the API).

use anyhow::Context;
use clap::Subcommand;
use keyfence::clients::{ClientStore, ClientsError};
use keyfence::config::KeyStoreSettings;
use keyfence::domain::ClientId;
use keyfence::keystore;
use keyfence::webhooks::{self, EndpointStore, TargetPolicy};
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
        /// An event to send (repeat for more): payment.succeeded, payment.rejected, payment.indeterminate.
        #[arg(long = "event", required = true)]
        events: Vec<String>,
        /// The endpoint may be inside the network or plain http on this machine (development only).
        #[arg(long = "allow-private", env = "KEYFENCE_WEBHOOKS_ALLOW_PRIVATE", default_value_t = false,
              value_parser = clap::builder::BoolishValueParser::new(), num_args = 0..=1,
              default_missing_value = "true", action = clap::ArgAction::Set)]
        allow_private: bool,
        #[command(flatten)]
        keys: KeyStoreSettings,
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
        #[arg(long)]
        json: bool,
    },
}

impl WebhooksCommand {
    pub async fn run(self) -> anyhow::Result<()> {
        match self {
            Self::Add { client, url, events, allow_private, keys, json } => {
                existing(&keys, client).await?;
                let events = webhooks::checked_events(&events).map_err(anyhow::Error::msg)?;
                let url = TargetPolicy { allow_private }.check(&url).await?;
                let endpoint = store(&keys).await?.add(client, &url, events).await?;
                let secret = &endpoint.secrets[0].value;
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
                let endpoints = store(&keys).await?.list(client).await?;
                if json {
                    let data: Vec<_> = endpoints.iter().map(webhooks::Endpoint::public).collect();
                    println!("{}", serde_json::to_string_pretty(&data)?);
                } else {
                    for e in &endpoints {
                        println!("{}  {}  {}", e.id, e.url, e.events.join(","));
                    }
                    println!("{} endpoint(s)", endpoints.len());
                }
            }
            Self::Remove { client, id, keys } => {
                store(&keys).await?.remove(client, id).await?;
                println!("endpoint {id} of client {client} removed");
            }
            Self::RotateSecret { client, id, grace, keys, json } => {
                let endpoint = store(&keys).await?.rotate(client, id, grace).await?;
                let secret = &endpoint.secrets[0].value;
                if json {
                    println!("{}", serde_json::json!({ "id": endpoint.id, "secret": secret }));
                } else {
                    println!("endpoint {id}: new signing secret (shown only now): {secret}");
                    println!("the previous secret signs too for {}", humantime::format_duration(grace));
                }
            }
        }
        Ok(())
    }
}

async fn store(keys: &KeyStoreSettings) -> anyhow::Result<EndpointStore> {
    Ok(EndpointStore::new(keystore::connect(keys).await?, keys.table.clone()))
}

/// Refuses endpoints for a client that does not exist.
async fn existing(keys: &KeyStoreSettings, client: ClientId) -> anyhow::Result<()> {
    let clients = ClientStore::new(keystore::connect(keys).await?, keys.table.clone());
    clients.record(client).await.context("reading the client")?.ok_or(ClientsError::Unknown(client))?;
    Ok(())
}
