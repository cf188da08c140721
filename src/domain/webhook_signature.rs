//! Standard Webhooks signatures (standardwebhooks.com): the signed content
//! is `{webhook-id}.{webhook-timestamp}.{body}`, signed with HMAC-SHA256
//! under the secret's 32 bytes (the base64 after `whsec_`), and the
//! `webhook-signature` header is `v1,` and the base64 of each signature,
//! separated by spaces: one per secret that signs, so a receiver holding
//! either the new or the previous secret during a rotation verifies.

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use hmac::{KeyInit, Mac};

use super::WebhookSecret;

type HmacSha256 = hmac::Hmac<sha2::Sha256>;

/// The `webhook-signature` header for `body` sent as `id` at `timestamp`
/// (seconds since the epoch), signed with each of `secrets`.
pub fn header(secrets: &[&WebhookSecret], id: &str, timestamp: i64, body: &[u8]) -> String {
    secrets
        .iter()
        .filter_map(|secret| sign(&secret.value, id, timestamp, body))
        .map(|signature| format!("v1,{signature}"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// The three Standard Webhooks headers of `body` sent as `id` now, signed
/// with each of `secrets`.
pub fn headers(secrets: &[&WebhookSecret], id: &str, body: &[u8]) -> [(&'static str, String); 3] {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    let timestamp = i64::try_from(now.as_secs()).unwrap_or(i64::MAX);
    [
        ("webhook-id", id.to_owned()),
        ("webhook-timestamp", timestamp.to_string()),
        ("webhook-signature", header(secrets, id, timestamp, body)),
    ]
}

/// How far a signed message's timestamp may be from now.
pub const TOLERANCE: std::time::Duration = std::time::Duration::from_secs(5 * 60);

/// Signatures one header may carry that are looked at (a sender has one
/// per secret it signs with: a few); the rest are ignored, so a header
/// of thousands costs no more than a few.
const MOST_SIGNATURES: usize = 4;

/// Whether `header` (a `webhook-signature`) holds a signature of `body`
/// sent as `id` at `timestamp` under `secret`, and `timestamp` is within
/// [`TOLERANCE`] of `now` (seconds since the epoch). Compared in constant time.
pub fn verify(secret: &str, id: &str, timestamp: i64, body: &[u8], header: &str, now: i64) -> bool {
    if timestamp.abs_diff(now) > TOLERANCE.as_secs() {
        return false;
    }
    let Some(key) = secret.strip_prefix("whsec_").and_then(|raw| STANDARD.decode(raw).ok()) else { return false };
    let candidates = header.split(' ').filter_map(|part| part.strip_prefix("v1,")).filter(|b64| b64.len() == 44);
    candidates.take(MOST_SIGNATURES).filter_map(|b64| STANDARD.decode(b64).ok()).any(|signature| {
        let Ok(mut mac) = HmacSha256::new_from_slice(&key) else { return false };
        mac.update(format!("{id}.{timestamp}.").as_bytes());
        mac.update(body);
        mac.verify_slice(&signature).is_ok()
    })
}

/// One signature in base64; `None` for a secret that is not `whsec_` and base64.
fn sign(secret: &str, id: &str, timestamp: i64, body: &[u8]) -> Option<String> {
    let key = STANDARD.decode(secret.strip_prefix("whsec_")?).ok()?;
    let mut mac = HmacSha256::new_from_slice(&key).ok()?;
    mac.update(format!("{id}.{timestamp}.").as_bytes());
    mac.update(body);
    Some(STANDARD.encode(mac.finalize().into_bytes()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secret(value: &str) -> WebhookSecret {
        WebhookSecret { value: value.to_owned(), created_at: 0, valid_until: None }
    }

    /// The example the specification's reference libraries test with.
    #[test]
    fn signs_as_the_reference_implementation_does() {
        let secret = secret("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw");
        let signed = header(&[&secret], "msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265330, br#"{"test": 2432232314}"#);
        assert_eq!(signed, "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=");
    }

    #[test]
    fn only_a_fresh_signature_by_the_secret_verifies() {
        let (secret, other) = (WebhookSecret::generate(1), WebhookSecret::generate(1));
        let signed = header(&[&other, &secret], "msg_1", 1000, b"{}");
        assert!(verify(&secret.value, "msg_1", 1000, b"{}", &signed, 1000));
        assert!(verify(&secret.value, "msg_1", 1000, b"{}", &signed, 1000 + 300), "within five minutes");
        assert!(!verify(&secret.value, "msg_1", 1000, b"{}", &signed, 1000 + 301), "stale");
        assert!(!verify(&secret.value, "msg_2", 1000, b"{}", &signed, 1000), "another id");
        assert!(!verify(&secret.value, "msg_1", 1000, b"{ }", &signed, 1000), "another body");
        assert!(!verify(&secret.value, "msg_1", 1000, b"{}", &header(&[&other], "msg_1", 1000, b"{}"), 1000));
        assert!(!verify(&secret.value, "msg_1", 1000, b"{}", "v1,!!! v2,abc", 1000));
        let junk = format!("v1,{}", "A".repeat(43) + "=");
        let late = format!("{} {signed}", [junk.as_str(); 4].join(" "));
        assert!(!verify(&secret.value, "msg_1", 1000, b"{}", &late, 1000), "only the first few are looked at");
        assert!(verify(&secret.value, "msg_1", 1000, b"{}", &format!("{signed} {late}"), 1000));
    }

    #[test]
    fn every_signing_secret_signs() {
        let (new, old) = (WebhookSecret::generate(1), WebhookSecret::generate(1));
        let both = header(&[&new, &old], "msg_1", 1, b"{}");
        let parts: Vec<&str> = both.split(' ').collect();
        assert_eq!(parts, [header(&[&new], "msg_1", 1, b"{}"), header(&[&old], "msg_1", 1, b"{}")]);
        assert_ne!(parts[0], parts[1]);
    }
}
