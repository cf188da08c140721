//! Region URLs: where payments go. Every request carries the client's API
//! key and a payment, so a region is `https`, except this machine itself
//! (`localhost`, `127.0.0.0/8`, `::1`: local development, a sidecar that
//! terminates TLS), where nothing crosses a network.

use url::{Host, Url};

use crate::error::BuildError;

/// `url` checked, without its trailing slashes (paths are appended to it).
pub(crate) fn checked(url: &str) -> Result<String, BuildError> {
    let parsed = Url::parse(url).map_err(|source| BuildError::InvalidUrl { url: url.to_owned(), source })?;
    let secure = match parsed.scheme() {
        "https" => true,
        "http" => is_this_machine(parsed.host()),
        _ => false,
    };
    if !secure {
        return Err(BuildError::NotHttps { url: url.to_owned() });
    }
    Ok(url.trim_end_matches('/').to_owned())
}

/// Names that reach this machine without a resolver's say-so: `localhost`
/// and the loopback addresses. Subdomains of `localhost` are not taken on
/// trust, since not every resolver keeps them local.
fn is_this_machine(host: Option<Host<&str>>) -> bool {
    match host {
        Some(Host::Domain(name)) => name.eq_ignore_ascii_case("localhost"),
        Some(Host::Ipv4(address)) => address.is_loopback(),
        Some(Host::Ipv6(address)) => address.is_loopback(),
        None => false,
    }
}
