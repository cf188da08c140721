//! The idempotency tables' day partitions (migration `0010`): `requests`,
//! `phase_runs` and `external_calls` are split by the UTC day of the
//! request's `created_at`. [`Ledger::maintain_partitions`] adds the days
//! ahead and drops whole days once every request in them is finished (or
//! given up) and was last written longer ago than the retention, its grace
//! and a margin: by then its key is gone from the key store too, so neither
//! a replay nor the reconciler can miss the rows. A day holding an
//! unfinished request is kept, and reported, however old it is. The
//! decisions are the migration's SQL functions; this module calls them, one
//! transaction each with a short lock timeout, and says what they did.
//! One instance at a time maintains (an advisory lock); the others skip.

use std::time::Duration;

use serde::Serialize;
use sqlx::Row;
use time::format_description::well_known::Rfc3339;
use time::{Date, OffsetDateTime};
use tokio::sync::watch;

use super::{Ledger, LedgerError};

/// The advisory lock maintenance holds ("kfpart").
const MAINTENANCE_LOCK: i64 = 0x6b66_7061_7274;

/// How long a maintenance step waits for the tables' locks before it gives
/// up until the next run (phases queue behind a waiting lock).
const LOCK_TIMEOUT: &str = "2s";

#[derive(Debug, Clone, Copy)]
pub struct Options {
    /// Days made ahead of today (UTC), today included.
    pub ahead_days: u32,
    /// How long a finished request is kept: the key store's retention, its
    /// grace, and a margin for a key finished late (after a key-store outage).
    pub keep: Duration,
}

/// What one run did.
#[derive(Debug, Default, Clone, Serialize)]
pub struct Report {
    /// Another instance was maintaining: nothing was done.
    pub skipped: bool,
    /// Day partitions made (each day is three tables).
    pub days_added: u32,
    /// Days dropped, as `YYYY-MM-DD`.
    pub days_dropped: Vec<String>,
    /// Old enough days kept, and why.
    pub days_kept: Vec<KeptDay>,
    /// Days partitioned now.
    pub days: usize,
    /// Requests outside every day partition (in the default partition).
    pub outside_days: i64,
    pub failures: Vec<String>,
}

#[derive(Debug, Clone, Serialize)]
pub struct KeptDay {
    pub day: String,
    /// Requests of the day not finished: they keep it however old it is.
    pub unfinished: i64,
    /// When the day was last written (a request finished late keeps it until its key is gone).
    pub last_written: Option<String>,
}

impl Report {
    pub fn summary(&self) -> String {
        if self.skipped {
            return "partitions: another instance is maintaining them; nothing done\n".into();
        }
        let mut out = format!(
            "partitions: {} days kept in all, {} added, {} dropped{}\n",
            self.days,
            self.days_added,
            self.days_dropped.len(),
            if self.days_dropped.is_empty() { String::new() } else { format!(" ({})", self.days_dropped.join(", ")) }
        );
        for kept in &self.days_kept {
            out += &match kept.unfinished {
                0 => format!(
                    "  {} kept: last written {}, within the retention\n",
                    kept.day,
                    kept.last_written.as_deref().unwrap_or("never")
                ),
                n => format!("  {} kept: {n} unfinished request(s)\n", kept.day),
            };
        }
        if self.outside_days > 0 {
            out += &format!(
                "  {} request(s) outside every day partition (in the default partition; kept)\n",
                self.outside_days
            );
        }
        for failure in &self.failures {
            out += &format!("  failed: {failure}\n");
        }
        out
    }
}

impl Ledger {
    /// Adds the days ahead and drops the days past their keeping.
    pub async fn maintain_partitions(&self, options: Options) -> Result<Report, LedgerError> {
        let mut lock = self.pool.acquire().await?;
        let held: bool =
            sqlx::query_scalar("SELECT pg_try_advisory_lock($1)").bind(MAINTENANCE_LOCK).fetch_one(&mut *lock).await?;
        if !held {
            return Ok(Report { skipped: true, ..Report::default() });
        }
        let report = self.maintain_locked(options).await;
        sqlx::query("SELECT pg_advisory_unlock($1)").bind(MAINTENANCE_LOCK).execute(&mut *lock).await?;
        report
    }

    async fn maintain_locked(&self, options: Options) -> Result<Report, LedgerError> {
        let mut report = Report::default();
        let now = OffsetDateTime::now_utc();
        let today = now.date();
        let last = today.saturating_add(time::Duration::days(i64::from(options.ahead_days.saturating_sub(1))));
        match self.step("SELECT keyfence_add_day_partitions($1, $2)", |q| q.bind(today).bind(last)).await {
            Ok(row) => report.days_added = u32::try_from(row.try_get::<i32, _>(0)?).unwrap_or(0) / 3,
            Err(e) => report.failures.push(format!("adding days up to {last}: {e}")),
        }

        let settled_before = now - options.keep;
        for day in self.days().await? {
            // A day can hold nothing settled before its own end.
            if day.next_day().is_none_or(|end| end.midnight().assume_utc() > settled_before) {
                continue;
            }
            let dropped = self
                .step("SELECT dropped, unfinished, last_written FROM keyfence_drop_day_partitions($1, $2)", |q| {
                    q.bind(day).bind(settled_before)
                })
                .await;
            let row = match dropped {
                Ok(row) => row,
                Err(e) => {
                    report.failures.push(format!("dropping {day}: {e}"));
                    continue;
                }
            };
            if row.try_get::<bool, _>("dropped")? {
                report.days_dropped.push(day.to_string());
            } else {
                report.days_kept.push(KeptDay {
                    day: day.to_string(),
                    unfinished: row.try_get("unfinished")?,
                    last_written: row
                        .try_get::<Option<OffsetDateTime>, _>("last_written")?
                        .and_then(|t| t.format(&Rfc3339).ok()),
                });
            }
        }
        report.days = self.days().await?.len();
        report.outside_days = sqlx::query_scalar("SELECT count(*) FROM requests_default").fetch_one(&self.pool).await?;
        metrics::gauge!("keyfence_ledger_days").set(report.days as f64);
        metrics::gauge!("keyfence_ledger_requests_outside_days").set(report.outside_days as f64);
        Ok(report)
    }

    /// The days `requests` is partitioned into, oldest first.
    async fn days(&self) -> Result<Vec<Date>, LedgerError> {
        let names: Vec<String> = sqlx::query_scalar(
            "SELECT c.relname::text FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
              WHERE i.inhparent = 'requests'::regclass",
        )
        .fetch_all(&self.pool)
        .await?;
        let mut days: Vec<Date> =
            names.iter().filter_map(|name| name.strip_prefix("requests_")).filter_map(day_named).collect();
        days.sort();
        Ok(days)
    }

    /// Runs one maintenance statement in a transaction of its own, waiting
    /// at most [`LOCK_TIMEOUT`] for locks.
    async fn step(
        &self,
        sql: &'static str,
        bind: impl FnOnce(Query<'static>) -> Query<'static>,
    ) -> Result<sqlx::postgres::PgRow, LedgerError> {
        let mut tx = self.pool.begin().await?;
        sqlx::query(sqlx::AssertSqlSafe(format!("SET LOCAL lock_timeout = '{LOCK_TIMEOUT}'")))
            .execute(&mut *tx)
            .await?;
        let row = bind(sqlx::query(sql)).fetch_one(&mut *tx).await?;
        tx.commit().await?;
        Ok(row)
    }
}

/// Maintains the partitions at start and then every `interval`, until
/// `stop` fires (inside `serve`).
pub async fn run_until_stopped(ledger: Ledger, interval: Duration, options: Options, mut stop: watch::Receiver<()>) {
    loop {
        match ledger.maintain_partitions(options).await {
            Ok(report) if !report.days_dropped.is_empty() || !report.failures.is_empty() || report.outside_days > 0 => {
                tracing::info!(
                    dropped = report.days_dropped.len(),
                    kept = report.days_kept.len(),
                    outside_days = report.outside_days,
                    failures = ?report.failures,
                    "ledger partitions maintained"
                );
            }
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "could not maintain the ledger's partitions"),
        }
        tokio::select! {
            _ = stop.changed() => return,
            () = tokio::time::sleep(interval) => {}
        }
    }
}

type Query<'q> = sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments>;

/// The day a partition's suffix names (`YYYYMMDD`).
fn day_named(suffix: &str) -> Option<Date> {
    let number = |range: std::ops::Range<usize>| suffix.get(range).and_then(|s| s.parse::<i32>().ok());
    if suffix.len() != 8 {
        return None;
    }
    let month = time::Month::try_from(u8::try_from(number(4..6)?).ok()?).ok()?;
    Date::from_calendar_date(number(0..4)?, month, u8::try_from(number(6..8)?).ok()?).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partitions_are_named_for_their_day() {
        assert_eq!(day_named("20261201"), Date::from_calendar_date(2026, time::Month::December, 1).ok());
        assert_eq!(day_named("default"), None);
        assert_eq!(day_named("20261301"), None);
        assert_eq!(day_named("2026120"), None);
    }
}
