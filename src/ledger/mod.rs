//! The regional ledger on PostgreSQL: requests with their fence and recovery
//! point, payments, double-entry postings and external-call records. The
//! schema lives in `migrations/`; the one rule every write obeys lives in
//! `phase`: a phase is a transaction that first proves its fence is current
//! (and that the region's own fence, [`region_fence`], is open).
//! [`payments`] and [`external`] are the writes phases make ([`writes`]
//! sends those nothing reads together); [`partitions`] keeps the
//! idempotency tables to what the retention allows, and a phase writes to
//! the partitions of its request's span (`routes`).

mod clients;
mod error;
pub mod external;
pub mod inbox;
pub mod partitions;
pub mod payments;
mod phase;
pub mod refunds;
mod region_fence;
pub mod routes;
mod settings;
mod subjects;
pub mod views;
pub mod writes;

use std::sync::Arc;

use sqlx::migrate::Migrator;
use sqlx::postgres::{PgPool, PgPoolOptions};
use time::OffsetDateTime;

use crate::domain::Millis;

pub use clients::LegacyClient;
pub use error::LedgerError;
pub use phase::{Adoption, Phase, RequestRecord};
pub use region_fence::{FenceChange, RegionFence};
pub use settings::{DatabaseUrl, LedgerSettings};

/// How long to wait for a connection: an unreachable database fails
/// start-up in seconds, and an exhausted pool is reported as unavailable.
const ACQUIRE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// The ledger's migrations, embedded in the binary.
pub static MIGRATOR: Migrator = sqlx::migrate!("./migrations");

/// A handle on one region's ledger.
#[derive(Clone, Debug)]
pub struct Ledger {
    pool: PgPool,
    /// The partitions phases write to, read from the catalog as needed.
    routes: Arc<routes::Routes>,
    /// How phases take the region fence's lock as they open.
    opener: Arc<region_fence::Opener>,
}

/// What [`Ledger::migrate`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MigrationReport {
    pub database_created: bool,
    pub applied: Vec<i64>,
    pub version: Option<i64>,
}

impl Ledger {
    pub fn new(pool: PgPool) -> Self {
        Self { pool, routes: Arc::default(), opener: Arc::default() }
    }

    /// Connects a pool to the configured database.
    pub async fn connect(settings: &LedgerSettings) -> Result<Self, LedgerError> {
        refuse_in_clear(&settings.database_url)?;
        let pool = PgPoolOptions::new()
            .max_connections(settings.pool_size)
            .acquire_timeout(ACQUIRE_TIMEOUT)
            // No ping before each use: it is a round trip per phase, and a
            // connection that died in the pool fails its first statement
            // instead, which is a transient error (503) like any other.
            .test_before_acquire(false)
            // A session idle inside a transaction this long is a stalled
            // phase (phases make no external call inside one): ending it
            // releases what it holds, the region fence's lock included.
            .connect_with(
                settings.database_url.options().clone().options([("idle_in_transaction_session_timeout", "60s")]),
            )
            .await?;
        Ok(Self::new(pool))
    }

    /// Creates the database if it does not exist, then applies every
    /// migration not yet applied. Safe to run any number of times.
    pub async fn migrate(settings: &LedgerSettings) -> Result<(Self, MigrationReport), LedgerError> {
        let database_created = create_database(settings).await?;
        let ledger = Self::connect(settings).await?;
        let before = ledger.applied_versions().await?;
        MIGRATOR.run(&ledger.pool).await?;
        let after = ledger.applied_versions().await?;
        let applied = after.iter().copied().filter(|v| !before.contains(v)).collect();
        let report = MigrationReport { database_created, applied, version: after.last().copied() };
        Ok((ledger, report))
    }

    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    async fn applied_versions(&self) -> Result<Vec<i64>, LedgerError> {
        let exists: bool =
            sqlx::query_scalar("SELECT to_regclass('_sqlx_migrations') IS NOT NULL").fetch_one(&self.pool).await?;
        if !exists {
            return Ok(Vec::new());
        }
        Ok(sqlx::query_scalar("SELECT version FROM _sqlx_migrations WHERE success ORDER BY version")
            .fetch_all(&self.pool)
            .await?)
    }
}

/// Creates the configured database unless it exists; true if it created it.
async fn create_database(settings: &LedgerSettings) -> Result<bool, LedgerError> {
    let url = &settings.database_url;
    let admin = maintenance(settings).await?;
    let exists: bool = sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)")
        .bind(url.database())
        .fetch_one(&admin)
        .await?;
    if exists {
        return Ok(false);
    }
    let create = format!("CREATE DATABASE {}", quote_ident(url.database()));
    let created = sqlx::query(sqlx::AssertSqlSafe(create)).execute(&admin).await;
    match created {
        Ok(_) => Ok(true),
        // Another migrate created it first.
        Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("42P04") => Ok(false),
        Err(e) => Err(e.into()),
    }
}

/// Drops the configured database if it exists, ending the sessions still
/// connected to it (a test's, an example's or a bench's own database).
pub async fn drop_database(settings: &LedgerSettings) -> Result<(), LedgerError> {
    let url = &settings.database_url;
    let admin = maintenance(settings).await?;
    let drop = format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", quote_ident(url.database()));
    sqlx::query(sqlx::AssertSqlSafe(drop)).execute(&admin).await?;
    Ok(())
}

/// One connection to the server's maintenance database, for creating and
/// dropping the configured one.
async fn maintenance(settings: &LedgerSettings) -> Result<sqlx::PgPool, LedgerError> {
    let url = settings.database_url.with_database("postgres");
    refuse_in_clear(&url)?;
    Ok(PgPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(ACQUIRE_TIMEOUT)
        .connect_with(url.options().clone())
        .await?)
}

/// Nothing connects where TLS would be used only if the server offers it.
fn refuse_in_clear(url: &settings::DatabaseUrl) -> Result<(), LedgerError> {
    url.fails_open().map_or(Ok(()), |why| Err(LedgerError::InClear(why)))
}

/// Quotes a PostgreSQL identifier, so any database name is taken literally.
pub fn quote_ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// A timestamp PostgreSQL stored, as a key item holds it.
pub fn millis(at: OffsetDateTime) -> Millis {
    Millis::new(u64::try_from(at.unix_timestamp_nanos() / 1_000_000).unwrap_or(0))
}

/// A key item's timestamp as PostgreSQL stores it.
pub fn timestamp(at: Millis) -> OffsetDateTime {
    OffsetDateTime::from_unix_timestamp_nanos(i128::from(at.get()) * 1_000_000).unwrap_or(OffsetDateTime::UNIX_EPOCH)
}
