//! The ledger's settings: which PostgreSQL (`DATABASE_URL`, its password
//! never shown) and how many connections its pool holds. A URL naming
//! another machine must say how TLS is used (`sslmode`): left out, the
//! driver's default tries TLS and falls back to plain text without a word.

use std::fmt;
use std::str::FromStr;

use std::ffi::OsStr;

use clap::builder::TypedValueParser;
use clap::error::ErrorKind;
use clap::{Args, Parser};
use sqlx::postgres::{PgConnectOptions, PgSslMode};

/// Where the regional ledger lives.
#[derive(Args, Clone, Debug)]
pub struct LedgerSettings {
    /// PostgreSQL URL of this region's ledger (created by `migrate` if missing).
    #[arg(
        long,
        env = "DATABASE_URL",
        default_value = "postgres://postgres@127.0.0.1:5432/keyfence",
        hide_env_values = true,
        value_parser = DatabaseUrlParser
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
}

impl DatabaseUrl {
    pub fn options(&self) -> &PgConnectOptions {
        &self.options
    }

    /// Why connecting would fail open, if it would: the server is another
    /// machine and TLS is used only if it offers it (`sslmode` `prefer`,
    /// the driver's default, or `allow`). Nothing connects then.
    pub fn fails_open(&self) -> Option<String> {
        let mode = self.options.get_ssl_mode();
        (!self.is_local() && matches!(mode, PgSslMode::Prefer | PgSslMode::Allow)).then(|| {
            format!(
                "the ledger at {} would be reached over TLS only if it offers it (sslmode {mode:?}: not set, set so, \
                 or not understood): add sslmode=verify-full&sslrootcert=<the server's CA bundle> to the URL (or \
                 sslmode=disable to mean it)",
                self.options.get_host(),
            )
        })
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
        Self { options: self.options.clone().database(name) }
    }
}

impl FromStr for DatabaseUrl {
    type Err = String;

    fn from_str(url: &str) -> Result<Self, Self::Err> {
        let options = url.parse::<PgConnectOptions>().map_err(|e| format!("not a PostgreSQL URL: {e}"))?;
        Ok(Self { options })
    }
}

/// Parses a ledger URL without ever repeating it in an error: it may hold a
/// password, and come from the environment.
#[derive(Clone, Copy, Debug)]
pub struct DatabaseUrlParser;

impl TypedValueParser for DatabaseUrlParser {
    type Value = DatabaseUrl;

    fn parse_ref(
        &self,
        cmd: &clap::Command,
        arg: Option<&clap::Arg>,
        value: &OsStr,
    ) -> Result<DatabaseUrl, clap::Error> {
        let name = arg.map_or_else(|| "the ledger URL".to_owned(), ToString::to_string);
        let refused =
            |why: String| clap::Error::raw(ErrorKind::ValueValidation, format!("{name}: {why}\n")).with_cmd(cmd);
        value.to_str().ok_or_else(|| refused("not UTF-8".into()))?.parse().map_err(refused)
    }
}

/// Whether `host` (a name, an address or a socket's directory) is this machine.
fn on_this_machine(host: &str) -> bool {
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    host.starts_with('/')
        || host.eq_ignore_ascii_case("localhost")
        || bare.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback())
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
        let open = |url: &str| url.parse::<DatabaseUrl>().unwrap().fails_open();
        for url in [
            "postgres://app@db.internal/ledger",
            "postgres://app@10.0.3.7:5432/ledger?sslmode=prefer",
            "postgres://app@db.internal/ledger?sslmode=PREFER",
            "postgres://app@db.internal/ledger?sslmode=allow",
            "postgres://app@db.internal/ledger?sslmode=require&sslmode=prefer",
            "postgres://app@127.0.0.1/ledger?host=db.internal",
            "postgres://app@localhost/ledger?hostaddr=10.0.3.7",
        ] {
            let why = open(url).unwrap_or_else(|| panic!("{url} fails open"));
            assert!(why.contains("sslmode=verify-full"), "{why}");
        }
        for url in [
            "postgres://app@db.internal/ledger?sslmode=verify-full",
            "postgres://app@db.internal/ledger?sslmode=require",
            "postgres://app@db.internal/ledger?sslmode=disable",
            "postgres://app@127.0.0.1/ledger",
            "postgres://app@localhost/ledger",
            "postgres://app@[::1]/ledger",
            "postgres://app@localhost/ledger?host=/var/run/postgresql",
        ] {
            assert_eq!(open(url), None, "{url}");
        }
        let url: DatabaseUrl = "postgres://app:s3cret@db.internal/ledger".parse().unwrap();
        assert!(url.with_database("postgres").fails_open().is_some(), "the maintenance database too");
        assert!(!url.fails_open().unwrap().contains("s3cret"));
    }

    #[test]
    fn a_url_that_does_not_parse_is_refused_without_being_repeated() {
        let command = clap::Command::new("keyfence");
        let secret = OsStr::new("postgres://app:s3cret@db.internal:port/ledger");
        let refused = DatabaseUrlParser.parse_ref(&command, None, secret).unwrap_err().to_string();
        assert!(refused.contains("the ledger URL") && !refused.contains("s3cret"), "{refused}");
    }
}
