//! The ledger's settings: which PostgreSQL (`DATABASE_URL`, its password
//! never shown) and how many connections its pool holds. A URL naming
//! another machine must say how TLS is used (`sslmode`): left out, the
//! driver's default tries TLS and falls back to plain text without a word.

use std::fmt;
use std::str::FromStr;

use clap::{Args, Parser};
use sqlx::postgres::PgConnectOptions;

/// Where the regional ledger lives.
#[derive(Args, Clone, Debug)]
pub struct LedgerSettings {
    /// PostgreSQL URL of this region's ledger (created by `migrate` if missing).
    #[arg(
        long,
        env = "DATABASE_URL",
        default_value = "postgres://postgres@127.0.0.1:5432/keyfence",
        hide_env_values = true
    )]
    pub database_url: DatabaseUrl,
    /// Connections the ledger pool holds at most (each phase takes one for its transaction).
    #[arg(long = "ledger-pool-size", env = "KEYFENCE_LEDGER_POOL_SIZE", default_value_t = 20,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub pool_size: u32,
}

impl LedgerSettings {
    /// A ledger a command makes a statement or two of (another region's):
    /// a pool of two.
    pub fn remote(database_url: DatabaseUrl) -> Self {
        Self { database_url, pool_size: 2 }
    }

    /// The settings as flags-less start-up would see them: environment, then defaults.
    pub fn from_env() -> Result<Self, clap::Error> {
        #[derive(Parser)]
        struct Only {
            #[command(flatten)]
            settings: LedgerSettings,
        }
        Ok(Only::try_parse_from(["keyfence"])?.settings)
    }
}

/// A PostgreSQL URL, checked when parsed; `Debug` and `Display` hide the
/// password.
#[derive(Clone)]
pub struct DatabaseUrl {
    options: PgConnectOptions,
    /// Why it would reach another machine over TLS only if offered, if so.
    in_clear: Option<String>,
}

impl DatabaseUrl {
    pub fn options(&self) -> &PgConnectOptions {
        &self.options
    }

    /// Why connecting would fail open (TLS not required to another
    /// machine), if it would: nothing connects then.
    pub fn fails_open(&self) -> Option<&str> {
        self.in_clear.as_deref()
    }

    /// The database this URL names (PostgreSQL's default: the user's name).
    pub fn database(&self) -> &str {
        self.options.get_database().unwrap_or_else(|| self.options.get_username())
    }

    /// Whether the server is on this machine (a loopback address or a Unix
    /// socket).
    pub fn is_local(&self) -> bool {
        self.options.get_socket().is_some() || on_this_machine(self.options.get_host())
    }

    /// The same server and credentials, another database.
    pub fn with_database(&self, name: &str) -> Self {
        Self { options: self.options.clone().database(name), in_clear: self.in_clear.clone() }
    }
}

impl FromStr for DatabaseUrl {
    type Err = String;

    fn from_str(url: &str) -> Result<Self, Self::Err> {
        let options = url.parse::<PgConnectOptions>().map_err(|e| format!("not a PostgreSQL URL: {e}"))?;
        // Refused when used, not here: a parse error would repeat the URL, password and all.
        Ok(Self { options, in_clear: fails_open(url, std::env::var("PGSSLMODE").ok()) })
    }
}

/// Whether `host` (a name, an address or a socket's directory) is this machine.
fn on_this_machine(host: &str) -> bool {
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    host.starts_with('/')
        || host.eq_ignore_ascii_case("localhost")
        || bare.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

/// Why `url` would reach another machine with TLS only if the server
/// offers it (no `sslmode`, nor `PGSSLMODE`, or `prefer` or `allow`), if it
/// would. Loopback and Unix sockets need none.
fn fails_open(url: &str, env_mode: Option<String>) -> Option<String> {
    let parsed = reqwest::Url::parse(url).ok()?;
    let asked = |name: &str| parsed.query_pairs().find(|(k, _)| k == name).map(|(_, v)| v.into_owned());
    let mode = asked("sslmode").or_else(|| asked("ssl-mode")).or(env_mode);
    if mode.as_deref().is_some_and(|m| !matches!(m, "prefer" | "allow")) {
        return None;
    }
    let host = asked("host").or_else(|| parsed.host_str().map(str::to_owned)).unwrap_or_default();
    (!host.is_empty() && !on_this_machine(&host)).then(|| {
        format!(
            "the ledger at {host} would be reached over TLS only if it offers it (sslmode {}): add \
             sslmode=verify-full&sslrootcert=<the server's CA bundle> to the URL (or sslmode=disable to mean it)",
            mode.as_deref().unwrap_or("not set")
        )
    })
}

impl fmt::Display for DatabaseUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let o = &self.options;
        write!(f, "postgres://{}@{}:{}/{}", o.get_username(), o.get_host(), o.get_port(), self.database())
    }
}

impl fmt::Debug for DatabaseUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "DatabaseUrl({self})")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn database_url_hides_its_password() {
        let url: DatabaseUrl = "postgres://app:s3cret@db.internal:6432/ledger?sslmode=require".parse().unwrap();
        assert_eq!(url.to_string(), "postgres://app@db.internal:6432/ledger");
        assert!(!format!("{url:?}").contains("s3cret"));
    }

    #[test]
    fn another_machine_is_reached_only_with_tls_asked_for() {
        for url in [
            "postgres://app@db.internal/ledger",
            "postgres://app@10.0.3.7:5432/ledger?sslmode=prefer",
            "postgres://app@db.internal/ledger?sslmode=allow",
            "postgres://app@127.0.0.1/ledger?host=db.internal",
        ] {
            let why = fails_open(url, None).unwrap_or_else(|| panic!("{url} fails open"));
            assert!(why.contains("sslmode=verify-full"), "{why}");
        }
        let url: DatabaseUrl = "postgres://app@db.internal/ledger?sslmode=prefer".parse().unwrap();
        assert!(url.fails_open().is_some() && url.with_database("postgres").fails_open().is_some());
        for url in [
            "postgres://app@db.internal/ledger?sslmode=verify-full",
            "postgres://app@db.internal/ledger?sslmode=require",
            "postgres://app@db.internal/ledger?sslmode=disable",
            "postgres://app@127.0.0.1/ledger",
            "postgres://app@localhost/ledger",
            "postgres://app@[::1]/ledger",
            "postgres://app@/ledger?host=/var/run/postgresql",
        ] {
            assert_eq!(fails_open(url, None), None, "{url}");
        }
        assert_eq!(fails_open("postgres://app@db.internal/ledger", Some("verify-full".into())), None, "PGSSLMODE");
        let secret = fails_open("postgres://app:s3cret@db.internal/ledger", None).unwrap();
        assert!(!secret.contains("s3cret"), "{secret}");
    }
}
