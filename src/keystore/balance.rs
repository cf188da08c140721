//! Balances: an amount that requests draw on with holds, kept in one
//! control item of the key table, so every region draws on the same one
//! (a payment's refundable amount, say: no two regions' refunds can
//! together exceed it). A hold is taken with one conditional write,
//! conditioned on what is left and on the hold not existing yet, so a
//! retried hold is recognised rather than doubled; it is settled (kept for
//! good) or released (given back) once, and stays in the item as the
//! record of which it was, so neither happens twice.
//!
//! A balance can be frozen (a return of the payment was received): from
//! then on no hold but a lasting one is taken on it, whatever it has left,
//! so a refund declined later does not make the payment refundable again.
//!
//! Item: `pk = control#balance#{name}`; `total` (what the balance allows
//! in all, fixed by the first hold), `reserved` (held and settled),
//! `settled`; `frozen` (what froze it, and when), once frozen; and one
//! attribute per hold, `hold#{request id}`, a map of its amount, state and
//! the request that took it.

use std::collections::HashMap;

use aws_sdk_dynamodb::Client;
use aws_sdk_dynamodb::types::AttributeValue;
use uuid::Uuid;

use super::failure::{Failure, classify, store_error};
use super::item::{CONTROL_PREFIX, attr, malformed, n, s};
use super::{KeyStoreError, StoreFailure};
use crate::domain::{ClientId, IdempotencyKey, Millis, ScopedKey};

type Attrs = HashMap<String, AttributeValue>;

/// A hold a request takes on a balance.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Hold {
    /// Which balance (one per thing it limits, e.g. `refundable#payment#{id}`).
    pub balance: String,
    /// What the balance allows in all: fixed when it is first drawn on.
    pub total: i64,
    pub amount: i64,
    /// Taken for good and never concluded (a return: the rail took the
    /// money back). Such a hold is not judged an orphan once its request's
    /// key and ledger rows are gone, however long ago.
    pub lasting: bool,
}

/// The request taking a hold: its id, its key and the key's `created_at`
/// (which request under the key), and the region working it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HeldBy {
    pub id: Uuid,
    pub key: ScopedKey,
    pub created_at: Millis,
    pub region: String,
}

/// What taking a hold came to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Holding {
    /// Held now, or by an earlier attempt of the same request.
    Held,
    /// Not held: the balance has only `left` to give.
    Exceeded { left: i64 },
}

/// How a hold ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Conclusion {
    /// Kept for good: the request did what it held the amount for.
    Settle,
    /// Given back: the request did not.
    Release,
    /// Given back after it was settled: what the request did was undone
    /// (a refund the rail returned: the money never reached the debtor).
    Undo,
}

/// What concluding a hold came to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Concluded {
    /// Concluded by this call.
    Now,
    /// Concluded so before (an earlier attempt, a retried write).
    Already,
    /// The balance holds no such hold.
    Missing,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HoldState {
    Held,
    Settled,
    Released,
    /// Settled, then undone ([`Conclusion::Undo`]): final, and unlike a
    /// released hold never settled again.
    Undone,
}

impl HoldState {
    pub fn as_str(self) -> &'static str {
        match self {
            HoldState::Held => "held",
            HoldState::Settled => "settled",
            HoldState::Released => "released",
            HoldState::Undone => "undone",
        }
    }

    fn parse(stored: &str) -> Result<Self, KeyStoreError> {
        match stored {
            "held" => Ok(HoldState::Held),
            "settled" => Ok(HoldState::Settled),
            "released" => Ok(HoldState::Released),
            "undone" => Ok(HoldState::Undone),
            other => Err(malformed("hold state", other)),
        }
    }
}

/// One hold as the balance records it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HoldEntry {
    pub by: HeldBy,
    pub amount: i64,
    pub state: HoldState,
    /// When it was taken.
    pub at: Millis,
    /// See [`Hold::lasting`].
    pub lasting: bool,
}

/// What froze a balance, and when.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Frozen {
    /// The message that froze it (a return: its rail and message id).
    pub by: String,
    pub at: Millis,
}

/// A balance as it stands.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Balance {
    pub total: i64,
    /// Held and settled together: what is no longer left.
    pub reserved: i64,
    pub settled: i64,
    pub holds: Vec<HoldEntry>,
    /// Set once, for good: then only lasting holds are taken.
    pub frozen: Option<Frozen>,
}

impl Balance {
    /// What a new hold may still take: nothing once frozen.
    pub fn left(&self) -> i64 {
        if self.frozen.is_some() { 0 } else { self.room() }
    }

    /// What is not reserved, frozen or not: what a lasting hold may take.
    fn room(&self) -> i64 {
        self.total - self.reserved
    }

    /// What `hold` may take: a lasting hold is not stopped by a freeze.
    pub fn room_for(&self, hold: &Hold) -> i64 {
        if hold.lasting { self.room() } else { self.left() }
    }

    pub fn hold(&self, id: Uuid) -> Option<&HoldEntry> {
        self.holds.iter().find(|h| h.by.id == id)
    }
}

pub(super) fn partition_key(balance: &str) -> String {
    format!("{CONTROL_PREFIX}balance#{balance}")
}

/// The balance a partition key names, if it names one.
pub(super) fn name_of(pk: &str) -> Option<&str> {
    pk.strip_prefix(CONTROL_PREFIX)?.strip_prefix("balance#")
}

/// Present (and true) on a lasting hold's entry only.
const LASTING: &str = "lasting";

/// Present on a frozen balance only.
const FROZEN: &str = "frozen";

fn hold_attr(id: Uuid) -> String {
    format!("hold#{id}")
}

/// Takes `hold` for `by` at `now`. A failed condition is read back
/// (consistently) to tell a hold already taken (in whatever state: a
/// request holds once) from a balance too small.
pub(super) async fn take(
    client: &Client,
    table: &str,
    hold: &Hold,
    by: &HeldBy,
    now: Millis,
) -> Result<Holding, KeyStoreError> {
    if hold.amount <= 0 || hold.amount > hold.total {
        return Ok(Holding::Exceeded { left: hold.total });
    }
    let mut entry = HashMap::from([
        ("amount".to_owned(), n(hold.amount.unsigned_abs())),
        ("state".to_owned(), s(HoldState::Held.as_str())),
        (attr::CLIENT_ID.to_owned(), s(by.key.client.to_string())),
        (attr::KEY.to_owned(), s(by.key.key.as_str())),
        (attr::CREATED_AT.to_owned(), n(by.created_at.get())),
        ("region".to_owned(), s(by.region.as_str())),
        ("at".to_owned(), n(now.get())),
    ]);
    if hold.lasting {
        entry.insert(LASTING.to_owned(), AttributeValue::Bool(true));
    }
    let entry = AttributeValue::M(entry);
    let mut condition = "attribute_not_exists(#hold) AND (attribute_not_exists(#total) OR #total = :total) \
                         AND (attribute_not_exists(#reserved) OR #reserved <= :limit)"
        .to_owned();
    let mut names = HashMap::from([
        ("#total".to_owned(), "total".to_owned()),
        ("#settled".to_owned(), "settled".to_owned()),
        ("#reserved".to_owned(), "reserved".to_owned()),
        ("#hold".to_owned(), hold_attr(by.id)),
    ]);
    if !hold.lasting {
        condition.push_str(" AND attribute_not_exists(#frozen)");
        names.insert("#frozen".to_owned(), FROZEN.to_owned());
    }
    // A balance whose holds came and went can be taken from again; a
    // retried hold finds its own entry and is recognised below.
    for _ in 0..3 {
        let sent = client
            .update_item()
            .table_name(table)
            .key(attr::PK, s(partition_key(&hold.balance)))
            .update_expression(
                "SET #total = if_not_exists(#total, :total), #settled = if_not_exists(#settled, :zero), \
                 #reserved = if_not_exists(#reserved, :zero) + :n, #hold = :entry",
            )
            .condition_expression(condition.as_str())
            .set_expression_attribute_names(Some(names.clone()))
            .expression_attribute_values(":total", n(hold.total.unsigned_abs()))
            .expression_attribute_values(":zero", n(0))
            .expression_attribute_values(":n", n(hold.amount.unsigned_abs()))
            .expression_attribute_values(":limit", n((hold.total - hold.amount).unsigned_abs()))
            .expression_attribute_values(":entry", entry.clone())
            .send()
            .await;
        match sent.map_err(classify) {
            Ok(_) => return Ok(Holding::Held),
            Err(Failure::Condition(_)) => {}
            Err(Failure::Store(e)) => return Err(e),
        }
        let balance = read(client, table, &hold.balance).await?.unwrap_or_default();
        if balance.total != 0 && balance.total != hold.total {
            return Err(KeyStoreError::Fault(StoreFailure::said(format!(
                "balance {} allows {}, not {}",
                hold.balance, balance.total, hold.total
            ))));
        }
        match balance.hold(by.id) {
            // Taken before (and perhaps concluded since, where its request
            // finished before this attempt resumed it): a request holds once.
            Some(_) => return Ok(Holding::Held),
            // Given back since the refusal: try again (unless a freeze refused it).
            None if balance.room_for(hold) >= hold.amount => continue,
            None => return Ok(Holding::Exceeded { left: balance.left() }),
        }
    }
    // Refused three times, yet there was room each time: others' holds
    // came and went meanwhile. Not a verdict on the amount: try again later.
    Err(KeyStoreError::Unavailable(StoreFailure::said(format!("balance {} is contended", hold.balance))))
}

/// Freezes `balance` (allowing `total`) for good, by `frozen`: made so if
/// never drawn on; freezing again keeps what froze it first.
pub(super) async fn freeze(
    client: &Client,
    table: &str,
    balance: &str,
    total: i64,
    frozen: &Frozen,
) -> Result<(), KeyStoreError> {
    let entry = AttributeValue::M(HashMap::from([
        ("by".to_owned(), s(frozen.by.as_str())),
        ("at".to_owned(), n(frozen.at.get())),
    ]));
    let sent = client
        .update_item()
        .table_name(table)
        .key(attr::PK, s(partition_key(balance)))
        .update_expression(
            "SET #total = if_not_exists(#total, :total), #settled = if_not_exists(#settled, :zero), \
             #reserved = if_not_exists(#reserved, :zero), #frozen = if_not_exists(#frozen, :frozen)",
        )
        .condition_expression("attribute_not_exists(#total) OR #total = :total")
        .expression_attribute_names("#total", "total")
        .expression_attribute_names("#settled", "settled")
        .expression_attribute_names("#reserved", "reserved")
        .expression_attribute_names("#frozen", FROZEN)
        .expression_attribute_values(":total", n(total.unsigned_abs()))
        .expression_attribute_values(":zero", n(0))
        .expression_attribute_values(":frozen", entry)
        .send()
        .await;
    match sent.map_err(classify) {
        Ok(_) => Ok(()),
        Err(Failure::Condition(_)) => Err(KeyStoreError::Fault(StoreFailure::said(format!(
            "balance {balance} allows another total than {total}"
        )))),
        Err(Failure::Store(e)) => Err(e),
    }
}

/// Concludes the hold of request `id` on `balance`, once.
pub(super) async fn conclude(
    client: &Client,
    table: &str,
    balance: &str,
    id: Uuid,
    how: Conclusion,
) -> Result<Concluded, KeyStoreError> {
    let (update, from, to) = match how {
        Conclusion::Settle => ("#settled = #settled + #hold.#amount", HoldState::Held, HoldState::Settled),
        Conclusion::Release => ("#reserved = #reserved - #hold.#amount", HoldState::Held, HoldState::Released),
        Conclusion::Undo => (
            "#settled = #settled - #hold.#amount, #reserved = #reserved - #hold.#amount",
            HoldState::Settled,
            HoldState::Undone,
        ),
    };
    let mut names = HashMap::from([
        ("#hold".to_owned(), hold_attr(id)),
        ("#state".to_owned(), "state".to_owned()),
        ("#amount".to_owned(), "amount".to_owned()),
    ]);
    for sum in ["settled", "reserved"].into_iter().filter(|sum| update.contains(&format!("#{sum}"))) {
        names.insert(format!("#{sum}"), sum.to_owned());
    }
    let sent = client
        .update_item()
        .table_name(table)
        .key(attr::PK, s(partition_key(balance)))
        .update_expression(format!("SET #hold.#state = :to, {update}"))
        .condition_expression("#hold.#state = :from")
        .set_expression_attribute_names(Some(names))
        .expression_attribute_values(":to", s(to.as_str()))
        .expression_attribute_values(":from", s(from.as_str()))
        .send()
        .await;
    match sent.map_err(classify) {
        Ok(_) => Ok(Concluded::Now),
        Err(Failure::Condition(_)) => {
            let now = read(client, table, balance).await?.unwrap_or_default();
            match now.hold(id).map(|h| (h.state, h.amount)) {
                None => Ok(Concluded::Missing),
                Some((state, _)) if state == to => Ok(Concluded::Already),
                Some((HoldState::Released, amount)) if how == Conclusion::Settle => {
                    settle_released(client, table, balance, id, now.total - amount).await
                }
                Some((state, _)) => Err(KeyStoreError::Fault(StoreFailure::said(format!(
                    "the hold of {id} on {balance} is {}, so it cannot be {}",
                    state.as_str(),
                    to.as_str()
                )))),
            }
        }
        Err(Failure::Store(e)) => Err(e),
    }
}

/// Settles a hold released before (its request ended one way in one
/// ledger and the other way in another: a rail that declined, then applied
/// the same instruction): taken back first, if there is still room for it
/// (`reserved` at most `limit`). Without room the balance would be
/// overspent, which is refused: a person settles it.
async fn settle_released(
    client: &Client,
    table: &str,
    balance: &str,
    id: Uuid,
    limit: i64,
) -> Result<Concluded, KeyStoreError> {
    let sent = client
        .update_item()
        .table_name(table)
        .key(attr::PK, s(partition_key(balance)))
        .update_expression(
            "SET #hold.#state = :settled, #reserved = #reserved + #hold.#amount, #settled = #settled + #hold.#amount",
        )
        .condition_expression("#hold.#state = :released AND #reserved <= :limit")
        .expression_attribute_names("#hold", hold_attr(id))
        .expression_attribute_names("#state", "state")
        .expression_attribute_names("#amount", "amount")
        .expression_attribute_names("#reserved", "reserved")
        .expression_attribute_names("#settled", "settled")
        .expression_attribute_values(":settled", s(HoldState::Settled.as_str()))
        .expression_attribute_values(":released", s(HoldState::Released.as_str()))
        .expression_attribute_values(":limit", n(limit.max(0).unsigned_abs()))
        .send()
        .await;
    match sent.map_err(classify) {
        Ok(_) => Ok(Concluded::Now),
        Err(Failure::Condition(_)) => {
            match read(client, table, balance).await?.and_then(|b| b.hold(id).map(|h| h.state)) {
                Some(HoldState::Settled) => Ok(Concluded::Already),
                _ => Err(KeyStoreError::Fault(StoreFailure::said(format!(
                    "the hold of {id} on {balance} was released, and settling it now would overspend the balance"
                )))),
            }
        }
        Err(Failure::Store(e)) => Err(e),
    }
}

/// The balance as it stands (a consistent read); `None` if nothing was ever held on it.
pub(super) async fn read(client: &Client, table: &str, balance: &str) -> Result<Option<Balance>, KeyStoreError> {
    let out = client
        .get_item()
        .table_name(table)
        .key(attr::PK, s(partition_key(balance)))
        .consistent_read(true)
        .send()
        .await
        .map_err(store_error)?;
    out.item().map(decode).transpose()
}

pub(super) fn decode(attrs: &Attrs) -> Result<Balance, KeyStoreError> {
    let number = |attrs: &Attrs, name: &str| -> Result<i64, KeyStoreError> {
        match attrs.get(name) {
            Some(AttributeValue::N(v)) => v.parse().map_err(|e| malformed(name, e)),
            None => Ok(0),
            Some(_) => Err(malformed(name, "not a number")),
        }
    };
    let text = |attrs: &'_ Attrs, name: &str| -> Result<String, KeyStoreError> {
        attrs.get(name).and_then(|v| v.as_s().ok()).cloned().ok_or_else(|| malformed(name, "missing"))
    };
    let mut holds = Vec::new();
    for (name, value) in attrs {
        let Some(id) = name.strip_prefix("hold#") else { continue };
        let id: Uuid = id.parse().map_err(|e| malformed(name, e))?;
        let entry = value.as_m().map_err(|_| malformed(name, "not a map"))?;
        let client: ClientId = text(entry, attr::CLIENT_ID)?.parse().map_err(|e| malformed(attr::CLIENT_ID, e))?;
        let key = IdempotencyKey::parse(&text(entry, attr::KEY)?).map_err(|e| malformed(attr::KEY, e))?;
        holds.push(HoldEntry {
            by: HeldBy {
                id,
                key: ScopedKey::new(client, key),
                created_at: Millis::new(number(entry, attr::CREATED_AT)?.unsigned_abs()),
                region: text(entry, "region")?,
            },
            amount: number(entry, "amount")?,
            state: HoldState::parse(&text(entry, "state")?)?,
            at: Millis::new(number(entry, "at")?.unsigned_abs()),
            lasting: matches!(entry.get(LASTING), Some(AttributeValue::Bool(true))),
        });
    }
    holds.sort_by_key(|h| (h.at, h.by.id));
    let frozen = match attrs.get(FROZEN) {
        None => None,
        Some(value) => {
            let entry = value.as_m().map_err(|_| malformed(FROZEN, "not a map"))?;
            Some(Frozen { by: text(entry, "by")?, at: Millis::new(number(entry, "at")?.unsigned_abs()) })
        }
    };
    Ok(Balance {
        total: number(attrs, "total")?,
        reserved: number(attrs, "reserved")?,
        settled: number(attrs, "settled")?,
        holds,
        frozen,
    })
}
