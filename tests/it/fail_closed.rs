//! Nothing fails open: settings that would reach another machine in clear,
//! through a proxy nobody chose, or into the network from a client's
//! webhook are refused before anything starts, and a password is never
//! taken from a command line (nor repeated in the refusal).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use reqwest::StatusCode;

use crate::app::{payment, spawn_app};
use crate::process::{ServeProcess, keyfence_command};

/// The output of `command` run to its end (refused, it ends at once): its
/// status code and stderr.
async fn refused(mut command: tokio::process::Command) -> (Option<i32>, String) {
    let run = tokio::time::timeout(std::time::Duration::from_secs(20), command.output());
    let out = run.await.expect("the command was refused, not run").unwrap();
    (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned())
}

/// A proxy set in the environment (as a host's or a container's often is)
/// is not used for the rails: the payment is sent to the rail itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_proxy_in_the_environment_is_not_used_for_the_rails() {
    let app = spawn_app().await;
    let proxy = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let proxy_url = format!("http://{}", proxy.local_addr().unwrap());
    let reached = Arc::new(AtomicUsize::new(0));
    let counted = reached.clone();
    tokio::spawn(async move {
        while let Ok((connection, _)) = proxy.accept().await {
            counted.fetch_add(1, Ordering::Relaxed);
            drop(connection);
        }
    });
    let mut command = keyfence_command(&app, "serve");
    for variable in ["HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"] {
        command.env(variable, &proxy_url);
    }
    // The key table's client may use the environment's proxy (AWS's SDK
    // does); the emulator is named `localhost`, which the proxy is told to
    // leave alone, and the rails `127.0.0.1`, which it is not.
    let emulator = app.keys.settings.aws_endpoint_url.clone().unwrap().replace("127.0.0.1", "localhost");
    command.env("AWS_ENDPOINT_URL", emulator).env("NO_PROXY", "localhost").env("no_proxy", "localhost");
    command.env("KEYFENCE_WEBHOOK_INTERVAL_MS", "0");
    let mut serve = ServeProcess::spawn(command).await;
    let paid = app
        .http
        .post(format!("{}/v1/payments", serve.url))
        .bearer_auth(&app.api_key)
        .header("Idempotency-Key", "through-no-proxy")
        .json(&payment("E2E-NO-PROXY"))
        .send()
        .await
        .unwrap();
    assert_eq!(paid.status(), StatusCode::CREATED);
    assert_eq!(app.e2.statement().await.len(), 1, "paid at the rail");
    assert_eq!(reached.load(Ordering::Relaxed), 0, "the proxy was never asked");
    serve.terminate().await;
}

/// Rails in clear off this machine, a ledger reached without TLS required,
/// and webhooks into the network beside stores that are not local are
/// refused at start (exit status 2 or an error naming the setting), with
/// no password repeated.
#[tokio::test]
async fn settings_that_fail_open_are_refused_at_start() {
    let app = spawn_app().await;

    let mut in_clear = keyfence_command(&app, "serve");
    in_clear.env("KEYFENCE_E2_URL", "http://user:hunter2-secret@rail.example.com");
    let (code, stderr) = refused(in_clear).await;
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("KEYFENCE_E2_URL") && stderr.contains("https"), "{stderr}");
    assert!(!stderr.contains("hunter2"), "{stderr}");

    // Through a proxy, loopback is the proxy's own machine: in clear there too.
    let mut proxied = keyfence_command(&app, "serve");
    proxied.env("KEYFENCE_RAIL_PROXY", "http://proxy.example.com:3128");
    let (code, stderr) = refused(proxied).await;
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("KEYFENCE_E1_URL") && stderr.contains("proxy"), "{stderr}");

    // A ledger URL that does not parse is refused without being repeated.
    let mut unparsed = keyfence_command(&app, "migrate");
    unparsed.env("DATABASE_URL", "postgres://keyfence:hunter2-secret@ledger.example.com:port/keyfence");
    let (code, stderr) = refused(unparsed).await;
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("database-url") && !stderr.contains("hunter2"), "{stderr}");

    let mut ledger = keyfence_command(&app, "migrate");
    ledger.env("DATABASE_URL", "postgres://keyfence:hunter2-secret@ledger.example.com:5432/keyfence");
    let (code, stderr) = refused(ledger).await;
    assert_ne!(code, Some(0), "{stderr}");
    assert!(stderr.contains("sslmode=verify-full") && !stderr.contains("hunter2"), "{stderr}");

    let mut private = keyfence_command(&app, "serve");
    private.env("DATABASE_URL", "postgres://keyfence@ledger.example.com:5432/keyfence?sslmode=verify-full");
    let (code, stderr) = refused(private).await;
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("KEYFENCE_WEBHOOKS_ALLOW_PRIVATE"), "{stderr}");
}

/// A URL with a password on the command line is refused before anything
/// runs, and the password is not repeated.
#[tokio::test]
async fn no_command_takes_a_password_on_its_command_line() {
    let app = spawn_app().await;
    for (subcommand, args) in [
        ("migrate", vec!["--database-url", "postgres://keyfence:hunter2-secret@127.0.0.1:5432/elsewhere"]),
        ("serve", vec!["--database-url=postgres://keyfence:hunter2-secret@127.0.0.1:5432/elsewhere"]),
        ("serve", vec!["--rail-proxy", "http://user:hunter2-secret@127.0.0.1:3128"]),
        ("reconcile", vec!["--database-url", "postgres://keyfence:hunter2-secret@127.0.0.1:5432/elsewhere"]),
        ("migrate", vec!["--database-url", "postgres://keyfence@127.0.0.1:5432/elsewhere?password=hunter2-secret"]),
        ("serve", vec!["--rail-proxy", "http://hunter2-secret@127.0.0.1:3128"]),
    ] {
        let mut command = keyfence_command(&app, subcommand);
        command.args(&args);
        let (code, stderr) = refused(command).await;
        assert_eq!(code, Some(2), "{subcommand} {args:?}: {stderr}");
        assert!(stderr.contains("password") && !stderr.contains("hunter2"), "{stderr}");
    }
}
