//! `keyfence-tools`: what runs beside the service, never inside it. The
//! benchmarks (`bench`, `bench-reconcile`), which write their figures to a
//! file and can draw them, and the rail simulator (`rail-sim`) that stands
//! in for the external systems locally. The serving binary, `keyfence`,
//! carries none of this.

mod bench;
mod commands;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "keyfence-tools", version, about = "keyfence's benchmarks and rail simulator")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run a rail simulator standing in for an external system (E1 or E2).
    ///
    /// POST /v1/instructions (honours Idempotency-Key), GET /v1/instructions/{key},
    /// GET /v1/statement (applied), GET /v1/declines (declined);
    /// PUT/DELETE /v1/faults {"latency_ms", "error_rate", "timeout_after_apply_rate"};
    /// PUT/DELETE /v1/rules {"decline_creditor_accounts": [...], "max_amount_minor": N}:
    /// matching instructions are declined with 402 and a reason code.
    RailSim(commands::RailSimArgs),
    /// Measure a running front door against the floor of its store and rail calls.
    Bench(Box<commands::BenchArgs>),
    /// Measure the reconciler's scan and repair rates at several table sizes.
    BenchReconcile(Box<commands::BenchReconcileArgs>),
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let telemetry = keyfence::telemetry::init()?;
    let outcome = match cli.command {
        Command::RailSim(args) => commands::rail_sim(args).await,
        Command::Bench(args) => commands::bench(*args).await,
        Command::BenchReconcile(args) => commands::bench_reconcile(*args).await,
    };
    telemetry.shutdown().await;
    outcome
}
