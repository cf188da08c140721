//! The floors behind HTTP: each iteration of [`super::floor`]'s loops
//! asked for by a request like the front door's (the same headers and
//! body) and answered with the answer the iteration stored or found, by
//! serve's own HTTP server ([`keyfence::http::server::serve`], on a runtime
//! sized as serve's is, by `TOKIO_WORKER_THREADS`) on threads of its own in
//! this process, whose CPU is counted apart from the bench's. Its throughput
//! and latency beside the floors' say what HTTP costs the same work; its
//! server's CPU beside serve's, what keyfence's own work costs on top of
//! HTTP and the store calls. It checks no API key and reads no idempotency
//! key: its keys are the floor's own, by the client and index in its path.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use axum::Router;
use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use keyfence::http::server::{self, Limits};
use tokio::sync::oneshot;
use uuid::Uuid;

use keyfence::domain::{ClientId, StoredResponse};

use super::cpu;
use super::floor::{self, Floor, Stores};

/// The running server: where it listens, and the threads it runs on.
pub struct HttpFloor {
    url: String,
    threads: Arc<Mutex<Threads>>,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// The runtime's threads: the `stat` file of each one running, and the
/// CPU seconds of those that have ended.
#[derive(Default)]
struct Threads {
    running: Vec<PathBuf>,
    ended: f64,
}

/// What serve answers with by default, but for the connections from one
/// address, which the bench's client needs all of (as `scripts/bench` lets
/// serve's be).
const LIMITS: Limits = Limits {
    header_read: Duration::from_secs(10),
    idle: Duration::from_secs(75),
    body_read: Duration::from_secs(10),
    max_connections: 1024,
    per_address: 1024,
    requests_per_connection: 1000,
    max_age: Duration::from_secs(60),
    write_stall: Duration::from_secs(10),
    drain: Duration::from_secs(10),
};

impl HttpFloor {
    /// Connects clients of its own to `stores` and listens on a free
    /// loopback port.
    pub fn start(stores: Stores) -> anyhow::Result<Self> {
        let threads = Arc::new(Mutex::new(Threads::default()));
        let (started, stopped) = (threads.clone(), threads.clone());
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .thread_name("http-floor")
            .on_thread_start(move || {
                if let (Some(me), Ok(mut threads)) = (this_thread(), started.lock()) {
                    threads.running.push(me);
                }
            })
            .on_thread_stop(move || {
                if let (Some(me), Ok(mut threads)) = (this_thread(), stopped.lock()) {
                    threads.ended += cpu::stat_seconds(&me).unwrap_or(0.0);
                    threads.running.retain(|path| *path != me);
                }
            })
            .enable_all()
            .build()
            .context("starting the HTTP floor's runtime")?;
        let (ready, listening) = std::sync::mpsc::channel();
        let (stop, stopping) = oneshot::channel();
        let thread = std::thread::spawn(move || {
            // Spawned, not run here: the server runs on the runtime's threads, whose CPU is counted.
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
                let app = Router::new().route("/{client}/{loop}/{i}", post(iteration)).with_state(floor.clone());
                let shutdown = async {
                    let _ = stopping.await;
                };
                if let Err(e) = server::serve(listener, app, LIMITS, shutdown).await {
                    tracing::warn!(error = %e, "the HTTP floor stopped serving");
                }
                floor.ledger.pool().close().await;
            });
            let _ = runtime.block_on(served);
        });
        let addr = listening.recv().context("the HTTP floor's thread ended before it listened")??;
        Ok(Self { url: format!("http://{addr}"), threads, stop: Some(stop), thread: Some(thread) })
    }

    /// The CPU seconds its runtime's threads have spent so far, or none if
    /// they cannot be read.
    pub fn cpu_seconds(&self) -> Option<f64> {
        let threads = self.threads.lock().ok()?;
        let running: Option<f64> = threads.running.iter().map(|stat| cpu::stat_seconds(stat)).sum();
        Some(threads.ended + running.filter(|_| !threads.running.is_empty())?)
    }

    /// The URL of one iteration of the payment floor or the replay floor.
    pub fn iteration(&self, client: ClientId, which: Loop, i: usize) -> String {
        let which = match which {
            Loop::Payments => "payments",
            Loop::Replays => "replays",
        };
        format!("{}/{}/{which}/{i}", self.url, client.as_uuid())
    }
}

/// The `stat` file of the calling thread (`/proc/<pid>/task/<tid>/stat`).
fn this_thread() -> Option<PathBuf> {
    Some(PathBuf::from("/proc").join(std::fs::read_link("/proc/thread-self").ok()?).join("stat"))
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

/// Which of the floor's loops an iteration is, as its path names it.
#[derive(Clone, Copy, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Loop {
    Payments,
    Replays,
}

async fn iteration(
    State(floor): State<Arc<Floor>>,
    Path((client, which, i)): Path<(Uuid, Loop, usize)>,
    axum::Json(_): axum::Json<serde_json::Value>,
) -> Response {
    let client = ClientId::new(client);
    answer(match which {
        Loop::Payments => floor::payment_loop(&floor, client, i).await,
        Loop::Replays => floor::replay_loop(&floor, client, i).await,
    })
}

/// The stored answer as the front door sends one, or why there is none
/// (logged too, since the bench reads no failed answer's body).
fn answer(outcome: Result<StoredResponse, String>) -> Response {
    let stored = match outcome {
        Ok(stored) => stored,
        Err(why) => {
            tracing::warn!(error = %why, "an HTTP floor iteration failed");
            return (StatusCode::INTERNAL_SERVER_ERROR, why).into_response();
        }
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

    use keyfence::config::RailSettings;
    use keyfence::keystore;
    use keyfence::keystore::KeyStoreSettings;
    use keyfence::ledger;
    use keyfence::ledger::LedgerSettings;
    use keyfence::rail::sim::{self, Simulator};

    use super::*;

    /// A rail simulator on a free port, for as long as the test runs.
    async fn rail(name: &str) -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(sim::serve(listener, Simulator::new(name, None), std::future::pending()));
        url
    }

    /// Removes the test's key table and floor ledger when dropped, whether
    /// the test passed or panicked.
    struct Made {
        keys: KeyStoreSettings,
        ledger: LedgerSettings,
    }

    impl Drop for Made {
        fn drop(&mut self) {
            let (keys, ledger) = (self.keys.clone(), self.ledger.clone());
            // The test's runtime is blocked here: the removal gets one of its own.
            let removed = std::thread::spawn(move || {
                tokio::runtime::Runtime::new().unwrap().block_on(async {
                    let _ = ledger::drop_database(&ledger).await;
                    if let Ok(client) = keystore::connect(&keys).await {
                        let _ = keystore::delete_table(&client, &keys.table).await;
                    }
                })
            });
            let _ = removed.join();
        }
    }

    /// Against the stores `scripts/test` starts: a request makes one
    /// payment's business records and stores its answer, which the request
    /// and its replay are both answered with, and the CPU counted is the
    /// server's own threads'.
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
        let _made = Made { keys: keys.clone(), ledger: ledger.clone() };
        let rails = RailSettings {
            e1_url: rail("e1").await,
            e2_url: rail("e2").await,
            rail_timeout: Duration::from_secs(5),
            rail_attempts: 1,
            rail_proxy: None,
        };

        let served = HttpFloor::start(Stores { keys, ledger, rails }).unwrap();
        let (http, payer) = (reqwest::Client::new(), ClientId::generate());
        let ask = |which| http.post(served.iteration(payer, which, 7)).json(&floor::payment(7)).send();
        let first = ask(Loop::Payments).await.unwrap();
        assert_eq!(first.status(), 201);
        let location = first.headers()["location"].to_str().unwrap().to_owned();
        let answer = first.bytes().await.unwrap();
        let payment: serde_json::Value = serde_json::from_slice(&answer).unwrap();
        assert_eq!((payment["status"].as_str(), payment["amount_minor"].as_i64()), (Some("succeeded"), Some(107)));
        assert_eq!(location, format!("/v1/payments/{}", payment["id"].as_str().unwrap()));
        let again = ask(Loop::Replays).await.unwrap();
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

        let counted: Vec<String> = served.threads.lock().unwrap().running.iter().map(|stat| name(stat)).collect();
        assert!(!counted.is_empty() && counted.iter().all(|n| n == "http-floor"), "counted threads: {counted:?}");
        assert!(served.cpu_seconds().is_some());
        drop(served);
        floor_ledger.pool().close().await;
    }

    /// The command name in a `stat` file.
    fn name(stat: &std::path::Path) -> String {
        let text = std::fs::read_to_string(stat).unwrap();
        text[text.find('(').unwrap() + 1..text.rfind(')').unwrap()].to_owned()
    }

    #[test]
    fn a_floor_whose_ledger_cannot_be_reached_does_not_start() {
        let keys = KeyStoreSettings {
            table: "keyfence-unused".into(),
            aws_endpoint_url: Some("http://127.0.0.1:1".into()),
            aws_region: Some("us-east-1".into()),
            dummy_credentials: true,
            max_attempts: None,
            attempt_timeout: Duration::from_secs(1),
        };
        let ledger = LedgerSettings::remote("postgres://postgres@127.0.0.1:1/nowhere".parse().unwrap());
        let rails = RailSettings {
            e1_url: "http://127.0.0.1:1".into(),
            e2_url: "http://127.0.0.1:1".into(),
            rail_timeout: Duration::from_secs(1),
            rail_attempts: 1,
            rail_proxy: None,
        };
        let refused = HttpFloor::start(Stores { keys, ledger, rails }).err().expect("no server without its ledger");
        assert!(format!("{refused:#}").contains("connecting the floor's ledger"), "{refused:#}");
    }
}
