//! `keyfence-tools`' commands: each `--help` offers the settings that tool
//! uses and no others, and a bench plots SVG without a font on the machine.

use std::process::Command;

fn help(tool: &str) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_keyfence-tools")).args([tool, "--help"]).output().unwrap();
    assert!(out.status.success(), "keyfence-tools {tool} --help failed");
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn each_tool_offers_only_its_own_settings() {
    let front_door = ["--listen", "--body-limit", "--header-timeout-ms", "--max-connections", "--public-url"];
    let protocol = ["--lease-ms", "--retention-hours", "--max-unknown-attempts", "--instance"];
    let rails = ["--e1-url", "--rail-timeout-ms"];
    let cases: [(&str, &[&str], Vec<&str>); 3] = [
        (
            "bench",
            &["--url", "--e1-url", "--table", "--database-url", "--plots"],
            [&front_door[..], &protocol[..]].concat(),
        ),
        ("bench-reconcile", &["--sizes", "--region", "--table"], [&front_door[..], &protocol[..], &rails[..]].concat()),
        (
            "rail-sim",
            &["--listen", "--name", "--dedup-window-ms", "--notify", "--notify-secret"],
            [&protocol[..], &rails[..], &["--table"][..]].concat(),
        ),
    ];
    for (tool, offered, absent) in cases {
        let text = help(tool);
        for flag in offered {
            assert!(text.contains(flag), "{tool} --help lacks {flag}");
        }
        for flag in absent {
            assert!(!text.contains(flag), "{tool} --help offers {flag}, which it does not use");
        }
    }
}
