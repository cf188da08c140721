//! A third operation, written outside the crate: a payout to a beneficiary,
//! worked by keyfence's engine against the real stores (DynamoDB through
//! the key table, PostgreSQL through the ledger, a rail over HTTP). The
//! payout keeps a table of its own beside the ledger's and calls a rail it
//! names itself; the engine supplies what every such operation needs: the
//! claim and its fence, phases that commit with the recovery point, the
//! derived key at the rail, and the answer every retry gets.
//!
//! With the local services up (`scripts/services`, and the environment
//! `scripts/test` sets: `AWS_ENDPOINT_URL`, `DATABASE_URL`):
//!
//! ```sh
//! cargo run --example payout
//! ```
//!
//! It makes a key table (for the run) and a database of its own, submits
//! one payout under one key from two engines at once and from a third
//! later, and checks that exactly one worked it, the rail saw one
//! instruction, one payout row was paid, and every caller got the same bytes.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::{Context, ensure};
use keyfence::domain::{
    ClientId, IdempotencyKey, ProbeBackoff, RecoveryPoint, RequestHash, Retention, ScopedKey, StoredResponse,
};
use keyfence::engine::{
    Answer, Engine, EngineError, EngineSettings, ExternalStep, Operation, Rails, Step, StepContext,
};
use keyfence::keystore::KeyStoreSettings;
use keyfence::keystore::{self, DynamoKeyStore};
use keyfence::ledger::Ledger;
use keyfence::ledger::LedgerSettings;
use keyfence::rail::{Applied, Declined, Instruction, RailClient, sim};
use keyfence::regions::{RegionStore, RegionView};
use serde::{Deserialize, Serialize};

/// The rail payouts go out on, by the name this operation gives it.
const PAYOUT_RAIL: &str = "payouts";

const RECORDED: RecoveryPoint = RecoveryPoint::named("PAYOUT_RECORDED");

static STEPS: [Step; 3] = [
    Step::Local(RECORDED),
    Step::External(ExternalStep {
        name: "payout",
        rail: PAYOUT_RAIL,
        sent: RecoveryPoint::named("PAYOUT_SENT"),
        done: RecoveryPoint::named("PAYOUT_DONE"),
    }),
    Step::Local(RecoveryPoint::FINISHED),
];

/// What a caller asks for.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct Payout {
    beneficiary: String,
    amount_minor: i64,
    currency: String,
    reference: String,
}

impl Operation for Payout {
    fn name(&self) -> &'static str {
        "payout"
    }

    fn steps(&self) -> &'static [Step] {
        &STEPS
    }

    async fn local(
        &self,
        point: &RecoveryPoint,
        cx: &mut StepContext<'_>,
    ) -> Result<Option<StoredResponse>, EngineError> {
        let id = cx.request.payment_id;
        if *point == RECORDED {
            // A write nothing in the phase reads is held, and goes with the
            // phase's next statement or its commit.
            cx.writes().push(
                "INSERT INTO example_payouts (id, beneficiary, amount_minor, currency, status)
                 VALUES ($1, $2, $3, $4, 'recorded')",
                |b| {
                    b.bind(id).bind(&self.beneficiary).bind(self.amount_minor).bind(&self.currency);
                },
            );
            return Ok(None);
        }
        let applied = cx.applied("payout").await?;
        cx.writes().push("UPDATE example_payouts SET status = 'paid' WHERE id = $1", |b| {
            b.bind(id);
        });
        let body = serde_json::json!({ "id": id, "status": "paid", "rail_reference": applied.reference });
        Ok(Some(answer(201, &body)))
    }

    async fn declined(
        &self,
        _step: &ExternalStep,
        declined: &Declined,
        cx: &mut StepContext<'_>,
    ) -> Result<StoredResponse, EngineError> {
        // A statement whose result the step reads goes through `cx.conn()`.
        let id = cx.request.payment_id;
        sqlx::query("UPDATE example_payouts SET status = 'declined' WHERE id = $1")
            .bind(id)
            .execute(cx.conn().await?)
            .await
            .map_err(|e| EngineError::Fault(e.to_string()))?;
        Ok(answer(402, &serde_json::json!({ "id": id, "reason": declined.reason_code })))
    }

    async fn indeterminate(&self, _step: &ExternalStep, _cx: &mut StepContext<'_>) -> Result<(), EngineError> {
        Ok(())
    }

    fn instruction(&self, _step: &ExternalStep) -> Instruction {
        Instruction {
            originator: String::new(),
            end_to_end_id: self.reference.clone(),
            amount_minor: self.amount_minor,
            currency: self.currency.clone(),
            debtor_account: "payouts:float".into(),
            creditor_account: self.beneficiary.clone(),
        }
    }
}

fn answer(status: u16, body: &serde_json::Value) -> StoredResponse {
    let headers = BTreeMap::from([("content-type".to_owned(), "application/json".to_owned())]);
    StoredResponse { status, headers, body: body.to_string().into_bytes() }
}

/// An engine of this example's own over the given stores.
fn engine(keys: &DynamoKeyStore, ledger: &Ledger, rail: &str, instance: &str) -> Engine<DynamoKeyStore> {
    let regions = RegionView::new(
        RegionStore::new(keys.client().clone(), keys.table()),
        Duration::from_secs(1),
        Default::default(),
    );
    let settings = EngineSettings {
        region: "example-1".into(),
        instance: instance.into(),
        lease: Duration::from_secs(10),
        retention: Retention { keep: Duration::from_secs(3600), grace: Duration::from_secs(600) },
        max_unknown_attempts: 5,
        probe_backoff: ProbeBackoff { first: Duration::from_millis(100), max: Duration::from_secs(1) },
        answer_limit: keyfence::domain::ANSWER_LIMIT as usize,
        clock: Default::default(),
    };
    let rails = Rails::new([RailClient::new(PAYOUT_RAIL, rail, Duration::from_secs(2), 3, None)]);
    Engine::new(keys.clone(), ledger.clone(), rails, regions, settings)
}

#[tokio::main]
pub async fn main() -> anyhow::Result<()> {
    // The stores: a key table and a database of this run's own, both
    // removed at the end.
    let mut key_settings = KeyStoreSettings::from_env()?;
    key_settings.table = format!("keyfence-example-payout-{}", uuid::Uuid::new_v4().simple());
    let client = keystore::connect(&key_settings).await.context("reaching DynamoDB (AWS_ENDPOINT_URL)")?;
    keystore::ensure_table(&client, &key_settings.table).await?;
    let keys = DynamoKeyStore::new(client.clone(), key_settings.table.clone());
    let mut ledger_settings = LedgerSettings::from_env()?;
    let database = format!("keyfence_example_payout_{}", uuid::Uuid::new_v4().simple());
    ledger_settings.database_url = ledger_settings.database_url.with_database(&database);
    let checked = run(&keys, &ledger_settings).await;
    // Both stores go whatever happened, and the run's own failure is told first.
    let table_deleted = client.delete_table().table_name(&key_settings.table).send().await;
    let database_dropped = keyfence::ledger::drop_database(&ledger_settings).await;
    checked?;
    table_deleted?;
    database_dropped?;
    Ok(())
}

/// Migrates the run's database and pays the payout out over it.
async fn run(keys: &DynamoKeyStore, settings: &LedgerSettings) -> anyhow::Result<()> {
    let (ledger, _) = Ledger::migrate(settings).await.context("reaching PostgreSQL (DATABASE_URL)")?;
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS example_payouts (
            id uuid PRIMARY KEY, beneficiary text NOT NULL, amount_minor bigint NOT NULL,
            currency char(3) NOT NULL, status text NOT NULL)",
    )
    .execute(ledger.pool())
    .await?;
    let checked = pay_out_once(keys, &ledger).await;
    ledger.pool().close().await;
    checked
}

/// Pays one payout out for two callers at once and a later retry, and
/// checks what must hold.
async fn pay_out_once(keys: &DynamoKeyStore, ledger: &Ledger) -> anyhow::Result<()> {
    // The rail: the simulator, on a port of its own.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let rail = format!("http://{}", listener.local_addr()?);
    let simulator = sim::Simulator::new("payouts", None);
    tokio::spawn(sim::serve(listener, simulator, std::future::pending()));

    // One payout, asked for by two callers at once under one key, then by
    // a third that has seen nothing.
    let (first, second) = (engine(keys, ledger, &rail, "a"), engine(keys, ledger, &rail, "b"));
    let payout = Payout {
        beneficiary: "FR1420041010050500013M02606".into(),
        amount_minor: 5000,
        currency: "EUR".into(),
        reference: format!("PAYOUT-{}", uuid::Uuid::new_v4().simple()),
    };
    let canonical = serde_json::to_vec(&payout)?;
    let key = ScopedKey::new(ClientId::generate(), IdempotencyKey::parse("payout-1")?);
    let submission = || keyfence::engine::Submission {
        key: key.clone(),
        request_hash: RequestHash::of("POST", "/payouts", &canonical),
        canonical: canonical.clone(),
        operation: payout.clone(),
    };
    let (a, b) = tokio::join!(first.submit(submission()), second.submit(submission()));
    let (a, b) = (a?, b?);
    let worked: Vec<&StoredResponse> = [&a, &b]
        .into_iter()
        .filter_map(|answer| match answer {
            Answer::Final { response, replayed: false } => Some(response),
            _ => None,
        })
        .collect();
    ensure!(worked.len() == 1, "exactly one of two callers at once works the payout: {a:?} / {b:?}");
    // A caller told the payout is in flight retries, as a client would,
    // until its answer is final: the same bytes as the one that worked it.
    for (answer, engine) in [(a.clone(), &first), (b.clone(), &second)] {
        let mut answer = answer;
        for _ in 0..100 {
            let Answer::InFlight { retry_after } = answer else { break };
            tokio::time::sleep(retry_after.min(std::time::Duration::from_millis(200))).await;
            answer = engine.submit(submission()).await?;
        }
        match answer {
            Answer::Final { response, .. } => ensure!(response == *worked[0], "both callers get the same bytes"),
            other => anyhow::bail!("a caller was answered {other:?}"),
        }
    }
    let third = engine(keys, ledger, &rail, "c");
    let replayed = match third.submit(submission()).await? {
        Answer::Final { response, replayed: true } => response,
        other => anyhow::bail!("a later caller was answered {other:?}, not the stored answer"),
    };
    ensure!(replayed == *worked[0], "a later caller gets the same bytes from the key store");

    // One instruction at the rail, one payout row, paid.
    let statement: Vec<Applied> = reqwest::get(format!("{rail}/v1/statement")).await?.json().await?;
    let sent: Vec<&Applied> = statement.iter().filter(|a| a.end_to_end_id == payout.reference).collect();
    ensure!(sent.len() == 1, "the rail saw {} instructions for one payout", sent.len());
    // Sends, not distinct keys: a second send under the key counts too.
    let sends: std::collections::BTreeMap<String, u32> = reqwest::get(format!("{rail}/v1/sends")).await?.json().await?;
    let under_key = sends.get(&sent[0].idempotency_key).copied().unwrap_or(0);
    ensure!(under_key == 1, "the rail took {under_key} sends under the payout's key");
    let id: uuid::Uuid = serde_json::from_slice::<serde_json::Value>(&replayed.body)?["id"]
        .as_str()
        .context("the answer names the payout")?
        .parse()?;
    let rows: Vec<String> = sqlx::query_scalar("SELECT status FROM example_payouts WHERE id = $1")
        .bind(id)
        .fetch_all(ledger.pool())
        .await?;
    ensure!(rows == ["paid"], "one payout row, paid: {rows:?}");
    println!(
        "payout {}: {} at the rail ({}), three callers, one instruction",
        payout.reference,
        String::from_utf8_lossy(&replayed.body),
        sent[0].reference,
    );
    Ok(())
}
