//! Looking up the names in webhook URLs, in the process and cancellable: a
//! lookup is a future that holds no thread and nothing shared, and ends
//! (sent queries and all) when its caller stops waiting, after
//! [`RESOLVE_FOR`] at most. Names that do not exist are remembered for a
//! while (negative caching), so asking again costs nothing. A client has at
//! most [`PER_CLIENT`] lookups of its own at once when it registers an
//! endpoint; its deliveries' lookups are bounded by the delivery worker's
//! share per client. So a client whose names never resolve (a zone whose
//! name servers do not answer) waits on its own lookups only.

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use hickory_resolver::TokioResolver;
use hickory_resolver::config::{NameServerConfig, ResolverConfig};
use hickory_resolver::net::runtime::TokioRuntimeProvider;

use crate::domain::{ClientId, Shares};

/// How long a name may take to resolve.
const RESOLVE_FOR: Duration = Duration::from_secs(2);

/// Lookups one client may have under way at once when registering.
pub const PER_CLIENT: usize = 4;

/// How long a name that does not exist is known not to, at least.
const REMEMBER_ABSENT: Duration = Duration::from_secs(30);

/// How long a name's addresses are kept at most, whatever their TTL.
const REMEMBER_FOUND: Duration = Duration::from_secs(300);

/// Answers kept at most.
const CACHED_ANSWERS: u64 = 256;

/// Addresses taken from one answer at most (every one must be public).
const ADDRESSES: usize = 16;

/// Why nothing could be looked up.
#[derive(Debug, thiserror::Error)]
pub enum NamesError {
    #[error("could not read the system's name-server settings: {0}")]
    System(#[source] hickory_resolver::net::NetError),
    #[error("could not make the name resolver: {0}")]
    Build(#[source] hickory_resolver::net::NetError),
}

/// A client has as many lookups under way as it may.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Busy;

/// The webhook name resolver; cheap to clone, one per process.
#[derive(Clone)]
pub struct Names {
    resolver: TokioResolver,
    /// Registration lookups under way, by client.
    asking: Shares<ClientId>,
}

impl Names {
    /// A resolver asking `server` (a DNS server's address), or the name
    /// servers of the system's settings (`/etc/resolv.conf`) when `None`.
    pub fn new(server: Option<SocketAddr>) -> Result<Self, NamesError> {
        let provider = TokioRuntimeProvider::default();
        let mut builder = match server {
            Some(at) => {
                let mut name_server = NameServerConfig::udp_and_tcp(at.ip());
                for connection in &mut name_server.connections {
                    connection.port = at.port();
                }
                TokioResolver::builder_with_config(ResolverConfig::from_name_servers(vec![name_server]), provider)
            }
            None => TokioResolver::builder(provider).map_err(NamesError::System)?,
        };
        let options = builder.options_mut();
        options.timeout = RESOLVE_FOR;
        options.attempts = 1;
        options.negative_min_ttl = Some(REMEMBER_ABSENT);
        // The cache is shared by every client: small, and nothing in it for
        // long, so no client's names can crowd it or pin memory.
        options.cache_size = CACHED_ANSWERS;
        options.positive_max_ttl = Some(REMEMBER_FOUND);
        let resolver = builder.build().map_err(NamesError::Build)?;
        Ok(Self { resolver, asking: Shares::default() })
    }

    /// The addresses `host` resolves to within [`RESOLVE_FOR`]; none when
    /// it does not resolve (or not in time).
    pub async fn resolve(&self, host: &str) -> Vec<IpAddr> {
        match tokio::time::timeout(RESOLVE_FOR, self.resolver.lookup_ip(host)).await {
            Ok(Ok(found)) => found.iter().take(ADDRESSES).collect(),
            Ok(Err(_)) | Err(_) => Vec::new(),
        }
    }

    /// [`Names::resolve`], as one of `client`'s [`PER_CLIENT`] lookups.
    pub async fn resolve_for(&self, client: ClientId, host: &str) -> Result<Vec<IpAddr>, Busy> {
        let _share = self.asking.take(client, PER_CLIENT).ok_or(Busy)?;
        Ok(self.resolve(host).await)
    }
}
