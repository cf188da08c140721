//! The floors the front door is measured against: the bare work of one
//! payment, and of one replay that asks the key store, made through the
//! same clients serve uses and with none of keyfence's logic.
//!
//! A floor iteration makes the store calls a payment must make, with the
//! same bytes: a claim carrying the canonical request, three PostgreSQL
//! transactions writing the payment's business records (the payment and its
//! first entry, the move to clearing, then the settling entry, the status and
//! the event its webhooks are made from), one call to each rail between
//! them, and a finish storing the 201 answer. Each transaction is `BEGIN`,
//! one statement and `COMMIT`. It writes nothing keyfence keeps to resume
//! and fence a payment: no request row or recovery point, no phase records,
//! no external-call records, no region fence, no ledger copy of the answer;
//! and its events are never fanned out to webhook endpoints, which serve's
//! webhook worker does for every payment's. Its rows go to a ledger of its
//! own, migrated like serve's (the same tables, indexes and balance check),
//! so no worker of serve's sees them.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::Context;
use sqlx::Postgres;
use sqlx::postgres::PgArguments;
use sqlx::query::Query;
use uuid::Uuid;

use keyfence::config::RailSettings;
use keyfence::domain::{
    ClientId, IdempotencyKey, Millis, Owner, PaymentRequest, RequestHash, ScopedKey, StoredResponse,
};
use keyfence::keystore::KeyStoreSettings;
use keyfence::keystore::{self, Claim, DynamoKeyStore, Finish, KeyStore, KeyStoreError, Lease};
use keyfence::ledger::LedgerSettings;
use keyfence::ledger::payments::Payment;
use keyfence::ledger::{self, Ledger};
use keyfence::rail::{CallOutcome, Instruction, RailClient, Verdict};
use keyfence::webhooks;

/// What the floors talk to directly.
pub struct Floor {
    pub keys: DynamoKeyStore,
    /// The floor's own ledger.
    pub ledger: Ledger,
    pub e1: RailClient,
    pub e2: RailClient,
}

/// Where a floor's clients connect: the stack's key store and rails, and
/// the floor's own ledger ([`fresh_ledger`]).
#[derive(Clone)]
pub struct Stores {
    pub keys: KeyStoreSettings,
    pub ledger: LedgerSettings,
    pub rails: RailSettings,
}

impl Floor {
    /// Clients of their own, as serve makes them at start-up.
    pub async fn connect(stores: &Stores) -> anyhow::Result<Self> {
        let rails = &stores.rails;
        let keys = keystore::connect(&stores.keys).await.context("connecting the floor's key store")?;
        Ok(Self {
            keys: DynamoKeyStore::new(keys, stores.keys.table.clone()),
            ledger: Ledger::connect(&stores.ledger).await.context("connecting the floor's ledger")?,
            e1: RailClient::new("screening", &rails.e1_url, rails.rail_timeout, rails.rail_attempts, None),
            e2: RailClient::new("payment", &rails.e2_url, rails.rail_timeout, rails.rail_attempts, None),
        })
    }
}

/// The floor's own ledger beside serve's (`settings`' database, `_floor`
/// appended), made afresh.
pub async fn fresh_ledger(settings: &LedgerSettings) -> anyhow::Result<(Ledger, LedgerSettings)> {
    let name = floor_database(settings.database_url.database())?;
    let settings = LedgerSettings { database_url: settings.database_url.with_database(&name), ..settings.clone() };
    ledger::drop_database(&settings).await?;
    match Ledger::migrate(&settings).await {
        Ok((ledger, _)) => Ok((ledger, settings)),
        Err(e) => {
            let _ = ledger::drop_database(&settings).await;
            Err(e.into())
        }
    }
}

/// The longest name PostgreSQL keeps whole (`NAMEDATALEN` - 1): a longer
/// one is cut to this many bytes without a word.
const LONGEST_NAME: usize = 63;

/// The floor's database name for a ledger named `ledger`, refused when
/// PostgreSQL would cut it short, since a cut name could be the ledger's
/// own, which the floor drops and makes afresh.
fn floor_database(ledger: &str) -> anyhow::Result<String> {
    let name = format!("{ledger}_floor");
    anyhow::ensure!(
        name.len() <= LONGEST_NAME,
        "the ledger's database name is too long to name the floor's beside it ({name:?} is over {LONGEST_NAME} bytes)"
    );
    Ok(name)
}

/// The request a floor iteration stands for: the front door's `i`th.
pub fn payment(i: usize) -> serde_json::Value {
    serde_json::json!({
        "amount_minor": 100 + i as i64,
        "currency": "EUR",
        "debtor_account": "DE89370400440532013000",
        "creditor_account": "FR1420041010050500013M02606",
        "end_to_end_id": format!("BENCH-{i}"),
    })
}

/// The claim of the floor's `i`th key, carrying its request as a
/// payment's claim does.
fn claim(client: ClientId, i: usize) -> Result<(Claim, PaymentRequest), String> {
    // As long as the front door's keys, which carry their run's id too.
    let key = format!("floor-{}-{i}", client.as_uuid().simple());
    let key = ScopedKey::new(client, IdempotencyKey::parse(&key).map_err(failed)?);
    let value = payment(i);
    let canonical = serde_jcs::to_vec(&value).map_err(failed)?;
    let request_hash = RequestHash::of("POST", "/v1/payments", &canonical);
    let request = PaymentRequest::parse(value).map_err(|e| format!("{e:?}"))?;
    let now = Millis::now();
    let claim = Claim {
        key,
        request_hash,
        request: serde_jcs::to_vec(&request).map_err(failed)?,
        operation: "payment".into(),
        payment_id: Uuid::now_v7(),
        owner: Owner::attempt_of("bench"),
        home_region: "bench".into(),
        lease: Lease { now, length: Duration::from_secs(10) },
        gone_before: now,
    };
    Ok((claim, request))
}

/// The irreducible work of one payment, with none of keyfence's logic;
/// the answer it stored.
pub async fn payment_loop(floor: &Floor, client: ClientId, i: usize) -> Result<StoredResponse, String> {
    let (claim, request) = claim(client, i)?;
    let item = floor.keys.claim(&claim).await.map_err(failed)?;
    let (id, created_at) = (claim.payment_id, ledger::timestamp(claim.lease.now));
    let amount = request.amount_minor;
    let debtor = format!("debtor:{}", request.debtor_account);
    let hold = format!("hold:{}", request.debtor_account);
    let creditor = format!("creditor:{}", request.creditor_account);
    let entry = |from: &str, to: &str| (vec![from.to_owned(), to.to_owned()], vec![-amount, amount]);

    let (accounts, amounts) = entry(&debtor, &hold);
    transaction(
        floor,
        sqlx::query(
            "WITH payment AS (
                INSERT INTO payments (id, client_id, idem_key, request_created_at, amount_minor, currency,
                                      debtor_account, creditor_account, end_to_end_id, status, fence, created_at)
                VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, 'pending', 1, $4) RETURNING id)
             INSERT INTO postings (payment_id, entry, account, amount_minor, currency, fence)
             SELECT payment.id, 'hold', account, amount, $6, 1
               FROM payment, unnest($10::text[], $11::bigint[]) AS leg(account, amount)",
        )
        .bind(id)
        .bind(client.as_uuid())
        .bind(claim.key.key.as_str())
        .bind(created_at)
        .bind(amount)
        .bind(&request.currency)
        .bind(&request.debtor_account)
        .bind(&request.creditor_account)
        .bind(&request.end_to_end_id)
        .bind(accounts)
        .bind(amounts),
    )
    .await?;

    let instruction = Instruction {
        originator: client.to_string(),
        end_to_end_id: request.end_to_end_id.clone(),
        amount_minor: amount,
        currency: request.currency.clone(),
        debtor_account: request.debtor_account.clone(),
        creditor_account: request.creditor_account.clone(),
    };
    send(&floor.e1, &instruction).await?;
    let (accounts, amounts) = entry(&hold, "clearing:rail");
    transaction(
        floor,
        sqlx::query(
            "INSERT INTO postings (payment_id, entry, account, amount_minor, currency, fence)
             SELECT $1, 'clear', account, amount, $2, 1 FROM unnest($3::text[], $4::bigint[]) AS leg(account, amount)",
        )
        .bind(id)
        .bind(&request.currency)
        .bind(accounts)
        .bind(amounts),
    )
    .await?;

    let reference = send(&floor.e2, &instruction).await?;
    let payment = Payment {
        id,
        status: "succeeded".into(),
        amount_minor: amount,
        currency: request.currency.clone(),
        debtor_account: request.debtor_account.clone(),
        creditor_account: request.creditor_account.clone(),
        end_to_end_id: request.end_to_end_id.clone(),
        remittance_info: None,
        rail_reference: Some(reference.clone()),
        reason: None,
        created_at,
    };
    let body = serde_json::to_vec(&payment).map_err(failed)?;
    let mut event = serde_json::to_value(&payment).map_err(failed)?;
    event["debtor_account"] = webhooks::masked(&payment.debtor_account).into();
    event["creditor_account"] = webhooks::masked(&payment.creditor_account).into();
    let (accounts, amounts) = entry("clearing:rail", &creditor);
    transaction(
        floor,
        sqlx::query(
            "WITH settled AS (
                UPDATE payments SET status = 'succeeded', rail_reference = $2, updated_at = now()
                 WHERE id = $1 RETURNING id),
             posted AS (
                INSERT INTO postings (payment_id, entry, account, amount_minor, currency, fence)
                SELECT settled.id, 'settle', account, amount, $3, 1
                  FROM settled, unnest($4::text[], $5::bigint[]) AS leg(account, amount))
             INSERT INTO outbox (event_id, client_id, payment_id, event, payload)
             VALUES ($6, $7, $1, 'payment.succeeded', $8)
             ON CONFLICT (payment_id, event) DO NOTHING",
        )
        .bind(id)
        .bind(&reference)
        .bind(&request.currency)
        .bind(accounts)
        .bind(amounts)
        .bind(webhooks::event_id(id, "payment.succeeded"))
        .bind(client.as_uuid())
        .bind(event),
    )
    .await?;

    let response = StoredResponse {
        status: 201,
        headers: BTreeMap::from([
            ("content-type".to_owned(), "application/json".to_owned()),
            ("location".to_owned(), format!("/v1/payments/{id}")),
        ]),
        body,
    };
    let finish = Finish { response, expires_at: claim.lease.now.plus(Duration::from_secs(3600)) };
    floor.keys.finish(&claim.key, &item.holder(), &finish).await.map_err(failed)?;
    Ok(finish.response)
}

/// One key-store round trip of the kind a replay makes: a claim of a key
/// that exists (the payment floor made it), answered with the item; the
/// answer the item holds.
pub async fn replay_loop(floor: &Floor, client: ClientId, i: usize) -> Result<StoredResponse, String> {
    let (claim, _) = claim(client, i)?;
    match floor.keys.claim(&claim).await {
        Err(KeyStoreError::Taken(Some(item))) => item.response.ok_or_else(|| "the key was not finished".into()),
        Ok(_) => Err("the key did not exist".into()),
        Err(e) => Err(e.to_string()),
    }
}

/// `BEGIN`, the one statement `write` is, `COMMIT`.
async fn transaction(floor: &Floor, write: Query<'_, Postgres, PgArguments>) -> Result<(), String> {
    let mut tx = floor.ledger.pool().begin().await.map_err(failed)?;
    write.execute(&mut *tx).await.map_err(failed)?;
    tx.commit().await.map_err(failed)
}

fn failed(e: impl std::fmt::Display) -> String {
    e.to_string()
}

/// Sends the instruction to a rail under a fresh key; the rail's reference.
async fn send(rail: &RailClient, instruction: &Instruction) -> Result<String, String> {
    match rail.send(&Uuid::new_v4().simple().to_string(), instruction).await {
        CallOutcome::Settled(Verdict::Applied(applied)) => Ok(applied.reference),
        CallOutcome::Settled(Verdict::Declined(declined)) => Err(format!("declined: {}", declined.reason)),
        CallOutcome::NotApplied(why) | CallOutcome::Unknown(why) => Err(why),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_floor_database_name_postgresql_would_cut_short_is_refused() {
        assert_eq!(floor_database("keyfence").unwrap(), "keyfence_floor");
        let longest = "k".repeat(LONGEST_NAME - "_floor".len());
        assert_eq!(floor_database(&longest).unwrap().len(), LONGEST_NAME);
        // Cut to 63 bytes, this one's floor would be the ledger itself.
        assert!(floor_database(&"k".repeat(LONGEST_NAME)).is_err());
        assert!(floor_database(&format!("{longest}k")).is_err());
    }
}
