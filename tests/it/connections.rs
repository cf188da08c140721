//! What anonymous callers can reach, and how long they may hold it: the
//! public `/readyz` is cheap however often it is asked and says nothing of
//! the stores; connections are capped per address and in age and requests,
//! so clients trickling tiny requests cannot keep an honest one out; writes
//! have a time limit, so clients that never read cannot either, nor hold up
//! a shutdown; a request head past the header limits is refused with 431;
//! and a keep-alive connection idle between requests outlasts the head
//! clock (a load balancer in front finds it open) until its own.

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use futures::future::join_all;
use reqwest::StatusCode;
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};
use tokio::time::Instant;

use crate::app::{TestApp, payment, spawn_app, spawn_app_with};
use crate::process::{ServeProcess, keyfence_command};

/// `keyfence_registry_reads_total`, as the admin listener shows it now.
async fn registry_reads(app: &TestApp) -> f64 {
    let text = app.http.get(format!("{}/metrics", app.admin_url)).send().await.unwrap().text().await.unwrap();
    text.lines()
        .find_map(|line| line.strip_prefix("keyfence_registry_reads_total "))
        .map_or(0.0, |n| n.trim().parse().unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_public_readyz_is_checked_once_however_many_ask_and_says_only_ready() {
    let app = spawn_app().await;
    let many = reqwest::Client::new();
    let before = registry_reads(&app).await;
    let answers = join_all((0..500).map(|_| many.get(format!("{}/readyz", app.url)).send())).await;
    let reads = registry_reads(&app).await - before;
    assert!(answers.iter().all(|a| a.as_ref().is_ok_and(|a| a.status() == StatusCode::OK)));
    assert!(reads <= 4.0, "500 probes made {reads} registry reads");

    let public: Value = many.get(format!("{}/readyz", app.url)).send().await.unwrap().json().await.unwrap();
    assert_eq!(public, serde_json::json!({ "ready": true }), "nothing about the stores");
    let detail: Value = many.get(format!("{}/readyz", app.admin_url)).send().await.unwrap().json().await.unwrap();
    assert_eq!((detail["key_table"].as_str(), detail["ledger"].as_str()), (Some("ok"), Some("ok")), "{detail}");
    let metrics = many.get(format!("{}/metrics", app.url)).send().await.unwrap();
    assert_eq!(metrics.status(), StatusCode::NOT_FOUND, "metrics are on the admin listener only");
}

/// A connection that asks for `/healthz` every 600 ms, reconnecting
/// whenever it is closed, until `until`.
async fn trickle(host: String, until: tokio::time::Instant) -> usize {
    let mut connections = 0;
    while tokio::time::Instant::now() < until {
        let Ok(mut stream) = TcpStream::connect(&host).await else { continue };
        connections += 1;
        let mut chunk = [0_u8; 4096];
        while tokio::time::Instant::now() < until {
            let request = format!("GET /healthz HTTP/1.1\r\nHost: {host}\r\n\r\n");
            if stream.write_all(request.as_bytes()).await.is_err() {
                break;
            }
            match tokio::time::timeout(Duration::from_secs(2), stream.read(&mut chunk)).await {
                Ok(Ok(n)) if n > 0 => {}
                _ => break,
            }
            tokio::time::sleep(Duration::from_millis(600)).await;
        }
    }
    connections
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_trickling_requests_cannot_keep_an_honest_one_out() {
    let app = spawn_app_with(|s| {
        s.max_connections = 4;
        s.max_connection_age = Duration::from_millis(1500);
    })
    .await;
    let host = app.url.trim_start_matches("http://").to_owned();
    let until = tokio::time::Instant::now() + Duration::from_secs(8);
    let hogs = join_all((0..4).map(|_| trickle(host.clone(), until)));
    let honest = async {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let patient = reqwest::Client::builder().timeout(Duration::from_secs(6)).build().unwrap();
        patient
            .post(format!("{}/v1/payments", app.url))
            .bearer_auth(&app.api_key)
            .header("Idempotency-Key", "honest-1")
            .json(&payment("E2E-HONEST"))
            .send()
            .await
            .map(|r| r.status())
    };
    let (hogs, honest) = tokio::join!(hogs, honest);
    assert_eq!(honest.ok(), Some(StatusCode::CREATED), "the honest client was served");
    assert!(hogs.iter().all(|&c| c >= 2), "every hog was made to reconnect: {hogs:?}");
    assert_eq!(app.e2.statement().await.len(), 1);
}

/// Sends `requests` on one connection; every answer's head, in order, and
/// whether the server closed the connection after the last.
async fn on_one_connection(app: &TestApp, requests: usize) -> (Vec<String>, bool) {
    let host = app.url.trim_start_matches("http://");
    let mut stream = TcpStream::connect(host).await.unwrap();
    let mut heads = Vec::new();
    let mut chunk = [0_u8; 4096];
    for _ in 0..requests {
        stream.write_all(format!("GET /healthz HTTP/1.1\r\nHost: {host}\r\n\r\n").as_bytes()).await.unwrap();
        let n = tokio::time::timeout(Duration::from_secs(2), stream.read(&mut chunk)).await.unwrap().unwrap();
        heads.push(String::from_utf8_lossy(&chunk[..n]).to_lowercase());
    }
    let closed = matches!(tokio::time::timeout(Duration::from_secs(2), stream.read(&mut chunk)).await, Ok(Ok(0)));
    (heads, closed)
}

#[tokio::test]
async fn a_connection_serves_so_many_requests_then_closes() {
    let app = spawn_app_with(|s| s.max_requests_per_connection = 3).await;
    let (heads, closed) = on_one_connection(&app, 3).await;
    assert!(heads.iter().all(|h| h.starts_with("http/1.1 200")), "{heads:?}");
    assert!(!heads[1].contains("connection: close") && heads[2].contains("connection: close"), "{heads:?}");
    assert!(closed, "closed after the third");
}

#[tokio::test]
async fn connections_from_one_address_are_capped() {
    let app = spawn_app_with(|s| s.max_connections_per_address = 2).await;
    let addr: std::net::SocketAddr = app.url.trim_start_matches("http://").parse().unwrap();
    let held = [TcpStream::connect(addr).await.unwrap(), TcpStream::connect(addr).await.unwrap()];
    tokio::time::sleep(Duration::from_millis(200)).await;
    let from = |source: &str| {
        let socket = TcpSocket::new_v4().unwrap();
        socket.bind(format!("{source}:0").parse().unwrap()).unwrap();
        async move {
            let mut stream = socket.connect(addr).await.unwrap();
            let _ = stream.write_all(format!("GET /healthz HTTP/1.1\r\nHost: {addr}\r\n\r\n").as_bytes()).await;
            let mut answer = Vec::new();
            let _ = tokio::time::timeout(Duration::from_secs(2), stream.read_to_end(&mut answer)).await;
            String::from_utf8_lossy(&answer).into_owned()
        }
    };
    assert_eq!(from("127.0.0.1").await, "", "a third from the same address is closed unanswered");
    assert!(from("127.0.0.2").await.starts_with("HTTP/1.1 200"), "another address is served");
    drop(held);
}

#[tokio::test]
async fn a_request_head_past_the_header_limits_is_refused() {
    let app = spawn_app().await;
    let mut request = reqwest::header::HeaderMap::new();
    for i in 0..100 {
        request.insert(reqwest::header::HeaderName::try_from(format!("x-padding-{i}")).unwrap(), "1".parse().unwrap());
    }
    let many = app.http.get(format!("{}/healthz", app.url)).headers(request).send().await.unwrap();
    assert_eq!(many.status(), StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE, "100 headers");
    let long = app.http.get(format!("{}/healthz", app.url)).header("x-padding", "a".repeat(20_000)).send().await;
    assert_eq!(long.unwrap().status(), StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE, "a 20 kB header");
    let plain = app.http.get(format!("{}/healthz", app.url)).send().await.unwrap();
    assert_eq!(plain.status(), StatusCode::OK, "within them, served");
}

/// A connection from `source` that pipelines requests and never reads an
/// answer, made again whenever it is cut off, for as long as the task runs;
/// `made` counts the connections.
async fn slow_reader(addr: SocketAddr, source: Ipv4Addr, made: Arc<AtomicUsize>) {
    let requests = format!("GET /healthz HTTP/1.1\r\nHost: {addr}\r\n\r\n").repeat(1024);
    loop {
        let socket = TcpSocket::new_v4().unwrap();
        socket.bind(SocketAddr::new(source.into(), 0)).unwrap();
        // A small window: the server's writes wait after a few answers.
        socket.set_recv_buffer_size(4096).unwrap();
        if let Ok(mut stream) = socket.connect(addr).await {
            made.fetch_add(1, Ordering::Relaxed);
            // Writes until the server stops reading, then waits on it until cut off.
            while stream.write_all(requests.as_bytes()).await.is_ok() {}
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Clients that pipeline requests and never read the answers, from two
/// addresses, take every connection slot and make their connections again
/// as soon as they are cut off; an honest client is still served each time
/// it comes, and SIGTERM stops `serve` within its drain timeout. (Before
/// writes had a time limit, the slots stayed taken for good and SIGTERM
/// waited on them.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_that_never_read_cannot_hold_the_listener_or_its_shutdown() {
    let app = spawn_app().await;
    let mut command = keyfence_command(&app, "serve");
    command
        .env("KEYFENCE_MAX_CONNECTIONS", "8")
        .env("KEYFENCE_MAX_CONNECTIONS_PER_ADDRESS", "4")
        .env("KEYFENCE_MAX_REQUESTS_PER_CONNECTION", "1000000")
        .env("KEYFENCE_WRITE_TIMEOUT_MS", "1000")
        .env("KEYFENCE_DRAIN_TIMEOUT_MS", "1500")
        // The attack shares this machine's cores: the rail has time to answer.
        .env("KEYFENCE_RAIL_TIMEOUT_MS", "3000")
        .env("KEYFENCE_LEASE_MS", "10000");
    let (mut serve, _logs) = ServeProcess::spawn_logged(command).await;
    let addr: SocketAddr = serve.url.trim_start_matches("http://").parse().unwrap();
    let sources = [Ipv4Addr::new(127, 0, 0, 2), Ipv4Addr::new(127, 0, 0, 3)];
    let made: Vec<Arc<AtomicUsize>> = (0..8).map(|_| Arc::default()).collect();
    let attackers: Vec<_> = made
        .iter()
        .enumerate()
        .map(|(i, made)| tokio::spawn(slow_reader(addr, sources[i % 2], made.clone())))
        .collect();
    tokio::time::sleep(Duration::from_secs(2)).await;

    for attempt in 0..3 {
        // A new connection each time: it waits in the backlog for a slot
        // like anyone's, behind the attackers' connections made before it
        // (each held until its writes have waited a second; the attack and
        // the server share this machine's two cores with other tests).
        let patient = Duration::from_secs(30);
        let honest = reqwest::Client::builder().timeout(patient).pool_max_idle_per_host(0).build().unwrap();
        let answer = honest
            .post(format!("{}/v1/payments", serve.url))
            .bearer_auth(&app.api_key)
            .header("Idempotency-Key", format!("honest-{attempt}"))
            .json(&payment(&format!("E2E-HONEST-{attempt}")))
            .send()
            .await
            .map(|r| r.status());
        assert_eq!(answer.ok(), Some(StatusCode::CREATED), "honest payment {attempt} was served");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    assert_eq!(app.e2.statement().await.len(), 3, "three payments at the rail");
    let metrics = app.http.get(format!("{}/metrics", serve.admin_url.as_deref().unwrap())).send().await.unwrap();
    let text = metrics.text().await.unwrap();
    let stalled = text
        .lines()
        .find_map(|l| l.strip_prefix("keyfence_connections_dropped_total{reason=\"write_stall\"} "))
        .map_or(0.0, |n| n.trim().parse::<f64>().unwrap());
    assert!(stalled >= 8.0, "every slow reader was cut off at least once: {stalled}");

    // Still under attack, SIGTERM: stopped within the drain timeout (and a
    // margin for a loaded machine).
    let asked = Instant::now();
    serve.signal("TERM").await;
    let stopped = tokio::time::timeout(Duration::from_secs(10), serve.exited()).await;
    assert!(stopped.is_ok_and(|s| s.success()), "serve exited cleanly on SIGTERM");
    assert!(asked.elapsed() < Duration::from_millis(1500 + 5000), "stopped in {:?}", asked.elapsed());
    for attacker in attackers {
        attacker.abort();
    }
    let made: Vec<usize> = made.iter().map(|m| m.load(Ordering::Relaxed)).collect();
    assert!(made.iter().all(|&n| n >= 2), "each slow reader was made to connect again: {made:?}");
}

/// A connection told to close at its age while a request is still in
/// flight (its body trickling in) is dropped once the drain timeout has
/// passed, not when the request ends (the body's own limit, a minute here).
#[tokio::test]
async fn a_connection_past_its_age_and_drain_is_dropped_whatever_it_is_doing() {
    let app = spawn_app_with(|s| {
        s.max_connection_age = Duration::from_millis(1000);
        s.drain_timeout = Duration::from_millis(1000);
        s.body_timeout = Duration::from_secs(60);
    })
    .await;
    let addr: SocketAddr = app.url.trim_start_matches("http://").parse().unwrap();
    let mut stream = TcpStream::connect(addr).await.unwrap();
    let opened = Instant::now();
    let head = format!(
        "POST /v1/payments HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {}\r\nIdempotency-Key: slow-body\r\n\
         Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{{",
        app.api_key
    );
    stream.write_all(head.as_bytes()).await.unwrap();
    let mut answer = Vec::new();
    let ended = tokio::time::timeout(Duration::from_secs(8), stream.read_to_end(&mut answer)).await;
    assert!(ended.is_ok(), "the connection was dropped");
    let ended = opened.elapsed();
    assert!(ended >= Duration::from_millis(1900), "not before its age and drain: {ended:?}");
    assert_eq!(app.count("requests").await, 0, "nothing was done");
}

/// A keep-alive connection idle between requests stays open past the head
/// clock (a load balancer reusing it must find it open) and closes after
/// its own idle clock; a head begun after idling still has only the head
/// clock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_keep_alive_connection_outlasts_the_header_timeout_but_not_its_own() {
    let app = spawn_app_with(|s| {
        s.header_timeout = Duration::from_millis(500);
        s.idle_timeout = Duration::from_secs(3);
    })
    .await;
    let host = app.url.trim_start_matches("http://").to_owned();
    let get = format!("GET /healthz HTTP/1.1\r\nHost: {host}\r\n\r\n");
    let mut chunk = [0_u8; 4096];
    let mut stream = TcpStream::connect(&host).await.unwrap();
    for round in 0..2 {
        stream.write_all(get.as_bytes()).await.unwrap();
        let n = tokio::time::timeout(Duration::from_secs(5), stream.read(&mut chunk)).await.unwrap().unwrap();
        assert!(String::from_utf8_lossy(&chunk[..n]).starts_with("HTTP/1.1 200"), "round {round}: closed while idle");
        // Three head clocks of idling.
        tokio::time::sleep(Duration::from_millis(1500)).await;
    }
    // Idle 1.5 s of 3; a head begins and stalls: cut at the head clock.
    stream.write_all(b"GET /healthz HTTP/1.1\r\n").await.unwrap();
    let begun = Instant::now();
    let n = tokio::time::timeout(Duration::from_secs(5), stream.read(&mut chunk)).await.unwrap().unwrap_or(0);
    assert_eq!(n, 0, "{}", String::from_utf8_lossy(&chunk[..n]));
    assert!(begun.elapsed() < Duration::from_millis(1400), "cut after {:?}, not by the head clock", begun.elapsed());

    // Idle after an answer that waited on the stores (its handler yielded).
    let mut idle = TcpStream::connect(&host).await.unwrap();
    let read = format!(
        "GET /v1/idempotency-keys/never-used HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {}\r\n\r\n",
        app.api_key
    );
    idle.write_all(read.as_bytes()).await.unwrap();
    let n = tokio::time::timeout(Duration::from_secs(5), idle.read(&mut chunk)).await.unwrap().unwrap();
    assert!(
        String::from_utf8_lossy(&chunk[..n]).starts_with("HTTP/1.1 404"),
        "{}",
        String::from_utf8_lossy(&chunk[..n])
    );
    let answered = Instant::now();
    let n = tokio::time::timeout(Duration::from_secs(10), idle.read(&mut chunk)).await.unwrap().unwrap_or(0);
    assert_eq!(n, 0);
    let lasted = answered.elapsed();
    assert!(lasted >= Duration::from_millis(2500) && lasted < Duration::from_secs(6), "idle for {lasted:?}, of 3 s");
}

/// A connection idle at its age is not closed under its client (a load
/// balancer may be sending on it at that moment): its next answer says
/// `Connection: close`, and the connection closes behind it.
#[tokio::test]
async fn a_connection_idle_at_its_age_closes_after_its_next_answer_not_under_it() {
    let app = spawn_app_with(|s| {
        s.max_connection_age = Duration::from_millis(500);
        s.idle_timeout = Duration::from_secs(10);
    })
    .await;
    let host = app.url.trim_start_matches("http://").to_owned();
    let get = format!("GET /healthz HTTP/1.1\r\nHost: {host}\r\n\r\n");
    let mut chunk = [0_u8; 4096];
    let mut stream = TcpStream::connect(&host).await.unwrap();
    stream.write_all(get.as_bytes()).await.unwrap();
    let n = tokio::time::timeout(Duration::from_secs(5), stream.read(&mut chunk)).await.unwrap().unwrap();
    assert!(!String::from_utf8_lossy(&chunk[..n]).to_lowercase().contains("connection: close"));
    tokio::time::sleep(Duration::from_millis(1000)).await;
    stream.write_all(get.as_bytes()).await.unwrap();
    let n = tokio::time::timeout(Duration::from_secs(5), stream.read(&mut chunk)).await.unwrap().unwrap_or(0);
    let head = String::from_utf8_lossy(&chunk[..n]).to_lowercase();
    assert!(
        head.starts_with("http/1.1 200") && head.contains("connection: close"),
        "closed under its client: {head:?}"
    );
    let after = tokio::time::timeout(Duration::from_secs(5), stream.read(&mut chunk)).await.unwrap().unwrap_or(0);
    assert_eq!(after, 0, "closed behind its answer");
}
