//! Errors keep their sources: what failed below the engine (a stored
//! record that does not read, a database that cannot be reached) is told by
//! its type, not by reading a message, and reaches the one log line written
//! where the error is handled.

use std::error::Error;

use keyfence::engine::{Cause, EngineError};
use keyfence::http::{ApiError, Failure};
use keyfence::ledger::LedgerError;
use keyfence::operations::{PaymentOperation, RefundOperation};

/// `e`'s causes, nearest first.
fn causes<'a>(e: &'a (dyn Error + 'static)) -> Vec<&'a (dyn Error + 'static)> {
    let mut causes = Vec::new();
    let mut next = e.source();
    while let Some(cause) = next {
        causes.push(cause);
        next = cause.source();
    }
    causes
}

#[test]
fn a_stored_request_that_does_not_read_keeps_the_parse_error() {
    let failures = [
        PaymentOperation::from_canonical(b"{\"amount_minor\":").err().expect("a payment that does not read"),
        RefundOperation::from_canonical(b"[]").err().expect("a refund that does not read"),
    ];
    for e in failures {
        assert!(matches!(e, EngineError::Broken(Cause::Record { .. })), "{e:?}");
        assert!(
            causes(&e).into_iter().any(|cause| cause.is::<serde_json::Error>()),
            "{e}: no parse error among its causes"
        );
    }
}

#[tokio::test]
async fn a_503_keeps_its_cause_for_the_log_and_out_of_the_body() {
    let unreachable = LedgerError::Database(sqlx::Error::PoolTimedOut);
    let e = EngineError::from(unreachable);
    assert!(matches!(e, EngineError::Transient(Cause::Ledger(LedgerError::Database(sqlx::Error::PoolTimedOut)))));
    let response = axum::response::IntoResponse::into_response(ApiError::from(e));
    assert_eq!(response.status(), 503);
    let Some(Failure(why)) = response.extensions().get::<Failure>().cloned() else {
        panic!("a 503 without its cause for the log");
    };
    assert!(causes(&*why).into_iter().any(|cause| cause.is::<sqlx::Error>()), "{why}: the database error is lost");
    let body = axum::body::to_bytes(response.into_body(), 1 << 16).await.unwrap();
    let body = String::from_utf8(body.to_vec()).unwrap();
    assert!(!body.contains("pool"), "the cause is for the log, not the client: {body}");
}
