//! `keyfence pay --file`: a file of payments paid exactly once, even when
//! run again, through the client library.

use std::process::ExitCode;

use anyhow::Context;
use clap::Args;
use keyfence::batch;

#[derive(Args)]
pub struct PayArgs {
    /// The payments: CSV with a header line, or JSON lines (.jsonl), with the fields
    /// client_ref, amount_minor, currency, debtor_account, creditor_account,
    /// end_to_end_id and remittance_info (may be empty).
    #[arg(long)]
    file: std::path::PathBuf,
    /// The front door; comma-separate several regions' URLs to fail over in order.
    #[arg(long, env = "KEYFENCE_URL", value_delimiter = ',', default_value = "http://127.0.0.1:8080")]
    url: Vec<String>,
    /// A file holding the client's API key; else KEYFENCE_API_KEY. Never the key itself as a flag:
    /// a command line is visible to every user of the machine.
    #[arg(long = "api-key-file", env = "KEYFENCE_API_KEY_FILE")]
    api_key_file: Option<std::path::PathBuf>,
    /// Refused: an API key on the command line (see --api-key-file).
    #[arg(long = "api-key", hide = true)]
    api_key_flag: Option<String>,
    /// The file's id, part of every line's key (default: the SHA-256 of its bytes).
    #[arg(long = "file-id", value_parser = batch::file::parse_file_id)]
    file_id: Option<String>,
    /// Payments in flight at once.
    #[arg(short = 'c', long, default_value_t = 8, value_parser = clap::value_parser!(u16).range(1..=256))]
    concurrency: u16,
    /// Where to write one CSV line per payment (default: FILE.results.csv).
    #[arg(long)]
    results: Option<std::path::PathBuf>,
    /// How long a line may stay unsettled before it is reported pending (seconds).
    #[arg(long = "deadline-secs", default_value_t = 60)]
    deadline_secs: u64,
    /// Print the summary as JSON.
    #[arg(long)]
    json: bool,
}

/// Exit status: 0 every line final, 1 some pending, 2 bad input (nothing sent
/// when the file does not validate).
pub async fn pay(args: PayArgs) -> anyhow::Result<ExitCode> {
    let bytes = std::fs::read(&args.file).with_context(|| format!("reading {}", args.file.display()))?;
    let file_id = batch::file::file_id(&bytes, args.file_id.as_deref());
    let items = match batch::file::read(&args.file, &bytes, &file_id) {
        Ok(items) => items,
        Err(invalid) => {
            eprintln!("keyfence pay: {} does not validate; nothing was sent.\n{invalid}", args.file.display());
            return Ok(ExitCode::from(2));
        }
    };
    let beside_the_file = || {
        let mut results = args.file.clone().into_os_string();
        results.push(".results.csv");
        std::path::PathBuf::from(results)
    };
    let api_key = match api_key(args.api_key_flag.is_some(), args.api_key_file.as_deref()) {
        Ok(key) => key,
        Err(why) => {
            eprintln!("keyfence pay: {why}; nothing was sent.");
            return Ok(ExitCode::from(2));
        }
    };
    let submission = batch::Submission {
        regions: args.url,
        api_key,
        concurrency: usize::from(args.concurrency),
        deadline: std::time::Duration::from_secs(args.deadline_secs),
        results: args.results.unwrap_or_else(beside_the_file),
    };
    let summary = match batch::submit(items, file_id, &submission).await {
        Ok(summary) => summary,
        // A client that cannot be built sends nothing: bad input, like a file that does not validate.
        Err(e) if e.downcast_ref::<keyfence_client::BuildError>().is_some() => {
            eprintln!("keyfence pay: {e}; nothing was sent.");
            return Ok(ExitCode::from(2));
        }
        Err(e) => return Err(e),
    };
    if args.json {
        println!("{}", serde_json::to_string(&summary)?);
    } else {
        println!("{summary}");
    }
    Ok(ExitCode::from(summary.exit_code()))
}

/// The client's API key, from `file` or else `KEYFENCE_API_KEY`; never
/// from a flag (`flagged`: one was given), which every user of the machine
/// could read in the process list.
pub fn api_key(flagged: bool, file: Option<&std::path::Path>) -> Result<String, String> {
    if flagged {
        return Err("an API key is not taken from the command line, where every user of the machine can read it: \
                    put it in KEYFENCE_API_KEY or in a file named by --api-key-file"
            .into());
    }
    let key = match file {
        Some(file) => std::fs::read_to_string(file)
            .map_err(|e| format!("cannot read the API key from {}: {e}", file.display()))?
            .trim()
            .to_owned(),
        None => std::env::var("KEYFENCE_API_KEY")
            .map(|key| key.trim().to_owned())
            .map_err(|_| "no API key: set KEYFENCE_API_KEY or --api-key-file")?,
    };
    if key.is_empty() { Err("the API key is empty".into()) } else { Ok(key) }
}
