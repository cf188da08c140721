//! The perimeter as other clients and other systems meet it: accounts that
//! belong to clients, clients' limits, keys sent the way the IETF draft
//! spells them, text that would hide or reorder what a person reads,
//! made-up bearer tokens, a rail whose answer is not about what was sent,
//! and the headers every answer carries.

use axum::Json;
use axum::extract::Path;
use axum::http::HeaderMap;
use axum::routing::{get, post};
use keyfence::keystore::KeyStore;
use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::app::{TestRail, payment, spawn_app, spawn_app_on};

/// The quoted (Structured Field string) and bare forms of one key are one
/// key: the second is a replay of the first.
#[tokio::test]
async fn a_quoted_idempotency_key_is_the_same_key_as_the_bare_one() {
    let app = spawn_app().await;
    let body = payment("E2E-QUOTED");
    let quoted = app.pay("\"8e03978e-40d5-43e8-bc93-6894a57f9324\"", &body).await;
    assert_eq!(quoted.status(), StatusCode::CREATED);
    let first = quoted.bytes().await.unwrap();
    let bare = app.pay("8e03978e-40d5-43e8-bc93-6894a57f9324", &body).await;
    assert_eq!(bare.status(), StatusCode::CREATED);
    assert_eq!(bare.headers()["idempotent-replayed"], "true");
    assert_eq!(bare.bytes().await.unwrap(), first);
    assert_eq!(app.count("payments").await, 1);
    let unclosed = app.pay("\"8e03978e", &body).await;
    assert_eq!(unclosed.status(), StatusCode::BAD_REQUEST, "an unclosed quote is refused");
}

/// A bidi override (or a zero-width character) in a text field would make
/// a statement read differently from what it holds: refused, naming the
/// field, before anything is claimed.
#[tokio::test]
async fn text_with_invisible_format_characters_is_refused() {
    let app = spawn_app().await;
    let mut body = payment("E2E-BIDI");
    body["remittance_info"] = json!("invoice \u{202E}24 eciovni");
    let refused = app.pay("bidi-1", &body).await;
    assert_eq!(refused.status(), StatusCode::BAD_REQUEST);
    let problem: Value = refused.json().await.unwrap();
    assert_eq!(problem["errors"][0]["field"], "remittance_info", "{problem}");
    assert_eq!(app.key_items().await, 0, "nothing claimed");
}

/// A rail that answers for another amount than it was sent (confused, or
/// hostile): the answer settles nothing; the payment stays pending (202),
/// to be probed again, never reported succeeded on a lie.
#[tokio::test]
async fn a_rail_answer_that_does_not_match_the_instruction_settles_nothing() {
    async fn lie(headers: HeaderMap, Json(sent): Json<Value>) -> (StatusCode, Json<Value>) {
        let key = headers["idempotency-key"].to_str().unwrap().to_owned();
        (StatusCode::CREATED, Json(answer(&key, &sent)))
    }
    fn answer(key: &str, sent: &Value) -> Value {
        json!({
            "idempotency_key": key,
            "end_to_end_id": sent["end_to_end_id"],
            "amount_minor": sent["amount_minor"].as_i64().unwrap_or(0) * 100,
            "currency": sent["currency"],
            "reference": "liar-1",
            "applied_at": "2026-12-01T00:00:00Z",
        })
    }
    let liar = axum::Router::new()
        .route("/v1/instructions", post(lie))
        .route("/v1/instructions/{key}", get(|Path(_key): Path<String>| async { StatusCode::NOT_FOUND }));
    let app = spawn_app_on(TestRail::start("e1").await, TestRail::serving(liar).await, |s| {
        s.engine.rails.rail_timeout = std::time::Duration::from_millis(300)
    })
    .await;
    let answered = app.pay("liar-1", &payment("E2E-LIAR")).await;
    assert_eq!(answered.status(), StatusCode::ACCEPTED, "unknown, not succeeded");
    let status: String =
        sqlx::query_scalar("SELECT status FROM payments").fetch_one(app.db.ledger.pool()).await.unwrap();
    assert_eq!(status, "pending");
    let settled: i64 = sqlx::query_scalar("SELECT count(*) FROM phase_runs WHERE point = 'EXT2_DONE'")
        .fetch_one(app.db.ledger.pool())
        .await
        .unwrap();
    assert_eq!(settled, 0, "nothing recorded as the rail's outcome");
}

/// Every answer names itself with a `Request-Id` (the caller's, if it sent
/// one); answers are never cached; a 405 says which methods are allowed.
#[tokio::test]
async fn every_answer_carries_a_request_id_and_payments_are_never_cached() {
    let app = spawn_app().await;
    let paid = app.pay("headers-1", &payment("E2E-HEADERS")).await;
    assert_eq!(paid.status(), StatusCode::CREATED);
    assert!(paid.headers().get("request-id").is_some_and(|id| !id.is_empty()), "{:?}", paid.headers());
    assert_eq!(paid.headers()["cache-control"], "no-store");
    let read = app.get_as(&app.api_key, &format!("/v1/payments/{}", uuid::Uuid::now_v7())).await;
    assert_eq!(read.status(), StatusCode::NOT_FOUND);
    assert!(read.headers().get("request-id").is_some());
    assert_eq!(read.headers()["cache-control"], "no-store");
    let mine =
        app.http.get(format!("{}/healthz", app.url)).header("request-id", "caller-chosen-7").send().await.unwrap();
    assert_eq!(mine.headers()["request-id"], "caller-chosen-7", "the caller's id is kept");
    let wrong = app.http.delete(format!("{}/v1/payments", app.url)).send().await.unwrap();
    assert_eq!(wrong.status(), StatusCode::METHOD_NOT_ALLOWED);
    let allow = wrong.headers().get("allow").map(|v| v.to_str().unwrap().to_owned()).unwrap_or_default();
    assert!(allow.contains("GET") && allow.contains("POST"), "Allow: {allow:?}");
    assert!(wrong.headers().get("request-id").is_some());
}

/// A counter of /metrics with its label, as `admin` shows it now.
async fn counted(app: &crate::app::TestApp, admin: &str, line: &str) -> u64 {
    let text = app.http.get(format!("{admin}/metrics")).send().await.unwrap().text().await.unwrap();
    text.lines().find_map(|l| l.strip_prefix(&format!("{line} "))).map_or(0, |n| n.trim().parse().unwrap())
}

/// A flood of made-up bearer tokens (well-formed and not) costs the key
/// table nothing, not even on an instance started during the flood: every
/// real client is served from its first request there, and so is a client
/// made during the flood. The key table is read once a second per
/// instance, whatever the flood.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn made_up_keys_cost_the_key_table_nothing_and_lock_out_no_real_one() {
    let app = spawn_app().await;
    let mut real = vec![app.api_key.clone()];
    for _ in 0..3 {
        real.push(app.add_client().await.1);
    }
    let reads = "keyfence_client_directory_reads_total{outcome=\"ok\"}";
    let before = counted(&app, &app.admin_url, reads).await;
    let started = std::time::Instant::now();
    let flooding = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let flood = |url: String| {
        let (http, flooding) = (app.http.clone(), flooding.clone());
        tokio::spawn(async move {
            let mut statuses = Vec::new();
            while flooding.load(std::sync::atomic::Ordering::Relaxed) {
                let batch = (0..150).map(|i| {
                    let token = match i % 5 {
                        0 => format!("guess-{i}"),
                        _ => keyfence::domain::ApiKey::generate().reveal().to_owned(),
                    };
                    http.get(format!("{url}/v1/payments?end_to_end_id=x")).bearer_auth(token).send()
                });
                statuses.extend(futures::future::join_all(batch).await.into_iter().map(|r| r.unwrap().status()));
            }
            statuses
        })
    };
    let first = flood(app.url.clone());
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;

    // A fresh instance, flooded from its start, serves every real client
    // from its first request.
    let fresh = crate::app::start_serving(&app.settings).await;
    let second = flood(fresh.url.clone());
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    for (i, key) in real.iter().enumerate() {
        let paid = app.try_pay_at(&fresh.url, key, &format!("fresh-{i}"), &payment(&format!("E2E-FRESH-{i}"))).await;
        assert_eq!(paid.unwrap().status(), StatusCode::CREATED, "real client {i} on the fresh instance");
    }
    // A client made now is served at once, by both instances.
    let (_, new_key) = app.add_client().await;
    for (i, url) in [&app.url, &fresh.url].into_iter().enumerate() {
        let paid = app.try_pay_at(url, &new_key, &format!("new-{i}"), &payment(&format!("E2E-NEW-{i}"))).await;
        assert_eq!(paid.unwrap().status(), StatusCode::CREATED, "the new client on instance {i}");
    }
    flooding.store(false, std::sync::atomic::Ordering::Relaxed);
    let mut statuses = first.await.unwrap();
    statuses.extend(second.await.unwrap());
    let seconds = started.elapsed().as_secs() + 1;
    assert!(statuses.len() >= 400, "a flood: {}", statuses.len());
    assert!(statuses.iter().all(|s| *s == StatusCode::UNAUTHORIZED), "made-up keys: 401 only");
    assert_eq!(app.e2.statement().await.len(), real.len() + 2, "every real payment at the rail");
    // Both instances share this process's counters: two rounds a second,
    // with a margin of a few, however many made-up keys came.
    let read = counted(&app, &app.admin_url, reads).await - before;
    assert!(read <= 2 * seconds + 4, "{read} directory reads in {seconds} s for {} made-up keys", statuses.len());
}

/// Accounts belong to clients. Client B pays from client A's account, and
/// from an account nobody holds: both refused alike (403, no oracle) before
/// anything is claimed. Not a stored answer: once B holds the account, the
/// same key pays, and the rail is told who asked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_pays_only_from_accounts_it_holds() {
    let app = spawn_app().await;
    let (b, b_key) = app.add_client_holding(&[]).await;
    let mut theirs = payment("E2E-NOT-MINE");
    theirs["debtor_account"] = json!(crate::app::DEBTOR);
    let refused = app.pay_as(&b_key, "steal-1", &theirs).await;
    assert_eq!(refused.status(), StatusCode::FORBIDDEN);
    let refused: Value = refused.json().await.unwrap();
    assert_eq!(refused["type"], "urn:keyfence:problem:account-not-permitted");
    let mut nobodys = payment("E2E-NOBODYS");
    nobodys["debtor_account"] = json!("gb29 nwbk 6016 1331 9268 19");
    let unheld = app.pay_as(&b_key, "own-1", &nobodys).await;
    assert_eq!(unheld.status(), StatusCode::FORBIDDEN);
    assert_eq!(unheld.json::<Value>().await.unwrap(), refused, "the same answer: no account oracle");
    assert_eq!(app.key_items().await, 0, "nothing claimed");
    assert!(app.e2.statement().await.is_empty(), "nothing at the rails");

    app.clients().change_accounts(b, &["GB29NWBK60161331926819".to_owned()], true).await.unwrap();
    app.clock.advance(keyfence::clients::CACHE_FOR);
    let paid = app.pay_as(&b_key, "own-1", &nobodys).await;
    assert_eq!(paid.status(), StatusCode::CREATED, "the same key pays once the account is B's");
    let shown: Value = paid.json().await.unwrap();
    assert_eq!(shown["debtor_account"], "GB29NWBK60161331926819", "stored in its normal form");
    let statement = app.e2.statement().await;
    assert_eq!(statement.len(), 1);
    assert_eq!(statement[0].originator, b.to_string(), "the rail is told who asked");
    let stolen = app.pay_as(&b_key, "steal-1", &theirs).await;
    assert_eq!(stolen.status(), StatusCode::FORBIDDEN, "still not B's to pay from");
    let key = keyfence::domain::ScopedKey::new(b, keyfence::domain::IdempotencyKey::parse("own-1").unwrap());
    let stored = app.keys.store.get(&key).await.unwrap().unwrap().request;
    assert!(String::from_utf8_lossy(&stored).contains("GB29NWBK60161331926819"), "kept in its normal form");

    // The account is taken away again: a retry of the payment it made is
    // still the replay of that payment, not a refusal saying nothing happened.
    app.clients().change_accounts(b, &["GB29NWBK60161331926819".to_owned()], false).await.unwrap();
    app.clock.advance(keyfence::clients::CACHE_FOR);
    let (fresh, _stop) = crate::app::start_instance(&app.settings).await;
    let retry = app.try_pay_at(&fresh, &b_key, "own-1", &nobodys).await.unwrap();
    assert_eq!(retry.status(), StatusCode::CREATED, "a replay");
    assert_eq!(retry.headers()["idempotent-replayed"], "true");
    assert_eq!(app.pay_as(&b_key, "own-2", &nobodys).await.status(), StatusCode::FORBIDDEN, "a new one is refused");
}

/// A client's limits (currencies, largest payment) are enforced before the
/// claim, with a 422 naming the limit.
#[tokio::test]
async fn a_clients_limits_are_enforced_before_anything_is_claimed() {
    let app = spawn_app().await;
    let limits = keyfence::clients::Limits {
        currencies: Some(["USD".to_owned()].into()),
        max_amount_minor: Some(1000),
        ..Default::default()
    };
    app.clients().set_limits(app.client_id().await, &limits).await.unwrap();
    // Seen at the instance's next read of the directory's changes.
    app.clock.advance(keyfence::clients::CACHE_FOR);
    let euros = app.pay("limits-1", &payment("E2E-LIMIT-1")).await;
    assert_eq!(euros.status(), StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(euros.json::<Value>().await.unwrap()["limit"], "currencies");
    let mut dollars = payment("E2E-LIMIT-2");
    dollars["currency"] = json!("USD");
    let large = app.pay("limits-2", &dollars).await;
    assert_eq!(large.status(), StatusCode::UNPROCESSABLE_ENTITY, "1250 is over 1000");
    assert_eq!(large.json::<Value>().await.unwrap()["limit"], "max_amount_minor");
    dollars["amount_minor"] = json!(900);
    assert_eq!(app.pay("limits-3", &dollars).await.status(), StatusCode::CREATED);
    assert_eq!(app.key_items().await, 1, "only the payment within the limits was claimed");
}

/// The operator's side: accounts are given in any spacing or case and kept
/// in their normal form; an IBAN with wrong check digits is refused.
#[tokio::test]
async fn accounts_are_managed_from_the_cli_in_their_normal_form() {
    let app = spawn_app().await;
    let id = app.client_id().await.to_string();
    let run = |args: &[&str]| {
        let mut command = crate::process::keyfence_command(&app, "accounts");
        command.args(args);
        async move { command.output().await.unwrap() }
    };
    let added = run(&["add", "--client", &id, "--account", "gb29 nwbk 6016 1331 9268 19"]).await;
    assert!(added.status.success(), "{}", String::from_utf8_lossy(&added.stderr));
    let bad = run(&["add", "--client", &id, "--account", "GB28NWBK60161331926819"]).await;
    assert_eq!(bad.status.code(), Some(2), "wrong check digits");
    let listed = run(&["list", "--client", &id, "--json"]).await;
    let listed: Value = serde_json::from_slice(&listed.stdout).unwrap();
    let accounts = listed["profile"]["accounts"].as_array().unwrap();
    assert_eq!(accounts, &vec![json!(crate::app::DEBTOR), json!("GB29NWBK60161331926819")]);
    let removed = run(&["remove", "--client", &id, "--account", "GB29NWBK60161331926819"]).await;
    assert!(removed.status.success());
    let listed: Value = serde_json::from_slice(&run(&["list", "--client", &id, "--json"]).await.stdout).unwrap();
    assert_eq!(listed["profile"]["accounts"], json!([crate::app::DEBTOR]));
}
