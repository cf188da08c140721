//! The idempotency tables' partitions by time (`requests`, `phase_runs`,
//! `external_calls`; see migrations/0010): made ahead, dropped when old,
//! so the tables hold what the retention allows and no more.
//!
//! A partition's suffix names the same span of time in all three tables: a
//! request's phase runs and external calls carry its `created_at`, so they
//! fall in partitions of its suffix. Spans are made for all three tables in
//! one transaction (a run and a call name their request partition to
//! partition), and dropped for all three in one, only when
//! - the span ended longer ago than the ledger keeps requests, and
//! - every request in it has ended (`FINISHED` or `VOIDED`) and none moved
//!   within that time either, so no live key names a row the ledger no
//!   longer has (the ledger keeps requests at least the key retention and
//!   two graces, and a key the reconciler restores expires a retention
//!   after its request finished), and a return, which a rail sends after
//!   settlement, finds its request as long as the ledger keeps it; and
//! - no hand-off from this region waits for the reconciler: a leftover of
//!   a request another region finished after a failover is undone from
//!   its rows here, so until it is, nothing is dropped.
//!
//! A span holding a request that has not ended is kept, and reported.
//! Making or dropping a partition takes an `ACCESS EXCLUSIVE` lock on
//! `requests` and its siblings, so the check before a drop and the drop
//! run with nothing landing in between. Such a lock waits for the
//! statements in flight and holds up those after it, and since statements
//! lock the tables in different orders it can deadlock with one: each
//! attempt waits at most [`LOCK_WAIT`], far below PostgreSQL's deadlock
//! timeout, so the housekeeper is the one that gives way, and a phase held
//! up behind it waits no more than the few such waits of one attempt; the
//! attempt is tried again after a pause, up to [`LOCK_ATTEMPTS`] times a
//! round. Rows of the default partition
//! (requests adopted long after they began, or written while no span was
//! made ahead) follow the same rule, deleted in batches.

use std::time::Duration;

use serde::Serialize;
use sqlx::AssertSqlSafe;
use sqlx::postgres::types::Oid;
use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;

use super::{Ledger, LedgerError, quote_ident};

/// The partitioned tables, in the order a phase writes them.
const TABLES: [&str; 3] = ["requests", "phase_runs", "external_calls"];

/// How long one attempt waits for its locks.
pub const LOCK_WAIT: Duration = Duration::from_millis(100);

/// Attempts a round makes at one partition's locks before reporting it busy.
pub const LOCK_ATTEMPTS: u32 = 20;

/// Ended rows of the default partition deleted per transaction.
const BATCH: i64 = 500;

/// How the idempotency tables are partitioned and how long they keep rows.
#[derive(Clone, Copy, Debug)]
pub struct Partitioning {
    /// The time one partition holds (a day by default); whole seconds.
    pub span: Duration,
    /// How many spans past now have their partitions made.
    pub ahead: u32,
    /// How long the ledger keeps a request's rows after it last moved.
    pub keep: Duration,
}

/// What one round of [`Ledger::maintain_partitions`] did.
#[derive(Debug, Default, Serialize)]
pub struct Report {
    /// Partitions made ahead (their suffixes).
    pub created: Vec<String>,
    /// Spans left to the default partition: it already held rows of them.
    pub skipped: Vec<String>,
    pub dropped: Vec<Dropped>,
    /// Old spans kept because a request in them has not ended, or moved too recently.
    pub kept: Vec<Kept>,
    /// Partitions another session held past the lock wait: tried again next round.
    pub busy: Vec<String>,
    /// Hand-offs from this region waiting for the reconciler: while any
    /// does, no partition is dropped (nor a row of the default deleted).
    pub held_for_handoffs: usize,
    /// This region's hand-offs could not be counted (the key table could
    /// not be read, or the ledger is not this region's): nothing was dropped.
    pub handoffs_unread: bool,
    /// Ended requests deleted from the default partition (with their runs and calls).
    pub default_deleted: u64,
    /// Inbox messages deleted: applied or found without effect, older than the ledger keeps requests.
    pub inbox_deleted: u64,
    /// Steps that failed; the rest of the round still ran.
    pub failed: Vec<Failed>,
}

#[derive(Debug, Serialize)]
pub struct Failed {
    /// What was being done: a span's drop, or a step of the round.
    pub step: String,
    pub error: String,
}

#[derive(Debug, Serialize)]
pub struct Dropped {
    pub partition: String,
    pub requests: i64,
}

#[derive(Debug, Serialize)]
pub struct Kept {
    pub partition: String,
    pub requests: i64,
    /// Requests that have not ended.
    pub open: i64,
    /// Requests that moved within the ledger's retention.
    pub recent: i64,
}

impl Report {
    /// Whether the round changed or found anything worth telling.
    pub fn eventful(&self) -> bool {
        !(self.created.is_empty()
            && self.skipped.is_empty()
            && self.dropped.is_empty()
            && self.kept.is_empty()
            && self.busy.is_empty()
            && self.held_for_handoffs == 0
            && !self.handoffs_unread
            && self.default_deleted == 0
            && self.inbox_deleted == 0
            && self.failed.is_empty())
    }

    /// Whether the round left something for a person: a span kept or left
    /// to the default partition, drops held, or a step failed.
    pub fn worrying(&self) -> bool {
        !(self.kept.is_empty() && self.skipped.is_empty() && self.failed.is_empty())
            || self.held_for_handoffs > 0
            || self.handoffs_unread
    }

    fn fail(&mut self, step: impl Into<String>, error: LedgerError) {
        self.failed.push(Failed { step: step.into(), error: error.to_string() });
    }

    /// A summary for a person.
    pub fn summary(&self) -> String {
        let mut out = format!(
            "ledger partitions: {} made ahead, {} dropped ({} requests), {} old kept\n",
            self.created.len(),
            self.dropped.len(),
            self.dropped.iter().map(|d| d.requests).sum::<i64>(),
            self.kept.len(),
        );
        for kept in &self.kept {
            out += &format!(
                "  kept {}: {} of its {} requests have not ended, {} moved within the ledger retention\n",
                kept.partition, kept.open, kept.requests, kept.recent
            );
        }
        for span in &self.skipped {
            out += &format!("  left {span} to the default partition, which already holds rows of it\n");
        }
        if self.held_for_handoffs > 0 {
            out += &format!(
                "  nothing dropped: {} hand-off(s) from this region wait for the reconciler (keyfence reconcile --repair)\n",
                self.held_for_handoffs
            );
        }
        if self.handoffs_unread {
            out += "  nothing dropped: this region's hand-offs could not be counted\n";
        }
        for busy in &self.busy {
            out += &format!("  {busy} was busy past the lock wait: tried again next round\n");
        }
        for failed in &self.failed {
            out += &format!("  {} failed: {}\n", failed.step, failed.error);
        }
        out += &format!(
            "default partition: {} ended requests deleted; inbox: {} messages deleted\n",
            self.default_deleted, self.inbox_deleted
        );
        out
    }
}

/// What became of a span [`Ledger::drop_span`] was asked to drop.
enum Fate {
    Dropped,
    /// A request in it moved after it was counted: kept.
    Moved,
    /// Another instance dropped it first.
    Gone,
}

/// One partition of `requests`, by suffix.
struct Span {
    oid: Oid,
    suffix: String,
    /// `None` for the default partition.
    until: Option<OffsetDateTime>,
}

impl Ledger {
    /// One round: makes the spans ahead, drops the old ones that may go,
    /// and deletes what may go from the default partition and the inbox.
    /// `handoffs` counts those from this region waiting for the
    /// reconciler (`None`: they could not be counted); unless it is zero, the
    /// round drops and deletes nothing of the requests. A step that fails,
    /// or a span that cannot be dropped, is reported and the rest still runs.
    pub async fn maintain_partitions(&self, plan: &Partitioning, handoffs: Option<usize>) -> Report {
        let mut report = Report {
            held_for_handoffs: handoffs.unwrap_or(0),
            handoffs_unread: handoffs.is_none(),
            ..Report::default()
        };
        if let Err(e) = self.make_ahead(plan, &mut report).await {
            report.fail("making spans ahead", e);
        }
        if handoffs == Some(0) {
            if let Err(e) = self.drop_old(plan, &mut report).await {
                report.fail("listing old spans", e);
            }
            match self.prune_default(plan).await {
                Ok(deleted) => report.default_deleted = deleted,
                Err(e) => report.fail("deleting from the default partition", e),
            }
        }
        match self.prune_inbox(plan).await {
            Ok(deleted) => report.inbox_deleted = deleted,
            Err(e) => report.fail("deleting from the inbox", e),
        }
        report
    }

    /// Makes the span partitions from the newest one (or now) to `ahead`
    /// spans past now, aligned to whole spans since the epoch.
    pub async fn make_ahead(&self, plan: &Partitioning, report: &mut Report) -> Result<(), LedgerError> {
        let now: OffsetDateTime = sqlx::query_scalar("SELECT now()").fetch_one(&self.pool).await?;
        let span = micros_of(plan.span);
        let newest = self.spans().await?.into_iter().filter_map(|s| s.until).max();
        let floor = |t: i64| t.div_euclid(span) * span;
        let mut start = newest.map(micros).unwrap_or(i64::MIN).max(floor(micros(now)));
        let until = micros(now) + span * i64::from(plan.ahead);
        while start < until {
            let end = floor(start) + span;
            let (from, to) = (at(start), at(end));
            let suffix = suffix_of(from);
            match with_locks(|| self.make_span(&suffix, from, to)).await {
                Ok(()) => report.created.push(suffix),
                // The default partition holds rows of this span already.
                Err(e) if e.has_code("23514") => report.skipped.push(suffix),
                // Another instance made it (or an overlapping one) first.
                Err(e) if e.has_code("42P07") || e.has_code("42P17") => {}
                Err(e) if lock_timed_out(&e) => {
                    report.busy.push(suffix);
                    return Ok(());
                }
                Err(e) => return Err(e),
            }
            start = end;
        }
        Ok(())
    }

    async fn make_span(&self, suffix: &str, from: OffsetDateTime, to: OffsetDateTime) -> Result<(), LedgerError> {
        let (from, to) = (literal(from)?, literal(to)?);
        let mut tx = self.pool.begin().await?;
        set_lock_wait(&mut tx).await?;
        let requests = quote_ident(&format!("requests_{suffix}"));
        for table in TABLES {
            let name = quote_ident(&format!("{table}_{suffix}"));
            let make = format!("CREATE TABLE {name} PARTITION OF {table} FOR VALUES FROM ({from}) TO ({to})");
            sqlx::query(AssertSqlSafe(make)).execute(&mut *tx).await?;
            if table != "requests" {
                let key = format!(
                    "ALTER TABLE {name} ADD FOREIGN KEY (client_id, idem_key, request_created_at) REFERENCES {requests}"
                );
                sqlx::query(AssertSqlSafe(key)).execute(&mut *tx).await?;
            }
        }
        tx.commit().await?;
        Ok(())
    }

    /// Drops every old span partition whose requests may go, oldest first;
    /// a span that cannot be counted or dropped is reported, and the next
    /// tried. One another instance drops meanwhile is left to it.
    async fn drop_old(&self, plan: &Partitioning, report: &mut Report) -> Result<(), LedgerError> {
        let before: OffsetDateTime = sqlx::query_scalar("SELECT now() - make_interval(secs => $1)")
            .bind(plan.keep.as_secs_f64())
            .fetch_one(&self.pool)
            .await?;
        let mut old: Vec<Span> =
            self.spans().await?.into_iter().filter(|s| s.until.is_some_and(|until| until <= before)).collect();
        old.sort_by(|a, b| (a.until, &a.suffix).cmp(&(b.until, &b.suffix)));
        for Span { oid, suffix, .. } in old {
            let partition = quote_ident(&format!("requests_{suffix}"));
            // Counted without a lock, for the report; checked again under one.
            let counted: Result<(i64, i64, i64), _> = sqlx::query_as(AssertSqlSafe(format!(
                "SELECT count(*), count(*) FILTER (WHERE {OPEN}), count(*) FILTER (WHERE {RECENT}) FROM {partition}"
            )))
            .bind(plan.keep.as_secs_f64())
            .fetch_one(&self.pool)
            .await;
            let (requests, open, recent) = match counted.map_err(LedgerError::from) {
                Ok(counts) => counts,
                // Another instance dropped it since it was listed.
                Err(e) if e.has_code("42P01") && !self.exists(oid).await.unwrap_or(true) => continue,
                Err(e) => {
                    report.fail(format!("counting {suffix}"), e);
                    continue;
                }
            };
            if open > 0 || recent > 0 {
                report.kept.push(Kept { partition: suffix, requests, open, recent });
                continue;
            }
            match with_locks(|| self.drop_span(&suffix, plan)).await {
                Ok(Fate::Dropped) => report.dropped.push(Dropped { partition: suffix, requests }),
                Ok(Fate::Moved) => report.kept.push(Kept { partition: suffix, requests, open: 0, recent: 0 }),
                Ok(Fate::Gone) => {}
                Err(e) if lock_timed_out(&e) => report.busy.push(suffix),
                Err(e) => report.fail(format!("dropping {suffix}"), e),
            }
        }
        Ok(())
    }

    /// Drops the span under locks every phase waits for, if its requests may
    /// still go. The partitions that name `requests` go first: a detached
    /// one would still name it.
    async fn drop_span(&self, suffix: &str, plan: &Partitioning) -> Result<Fate, LedgerError> {
        let mut tx = self.pool.begin().await?;
        set_lock_wait(&mut tx).await?;
        sqlx::query("LOCK TABLE requests, phase_runs, external_calls IN ACCESS EXCLUSIVE MODE")
            .execute(&mut *tx)
            .await?;
        let partition = quote_ident(&format!("requests_{suffix}"));
        let present: bool =
            sqlx::query_scalar("SELECT to_regclass($1) IS NOT NULL").bind(&partition).fetch_one(&mut *tx).await?;
        if !present {
            return Ok(Fate::Gone);
        }
        let moved: bool = sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT EXISTS (SELECT 1 FROM {partition} WHERE {OPEN}) OR EXISTS (SELECT 1 FROM {partition} WHERE {RECENT})"
        )))
        .bind(plan.keep.as_secs_f64())
        .fetch_one(&mut *tx)
        .await?;
        if moved {
            return Ok(Fate::Moved);
        }
        for table in TABLES.iter().rev() {
            let name = quote_ident(&format!("{table}_{suffix}"));
            let there: bool =
                sqlx::query_scalar("SELECT to_regclass($1) IS NOT NULL").bind(&name).fetch_one(&mut *tx).await?;
            if there {
                sqlx::query(AssertSqlSafe(format!("ALTER TABLE {table} DETACH PARTITION {name}")))
                    .execute(&mut *tx)
                    .await?;
                sqlx::query(AssertSqlSafe(format!("DROP TABLE {name}"))).execute(&mut *tx).await?;
            }
        }
        tx.commit().await?;
        Ok(Fate::Dropped)
    }

    /// Deletes the default partition's requests that may go, with their
    /// phase runs and calls, in batches; returns how many requests.
    async fn prune_default(&self, plan: &Partitioning) -> Result<u64, LedgerError> {
        let mut deleted = 0;
        loop {
            let mut tx = self.pool.begin().await?;
            let rows: Vec<(uuid::Uuid, String, OffsetDateTime)> = sqlx::query_as(AssertSqlSafe(format!(
                "SELECT client_id, idem_key, created_at FROM requests_default
                  WHERE created_at < now() - make_interval(secs => $1) AND NOT ({OPEN}) AND NOT ({RECENT})
                  ORDER BY created_at LIMIT $2 FOR UPDATE SKIP LOCKED"
            )))
            .bind(plan.keep.as_secs_f64())
            .bind(BATCH)
            .fetch_all(&mut *tx)
            .await?;
            let (clients, keys, created): (Vec<_>, Vec<_>, Vec<_>) = unzip3(rows);
            for (table, at) in [
                ("phase_runs", "request_created_at"),
                ("external_calls", "request_created_at"),
                ("requests", "created_at"),
            ] {
                sqlx::query(AssertSqlSafe(format!(
                    "DELETE FROM {table} WHERE (client_id, idem_key, {at}) IN
                        (SELECT * FROM unnest($1::uuid[], $2::text[], $3::timestamptz[]))"
                )))
                .bind(&clients)
                .bind(&keys)
                .bind(&created)
                .execute(&mut *tx)
                .await?;
            }
            tx.commit().await?;
            deleted += clients.len() as u64;
            if (clients.len() as i64) < BATCH {
                return Ok(deleted);
            }
        }
    }

    /// Deletes inbox messages that took effect or had none, once older than
    /// the requests they named; those waiting or unmatched stay for a person.
    async fn prune_inbox(&self, plan: &Partitioning) -> Result<u64, LedgerError> {
        let mut deleted = 0;
        loop {
            let done = sqlx::query(
                "DELETE FROM inbox WHERE (rail, message_id) IN
                    (SELECT rail, message_id FROM inbox
                      WHERE state IN ('applied', 'ignored', 'forwarded') AND received_at < now() - make_interval(secs => $1)
                      LIMIT $2)",
            )
            .bind(plan.keep.as_secs_f64())
            .bind(BATCH)
            .execute(&self.pool)
            .await?;
            deleted += done.rows_affected();
            if done.rows_affected() < BATCH as u64 {
                return Ok(deleted);
            }
        }
    }

    /// The partitions of `requests` with their upper bounds.
    async fn spans(&self) -> Result<Vec<Span>, LedgerError> {
        let rows: Vec<(Oid, String, Option<OffsetDateTime>)> = sqlx::query_as(
            "SELECT c.oid, substr(c.relname, length('requests_') + 1),
                    (regexp_match(pg_get_expr(c.relpartbound, c.oid), $$TO \\('([^']+)'\\)$$))[1]::timestamptz
               FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
              WHERE i.inhparent = 'requests'::regclass",
        )
        .fetch_all(&self.pool)
        .await?;
        Ok(rows.into_iter().map(|(oid, suffix, until)| Span { oid, suffix, until }).collect())
    }

    /// Whether the relation `oid` still exists (by its oid, not its name,
    /// which a partition outside the search path would not be found by).
    async fn exists(&self, oid: Oid) -> Result<bool, LedgerError> {
        Ok(sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_class WHERE oid = $1)")
            .bind(oid)
            .fetch_one(&self.pool)
            .await?)
    }
}

/// `serve`'s housekeeper: a round at once, then one every `every` until
/// `stop` changes; `handoffs` counts those from this region waiting for
/// the reconciler (when it cannot tell, the round makes spans ahead and
/// drops nothing).
pub async fn run_until_stopped<H: AsyncFn() -> Result<usize, String>>(
    ledger: Ledger,
    plan: Partitioning,
    every: Duration,
    handoffs: H,
    mut stop: tokio::sync::watch::Receiver<()>,
) {
    loop {
        let waiting = match handoffs().await {
            Ok(waiting) => Some(waiting),
            Err(e) => {
                tracing::warn!(error = %e, "ledger partitions: could not count this region's hand-offs; dropping nothing");
                None
            }
        };
        let report = ledger.maintain_partitions(&plan, waiting).await;
        if report.worrying() {
            tracing::warn!(report = %report.summary(), "ledger partitions kept, held, failed or left to the default partition")
        } else if report.eventful() {
            tracing::info!(report = %report.summary(), "ledger partitions")
        }
        tokio::select! {
            _ = stop.changed() => return,
            () = tokio::time::sleep(every) => {}
        }
    }
}

/// A request that has not ended.
const OPEN: &str = "recovery_point <> 'FINISHED' AND recovery_point <> 'VOIDED'";
/// A request that moved within the ledger's retention ($1 seconds).
const RECENT: &str = "updated_at >= now() - make_interval(secs => $1)";

/// `attempt` until it gets its locks, or [`LOCK_ATTEMPTS`] times, with a
/// growing, jittered pause between (so two housekeepers do not keep meeting).
async fn with_locks<T, F: Future<Output = Result<T, LedgerError>>>(
    mut attempt: impl FnMut() -> F,
) -> Result<T, LedgerError> {
    let mut tries = 1;
    loop {
        match attempt().await {
            Err(e) if lock_timed_out(&e) && tries < LOCK_ATTEMPTS => {
                let pause = LOCK_WAIT * tries.min(5) + Duration::from_millis(fastrand::u64(0..100));
                tokio::time::sleep(pause).await;
                tries += 1;
            }
            done => return done,
        }
    }
}

fn lock_timed_out(e: &LedgerError) -> bool {
    // lock_not_available: a lock not had within `lock_timeout`.
    e.has_code("55P03")
}

async fn set_lock_wait(tx: &mut sqlx::PgTransaction<'_>) -> Result<(), LedgerError> {
    let wait = format!("SET LOCAL lock_timeout = '{}ms'", LOCK_WAIT.as_millis());
    sqlx::query(AssertSqlSafe(wait)).execute(&mut **tx).await?;
    Ok(())
}

/// The suffix of the span starting at `from`: `p` and its UTC time to the second.
fn suffix_of(from: OffsetDateTime) -> String {
    format!(
        "p{:04}{:02}{:02}t{:02}{:02}{:02}",
        from.year(),
        u8::from(from.month()),
        from.day(),
        from.hour(),
        from.minute(),
        from.second()
    )
}

fn literal(at: OffsetDateTime) -> Result<String, LedgerError> {
    let text = at.format(&Rfc3339).map_err(|e| LedgerError::unreadable("a partition bound", e))?;
    Ok(format!("'{text}'"))
}

fn micros(at: OffsetDateTime) -> i64 {
    i64::try_from(at.unix_timestamp_nanos() / 1000).unwrap_or(i64::MAX)
}

fn micros_of(span: Duration) -> i64 {
    i64::try_from(span.as_micros()).unwrap_or(i64::MAX).max(1)
}

fn at(micros: i64) -> OffsetDateTime {
    OffsetDateTime::from_unix_timestamp_nanos(i128::from(micros) * 1000).unwrap_or(OffsetDateTime::UNIX_EPOCH)
}

fn unzip3<A, B, C>(rows: Vec<(A, B, C)>) -> (Vec<A>, Vec<B>, Vec<C>) {
    let mut out = (Vec::with_capacity(rows.len()), Vec::with_capacity(rows.len()), Vec::with_capacity(rows.len()));
    for (a, b, c) in rows {
        out.0.push(a);
        out.1.push(b);
        out.2.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_suffix_names_the_span_s_start_in_utc() {
        let from = OffsetDateTime::parse("2026-12-02T00:00:00Z", &Rfc3339).unwrap();
        assert_eq!(suffix_of(from), "p20261202t000000");
        let from = OffsetDateTime::parse("2026-12-02T07:30:05+02:00", &Rfc3339).unwrap();
        assert_eq!(suffix_of(from.to_offset(time::UtcOffset::UTC)), "p20261202t053005");
    }
}
