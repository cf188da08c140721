//! `keyfence inbox settle`: a person ends a rail notification the region
//! kept for them (it named no instruction of the ledger, or could not take
//! effect here: a return overlapping refunds), or one still waiting to be
//! handed to another region (which cannot be asked), once they have
//! settled it with the rail, saying what they did. The reconciler lists
//! such messages, and alerts on them, until then.

use anyhow::Context;
use clap::{Args, Subcommand};
use keyfence::ledger::Ledger;
use keyfence::ledger::LedgerSettings;

#[derive(Subcommand)]
pub enum InboxCommand {
    /// End a notification kept for a person (or waiting to be handed on), once settled with the rail.
    Settle(SettleArgs),
}

#[derive(Args)]
pub struct SettleArgs {
    /// The rail that sent it (its name in the notification path: e1, e2).
    #[arg(long)]
    rail: String,
    /// The notification's id (its `webhook-id`, as `keyfence reconcile` lists it).
    #[arg(long)]
    message: String,
    /// What was done about it, kept with the message.
    #[arg(long, value_parser = non_empty)]
    note: String,
    /// Print what was settled as JSON instead of a sentence.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    ledger: LedgerSettings,
}

fn non_empty(raw: &str) -> Result<String, String> {
    let note = raw.trim();
    if note.is_empty() { Err("say what was done about it".into()) } else { Ok(note.to_owned()) }
}

impl InboxCommand {
    pub async fn run(self) -> anyhow::Result<()> {
        let Self::Settle(args) = self;
        let ledger = Ledger::connect(&args.ledger).await.context("connecting to the ledger")?;
        let settled = ledger.settle_for_person(&args.rail, &args.message, &args.note).await?.with_context(|| {
            format!("no message {} from {} waits for a person in this ledger", args.message, args.rail)
        })?;
        if args.json {
            println!("{}", serde_json::to_string_pretty(&settled)?);
        } else {
            println!(
                "settled message {} from {} ({}), kept because: {}; noted: {}",
                settled.message_id,
                settled.rail,
                settled.kind,
                settled.kept_because.as_deref().unwrap_or("-"),
                settled.note
            );
            if settled.kind == "returned" {
                println!("a payment a return froze stays frozen: no refund of it begins");
            }
        }
        Ok(())
    }
}
