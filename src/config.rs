//! Settings, in groups each subcommand takes as it needs them (the key
//! store, the ledger, the rails, the protocol, and the front door around
//! them for `serve`), each read from a flag, else from the
//! environment (the standard `AWS_ENDPOINT_URL`, `AWS_REGION` and
//! `DATABASE_URL`, plus `KEYFENCE_*`), else a default that suits the local
//! stack. Values are validated when parsed, so a bad setting stops start-up
//! with a message naming it; secrets never appear in `Debug` output.

use std::time::Duration;

use clap::Args;

use crate::domain::{
    ANSWER_LIMIT, ProbeBackoff, RailSecrets, RegionSecret, Retention, SharedClock, parse_duration, parse_millis,
    parse_span,
};
use crate::http::FairUseSettings;
use crate::keystore::KeyStoreSettings;
use crate::ledger::LedgerSettings;
use crate::ledger::partitions::Partitioning;
use crate::rail::RailClient;
use crate::webhooks::{DeliverySettings, SealingSettings};

/// The external systems and how each is called.
#[derive(Args, Clone, Debug)]
pub struct RailSettings {
    /// Base URL of E1, the screening system.
    #[arg(long = "e1-url", env = "KEYFENCE_E1_URL", default_value = "http://127.0.0.1:9001",
          value_parser = clap::builder::NonEmptyStringValueParser::new())]
    pub e1_url: String,
    /// Base URL of E2, the payment rail.
    #[arg(long = "e2-url", env = "KEYFENCE_E2_URL", default_value = "http://127.0.0.1:9002",
          value_parser = clap::builder::NonEmptyStringValueParser::new())]
    pub e2_url: String,
    /// Time limit of one attempt at an external system, in milliseconds.
    #[arg(long = "rail-timeout-ms", env = "KEYFENCE_RAIL_TIMEOUT_MS", default_value = "1000", value_parser = parse_millis)]
    pub rail_timeout: Duration,
    /// Attempts per call to an external system when it answers "not applied" (503, 429, refused).
    #[arg(long = "rail-attempts", env = "KEYFENCE_RAIL_ATTEMPTS", default_value_t = 3,
          value_parser = clap::value_parser!(u32).range(1..=10))]
    pub rail_attempts: u32,
    /// A proxy every call to an external system goes through (`http://` or `https://`); none by
    /// default, whatever HTTP_PROXY and HTTPS_PROXY say.
    #[arg(long = "rail-proxy", env = "KEYFENCE_RAIL_PROXY", value_parser = ProxyParser, hide_env_values = true)]
    pub rail_proxy: Option<reqwest::Proxy>,
}

impl RailSettings {
    /// Why a rail's URL would send instructions in clear off this machine,
    /// if one would: plain http is for the simulators on loopback, and not
    /// through a proxy (where loopback is the proxy's own machine).
    pub fn in_clear(&self) -> Option<String> {
        [("KEYFENCE_E1_URL", &self.e1_url), ("KEYFENCE_E2_URL", &self.e2_url)].into_iter().find_map(|(name, url)| {
            let parsed = reqwest::Url::parse(url).ok();
            let scheme = parsed.as_ref().map_or("", |u| u.scheme());
            let host = parsed.as_ref().and_then(|u| u.host_str()).unwrap_or_default();
            let bare = host.trim_start_matches('[').trim_end_matches(']');
            let here = self.rail_proxy.is_none()
                && (host.eq_ignore_ascii_case("localhost")
                    || bare.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback()));
            match scheme {
                "https" => None,
                "http" if here => None,
                _ => Some(format!(
                    "{name} (host {host:?}) is not an https URL: plain http only to this machine, and through no proxy"
                )),
            }
        })
    }
}

/// Parses a proxy URL without ever repeating it in an error (it may hold
/// a credential, and come from the environment).
#[derive(Clone, Copy, Debug)]
struct ProxyParser;

impl clap::builder::TypedValueParser for ProxyParser {
    type Value = reqwest::Proxy;

    fn parse_ref(
        &self,
        cmd: &clap::Command,
        arg: Option<&clap::Arg>,
        value: &std::ffi::OsStr,
    ) -> Result<reqwest::Proxy, clap::Error> {
        let name = arg.map_or_else(|| "the proxy".to_owned(), ToString::to_string);
        let refused = |why: &str| {
            clap::Error::raw(clap::error::ErrorKind::ValueValidation, format!("{name}: {why}\n")).with_cmd(cmd)
        };
        let parsed =
            value.to_str().and_then(|url| reqwest::Url::parse(url).ok()).ok_or_else(|| refused("not a URL"))?;
        if !matches!(parsed.scheme(), "http" | "https") {
            return Err(refused("a proxy URL is http:// or https://"));
        }
        reqwest::Proxy::all(parsed).map_err(|_| refused("not a proxy URL the HTTP client takes"))
    }
}

/// How this instance takes part in the protocol.
#[derive(Args, Clone, Debug)]
pub struct WorkSettings {
    /// The region this instance works in; requests first claimed elsewhere are replayed, not worked.
    #[arg(long, env = "KEYFENCE_REGION", default_value = "local-1",
          value_parser = clap::builder::NonEmptyStringValueParser::new())]
    pub region: String,
    /// Names this instance in the leases it holds.
    #[arg(long, env = "KEYFENCE_INSTANCE", default_value_t = default_instance())]
    pub instance: String,
    /// Lease length in milliseconds: how long a silent owner keeps a request.
    #[arg(long = "lease-ms", env = "KEYFENCE_LEASE_MS", default_value = "10000", value_parser = parse_millis)]
    pub lease: Duration,
    /// Attempts with an unknown external outcome before a request is marked indeterminate.
    #[arg(long = "max-unknown-attempts", env = "KEYFENCE_MAX_UNKNOWN_ATTEMPTS", default_value_t = 5,
          value_parser = clap::value_parser!(i32).range(1..))]
    pub max_unknown_attempts: i32,
    /// How long the recovery worker leaves a parked request before probing it again, after its
    /// first unknown outcome (ms); doubled by every further one, up to --probe-backoff-max-ms.
    #[arg(long = "probe-backoff-ms", env = "KEYFENCE_PROBE_BACKOFF_MS", default_value = "5000",
          value_parser = parse_millis)]
    pub probe_backoff_first: Duration,
    /// The longest the recovery worker leaves a parked request unprobed (ms).
    #[arg(long = "probe-backoff-max-ms", env = "KEYFENCE_PROBE_BACKOFF_MAX_MS", default_value = "900000",
          value_parser = parse_millis)]
    pub probe_backoff_max: Duration,
    /// The largest final answer (status, headers and body, in bytes) a request may store, at
    /// least the default. Every field of a request, and every text a rail answers with, has a
    /// length limit that keeps the largest valid answer below the default; an answer over it is
    /// an operation's bug, refused before it is stored.
    #[arg(long = "answer-limit", env = "KEYFENCE_ANSWER_LIMIT", default_value_t = ANSWER_LIMIT,
          value_parser = clap::value_parser!(u32).range(i64::from(ANSWER_LIMIT)..=(350 * 1024)))]
    pub answer_limit: u32,
    #[command(flatten)]
    pub retention: RetentionSettings,
}

impl WorkSettings {
    pub fn probe_backoff(&self) -> ProbeBackoff {
        ProbeBackoff { first: self.probe_backoff_first, max: self.probe_backoff_max }
    }
}

/// How long finished keys are kept, and the margin for clock skew around
/// the end of that time (see [`Retention`]).
#[derive(Args, Clone, Debug)]
pub struct RetentionSettings {
    /// How long finished keys are kept and replayed: a duration such as 72h, 90m or 30s [default: 72h].
    #[arg(long = "retention", env = "KEYFENCE_RETENTION", value_parser = parse_duration)]
    pub retention: Option<Duration>,
    /// The same, in whole hours (kept for older deployments; KEYFENCE_RETENTION wins when both are set).
    #[arg(long = "retention-hours", env = "KEYFENCE_RETENTION_HOURS",
          value_parser = clap::value_parser!(u64).range(1..))]
    pub retention_hours: Option<u64>,
    /// Margin for clock skew: keys are deleted or claimed anew this long after their retention ends on
    /// the deciding clock, and no longer replayed from memory this long before it.
    #[arg(long = "retention-grace", env = "KEYFENCE_RETENTION_GRACE", default_value = "10m",
          value_parser = parse_duration)]
    pub grace: Duration,
}

impl RetentionSettings {
    /// 72 hours and a 10-minute grace, unless set.
    pub fn retention(&self) -> Retention {
        let keep = self
            .retention
            .or(self.retention_hours.map(|hours| Duration::from_secs(hours * 3600)))
            .unwrap_or(Duration::from_secs(72 * 3600));
        Retention { keep, grace: self.grace }
    }
}

/// How the ledger's idempotency tables are partitioned by time, and how
/// long they keep a request (see [`crate::ledger::partitions`]).
#[derive(Args, Clone, Copy, Debug)]
pub struct PartitionSettings {
    /// The time one partition holds: a duration in whole seconds such as 1d or 6h.
    #[arg(long = "partition-span", env = "KEYFENCE_PARTITION_SPAN", default_value = "1d", value_parser = parse_span)]
    pub span: Duration,
    /// How many spans past now have their partitions made.
    #[arg(long = "partitions-ahead", env = "KEYFENCE_PARTITIONS_AHEAD", default_value_t = 7,
          value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub ahead: u32,
    /// How long the ledger keeps a request's rows after it began: at least the retention and its
    /// grace, and longer than the rails take to return a payment (a return finds its payment
    /// through them; a later one is kept for a person).
    #[arg(long = "ledger-retention", env = "KEYFENCE_LEDGER_RETENTION", default_value = "35d",
          value_parser = parse_duration)]
    pub keep: Duration,
}

impl PartitionSettings {
    /// The partitioning, refused if the ledger would drop a request whose key may still be live
    /// (its retention, and a grace each for the clocks of the key store's writer and the ledger).
    pub fn partitioning(&self, retention: &Retention) -> Result<Partitioning, String> {
        let least = retention.keep + retention.grace * 2;
        if self.keep < least {
            return Err(format!(
                "KEYFENCE_LEDGER_RETENTION={} is shorter than the key retention and twice its grace ({}): the \
                 ledger would drop requests whose keys are still replayed",
                humantime::format_duration(self.keep),
                humantime::format_duration(least),
            ));
        }
        Ok(Partitioning { span: self.span, ahead: self.ahead, keep: self.keep })
    }
}

impl Default for PartitionSettings {
    fn default() -> Self {
        Self { span: Duration::from_secs(86_400), ahead: 7, keep: Duration::from_secs(35 * 86_400) }
    }
}

impl Default for RetentionSettings {
    fn default() -> Self {
        Self { retention: None, retention_hours: None, grace: Duration::from_secs(600) }
    }
}

/// What the engine works with: both stores, the rails, and how this
/// instance takes part (what `recover` and `reconcile` need, and `serve`).
#[derive(Args, Clone, Debug)]
pub struct EngineConfig {
    #[command(flatten)]
    pub keys: KeyStoreSettings,
    #[command(flatten)]
    pub ledger: LedgerSettings,
    #[command(flatten)]
    pub rails: RailSettings,
    #[command(flatten)]
    pub work: WorkSettings,
    /// The settings left at their local-development defaults (their
    /// variables' names), which the command line fills in: away from a
    /// local endpoint no command works the protocol on them.
    #[arg(skip)]
    pub defaulted: Vec<&'static str>,
    /// What the engine, the caches and the workers reckon time by: the
    /// system's, or one a test moves.
    #[arg(skip)]
    pub clock: SharedClock,
}

impl EngineConfig {
    /// Why these settings would work the protocol on local-development
    /// defaults away from a local endpoint, if they would.
    pub fn local_defaults_elsewhere(&self) -> Option<String> {
        (!self.keys.local_endpoint() && !self.defaulted.is_empty()).then(|| {
            format!(
                "{} left at the local-development default outside a local endpoint (AWS_ENDPOINT_URL is {}): set \
                 each explicitly for this region",
                self.defaulted.join(", "),
                self.keys.aws_endpoint_url.as_deref().unwrap_or("unset, so AWS itself"),
            )
        })
    }

    /// What makes these settings unable to work together, if anything. An
    /// owner checks its lease before each external call and renews it once
    /// a third is gone, so the longest call (every attempt timing out) must
    /// fit in a third of the lease; otherwise the lease can run out while a
    /// call is in flight and a second owner would start beside the first.
    pub fn conflicts(&self) -> Vec<String> {
        let (rails, lease) = (&self.rails, self.work.lease);
        let longest = RailClient::longest_call(rails.rail_timeout, rails.rail_attempts);
        let mut conflicts = Vec::new();
        let grace = self.work.retention.grace;
        if grace * 3 < lease {
            conflicts.push(format!(
                "KEYFENCE_RETENTION_GRACE={} s is less than a third of KEYFENCE_LEASE_MS={}: the grace is the clock \
                 skew keys tolerate at the end of their retention, and leases already tolerate a third of a lease; \
                 raise the grace to at least {} ms",
                grace.as_secs_f64(),
                lease.as_millis(),
                lease.as_millis().div_ceil(3),
            ));
        }
        if longest * 3 > lease {
            conflicts.push(format!(
                "a call to a rail can take {} ms ({} attempts of KEYFENCE_RAIL_TIMEOUT_MS={} with backoff), more than a \
                 third of KEYFENCE_LEASE_MS={}: raise the lease to at least {} ms, or lower the rail timeout or attempts",
                longest.as_millis(),
                rails.rail_attempts,
                rails.rail_timeout.as_millis(),
                lease.as_millis(),
                (longest * 3).as_millis(),
            ));
        }
        conflicts
    }
}

/// Everything `keyfence serve` needs: the engine, and the front door and
/// workers around it.
#[derive(Args, Clone, Debug)]
pub struct ServeSettings {
    #[command(flatten)]
    pub engine: EngineConfig,
    /// Address to listen on.
    #[arg(long, env = "KEYFENCE_LISTEN", default_value = "127.0.0.1:8080")]
    pub listen: std::net::SocketAddr,
    /// Address of the admin listener: /metrics and /readyz in detail, for operators and scrapers
    /// (keep it off the public network).
    #[arg(long = "admin-listen", env = "KEYFENCE_ADMIN_LISTEN", default_value = "127.0.0.1:9090")]
    pub admin_listen: std::net::SocketAddr,
    /// Where clients and other regions reach this region's front door (its load
    /// balancer); advertised in the key table so other regions can ask it for
    /// what only it holds. Default: http:// and the address `serve` listens on.
    #[arg(long = "public-url", env = "KEYFENCE_PUBLIC_URL")]
    pub public_url: Option<String>,
    /// Every region runs on this machine (development and tests): advertise a loopback or
    /// unspecified address too. Without it such a URL is not advertised, since another
    /// region asking it would reach its own front door.
    #[arg(long = "local-regions", env = "KEYFENCE_LOCAL_REGIONS", default_value_t = false,
          value_parser = clap::builder::BoolishValueParser::new(), num_args = 0..=1,
          default_missing_value = "true", action = clap::ArgAction::Set)]
    pub local_regions: bool,
    /// Webhook endpoints may point inside the network (loopback, private, link-local addresses)
    /// and, on this machine, use plain http: for development and tests only.
    #[arg(long = "webhooks-allow-private", env = "KEYFENCE_WEBHOOKS_ALLOW_PRIVATE", default_value_t = false,
          value_parser = clap::builder::BoolishValueParser::new(), num_args = 0..=1,
          default_missing_value = "true", action = clap::ArgAction::Set)]
    pub webhooks_allow_private: bool,
    /// The DNS server (`IP:PORT`) webhook URLs' names are looked up at; else the system's
    /// (`/etc/resolv.conf`).
    #[arg(long = "webhooks-resolver", env = "KEYFENCE_WEBHOOKS_RESOLVER")]
    pub webhooks_resolver: Option<std::net::SocketAddr>,
    #[command(flatten)]
    pub webhook_delivery: DeliverySettings,
    #[command(flatten)]
    pub webhook_sealing: SealingSettings,
    /// How often the inbox worker applies what the rails' notifications wait for (returns of
    /// payments that settled since, verdicts nobody is working), in milliseconds (0: never).
    #[arg(long = "inbox-interval-ms", env = "KEYFENCE_INBOX_INTERVAL_MS", default_value_t = 1000)]
    pub inbox_interval_ms: u64,
    /// The secrets the rails sign their notifications with, when given in code (tests); else
    /// `KEYFENCE_E1_NOTIFY_SECRET` and `KEYFENCE_E2_NOTIFY_SECRET` (the environment only).
    #[arg(skip)]
    pub rail_secrets: Option<RailSecrets>,
    /// Largest request body accepted, in bytes.
    #[arg(long = "body-limit", env = "KEYFENCE_BODY_LIMIT", default_value_t = 16 * 1024)]
    pub body_limit: usize,
    /// Time a client has to send a request's headers, from their first byte (a new connection's
    /// first request: from opening), in milliseconds.
    #[arg(long = "header-timeout-ms", env = "KEYFENCE_HEADER_TIMEOUT_MS", default_value = "10000", value_parser = parse_millis)]
    pub header_timeout: Duration,
    /// The longest a keep-alive connection stays open idle between requests, in milliseconds:
    /// longer than the idle timeout of the load balancer in front (AWS ALB: 60 s), so it is the
    /// load balancer that closes an idle connection, never keyfence under it.
    #[arg(long = "idle-timeout-ms", env = "KEYFENCE_IDLE_TIMEOUT_MS", default_value = "75000", value_parser = parse_millis)]
    pub idle_timeout: Duration,
    /// Time a client has to send a request's whole body, in milliseconds (past it: 408).
    #[arg(long = "body-timeout-ms", env = "KEYFENCE_BODY_TIMEOUT_MS", default_value = "10000", value_parser = parse_millis)]
    pub body_timeout: Duration,
    /// Connections served at once; more wait in the listen backlog.
    #[arg(long = "max-connections", env = "KEYFENCE_MAX_CONNECTIONS", default_value_t = 1024,
          value_parser = clap::builder::TypedValueParser::map(clap::value_parser!(u32).range(1..), |n| n as usize))]
    pub max_connections: usize,
    /// Connections served at once from one peer address; more are closed at
    /// once (behind a load balancer every connection comes from its few addresses: raise this to
    /// max-connections, and cap per client address at the load balancer).
    #[arg(long = "max-connections-per-address", env = "KEYFENCE_MAX_CONNECTIONS_PER_ADDRESS", default_value_t = 64,
          value_parser = clap::builder::TypedValueParser::map(clap::value_parser!(u32).range(1..), |n| n as usize))]
    pub max_connections_per_address: usize,
    /// Requests one connection serves; the last is answered with `Connection: close`.
    #[arg(long = "max-requests-per-connection", env = "KEYFENCE_MAX_REQUESTS_PER_CONNECTION", default_value_t = 1000,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub max_requests_per_connection: u32,
    /// How long one connection lives, in milliseconds; then it is closed after its request in flight.
    #[arg(long = "max-connection-age-ms", env = "KEYFENCE_MAX_CONNECTION_AGE_MS", default_value = "60000", value_parser = parse_millis)]
    pub max_connection_age: Duration,
    /// How long a write may wait on a client that reads nothing before its connection is cut
    /// off, in milliseconds (also the socket's TCP_USER_TIMEOUT).
    #[arg(long = "write-timeout-ms", env = "KEYFENCE_WRITE_TIMEOUT_MS", default_value = "10000", value_parser = parse_millis)]
    pub write_timeout: Duration,
    /// How long a connection told to close (past its age, or at shutdown) may take to finish
    /// its request in flight before it is dropped, in milliseconds: `serve` stops within it on
    /// SIGTERM.
    #[arg(long = "drain-timeout-ms", env = "KEYFENCE_DRAIN_TIMEOUT_MS", default_value = "10000", value_parser = parse_millis)]
    pub drain_timeout: Duration,
    /// How often the recovery worker looks for stale requests, in milliseconds (0: never).
    #[arg(long = "recovery-interval-ms", env = "KEYFENCE_RECOVERY_INTERVAL_MS", default_value_t = 5000)]
    pub recovery_interval_ms: u64,
    /// How often `serve` deletes expired keys itself, in milliseconds (0: never; for tables without
    /// a time-to-live, such as strongly consistent global tables).
    #[arg(long = "expire-interval-ms", env = "KEYFENCE_EXPIRE_INTERVAL_MS", default_value_t = 0)]
    pub expire_interval_ms: u64,
    /// Expired keys deleted per second at most.
    #[arg(long = "expire-rate", env = "KEYFENCE_EXPIRE_RATE", default_value_t = 50,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub expire_rate: u32,
    /// How often `serve` makes the ledger's partitions ahead and drops old ones, in milliseconds
    /// (0: never; then `keyfence maintain --partitions` must). The first round runs at start-up.
    #[arg(long = "partition-interval-ms", env = "KEYFENCE_PARTITION_INTERVAL_MS", default_value_t = 3_600_000)]
    pub partition_interval_ms: u64,
    #[command(flatten)]
    pub partitions: PartitionSettings,
    #[command(flatten)]
    pub fair_use: FairUseSettings,
    /// File holding the region secret every region of the deployment shares (at least 32 bytes),
    /// which signs the reads regions forward to each other. Else `KEYFENCE_REGION_SECRET` (the
    /// environment only: a secret is never a flag). Without either, no other region is asked.
    #[arg(long = "region-secret-file", env = "KEYFENCE_REGION_SECRET_FILE")]
    pub region_secret_file: Option<std::path::PathBuf>,
    /// The secret itself, when given in code (tests); else read from the file or the environment.
    #[arg(skip)]
    pub region_secret: Option<RegionSecret>,
    /// File holding a second region secret, accepted beside the first but never signed with,
    /// while the secret is rotated (docs/deploy.md). Else `KEYFENCE_REGION_SECRET_ACCEPTED` (the
    /// environment only).
    #[arg(long = "region-secret-accepted-file", env = "KEYFENCE_REGION_SECRET_ACCEPTED_FILE")]
    pub region_secret_accepted_file: Option<std::path::PathBuf>,
}

impl ServeSettings {
    /// The region secret: given in code, else read from
    /// `--region-secret-file`, else `KEYFENCE_REGION_SECRET`; `None` if
    /// none is set (an error says what is wrong with one that is).
    pub fn find_region_secret(&self) -> Result<Option<RegionSecret>, String> {
        if let Some(secret) = &self.region_secret {
            return Ok(Some(secret.clone()));
        }
        let secret = secret_from(self.region_secret_file.as_deref(), "KEYFENCE_REGION_SECRET")?;
        let accepted = secret_from(self.region_secret_accepted_file.as_deref(), "KEYFENCE_REGION_SECRET_ACCEPTED")?;
        match (secret, accepted) {
            (Some(secret), Some(accepted)) => Ok(Some(secret.also_accepting(&accepted))),
            (None, Some(_)) => Err("a region secret to accept is set, but none to sign with".into()),
            (secret, None) => Ok(secret),
        }
    }

    /// The rails' notification secrets: given in code, else
    /// `KEYFENCE_E1_NOTIFY_SECRET` and `KEYFENCE_E2_NOTIFY_SECRET`, where set.
    pub fn find_rail_secrets(&self) -> RailSecrets {
        if let Some(secrets) = &self.rail_secrets {
            return secrets.clone();
        }
        let secrets = ["e1", "e2"]
            .into_iter()
            .filter_map(|rail| {
                let secret = std::env::var(format!("KEYFENCE_{}_NOTIFY_SECRET", rail.to_uppercase())).ok()?;
                Some((rail.to_owned(), secret)).filter(|(_, s)| !s.is_empty())
            })
            .collect();
        RailSecrets::new(secrets)
    }
}

/// A region secret read from `file` if given, else from the environment
/// variable `variable`; `None` if neither is set.
fn secret_from(file: Option<&std::path::Path>, variable: &str) -> Result<Option<RegionSecret>, String> {
    if let Some(file) = file {
        let raw = std::fs::read_to_string(file)
            .map_err(|e| format!("cannot read the region secret from {}: {e}", file.display()))?;
        return RegionSecret::new(&raw).map(Some);
    }
    std::env::var(variable).ok().map(|raw| RegionSecret::new(&raw)).transpose()
}

fn default_instance() -> String {
    let host = std::env::var("HOSTNAME").unwrap_or_else(|_| "keyfence".to_owned());
    format!("{host}-{}", std::process::id())
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[test]
    fn retention_takes_durations_and_still_hours() {
        let parse = |args: &[&str]| {
            #[derive(Parser)]
            struct Only {
                #[command(flatten)]
                retention: RetentionSettings,
            }
            Only::try_parse_from(std::iter::once("keyfence").chain(args.iter().copied()))
                .map(|only| only.retention.retention())
        };
        let day = Duration::from_secs(24 * 3600);
        assert_eq!(parse(&[]).unwrap().keep, 3 * day, "72 hours by default");
        assert_eq!(parse(&[]).unwrap().grace, Duration::from_secs(600), "ten minutes of grace by default");
        assert_eq!(parse(&["--retention", "90s"]).unwrap().keep, Duration::from_secs(90));
        assert_eq!(parse(&["--retention", "1h 30m"]).unwrap().keep, Duration::from_secs(5400));
        assert_eq!(parse(&["--retention-hours", "24"]).unwrap().keep, day);
        assert_eq!(parse(&["--retention-hours", "24", "--retention", "2h"]).unwrap().keep, day / 12);
        assert_eq!(parse(&["--retention-grace", "45s"]).unwrap().grace, Duration::from_secs(45));
        assert!(parse(&["--retention", "soon"]).is_err());
        assert!(parse(&["--retention", "0s"]).is_err());
    }

    #[test]
    fn a_rail_is_called_in_clear_only_on_this_machine_and_proxied_only_when_asked() {
        let rails = |args: &[&str]| {
            #[derive(Parser)]
            struct Only {
                #[command(flatten)]
                rails: RailSettings,
            }
            Only::try_parse_from(std::iter::once("keyfence").chain(args.iter().copied())).map(|o| o.rails)
        };
        assert_eq!(rails(&[]).unwrap().in_clear(), None, "the simulators on loopback");
        assert_eq!(rails(&["--e2-url", "https://rail.example.com"]).unwrap().in_clear(), None);
        let why = rails(&["--e2-url", "http://rail.example.com"]).unwrap().in_clear().unwrap();
        assert!(why.contains("KEYFENCE_E2_URL"), "{why}");
        assert!(rails(&["--e1-url", "http://10.0.0.7:9001"]).unwrap().in_clear().is_some());
        assert!(rails(&["--e1-url", "ftp://[::1]:9001"]).unwrap().in_clear().is_some());
        assert!(rails(&[]).unwrap().rail_proxy.is_none(), "no proxy unless one is set");
        assert!(rails(&["--rail-proxy", "http://proxy.internal:3128"]).unwrap().rail_proxy.is_some());
        let refused = rails(&["--rail-proxy", "gopher://user:s3cret@proxy.internal"]).err().unwrap().to_string();
        assert!(refused.contains("http://") && !refused.contains("s3cret"), "{refused}");
        let proxied = rails(&["--rail-proxy", "http://proxy.internal:3128"]).unwrap();
        assert!(proxied.in_clear().is_some(), "the simulators' loopback is not the proxy's");
    }

    #[test]
    fn a_grace_shorter_than_the_skew_leases_tolerate_is_refused() {
        let engine = |args: &[&str]| {
            #[derive(Parser)]
            struct Only {
                #[command(flatten)]
                engine: EngineConfig,
            }
            Only::try_parse_from(std::iter::once("keyfence").chain(args.iter().copied())).unwrap().engine
        };
        assert!(engine(&[]).conflicts().is_empty());
        let conflicts = engine(&["--retention-grace", "3s", "--lease-ms", "10000"]).conflicts();
        assert_eq!(conflicts.len(), 1, "{conflicts:?}");
        assert!(conflicts[0].contains("KEYFENCE_RETENTION_GRACE"), "{conflicts:?}");
        assert!(engine(&["--retention-grace", "4s", "--lease-ms", "10000"]).conflicts().is_empty());
    }
}
