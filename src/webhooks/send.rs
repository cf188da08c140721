//! Sending one delivery. The address is checked again at every connection,
//! not only when the endpoint was registered: the HTTP client resolves
//! names through [`Guarded`], which hands it only addresses a webhook may
//! reach, so a name that resolved to a public address at registration and
//! to an internal one now (DNS rebinding) is refused, not called. No
//! redirect is followed (it could lead anywhere), no proxy is used (it
//! would resolve the name itself), and the receiver's body is not read.
//! Names are looked up by [`Names`], within its time limit; a client's
//! lookups at once are bounded by the worker's share per client.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use reqwest::dns::{Addrs, Name, Resolve, Resolving};

use super::names::Names;
use super::target::{is_internal, literal};

/// What the receiver made of one attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Response {
    /// 2xx: delivered.
    Accepted(u16),
    /// 410: the receiver wants nothing more at this endpoint.
    Gone,
    /// Any other status, with the wait it asked for on 429 or 503.
    Refused { status: u16, retry_after: Option<Duration> },
    /// No answer: not connected, timed out, or an address a webhook may not reach.
    Unreachable(String),
}

/// Sends deliveries; one per process, its connections reused.
#[derive(Clone)]
pub struct Sender {
    http: reqwest::Client,
    allow_private: bool,
}

impl Sender {
    pub fn new(allow_private: bool, names: Names, timeout: Duration) -> Self {
        let http = reqwest::Client::builder()
            .timeout(timeout)
            .connect_timeout(timeout.min(Duration::from_secs(5)))
            .redirect(reqwest::redirect::Policy::none())
            .no_proxy()
            .dns_resolver(Arc::new(Guarded { allow_private, names }))
            .user_agent(concat!("keyfence-webhooks/", env!("CARGO_PKG_VERSION")))
            .build()
            .expect("the webhook client's settings are valid");
        Self { http, allow_private }
    }

    /// POSTs `body` to `url` with its signature `headers` ([`crate::domain::webhook_signature::headers`]).
    pub async fn send(&self, url: &str, headers: [(&'static str, String); 3], body: Vec<u8>) -> Response {
        // A literal address is never resolved, so it is checked here.
        let parsed = match reqwest::Url::parse(url) {
            Ok(parsed) => parsed,
            Err(e) => return Response::Unreachable(format!("not a URL: {e}")),
        };
        if literal(&parsed).is_some_and(|ip| !self.allow_private && is_internal(ip)) {
            return Response::Unreachable("not a public address".into());
        }
        let mut request = self.http.post(parsed).header("content-type", "application/json");
        for (name, value) in headers {
            request = request.header(name, value);
        }
        let sent = request.body(body).send().await;
        match sent {
            Ok(response) => {
                let status = response.status().as_u16();
                match status {
                    200..=299 => Response::Accepted(status),
                    410 => Response::Gone,
                    429 | 503 => Response::Refused {
                        status,
                        retry_after: keyfence_client::retry_after(response.headers(), SystemTime::now()),
                    },
                    _ => Response::Refused { status, retry_after: None },
                }
            }
            Err(e) if e.is_timeout() => Response::Unreachable("timed out".into()),
            Err(e) => Response::Unreachable(reason(&e)),
        }
    }
}

/// The innermost cause of a failed send, which names what went wrong
/// (refused connection, certificate, the address check).
fn reason(error: &reqwest::Error) -> String {
    let mut cause: &dyn std::error::Error = error;
    while let Some(inner) = cause.source() {
        cause = inner;
    }
    cause.to_string()
}

/// Resolves names to the addresses a webhook may reach, and only those.
struct Guarded {
    allow_private: bool,
    names: Names,
}

impl Resolve for Guarded {
    fn resolve(&self, name: Name) -> Resolving {
        let (allow_private, names) = (self.allow_private, self.names.clone());
        let host = name.as_str().to_owned();
        Box::pin(async move {
            let found = names.resolve(&host).await;
            if found.is_empty() {
                return Err(format!("{host} did not resolve").into());
            }
            let allowed: Vec<SocketAddr> = found
                .into_iter()
                .filter(|ip| allow_private || !is_internal(*ip))
                .map(|ip| SocketAddr::new(ip, 0))
                .collect();
            if allowed.is_empty() {
                return Err(format!("{host} is not a public address").into());
            }
            Ok(Box::new(allowed.into_iter()) as Addrs)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn signed() -> [(&'static str, String); 3] {
        crate::domain::webhook_signature::headers(&[], "msg_1", b"{}")
    }

    /// An address inside the network is refused when it is sent to, not
    /// only when registered: literally, or by a name that resolves there.
    #[tokio::test]
    async fn internal_addresses_are_refused_at_send_time() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let names = Names::new(None).unwrap();
        let strict = Sender::new(false, names.clone(), Duration::from_secs(2));
        for url in [format!("http://127.0.0.1:{port}/hook"), format!("http://localhost:{port}/hook")] {
            match strict.send(&url, signed(), b"{}".to_vec()).await {
                Response::Unreachable(why) => assert!(why.contains("not a public address"), "{url}: {why}"),
                other => panic!("{url}: {other:?}"),
            }
        }
        // Allowed, the same name is called (and nobody answers over HTTP).
        drop(listener);
        let dev = Sender::new(true, names, Duration::from_secs(2));
        match dev.send(&format!("http://localhost:{port}/hook"), signed(), b"{}".to_vec()).await {
            Response::Unreachable(why) => assert!(!why.contains("not a public address"), "{why}"),
            other => panic!("{other:?}"),
        }
    }
}
