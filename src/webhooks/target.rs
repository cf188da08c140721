//! Where a webhook may point. Only https, to a host that resolves to public
//! addresses only: an endpoint at a loopback, private, link-local or
//! otherwise internal address would let any client make keyfence's
//! instances call into the network they run in. `KEYFENCE_WEBHOOKS_ALLOW_PRIVATE`
//! (the dev stack and tests) allows such addresses, resolving nothing, and
//! plain http to this machine.

use std::net::IpAddr;

/// How long a host's name may take to resolve.
const RESOLVE_FOR: std::time::Duration = std::time::Duration::from_secs(2);

/// What the operator allows webhooks to point at.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TargetPolicy {
    /// Internal addresses (and plain http to this machine) are allowed.
    pub allow_private: bool,
}

impl TargetPolicy {
    /// `url` normalised, if a webhook may point there; else why not. The
    /// host is resolved, and every address it resolves to must be allowed.
    pub async fn check(&self, url: &str) -> Result<String, String> {
        let parsed = reqwest::Url::parse(url).map_err(|e| format!("not a URL: {e}"))?;
        if !parsed.username().is_empty() || parsed.password().is_some() {
            return Err("a webhook URL holds no credentials".into());
        }
        let host = parsed.host_str().ok_or("a webhook URL names a host")?.to_owned();
        let port = parsed.port_or_known_default().ok_or("a webhook URL is https")?;
        let literal = host.trim_start_matches('[').trim_end_matches(']').parse::<IpAddr>().ok();
        if self.allow_private {
            // Anything goes but plain http off this machine: nothing to resolve.
            let here = literal.is_some_and(|ip| ip.is_loopback()) || host.eq_ignore_ascii_case("localhost");
            return match parsed.scheme() {
                "https" => Ok(parsed.to_string()),
                "http" if here => Ok(parsed.to_string()),
                _ => Err("a webhook URL is https (plain http only to this machine)".into()),
            };
        }
        let addresses: Vec<IpAddr> = match literal {
            Some(ip) => vec![ip],
            None => tokio::time::timeout(RESOLVE_FOR, tokio::net::lookup_host((host.as_str(), port)))
                .await
                .map_err(|_| format!("{host} did not resolve within {RESOLVE_FOR:?}"))?
                .map_err(|e| format!("{host} does not resolve: {e}"))?
                .map(|a| a.ip())
                .collect(),
        };
        if addresses.is_empty() {
            return Err(format!("{host} does not resolve"));
        }
        if parsed.scheme() != "https" {
            return Err("a webhook URL is https".into());
        }
        if addresses.iter().any(|ip| is_internal(*ip)) {
            return Err(format!(
                "{host} resolves to an address inside the network (loopback, private or link-local): not a webhook \
                 target"
            ));
        }
        Ok(parsed.to_string())
    }
}

/// Loopback, private, link-local, shared, unspecified, multicast or
/// documentation addresses: none is a receiver on the internet.
fn is_internal(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => {
            let [a, b, ..] = v4.octets();
            v4.is_loopback()
                || v4.is_private()
                || v4.is_link_local()
                || v4.is_unspecified()
                || v4.is_broadcast()
                || v4.is_multicast()
                || v4.is_documentation()
                || (a == 100 && (64..128).contains(&b))
                || a == 0
                || a >= 240
        }
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => is_internal(IpAddr::V4(v4)),
            None => {
                let first = v6.segments()[0];
                v6.is_loopback()
                    || v6.is_unspecified()
                    || v6.is_multicast()
                    || (first & 0xfe00) == 0xfc00
                    || (first & 0xffc0) == 0xfe80
            }
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn only_public_https_targets_unless_private_ones_are_allowed() {
        let strict = TargetPolicy::default();
        for url in [
            "http://93.184.216.34/hook",
            "https://10.0.0.7/hook",
            "https://192.168.1.1/hook",
            "https://172.16.0.1/hook",
            "https://169.254.169.254/latest/meta-data",
            "https://127.0.0.1:9000/hook",
            "https://[::1]/hook",
            "https://[fd00::1]/hook",
            "https://[::ffff:10.0.0.1]/hook",
            "https://100.64.0.1/hook",
            "https://0.0.0.0/hook",
            "https://localhost/hook",
            "https://user:pw@93.184.216.34/hook",
            "ftp://93.184.216.34/hook",
            "not a url",
        ] {
            assert!(strict.check(url).await.is_err(), "{url} is refused");
        }
        assert_eq!(strict.check("https://93.184.216.34/hook").await.unwrap(), "https://93.184.216.34/hook");

        let dev = TargetPolicy { allow_private: true };
        assert!(dev.check("http://127.0.0.1:9000/hook").await.is_ok());
        assert!(dev.check("https://10.0.0.7/hook").await.is_ok());
        assert!(dev.check("http://localhost:9000/hook").await.is_ok());
        assert!(dev.check("http://10.0.0.7/hook").await.is_err(), "plain http only to this machine");
        assert!(dev.check("http://hooks.example/hook").await.is_err());
    }
}
