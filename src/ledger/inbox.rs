//! The inbox's statements: recording a rail's message once by its id,
//! finding the verdict a notification brought for an instruction in
//! flight, and opening the phase that applies a return. A verdict is
//! applied by the phase that records the external call's outcome
//! ([`super::external::call_writes`] marks it in the same statement).

use sqlx::{Postgres, Transaction};
use time::OffsetDateTime;
use uuid::Uuid;

use super::{Ledger, LedgerError, millis};
use crate::domain::{ClientId, IdempotencyKey, Millis, ScopedKey};

/// A message as the rail sent it, checked and parsed.
#[derive(Debug, Clone)]
pub struct Message {
    pub rail: String,
    pub id: String,
    /// `applied`, `declined` or `returned`.
    pub kind: &'static str,
    pub derived_key: Option<Uuid>,
    pub body: serde_json::Value,
    /// The rail's own word, kept to hand the message on as it came.
    pub signed: Signed,
    /// The region that handed it here; such a message is never handed on.
    pub handed_from: Option<String>,
}

/// A notification's bytes and the rail's signature of them (Standard
/// Webhooks: its `webhook-timestamp` and `webhook-signature`).
#[derive(Debug, Clone, Default)]
pub struct Signed {
    pub raw: Vec<u8>,
    pub at: i64,
    pub signature: String,
}

/// A message waiting to be handed to the region that holds its live copy.
#[derive(Debug, Clone)]
pub struct Waiting {
    pub rail: String,
    pub message_id: String,
    pub signed: Signed,
    /// Since when it has been offered to the other regions.
    pub since: Millis,
}

/// What became of a message on arrival.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Arrival {
    /// Seen before under the same id: dropped.
    Duplicate,
    /// Seen before under the same id with another body: dropped, and logged.
    Conflicting,
    /// Kept to take effect: its instruction's request, to be resumed (or
    /// its payment, to be returned).
    Pending(InFlight),
    /// Nothing left to do (the same outcome was recorded already).
    Ignored,
    /// Kept for the reconciler: it names no instruction of this ledger, or
    /// cannot take effect here (see its note).
    Unknown(&'static str),
    /// Kept to be handed to another region, for the reason given.
    Forwarding(&'static str),
}

/// The request an instruction belongs to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InFlight {
    pub key: ScopedKey,
    pub created_at: Millis,
    pub payment_id: Uuid,
}

impl InFlight {
    /// The request named by a ledger row's columns; `None` if its key does not read.
    fn of(client: Uuid, key: &str, created_at: time::OffsetDateTime, payment_id: Uuid) -> Option<Self> {
        Some(Self {
            key: ScopedKey::new(ClientId::new(client), IdempotencyKey::parse(key).ok()?),
            created_at: millis(created_at),
            payment_id,
        })
    }
}

/// A message that names no instruction of this ledger, or could not take
/// effect here, kept for the reconciler (and a person: the rail may hold a
/// payment keyfence lost, or disagree with it).
#[derive(Debug, Clone, serde::Serialize, sqlx::FromRow)]
pub struct Unmatched {
    pub rail: String,
    pub message_id: String,
    pub kind: String,
    /// The instruction's key as the rail named it.
    pub idempotency_key: Option<String>,
    pub note: Option<String>,
    #[serde(with = "time::serde::rfc3339")]
    pub received_at: time::OffsetDateTime,
}

/// A message kept for a person, as a person settled it.
#[derive(Debug, Clone, serde::Serialize, sqlx::FromRow)]
pub struct SettledByPerson {
    pub rail: String,
    pub message_id: String,
    pub kind: String,
    /// Why it was kept.
    pub kept_because: Option<String>,
    /// What the person said they did.
    pub note: String,
}

/// A pending return, with the payment (or refund) it returns and its key.
#[derive(Debug, Clone)]
pub struct PendingReturn {
    pub rail: String,
    pub message_id: String,
    pub key: ScopedKey,
    /// The payment's request: its key's `created_at`.
    pub created_at: Millis,
    pub body: serde_json::Value,
    /// The payment's id, or the refund's.
    pub payment_id: Uuid,
    /// Whether it may be handed on (it was not handed here, and the rail's
    /// own word was kept with it).
    pub may_hand_on: bool,
}

/// What an inbox round finds to do.
#[derive(Debug, Clone, Copy)]
pub struct Due {
    pub pending: bool,
    pub to_hand_on: bool,
}

/// How a message waiting to be handed on ended.
#[derive(Debug, Clone, Copy)]
pub enum HandOnEnd<'a> {
    /// Taken by this region.
    To(&'a str),
    /// Kept for a person, for this reason.
    Kept(&'a str),
}

/// The instruction a message names, as this ledger holds it.
#[derive(sqlx::FromRow)]
struct Named {
    client_id: Uuid,
    idem_key: String,
    request_created_at: time::OffsetDateTime,
    step: String,
    outcome: String,
    payment_id: Uuid,
    status: Option<String>,
    amount_minor: Option<i64>,
    currency: Option<String>,
    end_to_end_id: Option<String>,
}

/// Why a message about a voided copy is kept for a person.
pub const LEFTOVER: &str = "this ledger holds a leftover; the payment's live copy is in another region";

/// Why a message naming no instruction of this ledger is kept.
pub const NOT_HERE: &str = "no instruction of this ledger has this key";

/// Why a message no region took is kept for a person.
pub const NOWHERE: &str = "no region holds a live copy of its instruction";

/// The steps whose instruction a rail may return: a payment's (`ext2`) and
/// a refund's.
const RETURNABLE: [&str; 2] = ["ext2", "refund"];

/// The rail each step calls, by the name its notifications come under.
fn rail_of(step: &str) -> &'static str {
    match step {
        "ext1" => "e1",
        _ => "e2",
    }
}

impl Named {
    /// What `message` can do to this instruction.
    fn arrival(&self, message: &Message) -> Arrival {
        if rail_of(&self.step) != message.rail {
            return Arrival::Unknown("the instruction was not sent to this rail");
        }
        let field = |name: &str| message.body.get(name);
        let same_reference = field("end_to_end_id").and_then(|v| v.as_str()) == self.end_to_end_id.as_deref();
        let same_amount = message.kind == "declined"
            || (field("amount_minor").and_then(|v| v.as_i64()) == self.amount_minor
                && field("currency").and_then(|v| v.as_str()) == self.currency.as_deref());
        if !same_reference || !same_amount {
            return Arrival::Unknown("it does not match the instruction sent");
        }
        // A payment's return still freezes its balance when this ledger
        // holds only a leftover (the inbox decides after freezing).
        let leftover = self.status.as_deref() == Some("voided");
        if leftover && !(message.kind == "returned" && self.step == "ext2") {
            return Arrival::Unknown(LEFTOVER);
        }
        let in_flight = || InFlight::of(self.client_id, &self.idem_key, self.request_created_at, self.payment_id);
        match (message.kind, self.outcome.as_str()) {
            ("returned", _) if !RETURNABLE.contains(&self.step.as_str()) => {
                Arrival::Unknown("only the payment rail returns, a payment or a refund")
            }
            ("applied", "done") | ("declined", "declined") => Arrival::Ignored,
            ("applied" | "declined", "done" | "declined") => Arrival::Unknown("it contradicts the outcome recorded"),
            _ => in_flight().map_or(Arrival::Unknown("the request's key does not read"), Arrival::Pending),
        }
    }
}

impl Ledger {
    /// Records `message` once: a message id seen before is a duplicate.
    /// One this ledger cannot take (no instruction of its has the key, or
    /// it holds a leftover) is kept to be handed on if `may_hand_on`.
    pub async fn receive(&self, message: &Message, may_hand_on: bool) -> Result<Arrival, LedgerError> {
        let named = self.named(message).await?;
        let arrival = match named.map_or(Arrival::Unknown(NOT_HERE), |named| named.arrival(message)) {
            Arrival::Unknown(why) if may_hand_on && [NOT_HERE, LEFTOVER].contains(&why) => Arrival::Forwarding(why),
            arrival => arrival,
        };
        let (state, note) = match &arrival {
            Arrival::Pending(_) => ("pending", None),
            Arrival::Ignored => ("ignored", Some("the outcome was recorded already")),
            Arrival::Unknown(why) => ("unknown", Some(*why)),
            Arrival::Forwarding(why) => ("forwarding", Some(*why)),
            Arrival::Duplicate | Arrival::Conflicting => unreachable!("decided below"),
        };
        let kept = sqlx::query(
            "INSERT INTO inbox (rail, message_id, kind, derived_key, body, state, note, raw, signed_at, signature,
                                handed_from, forwarding_since, hand_after)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11,
                     CASE WHEN $6 = 'forwarding' THEN now() END, CASE WHEN $6 = 'forwarding' THEN now() END)
             ON CONFLICT (rail, message_id) DO NOTHING",
        )
        .bind(&message.rail)
        .bind(&message.id)
        .bind(message.kind)
        .bind(message.derived_key)
        .bind(&message.body)
        .bind(state)
        .bind(note)
        .bind(&message.signed.raw)
        .bind(message.signed.at)
        .bind(&message.signed.signature)
        .bind(&message.handed_from)
        .execute(&self.pool)
        .await?;
        if kept.rows_affected() == 1 {
            return Ok(arrival);
        }
        let first: Option<serde_json::Value> =
            sqlx::query_scalar("SELECT body FROM inbox WHERE rail = $1 AND message_id = $2")
                .bind(&message.rail)
                .bind(&message.id)
                .fetch_optional(&self.pool)
                .await?;
        Ok(if first.as_ref() == Some(&message.body) { Arrival::Duplicate } else { Arrival::Conflicting })
    }

    /// The instruction `message` names, as this ledger holds it: matched
    /// against what the call's instruction carried (for every operation);
    /// a call recorded before that was kept is matched against its
    /// payment, as it was then.
    async fn named(&self, message: &Message) -> Result<Option<Named>, LedgerError> {
        let Some(key) = message.derived_key else { return Ok(None) };
        Ok(sqlx::query_as(
            "SELECT c.client_id, c.idem_key, c.request_created_at, c.step, c.outcome, r.payment_id, s.status,
                    coalesce((c.sent->>'amount_minor')::bigint, p.amount_minor) AS amount_minor,
                    coalesce(c.sent->>'currency', p.currency) AS currency,
                    coalesce(c.sent->>'end_to_end_id', p.end_to_end_id) AS end_to_end_id
               FROM external_calls c
               JOIN requests r ON (r.client_id, r.idem_key, r.created_at)
                                = (c.client_id, c.idem_key, c.request_created_at)
               LEFT JOIN ledger_subjects s ON s.id = r.payment_id
               LEFT JOIN payments p ON p.id = r.payment_id AND c.sent IS NULL
              WHERE c.derived_key = $1",
        )
        .bind(key)
        .fetch_optional(&self.pool)
        .await?)
    }

    /// The request whose instruction `message` names, if this ledger holds
    /// a copy of it that is not a leftover it voided (whether the request
    /// moved away since is the key store's to say).
    pub async fn live_request_of(&self, message: &Message) -> Result<Option<InFlight>, LedgerError> {
        Ok(self.named(message).await?.filter(|named| named.status.as_deref() != Some("voided")).and_then(|named| {
            InFlight::of(named.client_id, &named.idem_key, named.request_created_at, named.payment_id)
        }))
    }

    /// The verdict a notification brought for the instruction sent under
    /// `derived_key`, if one waits: (`applied` or `declined`, its body).
    pub async fn notified_verdict(
        &self,
        derived_key: Uuid,
    ) -> Result<Option<(String, serde_json::Value)>, LedgerError> {
        Ok(sqlx::query_as(
            "SELECT kind, body FROM inbox WHERE derived_key = $1 AND state = 'pending' AND kind <> 'returned'
              ORDER BY received_at LIMIT 1",
        )
        .bind(derived_key)
        .fetch_optional(&self.pool)
        .await?)
    }

    /// Whether any message is pending, and whether any waits to be handed
    /// on now (one statement, read off two partial indexes, `inbox_pending`
    /// and `inbox_forwarding`).
    pub async fn inbox_due(&self) -> Result<Due, LedgerError> {
        let (pending, to_hand_on) = sqlx::query_as(
            "SELECT EXISTS (SELECT 1 FROM inbox WHERE state = 'pending'),
                    EXISTS (SELECT 1 FROM inbox WHERE state = 'forwarding' AND hand_after <= now())",
        )
        .fetch_one(&self.pool)
        .await?;
        Ok(Due { pending, to_hand_on })
    }

    /// Up to `limit` messages due to be handed on, each put off by `again`
    /// as it is taken (so two workers never offer one at once, and one
    /// that no region took yet is offered again after that).
    pub async fn to_hand_on(&self, limit: i64, again: std::time::Duration) -> Result<Vec<Waiting>, LedgerError> {
        type Row = (String, String, Option<Vec<u8>>, Option<i64>, Option<String>, Option<OffsetDateTime>);
        let rows: Vec<Row> = sqlx::query_as(
            "UPDATE inbox SET hand_after = now() + make_interval(secs => $2)
              WHERE (rail, message_id) IN (SELECT rail, message_id FROM inbox
                                            WHERE state = 'forwarding' AND hand_after <= now()
                                            ORDER BY hand_after LIMIT $1 FOR UPDATE SKIP LOCKED)
              RETURNING rail, message_id, raw, signed_at, signature, forwarding_since",
        )
        .bind(limit)
        .bind(again.as_secs_f64())
        .fetch_all(&self.pool)
        .await?;
        Ok(rows
            .into_iter()
            .map(|(rail, message_id, raw, at, signature, since)| Waiting {
                rail,
                message_id,
                signed: Signed {
                    raw: raw.unwrap_or_default(),
                    at: at.unwrap_or_default(),
                    signature: signature.unwrap_or_default(),
                },
                since: since.map_or(Millis::now(), millis),
            })
            .collect())
    }

    /// Ends a message waiting to be handed on: taken by `region`
    /// (`forwarded`), or kept for a person (`unknown`) because `why`. A
    /// region's taking wins over a person's keeping that another worker
    /// recorded as no region held it.
    pub async fn hand_on_ended(&self, rail: &str, message_id: &str, ended: HandOnEnd<'_>) -> Result<(), LedgerError> {
        let (state, note) = match ended {
            HandOnEnd::To(region) => ("forwarded", format!("handed to region {region}")),
            HandOnEnd::Kept(why) => ("unknown", why.to_owned()),
        };
        sqlx::query(
            "UPDATE inbox SET state = $3, note = $4, applied_at = now(), unanswered_at = NULL
              WHERE rail = $1 AND message_id = $2
                AND (state = 'forwarding' OR ($3 = 'forwarded' AND state = 'unknown' AND note = $5))",
        )
        .bind(rail)
        .bind(message_id)
        .bind(state)
        .bind(note)
        .bind(NOWHERE)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// Records how the last offer of a message still waiting went: whether
    /// some region could not be asked.
    pub async fn offered(&self, rail: &str, message_id: &str, unanswered: bool) -> Result<(), LedgerError> {
        sqlx::query(
            "UPDATE inbox SET unanswered_at = CASE WHEN $3 THEN coalesce(unanswered_at, now()) END
              WHERE rail = $1 AND message_id = $2 AND state = 'forwarding'",
        )
        .bind(rail)
        .bind(message_id)
        .bind(unanswered)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// Takes back to work here a message waiting to be handed on, once this
    /// ledger holds a live copy of its instruction (the request was adopted
    /// here since it arrived): recorded as it would be had it come now
    /// (pending, for the inbox worker's next round; or known already).
    /// `None` if it does not wait here, or names no live copy here.
    pub async fn take_back(&self, message: &Message) -> Result<Option<Arrival>, LedgerError> {
        let Some(named) = self.named(message).await?.filter(|named| named.status.as_deref() != Some("voided")) else {
            return Ok(None);
        };
        let arrival = named.arrival(message);
        let (state, note) = match &arrival {
            Arrival::Pending(_) => ("pending", None),
            Arrival::Ignored => ("ignored", Some("the outcome was recorded already")),
            Arrival::Unknown(why) if ![NOT_HERE, LEFTOVER].contains(why) => ("unknown", Some(*why)),
            _ => return Ok(None),
        };
        let back = sqlx::query(
            "UPDATE inbox SET state = $3, note = $4, hand_after = NULL, unanswered_at = NULL,
                    applied_at = CASE WHEN $3 = 'pending' THEN NULL ELSE now() END
              WHERE rail = $1 AND message_id = $2 AND state = 'forwarding'",
        )
        .bind(&message.rail)
        .bind(&message.id)
        .bind(state)
        .bind(note)
        .execute(&self.pool)
        .await?;
        Ok((back.rows_affected() == 1).then_some(arrival))
    }

    /// Hands on the verdicts waiting here for `request`, which moved to
    /// another region (those handed here stay, and end as any verdict
    /// nobody takes up).
    pub async fn hand_on_verdicts(&self, request: &InFlight, why: &str) -> Result<u64, LedgerError> {
        let moved = sqlx::query(
            "UPDATE inbox i SET state = 'forwarding', note = $4, forwarding_since = now(), hand_after = now()
               FROM external_calls c
              WHERE c.derived_key = i.derived_key AND i.state = 'pending' AND i.kind <> 'returned'
                AND i.handed_from IS NULL AND i.raw IS NOT NULL
                AND (c.client_id, c.idem_key, c.request_created_at) = ($1, $2, $3)",
        )
        .bind(request.key.client.as_uuid())
        .bind(request.key.key.as_str())
        .bind(super::timestamp(request.created_at))
        .bind(why)
        .execute(&self.pool)
        .await?;
        Ok(moved.rows_affected())
    }

    /// How many messages wait to be handed to another region because, at
    /// their last offer, some region could not be asked (not those only
    /// offered within the usual window).
    pub async fn waiting_to_hand_on(&self) -> Result<i64, LedgerError> {
        Ok(sqlx::query_scalar("SELECT count(*) FROM inbox WHERE state = 'forwarding' AND unanswered_at IS NOT NULL")
            .fetch_one(&self.pool)
            .await?)
    }

    /// Ends verdicts that wait for an outcome recorded meanwhile (they
    /// arrived as it was being recorded, too late to be marked by it), and
    /// keeps for the reconciler those nobody took up within an hour (their
    /// request moved to another region, or its key is gone).
    pub async fn end_overtaken_verdicts(&self) -> Result<u64, LedgerError> {
        let overtaken = sqlx::query(
            "UPDATE inbox i SET applied_at = now(),
                    state = CASE WHEN (i.kind = 'applied') = (c.outcome = 'done') THEN 'ignored' ELSE 'unknown' END,
                    note = CASE WHEN (i.kind = 'applied') = (c.outcome = 'done') THEN 'the outcome was recorded already'
                                ELSE 'it contradicts the outcome recorded' END
               FROM external_calls c
              WHERE c.derived_key = i.derived_key AND i.state = 'pending' AND i.kind <> 'returned'
                AND c.outcome IN ('done', 'declined')",
        )
        .execute(&self.pool)
        .await?;
        let stale = sqlx::query(
            "UPDATE inbox SET state = 'unknown', note = 'nobody took it up within an hour'
              WHERE state = 'pending' AND kind <> 'returned' AND received_at < now() - interval '1 hour'",
        )
        .execute(&self.pool)
        .await?;
        Ok(overtaken.rows_affected() + stale.rows_affected())
    }

    /// Every message kept for a person (it named no instruction of this
    /// ledger, or could not take effect here), oldest first: all of them,
    /// read a page at a time.
    pub async fn unmatched(&self) -> Result<Vec<Unmatched>, LedgerError> {
        const PAGE: i64 = 1000;
        let mut all: Vec<Unmatched> = Vec::new();
        loop {
            let (at, rail, id) = match all.last() {
                Some(last) => (Some(last.received_at), Some(last.rail.clone()), Some(last.message_id.clone())),
                None => (None, None, None),
            };
            let page: Vec<Unmatched> = sqlx::query_as(
                "SELECT rail, message_id, kind, body->>'idempotency_key' AS idempotency_key, note, received_at
                   FROM inbox
                  WHERE state = 'unknown' AND ($1::timestamptz IS NULL OR (received_at, rail, message_id) > ($1, $2, $3))
                  ORDER BY received_at, rail, message_id LIMIT $4",
            )
            .bind(at)
            .bind(rail)
            .bind(id)
            .bind(PAGE)
            .fetch_all(&self.pool)
            .await?;
            let last_page = page.len() < PAGE as usize;
            all.extend(page);
            if last_page {
                return Ok(all);
            }
        }
    }

    /// Ends message `message_id` of `rail`, kept for a person (or still
    /// waiting to be handed on, which a person may settle instead), as
    /// settled by one, who did what `note` says; `None` if no such message
    /// waits here (never received by this region, or ended already).
    pub async fn settle_for_person(
        &self,
        rail: &str,
        message_id: &str,
        note: &str,
    ) -> Result<Option<SettledByPerson>, LedgerError> {
        Ok(sqlx::query_as(
            "WITH was AS (SELECT rail, message_id, note FROM inbox
                           WHERE rail = $1 AND message_id = $2 AND state IN ('unknown', 'forwarding') FOR UPDATE)
             UPDATE inbox i SET state = 'settled', applied_at = now(),
                    note = 'settled by a person: ' || $3 || ' (kept because: ' || coalesce(was.note, '-') || ')'
               FROM was WHERE (i.rail, i.message_id) = (was.rail, was.message_id)
             RETURNING i.rail, i.message_id, i.kind, was.note AS kept_because, $3 AS note",
        )
        .bind(rail)
        .bind(message_id)
        .bind(note)
        .fetch_optional(&self.pool)
        .await?)
    }

    /// Requests with a verdict waiting in the inbox, oldest first.
    pub async fn notified_in_flight(&self, limit: i64) -> Result<Vec<InFlight>, LedgerError> {
        let rows: Vec<(Uuid, String, time::OffsetDateTime, Uuid)> = sqlx::query_as(
            "SELECT c.client_id, c.idem_key, c.request_created_at, r.payment_id
               FROM inbox i
               JOIN external_calls c ON c.derived_key = i.derived_key
               JOIN requests r ON (r.client_id, r.idem_key, r.created_at) = (c.client_id, c.idem_key, c.request_created_at)
              WHERE i.state = 'pending' AND i.kind <> 'returned' AND c.outcome IN ('sent', 'unknown', 'indeterminate')
              GROUP BY c.client_id, c.idem_key, c.request_created_at, r.payment_id
              ORDER BY min(i.received_at) LIMIT $1",
        )
        .bind(limit)
        .fetch_all(&self.pool)
        .await?;
        Ok(rows
            .into_iter()
            .filter_map(|(client, key, created_at, payment_id)| InFlight::of(client, &key, created_at, payment_id))
            .collect())
    }

    /// Returns whose payment (or refund) is no longer in flight (so they
    /// can take effect, or be found to have none), oldest first. Those of
    /// requests still being worked wait, without holding up the others.
    pub async fn pending_returns(&self, limit: i64) -> Result<Vec<PendingReturn>, LedgerError> {
        type Row = (String, String, Uuid, String, OffsetDateTime, serde_json::Value, Uuid, bool);
        let rows: Vec<Row> = sqlx::query_as(
            "SELECT i.rail, i.message_id, c.client_id, c.idem_key, c.request_created_at, i.body, r.payment_id,
                    i.handed_from IS NULL AND i.raw IS NOT NULL AS may_hand_on
               FROM inbox i
               JOIN external_calls c ON c.derived_key = i.derived_key
               JOIN requests r ON (r.client_id, r.idem_key, r.created_at) = (c.client_id, c.idem_key, c.request_created_at)
               JOIN ledger_subjects s ON s.id = r.payment_id
              WHERE i.state = 'pending' AND i.kind = 'returned' AND s.status NOT IN ('pending', 'indeterminate')
              ORDER BY i.received_at LIMIT $1",
        )
        .bind(limit)
        .fetch_all(&self.pool)
        .await?;
        Ok(rows
            .into_iter()
            .filter_map(|(rail, message_id, client, key, created_at, body, payment_id, may_hand_on)| {
                let key = ScopedKey::new(ClientId::new(client), IdempotencyKey::parse(&key).ok()?);
                let created_at = millis(created_at);
                Some(PendingReturn { rail, message_id, key, created_at, body, payment_id, may_hand_on })
            })
            .collect())
    }

    /// Opens the phase that applies a return: under the region fence like
    /// every phase, with the message still pending and locked (so it takes
    /// effect once), and the payment (or refund) locked. `None` if the message was
    /// applied meanwhile; `Err(RegionFailed)` if the region is declared failed.
    pub async fn begin_return(
        &self,
        pending: &PendingReturn,
    ) -> Result<Option<Transaction<'static, Postgres>>, LedgerError> {
        let mut tx = self.opener.begin(&self.pool).await?;
        let fenced: Option<(bool, Option<String>)> =
            sqlx::query_as("SELECT failed, region FROM region_fence").fetch_optional(&mut *tx).await?;
        if let Some((true, region)) = fenced {
            return Err(LedgerError::RegionFailed(region.unwrap_or_default()));
        }
        let still: Option<i32> = sqlx::query_scalar(
            "SELECT 1 FROM inbox WHERE rail = $1 AND message_id = $2 AND state = 'pending' FOR UPDATE",
        )
        .bind(&pending.rail)
        .bind(&pending.message_id)
        .fetch_optional(&mut *tx)
        .await?;
        if still.is_none() {
            return Ok(None);
        }
        for locked in
            ["SELECT 1 FROM payments WHERE id = $1 FOR UPDATE", "SELECT 1 FROM refunds WHERE id = $1 FOR UPDATE"]
        {
            sqlx::query(locked).bind(pending.payment_id).execute(&mut *tx).await?;
        }
        Ok(Some(tx))
    }
}

/// Puts a message to be handed on inside the phase that found it cannot
/// take effect here, because `why`.
pub async fn hand_on_later(
    tx: &mut Transaction<'static, Postgres>,
    rail: &str,
    message_id: &str,
    why: &str,
) -> Result<(), LedgerError> {
    sqlx::query(
        "UPDATE inbox SET state = 'forwarding', note = $3, forwarding_since = now(), hand_after = now()
          WHERE rail = $1 AND message_id = $2",
    )
    .bind(rail)
    .bind(message_id)
    .bind(why)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// Ends a message inside the phase that took (or found no) effect.
pub async fn settle_message(
    tx: &mut Transaction<'static, Postgres>,
    rail: &str,
    message_id: &str,
    state: &str,
    note: Option<&str>,
) -> Result<(), LedgerError> {
    sqlx::query("UPDATE inbox SET state = $3, note = $4, applied_at = now() WHERE rail = $1 AND message_id = $2")
        .bind(rail)
        .bind(message_id)
        .bind(state)
        .bind(note)
        .execute(&mut **tx)
        .await?;
    Ok(())
}
