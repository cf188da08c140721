//! Reads another region may hold. A payment lives in the ledger of the
//! region that worked it; a client may ask any region. What this region's
//! ledger lacks (or holds only a leftover of) it asks the other regions for
//! (their front doors, at the URLs they advertise in the key table), the
//! request's home region first when the key names it, on the caller's own
//! credentials, marked as forwarded *for that region*: the region asked
//! answers only from its own ledger and only with a live copy, and a front
//! door of any other region (a URL that reaches the wrong place, a load
//! balancer shared by all regions) refuses it with 421, which counts as
//! "could not be asked". A region that cannot be asked makes the answer
//! 503, not 404: "not found" is said only when every region that could hold
//! it says so.

use std::time::Duration;

use axum::http::{HeaderMap, HeaderValue};
use serde_json::Value;

use super::ApiError;
use crate::regions::Registry;

/// Marks a request one region makes of another, naming the region meant.
pub const FORWARDED: &str = "keyfence-forwarded";

/// How long another region gets to answer.
const PEER_TIMEOUT: Duration = Duration::from_secs(2);

#[derive(Clone, Debug)]
pub struct Peers {
    http: reqwest::Client,
}

/// What the other regions said of one payment.
pub enum Asked {
    Found(Value),
    /// Every other region answered, and none holds it.
    Nowhere,
    /// These regions could not be asked.
    Unreachable(Vec<String>),
}

/// The caller's credentials, to ask the other regions with; `None` for a
/// request that is itself forwarded (it is answered from this ledger only).
pub fn forwardable(headers: &HeaderMap) -> Option<&HeaderValue> {
    headers.get(axum::http::header::AUTHORIZATION).filter(|_| !headers.contains_key(FORWARDED))
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

impl Default for Peers {
    fn default() -> Self {
        let http = reqwest::Client::builder().timeout(PEER_TIMEOUT).build().expect("an HTTP client");
        Self { http }
    }
}

impl Peers {
    /// The payment at `path` as the first other region holding a live copy
    /// shows it, asking `home` (the request's home region, when the key
    /// names it) first. A home that advertises no URL could not be asked.
    pub async fn payment(
        &self,
        registry: &Registry,
        me: &str,
        home: Option<&str>,
        auth: &HeaderValue,
        path: &str,
    ) -> Asked {
        let mut unreachable = Vec::new();
        if let Some(home) = home.filter(|h| *h != me && !registry.urls.contains_key(*h)) {
            unreachable.push(home.to_owned());
        }
        let mut asked: Vec<(&str, &str)> = others(registry, me).collect();
        asked.sort_by_key(|(region, _)| Some(*region) != home);
        for (region, url) in asked {
            match self.get(region, url, path, &[], auth).await {
                Ok(Some(found)) => return Asked::Found(found),
                Ok(None) => {}
                Err(()) => unreachable.push(region.to_owned()),
            }
        }
        if unreachable.is_empty() { Asked::Nowhere } else { Asked::Unreachable(unreachable) }
    }

    /// Every other region's answer to a listing at `path` with `query`
    /// (`{"data": [...]}`), or the regions that could not be asked.
    pub async fn listing(
        &self,
        registry: &Registry,
        me: &str,
        auth: &HeaderValue,
        path: &str,
        query: &[(&str, &str)],
    ) -> Result<Vec<Value>, Vec<String>> {
        let mut all = Vec::new();
        let mut unreachable = Vec::new();
        for (region, url) in others(registry, me) {
            match self.get(region, url, path, query, auth).await {
                Ok(Some(Value::Object(mut page))) => match page.remove("data") {
                    Some(Value::Array(items)) => all.extend(items),
                    _ => unreachable.push(region.to_owned()),
                },
                Ok(_) => {}
                Err(()) => unreachable.push(region.to_owned()),
            }
        }
        if unreachable.is_empty() { Ok(all) } else { Err(unreachable) }
    }

    /// `Ok(None)` for a 404; `Err` when the region did not answer usefully
    /// (a 421 included: the URL reached another region than `region`).
    async fn get(
        &self,
        region: &str,
        base: &str,
        path: &str,
        query: &[(&str, &str)],
        auth: &HeaderValue,
    ) -> Result<Option<Value>, ()> {
        let sent = self
            .http
            .get(format!("{}{path}", base.trim_end_matches('/')))
            .query(query)
            .header(axum::http::header::AUTHORIZATION, auth.clone())
            .header(FORWARDED, region)
            .send()
            .await
            .map_err(|e| tracing::warn!(base, error = %e, "another region could not be asked"))?;
        match sent.status() {
            reqwest::StatusCode::OK => sent.json().await.map(Some).map_err(|_| ()),
            reqwest::StatusCode::NOT_FOUND => Ok(None),
            status => {
                tracing::warn!(base, %status, "another region could not answer");
                Err(())
            }
        }
    }
}

/// The regions other than `me` that advertise a URL. A region declared
/// failed is asked too: it still holds what it finished, and answers reads
/// while it is reachable.
fn others<'a>(registry: &'a Registry, me: &'a str) -> impl Iterator<Item = (&'a str, &'a str)> + 'a {
    registry.urls.iter().filter(move |(region, _)| region.as_str() != me).map(|(r, url)| (r.as_str(), url.as_str()))
}
