//! `keyfence bench-reconcile`: how fast the reconciler compares and repairs,
//! at several sizes, so its growth with the number of keys can be read off.
//! For each size it makes a fresh key table and ledger database, loads that
//! many finished payments into both (consistent), and times: a report-only
//! run over the consistent data; then, after erasing a share of the
//! payments from the ledger, a report-only run and a repairing run (each
//! repair rebuilds a payment and probes two rail simulators). The table and
//! database are dropped afterwards.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;
use uuid::Uuid;

use keyfence::domain::{ClientId, Fence, IdempotencyKey, Millis, Owner, RequestHash, ScopedKey, StoredResponse};
use keyfence::engine::{Engine, EngineError, EngineSettings, Rails};
use keyfence::keystore::KeyStoreSettings;
use keyfence::keystore::{self, DynamoKeyStore, KeyItem, KeyState};
use keyfence::ledger::LedgerSettings;
use keyfence::ledger::{self, Ledger, timestamp};
use keyfence::rail::{RailClient, sim};
use keyfence::reconcile::{self, Options, Progress};
use keyfence::regions::{RegionStore, RegionView};
use keyfence::startup::REGION_VIEW_AGE;

#[derive(Debug, Clone, Serialize)]
pub struct SizeFigures {
    pub keys: usize,
    pub load_seconds: f64,
    /// Report-only over consistent stores.
    pub clean_seconds: f64,
    pub clean_keys_per_second: f64,
    /// Of the clean run: waiting on key-table scan pages / on the ledger,
    /// summed over segments.
    pub clean_key_store_seconds: f64,
    pub clean_ledger_seconds: f64,
    /// Payments erased from the ledger before the next two runs.
    pub divergent: usize,
    pub report_seconds: f64,
    pub report_keys_per_second: f64,
    /// The whole repairing run, its scan included.
    pub repair_seconds: f64,
    /// Repairs over the repairing run's time beyond the report run's.
    pub repairs_per_second: f64,
    pub found: usize,
    pub repaired: usize,
}

#[derive(Debug, Clone, Serialize)]
pub struct Figures {
    pub sizes: Vec<SizeFigures>,
    /// Clean-run seconds per key at each size over that at the smallest:
    /// near 1.0 everywhere means time grows linearly with keys.
    pub seconds_per_key_relative: Vec<f64>,
    /// The same for the time spent in the ledger alone.
    pub ledger_seconds_per_key_relative: Vec<f64>,
}

impl Figures {
    /// The figures for people, one size a line.
    pub fn table(&self) -> String {
        let mut out = format!(
            "{:>8} {:>8} {:>12} {:>10} {:>12} {:>10} {:>12}\n",
            "keys", "load s", "clean keys/s", "divergent", "report keys/s", "repair s", "repairs/s"
        );
        let relative = self.seconds_per_key_relative.iter().zip(&self.ledger_seconds_per_key_relative);
        for (f, (all, ledger)) in self.sizes.iter().zip(relative) {
            out += &format!(
                "{:>8} {:>8.1} {:>12.0} {:>10} {:>12.0} {:>10.1} {:>12.1}\n",
                f.keys,
                f.load_seconds,
                f.clean_keys_per_second,
                f.divergent,
                f.report_keys_per_second,
                f.repair_seconds,
                f.repairs_per_second
            );
            out += &format!(
                "         seconds per key vs the smallest size: x{all:.2} in all, x{ledger:.2} in the ledger \
                 (waiting on key-table scan pages {:.1} s, on the ledger {:.1} s, summed over segments)\n",
                f.clean_key_store_seconds, f.clean_ledger_seconds
            );
        }
        out
    }
}

/// A progress reporter that says nothing (the bench prints its own lines).
struct Silent;

impl Progress for Silent {
    fn scanned(&self, _: usize) {}
    fn repairing(&self, _: usize) {}
    fn repaired(&self) {}
}

/// Where the benchmark makes its tables and databases, and as which region.
#[derive(Clone, Copy)]
pub struct Stores<'a> {
    pub keys: &'a KeyStoreSettings,
    pub ledger: &'a LedgerSettings,
    pub region: &'a str,
}

/// Runs the benchmark at each size in `sizes`, erasing `divergent_share` of
/// the payments for the divergent runs.
pub async fn run(stores: Stores<'_>, sizes: &[usize], divergent_share: f64) -> anyhow::Result<Figures> {
    let mut figures = Vec::new();
    for &size in sizes {
        eprintln!("bench-reconcile: {size} keys");
        figures.push(one_size(stores, size, divergent_share).await?);
    }
    let relative = |seconds: fn(&SizeFigures) -> f64| -> Vec<f64> {
        let per_key = |f: &SizeFigures| seconds(f) / f.keys.max(1) as f64;
        let base = figures.first().map(per_key).unwrap_or(1.0).max(f64::EPSILON);
        figures.iter().map(|f| per_key(f) / base).collect()
    };
    let seconds_per_key_relative = relative(|f| f.clean_seconds);
    let ledger_seconds_per_key_relative = relative(|f| f.clean_ledger_seconds);
    Ok(Figures { sizes: figures, seconds_per_key_relative, ledger_seconds_per_key_relative })
}

async fn one_size(stores: Stores<'_>, size: usize, divergent_share: f64) -> anyhow::Result<SizeFigures> {
    let suffix = Uuid::new_v4().simple().to_string()[..8].to_owned();
    let mut keys_settings = stores.keys.clone();
    keys_settings.table = format!("keyfence-bench-{suffix}");
    // A scan page of a large table can take the local emulator seconds.
    keys_settings.attempt_timeout = keys_settings.attempt_timeout.max(Duration::from_secs(120));
    let mut ledger_settings = stores.ledger.clone();
    ledger_settings.database_url = ledger_settings.database_url.with_database(&format!("keyfence_bench_{suffix}"));

    let client = keystore::connect(&keys_settings).await?;
    keystore::ensure_table(&client, &keys_settings.table).await?;
    let keys = DynamoKeyStore::new(client.clone(), keys_settings.table.clone());
    let (ledger, _) = Ledger::migrate(&ledger_settings).await?;
    let (e1, e2) = (start_rail("e1").await?, start_rail("e2").await?);
    let engine = Engine::new(
        keys.clone(),
        ledger.clone(),
        Rails::new([
            RailClient::new("screening", &e1, Duration::from_secs(2), 3, None),
            RailClient::new("payment", &e2, Duration::from_secs(2), 3, None),
        ]),
        RegionView::new(
            RegionStore::new(client.clone(), keys_settings.table.clone()),
            REGION_VIEW_AGE,
            Default::default(),
        ),
        EngineSettings {
            region: stores.region.to_owned(),
            instance: "bench".into(),
            lease: Duration::from_secs(10),
            retention: keyfence::domain::Retention { keep: Duration::from_secs(3600), grace: Duration::from_secs(600) },
            max_unknown_attempts: 5,
            probe_backoff: keyfence::domain::ProbeBackoff { first: Duration::ZERO, max: Duration::ZERO },
            answer_limit: keyfence::domain::ANSWER_LIMIT as usize,
            clock: Default::default(),
        },
    );

    let loaded = Instant::now();
    let ids = load(&keys, &ledger, stores.region, size).await?;
    let load_seconds = loaded.elapsed().as_secs_f64();
    let options = Options {
        since: Millis::new(0),
        until: Millis::now().plus(Duration::from_secs(3600)),
        repair: false,
        stale_after: Duration::from_secs(30),
        unknown_after: Duration::from_secs(300),
        segments: 4,
    };
    let (clean, clean_seconds) = timed(reconcile::run(&engine, &options, &Silent)).await?;
    if !clean.findings.is_empty() {
        anyhow::bail!("freshly loaded stores disagree: {}", clean.table());
    }

    let divergent = ((size as f64) * divergent_share).round() as usize;
    erase(&ledger, &ids[..divergent]).await?;
    let (report, report_seconds) = timed(reconcile::run(&engine, &options, &Silent)).await?;
    let repair_options = Options { repair: true, ..options };
    let (repaired, repair_seconds) = timed(reconcile::run(&engine, &repair_options, &Silent)).await?;

    keystore::delete_table(&client, &keys_settings.table).await?;
    ledger.pool().close().await;
    ledger::drop_database(&ledger_settings).await?;
    Ok(SizeFigures {
        keys: size,
        load_seconds,
        clean_seconds,
        clean_keys_per_second: size as f64 / clean_seconds,
        clean_key_store_seconds: clean.key_store_seconds,
        clean_ledger_seconds: clean.ledger_seconds,
        divergent,
        report_seconds,
        report_keys_per_second: size as f64 / report_seconds,
        repair_seconds,
        // The repairing run scans like the report run; the rest is repairs.
        repairs_per_second: divergent as f64 / (repair_seconds - report_seconds).max(f64::EPSILON),
        found: report.findings.len(),
        repaired: repaired.findings.len() - repaired.unrepaired(),
    })
}

async fn timed<T>(work: impl Future<Output = Result<T, EngineError>>) -> Result<(T, f64), EngineError> {
    let started = Instant::now();
    let value = work.await?;
    Ok((value, started.elapsed().as_secs_f64()))
}

async fn start_rail(name: &str) -> Result<String, EngineError> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.map_err(|e| EngineError::Fault(e.to_string()))?;
    let url = format!("http://{}", listener.local_addr().map_err(|e| EngineError::Fault(e.to_string()))?);
    let name = name.to_owned();
    tokio::spawn(async move { sim::serve(listener, sim::Simulator::new(&name, None), std::future::pending()).await });
    Ok(url)
}

/// One finished payment as both stores hold it.
struct Seed {
    item: KeyItem,
    payment_id: Uuid,
}

/// Loads `size` finished payments into both stores; returns their ids.
async fn load(keys: &DynamoKeyStore, ledger: &Ledger, region: &str, size: usize) -> Result<Vec<Uuid>, EngineError> {
    let client = ClientId::generate();
    let now = Millis::now();
    let seeds: Vec<Seed> = (0..size)
        .map(|i| {
            let payment_id = Uuid::now_v7();
            let request = format!(
                r#"{{"amount_minor":{},"creditor_account":"FR14","currency":"EUR","debtor_account":"DE89","end_to_end_id":"B-{i}"}}"#,
                100 + i
            );
            let body = format!(r#"{{"id":"{payment_id}","status":"succeeded"}}"#);
            let item = KeyItem {
                key: ScopedKey::new(client, IdempotencyKey::parse(&format!("bench-{i}")).expect("a valid key")),
                request_hash: RequestHash::of("POST", "/v1/payments", request.as_bytes()),
                request: request.into_bytes(),
                operation: "payment".into(),
                state: KeyState::Finished,
                fence: Fence::FIRST,
                lease_until: now,
                owner: Owner::attempt_of("bench"),
                home_region: region.to_owned(),
                created_at: now,
                payment_id,
                response: Some(StoredResponse {
                    status: 201,
                    headers: BTreeMap::from([("content-type".to_owned(), "application/json".to_owned())]),
                    body: body.into_bytes(),
                }),
                expires_at: Some(now.plus(Duration::from_secs(3600)).as_secs()),
                left: Default::default(),
            };
            Seed { item, payment_id }
        })
        .collect();
    let items: Arc<Vec<KeyItem>> = Arc::new(seeds.iter().map(|s| s.item.clone()).collect());
    let writers = (0..8).map(|w| {
        let (keys, items) = (keys.clone(), items.clone());
        async move {
            let share: Vec<KeyItem> = items.iter().skip(w).step_by(8).cloned().collect();
            keys.seed(&share).await
        }
    });
    for written in futures::future::join_all(writers).await {
        written?;
    }
    for chunk in seeds.chunks(2000) {
        insert_ledger_rows(ledger, chunk).await?;
    }
    Ok(seeds.iter().map(|s| s.payment_id).collect())
}

async fn insert_ledger_rows(ledger: &Ledger, seeds: &[Seed]) -> Result<(), EngineError> {
    let client: Vec<Uuid> = seeds.iter().map(|s| s.item.key.client.as_uuid()).collect();
    let key: Vec<&str> = seeds.iter().map(|s| s.item.key.key.as_str()).collect();
    let created: Vec<_> = seeds.iter().map(|s| timestamp(s.item.created_at)).collect();
    let hash: Vec<&str> = seeds.iter().map(|s| s.item.request_hash.as_str()).collect();
    let payment: Vec<Uuid> = seeds.iter().map(|s| s.payment_id).collect();
    let request: Vec<&[u8]> = seeds.iter().map(|s| s.item.request.as_slice()).collect();
    let body: Vec<&[u8]> =
        seeds.iter().map(|s| s.item.response.as_ref().map_or(&[][..], |r| r.body.as_slice())).collect();
    let mut tx = ledger.pool().begin().await.map_err(ledger::LedgerError::from)?;
    // Bulk loading: the row triggers (balance, append-only) are set aside.
    let statements = [
        "SET LOCAL session_replication_role = replica",
        "INSERT INTO requests (client_id, idem_key, created_at, operation, request_hash, payment_id, fence,
                               recovery_point, response_status, response_headers, response_body, request)
         SELECT c, k, t, 'payment', h, p, 1, 'FINISHED', 201, '{\"content-type\":\"application/json\"}', b, r
           FROM unnest($1::uuid[], $2::text[], $3::timestamptz[], $4::text[], $5::uuid[], $6::bytea[], $7::bytea[])
                AS s(c, k, t, h, p, r, b)",
        "INSERT INTO payments (id, client_id, idem_key, request_created_at, amount_minor, currency, debtor_account,
                               creditor_account, end_to_end_id, status, fence)
         SELECT p, c, k, t, 100, 'EUR', 'DE89', 'FR14', k, 'succeeded', 1
           FROM unnest($1::uuid[], $2::text[], $3::timestamptz[], $5::uuid[]) AS s(c, k, t, p)",
        "INSERT INTO postings (payment_id, entry, account, amount_minor, currency, fence)
         SELECT p, e, a, m, 'EUR', 1
           FROM unnest($5::uuid[]) AS s(p),
                (VALUES ('hold', 'debtor:DE89', -100), ('hold', 'hold:DE89', 100),
                        ('clear', 'hold:DE89', -100), ('clear', 'clearing:rail', 100),
                        ('settle', 'clearing:rail', -100), ('settle', 'creditor:FR14', 100)) AS l(e, a, m)",
    ];
    for (i, sql) in statements.into_iter().enumerate() {
        let query = sqlx::query(sql);
        let query = if i == 0 {
            query
        } else {
            query.bind(&client).bind(&key).bind(&created).bind(&hash).bind(&payment).bind(&request).bind(&body)
        };
        query.execute(&mut *tx).await.map_err(ledger::LedgerError::from)?;
    }
    tx.commit().await.map_err(ledger::LedgerError::from)?;
    Ok(())
}

/// Erases payments from the ledger, as a lossy failover would.
async fn erase(ledger: &Ledger, payments: &[Uuid]) -> Result<(), EngineError> {
    let mut tx = ledger.pool().begin().await.map_err(ledger::LedgerError::from)?;
    let statements = [
        "SET LOCAL session_replication_role = replica",
        "DELETE FROM postings WHERE payment_id = ANY($1)",
        "DELETE FROM payments WHERE id = ANY($1)",
        "DELETE FROM requests WHERE payment_id = ANY($1)",
    ];
    for (i, sql) in statements.into_iter().enumerate() {
        let query = if i == 0 { sqlx::query(sql) } else { sqlx::query(sql).bind(payments) };
        query.execute(&mut *tx).await.map_err(ledger::LedgerError::from)?;
    }
    tx.commit().await.map_err(ledger::LedgerError::from)?;
    Ok(())
}
