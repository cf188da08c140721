//! External-call records: the intent committed before a call (with the
//! derived key the external system deduplicates on), the verdict after it
//! (`done` with what was applied, or `declined` with why), both written by
//! the statement that opens a phase, and attempts whose outcome stayed
//! unknown.

use std::collections::HashSet;

use sqlx::PgConnection;

use super::phase::{RequestRecord, fence_param};
use super::{LedgerError, timestamp};
use crate::domain::{Fence, Millis, ProbeBackoff};
use crate::rail::Verdict;

/// The external-call writes a phase makes in its opening statement, after
/// the fence check and only if it passed: the verdict of the step the
/// request awaited (`done` with what was applied, or `declined` with why),
/// and the intent of the step about to be sent, under its derived key.
#[derive(Clone, Copy, Debug, Default)]
pub struct CallWrites<'a> {
    pub verdict: Option<(&'a str, &'a Verdict)>,
    pub intent: Option<Intent<'a>>,
}

/// The intent of an external step: its derived key, and what its
/// instruction carries that a rail's notification about it is matched
/// against.
#[derive(Clone, Copy, Debug)]
pub struct Intent<'a> {
    pub step: &'a str,
    pub derived_key: uuid::Uuid,
    pub sent: Sent<'a>,
}

/// What a notification about an instruction must repeat: its end-to-end
/// reference, amount and currency.
#[derive(Clone, Copy, Debug, serde::Serialize)]
pub struct Sent<'a> {
    pub end_to_end_id: &'a str,
    pub amount_minor: i64,
    pub currency: &'a str,
}

/// [`CallWrites`] as the opening statement binds them: arrays, empty when
/// there is nothing to write.
#[derive(Default)]
pub(super) struct CallBinds {
    pub intent_steps: Vec<String>,
    pub intent_keys: Vec<uuid::Uuid>,
    pub verdict_steps: Vec<String>,
    pub verdict_outcomes: Vec<&'static str>,
    pub verdict_results: Vec<serde_json::Value>,
    pub intent_sent: Vec<serde_json::Value>,
}

impl CallWrites<'_> {
    pub(super) fn binds(&self) -> Result<CallBinds, LedgerError> {
        let mut binds = CallBinds::default();
        if let Some(intent) = self.intent {
            let sent = serde_json::to_value(intent.sent).map_err(|e| LedgerError::unreadable("an instruction", e))?;
            binds.intent_steps.push(intent.step.to_owned());
            binds.intent_keys.push(intent.derived_key);
            binds.intent_sent.push(sent);
        }
        if let Some((step, verdict)) = self.verdict {
            let (outcome, result) = match verdict {
                Verdict::Applied(applied) => ("done", serde_json::to_value(applied)),
                Verdict::Declined(declined) => ("declined", serde_json::to_value(declined)),
            };
            let result = result.map_err(|e| LedgerError::unreadable("a verdict", e))?;
            binds.verdict_steps.push(step.to_owned());
            binds.verdict_outcomes.push(outcome);
            binds.verdict_results.push(result);
        }
        Ok(binds)
    }
}

/// The common table expressions that make [`CallWrites`], for a phase's
/// opening statement whose `moved` says the fence check passed, with the
/// request's key as `$1`-`$3`, its fence as `$fence` and the six arrays
/// of [`CallBinds`] from `$first` on, writing the calls to `calls` (the
/// table, or the request's partition of it). Notifications waiting in the inbox
/// for the same instruction take effect with the verdict: one of the same
/// verdict is marked applied, one that contradicts it is kept for the
/// reconciler. A call with a verdict has no next probe, so it leaves the
/// index of calls in doubt (a call never parked had none: its update
/// stays heap-only).
pub(super) fn call_writes(calls: &str, fence: u8, first: u8) -> String {
    let [steps, keys, verdict_steps, outcomes, results, sent] = std::array::from_fn(|i| first + i as u8);
    format!(
        "intent AS (
        INSERT INTO {calls} (client_id, idem_key, request_created_at, step, derived_key, fence, outcome, sent)
        SELECT $1, $2, $3, step, key, ${fence}, 'sent', sent
          FROM unnest(${steps}::text[], ${keys}::uuid[], ${sent}::jsonb[]) AS i(step, key, sent)
         WHERE EXISTS (SELECT 1 FROM moved)),
     verdict AS (
        UPDATE {calls} c SET outcome = v.outcome, result = v.result, fence = ${fence}, done_at = now(),
                             next_probe_at = NULL
          FROM unnest(${verdict_steps}::text[], ${outcomes}::text[], ${results}::jsonb[]) AS v(step, outcome, result)
         WHERE c.client_id = $1 AND c.idem_key = $2 AND c.request_created_at = $3 AND c.step = v.step
           AND EXISTS (SELECT 1 FROM moved)
        RETURNING c.derived_key, CASE v.outcome WHEN 'done' THEN 'applied' ELSE 'declined' END AS kind),
     noted AS (
        UPDATE inbox SET applied_at = now(),
               state = CASE WHEN inbox.kind = v.kind THEN 'applied' ELSE 'unknown' END,
               note = CASE WHEN inbox.kind = v.kind THEN NULL ELSE 'contradicts the outcome recorded' END
          FROM verdict v
         WHERE inbox.derived_key = v.derived_key AND inbox.state = 'pending' AND inbox.kind <> 'returned')"
    )
}

/// Counts one more attempt at `step` whose outcome is still unknown;
/// returns how many attempts there have been.
pub async fn record_unknown_attempt(
    conn: &mut PgConnection,
    request: &RequestRecord,
    step: &str,
    fence: Fence,
    backoff: ProbeBackoff,
) -> Result<i32, LedgerError> {
    // The right-hand side reads the row before the update: `attempts` is
    // one (the first send) plus the unknown outcomes before this one.
    Ok(sqlx::query_scalar(
        "UPDATE external_calls SET outcome = 'unknown', attempts = attempts + 1, fence = $5, last_attempt_at = now(),
                next_probe_at = now() + make_interval(
                    secs => LEAST($7, $6 * power(2, LEAST(GREATEST(attempts - 1, 0), 30))) * (0.8 + random() * 0.4))
          WHERE client_id = $1 AND idem_key = $2 AND request_created_at = $3 AND step = $4
         RETURNING attempts",
    )
    .bind(request.key.client.as_uuid())
    .bind(request.key.key.as_str())
    .bind(timestamp(request.created_at))
    .bind(step)
    .bind(fence_param(fence))
    .bind(backoff.first.as_secs_f64())
    .bind(backoff.max.as_secs_f64())
    .fetch_one(conn)
    .await?)
}

/// Gives up guessing: the outcome of `step` is indeterminate until the
/// external system answers or settlement against its statement decides.
/// Its next probe stays set (an unknown attempt set it), which is what
/// lists it among the calls in doubt ([`super::Ledger::indeterminate`]).
pub async fn mark_indeterminate(
    conn: &mut PgConnection,
    request: &RequestRecord,
    step: &str,
    fence: Fence,
) -> Result<(), LedgerError> {
    sqlx::query(
        "UPDATE external_calls SET outcome = 'indeterminate', fence = $5, next_probe_at = coalesce(next_probe_at, now())
          WHERE client_id = $1 AND idem_key = $2 AND request_created_at = $3 AND step = $4",
    )
    .bind(request.key.client.as_uuid())
    .bind(request.key.key.as_str())
    .bind(timestamp(request.created_at))
    .bind(step)
    .bind(fence_param(fence))
    .execute(&mut *conn)
    .await?;
    Ok(())
}

/// An external call whose outcome stayed unknown, listed for settlement.
#[derive(Debug, Clone, serde::Serialize, sqlx::FromRow)]
pub struct Indeterminate {
    pub client_id: uuid::Uuid,
    pub idem_key: String,
    pub payment_id: uuid::Uuid,
    pub step: String,
    pub derived_key: uuid::Uuid,
    pub attempts: i32,
    #[serde(with = "time::serde::rfc3339")]
    pub last_attempt_at: time::OffsetDateTime,
    /// When the request was first claimed.
    #[serde(with = "time::serde::rfc3339")]
    pub created_at: time::OffsetDateTime,
}

impl super::Ledger {
    /// Of `requests` (client, key, first claimed), those parked until a
    /// probe that is not yet due: the recovery worker leaves them alone.
    /// With none to ask about, PostgreSQL is not asked (planning the join
    /// over the partitions costs a few milliseconds, every sweep).
    pub async fn parked_until_later(
        &self,
        requests: &[(uuid::Uuid, String, Millis)],
    ) -> Result<HashSet<(uuid::Uuid, String)>, LedgerError> {
        if requests.is_empty() {
            return Ok(HashSet::new());
        }
        let clients: Vec<uuid::Uuid> = requests.iter().map(|r| r.0).collect();
        let keys: Vec<&str> = requests.iter().map(|r| r.1.as_str()).collect();
        let created: Vec<time::OffsetDateTime> = requests.iter().map(|r| timestamp(r.2)).collect();
        let rows: Vec<(uuid::Uuid, String)> = sqlx::query_as(
            "SELECT DISTINCT c.client_id, c.idem_key
               FROM external_calls c
               JOIN UNNEST($1::uuid[], $2::text[], $3::timestamptz[]) AS s(client_id, idem_key, created_at)
                 ON (c.client_id, c.idem_key, c.request_created_at) = (s.client_id, s.idem_key, s.created_at)
              WHERE c.outcome IN ('unknown', 'indeterminate') AND c.next_probe_at > now()",
        )
        .bind(clients)
        .bind(keys)
        .bind(created)
        .fetch_all(&self.pool)
        .await?;
        Ok(rows.into_iter().collect())
    }

    /// Every external call currently marked indeterminate, oldest first,
    /// read through the index of calls in doubt (those with a next probe
    /// set), not from every call in the retention.
    pub async fn indeterminate(&self) -> Result<Vec<Indeterminate>, LedgerError> {
        Ok(sqlx::query_as(
            "SELECT c.client_id, c.idem_key, r.payment_id, c.step, c.derived_key, c.attempts, c.last_attempt_at,
                    c.request_created_at AS created_at
               FROM external_calls c
               JOIN requests r ON (r.client_id, r.idem_key, r.created_at) = (c.client_id, c.idem_key, c.request_created_at)
              WHERE c.next_probe_at IS NOT NULL AND c.outcome = 'indeterminate'
              ORDER BY c.last_attempt_at",
        )
        .fetch_all(&self.pool)
        .await?)
    }
}

/// The recorded result of `step`, once its outcome is known.
pub async fn outcome_of(
    conn: &mut PgConnection,
    request: &RequestRecord,
    step: &str,
) -> Result<Option<serde_json::Value>, LedgerError> {
    let result: Option<Option<serde_json::Value>> = sqlx::query_scalar(
        "SELECT result FROM external_calls
          WHERE client_id = $1 AND idem_key = $2 AND request_created_at = $3 AND step = $4 AND outcome = 'done'",
    )
    .bind(request.key.client.as_uuid())
    .bind(request.key.key.as_str())
    .bind(timestamp(request.created_at))
    .bind(step)
    .fetch_optional(conn)
    .await?;
    Ok(result.flatten())
}
