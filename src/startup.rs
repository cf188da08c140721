//! Bringing the service up. `migrate` prepares both stores; `Application`
//! builds the whole front door from settings (stores, rails, engine,
//! router, bound listener). `main` and the test harness both use these, so
//! tests run the same service that ships.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use tokio::net::TcpListener;

use crate::clients::{ClientRecord, ClientStore, Directory};
use crate::config::{EngineConfig, ServeSettings};
use crate::engine::{Engine, EngineSettings, Rails};
use crate::http::{AppState, PeerInboxes, Peers, Throttle, admin_router, router, server};
use crate::keystore::KeyStoreSettings;
use crate::keystore::{self, DynamoKeyStore, KeyStore, KeyStoreError, Leader, TableChange};
use crate::ledger::LedgerSettings;
use crate::ledger::partitions::{self, Partitioning};
use crate::ledger::{Ledger, LedgerError, MigrationReport};
use crate::operations::{PAYMENT_RAIL, SCREENING};
use crate::rail::RailClient;
use crate::regions::{RegionStore, RegionView};
use crate::webhooks::deliveries::Deliveries;
use crate::webhooks::worker::{Stores, Worker};
use crate::webhooks::{self, EndpointStore, Sealer, SealingSettings, TargetPolicy};
use crate::{expiry, recovery};

#[derive(Debug, thiserror::Error)]
pub enum StartupError {
    #[error("key store: {0}")]
    KeyStore(#[from] KeyStoreError),
    /// The key table's client could not be made: nothing was started.
    #[error("key store: {0}")]
    Connect(#[from] keystore::ConnectError),
    /// An existing key table keyfence cannot work on, and why.
    #[error("the key table is not as keyfence needs it:\n  {}", .0.join("\n  "))]
    Table(Vec<String>),
    #[error("ledger: {0}")]
    Ledger(#[from] LedgerError),
    #[error("clients: {0}")]
    Clients(#[from] crate::clients::ClientsError),
    #[error("webhooks: {0}")]
    Names(#[from] webhooks::names::NamesError),
    #[error("webhooks: {0}")]
    Sealing(#[from] webhooks::sealing::SealError),
    #[error("{0}")]
    Webhooks(#[from] webhooks::WebhooksError),
    #[error("{0}")]
    Regions(#[from] crate::regions::RegionsError),
    #[error("cannot listen on {addr}: {source}")]
    Listen { addr: SocketAddr, source: std::io::Error },
    /// Settings that cannot work together; nothing was started.
    #[error("settings that cannot work together:\n  {}", .0.join("\n  "))]
    Settings(Vec<String>),
}

/// How stale an instance's view of the region registry may be: a region
/// declared failed stops claiming and committing within this delay.
pub const REGION_VIEW_AGE: Duration = Duration::from_secs(1);

/// What `keyfence migrate` may do beyond the ledger's migrations.
#[derive(Debug, Clone, Copy, Default)]
pub struct MigrateOptions {
    /// Create the key table even where the endpoint is not local (AWS).
    pub create_table: bool,
    /// Delete the older layout's client items once copied.
    pub drop_older_clients: bool,
    /// Seal the webhook secrets older versions kept in the clear (once no
    /// instance of such a version runs: it cannot sign with a sealed one).
    pub seal_webhook_secrets: bool,
}

/// What `keyfence migrate` did to each store.
#[derive(Debug)]
pub struct Migrated {
    pub table: TableChange,
    /// What an operator should know about a table that was only checked.
    pub table_notes: Vec<String>,
    pub ledger: MigrationReport,
    /// Clients found in the ledger (from before clients were global), now
    /// in the key table.
    pub clients_copied: usize,
    /// What became of clients of the key table's older layout.
    pub older_clients: crate::clients::Carried,
    /// Webhook secrets stored in the clear (from before secrets were
    /// sealed): sealed, or left so.
    pub webhook_secrets: webhooks::InClear,
}

/// Creates the key table if missing and brings the ledger schema up to date.
/// Idempotent: a second run changes nothing.
/// With `drop_older_clients`, the older layout's client items are deleted
/// once copied (when no instance of an older version runs any more).
pub async fn migrate(
    keys: &KeyStoreSettings,
    ledger: &LedgerSettings,
    sealing: &SealingSettings,
    options: MigrateOptions,
) -> Result<Migrated, StartupError> {
    let client = keystore::connect(keys).await?;
    let local = keys.local_endpoint();
    let table = if local || options.create_table {
        keystore::ensure_table(&client, &keys.table).await?
    } else {
        TableChange::Checked
    };
    // A table on AWS is checked whoever made it.
    let mut table_notes = Vec::new();
    if !local {
        let check = keystore::check_table(&client, &keys.table).await?;
        if !check.problems.is_empty() {
            return Err(StartupError::Table(check.problems));
        }
        table_notes = check.notes;
    }
    RegionStore::new(client.clone(), keys.table.clone()).create().await?;
    // Without a key, secrets in the clear are counted, not sealed.
    let sealer = match Sealer::new(sealing, keys).await {
        Err(webhooks::sealing::SealError::NoKey) if !options.seal_webhook_secrets => Sealer::unavailable(),
        made => made?,
    };
    let drop_older_clients = options.drop_older_clients;
    let (regional, ledger) = Ledger::migrate(ledger).await?;
    // Clients used to live in each ledger; they are global now.
    let directory = ClientStore::new(client.clone(), keys.table.clone());
    let older_clients = directory.migrate_legacy(drop_older_clients).await?;
    let mut clients_copied = 0;
    for legacy in regional.legacy_clients().await? {
        let record = ClientRecord {
            id: legacy.id,
            name: legacy.name,
            created_at: legacy.created_at,
            revoked_at: None,
            keys: vec![],
        };
        directory.put(record, &legacy.digest).await?;
        clients_copied += 1;
    }
    let webhook_secrets =
        EndpointStore::new(client, keys.table.clone(), sealer).seal_in_clear(options.seal_webhook_secrets).await?;
    Ok(Migrated { table, table_notes, ledger, clients_copied, older_clients, webhook_secrets })
}

/// The engine over the configured stores and rails.
pub async fn build_engine(config: &EngineConfig) -> Result<Engine<DynamoKeyStore>, StartupError> {
    if let Some(why) = config.local_defaults_elsewhere().or_else(|| config.rails.in_clear()) {
        return Err(StartupError::Settings(vec![why]));
    }
    let client = keystore::connect(&config.keys).await?;
    let regions = RegionView::new(
        RegionStore::new(client.clone(), config.keys.table.clone()),
        REGION_VIEW_AGE,
        config.clock.clone(),
    );
    let keys = DynamoKeyStore::new(client, config.keys.table.clone());
    let ledger = Ledger::connect(&config.ledger).await?;
    let r = &config.rails;
    let rails = Rails::new([
        RailClient::new(SCREENING, &r.e1_url, r.rail_timeout, r.rail_attempts, r.rail_proxy.clone()),
        RailClient::new(PAYMENT_RAIL, &r.e2_url, r.rail_timeout, r.rail_attempts, r.rail_proxy.clone()),
    ]);
    let work = &config.work;
    let engine_settings = EngineSettings {
        region: work.region.clone(),
        instance: work.instance.clone(),
        lease: work.lease,
        retention: work.retention.retention(),
        max_unknown_attempts: work.max_unknown_attempts,
        probe_backoff: work.probe_backoff(),
        answer_limit: work.answer_limit as usize,
        clock: config.clock.clone(),
    };
    Ok(Engine::new(keys, ledger, rails, regions, engine_settings))
}

/// The front door, built and bound, not yet serving.
pub struct Application {
    listener: TcpListener,
    router: Router,
    /// The operators' listener and its routes.
    admin: (TcpListener, Router),
    engine: Arc<Engine<DynamoKeyStore>>,
    limits: server::Limits,
    /// `None`: no recovery worker in this process.
    recovery_interval: Option<Duration>,
    /// `None`: no expiry sweeper in this process.
    expiry: Option<(Duration, expiry::Options)>,
    /// `None`: this process delivers no webhooks.
    webhooks: Option<(Duration, Arc<webhooks::worker::Worker>)>,
    /// `None`: no inbox worker in this process; else how often it works,
    /// and the other regions' inboxes it hands messages on to.
    inbox: Option<(Duration, PeerInboxes)>,
    /// `None`: this process leaves the ledger's partitions to `keyfence maintain`.
    partitions: Option<(Duration, Partitioning)>,
    /// The clients, kept current while serving.
    clients: Directory,
}

impl Application {
    /// Builds it, refusing settings that cannot work together.
    pub async fn build(settings: &ServeSettings) -> Result<Self, StartupError> {
        let mut conflicts = settings.engine.conflicts();
        conflicts.extend(settings.engine.local_defaults_elsewhere());
        if settings.webhooks_allow_private
            && !(settings.engine.keys.local_endpoint() && settings.engine.ledger.database_url.is_local())
        {
            conflicts.push(
                "KEYFENCE_WEBHOOKS_ALLOW_PRIVATE lets clients' webhooks call into this network: it is for a development \
                 stack, and is refused while the key table or the ledger is not on this machine"
                    .into(),
            );
        }
        if !conflicts.is_empty() {
            return Err(StartupError::Settings(conflicts));
        }
        let secret = settings.find_region_secret().map_err(|why| StartupError::Settings(vec![why]))?;
        if secret.is_none() {
            tracing::warn!(
                "no region secret (KEYFENCE_REGION_SECRET_FILE or KEYFENCE_REGION_SECRET): this region neither asks \
                 other regions for payments it does not hold nor answers their reads"
            );
        }
        let partitions = Some(Duration::from_millis(settings.partition_interval_ms))
            .filter(|d| !d.is_zero())
            .map(|every| {
                settings.partitions.partitioning(&settings.engine.work.retention.retention()).map(|plan| (every, plan))
            })
            .transpose()
            .map_err(|why| StartupError::Settings(vec![why]))?;
        crate::metrics::install();
        let engine = Arc::new(build_engine(&settings.engine).await?);
        if let Some((_, plan)) = &partitions {
            // Before the first request, so it lands in a partition of its span.
            let mut made = partitions::Report::default();
            if let Err(e) = engine.ledger().make_ahead(plan, &mut made).await {
                tracing::warn!(error = %e, "could not make the ledger's partitions ahead; trying again next round");
            }
        }
        let store = ClientStore::new(engine.keys().client().clone(), settings.engine.keys.table.clone());
        // Every client is known before the first request.
        let clients = Directory::load(store, settings.engine.clock.clone()).await?;
        let listener = TcpListener::bind(settings.listen)
            .await
            .map_err(|source| StartupError::Listen { addr: settings.listen, source })?;
        let recovery_interval = Some(Duration::from_millis(settings.recovery_interval_ms)).filter(|d| !d.is_zero());
        let url = match &settings.public_url {
            Some(url) => url.clone(),
            None => format!(
                "http://{}",
                listener.local_addr().map_err(|source| StartupError::Listen { addr: settings.listen, source })?
            ),
        };
        let sealer = Sealer::new(&settings.webhook_sealing, &settings.engine.keys).await?;
        let endpoints = EndpointStore::new(engine.keys().client().clone(), settings.engine.keys.table.clone(), sealer);
        let targets = TargetPolicy {
            allow_private: settings.webhooks_allow_private,
            names: webhooks::Names::new(settings.webhooks_resolver)?,
        };
        let delivery = settings.webhook_delivery;
        let webhooks = Some(Duration::from_millis(delivery.interval_ms)).filter(|d| !d.is_zero()).map(|every| {
            let stores = Stores {
                deliveries: Deliveries::new(engine.ledger().pool().clone()),
                endpoints: endpoints.clone(),
                keys: engine.keys().clone(),
                region: settings.engine.work.region.clone(),
            };
            (every, Arc::new(Worker::new(stores, delivery, targets.clone())))
        });
        let state = AppState {
            engine: engine.clone(),
            clients,
            peers: Peers::new(secret, &url),
            throttle: Throttle::new(settings.fair_use),
            readiness: Default::default(),
            body_limit: settings.body_limit,
            webhooks: endpoints.clone(),
            webhook_targets: targets,
            rail_secrets: settings.find_rail_secrets(),
        };
        match advertisable(&url, settings.local_regions) {
            Ok(()) => {
                if let Err(e) = engine.regions().store().advertise(&settings.engine.work.region, &url).await {
                    tracing::warn!(error = %e, "could not advertise this region's URL; other regions cannot ask it for payments");
                }
            }
            Err(why) => tracing::warn!(
                url,
                "not advertising this region's URL ({why}): other regions cannot ask it for payments; set \
                 KEYFENCE_PUBLIC_URL to where they reach it, or KEYFENCE_LOCAL_REGIONS=1 when every region runs \
                 on this machine"
            ),
        }
        let limits = server::Limits {
            header_read: settings.header_timeout,
            idle: settings.idle_timeout,
            body_read: settings.body_timeout,
            max_connections: settings.max_connections,
            per_address: settings.max_connections_per_address,
            requests_per_connection: settings.max_requests_per_connection,
            max_age: settings.max_connection_age,
            write_stall: settings.write_timeout,
            drain: settings.drain_timeout,
        };
        let expiry = Some(Duration::from_millis(settings.expire_interval_ms)).filter(|d| !d.is_zero()).map(|every| {
            (
                every,
                expiry::Options {
                    segments: 1,
                    rate: settings.expire_rate,
                    grace: settings.engine.work.retention.grace,
                },
            )
        });
        let admin = TcpListener::bind(settings.admin_listen)
            .await
            .map_err(|source| StartupError::Listen { addr: settings.admin_listen, source })?;
        Ok(Self {
            listener,
            router: router(state.clone()),
            admin: (admin, admin_router(state.clone())),
            engine,
            limits,
            recovery_interval,
            expiry,
            webhooks,
            inbox: Some(Duration::from_millis(settings.inbox_interval_ms))
                .filter(|d| !d.is_zero())
                .map(|every| (every, state.peer_inboxes())),
            partitions,
            clients: state.clients.clone(),
        })
    }

    /// Where it listens (useful when bound to port 0).
    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    /// Where its admin listener (metrics, readiness in detail) listens.
    pub fn admin_addr(&self) -> std::io::Result<SocketAddr> {
        self.admin.0.local_addr()
    }

    /// Serves (and runs the recovery worker, the expiry sweeper, the
    /// webhook delivery worker, the inbox worker, the ledger's partition
    /// housekeeper and the ledger fence's follower) until `shutdown` resolves, then lets
    /// in-flight requests and the workers' rounds finish until the drain timeout, counted from
    /// the shutdown; what is left then is dropped (and resumed, like after a crash, by whichever
    /// instance sweeps next).
    pub async fn run_until_stopped(self, shutdown: impl Future<Output = ()> + Send + 'static) -> std::io::Result<()> {
        let (stop, stopped) = tokio::sync::watch::channel(());
        let follower = tokio::spawn(crate::regions::follow_registry(
            self.engine.regions().clone(),
            self.engine.ledger().clone(),
            self.engine.region().to_owned(),
            REGION_VIEW_AGE,
            stopped.clone(),
        ));
        let directory = tokio::spawn(self.clients.follow(stopped.clone()));
        let worker = self
            .recovery_interval
            .map(|every| tokio::spawn(recovery::run_until_stopped(self.engine.clone(), every, stopped.clone())));
        let reaper = self.expiry.map(|(every, options)| {
            let keys = self.engine.keys();
            let leader = Leader::new(keys.client().clone(), keys.table(), "expiry", self.engine.instance());
            tokio::spawn(expiry::run_until_stopped(self.engine.clone(), every, options, leader, stopped.clone()))
        });
        let courier =
            self.webhooks.map(|(every, worker)| tokio::spawn(worker.run_until_stopped(every, stopped.clone())));
        let clerk = self.inbox.map(|(every, hands)| {
            tokio::spawn(crate::inbox::worker::run_until_stopped(self.engine.clone(), hands, every, stopped.clone()))
        });
        let housekeeper = self.partitions.map(|(every, plan)| {
            let engine = self.engine.clone();
            // Counted under a name that is not the ledger's own (a stale
            // KEYFENCE_REGION), the hand-offs would be none and spans a
            // reconciler still needs would go: that round drops nothing.
            let handoffs = async move || {
                let region = engine.region();
                let fence = engine.ledger().bind_region_fence(region).await.map_err(|e| e.to_string())?;
                fence.belongs_to(region).map_err(|e| e.to_string())?;
                engine.keys().all_handoffs(region).await.map(|all| all.len()).map_err(|e| e.to_string())
            };
            tokio::spawn(partitions::run_until_stopped(
                self.engine.ledger().clone(),
                plan,
                every,
                handoffs,
                stopped.clone(),
            ))
        });
        let (admin_listener, admin_router) = self.admin;
        let mut admin_stopped = stopped;
        let admin = tokio::spawn(server::serve(admin_listener, admin_router, self.limits, async move {
            let _ = admin_stopped.changed().await;
        }));
        let asked = Arc::new(std::sync::OnceLock::new());
        let asked_at = asked.clone();
        let served = server::serve(self.listener, self.router, self.limits, async move {
            shutdown.await;
            let _ = asked_at.set(tokio::time::Instant::now());
            drop(stop);
        })
        .await;
        // The workers were told when the listener was: what they have not
        // finished by the time the connections had is dropped (and resumed
        // by whichever instance sweeps next, as after a crash).
        let deadline = *asked.get().unwrap_or(&tokio::time::Instant::now()) + self.limits.drain;
        for task in
            worker.into_iter().chain(reaper).chain(courier).chain(clerk).chain(housekeeper).chain([follower, directory])
        {
            finish_by(deadline, task).await;
        }
        finish_by(deadline, admin).await;
        served
    }
}

/// Waits for `task` until `deadline`, then aborts it.
async fn finish_by<T>(deadline: tokio::time::Instant, mut task: tokio::task::JoinHandle<T>) {
    if tokio::time::timeout_at(deadline, &mut task).await.is_err() {
        task.abort();
    }
}

/// Whether `url` can be advertised for other regions to ask: a loopback or
/// unspecified host reaches the asker's own machine, so only when every
/// region runs on one machine (`local_regions`).
fn advertisable(url: &str, local_regions: bool) -> Result<(), String> {
    let parsed = reqwest::Url::parse(url).map_err(|e| format!("not a URL: {e}"))?;
    let host = parsed.host_str().ok_or("no host")?;
    let local = match host.trim_start_matches('[').trim_end_matches(']').parse::<std::net::IpAddr>() {
        Ok(ip) => ip.is_loopback() || ip.is_unspecified(),
        Err(_) => host.eq_ignore_ascii_case("localhost"),
    };
    if local && !local_regions { Err("a loopback or unspecified address".into()) } else { Ok(()) }
}

/// Resolves on Ctrl-C or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! { () = ctrl_c => {}, () = term => {} }
}

#[cfg(test)]
mod tests {
    use super::advertisable;

    #[test]
    fn a_url_that_reaches_the_askers_own_machine_is_advertised_only_when_every_region_is_local() {
        for url in ["http://127.0.0.1:8080", "http://0.0.0.0:8080", "http://[::1]:8080", "http://localhost:8080"] {
            assert!(advertisable(url, false).is_err(), "{url}");
            assert!(advertisable(url, true).is_ok(), "{url}");
        }
        assert!(advertisable("https://eu-west-1.pay.example.com", false).is_ok());
        assert!(advertisable("http://10.0.3.7:8080", false).is_ok(), "a private address is another machine");
        assert!(advertisable("not a url", true).is_err());
    }
}
