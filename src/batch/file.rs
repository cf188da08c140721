//! A payments file, read and checked whole before anything is sent.
//!
//! CSV with a header line naming the columns `client_ref, amount_minor,
//! currency, debtor_account, creditor_account, end_to_end_id,
//! remittance_info` (any order; `remittance_info` may be empty), or JSON
//! lines with the same fields. `client_ref` is the line's own reference and
//! must be unique in the file. Every line is checked by the same rules the
//! front door applies, so a file that validates here is not refused there.
//!
//! Each line's idempotency key is `uuid5(BATCH_NAMESPACE,
//! "{file_id}:{client_ref}")`, where the file id is the one declared with
//! `--file-id` or else the SHA-256 of the file's bytes. A file id holds no
//! `:` ([`parse_file_id`] refuses one), so the first `:` ends it and no two
//! lines of two files share a key. Submitting the file again, or a copy of
//! it, sends the same keys and pays nothing twice; a different file with
//! the same lines pays again only if its id differs. The server scopes keys
//! per client, so two clients' files never collide.

use std::collections::HashMap;
use std::path::Path;

use serde::Deserialize;
use sha2::{Digest, Sha256};
use uuid::Uuid;

use crate::domain::PaymentRequest;

/// The namespace of batch keys (a fixed, published constant).
pub const BATCH_NAMESPACE: Uuid = Uuid::from_u128(0x6b65_7966_656e_6365_6261_7463_6866_696c);

/// A declared file id: not empty, and without the `:` that ends it in
/// each line's key (with one, line `c` of file `a:b` and line `b:c` of file
/// `a` would share a key).
pub fn parse_file_id(raw: &str) -> Result<String, String> {
    if raw.is_empty() || raw.contains(':') {
        return Err("a file id is not empty and holds no ':' (it ends the id in every line's key)".into());
    }
    Ok(raw.to_owned())
}

/// One line of the file, checked, with the key it is sent under.
#[derive(Clone, Debug)]
pub struct Item {
    /// 1-based line number in the file (the header is line 1 of a CSV).
    pub line: usize,
    pub client_ref: String,
    pub key: Uuid,
    /// The payment as the client library sends it, checked by the front
    /// door's rules.
    pub payment: keyfence_client::PaymentRequest,
}

/// A file that did not validate: every problem found, by line.
#[derive(Debug, thiserror::Error)]
#[error("{}", .problems.iter().map(|p| format!("line {}: {}", p.line, p.message)).collect::<Vec<_>>().join("\n"))]
pub struct InvalidFile {
    pub problems: Vec<Problem>,
}

#[derive(Debug)]
pub struct Problem {
    pub line: usize,
    pub message: String,
}

/// The fields of a line as written.
#[derive(Deserialize)]
struct Row {
    client_ref: String,
    amount_minor: serde_json::Value,
    currency: String,
    debtor_account: String,
    creditor_account: String,
    end_to_end_id: String,
    #[serde(default)]
    remittance_info: Option<String>,
}

/// The file's id: the declared one, or the SHA-256 of its bytes.
pub fn file_id(bytes: &[u8], declared: Option<&str>) -> String {
    declared.map_or_else(|| hex::encode(Sha256::digest(bytes)), str::to_owned)
}

/// Reads and checks every line; nothing is returned unless all are good.
pub fn read(path: &Path, bytes: &[u8], file_id: &str) -> Result<Vec<Item>, InvalidFile> {
    let jsonl = match path.extension().and_then(|e| e.to_str()) {
        Some("jsonl" | "ndjson") => true,
        Some("csv") => false,
        _ => bytes.iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'{'),
    };
    let rows = if jsonl { json_rows(bytes) } else { csv_rows(bytes) };
    let mut problems = Vec::new();
    let mut items = Vec::new();
    let mut seen: HashMap<String, usize> = HashMap::new();
    for (line, row) in rows {
        match row.and_then(|row| check(row, file_id)) {
            Ok((client_ref, key, payment)) => {
                if let Some(first) = seen.insert(client_ref.clone(), line) {
                    problems
                        .push(Problem { line, message: format!("client_ref {client_ref:?} is also on line {first}") });
                }
                items.push(Item { line, client_ref, key, payment });
            }
            Err(message) => problems.push(Problem { line, message }),
        }
    }
    if items.is_empty() && problems.is_empty() {
        problems.push(Problem { line: 1, message: "the file holds no payments".into() });
    }
    if problems.is_empty() { Ok(items) } else { Err(InvalidFile { problems }) }
}

fn csv_rows(bytes: &[u8]) -> Vec<(usize, Result<Row, String>)> {
    let mut reader = csv::ReaderBuilder::new().trim(csv::Trim::All).from_reader(bytes);
    let mut rows = Vec::new();
    for record in reader.deserialize::<Row>() {
        match record {
            Ok(row) => {
                let line = rows.len() + 2;
                rows.push((line, Ok(row)));
            }
            Err(e) => {
                let line = e.position().map_or(rows.len() + 2, |p| p.line() as usize);
                let message = match e.kind() {
                    csv::ErrorKind::Deserialize { err, .. } => err.to_string(),
                    _ => e.to_string(),
                };
                rows.push((line, Err(message)));
            }
        }
    }
    rows
}

fn json_rows(bytes: &[u8]) -> Vec<(usize, Result<Row, String>)> {
    bytes
        .split(|b| *b == b'\n')
        .enumerate()
        .filter(|(_, line)| !line.iter().all(u8::is_ascii_whitespace))
        .map(|(i, line)| (i + 1, serde_json::from_slice::<Row>(line).map_err(|e| e.to_string())))
        .collect()
}

fn whole(amount: &str) -> String {
    format!("amount_minor must be a whole number of minor units (cents), not {amount}")
}

/// The front door's own checks, and the line's key.
fn check(row: Row, file_id: &str) -> Result<(String, Uuid, keyfence_client::PaymentRequest), String> {
    let client_ref = row.client_ref.trim().to_owned();
    if client_ref.is_empty() || client_ref.chars().any(char::is_control) {
        return Err("client_ref must be a non-empty reference without control characters".into());
    }
    // CSV gives every field as text; the API takes the amount as a number.
    let amount = match row.amount_minor {
        serde_json::Value::String(text) => {
            text.parse::<i64>().map(serde_json::Value::from).map_err(|_| whole(&text))?
        }
        serde_json::Value::Number(n) if n.as_i64().is_none() => return Err(whole(&n.to_string())),
        other => other,
    };
    let mut body = serde_json::json!({
        "amount_minor": amount,
        "currency": row.currency,
        "debtor_account": row.debtor_account,
        "creditor_account": row.creditor_account,
        "end_to_end_id": row.end_to_end_id,
    });
    if let Some(remittance) = row.remittance_info.filter(|r| !r.is_empty()) {
        body["remittance_info"] = remittance.into();
    }
    let checked = PaymentRequest::parse(body)
        .map_err(|errors| errors.iter().map(|e| format!("{} {}", e.field, e.message)).collect::<Vec<_>>().join("; "))?;
    let mut payment = keyfence_client::PaymentRequest::new(checked.amount_minor, checked.currency)
        .debtor_account(checked.debtor_account)
        .creditor_account(checked.creditor_account)
        .end_to_end_id(checked.end_to_end_id);
    payment.remittance_info = checked.remittance_info;
    let key = line_key(file_id, &client_ref);
    Ok((client_ref, key, payment))
}

/// The key of line `client_ref` of file `file_id` (which holds no `:`).
fn line_key(file_id: &str, client_ref: &str) -> Uuid {
    Uuid::new_v5(&BATCH_NAMESPACE, format!("{file_id}:{client_ref}").as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    const HEADER: &str =
        "client_ref,amount_minor,currency,debtor_account,creditor_account,end_to_end_id,remittance_info\n";
    const GOOD: &str = "r1,1250,EUR,DE89370400440532013000,FR1420041010050500013M02606,E2E-1,\n";

    #[test]
    fn the_same_lines_under_the_same_id_get_the_same_keys() {
        let file = format!("{HEADER}{GOOD}r2,99,EUR,DE89370400440532013000,FR1420041010050500013M02606,E2E-2,rent\n");
        let id = file_id(file.as_bytes(), None);
        let first = read(Path::new("a.csv"), file.as_bytes(), &id).unwrap();
        let again = read(Path::new("copy.csv"), file.as_bytes(), &file_id(file.as_bytes(), None)).unwrap();
        assert_eq!(first.iter().map(|i| i.key).collect::<Vec<_>>(), again.iter().map(|i| i.key).collect::<Vec<_>>());
        assert_eq!(first[1].payment.remittance_info.as_deref(), Some("rent"));
        assert_eq!(first[0].payment.remittance_info, None);
        let other = read(Path::new("a.csv"), file.as_bytes(), "another-id").unwrap();
        assert_ne!(first[0].key, other[0].key);
    }

    #[test]
    fn keys_of_file_ids_without_a_separator_stay_what_they_were() {
        let file = format!("{HEADER}{GOOD}");
        let by_hash = read(Path::new("a.csv"), file.as_bytes(), &file_id(file.as_bytes(), None)).unwrap();
        assert_eq!(by_hash[0].key.to_string(), "47f98ae6-bb3f-57e8-b564-8a6bc895be13");
        let declared = read(Path::new("a.csv"), file.as_bytes(), "february").unwrap();
        assert_eq!(declared[0].key.to_string(), "c9af03b7-d481-5804-b852-1bf2da6b0437");
    }

    #[test]
    fn a_file_id_with_the_separator_is_refused() {
        assert!(parse_file_id("a:b").is_err());
        assert!(parse_file_id("").is_err());
        assert_eq!(parse_file_id("february-2026").unwrap(), "february-2026");
    }

    proptest::proptest! {
        /// Two lines of two files with accepted ids never share a key, over
        /// an alphabet of little but separators.
        #[test]
        fn lines_of_files_with_accepted_ids_never_share_a_key(
            (a, x) in ("[a1]{1,4}", "[a:1]{1,6}"),
            (b, y) in ("[a1]{1,4}", "[a:1]{1,6}"),
        ) {
            proptest::prop_assume!((&a, &x) != (&b, &y));
            proptest::prop_assert_ne!(line_key(&a, &x), line_key(&b, &y));
        }
    }

    #[test]
    fn a_bad_line_is_reported_with_its_number() {
        let file = format!("{HEADER}{GOOD}r2,12x,EUR,DE89370400440532013000,FR1420041010050500013M02606,E2E-2,\n");
        let err = read(Path::new("a.csv"), file.as_bytes(), "f").unwrap_err();
        assert_eq!(err.problems.len(), 1, "{err}");
        assert_eq!(err.problems[0].line, 3, "{err}");
        assert!(err.problems[0].message.contains("12x"), "{err}");
    }

    #[test]
    fn duplicate_references_and_invalid_fields_are_refused() {
        let file =
            format!("{HEADER}{GOOD}{GOOD}r3,-5,EURO,DE89370400440532013000,FR1420041010050500013M02606,E2E-3,\n");
        let err = read(Path::new("a.csv"), file.as_bytes(), "f").unwrap_err();
        let lines: Vec<usize> = err.problems.iter().map(|p| p.line).collect();
        assert_eq!(lines, [3, 4], "{err}");
    }

    #[test]
    fn json_lines_read_like_csv() {
        let file = concat!(
            r#"{"client_ref":"r1","amount_minor":1250,"currency":"EUR","debtor_account":"DE89370400440532013000","#,
            r#""creditor_account":"FR1420041010050500013M02606","end_to_end_id":"E2E-1"}"#,
            "\n\n{\"client_ref\":\"r2\"}\n"
        );
        let err = read(Path::new("a.jsonl"), file.as_bytes(), "f").unwrap_err();
        assert_eq!(err.problems.len(), 1, "{err}");
        assert_eq!(err.problems[0].line, 3, "{err}");
    }
}
