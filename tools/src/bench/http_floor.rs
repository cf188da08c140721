//! The floors behind HTTP: each iteration of [`super::floor`]'s loops
//! asked for by a request like the front door's (the same headers and
//! body) and answered with the answer the iteration stored or found, by a
//! server of serve's make (axum on a runtime of one worker) on threads of
//! its own in this process, whose CPU is counted apart from the bench's.
//! Beside the floors, it says what HTTP alone adds to the same work; beside
//! payments and cold replays, what keyfence's own logic adds to HTTP and
//! that work. It checks no API key and reads no idempotency key: its keys
//! are the floor's own, by the client and index in its path.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use anyhow::Context;
use axum::Router;
use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use tokio::sync::oneshot;
use uuid::Uuid;

use keyfence::domain::{ClientId, StoredResponse};

use super::cpu;
use super::floor::{self, Floor, Stores};

/// The running server: where it listens, and the threads it runs on.
pub struct HttpFloor {
    pub url: String,
    /// `/proc/self/task/<tid>/stat` of each of the runtime's threads.
    threads: Arc<Mutex<Vec<PathBuf>>>,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl HttpFloor {
    /// Connects clients of its own to `stores` and listens on a free
    /// loopback port.
    pub fn start(stores: Stores) -> anyhow::Result<Self> {
        let threads = Arc::new(Mutex::new(Vec::new()));
        let seen = threads.clone();
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("http-floor")
            .on_thread_start(move || {
                if let (Ok(me), Ok(mut all)) = (std::fs::read_link("/proc/thread-self"), seen.lock()) {
                    all.push(PathBuf::from("/proc").join(me).join("stat"));
                }
            })
            .enable_all()
            .build()
            .context("starting the HTTP floor's runtime")?;
        let (ready, listening) = std::sync::mpsc::channel();
        let (stop, stopped) = oneshot::channel();
        let thread = std::thread::spawn(move || {
            // Spawned, not run here: the accept loop runs on the worker, whose CPU is counted.
            let served = runtime.spawn(async move {
                let started = async {
                    let floor = Floor::connect(&stores).await?;
                    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
                    anyhow::Ok((Arc::new(floor), listener))
                };
                let (floor, listener) = match started.await {
                    Ok(started) => started,
                    Err(e) => {
                        let _ = ready.send(Err(e));
                        return;
                    }
                };
                let _ = ready.send(listener.local_addr().map_err(Into::into));
                let app = Router::new()
                    .route("/{client}/payments/{i}", post(payment))
                    .route("/{client}/replays/{i}", post(replay))
                    .with_state(floor);
                let serving = axum::serve(listener, app).with_graceful_shutdown(async {
                    let _ = stopped.await;
                });
                if let Err(e) = serving.await {
                    tracing::warn!(error = %e, "the HTTP floor stopped serving");
                }
            });
            let _ = runtime.block_on(served);
        });
        let addr = listening.recv().context("the HTTP floor's thread ended before it listened")??;
        Ok(Self { url: format!("http://{addr}"), threads, stop: Some(stop), thread: Some(thread) })
    }

    /// The CPU seconds its runtime's threads have spent so far (a thread
    /// that has ended counts nothing).
    pub fn cpu_seconds(&self) -> Option<f64> {
        let threads = self.threads.lock().ok()?;
        Some(threads.iter().filter_map(|stat| cpu::stat_seconds(stat)).sum())
    }

    /// The URL of one iteration of the payment floor or the replay floor.
    pub fn iteration(&self, client: ClientId, replay: bool, i: usize) -> String {
        let loop_ = if replay { "replays" } else { "payments" };
        format!("{}/{}/{loop_}/{i}", self.url, client.as_uuid())
    }
}

impl Drop for HttpFloor {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

async fn payment(
    State(floor): State<Arc<Floor>>,
    Path((client, i)): Path<(Uuid, usize)>,
    axum::Json(_): axum::Json<serde_json::Value>,
) -> Response {
    answer(floor::payment_loop(&floor, ClientId::new(client), i).await)
}

async fn replay(
    State(floor): State<Arc<Floor>>,
    Path((client, i)): Path<(Uuid, usize)>,
    axum::Json(_): axum::Json<serde_json::Value>,
) -> Response {
    answer(floor::replay_loop(&floor, ClientId::new(client), i).await)
}

/// The stored answer as the front door sends one, or why there is none.
fn answer(outcome: Result<StoredResponse, String>) -> Response {
    let stored = match outcome {
        Ok(stored) => stored,
        Err(why) => return (StatusCode::INTERNAL_SERVER_ERROR, why).into_response(),
    };
    let mut response = Response::builder().status(stored.status);
    for (name, value) in &stored.headers {
        response = response.header(name, value);
    }
    response
        .body(Body::from(stored.body))
        .unwrap_or_else(|e| (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response())
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use keyfence::config::{KeyStoreSettings, LedgerSettings, RailSettings};
    use keyfence::keystore;
    use keyfence::ledger;
    use keyfence::rail::sim::{self, Simulator};

    use super::*;

    /// A rail simulator on a free port, for as long as the test runs.
    async fn rail(name: &str) -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(sim::serve(listener, Simulator::new(name, None), std::future::pending()));
        url
    }

    /// Against the stores `scripts/test` starts: a request makes one
    /// payment's business records and stores its answer, which the request
    /// and its replay are both answered with, and the server's own threads
    /// are counted.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_payment_and_its_replay_over_http_do_the_floors_work_and_answer_what_it_stored() {
        let mut keys = KeyStoreSettings::from_env().expect("key store settings from the environment");
        keys.aws_endpoint_url.get_or_insert_with(|| "http://127.0.0.1:4566".to_owned());
        keys.table = format!("keyfence-test-{}", Uuid::new_v4().simple());
        let client = keystore::connect(&keys).await.unwrap();
        keystore::ensure_table(&client, &keys.table).await.expect("a test table (scripts/test starts the emulator)");
        let mut ledger = LedgerSettings::from_env().expect("ledger settings from the environment");
        ledger.database_url = ledger.database_url.with_database(&format!("keyfence_test_{}", Uuid::new_v4().simple()));
        let (floor_ledger, ledger) =
            floor::fresh_ledger(&ledger).await.expect("a floor ledger (is PostgreSQL running?)");
        let rails = RailSettings {
            e1_url: rail("e1").await,
            e2_url: rail("e2").await,
            rail_timeout: Duration::from_secs(5),
            rail_attempts: 1,
        };

        let served = HttpFloor::start(Stores { keys: keys.clone(), ledger: ledger.clone(), rails }).unwrap();
        assert!(served.cpu_seconds().is_some(), "the server's threads are readable");
        let (http, payer) = (reqwest::Client::new(), ClientId::generate());
        let ask = |replay| http.post(served.iteration(payer, replay, 7)).json(&floor::payment(7)).send();
        let first = ask(false).await.unwrap();
        assert_eq!(first.status(), 201);
        let location = first.headers()["location"].to_str().unwrap().to_owned();
        let answer = first.bytes().await.unwrap();
        let payment: serde_json::Value = serde_json::from_slice(&answer).unwrap();
        assert_eq!((payment["status"].as_str(), payment["amount_minor"].as_i64()), (Some("succeeded"), Some(107)));
        assert_eq!(location, format!("/v1/payments/{}", payment["id"].as_str().unwrap()));
        let again = ask(true).await.unwrap();
        assert_eq!(again.status(), 201);
        assert_eq!(again.bytes().await.unwrap(), answer, "the replay is answered with the stored bytes");

        let written: (i64, i64, i64) = sqlx::query_as(
            "SELECT (SELECT count(*) FROM payments WHERE status = 'succeeded'),
                    (SELECT count(*) FROM postings), (SELECT count(*) FROM outbox)",
        )
        .fetch_one(floor_ledger.pool())
        .await
        .unwrap();
        assert_eq!(written, (1, 6, 1), "one payment, its three entries of two legs, its event");

        drop(served);
        floor_ledger.pool().close().await;
        ledger::drop_database(&ledger).await.unwrap();
        keystore::delete_table(&client, &keys.table).await.unwrap();
    }

    #[test]
    fn a_floor_whose_ledger_cannot_be_reached_does_not_start() {
        let mut ledger = LedgerSettings::from_env().expect("ledger settings from the environment");
        ledger.database_url = "postgres://postgres@127.0.0.1:1/nowhere".parse().unwrap();
        let mut keys = KeyStoreSettings::from_env().expect("key store settings from the environment");
        keys.aws_region.get_or_insert_with(|| "us-east-1".to_owned());
        let rails = RailSettings {
            e1_url: "http://127.0.0.1:1".into(),
            e2_url: "http://127.0.0.1:1".into(),
            rail_timeout: Duration::from_secs(1),
            rail_attempts: 1,
        };
        assert!(HttpFloor::start(Stores { keys, ledger, rails }).is_err());
    }
}
