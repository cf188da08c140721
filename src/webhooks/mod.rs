//! Webhooks: the endpoints a client registers to hear how its payments
//! end. Endpoints are global, like clients (one control item of the key
//! table per client, [`store`]), so a payment worked in any region notifies
//! the same endpoints. Each has a signing secret (`whsec_...`, the Standard
//! Webhooks form), shown once when made and rotatable with a grace during
//! which the previous one signs too. A URL is checked before it is kept
//! ([`target`]): https only, and never an address inside the deployment's
//! network, unless the operator allows it (a webhook sender is an SSRF
//! vector otherwise).

pub mod store;
pub mod target;

use base64::Engine as _;
use serde::{Deserialize, Serialize};
use uuid::Uuid;

pub use store::{EndpointStore, WebhooksError};
pub use target::TargetPolicy;

/// The events a client may subscribe to.
pub const EVENTS: [&str; 3] = ["payment.succeeded", "payment.rejected", "payment.indeterminate"];

/// Endpoints one client may have at most.
pub const MAX_ENDPOINTS: usize = 16;

/// One registered endpoint.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Endpoint {
    pub id: Uuid,
    pub url: String,
    pub events: Vec<String>,
    /// Milliseconds since the epoch.
    pub created_at: u64,
    /// The secrets that sign, newest first; a previous one until its grace ends.
    pub secrets: Vec<Secret>,
}

/// A signing secret and until when it signs (`None`: the current one).
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Secret {
    pub value: String,
    pub created_at: u64,
    pub valid_until: Option<u64>,
}

/// Never shows the secret itself.
impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Secret")
            .field("value", &"<redacted>")
            .field("created_at", &self.created_at)
            .field("valid_until", &self.valid_until)
            .finish()
    }
}

impl Secret {
    /// A new secret: `whsec_` and 32 bytes in base64, the SHA-256 of three
    /// random UUIDs (366 random bits).
    pub fn generate(now: u64) -> Self {
        use sha2::Digest as _;
        let mut seed = sha2::Sha256::new();
        for _ in 0..3 {
            seed.update(Uuid::new_v4().as_bytes());
        }
        let value = format!("whsec_{}", base64::engine::general_purpose::STANDARD.encode(seed.finalize()));
        Self { value, created_at: now, valid_until: None }
    }

    /// Whether it still signs at `now`.
    pub fn signs_at(&self, now: u64) -> bool {
        self.valid_until.is_none_or(|until| now < until)
    }
}

impl Endpoint {
    /// The endpoint as its client sees it: everything but the secrets.
    pub fn public(&self) -> serde_json::Value {
        serde_json::json!({
            "id": self.id,
            "url": self.url,
            "events": self.events,
            "created_at": crate::ledger::timestamp(crate::domain::Millis::new(self.created_at))
                .format(&time::format_description::well_known::Rfc3339)
                .unwrap_or_default(),
        })
    }
}

/// The events named in `requested`, checked against [`EVENTS`]: at least
/// one, each known, none twice (kept in the catalogue's order).
pub fn checked_events(requested: &[String]) -> Result<Vec<String>, String> {
    if requested.is_empty() {
        return Err(format!("name at least one event of {}", EVENTS.join(", ")));
    }
    if let Some(unknown) = requested.iter().find(|e| !EVENTS.contains(&e.as_str())) {
        return Err(format!("{unknown:?} is not an event; the events are {}", EVENTS.join(", ")));
    }
    Ok(EVENTS.iter().filter(|e| requested.iter().any(|r| r == *e)).map(|e| (*e).to_owned()).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_are_standard_webhooks_secrets_and_never_shown_in_debug() {
        let secret = Secret::generate(1);
        let raw = secret.value.strip_prefix("whsec_").unwrap();
        assert_eq!(base64::engine::general_purpose::STANDARD.decode(raw).unwrap().len(), 32);
        assert_ne!(secret.value, Secret::generate(1).value);
        assert!(!format!("{secret:?}").contains(raw));
    }

    #[test]
    fn events_are_checked_against_the_catalogue() {
        let asked = |events: &[&str]| checked_events(&events.iter().map(|e| (*e).to_owned()).collect::<Vec<_>>());
        assert_eq!(
            asked(&["payment.rejected", "payment.succeeded", "payment.rejected"]).unwrap(),
            ["payment.succeeded", "payment.rejected"]
        );
        assert!(asked(&[]).is_err());
        assert!(asked(&["payment.created"]).unwrap_err().contains("not an event"));
    }
}
