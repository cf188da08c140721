//! Reading keyfence's answers without trusting the server that sends
//! them: a body is read up to [`MAX_BODY`] and no further, and
//! `Retry-After` is understood in both of its forms (RFC 9110 §10.2.3).

use std::time::{Duration, SystemTime};

use reqwest::Response;
use reqwest::header::{HeaderMap, RETRY_AFTER};
use serde::de::DeserializeOwned;

/// The longest answer read. keyfence's are well under a kilobyte; anything
/// past this is a server (or something in front of it) that should not be
/// able to make the client hold memory for it.
pub(crate) const MAX_BODY: usize = 64 * 1024;

/// The answer's JSON body, if it is one of at most [`MAX_BODY`] bytes.
/// Reading stops at the cap, and the connection goes with the response.
pub(crate) async fn json<T: DeserializeOwned>(mut response: Response) -> Option<T> {
    let mut body = Vec::new();
    while let Some(chunk) = response.chunk().await.ok()? {
        if body.len() + chunk.len() > MAX_BODY {
            return None;
        }
        body.extend_from_slice(&chunk);
    }
    serde_json::from_slice(&body).ok()
}

/// How long a server asks to be left alone: `Retry-After` as seconds, or
/// as an HTTP date (a date already past asks for no wait); `None` without
/// one, or with one that is neither.
pub fn retry_after(headers: &HeaderMap, now: SystemTime) -> Option<Duration> {
    let value = headers.get(RETRY_AFTER)?.to_str().ok()?.trim();
    if let Ok(seconds) = value.parse::<u64>() {
        return Some(Duration::from_secs(seconds));
    }
    let at = httpdate::parse_http_date(value).ok()?;
    Some(at.duration_since(now).unwrap_or_default())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(value: &str) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(RETRY_AFTER, value.parse().unwrap());
        headers
    }

    #[test]
    fn retry_after_is_read_as_seconds_or_as_a_date() {
        let now = httpdate::parse_http_date("Sun, 06 Nov 1994 08:49:37 GMT").unwrap();
        assert_eq!(retry_after(&with("120"), now), Some(Duration::from_secs(120)));
        assert_eq!(retry_after(&with("Sun, 06 Nov 1994 08:50:07 GMT"), now), Some(Duration::from_secs(30)));
        // RFC 850 and asctime dates, which recipients must still accept.
        assert_eq!(retry_after(&with("Sunday, 06-Nov-94 08:49:47 GMT"), now), Some(Duration::from_secs(10)));
        assert_eq!(retry_after(&with("Sun Nov  6 08:49:38 1994"), now), Some(Duration::from_secs(1)));
        assert_eq!(retry_after(&with("Sun, 06 Nov 1994 08:00:00 GMT"), now), Some(Duration::ZERO));
        assert_eq!(retry_after(&with("soon"), now), None);
        assert_eq!(retry_after(&HeaderMap::new(), now), None);
    }
}
