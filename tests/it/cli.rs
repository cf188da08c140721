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
    let protocol = ["--lease-ms", "--retention-hours", "--max-unknown-attempts", "--instance"];
    let rails = ["--e1-url", "--rail-timeout-ms"];
    let cases: [(&str, &[&str], Vec<&str>); 5] = [
        ("serve", &["--listen", "--lease-ms", "--e1-url", "--table", "--database-url"], vec![]),
        ("recover", &["--lease-ms", "--e1-url", "--table"], front_door.to_vec()),
        ("reconcile", &["--repair", "--lease-ms", "--table"], front_door.to_vec()),
        ("bench", &["--url", "--e1-url", "--table", "--database-url"], [&front_door[..], &protocol[..]].concat()),
        ("bench-reconcile", &["--sizes", "--region", "--table"], [&front_door[..], &protocol[..], &rails[..]].concat()),
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
