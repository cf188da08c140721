//! How a key-store request failed, read from the SDK's error: its
//! condition did not hold (with the item as it stood, when the store
//! returns it) or the store itself failed, told apart as throttling,
//! unavailability (both transient) or a fault. Every write of the key
//! table, of keys and of balances alike, reads its failures here.

use std::collections::HashMap;

use aws_sdk_dynamodb::config::http::HttpResponse;
use aws_sdk_dynamodb::error::{ProvideErrorMetadata, SdkError};
use aws_sdk_dynamodb::operation::delete_item::DeleteItemError;
use aws_sdk_dynamodb::operation::put_item::PutItemError;
use aws_sdk_dynamodb::operation::update_item::UpdateItemError;
use aws_sdk_dynamodb::types::AttributeValue;

use super::{KeyStoreError, StoreFailure};

type Attrs = HashMap<String, AttributeValue>;

/// A failed request: either its condition did not hold (with the item as it
/// stood, when it exists) or the store itself failed.
pub(super) enum Failure {
    Condition(Option<Attrs>),
    Store(KeyStoreError),
}

/// The operations whose errors can be a failed condition.
pub(super) trait ConditionFailure {
    /// `Some(item)` if the error is a failed condition, with the old item.
    fn condition_item(&self) -> Option<Option<&Attrs>>;
}

impl ConditionFailure for PutItemError {
    fn condition_item(&self) -> Option<Option<&Attrs>> {
        match self {
            PutItemError::ConditionalCheckFailedException(e) => Some(e.item()),
            _ => None,
        }
    }
}

impl ConditionFailure for UpdateItemError {
    fn condition_item(&self) -> Option<Option<&Attrs>> {
        match self {
            UpdateItemError::ConditionalCheckFailedException(e) => Some(e.item()),
            _ => None,
        }
    }
}

impl ConditionFailure for DeleteItemError {
    fn condition_item(&self) -> Option<Option<&Attrs>> {
        match self {
            DeleteItemError::ConditionalCheckFailedException(e) => Some(e.item()),
            _ => None,
        }
    }
}

pub(super) fn classify<E>(err: SdkError<E, HttpResponse>) -> Failure
where
    E: ConditionFailure + ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
{
    if let Some(item) = err.as_service_error().and_then(ConditionFailure::condition_item) {
        return Failure::Condition(item.cloned());
    }
    Failure::Store(store_error(err))
}

/// Separates throttling and unavailability (transient, worth a client retry)
/// from faults (configuration or data problems).
pub(super) fn store_error<E>(err: SdkError<E, HttpResponse>) -> KeyStoreError
where
    E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
{
    let kind = match &err {
        SdkError::ServiceError(ctx) => match ctx.err().code() {
            Some("ProvisionedThroughputExceededException" | "RequestLimitExceeded" | "ThrottlingException") => {
                KeyStoreError::Throttled
            }
            // A write that raced another region's write on the same item
            // (multi-Region strong consistency): nothing was applied.
            Some(
                "InternalServerError"
                | "ServiceUnavailable"
                | "ReplicatedWriteConflictException"
                | "TransactionConflictException",
            ) => KeyStoreError::Unavailable,
            _ if ctx.raw().status().is_server_error() => KeyStoreError::Unavailable,
            _ => KeyStoreError::Fault,
        },
        SdkError::TimeoutError(_) | SdkError::DispatchFailure(_) | SdkError::ResponseError(_) => {
            KeyStoreError::Unavailable
        }
        _ => KeyStoreError::Fault,
    };
    kind(StoreFailure::of(err))
}
