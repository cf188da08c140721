//! `spawn_app()`: the whole front door for one test: its own key table and
//! ledger database, two rail simulators (E1, E2) on real sockets, the
//! service itself on a random port, and a client with an API key.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use keyfence::clients::ClientStore;
use keyfence::config::{EngineConfig, PartitionSettings, RailSettings, ServeSettings, WorkSettings};
use keyfence::domain::{ApiKey, ClientId};
use keyfence::domain::{RailSecrets, RegionSecret, SharedClock, TestClock};
use keyfence::keystore::CONTROL_PREFIX;
use keyfence::rail::sim::Simulator;
use keyfence::rail::{Applied, Declined};
use keyfence::startup::Application;
use keyfence::webhooks::DeliverySettings;
use serde_json::{Value, json};
use tokio::sync::oneshot;

use crate::harness::{TestKeys, TestLedger};
use crate::proxy::Proxy;

/// How long a test rail deduplicates a key.
const FORGETS_AFTER: Duration = Duration::from_secs(1);

/// A rail simulator on a random local port.
pub struct TestRail {
    pub url: String,
    /// The simulator itself, when this is one.
    pub sim: Option<std::sync::Arc<Simulator>>,
    _stop: oneshot::Sender<()>,
}

impl TestRail {
    /// A stand-in rail serving `router` (a system that misbehaves on purpose).
    pub async fn serving(router: axum::Router) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let (stop, stopped) = oneshot::channel::<()>();
        tokio::spawn(async move {
            axum::serve(listener, router)
                .with_graceful_shutdown(async {
                    let _ = stopped.await;
                })
                .await
        });
        Self { url, sim: None, _stop: stop }
    }

    /// A rail that forgets a key a second after its instruction, as real
    /// rails forget theirs after a day or so: a send repeated past that is
    /// applied again, so it shows on the statement as well as in
    /// [`sends`](Self::sends).
    pub async fn start(name: &str) -> Self {
        Self::start_with(name, Some(FORGETS_AFTER)).await
    }

    /// A rail that forgets a key's deduplication `window` after its instruction.
    pub async fn start_with(name: &str, dedup_window: Option<Duration>) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let (stop, stopped) = oneshot::channel::<()>();
        let sim = Simulator::new(name, dedup_window);
        let served = sim.clone();
        tokio::spawn(async move {
            keyfence::rail::sim::serve(listener, served, async {
                let _ = stopped.await;
            })
            .await
        });
        Self { url, sim: Some(sim), _stop: stop }
    }

    /// Every instruction the rail declined, in order.
    pub async fn declines(&self) -> Vec<Declined> {
        reqwest::get(format!("{}/v1/declines", self.url)).await.unwrap().json().await.unwrap()
    }

    pub async fn set_rules(&self, rules: Value) {
        let response = reqwest::Client::new().put(format!("{}/v1/rules", self.url)).json(&rules).send().await.unwrap();
        assert!(response.status().is_success(), "setting rules: {}", response.status());
    }

    /// Every instruction the rail applied, in order.
    pub async fn statement(&self) -> Vec<Applied> {
        reqwest::get(format!("{}/v1/statement", self.url)).await.unwrap().json().await.unwrap()
    }

    /// How many instructions the rail took under each key (a 503 takes none).
    pub async fn sends(&self) -> BTreeMap<String, u32> {
        reqwest::get(format!("{}/v1/sends", self.url)).await.unwrap().json().await.unwrap()
    }

    /// The keys that arrived more than once, with how often.
    pub async fn sent_again(&self) -> BTreeMap<String, u32> {
        self.sends().await.into_iter().filter(|(_, n)| *n > 1).collect()
    }

    /// How the rail's notifications stand: copies taken, copies on their way.
    pub async fn notifications(&self) -> keyfence::rail::sim::notify::Tally {
        reqwest::get(format!("{}/v1/notifications", self.url)).await.unwrap().json().await.unwrap()
    }

    /// Every key probed, in order.
    pub async fn probes(&self) -> Vec<String> {
        reqwest::get(format!("{}/v1/probes", self.url)).await.unwrap().json().await.unwrap()
    }

    /// Asserts what an attempt after an unknown outcome must do: every key
    /// the rail took was probed, and taken once.
    pub async fn assert_probed_not_resent(&self, what: &str) {
        let (sends, probes) = (self.sends().await, self.probes().await);
        assert!(!sends.is_empty(), "{what}: nothing was sent");
        for (key, sent) in &sends {
            assert_eq!(*sent, 1, "{what}: {key} was sent {sent} times");
            assert!(probes.contains(key), "{what}: {key} was not probed ({probes:?})");
        }
    }

    pub async fn set_faults(&self, faults: Value) {
        let response =
            reqwest::Client::new().put(format!("{}/v1/faults", self.url)).json(&faults).send().await.unwrap();
        assert!(response.status().is_success(), "setting faults: {}", response.status());
    }

    pub async fn clear_faults(&self) {
        reqwest::Client::new().delete(format!("{}/v1/faults", self.url)).send().await.unwrap();
    }
}

pub struct TestApp {
    pub url: String,
    /// Its admin listener: /metrics, /readyz in detail.
    pub admin_url: String,
    /// The settings the in-process service runs with (other instances copy them).
    pub settings: ServeSettings,
    pub http: reqwest::Client,
    pub keys: TestKeys,
    pub db: TestLedger,
    pub e1: TestRail,
    pub e2: TestRail,
    pub api_key: String,
    /// The clock every instance of this deployment started here reckons
    /// by (leases, expiry, the caches): a test moves it on instead of
    /// waiting.
    pub clock: Arc<TestClock>,
    _stop: oneshot::Sender<()>,
}

/// Another region of the same deployment: the same key table and rails, a
/// ledger of its own, a front door of its own.
pub struct TestRegion {
    pub url: String,
    pub settings: ServeSettings,
    pub db: TestLedger,
    _stop: oneshot::Sender<()>,
}

impl TestApp {
    /// Starts region `name` beside this app's (whose region is `test-1`).
    pub async fn second_region(&self, name: &str) -> TestRegion {
        let db = TestLedger::new().await;
        let mut settings = self.settings.clone();
        settings.engine.work.region = name.to_owned();
        settings.engine.work.instance = format!("test-{name}");
        settings.engine.ledger = db.settings.clone();
        let (url, stop) = start_instance(&settings).await;
        TestRegion { url, settings, db, _stop: stop }
    }
}

/// The service with its defaults, as a user would run it.
pub async fn spawn_app() -> TestApp {
    spawn_app_with(|_| {}).await
}

/// The service with some settings changed first.
pub async fn spawn_app_with(adjust: impl FnOnce(&mut ServeSettings)) -> TestApp {
    spawn_app_on(TestRail::start("e1").await, TestRail::start("e2").await, adjust).await
}

/// The service over the given rails, with some settings changed first.
pub async fn spawn_app_on(e1: TestRail, e2: TestRail, adjust: impl FnOnce(&mut ServeSettings)) -> TestApp {
    let keys = TestKeys::new().await;
    let db = TestLedger::new().await;
    let clock = Arc::new(TestClock::default());
    let mut settings = ServeSettings {
        engine: EngineConfig {
            defaulted: Vec::new(),
            clock: SharedClock::new(clock.clone()),
            keys: keys.settings.clone(),
            ledger: db.settings.clone(),
            rails: RailSettings {
                e1_url: e1.url.clone(),
                e2_url: e2.url.clone(),
                rail_timeout: Duration::from_secs(1),
                rail_attempts: 3,
                rail_proxy: None,
            },
            work: WorkSettings {
                region: "test-1".into(),
                instance: "test".into(),
                lease: Duration::from_secs(10),
                max_unknown_attempts: 5,
                // Parked requests are probed again at once, as tests of
                // resuming expect; the back-off has tests of its own.
                probe_backoff_first: Duration::from_millis(1),
                probe_backoff_max: Duration::from_millis(1),
                answer_limit: keyfence::domain::ANSWER_LIMIT,
                retention: Default::default(),
            },
        },
        listen: "127.0.0.1:0".parse().unwrap(),
        admin_listen: "127.0.0.1:0".parse().unwrap(),
        body_limit: 16 * 1024,
        header_timeout: Duration::from_secs(10),
        idle_timeout: Duration::from_secs(75),
        body_timeout: Duration::from_secs(10),
        max_connections: 1024,
        max_connections_per_address: 1024,
        max_requests_per_connection: 1000,
        max_connection_age: Duration::from_secs(300),
        write_timeout: Duration::from_secs(10),
        drain_timeout: Duration::from_secs(10),
        public_url: None,
        local_regions: true,
        webhooks_allow_private: true,
        webhooks_resolver: None,
        webhook_delivery: test_delivery(),
        webhook_sealing: Default::default(),
        inbox_interval_ms: 200,
        rail_secrets: Some(RailSecrets::new(
            [("e1", RAIL_NOTIFY_SECRET), ("e2", RAIL_NOTIFY_SECRET)].map(|(r, s)| (r.to_owned(), s.to_owned())).into(),
        )),
        recovery_interval_ms: 0,
        expire_interval_ms: 0,
        expire_rate: 50,
        // The spans of today and tomorrow, made at start-up; a test of the
        // partitions sets its own.
        partition_interval_ms: 3_600_000,
        partitions: PartitionSettings { ahead: 1, ..Default::default() },
        fair_use: Default::default(),
        region_secret_file: None,
        region_secret_accepted_file: None,
        region_secret: Some(RegionSecret::new(REGION_SECRET).unwrap()),
    };
    adjust(&mut settings);
    // The client exists before the instance starts, as in a deployment:
    // its first request finds its key in the directory the instance read.
    let api_key = ApiKey::generate();
    let clients = ClientStore::new(keys.store.client().clone(), keys.store.table());
    let client = clients.add("test client", &api_key).await.unwrap();
    clients.change_accounts(client.id, &[DEBTOR.to_owned()], true).await.unwrap();
    let Served { url, admin_url, stop } = start_serving(&settings).await;
    TestApp {
        url,
        admin_url,
        settings,
        http: reqwest::Client::builder().pool_max_idle_per_host(0).build().unwrap(),
        keys,
        db,
        e1,
        e2,
        api_key: api_key.reveal().to_owned(),
        clock,
        _stop: stop,
    }
}

/// An instance of the service in this process with `settings`; it serves
/// until the returned sender is dropped.
pub async fn start_instance(settings: &ServeSettings) -> (String, oneshot::Sender<()>) {
    let served = start_serving(settings).await;
    (served.url, served.stop)
}

/// An instance serving in this process, and its admin listener.
pub struct Served {
    pub url: String,
    pub admin_url: String,
    pub stop: oneshot::Sender<()>,
}

pub async fn start_serving(settings: &ServeSettings) -> Served {
    let app = Application::build(settings).await.expect("the service starts");
    let url = format!("http://{}", app.local_addr().unwrap());
    let admin_url = format!("http://{}", app.admin_addr().unwrap());
    let (stop, stopped) = oneshot::channel::<()>();
    tokio::spawn(app.run_until_stopped(async {
        let _ = stopped.await;
    }));
    Served { url, admin_url, stop }
}

/// Webhook delivery as tests run it: rounds every 50 ms, and a retry
/// schedule of milliseconds (the default one has tests of its own).
pub fn test_delivery() -> DeliverySettings {
    DeliverySettings {
        interval_ms: 50,
        concurrency: 16,
        timeout: Duration::from_secs(2),
        retry_first: Duration::from_millis(50),
        retry_longest: Duration::from_millis(400),
        attempts: 6,
        disable_after: 5,
        retention: Duration::from_secs(7 * 24 * 3600),
    }
}

/// The secret the test rails sign their notifications with.
pub const RAIL_NOTIFY_SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";

/// The secret the test deployment's regions share.
pub const REGION_SECRET: &str = "the test deployment's region secret, 32 bytes or more";

/// The account the test client pays from (and holds).
pub const DEBTOR: &str = "DE89370400440532013000";

/// A valid payment body.
pub fn payment(end_to_end_id: &str) -> Value {
    json!({
        "amount_minor": 1250,
        "currency": "EUR",
        "debtor_account": DEBTOR,
        "creditor_account": "FR1420041010050500013M02606",
        "end_to_end_id": end_to_end_id,
        "remittance_info": "invoice 42",
    })
}

impl TestApp {
    /// POSTs a payment as this app's client.
    pub async fn pay(&self, key: &str, body: &Value) -> reqwest::Response {
        self.pay_as(&self.api_key, key, body).await
    }

    pub async fn pay_as(&self, api_key: &str, key: &str, body: &Value) -> reqwest::Response {
        self.try_pay_at(&self.url, api_key, key, body).await.expect("the service answers")
    }

    /// Waits until a request in this app's ledger has reached recovery
    /// point `point` (its phase committed): where a race test acts, rather
    /// than after a sleep that hopes the request got there.
    pub async fn reaches(&self, point: &str) {
        crate::harness::eventually(&format!("a request at {point}"), async || {
            let at: i64 = sqlx::query_scalar("SELECT count(*) FROM requests WHERE recovery_point = $1")
                .bind(point)
                .fetch_one(self.db.ledger.pool())
                .await
                .unwrap();
            at > 0
        })
        .await;
    }

    /// POSTs a payment to the front door at `url`; an error if no answer came.
    pub async fn try_pay_at(
        &self,
        url: &str,
        api_key: &str,
        key: &str,
        body: &Value,
    ) -> reqwest::Result<reqwest::Response> {
        self.http
            .post(format!("{url}/v1/payments"))
            .bearer_auth(api_key)
            .header("Idempotency-Key", key)
            .json(body)
            .send()
            .await
    }

    /// POSTs a payment to the front door at `url` from a task of its own,
    /// for a request that is meant to stall while the test goes on.
    pub fn pay_in_background(
        &self,
        url: &str,
        key: &str,
        body: &Value,
    ) -> tokio::task::JoinHandle<reqwest::Result<reqwest::Response>> {
        let request = self
            .http
            .post(format!("{url}/v1/payments"))
            .bearer_auth(&self.api_key)
            .header("Idempotency-Key", key)
            .json(body);
        tokio::spawn(request.send())
    }

    pub async fn get_as(&self, api_key: &str, path: &str) -> reqwest::Response {
        self.http.get(format!("{}{path}", self.url)).bearer_auth(api_key).send().await.unwrap()
    }

    /// The client directory every region reads.
    pub fn clients(&self) -> ClientStore {
        ClientStore::new(self.keys.store.client().clone(), self.keys.store.table())
    }

    /// The webhook endpoints, sealed and opened with the key `serve` uses
    /// here (the development key of a local key table).
    pub async fn endpoints(&self) -> keyfence::webhooks::EndpointStore {
        let sealer = keyfence::webhooks::Sealer::new(&Default::default(), &self.keys.settings).await.unwrap();
        keyfence::webhooks::EndpointStore::new(self.keys.store.client().clone(), self.keys.store.table(), sealer)
    }

    /// The client this app's API key belongs to.
    pub async fn client_id(&self) -> keyfence::domain::ClientId {
        let digest = ApiKey::presented(&self.api_key).digest();
        self.clients().by_digest(&digest).await.unwrap().expect("the test client exists").id
    }

    /// A second client of the same service, holding the same debtor account.
    pub async fn add_client(&self) -> (ClientId, String) {
        let (id, key) = self.add_client_holding(&[DEBTOR]).await;
        (id, key)
    }

    /// A client of the same service holding `accounts` (in normal form).
    pub async fn add_client_holding(&self, accounts: &[&str]) -> (ClientId, String) {
        let key = ApiKey::generate();
        let id = self.clients().add("another client", &key).await.unwrap().id;
        let accounts: Vec<String> = accounts.iter().map(|a| (*a).to_owned()).collect();
        self.clients().change_accounts(id, &accounts, true).await.unwrap();
        (id, key.reveal().to_owned())
    }

    /// Rows in a ledger table.
    pub async fn count(&self, table: &str) -> i64 {
        sqlx::query_scalar(sqlx::AssertSqlSafe(format!("SELECT count(*) FROM {table}")))
            .fetch_one(self.db.ledger.pool())
            .await
            .unwrap()
    }

    /// Payments whose postings do not sum to zero (must always be 0).
    pub async fn unbalanced_payments(&self) -> i64 {
        sqlx::query_scalar(
            "SELECT count(*) FROM (SELECT payment_id FROM postings GROUP BY payment_id, currency
                                    HAVING sum(amount_minor) <> 0) AS off",
        )
        .fetch_one(self.db.ledger.pool())
        .await
        .unwrap()
    }

    /// This app's settings with the ledger reached through a proxy the test
    /// can cut (a partition between the service and PostgreSQL).
    pub async fn behind_a_proxied_ledger(&self) -> (Proxy, ServeSettings) {
        let postgres = self.db.settings.database_url.options();
        let target = format!("{}:{}", postgres.get_host(), postgres.get_port());
        let proxy = Proxy::start(tokio::net::lookup_host(target).await.unwrap().next().unwrap()).await;
        let mut url = reqwest::Url::parse(&self.db.url).unwrap();
        url.set_host(Some("127.0.0.1")).unwrap();
        url.set_port(Some(proxy.addr.port())).unwrap();
        let mut settings = self.settings.clone();
        settings.engine.ledger.database_url = url.as_str().parse().unwrap();
        (proxy, settings)
    }

    /// Key items in the key table (control items, such as the region
    /// registry, left out).
    pub async fn key_items(&self) -> usize {
        let control = |item: &&std::collections::HashMap<String, aws_sdk_dynamodb::types::AttributeValue>| {
            item.get("pk").and_then(|pk| pk.as_s().ok()).is_some_and(|pk| pk.starts_with(CONTROL_PREFIX))
        };
        let (mut items, mut start) = (0, None);
        loop {
            let page = self
                .keys
                .store
                .client()
                .scan()
                .table_name(self.keys.store.table())
                .projection_expression("pk")
                .set_exclusive_start_key(start)
                .send()
                .await
                .unwrap();
            items += page.items().iter().filter(|item| !control(item)).count();
            start = page.last_evaluated_key().cloned();
            if start.is_none() {
                return items;
            }
        }
    }
}
