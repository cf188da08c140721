//! Pays one invoice exactly once, however often this program is run or
//! killed: the operation's key is kept in `pay-example.journal` before the
//! first attempt. Run it against `scripts/dev`:
//!
//! ```sh
//! KEYFENCE_API_KEY=... cargo run -p keyfence-client --example pay -- invoice-4711
//! ```
//!
//! `KEYFENCE_URL` (default `http://127.0.0.1:8080`) may list several regions,
//! comma-separated, to fail over in order.

use std::time::Duration;

use keyfence_client::{Client, OperationId, Outcome, PaymentRequest};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let urls = std::env::var("KEYFENCE_URL").unwrap_or_else(|_| "http://127.0.0.1:8080".into());
    let api_key = std::env::var("KEYFENCE_API_KEY").map_err(|_| "set KEYFENCE_API_KEY to a client's API key")?;
    let invoice = std::env::args().nth(1).unwrap_or_else(|| "invoice-4711".into());

    let client = Client::builder(urls.split(','), &api_key)
        .journal("pay-example.journal")
        .deadline(Duration::from_secs(30))
        .build()?;
    let request = PaymentRequest::new(1250, "EUR")
        .debtor_account("DE89370400440532013000")
        .creditor_account("FR1420041010050500013M02606")
        .end_to_end_id(invoice.to_uppercase())
        .remittance_info(format!("Invoice {invoice}"));
    let receipt = client.pay(&request, &OperationId::new(invoice)?).await?;
    let again = if receipt.replayed { " (paid before: this is the stored answer)" } else { "" };
    match receipt.outcome {
        Outcome::Succeeded { payment } => println!("paid {}{again}", payment.id),
        Outcome::Rejected { reason, .. } => println!("declined: {reason}{again}"),
        Outcome::Pending { .. } => println!("not final yet; run again later to learn the outcome"),
        other => println!("{other:?}"),
    }
    println!("idempotency key {}", receipt.idempotency_key);
    Ok(())
}
