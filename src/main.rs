//! The `keyfence` binary: parses the command line and runs it (`cli`).

mod cli;

use std::process::ExitCode;

use clap::{CommandFactory as _, FromArgMatches as _};

#[tokio::main]
async fn main() -> anyhow::Result<ExitCode> {
    let matches = cli::Cli::command().get_matches();
    if let Some(flag) = cli::passwords_on_command_line(&matches).first() {
        let why = format!(
            "{flag} holds a password or a credential: every user of this machine can read a command line; give \
             the URL through the environment (DATABASE_URL, KEYFENCE_RAIL_PROXY) instead"
        );
        cli::Cli::command().error(clap::error::ErrorKind::ArgumentConflict, why).exit();
    }
    let cli = cli::Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    let telemetry = keyfence::telemetry::init()?;
    #[cfg(feature = "failpoints")]
    let _failpoints = keyfence::failpoint::from_env();
    let outcome = cli.run(&matches).await;
    telemetry.shutdown().await;
    outcome
}
