//! The shared harness. `TestKeys::new()` makes a fresh key table and
//! `TestLedger::new()` a fresh, migrated ledger database; both are removed
//! when the value is dropped, whether the test passed or panicked, so tests
//! run in parallel and leave nothing behind.

use std::time::{Duration, Instant};

use keyfence::domain::{ClientId, IdempotencyKey, Millis, Owner, RequestHash, ScopedKey};
use keyfence::keystore::KeyStoreSettings;
use keyfence::keystore::{self, Claim, DynamoKeyStore, Lease};
use keyfence::ledger::LedgerSettings;
use keyfence::ledger::{self, Ledger};
use uuid::Uuid;

/// Where tests find the emulator when `AWS_ENDPOINT_URL` is not set: tests
/// never fall through to real AWS.
const LOCAL_DYNAMODB: &str = "http://127.0.0.1:4566";

pub struct TestKeys {
    pub store: DynamoKeyStore,
    pub settings: KeyStoreSettings,
}

impl TestKeys {
    pub async fn new() -> Self {
        let mut settings = KeyStoreSettings::from_env().expect("key store settings from the environment");
        settings.aws_endpoint_url.get_or_insert_with(|| LOCAL_DYNAMODB.to_owned());
        settings.table = format!("keyfence-test-{}", Uuid::new_v4().simple());
        // Hundreds of racers queue at the emulator, which serves one request at a time.
        settings.attempt_timeout = Duration::from_secs(30);
        let client = keystore::connect(&settings).await.unwrap();
        keystore::ensure_table(&client, &settings.table)
            .await
            .unwrap_or_else(|e| panic!("creating a test table (is the emulator running? scripts/test starts it): {e}"));
        // What `keyfence migrate` makes beside the table.
        keyfence::regions::RegionStore::new(client.clone(), settings.table.clone()).create().await.unwrap();
        Self { store: DynamoKeyStore::new(client, settings.table.clone()), settings }
    }
}

impl TestKeys {
    /// Deletes `key`'s item, as if it had been lost (or swept past its
    /// retention before its time).
    pub async fn lose(&self, key: &ScopedKey) {
        let pk = aws_sdk_dynamodb::types::AttributeValue::S(key.partition_key());
        self.store.client().delete_item().table_name(self.store.table()).key("pk", pk).send().await.unwrap();
    }

    /// Arms a fault of the bundled emulator for this test's table (see
    /// localstack/README.md): `fault` names the operation, count and action.
    pub async fn arm(&self, fault: serde_json::Value) {
        let armed = self.try_arm(fault.clone()).await;
        assert!(armed, "arming {fault} (the bundled emulator has the fault switch, LocalStack not)");
    }

    /// Arms `fault` as [`Self::arm`] does; false where the emulator has no
    /// fault switch (dynalite, LocalStack).
    pub async fn try_arm(&self, mut fault: serde_json::Value) -> bool {
        fault["table"] = self.settings.table.clone().into();
        let armed = reqwest::Client::new().post(self.faults_url()).json(&fault).send().await;
        armed.is_ok_and(|answer| answer.status().is_success())
    }

    /// Disarms every fault armed for this test's table.
    pub async fn disarm(&self) {
        let url = format!("{}?table={}", self.faults_url(), self.settings.table);
        let _ = reqwest::Client::new().delete(url).send().await;
    }

    fn faults_url(&self) -> String {
        let endpoint = self.settings.aws_endpoint_url.as_deref().unwrap_or(LOCAL_DYNAMODB);
        format!("{endpoint}/_keyfence/faults")
    }
}

impl Drop for TestKeys {
    fn drop(&mut self) {
        let settings = self.settings.clone();
        cleanup(async move {
            let client = keystore::connect(&settings).await.unwrap();
            if let Err(e) = keystore::delete_table(&client, &settings.table).await {
                eprintln!("could not delete test table {}: {e}", settings.table);
            }
        });
    }
}

pub struct TestLedger {
    pub ledger: Ledger,
    pub settings: LedgerSettings,
    /// The database's URL, for processes the test spawns.
    pub url: String,
}

impl TestLedger {
    pub async fn new() -> Self {
        let mut settings = LedgerSettings::from_env().expect("ledger settings from the environment");
        let name = format!("keyfence_test_{}", Uuid::new_v4().simple());
        settings.database_url = settings.database_url.with_database(&name);
        let base =
            std::env::var("DATABASE_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/keyfence".into());
        let url = url_with_database(&base, &name);
        let (ledger, _) = Ledger::migrate(&settings)
            .await
            .unwrap_or_else(|e| panic!("creating a test database (is PostgreSQL running?): {e}"));
        Self { ledger, settings, url }
    }
}

/// `base` (a PostgreSQL URL) naming database `name` instead.
fn url_with_database(base: &str, name: &str) -> String {
    let (without_query, query) = base.split_once('?').map_or((base, None), |(u, q)| (u, Some(q)));
    let authority_start = without_query.find("://").map_or(0, |i| i + 3);
    let server = match without_query[authority_start..].find('/') {
        Some(slash) => &without_query[..authority_start + slash],
        None => without_query,
    };
    match query {
        Some(q) => format!("{server}/{name}?{q}"),
        None => format!("{server}/{name}"),
    }
}

impl Drop for TestLedger {
    fn drop(&mut self) {
        let settings = self.settings.clone();
        // The pool's connections belong to the test's runtime, which is
        // blocked here; FORCE ends them from the server side instead.
        cleanup(async move {
            if let Err(e) = ledger::drop_database(&settings).await {
                eprintln!("could not drop test database {}: {e}", settings.database_url.database());
            }
        });
    }
}

/// Runs async cleanup to completion from `Drop`, on a runtime of its own
/// (the test's runtime may be shutting down or panicking).
fn cleanup(work: impl std::future::Future<Output = ()> + Send + 'static) {
    let done = std::thread::spawn(move || {
        tokio::runtime::Builder::new_current_thread().enable_all().build().expect("cleanup runtime").block_on(work)
    })
    .join();
    if done.is_err() {
        eprintln!("test cleanup panicked");
    }
}

/// A key no other test uses: a fresh client, a fixed key string.
pub fn fresh_key() -> ScopedKey {
    ScopedKey::new(ClientId::generate(), IdempotencyKey::parse("order-123").unwrap())
}

/// A claim of `key` by a fresh owner, its lease taken at `now`.
pub fn claim_of(key: &ScopedKey, now: Millis, lease: Duration) -> Claim {
    Claim {
        key: key.clone(),
        request_hash: RequestHash::from_hex("ab".repeat(32)),
        request: br#"{"amount_minor":1250,"currency":"EUR"}"#.to_vec(),
        operation: "payment".into(),
        payment_id: Uuid::now_v7(),
        owner: Owner::attempt_of("test"),
        home_region: "eu-west-1".into(),
        lease: Lease { now, length: lease },
        gone_before: now,
    }
}

/// Waits up to 20 s for `check` to hold.
/// Waits until `sessions` sessions of `pool`'s database wait for a lock in
/// a statement containing `statement` (10 s at most): the observed state a
/// race test needs, rather than a sleep that hopes for it.
pub async fn waiting_for_lock(pool: &sqlx::PgPool, statement: &str, sessions: i64) {
    let what = format!("{sessions} session(s) waiting for a lock in `{statement}`");
    eventually(&what, async || {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity
              WHERE datname = current_database() AND wait_event_type = 'Lock' AND pid <> pg_backend_pid()
                AND strpos(query, $1) > 0",
        )
        .bind(statement)
        .fetch_one(pool)
        .await
        .unwrap();
        waiting >= sessions
    })
    .await;
}

pub async fn eventually(what: &str, mut check: impl AsyncFnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !check().await {
        assert!(Instant::now() < deadline, "not within 20 s: {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
