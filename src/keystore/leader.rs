//! Leadership of a job that one instance at a time should run (the expiry
//! sweep scans the whole global table: every instance of every region
//! doing it each round would multiply that by the fleet). A job's leader
//! holds a lease, one control item of the key table
//! (`control#leader#{job}`: who, and until when), taken by a conditional
//! write that succeeds only where the lease is free, has run out, or is
//! already the taker's, and renewed by its holder while it works. Leases
//! are reckoned on each instance's clock; a holder that stops is replaced
//! once its lease runs out. Two instances may both run the job only where
//! clocks disagree by more than a lease, or a renewal fails and its holder
//! has not yet stopped: the jobs led this way are safe to run twice, and
//! leadership saves work, never guards correctness.

use std::time::Duration;

use aws_sdk_dynamodb::Client;
use aws_sdk_dynamodb::error::ProvideErrorMetadata;
use aws_sdk_dynamodb::types::AttributeValue;

use super::KeyStoreError;
use super::failure::store_error;
use super::item::CONTROL_PREFIX;
use crate::domain::Millis;

/// One instance's standing for one job.
#[derive(Clone, Debug)]
pub struct Leader {
    client: Client,
    table: String,
    job: &'static str,
    holder: String,
}

impl Leader {
    /// This process's standing for `job` over the key table `table`, as
    /// the instance named `instance`: the lease is held under the name and
    /// a token of this process's own, so two instances given one name (or
    /// a default name that repeats across machines) never both lead.
    pub fn new(client: Client, table: impl Into<String>, job: &'static str, instance: &str) -> Self {
        let holder = format!("{instance}#{}", uuid::Uuid::new_v4().simple());
        Self { client, table: table.into(), job, holder }
    }

    /// Whether this instance leads the job until `now + term`: the lease
    /// taken (free, run out, its own, or running out absurdly late, past
    /// two terms from now: written on a clock far ahead, or by a hand that
    /// meant to keep it) or held by another.
    pub async fn lead(&self, now: Millis, term: Duration) -> Result<bool, KeyStoreError> {
        let sent = self
            .client
            .put_item()
            .table_name(&self.table)
            .item("pk", AttributeValue::S(format!("{CONTROL_PREFIX}leader#{}", self.job)))
            .item("holder", AttributeValue::S(self.holder.clone()))
            .item("until", AttributeValue::N(now.plus(term).get().to_string()))
            .condition_expression("attribute_not_exists(pk) OR #until < :now OR #until > :far OR holder = :me")
            .expression_attribute_names("#until", "until")
            .expression_attribute_values(":now", AttributeValue::N(now.get().to_string()))
            .expression_attribute_values(":far", AttributeValue::N(now.plus(term * 2).get().to_string()))
            .expression_attribute_values(":me", AttributeValue::S(self.holder.clone()))
            .send()
            .await;
        match sent {
            Ok(_) => Ok(true),
            Err(e) if e.code() == Some("ConditionalCheckFailedException") => Ok(false),
            Err(e) => Err(store_error(e)),
        }
    }
}
