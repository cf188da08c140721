//! `DynamoKeyStore`: the key store on a DynamoDB table (AWS, LocalStack or the
//! bundled emulator, chosen only by endpoint). Each operation is one request;
//! retries are the SDK's own (configured in [`connect`]), which is why every
//! write recognises its own earlier success: a retried claim whose first
//! attempt landed finds an item with its own owner and treats it as won.

use std::collections::HashMap;
use std::time::Duration;

use aws_config::BehaviorVersion;
use aws_config::retry::RetryConfig;
use aws_config::stalled_stream_protection::StalledStreamProtectionConfig;
use aws_config::timeout::TimeoutConfig;
use aws_sdk_dynamodb::Client;
use aws_sdk_dynamodb::config::http::HttpResponse;
use aws_sdk_dynamodb::config::{Credentials, Region};
use aws_sdk_dynamodb::error::{ProvideErrorMetadata, SdkError};
use aws_sdk_dynamodb::types::{
    AttributeValue, PutRequest, ReturnValue, ReturnValuesOnConditionCheckFailure, WriteRequest,
};

use super::balance::{Balance, Concluded, Conclusion, Frozen, HeldBy, Hold, Holding};
use super::failure::{ConditionFailure, Failure, classify, store_error};
use super::item::{CONTROL_PREFIX, attr, decode, decode_stale, encode, encode_response, n, s, shard_name};
use super::{
    Claim, Finish, Handoff, Holder, INFLIGHT_INDEX, KeyItem, KeyState, KeyStore, KeyStoreError, KeyStoreSettings,
    Lease, Release, ScanPage, StaleKey, StoreFailure, balance, handoff,
};
use crate::domain::{Fence, Millis, Owner, ScopedKey};
use crate::metrics::Timer;
use uuid::Uuid;

type Attrs = HashMap<String, AttributeValue>;

/// The region a loopback endpoint is given when none is set.
const LOCAL_REGION: &str = "us-east-1";

/// The key table's client could not be made from the settings.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    #[error("no AWS region for the key table: set AWS_REGION (or --aws-region), or a region in the AWS profile")]
    NoRegion,
    #[error("AWS_MAX_ATTEMPTS={0} is not a number of attempts from 1 to 10")]
    MaxAttempts(String),
}

/// Attempts per request: keyfence's own setting, else `AWS_MAX_ATTEMPTS`,
/// else the SDK's standard 3. The SDK is never left to read retry settings
/// itself, which it would panic on where the AWS CLI accepts them (a
/// profile's `retry_mode = legacy`).
fn attempts(settings: &KeyStoreSettings) -> Result<u32, ConnectError> {
    if let Some(attempts) = settings.max_attempts {
        return Ok(attempts);
    }
    match std::env::var("AWS_MAX_ATTEMPTS") {
        Ok(raw) => raw.trim().parse().ok().filter(|n| (1..=10).contains(n)).ok_or(ConnectError::MaxAttempts(raw)),
        Err(_) => Ok(3),
    }
}

/// Builds the DynamoDB client every command uses. Region, credentials and
/// retries come from the SDK's own chains (environment, profile, web
/// identity, container and instance credentials), so keyfence runs on EKS,
/// ECS or EC2 as any AWS service does; settings given to keyfence override
/// them. Only a loopback endpoint (an emulator on this machine), or one
/// marked with `--aws-dummy-credentials`, is given made-up credentials and a
/// default region. Retries use the SDK's standard mode with a short first
/// back-off, and each attempt has a time limit, so a hung connection becomes
/// a retry rather than a hung request.
pub async fn connect(settings: &KeyStoreSettings) -> Result<Client, ConnectError> {
    let shared = sdk_config(settings).await?;
    let config = aws_sdk_dynamodb::config::Builder::from(&shared).interceptor(super::attempts::CountErrors);
    Ok(Client::from_conf(config.build()))
}

/// The AWS settings `connect` builds its client from, for the other AWS
/// services keyfence calls (KMS) to be reached the same way.
pub async fn sdk_config(settings: &KeyStoreSettings) -> Result<aws_config::SdkConfig, ConnectError> {
    let local = settings.local_endpoint();
    let retry =
        RetryConfig::standard().with_max_attempts(attempts(settings)?).with_initial_backoff(Duration::from_millis(25));
    // Every attempt is bounded whole by its timeout, so the SDK's watch on
    // stalled response bodies (a timer polled beside every body it reads)
    // guards nothing a key-store reply needs.
    let mut loader = aws_config::defaults(BehaviorVersion::latest())
        .retry_config(retry)
        .timeout_config(
            TimeoutConfig::builder()
                .connect_timeout(Duration::from_secs(3))
                .operation_attempt_timeout(settings.attempt_timeout)
                .build(),
        )
        .stalled_stream_protection(StalledStreamProtectionConfig::disabled());
    // A local endpoint never asks the instance metadata service for a region.
    match (settings.aws_region.as_ref().filter(|r| !r.is_empty()), local) {
        (Some(region), _) => loader = loader.region(Region::new(region.clone())),
        (None, true) => loader = loader.region(Region::new(LOCAL_REGION)),
        (None, false) => {}
    }
    if let Some(endpoint) = &settings.aws_endpoint_url {
        loader = loader.endpoint_url(endpoint);
    }
    let configured = ["AWS_ACCESS_KEY_ID", "AWS_PROFILE"].iter().any(|v| std::env::var_os(v).is_some());
    if (local || settings.dummy_credentials) && !configured {
        loader = loader.credentials_provider(Credentials::new("test", "test", None, None, "keyfence-local"));
    }
    let shared = loader.load().await;
    if shared.region().is_none() {
        return Err(ConnectError::NoRegion);
    }
    Ok(shared)
}

#[derive(Clone, Debug)]
pub struct DynamoKeyStore {
    client: Client,
    table: String,
}

impl DynamoKeyStore {
    pub fn new(client: Client, table: impl Into<String>) -> Self {
        Self { client, table: table.into() }
    }

    pub fn client(&self) -> &Client {
        &self.client
    }

    pub fn table(&self) -> &str {
        &self.table
    }

    /// Writes items unconditionally, 25 to a request: bulk loading for
    /// benchmarks and drills only, never for requests (it bypasses every
    /// condition the protocol relies on).
    pub async fn seed(&self, items: &[KeyItem]) -> Result<(), KeyStoreError> {
        for chunk in items.chunks(25) {
            let mut pending: Vec<WriteRequest> = chunk
                .iter()
                .map(|item| {
                    let put = PutRequest::builder().set_item(Some(encode(item))).build();
                    put.map(|p| WriteRequest::builder().put_request(p).build())
                })
                .collect::<Result<_, _>>()
                .map_err(|e| KeyStoreError::Fault(StoreFailure::of(e)))?;
            while !pending.is_empty() {
                let out = self
                    .client
                    .batch_write_item()
                    .request_items(&self.table, pending)
                    .send()
                    .await
                    .map_err(store_error)?;
                pending = out.unprocessed_items().and_then(|u| u.get(&self.table)).cloned().unwrap_or_default();
            }
        }
        Ok(())
    }

    fn pk(key: &ScopedKey) -> AttributeValue {
        s(key.partition_key())
    }

    /// A conditional write's result, a failed condition with the item it
    /// failed on. DynamoDB sends the item with the failure
    /// (`ReturnValuesOnConditionCheckFailure`); an implementation that does
    /// not (dynalite) leaves it to a consistent read here. The read sees
    /// that item or a later one, and every caller decides as it would on a
    /// write refused at the moment of the read:
    /// the condition was false then too unless the item changed, and a
    /// changed item is another owner's (taken, fenced out) or our own
    /// earlier delivery (recognised by fence and identity, as from
    /// DynamoDB). With DynamoDB a failure without an item means there was
    /// none, and the read finds none or a newer one: the same decisions.
    async fn settled<T, E>(&self, key: &ScopedKey, sent: Result<T, SdkError<E, HttpResponse>>) -> Result<T, Failure>
    where
        E: ConditionFailure + ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
    {
        match sent.map_err(classify) {
            Err(Failure::Condition(None)) => match self.read(key).await {
                Ok(item) => Err(Failure::Condition(item)),
                Err(e) => Err(Failure::Store(e)),
            },
            settled => settled,
        }
    }

    /// The key's item as it is now (a strongly consistent read).
    async fn read(&self, key: &ScopedKey) -> Result<Option<Attrs>, KeyStoreError> {
        let out = self
            .client
            .get_item()
            .table_name(&self.table)
            .key(attr::PK, Self::pk(key))
            .consistent_read(true)
            .send()
            .await
            .map_err(store_error)?;
        Ok(out.item().cloned())
    }

    /// Every entry of in-flight index partition `partition` (whose sort key
    /// lies before `before`, if given), page after page.
    async fn query_index<T>(
        &self,
        partition: String,
        before: Option<Millis>,
        decode: impl Fn(&Attrs) -> Result<T, KeyStoreError>,
    ) -> Result<Vec<T>, KeyStoreError> {
        let condition =
            if before.is_some() { "#inflight = :partition AND #lease < :before" } else { "#inflight = :partition" };
        let mut found = Vec::new();
        let mut start = None;
        loop {
            let mut query = self
                .client
                .query()
                .table_name(&self.table)
                .index_name(INFLIGHT_INDEX)
                .key_condition_expression(condition)
                .expression_attribute_names("#inflight", attr::INFLIGHT)
                .expression_attribute_values(":partition", s(partition.as_str()))
                .set_exclusive_start_key(start);
            if let Some(before) = before {
                query = query
                    .expression_attribute_names("#lease", attr::LEASE_UNTIL)
                    .expression_attribute_values(":before", n(before.get()));
            }
            let page = query.send().await.map_err(store_error)?;
            for entry in page.items() {
                found.push(decode(entry)?);
            }
            start = page.last_evaluated_key().cloned();
            if start.is_none() {
                return Ok(found);
            }
        }
    }

    /// Sets the lease of the started item `holder` holds to end at `until`:
    /// a heartbeat, or a hand-back with the lease at zero.
    async fn set_lease(&self, key: &ScopedKey, holder: &Holder, until: Millis) -> Result<(), Failure> {
        let sent = self
            .client
            .update_item()
            .table_name(&self.table)
            .key(attr::PK, Self::pk(key))
            .update_expression("SET #lease = :until")
            .condition_expression(HELD_BY_ME)
            .set_expression_attribute_names(Some(names_for(&["#lease", "#fence", "#owner", "#state"])))
            .set_expression_attribute_values(Some(held_by(holder, [(":until", n(until.get()))])))
            .return_values_on_condition_check_failure(ReturnValuesOnConditionCheckFailure::AllOld)
            .send()
            .await;
        self.settled(key, sent).await.map(|_| ())
    }

    /// Installs `owner` under fence `seen + 1` with a new lease, if the item
    /// is started, still at `seen`, and `when` holds. A condition failure
    /// that shows this very replacement already made (a retried request
    /// whose first delivery landed, and `ours` agrees) is success.
    async fn replace_owner(
        &self,
        key: &ScopedKey,
        seen: Fence,
        owner: &Owner,
        lease: Lease,
        when: Replacement,
        ours: impl Fn(&KeyItem) -> bool,
    ) -> Result<KeyItem, KeyStoreError> {
        let mut values: Attrs = when.values.into_iter().map(|(name, value)| (name.to_owned(), value)).collect();
        values.extend([
            (":next".to_owned(), n(seen.next().get())),
            (":until".to_owned(), n(lease.until().get())),
            (":owner".to_owned(), s(owner.as_str())),
            (":started".to_owned(), s(KeyState::Started.as_str())),
            (":seen".to_owned(), n(seen.get())),
        ]);
        let update = format!("SET #fence = :next, #lease = :until, #owner = :owner{}{}", when.set, when.add);
        let condition = format!("#state = :started AND #fence = :seen AND {}", when.condition);
        let used: Vec<&str> = ["#fence", "#lease", "#owner", "#state", "#home", "#left"]
            .into_iter()
            .filter(|name| update.contains(name) || condition.contains(name))
            .collect();
        let sent = self
            .client
            .update_item()
            .table_name(&self.table)
            .key(attr::PK, Self::pk(key))
            .update_expression(update)
            .condition_expression(condition)
            .set_expression_attribute_names(Some(names_for(&used)))
            .set_expression_attribute_values(Some(values))
            .return_values(ReturnValue::AllNew)
            .return_values_on_condition_check_failure(ReturnValuesOnConditionCheckFailure::AllOld)
            .send()
            .await;
        match self.settled(key, sent).await {
            Ok(out) => decode(out.attributes().unwrap_or(&HashMap::new())),
            Err(failure) => ours_or_taken(failure, |current| {
                current.owner == *owner
                    && current.fence == seen.next()
                    && current.state == KeyState::Started
                    && ours(current)
            }),
        }
    }
}

/// What an owner replacement adds to the update and to its condition.
struct Replacement {
    set: &'static str,
    /// An `ADD` clause after the `SET` (or nothing).
    add: &'static str,
    condition: &'static str,
    values: Vec<(&'static str, AttributeValue)>,
}

/// Names used in every condition; `state` and `owner` are reserved words.
fn names() -> HashMap<String, String> {
    [
        ("#state", attr::STATE),
        ("#fence", attr::FENCE),
        ("#lease", attr::LEASE_UNTIL),
        ("#owner", attr::OWNER),
        ("#expires", attr::EXPIRES_AT),
        ("#home", attr::HOME_REGION),
        ("#left", attr::LEFT),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v.to_owned()))
    .collect()
}

/// The condition of a claim: the key was never seen, or its item is past
/// its retention and only waits to be reaped (see [`KeyItem::expired`]).
const ABSENT_OR_EXPIRED: &str = "attribute_not_exists(pk) OR (#state = :finished AND #expires < :now)";

/// The condition of every owner write: the item is still in flight and held
/// by this very attempt (its fence and its identity).
const HELD_BY_ME: &str = "#fence = :mine AND #owner = :me AND #state = :started";

impl KeyStore for DynamoKeyStore {
    #[tracing::instrument(skip_all, fields(otel.name = "PutItem", otel.kind = "client", db.system.name = "aws.dynamodb", db.operation.name = "PutItem", pk = %claim.key))]
    async fn claim(&self, claim: &Claim) -> Result<KeyItem, KeyStoreError> {
        let _timer = Timer::start("keyfence_key_store_seconds", &[("op", "claim")]);
        let item = KeyItem::claimed(claim);
        let sent = self
            .client
            .put_item()
            .table_name(&self.table)
            .set_item(Some(encode(&item)))
            .condition_expression(ABSENT_OR_EXPIRED)
            .set_expression_attribute_names(Some(names_for(&["#state", "#expires"])))
            .expression_attribute_values(":finished", s(KeyState::Finished.as_str()))
            .expression_attribute_values(":now", n(claim.gone_before.as_secs()))
            .return_values_on_condition_check_failure(ReturnValuesOnConditionCheckFailure::AllOld)
            .send()
            .await;
        match self.settled(&claim.key, sent).await {
            Ok(_) => Ok(item),
            Err(failure) => {
                ours_or_taken(failure, |existing| existing.owner == claim.owner && existing.fence == Fence::FIRST)
            }
        }
    }

    #[tracing::instrument(skip_all, fields(otel.name = "UpdateItem", otel.kind = "client", db.system.name = "aws.dynamodb", db.operation.name = "UpdateItem", pk = %key, seen = %seen))]
    async fn take_over(
        &self,
        key: &ScopedKey,
        seen: Fence,
        owner: &Owner,
        lease: Lease,
    ) -> Result<KeyItem, KeyStoreError> {
        let _timer = Timer::start("keyfence_key_store_seconds", &[("op", "take_over")]);
        let when =
            Replacement { set: "", add: "", condition: "#lease < :now", values: vec![(":now", n(lease.now.get()))] };
        self.replace_owner(key, seen, owner, lease, when, |_| true).await
    }

    #[tracing::instrument(skip_all, fields(otel.name = "UpdateItem", otel.kind = "client", db.system.name = "aws.dynamodb", db.operation.name = "UpdateItem", pk = %key, seen = %seen, from, to))]
    async fn fail_over(
        &self,
        key: &ScopedKey,
        seen: Fence,
        owner: &Owner,
        lease: Lease,
        from: &str,
        to: &str,
    ) -> Result<KeyItem, KeyStoreError> {
        let _timer = Timer::start("keyfence_key_store_seconds", &[("op", "fail_over")]);
        // The region left joins the item's `left` set in the same write; a
        // request never moves back to a region it left.
        let when = Replacement {
            set: ", #home = :to",
            add: " ADD #left :from_set",
            condition: "#home = :from AND NOT contains(#left, :to)",
            values: vec![(":to", s(to)), (":from", s(from)), (":from_set", AttributeValue::Ss(vec![from.to_owned()]))],
        };
        self.replace_owner(key, seen, owner, lease, when, |current| {
            current.home_region == to && current.left.contains(from)
        })
        .await
    }

    #[tracing::instrument(skip_all, fields(otel.name = "UpdateItem", otel.kind = "client", db.system.name = "aws.dynamodb", db.operation.name = "UpdateItem", pk = %key, fence = %holder.fence))]
    async fn heartbeat(&self, key: &ScopedKey, holder: &Holder, lease: Lease) -> Result<Millis, KeyStoreError> {
        let _timer = Timer::start("keyfence_key_store_seconds", &[("op", "heartbeat")]);
        match self.set_lease(key, holder, lease.until()).await {
            Ok(()) => Ok(lease.until()),
            Err(failure) => Err(fenced_out(failure)?),
        }
    }

    #[tracing::instrument(skip_all, fields(otel.name = "UpdateItem", otel.kind = "client", db.system.name = "aws.dynamodb", db.operation.name = "UpdateItem", pk = %key, fence = %holder.fence))]
    async fn finish(&self, key: &ScopedKey, holder: &Holder, finish: &Finish) -> Result<KeyItem, KeyStoreError> {
        let _timer = Timer::start("keyfence_key_store_seconds", &[("op", "finish")]);
        let mut values = held_by(holder, [(":finished", s(KeyState::Finished.as_str()))]);
        values.insert(":expires".into(), n(finish.expires_at.as_secs()));
        values.extend(encode_response(&finish.response).into_iter().map(|(name, value)| (format!(":{name}"), value)));
        let sent = self
            .client
            .update_item()
            .table_name(&self.table)
            .key(attr::PK, Self::pk(key))
            .update_expression(format!(
                "SET #state = :finished, {st} = :{st}, {hd} = :{hd}, {bd} = :{bd}, {ex} = :expires REMOVE {inf}",
                st = attr::RESPONSE_STATUS,
                hd = attr::RESPONSE_HEADERS,
                bd = attr::RESPONSE_BODY,
                ex = attr::EXPIRES_AT,
                inf = attr::INFLIGHT,
            ))
            .condition_expression(HELD_BY_ME)
            .set_expression_attribute_names(Some(names_for(&["#state", "#fence", "#owner"])))
            .set_expression_attribute_values(Some(values))
            .return_values(ReturnValue::AllNew)
            .return_values_on_condition_check_failure(ReturnValuesOnConditionCheckFailure::AllOld)
            .send()
            .await;
        match self.settled(key, sent).await {
            Ok(out) => decode(out.attributes().unwrap_or(&HashMap::new())),
            // Our own earlier delivery may have landed before the SDK's
            // retry: finished under our fence *and* by us. Anyone else's
            // finished item is theirs, however its fence compares.
            Err(Failure::Condition(Some(current))) => {
                let current = decode(&current)?;
                let ours = current.state == KeyState::Finished
                    && current.fence == holder.fence
                    && current.owner == holder.owner;
                if ours { Ok(current) } else { Err(KeyStoreError::FencedOut(Some(Box::new(current)))) }
            }
            Err(failure) => Err(fenced_out(failure)?),
        }
    }

    #[tracing::instrument(skip_all, fields(otel.name = "UpdateItem", otel.kind = "client", db.system.name = "aws.dynamodb", db.operation.name = "UpdateItem", pk = %key, fence = %holder.fence, how = ?how))]
    async fn release(&self, key: &ScopedKey, holder: &Holder, how: Release) -> Result<(), KeyStoreError> {
        let _timer = Timer::start("keyfence_key_store_seconds", &[("op", "release")]);
        let how = if how == Release::Forget && holder.fence != Fence::FIRST { Release::Reopen } else { how };
        let sent = match how {
            Release::Forget | Release::Abandon => {
                let sent = self
                    .client
                    .delete_item()
                    .table_name(&self.table)
                    .key(attr::PK, Self::pk(key))
                    .condition_expression(HELD_BY_ME)
                    .set_expression_attribute_names(Some(names_for(&["#fence", "#owner", "#state"])))
                    .set_expression_attribute_values(Some(held_by(holder, [])))
                    .return_values_on_condition_check_failure(ReturnValuesOnConditionCheckFailure::AllOld)
                    .send()
                    .await;
                self.settled(key, sent).await.map(|_| ())
            }
            // A lease that ended long ago: the next actor resumes at once.
            Release::Reopen => self.set_lease(key, holder, Millis::new(0)).await,
        };
        match sent {
            Ok(()) => Ok(()),
            // Gone: our own earlier delivery deleted it, or it was forgotten
            // and nobody claimed it since. Either way nothing of anyone's
            // is left to protect. An item that exists is never read as ours
            // unless the condition (fence and identity) held.
            Err(Failure::Condition(None)) if how != Release::Reopen => Ok(()),
            Err(failure) => Err(fenced_out(failure)?),
        }
    }
    #[tracing::instrument(skip_all, fields(otel.name = "DeleteItem", otel.kind = "client", db.system.name = "aws.dynamodb", db.operation.name = "DeleteItem", pk = %key))]
    async fn delete_expired(&self, key: &ScopedKey, gone_before: Millis) -> Result<bool, KeyStoreError> {
        let _timer = Timer::start("keyfence_key_store_seconds", &[("op", "delete_expired")]);
        let sent = self
            .client
            .delete_item()
            .table_name(&self.table)
            .key(attr::PK, Self::pk(key))
            .condition_expression("#state = :finished AND #expires < :now")
            .set_expression_attribute_names(Some(names_for(&["#state", "#expires"])))
            .expression_attribute_values(":finished", s(KeyState::Finished.as_str()))
            .expression_attribute_values(":now", n(gone_before.as_secs()))
            .send()
            .await;
        match sent.map_err(classify) {
            Ok(_) => Ok(true),
            Err(Failure::Condition(_)) => Ok(false),
            Err(Failure::Store(e)) => Err(e),
        }
    }

    #[tracing::instrument(skip_all, fields(otel.name = "GetItem", otel.kind = "client", db.system.name = "aws.dynamodb", db.operation.name = "GetItem", pk = %key))]
    async fn get(&self, key: &ScopedKey) -> Result<Option<KeyItem>, KeyStoreError> {
        let _timer = Timer::start("keyfence_key_store_seconds", &[("op", "get")]);
        self.read(key).await?.as_ref().map(decode).transpose()
    }

    #[tracing::instrument(skip_all, fields(otel.name = "PutItem", otel.kind = "client", db.system.name = "aws.dynamodb", db.operation.name = "PutItem", pk = %item.key))]
    async fn restore(&self, item: &KeyItem) -> Result<(), KeyStoreError> {
        let _timer = Timer::start("keyfence_key_store_seconds", &[("op", "restore")]);
        let sent = self
            .client
            .put_item()
            .table_name(&self.table)
            .set_item(Some(encode(item)))
            .condition_expression("attribute_not_exists(pk)")
            .return_values_on_condition_check_failure(ReturnValuesOnConditionCheckFailure::AllOld)
            .send()
            .await;
        match self.settled(&item.key, sent).await {
            Ok(_) => Ok(()),
            Err(Failure::Condition(existing)) => {
                Err(KeyStoreError::Taken(existing.map(|e| decode(&e)).transpose()?.map(Box::new)))
            }
            Err(Failure::Store(e)) => Err(e),
        }
    }

    #[tracing::instrument(skip(self), fields(otel.name = "Scan", otel.kind = "client", db.system.name = "aws.dynamodb", db.operation.name = "Scan"))]
    async fn scan(&self, segment: u32, total: u32, cursor: Option<String>) -> Result<ScanPage, KeyStoreError> {
        let _timer = Timer::start("keyfence_key_store_seconds", &[("op", "scan")]);
        let start = cursor.map(|pk| HashMap::from([(attr::PK.to_owned(), s(pk))]));
        let page = self
            .client
            .scan()
            .table_name(&self.table)
            .segment(segment as i32)
            .total_segments(total as i32)
            .set_exclusive_start_key(start)
            .send()
            .await
            .map_err(store_error)?;
        let (mut items, mut balances) = (Vec::new(), Vec::new());
        for item in page.items() {
            let pk = item.get(attr::PK).and_then(|pk| pk.as_s().ok()).map(String::as_str).unwrap_or_default();
            match balance::name_of(pk) {
                Some(name) => balances.push((name.to_owned(), balance::decode(item)?)),
                None if pk.starts_with(CONTROL_PREFIX) => {}
                None => items.push(decode(item)?),
            }
        }
        let next = page.last_evaluated_key().and_then(|k| k.get(attr::PK)).and_then(|v| v.as_s().ok()).cloned();
        Ok(ScanPage { items, balances, next })
    }

    #[tracing::instrument(skip(self), fields(otel.name = "Query", otel.kind = "client", db.system.name = "aws.dynamodb", db.operation.name = "Query"))]
    async fn stale_in_flight(&self, shard: u64, now: Millis) -> Result<Vec<StaleKey>, KeyStoreError> {
        let _timer = Timer::start("keyfence_key_store_seconds", &[("op", "stale_in_flight")]);
        self.query_index(shard_name(shard), Some(now), decode_stale).await
    }

    #[tracing::instrument(skip_all, fields(otel.name = "PutItem", otel.kind = "client", db.system.name = "aws.dynamodb", db.operation.name = "PutItem", pk = %handoff.key, from = %handoff.from))]
    async fn hand_off(&self, handoff: &Handoff) -> Result<(), KeyStoreError> {
        let _timer = Timer::start("keyfence_key_store_seconds", &[("op", "hand_off")]);
        self.client
            .put_item()
            .table_name(&self.table)
            .set_item(Some(handoff::encode(handoff, Millis::now())))
            .send()
            .await
            .map(drop)
            .map_err(store_error)
    }

    #[tracing::instrument(skip(self), fields(otel.name = "Query", otel.kind = "client", db.system.name = "aws.dynamodb", db.operation.name = "Query"))]
    async fn handoffs(&self, from: &str, shard: u64) -> Result<Vec<Handoff>, KeyStoreError> {
        let _timer = Timer::start("keyfence_key_store_seconds", &[("op", "handoffs")]);
        self.query_index(handoff::index_partition(from, shard), None, |entry| handoff::decode(from, entry)).await
    }

    #[tracing::instrument(skip_all, fields(otel.name = "GetItem", otel.kind = "client", db.system.name = "aws.dynamodb", db.operation.name = "GetItem", pk = %key, from))]
    async fn handoff_of(&self, from: &str, key: &ScopedKey, created_at: Millis) -> Result<bool, KeyStoreError> {
        let _timer = Timer::start("keyfence_key_store_seconds", &[("op", "handoff_of")]);
        let out = self
            .client
            .get_item()
            .table_name(&self.table)
            .key(attr::PK, s(handoff::partition_key(from, key, created_at)))
            .consistent_read(true)
            .projection_expression(attr::PK)
            .send()
            .await
            .map_err(store_error)?;
        Ok(out.item().is_some())
    }

    #[tracing::instrument(skip_all, fields(otel.name = "DeleteItem", otel.kind = "client", db.system.name = "aws.dynamodb", db.operation.name = "DeleteItem", pk = %handoff.key, from = %handoff.from))]
    async fn forget_handoff(&self, handoff: &Handoff) -> Result<(), KeyStoreError> {
        let _timer = Timer::start("keyfence_key_store_seconds", &[("op", "forget_handoff")]);
        self.client
            .delete_item()
            .table_name(&self.table)
            .key(attr::PK, s(handoff.partition_key()))
            .send()
            .await
            .map(drop)
            .map_err(store_error)
    }
    #[tracing::instrument(skip_all, fields(otel.name = "UpdateItem", otel.kind = "client", db.system.name = "aws.dynamodb", db.operation.name = "UpdateItem", balance = %hold.balance, id = %by.id))]
    async fn hold(&self, hold: &Hold, by: &HeldBy, now: Millis) -> Result<Holding, KeyStoreError> {
        let _timer = Timer::start("keyfence_key_store_seconds", &[("op", "hold")]);
        balance::take(&self.client, &self.table, hold, by, now).await
    }

    #[tracing::instrument(skip_all, fields(otel.name = "UpdateItem", otel.kind = "client", db.system.name = "aws.dynamodb", db.operation.name = "UpdateItem", balance, by = %frozen.by))]
    async fn freeze(&self, balance: &str, total: i64, frozen: &Frozen) -> Result<(), KeyStoreError> {
        let _timer = Timer::start("keyfence_key_store_seconds", &[("op", "freeze")]);
        balance::freeze(&self.client, &self.table, balance, total, frozen).await
    }

    #[tracing::instrument(skip_all, fields(otel.name = "UpdateItem", otel.kind = "client", db.system.name = "aws.dynamodb", db.operation.name = "UpdateItem", balance, %id, how = ?how))]
    async fn conclude_hold(&self, balance: &str, id: Uuid, how: Conclusion) -> Result<Concluded, KeyStoreError> {
        let _timer = Timer::start("keyfence_key_store_seconds", &[("op", "conclude_hold")]);
        balance::conclude(&self.client, &self.table, balance, id, how).await
    }

    #[tracing::instrument(skip_all, fields(otel.name = "GetItem", otel.kind = "client", db.system.name = "aws.dynamodb", db.operation.name = "GetItem", balance))]
    async fn balance(&self, balance: &str) -> Result<Option<Balance>, KeyStoreError> {
        let _timer = Timer::start("keyfence_key_store_seconds", &[("op", "balance")]);
        balance::read(&self.client, &self.table, balance).await
    }
}

/// The values of [`HELD_BY_ME`] for `holder`, with an operation's own.
fn held_by<const N: usize>(holder: &Holder, own: [(&str, AttributeValue); N]) -> Attrs {
    let mut values: Attrs = own.into_iter().map(|(name, value)| (name.to_owned(), value)).collect();
    values.insert(":mine".into(), n(holder.fence.get()));
    values.insert(":me".into(), s(holder.owner.as_str()));
    values.insert(":started".into(), s(KeyState::Started.as_str()));
    values
}

/// DynamoDB rejects expression attribute names that the expression does not
/// use, so operations with fewer placeholders pass only theirs.
fn names_for(used: &[&str]) -> HashMap<String, String> {
    names().into_iter().filter(|(k, _)| used.contains(&k.as_str())).collect()
}

/// For a claim or an owner replacement, a failed condition is our own
/// earlier success (a retried request whose first delivery landed) when the
/// item shows it (`ours`); otherwise the key is taken.
fn ours_or_taken(failure: Failure, ours: impl Fn(&KeyItem) -> bool) -> Result<KeyItem, KeyStoreError> {
    match failure {
        Failure::Condition(Some(current)) => {
            let current = decode(&current)?;
            if ours(&current) { Ok(current) } else { Err(KeyStoreError::Taken(Some(Box::new(current)))) }
        }
        Failure::Condition(None) => Err(KeyStoreError::Taken(None)),
        Failure::Store(e) => Err(e),
    }
}

/// For fenced writes a failed condition means someone else owns the key now.
fn fenced_out(failure: Failure) -> Result<KeyStoreError, KeyStoreError> {
    match failure {
        Failure::Condition(current) => {
            Ok(KeyStoreError::FencedOut(current.map(|c| decode(&c)).transpose()?.map(Box::new)))
        }
        Failure::Store(e) => Err(e),
    }
}
