//! The product's vocabulary: validated newtypes for everything that crosses a
//! trust or storage boundary. Nothing here does I/O; every untrusted string is
//! parsed into one of these types at the edge and never handled raw again.

mod account;
mod api_key;
mod client_id;
mod fence;
mod idempotency_key;
mod millis;
mod owner;
mod payment;
mod probe_backoff;
mod recovery_point;
mod refund;
mod request_hash;
mod retention;
mod scoped_key;
mod stored_response;

pub use account::normal_account;
pub use api_key::ApiKey;
pub use client_id::ClientId;
pub use fence::Fence;
pub use idempotency_key::{IdempotencyKey, InvalidKey};
pub use millis::Millis;
pub use owner::Owner;
pub use payment::{FieldError, PaymentRequest, is_reference};
pub use probe_backoff::ProbeBackoff;
pub use recovery_point::RecoveryPoint;
pub use refund::RefundRequest;
pub use request_hash::RequestHash;
pub use retention::Retention;
pub use scoped_key::ScopedKey;
pub use stored_response::{ANSWER_LIMIT, StoredResponse};
