//! The local DynamoDB must be linearizable, as real DynamoDB is, or every
//! race test above would prove nothing. Stock moto fails both of these
//! (double commits of one conditional transaction, acknowledged writes lost
//! beside transactions); `localstack/emulator` serves it behind one lock.

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
            .map_err(|e| KeyStoreError::Fault(e.to_string()))
            .unwrap();
        stored += page.items().len();
        start = page.last_evaluated_key().cloned();
        if start.is_none() {
            break;
        }
    }
    assert_eq!(stored, acknowledged, "acknowledged writes were lost");
}
