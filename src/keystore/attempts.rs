//! Every attempt the SDK makes at the key table, seen from inside its
//! orchestrator (an interceptor), so retried throttles count too: errors
//! go to `keyfence_key_store_errors_total{op, kind}`, `op` being the
//! DynamoDB operation (`PutItem`, `UpdateItem`, ...) and `kind` one of
//! `throttled`, `unavailable`, `other`. A failed condition is an answer of
//! the protocol, not an error, and is not counted.

use aws_sdk_dynamodb::config::interceptors::FinalizerInterceptorContextRef;
use aws_sdk_dynamodb::config::{ConfigBag, Intercept, RuntimeComponents};
use aws_smithy_runtime_api::box_error::BoxError;
use aws_smithy_runtime_api::client::orchestrator::Metadata;

/// Error codes DynamoDB answers when it asks the caller to slow down.
const THROTTLES: [&str; 3] = ["ProvisionedThroughputExceededException", "RequestLimitExceeded", "ThrottlingException"];

/// Error codes that are answers of the protocol rather than failures.
const ANSWERS: [&str; 1] = ["ConditionalCheckFailedException"];

#[derive(Debug)]
pub struct CountErrors;

impl Intercept for CountErrors {
    fn name(&self) -> &'static str {
        "keyfence::CountErrors"
    }

    fn read_after_attempt(
        &self,
        context: &FinalizerInterceptorContextRef<'_>,
        _components: &RuntimeComponents,
        cfg: &mut ConfigBag,
    ) -> Result<(), BoxError> {
        let Some(Err(error)) = context.output_or_error() else { return Ok(()) };
        let response = context.response();
        let code = response.and_then(|r| r.body().bytes()).and_then(error_code);
        let kind = match code.as_deref() {
            Some(code) if ANSWERS.contains(&code) => return Ok(()),
            Some(code) if THROTTLES.contains(&code) => "throttled",
            _ if error.is_timeout_error() || error.is_connector_error() => "unavailable",
            _ if response.is_some_and(|r| r.status().is_server_error()) => "unavailable",
            _ => "other",
        };
        let op = cfg.load::<Metadata>().map_or_else(|| "unknown".to_owned(), |m| m.name().to_owned());
        metrics::counter!("keyfence_key_store_errors_total", "op" => op, "kind" => kind).increment(1);
        Ok(())
    }
}

/// The error code of a DynamoDB error body: the part of `__type` after `#`.
fn error_code(body: &[u8]) -> Option<String> {
    let body: serde_json::Value = serde_json::from_slice(body).ok()?;
    let kind = body.get("__type")?.as_str()?;
    Some(kind.rsplit('#').next().unwrap_or(kind).to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_code_is_read_off_the_type() {
        let throttled = br#"{"__type":"com.amazon.coral.availability#ThrottlingException","message":"slow down"}"#;
        assert_eq!(error_code(throttled).as_deref(), Some("ThrottlingException"));
        let plain = br#"{"__type":"ResourceNotFoundException"}"#;
        assert_eq!(error_code(plain).as_deref(), Some("ResourceNotFoundException"));
        assert_eq!(error_code(b"<html>"), None);
    }
}
