//! Reads one region forwards to another, proved with the deployment's
//! region secret rather than the caller's API key (which never leaves the
//! region that received it). The asking region signs the method, the
//! authority it sends to (host and port of the URL the region meant
//! advertises), the path with its query, the region meant, itself, the
//! caller's client id and the time (HMAC-SHA256); the region asked checks
//! the signature against its own advertised authority, so a signed request
//! sent to a URL that is not the region's own cannot be relayed to the
//! region, and it refuses a wrong signature or a time more than [`WINDOW`]
//! away (401), and
//! signs its answer, bound to the request's signature, so that an answer
//! from anything without the secret (a URL in the key table pointing
//! elsewhere) is not believed either.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use hmac::{Hmac, Mac};
use sha2::Sha256;

use super::{ApiError, AppState};
use crate::domain::{ClientId, RegionSecret};

/// Marks a request one region makes of another, naming the region meant.
pub const FORWARDED: &str = "keyfence-forwarded";
const FROM: &str = "keyfence-from";
const CLIENT: &str = "keyfence-client";
const TIMESTAMP: &str = "keyfence-timestamp";
const SIGNATURE: &str = "keyfence-signature";

/// How far a forwarded request's time may be from the receiver's clock.
pub const WINDOW: Duration = Duration::from_secs(60);

/// The largest answer one region takes from another, in bytes.
pub const MAX_ANSWER: usize = 1024 * 1024;

/// The client a verified forwarded request is made for.
#[derive(Clone, Copy, Debug)]
pub struct ForwardedFor(pub ClientId);

/// The region a verified forwarded request comes from.
#[derive(Clone, Debug)]
pub struct ForwardedFrom(pub String);

/// What a signed request says of itself.
pub struct Asking<'a> {
    pub method: &'a str,
    /// The host and port sent to ([`super::peers::authority`]).
    pub authority: &'a str,
    /// The path and query, exactly as sent.
    pub target: &'a str,
    /// The region meant, and the region asking.
    pub region: &'a str,
    pub from: &'a str,
    pub client: ClientId,
    /// Seconds since the epoch.
    pub at: u64,
}

/// The fields a request's signature covers, in order (`client` and `at`:
/// the request's, as text).
fn request_fields<'a>(asking: &'a Asking, client: &'a str, at: &'a str) -> [&'a [u8]; 8] {
    [
        b"request",
        asking.method.as_bytes(),
        asking.authority.as_bytes(),
        asking.target.as_bytes(),
        asking.region.as_bytes(),
        asking.from.as_bytes(),
        client.as_bytes(),
        at.as_bytes(),
    ]
}

impl RegionSecret {
    /// The headers that make `asking` a signed forwarded request, and its
    /// signature (which the answer is bound to).
    pub fn sign(&self, asking: &Asking) -> (Vec<(&'static str, String)>, String) {
        let (client, at) = (asking.client.to_string(), asking.at.to_string());
        let signature = hex::encode(self.mac(&request_fields(asking, &client, &at)).finalize().into_bytes());
        let headers = vec![
            (FORWARDED, asking.region.to_owned()),
            (FROM, asking.from.to_owned()),
            (CLIENT, asking.client.to_string()),
            (TIMESTAMP, asking.at.to_string()),
            (SIGNATURE, signature.clone()),
        ];
        (headers, signature)
    }

    /// The client a forwarded request is for, if its signature is right and
    /// its time within [`WINDOW`] of `now`; and the signature.
    fn verify(
        &self,
        method: &str,
        authority: &str,
        target: &str,
        headers: &HeaderMap,
        now: u64,
    ) -> Option<(ClientId, String)> {
        let text = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
        let at: u64 = text(TIMESTAMP)?.parse().ok()?;
        if now.abs_diff(at) > WINDOW.as_secs() {
            return None;
        }
        let client: ClientId = text(CLIENT)?.parse().ok()?;
        let asking = Asking { method, authority, target, region: text(FORWARDED)?, from: text(FROM)?, client, at };
        let signature = text(SIGNATURE)?;
        let (client_text, at_text) = (client.to_string(), at.to_string());
        let fields = request_fields(&asking, &client_text, &at_text);
        self.verifies(&fields, &hex::decode(signature).ok()?).then(|| (client, signature.to_owned()))
    }

    fn answer_mac(&self, request_signature: &str, status: StatusCode, body: &[u8]) -> Hmac<Sha256> {
        self.mac(&answer_fields(request_signature, &status, body))
    }

    /// Whether an answer to the request signed `request_signature` carries
    /// the region asked's signature.
    pub fn answered(&self, request_signature: &str, status: StatusCode, headers: &HeaderMap, body: &[u8]) -> bool {
        let Some(signature) = headers.get(SIGNATURE).and_then(|v| v.to_str().ok()).and_then(|s| hex::decode(s).ok())
        else {
            return false;
        };
        self.verifies(&answer_fields(request_signature, &status, body), &signature)
    }
}

/// The fields an answer's signature covers, in order.
fn answer_fields<'a>(request_signature: &'a str, status: &'a StatusCode, body: &'a [u8]) -> [&'a [u8]; 4] {
    [b"answer", request_signature.as_bytes(), status.as_str().as_bytes(), body]
}

/// Seconds since the epoch, now.
pub fn now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// Whether a request is one region's forwarded read (and so verified by
/// [`from_a_region`] before any handler saw it).
pub fn is_forwarded(headers: &HeaderMap) -> bool {
    headers.contains_key(FORWARDED)
}

/// Middleware: a request marked forwarded is a region's, signed, or it is
/// refused with 401 (without a region secret, every one is). A verified one
/// is answered as its client, and the answer signed.
pub async fn from_a_region(State(state): State<AppState>, mut request: Request, next: Next) -> Response {
    if !is_forwarded(request.headers()) {
        return next.run(request).await;
    }
    let Some(secret) = state.peers.secret().cloned() else { return ApiError::Unauthenticated.into_response() };
    let target = request.uri().path_and_query().map_or("/", |p| p.as_str()).to_owned();
    let method = request.method().as_str();
    let Some((client, signature)) = secret.verify(method, state.peers.authority(), &target, request.headers(), now())
    else {
        return ApiError::Unauthenticated.into_response();
    };
    let from = request.headers().get(FROM).and_then(|v| v.to_str().ok()).unwrap_or_default().to_owned();
    request.extensions_mut().insert(ForwardedFor(client));
    request.extensions_mut().insert(ForwardedFrom(from));
    let (mut parts, body) = next.run(request).await.into_parts();
    let Ok(body) = axum::body::to_bytes(body, MAX_ANSWER).await else {
        return ApiError::internal("an answer to another region is too large").into_response();
    };
    let mac = secret.answer_mac(&signature, parts.status, &body).finalize().into_bytes();
    parts.headers.insert(SIGNATURE, HeaderValue::try_from(hex::encode(mac)).expect("hex is a valid header value"));
    Response::from_parts(parts, Body::from(body))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secret() -> RegionSecret {
        RegionSecret::new("a deployment-wide secret of 32 bytes or more").unwrap()
    }

    fn headers(signed: Vec<(&'static str, String)>) -> HeaderMap {
        signed.into_iter().map(|(name, value)| (name.parse().unwrap(), value.parse().unwrap())).collect()
    }

    #[test]
    fn a_signed_request_is_verified_and_any_change_to_it_is_not() {
        let client = ClientId::generate();
        let asking = Asking {
            method: "GET",
            authority: "b.example:443",
            target: "/v1/payments/1",
            region: "b",
            from: "a",
            client,
            at: 1_000,
        };
        let (signed, signature) = secret().sign(&asking);
        let good = headers(signed.clone());
        assert_eq!(secret().verify("GET", "b.example:443", "/v1/payments/1", &good, 1_030), Some((client, signature)));
        assert!(secret().verify("GET", "b.example:443", "/v1/payments/2", &good, 1_000).is_none(), "another path");
        assert!(secret().verify("POST", "b.example:443", "/v1/payments/1", &good, 1_000).is_none(), "another method");
        assert!(secret().verify("GET", "b.example:443", "/v1/payments/1", &good, 1_061).is_none(), "stale");
        assert!(secret().verify("GET", "b.example:443", "/v1/payments/1", &good, 939).is_none(), "from the future");
        assert!(secret().verify("GET", "evil.example:443", "/v1/payments/1", &good, 1_000).is_none(), "relayed");
        let other = RegionSecret::new("another secret, also of 32 bytes or more").unwrap();
        assert!(other.verify("GET", "b.example:443", "/v1/payments/1", &good, 1_000).is_none(), "another secret");
        for (name, value) in [(CLIENT, ClientId::generate().to_string()), (FORWARDED, "c".into()), (FROM, "c".into())] {
            let mut changed = good.clone();
            changed.insert(name, value.parse().unwrap());
            assert!(
                secret().verify("GET", "b.example:443", "/v1/payments/1", &changed, 1_000).is_none(),
                "{name} changed"
            );
        }
    }

    #[test]
    fn an_answer_is_believed_only_with_the_secret_and_for_its_request() {
        let mac = secret().answer_mac("sig-1", StatusCode::OK, b"{}").finalize().into_bytes();
        let signed = headers(vec![(SIGNATURE, hex::encode(mac))]);
        assert!(secret().answered("sig-1", StatusCode::OK, &signed, b"{}"));
        assert!(!secret().answered("sig-2", StatusCode::OK, &signed, b"{}"), "another request");
        assert!(!secret().answered("sig-1", StatusCode::NOT_FOUND, &signed, b"{}"), "another status");
        assert!(!secret().answered("sig-1", StatusCode::OK, &signed, b"{\"id\":1}"), "another body");
        assert!(!secret().answered("sig-1", StatusCode::OK, &HeaderMap::new(), b"{}"), "unsigned");
    }

    #[test]
    fn during_a_rotation_an_answer_signed_with_the_other_secret_is_believed() {
        let next = RegionSecret::new("the deployment's next region secret, 32 bytes or more").unwrap();
        let mac = next.answer_mac("sig-1", StatusCode::OK, b"{}").finalize().into_bytes();
        let signed = headers(vec![(SIGNATURE, hex::encode(mac))]);
        assert!(!secret().answered("sig-1", StatusCode::OK, &signed, b"{}"), "not before the rotation");
        assert!(secret().also_accepting(&next).answered("sig-1", StatusCode::OK, &signed, b"{}"));
    }
}
