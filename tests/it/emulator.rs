//! The local DynamoDB must be linearizable, as real DynamoDB is, or every
//! race test above would prove nothing. Stock moto fails the first two
//! (double commits of one conditional transaction, acknowledged writes lost
//! beside transactions); `localstack/emulator` serves it behind one lock.
//! It also pages scans by bisecting to the start key instead of rereading
//! the table, and the last test holds that to DynamoDB's scan contract.

use aws_sdk_dynamodb::types::{AttributeValue, Put, TransactWriteItem};
use futures::future::join_all;
use keyfence::keystore::KeyStoreError;

use crate::harness::TestKeys;

const RACERS: usize = 100;
const ROUNDS: usize = 20;

fn s(v: impl Into<String>) -> AttributeValue {
    AttributeValue::S(v.into())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conditional_transactions_on_one_item_commit_once() {
    let keys = TestKeys::new().await;
    let client = keys.store.client();
    for round in 0..ROUNDS {
        let pk = format!("txn-race#{round}");
        let attempts = (0..RACERS).map(|i| {
            let put = Put::builder()
                .table_name(keys.store.table())
                .item("pk", s(&pk))
                .item("winner", s(i.to_string()))
                .condition_expression("attribute_not_exists(pk)")
                .build()
                .unwrap();
            client.transact_write_items().transact_items(TransactWriteItem::builder().put(put).build()).send()
        });
        let results = join_all(attempts).await;
        let committed = results.iter().filter(|r| r.is_ok()).count();
        for err in results.iter().filter_map(|r| r.as_ref().err()) {
            let code = aws_sdk_dynamodb::error::ProvideErrorMetadata::code(err);
            assert_eq!(code, Some("TransactionCanceledException"), "unexpected failure: {err:?}");
        }
        assert_eq!(committed, 1, "round {round}: {committed} transactions committed");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acknowledged_writes_beside_transactions_are_never_lost() {
    let keys = TestKeys::new().await;
    let client = keys.store.client();
    let table = keys.store.table();
    let plain = (0..300).map(|i| client.put_item().table_name(table).item("pk", s(format!("plain#{i}"))).send());
    let txns = (0..300).map(|i| {
        let put = Put::builder().table_name(table).item("pk", s(format!("txn#{i}"))).build().unwrap();
        client.transact_write_items().transact_items(TransactWriteItem::builder().put(put).build()).send()
    });
    let (plain, txns) = futures::join!(join_all(plain), join_all(txns));
    let acknowledged = plain.iter().filter(|r| r.is_ok()).count() + txns.iter().filter(|r| r.is_ok()).count();
    assert_eq!(acknowledged, 600, "some writes failed outright");

    let mut stored = 0;
    let mut start = None;
    loop {
        let page = client
            .scan()
            .table_name(table)
            .consistent_read(true)
            .set_exclusive_start_key(start)
            .send()
            .await
            .map_err(|e| KeyStoreError::Fault(keyfence::keystore::StoreFailure::of(e)))
            .unwrap();
        // The table's own control items (the region registry) are not the test's.
        stored += page.items().iter().filter(|i| i["pk"].as_s().is_ok_and(|pk| !pk.starts_with("control#"))).count();
        start = page.last_evaluated_key().cloned();
        if start.is_none() {
            break;
        }
    }
    assert_eq!(stored, acknowledged, "acknowledged writes were lost");
}

/// A paged, segmented scan (the reconciler's) returns every item that stays
/// in the table exactly once, while other writers add and remove items
/// between its pages.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn segmented_scans_return_each_item_once_while_the_table_changes() {
    const ITEMS: usize = 300;
    const SEGMENTS: i32 = 4;
    let keys = TestKeys::new().await;
    let client = keys.store.client();
    let table = keys.store.table();
    let puts = (0..ITEMS).map(|i| client.put_item().table_name(table).item("pk", s(format!("kept#{i:03}"))).send());
    assert!(join_all(puts).await.iter().all(|r| r.is_ok()), "loading the table failed");

    let mut seen = std::collections::HashMap::<String, usize>::new();
    let mut removed = std::collections::HashSet::new();
    let mut pages = 0;
    for segment in 0..SEGMENTS {
        let mut start = None;
        loop {
            let page = client
                .scan()
                .table_name(table)
                .segment(segment)
                .total_segments(SEGMENTS)
                .limit(7)
                .set_exclusive_start_key(start)
                .send()
                .await
                .unwrap();
            for item in page.items() {
                *seen.entry(item["pk"].as_s().unwrap().clone()).or_default() += 1;
            }
            pages += 1;
            let doomed = format!("kept#{:03}", (pages * 37) % ITEMS);
            client.delete_item().table_name(table).key("pk", s(&doomed)).send().await.unwrap();
            removed.insert(doomed);
            client.put_item().table_name(table).item("pk", s(format!("added#{pages}"))).send().await.unwrap();
            start = page.last_evaluated_key().cloned();
            if start.is_none() {
                break;
            }
        }
    }
    assert!(pages > ITEMS / 7, "the scan took {pages} pages: limit ignored?");
    let twice: Vec<_> = seen.iter().filter(|(_, n)| **n > 1).collect();
    assert!(twice.is_empty(), "returned more than once: {twice:?}");
    let missing: Vec<_> =
        (0..ITEMS).map(|i| format!("kept#{i:03}")).filter(|k| !removed.contains(k) && !seen.contains_key(k)).collect();
    assert!(missing.is_empty(), "items that stayed in the table were never returned: {missing:?}");
}
