//! Each subcommand's `--help` offers the settings that subcommand uses, and
//! no others.

use tokio::process::Command;

async fn help(subcommand: &str) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_keyfence")).args([subcommand, "--help"]).output().await.unwrap();
    assert!(out.status.success());
    String::from_utf8(out.stdout).unwrap()
}

#[tokio::test]
async fn each_subcommand_offers_only_its_own_settings() {
    let front_door = ["--listen", "--body-limit", "--header-timeout-ms", "--max-connections", "--public-url"];
    let workers = ["--recovery-interval-ms", "--expire-interval-ms"];
    let cases: [(&str, &[&str], Vec<&str>); 3] = [
        ("serve", &["--listen", "--lease-ms", "--e1-url", "--table", "--database-url"], vec![]),
        ("recover", &["--lease-ms", "--e1-url", "--table"], front_door.to_vec()),
        ("reconcile", &["--repair", "--lease-ms", "--table"], front_door.to_vec()),
    ];
    for (subcommand, offered, absent) in cases {
        let text = help(subcommand).await;
        for flag in offered {
            assert!(text.contains(flag), "{subcommand} --help lacks {flag}");
        }
        for flag in absent {
            assert!(!text.contains(flag), "{subcommand} --help offers {flag}, which it does not use");
        }
    }
    for flag in workers {
        assert!(!help("recover").await.contains(flag) && !help("reconcile").await.contains(flag));
    }
}

/// The serving binary serves and operates: the benchmarks and the rail
/// simulator are `keyfence-tools`' commands, not its own.
#[tokio::test]
async fn the_serving_binary_offers_no_tools() {
    let out = Command::new(env!("CARGO_BIN_EXE_keyfence")).arg("--help").output().await.unwrap();
    let text = String::from_utf8(out.stdout).unwrap();
    for command in ["serve", "migrate", "reconcile", "pay"] {
        assert!(text.contains(command), "keyfence --help lacks {command}");
    }
    for tool in ["bench", "rail-sim"] {
        assert!(!text.contains(tool), "keyfence --help offers {tool}: {text}");
        let out = Command::new(env!("CARGO_BIN_EXE_keyfence")).args([tool, "--help"]).output().await.unwrap();
        assert!(!out.status.success(), "keyfence {tool} still runs");
    }
}

/// A ledger URL with a password is never taken from the command line
/// (every user of the machine can read it there): refused without being
/// repeated, and nothing declared. The same URL from a file works.
#[tokio::test]
async fn a_ledger_password_is_refused_on_the_command_line_and_taken_from_a_file() {
    let app = crate::app::spawn_app().await;
    let secret_url = "postgres://keyfence:hunter2-secret@127.0.0.1:5432/elsewhere";
    let out = crate::process::keyfence_command(&app, "regions")
        .args(["fail", "--region", "test-9", "--reason", "drill", "--ledger", secret_url])
        .output()
        .await
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("--ledger-file") && !stderr.contains("hunter2"), "{stderr}");
    let store = keyfence::regions::RegionStore::new(app.keys.store.client().clone(), app.keys.store.table());
    assert_eq!(store.read().await.unwrap().state_of("test-9").as_str(), "active", "nothing declared");

    let file = std::env::temp_dir().join(format!("keyfence-ledger-{}", uuid::Uuid::new_v4()));
    std::fs::write(&file, &app.db.url).unwrap();
    let out = crate::process::keyfence_command(&app, "regions")
        .args(["list", "--ledger-file", file.to_str().unwrap()])
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("ledger fence: open"), "{stdout}");
    std::fs::remove_file(file).unwrap();
}
