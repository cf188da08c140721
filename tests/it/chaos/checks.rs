//! The money invariants of a chaos run, checked from the outside once its
//! faults are healed and both regions reconciled: the rails' books, both
//! ledgers, and the public API. Each broken one is a line of the report.
//! - Each derived key was applied once at its rail. (A key may reach its
//!   rail twice inside the rail's window: an instruction slower than the
//!   timeout is probed before it lands, not found, and sent again; the rail
//!   takes it once. The suite's own tests count sends exactly.)
//! - Per payment reference at the rail: no more payments than live
//!   payments in the ledgers, refunds never more than what was paid, and
//!   none standing beside a payment the ledgers say was returned.
//! - Every return a region received froze its payment's balance or holds
//!   all of it, and no refund of it began after the freeze (a return the
//!   rail made of a payment refunded before is the rail's to answer for,
//!   and kept for a person).
//! - One live copy of each request across both ledgers; postings balanced.
//! - Every payment debits an account its client holds.
//! - Every request a client made got a final answer of its kind (201 for
//!   a payment; 201 or 422 for a refund), and every answer
//!   asked for again while its key was kept came back the same bytes (once
//!   in the run, from any instance; and at the end, from both regions).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::Duration;

use keyfence::keystore::KeyStore;
use reqwest::StatusCode;
use sqlx::PgPool;
use uuid::Uuid;

use super::stack::{INSTANCES, Region, Stack};
use super::workload::{Done, Kind};

/// What broke, and how many answers were replayed in both regions.
pub async fn all(stack: &Stack, done: &Done) -> (Vec<String>, usize) {
    let mut broken = Vec::new();
    let pools = stack.fresh_pools();
    rails(stack, &pools, &mut broken).await;
    returns(stack, &pools, done, &mut broken).await;
    ledgers(stack, &pools, &mut broken).await;
    let replayed = answers(stack, done, &mut broken).await;
    broken.extend(done.changed.iter().cloned());
    (broken, replayed + done.replayed)
}

/// What the ledgers say each derived key was for (its step).
async fn steps(pools: &[PgPool; 2]) -> HashMap<Uuid, String> {
    let mut steps = HashMap::new();
    for pool in pools {
        let rows: Vec<(Uuid, String)> =
            sqlx::query_as("SELECT derived_key, step FROM external_calls").fetch_all(pool).await.unwrap();
        steps.extend(rows);
    }
    steps
}

async fn rails(stack: &Stack, pools: &[PgPool; 2], broken: &mut Vec<String>) {
    for (name, rail) in [("E1", &stack.app.e1), ("E2", &stack.app.e2)] {
        let statement = rail.statement().await;
        let distinct: HashSet<&str> = statement.iter().map(|a| a.idempotency_key.as_str()).collect();
        if distinct.len() != statement.len() {
            broken.push(format!("{name}: {} instructions applied under {} keys", statement.len(), distinct.len()));
        }
    }
    let steps = steps(pools).await;
    let returned: HashSet<String> = reqwest::get(format!("{}/v1/returns", stack.app.e2.url))
        .await
        .unwrap()
        .json::<Vec<serde_json::Value>>()
        .await
        .unwrap()
        .into_iter()
        .filter_map(|r| r["idempotency_key"].as_str().map(str::to_owned))
        .collect();
    // Per payment reference: what the ledgers hold live, and what went out.
    let (mut live, mut returned_payments) = (HashMap::<String, usize>::new(), HashSet::<String>::new());
    for pool in pools {
        let rows: Vec<(String, String)> =
            sqlx::query_as("SELECT end_to_end_id, status FROM payments WHERE status <> 'voided'")
                .fetch_all(pool)
                .await
                .unwrap();
        for (reference, status) in rows {
            *live.entry(reference.clone()).or_default() += 1;
            if status == "returned" {
                returned_payments.insert(reference);
            }
        }
    }
    #[derive(Default, Debug)]
    struct Flows {
        payments: Vec<i64>,
        refunds: i64,
    }
    let mut flows: BTreeMap<String, Flows> = BTreeMap::new();
    for applied in stack.app.e2.statement().await {
        let Some(step) = Uuid::parse_str(&applied.idempotency_key).ok().and_then(|k| steps.get(&k)) else {
            broken.push(format!("E2: {} ({}) is in no ledger", applied.idempotency_key, applied.end_to_end_id));
            continue;
        };
        let flow = flows.entry(applied.end_to_end_id.clone()).or_default();
        match step.as_str() {
            "refund" if !returned.contains(&applied.idempotency_key) => flow.refunds += applied.amount_minor,
            "refund" => {}
            _ => flow.payments.push(applied.amount_minor),
        }
    }
    for (reference, flow) in flows {
        let paid: i64 = flow.payments.iter().sum();
        let payments = live.get(&reference).copied().unwrap_or(0);
        if flow.payments.is_empty() {
            broken.push(format!("E2: refunds of {reference}, which was never paid: {flow:?}"));
        } else if flow.payments.len() > payments.max(1) {
            broken.push(format!("E2: {reference} paid more often than the ledgers hold it ({payments}): {flow:?}"));
        } else if flow.refunds > paid {
            broken.push(format!("E2: {reference} paid {paid} and refunded more: {flow:?}"));
        } else if flow.refunds > 0 && returned_payments.contains(&reference) {
            broken.push(format!("E2: {reference} was returned, and refunds of it stand: {flow:?}"));
        }
    }
}

/// Every return asked arrived (the rails notify region A); A handed on
/// what it could not take, and no return was taken by both regions; each
/// left nothing of its payment to refund, and no refund of the payment
/// began after the freeze.
async fn returns(stack: &Stack, pools: &[PgPool; 2], done: &Done, broken: &mut Vec<String>) {
    let mut received: Vec<(Uuid, String, Option<Uuid>)> = Vec::new();
    let mut taken: BTreeMap<String, Vec<&str>> = BTreeMap::new();
    for (region, pool) in [Region::A, Region::B].into_iter().zip(pools) {
        let rows: Vec<(String, Uuid, String, Option<Uuid>)> = sqlx::query_as(
            "SELECT i.message_id, i.derived_key, i.state, p.id FROM inbox i
               LEFT JOIN external_calls c ON c.derived_key = i.derived_key
               LEFT JOIN payments p USING (client_id, idem_key, request_created_at)
              WHERE i.kind = 'returned'",
        )
        .fetch_all(pool)
        .await
        .unwrap();
        for (message, key, state, payment) in rows {
            match state.as_str() {
                "applied" => taken.entry(message).or_default().push(region.name()),
                "forwarding" => broken.push(format!("{}: the return of {key} was never handed on", region.name())),
                _ => {}
            }
            if region == Region::A || payment.is_some() {
                received.push((key, state, payment));
            }
        }
    }
    for (message, regions) in taken.into_iter().filter(|(_, regions)| regions.len() > 1) {
        broken.push(format!("return {message} applied in more than one region: {regions:?}"));
    }
    for asked in &done.returned {
        let asked = Uuid::parse_str(asked).unwrap();
        if !received.iter().any(|(key, _, _)| *key == asked) {
            broken.push(format!("the return of {asked} never reached region A"));
        }
    }
    for (key, state, payment) in received {
        let Some(payment) = payment else { continue };
        let balance = keyfence::operations::RefundOperation::balance_of(payment);
        let Some(balance) = stack.app.keys.store.balance(&balance).await.unwrap() else {
            broken.push(format!("the return of {key} ({state}) froze nothing: payment {payment} has no balance"));
            continue;
        };
        let Some(frozen) = balance.frozen else {
            // Held whole by the return (as a region of an older version does) is as safe.
            if balance.left() > 0 {
                broken.push(format!("the return of {key} ({state}) left payment {payment} refundable: {balance:?}"));
            }
            continue;
        };
        for (region, pool) in [Region::A, Region::B].into_iter().zip(pools) {
            let late: Vec<(String, String)> = sqlx::query_as(
                "SELECT idem_key, status FROM refunds
                  WHERE payment_id = $1 AND status IN ('succeeded', 'returned')
                    AND request_created_at > to_timestamp($2::float8 / 1000)",
            )
            .bind(payment)
            .bind(frozen.at.get() as f64)
            .fetch_all(pool)
            .await
            .unwrap();
            for (refund, status) in late {
                broken.push(format!(
                    "{}: refund {refund} ({status}) began after the return froze {payment}",
                    region.name()
                ));
            }
        }
    }
}

async fn ledgers(stack: &Stack, pools: &[PgPool; 2], broken: &mut Vec<String>) {
    let mut live: BTreeMap<(String, Uuid, String, String), i64> = BTreeMap::new();
    let held: HashMap<Uuid, &str> = stack.clients.iter().map(|c| (c.id.as_uuid(), c.account)).collect();
    for (region, pool) in [Region::A, Region::B].into_iter().zip(pools) {
        for table in ["payments", "refunds"] {
            let rows: Vec<(Uuid, String, String, String)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
                "SELECT client_id, idem_key, request_created_at::text, debtor_account FROM {table}
                  WHERE status <> 'voided'"
            )))
            .fetch_all(pool)
            .await
            .unwrap();
            for (client, key, created, debtor) in rows {
                if table == "payments" && held.get(&client).is_some_and(|account| *account != debtor) {
                    broken
                        .push(format!("{}: {key} debits {debtor}, an account its client does not hold", region.name()));
                }
                *live.entry((table.to_owned(), client, key, created)).or_default() += 1;
            }
        }
        let unbalanced: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM (SELECT payment_id FROM postings GROUP BY payment_id, currency
                                    HAVING sum(amount_minor) <> 0) AS off",
        )
        .fetch_one(pool)
        .await
        .unwrap();
        if unbalanced > 0 {
            broken.push(format!("{}: {unbalanced} unbalanced postings", region.name()));
        }
    }
    for ((table, _, key, _), copies) in live {
        if copies > 1 {
            broken.push(format!("{table}: {key} has {copies} live copies across the ledgers"));
        }
    }
}

/// Every request has a final answer, and each whose key is still kept (its
/// answer stored) answers the same bytes from an instance of each region;
/// how many were asked.
async fn answers(stack: &Stack, done: &Done, broken: &mut Vec<String>) -> usize {
    let mut replayed = 0;
    let regions: Vec<usize> =
        [Region::A, Region::B].iter().filter_map(|r| INSTANCES.iter().position(|(_, at)| at == r)).collect();
    for request in done.requests.iter().filter(|r| r.kind != Kind::Stolen) {
        let Some((status, bytes)) = request.last() else {
            broken.push(format!("{:?} {}: no final answer", request.kind, request.key));
            continue;
        };
        let expected: &[u16] = if request.kind == Kind::Payment { &[201] } else { &[201, 422] };
        if !expected.contains(&status.as_u16()) {
            let body = String::from_utf8_lossy(bytes);
            broken.push(format!("{:?} {}: answered {status} {body}", request.kind, request.key));
        }
        // Only keys kept long enough to ask both regions before they go.
        if stack.kept_for(request.client, &request.key).await.is_none_or(|left| left < Duration::from_secs(5)) {
            continue;
        }
        replayed += 1;
        for &i in &regions {
            let again = replay(stack, i, request).await;
            if again.as_ref() != Some(&(*status, bytes.clone())) {
                let shown = again.map(|(s, b)| format!("{s} {}", String::from_utf8_lossy(&b)));
                broken.push(format!(
                    "{:?} {}: answered {status} {}, then from {} {shown:?}",
                    request.kind,
                    request.key,
                    String::from_utf8_lossy(bytes),
                    INSTANCES[i].0
                ));
            }
        }
    }
    replayed
}

/// The request sent again to instance `i`, past answers that say "try again".
async fn replay(stack: &Stack, i: usize, request: &super::workload::Request) -> Option<(StatusCode, Vec<u8>)> {
    let client = &stack.clients[request.client];
    for _ in 0..20 {
        let sent = stack
            .app
            .http
            .post(format!("{}{}", stack.url(i), request.path))
            .bearer_auth(&client.api_key)
            .header("Idempotency-Key", &request.key)
            .json(&request.body)
            .send()
            .await;
        if let Ok(answer) = sent
            && !matches!(answer.status().as_u16(), 409 | 429 | 503)
        {
            return Some((answer.status(), answer.bytes().await.ok()?.to_vec()));
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    None
}
