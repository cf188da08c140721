//! `keyfence pay --file`, the real binary against a real front door: a
//! file killed halfway and submitted again pays every line once, a third
//! submission finds everything done, and a malformed line stops the whole
//! file before anything is sent.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use crate::app::{TestApp, spawn_app_with};
use crate::process::keyfence_command;

const HEADER: &str = "client_ref,amount_minor,currency,debtor_account,creditor_account,end_to_end_id,remittance_info\n";

fn scratch() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("keyfence-batch-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn line(i: usize) -> String {
    format!("ref-{i},{},EUR,DE89370400440532013000,FR1420041010050500013M02606,BATCH-{i},line {i}\n", 100 + i)
}

fn pay_file(app: &TestApp, file: &Path, results: &Path) -> tokio::process::Command {
    let mut command = keyfence_command(app, "pay");
    command
        .args(["--file", file.to_str().unwrap(), "--url", &app.url, "-c", "16", "--json"])
        .args(["--results", results.to_str().unwrap()])
        .env("KEYFENCE_API_KEY", &app.api_key)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    command
}

fn lines_in(path: &Path) -> usize {
    std::fs::read_to_string(path).map_or(0, |text| text.lines().count().saturating_sub(1))
}

/// Runs a submission to its end: its exit code and its JSON summary.
async fn submit(app: &TestApp, file: &Path, results: &Path) -> (i32, serde_json::Value) {
    let output = pay_file(app, file, results).output().await.unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    let summary = serde_json::from_str(stdout.trim())
        .unwrap_or_else(|e| panic!("{e}: {stdout} {}", String::from_utf8_lossy(&output.stderr)));
    (output.status.code().unwrap_or(-1), summary)
}

async fn count(app: &TestApp, sql: &str) -> i64 {
    sqlx::query_scalar(sqlx::AssertSqlSafe(sql)).fetch_one(app.db.ledger.pool()).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_killed_halfway_and_submitted_again_pays_every_line_once() {
    let app = spawn_app_with(|s| s.recovery_interval_ms = 500).await;
    let dir = scratch();
    let file = dir.join("payments.csv");
    std::fs::write(&file, HEADER.to_owned() + &(0..1000).map(line).collect::<String>()).unwrap();
    let results = dir.join("results.csv");

    // First run: killed (SIGKILL) about halfway.
    let mut first = pay_file(&app, &file, &results).spawn().unwrap();
    // (The test suite shares the emulator: allow for it being busy.)
    let deadline = tokio::time::Instant::now() + Duration::from_secs(180);
    while lines_in(&results) < 500 {
        assert!(tokio::time::Instant::now() < deadline, "half the file was not paid within 180 s");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    first.start_kill().unwrap();
    first.wait().await.unwrap();
    let paid_before = app.e2.statement().await.len();
    assert!((500..1000).contains(&paid_before), "killed halfway: {paid_before} paid");

    // Second run: finishes the rest.
    let (code, summary) = submit(&app, &file, &results).await;
    assert_eq!(code, 0, "{summary}");
    assert_eq!(summary["succeeded"], 1000, "{summary}");
    assert!(summary["already_done"].as_u64().unwrap() >= 500, "{summary}");
    assert_eq!(app.e2.statement().await.len(), 1000, "one instruction per line at the rail");
    assert_eq!(count(&app, "SELECT count(*) FROM payments").await, 1000, "one payment per line");
    assert_eq!(count(&app, "SELECT count(DISTINCT end_to_end_id) FROM payments").await, 1000);

    // Third run: everything is already done; nothing new anywhere.
    let (code, summary) = submit(&app, &file, &results).await;
    assert_eq!(code, 0, "{summary}");
    assert_eq!(summary["already_done"], 1000, "{summary}");
    assert_eq!(app.e2.statement().await.len(), 1000);
    assert_eq!(count(&app, "SELECT count(*) FROM payments").await, 1000);
    let written = std::fs::read_to_string(&results).unwrap();
    assert_eq!(written.lines().count(), 1001, "a header and one line per payment");
    assert!(written.lines().skip(1).all(|l| l.contains(",succeeded,") && l.ends_with(",true")), "{written}");
    assert_eq!(app.unbalanced_payments().await, 0);
}

#[tokio::test]
async fn a_copy_of_a_file_pays_nothing_again_and_another_file_id_pays_anew() {
    let app = spawn_app_with(|_| {}).await;
    let dir = scratch();
    let body = HEADER.to_owned() + &(0..5).map(line).collect::<String>();
    let (original, copy) = (dir.join("a.csv"), dir.join("copy-of-a.csv"));
    std::fs::write(&original, &body).unwrap();
    std::fs::write(&copy, &body).unwrap();
    let results = dir.join("results.csv");
    assert_eq!(submit(&app, &original, &results).await.0, 0);
    let (code, summary) = submit(&app, &copy, &results).await;
    assert_eq!((code, summary["already_done"].as_u64()), (0, Some(5)), "{summary}");
    assert_eq!(app.e2.statement().await.len(), 5);

    let mut again = pay_file(&app, &copy, &results);
    again.args(["--file-id", "february"]);
    let output = again.output().await.unwrap();
    assert_eq!(output.status.code(), Some(0), "{}", String::from_utf8_lossy(&output.stderr));
    assert_eq!(app.e2.statement().await.len(), 10, "a file declared as another pays again");
}

#[tokio::test]
async fn a_malformed_line_rejects_the_whole_file_before_anything_is_sent() {
    let app = spawn_app_with(|_| {}).await;
    let dir = scratch();
    let file = dir.join("payments.csv");
    let bad = "ref-x,12.50,EUR,DE89370400440532013000,FR1420041010050500013M02606,BATCH-X,\n";
    std::fs::write(&file, format!("{HEADER}{}{}{bad}{}", line(0), line(1), line(2))).unwrap();
    let output = pay_file(&app, &file, &dir.join("results.csv")).output().await.unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("line 4") && stderr.contains("amount_minor"), "{stderr}");
    assert!(stderr.contains("nothing was sent"), "{stderr}");
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(app.e2.statement().await.len(), 0);
    assert_eq!(count(&app, "SELECT count(*) FROM payments").await, 0);
}

/// The API key is never taken from the command line (every user of the
/// machine can read it there): `--api-key` is refused before anything is
/// sent; a key file works like the environment.
#[tokio::test]
async fn the_api_key_comes_from_a_file_or_the_environment_never_the_command_line() {
    let app = spawn_app_with(|_| {}).await;
    let dir = scratch();
    let file = dir.join("payments.csv");
    std::fs::write(&file, HEADER.to_owned() + &line(1)).unwrap();
    let results = dir.join("results.csv");

    let mut flagged = pay_file(&app, &file, &results);
    flagged.env_remove("KEYFENCE_API_KEY").args(["--api-key", &app.api_key]);
    let out = flagged.output().await.unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("KEYFENCE_API_KEY or in a file"), "says what to do");
    assert!(app.e2.statement().await.is_empty(), "nothing was sent");

    let key_file = dir.join("api-key");
    std::fs::write(&key_file, format!("{}\n", app.api_key)).unwrap();
    let mut from_file = pay_file(&app, &file, &results);
    from_file.env_remove("KEYFENCE_API_KEY").args(["--api-key-file", key_file.to_str().unwrap()]);
    let out = from_file.output().await.unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(app.e2.statement().await.len(), 1);
}

/// A declared file id holding the key's separator (with which the line `c`
/// of file `a:b` and the line `b:c` of file `a` would share a key) is
/// refused before anything is sent.
#[tokio::test]
async fn a_file_id_holding_the_separator_is_refused_and_nothing_is_sent() {
    let app = spawn_app_with(|_| {}).await;
    let dir = scratch();
    let file = dir.join("payments.csv");
    std::fs::write(&file, HEADER.to_owned() + &line(1)).unwrap();
    let mut run = pay_file(&app, &file, &dir.join("results.csv"));
    run.args(["--file-id", "a:b"]);
    let output = run.output().await.unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("holds no ':'"), "{stderr}");
    assert!(app.e2.statement().await.is_empty(), "nothing sent");
}

/// Payments and the API key never cross a network in clear: a region URL
/// that is plain http to another machine stops the run before anything is
/// sent.
#[tokio::test]
async fn a_region_url_in_clear_to_another_machine_is_refused_before_anything_is_sent() {
    let app = spawn_app_with(|_| {}).await;
    let dir = scratch();
    let file = dir.join("payments.csv");
    std::fs::write(&file, HEADER.to_owned() + &line(1)).unwrap();
    let results = dir.join("results.csv");
    let mut run = pay_file(&app, &file, &results);
    run.args(["--url", "http://pay.example"]);
    let output = run.output().await.unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "bad input, nothing sent: {stderr}");
    assert!(stderr.contains("http://pay.example") && stderr.contains("not https"), "{stderr}");
    assert!(!results.exists(), "no results: nothing was sent");
    assert!(app.e2.statement().await.is_empty());
}
