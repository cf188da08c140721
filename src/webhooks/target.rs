//! Where a webhook may point. Only https, to a host that resolves to public
//! addresses only: an endpoint at a loopback, private, link-local or
//! otherwise internal address would let any client make keyfence's
//! instances call into the network they run in. `KEYFENCE_WEBHOOKS_ALLOW_PRIVATE`
//! (the dev stack and tests) allows such addresses, resolving nothing, and
//! plain http to this machine.

use std::net::IpAddr;

use super::names::{Busy, Names};
use crate::domain::ClientId;

/// The address a URL names literally, if it does (then nothing resolves it).
pub(super) fn literal(url: &reqwest::Url) -> Option<IpAddr> {
    url.host_str().and_then(|host| host.trim_start_matches('[').trim_end_matches(']').parse().ok())
}

/// Why a URL is not taken.
#[derive(Debug, thiserror::Error)]
pub enum Refused {
    #[error("{0}")]
    Invalid(String),
    /// The client has as many names being looked up as it may: try again.
    #[error("too many of this client's webhook URLs are being checked at once; try again")]
    Busy,
}

impl From<Busy> for Refused {
    fn from(Busy: Busy) -> Self {
        Self::Busy
    }
}

/// What the operator allows webhooks to point at, and how names are
/// looked up to tell.
#[derive(Clone)]
pub struct TargetPolicy {
    /// Internal addresses (and plain http to this machine) are allowed.
    pub allow_private: bool,
    pub names: Names,
}

impl TargetPolicy {
    /// `url` normalised, if a webhook may point there; else why not. The
    /// host is resolved, and every address it resolves to must be allowed.
    /// One answer for every host that is not a public address, whether it
    /// does not resolve or resolves inside: no view of the network's names.
    /// The lookup is one of `client`'s own ([`super::names::PER_CLIENT`]).
    pub async fn check(&self, url: &str, client: ClientId) -> Result<String, Refused> {
        let invalid = |why: &str| Refused::Invalid(why.to_owned());
        let parsed = reqwest::Url::parse(url).map_err(|e| Refused::Invalid(format!("not a URL: {e}")))?;
        if !parsed.username().is_empty() || parsed.password().is_some() {
            return Err(invalid("a webhook URL holds no credentials"));
        }
        let host = parsed.host_str().ok_or_else(|| invalid("a webhook URL names a host"))?.to_owned();
        let literal = literal(&parsed);
        if self.allow_private {
            // Anything goes but plain http off this machine: nothing to resolve.
            let here = literal.is_some_and(|ip| ip.is_loopback()) || host.eq_ignore_ascii_case("localhost");
            return match parsed.scheme() {
                "https" => Ok(parsed.to_string()),
                "http" if here => Ok(parsed.to_string()),
                _ => Err(invalid("a webhook URL is https (plain http only to this machine)")),
            };
        }
        if parsed.scheme() != "https" {
            return Err(invalid("a webhook URL is https"));
        }
        let not_public = || Refused::Invalid(format!("{host} is not a public address"));
        let addresses: Vec<IpAddr> = match literal {
            Some(ip) => vec![ip],
            None => self.names.resolve_for(client, &host).await?,
        };
        if addresses.is_empty() || addresses.iter().any(|ip| is_internal(*ip)) {
            return Err(not_public());
        }
        Ok(parsed.to_string())
    }
}

/// Loopback, private, link-local, shared, unspecified, multicast, reserved
/// or documentation addresses, and IPv6 forms that carry such an IPv4
/// address (mapped, compatible, NAT64, 6to4) or tunnel (Teredo): none is a
/// receiver on the internet.
pub(super) fn is_internal(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => {
            let [a, b, c, _] = v4.octets();
            v4.is_loopback()
                || v4.is_private()
                || v4.is_link_local()
                || v4.is_unspecified()
                || v4.is_broadcast()
                || v4.is_multicast()
                || v4.is_documentation()
                || (a == 100 && (64..128).contains(&b))
                || (a == 192 && b == 0 && c == 0)
                || (a == 198 && (18..20).contains(&b))
                || (a == 192 && b == 88 && c == 99)
                || a == 0
                || a >= 240
        }
        IpAddr::V6(v6) => {
            let s = v6.segments();
            let embedded = |high: u16, low: u16| {
                is_internal(IpAddr::V4(std::net::Ipv4Addr::new(
                    (high >> 8) as u8,
                    high as u8,
                    (low >> 8) as u8,
                    low as u8,
                )))
            };
            if let Some(v4) = v6.to_ipv4_mapped() {
                return is_internal(IpAddr::V4(v4));
            }
            v6.is_loopback()
                || v6.is_unspecified()
                || v6.is_multicast()
                || (s[0] & 0xfe00) == 0xfc00
                || (s[0] & 0xffc0) == 0xfe80
                || (s[0] & 0xffc0) == 0xfec0
                || (s[0] == 0x2001 && s[1] == 0x0db8)
                || (s[0] == 0x2001 && s[1] == 0)
                || (s[..6] == [0; 6] && embedded(s[6], s[7]))
                || (s[..6] == [0x64, 0xff9b, 0, 0, 0, 0] && embedded(s[6], s[7]))
                || (s[0] == 0x2002 && embedded(s[1], s[2]))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn only_public_https_targets_unless_private_ones_are_allowed() {
        let names = Names::new(None).unwrap();
        let client = ClientId::new(uuid::Uuid::nil());
        let strict = TargetPolicy { allow_private: false, names: names.clone() };
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
            "https://[64:ff9b::a00:1]/hook",
            "https://[::127.0.0.1]/hook",
            "https://[2002:a9fe:a9fe::]/hook",
            "https://[2001::1]/hook",
            "https://2130706433/hook",
            "https://198.18.0.1/hook",
            "https://100.64.0.1/hook",
            "https://0.0.0.0/hook",
            "https://localhost/hook",
            "https://user:pw@93.184.216.34/hook",
            "ftp://93.184.216.34/hook",
            "not a url",
        ] {
            assert!(strict.check(url, client).await.is_err(), "{url} is refused");
        }
        assert_eq!(strict.check("https://93.184.216.34/hook", client).await.unwrap(), "https://93.184.216.34/hook");

        let dev = TargetPolicy { allow_private: true, names };
        assert!(dev.check("http://127.0.0.1:9000/hook", client).await.is_ok());
        assert!(dev.check("https://10.0.0.7/hook", client).await.is_ok());
        assert!(dev.check("http://localhost:9000/hook", client).await.is_ok());
        assert!(dev.check("http://10.0.0.7/hook", client).await.is_err(), "plain http only to this machine");
        assert!(dev.check("http://hooks.example/hook", client).await.is_err());
    }
}
