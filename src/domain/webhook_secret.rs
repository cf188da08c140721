//! A Standard Webhooks signing secret (`whsec_` and 32 bytes in base64)
//! and until when it signs: an endpoint's (a rotation keeps the previous
//! one signing for a while) or a rail's. Never printed.

use base64::Engine as _;
use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// A signing secret and until when it signs (`None`: the current one).
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WebhookSecret {
    pub value: String,
    pub created_at: u64,
    pub valid_until: Option<u64>,
}

/// Never shows the secret itself.
impl std::fmt::Debug for WebhookSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WebhookSecret")
            .field("value", &"<redacted>")
            .field("created_at", &self.created_at)
            .field("valid_until", &self.valid_until)
            .finish()
    }
}

impl WebhookSecret {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_are_standard_webhooks_secrets_and_never_shown_in_debug() {
        let secret = WebhookSecret::generate(1);
        let raw = secret.value.strip_prefix("whsec_").unwrap();
        assert_eq!(base64::engine::general_purpose::STANDARD.decode(raw).unwrap().len(), 32);
        assert_ne!(secret.value, WebhookSecret::generate(1).value);
        assert!(!format!("{secret:?}").contains(raw));
    }
}
