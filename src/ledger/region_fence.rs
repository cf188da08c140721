//! The ledger's own region fence: one row saying whether this ledger's
//! region is declared failed, as of which registry epoch. Every phase reads
//! it in its first statement and commits nothing while it says failed, so a
//! ledger an SRE (or the region's own instances) could reach is fenced even
//! against an instance that cannot read the registry.
//!
//! Only a newer epoch changes the row, so two declarations that reach the
//! ledger in the reverse order of their epochs leave it as the newer one
//! says. Phases and the fence meet on a transaction-level advisory lock:
//! every phase takes it shared in the message that opens its transaction
//! (so the fence row it reads next is read after the lock is held), and a
//! change takes it exclusively. A phase tries the lock first and waits for
//! it only when the try fails; PostgreSQL fails a try and queues a wait
//! behind a waiting exclusive request, so a change waits only for the
//! phases already in flight, never behind an endless stream of new ones
//! (as it would behind row share locks, which compatible lockers keep
//! acquiring past a waiting writer), and once it returns no phase of the
//! old state can commit. A
//! change waits at most [`CHANGE_WAIT`] for the phases in flight: a phase
//! stalled inside its transaction (its owner paused, its connection half
//! dead) would otherwise hold every later phase behind the waiting change;
//! past the wait the change gives up, the phases go on, and the change is
//! tried again (and ledger sessions idle inside a transaction for a minute
//! are ended by PostgreSQL, so no stall lasts). The row also records whose
//! ledger it is: once a region's instance has bound it, a change naming
//! another region is refused.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use serde::Serialize;
use sqlx::{PgPool, Postgres, Transaction};

use super::{Ledger, LedgerError};

/// The advisory lock's key ("kf_regio"), the same in both statements below.
macro_rules! lock_key {
    () => {
        7738977954614962543
    };
}

/// Opens a ledger's phases: each transaction holding the lock shared, in
/// one round trip when no change of the fence holds the lock or waits for
/// it (the lock is tried, never waited for: [`BEGIN_PHASE_AT_ONCE`]), in
/// two when one does (the try fails, and the phase waits its turn:
/// [`BEGIN_PHASE_WAITING`]). Either way the phase reads committed whatever
/// the server's default, so the fence row its next statement reads is the
/// one as of after the lock, and either way the lock is taken in the
/// message's implicit transaction, which `BEGIN`, the message's last
/// statement, then makes the phase's: a try that fails, or a wait that
/// fails all the same, leaves nothing open. A ledger not yet migrated to
/// 0011 has no `region_fence_busy()`: once a try finds it missing, the
/// handle's phases open the waiting way, as before, until it is made
/// again (serve: until it restarts), and it says so once.
#[derive(Debug, Default)]
pub(super) struct Opener {
    unmigrated: AtomicBool,
}

impl Opener {
    pub(super) async fn begin(&self, pool: &PgPool) -> Result<Transaction<'static, Postgres>, LedgerError> {
        if !self.unmigrated.load(Ordering::Relaxed) {
            match pool.begin_with(BEGIN_PHASE_AT_ONCE).await {
                Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some(BUSY) => {}
                Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some(UNDEFINED_FUNCTION) => {
                    if !self.unmigrated.swap(true, Ordering::Relaxed) {
                        tracing::warn!(error = %e, "the ledger lacks migration 0011: its phases wait for the region \
                                                    fence's lock instead of trying it first; run `keyfence migrate`");
                    }
                }
                opened => return Ok(opened?),
            }
        }
        Ok(pool.begin_with(BEGIN_PHASE_WAITING).await?)
    }
}

/// What `region_fence_busy()` raises (migrations/0011_region_fence_busy.sql).
const BUSY: &str = "KF001";

/// What the try raises on a ledger without that migration.
const UNDEFINED_FUNCTION: &str = "42883";

/// Takes the lock shared if it can at once, else raises [`BUSY`]. A try
/// that finds a change waiting for the lock fails too (PostgreSQL queues a
/// request behind a waiting one it conflicts with), so no phase overtakes a
/// change. A try never waits, so no timeout of the server's can cut it short.
const BEGIN_PHASE_AT_ONCE: &str = concat!(
    "SET LOCAL transaction_isolation = 'read committed'; ",
    "SELECT region_fence_busy() WHERE NOT pg_try_advisory_xact_lock_shared(",
    lock_key!(),
    "); BEGIN"
);

/// Waits for the lock shared, behind the change that holds it or waits for
/// it. A waiting change gives up after [`CHANGE_WAIT`], so this wait is
/// bounded without a lock or statement timeout of its own, and a
/// server-wide one must not fail it: both are lifted for the wait, and once
/// the lock is held the server's statement timeout is the phase's again
/// (put back by the statement that waits, whose own timeout was settled as
/// it began: `BEGIN` stays the last statement, so a cancel that lands after
/// the wait still leaves nothing open, and the connection goes back to the
/// pool clean rather than inside an aborted transaction that would fail
/// every statement after it).
const BEGIN_PHASE_WAITING: &str = concat!(
    "SET LOCAL transaction_isolation = 'read committed'; SET LOCAL lock_timeout = 0; ",
    "SET LOCAL statement_timeout = 0; SELECT pg_advisory_xact_lock_shared(",
    lock_key!(),
    "), set_config('statement_timeout', NULL, true); BEGIN"
);

/// How long a fence change waits for the phases in flight.
pub const CHANGE_WAIT: Duration = Duration::from_secs(3);

/// Takes the lock exclusively, inside a change's transaction that has set
/// its lock timeout to [`CHANGE_WAIT`] (a statement of its own, so a
/// timeout rolls the transaction back cleanly).
const LOCK_FOR_CHANGE: &str = concat!("SELECT pg_advisory_xact_lock(", lock_key!(), ")");

/// The ledger's region fence as it stands.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, sqlx::FromRow)]
pub struct RegionFence {
    pub failed: bool,
    /// The region it was last set for, if ever.
    pub region: Option<String>,
    /// The registry epoch of the declaration it follows (0: never set).
    pub epoch: i64,
    pub reason: Option<String>,
}

impl RegionFence {
    /// Refuses work for `region` if the ledger is bound to another region
    /// (a ledger no region has bound yet takes any).
    pub fn belongs_to(&self, region: &str) -> Result<(), LedgerError> {
        match &self.region {
            Some(ledger) if ledger != region => {
                Err(LedgerError::OtherRegion { ledger: ledger.clone(), asked: region.to_owned() })
            }
            _ => Ok(()),
        }
    }

    pub fn state(&self) -> &'static str {
        if self.failed { "failed" } else { "open" }
    }
}

/// What a change of the fence came to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FenceChange {
    /// The fence now says what was asked, at the asked epoch.
    Set(RegionFence),
    /// The ledger follows a newer declaration already: left as it is.
    Newer(RegionFence),
}

impl Ledger {
    /// The fence as it stands.
    pub async fn region_fence(&self) -> Result<RegionFence, LedgerError> {
        Ok(sqlx::query_as("SELECT failed, region, epoch, reason FROM region_fence").fetch_one(&self.pool).await?)
    }

    /// Binds the ledger to `region` if no region has it yet: from then on a
    /// change naming another region is refused. Returns the fence, always bound.
    pub async fn bind_region_fence(&self, region: &str) -> Result<RegionFence, LedgerError> {
        let fence: RegionFence = sqlx::query_as(
            "WITH bound AS (UPDATE region_fence SET region = $1 WHERE region IS NULL RETURNING failed, region, epoch, reason)
             SELECT * FROM bound UNION ALL SELECT failed, region, epoch, reason FROM region_fence
              WHERE NOT EXISTS (SELECT 1 FROM bound)",
        )
        .bind(region)
        .fetch_one(&self.pool)
        .await?;
        if fence.region.is_some() {
            return Ok(fence);
        }
        // Another bind committed while this one waited for the row: the
        // statement's snapshot predates it, a new one sees whose it is.
        let fence = self.region_fence().await?;
        match fence.region {
            Some(_) => Ok(fence),
            // A bind returns a bound fence or nothing: callers count work
            // under the region it names.
            None => Err(LedgerError::Corrupt("the region fence is still unbound after a bind".into())),
        }
    }

    /// Sets the fence to `failed` for `region` as declared at registry epoch
    /// `epoch`, unless the ledger follows a newer declaration already, or is
    /// another region's. Returns once every phase in flight has ended (from
    /// then on no phase commits under the old state), or with
    /// [`LedgerError::FenceBusy`] if they did not within [`CHANGE_WAIT`].
    pub async fn set_region_fence(
        &self,
        failed: bool,
        region: &str,
        epoch: u64,
        reason: &str,
    ) -> Result<FenceChange, LedgerError> {
        let epoch = i64::try_from(epoch).unwrap_or(i64::MAX);
        let mut tx = self.pool.begin().await?;
        // Bounded by its lock wait, not by the server's statement timeout.
        let wait = format!("SET LOCAL lock_timeout = '{}ms'; SET LOCAL statement_timeout = 0", CHANGE_WAIT.as_millis());
        sqlx::raw_sql(sqlx::AssertSqlSafe(wait)).execute(&mut *tx).await?;
        match sqlx::query(LOCK_FOR_CHANGE).execute(&mut *tx).await {
            Ok(_) => {}
            Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("55P03") => {
                return Err(LedgerError::FenceBusy(CHANGE_WAIT));
            }
            Err(e) => return Err(e.into()),
        }
        let changed: Option<RegionFence> = sqlx::query_as(
            "UPDATE region_fence SET failed = $1, region = $2, epoch = $3, reason = $4, changed_at = now()
              WHERE epoch <= $3 AND (region IS NULL OR region = $2) RETURNING failed, region, epoch, reason",
        )
        .bind(failed)
        .bind(region)
        .bind(epoch)
        .bind(reason)
        .fetch_optional(&mut *tx)
        .await?;
        let change = match changed {
            Some(fence) => FenceChange::Set(fence),
            None => {
                let fence: RegionFence = sqlx::query_as("SELECT failed, region, epoch, reason FROM region_fence")
                    .fetch_one(&mut *tx)
                    .await?;
                fence.belongs_to(region)?;
                FenceChange::Newer(fence)
            }
        };
        tx.commit().await?;
        Ok(change)
    }
}
