//! The product's vocabulary: validated newtypes for everything that crosses a
//! trust or storage boundary. Nothing here does I/O; every untrusted string is
//! parsed into one of these types at the edge and never handled raw again.
//! The secrets (the region secret, the rails' and the webhook endpoints')
//! and the Standard Webhooks signature live here too, since rooms at every
//! height use them: the front door and the rail simulator, the inbox and
//! the webhook sender.

mod account;
mod api_key;
mod client_id;
mod clock;
mod duration;
mod fence;
mod idempotency_key;
mod millis;
mod owner;
mod payment;
mod probe_backoff;
mod rail_secrets;
mod recovery_point;
mod refund;
mod region_secret;
mod request_hash;
mod retention;
mod scoped_key;
mod shares;
mod stored_response;
mod webhook_secret;
pub mod webhook_signature;

pub use account::normal_account;
pub use api_key::ApiKey;
pub use client_id::ClientId;
pub use clock::{Clock, SharedClock, SystemClock, TestClock};
pub use duration::{parse_duration, parse_millis, parse_span};
pub use fence::Fence;
pub use idempotency_key::{IdempotencyKey, InvalidKey};
pub use millis::Millis;
pub use owner::Owner;
pub use payment::{FieldError, PaymentRequest, is_reference};
pub use probe_backoff::ProbeBackoff;
pub use rail_secrets::RailSecrets;
pub use recovery_point::RecoveryPoint;
pub use refund::RefundRequest;
pub use region_secret::RegionSecret;
pub use request_hash::RequestHash;
pub use retention::Retention;
pub use scoped_key::ScopedKey;
pub use shares::{Share, Shares};
pub use stored_response::{ANSWER_LIMIT, StoredResponse};
pub use webhook_secret::WebhookSecret;
