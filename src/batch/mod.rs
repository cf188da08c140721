//! `keyfence pay --file`: the batch channel. A file of payments is read
//! and checked whole ([`file`]), then every line is paid through the
//! client library under the line's deterministic key, at most N at a time.
//! Each result is written to the results file as it comes, and a summary
//! ends the run.
//!
//! A run can be stopped at any moment (Ctrl-C, `kill -9`) and started again
//! with the same file: lines already paid answer with their stored result,
//! lines in flight finish under the same key, and the rest are paid, so
//! every line has exactly one payment.

pub mod file;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use futures::StreamExt;
use keyfence_client::{Client, Outcome, PayError, Receipt};
use serde::Serialize;

use file::Item;

/// Where and how to submit.
pub struct Submission {
    pub regions: Vec<String>,
    pub api_key: String,
    pub concurrency: usize,
    /// How long each line may stay unsettled before it is reported pending.
    pub deadline: Duration,
    pub results: PathBuf,
}

/// How a run ended, for people (`Display`) and machines (JSON).
#[derive(Debug, Default, Serialize)]
pub struct Summary {
    pub file_id: String,
    pub items: usize,
    pub succeeded: usize,
    pub rejected: usize,
    pub pending: usize,
    pub refused: usize,
    /// Lines whose final answer was a replay: paid by an earlier run.
    pub already_done: usize,
    pub seconds: f64,
    pub results: PathBuf,
}

impl Summary {
    /// 0 when every line is final, 1 when some are still pending, 2 when
    /// keyfence refused some (bad credentials, a key reused for other data).
    pub fn exit_code(&self) -> u8 {
        if self.refused > 0 {
            2
        } else if self.pending > 0 {
            1
        } else {
            0
        }
    }
}

impl std::fmt::Display for Summary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "{} lines of file {} in {:.1} s:", self.items, self.file_id, self.seconds)?;
        writeln!(f, "  succeeded  {:>7}", self.succeeded)?;
        writeln!(f, "  rejected   {:>7}", self.rejected)?;
        writeln!(f, "  pending    {:>7}  (not final yet; run the same file again to finish them)", self.pending)?;
        writeln!(f, "  refused    {:>7}  (see the reason in the results)", self.refused)?;
        writeln!(f, "  {} of them already done before this run", self.already_done)?;
        write!(f, "results: {}", self.results.display())
    }
}

/// One line of the results file.
#[derive(Serialize)]
struct Line<'a> {
    line: usize,
    client_ref: &'a str,
    idempotency_key: String,
    status: &'static str,
    payment_id: String,
    reason: String,
    already_done: bool,
}

/// Pays every item; returns the summary once each has an answer.
pub async fn submit(items: Vec<Item>, file_id: String, how: &Submission) -> anyhow::Result<Summary> {
    let client = Client::builder(&how.regions, &how.api_key).deadline(how.deadline).build()?;
    let mut results = csv::Writer::from_path(&how.results)?;
    let started = Instant::now();
    let progress = indicatif::ProgressBar::new(items.len() as u64);
    progress.set_style(
        indicatif::ProgressStyle::with_template("{bar:40} {pos}/{len} lines  {per_sec}  eta {eta}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let mut summary = Summary { file_id, items: items.len(), results: how.results.clone(), ..Summary::default() };
    let mut answers = futures::stream::iter(items)
        .map(|item| {
            let client = client.clone();
            async move {
                let answer = client.pay_with_key(&item.payment, &item.key.to_string()).await;
                (item, answer)
            }
        })
        .buffer_unordered(how.concurrency.max(1));
    while let Some((item, answer)) = answers.next().await {
        let row = tally(&mut summary, &item, answer);
        results.serialize(row)?;
        // Flushed per line: a run killed halfway leaves what it finished.
        results.flush()?;
        progress.inc(1);
    }
    progress.finish_and_clear();
    summary.seconds = started.elapsed().as_secs_f64();
    Ok(summary)
}

fn tally<'a>(summary: &mut Summary, item: &'a Item, answer: Result<Receipt, PayError>) -> Line<'a> {
    let mut row = Line {
        line: item.line,
        client_ref: &item.client_ref,
        idempotency_key: item.key.to_string(),
        status: "refused",
        payment_id: String::new(),
        reason: String::new(),
        already_done: false,
    };
    match answer {
        Ok(receipt) => {
            row.already_done = receipt.replayed;
            summary.already_done += usize::from(receipt.replayed);
            match receipt.outcome {
                Outcome::Succeeded { payment } => {
                    summary.succeeded += 1;
                    (row.status, row.payment_id) = ("succeeded", payment.id.to_string());
                }
                Outcome::Rejected { payment_id, reason } => {
                    summary.rejected += 1;
                    row.status = "rejected";
                    row.payment_id = payment_id.map(|id| id.to_string()).unwrap_or_default();
                    row.reason = reason;
                }
                Outcome::Pending { payment_id } => {
                    summary.pending += 1;
                    row.status = "pending";
                    row.payment_id = payment_id.map(|id| id.to_string()).unwrap_or_default();
                }
                // An outcome newer than this build: not known final, so the
                // line counts as pending and a later run asks again.
                other => {
                    summary.pending += 1;
                    row.status = "pending";
                    row.reason = format!("{other:?}");
                }
            }
        }
        Err(refused) => {
            summary.refused += 1;
            row.reason = refused.to_string();
        }
    }
    row
}
