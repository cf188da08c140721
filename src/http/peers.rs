//! Reads another region may hold. A payment lives in the ledger of the
//! region that worked it; a client may ask any region. What this region's
//! ledger lacks (or holds only a leftover of) it asks the other regions for
//! (their front doors, at the URLs they advertise in the key table), the
//! request's home region first when the key names it, signed as this
//! region for the caller's client id ([`super::signed`]; the caller's API
//! key stays here), and marked for the region meant: the region asked
//! answers only from its own ledger and only with a live copy, and a front
//! door of any other region (a URL that reaches the wrong place, a load
//! balancer shared by all regions) refuses it with 421, which counts as
//! "could not be asked". So does every answer not to be believed: from a
//! URL that is not https (loopback aside), a redirect, an answer without
//! the region's signature, one larger than [`MAX_ANSWER`], or one about
//! another payment than asked. A region that cannot be asked makes the
//! answer 503, not 404: "not found" is said only when every region that
//! could hold it says so.

use std::time::Duration;

use axum::http::{HeaderMap, StatusCode};
use serde_json::Value;

use super::ApiError;
use super::signed::{Asking, FORWARDED, MAX_ANSWER, now};
use crate::domain::ClientId;
use crate::domain::RegionSecret;
use crate::regions::Registry;

/// How long another region gets to answer.
const PEER_TIMEOUT: Duration = Duration::from_secs(2);

#[derive(Clone, Debug)]
pub struct Peers {
    http: reqwest::Client,
    /// Without it no other region can be asked (or ask this one).
    secret: Option<RegionSecret>,
    /// Where other regions reach this one (the authority of the URL it
    /// advertises): a forwarded read must be signed for it.
    authority: String,
}

/// Who asks, and for whom.
#[derive(Clone, Copy)]
pub struct Asker<'a> {
    pub me: &'a str,
    pub client: ClientId,
}

/// Why another region's answer is not had: it could not be asked, or what
/// it said is not to be believed. Logged once, by whoever gives up on it.
#[derive(Debug, thiserror::Error)]
pub enum PeerError {
    #[error("no region secret: other regions cannot be asked (set KEYFENCE_REGION_SECRET_FILE)")]
    NoSecret,
    #[error("not asked at {base}: {why}")]
    Url { base: String, why: &'static str },
    #[error("could not be asked: {0}")]
    Unreachable(#[source] reqwest::Error),
    #[error("its answer was cut short: {0}")]
    Cut(#[source] reqwest::Error),
    #[error("its answer is over the size limit")]
    TooLarge,
    #[error("its answer ({0}) is without the region's signature: not believed")]
    Unsigned(StatusCode),
    #[error("it could not answer ({0})")]
    Refused(StatusCode),
    #[error("its answer does not read: {0}")]
    Unreadable(#[source] serde_json::Error),
    #[error("it answered about another payment than asked")]
    Other,
    #[error("its listing is not a listing of what was asked")]
    Unwanted,
}

/// What the other regions said of one payment.
pub enum Asked {
    Found(Value),
    /// Every other region answered, and none holds it.
    Nowhere,
    /// These regions could not be asked.
    Unreachable(Vec<String>),
}

/// Refuses a read forwarded for another region than `me`.
pub fn check_target(headers: &HeaderMap, me: &str) -> Result<(), ApiError> {
    match headers.get(FORWARDED).map(|v| v.to_str().unwrap_or_default()) {
        Some(meant_for) if meant_for != me => {
            Err(ApiError::Misdirected { meant_for: meant_for.to_owned(), here: me.to_owned() })
        }
        _ => Ok(()),
    }
}

impl Peers {
    /// Peers for a region other regions reach at `own_url`.
    pub fn new(secret: Option<RegionSecret>, own_url: &str) -> Self {
        let http = reqwest::Client::builder()
            .timeout(PEER_TIMEOUT)
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .expect("an HTTP client");
        let authority = reqwest::Url::parse(own_url).ok().map(|url| authority(&url)).unwrap_or_default();
        Self { http, secret, authority }
    }

    pub fn secret(&self) -> Option<&RegionSecret> {
        self.secret.as_ref()
    }

    /// The authority a forwarded read of this region must be signed for.
    pub fn authority(&self) -> &str {
        &self.authority
    }

    /// The payment (or refund) `id` of `collection` (`/v1/payments`,
    /// `/v1/refunds`) as the first other region holding a live copy shows
    /// it, asking `home` (the request's home region, when the key names it)
    /// first. A home that advertises no URL could not be asked.
    pub async fn one(
        &self,
        registry: &Registry,
        asker: Asker<'_>,
        home: Option<&str>,
        collection: &str,
        id: &str,
    ) -> Asked {
        let me = asker.me;
        let path = format!("{collection}/{id}");
        let mut unreachable = Vec::new();
        if let Some(home) = home.filter(|h| *h != me && !registry.urls.contains_key(*h)) {
            unreachable.push(home.to_owned());
        }
        let mut asked: Vec<(&str, &str)> = others(registry, me).collect();
        asked.sort_by_key(|(region, _)| Some(*region) != home);
        for (region, url) in asked {
            match self.get(asker, region, url, &path, &[]).await {
                Ok(Some(found)) if found["id"].as_str() == Some(id) => return Asked::Found(found),
                Ok(None) => {}
                answer => {
                    let e = answer.err().unwrap_or(PeerError::Other);
                    tracing::warn!(region, error = %e, "another region's answer is not had");
                    unreachable.push(region.to_owned());
                }
            }
        }
        if unreachable.is_empty() { Asked::Nowhere } else { Asked::Unreachable(unreachable) }
    }

    /// Every other region's listing at `path` with `query` (from
    /// `{"data": [...]}`), or the regions that could not be asked. A
    /// listing with an entry that is not `wanted` is not believed.
    pub async fn listing(
        &self,
        registry: &Registry,
        asker: Asker<'_>,
        path: &str,
        query: &[(&str, &str)],
        wanted: impl Fn(&Value) -> bool,
    ) -> Result<Vec<Value>, Vec<String>> {
        let mut all = Vec::new();
        let mut unreachable = Vec::new();
        for (region, url) in others(registry, asker.me) {
            let page = self.get(asker, region, url, path, query).await.and_then(|answer| match answer {
                Some(Value::Object(mut page)) => match page.remove("data") {
                    Some(Value::Array(items)) if items.iter().all(&wanted) => Ok(items),
                    _ => Err(PeerError::Unwanted),
                },
                _ => Ok(Vec::new()),
            });
            match page {
                Ok(items) => all.extend(items),
                Err(e) => {
                    tracing::warn!(region, error = %e, "another region's listing is not had");
                    unreachable.push(region.to_owned());
                }
            }
        }
        if unreachable.is_empty() { Ok(all) } else { Err(unreachable) }
    }

    /// `Ok(None)` for a 404; `Err` when the region did not answer usefully
    /// (a 421 included: the URL reached another region than `region`), or
    /// its answer is not to be believed.
    async fn get(
        &self,
        asker: Asker<'_>,
        region: &str,
        base: &str,
        path: &str,
        query: &[(&str, &str)],
    ) -> Result<Option<Value>, PeerError> {
        let (status, body) = self.exchange(asker, region, base, path, query, None).await?;
        match status {
            StatusCode::OK => serde_json::from_slice(&body).map(Some).map_err(PeerError::Unreadable),
            StatusCode::NOT_FOUND => Ok(None),
            status => Err(PeerError::Refused(status)),
        }
    }

    /// Sends `posted` (a body and its headers) to `region`'s `path`,
    /// signed as this region; how the region answered (status and body),
    /// if it is to be believed (signed by the region, for this request,
    /// within size).
    pub async fn post(
        &self,
        asker: Asker<'_>,
        region: &str,
        base: &str,
        path: &str,
        query: &[(&str, &str)],
        posted: Posted<'_>,
    ) -> Result<(StatusCode, Vec<u8>), PeerError> {
        self.exchange(asker, region, base, path, query, Some(posted)).await
    }

    /// A signed GET, or a POST of `posted`: the answer's status and body.
    async fn exchange(
        &self,
        asker: Asker<'_>,
        region: &str,
        base: &str,
        path: &str,
        query: &[(&str, &str)],
        posted: Option<Posted<'_>>,
    ) -> Result<(StatusCode, Vec<u8>), PeerError> {
        let Some(secret) = &self.secret else { return Err(PeerError::NoSecret) };
        let url = peer_url(base, path, query).map_err(|why| PeerError::Url { base: base.to_owned(), why })?;
        let target = match url.query() {
            Some(query) => format!("{}?{query}", url.path()),
            None => url.path().to_owned(),
        };
        let authority = authority(&url);
        let asking = Asking {
            method: if posted.is_some() { "POST" } else { "GET" },
            authority: &authority,
            target: &target,
            region,
            from: asker.me,
            client: asker.client,
            at: now(),
        };
        let (headers, signature) = secret.sign(&asking);
        let mut request = match posted {
            Some(posted) => {
                let mut request = self.http.post(url).body(posted.body.to_vec());
                for (name, value) in posted.headers {
                    request = request.header(*name, value.as_str());
                }
                request
            }
            None => self.http.get(url),
        };
        for (name, value) in headers {
            request = request.header(name, value);
        }
        // The other region's spans and log lines join this request's trace.
        let mut trace = axum::http::HeaderMap::new();
        crate::telemetry::inject_trace_context(&mut trace);
        request = request.headers(trace);
        let mut sent = request.send().await.map_err(PeerError::Unreachable)?;
        let status = sent.status();
        let answer_headers = std::mem::take(sent.headers_mut());
        let mut body = Vec::new();
        while let Some(chunk) = sent.chunk().await.map_err(PeerError::Cut)? {
            if body.len() + chunk.len() > MAX_ANSWER {
                return Err(PeerError::TooLarge);
            }
            body.extend_from_slice(&chunk);
        }
        if !secret.answered(&signature, status, &answer_headers, &body) {
            return Err(PeerError::Unsigned(status));
        }
        Ok((status, body))
    }
}

/// A body one region posts to another, with its own headers.
#[derive(Clone, Copy)]
pub struct Posted<'a> {
    pub body: &'a [u8],
    pub headers: &'a [(&'static str, String)],
}

/// A URL's host and port (the port even when it is the scheme's default),
/// lower case: what a signature binds the request's destination to.
pub fn authority(url: &reqwest::Url) -> String {
    format!("{}:{}", url.host_str().unwrap_or_default().to_ascii_lowercase(), url.port_or_known_default().unwrap_or(0))
}

/// Where to ask a region advertising `base`: https, or http to a loopback
/// address (every region on one machine).
fn peer_url(base: &str, path: &str, query: &[(&str, &str)]) -> Result<reqwest::Url, &'static str> {
    let mut url = reqwest::Url::parse(&format!("{}{path}", base.trim_end_matches('/'))).map_err(|_| "not a URL")?;
    let host = url.host_str().unwrap_or_default().trim_start_matches('[').trim_end_matches(']');
    let loopback = host == "localhost" || host.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback());
    if url.scheme() != "https" && !(url.scheme() == "http" && loopback) {
        return Err("a region's URL must be https (or http on a loopback address)");
    }
    if !query.is_empty() {
        url.query_pairs_mut().extend_pairs(query);
    }
    Ok(url)
}

/// The regions other than `me` that advertise a URL. A region declared
/// failed is asked too: it still holds what it finished, and answers reads
/// while it is reachable.
pub fn others<'a>(registry: &'a Registry, me: &'a str) -> impl Iterator<Item = (&'a str, &'a str)> + 'a {
    registry.urls.iter().filter(move |(region, _)| region.as_str() != me).map(|(r, url)| (r.as_str(), url.as_str()))
}

#[cfg(test)]
mod tests {
    use super::peer_url;

    #[test]
    fn a_region_is_asked_over_https_or_on_this_machine_only() {
        let url = |base| peer_url(base, "/v1/payments", &[("end_to_end_id", "E2E 1")]).map(|u| u.to_string());
        assert_eq!(
            url("https://eu.payments.example/").unwrap(),
            "https://eu.payments.example/v1/payments?end_to_end_id=E2E+1"
        );
        assert!(url("http://eu.payments.example").is_err(), "plain http to another machine");
        assert!(url("http://127.0.0.1:8080").is_ok());
        assert!(url("http://[::1]:8080").is_ok());
        assert!(url("http://localhost:8080").is_ok());
        assert!(url("ftp://127.0.0.1").is_err());
        assert!(url("not a url").is_err());
    }
}
