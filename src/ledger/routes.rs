//! Where a request's rows are: the partitions of `requests`, `phase_runs`
//! and `external_calls` whose span holds the request's `created_at` (the
//! three share a suffix and bounds, [`super::partitions`]). A phase names
//! those partitions rather than the partitioned tables: PostgreSQL plans a
//! statement that names a partitioned table afresh on every call (a
//! generic plan would lock every partition before pruning them), while
//! one that names the partitions is planned once per connection and locks
//! what it names (and the partitioned table only while PostgreSQL reloads
//! a partition's description, after an analyse, say).
//!
//! The spans are read from the catalog when first needed, again once what
//! was read is [`RELOAD_EVERY`] old, and again when a span read earlier
//! turns out gone or not to hold a request. A request no span holds (its
//! rows are in the default partition, or the spans are not made yet) is
//! written through the partitioned tables, which are right for every
//! request. The housekeeper never changes a span's bounds once it is made,
//! and drops a span only once every request in it ended, under locks on
//! all its partitions: so a span read earlier is still right, or names a
//! table that is gone, and a phase that finds it gone is opened again
//! through the partitioned tables. A span changed by hand (detached, or
//! made again with other bounds) is right again once the spans are read
//! again, within [`RELOAD_EVERY`] and a read: until then a detached one
//! still takes its phases' writes, and in one made again a first phase
//! whose row falls outside it goes through the partitioned tables while a
//! later phase finds no row and is refused.

use std::sync::{Arc, LazyLock, RwLock};
use std::time::{Duration, Instant};

use sqlx::PgPool;
use time::OffsetDateTime;

use super::phase::Statements;
use super::{LedgerError, quote_ident};

/// How old the spans read may get before they are read again.
pub const RELOAD_EVERY: Duration = Duration::from_secs(10);

/// A span's partitions and the phase statements that name them.
pub(super) struct Route {
    /// The partitions' suffix; `None` for the partitioned tables.
    pub suffix: Option<String>,
    pub statements: Statements,
}

impl Route {
    fn naming(suffix: Option<&str>) -> Self {
        let table = |name: &str| match suffix {
            Some(suffix) => quote_ident(&format!("{name}_{suffix}")),
            None => name.to_owned(),
        };
        Route {
            suffix: suffix.map(str::to_owned),
            statements: Statements::naming(&table("requests"), &table("phase_runs"), &table("external_calls")),
        }
    }
}

/// Through the partitioned tables: right for every request.
static PARTITIONED: LazyLock<Arc<Route>> = LazyLock::new(|| Arc::new(Route::naming(None)));

/// The spans as last read, shared by every clone of a ledger handle.
#[derive(Default)]
pub(super) struct Routes {
    read: RwLock<Read>,
    /// Held while the spans are read: one task reads them, and the others
    /// go by those read before.
    reading: tokio::sync::Mutex<()>,
}

#[derive(Default)]
struct Read {
    spans: Vec<Span>,
    at: Option<Instant>,
}

struct Span {
    /// Inclusive; `None` for the history's (from the beginning).
    from: Option<OffsetDateTime>,
    /// Exclusive.
    to: OffsetDateTime,
    route: Arc<Route>,
}

impl Read {
    fn find(&self, at: OffsetDateTime) -> Option<Arc<Route>> {
        self.spans.iter().find(|s| s.from.is_none_or(|from| from <= at) && at < s.to).map(|s| s.route.clone())
    }

    fn fresh(&self) -> bool {
        self.at.is_some_and(|at| at.elapsed() < RELOAD_EVERY)
    }
}

impl std::fmt::Debug for Routes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let spans = self.read.read().map_or(0, |read| read.spans.len());
        f.debug_struct("Routes").field("spans", &spans).finish()
    }
}

impl Routes {
    /// The route of a request created `at`. Once the spans read are
    /// [`RELOAD_EVERY`] old, one task reads them again while the others go
    /// by those read before. Spans that cannot be read are not an error:
    /// those read before serve until the next read (none at first, and the
    /// partitioned tables are right for every request).
    pub async fn to(&self, pool: &PgPool, at: OffsetDateTime) -> Arc<Route> {
        let (route, fresh) = self.lookup(at);
        if fresh {
            return route;
        }
        let Ok(_reading) = self.reading.try_lock() else {
            return route;
        };
        if let (route, true) = self.lookup(at) {
            return route;
        }
        let spans = read_spans(pool).await;
        let mut read = self.read.write().unwrap_or_else(|e| e.into_inner());
        match spans {
            Ok(spans) => read.spans = spans,
            Err(e) => {
                tracing::warn!(error = %e, "the ledger's spans could not be read; phases go by those read before")
            }
        }
        read.at = Some(Instant::now());
        read.find(at).unwrap_or_else(|| PARTITIONED.clone())
    }

    /// The partitioned tables' route, for a phase whose span was gone.
    pub fn partitioned() -> Arc<Route> {
        PARTITIONED.clone()
    }

    /// Forgets the spans read: one was found gone. Waits for a read under
    /// way, which may have listed it.
    pub async fn forget(&self) {
        let _reading = self.reading.lock().await;
        *self.read.write().unwrap_or_else(|e| e.into_inner()) = Read::default();
    }

    /// The span read holding `at`, or else the partitioned tables; and
    /// whether the spans were read recently.
    fn lookup(&self, at: OffsetDateTime) -> (Arc<Route>, bool) {
        let read = self.read.read().unwrap_or_else(|e| e.into_inner());
        (read.find(at).unwrap_or_else(|| PARTITIONED.clone()), read.fresh())
    }
}

/// The spans whose three partitions are all there (none being detached),
/// with the same bounds, and found by their names (the phase's statements
/// name them unqualified). Bounds are printed without their partition
/// (`pg_get_expr(…, 0)`: they name no column), so the read takes no lock
/// on any partition and waits for none.
async fn read_spans(pool: &PgPool) -> Result<Vec<Span>, LedgerError> {
    let rows: Vec<(String, Option<OffsetDateTime>, Option<OffsetDateTime>)> = sqlx::query_as(
        "SELECT s.suffix, (regexp_match(s.bound, $$FROM \\('([^']+)'\\)$$))[1]::timestamptz,
                (regexp_match(s.bound, $$TO \\('([^']+)'\\)$$))[1]::timestamptz
           FROM (SELECT substr(c.relname, length('requests_') + 1) AS suffix, pg_get_expr(c.relpartbound, 0) AS bound
                   FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
                  WHERE i.inhparent = 'requests'::regclass AND c.relname LIKE 'requests\\_%'
                    AND NOT i.inhdetachpending AND to_regclass(quote_ident(c.relname)) = c.oid) s
          WHERE (SELECT count(*) FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
                  WHERE (i.inhparent, c.relname) IN (('phase_runs'::regclass, 'phase_runs_' || s.suffix),
                                                     ('external_calls'::regclass, 'external_calls_' || s.suffix))
                    AND NOT i.inhdetachpending AND to_regclass(quote_ident(c.relname)) = c.oid
                    AND pg_get_expr(c.relpartbound, 0) = s.bound) = 2",
    )
    .fetch_all(pool)
    .await?;
    Ok(rows
        .into_iter()
        // The default partition has no upper bound: its rows go through the
        // partitioned tables.
        .filter_map(|(suffix, from, to)| Some(Span { from, to: to?, route: Arc::new(Route::naming(Some(&suffix))) }))
        .collect())
}
